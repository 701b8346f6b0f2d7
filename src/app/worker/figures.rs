//! The figures the front end shows: positions, residency and speed.

use super::Ctx;
use crate::stream::stats::{self, StatsSnapshot};

impl Ctx<'_> {
    /// The engine's figures now, with the turn's and the process's.
    pub(super) fn stats_snapshot(
        &self,
        turn_tokens: u64,
        turn_seconds: f64,
        tps: f64,
    ) -> StatsSnapshot {
        let model = self.session.model();
        let spec = self.session.spec_stats();
        let (rss, peak) = stats::rss_bytes();
        let base = model.stats();
        StatsSnapshot {
            tokens_per_second: tps,
            turn_tokens,
            turn_seconds,
            rss_bytes: rss,
            peak_rss_bytes: peak,
            compute_seconds: (self.busy_seconds - base.io_wait_seconds).max(0.0),
            positions: self.positions(),
            context_limit: self.session.settings.context_limit as u64,
            spec_passes: spec.passes,
            spec_proposed: spec.proposed,
            spec_accepted: spec.accepted,
            spec_steps: spec.steps,
            ..base
        }
    }

    /// Positions the conversation holds: its render as the next turn continues it (after an
    /// `/undo` that is shorter than the state the engine still holds), else what the engine
    /// covers with the id it sampled last.
    pub(super) fn positions(&self) -> u64 {
        let s = &self.session;
        let held = s.tokens().len() + usize::from(s.pending().is_some());
        let rendered = s
            .settings
            .render_options()
            .ok()
            .and_then(|o| s.render_conversation(&o, false).ok());
        rendered.map_or(held, |(ids, _)| ids.len()) as u64
    }

    pub(super) fn stats(&self) -> String {
        let s = &self.session;
        let spec = s.spec_stats();
        format!(
            "positions {} / {}; carried state {:.2} MB; mode {}; thinking {} ({}); peak RSS {:.1} MB; \
             speculation {}: {} passes, {:.2} tokens/pass, {} of {} proposals used\n{}",
            s.tokens().len(),
            s.settings.context_limit,
            s.state().bytes() as f64 / 1e6,
            s.mode.name(),
            if s.settings.thinking { "on" } else { "off" },
            s.settings.effort,
            crate::app::run::peak_rss_bytes() as f64 / 1e6,
            s.spec_mode(),
            spec.passes,
            spec.tokens_per_pass(),
            spec.accepted,
            spec.proposed,
            self.sources.line(&s.settings)
        )
    }
}
