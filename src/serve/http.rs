//! The HTTP side of `k3 serve` (axum on tokio): routes, the API key, admission to the bounded
//! queue, SSE streaming, `/metrics`, and the SIGTERM drain.

use super::engine::{Engine, Finished, Job, Logprob, Out};
use super::wire::{self, ApiError, Limits, Parsed};
use super::{ServeConfig, MAX_BODY_BYTES};
use crate::session::template::TolerantParser;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

struct AppState {
    engine: Engine,
    cfg: ServeConfig,
    started: u64,
    counter: AtomicU64,
}

type Shared = Arc<AppState>;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Serve until SIGTERM or SIGINT, then let the requests being served finish (requests still
/// queued are answered 503) and return 0. The drain is bounded: after `drain_timeout` the
/// connections still open are closed; a second signal returns at once with 128 + its number.
///
/// Every connection is bounded too: its request headers, its body and its idle time between
/// requests each get `client_timeout`, and past `max_connections` open ones a new connection
/// is answered 503 and closed.
pub async fn serve(cfg: ServeConfig, engine: Engine) -> crate::Result<i32> {
    let addr = (cfg.host, cfg.port);
    let info = engine.info.clone();
    let (client_timeout, drain_timeout, max_connections) =
        (cfg.client_timeout, cfg.drain_timeout, cfg.max_connections);
    let state = Arc::new(AppState {
        engine,
        cfg,
        started: unix_now(),
        counter: AtomicU64::new(0),
    });
    let app = Router::new()
        .route("/health", get(health))
        .route("/healthz", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .with_state(Arc::clone(&state));
    // Installed before listening, so that a signal from the moment the address is printed is
    // seen (and the default action, which would end the process mid-reply, is replaced).
    let mut signals = Signals::new()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::Error::Usage(format!("cannot listen on {}:{}: {e}", addr.0, addr.1)))?;
    let local = listener
        .local_addr()
        .map_err(|e| crate::Error::Usage(format!("listening socket: {e}")))?;
    eprintln!("k3 serve: {info}");
    eprintln!("k3 serve: listening on http://{local}");
    let mut http = hyper::server::conn::http1::Builder::new();
    // The header timer runs from the moment the connection waits for a request head: it bounds
    // both a slow head and an idle kept-alive connection.
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(client_timeout)
        .keep_alive(true);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(AtomicUsize::new(0));
    let first = loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors or a connection reset before it was taken: wait a
                        // moment rather than spin, and keep serving those already open.
                        eprintln!("k3 serve: accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(slot) = ConnectionSlot::take(&open, max_connections) else {
                    refuse_connection(&stream, max_connections);
                    continue;
                };
                let conn = http.serve_connection(
                    hyper_util::rt::TokioIo::new(stream),
                    hyper_util::service::TowerToHyperService::new(app.clone()),
                );
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _slot = slot;
                    let _ = conn.await;
                });
            }
            sig = signals.next() => break sig,
        }
    };
    drop(listener);
    state.engine.draining.store(true, Ordering::Relaxed);
    eprintln!(
        "k3 serve: {first}: stopping: finishing the requests in progress (at most {} s; a second \
         signal stops at once)",
        drain_timeout.as_secs()
    );
    tokio::select! {
        drained = tokio::time::timeout(drain_timeout, graceful.shutdown()) => {
            if drained.is_err() {
                eprintln!(
                    "k3 serve: {} connections still open after {} s: closing them",
                    open.load(Ordering::Relaxed),
                    drain_timeout.as_secs()
                );
            }
        }
        second = signals.next() => {
            eprintln!("k3 serve: {second} again: stopped at once");
            return Ok(second.exit_code());
        }
    }
    eprintln!("k3 serve: stopped");
    Ok(0)
}

/// One open connection counted against `--max-connections`; released when dropped.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<ConnectionSlot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| ConnectionSlot(Arc::clone(open)))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answer a connection past the cap with 503 and close it. The answer is written without
/// waiting (it fits a fresh socket's buffer); a client that is not reading loses nothing else.
fn refuse_connection(stream: &tokio::net::TcpStream, max: usize) {
    let body = ApiError {
        status: 503,
        message: format!("the server has {max} connections open (at most {max}); retry later"),
        param: None,
    }
    .body()
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(answer.as_bytes());
}

/// The signals that stop the server.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

/// Which signal arrived.
#[derive(Clone, Copy)]
enum Stop {
    Term,
    Int,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stop::Term => "SIGTERM",
            Stop::Int => "SIGINT",
        })
    }
}

impl Stop {
    /// The shell's status for a process ended by this signal.
    fn exit_code(self) -> i32 {
        128 + match self {
            Stop::Term => libc::SIGTERM,
            Stop::Int => libc::SIGINT,
        }
    }
}

impl Signals {
    fn new() -> crate::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        let listen = |kind: SignalKind| {
            signal(kind).map_err(|e| {
                crate::Error::Usage(format!("cannot listen for SIGTERM and SIGINT: {e}"))
            })
        };
        Ok(Signals {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
        })
    }

    /// The next signal (both streams stay registered, so a second one is never missed).
    async fn next(&mut self) -> Stop {
        tokio::select! {
            _ = self.term.recv() => Stop::Term,
            _ = self.int.recv() => Stop::Int,
        }
    }
}

fn error_response(e: &ApiError, retry_after: Option<u64>) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, Json(e.body())).into_response();
    if let Some(s) = retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    if e.status == 401 {
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
}

/// The key check: `Authorization: Bearer KEY` when the server has a key.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.cfg.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Compare every byte, whatever the first difference.
    let same = given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(ApiError {
            status: 401,
            message: if given.is_empty() {
                "this server needs an API key: send Authorization: Bearer KEY".into()
            } else {
                "the API key is not valid for this server".into()
            },
            param: None,
        })
    }
}

async fn not_found() -> Response {
    error_response(
        &ApiError {
            status: 404,
            message: "no such endpoint: the API serves /v1/models, /v1/chat/completions, \
                      /v1/completions, /health and /metrics"
                .into(),
            param: None,
        },
        None,
    )
}

async fn health(State(s): State<Shared>) -> Response {
    let depth = s.engine.in_system.load(Ordering::Relaxed);
    Json(json!({"status": "ok", "queue_depth": depth})).into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error_response(&e, None);
    }
    Json(json!({"object": "list", "data": [{
        "id": s.cfg.model_name, "object": "model", "created": s.started, "owned_by": "k3",
        "max_model_len": s.cfg.context,
    }]}))
    .into_response()
}

async fn metrics(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error_response(&e, None);
    }
    let m = s
        .engine
        .metrics
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let (rss, peak) = crate::stream::stats::rss_bytes();
    let depth = s.engine.in_system.load(Ordering::Relaxed);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    metric(
        "k3_requests_total",
        "counter",
        "Requests answered.",
        m.requests.to_string(),
    );
    metric(
        "k3_requests_rejected_total",
        "counter",
        "Requests refused with 429.",
        m.rejected.to_string(),
    );
    metric(
        "k3_requests_cancelled_total",
        "counter",
        "Requests stopped because the client went away.",
        m.cancelled.to_string(),
    );
    metric(
        "k3_prompt_tokens_total",
        "counter",
        "Prompt tokens of all requests.",
        m.prompt_tokens.to_string(),
    );
    metric(
        "k3_reused_prompt_tokens_total",
        "counter",
        "Prompt tokens whose state was reused.",
        m.reused_tokens.to_string(),
    );
    metric(
        "k3_generated_tokens_total",
        "counter",
        "Tokens generated.",
        m.generated_tokens.to_string(),
    );
    metric(
        "k3_decode_tokens_per_second",
        "gauge",
        "Decode tokens per second of the last request.",
        format!("{:.3}", m.last_decode_tps),
    );
    metric(
        "k3_prefill_tokens_per_second",
        "gauge",
        "Prefill tokens per second of the last request.",
        format!("{:.3}", m.last_prefill_tps),
    );
    metric(
        "k3_rss_bytes",
        "gauge",
        "Resident set size.",
        rss.to_string(),
    );
    metric(
        "k3_peak_rss_bytes",
        "gauge",
        "Peak resident set size.",
        peak.to_string(),
    );
    metric(
        "k3_bytes_read_total",
        "counter",
        "Bytes read from the checkpoint.",
        m.bytes_read.to_string(),
    );
    metric(
        "k3_expert_cache_hit_rate",
        "gauge",
        "Routed-expert cache hit rate.",
        format!("{:.4}", m.expert_hit_rate),
    );
    metric(
        "k3_parallel",
        "gauge",
        "Requests decoded together at most (--parallel).",
        m.parallel.to_string(),
    );
    metric(
        "k3_sequences_in_flight",
        "gauge",
        "Requests decoding now.",
        m.in_flight.to_string(),
    );
    metric(
        "k3_decode_steps_total",
        "counter",
        "Decoding steps, each one token of every request in flight in one pass.",
        m.decode_steps.to_string(),
    );
    metric(
        "k3_decode_step_tokens_total",
        "counter",
        "Tokens fed by those steps.",
        m.decode_step_tokens.to_string(),
    );
    metric(
        "k3_tokens_per_pass",
        "gauge",
        "Mean tokens fed per decoding step.",
        format!(
            "{:.3}",
            m.decode_step_tokens as f64 / m.decode_steps.max(1) as f64
        ),
    );
    metric(
        "k3_queue_depth",
        "gauge",
        "Requests being served or waiting.",
        depth.to_string(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Sets the job's cancel flag when dropped (the handler or the stream went away).
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A job admitted to the queue, with its first event read.
struct Admitted {
    rx: UnboundedReceiver<Out>,
    guard: CancelOnDrop,
    prompt_tokens: usize,
}

/// Admit a request (429 past the queue), hand it to the engine and wait until it starts.
async fn submit(s: &AppState, parsed: &Parsed) -> Result<Admitted, Response> {
    if !parsed.ignored.is_empty() {
        eprintln!(
            "k3 serve: ignored in a request: {}",
            parsed.ignored.join(", ")
        );
    }
    let cap = s.cfg.parallel.max(1) + s.cfg.queue;
    let counter = &s.engine.in_system;
    let mut n = counter.load(Ordering::Relaxed);
    loop {
        if n >= cap {
            let mean = {
                let mut m = s
                    .engine
                    .metrics
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                m.rejected += 1;
                m.mean_request_seconds
            };
            let wait = ((mean * n as f64 / s.cfg.parallel.max(1) as f64).ceil() as u64).max(1);
            return Err(error_response(
                &ApiError {
                    status: 429,
                    message: format!(
                        "the server is busy: {n} requests are being served or waiting (at most \
                         {cap}); retry after about {wait} s"
                    ),
                    param: None,
                },
                Some(wait),
            ));
        }
        match counter.compare_exchange(n, n + 1, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => n = now,
        }
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = unbounded_channel();
    let job = Job {
        task: parsed.task.clone(),
        settings: parsed.settings.clone(),
        stop: parsed.stop.clone(),
        adjust: parsed.adjust.clone(),
        logprobs: parsed.logprobs,
        token_ids: parsed.token_ids,
        cancel: Arc::clone(&cancel),
        out: tx,
    };
    let guard = CancelOnDrop(cancel);
    if !s.engine.submit(job) {
        counter.fetch_sub(1, Ordering::Relaxed);
        return Err(error_response(
            &ApiError {
                status: 500,
                message: "the engine thread has stopped".into(),
                param: None,
            },
            None,
        ));
    }
    match rx.recv().await {
        Some(Out::Started { prompt_tokens }) => Ok(Admitted {
            rx,
            guard,
            prompt_tokens,
        }),
        Some(Out::Error { status, message }) => Err(error_response(
            &ApiError {
                status,
                message,
                param: None,
            },
            None,
        )),
        _ => Err(error_response(
            &ApiError {
                status: 500,
                message: "the engine stopped before answering".into(),
                param: None,
            },
            None,
        )),
    }
}

/// Wait for the end of a job.
async fn finish(a: &mut Admitted) -> Result<Box<Finished>, ApiError> {
    loop {
        match a.rx.recv().await {
            Some(Out::Done(f)) => return Ok(f),
            Some(Out::Error { status, message }) => {
                return Err(ApiError {
                    status,
                    message,
                    param: None,
                })
            }
            Some(_) => {}
            None => {
                return Err(ApiError {
                    status: 500,
                    message: "the engine stopped before the reply was complete".into(),
                    param: None,
                })
            }
        }
    }
}

fn limits(s: &AppState) -> Limits {
    Limits {
        max_tokens: s.cfg.max_tokens,
        context: s.cfg.context,
        sampler: s.cfg.sampler,
        default_max_tokens: s.cfg.default_max_tokens,
        vocab: s.engine.vocab,
    }
}

/// The body of an authorized request, or the error response (401; 413 past the size cap; 408
/// when it does not arrive within the client timeout; 400 when the connection fails under it).
async fn checked_body(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Bytes, Box<Response>> {
    authorize(s, headers).map_err(|e| Box::new(error_response(&e, None)))?;
    let fail = |status: u16, message: String| {
        Box::new(error_response(
            &ApiError {
                status,
                message,
                param: None,
            },
            None,
        ))
    };
    let too_large = || {
        fail(
            413,
            format!(
                "the request body is larger than {} MiB",
                MAX_BODY_BYTES >> 20
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let limited = http_body_util::Limited::new(body, MAX_BODY_BYTES);
    let within = s.cfg.client_timeout;
    match tokio::time::timeout(within, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => Err(fail(400, format!("cannot read the request body: {e}"))),
        Err(_) => Err(fail(
            408,
            format!(
                "the request body did not arrive within {} s",
                within.as_secs()
            ),
        )),
    }
}

/// A response id unique to this server: `PREFIX-<start time>-<counter>`.
fn request_id(s: &Shared, prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        s.started,
        s.counter.fetch_add(1, Ordering::Relaxed)
    )
}

async fn chat(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let body = match checked_body(&s, &headers, body).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let parsed = match wire::parse_chat(&body, limits(&s)) {
        Ok(p) => p,
        Err(e) => return error_response(&e, None),
    };
    let mut admitted = match submit(&s, &parsed).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let id = request_id(&s, "chatcmpl");
    let created = unix_now();
    let model = s.cfg.model_name.clone();
    if !parsed.stream {
        return match finish(&mut admitted).await {
            Ok(f) => Json(wire::chat_response(&id, created, &model, &f)).into_response(),
            Err(e) => error_response(&e, None),
        };
    }
    let _ = admitted.prompt_tokens;
    let st = ChatStream {
        a: admitted,
        parser: TolerantParser::new(parsed.thinking),
        reasoning_sent: 0,
        content_sent: 0,
        started: false,
        done: false,
        id,
        created,
        model,
        include_usage: parsed.include_usage,
        logprobs: Vec::new(),
    };
    let events = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let events = st.step().await;
        Some((events, st))
    })
    .flat_map(|v| futures_util::stream::iter(v.into_iter().map(Ok::<Event, Infallible>)));
    Sse::new(events).into_response()
}

/// The state of one streamed chat reply.
struct ChatStream {
    a: Admitted,
    parser: TolerantParser,
    reasoning_sent: usize,
    content_sent: usize,
    started: bool,
    done: bool,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Log-probabilities of tokens whose text is not sent yet (they go with the next chunk).
    logprobs: Vec<Logprob>,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl ChatStream {
    /// A chunk, carrying the log-probabilities not sent yet.
    fn chunk(&mut self, delta: Value, finish: Option<&str>) -> Event {
        let mut v = wire::chunk(&self.id, self.created, &self.model, delta, finish);
        if !self.logprobs.is_empty() {
            v["choices"][0]["logprobs"] = wire::chat_logprobs(&std::mem::take(&mut self.logprobs));
        }
        data(&v)
    }

    /// Deltas for the text the parser has released since the last call.
    fn deltas(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        let r = self.parser.reasoning().len();
        if r > self.reasoning_sent {
            let d = self.parser.reasoning()[self.reasoning_sent..].to_owned();
            self.reasoning_sent = r;
            out.push(self.chunk(json!({"reasoning_content": d}), None));
        }
        let c = self.parser.content().len();
        if c > self.content_sent {
            let d = self.parser.content()[self.content_sent..].to_owned();
            self.content_sent = c;
            out.push(self.chunk(json!({"content": d}), None));
        }
        out
    }

    async fn step(&mut self) -> Vec<Event> {
        if !self.started {
            self.started = true;
            return vec![self.chunk(json!({"role": "assistant"}), None)];
        }
        match self.a.rx.recv().await {
            Some(Out::Token { text, logprobs }) => {
                self.logprobs.extend(logprobs);
                self.parser.push(&text);
                self.deltas()
            }
            Some(Out::Started { .. }) => Vec::new(),
            Some(Out::Done(f)) => {
                self.parser.finish();
                let mut out = self.deltas();
                if !f.tool_calls.is_empty() {
                    out.push(self.chunk(
                        json!({"tool_calls": wire::tool_calls(&f.tool_calls, true)}),
                        None,
                    ));
                }
                out.push(self.chunk(json!({}), Some(f.finish_reason)));
                if self.include_usage {
                    out.push(data(&json!({
                        "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "choices": [], "usage": wire::usage(&f),
                    })));
                }
                out.push(Event::default().data("[DONE]"));
                self.done = true;
                let _ = &self.a.guard;
                out
            }
            Some(Out::Error { status, message }) => {
                self.done = true;
                let e = ApiError {
                    status,
                    message,
                    param: None,
                };
                vec![data(&e.body()), Event::default().data("[DONE]")]
            }
            None => {
                self.done = true;
                let e = ApiError {
                    status: 500,
                    message: "the engine stopped before the reply was complete".into(),
                    param: None,
                };
                vec![data(&e.body()), Event::default().data("[DONE]")]
            }
        }
    }
}

async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let body = match checked_body(&s, &headers, body).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let parsed = match wire::parse_completion(&body, limits(&s)) {
        Ok(p) => p,
        Err(e) => return error_response(&e, None),
    };
    let mut admitted = match submit(&s, &parsed).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let id = request_id(&s, "cmpl");
    let created = unix_now();
    let model = s.cfg.model_name.clone();
    if !parsed.stream {
        return match finish(&mut admitted).await {
            Ok(f) => {
                let mut v = wire::text_completion(
                    &id,
                    created,
                    &model,
                    &f.content,
                    Some(f.finish_reason),
                    Some(wire::usage(&f)),
                );
                if let Some(lp) = &f.logprobs {
                    v["choices"][0]["logprobs"] = wire::completion_logprobs(lp, 0);
                }
                Json(v).into_response()
            }
            Err(e) => error_response(&e, None),
        };
    }
    let include_usage = parsed.include_usage;
    let events = futures_util::stream::unfold((admitted, false, 0), move |(mut a, done, at)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if done {
                return None;
            }
            let piece = |text: &str, finish: Option<&str>, usage: Option<Value>| {
                data(&wire::text_completion(
                    &id, created, &model, text, finish, usage,
                ))
            };
            let mut at = at;
            let (events, done) = match a.rx.recv().await {
                Some(Out::Token { text, logprobs }) if !logprobs.is_empty() => {
                    let mut v = wire::text_completion(&id, created, &model, &text, None, None);
                    v["choices"][0]["logprobs"] = wire::completion_logprobs(&logprobs, at);
                    at += logprobs
                        .iter()
                        .map(|e| e.token.chars().count())
                        .sum::<usize>();
                    (vec![data(&v)], false)
                }
                Some(Out::Token { text, .. }) => (vec![piece(&text, None, None)], false),
                Some(Out::Started { .. }) => (Vec::new(), false),
                Some(Out::Done(f)) => {
                    let mut v = vec![piece("", Some(f.finish_reason), None)];
                    if include_usage {
                        v.push(data(&json!({"id": id, "object": "text_completion",
                                "created": created, "model": model, "choices": [],
                                "usage": wire::usage(&f)})));
                    }
                    v.push(Event::default().data("[DONE]"));
                    (v, true)
                }
                Some(Out::Error { status, message }) => {
                    let e = ApiError {
                        status,
                        message,
                        param: None,
                    };
                    (vec![data(&e.body()), Event::default().data("[DONE]")], true)
                }
                None => (vec![Event::default().data("[DONE]")], true),
            };
            Some((events, (a, done, at)))
        }
    })
    .flat_map(|v| futures_util::stream::iter(v.into_iter().map(Ok::<Event, Infallible>)));
    Sse::new(events).into_response()
}
