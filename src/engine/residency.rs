//! Weights under a memory plan: pinned layers stay in memory, the others pass through a
//! read-ahead ring fed by a reader thread, routed experts live in a fixed number of cache slots
//! and are read in parallel as soon as a layer's routing is known, embedding rows are read on
//! demand and the output head is streamed in chunks when it is not pinned.
//!
//! Only *where bytes come from* depends on the plan: every product is computed by the same
//! kernels in the same order as for a resident model, so tokens and logits are bitwise
//! identical at every budget. A failed read fails the step with an error; an expert is never
//! skipped.

use super::config::ModelConfig;
use super::model::Layer;
use super::moe::{self, Expert, MoeParams, MoeWeights, Routing};
use super::tensor::{Dense, DenseData};
use super::weights::{bind_expert, bind_layer, names, Binder};
use crate::kernels;
use crate::stream::budget::{ModelSizes, Plan};
use crate::stream::cache_policy::{ExpertKey, KeySpace, LayerCycle, Lru, Policy};
use crate::stream::stats::{LayerResidency, Residency, StatsSnapshot};
use crate::stream::trunk::Trunk;
use crate::stream::{Checkpoint, Dtype, StreamError};
use rayon::prelude::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

type LayerResult = Result<Arc<Layer>, StreamError>;

/// Counters of what was read and how long the engine waited.
#[derive(Debug, Default)]
struct Counters {
    trunk_bytes: AtomicU64,
    expert_bytes: AtomicU64,
    embed_head_bytes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    io_wait_ns: AtomicU64,
}

/// The routed-expert cache: a fixed number of slots; which expert leaves when a slot is needed
/// is decided by a replacement policy ([`LayerCycle`] by default, `K3_CACHE_POLICY=lru` for
/// plain LRU).
struct ExpertCache {
    slots: usize,
    entries: HashMap<(usize, usize), Arc<Expert>>,
    policy: Box<dyn Policy + Send>,
    now: u64,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("slots", &self.slots)
            .field("resident", &self.entries.len())
            .field("policy", &self.policy.name())
            .finish()
    }
}

fn key(il: usize, e: usize) -> ExpertKey {
    ExpertKey::new(il as u16, e as u16)
}

impl ExpertCache {
    fn new(slots: usize, layers: usize, experts: usize) -> Self {
        let space = KeySpace::new(layers, experts);
        let policy: Box<dyn Policy + Send> = match std::env::var("K3_CACHE_POLICY").as_deref() {
            Ok("lru") => Box::new(Lru::new(space)),
            _ => Box::new(LayerCycle::new(space)),
        };
        ExpertCache {
            slots,
            entries: HashMap::new(),
            policy,
            now: 0,
        }
    }

    fn resident_in(&self, il: usize) -> u32 {
        self.entries.keys().filter(|(l, _)| *l == il).count() as u32
    }

    fn hit(&mut self, k: (usize, usize)) -> Option<Arc<Expert>> {
        let ex = self.entries.get(&k).cloned()?;
        self.now += 1;
        self.policy.on_hit(key(k.0, k.1), self.now);
        Some(ex)
    }

    fn insert(&mut self, k: (usize, usize), ex: Arc<Expert>) {
        if self.entries.len() < self.slots {
            self.now += 1;
            self.policy.on_insert(key(k.0, k.1), self.now);
            self.entries.insert(k, ex);
        }
    }

    /// Make room for `n` new entries without evicting anything in `keep`.
    fn make_room(&mut self, n: usize, keep: &[(usize, usize)]) {
        while self.entries.len() + n > self.slots {
            let mut cands: Vec<(usize, usize)> = self
                .entries
                .keys()
                .filter(|k| !keep.contains(k))
                .copied()
                .collect();
            cands.sort_unstable();
            let keys: Vec<ExpertKey> = cands.iter().map(|&(l, e)| key(l, e)).collect();
            let Some(i) = self.policy.victim(&keys) else {
                break;
            };
            self.entries.remove(&cands[i]);
            self.policy.on_evict(keys[i]);
        }
    }
}

/// What the plan keeps in memory.
#[derive(Debug)]
struct Resident {
    plan: Plan,
    pinned: Vec<Option<Arc<Layer>>>,
    head: Option<Arc<Dense>>,
    cache: ExpertCache,
}

/// The read-ahead ring: requests in flight to the reader thread, oldest first.
struct Ring {
    tx: Sender<(usize, Sender<LayerResult>)>,
    pending: VecDeque<(usize, Receiver<LayerResult>)>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("pending", &self.pending.len())
            .finish()
    }
}

/// Weights read from a checkpoint under a memory plan.
#[derive(Debug)]
pub struct Streamer {
    cfg: ModelConfig,
    ck: Arc<Checkpoint>,
    trunk: Option<Arc<Trunk>>,
    sizes: ModelSizes,
    resident: Mutex<Resident>,
    ring: Mutex<Ring>,
    counters: Counters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these structures half-updated in a way that
    // matters for correctness (they only cache reads), so a poisoned lock is used as is.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Threads that read missed experts: reads block in the kernel, so more of them than cores
/// keeps the device's queue full (`K3_IO_THREADS`, default 8). Results do not depend on it.
fn io_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("K3_IO_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| (1..=256).contains(&n))
            .unwrap_or(8);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("k3-io-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Read one layer's non-expert weights.
fn load_layer(ck: &Checkpoint, trunk: Option<&Trunk>, cfg: &ModelConfig, il: usize) -> LayerResult {
    let mut b = Binder::new(ck, true, false).with_trunk(trunk);
    let layer = bind_layer(&mut b, cfg, il)?;
    match (layer, b.into_result()) {
        (Some(l), Ok(())) => Ok(Arc::new(l)),
        (_, Err(e)) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il}"),
            reason: e.to_string(),
        }),
        (None, Ok(())) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il}"),
            reason: "incomplete layer".into(),
        }),
    }
}

fn load_expert(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    il: usize,
    e: usize,
) -> Result<Expert, StreamError> {
    let mut b = Binder::new(ck, true, true);
    let ex = bind_expert(&mut b, cfg, il, e)?;
    match (ex, b.into_result()) {
        (Some(x), Ok(())) => Ok(x),
        (_, r) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il} expert {e}"),
            reason: r
                .err()
                .map_or_else(|| "incomplete expert".into(), |e| e.to_string()),
        }),
    }
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

/// A dense chunk of rows as the kernels take it (BF16 stays BF16).
fn dense_rows(raw: &[u8], dtype: Dtype, rows: usize, cols: usize) -> Dense {
    let data = match dtype {
        Dtype::Bf16 => DenseData::Bf16(
            raw.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        _ => {
            let mut v = vec![0f32; rows * cols];
            widen(raw, dtype, &mut v);
            DenseData::F32(v)
        }
    };
    Dense { data, rows, cols }
}

impl Streamer {
    /// Start streaming `ck` under `plan` (pinned weights are read now).
    pub fn new(
        cfg: ModelConfig,
        ck: Arc<Checkpoint>,
        trunk: Option<Arc<Trunk>>,
        sizes: ModelSizes,
        plan: Plan,
    ) -> Result<Streamer, StreamError> {
        let (tx, rx) = channel::<(usize, Sender<LayerResult>)>();
        let (ck2, cfg2, trunk2) = (Arc::clone(&ck), cfg.clone(), trunk.clone());
        std::thread::Builder::new()
            .name("k3-reader".into())
            .spawn(move || {
                while let Ok((il, reply)) = rx.recv() {
                    let _ = reply.send(load_layer(&ck2, trunk2.as_deref(), &cfg2, il));
                }
            })
            .map_err(|e| StreamError::Open {
                path: ck.dir().to_path_buf(),
                source: e,
            })?;
        let n = cfg.num_hidden_layers;
        let n_exp = cfg.num_experts;
        let st = Streamer {
            cfg,
            ck,
            trunk,
            sizes,
            resident: Mutex::new(Resident {
                plan: plan.clone(),
                pinned: vec![None; n],
                head: None,
                cache: ExpertCache::new(plan.expert_slots as usize, n, n_exp),
            }),
            ring: Mutex::new(Ring {
                tx,
                pending: VecDeque::new(),
            }),
            counters: Counters::default(),
        };
        st.set_plan(plan)?;
        Ok(st)
    }

    /// The plan in force.
    #[must_use]
    pub fn plan(&self) -> Plan {
        lock(&self.resident).plan.clone()
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
        let mut r = lock(&self.resident);
        for (il, slot) in r.pinned.iter_mut().enumerate() {
            if !plan.pinned.get(il).copied().unwrap_or(false) {
                *slot = None;
            }
        }
        if !plan.head_resident {
            r.head = None;
        }
        r.cache.slots = plan.expert_slots as usize;
        r.cache.make_room(0, &[]);
        r.plan = plan;
        let to_pin: Vec<usize> = (0..r.pinned.len())
            .filter(|&il| r.plan.pinned[il] && r.pinned[il].is_none())
            .collect();
        let want_head = r.plan.head_resident && r.head.is_none();
        drop(r);
        // Drop read-ahead that the new plan no longer needs.
        lock(&self.ring).pending.clear();
        for il in to_pin {
            let t0 = Instant::now();
            let layer = load_layer(&self.ck, self.trunk.as_deref(), &self.cfg, il)?;
            self.note_io(t0, self.sizes.layer_trunk[il], &self.counters.trunk_bytes);
            lock(&self.resident).pinned[il] = Some(layer);
        }
        if want_head {
            let t0 = Instant::now();
            let (info, data) = self.ck.read(names::LM_HEAD)?;
            self.note_io(t0, info.n_bytes(), &self.counters.embed_head_bytes);
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
            lock(&self.resident).head = Some(Arc::new(dense));
        }
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
        let (is_pinned, held, pinned_map, ring_slots) = {
            let r = lock(&self.resident);
            (
                r.plan.pinned[il],
                r.pinned[il].clone(),
                r.plan.pinned.clone(),
                r.plan.ring_slots,
            )
        };
        if let Some(l) = held {
            return Ok(l);
        }
        let t0 = Instant::now();
        let layer = if is_pinned {
            let l = load_layer(&self.ck, self.trunk.as_deref(), &self.cfg, il)?;
            lock(&self.resident).pinned[il] = Some(Arc::clone(&l));
            l
        } else {
            let waiting = {
                let mut ring = lock(&self.ring);
                while ring.pending.front().is_some_and(|(j, _)| *j != il) {
                    ring.pending.pop_front();
                }
                ring.pending.pop_front()
            };
            match waiting.and_then(|(_, rx)| rx.recv().ok()) {
                Some(result) => result?,
                None => load_layer(&self.ck, self.trunk.as_deref(), &self.cfg, il)?,
            }
        };
        if !is_pinned || t0.elapsed().as_nanos() > 0 {
            self.note_io(t0, self.sizes.layer_trunk[il], &self.counters.trunk_bytes);
        }
        // Read ahead: keep up to ring_slots − 1 streamed layers in flight.
        let mut ring = lock(&self.ring);
        let mut at = il;
        while (ring.pending.len() as u64) + 1 < ring_slots.max(1) {
            let Some(next) = self.next_streamed(at, &pinned_map) else {
                break;
            };
            if next == il || ring.pending.iter().any(|(j, _)| *j == next) {
                break;
            }
            let (tx, rx) = channel();
            if ring.tx.send((next, tx)).is_err() {
                break;
            }
            ring.pending.push_back((next, rx));
            at = next;
        }
        Ok(layer)
    }

    /// Fetch the routed experts `ids` of layer `il` (misses are read in parallel).
    fn experts(&self, il: usize, ids: &[usize]) -> Result<Vec<Arc<Expert>>, StreamError> {
        let keys: Vec<(usize, usize)> = ids.iter().map(|&e| (il, e)).collect();
        let mut found: Vec<Option<Arc<Expert>>> = Vec::with_capacity(ids.len());
        let mut misses = Vec::new();
        {
            let mut r = lock(&self.resident);
            for (i, &k) in keys.iter().enumerate() {
                let ex = r.cache.hit(k);
                if ex.is_none() {
                    misses.push(i);
                }
                found.push(ex);
            }
        }
        self.counters
            .hits
            .fetch_add((ids.len() - misses.len()) as u64, Ordering::Relaxed);
        self.counters
            .misses
            .fetch_add(misses.len() as u64, Ordering::Relaxed);
        if !misses.is_empty() {
            let t0 = Instant::now();
            let read = || {
                misses
                    .par_iter()
                    .map(|&i| load_expert(&self.ck, &self.cfg, il, ids[i]))
                    .collect()
            };
            // Without an I/O pool (threads refused), the compute pool reads.
            let loaded: Vec<Result<Expert, StreamError>> = match io_pool() {
                Some(pool) => pool.install(read),
                None => read(),
            };
            self.note_io(
                t0,
                self.sizes.expert_bytes * misses.len() as u64,
                &self.counters.expert_bytes,
            );
            let mut r = lock(&self.resident);
            r.cache.make_room(misses.len(), &keys);
            for (&i, ex) in misses.iter().zip(loaded) {
                let ex = Arc::new(ex?);
                r.cache.insert(keys[i], Arc::clone(&ex));
                found[i] = Some(ex);
            }
        }
        found
            .into_iter()
            .zip(ids)
            .map(|(f, &e)| {
                f.ok_or_else(|| StreamError::Unrepresentable {
                    path: self.ck.dir().to_path_buf(),
                    name: format!("layer {il} expert {e}"),
                    reason: "expert not loaded".into(),
                })
            })
            .collect()
    }

    /// The MoE block of layer `il` with experts from the cache.
    pub fn moe(
        &self,
        il: usize,
        w: &MoeWeights,
        p: &MoeParams,
        x: &[f32],
    ) -> Result<(Vec<f32>, Routing), StreamError> {
        let group = lock(&self.resident).cache.slots.max(p.top_k);
        moe::forward_with(w, p, x, group, &mut |ids| self.experts(il, ids))
    }

    /// Embedding rows of `tokens`, read on demand: `[n_tok, hidden]`.
    pub fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>, StreamError> {
        let d = self.cfg.hidden_size;
        let mut x = vec![0f32; tokens.len() * d];
        let mut buf = Vec::new();
        let t0 = Instant::now();
        for (row, &id) in x.chunks_mut(d).zip(tokens) {
            let rb = self.sizes.row_bytes;
            let info = self
                .ck
                .read_span(names::EMBED, u64::from(id) * rb, rb, &mut buf)?;
            widen(&buf, info.dtype, row);
        }
        self.note_io(
            t0,
            self.sizes.row_bytes * tokens.len() as u64,
            &self.counters.embed_head_bytes,
        );
        Ok(x)
    }

    /// Logits for `rows` `[n, hidden]`: from the pinned head, or streamed chunk by chunk.
    pub fn head(&self, rows: &[f32]) -> Result<Vec<f32>, StreamError> {
        let (v, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let n = rows.len() / d;
        let mut logits = vec![0f32; n * v];
        let (head, chunk_rows) = {
            let r = lock(&self.resident);
            (r.head.clone(), r.plan.head_chunk_rows.max(1) as usize)
        };
        if let Some(h) = head {
            kernels::matmul(h.view(), v, d, rows, &mut logits);
            return Ok(logits);
        }
        let mut buf = Vec::new();
        let rb = self.sizes.row_bytes;
        for r0 in (0..v).step_by(chunk_rows) {
            let cr = chunk_rows.min(v - r0);
            let t0 = Instant::now();
            let info =
                self.ck
                    .read_span(names::LM_HEAD, r0 as u64 * rb, cr as u64 * rb, &mut buf)?;
            self.note_io(t0, cr as u64 * rb, &self.counters.embed_head_bytes);
            let chunk = dense_rows(&buf, info.dtype, cr, d);
            let mut part = vec![0f32; n * cr];
            kernels::matmul(chunk.view(), cr, d, rows, &mut part);
            for t in 0..n {
                logits[t * v + r0..t * v + r0 + cr].copy_from_slice(&part[t * cr..(t + 1) * cr]);
            }
        }
        Ok(logits)
    }

    /// Figures for the stats panes (the engine-side part).
    #[must_use]
    pub fn stats(&self) -> StatsSnapshot {
        let r = lock(&self.resident);
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
        let c = &self.counters;
        let read = c.trunk_bytes.load(Ordering::Relaxed)
            + c.expert_bytes.load(Ordering::Relaxed)
            + c.embed_head_bytes.load(Ordering::Relaxed);
        StatsSnapshot {
            budget_bytes: r.plan.budget_bytes,
            model_bytes: r.plan.model_bytes,
            disk_bytes_read: read,
            expert_hits: c.hits.load(Ordering::Relaxed),
            expert_misses: c.misses.load(Ordering::Relaxed),
            layers,
            io_wait_seconds: c.io_wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            ..StatsSnapshot::default()
        }
    }
}
