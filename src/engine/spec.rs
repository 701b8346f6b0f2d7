//! Exact speculative decoding: several proposed tokens verified in one forward pass over the
//! weights, the same tokens as decoding one at a time.
//!
//! A decoding loop samples a token, then asks [`Speculator::advance`] for the logits that
//! follow it. Without speculation that is one forward pass of one token. With it, a
//! [`Drafter`] proposes the tokens it expects next, and the token plus the proposals run as one
//! chunk ([`Model::forward_verify`]); the chunk's later rows are kept and handed out, one per
//! call, for as long as the sampled tokens equal the proposals. At the first token that differs,
//! the state is set to the accepted positions ([`Model::roll_back`]: MLA caches truncated,
//! KDA states advanced by replaying the recorded recurrence inputs, no weight read) and a new pass
//! starts from that token.
//!
//! Exactness: a chunk's logits are bitwise those of decoding its tokens one at a time (the
//! forward pass consumes positions in order with fixed reduction orders), the sampler is called
//! with the same logits, history and random stream as without speculation, and a proposal is
//! used only when it equals what the sampler drew. So greedy and seeded decoding emit the same
//! tokens with speculation on or off, at any draft length; only the time differs.
//!
//! A [`Governor`] chooses the draft length from the measured acceptance and the measured cost
//! of passes of each length, and stops drafting when it does not pay.

use super::model::{Logits, Model, Rollback};
use super::run_state::RunState;
use super::state::SeqState;
use crate::stream::StreamError;
use std::time::Instant;

/// Longest draft (tokens proposed per pass); the memory plan reserves room for it.
pub const MAX_DRAFT: usize = crate::stream::budget::SPEC_MAX_DRAFT;

/// How speculation is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Never draft.
    Off,
    /// Draft when the governor measures that it pays.
    Auto,
    /// Always draft up to this many tokens (1..=[`MAX_DRAFT`]).
    Fixed(usize),
}

impl SpecMode {
    /// Parse `off`, `auto` or a draft length `1..=8`; the environment variable `K3_NOSPEC`
    /// (any value but `0` or empty) forces `off` at the call sites that read it.
    ///
    /// # Errors
    /// A message naming the bad value.
    pub fn parse(s: &str) -> Result<SpecMode, String> {
        match s.trim() {
            "off" | "0" => Ok(SpecMode::Off),
            "auto" => Ok(SpecMode::Auto),
            other => match other.parse::<usize>() {
                Ok(n) if (1..=MAX_DRAFT).contains(&n) => Ok(SpecMode::Fixed(n)),
                _ => Err(format!(
                    "speculation must be off, auto or a draft length 1..={MAX_DRAFT}, not {other:?}"
                )),
            },
        }
    }

    /// `mode`, or `Off` when `K3_NOSPEC` is set to anything but `0` or empty.
    #[must_use]
    pub fn or_env_off(self) -> SpecMode {
        if crate::tuning::Tuning::get().no_spec {
            SpecMode::Off
        } else {
            self
        }
    }

    /// The most tokens one pass may draft in this mode (for the memory plan).
    #[must_use]
    pub fn max_draft(self) -> usize {
        match self {
            SpecMode::Off => 0,
            SpecMode::Auto => MAX_DRAFT,
            SpecMode::Fixed(n) => n,
        }
    }
}

impl std::fmt::Display for SpecMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpecMode::Off => f.write_str("off"),
            SpecMode::Auto => f.write_str("auto"),
            SpecMode::Fixed(n) => write!(f, "{n}"),
        }
    }
}

/// Proposes the tokens likely to follow a sequence. Implementations need not be right: a
/// wrong proposal costs time, never a different token.
pub trait Drafter: Send {
    /// Append up to `max` proposed continuations of `history` to `out` (which is empty).
    fn propose(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>);
}

/// Proposals from the sequence itself: the longest recent suffix of the history (at least
/// `min_match` tokens, at most `max_match`) that occurred before, continued with what followed
/// its latest earlier occurrence. No weights; strongest where text repeats (code, quotes,
/// edits, lists).
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    /// Shortest suffix that counts as a match.
    pub min_match: usize,
    /// Longest suffix tried.
    pub max_match: usize,
    /// How far back to look (tokens).
    pub window: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter {
            min_match: 2,
            max_match: 8,
            window: 1 << 16,
        }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        let n = history.len();
        if max == 0 || n < self.min_match + 1 {
            return;
        }
        let lo = n.saturating_sub(self.window);
        let last = history[n - 1];
        // Scan earlier positions (latest first) ending in the last token; keep the one with
        // the longest matching suffix, the latest on ties.
        let mut best: Option<(usize, usize)> = None; // (match length, end index exclusive)
        let mut end = n - 1;
        while end > lo {
            // `end` is exclusive: history[end - 1] is the candidate's last token.
            if history[end - 1] == last {
                let mut len = 1;
                while len < self.max_match
                    && end > lo + len
                    && history[end - 1 - len] == history[n - 1 - len]
                {
                    len += 1;
                }
                if len >= self.min_match && best.is_none_or(|(l, _)| len > l) {
                    best = Some((len, end));
                    if len == self.max_match {
                        break;
                    }
                }
            }
            end -= 1;
        }
        if let Some((_, end)) = best {
            out.extend(history[end..].iter().take(max));
        }
    }
}

/// Counters of what speculation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Forward passes while decoding (with or without a draft).
    pub passes: u64,
    /// Passes that verified a draft.
    pub draft_passes: u64,
    /// Tokens proposed.
    pub proposed: u64,
    /// Proposed tokens that were used.
    pub accepted: u64,
    /// Tokens whose logits the decoder handed out (each one a decoding step).
    pub steps: u64,
}

impl SpecStats {
    /// Decoding steps per forward pass.
    #[must_use]
    pub fn tokens_per_pass(&self) -> f64 {
        if self.passes == 0 {
            0.0
        } else {
            self.steps as f64 / self.passes as f64
        }
    }

    /// Fraction of proposals used.
    #[must_use]
    pub fn acceptance(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// Chooses the draft length. For each length it keeps the measured seconds per decoding step
/// of passes that drafted that many tokens (the pass, its rollback, divided by the steps it
/// yielded), and picks the length with the fewest; a length not measured yet is estimated from
/// the plain pass and the acceptance so far, optimistically, so that it gets tried. Plain
/// passes are timed every [`REMEASURE`] passes to keep the yardstick fresh.
#[derive(Clone, Debug)]
pub struct Governor {
    mode: SpecMode,
    /// Seconds per step of passes drafting k tokens, exponentially averaged, per k.
    per_step: [Option<f64>; MAX_DRAFT + 1],
    /// Proposals evaluated (position reached) and used, decayed.
    tried: f64,
    used: f64,
    /// Passes since a plain (draft-free) pass was timed, and since a draft was last tried.
    since_plain: u32,
    since_draft: u32,
    /// Plain passes between probes while drafting does not pay: [`PROBE`], doubled after
    /// each probe that did not pay (up to [`MAX_PROBE`]), back to [`PROBE`] after one that did.
    probe_every: u32,
}

/// Weight of the newest observation in the averages.
const EWMA: f64 = 0.25;
/// Draft passes after which a plain pass is timed again.
pub const REMEASURE: u32 = 32;
/// Plain passes after which a one-token draft is tried again while drafting does not pay.
pub const PROBE: u32 = 16;
/// Longest interval between probes on text where they keep failing.
pub const MAX_PROBE: u32 = 512;

impl Governor {
    /// A governor for `mode`.
    #[must_use]
    pub fn new(mode: SpecMode) -> Governor {
        Governor {
            mode,
            per_step: [None; MAX_DRAFT + 1],
            tried: 0.0,
            used: 0.0,
            since_plain: 0,
            since_draft: 0,
            probe_every: PROBE,
        }
    }

    /// The mode.
    #[must_use]
    pub fn mode(&self) -> SpecMode {
        self.mode
    }

    /// Estimated chance that a proposal is used, given the ones before it were (with a prior of
    /// one half over two proposals).
    #[must_use]
    pub fn acceptance(&self) -> f64 {
        (self.used + 1.0) / (self.tried + 2.0)
    }

    /// Steps a pass drafting `k` is expected to yield at the acceptance so far.
    fn steps_of(&self, k: usize) -> f64 {
        let a = self.acceptance();
        let (mut p, mut steps) = (1.0, 1.0);
        for _ in 0..k {
            p *= a;
            steps += p;
        }
        steps
    }

    /// Seconds per step of drafting `k`: measured, or (not measured yet) extrapolated from the
    /// marginal cost per draft token of the longest shorter length measured (a quarter of a
    /// plain pass until one is) over the steps the acceptance predicts.
    fn per_step_of(&self, k: usize) -> Option<f64> {
        if let Some(c) = self.per_step[k] {
            return Some(c);
        }
        let plain = self.per_step[0]?;
        let marginal = (1..k)
            .rev()
            .find_map(|j| {
                self.per_step[j].map(|c| ((c * self.steps_of(j) - plain) / j as f64).max(0.0))
            })
            .unwrap_or(0.25 * plain);
        Some((plain + marginal * k as f64) / self.steps_of(k))
    }

    /// Draft length for the next pass, at most `cap`.
    #[must_use]
    pub fn draft_len(&mut self, cap: usize) -> usize {
        let cap = cap.min(self.mode.max_draft());
        if cap == 0 {
            return 0;
        }
        if let SpecMode::Fixed(n) = self.mode {
            return n.min(cap);
        }
        if self.per_step[0].is_none() || self.since_plain >= REMEASURE {
            return 0;
        }
        let mut best = (self.per_step[0].unwrap_or(f64::MAX), 0);
        for k in 1..=cap {
            if let Some(c) = self.per_step_of(k) {
                // A longer draft must be clearly better to be chosen.
                if c * 1.02 < best.0 {
                    best = (c, k);
                }
            }
        }
        if best.1 == 0 && self.since_draft >= self.probe_every {
            // Drafting does not pay: try a one-token draft now and then, so that text that
            // starts to repeat turns it back on.
            return 1;
        }
        best.1
    }

    /// Record a pass that drafted `k` tokens (of which `used` were used, after `tried` were
    /// evaluated) and took `seconds`, rollback included.
    pub fn observe(&mut self, k: usize, tried: usize, used: usize, seconds: f64) {
        let per = seconds / (1 + used) as f64;
        let slot = &mut self.per_step[k.min(MAX_DRAFT)];
        *slot = Some(match *slot {
            None => per,
            Some(c) => c + EWMA * (per - c),
        });
        if k == 0 {
            self.since_plain = 0;
            self.since_draft = self.since_draft.saturating_add(1);
        } else {
            // A draft that yielded its steps more cheaply than plain passes do resets the
            // probe interval; one that did not doubles it.
            let paid = self.per_step[0].is_some_and(|plain| per < plain);
            self.probe_every = if paid {
                PROBE
            } else {
                (self.probe_every.saturating_mul(2)).min(MAX_PROBE)
            };
            self.since_plain = self.since_plain.saturating_add(1);
            self.since_draft = 0;
            // Decay old evidence so the estimate follows the text.
            self.tried = self.tried * 0.9 + tried as f64;
            self.used = self.used * 0.9 + used as f64;
        }
    }
}

/// A pass whose later rows are still being handed out: the draft is the speculator's
/// `draft`, the rows the logits in its run state.
struct Verified {
    /// Positions of the chunk consumed so far (the first is the token that started it), so
    /// also the row handed out last.
    kept: usize,
    seconds: f64,
}

/// Hands out the logits that follow each sampled token, from single-token passes or from
/// verified drafts (see the module documentation).
pub struct Speculator {
    governor: Governor,
    drafter: Box<dyn Drafter>,
    open: Option<Verified>,
    stats: SpecStats,
    /// The draft of the open pass (or of the one about to run).
    draft: Vec<u32>,
    /// The buffers of every pass, kept between steps; a verified chunk's rows stay in its
    /// logits while they are handed out.
    run: RunState,
    /// The open pass's rollback, refilled by each verification.
    rollback: Rollback,
    /// The chunk of the pass about to run.
    chunk: Vec<u32>,
}

impl std::fmt::Debug for Speculator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculator")
            .field("governor", &self.governor)
            .field("open", &self.open.is_some())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Speculator {
    /// A speculator drafting with n-gram matches over the sequence.
    #[must_use]
    pub fn new(mode: SpecMode) -> Speculator {
        Speculator::with_drafter(mode, Box::new(NgramDrafter::default()))
    }

    /// A speculator with another drafter (a draft model, say).
    #[must_use]
    pub fn with_drafter(mode: SpecMode, drafter: Box<dyn Drafter>) -> Speculator {
        Speculator {
            governor: Governor::new(mode),
            drafter,
            open: None,
            stats: SpecStats::default(),
            draft: Vec::with_capacity(MAX_DRAFT),
            run: RunState::new(),
            rollback: Rollback::default(),
            chunk: Vec::with_capacity(MAX_DRAFT + 1),
        }
    }

    /// The mode.
    #[must_use]
    pub fn mode(&self) -> SpecMode {
        self.governor.mode()
    }

    /// What it did so far.
    #[must_use]
    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    /// The drafted token expected at the position being sampled now, while a verified chunk
    /// is open (for speculative sampling that preserves the distribution).
    #[must_use]
    pub fn proposal(&self) -> Option<u32> {
        let v = self.open.as_ref()?;
        self.draft.get(v.kept - 1).copied()
    }

    /// Feed `next` (just sampled; `history` ends with it) to the model and return the logits
    /// that follow it, borrowed from the speculator until its next call. `room` is how many
    /// positions past `next` the state may take (the context limit): drafts are never longer.
    /// A pass without a draft reuses the speculator's run state and allocates nothing.
    ///
    /// # Errors
    /// A weight read failed; `state` may be partly advanced (restore a snapshot).
    pub fn advance(
        &mut self,
        model: &Model,
        state: &mut SeqState,
        history: &[u32],
        next: u32,
        room: usize,
    ) -> Result<&[f32], StreamError> {
        self.stats.steps += 1;
        let vocab = model.cfg.vocab_size;
        if let Some(v) = self.open.as_mut() {
            if self.draft.get(v.kept - 1) == Some(&next) {
                let row = v.kept;
                v.kept += 1;
                self.stats.accepted += 1;
                if v.kept > self.draft.len() {
                    self.close(model, state);
                }
                return Ok(&self.run.logits()[row * vocab..(row + 1) * vocab]);
            }
            self.close(model, state);
        }
        let k = self.governor.draft_len(room.min(MAX_DRAFT));
        self.draft.clear();
        if k > 0 {
            self.drafter.propose(history, k, &mut self.draft);
            self.draft.truncate(k);
        }
        self.stats.passes += 1;
        let t = Instant::now();
        if self.draft.is_empty() {
            let logits = model.forward_run(state, &mut self.run, &[next], Logits::Last)?;
            self.governor.observe(0, 0, 0, t.elapsed().as_secs_f64());
            return Ok(logits);
        }
        self.chunk.clear();
        self.chunk.push(next);
        self.chunk.extend_from_slice(&self.draft);
        model.forward_verify_run(state, &mut self.run, &self.chunk, &mut self.rollback)?;
        self.stats.draft_passes += 1;
        self.stats.proposed += self.draft.len() as u64;
        self.open = Some(Verified {
            kept: 1,
            seconds: t.elapsed().as_secs_f64(),
        });
        Ok(&self.run.logits()[..vocab])
    }

    /// Cut the state back to the tokens actually consumed (call before leaving the decoding
    /// loop, so that `state` covers exactly the tokens fed through [`Speculator::advance`]).
    pub fn settle(&mut self, model: &Model, state: &mut SeqState) {
        if self.open.is_some() {
            self.close(model, state);
        }
    }

    /// Forget an open pass without touching any state (after a failed forward pass, when the
    /// caller discards the state anyway).
    pub fn abandon(&mut self) {
        self.open = None;
    }

    fn close(&mut self, model: &Model, state: &mut SeqState) {
        if let Some(v) = self.open.take() {
            let t = Instant::now();
            model.roll_back(state, &mut self.rollback, v.kept);
            let seconds = v.seconds + t.elapsed().as_secs_f64();
            let used = v.kept - 1;
            let drafted = self.draft.len();
            // Proposals evaluated: the used ones and the one that failed (if any did).
            let tried = (used + 1).min(drafted);
            self.governor.observe(drafted, tried, used, seconds);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(h: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        NgramDrafter::default().propose(h, max, &mut out);
        out
    }

    #[test]
    fn ngram_continues_the_latest_longest_match() {
        // "1 2 3 4 5 … 1 2 3" → 4 5 …
        assert_eq!(propose(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // Two earlier matches of "7 8": the longer suffix "6 7 8" wins over the later "5 7 8".
        assert_eq!(propose(&[6, 7, 8, 1, 5, 7, 8, 2, 6, 7, 8], 1), vec![1]);
        // Equal lengths: the latest occurrence.
        assert_eq!(propose(&[7, 8, 1, 7, 8, 2, 7, 8], 3), vec![2, 7, 8]);
        // No match of two tokens: nothing.
        assert!(propose(&[1, 2, 3, 4, 5, 3], 4).is_empty());
        assert!(propose(&[1, 2], 4).is_empty());
        assert!(propose(&[1, 2, 1, 2], 0).is_empty());
        // The continuation may run into the suffix itself (a repeating pattern).
        assert_eq!(propose(&[5, 5, 5, 5], 4), vec![5]);
    }

    #[test]
    fn modes_parse() {
        assert_eq!(SpecMode::parse("off"), Ok(SpecMode::Off));
        assert_eq!(SpecMode::parse("auto"), Ok(SpecMode::Auto));
        assert_eq!(SpecMode::parse("4"), Ok(SpecMode::Fixed(4)));
        assert!(SpecMode::parse("9").unwrap_err().contains("1..=8"));
        assert!(SpecMode::parse("fast").is_err());
    }

    #[test]
    fn the_governor_drafts_when_it_pays_and_stops_when_it_does_not() {
        let mut g = Governor::new(SpecMode::Auto);
        assert_eq!(g.draft_len(8), 0, "times a plain pass first");
        g.observe(0, 0, 0, 1.0);
        // Not measured yet, with an even prior: drafting is tried.
        let k = g.draft_len(8);
        assert!(k > 0);
        // Every proposal used, a pass of 1+k costing little more than a plain one: it stays.
        for _ in 0..10 {
            g.observe(k, k, k, 1.1);
        }
        assert!(g.draft_len(8) >= 1);
        // Passes that yield 2 steps but cost 3 plain ones: drafting stops, though most
        // proposals are used.
        let mut g2 = Governor::new(SpecMode::Auto);
        g2.observe(0, 0, 0, 1.0);
        for _ in 0..40 {
            let k = g2.draft_len(8);
            if k == 0 {
                g2.observe(0, 0, 0, 1.0);
            } else {
                g2.observe(k, 2, 1, 3.0);
            }
        }
        let chosen: Vec<usize> = (0..10).map(|_| g2.draft_len(8)).collect();
        assert!(chosen.iter().all(|&k| k == 0), "{chosen:?}");
        // ... but a one-token draft is probed after enough plain passes, and the interval
        // doubles while the probes do not pay, up to MAX_PROBE.
        let mut probes = Vec::new();
        for step in 0..4000u32 {
            if g2.draft_len(8) == 1 {
                probes.push(step);
                g2.observe(1, 1, 0, 1.6);
            } else {
                g2.observe(0, 0, 0, 1.0);
            }
        }
        let gaps: Vec<u32> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|w| w[1] >= w[0]), "{gaps:?}");
        assert!(gaps.iter().all(|&g| g <= MAX_PROBE + 1), "{gaps:?}");
        assert!(
            probes.len() <= 16,
            "{} probes in 4000 passes: {probes:?}",
            probes.len()
        );
        // A probe that pays (the text starts to repeat) brings the interval back.
        while g2.draft_len(8) != 1 {
            g2.observe(0, 0, 0, 1.0);
        }
        g2.observe(1, 1, 1, 1.1);
        let mut plain = 0;
        while g2.draft_len(8) == 0 {
            g2.observe(0, 0, 0, 1.0);
            plain += 1;
        }
        assert!(plain <= PROBE, "{plain} plain passes before the next draft");
        // Plain passes are timed again after REMEASURE draft passes.
        let mut g3 = Governor::new(SpecMode::Auto);
        g3.observe(0, 0, 0, 1.0);
        for _ in 0..REMEASURE {
            g3.observe(4, 4, 4, 1.2);
        }
        assert_eq!(g3.draft_len(8), 0);
        // The cap (context room) bounds the draft; Off never drafts; Fixed always does.
        assert!(g.draft_len(1) <= 1);
        assert_eq!(Governor::new(SpecMode::Off).draft_len(8), 0);
        assert_eq!(Governor::new(SpecMode::Fixed(3)).draft_len(8), 3);
        assert_eq!(Governor::new(SpecMode::Fixed(3)).draft_len(2), 2);
    }
}
