//! Weights under a memory plan: pinned layers stay in memory, the others pass through a
//! read-ahead ring fed by a reader thread, routed experts live in a fixed number of cache slots
//! and are read in parallel as soon as a layer's routing is known, embedding rows are read on
//! demand and the output head is streamed in chunks when it is not pinned.
//!
//! Only *where bytes come from* depends on the plan: every product is computed by the same
//! kernels in the same order as for a resident model, so tokens and logits are bitwise
//! identical at every budget. A failed read fails the step with an error; an expert is never
//! skipped.

mod cache;
mod expert_io;
mod expert_reads;
mod layers;
mod leaf;
mod prefetch;

use self::cache::{Arrival, Counters, ExpertCache, Mailbox, Resident, Source};
use self::expert_io::ExpertTable;
use self::expert_reads::{ExpertRead, ExpertReaders, ReadSource};
use self::layers::{load_layer, LayerResult, LayerRing, LayerTable};
use self::leaf::Leaf;
use self::prefetch::{eager_ranks, score_by_rank, Prefetcher};
use super::bind::names;
use super::config::ModelConfig;
use super::layer::{FeedForward, Layer};
use super::moe::{self, Expert, MoeParams, MoeScratch, MoeWeights};
use super::store::WeightStore;
use super::tensor::{fit, Dense, DenseData};
use crate::kernels;
use crate::stream::arena::Arena;
use crate::stream::budget::{self, ModelSizes, Plan};
use crate::stream::checkpoint::io_pool;
use crate::stream::index::TensorInfo;
use crate::stream::stats::{LayerResidency, Residency, StatsSnapshot};
use crate::stream::trial::PairedTrial;
use crate::stream::trunk::Trunk;
use crate::stream::{Checkpoint, Dtype, StreamError};
use crate::tuning::Tuning;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use crate::tuning::{DEFAULT_PREFETCH, DEFAULT_PREFETCH_DEPTH, DEFAULT_PREFETCH_LATE_DEPTH};

/// One layer's experts as a [`moe::ExpertSource`].
struct LayerExperts<'a> {
    st: &'a Streamer,
    il: usize,
    /// A decoding step's early prediction input (the next layer's FFN input but for this
    /// layer's FFN and the next one's attention): the next layer's experts are predicted
    /// from it.
    predict_from: Option<&'a [f32]>,
    predicted: std::cell::Cell<bool>,
}

impl moe::ExpertSource for LayerExperts<'_> {
    type Error = StreamError;

    fn group(&self) -> usize {
        self.st.resident.lock().cache.slots()
    }

    type Arrivals<'s>
        = Arrivals<'s>
    where
        Self: 's;

    fn start<'s>(&'s self, ids: &[usize]) -> Arrivals<'s> {
        let arrivals = self.st.experts(self.il, ids);
        // This layer's reads are queued first; the prediction's come after them.
        if let Some(x) = self.predict_from.filter(|_| !self.predicted.replace(true)) {
            self.st.prefetch_after(self.il, x);
        }
        arrivals
    }
}

/// What one group's fetch works in: the ids asked for, the experts at hand, the lookups and
/// reads, and the channel completed reads arrive on. Kept in [`Streamer`]'s pool and reused
/// request after request, so a fetch allocates nothing once the pool holds one per fetch
/// under way (the channel is empty again when a fetch ends: dropping [`Arrivals`] waits for
/// every read it is owed).
struct FetchBufs {
    ids: Vec<usize>,
    ready: Vec<(usize, Arc<Expert>)>,
    sources: Vec<Source>,
    reads: Vec<ExpertRead>,
    pinned: Vec<usize>,
    tx: Arc<Mailbox>,
}

impl std::fmt::Debug for FetchBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchBufs")
            .field("ids", &self.ids.capacity())
            .finish()
    }
}

impl FetchBufs {
    /// Buffers for fetches of up to `experts` experts: the channel holds an arrival for each
    /// (made once: sending never allocates, and never blocks).
    fn new(experts: usize) -> Self {
        let tx = Mailbox::new(experts + 1);
        FetchBufs {
            ids: Vec::new(),
            ready: Vec::new(),
            sources: Vec::new(),
            reads: Vec::new(),
            pinned: Vec::new(),
            tx,
        }
    }
}

/// A group of one layer's experts being fetched: yields `(position in the request, expert)`
/// as each becomes available, residents first. Dropping it waits for the reads still in
/// flight, so no slot stays reserved.
pub struct Arrivals<'a> {
    st: &'a Streamer,
    il: usize,
    /// Taken from the streamer's pool; given back on drop.
    bufs: Option<FetchBufs>,
    outstanding: usize,
}

impl std::fmt::Debug for Arrivals<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arrivals")
            .field("layer", &self.il)
            .field("ready", &self.bufs.as_ref().map_or(0, |b| b.ready.len()))
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl Arrivals<'_> {
    /// Wait for the next completed read and file it in the cache.
    fn receive(&mut self) -> Result<(usize, Arc<Expert>), StreamError> {
        let Some(bufs) = self.bufs.as_ref() else {
            return Err(self.lost());
        };
        loop {
            let t0 = Instant::now();
            let got = bufs.tx.recv();
            self.st
                .counters
                .io_wait_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match got {
                Arrival::Read { k, slot, result } => {
                    self.outstanding -= 1;
                    return self.file(k, slot, result);
                }
                Arrival::Shared {
                    k,
                    expert: Some(ex),
                } => {
                    self.outstanding -= 1;
                    return Ok((k, ex));
                }
                // The prefetch it waited for failed: read it here (uncached), still owed.
                Arrival::Shared { k, expert: None } => {
                    self.st.spawn_read(ExpertRead {
                        il: self.il,
                        k,
                        e: bufs.ids[k],
                        slot: None,
                        spare: None,
                        tx: Arc::clone(&bufs.tx),
                    });
                }
            }
        }
    }

    fn lost(&self) -> StreamError {
        StreamError::Unrepresentable {
            path: self.st.ck.dir().to_path_buf(),
            name: format!("layer {} experts", self.il),
            reason: "an expert read was lost (I/O thread ended)".into(),
        }
    }

    /// File the request's own read of its `k`-th expert.
    fn file(
        &mut self,
        k: usize,
        slot: Option<usize>,
        r: Result<Arc<Expert>, StreamError>,
    ) -> Result<(usize, Arc<Expert>), StreamError> {
        match r {
            Ok(ex) => {
                self.st
                    .counters
                    .expert_bytes
                    .fetch_add(self.st.sizes.expert_bytes, Ordering::Relaxed);
                if let Some(slot) = slot {
                    self.st.resident.lock().cache.publish(slot, &ex);
                }
                Ok((k, ex))
            }
            Err(e) => {
                if let Some(slot) = slot {
                    self.st.resident.lock().cache.fail(slot);
                }
                Err(e)
            }
        }
    }
}

impl Iterator for Arrivals<'_> {
    type Item = Result<(usize, Arc<Expert>), StreamError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(r) = self.bufs.as_mut().and_then(|b| b.ready.pop()) {
            return Some(Ok(r));
        }
        (self.outstanding > 0).then(|| self.receive())
    }
}

impl Drop for Arrivals<'_> {
    fn drop(&mut self) {
        while self.outstanding > 0 {
            let _ = self.receive();
        }
        // Nothing is owed any more, so the mailbox is empty: the buffers serve the next fetch.
        if let Some(mut bufs) = self.bufs.take() {
            bufs.ready.clear();
            self.st.fetch_pool.lock().push(bufs);
        }
    }
}

/// Weights read from a checkpoint under a memory plan.
///
/// Locks: three nest, always in this order — `predict_scratch` (a prediction's buffers),
/// then `resident` (the plan, the pinned layers, the expert cache and the prediction scores),
/// then the prefetch queue's state. Every other lock (`fetch_pool`, `io`, `early`, the
/// read-ahead ring's, the arena's) is taken alone and released before another is taken.
/// `streaming::stats_read_under_load_change_nothing_and_never_block` runs the streamed path
/// while another thread reads the figures and the plan changes between tokens.
#[derive(Debug)]
pub struct Streamer {
    cfg: ModelConfig,
    ck: Arc<Checkpoint>,
    trunk: Option<Arc<Trunk>>,
    sizes: ModelSizes,
    resident: Arc<Leaf<Resident>>,
    /// The read-ahead ring streamed layers are read into.
    ring: Arc<LayerRing>,
    counters: Arc<Counters>,
    /// How many of the next layer's predicted experts (the most likely first) are read
    /// ahead (`K3_PREFETCH=N`; 0 turns it off).
    prefetch: std::sync::atomic::AtomicUsize,
    /// Predicted reads, behind the layers' own.
    prefetcher: Arc<Prefetcher>,
    /// Whether the next layer's experts are also predicted before a layer's experts are
    /// computed (the early prediction): fixed, or chosen per decoding step by timing steps
    /// with it off and on (`stream::trial`).
    early: Leaf<PairedTrial>,
    /// The setting of the decoding step under way.
    early_now: std::sync::atomic::AtomicBool,
    /// The first layer with routed experts: a pass reaching it begins a step.
    first_moe: Option<usize>,
    /// Pinned layers and the output head are taken in place from mappings of the shards
    /// (off with `K3_MMAP=0`); streamed layers and experts are always read.
    mapped: bool,
    /// The memory of the expert cache: slots streamed experts are read into, faulted in when
    /// a plan is applied.
    arena: Arc<Arena>,
    /// Where the embedding and the output head lie, found once at open.
    embed_info: TensorInfo,
    head_info: TensorInfo,
    /// The buffers embedding rows and streamed head chunks are read into.
    io: Leaf<IoScratch>,
    /// The threads expert misses are read on (None without I/O threads: read in place),
    /// and what they read from.
    readers: Option<Arc<ExpertReaders>>,
    readers_src: Arc<ReadSource>,
    /// Buffers of expert fetches, reused (one per fetch under way).
    fetch_pool: Leaf<Vec<FetchBufs>>,
    /// What a prediction routes and chooses in.
    predict_scratch: Leaf<PredictScratch>,
}

/// The buffers a prediction of a layer's experts works in, reused.
#[derive(Debug, Default)]
struct PredictScratch {
    logits: Vec<f32>,
    route: moe::RouteScratch,
    idx: Vec<usize>,
    weights: Vec<f32>,
    count: Vec<usize>,
    chosen: Vec<bool>,
    ids: Vec<usize>,
    reads: Vec<(usize, usize, usize)>,
}

/// How many threads read the plan's resident weights at once: as many as the I/O pool has
/// (`K3_IO_THREADS`, default 8), one where there is none.
fn load_workers() -> usize {
    io_pool().map_or(1, rayon::ThreadPool::current_num_threads)
}

/// Widen `rows` rows of raw little-endian `dtype` bytes to f32.
fn widen(raw: &[u8], dtype: Dtype, out: &mut [f32]) {
    match dtype {
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = kernels::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = kernels::f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::U8 => {}
    }
}

/// Buffers the embedding and streamed-head reads reuse: raw bytes (as 16-bit words, so a
/// BF16 chunk is multiplied in place; the decoded rows of an encoded head), a widened chunk
/// for other dtypes, the product of a chunk for several rows, and an encoded head's stored
/// bytes.
#[derive(Debug, Default)]
struct IoScratch {
    raw: Vec<u16>,
    wide: Vec<f32>,
    part: Vec<f32>,
    stored: Vec<u8>,
}

impl IoScratch {
    /// Bytes its buffers hold.
    fn held_bytes(&self) -> usize {
        2 * self.raw.capacity()
            + 4 * (self.wide.capacity() + self.part.capacity())
            + self.stored.capacity()
    }

    /// The first `n` bytes of the raw buffer (grown, never shrunk).
    fn bytes(&mut self, n: usize) -> &mut [u8] {
        fit_bytes(&mut self.raw, n)
    }
}

/// Multiply `cr` rows of the output head from row `r0` (`chunk`, `[cr, d]`) by the input
/// `rows` (`[n, d]`) into their columns of `logits` (`[n, v]`): one input row straight into
/// its logits, several through `part`.
fn head_chunk_into(
    chunk: kernels::DenseRef<'_>,
    (r0, cr): (usize, usize),
    (d, v): (usize, usize),
    rows: &[f32],
    part: &mut Vec<f32>,
    logits: &mut [f32],
) {
    let n = rows.len() / d.max(1);
    if n == 1 {
        kernels::matmul(chunk, cr, d, rows, &mut logits[r0..r0 + cr]);
        return;
    }
    let part = fit(part, n * cr);
    kernels::matmul(chunk, cr, d, rows, part);
    for t in 0..n {
        logits[t * v + r0..t * v + r0 + cr].copy_from_slice(&part[t * cr..(t + 1) * cr]);
    }
}

/// The first `n` bytes of `raw`, grown (never shrunk) to hold them.
fn fit_bytes(raw: &mut Vec<u16>, n: usize) -> &mut [u8] {
    let words = n.div_ceil(2);
    &mut bytemuck::cast_slice_mut(fit(raw, words))[..n]
}

impl Streamer {
    /// Start streaming `ck` under `plan` (pinned weights are read now).
    pub fn new(
        cfg: ModelConfig,
        ck: Arc<Checkpoint>,
        trunk: Option<Arc<Trunk>>,
        sizes: ModelSizes,
        plan: Plan,
        mapped: bool,
    ) -> Result<Streamer, StreamError> {
        let ring = LayerRing::start(layers::Source {
            table: LayerTable::new(&ck, trunk.as_deref(), &cfg),
            ck: Arc::clone(&ck),
            trunk: trunk.clone(),
            cfg: cfg.clone(),
        })
        .map_err(|e| StreamError::Open {
            path: ck.dir().to_path_buf(),
            source: e,
        })?;
        let missing = |name: &str| StreamError::NoSuchTensor(name.to_string());
        let embed_info = ck.info(names::EMBED).ok_or_else(|| missing(names::EMBED))?;
        let head_info = ck
            .info(names::LM_HEAD)
            .ok_or_else(|| missing(names::LM_HEAD))?;
        let n = cfg.num_hidden_layers;
        let n_exp = cfg.num_experts;
        // Streamed experts are read into the arena's slots; `set_plan` sizes it.
        let arena = Arena::new(budget::expert_slot_bytes(&sizes) as usize);
        ck.read_groups_into(Arc::clone(&arena));
        let cfg_arc = Arc::new(cfg.clone());
        let first_moe = (0..n).find(|&il| !cfg.is_dense(il));
        let resident = Arc::new(Leaf::new(Resident {
            pinned_map: plan.pinned.clone().into(),
            plan: plan.clone(),
            pinned: vec![None; n],
            head: None,
            cache: ExpertCache::new(plan.expert_slots as usize, n, n_exp),
            right_by_rank: Vec::new(),
            early_right_by_rank: Vec::new(),
            prefetch: prefetch::PrefetchState::default(),
        }));
        let counters = Arc::new(Counters::default());
        let tuning = Tuning::get();
        let table = Arc::new(ExpertTable::new(&ck, &cfg));
        let prefetcher = Arc::new(Prefetcher {
            ck: Arc::clone(&ck),
            cfg: Arc::clone(&cfg_arc),
            table: Arc::clone(&table),
            resident: Arc::clone(&resident),
            counters: Arc::clone(&counters),
            expert_bytes: sizes.expert_bytes,
            depth: std::sync::atomic::AtomicUsize::new(tuning.prefetch_depth),
            late_depth: std::sync::atomic::AtomicUsize::new(tuning.prefetch_late_depth),
            idle: std::sync::Condvar::new(),
        });
        let readers_src = Arc::new(ReadSource {
            ck: Arc::clone(&ck),
            cfg: Arc::clone(&cfg_arc),
            table: Arc::clone(&table),
            prefetcher: Arc::clone(&prefetcher),
        });
        let readers = match io_pool() {
            Some(pool) => Some(
                ExpertReaders::start(
                    pool.current_num_threads(),
                    4 * cfg.num_experts,
                    Arc::clone(&readers_src),
                )
                .map_err(|e| StreamError::Open {
                    path: ck.dir().to_path_buf(),
                    source: e,
                })?,
            ),
            None => None,
        };
        let st = Streamer {
            readers,
            readers_src,
            cfg,
            ck,
            trunk,
            sizes,
            resident,
            ring,
            counters,
            prefetch: std::sync::atomic::AtomicUsize::new(tuning.prefetch),
            prefetcher,
            early: Leaf::new(PairedTrial::new(tuning.prefetch_early)),
            early_now: std::sync::atomic::AtomicBool::new(false),
            first_moe,
            mapped,
            arena,
            embed_info,
            head_info,
            io: Leaf::new(IoScratch::default()),
            fetch_pool: Leaf::new(Vec::new()),
            predict_scratch: Leaf::new(PredictScratch::default()),
        };
        st.set_plan(plan)?;
        Ok(st)
    }

    /// Read up to `n` of the next layer's predicted experts ahead of it while decoding, the
    /// most likely first (0: off; [`DEFAULT_PREFETCH`] unless `K3_PREFETCH=N` says otherwise).
    /// Tokens do not depend on it.
    pub fn set_prefetch(&self, n: usize) {
        self.prefetch.store(n, Ordering::Relaxed);
    }

    /// Let a predicted read start only while fewer than `depth` reads are in flight (0: none
    /// starts, predictions stay queued until their layer drops them; [`DEFAULT_PREFETCH_DEPTH`]
    /// unless `K3_PREFETCH_DEPTH=N` says otherwise). Tokens do not depend on it.
    pub fn set_prefetch_depth(&self, depth: usize) {
        self.prefetcher.depth.store(depth, Ordering::Relaxed);
    }

    /// The same for the reads of a prediction made from a layer's output
    /// ([`DEFAULT_PREFETCH_LATE_DEPTH`] unless `K3_PREFETCH_LATE_DEPTH=N` says otherwise).
    pub fn set_prefetch_late_depth(&self, depth: usize) {
        self.prefetcher.late_depth.store(depth, Ordering::Relaxed);
    }

    /// Whether the early prediction (made before a layer's experts, see
    /// [`Streamer::begin_moe`]) is made:
    /// `Some` fixes it, `None` (the default; `K3_PREFETCH_EARLY=0` or `1` fixes it) times
    /// decoding steps with it off and on and keeps the faster for a while (`stream::trial`).
    /// The prediction from the layer's output is made either way. Where the disk waits for
    /// the CPU the early reads fill its idle time; where the disk is the bottleneck its wrong
    /// reads cost more than its right ones save. Tokens do not depend on it.
    pub fn set_prefetch_early(&self, on: Option<bool>) {
        self.early.lock().set_fixed(on);
        self.early_now.store(on.unwrap_or(false), Ordering::Relaxed);
    }

    /// A pass of `n_tok` tokens reaches MoE layer `il`: at the first one, a one-token pass
    /// (a decoding step) begins a step of the early prediction's trial and takes its setting;
    /// any other pass leaves the step under way untimed. The trial runs only where the early
    /// prediction can read anything: prefetch on and some MoE layer after the first pinned.
    ///
    /// Returns the next MoE layer when this is a decoding step with the early prediction on
    /// and that layer is pinned: the caller then forms that layer's FFN input as it would be
    /// without this layer's FFN (the mix of the residual stream after this layer's attention,
    /// normalised by the next layer's norm) and passes it to [`Streamer::moe`].
    pub fn begin_moe(&self, il: usize, n_tok: usize) -> Option<Arc<Layer>> {
        self.note_pass(il, n_tok);
        if n_tok != 1 || !self.early_now.load(Ordering::Relaxed) {
            return None;
        }
        self.next_pinned(il + 1)
    }

    fn note_pass(&self, il: usize, n_tok: usize) {
        if Some(il) != self.first_moe {
            return;
        }
        let can_predict = self.prefetch.load(Ordering::Relaxed) > 0
            && io_pool().is_some()
            && self
                .resident
                .lock()
                .pinned
                .iter()
                .enumerate()
                .any(|(j, p)| j > il && p.is_some() && !self.cfg.is_dense(j));
        // A leaf lock: taken after `resident` is released.
        let mut trial = self.early.lock();
        if n_tok != 1 {
            trial.interrupt();
            return;
        }
        let on = if can_predict || trial.fixed().is_some() {
            trial.begin(Instant::now())
        } else {
            trial.interrupt();
            false
        };
        self.early_now.store(on, Ordering::Relaxed);
    }

    /// The plan in force.
    #[must_use]
    pub fn plan(&self) -> Plan {
        self.resident.lock().plan.clone()
    }

    /// The checkpoint being streamed.
    #[must_use]
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ck
    }

    /// The packed trunk layers are read from, if any.
    #[must_use]
    pub fn trunk(&self) -> Option<&Trunk> {
        self.trunk.as_deref()
    }

    /// The model's byte sizes.
    #[must_use]
    pub fn sizes(&self) -> &ModelSizes {
        &self.sizes
    }

    /// Apply a new plan between forward passes: pin or release layers and the head, and grow
    /// or shrink the expert cache. Nothing else changes; the next tokens are those an
    /// unchanged run produces.
    pub fn set_plan(&self, plan: Plan) -> Result<(), StreamError> {
        // Queued predictions are dropped and those being read finish first, so every slot can
        // be resized.
        self.prefetcher.quiesce();
        let mut r = self.resident.lock();
        let mut shrinks = plan.expert_slots < r.plan.expert_slots;
        // Pinned layers held the other way (coded or decoded) are read again as the new plan
        // holds them: it counts them so.
        let recode = plan.pin_coded != r.plan.pin_coded;
        for (il, slot) in r.pinned.iter_mut().enumerate() {
            if recode || !plan.pinned.get(il).copied().unwrap_or(false) {
                shrinks |= slot.take().is_some();
            }
        }
        // A head held the other way (coded or decoded) is read again as the new plan holds it.
        if !plan.head_resident || plan.head_coded != r.plan.head_coded {
            shrinks |= r.head.take().is_some();
        }
        let to_pin: Vec<usize> = (0..r.pinned.len())
            .filter(|&il| plan.pinned.get(il).copied().unwrap_or(false) && r.pinned[il].is_none())
            .collect();
        // Where every layer is pinned the staging serves only to load them: none is made when
        // none is to be loaded, and one that is made is released once they are, its bytes
        // going to expert slots then (`Plan::load_expert_slots`).
        let only_to_load = plan.stage_only_to_load();
        let staging_then_slots = only_to_load && !to_pin.is_empty();
        let slots = if staging_then_slots {
            plan.load_expert_slots.min(plan.expert_slots)
        } else {
            plan.expert_slots
        };
        let final_slots = plan.expert_slots as usize;
        r.cache.resize(slots as usize);
        // The arena follows: its slots are the cache's plus room for reads in flight.
        let in_flight = budget::in_flight_slots(&self.sizes) as usize;
        let arena_slots = r.cache.slots() + in_flight;
        r.pinned_map = plan.pinned.clone().into();
        let head_streamed = !r.plan.head_resident;
        r.plan = plan;
        let want_head = r.plan.head_resident && r.head.is_none();
        let r_ring_slots = r.plan.ring_slots;
        let ring_coded = r.plan.ring_coded;
        let streamed_of = r.plan.pinned.clone();
        let stage = if only_to_load && to_pin.is_empty() {
            None
        } else {
            Some(usize::try_from(r.plan.stage_bytes).unwrap_or(usize::MAX))
        };
        let head_now_held = head_streamed && r.plan.head_resident;
        drop(r);
        if head_now_held {
            // A head that streamed and is now resident streams nothing: the buffers its chunks
            // were read through go, since the plan counts them only while the head streams
            // (the embedding's rows grow a small one again on demand).
            let freed = std::mem::take(&mut *self.io.lock());
            shrinks |= freed.held_bytes() > 0;
        }
        // Drop the read-ahead and make the new plan's ring.
        let ring_slots = usize::try_from(r_ring_slots).unwrap_or(usize::MAX);
        self.ring
            .resize(ring_slots, &streamed_of, stage, ring_coded)
            .map_err(|e| StreamError::Open {
                path: self.ck.dir().to_path_buf(),
                source: std::io::Error::new(
                    e.kind(),
                    format!("could not map the read-ahead ring ({ring_slots} slots): {e}"),
                ),
            })?;
        let arena_error = |e: std::io::Error| StreamError::Open {
            path: self.ck.dir().to_path_buf(),
            source: std::io::Error::new(
                e.kind(),
                format!(
                    "could not map the expert cache ({arena_slots} slots of {} bytes): {e}",
                    self.arena.slot_len()
                ),
            ),
        };
        let loaded = if arena_slots < self.arena.slots() {
            // Fewer slots release the free ones now; experts kept in retired slots move down,
            // and the slots they leave are released as they go.
            self.arena.set_slots(arena_slots).map_err(arena_error)?;
            self.resident.lock().cache.rehome(&self.arena);
            self.load_planned(to_pin, want_head)
        } else {
            // More slots are faulted in while the pinned weights are read (the resident lock
            // is not held, so the stats stay live).
            std::thread::scope(|sc| {
                let grow = sc.spawn(|| self.arena.set_slots(arena_slots));
                let loaded = self.load_planned(to_pin, want_head);
                let grown = grow.join().unwrap_or_else(|_| {
                    Err(std::io::Error::other("the thread faulting it in failed"))
                });
                grown.map_err(arena_error).and(loaded)
            })
        };
        if staging_then_slots && loaded.is_ok() {
            // The pinned layers are in: the staging goes, and the expert slots it held back
            // are made (between forward passes, like every change of the plan).
            self.ring.release_stage();
            let cache_slots = {
                let mut r = self.resident.lock();
                r.cache.resize(final_slots);
                r.cache.slots()
            };
            self.arena
                .set_slots(cache_slots + in_flight)
                .map_err(arena_error)?;
            shrinks = true;
        }
        if shrinks {
            // What the smaller plan let go goes back to the system, not only to the allocator.
            if let Some(t) = &self.trunk {
                t.release_pooled();
            }
            crate::stream::alloc::give_back_freed_memory();
        }
        // What took effect: resident and huge-page bytes of the arena, for the stats.
        self.arena.measure();
        loaded
    }

    /// Read the layers `to_pin` and, with `want_head`, the output head into the plan's
    /// resident set. They are read by up to [`load_workers`] threads at once, each taking the
    /// next weight in order (the head first, the largest), so the device gets parallel reads
    /// as the streamed experts do; what is read is the same, and where it goes does not
    /// depend on which thread read it. The wall time is counted as I/O wait once. The first
    /// failure (the lowest layer among those that failed) stops the others taking more, as
    /// does [`Checkpoint::stop_loading`].
    fn load_planned(&self, to_pin: Vec<usize>, want_head: bool) -> Result<(), StreamError> {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        // The jobs: None is the head.
        let jobs: Vec<Option<usize>> = want_head
            .then_some(None)
            .into_iter()
            .chain(to_pin.into_iter().map(Some))
            .collect();
        let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
        let t0 = Instant::now();
        let work = || -> Vec<(Option<usize>, StreamError)> {
            let mut errors = Vec::new();
            while !failed.load(Ordering::Relaxed) {
                let Some(&job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                if self.ck.loading_stopped() {
                    failed.store(true, Ordering::Relaxed);
                    errors.push((
                        job,
                        StreamError::Open {
                            path: self.ck.dir().to_path_buf(),
                            source: std::io::Error::other("loading was stopped"),
                        },
                    ));
                    break;
                }
                let done = match job {
                    Some(il) => self.pin_layer(il),
                    None => self.pin_head(),
                };
                if let Err(e) = done {
                    failed.store(true, Ordering::Relaxed);
                    errors.push((job, e));
                }
            }
            errors
        };
        let workers = load_workers().min(jobs.len());
        let mut errors = if workers <= 1 {
            work()
        } else {
            std::thread::scope(|sc| {
                let handles: Vec<_> = (0..workers).map(|_| sc.spawn(work)).collect();
                handles
                    .into_iter()
                    .flat_map(|h| {
                        h.join().unwrap_or_else(|_| {
                            vec![(
                                None,
                                StreamError::Unrepresentable {
                                    path: self.ck.dir().to_path_buf(),
                                    name: "the resident weights".into(),
                                    reason: "the thread reading them failed".into(),
                                },
                            )]
                        })
                    })
                    .collect()
            })
        };
        self.counters
            .io_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // The head (None) sorts first, then layers in order.
        errors.sort_by_key(|(job, _)| *job);
        match errors.into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Layer `il`'s non-expert weights in an allocation of their own, to be pinned: a layer
    /// stored encoded is read through the ring's staging memory (no more memory than the
    /// plan counts), its nibble-coded matrices kept coded where the plan says so
    /// (`Plan::pin_coded`), or read as it lies where it is then held as stored
    /// (`Trunk::in_place_len`); any other as it lies.
    fn load_pinned(&self, il: usize) -> LayerResult {
        if let Some(t) = self.trunk.as_deref() {
            let coded = self.resident.lock().plan.pin_coded;
            if coded && t.in_place_len(il).is_some() {
                return layers::load_in_place(&self.ck, t, &self.cfg, il);
            }
            if let Some(l) = layers::load_encoded(&self.ck, t, &self.cfg, il, &self.ring, coded) {
                return l;
            }
        }
        load_layer(&self.ck, self.trunk.as_deref(), &self.cfg, il, self.mapped)
    }

    /// Read layer `il`'s non-expert weights into the resident set.
    fn pin_layer(&self, il: usize) -> Result<(), StreamError> {
        let layer = self.load_pinned(il)?;
        self.counters
            .trunk_bytes
            .fetch_add(self.sizes.layer_trunk[il], Ordering::Relaxed);
        self.resident.lock().pinned[il] = Some(layer);
        Ok(())
    }

    /// Read the output head into the resident set: coded from the trunk where the plan holds
    /// it so (`Plan::head_coded`: it is stored nibble-coded), else from the checkpoint.
    fn pin_head(&self) -> Result<(), StreamError> {
        let coded = self.resident.lock().plan.head_coded;
        if let Some(t) = self.trunk.as_deref().filter(|_| coded) {
            if let Some(m) = t.read_head_coded()? {
                self.counters
                    .embed_head_bytes
                    .fetch_add(self.sizes.head_stored, Ordering::Relaxed);
                let dense = Dense {
                    data: DenseData::Coded(Box::new(m)),
                    rows: self.cfg.vocab_size,
                    cols: self.cfg.hidden_size,
                };
                self.resident.lock().head = Some(Arc::new(dense));
                return Ok(());
            }
        }
        let (info, data) = self.ck.read_maybe_mapped(names::LM_HEAD, self.mapped)?;
        self.counters
            .embed_head_bytes
            .fetch_add(info.n_bytes(), Ordering::Relaxed);
        let (rows, cols) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let dense = match data {
            crate::stream::TensorData::Bf16(v) => Dense {
                data: DenseData::Bf16(v),
                rows,
                cols,
            },
            crate::stream::TensorData::F32(v) => Dense {
                data: DenseData::F32(v),
                rows,
                cols,
            },
            crate::stream::TensorData::U8(_) => {
                return Err(StreamError::Unrepresentable {
                    path: self.ck.dir().to_path_buf(),
                    name: names::LM_HEAD.into(),
                    reason: "U8 output head".into(),
                })
            }
        };
        self.resident.lock().head = Some(Arc::new(dense));
        Ok(())
    }

    fn note_io(&self, t0: Instant, bytes: u64, counter: &AtomicU64) {
        counter.fetch_add(bytes, Ordering::Relaxed);
        self.counters
            .io_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// The next layer after `il` (cyclically) that the plan streams.
    fn next_streamed(&self, il: usize, pinned: &[bool]) -> Option<usize> {
        let n = pinned.len();
        (1..=n).map(|k| (il + k) % n).find(|&j| !pinned[j])
    }

    /// Layer `il`'s non-expert weights.
    pub fn layer(&self, il: usize) -> LayerResult {
        let (is_pinned, pinned_map, ring_slots) = {
            let r = self.resident.lock();
            if let Some(l) = &r.pinned[il] {
                return Ok(Arc::clone(l));
            }
            (
                r.plan.pinned[il],
                Arc::clone(&r.pinned_map),
                r.plan.ring_slots,
            )
        };
        let t0 = Instant::now();
        let layer = if is_pinned {
            let l = self.load_pinned(il)?;
            self.resident.lock().pinned[il] = Some(Arc::clone(&l));
            l
        } else {
            self.ring.take(il)?
        };
        if !is_pinned || t0.elapsed().as_nanos() > 0 {
            self.note_io(t0, self.sizes.layer_trunk[il], &self.counters.trunk_bytes);
        }
        // Read ahead: keep up to ring_slots − 1 streamed layers asked for.
        let depth = usize::try_from(ring_slots.saturating_sub(1)).unwrap_or(usize::MAX);
        let mut at = il;
        while let Some(next) = self.next_streamed(at, &pinned_map) {
            if next == il || !self.ring.read_ahead(next, depth) {
                break;
            }
            at = next;
        }
        Ok(layer)
    }

    /// Start fetching the routed experts `ids` of layer `il`: residents are handed back at
    /// once, misses are read in parallel on the I/O threads and handed back as each read
    /// completes, so the caller computes with one expert while the others are still read.
    pub fn experts(&self, il: usize, ids: &[usize]) -> Arrivals<'_> {
        let mut bufs = self
            .fetch_pool
            .lock()
            .pop()
            .unwrap_or_else(|| FetchBufs::new(self.cfg.num_experts));
        let used = {
            let mut r = self.resident.lock();
            // The routing is known: predictions not started yet give way to its reads.
            self.prefetcher.cancel_queued(&mut r);
            let Resident {
                cache: c,
                right_by_rank,
                early_right_by_rank,
                ..
            } = &mut *r;
            if let Some(predicted) = c.prediction.take_for(il) {
                self.note_prediction(right_by_rank, predicted, ids);
            }
            if let Some(predicted) = c.early_prediction.take_for(il) {
                score_by_rank(early_right_by_rank, predicted, ids);
                let c = &self.counters;
                c.early_predictions.fetch_add(1, Ordering::Relaxed);
            }
            let FetchBufs {
                sources,
                pinned,
                tx,
                ..
            } = &mut bufs;
            c.request(il, ids, tx, sources, pinned)
        };
        self.counters
            .prefetch_used
            .fetch_add(used, Ordering::Relaxed);
        let FetchBufs {
            ids: own_ids,
            ready,
            sources,
            reads,
            tx,
            ..
        } = &mut bufs;
        own_ids.clear();
        own_ids.extend_from_slice(ids);
        ready.clear();
        reads.clear();
        let mut outstanding = 0usize;
        let mut waited = 0usize;
        for (k, src) in sources.drain(..).enumerate() {
            match src {
                Source::Hit(ex) => ready.push((k, ex)),
                Source::Waiting => {
                    outstanding += 1;
                    waited += 1;
                }
                Source::Read(slot, spare) => {
                    outstanding += 1;
                    reads.push(ExpertRead {
                        il,
                        k,
                        e: ids[k],
                        slot,
                        spare,
                        tx: Arc::clone(tx),
                    });
                }
            }
        }
        self.counters
            .hits
            .fetch_add((ready.len() + waited) as u64, Ordering::Relaxed);
        self.counters
            .misses
            .fetch_add(reads.len() as u64, Ordering::Relaxed);
        ready.reverse();
        for read in reads.drain(..) {
            self.spawn_read(read);
        }
        Arrivals {
            st: self,
            il,
            bufs: Some(bufs),
            outstanding,
        }
    }

    /// Count how many of the experts `predicted` for a layer (the most likely first) its
    /// routing chose (`ids`), in all and per rank.
    fn note_prediction(&self, by_rank: &mut Vec<u64>, predicted: &[usize], ids: &[usize]) {
        let c = &self.counters;
        let right = score_by_rank(by_rank, predicted, ids);
        c.predictions.fetch_add(1, Ordering::Relaxed);
        c.predicted
            .fetch_add(predicted.len() as u64, Ordering::Relaxed);
        c.predicted_right.fetch_add(right, Ordering::Relaxed);
    }

    /// Read an expert on one of the expert readers (here, without them); the result goes to
    /// the request's channel.
    fn spawn_read(&self, read: ExpertRead) {
        self.prefetcher.demand_started();
        match &self.readers {
            Some(r) => r.push(read),
            None => self.readers_src.run(read),
        }
    }

    /// Predict the routed experts of the MoE layer after `il` from `x` (one token: that
    /// layer's FFN input as it would be without this layer's FFN and its own attention, see
    /// [`Streamer::begin_moe`]) through that layer's router, and queue reads of the most
    /// likely ones not cached, behind this layer's own reads (they start when the disk would
    /// idle; the next layer drops those not started): those of the ranks this prediction has
    /// got right at least half the time (every rank for its first 8). Only a prefetch: the
    /// next layer still asks for exactly the experts its own routing picks, so a wrong
    /// prediction costs bandwidth, never a different bit.
    pub fn prefetch_after(&self, il: usize, x: &[f32]) {
        if !self.early_now.load(Ordering::Relaxed) || x.len() != self.cfg.hidden_size {
            return;
        }
        if let Some(next) = self.next_pinned(il + 1) {
            self.predict(il + 1, &next, x, false, true);
        }
    }

    /// MoE layer `j`'s weights when a prediction for it can be made: prefetch is on and the
    /// layer is at hand (pinned), since a prediction needs its router (and the one from a
    /// layer's output its mixing vector and norm).
    #[must_use]
    pub fn next_pinned(&self, j: usize) -> Option<Arc<Layer>> {
        if self.prefetch.load(Ordering::Relaxed) == 0
            || j >= self.cfg.num_hidden_layers
            || self.cfg.is_dense(j)
            || io_pool().is_none()
        {
            return None;
        }
        self.resident.lock().pinned[j].clone()
    }

    /// Predict the routed experts of MoE layer `j` (`next`, from [`Streamer::next_pinned`])
    /// from `x`, its FFN input as it would be without its attention (computed from the
    /// previous layer's output). It replaces the earlier prediction from the previous
    /// layer's FFN input: the queued reads of that one are dropped, and this one's are read
    /// like the layer's own (up to `K3_PREFETCH_LATE_DEPTH` in flight) at the ranks that have
    /// been right at least half the time, since the attention rarely moves the routing; the
    /// other ranks wait for an idle disk as the first prediction's do. Only a prefetch, as
    /// [`Streamer::prefetch_after`].
    ///
    /// `x` holds the leading [`Streamer::prediction_rows`] of the pass's `n_tok` tokens.
    pub fn prefetch_next(&self, j: usize, next: &Layer, x: &[f32], n_tok: usize) {
        self.predict(j, next, x, true, n_tok == 1);
    }

    /// Most reads a prediction for a multi-token pass queues: half the cache, so that a wrong
    /// one cannot evict more than half of what is cached.
    fn chunk_prediction_reads(&self) -> usize {
        self.resident.lock().cache.slots() / 2
    }

    /// How many of a pass's `n_tok` tokens a prediction is made for (the leading ones): the
    /// token of a decoding step, and for a multi-token pass enough tokens that their routes
    /// together are likely to fill [`Streamer::chunk_prediction_reads`] (twice as many
    /// choices as reads, since the tokens share experts), so the router is not run twice for
    /// a long chunk.
    #[must_use]
    pub fn prediction_rows(&self, n_tok: usize) -> usize {
        if n_tok <= 1 {
            return n_tok;
        }
        let top_k = self.cfg.num_experts_per_token.max(1);
        (2 * self.chunk_prediction_reads())
            .div_ceil(top_k)
            .clamp(1, n_tok)
    }

    /// Route `x` (one or more tokens) through MoE layer `j`'s router (`next`) and queue reads
    /// of the most likely experts not cached; `late` for a prediction from the previous
    /// layer's output, `single` when `x` is a whole one-token pass (then the prediction is
    /// scored against the layer's routing).
    ///
    /// One token: its experts in rank order, up to `K3_PREFETCH` of them, those of the eager
    /// ranks leading. Several tokens: every expert their eager ranks choose (up to
    /// `K3_PREFETCH` ranks), each once, lowest id first, at most
    /// [`Streamer::chunk_prediction_reads`], all eager: a pass asks for its experts in that
    /// order, a cache-full group at a time, so these are the ones its first group reads.
    ///
    /// Over 100 lines: route, choose, score and queue share one locked scratch.
    fn predict(&self, j: usize, next: &Layer, x: &[f32], late: bool, single: bool) {
        let n = self.prefetch.load(Ordering::Relaxed);
        let FeedForward::Moe(m) = &next.ffn else {
            return;
        };
        let p = super::layer::moe_params(&self.cfg);
        let (n_exp, top_k) = (self.cfg.num_experts, p.top_k);
        let n_rows = x.len() / self.cfg.hidden_size;
        // Taken out of its cell (its buffers move, nothing is allocated) and put back at the
        // end, so no lock is held while `resident` is taken below.
        let mut ps = std::mem::take(&mut *self.predict_scratch.lock());
        let PredictScratch {
            logits,
            route,
            idx,
            weights,
            count,
            chosen,
            ids,
            reads,
        } = &mut ps;
        let logits = fit(logits, n_rows * n_exp);
        m.gate.apply_into(x, logits);
        let idx = fit(idx, n_rows * top_k);
        let weights = fit(weights, n_rows * top_k);
        let count = fit(count, n_rows);
        for t in 0..n_rows {
            let row = t * top_k..(t + 1) * top_k;
            count[t] = moe::route_into(
                &logits[t * n_exp..(t + 1) * n_exp],
                &m.bias,
                &p,
                route,
                &mut idx[row.clone()],
                &mut weights[row],
            );
        }
        let route_of = |t: usize| &idx[t * top_k..t * top_k + count[t]];
        let c = &self.counters;
        let eager = if late {
            eager_ranks(
                &self.resident.lock().right_by_rank,
                c.predictions.load(Ordering::Relaxed),
            )
        } else {
            0
        };
        ids.clear();
        let n_lead = if single {
            // An early prediction reads only the ranks it has got right at least half the
            // time: on a disk that is busy, a wrong read delays the layers' own.
            let take = if late {
                n
            } else {
                n.min(eager_ranks(
                    &self.resident.lock().early_right_by_rank,
                    c.early_predictions.load(Ordering::Relaxed),
                ))
            };
            if n_rows > 0 {
                ids.extend(route_of(0).iter().take(take));
            }
            eager.min(ids.len())
        } else {
            let chosen = fit(chosen, n_exp);
            chosen.fill(false);
            for t in 0..n_rows {
                for &e in route_of(t).iter().take(n.min(eager)) {
                    chosen[e] = true;
                }
            }
            let cap = self.chunk_prediction_reads();
            ids.extend((0..n_exp).filter(|&e| chosen[e]).take(cap));
            ids.len()
        };
        {
            let mut r = self.resident.lock();
            if late {
                self.prefetcher.cancel_queued(&mut r);
            }
            r.cache.reserve_prefetch(j, ids, reads);
            // Reads keep the order of `ids`; those of the eager ranks lead.
            let n_eager = if n_lead == ids.len() {
                reads.len()
            } else {
                let eager_ids = &ids[..n_lead];
                reads
                    .iter()
                    .take_while(|(_, e, _)| eager_ids.contains(e))
                    .count()
            };
            // Scored against the layer's routing over every rank, read or not.
            let scored = if late {
                &mut r.cache.prediction
            } else {
                &mut r.cache.early_prediction
            };
            if single && n_rows > 0 {
                scored.set(j, route_of(0));
            } else {
                scored.layer = None;
            }
            Prefetcher::enqueue(&mut r, reads, n_eager);
        }
        *self.predict_scratch.lock() = ps;
        self.prefetcher.pump();
    }

    /// The MoE block of layer `il` with experts from the cache, into `out` with the buffers
    /// of `sc`; `early` is the input of the early prediction for the next layer, when
    /// [`Streamer::begin_moe`] asked for one.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_into(
        &self,
        il: usize,
        w: &MoeWeights,
        p: &MoeParams,
        x: &[f32],
        sc: &mut MoeScratch,
        out: &mut [f32],
        early: Option<&[f32]>,
    ) -> Result<(), StreamError> {
        let source = LayerExperts {
            st: self,
            il,
            predict_from: early,
            predicted: std::cell::Cell::new(false),
        };
        moe::forward_with_into(w, p, x, &source, sc, out)
    }

    /// Embedding rows of `tokens`, read on demand straight into `out` `[n_tok, hidden]`
    /// (widened to f32 in place).
    pub fn embed_into(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), StreamError> {
        let d = self.cfg.hidden_size;
        let rb = self.sizes.row_bytes;
        let info = &self.embed_info;
        let t0 = Instant::now();
        let mut io = self.io.lock();
        for (row, &id) in out.chunks_mut(d).zip(tokens) {
            let raw = io.bytes(rb as usize);
            self.ck
                .read_span_into(info, names::EMBED, u64::from(id) * rb, raw)?;
            widen(raw, info.dtype, row);
        }
        self.note_io(
            t0,
            rb * tokens.len() as u64,
            &self.counters.embed_head_bytes,
        );
        Ok(())
    }

    /// Logits for `rows` `[n, hidden]` into `logits` `[n, vocab]`: from the pinned head, or
    /// streamed chunk by chunk through one reused buffer (a one-row call multiplies each
    /// chunk straight into its place in `logits`).
    pub fn head_into(&self, rows: &[f32], logits: &mut [f32]) -> Result<(), StreamError> {
        let (v, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let (head, chunk_rows) = {
            let r = self.resident.lock();
            (r.head.clone(), r.plan.head_chunk_rows.max(1) as usize)
        };
        if let Some(h) = head {
            h.apply_into(rows, logits);
            return Ok(());
        }
        // A head stored encoded is decoded from the trunk in as many bytes as its rows read raw
        // would take (`ModelSizes::head_rows_encoded`).
        let encoded = (self.trunk.as_deref()).zip(self.sizes.head_rows_encoded(chunk_rows as u64));
        if let Some((trunk, chunk_rows)) = encoded {
            let chunk_rows = chunk_rows as usize;
            let mut io = self.io.lock();
            let IoScratch {
                raw, part, stored, ..
            } = &mut *io;
            let reading = trunk.stream_head(chunk_rows, d, stored, raw, |r0, chunk| {
                let w = kernels::DenseRef::Bf16(chunk);
                head_chunk_into(w, (r0, chunk.len() / d), (d, v), rows, part, logits);
            })?;
            // The time spent reading, as the reads of a raw head count it.
            self.note_io(
                Instant::now()
                    .checked_sub(reading)
                    .unwrap_or_else(Instant::now),
                self.sizes.head_stored,
                &self.counters.embed_head_bytes,
            );
            return Ok(());
        }
        let rb = self.sizes.row_bytes;
        let info = &self.head_info;
        let mut io = self.io.lock();
        for r0 in (0..v).step_by(chunk_rows) {
            let cr = chunk_rows.min(v - r0);
            let t0 = Instant::now();
            let IoScratch {
                raw, wide, part, ..
            } = &mut *io;
            let bytes = fit_bytes(raw, cr * rb as usize);
            self.ck
                .read_span_into(info, names::LM_HEAD, r0 as u64 * rb, bytes)?;
            self.note_io(t0, cr as u64 * rb, &self.counters.embed_head_bytes);
            let chunk = match info.dtype {
                Dtype::Bf16 => kernels::DenseRef::Bf16(&raw[..cr * d]),
                dtype => {
                    let w = fit(wide, cr * d);
                    widen(bytemuck::cast_slice(&raw[..]), dtype, w);
                    kernels::DenseRef::F32(w)
                }
            };
            head_chunk_into(chunk, (r0, cr), (d, v), rows, part, logits);
        }
        Ok(())
    }

    /// Figures for the stats panes (the engine-side part).
    #[must_use]
    pub fn stats(&self) -> StatsSnapshot {
        // Each lock is taken alone: the resident set's for the plan and the cache, released
        // before the counters' and the trial's.
        let r = self.resident.lock();
        let (budget_bytes, floor_bytes, model_bytes) =
            (r.plan.budget_bytes, r.plan.floor_bytes, r.plan.model_bytes);
        let right_by_rank = r.right_by_rank.clone();
        let early_right_by_rank = r.early_right_by_rank.clone();
        let layers = (0..self.cfg.num_hidden_layers)
            .map(|il| LayerResidency {
                trunk: if r.plan.pinned[il] {
                    Residency::Pinned
                } else {
                    Residency::Ring
                },
                experts_resident: r.cache.resident_in(il),
                experts_total: if self.cfg.is_dense(il) {
                    0
                } else {
                    self.cfg.num_experts as u32
                },
            })
            .collect();
        drop(r);
        // Each in a statement of its own: a guard lives to the end of its statement.
        let early = self.early.lock().stats();
        let ring_bytes = self.ring.bytes();
        let stage_bytes = self.ring.stage_bytes();
        let c = &self.counters;
        let read = c.trunk_bytes.load(Ordering::Relaxed)
            + c.expert_bytes.load(Ordering::Relaxed)
            + c.embed_head_bytes.load(Ordering::Relaxed);
        StatsSnapshot {
            budget_bytes,
            floor_bytes,
            model_bytes,
            disk_bytes_read: read,
            expert_hits: c.hits.load(Ordering::Relaxed),
            expert_misses: c.misses.load(Ordering::Relaxed),
            layers,
            io_wait_seconds: c.io_wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            prefetch_reads: c.prefetch_reads.load(Ordering::Relaxed),
            prefetch_used: c.prefetch_used.load(Ordering::Relaxed),
            predicted: c.predicted.load(Ordering::Relaxed),
            predicted_right: c.predicted_right.load(Ordering::Relaxed),
            predictions: c.predictions.load(Ordering::Relaxed),
            predicted_right_by_rank: right_by_rank,
            early_predictions: c.early_predictions.load(Ordering::Relaxed),
            early_predicted_right_by_rank: early_right_by_rank,
            prefetch_cancelled: c.prefetch_cancelled.load(Ordering::Relaxed),
            early,
            arena: self.arena.stats(),
            ring_bytes,
            stage_bytes,
            ..StatsSnapshot::default()
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        // Predicted reads queued are dropped and those under way finish; the reader threads
        // (which hold the ring and the expert queue) end once told. Nothing of this store
        // runs after it is gone.
        self.prefetcher.quiesce();
        self.ring.stop();
        if let Some(r) = &self.readers {
            r.stop();
        }
    }
}

impl WeightStore for Streamer {
    fn embed_into(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), StreamError> {
        Streamer::embed_into(self, tokens, out)
    }

    fn layer(&self, il: usize) -> LayerResult {
        Streamer::layer(self, il)
    }

    fn moe_into(
        &self,
        il: usize,
        w: &MoeWeights,
        p: &MoeParams,
        x: &[f32],
        sc: &mut MoeScratch,
        out: &mut [f32],
        early: Option<&[f32]>,
    ) -> Result<(), StreamError> {
        Streamer::moe_into(self, il, w, p, x, sc, out, early)
    }

    fn head_into(&self, rows: &[f32], logits: &mut [f32]) -> Result<(), StreamError> {
        Streamer::head_into(self, rows, logits)
    }

    fn begin_moe(&self, il: usize, n_tok: usize) -> Option<Arc<Layer>> {
        Streamer::begin_moe(self, il, n_tok)
    }

    fn prediction_target(&self, j: usize) -> Option<Arc<Layer>> {
        self.next_pinned(j)
    }

    fn prediction_rows(&self, n_tok: usize) -> usize {
        Streamer::prediction_rows(self, n_tok)
    }

    fn prefetch_next(&self, j: usize, next: &Layer, x: &[f32], n_tok: usize) {
        Streamer::prefetch_next(self, j, next, x, n_tok);
    }

    fn stats(&self) -> StatsSnapshot {
        Streamer::stats(self)
    }

    fn planned(&self) -> Option<(&ModelSizes, Plan)> {
        Some((&self.sizes, self.plan()))
    }

    fn set_plan(&self, plan: Plan) -> Result<(), StreamError> {
        Streamer::set_plan(self, plan)
    }

    fn checkpoint(&self) -> Option<&Checkpoint> {
        Some(&self.ck)
    }

    fn trunk(&self) -> Option<&Trunk> {
        self.trunk.as_deref()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::eager_ranks;

    #[test]
    fn the_leading_ranks_right_at_least_half_the_time_are_eager() {
        // Too few predictions to judge: every rank.
        assert_eq!(eager_ranks(&[0, 0], 3), usize::MAX);
        // Ranks 1 and 2 right at least half of 10 times, rank 3 not; rank 4 does not count
        // after a rank that fell short.
        assert_eq!(eager_ranks(&[10, 5, 4, 9], 10), 2);
        assert_eq!(eager_ranks(&[4, 10], 10), 0);
        assert_eq!(eager_ranks(&[10, 10, 10], 10), 3);
    }
}
