//! The buffers of one forward call, kept between calls (llama2.c's `RunState`): the residual
//! stream and its block snapshots, each block's intermediates, and the logits. A caller that
//! decodes keeps one [`RunState`] per sequence and hands it to every forward call, so a
//! decoding step after the first allocates nothing on the resident path.
//!
//! Buffers are sized from the shapes of the first call that needs them and grown, never
//! shrunk, when a longer chunk (prefill) or a longer context (MLA scores) needs more; their
//! contents are scratch, fully overwritten before they are read.

use super::kda::KdaScratch;
use super::mla::MlaScratch;
use super::moe::MoeScratch;

/// Reusable buffers of the forward pass ([`super::Model::forward_run`]).
#[derive(Debug, Default)]
pub struct RunState {
    /// Floats of one `[n_tok, hidden]` row block in the current call.
    pub(super) len: usize,
    /// `[n_blocks, n_tok·hidden]` the AttnRes block snapshots of the chunk so far.
    pub(super) blocks: Vec<f32>,
    /// Snapshots taken so far in this chunk.
    pub(super) n_blocks: usize,
    /// `[n_tok, hidden]` the running partial sum.
    pub(super) partial: Vec<f32>,
    /// Whether `partial` holds a value (it does not right after a block boundary).
    pub(super) has_partial: bool,
    /// `[n_tok, hidden]` the normalised mix a block reads.
    pub(super) h: Vec<f32>,
    /// `[n_tok, hidden]` a block's output.
    pub(super) branch: Vec<f32>,
    /// `[hidden]` the next layer's FFN input as predicted before this layer's FFN (the early
    /// expert prediction's input, decoding only).
    pub(super) early: Vec<f32>,
    /// `[hidden]` and `[sources]`: the AttnRes scoring scratch.
    pub(super) mix_k: Vec<f32>,
    pub(super) mix_a: Vec<f32>,
    /// KDA intermediates.
    pub(super) kda: KdaScratch,
    /// MLA intermediates.
    pub(super) mla: MlaScratch,
    /// MoE and dense MLP intermediates.
    pub(super) moe: MoeScratch,
    /// `[n, vocab]` the logits of the last call (`n_logits` floats valid).
    pub(super) logits: Vec<f32>,
    pub(super) n_logits: usize,
}

impl RunState {
    /// Empty buffers; the first forward call sizes them.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The logits the last forward call wrote (`[n, vocab]`; empty after `Logits::None`).
    #[must_use]
    pub fn logits(&self) -> &[f32] {
        &self.logits[..self.n_logits]
    }

    /// Bytes the buffers hold (their capacity).
    #[must_use]
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| v.capacity() * 4;
        f(&self.blocks)
            + f(&self.partial)
            + f(&self.h)
            + f(&self.branch)
            + f(&self.early)
            + f(&self.mix_k)
            + f(&self.mix_a)
            + f(&self.logits)
            + self.kda.bytes()
            + self.mla.bytes()
            + self.moe.bytes()
    }
}

/// What the buffers of a forward call hold at most (a [`RunState`] and the kernels' batch
/// scratch, [`crate::kernels::batch_scratch_bytes`]), in bytes: `fixed + per_token · n_tok +
/// per_position · context` for a call of `n_tok` tokens whose sequence reserves `context`
/// positions. The memory plan counts this for the longest prefill chunk it allows
/// (`stream::budget`); `tests/alloc` checks it against what a prefill really takes.
///
/// Every buffer of every block kind is counted, as they are all kept at once: a chunk goes
/// through every layer with one run state. The logits rows are not (the plan counts them
/// with the speculative pass they depend on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationSizes {
    pub fixed: u64,
    pub per_token: u64,
    pub per_position: u64,
}

/// The [`ActivationSizes`] of a model (floats counted as they are laid out by `fit` in
/// `model.rs`, `kda.rs`, `mla.rs` and `moe.rs`; an index is two floats).
#[must_use]
pub fn activation_sizes(cfg: &super::ModelConfig) -> ActivationSizes {
    let h = cfg.hidden_size;
    let layers = cfg.num_hidden_layers;
    let usize_f = std::mem::size_of::<usize>() / 4;
    // The residual stream: block snapshots (one per block start), the partial sum, the mix
    // and a block's output.
    let blocks = cfg.block_starts();
    let mut per_token = (blocks + 3) * h;
    let mut fixed = 2 * h + blocks + 1;
    let (mut per_position, mut rows) = (0, h);
    let any_mla = cfg.is_mla.iter().take(layers).any(|&m| m);
    if cfg.is_mla.iter().take(layers).any(|&m| !m) {
        // raw and convolved q, k, v; z, gate, decays, four per-head copies, recurrence outputs
        // and gated outputs (15 widths); the decay's low-rank path; β twice.
        let p = cfg.kda_width();
        per_token += 15 * p + cfg.kda_head_dim + 2 * cfg.kda_num_heads;
        fixed += 2 * p;
        rows = rows.max(p);
    }
    if any_mla {
        let heads = cfg.num_attention_heads;
        let q = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
        let cw = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        let ow = heads * cfg.v_head_dim;
        per_token += cfg.q_lora_rank + q + cw + 2 * ow;
        // Per head: the absorbed query, the context latent, and a score per position.
        fixed += heads * 2 * cfg.kv_lora_rank;
        per_position += heads;
        rows = rows.max(cfg.q_lora_rank).max(q).max(cw).max(ow);
    }
    let any_moe = (0..layers).any(|il| !cfg.is_dense(il));
    let mut inter = 0;
    if (0..layers).any(|il| cfg.is_dense(il)) {
        inter = cfg.intermediate_size;
    }
    if any_moe {
        let (n_exp, k, latent) = (
            cfg.num_experts,
            cfg.num_experts_per_token,
            cfg.routed_expert_hidden_size,
        );
        // Router logits, weights, indices and counts; the experts in use and the (token,
        // slot) users of one; the latent input, one expert's rows and outputs, every slot's
        // output, the aggregate; the shared experts' output.
        per_token += n_exp + k + usize_f * (2 * k + 1 + 2) + 3 * latent + k * latent + latent + h;
        // The router's scores, choices and taken flags; the group being fetched.
        fixed += 3 * n_exp + usize_f * n_exp;
        inter = inter.max(cfg.moe_intermediate_size).max(cfg.shared_width());
        rows = rows.max(n_exp).max(latent);
    }
    // The gate and up intermediates of the widest MLP; the batch scratch of the widest
    // product (one buffer: one pass is in flight).
    per_token += 2 * inter;
    rows = rows.max(inter);
    per_token += rows;
    ActivationSizes {
        fixed: fixed as u64 * 4,
        per_token: per_token as u64 * 4,
        per_position: per_position as u64 * 4,
    }
}
