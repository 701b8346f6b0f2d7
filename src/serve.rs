//! `k3 serve`: the engine behind an OpenAI-compatible HTTP API (a front end beside `ui`).
//!
//! Threads: tokio's runtime runs the HTTP side (`http.rs`: axum handlers, SSE); one engine
//! thread (`engine.rs`) owns the model, the tokenizer and one [`crate::session::chat::Session`]
//! and serves [`engine::Job`]s in arrival order from a channel: one at a time, or up to
//! `parallel` at once, decoded together one token each per pass over the weights. A handler
//! sends its job with a cancel flag and reads [`engine::Out`] events back; dropping the handler
//! (the client went away) sets the flag, and the engine stops that job at the next token. The
//! states the session keeps (counted in the plan) are reused across requests by the longest
//! common prefix. `wire.rs` holds the request and response JSON.
//!
//! Never imports `app` or `ui`: the command line resolves everything into [`ServeConfig`].

pub mod engine;
pub mod http;
pub mod stop;
pub mod wire;

use std::net::IpAddr;
use std::path::PathBuf;

/// Largest request body accepted (bytes).
pub const MAX_BODY_BYTES: usize = 8 << 20;
/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 4096;

/// Everything `k3 serve` needs, resolved from the command line.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// The model name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// Address to listen on.
    pub host: IpAddr,
    /// Port (0: any free port; the chosen one is printed).
    pub port: u16,
    /// The key clients must send as `Authorization: Bearer KEY`, if any.
    pub api_key: Option<String>,
    /// Requests that may wait behind those being served; more get 429.
    pub queue: usize,
    /// Requests decoded together, one token each per pass over the weights (1: one at a time).
    pub parallel: usize,
    /// Most tokens one reply may have (also the default `max_tokens`).
    pub max_tokens: usize,
    /// Most positions one request may need (the plan reserves state for them).
    pub context: usize,
    /// Sampling of a request that leaves a setting out.
    pub sampler: crate::engine::sampling::SamplerConfig,
    /// Reply length of a chat request that gives no `max_tokens` (at most `max_tokens`).
    pub default_max_tokens: usize,
    /// Memory budget.
    pub budget: crate::stream::budget::BudgetRequest,
    /// A packed trunk.
    pub trunk: Option<PathBuf>,
    /// Most time a client may take to send a request's headers, to send its body, or to stay
    /// idle between requests on a kept-alive connection; past it the connection is closed.
    pub client_timeout: std::time::Duration,
    /// Most connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// After SIGTERM or SIGINT, most time given to the requests in progress before the
    /// connections still open are closed and the process exits.
    pub drain_timeout: std::time::Duration,
}

/// States kept for prefix reuse by a server decoding `parallel` requests together: a
/// conversation's snapshots, and one more for each other request in flight (1: the session's
/// [`crate::session::chat::SNAPSHOTS`]).
#[must_use]
pub fn kept_states(parallel: usize) -> usize {
    crate::session::chat::SNAPSHOTS + parallel.max(1) - 1
}

/// Sequence states the memory plan holds for a server decoding `parallel` requests together:
/// one per request in flight and the states kept for prefix reuse ([`kept_states`]).
#[must_use]
pub fn planned_states(parallel: usize) -> u64 {
    (parallel.max(1) + kept_states(parallel)) as u64
}

/// Run the server until SIGTERM or SIGINT; returns the exit status (0 after a clean drain).
pub fn run(cfg: ServeConfig) -> crate::Result<i32> {
    let engine = engine::Engine::start(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| crate::Error::Usage(format!("cannot start the HTTP runtime: {e}")))?;
    rt.block_on(http::serve(cfg, engine))
}
