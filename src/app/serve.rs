//! `k3 serve`: the command line of the API server; resolves the model directory, the budget,
//! the address and the key into a [`crate::serve::ServeConfig`].

use crate::session::defaults::{self, Source};
use crate::{Error, Result};
use clap::Args;
use std::net::IpAddr;
use std::path::PathBuf;

/// Arguments of `k3 serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Checkpoint directory; default: the config file's `model_dir`, else the demo model.
    pub model_dir: Option<PathBuf>,
    /// Address to listen on. Anything but a loopback address needs --api-key-env.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Environment variable holding the API key clients must send as a Bearer token.
    #[arg(long, value_name = "VAR")]
    pub api_key_env: Option<String>,
    /// Model name listed by /v1/models and written in responses.
    #[arg(long, default_value = "kimi-k3-local")]
    pub model_name: String,
    /// Requests that may wait behind those being served; more are answered 429.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Requests decoded together, one token each per pass over the weights (1: one at a time)
    /// [default: as many as the budget holds, up to 4].
    #[arg(long, value_name = "N")]
    pub parallel: Option<usize>,
    /// Most tokens one reply may have (and the default max_tokens of a chat request).
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: usize,
    /// Most positions one request may use [default: 32768].
    #[arg(long)]
    pub context: Option<usize>,
    /// Compute threads (default: all cores). Output does not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Seconds a client may take to send a request's headers, or its body, or stay idle between
    /// requests; past it the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub client_timeout: u64,
    /// Most connections open at once; more are answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// After SIGTERM or SIGINT, seconds given to the requests in progress before the server
    /// closes what is still open and exits (a second signal exits at once).
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub drain_timeout: u64,
    /// Memory budget (default: 80% of the memory available).
    #[command(flatten)]
    pub budget: super::budget_args::BudgetArgs,
}

/// Run `k3 serve`; returns the exit status.
pub fn run(args: &ServeArgs) -> Result<i32> {
    let cfg = super::config::Config::load().map_err(|e| Error::Usage(e.to_string()))?;
    let context = args
        .context
        .or(cfg.sampling.context)
        .unwrap_or(crate::session::chat::Settings::default().context_limit);
    if !(2..=crate::session::chat::MAX_CONTEXT).contains(&context) {
        return Err(Error::Usage(format!(
            "--context {context} must be between 2 and {} positions",
            crate::session::chat::MAX_CONTEXT
        )));
    }
    if args.client_timeout == 0 || args.client_timeout > 3600 {
        return Err(Error::Usage(format!(
            "--client-timeout {} must be between 1 and 3600 seconds",
            args.client_timeout
        )));
    }
    if args.drain_timeout > 3600 {
        return Err(Error::Usage(format!(
            "--drain-timeout {} must be at most 3600 seconds",
            args.drain_timeout
        )));
    }
    if args.max_connections == 0 {
        return Err(Error::Usage("--max-connections must be at least 1".into()));
    }
    if args.max_tokens == 0 {
        return Err(Error::Usage("--max-tokens must be at least 1".into()));
    }
    let api_key = match &args.api_key_env {
        Some(var) => match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Some(k.trim().to_owned()),
            _ => {
                return Err(Error::Usage(format!(
                    "--api-key-env {var}: the environment variable {var} is not set or empty"
                )))
            }
        },
        None => None,
    };
    if !args.host.is_loopback() && api_key.is_none() {
        return Err(Error::Usage(format!(
            "--host {}: listening beyond this machine needs an API key (--api-key-env VAR)",
            args.host
        )));
    }
    let model_dir = match args.model_dir.clone().or_else(|| cfg.model_dir.clone()) {
        Some(d) => d,
        None => super::demo::materialise()?,
    };
    let budget = args.budget.request(super::budget_args::auto_request())?;
    let parallel = match args.parallel {
        Some(n) if !(1..=super::prompts::MAX_PARALLEL).contains(&n) => {
            return Err(Error::Usage(format!(
                "--parallel {n}: expected 1 to {} requests",
                super::prompts::MAX_PARALLEL
            )))
        }
        Some(n) => n,
        None => default_parallel(&model_dir, budget, context)?,
    };
    super::run::set_threads(args.threads)?;
    // Requests that leave a setting out get the config file's, else the model's
    // generation_config.json's, else the built-in one; a reply length at most --max-tokens.
    let gen = defaults::GenerationConfig::load(&model_dir)?;
    let none = defaults::SamplingLayer::default();
    let (settings, sources) = defaults::resolve(
        crate::session::chat::Settings {
            max_tokens: args.max_tokens,
            ..defaults::built_in()
        },
        &[
            (Source::Model, gen.as_ref().map_or(&none, |g| &g.layer)),
            (Source::UserConfig, &cfg.sampling),
        ],
    );
    crate::engine::sampling::Sampler::new(settings.sampler)
        .map_err(|e| Error::Usage(e.to_string()))?;
    for note in gen.iter().flat_map(|g| &g.notes) {
        eprintln!("k3 serve: {note}");
    }
    eprintln!(
        "k3 serve: defaults for requests that leave them out: {}",
        sources.line(&settings)
    );
    crate::serve::run(crate::serve::ServeConfig {
        model_dir,
        model_name: args.model_name.clone(),
        host: args.host,
        port: args.port,
        api_key,
        queue: args.queue,
        parallel,
        max_tokens: args.max_tokens,
        context,
        sampler: settings.sampler,
        default_max_tokens: settings.max_tokens.min(args.max_tokens),
        budget,
        trunk: args.budget.trunk.clone(),
        client_timeout: std::time::Duration::from_secs(args.client_timeout),
        max_connections: args.max_connections,
        drain_timeout: std::time::Duration::from_secs(args.drain_timeout),
    })
}

/// Most requests `k3 serve` decodes together unless told: the gain per added sequence falls
/// as compute takes over, and each one holds a state.
pub const DEFAULT_PARALLEL: usize = 4;

/// `--parallel` when not given: the most requests, up to [`DEFAULT_PARALLEL`], whose states
/// (and the states kept for prefix reuse, [`crate::serve::planned_states`]) the memory plan
/// holds at `context` positions each; 1 when even one does not fit (the load then says why).
fn default_parallel(
    model_dir: &std::path::Path,
    budget: crate::stream::budget::BudgetRequest,
    context: usize,
) -> Result<usize> {
    let cfg = crate::engine::ModelConfig::load(&model_dir.join("config.json"))?;
    let ck = crate::stream::Checkpoint::open(model_dir)?;
    let sizes = crate::engine::weights::model_sizes(&cfg, &ck);
    let limit = crate::stream::budget::cgroup_limit();
    let fits = |n: usize| {
        let states = crate::serve::planned_states(n);
        crate::stream::budget::plan_states(&sizes, budget, context as u64, states, limit).is_ok()
    };
    Ok((1..=DEFAULT_PARALLEL).rev().find(|&n| fits(n)).unwrap_or(1))
}
