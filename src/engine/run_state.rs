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
