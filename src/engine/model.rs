//! The Kimi K3 decoder: embedding, 93 (or any configured number of) layers of attention
//! residuals + KDA/MLA + dense MLP/latent MoE, the output aggregator, final norm and lm_head
//! (docs/model.md#forward-pass).
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
use super::moe::Routing;
use super::residency::Streamer;
use super::run_state::RunState;
use super::state::{LayerState, SeqState};
use super::store::WeightStore;
use super::tensor::fit;
use crate::kernels::ops;
use crate::kernels::warm::warm;
use crate::stream::stats::StatsSnapshot;
use crate::stream::StreamError;

/// A loaded model (share it between sequences; the memory plan can change between calls).
#[derive(Debug)]
pub struct Model {
    /// Configuration.
    pub cfg: ModelConfig,
    /// `[hidden]` output AttnRes score vector.
    pub out_res_fold: Vec<f32>,
    /// `[hidden]` final norm gain.
    pub norm: Vec<f32>,
    /// The large weights, from wherever the store keeps them.
    pub weights: Box<dyn WeightStore>,
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

impl Logits {
    /// What chunk `i` of a prompt fed in `n_chunks` chunks asks for: the last position's
    /// logits for the last chunk, whose distribution is sampled, and none before it.
    #[must_use]
    pub fn for_chunk(i: usize, n_chunks: usize) -> Logits {
        if i + 1 == n_chunks {
            Logits::Last
        } else {
            Logits::None
        }
    }
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

/// What [`Model::forward_verify`] kept to cut its chunk back ([`Model::roll_back`]). One
/// kept by the caller is refilled in place by each verification pass.
#[derive(Debug, Default)]
pub struct Rollback {
    /// Positions before the chunk.
    base: usize,
    /// Positions in the chunk.
    len: usize,
    /// Per layer: the KDA record (None for MLA layers).
    records: Vec<Option<kda::KdaRecord>>,
    /// What the replay computes in.
    scratch: kda::ReplayScratch,
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

/// Mix the block snapshots `blocks` (`n_blocks` of `n` floats each) and the partial sum (when
/// there is one, `n` floats) into `out`, for its `out.len() / d` leading tokens, scoring with
/// `fold`.
#[allow(clippy::too_many_arguments)]
fn mix_into(
    blocks: &[f32],
    n: usize,
    n_blocks: usize,
    partial: Option<&[f32]>,
    fold: &[f32],
    eps: f32,
    d: usize,
    out: &mut [f32],
    k: &mut Vec<f32>,
    a: &mut Vec<f32>,
) {
    mix_from_into(blocks, n, 0, n_blocks, partial, fold, eps, d, out, k, a);
}

/// [`mix_into`] for the `out.len() / d` tokens from float `from` of each source on.
#[allow(clippy::too_many_arguments)]
fn mix_from_into(
    blocks: &[f32],
    n: usize,
    from: usize,
    n_blocks: usize,
    partial: Option<&[f32]>,
    fold: &[f32],
    eps: f32,
    d: usize,
    out: &mut [f32],
    k: &mut Vec<f32>,
    a: &mut Vec<f32>,
) {
    let n_src = n_blocks + usize::from(partial.is_some());
    let last = partial.map_or(&[][..], |p| &p[from..]);
    let source = |i: usize| {
        if i < n_blocks {
            &blocks[i * n + from..(i + 1) * n]
        } else {
            last
        }
    };
    attnres::aggregate_with(n_src, source, fold, eps, d, out, fit(k, d), fit(a, n_src));
}

/// Queue reads of the experts MoE layer `j` will most likely route to, predicted from its FFN
/// input as it would be without its attention (the AttnRes mix of the residual stream after
/// layer `j - 1`, normalised), when `j`'s weights are at hand: for a decoding step's token, or
/// for the leading tokens of a multi-token pass (a prefill chunk, a speculative verification),
/// whose reads then run during `j`'s attention. The mix is written into `run.h` (and, at a
/// block boundary, the snapshot `j` is about to take into `run.blocks`), both of which `j`
/// overwrites with the same values or its own before reading them, so nothing computed
/// changes. `finish` is what `j` computes after its attention: for the last token only, the
/// prediction is made for that token, and for none, no prediction is made.
fn predict_next(
    j: usize,
    cfg: &ModelConfig,
    run: &mut RunState,
    st: &dyn WeightStore,
    finish: Finish,
) {
    if finish == Finish::None {
        return;
    }
    let Some(next) = st.prediction_target(j) else {
        return;
    };
    let d = cfg.hidden_size;
    let RunState {
        len,
        blocks,
        n_blocks,
        partial,
        has_partial,
        h,
        mix_k,
        mix_a,
        ..
    } = run;
    let n = *len;
    if n == 0 || n % d != 0 || !*has_partial {
        return;
    }
    // The tokens the prediction is made for (the leading ones, or the last): the mix of the
    // others is not needed.
    let (rows, from, n_tok) = match finish {
        Finish::Last => (1, n - d, 1),
        _ => (st.prediction_rows(n / d), 0, n / d),
    };
    let (h, partial) = (&mut h[..rows * d], &partial[..n]);
    let nb = *n_blocks;
    let (n_src, last) = if cfg.is_block_start(j) {
        // `j` snapshots the partial sum as a block and has no partial sum until its attention.
        fit(blocks, (nb + 1) * n)[nb * n..].copy_from_slice(partial);
        (nb + 1, None)
    } else {
        (nb, Some(partial))
    };
    let eps = cfg.rms_norm_eps;
    mix_from_into(
        blocks,
        n,
        from,
        n_src,
        last,
        &next.mlp_res_fold,
        eps,
        d,
        h,
        mix_k,
        mix_a,
    );
    for row in h.chunks_mut(d) {
        ops::rmsnorm(row, &next.post_norm, eps);
    }
    st.prefetch_next(j, &next, h, n_tok);
}

/// What a layer computes after its attention. Nothing crosses positions there (docs/model.md#attention-residuals,
/// docs/model.md#prefill-and-decode), and the carried state is complete once the attention has run, so the last
/// layer of a pass finishes only the positions whose logits are asked for: its experts are
/// then read for those positions alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// Every position (any layer but the last, or logits for every position, or a trace).
    All,
    /// The last position only.
    Last,
    /// No position (no logits are asked for).
    None,
}

/// Keep only the last of the `n / d` positions of the residual stream: each of the
/// `n_blocks` snapshots (`n` floats apart) and the partial sum is cut down to its last row,
/// `d` floats apart.
fn keep_last_row(blocks: &mut [f32], n_blocks: usize, partial: &mut [f32], n: usize, d: usize) {
    // Each row moves down (b * d <= b * n + n - d), past the rows already moved and below
    // those still to move.
    for b in 0..n_blocks {
        blocks.copy_within(b * n + n - d..(b + 1) * n, b * d);
    }
    partial.copy_within(n - d..n, 0);
}

impl Layer {
    /// One decoder layer (docs/model.md#decoder-layer) over a chunk, on the residual stream kept in `run`:
    /// its partial sum is the previous layer's (the embedding at layer 0). Returns the routing
    /// decisions when `want_routing` and the layer routes. After its attention it computes
    /// the positions `finish` names; the residual stream in `run` is then cut down to them.
    ///
    /// Over 100 lines: AttnRes, mixer, AttnRes and feed-forward in the order that fixes the
    /// bits, over one shared run state.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        il: usize,
        cfg: &ModelConfig,
        run: &mut RunState,
        state: LayerStates<'_, '_>,
        weights: &dyn WeightStore,
        record: Option<&mut Option<kda::KdaRecord>>,
        want_routing: bool,
        finish: Finish,
    ) -> Result<Option<Routing>, StreamError> {
        let d = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let RunState {
            len,
            blocks,
            n_blocks,
            partial: partial_buf,
            has_partial,
            h: h_buf,
            branch: branch_buf,
            early: early_buf,
            mix_k,
            mix_a,
            kda: kda_sc,
            mla: mla_sc,
            moe: moe_sc,
            ..
        } = run;
        let mut n = *len;
        let (h, partial) = (&mut h_buf[..n], &mut partial_buf[..n]);
        let branch = fit(branch_buf, n);
        // 1–3: pre-attention mix (skipped while no snapshot exists), then the block boundary.
        if *n_blocks == 0 {
            h.copy_from_slice(partial);
        } else {
            let fold = &self.attn_res_fold;
            mix_into(
                blocks,
                n,
                *n_blocks,
                Some(partial),
                fold,
                eps,
                d,
                h,
                mix_k,
                mix_a,
            );
        }
        if cfg.is_block_start(il) {
            let nb = *n_blocks;
            fit(blocks, (nb + 1) * n)[nb * n..].copy_from_slice(partial);
            *n_blocks += 1;
            *has_partial = false;
        }
        // 4–6: attention on the normalised mix, added to the partial sum.
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.input_norm, eps);
        }
        match (&self.attn, state) {
            (Attention::Kda(w), LayerStates::One(LayerState::Kda(s))) => {
                kda::forward_into(w, &kda_params(cfg), h, s, record, kda_sc, branch);
            }
            (Attention::Mla(w), LayerStates::One(LayerState::Mla(c))) => {
                mla::forward_into(w, &mla_params(cfg), h, c, mla_sc, branch);
            }
            (Attention::Kda(w), LayerStates::Rows(seqs)) => {
                let states = seqs.iter_mut().map(|s| match &mut s.layers[il] {
                    LayerState::Kda(k) => k,
                    LayerState::Mla(_) => {
                        unreachable!("layer state kind is built from the same layer map")
                    }
                });
                kda::forward_rows_into(w, &kda_params(cfg), h, states, kda_sc, branch);
            }
            (Attention::Mla(w), LayerStates::Rows(seqs)) => {
                let caches = seqs.iter_mut().map(|s| match &mut s.layers[il] {
                    LayerState::Mla(c) => c,
                    LayerState::Kda(_) => {
                        unreachable!("layer state kind is built from the same layer map")
                    }
                });
                mla::forward_rows_into(w, &mla_params(cfg), h, caches, mla_sc, branch);
            }
            _ => unreachable!("layer state kind is built from the same layer map"),
        }
        add(partial, has_partial, branch);
        match finish {
            Finish::All => {}
            Finish::None => return Ok(None),
            Finish::Last => {
                if n > d {
                    keep_last_row(blocks, *n_blocks, partial, n, d);
                    n = d;
                    *len = n;
                }
            }
        }
        let (h, partial) = (&mut h_buf[..n], &mut partial_buf[..n]);
        let branch = fit(branch_buf, n);
        // 7–10: pre-FFN mix (always), FFN, added to the partial sum.
        mix_into(
            blocks,
            n,
            *n_blocks,
            Some(partial),
            &self.mlp_res_fold,
            eps,
            d,
            h,
            mix_k,
            mix_a,
        );
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.post_norm, eps);
        }
        let routing = match &self.ffn {
            FeedForward::Dense(m) => {
                m.forward_into(h, cfg.situ_beta, cfg.situ_linear_beta, moe_sc, branch);
                None
            }
            FeedForward::Moe(m) => {
                let p = moe_params(cfg);
                let early = weights.begin_moe(il, n / d).map(|next| {
                    // The next layer's FFN input but for this layer's FFN and its own
                    // attention: the mix of the stream after this attention (as at a block
                    // boundary, where the snapshot is this partial sum).
                    let x = fit(early_buf, d);
                    let last = (*has_partial).then_some(&partial[..]);
                    let fold = &next.mlp_res_fold;
                    mix_into(blocks, n, *n_blocks, last, fold, eps, d, x, mix_k, mix_a);
                    ops::rmsnorm(x, &next.post_norm, eps);
                    &early_buf[..d]
                });
                weights.moe_into(il, m, &p, h, moe_sc, branch, early)?;
                want_routing.then(|| moe_sc.routing())
            }
        };
        add(partial, has_partial, branch);
        Ok(routing)
    }
}

/// The sequences a forward pass advances: one (a chunk of its positions), or several with one
/// position each (a batched decoding step).
enum Seqs<'a, 'b> {
    /// One sequence.
    One(&'a mut SeqState),
    /// Row `t` of the pass is the next position of the `t`-th sequence.
    Rows(&'a mut [&'b mut SeqState]),
}

/// The carried state a layer's attention runs on ([`Seqs`] at one layer).
enum LayerStates<'a, 'b> {
    /// The layer's state of one sequence.
    One(&'a mut LayerState),
    /// Every sequence, one row each (the layer picks its own state out of each).
    Rows(&'a mut [&'b mut SeqState]),
}

/// Add a block's output to the partial sum (which it becomes, bit for bit, when there is
/// none).
fn add(partial: &mut [f32], has_partial: &mut bool, x: &[f32]) {
    if *has_partial {
        for (p, v) in partial.iter_mut().zip(x) {
            *p += v;
        }
    } else {
        partial.copy_from_slice(x);
        *has_partial = true;
    }
}

impl Model {
    /// Run `tokens` through the model on top of `state` (which is advanced) and return the
    /// logits asked for, `[n, vocab]` row-major.
    ///
    /// # Panics
    /// If a token id is not below the vocabulary size (callers validate ids first).
    ///
    /// Over 100 lines: the layer loop in the order that fixes the bits (embed, per layer
    /// AttnRes, mixer, AttnRes, feed-forward with its prediction hooks, then the head).
    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, StreamError> {
        self.forward_traced(state, tokens, want, None)
    }

    /// [`Model::forward`] with the buffers of `run`, kept by the caller between calls: the
    /// logits are written into `run` and borrowed from it. A decoding step after the first
    /// allocates nothing when the weights are resident.
    ///
    /// # Panics
    /// If a token id is not below the vocabulary size (callers validate ids first).
    pub fn forward_run<'r>(
        &self,
        state: &mut SeqState,
        run: &'r mut RunState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<&'r [f32], StreamError> {
        self.forward_impl(Seqs::One(state), run, tokens, want, None, None)?;
        Ok(run.logits())
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
        let mut run = RunState::new();
        self.forward_impl(Seqs::One(state), &mut run, tokens, want, trace, None)?;
        Ok(take_logits(run))
    }

    /// One decoding step of several sequences in one pass over the weights: `tokens[t]` is the
    /// next token of `seqs[t]` (each advanced by one position), and the logits after it are
    /// row `t` of the `[n, vocab]` result, written into `run` and borrowed from it. Each
    /// layer's matrices are applied to every row in one product and each routed expert to the
    /// rows routed to it, so the weights are read once for all the sequences; attention runs
    /// per row on that sequence's own state. Every row is bitwise what [`Model::forward_run`]
    /// gives that sequence alone (docs/batching.md). Sequences may be at any positions.
    ///
    /// # Errors
    /// A weight read failed; the states may be partly advanced (restore snapshots to retry).
    ///
    /// # Panics
    /// If `tokens` and `seqs` differ in length, or a token id is not below the vocabulary size.
    pub fn forward_batch<'r>(
        &self,
        seqs: &mut [&mut SeqState],
        run: &'r mut RunState,
        tokens: &[u32],
    ) -> Result<&'r [f32], StreamError> {
        assert_eq!(seqs.len(), tokens.len(), "one token per sequence");
        self.forward_impl(Seqs::Rows(seqs), run, tokens, Logits::All, None, None)?;
        Ok(run.logits())
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
        let mut run = RunState::new();
        let mut rollback = Rollback::default();
        self.forward_verify_run(state, &mut run, tokens, &mut rollback)?;
        Ok((take_logits(run), rollback))
    }

    /// [`Model::forward_verify`] with buffers kept by the caller: the logits of every position
    /// are written into `run` and borrowed from it, and `rollback` is refilled in place. A
    /// pass after one at least as long allocates nothing when the weights are resident.
    ///
    /// # Errors
    /// A weight read failed; `state` may be partly advanced and `rollback` is empty.
    pub fn forward_verify_run<'r>(
        &self,
        state: &mut SeqState,
        run: &'r mut RunState,
        tokens: &[u32],
        rollback: &mut Rollback,
    ) -> Result<&'r [f32], StreamError> {
        rollback.base = state.n_pos;
        rollback.len = 0;
        rollback.records.resize_with(state.layers.len(), || None);
        self.forward_impl(
            Seqs::One(state),
            run,
            tokens,
            Logits::All,
            None,
            Some(&mut rollback.records),
        )?;
        rollback.len = tokens.len();
        Ok(run.logits())
    }

    /// The forward pass, run on a thread of the rayon pool (the caller's, or the global one):
    /// the kernels' parallel loops then start from inside the pool, which hands them out
    /// without allocating, where a call from outside queues each one through the pool's
    /// shared queue.
    fn forward_impl(
        &self,
        state: Seqs<'_, '_>,
        run: &mut RunState,
        tokens: &[u32],
        want: Logits,
        trace: Option<&mut Trace>,
        records: Option<&mut Vec<Option<kda::KdaRecord>>>,
    ) -> Result<(), StreamError> {
        rayon::scope(|_| self.forward_chunk(state, run, tokens, want, trace, records))
    }

    /// Over 100 lines: one chunk through every layer, in the order that fixes the bits.
    fn forward_chunk(
        &self,
        mut seqs: Seqs<'_, '_>,
        run: &mut RunState,
        tokens: &[u32],
        want: Logits,
        mut trace: Option<&mut Trace>,
        mut records: Option<&mut Vec<Option<kda::KdaRecord>>>,
    ) -> Result<(), StreamError> {
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let n_tok = tokens.len();
        run.n_logits = 0;
        if n_tok == 0 {
            return Ok(());
        }
        for &id in tokens {
            assert!(
                (id as usize) < cfg.vocab_size,
                "token id {id} outside the vocabulary"
            );
        }
        let n = n_tok * d;
        run.len = n;
        fit(&mut run.h, n);
        // Room for every block snapshot of the chunk at once, so that taking one never
        // regrows the buffer (a regrowth holds the old and the new copy for a moment).
        fit(&mut run.blocks, cfg.block_starts() * n);
        self.weights.embed_into(tokens, fit(&mut run.partial, n))?;
        run.has_partial = true;
        run.n_blocks = 0;
        let want_routing = trace.is_some();
        // The last layer finishes only the positions whose logits are asked for (all of them
        // for a trace, which records every position's output).
        let finish = match want {
            _ if trace.is_some() => Finish::All,
            Logits::All => Finish::All,
            Logits::Last => Finish::Last,
            Logits::None => Finish::None,
        };
        let n_layers = match &seqs {
            Seqs::One(s) => s.layers.len(),
            Seqs::Rows(r) => {
                assert_eq!(r.len(), n_tok, "one token per sequence");
                let n = r.first().map_or(0, |s| s.layers.len());
                assert!(
                    r.iter().all(|s| s.layers.len() == n),
                    "sequences of one model"
                );
                n
            }
        };
        let finish_of = |il: usize| {
            if il + 1 == n_layers {
                finish
            } else {
                Finish::All
            }
        };
        for il in 0..n_layers {
            let ls = match &mut seqs {
                Seqs::One(s) => LayerStates::One(&mut s.layers[il]),
                Seqs::Rows(r) => LayerStates::Rows(r),
            };
            let layer = self.weights.layer(il)?;
            let record = records.as_deref_mut().map(|r| &mut r[il]);
            let routing = warm(|| {
                layer.forward(
                    il,
                    cfg,
                    run,
                    ls,
                    &*self.weights,
                    record,
                    want_routing,
                    finish_of(il),
                )
            })?;
            drop(layer);
            predict_next(il + 1, cfg, run, &*self.weights, finish_of(il + 1));
            if let Some(t) = trace.as_deref_mut() {
                t.layer_out.push(run.partial[..n].to_vec());
                t.routing.push(routing.unwrap_or_default());
            }
        }
        match seqs {
            Seqs::One(s) => s.n_pos += n_tok,
            Seqs::Rows(r) => r.iter_mut().for_each(|s| s.n_pos += 1),
        }
        if finish == Finish::None {
            return Ok(());
        }
        // The positions the last layer finished.
        let n = run.len;
        let eps = cfg.rms_norm_eps;
        let RunState {
            blocks,
            n_blocks,
            partial,
            has_partial,
            h,
            mix_k,
            mix_a,
            logits,
            n_logits,
            ..
        } = run;
        let h = &mut h[..n];
        let partial = has_partial.then_some(&partial[..n]);
        mix_into(
            blocks,
            n,
            *n_blocks,
            partial,
            &self.out_res_fold,
            eps,
            d,
            h,
            mix_k,
            mix_a,
        );
        for row in h.chunks_mut(d) {
            ops::rmsnorm(row, &self.norm, eps);
        }
        if let Some(t) = trace {
            t.final_hidden.clear();
            t.final_hidden.extend_from_slice(h);
        }
        let rows: &[f32] = match want {
            Logits::None => return Ok(()),
            Logits::Last => &h[n - d..],
            Logits::All => h,
        };
        let len = rows.len() / d * cfg.vocab_size;
        warm(|| self.weights.head_into(rows, fit(logits, len)))?;
        *n_logits = len;
        Ok(())
    }

    /// Leave `state`, given to [`Model::forward_verify`] with `rollback`'s chunk, after the
    /// chunk's first `keep` positions: MLA caches are truncated, KDA states advanced from the
    /// state before the chunk by replaying the recorded recurrence steps (no weight is read).
    /// Call it exactly once per verified chunk, also to keep all of it.
    ///
    /// # Panics
    /// If `keep` exceeds the chunk or `state` was not advanced by exactly that chunk.
    pub fn roll_back(&self, state: &mut SeqState, rollback: &mut Rollback, keep: usize) {
        assert!(keep <= rollback.len, "cannot keep more than the chunk");
        assert_eq!(
            state.n_pos,
            rollback.base + rollback.len,
            "state moved since"
        );
        let kp = kda_params(&self.cfg);
        let cw = mla_params(&self.cfg).cache_width();
        let base = rollback.base;
        let Rollback {
            records, scratch, ..
        } = rollback;
        // On a thread of the pool, as the forward pass runs, so the replay's parallel loops
        // start without queueing.
        rayon::scope(|_| {
            for (ls, rec) in state.layers.iter_mut().zip(records.iter()) {
                match (ls, rec) {
                    (LayerState::Mla(cache), _) => cache.truncate((base + keep) * cw),
                    (LayerState::Kda(s), Some(r)) => r.replay(&kp, keep, s, scratch),
                    (LayerState::Kda(_), None) => unreachable!("every KDA layer records"),
                }
            }
        });
        state.n_pos = base + keep;
    }

    /// The store the weights come from: the engine's figures, the plan in force.
    #[must_use]
    pub fn store(&self) -> &dyn WeightStore {
        &*self.weights
    }

    /// The engine's figures now (plan, bytes read, expert-cache residency, predictions).
    #[must_use]
    pub fn stats(&self) -> StatsSnapshot {
        self.weights.stats()
    }

    /// The streamer, when the model reads its weights under a memory plan: for the knobs
    /// only it has (prefetch depths, fault injection in tests).
    #[must_use]
    pub fn streamer(&self) -> Option<&Streamer> {
        self.weights.as_any().downcast_ref::<Streamer>()
    }
}

/// The logits a [`RunState`] holds, as an owned vector.
fn take_logits(mut run: RunState) -> Vec<f32> {
    let mut v = std::mem::take(&mut run.logits);
    v.truncate(run.n_logits);
    v
}
