//! The tiny released-format checkpoint against its float64 oracle (`tests/fixtures/tiny`).

use crate::common::{argmax, f32_bits, fixture, json, rel_err, u32s};
use k3::engine::{Logits, Model, SeqState, Trace};
use std::sync::OnceLock;

/// Relative logit tolerance: max|Δ| / max|want| per row.
const LOGIT_TOL: f64 = 1e-4;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(&fixture("tiny")).expect("tiny checkpoint loads"))
}

fn oracle() -> &'static serde_json::Value {
    static O: OnceLock<serde_json::Value> = OnceLock::new();
    O.get_or_init(|| json("tiny/oracle.json"))
}

fn vocab() -> usize {
    model().cfg.vocab_size
}

#[test]
fn teacher_forcing_matches_every_position() {
    let m = model();
    let o = oracle();
    let full = u32s(&o["full_ids"]);
    let mut st = SeqState::new(&m.cfg);
    let mut trace = Trace::default();
    let logits = m.forward_traced(&mut st, &full, Logits::All, Some(&mut trace));
    let preds: Vec<u32> = logits.chunks(vocab()).map(argmax).collect();
    assert_eq!(preds, u32s(&o["tf_pred"]));
    let n_prompt = o["prompt_ids"].as_array().unwrap().len();
    let e1 = rel_err(&logits[(n_prompt - 1) * vocab()..n_prompt * vocab()], &f32_bits(&o["logits_last_prompt_f32_bits"]));
    let e2 = rel_err(&logits[(full.len() - 1) * vocab()..], &f32_bits(&o["logits_last_f32_bits"]));
    println!("tiny oracle: teacher-forced logit error {e1:.3e} (last prompt), {e2:.3e} (last)");
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
    let m = model();
    let o = oracle();
    let prompt = u32s(&o["prompt_ids"]);
    let full = u32s(&o["full_ids"]);
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, &prompt, Logits::Last);
    let e = rel_err(&logits, &f32_bits(&o["logits_last_prompt_f32_bits"]));
    println!("tiny oracle: prefill logit error {e:.3e}");
    assert!(e < LOGIT_TOL);
    let mut ids = prompt.clone();
    let n_gen = o["n_generated"].as_u64().unwrap() as usize;
    for _ in 0..n_gen {
        let next = argmax(&logits);
        ids.push(next);
        logits = m.forward(&mut st, &[next], Logits::Last);
    }
    assert_eq!(ids, full, "greedy {n_gen}/{n_gen}");
}
