//! The engine thread of `k3 serve`: loads the model, owns one session, and answers jobs one at
//! a time in arrival order. Never blocks on the HTTP side: events go out over unbounded tokio
//! channels, and a job whose receiver is gone is cancelled at the next token.

use super::stop::StopMatcher;
use super::ServeConfig;
use crate::engine::logit_adjust::{LogitAdjust, TokenLogprob};
use crate::engine::Model;
use crate::session::chat::{Served, Session, Settings, Stop};
use crate::session::template::tools::{self, ApiMessage, ApiOptions, ToolCall};
use crate::session::template::{self, Phase, TolerantParser};
use crate::session::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// The finish reason of a request whose client went away (never sent).
const CANCELLED: &str = "cancelled";

/// What a job asks for.
#[derive(Clone, Debug)]
pub enum Task {
    /// A chat completion: messages rendered with the template.
    Chat {
        /// The conversation.
        messages: Vec<ApiMessage>,
        /// Tools, choice, format, thinking.
        options: ApiOptions,
    },
    /// A raw continuation of text (specials recognized, no template).
    Raw {
        /// The text.
        prompt: String,
    },
}

/// One request for the engine.
pub struct Job {
    /// What to do.
    pub task: Task,
    /// Sampling and length for this request.
    pub settings: Settings,
    /// Stop strings: the reply ends before the first one (never sent).
    pub stop: Vec<String>,
    /// Penalties and biases of this request.
    pub adjust: LogitAdjust,
    /// Report log-probabilities, with this many of the most likely tokens.
    pub logprobs: Option<usize>,
    /// Name tokens in log-probabilities as `token_id:ID` instead of their text.
    pub token_ids: bool,
    /// Set when the client is gone.
    pub cancel: Arc<AtomicBool>,
    /// Where the events go.
    pub out: UnboundedSender<Out>,
}

/// One generated token's log-probabilities as the API shows them.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprob {
    /// The token: its text (invalid UTF-8 replaced), or `token_id:ID`.
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens (token, bytes, log-probability), most likely first.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// A finished reply.
#[derive(Clone, Debug, Default)]
pub struct Finished {
    /// Generated ids.
    pub generated: Vec<u32>,
    /// Log-probabilities of the generated tokens (the final end id left out), when asked.
    pub logprobs: Option<Vec<Logprob>>,
    /// The answer (chat) or the continuation (raw).
    pub content: String,
    /// Reasoning (chat with thinking).
    pub reasoning: Option<String>,
    /// Tool calls parsed from the reply.
    pub tool_calls: Vec<ToolCall>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, the ones whose state was reused.
    pub cached_tokens: usize,
    /// Seconds from the start of the job to its first token.
    pub first_token_seconds: f64,
    /// Prefill and decode time.
    pub prefill_seconds: f64,
    /// Decode time.
    pub decode_seconds: f64,
}

/// Engine → handler.
#[derive(Clone, Debug)]
pub enum Out {
    /// The prompt is rendered and fits; generation starts.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
    },
    /// The text of one or more generated tokens (complete UTF-8 characters only; empty when
    /// it only carries log-probabilities held back until now).
    Token {
        /// The text.
        text: String,
        /// Log-probabilities of the tokens generated since the last event (when asked).
        logprobs: Vec<Logprob>,
    },
    /// The reply is complete.
    Done(Box<Finished>),
    /// The request failed.
    Error {
        /// HTTP status (400 for the request's fault, 500 for the engine's, 503 draining).
        status: u16,
        /// What went wrong.
        message: String,
    },
}

/// Figures for `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Requests answered (completed or failed).
    pub requests: u64,
    /// Requests refused with 429.
    pub rejected: u64,
    /// Requests stopped because their client went away.
    pub cancelled: u64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens whose state was reused.
    pub reused_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Seconds spent prefilling and decoding.
    pub prefill_seconds: f64,
    /// Decode seconds.
    pub decode_seconds: f64,
    /// Prefill tokens/s of the last request.
    pub last_prefill_tps: f64,
    /// Decode tokens/s of the last request.
    pub last_decode_tps: f64,
    /// Bytes read from the checkpoint (load included).
    pub bytes_read: u64,
    /// Routed-expert cache hit rate (1 when resident).
    pub expert_hit_rate: f64,
    /// Mean seconds per request, for `Retry-After`.
    pub mean_request_seconds: f64,
}

/// Handle on the engine thread.
pub struct Engine {
    tx: Mutex<Sender<Job>>,
    /// Jobs accepted and not finished (the one served included).
    pub in_system: Arc<AtomicUsize>,
    /// Set on SIGTERM: jobs not started yet are refused with 503.
    pub draining: Arc<AtomicBool>,
    /// Shared figures.
    pub metrics: Arc<Mutex<Metrics>>,
    /// One line about the model.
    pub info: String,
    /// The model's vocabulary size (token ids a request may name are below it).
    pub vocab: usize,
}

impl Engine {
    /// Start the thread and wait until the model is loaded (its error, if it fails).
    pub fn start(cfg: &ServeConfig) -> crate::Result<Engine> {
        let (tx, rx) = channel::<Job>();
        let (ready_tx, ready_rx) = channel::<Result<(String, usize), crate::Error>>();
        let in_system = Arc::new(AtomicUsize::new(0));
        let draining = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(Mutex::new(Metrics {
            expert_hit_rate: 1.0,
            ..Metrics::default()
        }));
        let ctx = Shared {
            in_system: Arc::clone(&in_system),
            draining: Arc::clone(&draining),
            metrics: Arc::clone(&metrics),
        };
        let cfg = cfg.clone();
        std::thread::Builder::new()
            .name("k3-engine".into())
            .spawn(move || run(&cfg, &rx, &ready_tx, &ctx))
            .map_err(|e| crate::Error::Usage(format!("cannot start the engine thread: {e}")))?;
        let (info, vocab) = ready_rx
            .recv()
            .map_err(|_| crate::Error::Usage("the engine thread ended while loading".into()))??;
        Ok(Engine {
            tx: Mutex::new(tx),
            in_system,
            draining,
            metrics,
            info,
            vocab,
        })
    }

    /// Queue a job; false when the engine is gone.
    pub fn submit(&self, job: Job) -> bool {
        let tx = self
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tx.send(job).is_ok()
    }
}

struct Shared {
    in_system: Arc<AtomicUsize>,
    draining: Arc<AtomicBool>,
    metrics: Arc<Mutex<Metrics>>,
}

fn run(
    cfg: &ServeConfig,
    rx: &Receiver<Job>,
    ready: &Sender<Result<(String, usize), crate::Error>>,
    shared: &Shared,
) {
    let opts = crate::engine::weights::OpenOptions {
        budget: cfg.budget,
        context: cfg.context as u64,
        // The live state and the snapshots the session keeps for prefix reuse.
        states: 1 + crate::session::chat::SNAPSHOTS as u64,
        trunk: cfg.trunk.clone(),
        ..Default::default()
    };
    let (model, info) = match Model::open_with(&cfg.model_dir, &opts) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let vocab = u32::try_from(model.cfg.vocab_size).unwrap_or(u32::MAX);
    let tok = match Tokenizer::load_expecting(&cfg.model_dir, vocab) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let settings = Settings {
        context_limit: cfg.context,
        ..Settings::default()
    };
    let mut session = match Session::new(&model, &tok, settings) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(crate::Error::Usage(e.to_string())));
            return;
        }
    };
    {
        let mut m = lock(&shared.metrics);
        m.bytes_read = info.bytes_read;
    }
    let line = format!(
        "{} ({} layers, vocabulary {})",
        crate::stream::shown(&cfg.model_dir),
        model.cfg.num_hidden_layers,
        model.cfg.vocab_size
    );
    if ready.send(Ok((line, model.cfg.vocab_size))).is_err() {
        return;
    }
    let load_bytes = info.bytes_read;
    let mut replies = Replies::default();
    while let Ok(job) = rx.recv() {
        let t0 = Instant::now();
        if shared.draining.load(Ordering::Relaxed) {
            let _ = job.out.send(Out::Error {
                status: 503,
                message: "the server is shutting down".into(),
            });
        } else if !job.cancel.load(Ordering::Relaxed) {
            let r = serve_job(&mut session, &job, t0, &mut replies);
            let mut m = lock(&shared.metrics);
            m.requests += 1;
            if let Some(f) = &r {
                m.cancelled += u64::from(f.finish_reason == CANCELLED);
                m.prompt_tokens += f.prompt_tokens as u64;
                m.reused_tokens += f.cached_tokens as u64;
                m.generated_tokens += f.generated.len() as u64;
                m.prefill_seconds += f.prefill_seconds;
                m.decode_seconds += f.decode_seconds;
                let pre = (f.prompt_tokens - f.cached_tokens) as f64;
                m.last_prefill_tps = if f.prefill_seconds > 0.0 {
                    pre / f.prefill_seconds
                } else {
                    0.0
                };
                m.last_decode_tps = if f.decode_seconds > 0.0 {
                    f.generated.len() as f64 / f.decode_seconds
                } else {
                    0.0
                };
            }
            let s = model.stats();
            m.bytes_read = s.disk_bytes_read.max(load_bytes);
            m.expert_hit_rate = s.expert_hit_rate();
            let dt = t0.elapsed().as_secs_f64();
            let n = m.requests as f64;
            m.mean_request_seconds += (dt - m.mean_request_seconds) / n;
        }
        shared.in_system.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Replies this server generated lately, and the reasoning each was generated with.
///
/// Clients such as `llm`, aichat and the `openai` package send a reply back without its
/// `reasoning_content`; K3 continues from the reasoning it wrote, so a later request's
/// assistant message that equals one of these replies (content and tool calls) gets its
/// reasoning back: the render is the one the model continues from, and the prefix cache holds
/// past that reply.
#[derive(Debug, Default)]
pub struct Replies {
    recent: std::collections::VecDeque<(String, String)>,
}

/// Replies remembered.
const REPLIES_KEPT: usize = 256;

impl Replies {
    fn key(content: &str, calls: &[ToolCall]) -> String {
        let mut k = content.to_owned();
        for c in calls {
            k.push('\u{0}');
            k.push_str(&c.name);
            k.push('\u{0}');
            k.push_str(&c.arguments);
        }
        k
    }

    /// Remember a reply and its reasoning.
    pub fn remember(&mut self, content: &str, calls: &[ToolCall], reasoning: &str) {
        let key = Self::key(content, calls);
        self.recent.retain(|(k, _)| *k != key);
        if self.recent.len() == REPLIES_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((key, reasoning.to_owned()));
    }

    /// Give each assistant message without reasoning the reasoning of the reply it equals.
    pub fn restore(&self, messages: &mut [ApiMessage]) -> usize {
        let mut n = 0;
        for m in messages
            .iter_mut()
            .filter(|m| m.role == tools::ApiRole::Assistant && m.reasoning.is_none())
        {
            let key = Self::key(&m.content, &m.tool_calls);
            if let Some((_, r)) = self.recent.iter().rev().find(|(k, _)| *k == key) {
                m.reasoning = Some(r.clone());
                n += 1;
            }
        }
        n
    }
}

/// Serve one job; the figures of a completed reply.
/// Over 100 lines: render, check, generate and answer one job; the emit callback shares the
/// stop matcher, the thinking parser and the stream's state.
fn serve_job(
    session: &mut Session<'_>,
    job: &Job,
    t0: Instant,
    replies: &mut Replies,
) -> Option<Finished> {
    let fail = |status: u16, message: String| {
        let _ = job.out.send(Out::Error { status, message });
        None
    };
    let tok = session.tokenizer();
    let markers = session.markers();
    let (prompt, history_end, stops, thinking) = match &job.task {
        Task::Chat { messages, options } => {
            let mut messages = messages.clone();
            replies.restore(&mut messages);
            let render = |gen: bool| {
                tools::render_api_segments(&messages, options, gen)
                    .and_then(|s| template::encode_segments(tok, &markers, &s))
            };
            let (prompt, history) = match (render(true), render(false)) {
                (Ok(p), Ok(h)) => (p, h.len()),
                (Err(e), _) | (_, Err(e)) => return fail(400, e.to_string()),
            };
            let mut stops = markers.stop_ids().to_vec();
            stops.extend(job.settings.stop_ids.iter().copied());
            (prompt, Some(history), stops, Some(options.render.thinking))
        }
        Task::Raw { prompt } => {
            let ids = template::render_raw(tok, prompt);
            if ids.is_empty() {
                return fail(400, "the prompt is empty".into());
            }
            (ids, None, job.settings.stop_ids.clone(), None)
        }
    };
    let limit = job.settings.context_limit;
    if prompt.len() + 1 > limit {
        return fail(
            400,
            format!(
                "the prompt is {} token{}; with one generated token it does not fit the \
                 context of {limit} positions",
                prompt.len(),
                if prompt.len() == 1 { "" } else { "s" }
            ),
        );
    }
    let mut settings = job.settings.clone();
    // A reply never runs past the context.
    settings.max_tokens = settings.max_tokens.min(limit - prompt.len()).max(1);
    if job
        .out
        .send(Out::Started {
            prompt_tokens: prompt.len(),
        })
        .is_err()
    {
        return None;
    }
    let mut first_token: Option<f64> = None;
    let cancel = &job.cancel;
    // Log-probabilities: every token's (the final end id dropped), and those not sent yet.
    let all_lp = std::cell::RefCell::new(Vec::<Logprob>::new());
    let pending_lp = std::cell::RefCell::new(Vec::<Logprob>::new());
    let mut observe = |t: TokenLogprob| {
        let lp = shown_logprob(tok, &t, job.token_ids);
        all_lp.borrow_mut().push(lp.clone());
        pending_lp.borrow_mut().push(lp);
    };
    let mut served = Served {
        adjust: &job.adjust,
        logprobs: job.logprobs,
        observe: &mut observe,
    };
    // Stop strings apply to the answer (the whole text of a raw completion), not to the
    // reasoning; `sent` is every piece of text sent.
    let mut stopper = StopMatcher::new(job.stop.clone());
    let mut channel = thinking.map(TolerantParser::new);
    let mut sent = String::new();
    let mut emit = |id: u32, text: &str| {
        first_token.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        if stops.contains(&id) && job.logprobs.is_some() {
            // The end of the reply is not part of it.
            pending_lp.borrow_mut().pop();
            all_lp.borrow_mut().pop();
        }
        let in_answer = match &mut channel {
            None => true,
            Some(p) => {
                p.push(text);
                p.phase() == Phase::Response
            }
        };
        let text = if in_answer {
            stopper.push(text)
        } else if stopper.hit() {
            String::new()
        } else {
            let mut held = stopper.finish();
            held.push_str(text);
            held
        };
        if stopper.hit() {
            // Ends the generation at the next token; the reply is answered (see below).
            cancel.store(true, Ordering::Relaxed);
        }
        sent.push_str(&text);
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut *pending_lp.borrow_mut());
            if job.out.send(Out::Token { text, logprobs }).is_err() {
                cancel.store(true, Ordering::Relaxed);
            }
        }
    };
    let done = match session.complete_prompt(
        &prompt,
        history_end,
        &stops,
        &settings,
        cancel,
        &mut emit,
        Some(&mut served),
    ) {
        Ok(d) => d,
        Err(e) => {
            let status = match e {
                crate::session::chat::TurnError::Refused(_)
                | crate::session::chat::TurnError::ContextFull { .. }
                | crate::session::chat::TurnError::Template(_) => 400,
                _ => 500,
            };
            return fail(status, e.to_string());
        }
    };
    let stopped_by_string = stopper.hit();
    let mut rest = String::new();
    if !stopped_by_string && done.stop != Stop::Cancelled {
        rest = stopper.finish();
        sent.push_str(&rest);
    }
    let logprobs = pending_lp.take();
    if !rest.is_empty() || !logprobs.is_empty() {
        let _ = job.out.send(Out::Token {
            text: rest,
            logprobs,
        });
    }
    let tok = session.tokenizer();
    let mut fin = Finished {
        prompt_tokens: prompt.len(),
        cached_tokens: done.reused,
        first_token_seconds: first_token.unwrap_or_else(|| t0.elapsed().as_secs_f64()),
        prefill_seconds: done.prefill_seconds,
        decode_seconds: done.decode_seconds,
        logprobs: job.logprobs.map(|_| all_lp.take()),
        finish_reason: match done.stop {
            _ if stopped_by_string => "stop",
            Stop::End(_) => "stop",
            Stop::Cancelled => CANCELLED,
            _ => "length",
        },
        ..Finished::default()
    };
    if stopped_by_string {
        // The reply as it was sent: up to the stop string.
        match thinking {
            Some(thinking) => {
                let mut p = TolerantParser::new(thinking);
                p.push(&sent);
                p.finish();
                fin.content = p.content().to_owned();
                fin.reasoning = thinking.then(|| p.reasoning().to_owned());
            }
            None => fin.content = sent,
        }
        fin.generated = done.generated;
        let _ = job.out.send(Out::Done(Box::new(fin.clone())));
        return Some(fin);
    }
    if done.stop == Stop::Cancelled {
        // Nobody is listening: counted, not answered.
        fin.generated = done.generated;
        return Some(fin);
    }
    match thinking {
        Some(thinking) => {
            match tools::parse_api_completion(tok, &markers, &done.generated, thinking) {
                Ok(t) => {
                    fin.content = t.turn.content;
                    fin.reasoning = t.turn.reasoning;
                    if let Some(r) = fin.reasoning.as_deref().filter(|r| !r.is_empty()) {
                        replies.remember(&fin.content, &t.tool_calls, r);
                    }
                    if !t.tool_calls.is_empty() {
                        fin.finish_reason = "tool_calls";
                    }
                    fin.tool_calls = t.tool_calls;
                }
                Err(_) => {
                    // Not a well-formed turn (cut off, or malformed): what a display shows.
                    let mut p = TolerantParser::new(thinking);
                    p.push(&tok.decode_lossy(&done.generated).unwrap_or_default());
                    p.finish();
                    fin.content = p.content().to_owned();
                    fin.reasoning = thinking.then(|| p.reasoning().to_owned());
                }
            }
        }
        None => fin.content = tok.decode_lossy(&done.generated).unwrap_or_default(),
    }
    fin.generated = done.generated;
    let _ = job.out.send(Out::Done(Box::new(fin.clone())));
    Some(fin)
}

/// A token's log-probabilities with the tokens named as the API shows them.
fn shown_logprob(tok: &Tokenizer, t: &TokenLogprob, token_ids: bool) -> Logprob {
    let named = |id: u32| {
        let bytes = tok.decode_bytes(&[id]).unwrap_or_default();
        let token = if token_ids {
            format!("token_id:{id}")
        } else {
            String::from_utf8_lossy(&bytes).into_owned()
        };
        (token, bytes)
    };
    let (token, bytes) = named(t.id);
    Logprob {
        token,
        bytes,
        logprob: t.logprob,
        top: t
            .top
            .iter()
            .map(|&(id, lp)| {
                let (token, bytes) = named(id);
                (token, bytes, lp)
            })
            .collect(),
    }
}
