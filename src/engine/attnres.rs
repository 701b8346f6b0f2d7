//! Attention Residuals: the softmax-weighted mix of block snapshots and the running partial sum
//! that replaces the residual stream (docs/model.md#attention-residuals).
//!
//! For sources `v_0..v_{n-1}` of one token: `k_i = v_i / sqrt(mean(v_i²) + eps)` (no gain),
//! `score_i = k_i · f` with `f = norm_weight ⊙ proj_weight`, `a = softmax(score)`, and the
//! output `Σ a_i v_i` mixes the **raw** sources. Nothing crosses token positions.

use crate::kernels::{self, ops};

/// Mix `sources` (each `[n_tok, d]`, oldest snapshot first, partial sum last) into `out`
/// `[n_tok, d]`, scoring with `fold` `[d]`.
pub fn aggregate(sources: &[&[f32]], fold: &[f32], eps: f32, d: usize, out: &mut [f32]) {
    let mut k = vec![0f32; d];
    let mut a = vec![0f32; sources.len()];
    aggregate_with(
        sources.len(),
        |i| sources[i],
        fold,
        eps,
        d,
        out,
        &mut k,
        &mut a,
    );
}

/// [`aggregate`] over `n_src` sources handed out by `source(i)`, with `k` (`d` long) and `a`
/// (`n_src` long) as scratch.
#[allow(clippy::too_many_arguments)]
pub fn aggregate_with<'s>(
    n_src: usize,
    source: impl Fn(usize) -> &'s [f32],
    fold: &[f32],
    eps: f32,
    d: usize,
    out: &mut [f32],
    k: &mut [f32],
    a: &mut [f32],
) {
    let n_tok = out.len() / d;
    let a = &mut a[..n_src];
    for t in 0..n_tok {
        let row = t * d..(t + 1) * d;
        for (i, ai) in a.iter_mut().enumerate() {
            let v = &source(i)[row.clone()];
            let inv = ops::rms_inv(v, eps);
            for (kj, &vj) in k.iter_mut().zip(v) {
                *kj = vj * inv;
            }
            *ai = kernels::dot(k, fold);
        }
        ops::softmax(a);
        let o = &mut out[row.clone()];
        o.fill(0.0);
        for (i, &ai) in a.iter().enumerate() {
            kernels::axpy(ai, &source(i)[row.clone()], o);
        }
    }
}
