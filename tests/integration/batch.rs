//! Several sequences decoded in one pass over the weights (`Model::forward_batch`): every
//! sequence's logits are bitwise those of decoding it alone, at every budget, greedy and
//! sampled, with sequences joining and leaving at different positions.

use crate::common::{fixture, json, u32s};
use k3::engine::model::Logits;
use k3::engine::sampling::{Sampler, SamplerConfig};
use k3::engine::{Model, RunState, SeqState};
use k3::stream::budget::BudgetRequest;
use std::io::Write;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A decoded sequence: the logits of each step, and the ids picked from them.
type Decoded = (Vec<Vec<f32>>, Vec<u32>);

/// One sequence of a schedule: its prompt, the step at which it joins, how many tokens it
/// generates and how it picks them.
#[derive(Clone)]
struct Request {
    prompt: Vec<u32>,
    join: usize,
    n_gen: usize,
    sampling: SamplerConfig,
}

/// The logits after the prompt and after each generated token but the last, and the
/// generated ids, of `r` decoded alone.
fn alone(m: &Model, r: &Request) -> Decoded {
    let mut st = SeqState::new(&m.cfg);
    let mut run = RunState::new();
    let mut sampler = Sampler::new(r.sampling).unwrap();
    let mut history = r.prompt.clone();
    let mut logits = m
        .forward_run(&mut st, &mut run, &r.prompt, Logits::Last)
        .unwrap()
        .to_vec();
    let (mut all, mut ids) = (Vec::new(), Vec::new());
    loop {
        let next = sampler.sample(&logits, &history).unwrap();
        all.push(logits);
        ids.push(next);
        history.push(next);
        if ids.len() == r.n_gen {
            return (all, ids);
        }
        logits = m
            .forward_run(&mut st, &mut run, &[next], Logits::Last)
            .unwrap()
            .to_vec();
    }
}

/// A sequence in flight in [`batched`].
struct Live {
    i: usize,
    state: SeqState,
    sampler: Sampler,
    history: Vec<u32>,
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

impl Live {
    fn take(&mut self, logits: &[f32]) {
        let next = self.sampler.sample(logits, &self.history).unwrap();
        self.logits.push(logits.to_vec());
        self.ids.push(next);
        self.history.push(next);
    }
}

/// The same as [`alone`] for every request, decoded together: a request is prefilled alone at
/// its join step, then steps with every other sequence in flight in one batched pass until it
/// has its tokens. Also the largest batch a step ran.
fn batched(m: &Model, reqs: &[Request]) -> (Vec<Decoded>, usize) {
    let mut done: Vec<Option<Decoded>> = vec![None; reqs.len()];
    let mut live: Vec<Live> = Vec::new();
    let mut run = RunState::new();
    let mut widest = 0;
    for step in 0.. {
        for (i, r) in reqs.iter().enumerate().filter(|(_, r)| r.join == step) {
            let mut state = SeqState::new(&m.cfg);
            let mut prefill = RunState::new();
            let logits = m
                .forward_run(&mut state, &mut prefill, &r.prompt, Logits::Last)
                .unwrap()
                .to_vec();
            let mut l = Live {
                i,
                state,
                sampler: Sampler::new(r.sampling).unwrap(),
                history: r.prompt.clone(),
                ids: Vec::new(),
                logits: Vec::new(),
            };
            l.take(&logits);
            live.push(l);
        }
        // Those with all their tokens leave.
        let mut k = 0;
        while k < live.len() {
            if live[k].ids.len() == reqs[live[k].i].n_gen {
                let l = live.remove(k);
                done[l.i] = Some((l.logits, l.ids));
            } else {
                k += 1;
            }
        }
        if live.is_empty() && reqs.iter().all(|r| r.join <= step) {
            break;
        }
        if live.is_empty() {
            continue;
        }
        widest = widest.max(live.len());
        let tokens: Vec<u32> = live.iter().map(|l| l.ids[l.ids.len() - 1]).collect();
        let mut seqs: Vec<&mut SeqState> = live.iter_mut().map(|l| &mut l.state).collect();
        let vocab = m.cfg.vocab_size;
        let logits = m.forward_batch(&mut seqs, &mut run, &tokens).unwrap();
        assert_eq!(logits.len(), tokens.len() * vocab);
        let rows: Vec<Vec<f32>> = logits.chunks(vocab).map(<[f32]>::to_vec).collect();
        for (l, row) in live.iter_mut().zip(&rows) {
            l.take(row);
        }
    }
    let out = done.into_iter().map(|d| d.unwrap()).collect();
    (out, widest)
}

/// Requests over a fixture's prompt: different lengths, join steps and lengths, two with
/// the same prompt, greedy and seeded.
fn requests(set: &str) -> Vec<Request> {
    let p = u32s(&json(&format!("{set}/oracle.json"))["prompt_ids"]);
    let seeded = |seed: u64, temperature: f32| SamplerConfig {
        temperature,
        top_k: 40,
        top_p: 0.95,
        seed,
        ..SamplerConfig::default()
    };
    let greedy = SamplerConfig::default();
    let cut = |a: usize, b: usize| p[a.min(p.len() - 1)..b.min(p.len())].to_vec();
    vec![
        Request {
            prompt: p.clone(),
            join: 0,
            n_gen: 9,
            sampling: greedy,
        },
        Request {
            prompt: cut(0, 3),
            join: 0,
            n_gen: 5,
            sampling: seeded(7, 0.8),
        },
        Request {
            prompt: cut(2, 9),
            join: 1,
            n_gen: 12,
            sampling: greedy,
        },
        Request {
            prompt: p.clone(),
            join: 2,
            n_gen: 6,
            sampling: seeded(3, 1.3),
        },
        Request {
            prompt: cut(1, 2),
            join: 2,
            n_gen: 8,
            sampling: seeded(11, 1.0),
        },
        Request {
            prompt: cut(0, 5),
            join: 4,
            n_gen: 4,
            sampling: greedy,
        },
        Request {
            prompt: p.clone(),
            join: 4,
            n_gen: 7,
            sampling: greedy,
        },
        Request {
            prompt: cut(3, 4),
            join: 9,
            n_gen: 3,
            sampling: seeded(5, 0.7),
        },
    ]
}

fn open(set: &str, req: BudgetRequest) -> (Model, k3::engine::weights::LoadInfo) {
    Model::open(&fixture(set), req, 512).unwrap()
}

#[test]
fn a_batched_step_gives_every_sequence_its_own_bits_at_every_budget() {
    for set in ["tiny", "tiny2"] {
        let reqs = requests(set);
        let (resident, info) = open(set, BudgetRequest::Resident);
        let want: Vec<_> = reqs.iter().map(|r| alone(&resident, r)).collect();
        let floor = info.plan.floor_bytes;
        let everything = info.sizes.model_bytes();
        let budgets = [
            BudgetRequest::Resident,
            BudgetRequest::Total(floor),
            BudgetRequest::Total(floor + everything / 4),
        ];
        for budget in budgets {
            let (m, _) = open(set, budget);
            let (got, widest) = batched(&m, &reqs);
            assert!(
                widest >= 5,
                "{set}: the schedule batches ({widest} at most)"
            );
            for (i, ((gl, gi), (wl, wi))) in got.iter().zip(&want).enumerate() {
                assert_eq!(gi, wi, "{set} {budget:?}: ids of sequence {i}");
                assert_eq!(gl.len(), wl.len());
                for (step, (a, b)) in gl.iter().zip(wl).enumerate() {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "{set} {budget:?}: sequence {i} step {step}"
                    );
                }
            }
            if let Some(st) = m.streamer() {
                assert!(st.stats().disk_bytes_read > 0);
            }
        }
    }
}

#[test]
fn a_batch_of_one_is_a_single_decoding_step() {
    let (m, _) = open("tiny", BudgetRequest::Resident);
    let prompt = u32s(&json("tiny/oracle.json")["prompt_ids"]);
    let (mut a, mut b) = (SeqState::new(&m.cfg), SeqState::new(&m.cfg));
    let (mut ra, mut rb) = (RunState::new(), RunState::new());
    m.forward_run(&mut a, &mut ra, &prompt, Logits::Last)
        .unwrap();
    m.forward_run(&mut b, &mut rb, &prompt, Logits::Last)
        .unwrap();
    for &t in &prompt[..4] {
        let one = m.forward_run(&mut a, &mut ra, &[t], Logits::Last).unwrap();
        let batch = m.forward_batch(&mut [&mut b], &mut rb, &[t]).unwrap();
        assert_eq!(bits(one), bits(batch));
        assert_eq!(a, b, "the carried state");
    }
}

#[test]
fn every_batch_width_gives_a_row_the_same_bits() {
    // The same sequence stepped in batches of 1 to 9 identical copies: every row of every
    // width equals the lone step (the kernels' blocks of 2, 3, 4 and 8 rows included).
    for set in ["tiny", "tiny2"] {
        let (m, _) = open(set, BudgetRequest::Resident);
        let prompt = u32s(&json(&format!("{set}/oracle.json"))["prompt_ids"]);
        let mut base = SeqState::new(&m.cfg);
        let mut run = RunState::new();
        m.forward_run(&mut base, &mut run, &prompt, Logits::Last)
            .unwrap();
        let mut lone = base.clone();
        let want = m
            .forward_run(&mut lone, &mut run, &[prompt[0]], Logits::Last)
            .unwrap()
            .to_vec();
        for width in 1..=9 {
            let mut states: Vec<SeqState> = vec![base.clone(); width];
            let mut seqs: Vec<&mut SeqState> = states.iter_mut().collect();
            let tokens = vec![prompt[0]; width];
            let got = m.forward_batch(&mut seqs, &mut run, &tokens).unwrap();
            for (t, row) in got.chunks(m.cfg.vocab_size).enumerate() {
                assert_eq!(bits(row), bits(&want), "{set}: row {t} of {width}");
            }
            assert!(
                states.iter().all(|s| *s == lone),
                "{set}: states at width {width}"
            );
        }
    }
}

#[test]
fn k3_bench_sequences_reports_the_batch_and_each_sequence_gets_its_lone_ids() {
    let tiny = fixture("tiny");
    let out = crate::common::run_ok(crate::common::k3_command().arg("bench").arg(&tiny).args([
        "--sequences",
        "3",
        "--gen",
        "5",
        "--prompt-len",
        "6",
        "--json",
    ]));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b = &j["batch"];
    assert_eq!(b["sequences"], 3, "{b}");
    assert_eq!(b["steps"], 4, "{b}");
    assert!(
        b["aggregate_tokens_per_second"].as_f64().unwrap() > 0.0,
        "{b}"
    );
    let agg = b["aggregate_tokens_per_second"].as_f64().unwrap();
    let each = b["per_sequence_tokens_per_second"].as_f64().unwrap();
    assert!((agg / 3.0 - each).abs() <= 1e-9 * agg, "{b}");
    let vocab = 512;
    for (i, ids) in b["generated_ids"].as_array().unwrap().iter().enumerate() {
        let prompt: Vec<String> = (0..6u32)
            .map(|k| ((k * 7 + 3 + i as u32) % vocab).to_string())
            .collect();
        let alone =
            crate::common::run_ok(crate::common::k3_command().arg("run").arg(&tiny).args([
                "--ids",
                &prompt.join(","),
                "--gen",
                "5",
                "--json",
            ]));
        let a: serde_json::Value = serde_json::from_slice(&alone.stdout).unwrap();
        assert_eq!(ids, &a["generated_ids"], "sequence {i}");
    }
    let bad = crate::common::k3_command()
        .arg("bench")
        .arg(&tiny)
        .args(["--sequences", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let bad = crate::common::k3_command()
        .arg("bench")
        .arg(&tiny)
        .args(["--sequences", "65"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn k3_plan_counts_the_sequences_that_fit_as_k3_run_prompts_plans_them() {
    let tiny = fixture("tiny");
    let plan = |extra: &[&str]| {
        let out = crate::common::k3_command()
            .arg("plan")
            .arg(&tiny)
            .args(["--context", "4", "--json"])
            .args(extra)
            .output()
            .unwrap();
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (out.status.code(), j)
    };
    let (code, j) = plan(&[]);
    assert_eq!(code, Some(0), "{j}");
    let floor = j["floor_bytes"].as_u64().unwrap();
    let each = j["sequence_state_bytes"].as_u64().unwrap();
    assert!(each > 0, "{j}");
    // Room above the one-sequence floor for two and a half more states: three fit.
    let mem = format!("{:.9}", (floor + each * 5 / 2) as f64 / 1e9);
    let (code, j) = plan(&["--mem", &mem]);
    assert_eq!(code, Some(0), "{j}");
    assert_eq!(j["sequences_fit"], 3, "{j}");
    // `k3 run --prompts` at that budget: three prompts of 4 positions together are planned,
    // four are refused.
    for (n, ok) in [(3, true), (4, false)] {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for _ in 0..n {
            writeln!(f, "{{\"ids\": [1, 2], \"max_tokens\": 2}}").unwrap();
        }
        let out = crate::common::k3_command()
            .arg("run")
            .arg(&tiny)
            .args(["--mem", &mem, "--parallel", &n.to_string(), "--prompts"])
            .arg(f.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{n}: {err}");
        if !ok {
            assert_eq!(out.status.code(), Some(2));
            assert!(err.contains("lower --parallel"), "{err}");
        }
    }
}
