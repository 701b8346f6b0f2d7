//! The byte progress bar of `k3 synth` and `k3 pack`.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress bar in bytes, drawn on stderr (when it is a terminal) once the total is known.
pub struct ByteBar(ProgressBar);

impl ByteBar {
    /// A hidden bar labelled `msg`.
    #[must_use]
    pub fn new(msg: String) -> ByteBar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(msg);
        ByteBar(bar)
    }

    /// `done` of `total` bytes.
    pub fn update(&self, done: u64, total: u64) {
        if self.0.length() != Some(total) {
            self.0.set_length(total);
            self.0.set_draw_target(ProgressDrawTarget::stderr());
        }
        self.0.set_position(done);
    }

    /// Remove the bar.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
