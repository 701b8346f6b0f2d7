//! The engine thread of `k3 serve`: loads the model, owns one session, and answers jobs in
//! arrival order, one at a time or up to `--parallel` decoded together (docs/serve.md). Never
//! blocks on the HTTP side: events go out over unbounded tokio channels, and a job whose
//! receiver is gone is cancelled at the next token.

use super::stop::StopMatcher;
use super::ServeConfig;
use crate::engine::logit_adjust::{LogitAdjust, TokenLogprob};
use crate::engine::Model;
use crate::engine::RunState;
use crate::session::chat::{Completion, Generation, Served, Session, Settings, Stop, TurnError};
use crate::session::template::tools::{self, ApiMessage, ApiOptions, ToolCall};
use crate::session::template::{self, Phase, TolerantParser};
use crate::session::tokenizer::Tokenizer;
use std::cell::RefCell;
use std::collections::VecDeque;
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
    /// Sequences decoded together at most (`--parallel`).
    pub parallel: usize,
    /// Sequences decoding now.
    pub in_flight: usize,
    /// Decoding steps: each feeds one token of every sequence in flight in one pass over the
    /// weights (or hands out a row of a verified speculative pass).
    pub decode_steps: u64,
    /// Tokens those steps fed (their sum of sequences).
    pub decode_step_tokens: u64,
}

/// Handle on the engine thread.
pub struct Engine {
    tx: Mutex<Sender<Job>>,
    /// Jobs accepted and not finished (those being served included).
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
        // Every sequence in flight and the states kept for prefix reuse.
        states: super::planned_states(cfg.parallel),
        trunk: cfg.trunk.clone(),
        ..Default::default()
    };
    let (model, info) = match Model::open_with(&cfg.model_dir, &opts) {
        Ok(m) => m,
        Err(crate::engine::weights::LoadError::Budget(m)) if cfg.parallel > 1 => {
            let _ = ready.send(Err(crate::Error::Usage(format!(
                "{m} (the plan holds state for {} sequences decoded together and the states \
                 kept for prefix reuse, of {} positions each; lower --parallel or --context)",
                cfg.parallel, cfg.context
            ))));
            return;
        }
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
        m.parallel = cfg.parallel;
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
    let mut figures = Figures {
        shared,
        model: &model,
        load_bytes: info.bytes_read,
    };
    let mut replies = Replies::default();
    if cfg.parallel > 1 {
        session.set_max_snapshots(super::kept_states(cfg.parallel));
        serve_batched(cfg.parallel, rx, &mut session, &mut replies, &mut figures);
        return;
    }
    while let Ok(job) = rx.recv() {
        let t0 = Instant::now();
        if shared.draining.load(Ordering::Relaxed) {
            let _ = job.out.send(Out::Error {
                status: 503,
                message: "the server is shutting down".into(),
            });
        } else if !job.cancel.load(Ordering::Relaxed) {
            lock(&shared.metrics).in_flight = 1;
            let r = serve_job(&mut session, job, t0, &mut replies);
            figures.record(r.as_ref(), t0);
        }
        shared.in_system.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where the engine records what each request did.
struct Figures<'s, 'm> {
    shared: &'s Shared,
    model: &'m Model,
    load_bytes: u64,
}

impl Figures<'_, '_> {
    /// One request answered (completed, failed or cancelled), started at `t0`; `in_flight`
    /// is how many sequences still decode.
    fn record(&mut self, r: Option<&Finished>, t0: Instant) {
        let mut m = lock(&self.shared.metrics);
        m.requests += 1;
        if let Some(f) = r {
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
            if m.parallel <= 1 {
                // The lone loop feeds every generated id but the last.
                let fed = f.generated.len().saturating_sub(1) as u64;
                m.decode_steps += fed;
                m.decode_step_tokens += fed;
            }
        }
        if m.parallel <= 1 {
            m.in_flight = 0;
        }
        let s = self.model.stats();
        m.bytes_read = s.disk_bytes_read.max(self.load_bytes);
        m.expert_hit_rate = s.expert_hit_rate();
        let dt = t0.elapsed().as_secs_f64();
        let n = m.requests as f64;
        m.mean_request_seconds += (dt - m.mean_request_seconds) / n;
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

/// A job rendered and checked, with the state of its reply as it is sent.
struct Request {
    job: Job,
    prompt: Vec<u32>,
    history_end: Option<usize>,
    /// Ids that end the reply.
    stops: Vec<u32>,
    /// Chat: whether the reply starts in the thinking channel; raw: None.
    thinking: Option<bool>,
    /// The job's settings, the reply bounded by the context.
    settings: Settings,
    t0: Instant,
    reply: RefCell<Reply>,
}

/// What has been sent of a reply.
struct Reply {
    first_token: Option<f64>,
    /// Log-probabilities: every token's (the final end id dropped), and those not sent yet.
    all_lp: Vec<Logprob>,
    pending_lp: Vec<Logprob>,
    /// Stop strings apply to the answer (the whole text of a raw completion), not to the
    /// reasoning.
    stopper: StopMatcher,
    channel: Option<TolerantParser>,
    /// Every piece of text sent.
    sent: String,
}

/// Render and check a job and tell its handler it starts; None when it was answered already
/// (an error) or its client is gone.
fn prepare(session: &Session<'_>, job: Job, t0: Instant, replies: &Replies) -> Option<Request> {
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
    let reply = Reply {
        first_token: None,
        all_lp: Vec::new(),
        pending_lp: Vec::new(),
        stopper: StopMatcher::new(job.stop.clone()),
        channel: thinking.map(TolerantParser::new),
        sent: String::new(),
    };
    Some(Request {
        job,
        prompt,
        history_end,
        stops,
        thinking,
        settings,
        t0,
        reply: RefCell::new(reply),
    })
}

impl Request {
    /// A sampled token's log-probabilities (before its text is emitted).
    fn observe(&self, tok: &Tokenizer, t: &TokenLogprob) {
        let lp = shown_logprob(tok, t, self.job.token_ids);
        let mut r = self.reply.borrow_mut();
        r.all_lp.push(lp.clone());
        r.pending_lp.push(lp);
    }

    /// A generated id and its text: sent unless a stop string holds it back; a stop string
    /// found, or a client gone, ends the generation at the next token (the reply is answered
    /// in [`answer`]).
    fn emit(&self, id: u32, text: &str) {
        let mut r = self.reply.borrow_mut();
        let r = &mut *r;
        let cancel = &self.job.cancel;
        r.first_token
            .get_or_insert_with(|| self.t0.elapsed().as_secs_f64());
        if self.stops.contains(&id) && self.job.logprobs.is_some() {
            // The end of the reply is not part of it.
            r.pending_lp.pop();
            r.all_lp.pop();
        }
        let in_answer = match &mut r.channel {
            None => true,
            Some(p) => {
                p.push(text);
                p.phase() == Phase::Response
            }
        };
        let text = if in_answer {
            r.stopper.push(text)
        } else if r.stopper.hit() {
            String::new()
        } else {
            let mut held = r.stopper.finish();
            held.push_str(text);
            held
        };
        if r.stopper.hit() {
            cancel.store(true, Ordering::Relaxed);
        }
        r.sent.push_str(&text);
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut r.pending_lp);
            if self.job.out.send(Out::Token { text, logprobs }).is_err() {
                cancel.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Run `f` with this request's callbacks: where generated text goes ([`Request::emit`]),
    /// and the hooks of the sampler (the logit adjustment, the log-probabilities asked for
    /// and where they go, [`Request::observe`]).
    fn hooked<R>(
        &self,
        tok: &Tokenizer,
        f: impl FnOnce(&mut dyn FnMut(u32, &str), &mut Served<'_>) -> R,
    ) -> R {
        let mut observe = |t: TokenLogprob| self.observe(tok, &t);
        let mut served = Served {
            adjust: &self.job.adjust,
            logprobs: self.job.logprobs,
            observe: &mut observe,
        };
        f(&mut |id, text| self.emit(id, text), &mut served)
    }

    /// Answer a failed generation.
    fn fail(&self, e: &TurnError) {
        let status = match e {
            TurnError::Refused(_) | TurnError::ContextFull { .. } | TurnError::Template(_) => 400,
            _ => 500,
        };
        let _ = self.job.out.send(Out::Error {
            status,
            message: e.to_string(),
        });
    }
}

/// Serve one job alone; the figures of a completed reply.
fn serve_job(
    session: &mut Session<'_>,
    job: Job,
    t0: Instant,
    replies: &mut Replies,
) -> Option<Finished> {
    let req = prepare(session, job, t0, replies)?;
    let tok = session.tokenizer();
    let done = req.hooked(tok, |emit, served| {
        session.complete_prompt(
            &req.prompt,
            req.history_end,
            &req.stops,
            &req.settings,
            &req.job.cancel,
            emit,
            Some(served),
        )
    });
    match done {
        Ok(d) => Some(answer(session, &req, d, replies)),
        Err(e) => {
            req.fail(&e);
            None
        }
    }
}

/// Answer a finished generation: the rest of its text, then the reply (its parts parsed);
/// a cancelled one is counted, not answered.
fn answer(
    session: &Session<'_>,
    req: &Request,
    done: Completion,
    replies: &mut Replies,
) -> Finished {
    let job = &req.job;
    let mut r = req.reply.borrow_mut();
    let r = &mut *r;
    let stopped_by_string = r.stopper.hit();
    let mut rest = String::new();
    if !stopped_by_string && done.stop != Stop::Cancelled {
        rest = r.stopper.finish();
        r.sent.push_str(&rest);
    }
    let logprobs = std::mem::take(&mut r.pending_lp);
    if !rest.is_empty() || !logprobs.is_empty() {
        let _ = job.out.send(Out::Token {
            text: rest,
            logprobs,
        });
    }
    let tok = session.tokenizer();
    let markers = session.markers();
    let mut fin = Finished {
        prompt_tokens: req.prompt.len(),
        cached_tokens: done.reused,
        first_token_seconds: r
            .first_token
            .unwrap_or_else(|| req.t0.elapsed().as_secs_f64()),
        prefill_seconds: done.prefill_seconds,
        decode_seconds: done.decode_seconds,
        logprobs: job.logprobs.map(|_| std::mem::take(&mut r.all_lp)),
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
        match req.thinking {
            Some(thinking) => {
                let mut p = TolerantParser::new(thinking);
                p.push(&r.sent);
                p.finish();
                fin.content = p.content().to_owned();
                fin.reasoning = thinking.then(|| p.reasoning().to_owned());
            }
            None => fin.content = std::mem::take(&mut r.sent),
        }
        fin.generated = done.generated;
        let _ = job.out.send(Out::Done(Box::new(fin.clone())));
        return fin;
    }
    if done.stop == Stop::Cancelled {
        // Nobody is listening: counted, not answered.
        fin.generated = done.generated;
        return fin;
    }
    match req.thinking {
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
    fin
}

/// A request decoding beside others.
struct Active<'a> {
    req: Request,
    gen: Generation<'a>,
}

impl Active<'_> {
    /// Sample its next id from `logits`; whether it has ended. A failure is answered here.
    fn sample(&mut self, tok: &Tokenizer, logits: &[f32]) -> Result<bool, TurnError> {
        let Active { req, gen } = self;
        req.hooked(tok, |emit, served| {
            gen.sample(logits, &req.job.cancel, emit, Some(served))
        })
        .inspect_err(|e| req.fail(e))
    }
}

/// Serve up to `parallel` requests at once (docs/serve.md#several-requests-at-once): a job
/// is prefilled alone when a place is free and joins the others at the next step; each step
/// feeds every sequence in flight its last sampled id in one pass over the weights
/// ([`Session::step`]); a sequence leaves when it ends or its client goes away, its state
/// kept for prefix reuse.
fn serve_batched<'a>(
    parallel: usize,
    rx: &Receiver<Job>,
    session: &mut Session<'a>,
    replies: &mut Replies,
    figures: &mut Figures<'_, '_>,
) {
    let shared = figures.shared;
    let tok = session.tokenizer();
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Active<'a>> = Vec::with_capacity(parallel);
    let mut run = RunState::new();
    let mut logits = Vec::new();
    let set_in_flight = |n: usize| lock(&shared.metrics).in_flight = n;
    loop {
        if active.is_empty() && waiting.is_empty() {
            match rx.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        while let Ok(job) = rx.try_recv() {
            waiting.push_back(job);
        }
        if shared.draining.load(Ordering::Relaxed) {
            // Stopping: those in flight finish, those waiting are refused now.
            for job in waiting.drain(..) {
                let _ = job.out.send(Out::Error {
                    status: 503,
                    message: "the server is shutting down".into(),
                });
                shared.in_system.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // One waiting job (prefilled alone) takes a free place, so the others wait one
        // prefill at most between steps.
        while active.len() < parallel {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            let t0 = Instant::now();
            if job.cancel.load(Ordering::Relaxed) {
                shared.in_system.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            let Some(req) = prepare(session, job, t0, replies) else {
                figures.record(None, t0);
                shared.in_system.fetch_sub(1, Ordering::Relaxed);
                continue;
            };
            let begun = session.begin(&req.prompt, req.history_end, &req.stops, &req.settings);
            let (gen, first) = match begun {
                Ok(b) => b,
                Err(e) => {
                    req.fail(&e);
                    figures.record(None, t0);
                    shared.in_system.fetch_sub(1, Ordering::Relaxed);
                    continue;
                }
            };
            let mut a = Active { req, gen };
            match a.sample(tok, &first) {
                Ok(false) => active.push(a),
                Ok(true) => {
                    let done = session.end(a.gen);
                    let fin = answer(session, &a.req, done, replies);
                    figures.record(Some(&fin), a.req.t0);
                    shared.in_system.fetch_sub(1, Ordering::Relaxed);
                }
                Err(_) => {
                    session.fail(a.gen);
                    figures.record(None, a.req.t0);
                    shared.in_system.fetch_sub(1, Ordering::Relaxed);
                }
            }
            set_in_flight(active.len());
            if !active.is_empty() {
                break;
            }
        }
        // A client gone (or a stop string found) leaves before the step.
        let mut k = 0;
        while k < active.len() {
            if active[k].req.job.cancel.load(Ordering::Relaxed) {
                let mut a = active.remove(k);
                let req = &a.req;
                a.gen.cancel(&mut |id, text| req.emit(id, text));
                let done = session.end(a.gen);
                let fin = answer(session, &a.req, done, replies);
                figures.record(Some(&fin), a.req.t0);
                shared.in_system.fetch_sub(1, Ordering::Relaxed);
            } else {
                k += 1;
            }
        }
        set_in_flight(active.len());
        if active.is_empty() {
            continue;
        }
        let mut gens: Vec<&mut Generation<'a>> = active.iter_mut().map(|a| &mut a.gen).collect();
        let stepped = session.step(&mut gens, &mut run, &mut logits);
        drop(gens);
        if let Err(e) = stepped {
            // Every state in the step may be partly advanced: each request fails.
            for a in active.drain(..) {
                a.req.fail(&e);
                session.fail(a.gen);
                figures.record(None, a.req.t0);
                shared.in_system.fetch_sub(1, Ordering::Relaxed);
            }
            set_in_flight(0);
            continue;
        }
        {
            let mut m = lock(&shared.metrics);
            m.decode_steps += 1;
            m.decode_step_tokens += active.len() as u64;
        }
        let vocab = logits.len() / active.len();
        let mut k = 0;
        for row in logits.chunks(vocab.max(1)) {
            let ended = active[k].sample(tok, row);
            if matches!(ended, Ok(false)) {
                k += 1;
                continue;
            }
            let a = active.remove(k);
            match ended {
                Ok(_) => {
                    let done = session.end(a.gen);
                    let fin = answer(session, &a.req, done, replies);
                    figures.record(Some(&fin), a.req.t0);
                }
                Err(_) => {
                    session.fail(a.gen);
                    figures.record(None, a.req.t0);
                }
            }
            shared.in_system.fetch_sub(1, Ordering::Relaxed);
        }
        set_in_flight(active.len());
    }
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
