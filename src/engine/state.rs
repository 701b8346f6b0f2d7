//! Per-sequence state carried between tokens and chat turns (docs/model.md#per-sequence-state): the KDA recurrent
//! matrices and conv windows, the MLA latent cache, and the count of processed positions.
//! A plain value: clone it to snapshot, assign it back to restore.

use super::config::ModelConfig;
use super::kda::KdaState;
use super::layer::{kda_params, mla_params};

/// Carried state of one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// A KDA layer's recurrent matrices and conv windows.
    Kda(KdaState),
    /// An MLA layer's latent cache `[n_pos, kv_lora + rope]`.
    Mla(Vec<f32>),
}

/// Everything a sequence carries from one forward call to the next.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    /// Positions already processed.
    pub n_pos: usize,
    /// One entry per decoder layer.
    pub layers: Vec<LayerState>,
}

impl SeqState {
    /// The state of an empty sequence.
    #[must_use]
    pub fn new(cfg: &ModelConfig) -> Self {
        let kp = kda_params(cfg);
        let layers = cfg
            .is_mla
            .iter()
            .map(|&m| {
                if m {
                    LayerState::Mla(Vec::new())
                } else {
                    LayerState::Kda(KdaState::new(&kp))
                }
            })
            .collect();
        SeqState { n_pos: 0, layers }
    }

    /// Make room in the MLA latent caches for `positions` positions in all, so that decoding
    /// up to there never reallocates a cache (a clone still holds only what is used).
    pub fn reserve(&mut self, positions: usize, cfg: &ModelConfig) {
        let cw = mla_params(cfg).cache_width();
        for l in &mut self.layers {
            if let LayerState::Mla(c) = l {
                c.reserve(positions.saturating_mul(cw).saturating_sub(c.len()));
            }
        }
    }

    /// Floats the MLA latent cache holds per position and MLA layer.
    #[must_use]
    pub fn mla_floats_per_position(cfg: &ModelConfig) -> usize {
        mla_params(cfg).cache_width()
    }

    /// Bytes held by the carried state.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(k) => 4 * (k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>()),
                LayerState::Mla(c) => 4 * c.len(),
            })
            .sum()
    }
}

/// The state after a prefix of ids, with the logits that follow it: what a chat keeps to
/// restart from when a later prompt shares that prefix (KDA state cannot be rolled back).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The ids the state covers (`state.n_pos` of them).
    pub tokens: Vec<u32>,
    /// The state after them.
    pub state: SeqState,
    /// The logits after the last of them.
    pub logits: Vec<f32>,
}
