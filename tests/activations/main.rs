//! The memory of a forward call against what the plan counts for it: the heap a prefill
//! chunk of `n` tokens takes at its peak (the run state's buffers, the kernels' batch
//! scratch and anything transient) is at most `engine::activation_sizes` for `n` tokens and
//! the positions its sequence reserves, plus the logits row the plan counts apart. The plan
//! (`stream::budget`) reserves exactly that for the longest chunk it allows, so a long
//! prompt cannot take a process past its budget.
//!
//! The allocator counts every thread of the process, so this binary holds this one test.
#![allow(clippy::unwrap_used)]

use k3::engine::{activation_sizes, Logits, Model, RunState, SeqState};
use peak_alloc::PeakAlloc;
use std::path::PathBuf;

#[global_allocator]
static PEAK: PeakAlloc = PeakAlloc;

fn fixture(set: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(set)
}

#[test]
fn a_prefill_chunk_takes_no_more_memory_than_the_plan_counts() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    // The pool's threads allocate as they start (their names, deques and epoch records),
    // and may still be starting when `build` returns: let each run once, then warm the
    // pool up with a chunk of its own, so that the first counted chunk counts only itself.
    pool.broadcast(|_| ());
    for set in ["tiny", "tiny2"] {
        let m = Model::load(&fixture(set)).unwrap();
        let mut st = SeqState::new(&m.cfg);
        pool.install(|| {
            m.forward_run(&mut st, &mut RunState::new(), &[3, 5], Logits::Last)
                .unwrap();
        });
        let act = activation_sizes(&m.cfg);
        let logits = m.cfg.vocab_size as u64 * 4;
        let v = m.cfg.vocab_size as u32;
        for n in [1usize, 7, 64, 200] {
            let ids: Vec<u32> = (0..n as u32).map(|i| (3 + 29 * i) % v).collect();
            let mut st = SeqState::new(&m.cfg);
            st.reserve(n, &m.cfg);
            let mut run = RunState::new();
            k3::kernels::release_batch_scratch();
            let before = PEAK.current_usage();
            PEAK.reset_peak_usage();
            pool.install(|| {
                m.forward_run(&mut st, &mut run, &ids, Logits::Last)
                    .unwrap();
            });
            let peak = (PEAK.peak_usage() - before) as u64;
            let held = (run.bytes() + k3::kernels::batch_scratch_bytes()) as u64;
            let counted = act.fixed + n as u64 * (act.per_token + act.per_position) + logits;
            println!("{set} n={n}: peak {peak} B, held {held} B, counted {counted} B");
            assert!(
                peak <= counted,
                "{set}: a {n}-token chunk peaked at {peak} B, the plan counts {counted} B"
            );
            // The count follows the buffers: at a long chunk it is not far above them.
            if n >= 64 {
                assert!(
                    counted as f64 <= 1.25 * held as f64,
                    "{set}: {n} tokens hold {held} B, the plan counts {counted} B"
                );
            }
        }
    }
}
