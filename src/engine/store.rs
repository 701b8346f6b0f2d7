//! The one interface the forward pass reads weights through.
//!
//! The forward pass asks a [`WeightStore`] for four things — embedding rows, a layer's
//! non-expert weights, a MoE block computed with its routed experts, and the output head's
//! logits — and every answer is written into the caller's buffers. Where the bytes live is
//! the store's business alone: [`ResidentWeights`] holds the whole model (read or mapped at
//! open), the `Streamer` (`residency.rs`) serves the same requests under a
//! memory plan (pinned layers, a read-ahead ring, an expert cache). The forward pass never
//! branches on which it has; the front ends read the engine's figures through
//! [`WeightStore::stats`] and re-plan through [`WeightStore::set_plan`].
//!
//! The products are computed by the same kernels in the same order whichever store serves
//! them, so tokens and logits are bitwise identical at every budget.

use super::config::ModelConfig;
use super::layer::Layer;
use super::moe::{self, MoeParams, MoeScratch, MoeWeights};
use super::tensor::Dense;
use crate::stream::budget::{ModelSizes, Plan};
use crate::stream::stats::{LayerResidency, Residency, StatsSnapshot};
use crate::stream::trunk::Trunk;
use crate::stream::{Checkpoint, StreamError};
use std::sync::Arc;

/// Where the forward pass gets its weights. Implementations write into the buffers they are
/// handed and compute every product with the shared kernels, so the bits do not depend on
/// which implementation serves a call.
pub trait WeightStore: std::fmt::Debug + Send + Sync {
    /// Embedding rows of `tokens` (widened to f32) into `out` `[n_tok, hidden]`.
    ///
    /// # Errors
    /// A read failed.
    fn embed_into(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), StreamError>;

    /// Layer `il`'s non-expert weights (a MoE layer's routed experts come through
    /// [`WeightStore::moe_into`]).
    ///
    /// # Errors
    /// A read failed.
    fn layer(&self, il: usize) -> Result<Arc<Layer>, StreamError>;

    /// Layer `il`'s MoE block `w` over `x` `[n_tok, hidden]` into `out`, with the buffers of
    /// `sc` (where the routing is left, [`MoeScratch::routing`]). `early` is the input of an
    /// early prediction of the next layer's experts, when [`WeightStore::begin_moe`] asked
    /// for one.
    ///
    /// # Errors
    /// A read of a routed expert failed.
    #[allow(clippy::too_many_arguments)]
    fn moe_into(
        &self,
        il: usize,
        w: &MoeWeights,
        p: &MoeParams,
        x: &[f32],
        sc: &mut MoeScratch,
        out: &mut [f32],
        early: Option<&[f32]>,
    ) -> Result<(), StreamError>;

    /// Logits of `rows` `[n, hidden]` into `logits` `[n, vocab]`.
    ///
    /// # Errors
    /// A read of the output head failed.
    fn head_into(&self, rows: &[f32], logits: &mut [f32]) -> Result<(), StreamError>;

    /// A pass of `n_tok` tokens reaches MoE layer `il`. Returns the next MoE layer when the
    /// store wants an early prediction of its experts: the caller then forms that layer's
    /// FFN input as it would be without this layer's FFN and passes it as `early` to
    /// [`WeightStore::moe_into`]. A store that reads nothing ahead returns None.
    fn begin_moe(&self, _il: usize, _n_tok: usize) -> Option<Arc<Layer>> {
        None
    }

    /// MoE layer `j`'s weights when a prediction of its experts from the previous layer's
    /// output is wanted (the store reads ahead, and the layer is at hand).
    fn prediction_target(&self, _j: usize) -> Option<Arc<Layer>> {
        None
    }

    /// How many of a pass's leading `n_tok` tokens such a prediction is made for.
    fn prediction_rows(&self, n_tok: usize) -> usize {
        n_tok
    }

    /// Layer `j`'s experts are predicted from `x` (its FFN input as it would be without its
    /// attention, for the pass's leading [`WeightStore::prediction_rows`] of `n_tok` tokens):
    /// read them ahead. Only a prefetch: the layer still asks for what its routing picks.
    fn prefetch_next(&self, _j: usize, _next: &Layer, _x: &[f32], _n_tok: usize) {}

    /// The engine's figures now (plan, bytes read, expert-cache residency, predictions).
    fn stats(&self) -> StatsSnapshot;

    /// The model's byte sizes and the plan in force, when the store serves under a plan that
    /// [`WeightStore::set_plan`] can change; None for a fully resident model.
    fn planned(&self) -> Option<(&ModelSizes, Plan)> {
        None
    }

    /// Apply a new plan between forward passes. The next tokens are those an unchanged run
    /// produces.
    ///
    /// # Errors
    /// The store holds the whole model and has no plan to change, or reading what the new
    /// plan pins failed.
    fn set_plan(&self, _plan: Plan) -> Result<(), StreamError> {
        Err(StreamError::Unrepresentable {
            path: std::path::PathBuf::new(),
            name: "the memory plan".into(),
            reason: "the model was opened fully resident and has no plan to change".into(),
        })
    }

    /// The checkpoint weights are read from while running (None when everything was read at
    /// open).
    fn checkpoint(&self) -> Option<&Checkpoint> {
        None
    }

    /// The packed trunk streamed layers are read from, if any.
    fn trunk(&self) -> Option<&Trunk> {
        None
    }

    /// The store as `Any`, so a caller that knows an implementation (the `Streamer`'s knobs
    /// in tests and tuning) can reach it without this interface naming it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Every weight in memory: read (or mapped) when the model was opened.
#[derive(Debug)]
pub struct ResidentWeights {
    /// `[vocab, hidden]`.
    pub embed: Dense,
    /// Decoder layers, routed experts included.
    pub layers: Vec<Arc<Layer>>,
    /// `[vocab, hidden]`.
    pub lm_head: Dense,
    /// Per layer: whether it is dense, and its routed expert count (for the stats).
    experts_per_layer: Vec<u32>,
    /// Bytes of weights in the checkpoint (all of them resident and read once).
    model_bytes: u64,
}

impl ResidentWeights {
    /// The whole model, bound; `model_bytes` is what it holds (and what opening it read).
    #[must_use]
    pub fn new(
        cfg: &ModelConfig,
        embed: Dense,
        layers: Vec<Arc<Layer>>,
        lm_head: Dense,
        model_bytes: u64,
    ) -> Self {
        let experts_per_layer = (0..cfg.num_hidden_layers)
            .map(|il| {
                if cfg.is_dense(il) {
                    0
                } else {
                    cfg.num_experts as u32
                }
            })
            .collect();
        ResidentWeights {
            embed,
            layers,
            lm_head,
            experts_per_layer,
            model_bytes,
        }
    }
}

impl WeightStore for ResidentWeights {
    fn embed_into(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), StreamError> {
        let d = self.embed.cols;
        for (row, &id) in out.chunks_mut(d).zip(tokens) {
            self.embed.row_into(id as usize, row);
        }
        Ok(())
    }

    fn layer(&self, il: usize) -> Result<Arc<Layer>, StreamError> {
        Ok(Arc::clone(&self.layers[il]))
    }

    fn moe_into(
        &self,
        _il: usize,
        w: &MoeWeights,
        p: &MoeParams,
        x: &[f32],
        sc: &mut MoeScratch,
        out: &mut [f32],
        _early: Option<&[f32]>,
    ) -> Result<(), StreamError> {
        moe::forward_into(w, p, x, sc, out);
        Ok(())
    }

    fn head_into(&self, rows: &[f32], logits: &mut [f32]) -> Result<(), StreamError> {
        let h = &self.lm_head;
        h.apply_into(rows, logits);
        Ok(())
    }

    /// The whole model is resident: every layer is pinned and every expert lookup is a hit.
    fn stats(&self) -> StatsSnapshot {
        let layers = self
            .experts_per_layer
            .iter()
            .map(|&e| LayerResidency {
                trunk: Residency::Pinned,
                experts_resident: e,
                experts_total: e,
            })
            .collect();
        StatsSnapshot {
            model_bytes: self.model_bytes,
            disk_bytes_read: self.model_bytes,
            layers,
            ..StatsSnapshot::default()
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
