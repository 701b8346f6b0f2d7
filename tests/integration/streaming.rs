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

/// A fixture's prompt, the logits of `n` greedy steps after it with the whole model resident,
/// and the resident load's information (sizes and floor).
fn serial_reference(
    set: &str,
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>, k3::engine::weights::LoadInfo) {
    let o = json(&format!("{set}/oracle.json"));
    let prompt = u32s(&o["prompt_ids"]);
    let (resident, info) = open(set, BudgetRequest::Resident);
    let want = generate(&resident, &prompt, n, |_| {});
    (prompt, want, info)
}

#[test]
fn every_budget_gives_the_same_logits() {
    for set in ["tiny", "tiny2"] {
        let (prompt, want, info) = serial_reference(set, 12);
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

/// The read-ahead ring's slots take what the plan counts for them (the sizes of the largest
/// layers it streams, one slot each), not as many slots of the largest layer's size, at every
/// budget — and the tokens stay the resident model's.
#[test]
fn the_read_ahead_ring_takes_what_the_plan_counts() {
    // A page per slot (the arena's rounding) and the 64-byte alignment of each tensor.
    const SLACK: u64 = 64 << 10;
    let mut differ = 0;
    let small = small().join("small");
    for set in ["tiny", "tiny2", "small"] {
        let dir = match set {
            "small" => small.clone(),
            _ => fixture(set),
        };
        let prompt = [1u32, 5, 9, 2];
        let (resident, info) = Model::open(&dir, BudgetRequest::Resident, 512).unwrap();
        let want = generate(&resident, &prompt, 3, |_| {});
        drop(resident);
        let floor = info.plan.floor_bytes;
        let everything = info.sizes.model_bytes();
        for total in [floor, floor + everything / 4, floor + everything / 2] {
            let (m, info) = Model::open(&dir, BudgetRequest::Total(total), 512).unwrap();
            let st = m.streamer().expect("a budget below the model size streams");
            let got = generate(&m, &prompt, 3, |_| {});
            for (a, b) in got.iter().zip(&want) {
                assert_eq!(bits(a), bits(b), "{set} at {total} bytes");
            }
            let plan = st.plan();
            let ring = st.stats().ring_bytes;
            let largest = (0..plan.pinned.len())
                .filter(|&il| !plan.pinned[il])
                .map(|il| info.sizes.layer_trunk[il])
                .max()
                .unwrap_or(0);
            println!(
                "{set} at {total} B: {} slots, plan {} B, ring {ring} B, largest streamed {largest} B",
                plan.ring_slots, plan.ring_bytes
            );
            assert!(
                ring <= plan.ring_bytes + plan.ring_slots * SLACK,
                "{set} at {total} B: the ring takes {ring} B, the plan counts {} B",
                plan.ring_bytes
            );
            if plan.ring_slots * largest > plan.ring_bytes + plan.ring_slots * SLACK {
                differ += 1;
            }
        }
    }
    assert!(
        differ > 0,
        "no plan streams layers of different sizes: the test shows nothing"
    );
}

#[test]
fn prefetching_predicted_experts_changes_no_token() {
    let mut read_ahead = 0;
    for set in ["tiny", "tiny2"] {
        let (prompt, want, info) = serial_reference(set, 12);
        let (floor, everything) = (info.plan.floor_bytes, info.sizes.model_bytes());
        for (total, n) in [(floor + everything / 2, 2), (floor + everything / 3, 16)] {
            let (m, _) = open(set, BudgetRequest::Total(total));
            let st = m.streamer().expect("streamed");
            st.set_prefetch(n);
            let got = generate(&m, &prompt, 12, |step| {
                // A plan change waits for reads ahead of a layer that never asked for them.
                if step == 6 {
                    let p = budget::plan(&info.sizes, BudgetRequest::Total(floor), 512, None);
                    st.set_plan(p.unwrap()).unwrap();
                }
            });
            for (a, b) in got.iter().zip(&want) {
                assert_eq!(bits(a), bits(b), "{set} at {total} bytes, prefetch {n}");
            }
            let s = st.stats();
            println!(
                "{set}: prefetch {n}: {} read ahead, {} used, {} dropped; {} of {} predicted right",
                s.prefetch_reads,
                s.prefetch_used,
                s.prefetch_cancelled,
                s.predicted_right,
                s.predicted
            );
            assert!(s.prefetch_used <= s.prefetch_reads, "{s:?}");
            read_ahead += s.prefetch_reads;
        }
    }
    assert!(read_ahead > 0, "no expert was read ahead");
}

#[test]
fn a_prompt_pass_reads_the_next_layers_predicted_experts_ahead_and_changes_no_bit() {
    let (mut queued, mut used) = (0, 0);
    for set in ["tiny", "tiny2"] {
        let o = json(&format!("{set}/oracle.json"));
        let prompt = u32s(&o["prompt_ids"]);
        assert!(
            prompt.len() > 1,
            "{set}: the prompt is one pass of several tokens"
        );
        let (resident, info) = open(set, BudgetRequest::Resident);
        let want = resident
            .forward(&mut SeqState::new(&resident.cfg), &prompt, Logits::All)
            .unwrap();
        let (floor, everything) = (info.plan.floor_bytes, info.sizes.model_bytes());
        for total in [floor + everything / 4, floor + everything / 2] {
            // Late depth 0 queues every read and starts none (the layer's routing drops
            // them); 64 starts them beside the layer's own reads.
            for late in [0, 64] {
                let (m, _) = open(set, BudgetRequest::Total(total));
                let st = m.streamer().unwrap();
                st.set_prefetch(16);
                st.set_prefetch_depth(late.min(3));
                st.set_prefetch_late_depth(late);
                let got = m
                    .forward(&mut SeqState::new(&m.cfg), &prompt, Logits::All)
                    .unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{set} at {total} B, late depth {late}"
                );
                let s = st.stats();
                // A multi-token pass's prediction is not scored per rank.
                assert_eq!(s.predictions, 0, "{s:?}");
                if late == 0 {
                    assert_eq!(s.prefetch_reads, 0, "{s:?}");
                }
                assert!(s.prefetch_used <= s.prefetch_reads, "{s:?}");
                let pinned = &st.plan().pinned;
                if (1..pinned.len()).any(|j| pinned[j] && !m.cfg.is_dense(j)) {
                    assert!(s.prefetch_reads + s.prefetch_cancelled > 0, "{set}: {s:?}");
                }
                queued += s.prefetch_reads + s.prefetch_cancelled;
                used += s.prefetch_used;
            }
        }
    }
    assert!(queued > 0, "no prompt pass predicted a layer's experts");
    assert!(
        used > 0,
        "no expert read ahead of a prompt pass's layer was used"
    );
}

/// Per-rank prediction counts agree with the totals: each rank is right at most once per
/// prediction, and the ranks add up to the experts predicted right.
fn check_prediction_counts(s: &k3::stream::stats::StatsSnapshot) {
    let by_rank = &s.predicted_right_by_rank;
    assert_eq!(by_rank.iter().sum::<u64>(), s.predicted_right, "{s:?}");
    assert!(by_rank.iter().all(|&r| r <= s.predictions), "{s:?}");
    assert!(s.predicted_right <= s.predicted, "{s:?}");
    let acc = s.prediction_accuracy_by_rank();
    assert!(acc.iter().all(|a| (0.0..=1.0).contains(a)), "{acc:?}");
}

#[test]
fn the_prefetch_queue_changes_no_bit_at_any_budget_or_depth() {
    let mut read_ahead = 0;
    let mut dropped = 0;
    let mut predicted_late = 0;
    let mut auto_timed = 0;
    for set in ["tiny", "tiny2"] {
        let (prompt, want, info) = serial_reference(set, 10);
        let (floor, everything) = (info.plan.floor_bytes, info.sizes.model_bytes());
        for total in [floor, floor + everything / 4, floor + everything / 2] {
            let (off, _) = open(set, BudgetRequest::Total(total));
            off.streamer().unwrap().set_prefetch(0);
            let got_off = generate(&off, &prompt, 10, |_| {});
            assert_eq!(off.streamer().unwrap().stats().prefetch_reads, 0);
            // Depth 0 queues every prediction and starts none; 1 starts one only on an idle
            // disk; 64 lets predictions start beside a layer's own reads. The prediction
            // from a layer's output gets its own depth, and the earlier one from the layer's
            // FFN input is made or not.
            // Or chosen by timing steps with it off and on (None, the default).
            for (depth, late, early) in [
                (0, 0, Some(true)),
                (1, 1, Some(false)),
                (4, 16, Some(true)),
                (4, 16, None),
                (64, 64, Some(false)),
            ] {
                let (m, _) = open(set, BudgetRequest::Total(total));
                let st = m.streamer().unwrap();
                st.set_prefetch(16);
                st.set_prefetch_depth(depth);
                st.set_prefetch_late_depth(late);
                st.set_prefetch_early(early);
                let got = generate(&m, &prompt, 10, |_| {});
                let what = format!("{set} at {total} B, depth {depth}/{late}, early {early:?}");
                for ((a, b), c) in got.iter().zip(&got_off).zip(&want) {
                    assert_eq!(bits(a), bits(b), "{what}");
                    assert_eq!(bits(a), bits(c), "{what}");
                }
                let s = st.stats();
                check_prediction_counts(&s);
                if depth == 0 {
                    assert_eq!(s.prefetch_reads, 0, "depth 0 started a read: {s:?}");
                }
                // A layer after a pinned MoE layer's predecessor is predicted from that
                // layer's output at every decoding step, early prediction or not.
                let pinned = &st.plan().pinned;
                let after_pinned = (1..pinned.len())
                    .filter(|&j| pinned[j] && !m.cfg.is_dense(j))
                    .count() as u64;
                assert_eq!(s.predictions, after_pinned * 10, "{what}: {s:?}");
                // The early prediction, made only when on from a MoE layer's FFN input, is
                // scored on its own.
                let after_moe = (1..pinned.len())
                    .filter(|&j| pinned[j] && !m.cfg.is_dense(j) && !m.cfg.is_dense(j - 1))
                    .count() as u64;
                let early_made = match early {
                    Some(true) => after_moe * 10,
                    Some(false) => 0,
                    None => after_moe * s.early.steps_on,
                };
                assert_eq!(s.early_predictions, early_made, "{what}: {s:?}");
                if early.is_none() && after_moe > 0 {
                    // The trial timed every decoding step, with the prediction off and on.
                    assert_eq!(s.early.mode, "auto", "{what}");
                    assert_eq!(s.early.steps_off + s.early.steps_on, 10, "{what}: {s:?}");
                    assert!(s.early.steps_on > 0 && s.early.steps_off > 0, "{what}");
                    auto_timed += 1;
                }
                assert!(
                    s.early_predicted_right_by_rank
                        .iter()
                        .all(|&r| r <= s.early_predictions),
                    "{what}: {s:?}"
                );
                predicted_late += after_pinned;
                read_ahead += s.prefetch_reads;
                dropped += s.prefetch_cancelled;
            }
        }
    }
    assert!(read_ahead > 0, "no expert was read ahead");
    assert!(dropped > 0, "no queued prediction was ever dropped");
    assert!(
        predicted_late > 0,
        "no budget pinned a MoE layer to predict"
    );
    assert!(
        auto_timed > 0,
        "no budget let the early prediction be timed"
    );
}

#[test]
fn a_lowered_budget_with_predictions_queued_or_in_flight_is_exact() {
    for set in ["tiny", "tiny2"] {
        let (prompt, want, info) = serial_reference(set, 12);
        let (floor, everything) = (info.plan.floor_bytes, info.sizes.model_bytes());
        // The layers whose next layer is pinned: a prediction for it can be made.
        let before_in = |pinned: &[bool]| {
            (0..pinned.len() - 1)
                .filter(|&l| pinned[l + 1])
                .collect::<Vec<_>>()
        };
        // The least budget (in eighths of the model above the floor) that pins such a layer.
        let total = (1..8)
            .map(|k| floor + everything * k / 8)
            .find(|&t| {
                let p = budget::plan(&info.sizes, BudgetRequest::Total(t), 512, None).unwrap();
                !before_in(&p.pinned).is_empty()
            })
            .expect("a budget that pins a layer after another");
        let (m, _) = open(set, BudgetRequest::Total(total));
        let st = m.streamer().unwrap();
        st.set_prefetch(16);
        st.set_prefetch_early(Some(true));
        let before = || before_in(&st.plan().pinned);
        let d = m.cfg.hidden_size;
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let lower = |total| budget::plan(&info.sizes, BudgetRequest::Total(total), 512, None);
        let got = generate(&m, &prompt, 12, |step| match step {
            3 => {
                // Everything predicted stays queued, then the plan shrinks under it.
                st.set_prefetch_depth(0);
                let dropped = st.stats().prefetch_cancelled;
                for l in before() {
                    st.prefetch_after(l, &x);
                }
                st.set_plan(lower((floor + total) / 2).unwrap()).unwrap();
                let s = st.stats();
                assert!(
                    s.prefetch_cancelled > dropped,
                    "{set}: nothing was queued: {s:?}"
                );
            }
            7 => {
                // Predicted reads start at once and are in flight as the plan shrinks.
                st.set_prefetch_depth(64);
                for l in before() {
                    st.prefetch_after(l, &x);
                }
                st.set_plan(lower(floor).unwrap()).unwrap();
            }
            _ => {}
        });
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(bits(a), bits(b), "{set}");
        }
        let s = st.stats();
        check_prediction_counts(&s);
        assert!(s.prefetch_used <= s.prefetch_reads, "{s:?}");
    }
}

#[test]
fn a_plan_change_between_tokens_changes_no_token() {
    let set = "tiny";
    let (prompt, want, info) = serial_reference(set, 16);
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

/// A `small` synthetic checkpoint (~390 MB), written once per test run.
pub fn small() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = crate::common::process_scratch("small");
        crate::common::run_ok(
            crate::common::k3_command()
                .args(["synth", "small"])
                .arg(dir.join("small")),
        );
        dir
    })
}

/// `k3 run` on `small` with extra flags: (generated ids, dumped logits, peak RSS).
fn run_small(extra: &[&str]) -> (serde_json::Value, Vec<u8>, u64) {
    let (ids, logits, peak, _) = run_small_env(extra, &[]);
    (ids, logits, peak)
}

/// `small` packed by `k3 pack` (the default encoding) into `name` beside it.
fn pack_small(name: &str) -> std::path::PathBuf {
    pack_small_with(name, &[])
}

/// [`pack_small`] with more `k3 pack` arguments.
fn pack_small_with(name: &str, args: &[&str]) -> std::path::PathBuf {
    let trunk = small().join(name);
    crate::common::run_ok(
        crate::common::k3_command()
            .arg("pack")
            .arg(small().join("small"))
            .arg(&trunk)
            .args(args),
    );
    trunk
}

/// [`run_small`] with environment variables set; also the `--json` stats.
fn run_small_env(
    extra: &[&str],
    env: &[(&str, &str)],
) -> (serde_json::Value, Vec<u8>, u64, serde_json::Value) {
    let dir = small().join("small");
    let dump = tempfile::NamedTempFile::new().unwrap();
    let out = crate::common::run_ok(
        crate::common::k3_command()
            .envs(env.iter().copied())
            .arg("run")
            .arg(&dir)
            .args([
                "--ids",
                "1,2,3,4,5,6,7,8,9,10",
                "--gen",
                "6",
                "--json",
                "--dump-logits",
            ])
            .arg(dump.path())
            .args(extra),
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peak = j["peak_rss_bytes"].as_u64().unwrap();
    (
        j["generated_ids"].clone(),
        std::fs::read(dump.path()).unwrap(),
        peak,
        j["stats"].clone(),
    )
}

/// `small` packed by `k3 pack` stores its output head encoded (several codec blocks). At the
/// floor, as a split budget whose trunk share holds no head (a total budget pins a head this
/// small in the bytes the floor counts to stream it), the head is streamed, and read from its
/// encoded run: the ids and logits of the checkpoint's head, fewer bytes read than with the
/// head read raw (its run removed from the manifest, as an earlier pack wrote it), peak RSS
/// inside the budget. A block of it corrupted (the run's checksum re-sealed) stops the run
/// with exit 3, naming the head.
#[test]
fn the_output_head_is_streamed_from_its_encoded_run() {
    let trunk = pack_small("trunk-head");
    let ts = trunk.to_str().unwrap();
    let json_path = trunk.join("trunk.json");
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    let head = &m["head"];
    let t = head["tensors"][k3::engine::bind::names::LM_HEAD].clone();
    assert_eq!(t["encoding"], "k3n1", "{head}");
    let (stored, nbytes) = (t["stored"].as_u64().unwrap(), t["nbytes"].as_u64().unwrap());
    assert!(nbytes > 4 * 2 * k3::stream::codec::BLOCK_ELEMS as u64);
    assert!(stored < nbytes * 4 / 5, "{stored} of {nbytes}");
    // The floor of a run of 10 ids and 6 generated (16 positions).
    let floor = plan_16(ts, &["--mem", "1000"])["floor_bytes"]
        .as_u64()
        .unwrap();
    let gb = format!("{:.6}", floor.div_ceil(1000) as f64 / 1e6);
    assert_eq!(plan_16(ts, &["--mem", &gb])["head_resident"], true);
    // The trunk's share at its least (the ring), the rest to the cache's.
    let split = ["--trunk-gb", "0.000001", "--cache-gb", &gb];
    let p = plan_16(ts, &split);
    assert_eq!(p["head_resident"], false);
    assert!(p["budget_bytes"].as_u64().unwrap() <= floor.div_ceil(1000) * 1000 + 1000);
    // The checkpoint alone, with everything resident (its own floor is higher: the trunk's
    // layers are read in place).
    let (want_ids, want_logits, _) = run_small(&[]);
    let with_trunk = [&split[..], &["--trunk", ts]].concat();
    let (ids, logits, peak, st) = run_small_env(&with_trunk, &[]);
    assert_eq!(ids, want_ids);
    assert!(logits == want_logits, "logits differ with the encoded head");
    assert!(
        peak <= floor.div_ceil(1000) * 1000 + 1000,
        "peak RSS {peak}, budget {gb} GB"
    );
    // The same run with the head read raw from the checkpoint reads more.
    let orig = std::fs::read(&json_path).unwrap();
    let mut no_head = m.clone();
    no_head.as_object_mut().unwrap().remove("head");
    std::fs::write(&json_path, serde_json::to_vec(&no_head).unwrap()).unwrap();
    let (raw_ids, raw_logits, _, raw_st) = run_small_env(&with_trunk, &[]);
    assert_eq!(raw_ids, want_ids);
    assert!(raw_logits == want_logits);
    let read = |s: &serde_json::Value| s["disk_bytes_read"].as_u64().unwrap();
    assert!(
        read(&st) < read(&raw_st),
        "{} bytes read with the encoded head, {} with the raw one",
        read(&st),
        read(&raw_st)
    );
    // A byte of the head's blocks flipped, its run's checksum re-sealed.
    std::fs::write(&json_path, &orig).unwrap();
    let (orig_bin, sealed, _) = flip_head_block(&trunk);
    std::fs::write(
        trunk.join("trunk.json"),
        serde_json::to_vec(&sealed).unwrap(),
    )
    .unwrap();
    let args = ["--ids", "1,2,3,4,5,6,7,8,9,10", "--gen", "6"];
    assert_head_refused(&args, &split, ts);
    std::fs::write(trunk.join("trunk.bin"), &orig_bin).unwrap();
    std::fs::write(&json_path, &orig).unwrap();
}

/// `small` packed by `k3 pack`, at a budget whose plan holds pinned layers coded: the output
/// head is held coded too, read from its encoded run, and multiplied coded (`k3 plan` says
/// so), with the ids and logits of the checkpoint alone and peak RSS inside the budget. A
/// block of it corrupted (the run's checksum re-sealed), or a byte of its run flipped, stops
/// the run with exit 3 naming the head.
#[test]
fn a_resident_head_is_held_coded_from_its_encoded_run() {
    let trunk = pack_small("trunk-head-held");
    let ts = trunk.to_str().unwrap();
    let plan_at = |mem: &str| plan_16(ts, &["--mem", mem]);
    let floor = plan_at("1000")["floor_bytes"].as_u64().unwrap();
    // The least budget (in steps of 5 MB from the floor) whose plan holds the head coded.
    let gb = (1..40)
        .map(|k| format!("{:.3}", (floor.div_ceil(5_000_000) + k) as f64 * 0.005))
        .find(|gb| plan_at(gb)["head_coded"] == true)
        .expect("a budget that holds the head coded");
    let p = plan_at(&gb);
    assert_eq!(
        (p["head_resident"].clone(), p["pin_coded"].clone()),
        (true.into(), true.into())
    );
    let text = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(small().join("small"))
            .args(["--trunk", ts, "--context", "16", "--mem", &gb]),
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("resident, held coded"), "{text}");
    let (want_ids, want_logits, _) = run_small(&["--mem", &gb]);
    let (ids, logits, peak, _) = run_small_env(&["--mem", &gb, "--trunk", ts], &[]);
    assert_eq!(ids, want_ids);
    assert!(
        logits == want_logits,
        "logits differ with the head held coded"
    );
    let budget = (gb.parse::<f64>().unwrap() * 1e9) as u64;
    assert!(peak <= budget, "peak RSS {peak}, budget {gb} GB");
    // A byte of the head's blocks flipped (its run's checksum re-sealed), then a byte of its
    // run flipped: both refused when the head is loaded, under the budget and, where the
    // kernels' coded products are the faster ones (the head is held coded then), without one.
    let json_path = trunk.join("trunk.json");
    let (orig_bin, sealed, m) = flip_head_block(&trunk);
    let unbudgeted = p["sizes"]["coded_first"].as_bool().unwrap();
    for manifest in [&sealed, &m] {
        std::fs::write(&json_path, serde_json::to_vec(manifest).unwrap()).unwrap();
        let args = ["--ids", "1,2,3", "--gen", "2"];
        assert_head_refused(&args, &["--mem", &gb], ts);
        if unbudgeted {
            assert_head_refused(&args, &[], ts);
        }
    }
    std::fs::write(trunk.join("trunk.bin"), &orig_bin).unwrap();
    std::fs::write(&json_path, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// `k3 plan --json` of `small` with the trunk `ts` and the budget arguments `budget`, for the
/// 16 positions of a run of 10 ids and 6 generated.
fn plan_16(ts: &str, budget: &[&str]) -> serde_json::Value {
    let out = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(small().join("small"))
            .args(["--trunk", ts, "--context", "16", "--json"])
            .args(budget),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Flip a byte of the first block of `trunk`'s encoded head in `trunk.bin`: (the bytes
/// before, the manifest with the head run's checksum re-sealed over the flipped bytes, the
/// manifest as it was). The manifest is left as it was.
fn flip_head_block(trunk: &std::path::Path) -> (Vec<u8>, serde_json::Value, serde_json::Value) {
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(trunk.join("trunk.json")).unwrap()).unwrap();
    let bin = trunk.join("trunk.bin");
    let orig_bin = std::fs::read(&bin).unwrap();
    let (off, len) = (
        m["head"]["file_off"].as_u64().unwrap() as usize,
        m["head"]["nbytes"].as_u64().unwrap() as usize,
    );
    let mut bad = orig_bin.clone();
    bad[off + k3::stream::codec::HEADER + 1000] ^= 0x08;
    let mut sealed = m.clone();
    sealed["head"]["crc32"] = serde_json::json!(crc32fast::hash(&bad[off..off + len]));
    std::fs::write(&bin, &bad).unwrap();
    (orig_bin, sealed, m)
}

/// `k3 run` on `small` with `args`, the budget arguments `budget` (none: no budget) and
/// `--trunk ts` exits 3 naming the output head and a checksum, without a panic.
fn assert_head_refused(args: &[&str], budget: &[&str], ts: &str) {
    let out = crate::common::k3_command()
        .arg("run")
        .arg(small().join("small"))
        .args(args)
        .args(budget)
        .args(["--trunk", ts])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("trunk output head") && err.contains("checksum"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn k3_run_with_and_without_prefetch_gives_the_same_bits_inside_the_budget() {
    let plan = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(small().join("small"))
            .args(["--mem", "1000", "--json"]),
    );
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let mut read_ahead = 0;
    for budget in [model / 4, model / 2] {
        let gb = format!("{}", budget as f64 / 1e9);
        let mem = ["--mem", gb.as_str()];
        let (ids, logits, _, off) = run_small_env(&mem, &[("K3_PREFETCH", "0")]);
        assert_eq!(off["prefetch_reads"], 0, "{off}");
        for depth in ["1", "4"] {
            let env = [("K3_PREFETCH_DEPTH", depth)];
            let (got_ids, got_logits, peak, st) = run_small_env(&mem, &env);
            assert_eq!(got_ids, ids, "budget {budget}, depth {depth}");
            assert!(
                got_logits == logits,
                "logits differ at {budget}, depth {depth}"
            );
            assert!(peak <= budget, "peak RSS {peak} above the budget {budget}");
            let reads = st["prefetch_reads"].as_u64().unwrap();
            assert!(st["prefetch_used"].as_u64().unwrap() <= reads, "{st}");
            let acc = st["prediction_accuracy_by_rank"].as_array().unwrap();
            if st["predictions"].as_u64().unwrap() > 0 {
                assert!(!acc.is_empty(), "{st}");
            }
            assert!(
                acc.iter()
                    .all(|a| (0.0..=1.0).contains(&a.as_f64().unwrap())),
                "{st}"
            );
            println!("small at {budget} B, depth {depth}: {st}");
            read_ahead += reads;
        }
    }
    assert!(read_ahead > 0, "nothing was read ahead by default");
}

#[test]
fn small_checkpoint_same_logits_at_every_budget_and_rss_within_budget() {
    let (ids, logits, resident_peak) = run_small(&[]);
    let plan = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("plan")
        .arg(small().join("small"))
        .args(["--mem", "1000", "--json"])
        .output()
        .unwrap();
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let floor = plan["floor_bytes"].as_u64().unwrap();
    assert!(plan["fits"].as_bool().unwrap());
    for budget in [floor, model / 4, model / 2, model * 2] {
        let gb = format!("{}", budget as f64 / 1e9);
        let (got_ids, got_logits, peak) = run_small(&["--mem", &gb]);
        assert_eq!(got_ids, ids, "budget {budget}");
        assert!(
            got_logits == logits,
            "dumped logits differ at budget {budget}"
        );
        println!(
            "small at {budget} B: peak RSS {peak} B (resident {resident_peak} B, model {model} B)"
        );
        // At every budget, the whole process stays inside it.
        assert!(peak <= budget, "peak RSS {peak} above the budget {budget}");
    }
    // The same with a packed trunk, encoded and raw (the default).
    for (name, raw) in [("trunk", false), ("trunk-raw", true)] {
        let trunk = small().join(name);
        let mut pack = crate::common::k3_command();
        pack.arg("pack").arg(small().join("small")).arg(&trunk);
        if !raw {
            pack.arg("--encode");
        }
        crate::common::run_ok(&mut pack);
        let t = trunk.to_str().unwrap();
        for budget in [Some(floor), Some(model / 4), Some(model / 2), None] {
            let gb = budget.map(|b| format!("{}", b as f64 / 1e9));
            let mut extra = vec!["--trunk", t];
            if let Some(gb) = &gb {
                extra.extend(["--mem", gb.as_str()]);
            }
            let (got_ids, got_logits, peak) = run_small(&extra);
            assert_eq!(got_ids, ids, "trunk, budget {budget:?}");
            assert!(
                got_logits == logits,
                "dumped logits differ with the trunk at {budget:?}"
            );
            println!("small with {name} at {budget:?} B: peak RSS {peak} B");
            if let Some(b) = budget {
                assert!(
                    peak <= b,
                    "peak RSS {peak} above the budget {b} with {name}"
                );
            }
        }
    }
}

/// With reads of 64 KiB ahead of the decoder, `small`'s entropy-coded layers (staged and
/// decoded, not read in place) are longer than the window the floor stages them through: at
/// the floor every layer streams through the window (and a pinned one is loaded through it),
/// at the ids and logits of the checkpoint alone, inside the budget; a budget with room
/// stages whole runs and gives the same.
#[test]
fn encoded_layers_streamed_through_a_window_of_their_runs_give_the_same_bits() {
    let (ids, logits, _) = run_small(&[]);
    let trunk = pack_small_with("trunk-window", &["--codec", "entropy"]);
    let t = trunk.to_str().unwrap();
    let env = [("K3_TRUNK_SEGMENT_KB", "64")];
    let plan = |mem: &str| -> serde_json::Value {
        let out = crate::common::run_ok(
            crate::common::k3_command()
                .envs(env)
                .arg("plan")
                .arg(small().join("small"))
                .args(["--trunk", t, "--json", "--mem", mem]),
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let at = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap();
    let probe = plan("1000");
    let most = |key: &str| {
        (probe["sizes"][key].as_array().unwrap().iter())
            .filter_map(serde_json::Value::as_u64)
            .max()
            .unwrap()
    };
    let (window, run) = (most("layer_window"), most("layer_staged"));
    assert!(
        window > 0 && window * 2 < run,
        "window {window}, largest run {run}"
    );
    let (floor, model) = (at(&probe, "floor_bytes"), at(&probe, "model_bytes"));
    for budget in [floor, floor + model / 8, model * 2] {
        let gb = format!("{}", budget as f64 / 1e9);
        let p = plan(&gb);
        let staged = at(&p, "stage_bytes");
        if budget == floor {
            assert_eq!(staged, window, "the floor stages through the window");
        } else if budget > model {
            assert_eq!(staged, run, "room for whole runs");
        }
        let (got_ids, got_logits, peak, _) = run_small_env(&["--trunk", t, "--mem", &gb], &env);
        assert_eq!(got_ids, ids, "budget {budget}, staging {staged}");
        assert!(got_logits == logits, "logits differ at {budget}");
        assert!(peak <= budget, "peak RSS {peak} above the budget {budget}");
        println!("small through a staging of {staged} B (runs up to {run} B) at {budget} B: peak RSS {peak} B");
    }
}

#[test]
fn a_chat_keeps_its_snapshots_inside_the_budget() {
    let plan = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(small().join("small"))
            .args(["--mem", "1000", "--json", "--chat", "--context", "2048"]),
    );
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let floor = plan["floor_bytes"].as_u64().unwrap();
    assert_eq!(
        plan["states"].as_u64().unwrap(),
        1 + k3::session::chat::SNAPSHOTS as u64
    );
    let dir = tempfile::tempdir().unwrap();
    let turns = "Hello there\nTell me more\nAnd then?\nOnce more\nThe end\n";
    let mut replies = None;
    for (i, budget) in [floor, (floor + model / 2) / 2, model / 2, model * 2]
        .into_iter()
        .enumerate()
    {
        let gb = format!("{}", budget as f64 / 1e9);
        let chat = |extra: &[&str], input: &str| {
            crate::common::jsonl_with_input(
                crate::common::k3_command()
                    .arg("chat")
                    .arg(small().join("small"))
                    .args([
                        "--plain",
                        "--jsonl",
                        "--greedy",
                        "--no-think",
                        "--max-tokens",
                        "12",
                        "--context",
                        "2048",
                        "--mem",
                        &gb,
                        "--session-dir",
                    ])
                    .arg(dir.path())
                    .args(extra),
                input,
            )
        };
        let name = format!("rss-{i}");
        let lines = chat(&[], &format!("{turns}/save {name}\n"));
        assert_eq!(lines.len(), 5, "budget {budget}");
        // Resumed, with the saved state and snapshots loaded, and a regenerate from one.
        let resumed = chat(&["--resume", &name], "/regen\n");
        assert_eq!(resumed.len(), 1, "budget {budget}");
        assert_eq!(resumed[0]["prefilled_tokens"], 0, "budget {budget}");
        assert_eq!(resumed[0]["generated_ids"], lines[4]["generated_ids"]);
        let peak = resumed[0]["peak_rss_bytes"].as_u64().unwrap();
        println!("resumed chat on small at {budget} B: peak RSS {peak} B");
        assert!(
            peak > 0 && peak <= budget,
            "resumed chat peak RSS {peak} above {budget}"
        );
        let peak = lines
            .iter()
            .map(|l| l["peak_rss_bytes"].as_u64().unwrap())
            .max();
        let peak = peak.unwrap_or(0);
        println!("chat on small at {budget} B: peak RSS {peak} B");
        assert!(
            peak > 0 && peak <= budget,
            "chat peak RSS {peak} above {budget}"
        );
        let ids: Vec<_> = lines.iter().map(|l| l["generated_ids"].clone()).collect();
        match &replies {
            None => replies = Some(ids),
            Some(want) => assert_eq!(&ids, want, "chat replies differ at budget {budget}"),
        }
    }
}

#[test]
fn resident_memory_follows_a_lowered_budget_down() {
    let plan = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(small().join("small"))
            .args(["--mem", "1000", "--json", "--chat", "--context", "2048"]),
    );
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let floor = plan["floor_bytes"].as_u64().unwrap();
    let low = (floor + model / 2) / 2;
    let gb = |b: u64| format!("{}", b as f64 / 1e9);
    let dir = tempfile::tempdir().unwrap();
    // Everything held, one turn; then a budget below what is held, and a turn under it.
    let lines = crate::common::jsonl_with_input(
        crate::common::k3_command()
            .arg("chat")
            .arg(small().join("small"))
            .args([
                "--plain",
                "--jsonl",
                "--greedy",
                "--no-think",
                "--max-tokens",
                "6",
                "--context",
                "2048",
                "--mem",
                &gb(model * 2),
                "--session-dir",
            ])
            .arg(dir.path()),
        &format!("Hello there\n/budget {}\nTell me more\n", gb(low)),
    );
    assert_eq!(lines.len(), 2, "{lines:?}");
    let rss = |i: usize| lines[i]["rss_bytes"].as_u64().unwrap();
    println!(
        "RSS {} B with everything held, {} B after lowering the budget to {low} B (model {model} B)",
        rss(0),
        rss(1)
    );
    assert!(
        rss(0) > low,
        "the first turn held less than the lower budget"
    );
    assert!(
        rss(1) <= low,
        "RSS {} B after lowering the budget to {low} B",
        rss(1)
    );
}

/// Greedy generation that reports a failed read instead of panicking.
fn try_generate(m: &Model, prompt: &[u32], n: usize) -> Result<Vec<u32>, k3::stream::StreamError> {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last)?;
    let mut ids = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits);
        ids.push(next);
        logits = m.forward(&mut st, &[next], Logits::Last)?;
    }
    Ok(ids)
}

#[test]
fn injected_read_faults_are_retried_or_fail_the_step_never_a_wrong_token() {
    use k3::stream::checkpoint::Fault;
    let o = json("tiny/oracle.json");
    let prompt = u32s(&o["prompt_ids"]);
    let (resident, info) = open("tiny", BudgetRequest::Resident);
    let want = try_generate(&resident, &prompt, 6).unwrap();
    let floor = BudgetRequest::Total(info.plan.floor_bytes);
    let (m, _) = open("tiny", floor);
    let ck = m.streamer().unwrap().checkpoint();
    let start = ck.reads_issued();
    assert_eq!(try_generate(&m, &prompt, 6).unwrap(), want);
    let n_reads = ck.reads_issued() - start;
    assert!(n_reads > 100, "{n_reads} reads");
    let (mut tried, mut failed) = (0, 0);
    for n in (0..n_reads).step_by(53).chain([n_reads - 1]) {
        for fault in [
            Fault::Interrupted,
            Fault::Short,
            Fault::TransientIo,
            Fault::Io,
        ] {
            let (m, _) = open("tiny", floor);
            let ck = m.streamer().unwrap().checkpoint();
            ck.inject_fault(ck.reads_issued() + n, fault);
            let got = try_generate(&m, &prompt, 6);
            match fault {
                // A failed read fails the step with a named error — unless it hit a read-ahead
                // whose layer was never needed (after the last step): then nothing was lost.
                Fault::Io => match got {
                    Err(e) => {
                        assert!(e.to_string().contains("read error in"), "{e}");
                        assert_eq!(e.exit_code(), 1);
                        failed += 1;
                    }
                    Ok(ids) => assert_eq!(ids, want, "EIO at read {n}"),
                },
                _ => assert_eq!(got.unwrap(), want, "{fault:?} at read {n}"),
            }
            tried += 1;
        }
    }
    println!("{tried} injected faults over {n_reads} reads; {failed} EIO failed their step");
    assert!(
        failed * 2 > tried / 3,
        "most injected EIO faults must fail the step"
    );
}

#[test]
fn bench_reports_speed_next_to_its_floors() {
    let out = crate::common::run_ok(
        crate::common::k3_command()
            .arg("bench")
            .arg(fixture("tiny"))
            .args(["--mem", "0.06", "--gen", "3", "--prompt-len", "8", "--json"]),
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "prefill_tokens_per_second",
        "decode_seconds_per_token",
        "bytes_read_per_token",
        "memory_floor_seconds_per_token",
        "ratio_to_memory_floor",
        "peak_rss_bytes",
    ] {
        let v = j[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v >= 0.0, "{key}: {}", j[key]);
    }
    assert!(
        j["bytes_read_per_token"].as_f64().unwrap() > 0.0,
        "a streamed run reads per token"
    );
    // The disk is probed the ways the engine reads, expert-sized random reads first (the
    // fixture's shards are smaller than the sequential patterns' reads), and the floor is the
    // best pattern.
    let patterns = j["disk_probe_patterns"].as_array().expect("probed");
    assert!(
        patterns[0]["pattern"]
            .as_str()
            .unwrap()
            .starts_with("random "),
        "{patterns:?}"
    );
    let best = patterns
        .iter()
        .map(|p| p["gb_per_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(best > 0.0, "{patterns:?}");
    assert_eq!(j["disk_read_gb_per_s"].as_f64(), Some(best));
    let r = j["ratio_to_io_floor"].as_f64().unwrap_or(f64::NAN);
    assert!(r.is_finite() && r > 0.0, "{}", j["ratio_to_io_floor"]);
    crate::common::assert_steal_is_a_fraction(&j);
}

#[test]
fn the_expert_arena_is_faulted_in_with_the_plan_and_follows_it_down() {
    use k3::stream::arena::{Prefault, HUGE_PAGE};
    let smaps = std::path::Path::new("/proc/self/smaps").exists();
    let set = "tiny";
    let (prompt, want, info) = serial_reference(set, 8);
    let sizes = info.sizes.clone();
    let (floor, everything) = (info.plan.floor_bytes, sizes.model_bytes());
    // Every expert held (in slots a little larger than the experts), then the floor.
    let (m, _) = open(set, BudgetRequest::Total(floor + 4 * everything));
    let st = m.streamer().expect("streamed");
    let extra = budget::in_flight_slots(&sizes);
    let a = st.stats().arena;
    assert_eq!(a.slots, st.plan().expert_slots + extra, "{a:?}");
    assert_eq!(a.slot_bytes, budget::expert_slot_bytes(&sizes));
    assert_eq!(a.slot_bytes % 4096, 0);
    assert_ne!(
        a.prefault,
        Prefault::None,
        "the arena was not faulted in: {a:?}"
    );
    if smaps {
        // Every slot is resident before the first token (nothing faults inside a pass).
        assert!(a.resident_bytes >= a.slots * a.slot_bytes, "{a:?}");
    }
    let low = budget::plan(&sizes, BudgetRequest::Total(floor), 512, None).unwrap();
    let got = generate(&m, &prompt, 8, |step| {
        if step == 3 {
            let a = st.stats().arena;
            assert!(a.in_use > 0 && a.in_use <= a.slots, "{a:?}");
            st.set_plan(low.clone()).unwrap();
        }
    });
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(bits(a), bits(b), "a lowered budget changed a logit");
    }
    let b = st.stats().arena;
    println!("arena before {a:?}\narena after a lowered budget {b:?}");
    assert_eq!(b.slots, low.expert_slots + extra, "{b:?}");
    assert!(b.in_use <= b.slots, "{b:?}");
    assert_eq!(
        b.heap_fallbacks, 0,
        "an expert read missed the arena: {b:?}"
    );
    if smaps {
        // The retired slots went back to the system when the plan was applied.
        assert!(
            b.resident_bytes <= b.slots * b.slot_bytes + HUGE_PAGE as u64,
            "{b:?}"
        );
        assert!(b.resident_bytes < a.resident_bytes, "{a:?} -> {b:?}");
    }
}

#[test]
fn k3_run_reports_the_expert_arena() {
    let dir = small().join("small");
    let cfg = k3::engine::ModelConfig::load(&dir.join("config.json")).unwrap();
    let top_k = cfg.num_experts_per_token as u64;
    let plan = crate::common::run_ok(
        crate::common::k3_command()
            .arg("plan")
            .arg(&dir)
            .args(["--mem", "1000", "--json"]),
    );
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let gb = format!("{}", (model / 3) as f64 / 1e9);
    let out = crate::common::run_ok(crate::common::k3_command().arg("run").arg(&dir).args([
        "--ids",
        "1,2,3,4,5",
        "--gen",
        "3",
        "--json",
        "--mem",
        &gb,
    ]));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let j = &j["stats"];
    let a = &j["expert_arena"];
    println!("{a}");
    assert_eq!(
        a["slots"].as_u64().unwrap(),
        j["expert_slots"].as_u64().unwrap() + 2 * top_k,
        "{j}"
    );
    let how = a["prefault"].as_str().unwrap();
    assert!(how == "populate" || how == "touch", "{a}");
    assert_eq!(a["heap_fallbacks"], 0, "{a}");
    let (slots, slot) = (
        a["slots"].as_u64().unwrap(),
        a["slot_bytes"].as_u64().unwrap(),
    );
    assert!(a["resident_bytes"].as_u64().unwrap() >= slots * slot, "{a}");
    assert!(a["huge_page_bytes"].as_u64().unwrap() <= a["resident_bytes"].as_u64().unwrap());
}

#[test]
fn k3_run_json_counts_each_byte_read_once() {
    let dir = small().join("small");
    let on_disk: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = crate::common::run_ok(
            crate::common::k3_command()
                .arg("run")
                .arg(&dir)
                .args(["--ids", "1,2,3,4", "--gen", "2", "--json"])
                .args(extra),
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // Resident: the load is everything read, and no more than the files hold.
    let resident = run(&[]);
    let read = resident["bytes_read"].as_u64().unwrap();
    assert_eq!(resident["stats"]["load_bytes_read"], read, "{resident}");
    assert!(read > 0 && read <= on_disk, "{read} B read of {on_disk} B");
    // Streamed: the streamer read the load, so its counter holds it already.
    let model = resident["stats"]["model_bytes"].as_u64().unwrap();
    let gb = format!("{}", (model / 4) as f64 / 1e9);
    let streamed = run(&["--mem", &gb]);
    let st = &streamed["stats"];
    let (load, disk) = (
        st["load_bytes_read"].as_u64().unwrap(),
        st["disk_bytes_read"].as_u64().unwrap(),
    );
    assert!(load > 0 && disk > load, "{st}");
    assert_eq!(streamed["bytes_read"].as_u64().unwrap(), disk, "{streamed}");
}

/// A pass reads the last layer's experts only for the positions whose logits it is asked for:
/// against a pass asking for every position's, one asking for the last position's asks the
/// streamer for exactly the experts only the other positions route to, and one asking for
/// none for all of the last layer's.
#[test]
fn the_last_layer_reads_experts_only_for_the_positions_asked_for() {
    use std::collections::BTreeSet;
    for set in ["tiny", "tiny2"] {
        let o = json(&format!("{set}/oracle.json"));
        let prompt = u32s(&o["prompt_ids"]);
        let (resident, info) = open(set, BudgetRequest::Resident);
        let mut trace = k3::engine::Trace::default();
        resident
            .forward_traced(
                &mut SeqState::new(&resident.cfg),
                &prompt,
                Logits::All,
                Some(&mut trace),
            )
            .unwrap();
        let routes = trace.routing.last().unwrap();
        assert_eq!(routes.len(), prompt.len(), "{set}: the last layer routes");
        let union: BTreeSet<usize> = routes.iter().flat_map(|r| r.0.iter().copied()).collect();
        let last: BTreeSet<usize> = routes.last().unwrap().0.iter().copied().collect();
        assert!(
            union.len() > last.len(),
            "{set}: the other positions add experts"
        );
        let asked = |want: Logits| {
            let (m, _) = open(set, BudgetRequest::Total(info.plan.floor_bytes));
            let st = m.streamer().unwrap();
            st.set_prefetch(0);
            let logits = m
                .forward(&mut SeqState::new(&m.cfg), &prompt, want)
                .unwrap();
            let s = st.stats();
            (s.expert_hits + s.expert_misses, logits)
        };
        let (all, all_logits) = asked(Logits::All);
        let (last_only, last_logits) = asked(Logits::Last);
        let (none, _) = asked(Logits::None);
        let v = resident.cfg.vocab_size;
        assert_eq!(
            bits(&last_logits),
            bits(&all_logits[all_logits.len() - v..])
        );
        assert_eq!(all - last_only, (union.len() - last.len()) as u64, "{set}");
        assert_eq!(all - none, union.len() as u64, "{set}");
    }
}

/// A load told to stop (the checkpoint was refused while its weights were read) gives up
/// before reading another weight and fails; the same load not stopped reads every pinned
/// byte, and the plan's weights are all there.
#[test]
fn a_stopped_load_reads_nothing_more_and_fails() {
    use k3::engine::residency::Streamer;
    use k3::stream::Checkpoint;
    use std::sync::Arc;
    let dir = fixture("tiny");
    let cfg = k3::engine::ModelConfig::load(&dir.join("config.json")).unwrap();
    let open = || {
        let ck = Checkpoint::open(&dir).unwrap();
        let sizes = k3::engine::weights::model_sizes(&cfg, &ck);
        let plan = budget::plan(&sizes, BudgetRequest::Total(1 << 40), 512, None).unwrap();
        (Arc::new(ck), sizes, plan)
    };
    let (ck, sizes, plan) = open();
    assert_eq!(plan.n_pinned(), cfg.num_hidden_layers, "everything pinned");
    let whole = Streamer::new(cfg.clone(), Arc::clone(&ck), None, sizes, plan, true).unwrap();
    let read = whole.stats().disk_bytes_read;
    let sizes = whole.sizes();
    let pinned: u64 = sizes.layer_trunk.iter().sum::<u64>() + sizes.head;
    assert_eq!(read, pinned, "every pinned layer and the head, once");
    let (ck, sizes, plan) = open();
    ck.stop_loading();
    let Err(e) = Streamer::new(cfg.clone(), Arc::clone(&ck), None, sizes, plan, true) else {
        panic!("a stopped load succeeded");
    };
    assert!(e.to_string().contains("loading was stopped"), "{e}");
    assert_eq!(ck.bytes_read(), 0, "nothing read after the stop");
}

/// The front ends read the engine's figures while it decodes (the TUI every few hundred
/// milliseconds, `/metrics` on every scrape). Read them as fast as a thread can while the
/// streamed path decodes at the floor budget (streamed layers, expert misses, predictions,
/// plan changes between steps): every step gives the resident bits, the reads never block a
/// step for good, and each snapshot is consistent (hits and misses never go down).
#[test]
fn stats_read_under_load_change_nothing_and_never_block() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (prompt, want, info) = serial_reference("tiny2", 16);
    let floor = info.plan.floor_bytes;
    let (m, _) = open("tiny2", BudgetRequest::Total(floor));
    let done = AtomicBool::new(false);
    let (got, reads) = std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            let (mut reads, mut last) = (0u64, (0, 0));
            while !done.load(Ordering::Relaxed) {
                let s = m.stats();
                assert!(
                    s.expert_hits >= last.0 && s.expert_misses >= last.1,
                    "{s:?}"
                );
                last = (s.expert_hits, s.expert_misses);
                assert_eq!(s.layers.len(), m.cfg.num_hidden_layers);
                reads += 1;
            }
            reads
        });
        let sizes = info.sizes.clone();
        let got = generate(&m, &prompt, 16, |step| {
            // Every fourth step a plan change, as the budget slider makes.
            if step % 4 == 3 {
                let total = floor + (step as u64 % 8) * sizes.model_bytes() / 8;
                let plan =
                    budget::plan_states(&sizes, BudgetRequest::Total(total), 512, 1, None).unwrap();
                m.store().set_plan(plan).unwrap();
            }
        });
        done.store(true, Ordering::Relaxed);
        (got, reader.join().unwrap())
    });
    assert!(
        reads > 16,
        "the figures were read while decoding ({reads} reads)"
    );
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(bits(a), bits(b), "a read of the figures changed a bit");
    }
    assert!(m.stats().expert_misses > 0, "the experts streamed");
}

#[test]
fn pinned_layers_hold_their_coded_matrices_and_give_the_same_bits() {
    let (ids, logits, _) = run_small(&["--spec", "off"]);
    let pack = |name: &str, extra: &[&str]| {
        let dir = small().join(name);
        crate::common::run_ok(
            crate::common::k3_command()
                .arg("pack")
                .arg(small().join("small"))
                .arg(&dir)
                .args(extra),
        );
        dir.to_str().unwrap().to_string()
    };
    let (coded, raw) = (pack("trunk-held", &[]), pack("trunk-held-raw", &["--raw"]));
    let plan = |t: &str, mem: &str| -> serde_json::Value {
        let out = crate::common::run_ok(
            crate::common::k3_command()
                .arg("plan")
                .arg(small().join("small"))
                .args(["--trunk", t, "--json", "--mem", mem]),
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let at = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap();
    let list = |p: &serde_json::Value, key: &str| -> Vec<u64> {
        (p["sizes"][key].as_array().unwrap().iter())
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let probe = plan(&coded, "1000");
    let (held, decoded) = (list(&probe, "layer_pinned"), list(&probe, "layer_trunk"));
    assert_eq!(held.len(), decoded.len());
    for (il, (h, d)) in held.iter().zip(&decoded).enumerate() {
        // Every layer of `small` holds nibble-coded matrices: about three quarters of them.
        assert!(
            *h > 0 && *h * 10 < *d * 9,
            "layer {il}: held {h} B, decoded {d} B"
        );
    }
    let pinned = |p: &serde_json::Value| {
        (p["pinned"].as_array().unwrap().iter())
            .filter(|v| v.as_bool().unwrap())
            .count()
    };
    let (floor, model) = (
        at(&probe, "floor_bytes"),
        at(&plan(&raw, "1000"), "model_bytes"),
    );
    // The budgets between the floor and holding everything where coded layers pin more: the
    // plan holds them coded there, and decoded (faster products) where that pins as many.
    let mut more = Vec::new();
    for k in 1..16 {
        let budget = floor + (model - floor) * k / 16;
        let gb = format!("{}", budget as f64 / 1e9);
        let p = plan(&coded, &gb);
        let (c, r) = (pinned(&p), pinned(&plan(&raw, &gb)));
        assert!(c >= r, "{budget} B: {c} layers pinned coded, {r} raw");
        let coded_plan = p["pin_coded"].as_bool().unwrap();
        assert!(
            c <= r || coded_plan,
            "{budget} B: {c} pinned against {r}, decoded"
        );
        println!("small at {budget} B: {c} layers pinned against {r} raw");
        if c > r && c < held.len() {
            more.push((gb, budget, c));
        }
    }
    assert!(
        more.len() >= 2,
        "budgets pinning more layers coded: {more:?}"
    );
    // Part pinned, part streamed: the same bits, prefilled, decoded and verified in batches.
    for (gb, budget, c) in &more[..2] {
        for spec in ["off", "4"] {
            let args = ["--trunk", &coded, "--mem", gb, "--spec", spec];
            let (got_ids, got_logits, peak, _) = run_small_env(&args, &[]);
            assert_eq!(got_ids, ids, "budget {budget}, {c} pinned, spec {spec}");
            assert!(
                got_logits == logits,
                "logits differ at {budget}, spec {spec}"
            );
            assert!(peak <= *budget, "peak RSS {peak} above the budget {budget}");
        }
    }
    // Where every layer is pinned coded and the budget falls short of holding them decoded.
    let all = (1..64)
        .map(|k| floor + (model - floor) * k / 64)
        .find(|&b| {
            let p = plan(&coded, &format!("{}", b as f64 / 1e9));
            pinned(&p) == held.len() && p["pin_coded"].as_bool().unwrap()
        })
        .expect("a budget pins every layer coded");
    let gb = format!("{}", all as f64 / 1e9);
    let (got_ids, got_logits, peak, _) = run_small_env(&["--trunk", &coded, "--mem", &gb], &[]);
    assert_eq!(got_ids, ids, "every layer pinned coded at {all}");
    assert!(got_logits == logits, "logits differ at {all}");
    assert!(peak <= all, "peak RSS {peak} above the budget {all}");
    // Everything resident: held coded where the kernels multiply coded weights faster
    // (`kernels::coded_outruns_bf16`, which `coded_first` reports), else decoded.
    let resident = plan(&coded, "1000");
    assert_eq!(
        resident["pin_coded"], resident["sizes"]["coded_first"],
        "{resident}"
    );
    let (got_ids, got_logits, _, _) = run_small_env(&["--trunk", &coded, "--mem", "1000"], &[]);
    assert_eq!(got_ids, ids);
    assert!(got_logits == logits, "logits differ resident");
}

/// `small` packed into `name` ([`pack_small`]), its directory, a prompt, and the logits of 12
/// greedy steps after it from the checkpoint alone, every weight resident.
fn small_packed_and_generated(
    name: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    Vec<u32>,
    Vec<Vec<f32>>,
) {
    let trunk = pack_small(name);
    let dir = small().join("small");
    let prompt: Vec<u32> = (1..=10).collect();
    let (plain, _) = Model::open(&dir, BudgetRequest::Resident, 512).unwrap();
    let want = generate(&plain, &prompt, 12, |_| {});
    (trunk, dir, prompt, want)
}

/// With no budget (`k3 run` without `--mem`: everything resident) and an encoded trunk, the
/// layers and the output head are held as the plan says: coded where the kernels multiply coded
/// weights faster (the SIMD paths), decoded on the scalar path; the tokens are the checkpoint's
/// either way.
#[test]
fn a_model_without_a_budget_holds_the_trunk_as_the_plan_says() {
    use k3::engine::store::ResidentWeights;
    use k3::engine::tensor::DenseData;
    use k3::engine::weights::OpenOptions;
    let (trunk, dir, prompt, want) = small_packed_and_generated("trunk-unbudgeted");
    let opts = OpenOptions {
        budget: BudgetRequest::Resident,
        context: 512,
        trunk: Some(trunk),
        ..OpenOptions::default()
    };
    let (m, info) = Model::open_with(&dir, &opts).unwrap();
    let coded = k3::kernels::coded_outruns_bf16();
    assert_eq!(info.sizes.coded_first, coded);
    assert_eq!((info.plan.pin_coded, info.plan.head_coded), (coded, coded));
    let w = (m.store().as_any().downcast_ref::<ResidentWeights>()).expect("every weight resident");
    let is_coded = |d: &k3::engine::tensor::Dense| matches!(d.data, DenseData::Coded(_));
    assert_eq!(is_coded(&w.lm_head), coded, "the output head");
    let dense_mlp = (w.layers.iter())
        .find_map(|l| match &l.ffn {
            k3::engine::layer::FeedForward::Dense(mlp) => Some(mlp),
            k3::engine::layer::FeedForward::Moe(_) => None,
        })
        .expect("small has a dense layer");
    assert_eq!(
        [&dense_mlp.gate, &dense_mlp.up, &dense_mlp.down].map(is_coded),
        [coded; 3],
        "a dense layer's matrices"
    );
    let got = generate(&m, &prompt, 12, |_| {});
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(a), bits(b), "step {i}");
    }
}

/// The budget slider moving between a plan that holds pinned layers and the output head coded
/// and one that holds them decoded (and one that streams most): the pinned layers and the head
/// are read again the new plan's way, and every step gives the bits of the checkpoint alone.
#[test]
fn plan_changes_between_coded_and_decoded_pinned_layers_change_no_bit() {
    use k3::engine::weights::OpenOptions;
    let (trunk, dir, prompt, want) = small_packed_and_generated("trunk-recode");
    let opts = |req| OpenOptions {
        budget: req,
        context: 512,
        trunk: Some(trunk.clone()),
        ..OpenOptions::default()
    };
    let (_, info) = Model::open_with(&dir, &opts(BudgetRequest::Resident)).unwrap();
    let sizes = info.sizes.clone();
    let plan = |b: u64| budget::plan_states(&sizes, BudgetRequest::Total(b), 512, 1, None).unwrap();
    let (floor, model) = (info.plan.floor_bytes, sizes.model_bytes());
    // A budget whose plan pins every layer coded, and one that pins them decoded.
    let coded = (1..64)
        .map(|k| floor + model * k / 64)
        .find(|&b| plan(b).pin_coded && plan(b).n_pinned() == sizes.layer_trunk.len())
        .expect("a budget pins every layer coded");
    // Where the coded products are the faster ones every budget that pins every layer holds
    // them coded: the plan that holds them decoded is the one made where they are not.
    let decoded_sizes = budget::ModelSizes {
        coded_first: false,
        ..sizes.clone()
    };
    let decoded = 4 * model;
    let plan_decoded =
        budget::plan_states(&decoded_sizes, BudgetRequest::Total(decoded), 512, 1, None).unwrap();
    assert!(!plan_decoded.pin_coded);
    // The output head goes with them: held coded, then decoded, then streamed, then coded.
    // (A total budget pins a head this small in the bytes the floor counts to stream it; a
    // split budget at the floor whose trunk share is the least streams it.)
    let streamed = budget::plan_states(
        &sizes,
        BudgetRequest::Split {
            trunk: Some(1),
            cache: floor,
        },
        512,
        1,
        None,
    )
    .unwrap();
    assert!(plan(coded).head_coded && plan(coded).head_resident);
    assert!(!plan_decoded.head_coded && plan_decoded.head_resident);
    assert!(plan(floor).head_resident && !streamed.head_resident);
    let (m, _) = Model::open_with(&dir, &opts(BudgetRequest::Total(coded))).unwrap();
    let got = generate(&m, &prompt, 12, |step| {
        let p = match step {
            2 => plan_decoded.clone(),
            5 => plan(coded),
            8 => streamed.clone(),
            10 => plan(coded),
            _ => return,
        };
        m.store().set_plan(p).unwrap();
    });
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(a), bits(b), "step {i}");
    }
}

/// A budget that pins every layer of an entropy-coded trunk (short of holding everything)
/// keeps the staging their runs are read through only while they load: after, none is held
/// and its bytes are expert slots, at the bits of the checkpoint alone and inside the budget,
/// loading included. (A nibble-coded trunk's layers are read in place: no staging at all.)
#[test]
fn a_plan_pinning_every_encoded_layer_gives_its_staging_to_expert_slots() {
    let (ids, logits, _) = run_small(&[]);
    let trunk = pack_small_with("trunk-all-pinned", &["--codec", "entropy"]);
    let t = trunk.to_str().unwrap();
    // `k3 run` plans for its prompt and generated tokens: 16 positions.
    let plan = |mem: &str| -> serde_json::Value {
        let out = crate::common::run_ok(
            crate::common::k3_command()
                .arg("plan")
                .arg(small().join("small"))
                .args(["--trunk", t, "--json", "--context", "16", "--mem", mem]),
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let at = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap();
    let probe = plan("1000");
    let (floor, model) = (at(&probe, "floor_bytes"), at(&probe, "model_bytes"));
    let all_experts = at(&probe, "expert_slots");
    // The least budget (in steps of a 32nd of the model) that pins every layer.
    let (budget, p) = (1..64)
        .map(|k| floor + model * k / 32)
        .map(|b| (b, plan(&format!("{}", b as f64 / 1e9))))
        .find(|(_, p)| p["pinned"].as_array().unwrap().iter().all(|x| x == true))
        .expect("a budget pins every layer");
    let (slots, loading) = (at(&p, "expert_slots"), at(&p, "load_expert_slots"));
    let stage = at(&p, "stage_bytes");
    assert!(stage > 0, "{p}");
    assert_eq!(at(&p, "ring_bytes"), 0, "no layer streams: {p}");
    assert!(slots < all_experts, "not everything held: {p}");
    assert!(
        loading < slots,
        "the staging takes slots while loading: {p}"
    );
    let slot = at(&p["sizes"], "expert_bytes");
    assert!(
        (slots - loading) * slot >= stage / 2,
        "the staging's bytes come back as slots: {slots} against {loading} of {slot} B, staging {stage} B"
    );
    let gb = format!("{}", budget as f64 / 1e9);
    let (got_ids, got_logits, peak, stats) = run_small_env(&["--trunk", t, "--mem", &gb], &[]);
    assert_eq!(got_ids, ids, "budget {budget}");
    assert!(got_logits == logits, "logits differ at {budget}");
    assert!(peak <= budget, "peak RSS {peak} above the budget {budget}");
    assert_eq!(stats["stage_bytes"], 0, "the staging is released: {stats}");
    assert_eq!(stats["expert_slots"], slots, "{stats}");
    assert_eq!(
        stats["expert_arena"]["slots"].as_u64().unwrap(),
        slots + 2 * at(&p["sizes"], "top_k"),
        "the arena has the plan's slots after loading: {stats}"
    );
}
