//! `k3 serve` takes what real clients send: request bodies of `llm`, aichat, the `openai`
//! package, Open WebUI and Continue (tests/fixtures/clients) each get a correct answer, unknown
//! fields are named in the log; stop strings end a reply before them, streamed or not; and a
//! client that drops `reasoning_content` gets the answers of one that sends it back.

use crate::serve::{assemble, curl, post, sse, start, user, Server};
use serde_json::{json, Value};

/// The answer of a request, streamed or not: (reasoning, content, finish reason, usage).
fn answer(s: &Server, endpoint: &str, body: &Value) -> (String, String, String, Value) {
    let streamed = body["stream"] == true;
    let (code, text) = curl(s, endpoint, Some(&body.to_string()), &["-N"]);
    assert_eq!(code, 200, "{endpoint} {body}: {text}");
    if endpoint == "/v1/completions" {
        if !streamed {
            let v: Value = serde_json::from_str(&text).unwrap();
            let c = &v["choices"][0];
            return (
                String::new(),
                c["text"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
                v["usage"].clone(),
            );
        }
        let (mut content, mut finish) = (String::new(), String::new());
        for e in sse(&text).iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            if let Some(t) = v["choices"][0]["text"].as_str() {
                content.push_str(t);
            }
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
        return (String::new(), content, finish, Value::Null);
    }
    if streamed {
        let (r, c, f, u) = assemble(&sse(&text));
        return (r, c, f, u.unwrap_or(Value::Null));
    }
    let v: Value = serde_json::from_str(&text).unwrap();
    let m = &v["choices"][0]["message"];
    (
        m["reasoning_content"].as_str().unwrap_or("").to_string(),
        m["content"].as_str().unwrap_or("").to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"].clone(),
    )
}

/// Stderr lines the server printed so far.
fn log(s: &Server) -> String {
    let mut out = String::new();
    while let Ok(l) = s.stderr.recv_timeout(std::time::Duration::from_millis(200)) {
        out.push_str(&l);
        out.push('\n');
    }
    out
}

#[test]
fn request_bodies_of_real_clients_get_answers() {
    let s = start(&[], &[]);
    let dir = crate::common::fixture("clients");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 6, "{names:?}");
    for path in names {
        let f: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let endpoint = f["endpoint"].as_str().unwrap();
        let body = &f["body"];
        let (reasoning, content, finish, _) = answer(&s, endpoint, body);
        let what = format!("{} ({})", path.display(), f["client"]);
        assert!(
            !(reasoning.trim().is_empty() && content.trim().is_empty()),
            "{what}: empty answer"
        );
        assert!(finish == "stop" || finish == "length", "{what}: {finish}");
        let stops: Vec<String> = match &body["stop"] {
            Value::String(s) => vec![s.clone()],
            Value::Array(a) => a.iter().map(|v| v.as_str().unwrap().to_string()).collect(),
            _ => Vec::new(),
        };
        for stop in &stops {
            assert!(
                !content.contains(stop.as_str()),
                "{what}: {stop:?} in {content:?}"
            );
        }
        // The answer is right: it names what was asked for, or it is the model's own
        // continuation of the prompt (`k3 run`, greedy) up to the first stop string.
        match f["expect"].as_str() {
            Some(want) => assert!(content.contains(want), "{what}: {content:?}"),
            None => {
                let prompt = body["prompt"].as_str().expect("a raw completion");
                let gen = body["max_tokens"].as_u64().unwrap().to_string();
                let run = crate::common::run_ok(
                    crate::common::k3_command()
                        .arg("run")
                        .arg(crate::common::demo_model())
                        .args(["--prompt", prompt, "--gen", &gen, "--temperature", "0"])
                        .arg("--json"),
                );
                let run: Value = serde_json::from_slice(&run.stdout).unwrap();
                let mut want = run["text"].as_str().unwrap();
                for stop in &stops {
                    if let Some(at) = want.find(stop.as_str()) {
                        want = &want[..at];
                    }
                }
                assert_eq!(content, want, "{what}");
            }
        }
        let logged = log(&s);
        for field in f["unknown"].as_array().unwrap() {
            let field = field.as_str().unwrap();
            assert!(
                logged.contains(&format!("{field} (unknown)")),
                "{what}: {field} not named in the log:\n{logged}"
            );
        }
    }
}

#[test]
fn a_stop_string_ends_the_reply_before_it_streamed_or_not() {
    let s = start(&[], &[]);
    let base = json!({"messages": [user("What is the capital of France?")], "temperature": 0,
                      "thinking": {"type": "disabled"}});
    let full = answer(&s, "/v1/chat/completions", &base).1;
    let at = full.find("Paris").expect("the demo model names Paris");
    for stream in [false, true] {
        let mut body = base.clone();
        body["stop"] = json!(["Par", "never-in-the-reply"]);
        body["stream"] = json!(stream);
        let (_, content, finish, _) = answer(&s, "/v1/chat/completions", &body);
        assert_eq!(content, full[..at], "stream {stream}");
        assert_eq!(finish, "stop");
    }
    // A stop string that never comes: the whole reply.
    let mut body = base.clone();
    body["stop"] = json!("never-in-the-reply");
    assert_eq!(answer(&s, "/v1/chat/completions", &body).1, full);
    // Raw completions take stop strings too.
    let raw = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let whole = answer(&s, "/v1/completions", &raw).1;
    let cut = whole.char_indices().nth(3).map(|(i, _)| i).unwrap();
    let stop = whole[cut..].chars().take(2).collect::<String>();
    let mut body = raw.clone();
    body["stop"] = json!(stop);
    let first = whole.find(stop.as_str()).unwrap();
    assert_eq!(answer(&s, "/v1/completions", &body).1, whole[..first]);
}

/// A 4-turn conversation through a client that sends replies back with their reasoning
/// (`replay`) or without it: each turn's (content, usage).
fn conversation(replay: bool) -> Vec<(String, Value)> {
    let s = start(&[], &[]);
    let mut messages = vec![];
    let mut out = vec![];
    for q in [
        "My name is Ada.",
        "What is the capital of France?",
        "Thank you.",
        "What is my name?",
    ] {
        messages.push(user(q));
        let r = post(
            &s,
            "/v1/chat/completions",
            &json!({"messages": messages, "temperature": 0}),
        );
        let m = &r["choices"][0]["message"];
        assert!(
            !m["reasoning_content"].as_str().unwrap_or("").is_empty(),
            "{r}"
        );
        let mut back = json!({"role": "assistant", "content": m["content"]});
        if replay {
            back["reasoning_content"] = m["reasoning_content"].clone();
        }
        messages.push(back);
        out.push((
            m["content"].as_str().unwrap().to_string(),
            r["usage"].clone(),
        ));
    }
    out
}

#[test]
fn a_client_that_drops_reasoning_gets_the_answers_of_one_that_replays_it() {
    let replaying = conversation(true);
    let dropping = conversation(false);
    for (k, (r, d)) in replaying.iter().zip(&dropping).enumerate() {
        assert_eq!(r.0, d.0, "turn {}", k + 1);
        assert_eq!(r.1, d.1, "turn {}", k + 1);
    }
    // The prefix cache reaches into each earlier reply (past its reasoning, where a render
    // without the reasoning would part from what the server holds).
    for k in 1..dropping.len() {
        let cached = dropping[k].1["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let earlier = dropping[k - 1].1["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached > earlier,
            "turn {}: {cached} cached, {earlier} before",
            k + 1
        );
    }
}
