//! The stable latent MoE and the dense SiTU MLP (docs/model.md#latent-moe-and-the-dense-mlp).
//!
//! Routing reads the full-width input: independent sigmoid scores, selection on score + bias,
//! weights from the unbiased scores. Routed experts run in the latent space; their weighted sum
//! is accumulated in top-k order, RMS-normalised once, and projected up; the shared experts run on
//! the full-width input and are added unweighted.

use super::tensor::{fit, Dense, Matrix};
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
    let mut sc = RouteScratch::default();
    let mut idx = vec![0; p.top_k];
    let mut weights = vec![0f32; p.top_k];
    let n = route_into(logits, bias, p, &mut sc, &mut idx, &mut weights);
    idx.truncate(n);
    weights.truncate(n);
    (idx, weights)
}

/// Buffers of [`route_into`], reused between calls.
#[derive(Clone, Debug, Default)]
pub struct RouteScratch {
    scores: Vec<f32>,
    choice: Vec<f32>,
    taken: Vec<bool>,
}

/// [`route`] into `idx` and `weights` (each at least `top_k` long); returns how many experts
/// were chosen (`top_k`, or fewer when there are fewer experts).
pub fn route_into(
    logits: &[f32],
    bias: &[f32],
    p: &MoeParams,
    sc: &mut RouteScratch,
    idx: &mut [usize],
    weights: &mut [f32],
) -> usize {
    sc.scores.clear();
    sc.scores.extend(logits.iter().map(|&l| ops::sigmoid(l)));
    sc.choice.clear();
    sc.choice
        .extend(sc.scores.iter().zip(bias).map(|(&s, &b)| s + b));
    sc.taken.clear();
    sc.taken.resize(sc.scores.len(), false);
    let mut n = 0;
    for _ in 0..p.top_k {
        let mut best: Option<usize> = None;
        for (e, &c) in sc.choice.iter().enumerate() {
            if !sc.taken[e] && best.is_none_or(|b| c > sc.choice[b]) {
                best = Some(e);
            }
        }
        let Some(b) = best else { break };
        sc.taken[b] = true;
        idx[n] = b;
        n += 1;
    }
    let weights = &mut weights[..n];
    for (w, &e) in weights.iter_mut().zip(&idx[..n]) {
        *w = sc.scores[e];
    }
    if p.renormalize && p.top_k > 1 {
        let sum: f32 = weights.iter().sum();
        let inv = 1.0 / (sum + 1e-20);
        for w in weights.iter_mut() {
            *w *= inv;
        }
    }
    for w in weights.iter_mut() {
        *w *= p.scaling;
    }
    n
}

/// A matrix applied to a batch of vectors.
trait Apply {
    fn out_rows(&self) -> usize;
    fn apply_batch_into(&self, x: &[f32], y: &mut [f32]);
}

impl Apply for Matrix {
    fn out_rows(&self) -> usize {
        self.rows()
    }

    fn apply_batch_into(&self, x: &[f32], y: &mut [f32]) {
        self.apply_into(x, y);
    }
}

impl Apply for Dense {
    fn out_rows(&self) -> usize {
        self.rows
    }

    fn apply_batch_into(&self, x: &[f32], y: &mut [f32]) {
        self.apply_into(x, y);
    }
}

/// `down(SiTU(gate x, up x))` for a batch `x` `[n_tok, in]` into `out` `[n_tok, down rows]`,
/// with `g` and `u` as the intermediate buffers.
#[allow(clippy::too_many_arguments)]
fn situ_glu_into<M: Apply>(
    gate: &M,
    up: &M,
    down: &M,
    x: &[f32],
    b1: f32,
    b2: f32,
    g: &mut Vec<f32>,
    u: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n_tok = out.len() / down.out_rows().max(1);
    let inter = gate.out_rows();
    let g = fit(g, n_tok * inter);
    let u = fit(u, n_tok * up.out_rows());
    gate.apply_batch_into(x, g);
    up.apply_batch_into(x, u);
    ops::situ_inplace(g, u, b1, b2);
    down.apply_batch_into(g, out);
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
        let n_tok = x.len() / self.gate.cols;
        let mut out = vec![0f32; n_tok * self.down.rows];
        self.forward_into(x, beta1, beta2, &mut MoeScratch::default(), &mut out);
        out
    }

    /// [`DenseMlp::forward`] into `out` `[n_tok, hidden]`, its intermediates in `sc`.
    pub fn forward_into(
        &self,
        x: &[f32],
        beta1: f32,
        beta2: f32,
        sc: &mut MoeScratch,
        out: &mut [f32],
    ) {
        situ_glu_into(
            &self.gate, &self.up, &self.down, x, beta1, beta2, &mut sc.g, &mut sc.u, out,
        );
    }
}

/// Routing decisions of a chunk: per token, experts and weights.
pub type Routing = Vec<(Vec<usize>, Vec<f32>)>;

/// The buffers one MoE block (or dense MLP) needs, reused between calls: after the first call
/// of a given chunk length, a call allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct MoeScratch {
    /// `[n_tok, n_expert]` router logits.
    logits: Vec<f32>,
    route: RouteScratch,
    /// `[n_tok, top_k]` chosen experts and their weights; `count[t]` of each row are valid.
    idx: Vec<usize>,
    weights: Vec<f32>,
    count: Vec<usize>,
    top_k: usize,
    /// Experts in use, in id order.
    used: Vec<usize>,
    /// The group of them being fetched.
    group: Vec<usize>,
    /// `(token, slot)` pairs that chose the expert being computed.
    users: Vec<(usize, usize)>,
    /// `[n_tok, latent]` the projected-down input.
    z: Vec<f32>,
    /// `[users, latent]` its rows for one expert, and that expert's outputs.
    zs: Vec<f32>,
    ye: Vec<f32>,
    /// SiTU intermediates.
    g: Vec<f32>,
    u: Vec<f32>,
    /// `[n_tok, top_k, latent]` each (token, slot)'s expert output.
    outs: Vec<f32>,
    /// `[n_tok, latent]` the weighted routed aggregate.
    agg: Vec<f32>,
    /// `[n_tok, hidden]` the shared experts' output.
    shared: Vec<f32>,
    n_tok: usize,
    latent: usize,
    hidden: usize,
    /// Whether `z` and `shared` hold this call's values.
    shared_done: bool,
}

impl MoeScratch {
    /// Bytes the buffers hold (their capacity).
    #[must_use]
    pub fn bytes(&self) -> usize {
        let f = [
            &self.logits,
            &self.weights,
            &self.z,
            &self.zs,
            &self.ye,
            &self.g,
            &self.u,
            &self.outs,
            &self.agg,
            &self.shared,
        ]
        .into_iter()
        .map(|v| v.capacity() * 4)
        .sum::<usize>();
        let r = &self.route;
        f + (r.scores.capacity() + r.choice.capacity()) * 4
            + r.taken.capacity()
            + (self.idx.capacity()
                + self.count.capacity()
                + self.used.capacity()
                + self.group.capacity())
                * std::mem::size_of::<usize>()
            + self.users.capacity() * 2 * std::mem::size_of::<usize>()
    }

    /// The routing decisions of the last call, as an owned value.
    #[must_use]
    pub fn routing(&self) -> Routing {
        (0..self.n_tok)
            .map(|t| {
                let row = t * self.top_k..t * self.top_k + self.count[t];
                (self.idx[row.clone()].to_vec(), self.weights[row].to_vec())
            })
            .collect()
    }

    /// Route the chunk `x` and list the experts it uses.
    fn prepare(&mut self, w: &MoeWeights, p: &MoeParams, x: &[f32]) {
        let hidden = w.gate.cols;
        let n_tok = x.len() / hidden;
        let n_exp = w.gate.rows;
        let latent = w.down.rows;
        (self.n_tok, self.latent, self.hidden, self.top_k) = (n_tok, latent, hidden, p.top_k);
        self.shared_done = false;
        let logits = fit(&mut self.logits, n_tok * n_exp);
        w.gate.apply_into(x, logits);
        let idx = fit(&mut self.idx, n_tok * p.top_k);
        let weights = fit(&mut self.weights, n_tok * p.top_k);
        let count = fit(&mut self.count, n_tok);
        for t in 0..n_tok {
            let row = t * p.top_k..(t + 1) * p.top_k;
            count[t] = route_into(
                &logits[t * n_exp..(t + 1) * n_exp],
                &w.bias,
                p,
                &mut self.route,
                &mut idx[row.clone()],
                &mut weights[row],
            );
        }
        self.used.clear();
        for (t, &c) in count.iter().enumerate() {
            self.used
                .extend_from_slice(&idx[t * p.top_k..t * p.top_k + c]);
        }
        self.used.sort_unstable();
        self.used.dedup();
    }

    /// Work that needs no routed expert: the latent projection and the shared experts.
    fn shared_and_latent(&mut self, w: &MoeWeights, p: &MoeParams, x: &[f32]) {
        if self.shared_done {
            return;
        }
        self.shared_done = true;
        let z = fit(&mut self.z, self.n_tok * self.latent);
        w.down.apply_into(x, z);
        let shared = fit(&mut self.shared, self.n_tok * self.hidden);
        situ_glu_into(
            &w.shared_gate,
            &w.shared_up,
            &w.shared_down,
            x,
            p.beta1,
            p.beta2,
            &mut self.g,
            &mut self.u,
            shared,
        );
    }

    /// Routed expert `e` over the tokens that chose it, into their (token, slot) outputs.
    fn run_expert(&mut self, e: usize, ex: &Expert, p: &MoeParams) {
        let (latent, top_k) = (self.latent, self.top_k);
        self.users.clear();
        for t in 0..self.n_tok {
            let row = &self.idx[t * top_k..t * top_k + self.count[t]];
            if let Some(j) = row.iter().position(|&i| i == e) {
                self.users.push((t, j));
            }
        }
        let n = self.users.len();
        let zs = fit(&mut self.zs, n * latent);
        for (zr, &(t, _)) in zs.chunks_mut(latent).zip(&self.users) {
            zr.copy_from_slice(&self.z[t * latent..(t + 1) * latent]);
        }
        let ye = fit(&mut self.ye, n * latent);
        situ_glu_into(
            &ex.w1,
            &ex.w3,
            &ex.w2,
            zs,
            p.beta1,
            p.beta2,
            &mut self.g,
            &mut self.u,
            ye,
        );
        let outs = fit(&mut self.outs, self.n_tok * top_k * latent);
        for (yr, &(t, j)) in ye.chunks(latent).zip(&self.users) {
            let at = (t * top_k + j) * latent;
            outs[at..at + latent].copy_from_slice(yr);
        }
    }

    /// Sum each token's expert outputs in top-k order, normalise, project up and add the
    /// shared experts: `out` `[n_tok, hidden]`.
    fn finish(&mut self, w: &MoeWeights, p: &MoeParams, out: &mut [f32]) {
        let (latent, top_k) = (self.latent, self.top_k);
        let agg = fit(&mut self.agg, self.n_tok * latent);
        let outs = fit(&mut self.outs, self.n_tok * top_k * latent);
        for (t, ut) in agg.chunks_mut(latent).enumerate() {
            ut.fill(0.0);
            for j in 0..self.count[t] {
                let at = (t * top_k + j) * latent;
                // Every selected (token, slot) was filled by the loop over experts.
                kernels::axpy(self.weights[t * top_k + j], &outs[at..at + latent], ut);
            }
            ops::rmsnorm(ut, &w.norm, p.rms_eps);
        }
        w.up.apply_into(agg, out);
        for (a, b) in out.iter_mut().zip(&self.shared) {
            *a += b;
        }
    }
}

/// Where an MoE block's routed experts come from (all of one layer).
pub trait ExpertSource {
    /// A failed fetch.
    type Error;
    /// A group of experts being fetched: `(position in the ids asked for, expert)` in
    /// whatever order they become available.
    type Arrivals<'s>: Iterator<Item = Result<(usize, Arc<Expert>), Self::Error>>
    where
        Self: 's;
    /// Most experts to ask for at once (each group is fetched, used and released).
    fn group(&self) -> usize;
    /// Start fetching `ids`; the experts arrive through the returned iterator.
    fn start<'s>(&'s self, ids: &[usize]) -> Self::Arrivals<'s>;
}

/// One MoE block over `x` `[n_tok, hidden]` with the experts held in `w`; also returns the
/// routing decisions.
///
/// # Panics
/// If `w.experts` does not hold every routed expert.
#[must_use]
pub fn forward(w: &MoeWeights, p: &MoeParams, x: &[f32]) -> (Vec<f32>, Routing) {
    let mut sc = MoeScratch::default();
    let mut y = vec![0f32; x.len()];
    forward_into(w, p, x, &mut sc, &mut y);
    (y, sc.routing())
}

/// [`forward`] into `out` `[n_tok, hidden]` with the buffers of `sc`, where the routing is
/// left ([`MoeScratch::routing`]).
///
/// # Panics
/// If `w.experts` does not hold every routed expert.
pub fn forward_into(
    w: &MoeWeights,
    p: &MoeParams,
    x: &[f32],
    sc: &mut MoeScratch,
    out: &mut [f32],
) {
    sc.prepare(w, p, x);
    sc.shared_and_latent(w, p, x);
    for i in 0..sc.used.len() {
        let e = sc.used[i];
        sc.run_expert(e, &w.experts[e], p);
    }
    sc.finish(w, p, out);
}

/// One MoE block whose routed experts come from `source`, asked for at most `group()` at a
/// time, into `out` `[n_tok, hidden]` with the buffers of `sc` (where the routing is left,
/// [`MoeScratch::routing`]). Each expert is computed as soon as it arrives (the shared experts
/// while the first reads are in flight); its outputs are kept per (token, slot) and
/// accumulated per token in top-k order afterwards, so neither the grouping nor the arrival
/// order changes a bit.
pub fn forward_with_into<S: ExpertSource + ?Sized>(
    w: &MoeWeights,
    p: &MoeParams,
    x: &[f32],
    source: &S,
    sc: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), S::Error> {
    sc.prepare(w, p, x);
    let group = source.group().max(1);
    let mut at = 0;
    while at < sc.used.len() {
        let end = (at + group).min(sc.used.len());
        // The group's ids are copied into the scratch's own buffer so that `sc` can be
        // borrowed mutably while the source reads them.
        sc.group.clear();
        sc.group.extend_from_slice(&sc.used[at..end]);
        let ids = std::mem::take(&mut sc.group);
        let arrivals = source.start(&ids);
        // Work that needs no routed expert, done while the first group's reads are in flight.
        sc.shared_and_latent(w, p, x);
        let mut failed = None;
        for got in arrivals {
            match got {
                Ok((k, ex)) => sc.run_expert(ids[k], &ex, p),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        sc.group = ids;
        if let Some(e) = failed {
            return Err(e);
        }
        at = end;
    }
    sc.shared_and_latent(w, p, x);
    sc.finish(w, p, out);
    Ok(())
}
