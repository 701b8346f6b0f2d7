//! `k3 serve` applies the sampling parameters of the OpenAI API as vLLM does: `logit_bias`,
//! `presence_penalty` and `frequency_penalty` change the tokens as their definitions say,
//! `seed` makes a sampled reply repeatable, `logprobs`/`top_logprobs` are the log-softmax of
//! the logits `k3 run --dump-logits` writes for the same prompt, streamed or not, and bad
//! values are refused with a 400 naming the parameter.

use crate::serve::{curl, post, sse, start, user, Server};
use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

/// Log-softmax of one row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
    row.iter().map(|&x| x as f64 - m - z.ln()).collect()
}

/// The id of a `token_id:ID` token.
fn id_of(token: &str) -> u32 {
    token.strip_prefix("token_id:").unwrap().parse().unwrap()
}

/// The most likely ids of each token with their log-probabilities.
type Top = Vec<Vec<(u32, f64)>>;

/// A raw completion of PROMPT with `extra` fields: (generated ids, token logprobs, top
/// logprobs by id per token, text).
fn complete(s: &Server, extra: Value) -> (Vec<u32>, Vec<f64>, Top, String) {
    let mut body = json!({"prompt": PROMPT, "temperature": 0, "logprobs": 20,
                          "return_tokens_as_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = post(s, "/v1/completions", &body);
    let lp = &r["choices"][0]["logprobs"];
    let ids = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| id_of(t.as_str().unwrap()))
        .collect();
    let token_lp = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let top = lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_object()
                .unwrap()
                .iter()
                .map(|(t, v)| (id_of(t), v.as_f64().unwrap()))
                .collect()
        })
        .collect();
    let text = r["choices"][0]["text"].as_str().unwrap().to_string();
    (ids, token_lp, top, text)
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits_k3_run_dumps() {
    let s = start(&[], &[]);
    let (ids, token_lp, top, text) = complete(&s, json!({"max_tokens": 8, "logprobs": 5}));
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("logits.bin");
    let run = crate::common::run_ok(
        crate::common::k3_command()
            .arg("run")
            .arg(crate::common::demo_model())
            .args([
                "--prompt",
                PROMPT,
                "--gen",
                "8",
                "--temperature",
                "0",
                "--json",
            ])
            .arg("--dump-logits")
            .arg(&dump),
    );
    let run: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(text, run["text"].as_str().unwrap());
    let run_ids: Vec<u32> = crate::common::u32s(&run["generated_ids"]);
    assert_eq!(ids, run_ids);
    let bytes = std::fs::read(&dump).unwrap();
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(
        floats.len() % 4352,
        0,
        "rows of the demo model's vocabulary"
    );
    for (step, row) in floats.chunks_exact(4352).enumerate().take(ids.len()) {
        let want = log_softmax(row);
        let got = token_lp[step];
        assert!(
            (got - want[ids[step] as usize]).abs() < 1e-4,
            "step {step}: {got} vs {}",
            want[ids[step] as usize]
        );
        // The five most likely ids, with their log-probabilities.
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut got_top = top[step].clone();
        got_top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        assert_eq!(got_top.len(), 5, "step {step}");
        for (k, (id, lp)) in got_top.iter().enumerate() {
            assert_eq!(*id as usize, order[k], "step {step} rank {k}");
            assert!((lp - want[order[k]]).abs() < 1e-4);
        }
        // Greedy: the chosen token is the most likely.
        assert_eq!(ids[step] as usize, order[0]);
    }
}

/// The chat `logprobs.content` entries of a reply, streamed or not.
fn chat_logprobs(s: &Server, stream: bool) -> (Vec<Value>, Value, String) {
    let body = json!({"messages": [user("What is the capital of France?")], "temperature": 0,
                      "logprobs": true, "top_logprobs": 3, "stream": stream,
                      "stream_options": {"include_usage": true}});
    if !stream {
        let r = post(s, "/v1/chat/completions", &body);
        let c = &r["choices"][0];
        return (
            c["logprobs"]["content"].as_array().unwrap().clone(),
            r["usage"].clone(),
            c["finish_reason"].as_str().unwrap().to_string(),
        );
    }
    let (code, text) = curl(s, "/v1/chat/completions", Some(&body.to_string()), &["-N"]);
    assert_eq!(code, 200, "{text}");
    let (mut entries, mut usage, mut finish) = (Vec::new(), Value::Null, String::new());
    for e in sse(&text).iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(u) = v.get("usage") {
            usage = u.clone();
            continue;
        }
        if let Some(c) = v["choices"][0]["logprobs"]["content"].as_array() {
            entries.extend(c.iter().cloned());
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (entries, usage, finish)
}

#[test]
fn chat_logprobs_are_the_same_streamed_or_not() {
    let s = start(&[], &[]);
    let (plain, usage, finish) = chat_logprobs(&s, false);
    let (streamed, _, streamed_finish) = chat_logprobs(&s, true);
    assert_eq!(plain, streamed);
    assert_eq!(finish, streamed_finish);
    // One entry per generated token, the final end of the turn left out.
    let generated = usage["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(plain.len(), generated - usize::from(finish == "stop"));
    for e in &plain {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{e}");
        // Greedy: the chosen token is the first of the most likely.
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert_eq!(e["logprob"], top[0]["logprob"], "{e}");
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
    }
}

#[test]
fn logit_bias_steers_and_forces_tokens() {
    let s = start(&[], &[]);
    let (ids, _, top, text) = complete(&s, json!({"max_tokens": 6}));
    // No bias and no penalty, spelled out, is the default exactly.
    let (same, _, _, same_text) = complete(
        &s,
        json!({"max_tokens": 6, "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0}),
    );
    assert_eq!((&same, &same_text), (&ids, &text));
    // −100 on the greedy token: the next most likely one comes out.
    let mut second = top[0].clone();
    second.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let (banned, _, _, _) = complete(
        &s,
        json!({"max_tokens": 1, "logit_bias": {ids[0].to_string(): -100}}),
    );
    assert_eq!(banned, [second[1].0], "{second:?}");
    // +100 on an unlikely token forces it, sampled or greedy.
    let forced = second[19].0;
    for extra in [json!({}), json!({"temperature": 1.0, "seed": 3})] {
        let mut body = json!({"max_tokens": 4, "logit_bias": {forced.to_string(): 100}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (got, lps, _, _) = complete(&s, body);
        assert_eq!(got, [forced; 4]);
        // Log-probabilities are the model's, not the biased ones.
        assert!(lps[0] < -1.0, "{lps:?}");
    }
}

/// Check each step of a greedy reply against the penalties' definition: the chosen token is
/// the most likely of the top 20 once each is lowered by `presence` if it occurred before
/// and by `frequency` per earlier occurrence.
fn check_penalised_greedy(
    ids: &[u32],
    lps: &[f64],
    top: &[Vec<(u32, f64)>],
    presence: f64,
    frequency: f64,
) {
    for step in 0..ids.len() {
        let count = |id: u32| ids[..step].iter().filter(|&&x| x == id).count() as f64;
        let pen = |id: u32, lp: f64| {
            let n = count(id);
            lp - frequency * n - if n > 0.0 { presence } else { 0.0 }
        };
        let chosen = pen(ids[step], lps[step]);
        for &(id, lp) in &top[step] {
            assert!(
                chosen >= pen(id, lp) - 1e-4,
                "step {step}: {} ({chosen}) chosen over {id} ({})",
                ids[step],
                pen(id, lp)
            );
        }
    }
}

#[test]
fn presence_and_frequency_penalties_follow_the_generated_counts() {
    let s = start(&[], &[]);
    let distinct = |ids: &[u32]| ids.iter().collect::<std::collections::BTreeSet<_>>().len();
    let (plain, lps, top, _) = complete(&s, json!({"max_tokens": 40}));
    check_penalised_greedy(&plain, &lps, &top, 0.0, 0.0);
    // The demo model loops when greedy ("9 plus 9 is 18. 9 plus 9 is 18. …").
    assert!(distinct(&plain) * 2 < plain.len(), "{plain:?}");
    for (presence, frequency) in [(2.0, 0.0), (0.0, 1.5), (1.0, 0.5)] {
        let (ids, lps, top, _) = complete(
            &s,
            json!({"max_tokens": 40, "presence_penalty": presence,
                   "frequency_penalty": frequency}),
        );
        check_penalised_greedy(&ids, &lps, &top, presence, frequency);
        assert!(
            distinct(&ids) > distinct(&plain),
            "presence {presence} frequency {frequency}: {ids:?}"
        );
    }
    // A negative presence penalty favours repeats.
    let (ids, lps, top, _) = complete(&s, json!({"max_tokens": 40, "presence_penalty": -2.0}));
    check_penalised_greedy(&ids, &lps, &top, -2.0, 0.0);
    assert!(distinct(&ids) <= distinct(&plain), "{ids:?}");
}

#[test]
fn a_seed_makes_a_sampled_reply_repeatable() {
    let s = start(&[], &[]);
    let reply = |seed: u64| {
        post(
            &s,
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": seed}),
        )["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let a = reply(11);
    assert_eq!(reply(11), a);
    let others: std::collections::BTreeSet<String> = (1..=6).map(reply).collect();
    assert!(others.len() > 1, "six seeds, one reply: {others:?}");
}

#[test]
fn bad_sampling_parameters_get_a_400_naming_them() {
    let s = start(&[], &[]);
    let m = json!([user("hi")]);
    for (body, param, says) in [
        (
            json!({"messages": m, "logit_bias": {"4352": 1}}),
            "logit_bias",
            "0 to 4351",
        ),
        (
            json!({"messages": m, "logit_bias": {"5": -101}}),
            "logit_bias",
            "-100 to 100",
        ),
        (json!({"messages": m, "n": 2}), "n", "n = 1"),
        (
            json!({"messages": m, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "0 to 20",
        ),
        (
            json!({"messages": m, "frequency_penalty": 2.5}),
            "frequency_penalty",
            "-2 to 2",
        ),
    ] {
        let (code, text) = curl(&s, "/v1/chat/completions", Some(&body.to_string()), &[]);
        assert_eq!(code, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{text}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{text}"
        );
    }
    let (code, text) = curl(
        &s,
        "/v1/completions",
        Some(&json!({"prompt": "a", "logprobs": 21}).to_string()),
        &[],
    );
    assert_eq!(code, 400, "{text}");
}
