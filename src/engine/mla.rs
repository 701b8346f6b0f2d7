//! Gated Multi-head Latent Attention without positions (docs/model.md#gated-mla), in the absorbed form
//! over a latent cache.
//!
//! Per position the cache keeps only `c` (the normalised KV latent, `kv_lora` wide) and `r` (the
//! shared, never-rotated "rope" key, `rope` wide). A query head scores a cached position as
//! `((W_Kᵀ q_nope)·c + q_rope·r) / sqrt(nope + rope)` and reads `W_V (Σ a·c)`. Each (token, head)
//! pair is computed independently, in parallel, with a fixed order inside.

use super::tensor::{fit, Dense};
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

/// The buffers one MLA block needs, reused between calls: after the first call of a given
/// chunk length and context, a call allocates nothing.
#[derive(Clone, Debug, Default)]
pub struct MlaScratch {
    /// `[n_tok, q_lora]` and `[n_tok, heads·(nope+rope)]`: the query path.
    cq: Vec<f32>,
    q: Vec<f32>,
    /// `[n_tok, kv_lora + rope]` this chunk's latent rows.
    kv: Vec<f32>,
    /// `[n_tok, heads·v]` the output gate logits.
    gate: Vec<f32>,
    /// `[heads][2·kv_lora + context]` per head: absorbed query, context latent, scores.
    head: Vec<f32>,
    /// `[n_tok, heads·v]` attention outputs.
    o: Vec<f32>,
}

impl MlaScratch {
    /// Bytes the buffers hold (their capacity).
    #[must_use]
    pub fn bytes(&self) -> usize {
        [&self.cq, &self.q, &self.kv, &self.gate, &self.head, &self.o]
            .into_iter()
            .map(|v| v.capacity() * 4)
            .sum()
    }
}

/// Append this chunk's latent `[c ‖ r]` rows to `cache`; returns the gated attention output
/// `[n_tok, hidden]` for `x` `[n_tok, hidden]`.
#[must_use]
pub fn forward(w: &MlaWeights, p: &MlaParams, x: &[f32], cache: &mut Vec<f32>) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    forward_into(w, p, x, cache, &mut MlaScratch::default(), &mut out);
    out
}

/// [`forward`] into `out` `[n_tok, hidden]` with the buffers of `sc`. Tokens are taken in
/// order, the heads of one token in parallel.
pub fn forward_into(
    w: &MlaWeights,
    p: &MlaParams,
    x: &[f32],
    cache: &mut Vec<f32>,
    sc: &mut MlaScratch,
    out: &mut [f32],
) {
    let n_tok = x.len() / w.q_a.cols;
    let cw = p.cache_width();
    let qh = p.nope + p.rope;
    let cq = fit(&mut sc.cq, n_tok * w.q_a.rows);
    w.q_a.apply_into(x, cq);
    for row in cq.chunks_mut(w.q_a.rows) {
        ops::rmsnorm(row, &w.q_a_norm, p.lora_eps);
    }
    let q = fit(&mut sc.q, n_tok * w.q_b.rows);
    w.q_b.apply_into(cq, q);
    let kv = fit(&mut sc.kv, n_tok * cw);
    w.kv_a.apply_into(x, kv);
    for row in kv.chunks_mut(cw) {
        ops::rmsnorm(&mut row[..p.kv_lora], &w.kv_a_norm, p.lora_eps);
    }
    let n_past = cache.len() / cw;
    cache.extend_from_slice(kv);
    let scale = 1.0 / (qh as f32).sqrt();
    let ow = p.heads * p.v;
    // Score room for as many positions as the cache has room for, so that decoding within
    // the cache's capacity never regrows this buffer.
    let per_head = 2 * p.kv_lora + (n_past + n_tok).max(cache.capacity() / cw.max(1));
    let head = fit(&mut sc.head, p.heads * per_head);
    let o = fit(&mut sc.o, n_tok * ow);
    let q: &[f32] = q;
    let cache: &[f32] = cache;
    for t in 0..n_tok {
        let n_ctx = n_past + t + 1;
        o[t * ow..(t + 1) * ow]
            .par_chunks_mut(p.v)
            .zip(head.par_chunks_mut(per_head))
            .enumerate()
            .for_each(|(h, (ho, buf))| {
                let qv = &q[t * p.heads * qh + h * qh..t * p.heads * qh + (h + 1) * qh];
                let (q_nope, q_rope) = qv.split_at(p.nope);
                let (q_abs, rest) = buf.split_at_mut(p.kv_lora);
                let (ctx, a) = rest.split_at_mut(p.kv_lora);
                let a = &mut a[..n_ctx];
                // Absorbed query: W_Kᵀ q_nope (kv_lora wide).
                q_abs.fill(0.0);
                for (dd, &qd) in q_nope.iter().enumerate() {
                    w.kv_b.row_axpy(h * (p.nope + p.v) + dd, qd, q_abs);
                }
                // Per position: (q_abs·c + q_rope·r)·scale, then ctx = Σ a_τ c_τ in order.
                kernels::scores(q_abs, q_rope, &cache[..n_ctx * cw], cw, scale, a);
                ops::softmax(a);
                ctx.fill(0.0);
                kernels::axpy_rows(a, &cache[..n_ctx * cw], cw, ctx);
                for (j, oj) in ho.iter_mut().enumerate() {
                    *oj = w.kv_b.row_dot(h * (p.nope + p.v) + p.nope + j, ctx);
                }
            });
    }
    let gate = fit(&mut sc.gate, n_tok * w.g_proj.rows);
    w.g_proj.apply_into(x, gate);
    for (oi, &g) in o.iter_mut().zip(gate.iter()) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply_into(o, out);
}

/// One MLA block over `n_rows` rows that belong to different sequences, one position each (a
/// batched decoding step): row `t` of `x` `[n_rows, hidden]` appends its latent row to the
/// `t`-th cache `caches` yields and attends over that cache alone. The projections take every
/// row in one call. Each row's output and cache are bitwise those of [`forward_into`] over
/// that row alone: every step is per row, and the matrix products give a row the same bits
/// whatever rows share the call.
///
/// # Panics
/// If `caches` yields fewer caches than `x` has rows.
pub fn forward_rows_into<'c>(
    w: &MlaWeights,
    p: &MlaParams,
    x: &[f32],
    caches: impl Iterator<Item = &'c mut Vec<f32>>,
    sc: &mut MlaScratch,
    out: &mut [f32],
) {
    let n_rows = x.len() / w.q_a.cols;
    let cw = p.cache_width();
    let qh = p.nope + p.rope;
    let cq = fit(&mut sc.cq, n_rows * w.q_a.rows);
    w.q_a.apply_into(x, cq);
    for row in cq.chunks_mut(w.q_a.rows) {
        ops::rmsnorm(row, &w.q_a_norm, p.lora_eps);
    }
    let q = fit(&mut sc.q, n_rows * w.q_b.rows);
    w.q_b.apply_into(cq, q);
    let kv = fit(&mut sc.kv, n_rows * cw);
    w.kv_a.apply_into(x, kv);
    for row in kv.chunks_mut(cw) {
        ops::rmsnorm(&mut row[..p.kv_lora], &w.kv_a_norm, p.lora_eps);
    }
    let scale = 1.0 / (qh as f32).sqrt();
    let ow = p.heads * p.v;
    let o = fit(&mut sc.o, n_rows * ow);
    let q: &[f32] = q;
    let mut caches = caches;
    for t in 0..n_rows {
        let Some(cache) = caches.next() else {
            panic!("mla::forward_rows_into: a cache for every row");
        };
        cache.extend_from_slice(&kv[t * cw..(t + 1) * cw]);
        let n_ctx = cache.len() / cw;
        let per_head = 2 * p.kv_lora + n_ctx.max(cache.capacity() / cw.max(1));
        let head = fit(&mut sc.head, p.heads * per_head);
        let cache: &[f32] = cache;
        let qt = &q[t * p.heads * qh..(t + 1) * p.heads * qh];
        o[t * ow..(t + 1) * ow]
            .par_chunks_mut(p.v)
            .zip(head.par_chunks_mut(per_head))
            .enumerate()
            .for_each(|(h, (ho, buf))| {
                let (q_nope, q_rope) = qt[h * qh..(h + 1) * qh].split_at(p.nope);
                let (q_abs, rest) = buf.split_at_mut(p.kv_lora);
                let (ctx, a) = rest.split_at_mut(p.kv_lora);
                let a = &mut a[..n_ctx];
                q_abs.fill(0.0);
                for (dd, &qd) in q_nope.iter().enumerate() {
                    w.kv_b.row_axpy(h * (p.nope + p.v) + dd, qd, q_abs);
                }
                kernels::scores(q_abs, q_rope, &cache[..n_ctx * cw], cw, scale, a);
                ops::softmax(a);
                ctx.fill(0.0);
                kernels::axpy_rows(a, &cache[..n_ctx * cw], cw, ctx);
                for (j, oj) in ho.iter_mut().enumerate() {
                    *oj = w.kv_b.row_dot(h * (p.nope + p.v) + p.nope + j, ctx);
                }
            });
    }
    let gate = fit(&mut sc.gate, n_rows * w.g_proj.rows);
    w.g_proj.apply_into(x, gate);
    for (oi, &g) in o.iter_mut().zip(gate.iter()) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply_into(o, out);
}
