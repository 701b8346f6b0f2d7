//! Allocations of a decoding step: after a few warm-up steps have sized the run state's
//! buffers, a step allocates nothing, on any thread, with the model resident or under a
//! budget (pinned layers, streamed layers, experts found in the cache or read on a miss); nor does a speculative step with
//! drafts verified and rolled back, nor a prefill chunk.
//!
//! The counting allocator (`stats_alloc`) counts every thread of the process, rayon's workers
//! included, so a step that moved an allocation onto a worker would still be caught. For the
//! same reason this binary has no test harness (`harness = false` in Cargo.toml): libtest's
//! main thread allocates while tests run (its "has been running for over 60 seconds" notice
//! fires on a slow machine), and it would be counted. `main` runs the tests one after another
//! on its own thread, and nothing else runs while one measures.
#![allow(clippy::unwrap_used)]

use k3::engine::spec::{SpecMode, Speculator};
use k3::engine::{Logits, Model, RunState, SeqState};
use k3::stream::budget::BudgetRequest;
use k3::stream::codec::Coding;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Warm-up steps before counting, and steps counted.
const WARM: usize = 3;
const STEPS: usize = 128;
/// What a step called from outside the rayon pool may allocate: each forward call hands one
/// job to the pool through its shared queue, which takes a fresh block every 63 jobs (a
/// count that does not depend on the model's size, depth or context). Called from inside the
/// pool, a step allocates nothing at all.
const OUTSIDE_THE_POOL: usize = STEPS / 32;
/// Positions the states reserve: the prompt and every step.
const POSITIONS: usize = 5 + WARM + STEPS;

fn fixture(set: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(set)
}

fn prompt(m: &Model) -> Vec<u32> {
    let v = m.cfg.vocab_size as u32;
    (0..5u32).map(|i| (7 + 13 * i) % v).collect()
}

/// The one two-thread pool the tests run steps on. A pool made and dropped per test would
/// have its threads end while the next test counts, and a rayon thread that ends allocates
/// (its work-stealing deque's epoch bag goes to the global queue).
fn two_threads() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
    })
}

/// Allocations (fresh and regrown) made while `f` runs, on every thread.
fn allocations(f: impl FnOnce()) -> usize {
    let region = Region::new(GLOBAL);
    f();
    let c = region.change();
    c.allocations + c.reallocations
}

/// Decode greedily with a kept run state; returns the allocations of the counted steps and
/// the logits of every step (warm-up and counted).
fn decode_run_state(m: &Model) -> (usize, Vec<Vec<f32>>) {
    let mut st = SeqState::new(&m.cfg);
    st.reserve(POSITIONS, &m.cfg);
    let mut run = RunState::new();
    let mut seen = Vec::new();
    let mut next = k3::kernels::argmax(
        m.forward_run(&mut st, &mut run, &prompt(m), Logits::Last)
            .unwrap(),
    );
    seen.push(run.logits().to_vec());
    for _ in 0..WARM {
        next = k3::kernels::argmax(
            m.forward_run(&mut st, &mut run, &[next], Logits::Last)
                .unwrap(),
        );
        seen.push(run.logits().to_vec());
    }
    let mut counted = vec![0f32; STEPS * m.cfg.vocab_size];
    let n = allocations(|| {
        for row in counted.chunks_mut(m.cfg.vocab_size) {
            let l = m
                .forward_run(&mut st, &mut run, &[next], Logits::Last)
                .unwrap();
            row.copy_from_slice(l);
            next = k3::kernels::argmax(l);
        }
    });
    seen.extend(counted.chunks(m.cfg.vocab_size).map(<[f32]>::to_vec));
    (n, seen)
}

/// The same greedy decode through the allocating API: the oracle for the logits.
fn decode_plain(m: &Model) -> Vec<Vec<f32>> {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, &prompt(m), Logits::Last).unwrap();
    let mut seen = vec![logits.clone()];
    for _ in 0..WARM + STEPS {
        let next = k3::kernels::argmax(&logits);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
        seen.push(logits.clone());
    }
    seen
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn a_resident_decoding_step_allocates_nothing() {
    // Two shapes (6 and 9 layers, different widths, block sizes and expert counts): the count
    // does not depend on any of them.
    for set in ["tiny", "tiny2"] {
        let m = Model::load(&fixture(set)).unwrap();
        let (n, seen) = decode_run_state(&m);
        assert!(
            n <= OUTSIDE_THE_POOL,
            "{set}: {n} allocations in {STEPS} decoding steps"
        );
        assert_eq!(
            bits(&seen),
            bits(&decode_plain(&m)),
            "{set}: the run state changed a bit of the logits"
        );
    }
}

/// Decoding under a memory budget: every layer pinned and an expert cache that holds every
/// expert once read. The first decode reads the experts the sequence routes to; the second,
/// the same sequence from a fresh state, finds every one of them in the cache, and its steps
/// (the store's lookups, its predictions of the next layer's experts, the embedding row read
/// from the checkpoint, the pinned head) allocate no more than a resident step.
fn a_decoding_step_under_a_budget_allocates_nothing() {
    for set in ["tiny", "tiny2"] {
        let req = BudgetRequest::Split {
            trunk: None,
            cache: 1 << 30,
        };
        let (m, info) = Model::open(&fixture(set), req, POSITIONS as u64).unwrap();
        assert!(info.plan.budget_bytes.is_some(), "{set}: the model streams");
        assert!(m.store().planned().is_some());
        let (_, first) = decode_run_state(&m);
        let reads = |s: k3::stream::stats::StatsSnapshot| (s.expert_misses, s.prefetch_reads);
        let after_first = reads(m.stats());
        assert!(
            after_first.0 + after_first.1 > 0,
            "{set}: the first decode read its experts"
        );
        let (n, seen) = decode_run_state(&m);
        assert_eq!(
            reads(m.stats()),
            after_first,
            "{set}: the second decode found every expert in the cache"
        );
        assert!(
            n <= OUTSIDE_THE_POOL,
            "{set}: {n} allocations in {STEPS} decoding steps under a budget"
        );
        let resident = Model::load(&fixture(set)).unwrap();
        let want = bits(&decode_plain(&resident));
        assert_eq!(bits(&first), want, "{set}: the budget changed a bit");
        assert_eq!(bits(&seen), want, "{set}: the budget changed a bit");
    }
}

/// Decoding at the floor budget: no layer pinned, so every layer is read for each step (from
/// the shards, then from a packed trunk stored raw, then from one stored encoded, staged and
/// decoded into the slot) into the read-ahead ring's slots and bound through the layer table
/// made at open, and the floor's few expert slots miss again and again (each miss
/// read in place into the memory of the expert its slot let go). Nothing of this allocates;
/// nor does the same with an expert cache that holds every expert, where every expert hits.
fn a_decoding_step_at_the_floor_allocates_nothing() {
    let pool = two_threads();
    for set in ["tiny", "tiny2"] {
        let resident = Model::load(&fixture(set)).unwrap();
        let want = bits(&decode_plain(&resident));
        let (_, info) =
            Model::open(&fixture(set), BudgetRequest::Resident, POSITIONS as u64).unwrap();
        let floor = info.plan.floor_bytes;
        let dir = std::env::temp_dir().join(format!("k3-alloc-trunk-{set}-{}", std::process::id()));
        let enc = dir.with_extension("encoded");
        let nib = dir.with_extension("nibble");
        for (d, coding) in [
            (&dir, None),
            (&enc, Some(Coding::Entropy)),
            (&nib, Some(Coding::Nibble)),
        ] {
            let _ = std::fs::remove_dir_all(d);
            let ck = k3::stream::checkpoint::Checkpoint::open(&fixture(set)).unwrap();
            let layers = resident.cfg.num_hidden_layers;
            let r = k3::stream::trunk::pack(
                &ck,
                layers,
                Some(k3::engine::bind::names::LM_HEAD),
                d,
                false,
                coding,
                &|_, _| {},
            )
            .unwrap();
            let encoded = r.manifest.layers.iter().flat_map(|l| l.tensors.values());
            assert_eq!(
                encoded.filter(|t| t.is_encoded()).count() > 0,
                coding.is_some()
            );
        }
        // The floor's plan, and the same with an expert cache that holds every expert: there
        // every layer is still read for each step, and the counted decode (the second) finds
        // every expert in the cache.
        let every = (resident.cfg.num_hidden_layers * resident.cfg.num_experts) as u64;
        for (trunk, cache_all) in [
            (None, false),
            (None, true),
            (Some(&dir), false),
            (Some(&dir), true),
            (Some(&enc), false),
            (Some(&enc), true),
            (Some(&nib), false),
            (Some(&nib), true),
        ] {
            let mut opts = k3::engine::weights::OpenOptions {
                budget: BudgetRequest::Resident,
                context: POSITIONS as u64,
                trunk: trunk.cloned(),
                ..Default::default()
            };
            // An entropy-coded trunk's floor counts the staging of its largest run (a
            // nibble-coded one's layers may be read in place instead, with none).
            let (_, info) = Model::open_with(&fixture(set), &opts).unwrap();
            let staged = info.sizes.layer_window.iter().max().copied().unwrap_or(0);
            if trunk != Some(&nib) {
                assert_eq!(info.plan.floor_bytes, floor + staged, "{set}");
            }
            assert_eq!(staged > 0, trunk.is_some_and(|t| *t != dir), "{set}");
            opts.budget = BudgetRequest::Total(info.plan.floor_bytes);
            let (m, _) = Model::open_with(&fixture(set), &opts).unwrap();
            let mut plan = m.store().planned().unwrap().1;
            assert_eq!(plan.n_pinned(), 0, "{set}: nothing pinned at the floor");
            if cache_all {
                plan.expert_slots = every;
                m.store().set_plan(plan).unwrap();
                let _ = pool.install(|| decode_run_state(&m));
            }
            let before = m.stats();
            let (n, seen) = pool.install(|| decode_run_state(&m));
            let s = m.stats();
            let (misses, hits) = (
                s.expert_misses - before.expert_misses,
                s.expert_hits - before.expert_hits,
            );
            if cache_all {
                assert_eq!(misses, 0, "{set}: every expert was in the cache");
                assert!(hits > 0);
            } else {
                assert!(misses > 0, "{set}: the floor's cache missed");
            }
            assert_eq!(
                n, 0,
                "{set} (trunk {trunk:?}, cache of every expert {cache_all}): {n} allocations \
                 in {STEPS} steps streaming every layer, {misses} expert misses"
            );
            assert_eq!(bits(&seen), want, "{set}: the floor changed a bit");
        }
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&enc);
        let _ = std::fs::remove_dir_all(&nib);
    }
}

/// Pinning layers stored encoded takes the layers' own memory and no buffer of their stored
/// runs beside them (those are read into the ring's staging buffer, which the plan counts):
/// the bytes allocated while a plan pins every layer stay within the layers' decoded size
/// plus the bound values' widened vectors, under 1.5 times it (reading each run into a buffer
/// of its own allocated about 1.9 times it), and the
/// tokens stay the resident model's.
fn pinning_an_encoded_layer_allocates_only_the_layer() {
    for set in ["tiny", "tiny2"] {
        let resident = Model::load(&fixture(set)).unwrap();
        let want = bits(&decode_plain(&resident));
        let enc = std::env::temp_dir().join(format!("k3-alloc-pin-{set}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&enc);
        let ck = k3::stream::checkpoint::Checkpoint::open(&fixture(set)).unwrap();
        let layers = resident.cfg.num_hidden_layers;
        k3::stream::trunk::pack(
            &ck,
            layers,
            Some(k3::engine::bind::names::LM_HEAD),
            &enc,
            false,
            Some(Coding::Entropy),
            &|_, _| {},
        )
        .unwrap();
        let mut opts = k3::engine::weights::OpenOptions {
            budget: BudgetRequest::Resident,
            context: POSITIONS as u64,
            trunk: Some(enc.clone()),
            ..Default::default()
        };
        let (_, info) = Model::open_with(&fixture(set), &opts).unwrap();
        opts.budget = BudgetRequest::Total(info.plan.floor_bytes);
        let (m, info) = Model::open_with(&fixture(set), &opts).unwrap();
        let mut plan = m.store().planned().unwrap().1;
        assert_eq!(plan.n_pinned(), 0, "{set}: nothing pinned at the floor");
        plan.pinned.iter_mut().for_each(|p| *p = true);
        let region = Region::new(GLOBAL);
        m.store().set_plan(plan).unwrap();
        let bytes = region.change().bytes_allocated as u64;
        let layers_bytes: u64 = info.sizes.layer_trunk.iter().sum();
        assert!(
            bytes <= layers_bytes + layers_bytes / 2,
            "{set}: pinning {layers} encoded layers of {layers_bytes} B allocated {bytes} B"
        );
        println!("{set}: pinning {layers_bytes} B of layers allocated {bytes} B");
        assert_eq!(
            bits(&decode_plain(&m)),
            want,
            "{set}: pinned encoded layers changed a bit"
        );
        let _ = std::fs::remove_dir_all(&enc);
    }
}

fn a_step_on_two_worker_threads_allocates_nothing() {
    let m = Model::load(&fixture("tiny2")).unwrap();
    let pool = two_threads();
    let (n, seen) = pool.install(|| decode_run_state(&m));
    assert_eq!(
        n, 0,
        "{n} allocations in {STEPS} decoding steps on two threads"
    );
    assert_eq!(bits(&seen), bits(&decode_plain(&m)));
}

fn a_speculator_step_without_a_draft_allocates_nothing() {
    let m = Model::load(&fixture("tiny")).unwrap();
    let mut st = SeqState::new(&m.cfg);
    st.reserve(POSITIONS, &m.cfg);
    let mut spec = Speculator::new(SpecMode::Off);
    let mut history = prompt(&m);
    history.reserve(WARM + STEPS + 1);
    let mut logits = m.forward(&mut st, &history, Logits::Last).unwrap();
    let mut step = |history: &mut Vec<u32>, logits: &mut Vec<f32>| {
        let next = k3::kernels::argmax(logits);
        history.push(next);
        let l = spec.advance(&m, &mut st, history, next, POSITIONS).unwrap();
        logits.clear();
        logits.extend_from_slice(l);
    };
    for _ in 0..WARM {
        step(&mut history, &mut logits);
    }
    let n = allocations(|| {
        for _ in 0..STEPS {
            step(&mut history, &mut logits);
        }
    });
    assert!(
        n <= OUTSIDE_THE_POOL,
        "{n} allocations in {STEPS} speculator steps"
    );
    let want = decode_plain(&m);
    assert_eq!(bits(&[logits]), bits(&want[WARM + STEPS..]));
}

/// Proposes the serial greedy continuation with one token changed at a place that moves with
/// the position (or none), so that verification passes are kept in full, in part, or not at
/// all.
struct Oracle {
    /// The serial greedy ids: `ids[j]` follows the prompt and `ids[..j]`.
    ids: Vec<u32>,
    prompt: usize,
    vocab: u32,
}

impl k3::engine::spec::Drafter for Oracle {
    fn propose(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        let j = history.len() - self.prompt;
        let wrong = (history.len() / 2) % 5;
        for (i, &id) in self.ids[j..].iter().take(max).enumerate() {
            out.push(if i == wrong {
                (id + 1) % self.vocab
            } else {
                id
            });
        }
    }
}

fn a_speculator_step_with_drafts_allocates_nothing() {
    let pool = two_threads();
    for set in ["tiny", "tiny2"] {
        let m = Model::load(&fixture(set)).unwrap();
        let want = decode_plain(&m);
        let ids: Vec<u32> = want.iter().map(|l| k3::kernels::argmax(l)).collect();
        // Longer warm-up: the longest chunk and every kind of rollback have been seen.
        let (warm, steps) = (24, STEPS - 24);
        let drafter = Oracle {
            ids: ids.clone(),
            prompt: prompt(&m).len(),
            vocab: m.cfg.vocab_size as u32,
        };
        let mut spec = Speculator::with_drafter(SpecMode::Fixed(4), Box::new(drafter));
        let mut st = SeqState::new(&m.cfg);
        st.reserve(POSITIONS + 8, &m.cfg);
        let mut history = prompt(&m);
        let n_prompt = history.len();
        history.reserve(POSITIONS);
        let mut seen = vec![m.forward(&mut st, &history, Logits::Last).unwrap()];
        let mut counted = vec![0f32; steps * m.cfg.vocab_size];
        let n = pool.install(|| {
            let mut step = |history: &mut Vec<u32>, out: &mut [f32]| {
                let next = ids[history.len() - n_prompt];
                history.push(next);
                let l = spec.advance(&m, &mut st, history, next, POSITIONS).unwrap();
                out.copy_from_slice(l);
            };
            for _ in 0..warm {
                let mut row = vec![0f32; m.cfg.vocab_size];
                step(&mut history, &mut row);
                seen.push(row);
            }
            allocations(|| {
                for row in counted.chunks_mut(m.cfg.vocab_size) {
                    step(&mut history, row);
                }
            })
        });
        seen.extend(counted.chunks(m.cfg.vocab_size).map(<[f32]>::to_vec));
        let stats = spec.stats();
        assert!(
            stats.draft_passes > 8 && stats.accepted > 8 && stats.accepted < stats.proposed,
            "{set}: drafts were not verified and rejected in part: {stats:?}"
        );
        assert_eq!(
            n, 0,
            "{set}: {n} allocations in {steps} speculative steps on two threads"
        );
        assert_eq!(
            bits(&seen),
            bits(&want[..=warm + steps]),
            "{set}: speculation changed a bit of the logits"
        );
    }
}

fn a_prefill_chunk_allocates_nothing_once_the_buffers_are_sized() {
    let pool = two_threads();
    for set in ["tiny", "tiny2"] {
        let m = Model::load(&fixture(set)).unwrap();
        let v = m.cfg.vocab_size as u32;
        let ids: Vec<u32> = (0..64u32).map(|i| (3 + 29 * i) % v).collect();
        // Four chunks of 16 on one state size the buffers (the attention scores grow with the
        // context); the same four on a second state are counted.
        let mut states = [SeqState::new(&m.cfg), SeqState::new(&m.cfg)];
        for st in &mut states {
            st.reserve(ids.len(), &m.cfg);
        }
        let [first, second] = &mut states;
        let mut run = RunState::new();
        let mut last = Vec::new();
        let n = pool.install(|| {
            for c in ids.chunks(16) {
                m.forward_run(first, &mut run, c, Logits::Last).unwrap();
            }
            allocations(|| {
                for c in ids.chunks(16) {
                    m.forward_run(second, &mut run, c, Logits::Last).unwrap();
                }
            })
        });
        last.extend_from_slice(run.logits());
        assert_eq!(n, 0, "{set}: {n} allocations in four prefill chunks");
        let mut plain = SeqState::new(&m.cfg);
        let want = m.forward(&mut plain, &ids, Logits::Last).unwrap();
        assert_eq!(
            bits(&[last]),
            bits(&[want]),
            "{set}: chunked prefill changed a bit"
        );
    }
}

/// `(name, function)` pairs, each name written once.
macro_rules! tests {
    ($($f:ident),* $(,)?) => {
        &[$((stringify!($f), $f as fn())),*]
    };
}

/// The tests, in the order they run.
/// Reading and decoding an encoded output head rows at a time, as a token that streams it does
/// (`Trunk::stream_head`: stored bytes read a segment at a time, decoded a block at a time
/// into whole rows), allocates nothing once its two buffers have grown, and gives the head's
/// bytes. (The test models' heads are small enough that the streamer reads them raw; the
/// reader is the same whatever the head's size.)
fn streaming_an_encoded_head_allocates_nothing() {
    let set = "tiny";
    let resident = Model::load(&fixture(set)).unwrap();
    let dir = std::env::temp_dir().join(format!("k3-alloc-head-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ck = k3::stream::checkpoint::Checkpoint::open(&fixture(set)).unwrap();
    let layers = resident.cfg.num_hidden_layers;
    let head = k3::engine::bind::names::LM_HEAD;
    for coding in [Coding::Nibble, Coding::Entropy] {
        k3::stream::trunk::pack(
            &ck,
            layers,
            Some(head),
            &dir,
            true,
            Some(coding),
            &|_, _| {},
        )
        .unwrap();
        let trunk = k3::stream::trunk::Trunk::open(&dir, &ck, layers).unwrap();
        let cols = resident.cfg.hidden_size;
        let mut want = Vec::new();
        ck.read_span(
            head,
            0,
            (resident.cfg.vocab_size * cols * 2) as u64,
            &mut want,
        )
        .unwrap();
        let mut got = vec![0u8; want.len()];
        let (mut enc, mut dec) = (Vec::new(), Vec::new());
        let mut read = || {
            trunk
                .stream_head(7, cols, &mut enc, &mut dec, |r0, v| {
                    for (k, x) in v.iter().enumerate() {
                        let at = 2 * (r0 * cols + k);
                        got[at..at + 2].copy_from_slice(&x.to_le_bytes());
                    }
                })
                .unwrap();
        };
        read();
        let n = allocations(|| {
            for _ in 0..4 {
                read();
            }
        });
        assert_eq!(n, 0, "{coding:?}: {n} allocations in 4 reads of the head");
        assert!(got == want, "{coding:?}: the head decodes to its source");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const TESTS: &[(&str, fn())] = tests![
    a_resident_decoding_step_allocates_nothing,
    a_decoding_step_under_a_budget_allocates_nothing,
    a_decoding_step_at_the_floor_allocates_nothing,
    pinning_an_encoded_layer_allocates_only_the_layer,
    a_step_on_two_worker_threads_allocates_nothing,
    a_speculator_step_without_a_draft_allocates_nothing,
    a_speculator_step_with_drafts_allocates_nothing,
    a_prefill_chunk_allocates_nothing_once_the_buffers_are_sized,
    streaming_an_encoded_head_allocates_nothing,
];

/// Runs every test whose name contains one of the arguments that are not flags (all of them
/// when there is none) and none named by `--skip`, one after another; `--list` lists them as
/// libtest does. A failing test panics, which ends the process with a failing status.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // libtest's flags that take a value; `--skip`'s value names tests to leave out.
    const VALUED: &[&str] = &["--test-threads", "--format", "--color", "--logfile", "-Z"];
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut it = args.iter().map(String::as_str);
    while let Some(a) = it.next() {
        if a == "--skip" {
            skips.extend(it.next());
        } else if VALUED.contains(&a) {
            it.next();
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    let chosen = TESTS.iter().filter(|(name, _)| {
        (filters.is_empty() || filters.iter().any(|f| name.contains(f)))
            && !skips.iter().any(|s| name.contains(s))
    });
    if args.iter().any(|a| a == "--list") {
        for (name, _) in chosen {
            println!("{name}: test");
        }
        return;
    }
    let mut ran = 0;
    for (name, test) in chosen {
        print!("test {name} ... ");
        test();
        println!("ok");
        ran += 1;
    }
    println!("\ntest result: ok. {ran} passed; 0 failed");
}
