//! `k3 serve --parallel N` decodes up to N requests together, one token each per pass over the
//! weights: every request's reply (ids, log-probabilities, text, finish) is the one a server
//! answering one request at a time gives it, greedy and seeded, with penalties, biases, stop
//! strings, chat and raw, streamed or not, while requests join and leave mid-way and one is
//! cancelled by its client going away; past N in flight and `--queue` waiting the answer is
//! 429; `/metrics` reports the sequences in flight and the tokens per pass.

use crate::serve::{curl, metric, sse, start, user, wait_until, Server};
use serde_json::{json, Value};
use std::io::BufRead;
use std::process::{Child, Command, Stdio};

/// What a reply says, streamed or not, in one form: (text, reasoning, finish reason, every
/// token's log-probability entry, completion tokens when the server reports them).
type Reply = (String, String, String, Vec<Value>, Option<u64>);

/// The [`Reply`] of one choice object (a response's or a stream chunk's) added to `r`.
fn add_choice(r: &mut Reply, c: &Value, streamed: bool) {
    let (text, reasoning) = if streamed {
        match c.get("delta") {
            Some(d) => (&d["content"], &d["reasoning_content"]),
            None => (&c["text"], &Value::Null),
        }
    } else {
        match c.get("message") {
            Some(m) => (&m["content"], &m["reasoning_content"]),
            None => (&c["text"], &Value::Null),
        }
    };
    r.0.push_str(text.as_str().unwrap_or(""));
    r.1.push_str(reasoning.as_str().unwrap_or(""));
    if let Some(f) = c["finish_reason"].as_str() {
        r.2 = f.to_string();
    }
    let lp = &c["logprobs"];
    if let Some(content) = lp["content"].as_array() {
        r.3.extend(content.iter().cloned());
    } else if let Some(tokens) = lp["tokens"].as_array() {
        for (i, t) in tokens.iter().enumerate() {
            r.3.push(json!([t, lp["token_logprobs"][i], lp["top_logprobs"][i]]));
        }
    }
}

/// The [`Reply`] of a response body.
fn reply_of(body: &str, streamed: bool) -> Reply {
    let mut r: Reply = Default::default();
    if streamed {
        let events = sse(body);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            if let Some(c) = v["choices"].get(0) {
                add_choice(&mut r, c, true);
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                r.4 = Some(n);
            }
        }
    } else {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        add_choice(&mut r, &v["choices"][0], false);
        r.4 = v["usage"]["completion_tokens"].as_u64();
    }
    r
}

fn endpoint(body: &Value) -> &'static str {
    if body.get("messages").is_some() {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// POST `body` to the server at `url` (a [`Server`] is not shared between threads); (status,
/// body).
fn post_to(url: &str, path: &str, body: &Value) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-N", "-o", "-", "-w", "\n%{http_code}"])
        .args(["-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg(format!("{url}{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_string())
}

/// A request answered in full.
fn ask(url: &str, body: &Value) -> Reply {
    let (code, text) = post_to(url, endpoint(body), body);
    assert_eq!(code, 200, "{body}: {text}");
    reply_of(&text, body["stream"] == true)
}

/// A streamed request whose first event has arrived.
struct Stream {
    child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    /// What was read so far.
    text: String,
}

impl Stream {
    fn open(s: &Server, body: &Value) -> Stream {
        let mut child = Command::new("curl")
            .args(["-sS", "-N", "-H", "content-type: application/json", "-d"])
            .arg(body.to_string())
            .arg(format!("{}{}", s.url, endpoint(body)))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut st = Stream {
            child,
            out,
            text: String::new(),
        };
        st.read_events(1);
        st
    }

    /// Read until `n` more events have arrived.
    fn read_events(&mut self, n: usize) {
        let mut seen = 0;
        while seen < n {
            let mut line = String::new();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "the stream ended early: {}",
                self.text
            );
            seen += usize::from(line.starts_with("data:"));
            self.text.push_str(&line);
        }
    }

    /// Read to the end: the reply.
    fn finish(mut self) -> Reply {
        std::io::Read::read_to_string(&mut self.out, &mut self.text).unwrap();
        let _ = self.child.wait();
        reply_of(&self.text, true)
    }

    /// Go away mid-stream.
    fn drop_client(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
    }
}

/// The requests of the identity test, each with what makes it differ: greedy and seeded,
/// penalties and a bias, a stop string, chat and raw, streamed or not, different lengths.
fn requests() -> Vec<Value> {
    let lp = |mut v: Value| {
        v["logprobs"] = json!(3);
        v["return_tokens_as_token_ids"] = json!(true);
        v
    };
    vec![
        lp(json!({"prompt": "The capital of France is", "temperature": 0, "max_tokens": 40})),
        lp(
            json!({"prompt": "Once upon a time", "temperature": 0.9, "seed": 7, "top_p": 0.9,
                  "max_tokens": 60, "stream": true}),
        ),
        lp(
            json!({"prompt": "A list of fruits:", "temperature": 0.7, "seed": 11,
                  "presence_penalty": 0.6, "frequency_penalty": 0.4,
                  "logit_bias": {"100": 3.0, "7": -100}, "max_tokens": 25}),
        ),
        json!({"prompt": "Tell me about the sea", "temperature": 0, "max_tokens": 70,
               "stop": ["the"], "stream": true}),
        json!({"messages": [user("Say hello to the world.")], "temperature": 0,
               "max_tokens": 50, "logprobs": true, "top_logprobs": 2}),
        json!({"messages": [user("Count to five.")], "temperature": 0.8, "seed": 3,
               "max_tokens": 80, "stream": true}),
        json!({"prompt": "1, 2, 3,", "temperature": 0, "max_tokens": 5}),
    ]
}

/// The long greedy stream that is in flight while the others join and leave.
fn long_request() -> Value {
    json!({"prompt": "Once upon a time", "temperature": 0, "max_tokens": 400, "stream": true,
           "logprobs": 1, "return_tokens_as_token_ids": true})
}

/// The stream whose client goes away mid-way.
fn cancelled_request() -> Value {
    json!({"prompt": "It was a dark and stormy night", "temperature": 1.0, "seed": 5,
           "max_tokens": 4000, "stream": true})
}

#[test]
fn concurrent_requests_get_the_replies_they_get_alone() {
    replies_alone_and_together(&[]);
}

#[test]
fn concurrent_requests_get_the_replies_they_get_alone_with_every_weight_streamed() {
    // The budget at the floor of a plan holding 3 sequences and the kept states: every layer
    // and expert streams.
    let context = 2048;
    let out = crate::common::k3_command()
        .args(["plan", "--json", "--context", &context.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    let states = k3::serve::planned_states(3);
    let floor = plan["floor_bytes"].as_u64().unwrap()
        + (states - 1) * plan["sequence_state_bytes"].as_u64().unwrap();
    let budget = floor + 1_000;
    let mem = format!("{:.9}", budget as f64 / 1e9);
    let context = context.to_string();
    let (read, peak) = replies_alone_and_together(&["--mem", &mem, "--context", &context]);
    let model = plan["model_bytes"].as_u64().unwrap() as f64;
    assert!(
        read > 50.0 * model,
        "{read} bytes read: the weights did not stream"
    );
    // Three sequences, their kept states and the streamed weights inside the budget.
    assert!(
        peak > 0.0 && peak <= budget as f64,
        "peak RSS {peak} B above the budget {budget} B"
    );
    // More sequences than that budget holds are refused, saying what to lower.
    let out = crate::common::k3_command()
        .args(["serve", "--port", "0", "--parallel", "8", "--mem", &mem])
        .args(["--context", &context])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("lower --parallel"), "{err}");
}

/// Every request's reply from a server decoding 3 together equals its reply from a server
/// answering one at a time (both started with `args`). Returns the bytes the second read
/// from the checkpoint, and its peak resident set.
fn replies_alone_and_together(args: &[&str]) -> (f64, f64) {
    let with = |more: &[&'static str]| -> Vec<&str> {
        args.iter().copied().chain(more.iter().copied()).collect()
    };
    let alone = start(&with(&["--parallel", "1"]), &[]);
    let reqs = requests();
    let want: Vec<Reply> = reqs.iter().map(|r| ask(&alone.url, r)).collect();
    let want_long = ask(&alone.url, &long_request());
    drop(alone);
    for (r, w) in reqs.iter().zip(&want) {
        assert!(!w.0.is_empty() || !w.1.is_empty(), "{r}: an empty reply");
    }

    let s = start(&with(&["--parallel", "3", "--queue", "16"]), &[]);
    assert_eq!(metric(&s, "k3_parallel"), 3.0);
    // A long reply in flight, and one whose client goes away while the others run.
    let long = Stream::open(&s, &long_request());
    let mut gone = Stream::open(&s, &cancelled_request());
    let got: Vec<Reply> = std::thread::scope(|scope| {
        let handles: Vec<_> = reqs
            .iter()
            .map(|r| {
                let url = s.url.as_str();
                scope.spawn(move || ask(url, r))
            })
            .collect();
        // The others have joined or wait for a place; this one leaves now.
        wait_until("the batch to fill", || {
            metric(&s, "k3_sequences_in_flight") >= 3.0
        });
        gone.read_events(3);
        gone.drop_client();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((r, w), g) in reqs.iter().zip(&want).zip(&got) {
        assert_eq!(g, w, "{r}: the reply differs from the one served alone");
    }
    assert_eq!(long.finish(), want_long, "the long reply differs");
    wait_until("the cancelled request to be counted", || {
        metric(&s, "k3_requests_cancelled_total") == 1.0
    });
    // A reply is sent a moment before its request is counted.
    wait_until("every request to be counted", || {
        metric(&s, "k3_requests_total") == (reqs.len() + 2) as f64
            && metric(&s, "k3_sequences_in_flight") == 0.0
            && metric(&s, "k3_queue_depth") == 0.0
    });
    // Sequences shared passes: more tokens fed than steps, never more than 3 per step.
    let steps = metric(&s, "k3_decode_steps_total");
    let fed = metric(&s, "k3_decode_step_tokens_total");
    let per_pass = metric(&s, "k3_tokens_per_pass");
    assert!(
        steps > 0.0 && fed > steps && fed <= 3.0 * steps,
        "{fed} tokens in {steps} steps"
    );
    assert!(
        (per_pass - fed / steps).abs() < 1e-3,
        "{per_pass} != {fed} / {steps}"
    );
    assert!(per_pass > 1.0, "{per_pass}");
    (
        metric(&s, "k3_bytes_read_total"),
        metric(&s, "k3_peak_rss_bytes"),
    )
}

#[test]
fn beyond_parallel_and_queue_the_answer_is_429() {
    let s = start(&["--parallel", "2", "--queue", "1"], &[]);
    let long = |seed: u64| {
        json!({"prompt": "Once upon a time", "temperature": 1.0, "seed": seed,
               "max_tokens": 4000, "stream": true})
    };
    let a = Stream::open(&s, &long(1));
    let b = Stream::open(&s, &long(2));
    wait_until("two sequences in flight", || {
        metric(&s, "k3_sequences_in_flight") == 2.0
    });
    // The third waits for a place: its answer does not start until one is free.
    let waiting = Command::new("curl")
        .args(["-sS", "-N", "-H", "content-type: application/json", "-d"])
        .arg(long(3).to_string())
        .arg(format!("{}/v1/completions", s.url))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("three requests in the system", || {
        metric(&s, "k3_queue_depth") == 3.0
    });
    let (code, text) = curl(
        &s,
        "/v1/completions",
        Some(r#"{"prompt":"Hi","max_tokens":2}"#),
        &[],
    );
    assert_eq!(code, 429, "{text}");
    assert!(text.contains("at most 3"), "{text}");
    assert_eq!(metric(&s, "k3_requests_rejected_total"), 1.0);
    assert_eq!(metric(&s, "k3_sequences_in_flight"), 2.0);
    // One leaves: the waiting one takes its place.
    a.drop_client();
    wait_until("the waiting request to start", || {
        metric(&s, "k3_requests_cancelled_total") == 1.0
            && metric(&s, "k3_sequences_in_flight") == 2.0
    });
    b.drop_client();
    let mut waiting = waiting;
    waiting.kill().unwrap();
    let _ = waiting.wait();
    wait_until("every request to end", || {
        metric(&s, "k3_queue_depth") == 0.0 && metric(&s, "k3_sequences_in_flight") == 0.0
    });
    assert_eq!(metric(&s, "k3_requests_cancelled_total"), 3.0);
    let (code, text) = curl(
        &s,
        "/v1/completions",
        Some(r#"{"prompt":"Hi","max_tokens":2}"#),
        &[],
    );
    assert_eq!(code, 200, "{text}");
}

#[test]
fn serve_refuses_a_parallel_count_out_of_range_and_plans_a_default() {
    for bad in ["0", "65"] {
        let out = crate::common::k3_command()
            .args(["serve", "--port", "0", "--parallel", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "--parallel {bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--parallel"), "{err}");
    }
    // The demo model's states fit any budget k3 picks: the default is the cap.
    let s = start(&[], &[]);
    assert_eq!(metric(&s, "k3_parallel"), 4.0);
}

#[test]
fn each_conversation_reuses_its_own_prefix_while_others_decode() {
    let s = start(&["--parallel", "2"], &[]);
    let alone = start(&["--parallel", "1"], &[]);
    let names = ["Ada", "Grace"];
    let first = |name: &str| {
        json!({"messages": [user(&format!("My name is {name}."))], "temperature": 0,
               "max_tokens": 120})
    };
    let follow = |name: &str, r1: &Value| {
        let m1 = &r1["choices"][0]["message"];
        json!({"messages": [
            user(&format!("My name is {name}.")),
            {"role": "assistant", "content": m1["content"],
             "reasoning_content": m1["reasoning_content"]},
            user("What is my name?"),
        ], "temperature": 0, "max_tokens": 120})
    };
    let post_all = |bodies: Vec<Value>| -> Vec<Value> {
        std::thread::scope(|scope| {
            let hs: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let url = s.url.as_str();
                    scope.spawn(move || {
                        let (code, text) = post_to(url, "/v1/chat/completions", b);
                        assert_eq!(code, 200, "{text}");
                        serde_json::from_str::<Value>(&text).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let r1 = post_all(names.iter().map(|n| first(n)).collect());
    let r2 = post_all(names.iter().zip(&r1).map(|(n, r)| follow(n, r)).collect());
    for ((name, a), b) in names.iter().zip(&r1).zip(&r2) {
        let first_prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= first_prompt,
            "{name}: {cached} < {first_prompt}: {b}"
        );
        let want1 = crate::serve::post(&alone, "/v1/chat/completions", &first(name));
        assert_eq!(a["choices"][0]["message"], want1["choices"][0]["message"]);
        let want2 = crate::serve::post(&alone, "/v1/chat/completions", &follow(name, a));
        assert_eq!(b["choices"][0]["message"], want2["choices"][0]["message"]);
        assert_eq!(b["usage"]["prompt_tokens"], want2["usage"]["prompt_tokens"]);
    }
}
