//! Choosing between two settings that give the same bits by timing both, and keeping the
//! faster for a while before timing them again.
//!
//! The early expert prediction (reading the experts a layer's FFN input predicts for the next
//! layer) is such a setting: where the disk waits for the CPU its right reads fill the disk's
//! idle time, and where the disk is the bottleneck its wrong reads delay the layers' own. Which
//! of the two holds depends on the disk and the CPU of the moment (a cloud disk's bandwidth
//! moves from hour to hour), so a decoding loop times steps with it off and on in turn
//! ([`TRIAL_STEPS`] each), keeps the setting whose shorter steps were shorter for
//! [`KEEP_STEPS`] steps, and then times both again. A step's time only grows with what else
//! the machine does (a stalled read, a busy neighbour), so each setting is judged by its
//! shortest steps: the mean of all but its longest. The first step after a pause or a
//! multi-token pass is not timed (it runs while that pass's effects settle). Nothing here
//! reads a clock: the caller passes the instant each step begins.

use serde::Serialize;
use std::time::{Duration, Instant};

/// Steps timed per setting in a trial.
pub const TRIAL_STEPS: usize = 3;

/// Steps run with the kept setting before both are timed again.
pub const KEEP_STEPS: u32 = 58;

/// What a [`PairedTrial`] has done, for the stats.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TrialStats {
    /// "auto" when the setting is chosen by timing, else "on" or "off" (fixed).
    pub mode: &'static str,
    /// The setting in force for the step under way (or the last one).
    pub on: bool,
    /// Steps begun with the setting off and on.
    pub steps_off: u64,
    /// See `steps_off`.
    pub steps_on: u64,
    /// Trials completed.
    pub trials: u64,
    /// The last completed trial's step time, off and on (seconds): the mean of each
    /// setting's steps but the longest.
    pub last_off: Option<f64>,
    /// See `last_off`.
    pub last_on: Option<f64>,
}

impl TrialStats {
    /// One line: the mode, the setting in force and what the last trial measured.
    #[must_use]
    pub fn describe(&self) -> String {
        let on = if self.on { "on" } else { "off" };
        let steps = format!(
            "{} of {} steps on",
            self.steps_on,
            self.steps_on + self.steps_off
        );
        match (self.mode, self.last_off, self.last_on) {
            ("auto", Some(off), Some(t_on)) => format!(
                "auto, {on} ({steps}; last of {} trials: step {off:.4} s off, {t_on:.4} s on)",
                self.trials
            ),
            ("auto", ..) => format!("auto, still being timed ({steps})"),
            (mode, ..) => format!("{mode} (fixed)"),
        }
    }
}

/// Two settings of a decoding step (off and on) that give the same bits, chosen by timing.
#[derive(Clone, Debug)]
pub struct PairedTrial {
    /// A setting fixed by the user (no timing), or None to choose by timing.
    fixed: Option<bool>,
    /// The step under way: when it began and its setting, while it is to be timed.
    step: Option<(Instant, bool)>,
    /// Whether a step has begun since the last pause (the next one is timed).
    warm: bool,
    /// Durations of the trial under way, off then on.
    /// (Fixed arrays: a decoding step allocates nothing.)
    timed: [[Duration; TRIAL_STEPS]; 2],
    /// How many of each are filled.
    n_timed: [usize; 2],
    /// The setting kept and how many more steps keep it before the next trial.
    kept: Option<(bool, u32)>,
    stats: TrialStats,
}

impl PairedTrial {
    /// A trial, or a fixed setting when `fixed` is Some.
    #[must_use]
    pub fn new(fixed: Option<bool>) -> Self {
        let mut t = PairedTrial {
            fixed: None,
            step: None,
            warm: false,
            timed: [[Duration::ZERO; TRIAL_STEPS]; 2],
            n_timed: [0; 2],
            kept: None,
            stats: TrialStats::default(),
        };
        t.set_fixed(fixed);
        t
    }

    /// Fix the setting (Some), or choose it by timing from now on (None, a fresh trial).
    pub fn set_fixed(&mut self, fixed: Option<bool>) {
        self.fixed = fixed;
        self.step = None;
        self.warm = false;
        self.n_timed = [0; 2];
        self.kept = None;
        self.stats.mode = match fixed {
            None => "auto",
            Some(true) => "on",
            Some(false) => "off",
        };
        self.stats.on = fixed.unwrap_or(false);
    }

    /// The setting fixed by the user, if any.
    #[must_use]
    pub fn fixed(&self) -> Option<bool> {
        self.fixed
    }

    /// A step begins at `now`: the one under way (if it is being timed) ends here. Returns
    /// the setting for the step that begins.
    pub fn begin(&mut self, now: Instant) -> bool {
        let on = match self.fixed {
            Some(on) => on,
            None => {
                if let Some((t0, on)) = self.step.take() {
                    self.record(on, now.saturating_duration_since(t0));
                }
                let on = self.next_setting();
                self.step = self.warm.then_some((now, on));
                self.warm = true;
                on
            }
        };
        self.stats.on = on;
        if on {
            self.stats.steps_on += 1;
        } else {
            self.stats.steps_off += 1;
        }
        on
    }

    /// Something other than a step ran since the last [`PairedTrial::begin`] (a multi-token
    /// pass, a pause): the step under way is not timed.
    pub fn interrupt(&mut self) {
        self.step = None;
        self.warm = false;
    }

    /// What the trial has done.
    #[must_use]
    pub fn stats(&self) -> TrialStats {
        self.stats.clone()
    }

    fn record(&mut self, on: bool, took: Duration) {
        if self.kept.is_some() {
            return;
        }
        let i = usize::from(on);
        if self.n_timed[i] < TRIAL_STEPS {
            self.timed[i][self.n_timed[i]] = took;
            self.n_timed[i] += 1;
        }
        if self.n_timed.iter().all(|&n| n >= TRIAL_STEPS) {
            let [off, on] = [0, 1].map(|i| shortest(&mut self.timed[i]));
            // On only when strictly faster: off reads fewer bytes.
            self.kept = Some((on < off, KEEP_STEPS));
            self.stats.trials += 1;
            self.stats.last_off = Some(off);
            self.stats.last_on = Some(on);
            self.n_timed = [0; 2];
        }
    }

    /// The setting of the next step: the kept one while it lasts, else the one of the trial
    /// with fewer steps timed (off first).
    fn next_setting(&mut self) -> bool {
        if let Some((on, left)) = self.kept {
            if left > 0 {
                self.kept = Some((on, left - 1));
                return on;
            }
            self.kept = None;
        }
        self.n_timed[1] < self.n_timed[0]
    }
}

/// The mean of `d` but its longest, in seconds (of all of it for one); `d` is sorted.
fn shortest(d: &mut [Duration]) -> f64 {
    d.sort_unstable();
    let kept = &d[..d.len().saturating_sub(1).max(1).min(d.len())];
    kept.iter().map(Duration::as_secs_f64).sum::<f64>() / kept.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `steps` steps; a step with setting `on` takes `took(on, i)` milliseconds (i: the
    /// step's index). Returns the settings used.
    fn drive(t: &mut PairedTrial, steps: usize, took: impl Fn(bool, usize) -> u64) -> Vec<bool> {
        let mut now = Instant::now();
        let mut used = Vec::new();
        for i in 0..steps {
            let on = t.begin(now);
            used.push(on);
            now += Duration::from_millis(took(on, i));
        }
        used
    }

    /// The settings of a trial's steps: the first (untimed) one off, then off and on in turn.
    const TRIAL: [bool; 7] = [false, false, true, false, true, false, true];

    #[test]
    fn the_faster_setting_is_kept_after_a_trial() {
        for on_faster in [false, true] {
            let mut t = PairedTrial::new(None);
            // The first step is slow either way: it is not timed.
            let used = drive(&mut t, 20, |on, i| match i {
                0 => 900,
                _ if on == on_faster => 250,
                _ => 320,
            });
            // The sample of the trial's last step is taken when the next step begins, and
            // that step already has the faster setting.
            assert_eq!(&used[..7], &TRIAL);
            assert!(used[7..].iter().all(|&on| on == on_faster), "{used:?}");
            let s = t.stats();
            assert_eq!((s.mode, s.trials, s.on), ("auto", 1, on_faster));
            assert_eq!(s.steps_on + s.steps_off, 20);
            let (fast, slow) = if on_faster {
                (s.last_on, s.last_off)
            } else {
                (s.last_off, s.last_on)
            };
            assert_eq!((fast, slow), (Some(0.25), Some(0.32)));
            assert!(s.describe().starts_with("auto, "), "{}", s.describe());
        }
    }

    #[test]
    fn a_tie_keeps_it_off_and_one_slow_step_does_not_decide() {
        let mut t = PairedTrial::new(None);
        let used = drive(&mut t, 9, |_, _| 300);
        assert!(used[7..].iter().all(|&on| !on));
        // On is faster but for one very slow step (a stalled read): it is left out.
        let mut t = PairedTrial::new(None);
        let used = drive(&mut t, 9, |on, i| match (on, i) {
            (true, 2) => 5_000,
            (true, _) => 200,
            (false, _) => 300,
        });
        assert!(used[7..].iter().all(|&on| on), "{used:?}");
        // Off is faster but for one slow step: kept off.
        let mut t = PairedTrial::new(None);
        let used = drive(&mut t, 9, |on, i| match (on, i) {
            (false, 3) => 5_000,
            (false, _) => 200,
            (true, _) => 300,
        });
        assert!(used[7..].iter().all(|&on| !on), "{used:?}");
    }

    #[test]
    fn both_are_timed_again_after_the_kept_steps() {
        let mut t = PairedTrial::new(None);
        // On is faster until step 40, then off is.
        let took = |on: bool, i: usize| match (on, i < 40) {
            (true, true) | (false, false) => 200,
            _ => 300,
        };
        let first = TRIAL.len();
        let second = first + KEEP_STEPS as usize;
        let used = drive(&mut t, second + 2 * TRIAL_STEPS + 4, took);
        assert!(used[first..second].iter().all(|&on| on));
        // A trial after kept steps times from its first step (the loop was not paused).
        assert_eq!(&used[second..second + 6], &TRIAL[1..]);
        assert!(used[second + 2 * TRIAL_STEPS..].iter().all(|&on| !on));
        assert_eq!(t.stats().trials, 2);
    }

    #[test]
    fn an_interrupted_step_is_not_timed() {
        let mut t = PairedTrial::new(None);
        let mut now = Instant::now();
        // The first step is not timed; the second, off, is interrupted by a long pause; then
        // the first step after it is not timed either, and the trial goes on from the same
        // counts.
        assert!(!t.begin(now));
        now += Duration::from_millis(300);
        assert!(!t.begin(now));
        t.interrupt();
        now += Duration::from_secs(60);
        assert!(!t.begin(now), "no sample yet, so off again");
        now += Duration::from_millis(300);
        assert!(!t.begin(now), "the step after the pause was not timed");
        now += Duration::from_millis(300);
        assert!(t.begin(now));
        now += Duration::from_millis(200);
        assert!(!t.begin(now));
        let s = t.stats();
        assert_eq!((s.steps_off, s.steps_on, s.trials), (5, 1, 0));
    }

    #[test]
    fn a_fixed_setting_is_never_timed() {
        for on in [false, true] {
            let mut t = PairedTrial::new(Some(on));
            let used = drive(&mut t, 12, |o, _| if o { 500 } else { 100 });
            assert!(used.iter().all(|&u| u == on));
            let s = t.stats();
            assert_eq!(s.mode, if on { "on" } else { "off" });
            assert_eq!(s.trials, 0);
            assert!(s.describe().ends_with("(fixed)"));
            t.set_fixed(None);
            assert_eq!(t.stats().mode, "auto");
        }
    }
}
