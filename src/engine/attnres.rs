//! Attention Residuals: the softmax-weighted mix of block snapshots and the running partial sum
//! that replaces the residual stream (MODEL.md §3.2).
//!
//! For sources `v_0..v_{n-1}` of one token: `k_i = v_i / sqrt(mean(v_i²) + eps)` (no gain),
//! `score_i = k_i · f` with `f = norm_weight ⊙ proj_weight`, `a = softmax(score)`, and the
//! output `Σ a_i v_i` mixes the **raw** sources. Nothing crosses token positions.

use crate::kernels::{self, ops};

/// Mix `sources` (each `[n_tok, d]`, oldest snapshot first, partial sum last) into `out`
/// `[n_tok, d]`, scoring with `fold` `[d]`.
pub fn aggregate(sources: &[&[f32]], fold: &[f32], eps: f32, d: usize, out: &mut [f32]) {
    let n_tok = out.len() / d;
    let mut k = vec![0f32; d];
    let mut a = vec![0f32; sources.len()];
    for t in 0..n_tok {
        let row = t * d..(t + 1) * d;
        for (ai, src) in a.iter_mut().zip(sources) {
            let v = &src[row.clone()];
            let inv = ops::rms_inv(v, eps);
            for (kj, &vj) in k.iter_mut().zip(v) {
                *kj = vj * inv;
            }
            *ai = kernels::dot(&k, fold);
        }
        ops::softmax(&mut a);
        let o = &mut out[row.clone()];
        o.fill(0.0);
        for (&ai, src) in a.iter().zip(sources) {
            kernels::axpy(ai, &src[row.clone()], o);
        }
    }
}
