//! Keeping the compute pool's threads awake between the parallel loops of a forward pass.
//!
//! A one-token forward pass is some two hundred short parallel loops (each product of a
//! layer, the heads of KDA and MLA, the experts) separated by short serial steps (norms,
//! routing, the recurrence's bookkeeping). Between two loops a rayon worker that finds no
//! work soon parks itself on a futex, and the next loop has to wake it again: on a virtual
//! machine a vCPU that went idle takes tens of microseconds to wake, and the loop's other
//! half waits for it. [`warm`] runs a step with, beside it on the pool, jobs that keep
//! looking for work with [`rayon::yield_now`] (running what they find: the loops' pieces)
//! and spin while there is none, so the other threads take their share at once. A job gives
//! its core back after 200 µs without work, so a step that waits for the disk (a streamed
//! layer, an expert read) does not hold a core the reader threads need; from then on the
//! step runs as it would without them.
//!
//! Only scheduling changes: which thread runs a loop's piece never changes its bits, since
//! every output is one fixed-order reduction wherever it runs. The jobs are rayon's own
//! stack jobs ([`rayon::join`]), so a step allocates nothing more.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a spinning job looks for work in vain before it gives its core back.
const IDLE: Duration = Duration::from_micros(200);

/// Run `f` on the current thread with the pool's other threads (as many as there are other
/// cores) kept looking for work until it returns (see the module's doc). Off on a pool of
/// one thread or on one core, outside a pool, and where `K3_KEEP_WARM=0` (docs/tuning.md):
/// `f` then just runs.
pub fn warm<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let Some(owner) = rayon::current_thread_index() else {
        return f();
    };
    // One helper per other thread of the pool, but never more threads busy than cores: a
    // pool larger than the machine (`--threads 16` on two cores) would have its helpers take
    // the cores from the step itself.
    let helpers = rayon::current_num_threads().min(cores()).saturating_sub(1);
    if helpers == 0 || !crate::tuning::Tuning::get().keep_warm {
        return f();
    }
    let done = AtomicBool::new(false);
    let mut f = Some(f);
    let mut out = None;
    let mut step = || {
        if let Some(f) = f.take() {
            out = Some(f());
        }
    };
    with_helpers(helpers, owner, &done, &mut step);
    out.expect("the step ran")
}

/// The cores this process may run on, read once.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get))
}

/// `step`, then `done` set, beside `n` spinning jobs (one `join` each, nested).
fn with_helpers(n: usize, owner: usize, done: &AtomicBool, step: &mut (dyn FnMut() + Send)) {
    if n == 0 {
        step();
        done.store(true, Ordering::Release);
        return;
    }
    rayon::join(
        || with_helpers(n - 1, owner, done, step),
        || spin(owner, done),
    );
}

/// Look for work until `done`, or until none has come for [`IDLE`].
fn spin(owner: usize, done: &AtomicBool) {
    // Taken back by the step's own thread while it waited for a piece of a loop: spinning
    // there would hold the step up.
    if rayon::current_thread_index() == Some(owner) {
        return;
    }
    let mut since = Instant::now();
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => since = Instant::now(),
            _ => {
                if since.elapsed() > IDLE {
                    return;
                }
                for _ in 0..16 {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    }

    /// The products of a step run under `warm` are the products run alone, bit for bit,
    /// on pools of one to three threads, and `warm` hands back the step's result.
    #[test]
    fn a_warm_step_computes_the_same_bits() {
        let (rows, cols) = (96, 160);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1009) as f32 / 1009.0 - 0.5)
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let product = || {
            let mut y = vec![0.0f32; rows];
            crate::kernels::matmul(crate::kernels::DenseRef::F32(&w), rows, cols, &x, &mut y);
            y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let alone = pool(1).install(product);
        for n in 1..=3 {
            let warmed = pool(n).install(|| warm(|| (product(), 7)));
            assert_eq!(warmed, (alone.clone(), 7), "{n} threads");
        }
        // Outside any pool `warm` just runs the step.
        assert_eq!(warm(product), alone);
    }

    /// A step that waits (as for the disk) ends with its result, and a helper returns: when
    /// the step is done, at once on the step's own thread, and, with no work and the step not
    /// done, after its idle spell instead of spinning on.
    #[test]
    fn a_helper_stops_when_the_step_is_done_or_when_no_work_comes() {
        let p = pool(2);
        let waited = p.install(|| {
            warm(|| {
                std::thread::sleep(Duration::from_millis(20));
                "waited"
            })
        });
        assert_eq!(waited, "waited");
        let done = AtomicBool::new(false);
        // On a pool thread that is not the owner, nothing to do, never done: it returns.
        p.install(|| {
            let me = rayon::current_thread_index().unwrap();
            let other = (me + 1) % 2;
            spin(other, &done);
        });
        // On the owner's thread it returns at once, done or not.
        p.install(|| spin(rayon::current_thread_index().unwrap(), &done));
        done.store(true, Ordering::Release);
        p.install(|| spin(usize::MAX, &done));
    }
}
