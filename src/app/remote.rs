//! `k3 chat --remote URL`: a worker that answers the same [`Request`]s with the same
//! [`EngineEvent`]s as the local one, by talking to an OpenAI-compatible server (`k3 serve`,
//! vLLM, SGLang, …) over HTTP or HTTPS. It owns the transcript and the settings; the server
//! owns the model. Sessions are saved as transcript and settings (JSON), never engine state;
//! every change is journaled beside them until it is saved.
//!
//! Replies stream over SSE; `reasoning_content` deltas become the thinking channel and are
//! sent back on later turns. The events carry the channel markers a local completion has, so
//! the front ends show a remote reply exactly as a local one. Cancelling closes the stream.
//!
//! What the server sends is bounded (docs/remote.md): a reply stops at `max_tokens` pieces
//! whatever the server does, one SSE line is at most [`sse::MAX_LINE`] bytes, and the connect,
//! first-byte and idle timeouts end a turn with a message naming the timeout; the conversation
//! before the turn is kept (and journaled) in every case.

pub mod sse;

use super::protocol::{EngineEvent, Request, TurnId};
use crate::session::chat::{self, Entry, Mode, Settings, Stop, TurnReport};
use crate::session::commands::{Command, ExportFormat, HELP};
use crate::stream::stats::StatsSnapshot;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sse::{LineBuffer, SseError, SseEvent};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

/// Default time to establish a connection (TCP and TLS).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest silence of the server: before its answer starts (a long prompt is read
/// first, and a streamed model may take minutes) and between two reads of a reply.
pub const READ_TIMEOUT: Duration = Duration::from_secs(600);
/// Bytes of reply text allowed per token of `max_tokens` (a token's text is a few bytes; a
/// server sending more per chunk is cut off here).
const BYTES_PER_TOKEN: usize = 256;

/// What the remote worker needs.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// Base URL of the API (`http://host:port`, with or without `/v1`).
    pub url: String,
    /// Model name sent with each request (default: the first one `/v1/models` lists).
    pub model: Option<String>,
    /// API key sent as a Bearer token.
    pub api_key: Option<String>,
    /// Initial settings.
    pub settings: Settings,
    /// The values given by command-line flags: they win over a loaded session's settings.
    pub flags: crate::session::defaults::SamplingLayer,
    /// Initial system message.
    pub system: Option<String>,
    /// Session to resume.
    pub resume: Option<String>,
    /// Name to save under.
    pub session_name: Option<String>,
    /// Directory of saved remote sessions.
    pub session_dir: PathBuf,
    /// Certificates (DER) trusted besides the system's roots (`--ca-cert`).
    pub extra_roots: Vec<Vec<u8>>,
    /// Time allowed to connect.
    pub connect_timeout: Duration,
    /// Longest silence of the server before and within a reply.
    pub read_timeout: Duration,
}

/// The certificates of a PEM file (`--ca-cert`), as DER; an error names the file and what is
/// wrong with it.
pub fn read_ca_file(path: &Path) -> Result<Vec<Vec<u8>>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("--ca-cert {}: {e}", path.display()))?;
    if !meta.is_file() || meta.len() > 16 << 20 {
        return Err(format!(
            "--ca-cert {}: not a regular file of PEM certificates (at most 16 MiB)",
            path.display()
        ));
    }
    let pem = std::fs::read(path).map_err(|e| format!("--ca-cert {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => out.push(c.der().to_vec()),
            Ok(_) => {}
            Err(e) => return Err(format!("--ca-cert {}: {e}", path.display())),
        }
    }
    if out.is_empty() {
        return Err(format!(
            "--ca-cert {}: no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(out)
}

/// The roots an HTTPS connection trusts: the system's (`SSL_CERT_FILE` and `SSL_CERT_DIR`
/// when set, as OpenSSL reads them), then `extra`; Mozilla's roots when there are none.
fn tls_config(extra: &[Vec<u8>]) -> ureq::tls::TlsConfig {
    use ureq::tls::{Certificate, RootCerts, TlsConfig};
    let mut roots: Vec<Certificate<'static>> = rustls_native_certs::load_native_certs()
        .certs
        .iter()
        .map(|c| Certificate::from_der(c.as_ref()).to_owned())
        .collect();
    roots.extend(extra.iter().map(|d| Certificate::from_der(d).to_owned()));
    let root_certs = if roots.is_empty() {
        RootCerts::WebPki
    } else {
        RootCerts::Specific(std::sync::Arc::new(roots))
    };
    TlsConfig::builder().root_certs(root_certs).build()
}

/// The file of a saved remote session.
#[derive(Debug, Serialize, Deserialize)]
struct SavedRemote {
    format: String,
    url: String,
    model: String,
    system: Option<String>,
    entries: Vec<Entry>,
    settings: Settings,
}

const FORMAT: &str = "k3-remote-session/1";

/// Extension of saved remote sessions (beside the local `.k3session` files).
const EXTENSION: &str = "k3remote.json";
/// Extension of their journals.
const JOURNAL_EXTENSION: &str = "k3remote-journal";
/// Format named by a remote journal's first record.
const JOURNAL_FORMAT: &str = "k3-remote-journal/1";
/// Largest remote session file read (its transcript and settings).
const MAX_SAVED_BYTES: u64 = 256 << 20;

/// Local-only commands, answered plainly.
const LOCAL_ONLY: &str =
    "is local-only: a remote engine has no raw mode, budget or engine state here";

struct Ctx<'a> {
    cfg: RemoteConfig,
    base: String,
    model: String,
    agent: ureq::Agent,
    system: Option<String>,
    entries: Vec<Entry>,
    settings: Settings,
    name: Option<String>,
    tx: &'a Sender<EngineEvent>,
    cancel: &'a AtomicBool,
    changed: bool,
    /// The journal of the changes since the last save or load, and the name it is kept under.
    journal: Option<(String, crate::session::journal::Journal)>,
    /// A turn failed on the network or the server (exit status 1 when stdin is not a terminal).
    failed: bool,
    /// A command was refused (a `/load` of no such session): exit status 2 when stdin is not
    /// a terminal and no turn failed.
    refused: bool,
    /// Positions the conversation held after the last reply (the server's `usage`).
    positions: u64,
}

/// The worker thread's body.
/// Over 100 lines: the remote worker's start (URL, TLS, model, resume) and its request loop
/// share the connection context.
pub fn run(
    cfg: RemoteConfig,
    rx: &Receiver<Request>,
    tx: &Sender<EngineEvent>,
    cancel: &AtomicBool,
) {
    let fail = |msg: String, code: i32| {
        let _ = tx.send(EngineEvent::Failed {
            turn: 0,
            message: msg,
        });
        let _ = tx.send(EngineEvent::Stopped { exit_code: code });
    };
    let base = {
        let u = cfg.url.trim_end_matches('/');
        if u.ends_with("/v1") {
            u.to_owned()
        } else {
            format!("{u}/v1")
        }
    };
    let mut agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(cfg.connect_timeout))
        .timeout_recv_response(Some(cfg.read_timeout))
        .timeout_per_read(Some(cfg.read_timeout));
    if base.starts_with("https://") {
        agent = agent.tls_config(tls_config(&cfg.extra_roots));
    }
    let agent: ureq::Agent = agent.build().into();
    let mut ctx = Ctx {
        base,
        model: String::new(),
        agent,
        system: cfg.system.clone(),
        entries: Vec::new(),
        settings: cfg.settings.clone(),
        name: cfg.session_name.clone(),
        tx,
        cancel,
        changed: false,
        journal: None,
        failed: false,
        refused: false,
        positions: 0,
        cfg,
    };
    let model = match ctx.cfg.model.clone() {
        Some(m) => m,
        None => match ctx.first_model() {
            Ok(m) => m,
            Err(e) => return fail(e, 1),
        },
    };
    if model.is_empty() {
        return fail(
            "the server named an empty model; give --model NAME".into(),
            1,
        );
    }
    ctx.model = model;
    let mut extra = String::new();
    if let Some(name) = ctx.cfg.resume.clone() {
        match ctx.load(&name) {
            Ok(msg) => extra = format!("\n{msg}"),
            Err(e) => return fail(e, 2),
        }
    }
    let info = format!(
        "k3: remote {} (model {:?}), {}, chat mode{extra}",
        ctx.base,
        ctx.model,
        match &ctx.name {
            Some(n) => format!("session {n:?}"),
            None => "new session (named at its first turn)".into(),
        }
    );
    if tx.send(EngineEvent::Ready { info }).is_err() {
        return;
    }
    while let Ok(req) = rx.recv() {
        let alive = match req {
            Request::Shutdown => break,
            Request::Send { turn, text } => {
                ctx.entries.push(Entry::Message {
                    role: "user".into(),
                    content: text,
                    reasoning: None,
                });
                ctx.turn(turn)
            }
            Request::Command { turn, command } => ctx.command(turn, command),
            Request::History { turn } => ctx.event(EngineEvent::History {
                turn,
                history: Box::new(super::protocol::HistoryView {
                    name: ctx.name.clone(),
                    system: ctx.system.clone(),
                    mode: crate::session::chat::Mode::Chat,
                    entries: ctx.entries.clone(),
                    unsaved: ctx.changed,
                }),
            }),
            Request::ListSessions { turn } => {
                let rows = ctx
                    .session_names()
                    .into_iter()
                    .map(|name| super::protocol::SessionRow {
                        name,
                        saved_unix: 0,
                        saved: String::new(),
                        turns: 0,
                        bytes: 0,
                        problem: None,
                        unsaved: false,
                    })
                    .collect();
                ctx.event(EngineEvent::Sessions { turn, rows })
            }
            Request::RenameSession { turn, .. } | Request::DeleteSession { turn, .. } => {
                ctx.event(EngineEvent::Failed {
                    turn,
                    message: "with --remote, sessions are renamed and deleted as files in the \
                              session directory; the dialog does not do it"
                        .into(),
                })
            }
        };
        if !alive {
            break;
        }
    }
    if ctx.changed {
        let text = match &ctx.journal {
            Some((name, j)) => format!(
                "this conversation was NOT saved; its turns are kept in {} (k3 chat --remote \
                 {} --resume {name} recovers them)",
                j.path().display(),
                ctx.cfg.url
            ),
            None => "this conversation was NOT saved (/save [NAME] before leaving keeps it)".into(),
        };
        let _ = tx.send(EngineEvent::Notice { turn: 0, text });
    }
    let _ = tx.send(EngineEvent::Stopped {
        exit_code: if ctx.failed {
            1
        } else if ctx.refused {
            2
        } else {
            0
        },
    });
}

/// Why reading a reply stopped early.
enum Cut {
    /// The front end's cancel flag.
    Cancelled,
    /// The reply reached `max_tokens` pieces (or their bytes).
    MaxTokens,
}

/// What the reading thread hands over.
enum Piece {
    Bytes(Vec<u8>),
    End,
    Error(std::io::Error),
}

/// One line for an HTTP failure: the status and the server's own message.
fn http_error(status: u16, body: &str) -> String {
    let message = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(200).collect());
    match status {
        401 | 403 => format!("the server refused the API key ({status}): {message}"),
        429 => format!("the server is busy (429): {message}"),
        _ => format!("the server answered {status}: {message}"),
    }
}

impl Ctx<'_> {
    fn event(&self, e: EngineEvent) -> bool {
        self.tx.send(e).is_ok()
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<ureq::http::Response<ureq::Body>, String> {
        let url = format!("{}{path}", self.base);
        let auth = self.cfg.api_key.as_ref().map(|k| format!("Bearer {k}"));
        let r = if method == "GET" {
            let mut q = self.agent.get(&url);
            if let Some(a) = &auth {
                q = q.header("Authorization", a);
            }
            q.call()
        } else {
            let mut q = self
                .agent
                .post(&url)
                .header("Content-Type", "application/json");
            if let Some(a) = &auth {
                q = q.header("Authorization", a);
            }
            q.send(body.map(Value::to_string).unwrap_or_default())
        };
        r.map_err(|e| {
            let connect = self.cfg.connect_timeout.as_secs();
            let read = self.cfg.read_timeout.as_secs();
            match e {
                ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => {
                    format!(
                        "cannot reach {url}: no connection within {connect} s \
                         (--connect-timeout SECS waits longer)"
                    )
                }
                ureq::Error::Timeout(_) => format!(
                    "{url}: the server took the request but sent no answer within {read} s \
                     (--read-timeout SECS waits longer); the conversation before this \
                     message is kept"
                ),
                e => {
                    let text = e.to_string();
                    let hint = if url.starts_with("https://")
                        && (text.contains("certificate") || text.contains("UnknownIssuer"))
                    {
                        " (a server certified by a private CA needs --ca-cert FILE or \
                         SSL_CERT_FILE)"
                    } else {
                        ""
                    };
                    format!("cannot reach {url}: {text}{hint}")
                }
            }
        })
    }

    fn first_model(&self) -> Result<String, String> {
        let resp = self.request("GET", "/models", None)?;
        let status = resp.status().as_u16();
        let mut body = String::new();
        resp.into_body()
            .into_reader()
            .take(4 << 20)
            .read_to_string(&mut body)
            .map_err(|e| format!("{}/models: {e}", self.base))?;
        if status != 200 {
            return Err(http_error(status, &body));
        }
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("/models: {e}"))?;
        v["data"][0]["id"]
            .as_str()
            .filter(|m| !m.is_empty() && m.len() <= 256)
            .map(str::to_owned)
            .ok_or_else(|| format!("{}/models lists no model; give --model NAME", self.base))
    }

    fn messages(&self) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(s) = &self.system {
            out.push(json!({"role": "system", "content": s}));
        }
        for e in &self.entries {
            if let Entry::Message {
                role,
                content,
                reasoning,
            } = e
            {
                let mut m = json!({"role": role, "content": content});
                if let Some(r) = reasoning.as_ref().filter(|_| role == "assistant") {
                    m["reasoning_content"] = json!(r);
                }
                out.push(m);
            }
        }
        out
    }

    /// Answer the conversation as it stands (its last message is the user's).
    fn turn(&mut self, turn: TurnId) -> bool {
        let s = &self.settings;
        let thinking = s.thinking;
        let mut body = json!({
            "model": self.model,
            "messages": self.messages(),
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": s.max_tokens,
            "temperature": s.sampler.temperature,
            "top_p": s.sampler.top_p,
            "seed": s.sampler.seed,
        });
        body["thinking"] = if thinking {
            json!({"type": "enabled", "effort": s.effort})
        } else {
            json!({"type": "disabled"})
        };
        if s.sampler.top_k > 0 {
            body["top_k"] = json!(s.sampler.top_k);
        }
        if s.sampler.min_p > 0.0 {
            body["min_p"] = json!(s.sampler.min_p);
        }
        if s.sampler.repeat_penalty != 1.0 {
            body["repetition_penalty"] = json!(s.sampler.repeat_penalty);
        }
        if !self.event(EngineEvent::TurnStarted {
            turn,
            raw: false,
            thinking,
            max_tokens: s.max_tokens as u64,
        }) {
            return false;
        }
        match self.stream(turn, &body, thinking) {
            Ok(report) => {
                if report.accepted {
                    self.entries.push(Entry::Message {
                        role: "assistant".into(),
                        content: report.reply.clone(),
                        reasoning: report.reasoning.clone(),
                    });
                }
                self.changed = true;
                let alive = self.event(EngineEvent::TurnDone {
                    turn,
                    report: Box::new(report),
                });
                self.record();
                alive
            }
            Err(message) => {
                // The session is kept as it was before this message.
                self.entries.pop();
                self.failed = true;
                self.event(EngineEvent::Failed { turn, message })
            }
        }
    }

    fn token(&self, turn: TurnId, text: &str) -> bool {
        self.event(EngineEvent::Token {
            turn,
            id: 0,
            text: text.to_owned(),
            position: 0,
        })
    }

    /// A read error of the body, in words: a timeout names the option that sets it.
    fn read_error(&self, e: &std::io::Error, got: usize) -> String {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        ) || matches!(
            e.get_ref().and_then(|x| x.downcast_ref::<ureq::Error>()),
            Some(ureq::Error::Timeout(_))
        );
        if timed_out {
            format!(
                "the server sent nothing for {} s in the middle of the reply ({got} characters \
                 received; --read-timeout SECS waits longer); the conversation before this \
                 message is kept",
                self.cfg.read_timeout.as_secs()
            )
        } else {
            format!(
                "the stream was cut in the middle ({got} characters received): {e}; the \
                 conversation before this message is kept"
            )
        }
    }

    /// Over 100 lines: one SSE read loop; its state (reasoning, content, finish reason, usage,
    /// limits, cancellation) is shared by every event it handles.
    fn stream(&mut self, turn: TurnId, body: &Value, thinking: bool) -> Result<TurnReport, String> {
        let t0 = Instant::now();
        let resp = self.request("POST", "/chat/completions", Some(body))?;
        let status = resp.status().as_u16();
        if status != 200 {
            let mut text = String::new();
            let _ = resp
                .into_body()
                .into_reader()
                .take(64 << 10)
                .read_to_string(&mut text);
            return Err(http_error(status, &text));
        }
        // The body is read on a thread of its own, a bounded channel between, so that the
        // cancel flag is seen while the server is silent and at most a few reads are held.
        let mut reader = resp.into_body().into_reader();
        let (ptx, prx) = std::sync::mpsc::sync_channel::<Piece>(8);
        std::thread::Builder::new()
            .name("k3-remote-read".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let piece = match reader.read(&mut buf) {
                        Ok(0) => Piece::End,
                        Ok(n) => Piece::Bytes(buf[..n].to_vec()),
                        Err(e) => Piece::Error(e),
                    };
                    let last = !matches!(piece, Piece::Bytes(_));
                    if ptx.send(piece).is_err() || last {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot start the reading thread: {e}"))?;
        let max_pieces = self.settings.max_tokens.max(1);
        let max_bytes = max_pieces.saturating_mul(BYTES_PER_TOKEN);
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut in_response = !thinking;
        let mut finish: Option<String> = None;
        let mut usage = sse::Usage::default();
        let mut first: Option<f64> = None;
        let mut pieces = 0usize;
        let mut done = false;
        let mut cut: Option<Cut> = None;
        let mut lines = LineBuffer::new(sse::MAX_LINE);
        'read: loop {
            if self.cancel.load(Ordering::Relaxed) {
                cut = Some(Cut::Cancelled);
                break;
            }
            let bytes = match prx.recv_timeout(Duration::from_millis(50)) {
                Ok(Piece::Bytes(b)) => b,
                Ok(Piece::End) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(Piece::Error(e)) => {
                    return Err(self.read_error(&e, reasoning.len() + content.len()))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            };
            let got = lines.push(&bytes).map_err(|e| {
                format!("{e}; the reply is dropped, the conversation before it is kept")
            })?;
            for line in got {
                let event = sse::parse_line(&line).map_err(|e| match e {
                    SseError::Server(_) => e.to_string(),
                    _ => format!("{e}; the reply is dropped, the conversation before it is kept"),
                })?;
                let chunk = match event {
                    None => continue,
                    Some(SseEvent::Done) => {
                        done = true;
                        break 'read;
                    }
                    Some(SseEvent::Chunk(c)) => c,
                };
                if let Some(u) = chunk.usage {
                    usage = u;
                }
                // What the server sends is held to max_tokens pieces (and their bytes),
                // whatever it says: a piece past them ends the reply here.
                let more = chunk.reasoning.as_ref().map_or(0, String::len)
                    + chunk.content.as_ref().map_or(0, String::len);
                let pieces_in =
                    usize::from(chunk.reasoning.is_some()) + usize::from(chunk.content.is_some());
                if pieces_in > 0
                    && (pieces + pieces_in > max_pieces
                        || reasoning.len() + content.len() + more > max_bytes)
                {
                    cut = Some(Cut::MaxTokens);
                    break 'read;
                }
                if let Some(r) = chunk.reasoning {
                    first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    pieces += 1;
                    reasoning.push_str(&r);
                    if thinking && !in_response && !self.token(turn, &r) {
                        return Err("the front end is gone".into());
                    }
                }
                if let Some(c) = chunk.content {
                    first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    pieces += 1;
                    let mut text = String::new();
                    if !in_response {
                        // Close the thinking channel as a local completion does.
                        text.push_str("<|close|>think<|sep|><|open|>response<|sep|>");
                        in_response = true;
                    }
                    text.push_str(&c);
                    content.push_str(&c);
                    if !self.token(turn, &text) {
                        return Err("the front end is gone".into());
                    }
                }
                if let Some(f) = chunk.finish {
                    finish = Some(f);
                }
            }
        }
        // Dropping the receiver ends the reading thread at its next read.
        drop(prx);
        if !done && cut.is_none() {
            return Err(format!(
                "the stream was cut in the middle ({} characters received); the conversation \
                 before this message is kept",
                reasoning.len() + content.len()
            ));
        }
        let total = t0.elapsed().as_secs_f64();
        let ttft = first.unwrap_or(total);
        let stop = match cut {
            Some(Cut::Cancelled) => Stop::Cancelled,
            Some(Cut::MaxTokens) => Stop::MaxTokens,
            None if finish.as_deref() == Some("length") => Stop::MaxTokens,
            None => Stop::End(0),
        };
        let accepted = matches!(stop, Stop::End(_));
        let tail = if in_response {
            "<|close|>response<|sep|><|close|>message<|sep|>"
        } else {
            ""
        };
        if accepted && !tail.is_empty() {
            let _ = self.token(turn, tail);
        }
        // The server's counts when it sent them, else the pieces received (one per token on
        // k3 serve and vLLM).
        let generated = if usage.completion > 0 {
            usize::try_from(usage.completion).unwrap_or(usize::MAX)
        } else {
            pieces
        };
        let prompt = usize::try_from(usage.prompt).unwrap_or(usize::MAX);
        let cached = usize::try_from(usage.cached)
            .unwrap_or(usize::MAX)
            .min(prompt);
        if usage.prompt > 0 {
            self.positions = usage.prompt.saturating_add(generated as u64);
        }
        let decode = (total - ttft).max(0.0);
        let _ = self.event(EngineEvent::Stats {
            turn,
            stats: Box::new(StatsSnapshot {
                tokens_per_second: if decode > 0.0 {
                    generated as f64 / decode
                } else {
                    0.0
                },
                turn_tokens: generated as u64,
                turn_seconds: total,
                prefill_done: prompt as u64,
                prefill_total: prompt as u64,
                positions: self.positions,
                context_limit: self.settings.context_limit as u64,
                ..StatsSnapshot::default()
            }),
        });
        Ok(TurnReport {
            mode: Mode::Chat,
            prompt_ids: Vec::new(),
            generated_ids: Vec::new(),
            generated_tokens: generated,
            reply: content,
            reasoning: thinking.then_some(reasoning),
            reused_tokens: cached,
            prefilled_tokens: prompt.saturating_sub(cached),
            stop,
            accepted,
            rejected_because: (!accepted).then(|| match stop {
                Stop::Cancelled => "stopped".to_owned(),
                _ => "the reply reached max_tokens".to_owned(),
            }),
            prefill_seconds: ttft,
            decode_seconds: decode,
            context_warning: None,
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.cfg.session_dir.join(format!("{name}.{EXTENSION}"))
    }

    fn journal_path(&self, name: &str) -> PathBuf {
        self.cfg
            .session_dir
            .join(format!("{name}.{JOURNAL_EXTENSION}"))
    }

    fn state(&self) -> SavedRemote {
        SavedRemote {
            format: FORMAT.into(),
            url: self.base.clone(),
            model: self.model.clone(),
            system: self.system.clone(),
            entries: self.entries.clone(),
            settings: self.settings.clone(),
        }
    }

    /// A name no saved session or journal has: the conversation's first words and the date.
    fn fresh_name(&self) -> String {
        let first = self
            .entries
            .iter()
            .find_map(|e| match e {
                Entry::Message { role, content, .. } if role == "user" => Some(content.clone()),
                _ => None,
            })
            .unwrap_or_default();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = crate::session::naming::default_name(&first, now);
        (1..)
            .map(|k| crate::session::naming::with_suffix(&base, k))
            .find(|n| !self.path(n).exists() && !self.journal_path(n).exists())
            .unwrap_or(base)
    }

    /// Journal the conversation as it stands (the journal holds its latest state, durably);
    /// a conversation without a name gets one now. A write that fails is reported once and
    /// stops the journal; the conversation goes on.
    fn record(&mut self) {
        if self.journal.is_none() && !self.changed {
            return;
        }
        let name = match (&self.journal, &self.name) {
            (Some((n, _)), _) | (None, Some(n)) => n.clone(),
            (None, None) => {
                let n = self.fresh_name();
                self.name = Some(n.clone());
                let _ = self.event(EngineEvent::Named { name: n.clone() });
                n
            }
        };
        let path = self.journal_path(&name);
        let header = json!({"format": JOURNAL_FORMAT, "session": name}).to_string();
        let written = serde_json::to_vec(&self.state())
            .map_err(std::io::Error::other)
            .and_then(|payload| {
                std::fs::create_dir_all(&self.cfg.session_dir)?;
                let mut j = crate::session::journal::Journal::create(&path, header.as_bytes())?;
                j.append(&payload)?;
                Ok(j)
            });
        match written {
            Ok(j) => self.journal = Some((name, j)),
            Err(e) => {
                self.journal = None;
                let _ = self.event(EngineEvent::Notice {
                    turn: 0,
                    text: format!(
                        "the journal {} cannot be written ({e}); /save keeps this conversation",
                        path.display()
                    ),
                });
            }
        }
    }

    /// The conversation a journal of `name` holds, if there is one.
    fn journaled(&self, name: &str) -> Result<Option<SavedRemote>, String> {
        let path = self.journal_path(name);
        let Some(rec) = crate::session::journal::read(&path).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let Some(last) = rec.records.get(1..).and_then(<[Vec<u8>]>::last) else {
            return Ok(None);
        };
        serde_json::from_slice(last)
            .map(Some)
            .map_err(|e| format!("journal {}: {e}", path.display()))
    }

    fn save(&mut self, name: Option<String>, replace: bool) -> Result<String, String> {
        let name = name
            .or_else(|| self.name.clone())
            .unwrap_or_else(|| self.fresh_name());
        crate::session::store::validate_name(&name).map_err(|e| format!("NOT saved: {e}"))?;
        let path = self.path(&name);
        if path.exists() && !replace && self.name.as_deref() != Some(name.as_str()) {
            return Err(format!(
                "session {name:?} NOT saved: a different saved session has that name; /save! \
                 {name} replaces it"
            ));
        }
        let text = serde_json::to_vec_pretty(&self.state()).map_err(|e| e.to_string())?;
        crate::stream::atomic::write(&path, &text)
            .map_err(|e| format!("session {name:?} NOT saved: {e}"))?;
        // The journal's changes are saved now (under this name or another).
        if let Some((_, j)) = self.journal.take() {
            let _ = j.remove();
        }
        let _ = std::fs::remove_file(self.journal_path(&name));
        self.name = Some(name.clone());
        self.changed = false;
        Ok(format!(
            "saved session {name:?} (transcript and settings; the engine state stays with the \
             server)"
        ))
    }

    fn load(&mut self, name: &str) -> Result<String, String> {
        crate::session::store::validate_name(name).map_err(|e| e.to_string())?;
        let path = self.path(name);
        let saved: Option<SavedRemote> = match crate::stream::read_capped(&path, MAX_SAVED_BYTES) {
            Ok(text) => Some(
                serde_json::from_slice(&text)
                    .map_err(|e| format!("session {name:?} is damaged: {e}"))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("session {name:?}: {e}")),
        };
        let journaled = self.journaled(name)?;
        let recovered = journaled.is_some();
        let Some(rec) = journaled.or(saved) else {
            return Err(format!(
                "session {name:?}: no saved remote session or journal of that name in {}",
                self.cfg.session_dir.display()
            ));
        };
        if rec.format != FORMAT {
            return Err(format!(
                "session {name:?}: format {:?}, expected {FORMAT}",
                rec.format
            ));
        }
        let context = self.settings.context_limit;
        self.settings = Settings {
            context_limit: context,
            ..rec.settings
        };
        self.system = rec.system;
        self.entries = rec.entries;
        self.name = Some(name.to_owned());
        // The journal of the conversation left stays on disk for a later resume.
        self.journal = None;
        self.changed = recovered;
        self.positions = 0;
        let turns = self
            .entries
            .iter()
            .filter(|e| matches!(e, Entry::Message { role, .. } if role == "assistant"))
            .count();
        let from = if recovered {
            format!(
                "; recovered unsaved changes from {} (/save keeps them)",
                self.journal_path(name).display()
            )
        } else {
            String::new()
        };
        if recovered {
            self.record();
        }
        let mut sources = crate::session::defaults::Sources::default();
        let flags = match self
            .cfg
            .flags
            .over_session(&mut self.settings, &mut sources)
        {
            Some(line) => format!("\n{line}"),
            None => String::new(),
        };
        Ok(format!(
            "loaded session {name:?}: {turns} turns (transcript; the next turn is re-read by \
             the server){from}{flags}"
        ))
    }

    fn session_names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.cfg.session_dir)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.strip_suffix(&format!(".{EXTENSION}")))
                            .filter(|n| !n.starts_with('.'))
                            .map(str::to_owned)
                    })
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    fn sessions(&self) -> Result<String, String> {
        let names = self.session_names();
        if names.is_empty() {
            return Ok(format!(
                "no saved remote sessions in {}",
                self.cfg.session_dir.display()
            ));
        }
        Ok(format!(
            "{} saved remote session(s): {}",
            names.len(),
            names.join(", ")
        ))
    }

    fn export(&self, fmt: ExportFormat, path: &str) -> Result<String, String> {
        let text = match fmt {
            ExportFormat::Json => serde_json::to_string_pretty(&json!({
                "system": self.system, "mode": "chat", "entries": self.entries,
            }))
            .map_err(|e| e.to_string())?,
            // The remote transcript holds messages only (raw mode is local).
            ExportFormat::Markdown => chat::markdown(
                self.name.as_deref(),
                self.system.as_deref(),
                self.entries
                    .iter()
                    .filter(|e| matches!(e, Entry::Message { .. })),
            ),
        };
        std::fs::write(path, text).map_err(|e| format!("/export {path}: {e}"))?;
        Ok(format!("transcript written to {path}"))
    }

    fn last_user(&self) -> Option<usize> {
        self.entries
            .iter()
            .rposition(|e| matches!(e, Entry::Message { role, .. } if role == "user"))
    }

    fn command(&mut self, turn: TurnId, command: Command) -> bool {
        let changes = matches!(
            command,
            Command::Undo | Command::System(_) | Command::Think(_) | Command::Set(..)
        );
        let answer: Result<String, String> = match command {
            Command::Regen => match self.last_user() {
                Some(u) => {
                    self.entries.truncate(u + 1);
                    return self.turn(turn);
                }
                None => Err("/regen: there is no message to answer yet".into()),
            },
            Command::Edit(text) => match self.last_user() {
                Some(u) => {
                    self.entries.truncate(u);
                    self.entries.push(Entry::Message {
                        role: "user".into(),
                        content: text,
                        reasoning: None,
                    });
                    return self.turn(turn);
                }
                None => Err("/edit: there is no message to edit yet".into()),
            },
            Command::Undo => match self.last_user() {
                Some(u) => {
                    self.entries.truncate(u);
                    self.changed = true;
                    Ok("last exchange removed".into())
                }
                None => Err("/undo: nothing to undo".into()),
            },
            Command::New => {
                let kept = self
                    .journal
                    .take()
                    .filter(|_| self.changed)
                    .map(|(_, j)| {
                        format!(
                            " (the last one's unsaved turns are kept in {})",
                            j.path().display()
                        )
                    })
                    .unwrap_or_default();
                self.entries.clear();
                self.name = None;
                self.positions = 0;
                self.changed = false;
                Ok(format!("new conversation{kept}"))
            }
            Command::System(text) => {
                let cleared = text.is_empty();
                self.system = (!cleared).then_some(text);
                self.changed = true;
                Ok(if cleared {
                    "system message cleared"
                } else {
                    "system message set"
                }
                .into())
            }
            Command::Think(t) => Ok(t.apply(&mut self.settings)),
            Command::Set(setting, v) => Ok(setting.apply(v, &mut self.settings)),
            Command::Save(name) => self.save(name, false),
            Command::SaveOver(name) => self.save(name, true),
            Command::Load(name) => {
                let r = self.load(&name);
                self.refused |= r.is_err();
                r
            }
            Command::Sessions => self.sessions(),
            Command::Export(fmt, path) => self.export(fmt, &path),
            Command::Stats => Ok(format!(
                "remote engine {} (model {}); {} messages; thinking {} ({}). Memory, disk, \
                 expert residency and /budget are local-only.",
                self.base,
                self.model,
                self.entries.len(),
                if self.settings.thinking { "on" } else { "off" },
                self.settings.effort
            )),
            Command::Raw => Err(format!("/raw {LOCAL_ONLY}")),
            Command::Budget(_) => Err(format!("/budget {LOCAL_ONLY}")),
            Command::Chat => Ok("chat mode".into()),
            Command::Help => Ok(HELP.to_string()),
            Command::Quit => Ok("bye".into()),
        };
        if changes && answer.is_ok() {
            self.changed = true;
            self.record();
        }
        match answer {
            Ok(text) => self.event(EngineEvent::Notice { turn, text }),
            Err(message) => self.event(EngineEvent::Failed { turn, message }),
        }
    }
}
