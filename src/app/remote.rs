//! `k3 chat --remote URL`: a worker that answers the same [`Request`]s with the same
//! [`EngineEvent`]s as the local one, by talking to an OpenAI-compatible server (`k3 serve`,
//! vLLM, SGLang, …) over HTTP. It owns the transcript and the settings; the server owns the
//! model. Sessions are saved as transcript and settings (JSON), never engine state.
//!
//! Replies stream over SSE; `reasoning_content` deltas become the thinking channel and are
//! sent back on later turns. The events carry the channel markers a local completion has, so
//! the front ends show a remote reply exactly as a local one. Cancelling closes the stream.

use super::protocol::{EngineEvent, Request, TurnId};
use crate::session::chat::{self, Entry, Mode, Settings, Stop, TurnReport};
use crate::session::commands::{Command, ExportFormat, HELP};
use crate::stream::stats::StatsSnapshot;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

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
    /// Initial system message.
    pub system: Option<String>,
    /// Session to resume.
    pub resume: Option<String>,
    /// Name to save under.
    pub session_name: Option<String>,
    /// Directory of saved remote sessions.
    pub session_dir: PathBuf,
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
}

/// The worker thread's body.
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
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(std::time::Duration::from_secs(10)))
        .build()
        .into();
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
        cfg,
    };
    let model = match ctx.cfg.model.clone() {
        Some(m) => m,
        None => match ctx.first_model() {
            Ok(m) => m,
            Err(e) => return fail(e, 1),
        },
    };
    ctx.model = model;
    let mut extra = String::new();
    if let Some(name) = ctx.cfg.resume.clone() {
        match ctx.load(&name) {
            Ok(msg) => extra = format!("\n{msg}"),
            Err(e) => return fail(e, 2),
        }
    }
    let info = format!(
        "k3: remote {} (model {}), {}, chat mode{extra}",
        ctx.base,
        ctx.model,
        match &ctx.name {
            Some(n) => format!("session {n:?}"),
            None => "new session (named when first saved)".into(),
        }
    );
    if tx.send(EngineEvent::Ready { info }).is_err() {
        return;
    }
    while let Ok(req) = rx.recv() {
        cancel.store(false, Ordering::Relaxed);
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
        let _ = tx.send(EngineEvent::Notice {
            turn: 0,
            text: "this conversation was NOT saved (/save [NAME] before leaving keeps it)".into(),
        });
    }
    let _ = tx.send(EngineEvent::Stopped { exit_code: 0 });
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
        r.map_err(|e| format!("cannot reach {url}: {e}"))
    }

    fn first_model(&self) -> Result<String, String> {
        let resp = self.request("GET", "/models", None)?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .read_to_string()
            .map_err(|e| format!("{}/models: {e}", self.base))?;
        if status != 200 {
            return Err(http_error(status, &body));
        }
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("/models: {e}"))?;
        v["data"][0]["id"]
            .as_str()
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
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
        });
        body["thinking"] = if thinking {
            json!({"type": "enabled", "effort": s.effort})
        } else {
            json!({"type": "disabled"})
        };
        if s.top_k > 0 {
            body["top_k"] = json!(s.top_k);
        }
        if s.min_p > 0.0 {
            body["min_p"] = json!(s.min_p);
        }
        if s.repeat_penalty != 1.0 {
            body["repetition_penalty"] = json!(s.repeat_penalty);
        }
        if !self.event(EngineEvent::TurnStarted {
            turn,
            raw: false,
            thinking,
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
                self.event(EngineEvent::TurnDone {
                    turn,
                    report: Box::new(report),
                })
            }
            Err(message) => {
                // The session is kept as it was before this message.
                self.entries.pop();
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

    fn stream(&self, turn: TurnId, body: &Value, thinking: bool) -> Result<TurnReport, String> {
        let t0 = Instant::now();
        let resp = self.request("POST", "/chat/completions", Some(body))?;
        let status = resp.status().as_u16();
        if status != 200 {
            let text = resp.into_body().read_to_string().unwrap_or_default();
            return Err(http_error(status, &text));
        }
        let reader = BufReader::new(resp.into_body().into_reader());
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut in_response = !thinking;
        let mut finish: Option<String> = None;
        let mut usage = Value::Null;
        let mut first: Option<f64> = None;
        let mut pieces = 0u64;
        let mut done = false;
        let mut cancelled = false;
        for line in reader.lines() {
            if self.cancel.load(Ordering::Relaxed) {
                cancelled = true;
                break;
            }
            let line = line.map_err(|e| format!("the stream was cut in the middle: {e}"))?;
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(data)
                .map_err(|e| format!("the server sent a chunk that is not JSON: {e}"))?;
            if let Some(e) = v.get("error") {
                return Err(format!(
                    "the server failed during the reply: {}",
                    e["message"].as_str().unwrap_or("unknown error")
                ));
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
            let Some(choice) = v["choices"].get(0) else {
                continue;
            };
            let delta = &choice["delta"];
            if let Some(r) = delta["reasoning_content"]
                .as_str()
                .filter(|r| !r.is_empty())
            {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                pieces += 1;
                reasoning.push_str(r);
                if thinking && !in_response && !self.token(turn, r) {
                    return Err("the front end is gone".into());
                }
            }
            if let Some(c) = delta["content"].as_str().filter(|c| !c.is_empty()) {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                pieces += 1;
                let mut text = String::new();
                if !in_response {
                    // Close the thinking channel as a local completion does.
                    text.push_str("<|close|>think<|sep|><|open|>response<|sep|>");
                    in_response = true;
                }
                text.push_str(c);
                content.push_str(c);
                if !self.token(turn, &text) {
                    return Err("the front end is gone".into());
                }
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        if !done && !cancelled {
            return Err(format!(
                "the stream was cut in the middle ({} characters received); the session is kept",
                reasoning.len() + content.len()
            ));
        }
        let total = t0.elapsed().as_secs_f64();
        let ttft = first.unwrap_or(total);
        let stop = if cancelled {
            Stop::Cancelled
        } else if finish.as_deref() == Some("length") {
            Stop::MaxTokens
        } else {
            Stop::End(0)
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
        let n = |k: &str| usage[k].as_u64().unwrap_or(0) as usize;
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize;
        let generated = n("completion_tokens").max(pieces as usize);
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
                prefill_done: n("prompt_tokens") as u64,
                prefill_total: n("prompt_tokens") as u64,
                context_limit: self.settings.context_limit as u64,
                ..StatsSnapshot::default()
            }),
        });
        Ok(TurnReport {
            mode: Mode::Chat,
            prompt_ids: Vec::new(),
            generated_ids: Vec::new(),
            reply: content,
            reasoning: thinking.then_some(reasoning),
            reused_tokens: cached,
            prefilled_tokens: n("prompt_tokens").saturating_sub(cached),
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

    fn save(&mut self, name: Option<String>, replace: bool) -> Result<String, String> {
        let name = name.or_else(|| self.name.clone()).unwrap_or_else(|| {
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
            crate::session::naming::default_name(&first, now)
        });
        crate::session::store::validate_name(&name).map_err(|e| format!("NOT saved: {e}"))?;
        let path = self.path(&name);
        if path.exists() && !replace && self.name.as_deref() != Some(name.as_str()) {
            return Err(format!(
                "session {name:?} NOT saved: a different saved session has that name; /save! \
                 {name} replaces it"
            ));
        }
        let rec = SavedRemote {
            format: FORMAT.into(),
            url: self.base.clone(),
            model: self.model.clone(),
            system: self.system.clone(),
            entries: self.entries.clone(),
            settings: self.settings.clone(),
        };
        let text = serde_json::to_vec_pretty(&rec).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&self.cfg.session_dir)
            .map_err(|e| format!("session {name:?} NOT saved: {e}"))?;
        let tmp = self
            .cfg
            .session_dir
            .join(format!(".{name}.{EXTENSION}.tmp"));
        std::fs::write(&tmp, &text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                format!("session {name:?} NOT saved: {e}")
            })?;
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
        let text = std::fs::read(&path).map_err(|e| format!("session {name:?}: {e}"))?;
        let rec: SavedRemote = serde_json::from_slice(&text)
            .map_err(|e| format!("session {name:?} is damaged: {e}"))?;
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
        self.changed = false;
        let turns = self
            .entries
            .iter()
            .filter(|e| matches!(e, Entry::Message { role, .. } if role == "assistant"))
            .count();
        Ok(format!("loaded session {name:?}: {turns} turns (transcript; the next turn is re-read by the server)"))
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
                self.entries.clear();
                self.changed = false;
                Ok("new conversation".into())
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
            Command::Load(name) => self.load(&name),
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
        match answer {
            Ok(text) => self.event(EngineEvent::Notice { turn, text }),
            Err(message) => self.event(EngineEvent::Failed { turn, message }),
        }
    }
}
