//! The tiny released-format checkpoint against its float64 oracle (`tests/fixtures/tiny`).

use crate::common::{argmax, f32_bits, fixture, json, rel_err, u32s};
use k3::engine::{Logits, Model, SeqState, Trace};
use std::sync::OnceLock;

/// Relative logit tolerance: max|Δ| / max|want| per row.
const LOGIT_TOL: f64 = 1e-4;

/// The two oracle sets: `tiny` (the shared oracle's shape) and `tiny2` (another shape: 9
/// layers, block size 2, two dense layers, 16 experts top-4, scaling 2.5, eps 3e-6).
const SETS: [&str; 2] = ["tiny", "tiny2"];

fn model_of(set: &str) -> &'static Model {
    static M: [OnceLock<Model>; 2] = [OnceLock::new(), OnceLock::new()];
    let i = SETS.iter().position(|s| *s == set).unwrap();
    M[i].get_or_init(|| Model::load(&fixture(set)).expect("checkpoint loads"))
}

fn oracle_of(set: &str) -> &'static serde_json::Value {
    static O: [OnceLock<serde_json::Value>; 2] = [OnceLock::new(), OnceLock::new()];
    let i = SETS.iter().position(|s| *s == set).unwrap();
    O[i].get_or_init(|| json(&format!("{set}/oracle.json")))
}

fn model() -> &'static Model {
    model_of("tiny")
}

fn oracle() -> &'static serde_json::Value {
    oracle_of("tiny")
}

fn vocab() -> usize {
    model().cfg.vocab_size
}

#[test]
fn teacher_forcing_matches_every_position() {
    for set in SETS {
        teacher_forcing(set);
    }
}

fn teacher_forcing(set: &str) {
    let m = model_of(set);
    let o = oracle_of(set);
    let vocab = || m.cfg.vocab_size;
    let full = u32s(&o["full_ids"]);
    let mut st = SeqState::new(&m.cfg);
    let mut trace = Trace::default();
    let logits = m
        .forward_traced(&mut st, &full, Logits::All, Some(&mut trace))
        .unwrap();
    let preds: Vec<u32> = logits.chunks(vocab()).map(argmax).collect();
    assert_eq!(preds, u32s(&o["tf_pred"]));
    let n_prompt = o["prompt_ids"].as_array().unwrap().len();
    let e1 = rel_err(
        &logits[(n_prompt - 1) * vocab()..n_prompt * vocab()],
        &f32_bits(&o["logits_last_prompt_f32_bits"]),
    );
    let e2 = rel_err(
        &logits[(full.len() - 1) * vocab()..],
        &f32_bits(&o["logits_last_f32_bits"]),
    );
    println!("{set} oracle: teacher-forced logit error {e1:.3e} (last prompt), {e2:.3e} (last)");
    assert!(e1 < LOGIT_TOL && e2 < LOGIT_TOL, "{e1} {e2}");
    // Layer trace at the two recorded positions.
    let pos = u32s(&o["trace"]["positions"]);
    let d = m.cfg.hidden_size;
    for (pi, &p) in pos.iter().enumerate() {
        for (il, lo) in trace.layer_out.iter().enumerate() {
            let want = f32_bits(&o["trace"]["layer_out_f32_bits"][pi][il]);
            let got = &lo[p as usize * d..(p as usize + 1) * d];
            let e = rel_err(got, &want);
            assert!(e < LOGIT_TOL, "layer {il} position {p}: {e}");
        }
    }
}

#[test]
fn greedy_prefill_then_incremental_decode() {
    for set in SETS {
        greedy(set);
    }
}

fn greedy(set: &str) {
    let m = model_of(set);
    let o = oracle_of(set);
    let prompt = u32s(&o["prompt_ids"]);
    let full = u32s(&o["full_ids"]);
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, &prompt, Logits::Last).unwrap();
    let e = rel_err(&logits, &f32_bits(&o["logits_last_prompt_f32_bits"]));
    println!("{set} oracle: prefill logit error {e:.3e}");
    assert!(e < LOGIT_TOL);
    let mut ids = prompt.clone();
    let n_gen = o["n_generated"].as_u64().unwrap() as usize;
    for _ in 0..n_gen {
        let next = argmax(&logits);
        ids.push(next);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
    }
    assert_eq!(ids, full, "greedy {n_gen}/{n_gen}");
}

#[test]
fn multi_turn_carried_state() {
    let m = model();
    let mt = &oracle()["multi_turn"];
    let v = vocab();
    let t1 = u32s(&mt["turn1_ids"]);
    let r1 = u32s(&mt["turn1_reply_ids"]);
    let t2 = u32s(&mt["turn2_ids"]);
    let r2 = u32s(&mt["turn2_reply_ids"]);
    let tf = u32s(&mt["tf_pred"]);
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, &t1, Logits::Last).unwrap();
    let e1 = rel_err(&logits, &f32_bits(&mt["logits_end_turn1_f32_bits"]));
    let mut reply = Vec::new();
    for i in 0..r1.len() {
        let next = argmax(&logits);
        reply.push(next);
        if i + 1 < r1.len() {
            logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
        }
    }
    assert_eq!(reply, r1, "turn 1 reply");
    // Turn 2 as one chunk on top of the carried state: the last reply id (not yet forwarded)
    // followed by the new turn.
    let mut chunk = vec![*reply.last().unwrap()];
    chunk.extend_from_slice(&t2);
    let all = m.forward(&mut st, &chunk, Logits::All).unwrap();
    let start = t1.len() + r1.len() - 1;
    let preds: Vec<u32> = all.chunks(v).map(argmax).collect();
    assert_eq!(
        preds,
        tf[start..start + chunk.len()],
        "turn 2 chunk argmaxes"
    );
    let last = &all[(chunk.len() - 1) * v..];
    let e2 = rel_err(last, &f32_bits(&mt["logits_end_turn2_prompt_f32_bits"]));
    let mut logits = last.to_vec();
    let mut reply = Vec::new();
    for _ in 0..r2.len() {
        let next = argmax(&logits);
        reply.push(next);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
    }
    assert_eq!(reply, r2, "turn 2 reply");
    // One fresh teacher-forced pass over the whole conversation.
    let full = u32s(&mt["full_ids"]);
    let mut fresh = SeqState::new(&m.cfg);
    let all = m.forward(&mut fresh, &full, Logits::All).unwrap();
    let preds: Vec<u32> = all.chunks(v).map(argmax).collect();
    assert_eq!(preds, tf);
    let e3 = rel_err(
        &all[(full.len() - 1) * v..],
        &f32_bits(&mt["logits_last_f32_bits"]),
    );
    println!("tiny oracle multi-turn: logit error {e1:.3e} / {e2:.3e} / {e3:.3e}");
    assert!(
        e1 < LOGIT_TOL && e2 < LOGIT_TOL && e3 < LOGIT_TOL,
        "{e1} {e2} {e3}"
    );
}

#[test]
fn routing_matches_the_oracle() {
    for set in SETS {
        routing(set);
    }
}

fn routing(set: &str) {
    let m = model_of(set);
    let o = oracle_of(set);
    let full = u32s(&o["full_ids"]);
    let mut st = SeqState::new(&m.cfg);
    let mut trace = Trace::default();
    m.forward_traced(&mut st, &full, Logits::None, Some(&mut trace))
        .unwrap();
    for entry in o["routing"].as_array().unwrap() {
        let il = entry["layer"].as_u64().unwrap() as usize;
        for (t, want) in entry["topk_idx"].as_array().unwrap().iter().enumerate() {
            let mut want = u32s(want);
            let mut got: Vec<u32> = trace.routing[il][t].0.iter().map(|&e| e as u32).collect();
            want.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, want, "{set} layer {il} position {t}");
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn prefill_and_incremental_decode_are_bitwise_identical() {
    let m = model();
    let full = u32s(&oracle()["full_ids"]);
    let v = vocab();
    let mut a = SeqState::new(&m.cfg);
    let all = m.forward(&mut a, &full, Logits::All).unwrap();
    let mut b = SeqState::new(&m.cfg);
    let mut stepwise = Vec::new();
    // Mixed chunk sizes: 5, then 1 at a time, then the rest as one chunk.
    stepwise.extend(m.forward(&mut b, &full[..5], Logits::All).unwrap());
    for &id in &full[5..20] {
        stepwise.extend(m.forward(&mut b, &[id], Logits::All).unwrap());
    }
    stepwise.extend(m.forward(&mut b, &full[20..], Logits::All).unwrap());
    assert_eq!(bits(&all), bits(&stepwise));
    assert_eq!(a, b, "carried state");
    assert_eq!(all.len(), full.len() * v);
}

#[test]
fn thread_count_does_not_change_a_bit() {
    let m = model();
    let full = u32s(&oracle()["full_ids"]);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut st = SeqState::new(&m.cfg);
            m.forward(&mut st, &full, Logits::All).unwrap()
        })
    };
    let one = run(1);
    assert_eq!(bits(&one), bits(&run(2)));
    assert_eq!(bits(&one), bits(&run(3)));
}

/// The six rows of logits `k3 run --gen 6 --dump-logits` writes for the oracle's prompt on
/// `tiny`, with `envs` set and `args` added; each run in its own process, so no test changes
/// the settings others run with.
fn tiny_run_logits(envs: &[(&str, &str)], args: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("logits.f32");
    let full = u32s(&oracle()["full_ids"]);
    let ids: Vec<String> = full.iter().map(u32::to_string).collect();
    crate::common::run_ok(
        crate::common::k3_command()
            .envs(envs.iter().copied())
            .args([
                "run",
                fixture("tiny").to_str().unwrap(),
                "--ids",
                &ids.join(","),
                "--gen",
                "6",
                "--dump-logits",
                out.to_str().unwrap(),
            ])
            .args(args),
    );
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(
        bytes.len(),
        6 * vocab() * 4,
        "{envs:?} {args:?}: six rows of logits"
    );
    bytes
}

/// Keeping the pool's threads looking for work between a pass's parallel loops
/// (`K3_KEEP_WARM`, on by default) changes only who runs a loop's pieces: `k3 run` on two and
/// three threads gives the logits of one thread with it on and off, prompt and decoding.
#[test]
fn keeping_the_pool_warm_does_not_change_a_bit() {
    let one = tiny_run_logits(&[("K3_KEEP_WARM", "0")], &["--threads", "1"]);
    for threads in ["2", "3"] {
        for keep_warm in ["0", "1"] {
            assert_eq!(
                tiny_run_logits(&[("K3_KEEP_WARM", keep_warm)], &["--threads", threads]),
                one,
                "--threads {threads}, K3_KEEP_WARM={keep_warm}"
            );
        }
    }
}

/// Every kernel path gives the same logits, bit for bit: `k3 run` with each path forced by
/// `K3_KERNELS` dumps the logits of the prompt and of every generated token.
#[test]
fn scalar_and_simd_paths_agree_bitwise() {
    let dump = |path: &str| tiny_run_logits(&[("K3_KERNELS", path)], &[]);
    let scalar = dump("generic");
    // Stated tolerance: zero. The paths share lane partitions and reduction trees.
    assert_eq!(dump("auto"), scalar, "the detected path");
    assert_eq!(dump("avx2"), scalar, "AVX2 (or the best path below it)");
}

/// The last layer finishes only the positions whose logits are asked for: the last position's
/// logits of a pass are bit for bit the last row of every position's, and a pass that asks
/// for none leaves the same state, from which decoding goes on the same.
#[test]
fn a_pass_that_asks_for_fewer_logits_gives_the_same_bits_and_state() {
    for set in SETS {
        let m = model_of(set);
        let full = u32s(&oracle_of(set)["full_ids"]);
        let v = m.cfg.vocab_size;
        let (head, tail) = full.split_at(full.len() - 3);
        let mut all_st = SeqState::new(&m.cfg);
        let all = m.forward(&mut all_st, head, Logits::All).unwrap();
        let mut last_st = SeqState::new(&m.cfg);
        let last = m.forward(&mut last_st, head, Logits::Last).unwrap();
        assert_eq!(bits(&last), bits(&all[all.len() - v..]), "{set}");
        let mut none_st = SeqState::new(&m.cfg);
        let none = m.forward(&mut none_st, head, Logits::None).unwrap();
        assert!(none.is_empty(), "{set}");
        assert_eq!(all_st, last_st, "{set}: carried state");
        assert_eq!(all_st, none_st, "{set}: carried state");
        // A pass of one position, and one of several: the same bits after each state.
        let mut after = Vec::new();
        for st in [&mut all_st, &mut last_st, &mut none_st] {
            let one = m.forward(st, &tail[..1], Logits::Last).unwrap();
            let rest = m.forward(st, &tail[1..], Logits::Last).unwrap();
            after.push((bits(&one), bits(&rest)));
        }
        assert_eq!(after[0], after[1], "{set}");
        assert_eq!(after[0], after[2], "{set}");
        let mut whole = SeqState::new(&m.cfg);
        let want = m.forward(&mut whole, &full, Logits::All).unwrap();
        assert_eq!(after[0].1, bits(&want[want.len() - v..]), "{set}");
    }
}
