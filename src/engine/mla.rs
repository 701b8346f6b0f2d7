//! Gated Multi-head Latent Attention without positions (MODEL.md §3.5), in the absorbed form
//! over a latent cache.
//!
//! Per position the cache keeps only `c` (the normalised KV latent, `kv_lora` wide) and `r` (the
//! shared, never-rotated "rope" key, `rope` wide). A query head scores a cached position as
//! `((W_Kᵀ q_nope)·c + q_rope·r) / sqrt(nope + rope)` and reads `W_V (Σ a·c)`. Each (token, head)
//! pair is computed independently, in parallel, with a fixed order inside.

use super::tensor::Dense;
use crate::kernels::{self, ops};
use rayon::prelude::*;

/// Weights of one MLA block.
#[derive(Clone, Debug)]
pub struct MlaWeights {
    /// `[q_lora, hidden]`.
    pub q_a: Dense,
    /// `[q_lora]`.
    pub q_a_norm: Vec<f32>,
    /// `[heads·(nope+rope), q_lora]`.
    pub q_b: Dense,
    /// `[kv_lora + rope, hidden]`.
    pub kv_a: Dense,
    /// `[kv_lora]`.
    pub kv_a_norm: Vec<f32>,
    /// `[heads·(nope+v), kv_lora]`: per head `nope` key rows then `v` value rows.
    pub kv_b: Dense,
    /// `[heads·v, hidden]` output gate.
    pub g_proj: Dense,
    /// `[hidden, heads·v]`.
    pub o_proj: Dense,
}

/// Shape and constants of an MLA block.
#[derive(Clone, Copy, Debug)]
pub struct MlaParams {
    /// Heads.
    pub heads: usize,
    /// No-position q/k dims per head.
    pub nope: usize,
    /// Unrotated "rope" dims per head (shared key).
    pub rope: usize,
    /// Value dims per head.
    pub v: usize,
    /// KV latent rank.
    pub kv_lora: usize,
    /// Epsilon of `q_a_layernorm` and `kv_a_layernorm`.
    pub lora_eps: f32,
}

impl MlaParams {
    /// Floats cached per position (`kv_lora + rope`).
    #[must_use]
    pub fn cache_width(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// Append this chunk's latent `[c ‖ r]` rows to `cache`; returns the gated attention output
/// `[n_tok, hidden]` for `x` `[n_tok, hidden]`.
#[must_use]
pub fn forward(w: &MlaWeights, p: &MlaParams, x: &[f32], cache: &mut Vec<f32>) -> Vec<f32> {
    let n_tok = x.len() / w.q_a.cols;
    let cw = p.cache_width();
    let qh = p.nope + p.rope;
    let mut cq = w.q_a.apply(x);
    for row in cq.chunks_mut(w.q_a.rows) {
        ops::rmsnorm(row, &w.q_a_norm, p.lora_eps);
    }
    let q = w.q_b.apply(&cq);
    let mut kv = w.kv_a.apply(x);
    for row in kv.chunks_mut(cw) {
        ops::rmsnorm(&mut row[..p.kv_lora], &w.kv_a_norm, p.lora_eps);
    }
    let n_past = cache.len() / cw;
    cache.extend_from_slice(&kv);
    let cache: &[f32] = cache;
    let scale = 1.0 / (qh as f32).sqrt();
    let ow = p.heads * p.v;
    let head_out: Vec<Vec<f32>> = (0..n_tok * p.heads)
        .into_par_iter()
        .map(|th| {
            let (t, h) = (th / p.heads, th % p.heads);
            let qv = &q[t * p.heads * qh + h * qh..t * p.heads * qh + (h + 1) * qh];
            let (q_nope, q_rope) = qv.split_at(p.nope);
            // Absorbed query: W_Kᵀ q_nope (kv_lora wide).
            let mut q_abs = vec![0f32; p.kv_lora];
            for (dd, &qd) in q_nope.iter().enumerate() {
                w.kv_b.row_axpy(h * (p.nope + p.v) + dd, qd, &mut q_abs);
            }
            let n_ctx = n_past + t + 1;
            let mut a: Vec<f32> = (0..n_ctx)
                .map(|tau| {
                    let row = &cache[tau * cw..(tau + 1) * cw];
                    let (c, r) = row.split_at(p.kv_lora);
                    (kernels::dot(&q_abs, c) + kernels::dot(q_rope, r)) * scale
                })
                .collect();
            ops::softmax(&mut a);
            let mut ctx = vec![0f32; p.kv_lora];
            for (tau, &at) in a.iter().enumerate() {
                kernels::axpy(at, &cache[tau * cw..tau * cw + p.kv_lora], &mut ctx);
            }
            (0..p.v)
                .map(|j| w.kv_b.row_dot(h * (p.nope + p.v) + p.nope + j, &ctx))
                .collect()
        })
        .collect();
    let gate = w.g_proj.apply(x);
    let mut o = vec![0f32; n_tok * ow];
    for (th, ho) in head_out.iter().enumerate() {
        let (t, h) = (th / p.heads, th % p.heads);
        o[t * ow + h * p.v..t * ow + (h + 1) * p.v].copy_from_slice(ho);
    }
    for (oi, &g) in o.iter_mut().zip(&gate) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply(&o)
}
