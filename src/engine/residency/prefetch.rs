//! Reads of experts predicted for the next layer, queued behind the reads layers ask for.

use super::cache::{Arrival, Counters, Resident};
use super::expert_io::{read_expert, ExpertTable};
use super::leaf::Leaf;
use crate::engine::config::ModelConfig;
use crate::stream::checkpoint::io_pool;
use crate::stream::Checkpoint;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Predicted reads waiting for the disk to be idle, and the reads in flight. It lives with the
/// expert cache under the resident set's lock: queueing, cancelling and completing a read
/// change both at once.
#[derive(Debug, Default)]
pub(super) struct PrefetchState {
    /// Predicted reads not started, the most likely first: (layer, expert, reserved slot).
    pub(super) queued: VecDeque<(usize, usize, usize)>,
    /// Reads a layer asked for that have not completed (queued on the I/O threads or running).
    pub(super) demand: usize,
    /// Predicted reads started and not completed.
    pub(super) in_flight: usize,
    /// How many reads at the front of the queue come from a prediction made from a layer's
    /// output at a rank that has been right at least half the time: `late_depth` applies to
    /// them, `depth` to the rest.
    pub(super) eager: usize,
}

/// Predictions counted before per-rank accuracy decides which late reads are eager (until
/// then all are).
pub(super) const EAGER_AFTER: u64 = 8;

/// How many of a prediction's leading ranks have been right at least half the time, given how
/// often each rank was right (`right_by_rank`) over `predictions` predictions; every rank
/// until [`EAGER_AFTER`] predictions are counted. A read of such a rank is expected to save
/// more of the layer's time than a wrong one costs it.
pub(super) fn eager_ranks(right_by_rank: &[u64], predictions: u64) -> usize {
    if predictions < EAGER_AFTER {
        return usize::MAX;
    }
    right_by_rank
        .iter()
        .take_while(|&&r| 2 * r >= predictions)
        .count()
}

/// Count, per rank of `predicted` (the most likely first), whether the layer's routing chose
/// it (`ids`), into `by_rank`; returns how many it chose.
pub(super) fn score_by_rank(by_rank: &mut Vec<u64>, predicted: &[usize], ids: &[usize]) -> u64 {
    if by_rank.len() < predicted.len() {
        by_rank.resize(predicted.len(), 0);
    }
    let mut right = 0;
    for (n, e) in by_rank.iter_mut().zip(predicted) {
        if ids.contains(e) {
            *n += 1;
            right += 1;
        }
    }
    right
}

/// Reads of experts predicted for the next layer, in a low-priority queue behind the reads
/// layers ask for: one starts only while fewer than `depth` reads of either kind are in flight,
/// so the disk reads predictions only when it would otherwise idle and a wrong one delays a
/// layer's own reads by at most part of one read. When a layer's routing is known, the queued
/// predictions are dropped before its reads are issued.
pub(super) struct Prefetcher {
    pub(super) ck: Arc<Checkpoint>,
    pub(super) cfg: Arc<ModelConfig>,
    pub(super) table: Arc<ExpertTable>,
    pub(super) resident: Arc<Leaf<Resident>>,
    pub(super) counters: Arc<Counters>,
    pub(super) expert_bytes: u64,
    /// Predicted reads may start while fewer reads than this are in flight.
    pub(super) depth: std::sync::atomic::AtomicUsize,
    /// The same for a prediction from a layer's output.
    pub(super) late_depth: std::sync::atomic::AtomicUsize,
    /// Told when the last predicted read in flight completes.
    pub(super) idle: std::sync::Condvar,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("depth", &self.depth.load(Ordering::Relaxed))
            .finish()
    }
}

impl Prefetcher {
    /// Queue predicted reads (reserved slots of `r`'s cache) behind those queued already;
    /// the first `eager` of them may start under `late_depth` (when the queue was empty).
    pub(super) fn enqueue(r: &mut Resident, reads: &[(usize, usize, usize)], eager: usize) {
        let s = &mut r.prefetch;
        if s.queued.is_empty() {
            s.eager = eager.min(reads.len());
        }
        s.queued.extend(reads.iter().copied());
    }

    /// Drop every queued predicted read, freeing its slot in `r`'s cache.
    pub(super) fn cancel_queued(&self, r: &mut Resident) {
        let Resident {
            prefetch: s, cache, ..
        } = r;
        s.eager = 0;
        let dropped = s.queued.len() as u64;
        while let Some((_, _, slot)) = s.queued.pop_front() {
            cache.cancel_prefetch(slot);
        }
        self.counters
            .prefetch_cancelled
            .fetch_add(dropped, Ordering::Relaxed);
    }

    /// A layer's own read is issued.
    pub(super) fn demand_started(&self) {
        self.resident.lock().prefetch.demand += 1;
    }

    /// A layer's own read completed: predicted reads may use the disk if it goes idle.
    pub(super) fn demand_done(self: &Arc<Self>) {
        self.resident.lock().prefetch.demand -= 1;
        self.pump();
    }

    /// Start queued predicted reads, the most likely first, while the disk has room for them.
    pub(super) fn pump(self: &Arc<Self>) {
        let Some(pool) = io_pool() else { return };
        let (depth, late_depth) = (
            self.depth.load(Ordering::Relaxed),
            self.late_depth.load(Ordering::Relaxed),
        );
        loop {
            let next = {
                let mut r = self.resident.lock();
                let s = &mut r.prefetch;
                if s.demand + s.in_flight >= if s.eager > 0 { late_depth } else { depth } {
                    return;
                }
                let Some(next) = s.queued.pop_front() else {
                    return;
                };
                s.eager = s.eager.saturating_sub(1);
                s.in_flight += 1;
                next
            };
            let me = Arc::clone(self);
            pool.spawn(move || me.read(next));
        }
    }

    /// Read one predicted expert into its reserved slot.
    pub(super) fn read(self: &Arc<Self>, (il, e, slot): (usize, usize, usize)) {
        self.counters.prefetch_reads.fetch_add(1, Ordering::Relaxed);
        let result = read_expert(&self.ck, &self.cfg, &self.table, il, e);
        if result.is_ok() {
            self.counters
                .expert_bytes
                .fetch_add(self.expert_bytes, Ordering::Relaxed);
        }
        let (expert, waiting) = {
            let mut r = self.resident.lock();
            let done = r.cache.complete_prefetch(slot, result);
            r.prefetch.in_flight -= 1;
            if r.prefetch.in_flight == 0 {
                self.idle.notify_all();
            }
            done
        };
        for (tx, k) in waiting {
            tx.send(Arrival::Shared {
                k,
                expert: expert.clone(),
            });
        }
        self.pump();
    }

    /// Drop the queued predicted reads and wait for those in flight (before a plan change).
    pub(super) fn quiesce(&self) {
        let mut r = self.resident.lock();
        self.cancel_queued(&mut r);
        while r.prefetch.in_flight > 0 {
            r = r.wait(&self.idle);
        }
    }
}
