//! The routed experts a layer's routing missed, read by a few threads of their own from one
//! queue made at open: a miss hands its read over without allocating (no boxed job on a
//! shared pool), and the read takes over the memory of the expert its cache slot let go
//! when nothing else holds it (`expert_io::refill_expert`), so the expert itself is no new
//! allocation either.

use super::cache::{Arrival, Mailbox};
use super::expert_io::{read_expert, refill_expert, ExpertTable};
use super::leaf::Leaf;
use super::prefetch::Prefetcher;
use crate::engine::config::ModelConfig;
use crate::engine::moe::Expert;
use crate::stream::{Checkpoint, StreamError};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar};

/// Expert `e` of layer `il`, the `k`-th of a request, to be read into cache slot `slot`
/// (None: read without caching it), with the expert that slot let go (`spare`) and the
/// request's channel.
#[derive(Debug)]
pub(super) struct ExpertRead {
    pub(super) il: usize,
    pub(super) k: usize,
    pub(super) e: usize,
    pub(super) slot: Option<usize>,
    pub(super) spare: Option<Arc<Expert>>,
    pub(super) tx: Arc<Mailbox>,
}

/// What a read needs.
#[derive(Debug)]
pub(super) struct ReadSource {
    pub(super) ck: Arc<Checkpoint>,
    pub(super) cfg: Arc<ModelConfig>,
    pub(super) table: Arc<ExpertTable>,
    pub(super) prefetcher: Arc<Prefetcher>,
}

impl ReadSource {
    /// Read it and send the result to the request.
    pub(super) fn run(&self, r: ExpertRead) {
        let ExpertRead {
            il,
            k,
            e,
            slot,
            spare,
            tx,
        } = r;
        let result = self.read(il, e, spare);
        self.prefetcher.demand_done();
        tx.send(Arrival::Read { k, slot, result });
    }

    /// In place into the spare's memory when nothing else holds it, else into a new slot.
    fn read(
        &self,
        il: usize,
        e: usize,
        spare: Option<Arc<Expert>>,
    ) -> Result<Arc<Expert>, StreamError> {
        if let Some(mut old) = spare {
            if let Some(ex) = Arc::get_mut(&mut old) {
                if let Some(done) = refill_expert(&self.ck, &self.table, il, e, ex) {
                    return done.map(|()| old);
                }
            }
        }
        read_expert(&self.ck, &self.cfg, &self.table, il, e).map(Arc::new)
    }
}

#[derive(Debug)]
struct Queue {
    reads: VecDeque<ExpertRead>,
    stop: bool,
}

/// The expert readers: threads taking reads from one queue, in order.
#[derive(Debug)]
pub(super) struct ExpertReaders {
    queue: Leaf<Queue>,
    more: Condvar,
    threads: Leaf<Vec<std::thread::JoinHandle<()>>>,
}

impl ExpertReaders {
    /// `threads` readers of `src`, with room queued for `room` reads before the queue grows.
    pub(super) fn start(
        threads: usize,
        room: usize,
        src: Arc<ReadSource>,
    ) -> std::io::Result<Arc<ExpertReaders>> {
        let readers = Arc::new(ExpertReaders {
            queue: Leaf::new(Queue {
                reads: VecDeque::with_capacity(room),
                stop: false,
            }),
            more: Condvar::new(),
            threads: Leaf::new(Vec::new()),
        });
        for i in 0..threads.max(1) {
            let (me, src) = (Arc::clone(&readers), Arc::clone(&src));
            let handle = std::thread::Builder::new()
                .name(format!("k3-expert-{i}"))
                .spawn(move || me.serve(&src))?;
            readers.threads.lock().push(handle);
        }
        Ok(readers)
    }

    fn serve(&self, src: &ReadSource) {
        let mut q = self.queue.lock();
        loop {
            if let Some(r) = q.reads.pop_front() {
                drop(q);
                src.run(r);
                q = self.queue.lock();
            } else if q.stop {
                return;
            } else {
                q = q.wait(&self.more);
            }
        }
    }

    /// Queue a read.
    pub(super) fn push(&self, r: ExpertRead) {
        self.queue.lock().reads.push_back(r);
        self.more.notify_one();
    }

    /// End the readers once the queue is empty, and wait until they have.
    pub(super) fn stop(&self) {
        self.queue.lock().stop = true;
        self.more.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}
