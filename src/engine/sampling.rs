//! Next-token selection from logits: the sampler configuration and its
//! validation, the seeded random generator (splitmix64 seeding,
//! xorshift64* stream, 53-bit uniforms), and the fixed order of
//! repetition penalty, greedy short-circuit, non-finite check, tempered
//! softmax, top-k, top-p, min-p and the single uniform draw.
//!
//! With the repetition penalty at 1, min-p at 0 and top-k off, selection is
//! bit-for-bit the reference sampler: same seed and logits give the same
//! token and leave the generator in the same state.

use std::borrow::Cow;

/// Seed used in place of a zero seed before splitmix64.
pub const ZERO_SEED_REPLACEMENT: u64 = 0x4b33_4d41_584c_4f43;

/// State used when splitmix64 yields zero (xorshift must not start at 0).
pub const ZERO_STATE_REPLACEMENT: u64 = 0x2545_f491_4f6c_dd1d;

/// XOR applied to the seed for a speculative-decoding draft sampler.
pub const DRAFT_SEED_XOR: u64 = 0xd6e8_feb8_6659_fd93;

/// XOR applied to the seed for a speculative-decoding acceptance stream.
pub const ACCEPT_SEED_XOR: u64 = 0xa5a3_564e_27f8_862b;

const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
const SPLITMIX_MUL1: u64 = 0xbf58_476d_1ce4_e5b9;
const SPLITMIX_MUL2: u64 = 0x94d0_49bb_1331_11eb;
const XORSHIFT_STAR_MUL: u64 = 2_685_821_657_736_338_717;
/// 2^-53.
const UNIT_53: f64 = 1.0 / 9_007_199_254_740_992.0;

/// The sampler's random generator: one 64-bit xorshift64* state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// Seeds the generator: splitmix64 of the seed (a zero seed is replaced
    /// by [`ZERO_SEED_REPLACEMENT`], a zero result by
    /// [`ZERO_STATE_REPLACEMENT`]).
    pub fn from_seed(seed: u64) -> Rng {
        let x = if seed == 0 {
            ZERO_SEED_REPLACEMENT
        } else {
            seed
        };
        let x = x.wrapping_add(SPLITMIX_GAMMA);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(SPLITMIX_MUL1);
        z = (z ^ (z >> 27)).wrapping_mul(SPLITMIX_MUL2);
        let z = z ^ (z >> 31);
        Rng {
            state: if z == 0 { ZERO_STATE_REPLACEMENT } else { z },
        }
    }

    /// Restores a generator from a saved state; `None` for the invalid
    /// state 0.
    pub fn from_state(state: u64) -> Option<Rng> {
        (state != 0).then_some(Rng { state })
    }

    /// Current state, enough to resume the stream exactly.
    pub fn state(&self) -> u64 {
        self.state
    }

    /// Next 64-bit output (xorshift64*).
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(XORSHIFT_STAR_MUL)
    }

    /// Next uniform in [0, 1) from the top 53 bits of one output.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * UNIT_53
    }
}

/// Sampling settings: the one type every front end, the session, the server and the session
/// file use for them. `Default` is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 selects greedy decoding. Must be finite, ≥ 0.
    pub temperature: f32,
    /// Keep only the k most probable ids; 0 disables top-k.
    pub top_k: usize,
    /// Nucleus threshold in (0, 1]; 1 disables top-p.
    pub top_p: f32,
    /// Drop ids whose probability is below `min_p` times the largest
    /// probability; in [0, 1], 0 disables min-p.
    pub min_p: f32,
    /// Repetition penalty (> 0) applied to logits of ids already in the
    /// history: positive logits divided, negative ones multiplied; 1 disables.
    pub repeat_penalty: f32,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            seed: 1,
        }
    }
}

/// An out-of-range sampler setting.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Temperature negative or not finite.
    #[error("temperature: expected a finite value >= 0, found {0}")]
    Temperature(f32),
    /// Top-p outside (0, 1].
    #[error("top_p: expected a value in (0, 1], found {0}")]
    TopP(f32),
    /// Min-p outside [0, 1].
    #[error("min_p: expected a value in [0, 1], found {0}")]
    MinP(f32),
    /// Repetition penalty not a finite positive value.
    #[error("repeat_penalty: expected a finite value > 0, found {0}")]
    RepeatPenalty(f32),
    /// A saved generator state of 0 (xorshift cannot leave 0).
    #[error("rng state: expected a non-zero state, found 0")]
    ZeroRngState,
}

/// A failure while selecting a token.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SampleError {
    /// The logits slice is empty.
    #[error("logits: expected at least one value, found none")]
    EmptyLogits,
    /// More logits than `u32` token ids can address.
    #[error("logits: expected at most 2^32 values, found {len}")]
    TooManyLogits {
        /// Number of logits given.
        len: usize,
    },
    /// A logit is NaN or infinite (after the repetition penalty).
    #[error("logits: expected finite values, found {value} at index {index}")]
    NonFiniteLogit {
        /// Position of the first offending logit.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// The history holds an id outside the logits (only checked when the
    /// repetition penalty is active).
    #[error("history: expected ids below {vocab}, found {id}")]
    HistoryIdOutOfRange {
        /// The offending id.
        id: u32,
        /// Number of logits.
        vocab: usize,
    },
}

impl SamplerConfig {
    /// Checks every setting's range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ConfigError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ConfigError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(ConfigError::MinP(self.min_p));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(ConfigError::RepeatPenalty(self.repeat_penalty));
        }
        Ok(())
    }

    /// Whether these settings select greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A seeded sampler. Cloning copies the generator state, so a clone (or a
/// sampler rebuilt with [`Sampler::with_rng_state`]) continues the same
/// stream.
/// A distribution to draw one token from, in the arithmetic [`Sampler::sample`] uses.
enum Dist {
    /// No draw: this id.
    Greedy(u32),
    /// Weights over the whole vocabulary (id order) and their ordered sum.
    Full { weights: Vec<f64>, total: f64 },
    /// Kept ids in vocabulary order, their normalised probabilities and the ordered sum.
    Kept {
        ids: Vec<usize>,
        probs: Vec<f64>,
        sum: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    /// Validates the settings and seeds the generator from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Result<Sampler, ConfigError> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            rng: Rng::from_seed(cfg.seed),
        })
    }

    /// Validates the settings and resumes the generator from a saved state
    /// (as returned by [`Sampler::rng_state`]).
    pub fn with_rng_state(cfg: SamplerConfig, state: u64) -> Result<Sampler, ConfigError> {
        cfg.validate()?;
        let rng = Rng::from_state(state).ok_or(ConfigError::ZeroRngState)?;
        Ok(Sampler { cfg, rng })
    }

    /// Current settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Replaces the settings, keeping the generator state.
    pub fn set_config(&mut self, cfg: SamplerConfig) -> Result<(), ConfigError> {
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Current generator state.
    pub fn rng_state(&self) -> u64 {
        self.rng.state()
    }

    /// Selects the next token from `logits` (one per vocabulary id), given
    /// the ids already in the sequence (used only by the repetition
    /// penalty). Greedy decoding consumes no random draw; every other
    /// successful call consumes exactly one. On error the generator state is
    /// unchanged.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        if u32::try_from(logits.len() - 1).is_err() {
            return Err(SampleError::TooManyLogits { len: logits.len() });
        }
        let logits = self.apply_repeat_penalty(logits, history)?;
        match self.distribution(&logits)? {
            Dist::Greedy(id) => Ok(id),
            dist => Ok(self.draw(&dist)),
        }
    }

    /// The distribution `sample` draws from: the penalised logits tempered, truncated and
    /// weighted exactly as [`Sampler::sample`] does.
    fn distribution(&self, logits: &[f32]) -> Result<Dist, SampleError> {
        if self.cfg.is_greedy() {
            if let Some((index, &value)) = logits.iter().enumerate().find(|(_, v)| v.is_nan()) {
                return Err(SampleError::NonFiniteLogit { index, value });
            }
            return Ok(Dist::Greedy(index_u32(argmax_first(logits))));
        }
        if let Some((index, &value)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(SampleError::NonFiniteLogit { index, value });
        }
        let t = f64::from(self.cfg.temperature);
        let m = logits
            .iter()
            .map(|&l| f64::from(l) / t)
            .fold(f64::NEG_INFINITY, |m, v| if v > m { v } else { m });
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| (f64::from(l) / t - m).exp())
            .collect();
        let total = sum_in_order(weights.iter().copied());

        let vocab = weights.len();
        let top_k_active = self.cfg.top_k > 0 && self.cfg.top_k < vocab;
        let top_p_active = self.cfg.top_p < 1.0;
        let min_p_active = self.cfg.min_p > 0.0;

        if !top_k_active && !top_p_active && !min_p_active {
            return Ok(Dist::Full { weights, total });
        }

        let kept = self.truncate(&weights, total, top_k_active, top_p_active, min_p_active);
        let kept_sum = sum_in_order(kept.iter().map(|&i| weights[i]));
        let mut kept_by_id = kept;
        kept_by_id.sort_unstable();
        let probs: Vec<f64> = kept_by_id.iter().map(|&i| weights[i] / kept_sum).collect();
        let prob_sum = sum_in_order(probs.iter().copied());
        Ok(Dist::Kept {
            ids: kept_by_id,
            probs,
            sum: prob_sum,
        })
    }

    /// One draw from `dist` with this sampler's generator.
    fn draw(&mut self, dist: &Dist) -> u32 {
        match dist {
            Dist::Greedy(id) => *id,
            Dist::Full { weights, total } => {
                let target = self.rng.next_f64() * total;
                let mut acc = 0.0;
                for (i, &w) in weights.iter().enumerate() {
                    acc += w;
                    if target < acc {
                        return index_u32(i);
                    }
                }
                index_u32(weights.len() - 1)
            }
            Dist::Kept { ids, probs, sum } => {
                let target = self.rng.next_f64() * sum;
                let mut acc = 0.0;
                for (&id, &p) in ids.iter().zip(probs) {
                    acc += p;
                    if target < acc {
                        return index_u32(id);
                    }
                }
                let fallback = ids
                    .iter()
                    .zip(probs)
                    .rev()
                    .find(|(_, &p)| p != 0.0)
                    .map(|(&id, _)| id)
                    .or_else(|| ids.first().copied())
                    .unwrap_or(0);
                index_u32(fallback)
            }
        }
    }

    /// Speculative sampling that preserves the distribution (docs/runtime.md#speculative-decoding) for a proposal
    /// drawn from a one-hot distribution (an n-gram draft): `proposal` is accepted with
    /// probability p(proposal), decided by one draw of `accept`; on a rejection the token is
    /// drawn with this sampler's generator from p with the proposal removed (the normalised
    /// positive part of p − q). Returns the token and whether it is the proposal. The tokens
    /// have exactly the distribution of [`Sampler::sample`]'s, but not its seeded sequence.
    /// Greedy decoding consumes no draw and returns the argmax.
    pub fn accept_or_correct(
        &mut self,
        logits: &[f32],
        history: &[u32],
        proposal: u32,
        accept: &mut Rng,
    ) -> Result<(u32, bool), SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        if u32::try_from(logits.len() - 1).is_err() {
            return Err(SampleError::TooManyLogits { len: logits.len() });
        }
        let logits = self.apply_repeat_penalty(logits, history)?;
        let dist = self.distribution(&logits)?;
        let (p_y, residual) = match dist {
            Dist::Greedy(id) => return Ok((id, id == proposal)),
            Dist::Full { mut weights, total } => {
                let i = proposal as usize;
                let w = weights.get(i).copied().unwrap_or(0.0);
                if let Some(slot) = weights.get_mut(i) {
                    *slot = 0.0;
                }
                let rest = sum_in_order(weights.iter().copied());
                (
                    w / total,
                    Dist::Full {
                        weights,
                        total: rest,
                    },
                )
            }
            Dist::Kept {
                ids,
                mut probs,
                sum,
            } => {
                let pos = ids.iter().position(|&id| id == proposal as usize);
                let p = pos.map_or(0.0, |k| probs[k] / sum);
                if let Some(k) = pos {
                    probs[k] = 0.0;
                }
                let rest = sum_in_order(probs.iter().copied());
                (
                    p,
                    Dist::Kept {
                        ids,
                        probs,
                        sum: rest,
                    },
                )
            }
        };
        if accept.next_f64() < p_y {
            return Ok((proposal, true));
        }
        Ok((self.draw(&residual), false))
    }

    /// Returns the logits with the repetition penalty applied (borrowed
    /// unchanged when the penalty is off or the history is empty).
    fn apply_repeat_penalty<'a>(
        &self,
        logits: &'a [f32],
        history: &[u32],
    ) -> Result<Cow<'a, [f32]>, SampleError> {
        let penalty = self.cfg.repeat_penalty;
        if penalty == 1.0 || history.is_empty() {
            return Ok(Cow::Borrowed(logits));
        }
        let mut ids = history.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let mut out = logits.to_vec();
        for id in ids {
            let slot = usize::try_from(id)
                .ok()
                .and_then(|i| out.get_mut(i))
                .ok_or(SampleError::HistoryIdOutOfRange {
                    id,
                    vocab: logits.len(),
                })?;
            if *slot > 0.0 {
                *slot /= penalty;
            } else if *slot < 0.0 {
                *slot *= penalty;
            }
        }
        Ok(Cow::Owned(out))
    }

    /// Applies top-k, top-p and min-p; returns kept ids in descending
    /// weight order (ties by lower id). Never empty.
    fn truncate(
        &self,
        weights: &[f64],
        total: f64,
        top_k_active: bool,
        top_p_active: bool,
        min_p_active: bool,
    ) -> Vec<usize> {
        let by_weight_desc =
            |&a: &usize, &b: &usize| weights[b].total_cmp(&weights[a]).then(a.cmp(&b));
        let mut order: Vec<usize> = (0..weights.len()).collect();
        let limit = if top_k_active {
            let k = self.cfg.top_k;
            order.select_nth_unstable_by(k - 1, by_weight_desc);
            order.truncate(k);
            k
        } else {
            order.len()
        };
        order.sort_unstable_by(by_weight_desc);

        let threshold = f64::from(self.cfg.top_p) * total;
        let mut kept = Vec::new();
        let mut sum = 0.0;
        for &id in order.iter().take(limit) {
            kept.push(id);
            sum += weights[id];
            if top_p_active && sum >= threshold {
                break;
            }
        }

        if min_p_active {
            if let Some(&best) = kept.first() {
                let cutoff = f64::from(self.cfg.min_p) * (weights[best] / total);
                kept.retain(|&id| weights[id] / total >= cutoff);
            }
        }
        kept
    }
}

/// Left-to-right sum starting from +0.0.
fn sum_in_order(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |acc, v| acc + v)
}

/// First index of the maximum (strict greater-than scan).
fn argmax_first(values: &[f32]) -> usize {
    let mut best = 0;
    let mut best_value = values.first().copied().unwrap_or(f32::NEG_INFINITY);
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best
}

/// Converts a logit index to a token id; `sample` has already checked that
/// every index fits.
fn index_u32(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference sampler, transcribed step by step from its
    /// description: its own generator and its own selection.
    mod reference {
        pub fn seed(seed: u64) -> u64 {
            let mut x = if seed == 0 {
                0x4b33_4d41_584c_4f43
            } else {
                seed
            };
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let r = z ^ (z >> 31);
            if r == 0 {
                0x2545_f491_4f6c_dd1d
            } else {
                r
            }
        }

        pub fn next(state: &mut u64) -> u64 {
            let mut x = *state;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            *state = x;
            x.wrapping_mul(2_685_821_657_736_338_717)
        }

        pub fn uniform(state: &mut u64) -> f64 {
            (next(state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
        }

        pub fn sample(
            logits: &[f32],
            temperature: f32,
            top_p: f32,
            state: &mut u64,
        ) -> Option<usize> {
            let v = logits.len();
            if temperature <= 0.0 {
                let mut best = 0;
                for i in 1..v {
                    if logits[i] > logits[best] {
                        best = i;
                    }
                }
                return Some(best);
            }
            if logits.iter().any(|l| !l.is_finite()) {
                return None;
            }
            let t = temperature as f64;
            let mut m = f64::NEG_INFINITY;
            for &l in logits {
                let s = l as f64 / t;
                if s > m {
                    m = s;
                }
            }
            let w: Vec<f64> = logits.iter().map(|&l| (l as f64 / t - m).exp()).collect();
            let mut total = 0.0;
            for &x in &w {
                total += x;
            }
            if top_p >= 1.0 {
                let target = uniform(state) * total;
                let mut acc = 0.0;
                for (i, &x) in w.iter().enumerate() {
                    acc += x;
                    if target < acc {
                        return Some(i);
                    }
                }
                return Some(v - 1);
            }
            let mut ids: Vec<usize> = (0..v).collect();
            ids.sort_by(|&a, &b| w[b].partial_cmp(&w[a]).expect("finite").then(a.cmp(&b)));
            let limit = top_p as f64 * total;
            let mut kept_sum = 0.0;
            let mut n_keep = 0;
            for &id in &ids {
                kept_sum += w[id];
                n_keep += 1;
                if kept_sum >= limit {
                    break;
                }
            }
            let mut probs = vec![0.0f64; v];
            for &id in &ids[..n_keep] {
                probs[id] = w[id] / kept_sum;
            }
            let mut sum = 0.0;
            for &p in &probs {
                sum += p;
            }
            let target = uniform(state) * sum;
            let mut acc = 0.0;
            for (i, &p) in probs.iter().enumerate() {
                acc += p;
                if target < acc {
                    return Some(i);
                }
            }
            probs.iter().rposition(|&p| p != 0.0)
        }
    }

    /// Small deterministic generator for test inputs.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            self.0 >> 11
        }

        fn unit(&mut self) -> f64 {
            self.next() as f64 / (1u64 << 53) as f64
        }

        fn logits(&mut self, n: usize, style: usize) -> Vec<f32> {
            (0..n)
                .map(|_| match style {
                    0 => (self.unit() * 20.0 - 10.0) as f32,
                    1 => (self.unit() * 4.0).round() as f32,
                    2 => (self.unit() * 200.0 - 100.0) as f32,
                    3 => 1.5,
                    _ => {
                        let u = self.unit();
                        (u * u * u * 30.0 - 5.0) as f32
                    }
                })
                .collect()
        }
    }

    fn cfg(temperature: f32, top_p: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_p,
            seed,
            ..SamplerConfig::default()
        }
    }

    #[test]
    fn sampler_is_send_and_sync() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Sampler>();
        check::<SampleError>();
        check::<ConfigError>();
    }

    #[test]
    fn rng_known_answers() {
        let mut one = Rng::from_seed(1);
        assert_eq!(one.state(), 0x910a_2dec_8902_5cc1);
        assert_eq!(one.next_u64(), 0x4b46_a55d_f361_1b9b);
        assert_eq!(one.next_u64(), 0xd7e1_f141_0e76_3ef4);
        let mut zero = Rng::from_seed(0);
        assert_eq!(zero.state(), 0x5409_8036_4686_7b4b);
        assert_eq!(zero.next_u64(), 0x5f36_9f9c_107f_5253);
        let mut big = Rng::from_seed(u64::MAX);
        assert_eq!(big.state(), 0xe4d9_7177_1b65_2c20);
        assert_eq!(big.next_u64(), 0x079c_e65d_0924_0e13);
        let mut s42 = Rng::from_seed(42);
        assert_eq!(s42.state(), 0xbdd7_3226_2feb_6e95);
        assert_eq!(s42.next_f64(), 0.194_105_917_534_182_6);
    }

    #[test]
    fn rng_zero_splitmix_result_is_replaced() {
        let seed = 0u64.wrapping_sub(SPLITMIX_GAMMA);
        assert_eq!(Rng::from_seed(seed).state(), ZERO_STATE_REPLACEMENT);
        assert_eq!(reference::seed(seed), ZERO_STATE_REPLACEMENT);
        assert_eq!(Rng::from_state(0), None);
    }

    #[test]
    fn uniforms_lie_in_unit_interval() {
        let mut rng = Rng::from_seed(7);
        for _ in 0..10_000 {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn matches_reference_sampler_bit_for_bit() {
        let mut gen = Lcg(99);
        let sizes = [1usize, 2, 3, 7, 50, 257, 1000];
        let temperatures = [0.0f32, 0.05, 0.6, 1.0, 1.7, 10.0];
        let top_ps = [1.0f32, 0.999, 0.95, 0.5, 0.1, 1e-6];
        let mut sampled = 0;
        for (case, &n) in sizes.iter().cycle().take(60).enumerate() {
            let seed = if case % 7 == 0 { 0 } else { gen.next() };
            for &temperature in &temperatures {
                for &top_p in &top_ps {
                    let mut sampler = Sampler::new(cfg(temperature, top_p, seed)).expect("valid");
                    let mut state = reference::seed(seed);
                    assert_eq!(sampler.rng_state(), state);
                    for step in 0..8 {
                        let logits = gen.logits(n, (case + step) % 5);
                        let ours = sampler.sample(&logits, &[]).expect("finite logits");
                        let theirs = reference::sample(&logits, temperature, top_p, &mut state)
                            .expect("finite logits");
                        assert_eq!(
                            ours as usize, theirs,
                            "n={n} T={temperature} p={top_p} step={step}"
                        );
                        assert_eq!(sampler.rng_state(), state);
                        sampled += 1;
                    }
                }
            }
        }
        assert!(sampled > 10_000);
    }

    #[test]
    fn top_k_at_or_above_vocab_is_off() {
        let mut gen = Lcg(5);
        for top_k in [0usize, 50, 51, 1000] {
            let mut a = Sampler::new(cfg(0.8, 0.9, 3)).expect("valid");
            let mut b = Sampler::new(SamplerConfig {
                top_k,
                ..cfg(0.8, 0.9, 3)
            })
            .expect("valid");
            for _ in 0..50 {
                let logits = gen.logits(50, 0);
                assert_eq!(a.sample(&logits, &[]), b.sample(&logits, &[]));
            }
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let mut gen = Lcg(11);
        let inputs: Vec<Vec<f32>> = (0..200).map(|i| gen.logits(300, i % 5)).collect();
        let config = SamplerConfig {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            repeat_penalty: 1.1,
            seed: 1234,
        };
        let run = |cfg: SamplerConfig| {
            let mut sampler = Sampler::new(cfg).expect("valid");
            let mut history = Vec::new();
            for logits in &inputs {
                let id = sampler.sample(logits, &history).expect("valid");
                history.push(id);
            }
            history
        };
        let first = run(config);
        assert_eq!(first, run(config));
        assert_ne!(
            first,
            run(SamplerConfig {
                seed: 4321,
                ..config
            })
        );
    }

    #[test]
    fn clone_and_saved_state_resume_the_stream() {
        let mut gen = Lcg(17);
        let inputs: Vec<Vec<f32>> = (0..40).map(|i| gen.logits(100, i % 5)).collect();
        let config = cfg(1.0, 1.0, 77);
        let mut sampler = Sampler::new(config).expect("valid");
        for logits in &inputs[..20] {
            sampler.sample(logits, &[]).expect("valid");
        }
        let mut cloned = sampler.clone();
        let mut restored = Sampler::with_rng_state(config, sampler.rng_state()).expect("valid");
        for logits in &inputs[20..] {
            let id = sampler.sample(logits, &[]).expect("valid");
            assert_eq!(cloned.sample(logits, &[]).expect("valid"), id);
            assert_eq!(restored.sample(logits, &[]).expect("valid"), id);
        }
        assert_eq!(sampler, cloned);
        assert_eq!(
            Sampler::with_rng_state(config, 0),
            Err(ConfigError::ZeroRngState)
        );
    }

    #[test]
    fn accepting_a_draft_with_probability_p_keeps_the_distribution() {
        let logits = [0.3f32, 1.2, -0.4, 2.0, 0.9, -1.5];
        for (top_p, proposal) in [(1.0f32, 3u32), (1.0, 5), (0.9, 1), (0.9, 5)] {
            // The distribution `sample` draws from, measured.
            let n = 200_000;
            let mut want = [0f64; 6];
            let mut serial = Sampler::new(cfg(1.0, top_p, 11)).unwrap();
            for _ in 0..n {
                want[serial.sample(&logits, &[]).unwrap() as usize] += 1.0 / f64::from(n);
            }
            let mut got = [0f64; 6];
            let mut accepted = 0u32;
            let mut s = Sampler::new(cfg(1.0, top_p, 12)).unwrap();
            let mut accept = Rng::from_seed(13);
            for _ in 0..n {
                let (id, used) = s
                    .accept_or_correct(&logits, &[], proposal, &mut accept)
                    .unwrap();
                assert_eq!(used, id == proposal, "a correction is never the draft");
                accepted += u32::from(used);
                got[id as usize] += 1.0 / f64::from(n);
            }
            for k in 0..6 {
                assert!(
                    (got[k] - want[k]).abs() < 0.006,
                    "top_p {top_p}, draft {proposal}: id {k} drawn {:.4}, sample gives {:.4}",
                    got[k],
                    want[k]
                );
            }
            // The draft is used as often as p gives it.
            let p_draft = want[proposal as usize];
            assert!((f64::from(accepted) / f64::from(n) - p_draft).abs() < 0.006);
        }
        // Greedy: the argmax, no draw from either stream.
        let mut g = Sampler::new(SamplerConfig::default()).unwrap();
        let mut accept = Rng::from_seed(5);
        let before = (g.rng_state(), accept.state());
        assert_eq!(
            g.accept_or_correct(&logits, &[], 3, &mut accept).unwrap(),
            (3, true)
        );
        assert_eq!(
            g.accept_or_correct(&logits, &[], 1, &mut accept).unwrap(),
            (3, false)
        );
        assert_eq!((g.rng_state(), accept.state()), before);
    }

    #[test]
    fn greedy_is_default_and_consumes_no_draw() {
        let config = SamplerConfig::default();
        assert_eq!(config.temperature, 0.0);
        assert_eq!(config.top_k, 0);
        assert_eq!(config.top_p, 1.0);
        assert_eq!(config.min_p, 0.0);
        assert_eq!(config.repeat_penalty, 1.0);
        assert_eq!(config.seed, 1);
        assert!(config.is_greedy());
        let mut sampler = Sampler::new(config).expect("valid");
        let before = sampler.rng_state();
        assert_eq!(sampler.sample(&[1.0, 3.0, 3.0, -2.0], &[]), Ok(1));
        assert_eq!(
            sampler.sample(&[f32::NEG_INFINITY, -1.0, f32::INFINITY], &[]),
            Ok(2)
        );
        assert_eq!(sampler.sample(&[0.5], &[]), Ok(0));
        assert_eq!(sampler.rng_state(), before);
    }

    #[test]
    fn sampling_consumes_exactly_one_draw() {
        let mut sampler = Sampler::new(SamplerConfig {
            top_k: 3,
            min_p: 0.1,
            ..cfg(0.7, 0.8, 9)
        })
        .expect("valid");
        let mut rng = Rng::from_seed(9);
        for _ in 0..10 {
            sampler
                .sample(&[0.1, 2.0, 1.0, -3.0, 0.4], &[])
                .expect("valid");
            rng.next_u64();
            assert_eq!(sampler.rng_state(), rng.state());
        }
    }

    #[test]
    fn non_finite_logits_are_refused() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut sampler = Sampler::new(cfg(1.0, 0.9, 1)).expect("valid");
            let before = sampler.rng_state();
            let err = sampler
                .sample(&[0.0, 1.0, bad, 2.0], &[])
                .expect_err("refused");
            assert!(matches!(err, SampleError::NonFiniteLogit { index: 2, .. }));
            assert_eq!(sampler.rng_state(), before);
        }
        let mut greedy = Sampler::new(SamplerConfig::default()).expect("valid");
        assert!(matches!(
            greedy.sample(&[f32::NAN, 1.0], &[]),
            Err(SampleError::NonFiniteLogit { index: 0, .. })
        ));
        assert_eq!(greedy.sample(&[], &[]), Err(SampleError::EmptyLogits));
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut gen = Lcg(23);
        let mut sampler = Sampler::new(SamplerConfig {
            top_k: 1,
            ..cfg(1.3, 1.0, 5)
        })
        .expect("valid");
        let mut greedy = Sampler::new(SamplerConfig::default()).expect("valid");
        for i in 0..200 {
            let logits = gen.logits(64, i % 5);
            assert_eq!(sampler.sample(&logits, &[]), greedy.sample(&logits, &[]));
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best_with_low_id_ties() {
        let logits = [1.0, 5.0, 3.0, 5.0, 4.0, 0.0];
        let mut seen = [0usize; 6];
        let mut sampler = Sampler::new(SamplerConfig {
            top_k: 2,
            ..cfg(5.0, 1.0, 8)
        })
        .expect("valid");
        for _ in 0..2000 {
            seen[sampler.sample(&logits, &[]).expect("valid") as usize] += 1;
        }
        assert!(seen[1] > 0 && seen[3] > 0);
        assert_eq!(seen[0] + seen[2] + seen[4] + seen[5], 0);

        let ties = [2.0, 2.0, 2.0, 2.0];
        let mut sampler = Sampler::new(SamplerConfig {
            top_k: 3,
            ..cfg(1.0, 1.0, 8)
        })
        .expect("valid");
        for _ in 0..500 {
            assert!(sampler.sample(&ties, &[]).expect("valid") < 3);
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_max() {
        let mut gen = Lcg(29);
        let mut sampler = Sampler::new(cfg(1.0, 1e-9, 13)).expect("valid");
        let mut greedy = Sampler::new(SamplerConfig::default()).expect("valid");
        for i in 0..200 {
            let logits = gen.logits(80, i % 5);
            assert_eq!(sampler.sample(&logits, &[]), greedy.sample(&logits, &[]));
        }
    }

    #[test]
    fn top_p_includes_the_crossing_id() {
        // Probabilities 0.5, 0.3, 0.2 at temperature 1: top-p 0.6 keeps ids 0 and 1.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut seen = [0usize; 3];
        let mut sampler = Sampler::new(cfg(1.0, 0.6, 21)).expect("valid");
        for _ in 0..3000 {
            seen[sampler.sample(&logits, &[]).expect("valid") as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0);
        assert_eq!(seen[2], 0);
    }

    #[test]
    fn min_p_drops_unlikely_ids() {
        // Probabilities 0.6, 0.25, 0.1, 0.05: min-p 0.2 keeps p >= 0.12.
        let logits = [0.6f32.ln(), 0.25f32.ln(), 0.1f32.ln(), 0.05f32.ln()];
        let mut seen = [0usize; 4];
        let mut sampler = Sampler::new(SamplerConfig {
            min_p: 0.2,
            ..cfg(1.0, 1.0, 31)
        })
        .expect("valid");
        for _ in 0..4000 {
            seen[sampler.sample(&logits, &[]).expect("valid") as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0);
        assert_eq!(seen[2] + seen[3], 0);

        let mut all = Sampler::new(SamplerConfig {
            min_p: 1.0,
            ..cfg(1.0, 1.0, 31)
        })
        .expect("valid");
        for _ in 0..100 {
            assert_eq!(all.sample(&logits, &[]), Ok(0));
        }
    }

    #[test]
    fn repetition_penalty_on_positive_and_negative_logits() {
        let greedy_with_penalty = |penalty: f32| {
            Sampler::new(SamplerConfig {
                repeat_penalty: penalty,
                ..SamplerConfig::default()
            })
            .expect("valid")
        };
        // Positive logit divided: 4.0 / 2 = 2.0 < 3.0.
        let mut s = greedy_with_penalty(2.0);
        assert_eq!(s.sample(&[4.0, 3.0], &[]), Ok(0));
        assert_eq!(s.sample(&[4.0, 3.0], &[0]), Ok(1));
        // Negative logit multiplied: -1.0 * 2 = -2.0 < -1.5.
        assert_eq!(s.sample(&[-1.0, -1.5], &[0, 0, 0]), Ok(1));
        // A penalty below 1 boosts instead.
        let mut boost = greedy_with_penalty(0.5);
        assert_eq!(boost.sample(&[3.0, 2.0], &[1]), Ok(1));
        assert_eq!(boost.sample(&[-1.0, -1.5], &[1]), Ok(1));
        // Zero logits stay zero; repeated history entries apply once.
        let mut s = greedy_with_penalty(3.0);
        assert_eq!(s.sample(&[0.0, -0.1], &[0]), Ok(0));
        assert_eq!(s.sample(&[9.0, 2.0], &[0, 0, 0, 0]), Ok(0));
        // Out-of-range history ids are refused while the penalty is active.
        assert_eq!(
            s.sample(&[1.0, 2.0], &[7]),
            Err(SampleError::HistoryIdOutOfRange { id: 7, vocab: 2 })
        );
        let mut off = Sampler::new(SamplerConfig::default()).expect("valid");
        assert_eq!(off.sample(&[1.0, 2.0], &[7]), Ok(1));
    }

    #[test]
    fn penalty_one_is_bit_identical_to_no_penalty() {
        let mut gen = Lcg(41);
        let mut a = Sampler::new(cfg(0.9, 0.95, 2)).expect("valid");
        let mut b = Sampler::new(cfg(0.9, 0.95, 2)).expect("valid");
        for i in 0..100 {
            let logits = gen.logits(120, i % 5);
            let history: Vec<u32> = (0..20).map(|j| (j * 7 % 120) as u32).collect();
            assert_eq!(a.sample(&logits, &history), b.sample(&logits, &[]));
        }
    }

    #[test]
    fn config_validation() {
        let ok = SamplerConfig::default();
        assert_eq!(ok.validate(), Ok(()));
        let bad = [
            (
                SamplerConfig {
                    temperature: -0.1,
                    ..ok
                },
                ConfigError::Temperature(-0.1),
            ),
            (
                SamplerConfig {
                    temperature: f32::INFINITY,
                    ..ok
                },
                ConfigError::Temperature(f32::INFINITY),
            ),
            (SamplerConfig { top_p: 0.0, ..ok }, ConfigError::TopP(0.0)),
            (SamplerConfig { top_p: 1.01, ..ok }, ConfigError::TopP(1.01)),
            (
                SamplerConfig { min_p: -0.01, ..ok },
                ConfigError::MinP(-0.01),
            ),
            (SamplerConfig { min_p: 1.5, ..ok }, ConfigError::MinP(1.5)),
            (
                SamplerConfig {
                    repeat_penalty: 0.0,
                    ..ok
                },
                ConfigError::RepeatPenalty(0.0),
            ),
            (
                SamplerConfig {
                    repeat_penalty: -1.0,
                    ..ok
                },
                ConfigError::RepeatPenalty(-1.0),
            ),
        ];
        for (config, expected) in bad {
            assert_eq!(config.validate(), Err(expected.clone()));
            assert_eq!(Sampler::new(config), Err(expected));
        }
        for config in [
            SamplerConfig {
                temperature: f32::NAN,
                ..ok
            },
            SamplerConfig {
                top_p: f32::NAN,
                ..ok
            },
            SamplerConfig {
                min_p: f32::NAN,
                ..ok
            },
            SamplerConfig {
                repeat_penalty: f32::NAN,
                ..ok
            },
            SamplerConfig {
                repeat_penalty: f32::INFINITY,
                ..ok
            },
        ] {
            assert!(config.validate().is_err(), "{config:?}");
        }
        let edge = SamplerConfig {
            temperature: 2.0,
            top_k: usize::MAX,
            top_p: f32::MIN_POSITIVE,
            min_p: 1.0,
            repeat_penalty: 0.01,
            seed: 0,
        };
        assert_eq!(edge.validate(), Ok(()));
        assert!(ConfigError::TopP(1.01).to_string().contains("(0, 1]"));
        let mut sampler = Sampler::new(ok).expect("valid");
        assert_eq!(
            sampler.set_config(SamplerConfig { top_p: 2.0, ..ok }),
            Err(ConfigError::TopP(2.0))
        );
        assert_eq!(sampler.config(), &ok);
    }

    #[test]
    fn extreme_temperatures_stay_finite() {
        let mut cold = Sampler::new(cfg(f32::MIN_POSITIVE, 1.0, 3)).expect("valid");
        let logits = [f32::MAX, -f32::MAX, 0.0, f32::MAX];
        for _ in 0..20 {
            let id = cold.sample(&logits, &[]).expect("valid");
            assert!(id == 0 || id == 3);
        }
        let mut hot = Sampler::new(cfg(f32::MAX, 0.5, 3)).expect("valid");
        for _ in 0..20 {
            assert!(hot.sample(&logits, &[]).expect("valid") < 4);
        }
    }
}
