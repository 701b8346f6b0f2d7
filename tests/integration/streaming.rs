//! The same tokens at every memory budget: a resident model and streamed ones (minimum budget,
//! about half, a split budget) give bitwise identical logits, also when the plan changes in the
//! middle of a generation.

use crate::common::{argmax, fixture, json, u32s};
use k3::engine::model::Logits;
use k3::engine::{Model, SeqState};
use k3::stream::budget::{self, BudgetRequest};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Greedy generation: the logits of every step.
fn generate(m: &Model, prompt: &[u32], n: usize, mut between: impl FnMut(usize)) -> Vec<Vec<f32>> {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last).unwrap();
    let mut out = vec![logits.clone()];
    for step in 0..n {
        between(step);
        let next = argmax(&logits);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
        out.push(logits.clone());
    }
    out
}

fn open(set: &str, req: BudgetRequest) -> (Model, k3::engine::weights::LoadInfo) {
    Model::open(&fixture(set), req, 512).unwrap()
}

#[test]
fn every_budget_gives_the_same_logits() {
    for set in ["tiny", "tiny2"] {
        let o = json(&format!("{set}/oracle.json"));
        let prompt = u32s(&o["prompt_ids"]);
        let (resident, info) = open(set, BudgetRequest::Resident);
        let want = generate(&resident, &prompt, 12, |_| {});
        let floor = info.plan.floor_bytes;
        let everything = info.sizes.model_bytes();
        for total in [floor, floor + everything / 2, floor + everything / 4] {
            let (m, info) = open(set, BudgetRequest::Total(total));
            let st = m.streamer().expect("a budget below the model size streams");
            let plan = st.plan();
            println!(
                "{set} at {}: {} of {} layers pinned, {} expert slots, head resident {}",
                budget::gb(total),
                plan.n_pinned(),
                plan.pinned.len(),
                plan.expert_slots,
                plan.head_resident
            );
            assert!(info.plan.budget_bytes.is_some());
            let got = generate(&m, &prompt, 12, |_| {});
            for (a, b) in got.iter().zip(&want) {
                assert_eq!(bits(a), bits(b), "{set} at {total} bytes");
            }
            let s = st.stats();
            assert!(s.disk_bytes_read > 0 && s.expert_misses > 0, "{s:?}");
        }
    }
}

#[test]
fn a_plan_change_between_tokens_changes_no_token() {
    let set = "tiny";
    let o = json(&format!("{set}/oracle.json"));
    let prompt = u32s(&o["prompt_ids"]);
    let (resident, info) = open(set, BudgetRequest::Resident);
    let want = generate(&resident, &prompt, 16, |_| {});
    let sizes = info.sizes.clone();
    let floor = info.plan.floor_bytes;
    let (m, _) = open(set, BudgetRequest::Total(floor));
    let st = m.streamer().unwrap();
    let got = generate(&m, &prompt, 16, |step| {
        let total = match step {
            4 => floor + sizes.model_bytes(), // grow: everything pinned
            9 => floor,                       // shrink back to the floor
            12 => floor + sizes.model_bytes() / 3,
            _ => return,
        };
        let p = budget::plan(&sizes, BudgetRequest::Total(total), 512, None).unwrap();
        st.set_plan(p).unwrap();
    });
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn a_budget_below_the_floor_is_refused_with_three_numbers() {
    let (_, info) = open("tiny", BudgetRequest::Resident);
    let err = Model::open(
        &fixture("tiny"),
        BudgetRequest::Total(info.plan.floor_bytes - 1),
        512,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("floor") && err.contains("short by"), "{err}");
}
