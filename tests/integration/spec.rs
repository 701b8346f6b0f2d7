//! Speculative decoding changes no token: verification chunks give the serial logits bit for
//! bit, a rollback leaves bit for bit the serial state, and greedy and seeded generation emit the
//! same ids with speculation off, automatic or at any fixed draft length — resident, streamed at
//! several budgets, and through the `k3` binary on the demo model and a synthetic checkpoint.

use crate::common::{fixture, json, k3_command, run_ok, u32s};
use k3::engine::kda::KdaState;
use k3::engine::model::Logits;
use k3::engine::sampling::{Sampler, SamplerConfig};
use k3::engine::spec::{Drafter, SpecMode, Speculator};
use k3::engine::state::LayerState;
use k3::engine::{Model, SeqState};
use k3::stream::budget::BudgetRequest;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The state as bit patterns (so that −0.0 and 0.0, or two NaNs, are told apart).
fn state_bits(s: &SeqState) -> (usize, Vec<Vec<u32>>) {
    let layers = s
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Mla(c) => bits(c),
            LayerState::Kda(KdaState { s, conv }) => {
                let mut v = bits(s);
                for c in conv {
                    v.extend(bits(c));
                }
                v
            }
        })
        .collect();
    (s.n_pos, layers)
}

fn open(set: &str, req: BudgetRequest) -> Model {
    Model::open(&fixture(set), req, 512).unwrap().0
}

/// Serial logits after each of `ids` fed one at a time on top of `state`.
fn serial(m: &Model, state: &mut SeqState, ids: &[u32]) -> Vec<Vec<f32>> {
    ids.iter()
        .map(|&id| m.forward(state, &[id], Logits::Last).unwrap())
        .collect()
}

#[test]
fn kept_buffers_refilled_by_pass_after_pass_leave_the_serial_state_bit_for_bit() {
    // One run state and one rollback serve every pass, as in the decoding loop: chunks of
    // different lengths, each kept in full, in part or not past its first token, so that no
    // pass may read what an earlier, longer one left behind.
    for set in ["tiny", "tiny2"] {
        let m = open(set, BudgetRequest::Resident);
        let full = u32s(&json(&format!("{set}/oracle.json"))["full_ids"]);
        let mut run = k3::engine::RunState::new();
        let mut rb = k3::engine::Rollback::default();
        let mut st = SeqState::new(&m.cfg);
        let mut want = SeqState::new(&m.cfg);
        m.forward(&mut st, &full[..3], Logits::None).unwrap();
        m.forward(&mut want, &full[..3], Logits::None).unwrap();
        let mut pos = 3;
        for (len, keep) in [(6, 2), (2, 2), (9, 9), (4, 1), (7, 5), (3, 0), (5, 5)] {
            let chunk = &full[pos..pos + len];
            let want_rows = serial(&m, &mut want.clone(), chunk);
            let all = m
                .forward_verify_run(&mut st, &mut run, chunk, &mut rb)
                .unwrap();
            let v = m.cfg.vocab_size;
            for (i, row) in all.chunks(v).enumerate() {
                assert_eq!(bits(row), bits(&want_rows[i]), "{set}: len {len}, row {i}");
            }
            m.roll_back(&mut st, &mut rb, keep);
            m.forward(&mut want, &chunk[..keep], Logits::None).unwrap();
            assert_eq!(
                state_bits(&st),
                state_bits(&want),
                "{set}: len {len}, keep {keep}"
            );
            pos += keep;
        }
    }
}

#[test]
fn a_rolled_back_chunk_leaves_the_serial_state_bit_for_bit() {
    for set in ["tiny", "tiny2"] {
        let m = open(set, BudgetRequest::Resident);
        let full = u32s(&json(&format!("{set}/oracle.json"))["full_ids"]);
        let (prefix, chunk) = (&full[..7], &full[7..14]);
        let mut base = SeqState::new(&m.cfg);
        m.forward(&mut base, prefix, Logits::None).unwrap();
        let mut s = base.clone();
        let want_logits = serial(&m, &mut s, chunk);
        for keep in 0..=chunk.len() {
            let mut st = base.clone();
            let (all, mut rb) = m.forward_verify(&mut st, chunk).unwrap();
            let v = m.cfg.vocab_size;
            for (i, row) in all.chunks(v).enumerate() {
                assert_eq!(bits(row), bits(&want_logits[i]), "{set}: row {i}");
            }
            m.roll_back(&mut st, &mut rb, keep);
            let mut want = base.clone();
            m.forward(&mut want, &chunk[..keep], Logits::None).unwrap();
            assert_eq!(state_bits(&st), state_bits(&want), "{set}: keep {keep}");
            // And it goes on exactly as the serial state does.
            let next = full[14];
            assert_eq!(
                bits(&m.forward(&mut st, &[next], Logits::Last).unwrap()),
                bits(&m.forward(&mut want, &[next], Logits::Last).unwrap()),
                "{set}: after keep {keep}"
            );
        }
    }
}

/// Proposes the ids of a known continuation (all right), or ids shifted by one (all wrong),
/// or alternately right and wrong.
struct Scripted {
    reference: Vec<u32>,
    kind: u8,
    vocab: u32,
}

impl Drafter for Scripted {
    fn propose(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        let at = history.len();
        for (i, &id) in self.reference.iter().skip(at).take(max).enumerate() {
            let wrong = (id + 1) % self.vocab;
            out.push(match self.kind {
                0 => id,
                1 => wrong,
                _ if (at + i) % 3 == 2 => wrong,
                _ => id,
            });
        }
    }
}

/// Generate `n` tokens after `prompt` the way `k3 run` does, through a speculator.
fn generate(
    m: &Model,
    prompt: &[u32],
    n: usize,
    cfg: SamplerConfig,
    mut spec: Speculator,
) -> Vec<u32> {
    let mut sampler = Sampler::new(cfg).unwrap();
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last).unwrap();
    let mut history = prompt.to_vec();
    for step in 0..n {
        let next = sampler.sample(&logits, &history).unwrap();
        history.push(next);
        if step + 1 == n {
            break;
        }
        logits = spec
            .advance(m, &mut st, &history, next, n - step - 2)
            .unwrap()
            .to_vec();
    }
    spec.settle(m, &mut st);
    // The state covers exactly the fed tokens: everything but the last sampled id.
    let mut want = SeqState::new(&m.cfg);
    m.forward(&mut want, &history[..history.len() - 1], Logits::None)
        .unwrap();
    assert_eq!(state_bits(&st), state_bits(&want), "state after settle");
    history[prompt.len()..].to_vec()
}

fn samplers() -> [SamplerConfig; 2] {
    let greedy = SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    };
    let seeded = SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        repeat_penalty: 1.1,
        seed: 20_261_201,
        ..SamplerConfig::default()
    };
    [greedy, seeded]
}

#[test]
fn greedy_and_seeded_generation_are_the_same_with_any_drafts() {
    for set in ["tiny", "tiny2"] {
        let o = json(&format!("{set}/oracle.json"));
        let prompt = u32s(&o["prompt_ids"]);
        let resident = open(set, BudgetRequest::Resident);
        let (_, info) = Model::open(&fixture(set), BudgetRequest::Resident, 512).unwrap();
        let floor = info.plan.floor_bytes;
        let streamed = [
            open(set, BudgetRequest::Total(floor)),
            open(
                set,
                BudgetRequest::Total(floor + info.sizes.model_bytes() / 3),
            ),
        ];
        let vocab = resident.cfg.vocab_size as u32;
        for cfg in samplers() {
            let n = 24;
            let want = generate(&resident, &prompt, n, cfg, Speculator::new(SpecMode::Off));
            let mut reference = prompt.clone();
            reference.extend(&want);
            for m in std::iter::once(&resident).chain(&streamed) {
                for mode in [
                    SpecMode::Auto,
                    SpecMode::Fixed(1),
                    SpecMode::Fixed(3),
                    SpecMode::Fixed(8),
                ] {
                    let got = generate(m, &prompt, n, cfg, Speculator::new(mode));
                    assert_eq!(got, want, "{set} {mode} t={}", cfg.temperature);
                    for kind in 0..3 {
                        let d = Scripted {
                            reference: reference.clone(),
                            kind,
                            vocab,
                        };
                        let spec = Speculator::with_drafter(mode, Box::new(d));
                        let got = generate(m, &prompt, n, cfg, spec);
                        assert_eq!(
                            got, want,
                            "{set} {mode} drafter {kind} t={}",
                            cfg.temperature
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_right_draft_is_used_and_a_wrong_one_is_not() {
    let m = open("tiny", BudgetRequest::Resident);
    let prompt = u32s(&json("tiny/oracle.json")["prompt_ids"]);
    let cfg = samplers()[0];
    let want = generate(&m, &prompt, 20, cfg, Speculator::new(SpecMode::Off));
    let mut reference = prompt.clone();
    reference.extend(&want);
    let vocab = m.cfg.vocab_size as u32;
    let run = |kind| {
        let d = Scripted {
            reference: reference.clone(),
            kind,
            vocab,
        };
        let mut spec = Speculator::with_drafter(SpecMode::Fixed(4), Box::new(d));
        let mut sampler = Sampler::new(cfg).unwrap();
        let mut st = SeqState::new(&m.cfg);
        let mut logits = m.forward(&mut st, &prompt, Logits::Last).unwrap();
        let mut history = prompt.clone();
        for step in 0..19 {
            let next = sampler.sample(&logits, &history).unwrap();
            history.push(next);
            logits = spec
                .advance(&m, &mut st, &history, next, 18 - step)
                .unwrap()
                .to_vec();
        }
        spec.settle(&m, &mut st);
        spec.stats()
    };
    let right = run(0);
    assert_eq!(right.accepted, right.proposed, "{right:?}");
    assert!(right.tokens_per_pass() > 3.0, "{right:?}");
    let wrong = run(1);
    assert_eq!(wrong.accepted, 0, "{wrong:?}");
    assert_eq!(wrong.passes, 19, "{wrong:?}");
}

/// `k3 run --json` generated ids with extra flags.
fn run_ids(args: &[&str]) -> (serde_json::Value, serde_json::Value) {
    let out = run_ok(k3_command().arg("run").args(args).arg("--json"));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (j["generated_ids"].clone(), j["spec"].clone())
}

#[test]
fn the_binary_gives_the_same_tokens_with_speculation_on_the_demo_and_a_streamed_checkpoint() {
    // The demo model falls into a repeating list here, so drafts are proposed and used.
    let prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,";
    for sampling in [
        vec!["--temperature", "0"],
        vec!["--temperature", "0.8", "--top-k", "20", "--seed", "7"],
    ] {
        let base: Vec<&str> = [vec!["--prompt", prompt, "--gen", "48"], sampling.clone()].concat();
        let (want, off) = run_ids(&[base.clone(), vec!["--spec", "off"]].concat());
        assert_eq!(off["proposed"], 0);
        for spec in ["auto", "2", "8"] {
            for budget in [vec![], vec!["--mem", "0.06"]] {
                let (got, st) =
                    run_ids(&[base.clone(), vec!["--spec", spec], budget.clone()].concat());
                assert_eq!(got, want, "demo --spec {spec} {budget:?} {sampling:?}");
                if spec == "8" && sampling[1] == "0" {
                    assert!(st["accepted"].as_u64().unwrap() > 0, "{st}");
                }
            }
        }
        // K3_NOSPEC turns it off whatever the flag says.
        let out = run_ok(
            k3_command()
                .env("K3_NOSPEC", "1")
                .arg("run")
                .args(&base)
                .args(["--spec", "8", "--json"]),
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["generated_ids"], want);
        assert_eq!(j["spec"]["proposed"], 0);
        assert_eq!(j["spec"]["mode"], "off");
    }
}

#[test]
fn a_bad_spec_value_is_refused() {
    let out = k3_command()
        .args(["run", "--ids", "1,2", "--spec", "fast"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("off, auto or a draft length"));
}

#[test]
fn chat_replies_are_the_same_with_speculation() {
    let input = "Count the days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday\nWhat is the capital of France?\n/raw\nMonday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday,\n";
    let chat = |spec: &str, extra: &[&str]| {
        crate::common::jsonl_with_input(
            k3_command()
                .args([
                    "chat",
                    "--jsonl",
                    "--greedy",
                    "--max-tokens",
                    "40",
                    "--raw-max-tokens",
                    "40",
                    "--spec",
                    spec,
                ])
                .args(extra)
                .env(
                    "K3_CACHE_DIR",
                    std::env::temp_dir().join("k3-spec-test-cache"),
                )
                .arg("--session-dir")
                .arg(tempfile::tempdir().unwrap().path()),
            input,
        )
    };
    let strip = |v: Vec<serde_json::Value>| -> Vec<(serde_json::Value, serde_json::Value)> {
        v.into_iter()
            .filter(|j| j.get("generated_ids").is_some())
            .map(|j| (j["generated_ids"].clone(), j["reply"].clone()))
            .collect()
    };
    let want = strip(chat("off", &["--context", "2048"]));
    assert_eq!(want.len(), 3, "{want:?}");
    for (spec, extra) in [
        ("auto", vec!["--context", "2048"]),
        ("4", vec!["--context", "2048"]),
        ("4", vec!["--mem", "0.065", "--context", "2048"]),
    ] {
        let got = chat(spec, &extra);
        let last = got.last().cloned().unwrap();
        assert_eq!(strip(got), want, "--spec {spec} {extra:?}");
        if spec == "4" {
            assert!(last["spec"]["proposed"].as_u64().unwrap() > 0, "{last}");
        }
    }
}

#[test]
fn a_streamed_synthetic_checkpoint_gives_the_same_tokens_with_speculation() {
    let dir = crate::streaming::small().join("small");
    let plan = run_ok(
        k3_command()
            .arg("plan")
            .arg(&dir)
            .args(["--mem", "1000", "--json"]),
    );
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let (model, floor) = (
        plan["model_bytes"].as_u64().unwrap(),
        plan["floor_bytes"].as_u64().unwrap(),
    );
    let d = dir.to_str().unwrap();
    for sampling in [
        vec!["--temperature", "0"],
        vec!["--temperature", "1", "--seed", "3"],
    ] {
        let base = [
            vec![d, "--ids", "5,6,7,8,5,6,7,8,5,6,7", "--gen", "10"],
            sampling,
        ]
        .concat();
        let (want, _) = run_ids(&[base.clone(), vec!["--spec", "off"]].concat());
        for budget in [floor, model / 3] {
            let gb = format!("{}", budget as f64 / 1e9);
            for spec in ["auto", "3"] {
                let (got, _) =
                    run_ids(&[base.clone(), vec!["--spec", spec, "--mem", gb.as_str()]].concat());
                assert_eq!(got, want, "--spec {spec} at {budget} B");
            }
        }
    }
}

#[test]
fn distribution_preserving_speculation_is_seeded_greedy_exact_and_needs_a_fixed_length() {
    let prompt = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,";
    let base = [
        "--prompt",
        prompt,
        "--gen",
        "48",
        "--spec-sampling",
        "distribution",
    ];
    // Greedy: the same tokens as without speculation.
    let (want, _) = run_ids(&[&base[..], &["--temperature", "0", "--spec", "off"]].concat());
    let (got, st) = run_ids(&[&base[..], &["--temperature", "0", "--spec", "8"]].concat());
    assert_eq!(got, want);
    assert!(st["accepted"].as_u64().unwrap() > 0, "{st}");
    // Sampled: reproducible from the seed, at every budget (the acceptance stream is part of
    // the schedule), and drafts are used.
    let sampled = [
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--spec",
        "4",
    ];
    let (a, st) = run_ids(&[&base[..], &sampled[..]].concat());
    let (b, _) = run_ids(&[&base[..], &sampled[..], &["--mem", "0.06"]].concat());
    assert_eq!(a, b);
    assert!(st["proposed"].as_u64().unwrap() > 0, "{st}");
    // An adaptive length would change which draws are used: refused.
    let out = k3_command()
        .args([
            "run",
            "--prompt",
            prompt,
            "--gen",
            "4",
            "--temperature",
            "0.8",
        ])
        .args(["--spec", "auto", "--spec-sampling", "distribution"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("fixed draft length"));
}

/// `k3 run --json` on `args`: generated ids, the `spec` object and the stats.
fn run_json(args: &[&str]) -> serde_json::Value {
    let out = run_ok(k3_command().arg("run").args(args).arg("--json"));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn on_a_checkpoint_that_repeats_drafts_are_used_and_each_token_reads_less() {
    // A cycled checkpoint continues every id with the next of its run of 64; given one whole
    // run, its reply quotes the prompt. Streamed below its size, speculation must give the
    // serial ids, use nearly every draft, and read fewer bytes per token (the trunk once per
    // pass instead of once per token).
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cyc");
    run_ok(
        k3_command()
            .args(["synth", "small"])
            .arg(&dir)
            .args(["--cycle", "64"]),
    );
    let d = dir.to_str().unwrap();
    let prompt: Vec<String> = (64..128).map(|i: u32| i.to_string()).collect();
    let prompt = prompt.join(",");
    let plan = run_ok(k3_command().arg("plan").arg(&dir).args(["--json"]));
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    let model = plan["model_bytes"].as_u64().unwrap();
    let base = vec![
        d,
        "--ids",
        prompt.as_str(),
        "--gen",
        "40",
        "--temperature",
        "0",
    ];
    let serial = run_json(&[base.clone(), vec!["--spec", "off"]].concat());
    let want: Vec<u64> = (0..40).map(|i| 64 + i % 64).collect();
    let got: Vec<u64> = serial["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, want, "the cycled checkpoint does not quote its cycle");
    for budget in [None, Some(model / 3)] {
        let gb = budget.map(|b| format!("{}", b as f64 / 1e9));
        let mem: Vec<&str> = gb.iter().flat_map(|g| ["--mem", g.as_str()]).collect();
        let off = run_json(&[base.clone(), vec!["--spec", "off"], mem.clone()].concat());
        for spec in ["auto", "8"] {
            let j = run_json(&[base.clone(), vec!["--spec", spec], mem.clone()].concat());
            assert_eq!(
                j["generated_ids"], serial["generated_ids"],
                "--spec {spec} {mem:?}"
            );
            if spec == "8" {
                let st = &j["spec"];
                assert!(
                    st["acceptance"].as_f64().unwrap() > 0.9
                        && st["tokens_per_pass"].as_f64().unwrap() > 4.0,
                    "{mem:?}: {st}"
                );
                if budget.is_some() {
                    let per =
                        |j: &serde_json::Value| j["spec"]["bytes_read_per_token"].as_f64().unwrap();
                    assert!(
                        per(&j) < 0.5 * per(&off),
                        "{mem:?}: {} bytes per token speculating, {} serially",
                        per(&j),
                        per(&off)
                    );
                }
            }
        }
    }
}

#[test]
fn a_cycle_is_refused_where_it_cannot_be_written() {
    let tmp = tempfile::tempdir().unwrap();
    for (shape, n) in [("k3", "16"), ("tiny", "1"), ("tiny", "100000")] {
        let out = k3_command()
            .args(["synth", shape])
            .arg(tmp.path().join(format!("{shape}-{n}")))
            .args(["--cycle", n])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{shape} --cycle {n}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--cycle"), "{err}");
        assert!(!tmp.path().join(format!("{shape}-{n}")).exists());
    }
}
