//! The Kimi K3 decoder: embedding, 93 (or any configured number of) layers of attention
//! residuals + KDA/MLA + dense MLP/latent MoE, the output aggregator, final norm and lm_head
//! (MODEL.md §3).
//!
//! `forward` takes a chunk of token ids and the sequence state, and returns logits for the
//! positions asked for. Everything except the KDA recurrence, the short convolution and MLA
//! attention is per position, and each of those consumes positions in order, so prefilling a
//! chunk and decoding it one token at a time give bitwise identical logits.

use super::attnres;
use super::config::ModelConfig;
use super::kda;
pub use super::layer::{kda_params, mla_params, moe_params, Attention, FeedForward, Layer};
use super::mla;
use super::moe::{self, MoeParams, MoeWeights, Routing};
use super::residency::Streamer;
use super::state::{LayerState, SeqState};
use super::tensor::Dense;
use crate::kernels::{self, ops};
use crate::stream::StreamError;
use std::sync::Arc;

/// Where a model's large weights come from.
#[derive(Debug)]
pub enum Weights {
    /// Everything held in memory.
    Resident {
        /// `[vocab, hidden]`.
        embed: Dense,
        /// Decoder layers (experts included).
        layers: Vec<Arc<Layer>>,
        /// `[vocab, hidden]`.
        lm_head: Dense,
    },
    /// Read from the checkpoint under a memory plan (pinned layers, a read-ahead ring, an
    /// expert cache, streamed embedding rows and output head).
    Streamed(Box<Streamer>),
}

impl Weights {
    /// Embedding rows of `tokens`, `[n_tok, hidden]`.
    fn embed(&self, tokens: &[u32], d: usize) -> Result<Vec<f32>, StreamError> {
        match self {
            Weights::Resident { embed, .. } => {
                let mut x = vec![0f32; tokens.len() * d];
                for (row, &id) in x.chunks_mut(d).zip(tokens) {
                    embed.row_into(id as usize, row);
                }
                Ok(x)
            }
            Weights::Streamed(st) => st.embed_rows(tokens),
        }
    }

    /// Layer `il`'s non-expert weights.
    fn layer(&self, il: usize) -> Result<Arc<Layer>, StreamError> {
        match self {
            Weights::Resident { layers, .. } => Ok(Arc::clone(&layers[il])),
            Weights::Streamed(st) => st.layer(il),
        }
    }

    /// Layer `il`'s MoE block over `h`, with its routed experts from wherever they live.
    fn moe(
        &self,
        il: usize,
        m: &MoeWeights,
        p: &MoeParams,
        h: &[f32],
    ) -> Result<(Vec<f32>, Routing), StreamError> {
        match self {
            Weights::Resident { .. } => Ok(moe::forward(m, p, h)),
            Weights::Streamed(st) => st.moe(il, m, p, h),
        }
    }

    /// Logits of `rows` `[n, hidden]`, `[n, vocab]`.
    fn head(&self, rows: &[f32], vocab: usize, d: usize) -> Result<Vec<f32>, StreamError> {
        match self {
            Weights::Resident { lm_head, .. } => {
                let mut logits = vec![0f32; rows.len() / d * vocab];
                kernels::matmul(lm_head.view(), vocab, d, rows, &mut logits);
                Ok(logits)
            }
            Weights::Streamed(st) => st.head(rows),
        }
    }
}

/// A loaded model (share it between sequences; the memory plan can change between calls).
#[derive(Debug)]
pub struct Model {
    /// Configuration.
    pub cfg: ModelConfig,
    /// `[hidden]` output AttnRes score vector.
    pub out_res_fold: Vec<f32>,
    /// `[hidden]` final norm gain.
    pub norm: Vec<f32>,
    /// The large weights.
    pub weights: Weights,
}

/// Which positions of a chunk need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (decoding).
    Last,
    /// Every position (teacher forcing).
    All,
    /// None (prefill whose distribution is not needed).
    None,
}

/// Optional per-layer observations of one forward call.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Per layer, the returned partial sum `[n_tok, hidden]`.
    pub layer_out: Vec<Vec<f32>>,
    /// Per layer, the routing decisions (empty for dense layers).
    pub routing: Vec<Routing>,
    /// `[n_tok, hidden]` after the output aggregator and the final norm.
    pub final_hidden: Vec<f32>,
}

/// What [`Model::forward_verify`] kept to cut its chunk back ([`Model::roll_back`]).
#[derive(Debug)]
pub struct Rollback {
    /// Positions before the chunk.
    base: usize,
    /// Positions in the chunk.
    len: usize,
    /// Per layer: the KDA record (None for MLA layers).
    records: Vec<Option<kda::KdaRecord>>,
}

impl Rollback {
    /// Positions in the chunk.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chunk was empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Per-chunk AttnRes bookkeeping: block snapshots and the running partial sum.
struct Residuals {
    blocks: Vec<Vec<f32>>,
    partial: Option<Vec<f32>>,
}

impl Residuals {
    fn mix(&self, fold: &[f32], eps: f32, d: usize, n: usize) -> Vec<f32> {
        let mut srcs: Vec<&[f32]> = self.blocks.iter().map(Vec::as_slice).collect();
        if let Some(p) = &self.partial {
            srcs.push(p);
        }
        let mut out = vec![0f32; n];
        attnres::aggregate(&srcs, fold, eps, d, &mut out);
        out
    }

    fn add(&mut self, a: Vec<f32>) {
        match &mut self.partial {
            None => self.partial = Some(a),
            Some(p) => {
                for (x, y) in p.iter_mut().zip(&a) {
                    *x += y;
                }
            }
        }
    }
}

impl Layer {
    /// One decoder layer (MODEL.md §3.3) over a chunk. `h` is the previous layer's returned
    /// partial sum (the embedding at layer 0).
    fn forward(
        &self,
        il: usize,
        cfg: &ModelConfig,
        res: &mut Residuals,
        state: &mut LayerState,
        weights: &Weights,
        record: Option<&mut Option<kda::KdaRecord>>,
    ) -> Result<Option<Routing>, StreamError> {
        let d = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let p_in = res.partial.take().unwrap_or_default();
        let n = p_in.len();
        // 1–3: pre-attention mix (skipped while no snapshot exists), then the block boundary.
        let mut h = if res.blocks.is_empty() {
            p_in.clone()
        } else {
            res.partial = Some(p_in.clone());
            let mixed = res.mix(&self.attn_res_fold, eps, d, n);
            res.partial = None;
            mixed
        };
        if cfg.is_block_start(il) {
            res.blocks.push(p_in);
            res.partial = None;
        } else {
            res.partial = Some(p_in);
        }
        // 4–6: attention on the normalised mix, added to the partial sum.
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.input_norm, eps);
        }
        let a = match (&self.attn, state) {
            (Attention::Kda(w), LayerState::Kda(s)) => {
                kda::forward_recorded(w, &kda_params(cfg), &h, s, record)
            }
            (Attention::Mla(w), LayerState::Mla(c)) => mla::forward(w, &mla_params(cfg), &h, c),
            _ => unreachable!("layer state kind is built from the same layer map"),
        };
        res.add(a);
        // 7–10: pre-FFN mix (always), FFN, added to the partial sum.
        let mut h = res.mix(&self.mlp_res_fold, eps, d, n);
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.post_norm, eps);
        }
        let (f, routing) = match &self.ffn {
            FeedForward::Dense(m) => (m.forward(&h, cfg.situ_beta, cfg.situ_linear_beta), None),
            FeedForward::Moe(m) => {
                let (y, r) = weights.moe(il, m, &moe_params(cfg), &h)?;
                (y, Some(r))
            }
        };
        res.add(f);
        Ok(routing)
    }
}

impl Model {
    /// Run `tokens` through the model on top of `state` (which is advanced) and return the
    /// logits asked for, `[n, vocab]` row-major.
    ///
    /// # Panics
    /// If a token id is not below the vocabulary size (callers validate ids first).
    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, StreamError> {
        self.forward_traced(state, tokens, want, None)
    }

    /// [`Model::forward`] that also records per-layer outputs and routing into `trace`.
    ///
    /// A read failure leaves `state` untouched only up to the failing layer: callers restore a
    /// snapshot (the session does) before retrying.
    pub fn forward_traced(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, StreamError> {
        self.forward_impl(state, tokens, want, trace, None)
    }

    /// Run a chunk that may be only partly kept (speculative verification): the logits of
    /// every position, and a [`Rollback`] with which [`Model::roll_back`] then leaves `state`
    /// after any prefix of the chunk without reading a weight — bit for bit the state a
    /// forward pass over only that prefix would have left. Until then `state` is between the
    /// two (MLA caches hold the whole chunk, KDA states none of it) and must not be used.
    pub fn forward_verify(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
    ) -> Result<(Vec<f32>, Rollback), StreamError> {
        let base = state.n_pos;
        let mut records: Vec<Option<kda::KdaRecord>> = vec![None; state.layers.len()];
        let logits = self.forward_impl(state, tokens, Logits::All, None, Some(&mut records))?;
        Ok((
            logits,
            Rollback {
                base,
                len: tokens.len(),
                records,
            },
        ))
    }

    fn forward_impl(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        mut trace: Option<&mut Trace>,
        mut records: Option<&mut Vec<Option<kda::KdaRecord>>>,
    ) -> Result<Vec<f32>, StreamError> {
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let n_tok = tokens.len();
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        for &id in tokens {
            assert!(
                (id as usize) < cfg.vocab_size,
                "token id {id} outside the vocabulary"
            );
        }
        let x = self.weights.embed(tokens, d)?;
        let mut res = Residuals {
            blocks: Vec::new(),
            partial: Some(x),
        };
        for (il, ls) in state.layers.iter_mut().enumerate() {
            let layer = self.weights.layer(il)?;
            let record = records.as_deref_mut().map(|r| &mut r[il]);
            let routing = layer.forward(il, cfg, &mut res, ls, &self.weights, record)?;
            drop(layer);
            if let Some(t) = trace.as_deref_mut() {
                t.layer_out.push(res.partial.clone().unwrap_or_default());
                t.routing.push(routing.unwrap_or_default());
            }
        }
        state.n_pos += n_tok;
        let mut h = res.mix(&self.out_res_fold, cfg.rms_norm_eps, d, n_tok * d);
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.norm, cfg.rms_norm_eps);
        }
        if let Some(t) = trace {
            t.final_hidden.clone_from(&h);
        }
        let rows: &[f32] = match want {
            Logits::None => return Ok(Vec::new()),
            Logits::Last => &h[(n_tok - 1) * d..],
            Logits::All => &h,
        };
        self.weights.head(rows, cfg.vocab_size, d)
    }

    /// Leave `state`, given to [`Model::forward_verify`] with `rollback`'s chunk, after the
    /// chunk's first `keep` positions: MLA caches are truncated, KDA states advanced from the
    /// state before the chunk by replaying the recorded recurrence steps (no weight is read).
    /// Call it exactly once per verified chunk, also to keep all of it.
    ///
    /// # Panics
    /// If `keep` exceeds the chunk or `state` was not advanced by exactly that chunk.
    pub fn roll_back(&self, state: &mut SeqState, rollback: &Rollback, keep: usize) {
        assert!(keep <= rollback.len, "cannot keep more than the chunk");
        assert_eq!(
            state.n_pos,
            rollback.base + rollback.len,
            "state moved since"
        );
        let kp = kda_params(&self.cfg);
        let cw = mla_params(&self.cfg).cache_width();
        for (ls, rec) in state.layers.iter_mut().zip(&rollback.records) {
            match (ls, rec) {
                (LayerState::Mla(cache), _) => cache.truncate((rollback.base + keep) * cw),
                (LayerState::Kda(s), Some(r)) => r.replay(&kp, keep, s),
                (LayerState::Kda(_), None) => unreachable!("every KDA layer records"),
            }
        }
        state.n_pos = rollback.base + keep;
    }

    /// The streamer, when the model reads its weights under a memory plan.
    #[must_use]
    pub fn streamer(&self) -> Option<&Streamer> {
        match &self.weights {
            Weights::Streamed(s) => Some(s),
            Weights::Resident { .. } => None,
        }
    }
}
