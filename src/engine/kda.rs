//! Kimi Delta Attention: gated delta-rule linear attention with a short causal convolution
//! (MODEL.md §3.4). Tokens are processed strictly in order; heads run in parallel, each owning
//! its slice of the recurrent state, so the result does not depend on the thread count.

use super::tensor::Dense;
use crate::kernels::{self, ops};
use rayon::prelude::*;

/// Weights of one KDA attention block. `P = heads · head_dim`.
#[derive(Clone, Debug)]
pub struct KdaWeights {
    /// `[P, hidden]`.
    pub q_proj: Dense,
    /// `[P, hidden]`.
    pub k_proj: Dense,
    /// `[P, hidden]`.
    pub v_proj: Dense,
    /// `[P, K]` conv taps for q (tap K−1 multiplies the current input).
    pub q_conv: Vec<f32>,
    /// `[P, K]`.
    pub k_conv: Vec<f32>,
    /// `[P, K]`.
    pub v_conv: Vec<f32>,
    /// `[head_dim, hidden]` decay low-rank down.
    pub f_a: Dense,
    /// `[P, head_dim]` decay low-rank up.
    pub f_b: Dense,
    /// `[heads]` per-head log scale (first `heads` values of the checkpoint tensor).
    pub a_log: Vec<f32>,
    /// `[P]` per-channel decay bias.
    pub dt_bias: Vec<f32>,
    /// `[heads, hidden]` write-strength logits.
    pub b_proj: Dense,
    /// `[P, hidden]` output gate.
    pub g_proj: Dense,
    /// `[head_dim]` head-wise output norm gain.
    pub o_norm: Vec<f32>,
    /// `[hidden, P]`.
    pub o_proj: Dense,
}

/// Shape and constants of a KDA block.
#[derive(Clone, Copy, Debug)]
pub struct KdaParams {
    /// Heads.
    pub heads: usize,
    /// d_k = d_v.
    pub head_dim: usize,
    /// Conv taps.
    pub kernel: usize,
    /// g_min (negative).
    pub lower_bound: f32,
    /// Epsilon of the head-wise output RMSNorm.
    pub rms_eps: f32,
    /// Epsilon of the q/k L2 norm.
    pub l2_eps: f32,
}

/// Carried state of one KDA layer.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// `[heads, head_dim (key), head_dim (value)]` recurrent matrices.
    pub s: Vec<f32>,
    /// `[3][P, K−1]` last K−1 pre-convolution inputs of q, k, v (oldest first).
    pub conv: [Vec<f32>; 3],
}

impl KdaState {
    /// Zero state for a fresh sequence.
    #[must_use]
    pub fn new(p: &KdaParams) -> Self {
        let width = p.heads * p.head_dim;
        let hist = width * (p.kernel - 1);
        KdaState {
            s: vec![0.0; p.heads * p.head_dim * p.head_dim],
            conv: [vec![0.0; hist], vec![0.0; hist], vec![0.0; hist]],
        }
    }
}

/// Decay `α = exp(g_min · σ(exp(A_log[h]) · (z + dt_bias)))` for one token's `z` `[P]`.
pub fn decay(z: &[f32], a_log: &[f32], dt_bias: &[f32], p: &KdaParams, alpha: &mut [f32]) {
    for (c, a) in alpha.iter_mut().enumerate() {
        let h = c / p.head_dim;
        let g = p.lower_bound * ops::sigmoid(a_log[h].exp() * (z[c] + dt_bias[c]));
        *a = g.exp();
    }
}

/// The delta-rule recurrence of one head over `n_tok` steps.
///
/// `q, k, v, alpha` are `[n_tok, d]` for this head (q already scaled), `beta` is `[n_tok]`;
/// `s` is `[d, d]` (key rows, value columns); returns `o` `[n_tok, d]`.
pub fn recur_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: &[f32],
    s: &mut [f32],
    d: usize,
) -> Vec<f32> {
    let n_tok = beta.len();
    let mut out = vec![0f32; n_tok * d];
    let mut u = vec![0f32; d];
    let mut w = vec![0f32; d];
    for (t, (o, &bt)) in out.chunks_mut(d).zip(beta).enumerate() {
        let row = t * d..(t + 1) * d;
        let (qt, kt, vt, at) = (
            &q[row.clone()],
            &k[row.clone()],
            &v[row.clone()],
            &alpha[row],
        );
        // a + b: decay the key rows, then read u = Sᵀk.
        u.fill(0.0);
        for ((si, &ai), &ki) in s.chunks_mut(d).zip(at).zip(kt) {
            for x in si.iter_mut() {
                *x *= ai;
            }
            kernels::axpy(ki, si, &mut u);
        }
        // c: delta write S += k (β (v − u))ᵀ; d: o = Sᵀ q̂ from the updated state.
        for ((wj, &vj), &uj) in w.iter_mut().zip(vt).zip(&u) {
            *wj = bt * (vj - uj);
        }
        for ((si, &ki), &qi) in s.chunks_mut(d).zip(kt).zip(qt) {
            kernels::axpy(ki, &w, si);
            kernels::axpy(qi, si, o);
        }
    }
    out
}

/// Split `[n_tok, heads·d]` into per-head `[n_tok, d]` buffers.
fn per_head(x: &[f32], n_tok: usize, heads: usize, d: usize) -> Vec<Vec<f32>> {
    (0..heads)
        .map(|h| {
            let mut v = Vec::with_capacity(n_tok * d);
            for t in 0..n_tok {
                let base = t * heads * d + h * d;
                v.extend_from_slice(&x[base..base + d]);
            }
            v
        })
        .collect()
}

/// Causal conv + SiLU over a chunk, advancing `state`.
fn conv_chunk(x: &[f32], w: &[f32], state: &mut [f32], kernel: usize, width: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (xt, ot) in x.chunks(width).zip(out.chunks_mut(width)) {
        ops::shortconv_step(xt, w, state, kernel, ot);
    }
    out
}

/// What one KDA block consumed per position of a chunk, kept so that the state after any
/// prefix of the chunk can be built from the state before it without the weights
/// ([`KdaRecord::replay`]): the pre-convolution q/k/v rows (for the conv windows) and the
/// inputs of the recurrence (normalised q and k, v, the decay α and the write strength β).
#[derive(Clone, Debug)]
pub struct KdaRecord {
    /// `[3][n_tok, P]` projected q, k, v before the convolution.
    raw: [Vec<f32>; 3],
    /// `[n_tok, P]` each: the recurrence's q (scaled), k, v and α.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    alpha: Vec<f32>,
    /// `[n_tok, heads]`.
    beta: Vec<f32>,
    /// Heads.
    heads: usize,
}

impl KdaRecord {
    /// Positions recorded.
    #[must_use]
    pub fn len(&self) -> usize {
        self.beta.len() / self.heads.max(1)
    }

    /// Whether nothing was recorded.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.beta.is_empty()
    }

    /// Floats a record holds per position (`7·P + heads`), for the memory plan.
    #[must_use]
    pub fn floats_per_position(p: &KdaParams) -> usize {
        7 * p.heads * p.head_dim + p.heads
    }

    /// Advance `state` (the state before the recorded chunk) over the chunk's first `keep`
    /// positions by running the same recurrence steps on the recorded inputs: bit for bit the
    /// state a forward pass over only those positions leaves.
    pub fn replay(&self, p: &KdaParams, keep: usize, state: &mut KdaState) {
        assert!(keep <= self.len(), "cannot keep more than the chunk");
        let (heads, d) = (p.heads, p.head_dim);
        let width = heads * d;
        let hist = p.kernel - 1;
        for (win, raw) in state.conv.iter_mut().zip(&self.raw) {
            for ch in 0..width {
                let st = &mut win[ch * hist..(ch + 1) * hist];
                for t in 0..keep {
                    if hist > 0 {
                        st.copy_within(1.., 0);
                        st[hist - 1] = raw[t * width + ch];
                    }
                }
            }
        }
        let rows = |x: &[f32], h: usize| -> Vec<f32> {
            let mut v = Vec::with_capacity(keep * d);
            for t in 0..keep {
                v.extend_from_slice(&x[t * width + h * d..t * width + (h + 1) * d]);
            }
            v
        };
        state
            .s
            .par_chunks_mut(d * d)
            .enumerate()
            .for_each(|(h, s)| {
                let b: Vec<f32> = (0..keep).map(|t| self.beta[t * heads + h]).collect();
                let _ = recur_head(
                    &rows(&self.q, h),
                    &rows(&self.k, h),
                    &rows(&self.v, h),
                    &rows(&self.alpha, h),
                    &b,
                    s,
                    d,
                );
            });
    }
}

/// One KDA block over a chunk: `x` `[n_tok, hidden]` (normalised input) → `[n_tok, hidden]`.
#[must_use]
pub fn forward(w: &KdaWeights, p: &KdaParams, x: &[f32], state: &mut KdaState) -> Vec<f32> {
    forward_recorded(w, p, x, state, None)
}

/// [`forward`] that, given a `record`, leaves `state` as it was and keeps in the record what
/// the chunk's positions consumed, so that any prefix of the chunk can be applied to the state
/// afterwards ([`KdaRecord::replay`]); the chunk is computed on a scratch copy of the state.
#[must_use]
pub fn forward_recorded(
    w: &KdaWeights,
    p: &KdaParams,
    x: &[f32],
    state: &mut KdaState,
    record: Option<&mut Option<KdaRecord>>,
) -> Vec<f32> {
    let mut scratch = record.is_some().then(|| state.clone());
    let state = scratch.as_mut().unwrap_or(state);
    let (heads, d) = (p.heads, p.head_dim);
    let width = heads * d;
    let n_tok = x.len() / w.q_proj.cols;
    let recording = record.is_some();
    let raw = [w.q_proj.apply(x), w.k_proj.apply(x), w.v_proj.apply(x)];
    let mut q = conv_chunk(&raw[0], &w.q_conv, &mut state.conv[0], p.kernel, width);
    let mut k = conv_chunk(&raw[1], &w.k_conv, &mut state.conv[1], p.kernel, width);
    let v = conv_chunk(&raw[2], &w.v_conv, &mut state.conv[2], p.kernel, width);
    let raw = if recording {
        Some(raw)
    } else {
        drop(raw);
        None
    };
    let beta: Vec<f32> = w.b_proj.apply(x).into_iter().map(ops::sigmoid).collect();
    let z = w.f_b.apply(&w.f_a.apply(x));
    let gate = w.g_proj.apply(x);
    let q_scale = 1.0 / (d as f32).sqrt();
    let mut alpha = vec![0f32; n_tok * width];
    for t in 0..n_tok {
        let row = t * width..(t + 1) * width;
        for h in 0..heads {
            let hr = t * width + h * d..t * width + (h + 1) * d;
            ops::l2norm(&mut q[hr.clone()], p.l2_eps);
            ops::l2norm(&mut k[hr.clone()], p.l2_eps);
            for x in &mut q[hr] {
                *x *= q_scale;
            }
        }
        decay(&z[row.clone()], &w.a_log, &w.dt_bias, p, &mut alpha[row]);
    }
    if let (Some(slot), Some(raw)) = (record, raw) {
        *slot = Some(KdaRecord {
            raw,
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            alpha: alpha.clone(),
            beta: beta.clone(),
            heads,
        });
    }
    let (qh, kh, vh, ah) = (
        per_head(&q, n_tok, heads, d),
        per_head(&k, n_tok, heads, d),
        per_head(&v, n_tok, heads, d),
        per_head(&alpha, n_tok, heads, d),
    );
    let outs: Vec<Vec<f32>> = state
        .s
        .par_chunks_mut(d * d)
        .enumerate()
        .map(|(h, s)| {
            let b: Vec<f32> = (0..n_tok).map(|t| beta[t * heads + h]).collect();
            recur_head(&qh[h], &kh[h], &vh[h], &ah[h], &b, s, d)
        })
        .collect();
    // Head-wise RMSNorm, then the sigmoid gate, then the output projection.
    let mut o = vec![0f32; n_tok * width];
    for t in 0..n_tok {
        for (h, oh) in outs.iter().enumerate() {
            let dst = &mut o[t * width + h * d..t * width + (h + 1) * d];
            dst.copy_from_slice(&oh[t * d..(t + 1) * d]);
            ops::rmsnorm(dst, &w.o_norm, p.rms_eps);
        }
    }
    for (oi, &g) in o.iter_mut().zip(&gate) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply(&o)
}
