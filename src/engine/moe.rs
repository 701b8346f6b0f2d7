//! The stable latent MoE (MODEL.md §3.6) and the dense SiTU MLP (§3.7).
//!
//! Routing reads the full-width input: independent sigmoid scores, selection on score + bias,
//! weights from the unbiased scores. Routed experts run in the latent space; their weighted sum
//! is accumulated in top-k order, RMS-normalised once, and projected up; the shared experts run on
//! the full-width input and are added unweighted.

use super::tensor::{Dense, Matrix};
use crate::kernels::{self, ops};
use std::sync::Arc;

/// One routed expert: w1 = gate, w3 = up, w2 = down.
#[derive(Clone, Debug)]
pub struct Expert {
    /// `[inter, latent]` gate.
    pub w1: Matrix,
    /// `[latent, inter]` down.
    pub w2: Matrix,
    /// `[inter, latent]` up.
    pub w3: Matrix,
}

/// Weights of one MoE block.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[n_expert, hidden]` router.
    pub gate: Dense,
    /// `[n_expert]` selection-only bias.
    pub bias: Vec<f32>,
    /// `[latent, hidden]`.
    pub down: Dense,
    /// `[hidden, latent]`.
    pub up: Dense,
    /// `[latent]` gain of the RMSNorm on the routed aggregate.
    pub norm: Vec<f32>,
    /// `[shared, hidden]`.
    pub shared_gate: Dense,
    /// `[shared, hidden]`.
    pub shared_up: Dense,
    /// `[hidden, shared]`.
    pub shared_down: Dense,
    /// Routed experts held with the layer (empty when they are fetched through a cache).
    pub experts: Vec<Arc<Expert>>,
}

/// Constants of an MoE block.
#[derive(Clone, Copy, Debug)]
pub struct MoeParams {
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k weights.
    pub renormalize: bool,
    /// Multiplier on the weights.
    pub scaling: f32,
    /// Epsilon of the aggregate RMSNorm.
    pub rms_eps: f32,
    /// SiTU β1.
    pub beta1: f32,
    /// SiTU β2.
    pub beta2: f32,
}

/// Top-k selection for one token from router logits: repeated arg-max of `σ(logit) + bias`
/// (ties to the lower index), weights from the unbiased scores. Returns `(experts, weights)`
/// in descending biased-score order.
#[must_use]
pub fn route(logits: &[f32], bias: &[f32], p: &MoeParams) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&l| ops::sigmoid(l)).collect();
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(&s, &b)| s + b).collect();
    let mut taken = vec![false; scores.len()];
    let mut idx = Vec::with_capacity(p.top_k);
    for _ in 0..p.top_k {
        let mut best: Option<usize> = None;
        for (e, &c) in choice.iter().enumerate() {
            if !taken[e] && best.is_none_or(|b| c > choice[b]) {
                best = Some(e);
            }
        }
        let Some(b) = best else { break };
        taken[b] = true;
        idx.push(b);
    }
    let mut weights: Vec<f32> = idx.iter().map(|&e| scores[e]).collect();
    if p.renormalize && p.top_k > 1 {
        let sum: f32 = weights.iter().sum();
        let inv = 1.0 / (sum + 1e-20);
        for w in &mut weights {
            *w *= inv;
        }
    }
    for w in &mut weights {
        *w *= p.scaling;
    }
    (idx, weights)
}

/// A matrix applied to a batch of vectors.
trait Apply {
    fn apply_batch(&self, x: &[f32]) -> Vec<f32>;
}

impl Apply for Matrix {
    fn apply_batch(&self, x: &[f32]) -> Vec<f32> {
        self.apply(x)
    }
}

impl Apply for Dense {
    fn apply_batch(&self, x: &[f32]) -> Vec<f32> {
        self.apply(x)
    }
}

/// `down(SiTU(gate x, up x))` for a batch.
fn situ_glu_mlp<M: Apply>(gate: &M, up: &M, down: &M, x: &[f32], b1: f32, b2: f32) -> Vec<f32> {
    let mut g = gate.apply_batch(x);
    let u = up.apply_batch(x);
    ops::situ_inplace(&mut g, &u, b1, b2);
    down.apply_batch(&g)
}

/// Dense SiTU MLP (layer 0) weights.
#[derive(Clone, Debug)]
pub struct DenseMlp {
    /// `[inter, hidden]`.
    pub gate: Dense,
    /// `[inter, hidden]`.
    pub up: Dense,
    /// `[hidden, inter]`.
    pub down: Dense,
}

impl DenseMlp {
    /// `down(SiTU(gate x, up x))` for `x` `[n_tok, hidden]`.
    #[must_use]
    pub fn forward(&self, x: &[f32], beta1: f32, beta2: f32) -> Vec<f32> {
        situ_glu_mlp(&self.gate, &self.up, &self.down, x, beta1, beta2)
    }
}

/// Routing decisions of a chunk: per token, experts and weights.
pub type Routing = Vec<(Vec<usize>, Vec<f32>)>;

/// A group of experts being fetched: `(position in the ids asked for, expert)` in whatever
/// order they become available.
pub type Arrivals<'a, E> = Box<dyn Iterator<Item = Result<(usize, Arc<Expert>), E>> + 'a>;

/// Where an MoE block's routed experts come from (all of one layer).
pub trait ExpertSource {
    /// A failed fetch.
    type Error;
    /// Most experts to ask for at once (each group is fetched, used and released).
    fn group(&self) -> usize;
    /// Start fetching `ids`; the experts arrive through the returned iterator.
    fn start<'s>(&'s self, ids: &[usize]) -> Arrivals<'s, Self::Error>;
}

/// Experts held in memory, handed out in the order asked.
struct Held<'a>(&'a [Arc<Expert>]);

impl ExpertSource for Held<'_> {
    type Error = std::convert::Infallible;

    fn group(&self) -> usize {
        usize::MAX
    }

    fn start<'s>(&'s self, ids: &[usize]) -> Arrivals<'s, Self::Error> {
        let got: Vec<_> = ids
            .iter()
            .enumerate()
            .map(|(k, &e)| Ok((k, Arc::clone(&self.0[e]))))
            .collect();
        Box::new(got.into_iter())
    }
}

/// One MoE block over `x` `[n_tok, hidden]` with the experts held in `w`; also returns the
/// routing decisions.
///
/// # Panics
/// If `w.experts` does not hold every routed expert.
#[must_use]
pub fn forward(w: &MoeWeights, p: &MoeParams, x: &[f32]) -> (Vec<f32>, Routing) {
    match forward_with(w, p, x, &Held(&w.experts)) {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// One MoE block whose routed experts come from `source`, asked for at most `group()` at a
/// time. Each expert is computed as soon as it arrives (the shared experts while the first
/// reads are in flight); its outputs are kept per (token, slot) and accumulated per token in
/// top-k order afterwards, so neither the grouping nor the arrival order changes a bit.
pub fn forward_with<S: ExpertSource + ?Sized>(
    w: &MoeWeights,
    p: &MoeParams,
    x: &[f32],
    source: &S,
) -> Result<(Vec<f32>, Routing), S::Error> {
    let hidden = w.gate.cols;
    let n_tok = x.len() / hidden;
    let n_exp = w.gate.rows;
    let logits = w.gate.apply(x);
    let routing: Routing = logits.chunks(n_exp).map(|l| route(l, &w.bias, p)).collect();
    let latent = w.down.rows;
    // Experts in use, in id order; each runs once over the tokens that chose it.
    let mut used: Vec<usize> = routing
        .iter()
        .flat_map(|(idx, _)| idx.iter().copied())
        .collect();
    used.sort_unstable();
    used.dedup();
    let mut outs: Vec<Vec<Vec<f32>>> = routing
        .iter()
        .map(|(idx, _)| vec![Vec::new(); idx.len()])
        .collect();
    let shared = || {
        situ_glu_mlp(
            &w.shared_gate,
            &w.shared_up,
            &w.shared_down,
            x,
            p.beta1,
            p.beta2,
        )
    };
    let mut ys: Option<Vec<f32>> = None;
    let mut z: Option<Vec<f32>> = None;
    for ids in used.chunks(source.group().max(1)) {
        let arrivals = source.start(ids);
        // Work that needs no routed expert, done while the first group's reads are in flight.
        let z = z.get_or_insert_with(|| w.down.apply(x));
        if ys.is_none() {
            ys = Some(shared());
        }
        for got in arrivals {
            let (k, ex) = got?;
            let e = ids[k];
            let users: Vec<(usize, usize)> = routing
                .iter()
                .enumerate()
                .filter_map(|(t, (idx, _))| idx.iter().position(|&i| i == e).map(|j| (t, j)))
                .collect();
            let mut zs = Vec::with_capacity(users.len() * latent);
            for &(t, _) in &users {
                zs.extend_from_slice(&z[t * latent..(t + 1) * latent]);
            }
            let y = situ_glu_mlp(&ex.w1, &ex.w3, &ex.w2, &zs, p.beta1, p.beta2);
            for (n, &(t, j)) in users.iter().enumerate() {
                outs[t][j] = y[n * latent..(n + 1) * latent].to_vec();
            }
        }
    }
    let ys = ys.unwrap_or_else(shared);
    let mut u = vec![0f32; n_tok * latent];
    for t in 0..n_tok {
        let ut = &mut u[t * latent..(t + 1) * latent];
        for (j, &wj) in routing[t].1.iter().enumerate() {
            // Every selected (token, slot) was filled by the loop over experts above.
            debug_assert_eq!(outs[t][j].len(), latent);
            kernels::axpy(wj, &outs[t][j], ut);
        }
        ops::rmsnorm(ut, &w.norm, p.rms_eps);
    }
    let mut y = w.up.apply(&u);
    for (a, b) in y.iter_mut().zip(&ys) {
        *a += b;
    }
    Ok((y, routing))
}
