//! [`CycleQueue`]: the layer-cycle estimate of [`LayerCycle`] kept in a bucket queue, so that
//! choosing a victim takes a bounded number of steps however many slots the cache has.
//!
//! Time is counted in *ticks*, one per layer visit (a maximal run of requests to one layer),
//! so the time between two visits of one layer (`period`) is the number of MoE layers a
//! forward pass visits. Usage is counted exactly as [`LayerCycle`] counts it (visits using the
//! expert `u` out of a window of `w` visits of its layer, same aging). Each tracked expert has
//! an estimate, set when it is used and again when the visit of its layer in which it was
//! expected ends without it:
//! - `w / u ≥` [`CycleQueue::COLD`]: *cold*, expected so far ahead that it goes first; it is
//!   not estimated again until it is used;
//! - otherwise `next = start of its layer's visit + period × w / u` (integer arithmetic; the
//!   same number [`LayerCycle`] computes, in ticks), and it is expected in the visit
//!   `due = visit + max(1, w / 2u)` of its layer. When that visit ends without a use, `w` has
//!   grown and both are computed again.
//!
//! [`LayerCycle`] re-evaluates every candidate at each eviction; here an estimate is refreshed
//! every `max(1, w / 2u)` visits of its layer: every visit while `w < 4u` (an expert used in
//! a quarter of its layer's visits or more), then with `w` growing by a factor of at least
//! `1 + 1/4u` between refreshes, until it is cold at `w ≥ 16u`. So the refreshes after a use
//! are at most about `9u` (`u` is at most the aging horizon): the work per request is bounded
//! independently of the number of slots. The tests measure it and the victim search from 1k
//! to 64k slots.
//!
//! The victim is chosen in this order: the cold expert queued longest; else the expert with
//! the latest `next`, the longest queued on ties; else (only experts used in the visit under
//! way are evictable) the least recently used of those. Experts used in the visit under way
//! are held out of the queue until it ends, because the rest of the visit may ask for them
//! again. The queue is a ring of [`CycleQueue::RING`] buckets by `next` modulo the ring, each
//! an intrusive doubly-linked list, with a two-level bitmap of the non-empty buckets;
//! "latest" is measured round the ring from [`CycleQueue::BEHIND`] ticks before the present,
//! so a `next` further in the past than that (its layer has not come round for a long time)
//! counts as the far future. Choosing a victim reads at most 13 bitmap words and list heads;
//! each layer's experts are also listed by `due`, so ending a visit refreshes exactly the
//! experts expected in it.

use super::{ExpertKey, KeySpace, LayerCycle, Policy};

const NIL: u32 = u32::MAX;

/// Intrusive doubly-linked FIFO lists over the dense key indices: each node is in at most one
/// list at a time.
#[derive(Clone, Debug)]
struct Lists {
    next: Vec<u32>,
    prev: Vec<u32>,
    /// The list each node is in, or `NIL`.
    list_of: Vec<u32>,
    head: Vec<u32>,
    tail: Vec<u32>,
}

impl Lists {
    fn new(nodes: usize, lists: usize) -> Self {
        Lists {
            next: vec![NIL; nodes],
            prev: vec![NIL; nodes],
            list_of: vec![NIL; nodes],
            head: vec![NIL; lists],
            tail: vec![NIL; lists],
        }
    }

    fn is_empty(&self, list: usize) -> bool {
        self.head[list] == NIL
    }

    fn push_back(&mut self, list: usize, node: usize) {
        debug_assert_eq!(self.list_of[node], NIL);
        let (l, n) = (list as u32, node as u32);
        self.list_of[node] = l;
        self.next[node] = NIL;
        self.prev[node] = self.tail[list];
        match self.tail[list] {
            NIL => self.head[list] = n,
            t => self.next[t as usize] = n,
        }
        self.tail[list] = n;
    }

    /// Unlink `node` from its list; returns the list it was in (now possibly empty).
    fn remove(&mut self, node: usize) -> Option<usize> {
        let list = self.list_of[node];
        if list == NIL {
            return None;
        }
        let (p, n) = (self.prev[node], self.next[node]);
        match p {
            NIL => self.head[list as usize] = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail[list as usize] = p,
            n => self.prev[n as usize] = p,
        }
        self.list_of[node] = NIL;
        self.next[node] = NIL;
        self.prev[node] = NIL;
        Some(list as usize)
    }

    /// Detach every node of `list` and return them in order.
    fn drain_into(&mut self, list: usize, out: &mut Vec<u32>) {
        out.clear();
        let mut n = self.head[list];
        while n != NIL {
            out.push(n);
            let next = self.next[n as usize];
            self.list_of[n as usize] = NIL;
            self.next[n as usize] = NIL;
            self.prev[n as usize] = NIL;
            n = next;
        }
        self.head[list] = NIL;
        self.tail[list] = NIL;
    }
}

/// A two-level bitmap over `RING` buckets: which are non-empty.
#[derive(Clone, Debug)]
struct Bitmap {
    words: Vec<u64>,
    summary: Vec<u64>,
}

impl Bitmap {
    fn new(bits: usize) -> Self {
        let words = bits.div_ceil(64);
        Bitmap {
            words: vec![0; words],
            summary: vec![0; words.div_ceil(64)],
        }
    }

    fn set(&mut self, i: usize) {
        self.words[i / 64] |= 1 << (i % 64);
        self.summary[i / 4096] |= 1 << ((i / 64) % 64);
    }

    fn clear(&mut self, i: usize) {
        let w = i / 64;
        self.words[w] &= !(1 << (i % 64));
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// The highest set bit at or below `i`, and how many words were read to find it.
    fn highest_at_or_below(&self, i: usize) -> (Option<usize>, u32) {
        let w = i / 64;
        let below = |b: usize| {
            if b == 63 {
                u64::MAX
            } else {
                (1u64 << (b + 1)) - 1
            }
        };
        let top = |x: u64| 63 - x.leading_zeros() as usize;
        let m = self.words[w] & below(i % 64);
        if m != 0 {
            return (Some(w * 64 + top(m)), 1);
        }
        let mut read = 1;
        // Non-empty words strictly below `w`, in this summary word first.
        let s = w / 64;
        let first = if w.is_multiple_of(64) {
            0
        } else {
            self.summary[s] & below(w % 64 - 1)
        };
        read += 1;
        let mut found = (first != 0).then(|| s * 64 + top(first));
        if found.is_none() {
            for t in (0..s).rev() {
                read += 1;
                if self.summary[t] != 0 {
                    found = Some(t * 64 + top(self.summary[t]));
                    break;
                }
            }
        }
        match found {
            Some(w2) => {
                read += 1;
                (Some(w2 * 64 + top(self.words[w2])), read)
            }
            None => (None, read),
        }
    }
}

/// Layer-cycle policy with bounded-cost eviction (see the module documentation).
#[derive(Clone, Debug)]
pub struct CycleQueue {
    /// Usage counting, visits and the current layer, exactly as [`LayerCycle`] keeps them.
    counts: LayerCycle,
    /// Layer visits started so far.
    tick: u64,
    /// Tick at which each layer's current or last visit started.
    layer_tick: Vec<u64>,
    /// Ticks between the last two visit starts of one layer.
    period: u64,
    /// Per key: estimated tick of the next use.
    next: Vec<u64>,
    /// Per key: inserted and not evicted.
    tracked: Vec<bool>,
    /// Per key: expected so far ahead that it goes first, and not estimated again until used.
    cold: Vec<bool>,
    /// Per key: tracked, resident and not pinned (in the victim queue).
    evictable: Vec<bool>,
    /// Victim queue: `RING` buckets by `next % RING`.
    queue: Lists,
    occupied: Bitmap,
    /// Per layer, `DUE_RING` buckets by `due % DUE_RING`.
    dues: Lists,
    scratch: Vec<u32>,
    stats: CycleQueueStats,
}

/// Work counters of a [`CycleQueue`], for the bound tests and the benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CycleQueueStats {
    /// Victims chosen.
    pub picks: u64,
    /// Bitmap words and list heads read while choosing them.
    pub examined: u64,
    /// The most read for one victim.
    pub max_examined: u64,
    /// Estimates recomputed because an expected visit ended without a use.
    pub reestimated: u64,
    /// Estimates set because an expert was used.
    pub touches: u64,
}

impl CycleQueue {
    /// Buckets of the victim queue (ticks of `next` it tells apart).
    pub const RING: usize = 1 << 14;
    /// Ticks before the present that the ring still orders as the past.
    pub const BEHIND: u64 = 1 << 12;
    /// The furthest ahead of its visit's start an estimate is placed, in ticks.
    pub const MAX_AHEAD: u64 = 1 << 13;
    /// An expert expected `COLD` or more visits of its layer ahead (`w / u ≥ COLD`) is cold.
    pub const COLD: u32 = 16;
    /// Buckets of each layer's due ring: `due − visit` is below `COLD / 2`.
    const DUE_RING: u32 = Self::COLD / 2;
    /// The list of experts used in the visit under way (after the ring's buckets).
    const HELD: usize = Self::RING;
    /// The list of cold experts (after the held list).
    const COLD_LIST: usize = Self::RING + 1;

    /// A cycle-queue policy over `space` with [`LayerCycle::DEFAULT_HORIZON`].
    #[must_use]
    pub fn new(space: KeySpace) -> Self {
        Self::with_horizon(space, LayerCycle::DEFAULT_HORIZON)
    }

    /// A cycle-queue policy whose usage counts are halved every `horizon` layer visits.
    #[must_use]
    pub fn with_horizon(space: KeySpace, horizon: u32) -> Self {
        let n = space.len();
        let due_buckets = Self::DUE_RING as usize * space.layers();
        CycleQueue {
            counts: LayerCycle::with_horizon(space, horizon),
            tick: 0,
            layer_tick: vec![0; space.layers()],
            // Until a layer comes round, assume every layer of the space is visited.
            period: space.layers() as u64,
            next: vec![0; n],
            tracked: vec![false; n],
            cold: vec![false; n],
            evictable: vec![false; n],
            queue: Lists::new(n, Self::RING + 2),
            occupied: Bitmap::new(Self::RING),
            dues: Lists::new(n, due_buckets),
            scratch: Vec::new(),
            stats: CycleQueueStats::default(),
        }
    }

    /// Work done so far.
    #[must_use]
    pub fn stats(&self) -> CycleQueueStats {
        self.stats
    }

    /// The estimated tick of `key`'s next use, while it is tracked.
    #[must_use]
    pub fn next_use(&self, key: ExpertKey) -> Option<u64> {
        let i = self.counts.space.index(key)?;
        self.tracked[i].then_some(self.next[i])
    }

    /// Layer visits started so far (the present, in ticks).
    #[must_use]
    pub fn tick(&self) -> u64 {
        self.tick
    }

    /// The key of dense index `i`.
    fn key_of(&self, i: usize) -> ExpertKey {
        let e = self.counts.space.experts();
        ExpertKey::new((i / e) as u16, (i % e) as u16)
    }

    fn due_list(&self, layer: usize, due: u32) -> usize {
        layer * Self::DUE_RING as usize + (due % Self::DUE_RING) as usize
    }

    /// Estimate key `i` (of `key.layer`) again at the current visit of its layer.
    fn estimate(&mut self, i: usize, key: ExpertKey) {
        let l = usize::from(key.layer);
        self.dues.remove(i);
        match estimate(&self.counts, key, self.layer_tick[l], self.period) {
            Some((next, due)) => {
                self.next[i] = next;
                self.cold[i] = false;
                let d = self.due_list(l, due);
                self.dues.push_back(d, i);
            }
            None => self.cold[i] = true,
        }
        if self.evictable[i] {
            self.unqueue(i);
            self.enqueue(i, key);
        }
    }

    /// Whether `key` was used in the visit now under way (so it is held back until it ends).
    fn in_current_visit(&self, i: usize, key: ExpertKey) -> bool {
        self.counts.current == Some(key.layer)
            && self.counts.used_in[i] == self.counts.layers[usize::from(key.layer)].visits
    }

    fn enqueue(&mut self, i: usize, key: ExpertKey) {
        if self.in_current_visit(i, key) {
            self.queue.push_back(Self::HELD, i);
            return;
        }
        if self.cold[i] {
            self.queue.push_back(Self::COLD_LIST, i);
            return;
        }
        let b = (self.next[i] % Self::RING as u64) as usize;
        self.queue.push_back(b, i);
        self.occupied.set(b);
    }

    fn unqueue(&mut self, i: usize) {
        if let Some(b) = self.queue.remove(i) {
            if b < Self::RING && self.queue.is_empty(b) {
                self.occupied.clear(b);
            }
        }
    }

    /// The non-empty ring bucket with the latest `next` (counted round the ring from `BEHIND`
    /// ticks ago), and how many bitmap words were read to find it.
    fn latest_bucket(&self) -> (Option<usize>, u32) {
        let mask = Self::RING - 1;
        let start = (self.tick.wrapping_sub(Self::BEHIND) as usize) & mask;
        // Buckets `start − 1` down to 0, then `RING − 1` down to `start`.
        let top = start.wrapping_sub(1) & mask;
        let (found, read) = self.occupied.highest_at_or_below(top);
        if found.is_some() || top == mask {
            return (found, read);
        }
        let (wrapped, more) = self.occupied.highest_at_or_below(mask);
        (wrapped.filter(|&b| b > top), read + more)
    }

    /// The visit of `layer` has ended: estimate again the experts expected in it.
    /// Called when the next visit has started (`counts.current` is no longer `layer`).
    fn end_visit(&mut self, layer: u16) {
        let l = usize::from(layer);
        let visit = self.counts.layers[l].visits;
        let mut keys = std::mem::take(&mut self.scratch);
        // The experts used in the visit join the queue, least recently used first.
        self.queue.drain_into(Self::HELD, &mut keys);
        for &i in &keys {
            let i = i as usize;
            self.enqueue(i, self.key_of(i));
        }
        // The experts expected in it and not used are estimated again.
        let list = self.due_list(l, visit);
        self.dues.drain_into(list, &mut keys);
        for &i in &keys {
            let i = i as usize;
            self.stats.reestimated += 1;
            self.estimate(i, self.key_of(i));
        }
        self.scratch = keys;
    }

    fn touch(&mut self, key: ExpertKey, now: u64) {
        let Some(i) = self.counts.space.index(key) else {
            return;
        };
        let prev = self.counts.current;
        self.counts.touch(key, now);
        if prev != Some(key.layer) {
            if let Some(p) = prev {
                self.end_visit(p);
            }
            let l = usize::from(key.layer);
            self.tick += 1;
            if self.counts.layers[l].visits > 1 {
                self.period = self.tick - self.layer_tick[l];
            }
            self.layer_tick[l] = self.tick;
        }
        self.tracked[i] = true;
        self.stats.touches += 1;
        self.estimate(i, key);
    }
}

/// `(next, due)` of `key` at the current visit of its layer, which started at tick `start`
/// (see the module documentation), or `None` when it is cold.
fn estimate(counts: &LayerCycle, key: ExpertKey, start: u64, period: u64) -> Option<(u64, u32)> {
    let i = counts.space.index(key)?;
    let usage = counts.usage[i];
    let w = u64::from(counts.window(key.layer, usage));
    let u = u64::from(usage.uses.max(1));
    if w >= u64::from(CycleQueue::COLD) * u {
        return None;
    }
    let next = start + (period.saturating_mul(w) / u).min(CycleQueue::MAX_AHEAD);
    // w / 2u < COLD / 2 = DUE_RING, so `due` never aliases a bucket still in use.
    let ahead = (w / (2 * u)).max(1) as u32;
    let visit = counts.layers[usize::from(key.layer)].visits;
    Some((next, visit.saturating_add(ahead)))
}

impl Policy for CycleQueue {
    fn name(&self) -> &'static str {
        "cycle-queue"
    }

    fn on_hit(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn on_insert(&mut self, key: ExpertKey, now: u64) {
        self.touch(key, now);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        let Some(i) = self.counts.space.index(key) else {
            return;
        };
        self.unqueue(i);
        self.dues.remove(i);
        self.tracked[i] = false;
        self.evictable[i] = false;
    }

    fn indexed(&self) -> bool {
        true
    }

    fn on_evictable(&mut self, key: ExpertKey, evictable: bool) {
        let Some(i) = self.counts.space.index(key) else {
            return;
        };
        let evictable = evictable && self.tracked[i];
        if evictable == self.evictable[i] {
            return;
        }
        self.evictable[i] = evictable;
        if evictable {
            self.enqueue(i, key);
        } else {
            self.unqueue(i);
        }
    }

    fn pick(&mut self) -> Option<ExpertKey> {
        self.stats.picks += 1;
        let (list, read) = if self.queue.is_empty(Self::COLD_LIST) {
            let (bucket, read) = self.latest_bucket();
            (bucket.unwrap_or(Self::HELD), read + 1)
        } else {
            (Self::COLD_LIST, 1)
        };
        self.stats.examined += u64::from(read);
        self.stats.max_examined = self.stats.max_examined.max(u64::from(read));
        let i = self.queue.head[list];
        (i != NIL).then(|| self.key_of(i as usize))
    }

    fn victim(&self, candidates: &[ExpertKey]) -> Option<usize> {
        // The same order by a scan, for callers that offer candidates (the first candidate
        // stands for "queued longest" on ties): cold, then latest `next`, then used in the
        // visit under way.
        let start = self.tick.wrapping_sub(Self::BEHIND);
        super::argmax_by(candidates, |k| match self.counts.space.index(k) {
            Some(i) if self.tracked[i] && !self.in_current_visit(i, k) => {
                if self.cold[i] {
                    (2, 0)
                } else {
                    (1, self.next[i].wrapping_sub(start) % Self::RING as u64)
                }
            }
            Some(i) if self.tracked[i] => (0, 0),
            _ => (3, 0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{LayerCycle, Lookup, SlotError, SlotTable};
    use super::*;
    use std::collections::BTreeMap;

    /// xorshift64*: deterministic pseudo-random numbers for the generated traces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    #[derive(Clone, Copy, Debug)]
    struct Entry {
        next: u64,
        /// `None`: cold.
        due: Option<u32>,
        evictable: bool,
        /// When it last joined the victim queue (ties go to the smallest).
        queued: u64,
        /// When it last joined its layer's due list (refreshes happen in this order).
        listed: u64,
    }

    /// The rule of [`CycleQueue`] written the plain way: every tracked expert in a map,
    /// refreshed by scanning its layer when a visit ends, the victim found by scanning them all.
    struct Reference {
        counts: LayerCycle,
        tick: u64,
        layer_tick: Vec<u64>,
        period: u64,
        keys: BTreeMap<usize, Entry>,
        seq: u64,
    }

    impl Reference {
        fn new(space: KeySpace, horizon: u32) -> Self {
            Reference {
                counts: LayerCycle::with_horizon(space, horizon),
                tick: 0,
                layer_tick: vec![0; space.layers()],
                period: space.layers() as u64,
                keys: BTreeMap::new(),
                seq: 0,
            }
        }

        fn key(&self, i: usize) -> ExpertKey {
            let e = self.counts.space.experts();
            ExpertKey::new((i / e) as u16, (i % e) as u16)
        }

        fn used_now(&self, i: usize) -> bool {
            let key = self.key(i);
            self.counts.current == Some(key.layer)
                && self.counts.used_in[i] == self.counts.layers[usize::from(key.layer)].visits
        }

        fn refresh(&mut self, i: usize) {
            let key = self.key(i);
            let l = usize::from(key.layer);
            let usage = self.counts.usage[i];
            let w = u64::from(self.counts.window(key.layer, usage));
            let u = u64::from(usage.uses.max(1));
            let visit = self.counts.layers[l].visits;
            self.seq += 1;
            let seq = self.seq;
            let (start, period) = (self.layer_tick[l], self.period);
            let e = self.keys.get_mut(&i).expect("tracked");
            if w >= 16 * u {
                e.due = None;
            } else {
                e.next = start + (period * w / u).min(8192);
                e.due = Some(visit + (w / (2 * u)).max(1) as u32);
                e.listed = seq;
            }
            if e.evictable {
                e.queued = seq;
            }
        }

        fn end_visit(&mut self, layer: u16) {
            let visit = self.counts.layers[usize::from(layer)].visits;
            let of_layer: Vec<(usize, Entry)> = self
                .keys
                .iter()
                .filter(|(&i, _)| self.key(i).layer == layer)
                .map(|(&i, &e)| (i, e))
                .collect();
            let mut used: Vec<(u64, usize)> = of_layer
                .iter()
                .filter(|(i, e)| e.evictable && self.counts.used_in[*i] == visit)
                .map(|&(i, e)| (e.queued, i))
                .collect();
            used.sort_unstable();
            for (_, i) in used {
                self.seq += 1;
                self.keys.get_mut(&i).expect("tracked").queued = self.seq;
            }
            let mut due: Vec<(u64, usize)> = of_layer
                .iter()
                .filter(|(_, e)| e.due == Some(visit))
                .map(|&(i, e)| (e.listed, i))
                .collect();
            due.sort_unstable();
            for (_, i) in due {
                self.refresh(i);
            }
        }

        fn touch(&mut self, key: ExpertKey, now: u64) {
            let Some(i) = self.counts.space.index(key) else {
                return;
            };
            let prev = self.counts.current;
            self.counts.touch(key, now);
            if prev != Some(key.layer) {
                if let Some(p) = prev {
                    self.end_visit(p);
                }
                let l = usize::from(key.layer);
                self.tick += 1;
                if self.counts.layers[l].visits > 1 {
                    self.period = self.tick - self.layer_tick[l];
                }
                self.layer_tick[l] = self.tick;
            }
            self.keys.entry(i).or_insert(Entry {
                next: 0,
                due: None,
                evictable: false,
                queued: 0,
                listed: 0,
            });
            self.refresh(i);
        }
    }

    impl Policy for Reference {
        fn name(&self) -> &'static str {
            "reference"
        }

        fn on_hit(&mut self, key: ExpertKey, now: u64) {
            self.touch(key, now);
        }

        fn on_insert(&mut self, key: ExpertKey, now: u64) {
            self.touch(key, now);
        }

        fn on_evict(&mut self, key: ExpertKey) {
            if let Some(i) = self.counts.space.index(key) {
                self.keys.remove(&i);
            }
        }

        fn victim(&self, _candidates: &[ExpertKey]) -> Option<usize> {
            None
        }

        fn indexed(&self) -> bool {
            true
        }

        fn on_evictable(&mut self, key: ExpertKey, evictable: bool) {
            let Some(i) = self.counts.space.index(key) else {
                return;
            };
            self.seq += 1;
            let seq = self.seq;
            if let Some(e) = self.keys.get_mut(&i) {
                if evictable && !e.evictable {
                    e.queued = seq;
                }
                e.evictable = evictable;
            }
        }

        fn pick(&mut self) -> Option<ExpertKey> {
            // Rank: cold first, then the latest `next` round the ring, then used in this
            // visit; the earliest queued within a rank.
            let start = self.tick.wrapping_sub(4096);
            let rank = |i: usize, e: &Entry| -> (u8, u64) {
                if self.used_now(i) {
                    (0, 0)
                } else if e.due.is_none() {
                    (2, 0)
                } else {
                    (1, e.next.wrapping_sub(start) % 16384)
                }
            };
            self.keys
                .iter()
                .filter(|(_, e)| e.evictable)
                .max_by(|(&a, ea), (&b, eb)| {
                    rank(a, ea)
                        .cmp(&rank(b, eb))
                        .then(eb.queued.cmp(&ea.queued))
                })
                .map(|(&i, _)| self.key(i))
        }
    }

    /// Requests that mostly go round the layers in order, with skewed expert choice, layers
    /// left out for long stretches (so estimates fall far behind) and occasional jumps.
    fn next_request(rng: &mut Rng, space: KeySpace, at: &mut (u16, u32), skip: u16) -> ExpertKey {
        let layers = space.layers() as u16;
        if at.1 == 0 {
            at.0 = (at.0 + 1) % layers;
            if at.0 == skip {
                at.0 = (at.0 + 1) % layers;
            }
            if rng.below(50) == 0 {
                at.0 = rng.below(u64::from(layers)) as u16;
            }
            at.1 = 1 + rng.below(6) as u32;
        }
        at.1 -= 1;
        let e = space.experts() as u64;
        let r = rng.below(e * e);
        let expert = if rng.below(4) == 0 {
            r % e
        } else {
            r / e * r / (e * e)
        };
        ExpertKey::new(at.0, expert as u16)
    }

    #[test]
    fn evicts_the_same_victims_as_a_reference_implementation_of_its_rule() {
        let mut evictions = 0;
        for seed in 1..=12u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let space = KeySpace::new(2 + rng.below(5) as usize, 4 + rng.below(20) as usize);
            let horizon = [4, 16, LayerCycle::DEFAULT_HORIZON][seed as usize % 3];
            let slots = 2 + rng.below(space.len() as u64 / 2) as usize;
            let mut fast = SlotTable::new(space, slots, CycleQueue::with_horizon(space, horizon));
            let mut slow = SlotTable::new(space, slots, Reference::new(space, horizon));
            let mut flying: Vec<usize> = Vec::new();
            let mut at = (0u16, 0u32);
            let mut skip = u16::MAX;
            for now in 0..30_000u64 {
                if now % 9_000 == 0 {
                    // Leave a layer out for a while: its estimates fall behind the present.
                    skip = rng.below(space.layers() as u64) as u16;
                }
                let op = rng.below(100);
                if op < 70 {
                    let key = next_request(&mut rng, space, &mut at, skip);
                    let (a, b) = (fast.request(key, now), slow.request(key, now));
                    assert_eq!(a, b, "seed {seed} request {now} {key:?}");
                    if let Ok(Lookup::Miss { slot, evicted }) = a {
                        evictions += u64::from(evicted.is_some());
                        if rng.below(4) == 0 {
                            flying.push(slot);
                        } else {
                            assert_eq!(fast.publish(slot), slow.publish(slot));
                        }
                    }
                } else if op < 80 && !flying.is_empty() {
                    let s = flying.swap_remove(rng.below(flying.len() as u64) as usize);
                    if op < 77 {
                        assert_eq!(fast.publish(s), slow.publish(s));
                    } else {
                        assert_eq!(fast.fail(s), slow.fail(s));
                    }
                } else if op < 95 {
                    let s = rng.below(slots as u64) as usize;
                    let pin = rng.below(3) == 0;
                    assert_eq!(fast.set_pinned(s, pin), slow.set_pinned(s, pin));
                } else if op == 99 && flying.is_empty() && rng.below(20) == 0 {
                    let to = 1 + rng.below(slots as u64 + 4) as usize;
                    assert_eq!(fast.resize(to), slow.resize(to), "seed {seed} resize {to}");
                }
                for s in 0..fast.capacity() {
                    assert_eq!(fast.state(s), slow.state(s));
                }
            }
            assert_eq!(fast.stats(), slow.stats(), "seed {seed}");
        }
        assert!(evictions > 50_000, "{evictions}");
    }

    /// Tokens that visit layers 1..=92 in order, 16 distinct experts each (skewed choice).
    fn cyclic_trace(tokens: usize, seed: u64) -> Vec<ExpertKey> {
        let mut rng = Rng(seed);
        let mut out = Vec::with_capacity(tokens * 92 * 16);
        for _ in 0..tokens {
            for layer in 1..=92u16 {
                let mut chosen = [u16::MAX; 16];
                for k in 0..16 {
                    loop {
                        let r = rng.below(896 * 896);
                        let e = if rng.below(2) == 0 {
                            r % 896
                        } else {
                            r / 896 * r / (896 * 896)
                        };
                        let e = e as u16;
                        if !chosen[..k].contains(&e) {
                            chosen[k] = e;
                            break;
                        }
                    }
                    out.push(ExpertKey::new(layer, chosen[k]));
                }
            }
        }
        out
    }

    #[test]
    fn choosing_a_victim_reads_a_bounded_number_of_entries_from_1k_to_64k_slots() {
        let trace = cyclic_trace(400, 7);
        let mut report = String::from("\ncycle-queue work on a cyclic trace\n");
        for slots in [1 << 10, 1 << 12, 1 << 14, 1 << 16] {
            let mut t = SlotTable::new(KeySpace::K3, slots, CycleQueue::new(KeySpace::K3));
            for (now, &key) in trace.iter().enumerate() {
                assert!(t.access(key, now as u64).is_ok());
            }
            let (hits, st) = (t.stats(), t.policy().stats());
            let per_request = (st.reestimated + st.touches) as f64 / hits.requests as f64;
            report.push_str(&format!(
                "{slots:>6} slots: {} evictions, {:.2} entries read per victim (max {}), \
                 {per_request:.2} estimates per request\n",
                hits.evictions,
                st.examined as f64 / st.picks.max(1) as f64,
                st.max_examined
            ));
            assert!(hits.evictions > 10_000, "{slots}: {hits:?}");
            assert_eq!(st.picks, hits.evictions);
            assert!(st.max_examined <= 13, "{slots}: {st:?}");
            assert!(per_request <= 4.0, "{slots}: {per_request}");
        }
        print!("{report}");
    }

    #[test]
    fn bitmap_finds_the_highest_set_bucket_below_a_point() {
        let mut rng = Rng(99);
        let mut b = Bitmap::new(CycleQueue::RING);
        let mut set = vec![false; CycleQueue::RING];
        for round in 0..20_000 {
            let i = rng.below(CycleQueue::RING as u64) as usize;
            if rng.below(3) == 0 {
                b.clear(i);
                set[i] = false;
            } else {
                b.set(i);
                set[i] = true;
            }
            let q = rng.below(CycleQueue::RING as u64) as usize;
            let want = (0..=q).rev().find(|&j| set[j]);
            let (got, read) = b.highest_at_or_below(q);
            assert_eq!(got, want, "round {round} query {q}");
            assert!(read <= 6, "{read}");
        }
    }

    #[test]
    fn cold_experts_go_first_and_the_visit_under_way_is_held_back() {
        let space = KeySpace::new(4, 8);
        let mut t = SlotTable::new(space, 5, CycleQueue::new(space));
        let k = ExpertKey::new;
        let mut now = 0;
        let mut req = |t: &mut SlotTable<CycleQueue>, key: ExpertKey| {
            now += 1;
            t.access(key, now).map_err(|e: SlotError| e.to_string())
        };
        // Expert (1, 7) is used once; (1, 0), (2, 0), (3, 0) every token for 80 tokens.
        req(&mut t, k(1, 7)).unwrap();
        for _ in 0..80 {
            for layer in 1..=3 {
                req(&mut t, k(layer, 0)).unwrap();
            }
        }
        // Token 81 at layer 1 uses (1, 1) and (1, 2): five slots are full, so the cold expert
        // (1, 7) goes first, then the expert needed furthest ahead: (3, 0), whose layer was
        // just visited, not (1, 1) of the visit under way.
        let Lookup::Miss { evicted, slot } = t.request(k(1, 1), 1_000).unwrap() else {
            panic!("expected a miss");
        };
        t.publish(slot).unwrap();
        assert_eq!(evicted, None);
        let Lookup::Miss { evicted, slot } = t.request(k(1, 2), 1_001).unwrap() else {
            panic!("expected a miss");
        };
        t.publish(slot).unwrap();
        assert_eq!(evicted, Some(k(1, 7)));
        let (p2, p3) = (t.policy().next_use(k(2, 0)), t.policy().next_use(k(3, 0)));
        assert!(p2.is_some() && p3 > p2, "{p2:?} {p3:?}");
        let Lookup::Miss { evicted, .. } = t.request(k(1, 3), 1_002).unwrap() else {
            panic!("expected a miss");
        };
        assert_eq!(evicted, Some(k(3, 0)));
    }
}
