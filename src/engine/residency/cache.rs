//! The routed-expert cache (which expert each slot holds, what is in flight, the last
//! predictions), what the plan keeps in memory, and the counters of what was read.
//!
//! Lock order: `Resident` (which owns the cache) is taken before the prefetch queue's state
//! (`super::prefetch`); nothing here takes another lock.

use super::leaf::Leaf;
use crate::engine::layer::Layer;
use crate::engine::moe::Expert;
use crate::engine::tensor::Dense;
use crate::stream::arena::Arena;
use crate::stream::budget::Plan;
use crate::stream::cache_policy::{
    CycleQueue, ExpertKey, KeySpace, LayerCycle, Lookup, Lru, Policy, SlotState, SlotTable,
};
use crate::stream::StreamError;
use crate::tuning::{CachePolicy, Tuning};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar};

use super::expert_io::rehome_expert;

/// Counters of what was read and how long the engine waited.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) trunk_bytes: AtomicU64,
    pub(super) expert_bytes: AtomicU64,
    pub(super) embed_head_bytes: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) io_wait_ns: AtomicU64,
    pub(super) prefetch_reads: AtomicU64,
    pub(super) prefetch_used: AtomicU64,
    pub(super) predicted: AtomicU64,
    pub(super) predicted_right: AtomicU64,
    /// Predictions checked against their layer's routing.
    pub(super) predictions: AtomicU64,
    /// The same for the early predictions (from the previous layer's FFN input); the counts
    /// by rank are kept with the resident set ([`Resident::right_by_rank`]).
    pub(super) early_predictions: AtomicU64,
    /// Predicted reads dropped from the queue before they started.
    pub(super) prefetch_cancelled: AtomicU64,
}

/// The routed-expert cache: the slot table of `stream::cache_policy` (the bookkeeping whose
/// hit rates the replay measures) driven by its replacement policy ([`CycleQueue`] by
/// default, `K3_CACHE_POLICY=layer-cycle` or `lru` for the scanning ones), and the expert each
/// slot holds. A miss
/// reserves its slot before the read starts (never a victim while in flight); the read's
/// bytes become the slot's expert when it completes.
pub(super) struct ExpertCache {
    pub(super) table: SlotTable<Box<dyn Policy + Send>>,
    pub(super) held: Vec<Option<Arc<Expert>>>,
    pub(super) per_layer: Vec<u32>,
    pub(super) now: u64,
    /// Slots being filled by a prefetch, with the requests waiting for them.
    pub(super) waiting: HashMap<usize, Waiters>,
    /// Slots filled (or being filled) by a prefetch that no request has asked for yet.
    pub(super) prefetched: Vec<bool>,
    /// The last prediction, checked against its layer's routing.
    pub(super) prediction: Prediction,
    /// The last early prediction (from the previous layer's FFN input): (layer, experts).
    pub(super) early_prediction: Prediction,
}

/// A prediction of a layer's experts (every rank, the most likely first), kept until that
/// layer's routing is known; its buffer is reused.
#[derive(Debug, Default)]
pub(super) struct Prediction {
    pub(super) layer: Option<usize>,
    pub(super) ids: Vec<usize>,
}

impl Prediction {
    pub(super) fn set(&mut self, layer: usize, ids: &[usize]) {
        self.layer = Some(layer);
        self.ids.clear();
        self.ids.extend_from_slice(ids);
    }

    /// The prediction, when it was made for layer `il`; either way it is used up.
    pub(super) fn take_for(&mut self, il: usize) -> Option<&[usize]> {
        (self.layer.take() == Some(il)).then_some(&self.ids[..])
    }
}

/// A completed read, sent to the request that waits for it.
pub(super) enum Arrival {
    /// The request's own read into `slot` (None: uncached) of its `k`-th expert.
    Read {
        k: usize,
        slot: Option<usize>,
        result: Result<Arc<Expert>, StreamError>,
    },
    /// A prefetch the request waited for (already in the cache); None if that read failed.
    Shared {
        k: usize,
        expert: Option<Arc<Expert>>,
    },
}

/// Requests waiting for a prefetch: where to leave it, and which of their experts it is.
pub(super) type Waiters = Vec<(Arc<Mailbox>, usize)>;

/// Where a request's arrivals are left: a queue made once, with room for every expert of a
/// request, and a condition variable the request waits on. Neither sending nor waiting
/// allocates (a channel's receiver registers itself in a list the first time it blocks).
pub(super) struct Mailbox {
    queue: Leaf<VecDeque<Arrival>>,
    landed: Condvar,
}

impl std::fmt::Debug for Mailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailbox").finish_non_exhaustive()
    }
}

impl Mailbox {
    /// A mailbox with room for `room` arrivals before its queue grows.
    pub(super) fn new(room: usize) -> Arc<Mailbox> {
        Arc::new(Mailbox {
            queue: Leaf::new(VecDeque::with_capacity(room)),
            landed: Condvar::new(),
        })
    }

    /// Leave an arrival.
    pub(super) fn send(&self, a: Arrival) {
        self.queue.lock().push_back(a);
        self.landed.notify_one();
    }

    /// The next arrival, waited for.
    pub(super) fn recv(&self) -> Arrival {
        let mut q = self.queue.lock();
        loop {
            if let Some(a) = q.pop_front() {
                return a;
            }
            q = q.wait(&self.landed);
        }
    }
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("slots", &self.table.capacity())
            .field("occupied", &self.table.occupied())
            .field("policy", &self.table.policy().name())
            .finish()
    }
}

pub(super) fn key(il: usize, e: usize) -> ExpertKey {
    ExpertKey::new(il as u16, e as u16)
}

/// Where a requested expert comes from.
pub(super) enum Source {
    /// Resident: here it is.
    Hit(Arc<Expert>),
    /// To be read into this reserved slot (None: read without caching it); with the expert
    /// that slot let go, whose memory the read may take over.
    Read(Option<usize>, Option<Arc<Expert>>),
    /// Being read by a prefetch; it arrives with that read.
    Waiting,
}

impl ExpertCache {
    pub(super) fn new(slots: usize, layers: usize, experts: usize) -> Self {
        let space = KeySpace::new(layers, experts);
        let policy: Box<dyn Policy + Send> = match Tuning::get().cache_policy {
            CachePolicy::Lru => Box::new(Lru::new(space)),
            CachePolicy::LayerCycle => Box::new(LayerCycle::new(space)),
            CachePolicy::CycleQueue => Box::new(CycleQueue::new(space)),
        };
        let slots = slots.max(1);
        ExpertCache {
            table: SlotTable::new(space, slots, policy),
            held: vec![None; slots],
            per_layer: vec![0; layers],
            now: 0,
            waiting: HashMap::new(),
            prefetched: vec![false; slots],
            prediction: Prediction::default(),
            early_prediction: Prediction::default(),
        }
    }

    pub(super) fn slots(&self) -> usize {
        self.table.capacity()
    }

    pub(super) fn resident_in(&self, il: usize) -> u32 {
        self.per_layer.get(il).copied().unwrap_or(0)
    }

    /// Look up `ids` of layer `il` into `out`: residents are returned, misses get a reserved
    /// slot, and experts a prefetch is still reading are waited for (`tx` is told when they
    /// land). Residents asked for here are not evicted by the misses that follow them
    /// (`pinned` holds them meanwhile). Returns how many prefetched experts were used.
    pub(super) fn request(
        &mut self,
        il: usize,
        ids: &[usize],
        tx: &Arc<Mailbox>,
        out: &mut Vec<Source>,
        pinned: &mut Vec<usize>,
    ) -> u64 {
        out.clear();
        pinned.clear();
        let mut used = 0;
        for (k, &e) in ids.iter().enumerate() {
            self.now += 1;
            let src = match self.table.request(key(il, e), self.now) {
                Ok(Lookup::Hit { slot }) => {
                    if std::mem::take(&mut self.prefetched[slot]) {
                        used += 1;
                    }
                    match self.held.get(slot).cloned().flatten() {
                        Some(ex) => {
                            if !self.table.is_pinned(slot)
                                && self.table.set_pinned(slot, true).is_ok()
                            {
                                pinned.push(slot);
                            }
                            Source::Hit(ex)
                        }
                        None => match self.waiting.get_mut(&slot) {
                            // A prefetch is reading it: wait for that read.
                            Some(w) => {
                                w.push((Arc::clone(tx), k));
                                Source::Waiting
                            }
                            // In flight for another request: read it again, uncached.
                            None => Source::Read(None, None),
                        },
                    }
                }
                Ok(Lookup::Miss { slot, evicted }) => {
                    let mut spare = None;
                    if let Some(old) = evicted {
                        spare = self.held[slot].take();
                        if let Some(n) = self.per_layer.get_mut(usize::from(old.layer)) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    Source::Read(Some(slot), spare)
                }
                // No slot can be had (every one pinned or in flight): read without caching.
                Err(_) => Source::Read(None, None),
            };
            out.push(src);
        }
        for &slot in pinned.iter() {
            let _ = self.table.set_pinned(slot, false);
        }
        used
    }

    /// Reserve slots for a prefetch of `ids` of layer `il`: the ones neither resident nor in
    /// flight, as long as a slot can be had. Fills `out` with the (layer, expert, slot)
    /// triples to read.
    pub(super) fn reserve_prefetch(
        &mut self,
        il: usize,
        ids: &[usize],
        out: &mut Vec<(usize, usize, usize)>,
    ) {
        out.clear();
        for &e in ids {
            if self.table.slot_of(key(il, e)).is_some() {
                continue;
            }
            self.now += 1;
            match self.table.request(key(il, e), self.now) {
                Ok(Lookup::Miss { slot, evicted }) => {
                    if let Some(old) = evicted {
                        self.held[slot] = None;
                        self.prefetched[slot] = false;
                        if let Some(n) = self.per_layer.get_mut(usize::from(old.layer)) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    self.prefetched[slot] = true;
                    self.waiting.insert(slot, Vec::new());
                    out.push((il, e, slot));
                }
                Ok(Lookup::Hit { .. }) => {}
                Err(_) => break,
            }
        }
    }

    /// A queued prefetch into `slot` that will not be read: the slot is free again.
    pub(super) fn cancel_prefetch(&mut self, slot: usize) {
        self.prefetched[slot] = false;
        self.waiting.remove(&slot);
        self.fail(slot);
    }

    /// A prefetch into `slot` completed: file it, and return it with the requests waiting for
    /// it, to be handed to them once the caller lets the resident set's lock go.
    pub(super) fn complete_prefetch(
        &mut self,
        slot: usize,
        result: Result<Expert, StreamError>,
    ) -> (Option<Arc<Expert>>, Waiters) {
        let expert = match result {
            Ok(ex) => {
                let ex = Arc::new(ex);
                self.publish(slot, &ex);
                Some(ex)
            }
            Err(_) => {
                self.prefetched[slot] = false;
                self.fail(slot);
                None
            }
        };
        (expert, self.waiting.remove(&slot).unwrap_or_default())
    }

    /// The read into `slot` completed with `ex`.
    pub(super) fn publish(&mut self, slot: usize, ex: &Arc<Expert>) {
        if let Ok(k) = self.table.publish(slot) {
            self.held[slot] = Some(Arc::clone(ex));
            if let Some(n) = self.per_layer.get_mut(usize::from(k.layer)) {
                *n += 1;
            }
        }
    }

    /// The read into `slot` failed: the slot is free again.
    pub(super) fn fail(&mut self, slot: usize) {
        let _ = self.table.fail(slot);
    }

    /// Move the experts held in slots of `arena` that a smaller plan retired into usable
    /// ones (the same bytes, so the same products; the arena counts them).
    pub(super) fn rehome(&mut self, arena: &Arc<Arena>) {
        for h in &mut self.held {
            let Some(ex) = h.as_ref() else { continue };
            if let Some(moved) = rehome_expert(ex, arena) {
                *h = Some(Arc::new(moved));
            }
        }
    }

    /// Change the number of slots (between forward passes).
    pub(super) fn resize(&mut self, slots: usize) {
        let slots = slots.max(1);
        if slots == self.slots() {
            return;
        }
        if let Ok(r) = self.table.resize(slots) {
            for k in &r.evicted {
                if let Some(n) = self.per_layer.get_mut(usize::from(k.layer)) {
                    *n = n.saturating_sub(1);
                }
            }
            let mut held = std::mem::take(&mut self.held);
            held.resize(held.len().max(slots), None);
            for &(from, to) in &r.moved {
                held[to] = held[from].take();
            }
            held.truncate(slots);
            self.prefetched = vec![false; slots];
            // Slots the table emptied (evicted) drop their expert.
            for (s, h) in held.iter_mut().enumerate() {
                if !matches!(self.table.state(s), Some(SlotState::Resident(_))) {
                    *h = None;
                }
            }
            self.held = held;
        }
    }
}

/// What the plan keeps in memory.
#[derive(Debug)]
pub(super) struct Resident {
    pub(super) plan: Plan,
    /// `plan.pinned`, shared with the read-ahead (which looks ahead without the lock).
    pub(super) pinned_map: Arc<[bool]>,
    pub(super) pinned: Vec<Option<Arc<Layer>>>,
    pub(super) head: Option<Arc<Dense>>,
    pub(super) cache: ExpertCache,
    /// Per rank of a prediction (the most likely first): how often its layer chose it.
    pub(super) right_by_rank: Vec<u64>,
    /// The same for the early predictions.
    pub(super) early_right_by_rank: Vec<u64>,
    /// Predicted reads queued and reads in flight.
    pub(super) prefetch: super::prefetch::PrefetchState,
}
