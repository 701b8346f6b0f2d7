//! Replacement policies for the routed-expert cache and the slot bookkeeping they plug into
//! (docs/runtime.md#expert-cache).
//!
//! A [`Policy`] only ranks resident experts; it never sees bytes. [`SlotTable`] is the
//! bookkeeping half of the slot arena: which key lives in which slot, which slots are empty,
//! reserved for a read in flight, or pinned, and which slot a request gets. Pinned and
//! in-flight slots are never offered to the policy as eviction candidates, nor reported
//! evictable to a policy that keeps its own index ([`Policy::indexed`]); a victim such a
//! policy names that is not evictable is refused, never evicted.
//!
//! Three policies:
//! - [`Lru`]: evict the least recently used expert (the reference engine's policy).
//! - [`LayerCycle`]: the layer-cycle estimate, better than LRU. A token visits the MoE layers in a fixed order,
//!   so an expert of layer `l` cannot be used again before layer `l` comes round again, and
//!   LRU, which keeps what was just used, evicts exactly what the next token needs whenever the
//!   cache is smaller than one token's working set. `LayerCycle` estimates each resident
//!   expert's next use as "when its layer is next visited, plus whole cycles while it is not
//!   chosen": `next ≈ start of the layer's last visit + period / p`, where `period` is the
//!   measured time between two visits of the same layer and `p` the fraction of its layer's
//!   visits (since the expert was first seen, with one prior miss and slow aging) in which the
//!   expert was used. It evicts the largest estimate. Experts of the layer being visited now are
//!   evicted last (LRU among them), because the rest of the visit may still ask for them. It
//!   scans every candidate at each eviction, so a victim costs O(slots).
//! - [`CycleQueue`]: the engine's policy. The same estimate, kept in a bucket queue and
//!   refreshed only when an expert is used or the visit in which it was expected ends without
//!   it, so a victim costs a bounded number of steps at any cache size (O(1) amortised work per
//!   request). It names its victims itself ([`Policy::indexed`]): the [`SlotTable`] tells it
//!   which experts are evictable instead of offering it the candidates.
//!
//! On the recorded trace of the released model (100,096 requests) `LayerCycle` comes within
//! half a percentage point of Belady's MIN (the offline ceiling, which needs the whole future)
//! at every size from 8 to 128 GB, where LRU is flat at 36.24% up to 64 GB, and `CycleQueue`
//! within 0.06 points of `LayerCycle` (0.25 in decode order). The replay, Belady and the
//! `hit_rate_table` test that prints the table are in `tests/integration/cache_policy.rs`.

/// Identity of one routed expert: the MoE layer and the expert index within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Layer index (the released model's MoE layers are 1..=92).
    pub layer: u16,
    /// Expert index within the layer (0..896 on the released model).
    pub expert: u16,
}

impl ExpertKey {
    /// The key of expert `expert` of layer `layer`.
    #[must_use]
    pub const fn new(layer: u16, expert: u16) -> Self {
        ExpertKey { layer, expert }
    }
}

/// Dense numbering of expert keys (`layer × experts + expert`), used to size per-key tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpace {
    layers: usize,
    experts: usize,
}

impl KeySpace {
    /// The released model: layer indices 0..=92 (layer 0 is dense), 896 experts per layer.
    pub const K3: KeySpace = KeySpace {
        layers: 93,
        experts: 896,
    };

    /// A space of `layers` layer indices (0..layers) with `experts` experts each.
    #[must_use]
    pub const fn new(layers: usize, experts: usize) -> Self {
        KeySpace { layers, experts }
    }

    /// The smallest space that holds every key of `keys`.
    #[must_use]
    pub fn covering(keys: &[ExpertKey]) -> Self {
        let layers = keys.iter().map(|k| usize::from(k.layer) + 1).max();
        let experts = keys.iter().map(|k| usize::from(k.expert) + 1).max();
        KeySpace {
            layers: layers.unwrap_or(0),
            experts: experts.unwrap_or(0),
        }
    }

    /// Number of layer indices.
    #[must_use]
    pub const fn layers(&self) -> usize {
        self.layers
    }

    /// Number of experts per layer.
    #[must_use]
    pub const fn experts(&self) -> usize {
        self.experts
    }

    /// Number of keys.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.layers * self.experts
    }

    /// Whether the space holds no key.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dense index of `key`, or `None` when it lies outside the space.
    #[must_use]
    pub fn index(&self, key: ExpertKey) -> Option<usize> {
        let (l, e) = (usize::from(key.layer), usize::from(key.expert));
        (l < self.layers && e < self.experts).then_some(l * self.experts + e)
    }
}

/// A replacement policy: told about every hit, insertion and eviction, asked for a victim.
///
/// `now` is a request counter that never decreases (the position in the request stream).
/// Keys outside the policy's [`KeySpace`] are tolerated: their updates are ignored and they are
/// the first victims.
pub trait Policy {
    /// Short name for tables and logs.
    fn name(&self) -> &'static str;
    /// `key` was requested at `now` and was resident.
    fn on_hit(&mut self, key: ExpertKey, now: u64);
    /// `key` was requested at `now`, was not resident, and now occupies a slot (possibly still
    /// being read).
    fn on_insert(&mut self, key: ExpertKey, now: u64);
    /// `key` left the cache (evicted, or its read failed).
    fn on_evict(&mut self, _key: ExpertKey) {}
    /// The position in `candidates` of the expert to evict, or `None` when `candidates` is
    /// empty. Every candidate is resident and evictable (neither pinned nor in flight).
    fn victim(&self, candidates: &[ExpertKey]) -> Option<usize>;
    /// Whether the policy keeps its own index of the evictable experts (told through
    /// [`Policy::on_evictable`]) and names victims with [`Policy::pick`], so that no caller
    /// has to offer it every candidate.
    fn indexed(&self) -> bool {
        false
    }
    /// `key` became evictable (resident and not pinned) or stopped being so. Called for every
    /// change, after `on_insert` and before or after `on_evict`.
    fn on_evictable(&mut self, _key: ExpertKey, _evictable: bool) {}
    /// For an [`indexed`](Policy::indexed) policy: the evictable expert to evict, or `None`
    /// when there is none.
    fn pick(&mut self) -> Option<ExpertKey> {
        None
    }
}

impl<P: Policy + ?Sized> Policy for Box<P> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn on_hit(&mut self, key: ExpertKey, now: u64) {
        (**self).on_hit(key, now);
    }

    fn on_insert(&mut self, key: ExpertKey, now: u64) {
        (**self).on_insert(key, now);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        (**self).on_evict(key);
    }

    fn victim(&self, candidates: &[ExpertKey]) -> Option<usize> {
        (**self).victim(candidates)
    }

    fn indexed(&self) -> bool {
        (**self).indexed()
    }

    fn on_evictable(&mut self, key: ExpertKey, evictable: bool) {
        (**self).on_evictable(key, evictable);
    }

    fn pick(&mut self) -> Option<ExpertKey> {
        (**self).pick()
    }
}

/// Position of the candidate with the largest score (the first one on ties).
fn argmax_by<T, F>(candidates: &[ExpertKey], mut score: F) -> Option<usize>
where
    F: FnMut(ExpertKey) -> T,
    T: PartialOrd,
{
    let (&first, rest) = candidates.split_first()?;
    let (mut best, mut best_score) = (0, score(first));
    for (i, &key) in rest.iter().enumerate() {
        let s = score(key);
        if s > best_score {
            best = i + 1;
            best_score = s;
        }
    }
    Some(best)
}

mod cycle_queue;
pub use cycle_queue::{CycleQueue, CycleQueueStats};

/// Least recently used.
#[derive(Clone, Debug)]
pub struct Lru {
    space: KeySpace,
    last_used: Vec<u64>,
}

impl Lru {
    /// An LRU policy over `space`.
    #[must_use]
    pub fn new(space: KeySpace) -> Self {
        Lru {
            space,
            last_used: vec![0; space.len()],
        }
    }

    fn touch(&mut self, key: ExpertKey, now: u64) {
        if let Some(i) = self.space.index(key) {
            self.last_used[i] = now;
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_hit(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn on_insert(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn victim(&self, candidates: &[ExpertKey]) -> Option<usize> {
        argmax_by(candidates, |k| match self.space.index(k) {
            Some(i) => u64::MAX - self.last_used[i],
            None => u64::MAX,
        })
    }
}

/// Per-expert usage counts of [`LayerCycle`] (read for every candidate, so kept small).
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    /// Visits of the expert's layer (halved when aged) in which it was used, since `base`.
    uses: u32,
    /// Layer-visit number at which the counting window starts.
    base: u32,
}

/// Per-layer state of [`LayerCycle`].
#[derive(Clone, Copy, Debug, Default)]
struct CycleLayer {
    /// Visits so far (a visit is a maximal run of consecutive requests to the layer).
    visits: u32,
    /// Request time at which the current or last visit started.
    start: u64,
}

/// Layer-cycle aware, online policy (see the module documentation).
///
/// Evicts the resident expert with the latest estimated next use,
/// `start of its layer's last visit + period / p`, where `p` = visits using the expert ÷
/// (its layer's visits since the expert was first seen + 1) and `period` is the last measured
/// time between two visits of one layer. Experts of the layer being visited are evicted last,
/// least recently used first. Counts are halved once an expert's window exceeds the aging
/// horizon ([`LayerCycle::DEFAULT_HORIZON`] visits), so usage that has moved on is forgotten.
#[derive(Clone, Debug)]
pub struct LayerCycle {
    space: KeySpace,
    usage: Vec<Usage>,
    /// Layer-visit number of each expert's last use; 0 before the first (visits count from 1).
    used_in: Vec<u32>,
    /// Last request time of each expert.
    last: Vec<u64>,
    layers: Vec<CycleLayer>,
    current: Option<u16>,
    period: u64,
    horizon: u32,
}

impl LayerCycle {
    /// Layer visits after which an expert's usage counts are halved.
    pub const DEFAULT_HORIZON: u32 = 128;

    /// A layer-cycle policy over `space` with the default aging horizon.
    #[must_use]
    pub fn new(space: KeySpace) -> Self {
        Self::with_horizon(space, Self::DEFAULT_HORIZON)
    }

    /// A layer-cycle policy whose usage counts are halved every `horizon` layer visits (at
    /// least 2).
    #[must_use]
    pub fn with_horizon(space: KeySpace, horizon: u32) -> Self {
        LayerCycle {
            space,
            usage: vec![Usage::default(); space.len()],
            used_in: vec![0; space.len()],
            last: vec![0; space.len()],
            layers: vec![CycleLayer::default(); space.layers()],
            current: None,
            period: 0,
            horizon: horizon.max(2),
        }
    }

    /// The estimated probability that `key` is used in the next visit of its layer, or `None`
    /// for a key outside the space.
    #[must_use]
    pub fn reuse_estimate(&self, key: ExpertKey) -> Option<f64> {
        let i = self.space.index(key)?;
        let u = self.usage[i];
        Some(f64::from(u.uses) / f64::from(self.window(key.layer, u)))
    }

    /// The last measured number of requests between the starts of two visits of one layer.
    #[must_use]
    pub fn period(&self) -> u64 {
        self.period
    }

    /// Visits of `layer` since the expert was first seen (or since its aged base), plus one
    /// prior visit without a use.
    fn window(&self, layer: u16, u: Usage) -> u32 {
        let visits = self.layers[usize::from(layer)].visits;
        visits.saturating_sub(u.base).saturating_add(2)
    }

    fn touch(&mut self, key: ExpertKey, now: u64) {
        let Some(i) = self.space.index(key) else {
            return;
        };
        let layer = &mut self.layers[usize::from(key.layer)];
        if self.current != Some(key.layer) {
            if layer.visits > 0 {
                self.period = now.saturating_sub(layer.start);
            }
            layer.visits = layer.visits.saturating_add(1);
            layer.start = now;
            self.current = Some(key.layer);
        }
        let visit = layer.visits;
        self.last[i] = now;
        if self.used_in[i] == visit {
            return;
        }
        let u = &mut self.usage[i];
        if self.used_in[i] == 0 {
            u.base = visit;
        }
        self.used_in[i] = visit;
        u.uses = u.uses.saturating_add(1);
        let span = visit.saturating_sub(u.base).saturating_add(1);
        if span > self.horizon {
            u.uses = u.uses.div_ceil(2);
            u.base = visit - span / 2;
        }
    }

    /// Estimated time of the next use of a key of a layer other than the current one.
    fn next_use(&self, key: ExpertKey) -> f64 {
        let Some(i) = self.space.index(key) else {
            return f64::INFINITY;
        };
        let u = self.usage[i];
        // start + period / p, with p = uses / window (x / 0 = infinity: never used).
        let start = self.layers[usize::from(key.layer)].start;
        let cycles = f64::from(self.window(key.layer, u)) / f64::from(u.uses);
        start as f64 + self.period as f64 * cycles
    }
}

impl Policy for LayerCycle {
    fn name(&self) -> &'static str {
        "layer-cycle"
    }

    fn on_hit(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn on_insert(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn victim(&self, candidates: &[ExpertKey]) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (i, &key) in candidates.iter().enumerate() {
            if Some(key.layer) == self.current {
                continue;
            }
            let t = self.next_use(key);
            if best.is_none_or(|(_, b)| t > b) {
                best = Some((i, t));
            }
        }
        if best.is_some() {
            return best.map(|(i, _)| i);
        }
        // Only the current layer is left: least recently used first.
        argmax_by(candidates, |k| match self.space.index(k) {
            Some(i) => u64::MAX - self.last[i],
            None => u64::MAX,
        })
    }
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing; free for the next miss.
    Empty,
    /// Reserved for `key`, whose read has not completed; never a victim.
    InFlight(ExpertKey),
    /// Holds `key`.
    Resident(ExpertKey),
}

/// The slot a request was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The expert is resident (or already being read) in `slot`.
    Hit {
        /// Its slot.
        slot: usize,
    },
    /// The expert was not resident; `slot` is now reserved for it (in flight).
    Miss {
        /// The reserved slot.
        slot: usize,
        /// The expert evicted to make room, if the slot was not empty.
        evicted: Option<ExpertKey>,
    },
}

/// A slot-table operation that cannot be done.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlotError {
    /// Every slot is pinned or in flight, so nothing can be evicted.
    #[error("expert cache: all {slots} slots are pinned or in flight, nothing can be evicted")]
    NoVictim {
        /// Slots in the table.
        slots: usize,
    },
    /// The key lies outside the table's key space.
    #[error("expert cache: layer {} expert {} is outside the cache's key space", .0.layer, .0.expert)]
    OutOfSpace(ExpertKey),
    /// The slot index does not exist or is not in the state the operation needs.
    #[error("expert cache: slot {slot} is not {expected}")]
    BadSlot {
        /// The slot.
        slot: usize,
        /// The state the operation needed.
        expected: &'static str,
    },
    /// A resize was asked while reads were in flight (resize only between forward passes).
    #[error("expert cache: cannot resize while {0} read(s) are in flight")]
    InFlight(usize),
    /// A resize would leave fewer slots than pinned experts, or no slot at all.
    #[error("expert cache: cannot shrink to {slots} slots with {pinned} pinned")]
    TooSmall {
        /// Requested slots.
        slots: usize,
        /// Pinned slots.
        pinned: usize,
    },
}

/// What a resize did: experts evicted, and residents moved from a removed tail slot into a
/// kept one (the arena must copy their bytes `from` → `to` before releasing the tail).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resize {
    /// Experts evicted, in eviction order.
    pub evicted: Vec<ExpertKey>,
    /// `(from, to)` slot moves.
    pub moved: Vec<(usize, usize)>,
}

/// Hit and miss counts of a cache or a replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HitStats {
    /// Requests seen.
    pub requests: u64,
    /// Requests that found their expert resident or in flight.
    pub hits: u64,
    /// Requests that had to read their expert.
    pub misses: u64,
    /// Misses that evicted a resident expert (the others took an empty slot).
    pub evictions: u64,
}

impl HitStats {
    /// Hits as a fraction of requests (0 when there were none).
    #[must_use]
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hits as f64 / self.requests as f64
        }
    }

    /// Hits as a percentage of requests.
    #[must_use]
    pub fn hit_percent(&self) -> f64 {
        100.0 * self.hit_rate()
    }
}

const NO_SLOT: u32 = u32::MAX;

/// Slot bookkeeping of the expert arena, driven by a [`Policy`].
///
/// A miss takes an empty slot if there is one, otherwise the policy's victim among the
/// resident, unpinned slots; the slot is then in flight until [`SlotTable::publish`] (read
/// complete) or [`SlotTable::fail`] (read failed: the slot goes back to empty).
#[derive(Debug)]
pub struct SlotTable<P> {
    space: KeySpace,
    policy: P,
    state: Vec<SlotState>,
    pinned: Vec<bool>,
    slot_of: Vec<u32>,
    free: Vec<u32>,
    /// Resident, unpinned experts: what the policy may evict.
    candidates: Vec<ExpertKey>,
    /// The slot of each candidate.
    candidate_slots: Vec<u32>,
    /// Each slot's position in `candidates`, or `NO_SLOT`.
    candidate_pos: Vec<u32>,
    stats: HitStats,
}

impl<P: Policy> SlotTable<P> {
    /// A table of `slots` empty slots for keys of `space`.
    #[must_use]
    pub fn new(space: KeySpace, slots: usize, policy: P) -> Self {
        let slots = slots.min(NO_SLOT as usize);
        SlotTable {
            space,
            policy,
            state: vec![SlotState::Empty; slots],
            pinned: vec![false; slots],
            slot_of: vec![NO_SLOT; space.len()],
            free: (0..slots as u32).rev().collect(),
            candidates: Vec::new(),
            candidate_slots: Vec::new(),
            candidate_pos: vec![NO_SLOT; slots],
            stats: HitStats::default(),
        }
    }

    /// Number of slots.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.state.len()
    }

    /// Slots holding an expert (resident or in flight).
    #[must_use]
    pub fn occupied(&self) -> usize {
        self.state.len() - self.free.len()
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Counts since the table was made.
    #[must_use]
    pub fn stats(&self) -> HitStats {
        self.stats
    }

    /// What slot `slot` holds, or `None` for a slot that does not exist.
    #[must_use]
    pub fn state(&self, slot: usize) -> Option<SlotState> {
        self.state.get(slot).copied()
    }

    /// The slot holding `key` (resident or in flight).
    #[must_use]
    pub fn slot_of(&self, key: ExpertKey) -> Option<usize> {
        let i = self.space.index(key)?;
        let s = self.slot_of[i];
        (s != NO_SLOT).then_some(s as usize)
    }

    /// Whether `key` is resident (read complete).
    #[must_use]
    pub fn is_resident(&self, key: ExpertKey) -> bool {
        self.slot_of(key)
            .is_some_and(|s| self.state[s] == SlotState::Resident(key))
    }

    /// Pin or unpin a slot: a pinned slot is never evicted (it may still be empty).
    ///
    /// # Errors
    /// [`SlotError::BadSlot`] for a slot that does not exist.
    pub fn set_pinned(&mut self, slot: usize, pinned: bool) -> Result<(), SlotError> {
        let p = self.pinned.get_mut(slot).ok_or(SlotError::BadSlot {
            slot,
            expected: "a slot of this table",
        })?;
        *p = pinned;
        self.sync(slot);
        Ok(())
    }

    /// Whether `slot` is pinned.
    #[must_use]
    pub fn is_pinned(&self, slot: usize) -> bool {
        self.pinned.get(slot).copied().unwrap_or(false)
    }

    /// Request `key` at time `now`: a hit if it is resident or in flight, otherwise reserve a
    /// slot for it (in flight) and tell the caller what was evicted.
    ///
    /// # Errors
    /// [`SlotError::OutOfSpace`] for a key outside the space; [`SlotError::NoVictim`] when the
    /// expert is not resident and every slot is pinned or in flight.
    pub fn request(&mut self, key: ExpertKey, now: u64) -> Result<Lookup, SlotError> {
        let i = self.space.index(key).ok_or(SlotError::OutOfSpace(key))?;
        if self.slot_of[i] != NO_SLOT {
            self.stats.requests += 1;
            self.stats.hits += 1;
            self.policy.on_hit(key, now);
            return Ok(Lookup::Hit {
                slot: self.slot_of[i] as usize,
            });
        }
        let (slot, evicted) = self.take_slot()?;
        self.stats.requests += 1;
        self.stats.misses += 1;
        if let Some(old) = evicted {
            self.stats.evictions += 1;
            self.forget(old);
        }
        self.state[slot] = SlotState::InFlight(key);
        self.sync(slot);
        self.slot_of[i] = slot as u32;
        self.policy.on_insert(key, now);
        Ok(Lookup::Miss { slot, evicted })
    }

    /// The read into `slot` completed: its expert becomes resident.
    ///
    /// # Errors
    /// [`SlotError::BadSlot`] if `slot` is not in flight.
    pub fn publish(&mut self, slot: usize) -> Result<ExpertKey, SlotError> {
        match self.state.get(slot) {
            Some(&SlotState::InFlight(key)) => {
                self.state[slot] = SlotState::Resident(key);
                self.sync(slot);
                Ok(key)
            }
            _ => Err(SlotError::BadSlot {
                slot,
                expected: "in flight",
            }),
        }
    }

    /// The read into `slot` failed: the slot goes back to empty and its expert is not cached.
    ///
    /// # Errors
    /// [`SlotError::BadSlot`] if `slot` is not in flight.
    pub fn fail(&mut self, slot: usize) -> Result<ExpertKey, SlotError> {
        match self.state.get(slot) {
            Some(&SlotState::InFlight(key)) => {
                self.forget(key);
                self.release(slot);
                Ok(key)
            }
            _ => Err(SlotError::BadSlot {
                slot,
                expected: "in flight",
            }),
        }
    }

    /// Request `key` and complete any read at once (for replay and tests): true on a hit.
    ///
    /// # Errors
    /// As [`SlotTable::request`].
    pub fn access(&mut self, key: ExpertKey, now: u64) -> Result<bool, SlotError> {
        match self.request(key, now)? {
            Lookup::Hit { .. } => Ok(true),
            Lookup::Miss { slot, .. } => {
                self.publish(slot)?;
                Ok(false)
            }
        }
    }

    /// Change the number of slots (between forward passes only). Growing adds empty slots and
    /// keeps every expert. Shrinking evicts, in the policy's order, until the residents fit,
    /// then moves residents of removed slots into kept free slots.
    ///
    /// # Errors
    /// [`SlotError::InFlight`] while any read is in flight; [`SlotError::TooSmall`] for zero
    /// slots or fewer slots than pinned ones that hold an expert.
    pub fn resize(&mut self, slots: usize) -> Result<Resize, SlotError> {
        let slots = slots.min(NO_SLOT as usize);
        let in_flight = self
            .state
            .iter()
            .filter(|s| matches!(s, SlotState::InFlight(_)))
            .count();
        if in_flight > 0 {
            return Err(SlotError::InFlight(in_flight));
        }
        let pinned_full = (0..self.capacity())
            .filter(|&s| self.pinned[s] && self.state[s] != SlotState::Empty)
            .count();
        if slots == 0 || pinned_full > slots {
            return Err(SlotError::TooSmall {
                slots,
                pinned: pinned_full,
            });
        }
        let mut out = Resize::default();
        let old = self.capacity();
        if slots >= old {
            self.state.resize(slots, SlotState::Empty);
            self.pinned.resize(slots, false);
            self.rebuild_free();
            self.rebuild_candidates();
            return Ok(out);
        }
        while self.occupied() > slots {
            let (slot, evicted) = self.pick_victim()?;
            if let Some(key) = evicted {
                self.forget(key);
                out.evicted.push(key);
            }
            self.release(slot);
        }
        let mut targets: Vec<usize> = (0..slots)
            .filter(|&s| self.state[s] == SlotState::Empty)
            .collect();
        targets.reverse();
        for from in slots..old {
            if let SlotState::Resident(key) = self.state[from] {
                let to = targets.pop().ok_or(SlotError::TooSmall {
                    slots,
                    pinned: pinned_full,
                })?;
                self.state[to] = SlotState::Resident(key);
                self.pinned[to] = self.pinned[from];
                if let Some(i) = self.space.index(key) {
                    self.slot_of[i] = to as u32;
                }
                out.moved.push((from, to));
            }
        }
        self.state.truncate(slots);
        self.pinned.truncate(slots);
        self.rebuild_free();
        self.rebuild_candidates();
        Ok(out)
    }

    /// Empty slot if any, else the policy's victim among resident unpinned slots. The slot is
    /// not modified.
    fn take_slot(&mut self) -> Result<(usize, Option<ExpertKey>), SlotError> {
        if let Some(s) = self.free.pop() {
            return Ok((s as usize, None));
        }
        self.pick_victim()
    }

    fn pick_victim(&mut self) -> Result<(usize, Option<ExpertKey>), SlotError> {
        let slot = if self.policy.indexed() {
            // The policy's own index; anything it names that is not a candidate (a policy
            // bug) is refused rather than evicted.
            self.policy
                .pick()
                .and_then(|key| self.slot_of(key))
                .filter(|&s| self.candidate_pos[s] != NO_SLOT)
        } else {
            self.policy
                .victim(&self.candidates)
                .and_then(|i| self.candidate_slots.get(i))
                .map(|&s| s as usize)
        };
        match slot.map(|s| (s, self.state[s])) {
            Some((s, SlotState::Resident(key))) if !self.pinned[s] => Ok((s, Some(key))),
            _ => Err(SlotError::NoVictim {
                slots: self.capacity(),
            }),
        }
    }

    /// Make `slot`'s membership of the candidate list match its state and pin.
    fn sync(&mut self, slot: usize) {
        let key = match self.state[slot] {
            SlotState::Resident(key) if !self.pinned[slot] => Some(key),
            _ => None,
        };
        let pos = self.candidate_pos[slot];
        match (key, pos == NO_SLOT) {
            (Some(key), true) => {
                self.candidate_pos[slot] = self.candidates.len() as u32;
                self.candidates.push(key);
                self.candidate_slots.push(slot as u32);
                self.policy.on_evictable(key, true);
            }
            (Some(key), false) => {
                let old = std::mem::replace(&mut self.candidates[pos as usize], key);
                if old != key {
                    self.policy.on_evictable(old, false);
                    self.policy.on_evictable(key, true);
                }
            }
            (None, false) => {
                let pos = pos as usize;
                let old = self.candidates.swap_remove(pos);
                self.policy.on_evictable(old, false);
                self.candidate_slots.swap_remove(pos);
                if let Some(&moved) = self.candidate_slots.get(pos) {
                    self.candidate_pos[moved as usize] = pos as u32;
                }
                self.candidate_pos[slot] = NO_SLOT;
            }
            (None, true) => {}
        }
    }

    fn rebuild_candidates(&mut self) {
        for &key in &self.candidates {
            self.policy.on_evictable(key, false);
        }
        self.candidates.clear();
        self.candidate_slots.clear();
        self.candidate_pos = vec![NO_SLOT; self.capacity()];
        for slot in 0..self.capacity() {
            self.sync(slot);
        }
    }

    /// Drop `key` from the key → slot map and tell the policy.
    fn forget(&mut self, key: ExpertKey) {
        if let Some(i) = self.space.index(key) {
            self.slot_of[i] = NO_SLOT;
        }
        self.policy.on_evict(key);
    }

    fn release(&mut self, slot: usize) {
        self.state[slot] = SlotState::Empty;
        self.sync(slot);
        self.free.push(slot as u32);
    }

    fn rebuild_free(&mut self) {
        self.free = (0..self.capacity())
            .rev()
            .filter(|&s| self.state[s] == SlotState::Empty)
            .map(|s| s as u32)
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(layer: u16, expert: u16) -> ExpertKey {
        ExpertKey::new(layer, expert)
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut p = Lru::new(KeySpace::new(4, 8));
        p.on_insert(k(1, 0), 1);
        p.on_insert(k(1, 1), 2);
        p.on_insert(k(2, 0), 3);
        p.on_hit(k(1, 0), 4);
        let c = [k(1, 0), k(1, 1), k(2, 0)];
        assert_eq!(p.victim(&c), Some(1));
        p.on_hit(k(1, 1), 5);
        assert_eq!(p.victim(&c), Some(2));
        assert_eq!(p.victim(&[]), None);
        // A key outside the space goes first.
        assert_eq!(p.victim(&[k(1, 0), k(9, 0)]), Some(1));
    }

    #[test]
    fn layer_cycle_evicts_the_layer_visited_last_and_protects_the_current_one() {
        let mut p = LayerCycle::new(KeySpace::new(5, 8));
        let mut now = 0;
        let mut visit = |p: &mut LayerCycle, layer: u16, experts: &[u16]| {
            for &e in experts {
                p.on_insert(k(layer, e), now);
                now += 1;
            }
        };
        // Token 1 and 2 visit layers 1, 2, 3; token 3 is at layer 1.
        for _ in 0..2 {
            visit(&mut p, 1, &[0, 1]);
            visit(&mut p, 2, &[0, 1]);
            visit(&mut p, 3, &[0, 1]);
        }
        visit(&mut p, 1, &[0]);
        assert_eq!(p.period(), 6);
        // Equal reuse: layer 3 is needed again last, so it goes first; layer 1 (now) last.
        let c = [k(1, 1), k(2, 0), k(3, 0), k(1, 0)];
        assert_eq!(p.victim(&c), Some(2));
        assert_eq!(p.victim(&[k(1, 1), k(2, 0)]), Some(1));
        // Among the current layer's experts, the least recently used goes.
        assert_eq!(p.victim(&[k(1, 0), k(1, 1)]), Some(1));
    }

    #[test]
    fn layer_cycle_keeps_experts_used_in_more_visits() {
        let mut p = LayerCycle::new(KeySpace::new(4, 8));
        let mut now = 0;
        // Layer 1 expert 0 is used every token, expert 1 only in the first; layer 2 between.
        for token in 0..4 {
            p.on_insert(k(1, 0), now);
            if token == 0 {
                p.on_insert(k(1, 1), now + 1);
            }
            p.on_insert(k(2, 0), now + 2);
            now += 3;
        }
        p.on_insert(k(3, 0), now);
        let (hot, cold) = (p.reuse_estimate(k(1, 0)), p.reuse_estimate(k(1, 1)));
        assert!(hot > cold, "{hot:?} {cold:?}");
        assert_eq!(p.victim(&[k(1, 0), k(1, 1)]), Some(1));
        // An expert seen once a long time ago loses to one used every visit of a nearer layer.
        assert_eq!(p.victim(&[k(2, 0), k(1, 1)]), Some(1));
    }

    #[test]
    fn layer_cycle_ages_old_usage() {
        let mut p = LayerCycle::with_horizon(KeySpace::new(3, 4), 4);
        let mut now = 0;
        for _ in 0..20 {
            p.on_hit(k(1, 0), now);
            p.on_hit(k(2, 0), now + 1);
            now += 2;
        }
        let busy = p.reuse_estimate(k(1, 0)).unwrap();
        assert!((0.5..1.0).contains(&busy), "{busy}");
        for _ in 0..8 {
            p.on_hit(k(1, 1), now);
            p.on_hit(k(2, 0), now + 1);
            now += 2;
        }
        // Eight visits without a use outweigh twenty with one, thanks to the halving.
        let idle = p.reuse_estimate(k(1, 0)).unwrap();
        assert!(idle < 0.35, "{idle}");
    }

    #[test]
    fn shrinking_evicts_by_policy_and_growing_keeps_everything() {
        let space = KeySpace::new(4, 16);
        let mut t = SlotTable::new(space, 6, Lru::new(space));
        for e in 0..6 {
            t.access(k(1, e), u64::from(e)).unwrap();
        }
        // Recency order after these hits: 2, 3, 4, 0, 5, 1 (oldest first).
        t.access(k(1, 0), 6).unwrap();
        t.access(k(1, 5), 7).unwrap();
        t.access(k(1, 1), 8).unwrap();
        let pinned = t.slot_of(k(1, 2)).unwrap();
        t.set_pinned(pinned, true).unwrap();
        let r = t.resize(3).unwrap();
        // Pinned expert 2 stays; the two least recent unpinned ones (3, 4) go, then 0.
        assert_eq!(r.evicted, vec![k(1, 3), k(1, 4), k(1, 0)]);
        assert_eq!(t.capacity(), 3);
        for e in [1, 2, 5] {
            let s = t.slot_of(k(1, e)).unwrap();
            assert!(s < 3);
            assert_eq!(t.state(s), Some(SlotState::Resident(k(1, e))));
        }
        assert!(t.is_pinned(t.slot_of(k(1, 2)).unwrap()));
        for &(from, to) in &r.moved {
            assert!(from >= 3 && to < 3);
        }
        let r = t.resize(8).unwrap();
        assert_eq!(r, Resize::default());
        assert_eq!(t.capacity(), 8);
        for (now, e) in (9..).zip([1, 2, 5]) {
            assert!(t.access(k(1, e), now).unwrap());
        }
        // Five new experts fill the new slots without evicting anything.
        for (now, e) in (20..).zip(6..11) {
            let Lookup::Miss { evicted, slot } = t.request(k(1, e), now).unwrap() else {
                panic!("expected a miss");
            };
            assert_eq!(evicted, None);
            t.publish(slot).unwrap();
        }
        assert_eq!(t.stats().evictions, 0);
        // Refusals: in-flight reads, fewer slots than pinned experts, zero.
        let Lookup::Miss { slot, .. } = t.request(k(1, 12), 30).unwrap() else {
            panic!("expected a miss");
        };
        assert_eq!(t.resize(4), Err(SlotError::InFlight(1)));
        t.publish(slot).unwrap();
        assert!(matches!(t.resize(0), Err(SlotError::TooSmall { .. })));
    }

    #[test]
    fn shrinking_layer_cycle_drops_the_layer_needed_last() {
        let space = KeySpace::new(4, 8);
        let mut t = SlotTable::new(space, 6, LayerCycle::new(space));
        shrink_drops_the_layer_needed_last(&mut t);
        let mut t = SlotTable::new(space, 6, CycleQueue::new(space));
        shrink_drops_the_layer_needed_last(&mut t);
    }

    fn shrink_drops_the_layer_needed_last<P: Policy>(t: &mut SlotTable<P>) {
        let mut now = 0;
        for _ in 0..2 {
            for layer in 1..=3 {
                for e in 0..2 {
                    t.access(k(layer, e), now).unwrap();
                    now += 1;
                }
            }
        }
        t.access(k(1, 0), now).unwrap();
        // At layer 1: layer 3 was visited last, so it is needed furthest in the future.
        let r = t.resize(4).unwrap();
        let mut ev = r.evicted.clone();
        ev.sort_unstable();
        assert_eq!(ev, vec![k(3, 0), k(3, 1)]);
    }
}
