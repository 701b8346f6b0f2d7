//! What one API request may add to sampling (docs/serve.md): a bias per token id, frequency and
//! presence penalties over the tokens generated so far, and the log-probabilities of the
//! sampled token and of the most likely ones. Nothing here runs unless a request asks for it,
//! so the default sampling path is untouched.

/// Largest magnitude of one `logit_bias` value.
pub const MAX_BIAS: f32 = 100.0;
/// Largest magnitude of `frequency_penalty` and `presence_penalty`.
pub const MAX_PENALTY: f32 = 2.0;
/// Most `top_logprobs` one token may report.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Changes to the logits of every step of one request, applied before the sampler (and so
/// before its repetition penalty, temperature and truncation), in f32:
/// `logit[t] + bias[t] − frequency · count(t) − presence · [count(t) > 0]`, `count(t)` being
/// how often `t` occurs among the tokens generated so far in this reply (the prompt does not
/// count), as the OpenAI API and vLLM define them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitAdjust {
    /// Subtracted once per earlier occurrence.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurred.
    pub presence_penalty: f32,
    /// `(token id, bias)`, ids unique, in increasing order.
    pub bias: Vec<(u32, f32)>,
}

impl LogitAdjust {
    /// True when applying it changes nothing.
    #[must_use]
    pub fn is_identity(&self) -> bool {
        self.frequency_penalty == 0.0 && self.presence_penalty == 0.0 && self.bias.is_empty()
    }

    /// Apply to `logits` (one per vocabulary id) given the tokens generated so far. Ids
    /// outside `logits` are skipped (the request checks refuse them first).
    pub fn apply(&self, logits: &mut [f32], generated: &[u32]) {
        for &(id, b) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if self.frequency_penalty == 0.0 && self.presence_penalty == 0.0 {
            return;
        }
        let mut counts: Vec<(u32, u32)> = Vec::new();
        let mut sorted = generated.to_vec();
        sorted.sort_unstable();
        for id in sorted {
            match counts.last_mut() {
                Some((last, n)) if *last == id => *n += 1,
                _ => counts.push((id, 1)),
            }
        }
        for (id, n) in counts {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= self.frequency_penalty * n as f32 + self.presence_penalty;
            }
        }
    }
}

/// The log-probability of a sampled token and of the most likely ones, from one step's logits.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The sampled id.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely ids with their log-probabilities, most likely first (ties: lower id
    /// first).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `id` and at the `top` most likely ids. The normaliser is summed
/// in f64 in id order (one fixed order: the same logits give the same figures).
#[must_use]
pub fn logprobs(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m = f64::from(m);
    let sum: f64 = logits.iter().map(|&l| (f64::from(l) - m).exp()).sum();
    let lse = m + sum.ln();
    let lp = |i: usize| {
        logits
            .get(i)
            .map_or(f32::NEG_INFINITY, |&l| (f64::from(l) - lse) as f32)
    };
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    let n = top.min(ids.len());
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, order);
    }
    ids.truncate(n);
    ids.sort_unstable_by(order);
    TokenLogprob {
        id,
        logprob: lp(id as usize),
        top: ids
            .into_iter()
            .map(|i| (u32::try_from(i).unwrap_or(u32::MAX), lp(i)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_changes_nothing_and_bias_adds() {
        let mut l = vec![1.0f32, -2.0, 0.5];
        let before = l.clone();
        LogitAdjust::default().apply(&mut l, &[0, 0, 1]);
        assert_eq!(l, before);
        assert!(LogitAdjust::default().is_identity());
        let a = LogitAdjust {
            bias: vec![(1, 100.0), (7, 3.0)],
            ..LogitAdjust::default()
        };
        a.apply(&mut l, &[]);
        assert_eq!(l, [1.0, 98.0, 0.5]);
    }

    #[test]
    fn penalties_count_the_generated_tokens() {
        let a = LogitAdjust {
            frequency_penalty: 0.5,
            presence_penalty: 1.0,
            bias: Vec::new(),
        };
        let mut l = vec![0.0f32; 4];
        a.apply(&mut l, &[2, 0, 2, 2]);
        // id 0 once: 0.5 + 1; id 2 three times: 1.5 + 1; ids 1 and 3 untouched.
        assert_eq!(l, [-1.5, 0.0, -2.5, 0.0]);
    }

    #[test]
    fn logprobs_are_a_log_softmax_and_top_is_sorted() {
        let l = [0.0f32, 2.0, 2.0, -1.0];
        let t = logprobs(&l, 3, 3);
        let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((f64::from(t.logprob) - (-1.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|p| p.0).collect();
        assert_eq!(ids, [1, 2, 0], "ties keep the lower id first");
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let total: f64 = (0..4)
            .map(|i| f64::from(logprobs(&l, i, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(logprobs(&l, 0, 10).top.len(), 4);
        assert!(logprobs(&l, 0, 0).top.is_empty());
    }
}
