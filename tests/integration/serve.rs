//! `k3 serve` on the embedded demo model, driven over loopback by `curl` and by the official
//! `openai` Python package: chat (plain and streamed), raw completions against `k3 run`,
//! thinking off and effort, prefix reuse against a fresh server, bad requests, the API key,
//! the queue, a client that goes away, and the SIGTERM drain.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A running `k3 serve`, killed when dropped.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) url: String,
    _tmp: tempfile::TempDir,
    pub(crate) stderr: std::sync::mpsc::Receiver<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The demo model, written once for every server of this binary.
fn demo() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let scratch = crate::common::process_scratch("serve-demo");
        k3::app::demo::materialise_in(&scratch).unwrap()
    })
    .clone()
}

pub(crate) fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = crate::common::k3_command();
    cmd.arg("serve")
        .arg(demo())
        .args(["--port", "0"])
        .args(args)
        .env("XDG_CONFIG_HOME", tmp.path().join("no-config"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = String::new();
    let url = loop {
        let line = rx
            .recv()
            .unwrap_or_else(|_| panic!("k3 serve ended before listening:\n{seen}"));
        seen.push_str(&line);
        seen.push('\n');
        if let Some(at) = line.find("listening on ") {
            break line[at + "listening on ".len()..].trim().to_string();
        }
    };
    Server {
        child,
        url,
        _tmp: tmp,
        stderr: rx,
    }
}

/// `curl` a path; (status, body).
pub(crate) fn curl(s: &Server, path: &str, body: Option<&str>, extra: &[&str]) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-o", "-", "-w", "\n%{http_code}"])
        .args(extra);
    if let Some(b) = body {
        cmd.args([
            "-H",
            "content-type: application/json",
            "--data-binary",
            "@-",
        ]);
        cmd.stdin(Stdio::piped());
        let _ = b;
    }
    cmd.arg(format!("{}{path}", s.url));
    cmd.stdout(Stdio::piped());
    let mut child = cmd.spawn().expect("curl runs");
    if let Some(b) = body {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_string())
}

pub(crate) fn post(s: &Server, path: &str, body: &Value) -> Value {
    let (code, text) = curl(s, path, Some(&body.to_string()), &[]);
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// The `data:` payloads of an SSE body.
pub(crate) fn sse(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|d| d.trim().to_string())
        .collect()
}

/// Concatenated reasoning and content deltas, the finish reason, and the usage chunk.
pub(crate) fn assemble(events: &[String]) -> (String, String, String, Option<Value>) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let (mut reasoning, mut content, mut finish, mut usage) =
        (String::new(), String::new(), String::new(), None);
    for (i, e) in events[..events.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
            continue;
        }
        let delta = &v["choices"][0]["delta"];
        if i == 0 {
            assert_eq!(delta["role"], "assistant", "the role comes first");
        }
        if let Some(r) = delta["reasoning_content"].as_str() {
            reasoning.push_str(r);
        }
        if let Some(c) = delta["content"].as_str() {
            content.push_str(c);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (reasoning, content, finish, usage)
}

pub(crate) fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

#[test]
fn chat_streaming_thinking_and_raw_completions_over_curl() {
    let s = start(&[], &[]);
    let (code, health) = curl(&s, "/health", None, &[]);
    assert_eq!((code, health.contains("ok")), (200, true), "{health}");
    let models: Value = serde_json::from_str(&curl(&s, "/v1/models", None, &[]).1).unwrap();
    assert_eq!(models["data"][0]["id"], "kimi-k3-local");

    let req = json!({"messages": [user("What is the capital of France?")],
                     "temperature": 0, "max_tokens": 200});
    let full = post(&s, "/v1/chat/completions", &req);
    let msg = &full["choices"][0]["message"];
    let content = msg["content"].as_str().unwrap();
    let reasoning = msg["reasoning_content"].as_str().unwrap();
    assert!(content.contains("Paris"), "{full}");
    assert!(!reasoning.is_empty(), "thinking is on by default: {full}");
    assert_eq!(full["choices"][0]["finish_reason"], "stop");

    // Streamed: the same reply, delta by delta.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let (code, body) = curl(&s, "/v1/chat/completions", Some(&sreq.to_string()), &["-N"]);
    assert_eq!(code, 200);
    let events = sse(&body);
    let (r, c, finish, usage) = assemble(&events);
    assert_eq!((r.as_str(), c.as_str()), (reasoning, content));
    assert_eq!(finish, "stop");
    let usage = usage.expect("a usage chunk");
    assert_eq!(
        usage["completion_tokens"],
        full["usage"]["completion_tokens"]
    );
    // The same prompt again: all of it but nothing more is reused.
    assert_eq!(usage["prompt_tokens"], full["usage"]["prompt_tokens"]);

    // Thinking off: no reasoning, a shorter prompt; effort low: another preamble.
    let mut off = req.clone();
    off["thinking"] = json!({"type": "disabled"});
    let off = post(&s, "/v1/chat/completions", &off);
    assert!(
        off["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{off}"
    );
    assert!(off["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("Paris"));
    let (p_max, p_off) = (
        full["usage"]["prompt_tokens"].as_u64().unwrap(),
        off["usage"]["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(p_off < p_max, "{p_off} vs {p_max}");
    let mut low = req.clone();
    low["reasoning_effort"] = json!("low");
    let low = post(&s, "/v1/chat/completions", &low);
    let p_low = low["usage"]["prompt_tokens"].as_u64().unwrap();
    let low_cached = low["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The effort message is there, and it differs from max's before the conversation starts.
    assert!(p_low > p_off, "{p_low} vs {p_off}");
    assert!(low_cached < p_low - 10, "{low}");

    // Raw completion: the same tokens as `k3 run`.
    let prompt = "The capital of Peru is Lima. The capital of Kenya is";
    let raw = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    let run = crate::common::run_ok(crate::common::k3_command().arg("run").arg(demo()).args([
        "--prompt",
        prompt,
        "--gen",
        "8",
        "--temperature",
        "0",
        "--json",
    ]));
    let run: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(raw["choices"][0]["text"], run["text"], "{raw}");
    assert_eq!(raw["choices"][0]["finish_reason"], "length");
    let (code, body) = curl(
        &s,
        "/v1/completions",
        Some(
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": true})
                .to_string(),
        ),
        &["-N"],
    );
    assert_eq!(code, 200);
    let text: String = sse(&body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(text, run["text"].as_str().unwrap());

    let (code, metrics) = curl(&s, "/metrics", None, &[]);
    assert_eq!(code, 200);
    for name in [
        "k3_decode_tokens_per_second",
        "k3_prefill_tokens_per_second",
        "k3_rss_bytes",
        "k3_bytes_read_total",
        "k3_expert_cache_hit_rate",
        "k3_queue_depth",
        "k3_reused_prompt_tokens_total",
    ] {
        assert!(
            metrics.contains(&format!("\n{name} ")),
            "{name} missing:\n{metrics}"
        );
    }
}

#[test]
fn a_follow_up_reuses_the_prefix_and_answers_as_a_fresh_server() {
    let a = start(&[], &[]);
    let b = start(&[], &[]);
    let first = json!({"messages": [user("My name is Ada.")], "temperature": 0, "max_tokens": 200});
    let r1 = post(&a, "/v1/chat/completions", &first);
    let m1 = &r1["choices"][0]["message"];
    let follow = json!({"messages": [
        user("My name is Ada."),
        {"role": "assistant", "content": m1["content"], "reasoning_content": m1["reasoning_content"]},
        user("What is my name?"),
    ], "temperature": 0, "max_tokens": 200});
    let warm = post(&a, "/v1/chat/completions", &follow);
    let cold = post(&b, "/v1/chat/completions", &follow);
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let first_prompt = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached >= first_prompt, "{cached} < {first_prompt}: {warm}");
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(warm["choices"][0]["message"], cold["choices"][0]["message"]);
    assert_eq!(
        warm["usage"]["prompt_tokens"],
        cold["usage"]["prompt_tokens"]
    );
}

#[test]
fn bad_requests_get_openai_errors_and_the_key_is_checked() {
    let s = start(&["--max-tokens", "64"], &[]);
    let cases: &[(&str, u16, &str)] = &[
        ("{not json", 400, "not a valid request"),
        (
            r#"{"messages":[{"role":"user","content":null}]}"#,
            400,
            "a user message needs content",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"description":"d"}}]}"#,
            400,
            "a tool needs a name",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"n":3}"#,
            400,
            "n = 1",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":65}"#,
            400,
            "limit of 64",
        ),
        (r#"{"messages":[]}"#, 400, "empty"),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"thinking":{"type":"enabled","effort":"medium"}}"#,
            400,
            "medium",
        ),
    ];
    for (body, status, needle) in cases {
        let (code, text) = curl(&s, "/v1/chat/completions", Some(body), &[]);
        assert_eq!(code, *status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{text}"
        );
    }
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(9 << 20));
    let (code, text) = curl(&s, "/v1/completions", Some(&big), &[]);
    assert_eq!(code, 413, "{text}");
    let (code, _) = curl(&s, "/v1/nothing", None, &[]);
    assert_eq!(code, 404);
    // The server still answers.
    let ok = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 2}),
    );
    assert_eq!(ok["usage"]["completion_tokens"], 2);

    let k = start(
        &["--api-key-env", "K3_TEST_KEY"],
        &[("K3_TEST_KEY", "sesame")],
    );
    let body = r#"{"prompt":"Once","max_tokens":2}"#;
    let (code, text) = curl(&k, "/v1/completions", Some(body), &[]);
    assert_eq!(code, 401, "{text}");
    let (code, _) = curl(
        &k,
        "/v1/completions",
        Some(body),
        &["-H", "authorization: Bearer nope"],
    );
    assert_eq!(code, 401);
    let (code, _) = curl(
        &k,
        "/v1/completions",
        Some(body),
        &["-H", "authorization: Bearer sesame"],
    );
    assert_eq!(code, 200);

    // Beyond loopback without a key: refused at start.
    let out = crate::common::k3_command()
        .arg("serve")
        .arg(demo())
        .args(["--host", "0.0.0.0", "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-key-env"));
}

/// Start a long streamed raw completion; the child curl and a reader of its first line.
pub(crate) fn long_stream(
    s: &Server,
    max_tokens: usize,
) -> (Child, BufReader<std::process::ChildStdout>) {
    let body = json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": true});
    let mut child = Command::new("curl")
        .args(["-sS", "-N", "-H", "content-type: application/json", "-d"])
        .arg(body.to_string())
        .arg(format!("{}/v1/completions", s.url))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the stream ended at once"
        );
    }
    (child, out)
}

/// The value of the metric `name` in the server's `/metrics`.
pub(crate) fn metric(s: &Server, name: &str) -> f64 {
    let (_, m) = curl(s, "/metrics", None, &[]);
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing:\n{m}"))
        .parse()
        .unwrap()
}

/// Poll `f` until it holds; panic naming `what` after a minute.
pub(crate) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    panic!("{what} did not happen");
}

#[test]
fn a_gone_client_stops_its_generation_and_a_full_queue_gets_429() {
    let s = start(&["--queue", "0", "--parallel", "1"], &[]);
    let max = 4000;
    let (mut client, _out) = long_stream(&s, max);
    let (code, text) = curl(
        &s,
        "/v1/completions",
        Some(r#"{"prompt":"Hi","max_tokens":2}"#),
        &[],
    );
    assert_eq!(code, 429, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    let (_, headers) = curl(
        &s,
        "/v1/completions",
        Some(r#"{"prompt":"Hi","max_tokens":2}"#),
        &["-o", "/dev/null", "-D", "-"],
    );
    assert!(
        headers.to_ascii_lowercase().contains("retry-after:"),
        "{headers}"
    );
    client.kill().unwrap();
    let _ = client.wait();
    wait_until("the cancelled request to end", || {
        metric(&s, "k3_requests_cancelled_total") == 1.0
    });
    let generated = metric(&s, "k3_generated_tokens_total");
    assert!(
        generated < max as f64,
        "{generated} tokens: generation did not stop"
    );
    assert_eq!(metric(&s, "k3_queue_depth"), 0.0);
    let ok = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(ok["usage"]["completion_tokens"], 2);
}

#[test]
fn sigterm_finishes_the_request_in_progress_and_exits_0() {
    let mut s = start(&[], &[]);
    let n = 300;
    let (mut client, mut out) = long_stream(&s, n);
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let _ = client.wait();
    let events = sse(&rest);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{rest}");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{rest}");
    let status = s.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    // Every line the server wrote: the reader thread forwards them until the pipe's end, which
    // can come a moment after the exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut said = Vec::new();
    while let Ok(line) = s
        .stderr
        .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        said.push(line);
    }
    assert!(said.iter().any(|l| l.contains("stopped")), "{said:?}");
}

fn python_with_openai() -> Option<String> {
    let python = std::env::var("K3_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(python)
}

#[test]
fn the_openai_python_client_talks_to_k3_serve() {
    let Some(python) = python_with_openai() else {
        panic!(
            "the openai Python package is needed (python3 -m pip install --user openai; \
             .ci/run installs it; K3_TEST_PYTHON names another interpreter)"
        );
    };
    let s = start(&[], &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/serve_openai.py");
    let out = Command::new(python)
        .arg(script)
        .arg(format!("{}/v1", s.url))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

// ---- k3 chat --remote against a real k3 serve ----

/// `k3 chat --plain --jsonl --greedy --no-think` with `args`, on `input`.
fn chat_jsonl(args: &[String], input: &str) -> Vec<Value> {
    let tmp = tempfile::tempdir().unwrap();
    crate::common::jsonl_with_input(
        crate::common::k3_command()
            .args(["chat", "--plain", "--jsonl", "--greedy", "--no-think"])
            .arg("--session-dir")
            .arg(tmp.path().join("sessions"))
            .args(args)
            .env("XDG_CONFIG_HOME", tmp.path().join("no-config")),
        input,
    )
}

#[test]
fn a_remote_conversation_equals_the_local_one() {
    let s = start(&[], &[]);
    let input = "My name is Ada.\nWhat is my name?\nWhat is the capital of France?\n";
    let remote = chat_jsonl(&["--remote".into(), s.url.clone()], input);
    let local = chat_jsonl(&[demo().display().to_string()], input);
    assert_eq!(remote.len(), 3);
    assert_eq!(local.len(), 3);
    for (r, l) in remote.iter().zip(&local) {
        assert_eq!(r["reply"], l["reply"], "{r}\n{l}");
        // The server reused what the local session reused.
        assert_eq!(r["reused_tokens"], l["reused_tokens"]);
        assert_eq!(r["prefilled_tokens"], l["prefilled_tokens"]);
    }
    assert!(remote[2]["reply"].as_str().unwrap().contains("Paris"));
}

fn remote_worker(
    url: &str,
    model: Option<&str>,
    key: Option<&str>,
    dir: &Path,
) -> k3::app::worker::Worker {
    let settings = k3::session::chat::Settings {
        sampler: k3::engine::sampling::SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        ..k3::session::chat::Settings::default()
    };
    k3::app::worker::Worker::spawn_remote(k3::app::remote::RemoteConfig {
        url: url.to_string(),
        model: model.map(str::to_string),
        api_key: key.map(str::to_string),
        settings,
        flags: Default::default(),
        system: None,
        resume: None,
        session_name: None,
        session_dir: dir.to_path_buf(),
        extra_roots: Vec::new(),
        connect_timeout: k3::app::remote::CONNECT_TIMEOUT,
        read_timeout: k3::app::remote::READ_TIMEOUT,
    })
}

use k3::app::protocol::{EngineEvent, Request};

/// Events of `turn` up to its end (TurnDone or Failed).
fn until_done(w: &k3::app::worker::Worker, turn: u64, mut on_token: impl FnMut()) -> EngineEvent {
    loop {
        match w.recv().expect("the worker is alive") {
            EngineEvent::Token { turn: t, .. } if t == turn => on_token(),
            e @ (EngineEvent::TurnDone { .. } | EngineEvent::Failed { .. }) => return e,
            _ => {}
        }
    }
}

fn ready(w: &k3::app::worker::Worker) -> Result<String, String> {
    loop {
        match w.recv().expect("an event") {
            EngineEvent::Ready { info } => return Ok(info),
            EngineEvent::Failed { message, .. } => return Err(message),
            _ => {}
        }
    }
}

fn send(w: &k3::app::worker::Worker, turn: u64, text: &str) {
    assert!(w.send(Request::Send {
        turn,
        text: text.into()
    }));
}

#[test]
fn remote_stop_a_cut_stream_a_gone_server_and_a_wrong_key() {
    let tmp = tempfile::tempdir().unwrap();
    let s = start(&[], &[]);
    let w = remote_worker(&s.url, None, None, tmp.path());
    assert!(ready(&w).unwrap().contains("kimi-k3-local"));
    // Stop at the first token: the turn ends as stopped and the next one is answered.
    send(&w, 1, "What is the capital of France?");
    let flag = w.cancel_flag();
    match until_done(&w, 1, || {
        flag.store(true, std::sync::atomic::Ordering::Relaxed)
    }) {
        EngineEvent::TurnDone { report, .. } => {
            assert_eq!(report.stop, k3::session::chat::Stop::Cancelled);
            assert!(!report.accepted);
        }
        other => panic!("{other:?}"),
    }
    send(&w, 2, "What is the capital of France?");
    match until_done(&w, 2, || {}) {
        EngineEvent::TurnDone { report, .. } => {
            assert!(
                report.accepted && report.reply.contains("Paris"),
                "{report:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    // The server goes away: one clear line, the session is kept.
    drop(s);
    send(&w, 3, "Hello");
    match until_done(&w, 3, || {}) {
        EngineEvent::Failed { message, .. } => {
            assert!(message.contains("cannot reach"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(w.send(Request::Command {
        turn: 4,
        command: k3::session::commands::Command::Save(Some("kept".into())),
    }));
    match w.recv().unwrap() {
        EngineEvent::Notice { text, .. } => assert!(text.contains("saved session"), "{text}"),
        other => panic!("{other:?}"),
    }
    let saved: Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("kept.k3remote.json")).unwrap())
            .unwrap();
    let entries = saved["entries"].as_array().unwrap();
    // The stopped turn's question, then the answered exchange; the failed one is not there.
    assert_eq!(entries.len(), 3, "{saved}");
    assert_eq!(entries[2]["role"], "assistant");
    w.shutdown();

    // A stream cut in the middle, from a server that closes the connection after two chunks.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        use std::io::Write;
        if let Ok((mut c, _)) = listener.accept() {
            let mut buf = [0u8; 65536];
            let _ = std::io::Read::read(&mut c, &mut buf);
            let chunk = |d: &str| {
                format!(
                    "data: {}\n\n",
                    json!({"choices": [{"index": 0, "delta": {"content": d}, "finish_reason": null}]})
                )
            };
            let body = format!("{}{}", chunk("Hel"), chunk("lo"));
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
                body.len() + 100
            );
        }
    });
    let w = remote_worker(&format!("http://{addr}"), Some("m"), None, tmp.path());
    ready(&w).unwrap();
    send(&w, 1, "Hi");
    match until_done(&w, 1, || {}) {
        EngineEvent::Failed { message, .. } => {
            assert!(message.contains("cut in the middle"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    w.shutdown();

    // A wrong key: refused at start (the model list), or at the first turn.
    let k = start(
        &["--api-key-env", "K3_TEST_KEY"],
        &[("K3_TEST_KEY", "sesame")],
    );
    let w = remote_worker(&k.url, None, Some("wrong"), tmp.path());
    let e = ready(&w).unwrap_err();
    assert!(e.contains("refused the API key (401)"), "{e}");
    let w = remote_worker(&k.url, Some("kimi-k3-local"), Some("wrong"), tmp.path());
    ready(&w).unwrap();
    send(&w, 1, "Hi");
    match until_done(&w, 1, || {}) {
        EngineEvent::Failed { message, .. } => assert!(message.contains("401"), "{message}"),
        other => panic!("{other:?}"),
    }
    w.shutdown();
    let w = remote_worker(&k.url, None, Some("sesame"), tmp.path());
    ready(&w).unwrap();
    w.shutdown();
}
