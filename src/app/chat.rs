//! `k3 chat` below the front ends: its arguments, the settings (the flags, then the user
//! config file, then the built-in defaults), the checks made before anything starts, and the
//! engine worker. [`crate::cli::chat`] then runs the terminal interface (when stdin and stdout
//! are terminals and TERM is not `dumb`) or the plain REPL (otherwise, or `--plain`) on it.

use super::config::{Cmd, Config, KeyChord, ThemeName};
use super::worker::{ChatConfig, Worker};
use crate::session::chat::Settings;
use crate::session::defaults::{self, SamplingLayer, Source, Sources};
use clap::Args;
use std::io::IsTerminal;
use std::path::PathBuf;

/// Arguments of `k3 chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    /// Checkpoint directory (config.json, safetensors shards, tokenizer files); default: the
    /// config file's `model_dir`, else the small demo model built into k3.
    pub model_dir: Option<PathBuf>,
    /// Use the plain line-mode client instead of the terminal interface (automatic when stdin
    /// or stdout is not a terminal, or TERM is `dumb`).
    #[arg(long)]
    pub plain: bool,
    /// Print one JSON line per finished turn (prompt ids, generated ids, reply, reuse counts).
    #[arg(long)]
    pub jsonl: bool,
    /// Resume a saved session (no re-prefill).
    #[arg(long, value_name = "NAME")]
    pub resume: Option<String>,
    /// Resume the most recently saved session.
    #[arg(short = 'c', long = "continue", conflicts_with = "resume")]
    pub continue_last: bool,
    /// Name to save the session under [default: the first words of the conversation and the
    /// date, with -2, -3, … when taken].
    #[arg(long, value_name = "NAME")]
    pub session: Option<String>,
    /// Directory for saved sessions (default: the user data directory).
    #[arg(long, value_name = "DIR")]
    pub session_dir: Option<PathBuf>,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Turn the thinking channel off.
    #[arg(long, conflicts_with = "think")]
    pub no_think: bool,
    /// Turn the thinking channel on (when the config file turns it off).
    #[arg(long)]
    pub think: bool,
    /// Thinking effort: low, high or max [default: max, or the config file's].
    #[arg(long)]
    pub effort: Option<String>,
    /// Greedy decoding (overrides the sampling flags).
    #[arg(long)]
    pub greedy: bool,
    #[command(flatten)]
    pub sampling: super::sampling_args::SamplingArgs,
    /// Longest reply in tokens [default: 512].
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Longest raw-mode continuation in tokens (it also stops at an end-of-text token)
    /// [default: 200].
    #[arg(long, value_name = "N")]
    pub raw_max_tokens: Option<usize>,
    /// Raw mode runs past the end-of-text tokens, to the raw limit or a --stop-id (plain
    /// base-model continuation).
    #[arg(long)]
    pub raw_ignore_end: bool,
    /// Most positions a session may hold [default: 32768].
    #[arg(long)]
    pub context: Option<usize>,
    /// Extra stop id (repeatable), besides the template's end-of-text ids.
    #[arg(long = "stop-id", value_name = "ID")]
    pub stop_ids: Vec<u32>,
    /// Compute threads (default: all cores). Output does not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Speculative decoding: `off`, `auto` (draft when it measurably pays) or a fixed draft
    /// length 1..=8. Replies do not depend on it. `K3_NOSPEC=1` forces `off`.
    #[arg(long, default_value = "auto", value_parser = crate::engine::spec::SpecMode::parse, value_name = "off|auto|N")]
    pub spec: crate::engine::spec::SpecMode,
    /// Chat with an OpenAI-compatible server (k3 serve, vLLM, SGLang, …) at this URL instead of
    /// a local model; sessions keep the transcript and settings.
    #[arg(long, value_name = "URL", conflicts_with = "model_dir")]
    pub remote: Option<String>,
    /// Model name to ask the remote server for [default: the first it lists].
    #[arg(long, value_name = "NAME", requires = "remote")]
    pub model: Option<String>,
    /// Environment variable holding the remote server's API key.
    #[arg(long, value_name = "VAR", requires = "remote")]
    pub api_key_env: Option<String>,
    /// PEM file of certificates to trust for an https:// remote, besides the system's roots
    /// (and `SSL_CERT_FILE`): a private CA's, or a self-signed server's.
    #[arg(long, value_name = "FILE", requires = "remote")]
    pub ca_cert: Option<PathBuf>,
    /// Seconds allowed to connect to the remote server (TCP and TLS) [default: 10].
    #[arg(long, value_name = "SECS", requires = "remote", value_parser = positive_secs)]
    pub connect_timeout: Option<u64>,
    /// Seconds the remote server may stay silent, before its answer starts (while it reads
    /// the prompt) or within it [default: 600].
    #[arg(long, value_name = "SECS", requires = "remote", value_parser = positive_secs)]
    pub read_timeout: Option<u64>,
    /// Memory budget (default: 80% of the memory available). Tokens do not depend on it;
    /// `/budget GB` changes it while chatting.
    #[command(flatten)]
    pub budget: super::budget_args::BudgetArgs,
}

/// A whole number of seconds, at least 1 and at most a day.
fn positive_secs(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if (1..=86_400).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?} is not a whole number of seconds from 1 to 86400"
        )),
    }
}

/// Whether the terminal interface can run here: stdin and stdout are terminals and TERM is set
/// and not `dumb`.
#[must_use]
pub fn terminal_usable() -> bool {
    let term = std::env::var("TERM").unwrap_or_default();
    std::io::stdin().is_terminal()
        && std::io::stdout().is_terminal()
        && !term.is_empty()
        && term != "dumb"
}

/// The settings: flags over the config file over the model's `generation_config.json` (`gen`)
/// over the built-in defaults; and where each sampling value came from.
fn settings(
    args: &ChatArgs,
    cfg: &Config,
    gen: Option<&crate::session::defaults::GenerationConfig>,
) -> (Settings, Sources, SamplingLayer) {
    let flags = SamplingLayer {
        temperature: if args.greedy {
            Some(0.0)
        } else {
            args.sampling.temperature
        },
        max_tokens: args.max_tokens,
        raw_max_tokens: args.raw_max_tokens,
        context: args.context,
        ..args.sampling.layer()
    };
    let none = SamplingLayer::default();
    let (mut s, sources) = defaults::resolve(
        defaults::built_in(),
        &[
            (Source::Model, gen.map_or(&none, |g| &g.layer)),
            (Source::UserConfig, &cfg.sampling),
            (Source::Flag, &flags),
        ],
    );
    s.thinking = if args.no_think {
        false
    } else {
        args.think || cfg.thinking.enabled
    };
    s.effort = args
        .effort
        .clone()
        .unwrap_or_else(|| cfg.thinking.effort.clone());
    s.stop_ids.clone_from(&args.stop_ids);
    s.raw_ignore_end = args.raw_ignore_end;
    (s, sources, flags)
}

/// Refuse a budget below the floor of `k3 chat`'s plan (its context and its snapshots) before
/// any front end takes the terminal, with the floor and the context it assumes.
fn check_floor(
    model_dir: &std::path::Path,
    trunk: Option<&std::path::Path>,
    req: crate::stream::budget::BudgetRequest,
    context: u64,
) -> crate::Result<()> {
    use crate::stream::budget;
    if matches!(req, budget::BudgetRequest::Resident) {
        return Ok(());
    }
    let cfg = crate::engine::config::ModelConfig::load(&model_dir.join("config.json"))?;
    let ck = crate::stream::Checkpoint::open(model_dir)?;
    let mut sizes = crate::engine::weights::model_sizes(&cfg, &ck);
    // An encoded trunk's layers are staged before decoding (a bad trunk is reported when the
    // model opens).
    if let Some(m) = trunk.and_then(|t| crate::stream::trunk::read_manifest(t).ok()) {
        m.sizes_into(&mut sizes, crate::engine::bind::names::LM_HEAD);
    }
    let states = 1 + crate::session::chat::SNAPSHOTS as u64;
    budget::plan_states(&sizes, req, context, states, budget::cgroup_limit())
        .map(|_| ())
        .map_err(|e| {
            crate::Error::Usage(format!(
                "{e} (k3 chat plans for a context of {context} positions and {states} sequence states; --context N with a smaller N lowers the floor)"
            ))
        })
}

/// The budget the demo model opens under when none is asked for: its floor plus a third of its
/// weights, so that most experts and layers are streamed and the panes show the engine at
/// work. Returns the budget and the line that says so.
fn demo_budget(model_dir: &std::path::Path, context: u64) -> crate::Result<(u64, String)> {
    use crate::stream::budget;
    let cfg = crate::engine::config::ModelConfig::load(&model_dir.join("config.json"))?;
    let ck = crate::stream::Checkpoint::open(model_dir)?;
    let sizes = crate::engine::weights::model_sizes(&cfg, &ck);
    let states = 1 + crate::session::chat::SNAPSHOTS as u64;
    let all = budget::plan_states(
        &sizes,
        budget::BudgetRequest::Total(1_000_000_000_000),
        context,
        states,
        None,
    )
    .map_err(|e| crate::Error::Usage(e.to_string()))?;
    let model = sizes.model_bytes();
    // Rounded up to a tenth of a MB, so the figure shown is the budget.
    let b = (all.floor_bytes + model / 3).div_ceil(100_000) * 100_000;
    let line = format!(
        "the demo model ({} of weights) is streamed under a {} budget, below what holding \
         it all takes, so experts and layers are read from disk as they are needed and the \
         panes show the engine at work (the tokens are the same at every budget); --mem GB \
         changes it",
        budget::gb(model),
        budget::gb(b)
    );
    Ok((b, line))
}

/// The most recent conversation, for `--continue`: the newest of the saved sessions that can
/// be read and the conversations kept in journals (saved or not), by the time each was last
/// saved or journaled.
fn most_recent(args: &ChatArgs) -> crate::Result<String> {
    use crate::session::store::SessionStore;
    let store = SessionStore::new(
        args.session_dir
            .clone()
            .unwrap_or_else(SessionStore::default_dir),
    );
    let unreadable = |e: std::io::Error| {
        crate::Error::Usage(format!("--continue: {}: {e}", store.dir().display()))
    };
    // Both lists are newest first.
    let saved = store
        .list()
        .map_err(unreadable)?
        .into_iter()
        .find(|s| s.problem.is_none())
        .map(|s| (s.saved_unix, s.name));
    let journaled = store
        .journals()
        .map_err(unreadable)?
        .into_iter()
        .next()
        .map(|j| (j.modified_unix, j.name));
    match (saved, journaled) {
        (Some(s), Some(j)) => Ok(if j.0 >= s.0 { j.1 } else { s.1 }),
        (Some((_, name)), None) | (None, Some((_, name))) => Ok(name),
        (None, None) => Err(crate::Error::Usage(format!(
            "--continue: no saved session or unsaved conversation in {} to continue",
            store.dir().display()
        ))),
    }
}

/// The user data directory (`$K3_DATA_DIR`, else the platform's).
fn data_dir() -> Option<std::path::PathBuf> {
    match std::env::var_os(crate::session::store::DATA_DIR_ENV) {
        Some(d) if !d.is_empty() => Some(std::path::PathBuf::from(d)),
        _ => directories::ProjectDirs::from("", "", "k3").map(|d| d.data_dir().to_path_buf()),
    }
}

/// A started `k3 chat`: the worker (loading the model) and what a front end needs.
pub struct Started {
    /// The engine worker.
    pub worker: Worker,
    /// Run the terminal interface (else the plain REPL).
    pub tui: bool,
    /// One JSON line per turn (plain REPL).
    pub jsonl: bool,
    /// Model name for the status bar: the checkpoint directory's name, or "demo model".
    pub model: String,
    /// The session given with `--session` or `--resume`.
    pub session: Option<String>,
    /// A session is resumed.
    pub resume: bool,
    /// The settings in force at start.
    pub settings: Settings,
    /// Budget the terminal interface asks for once the model is ready (config file).
    pub budget_gb: Option<f64>,
    /// Key bindings (checked: no two commands on one chord).
    pub bindings: Vec<(Cmd, KeyChord)>,
    /// Colour scheme.
    pub theme: ThemeName,
    /// The line history of the plain REPL.
    pub history_file: Option<std::path::PathBuf>,
    /// The input history of the terminal client.
    pub tui_history: Option<std::path::PathBuf>,
}

/// Check everything that can be checked before the model opens, then start the worker.
/// Over 100 lines: every check that can be made before the model opens, each a few lines, in
/// the order the flags depend on each other, then the start.
pub fn start(args: &ChatArgs) -> crate::Result<Started> {
    let mut args_resume = args.resume.clone();
    if args.continue_last {
        args_resume = Some(most_recent(args)?);
    }
    let resume = &args_resume;
    let cfg = Config::load().map_err(|e| crate::Error::Usage(e.to_string()))?;
    // A session name is checked now, not at the first `/save`.
    for (flag, name) in [("--session", &args.session), ("--resume", resume)] {
        if let Some(name) = name {
            crate::session::store::validate_name(name)
                .map_err(|e| crate::Error::Usage(format!("{flag}: {e}")))?;
        }
    }
    if let Some(n) = args
        .context
        .filter(|&n| n > crate::session::chat::MAX_CONTEXT)
    {
        return Err(crate::Error::Usage(format!(
            "--context {n} is above the limit of {} positions",
            crate::session::chat::MAX_CONTEXT
        )));
    }
    if let Some(url) = &args.remote {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(crate::Error::Usage(format!(
                "--remote {url}: expected an http:// or https:// URL"
            )));
        }
    }
    let given = args.model_dir.clone().or_else(|| cfg.model_dir.clone());
    let demo = given.is_none() && args.remote.is_none();
    let model_dir = match (given, &args.remote) {
        (_, Some(url)) => PathBuf::from(url),
        (Some(d), None) => d,
        (None, None) => super::demo::materialise()?,
    };
    super::run::set_threads(args.threads)?;
    let gen = if args.remote.is_none() {
        defaults::GenerationConfig::load(&model_dir)?
    } else {
        None
    };
    let (settings, sources, flags) = settings(args, &cfg, gen.as_ref());
    settings.render_options().map_err(crate::Error::Usage)?;
    crate::engine::sampling::Sampler::new(settings.sampler())
        .map_err(|e| crate::Error::Usage(e.to_string()))?;
    let tui = !args.plain && !args.jsonl && terminal_usable();
    let bindings = cfg
        .keys
        .bindings()
        .map_err(|(field, msg)| crate::Error::Usage(format!("{field}: {msg}")))?;
    let (budget, budget_note) = if demo && !args.budget.given() && cfg.memory.budget_gb.is_none() {
        let (b, line) = demo_budget(&model_dir, settings.context_limit as u64)?;
        (crate::stream::budget::BudgetRequest::Total(b), Some(line))
    } else {
        (
            args.budget.request(super::budget_args::auto_request())?,
            None,
        )
    };
    // What the model's generation_config.json had that k3 does not use, and the budget's
    // reason (the worker adds where each sampling value came from).
    let notes: Vec<&String> = gen
        .iter()
        .flat_map(|g| &g.notes)
        .chain(&budget_note)
        .collect();
    let start_note = (!notes.is_empty()).then(|| {
        notes
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    });
    if args.remote.is_none() {
        check_floor(
            &model_dir,
            args.budget.trunk.as_deref(),
            budget,
            settings.context_limit as u64,
        )?;
    }
    let worker = if let Some(url) = &args.remote {
        let api_key = match &args.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                crate::Error::Usage(format!("--api-key-env {var}: {var} is not set"))
            })?),
            None => None,
        };
        Worker::spawn_remote(super::remote::RemoteConfig {
            url: url.clone(),
            model: args.model.clone(),
            api_key,
            settings: settings.clone(),
            flags: flags.clone(),
            system: args.system.clone(),
            resume: resume.clone(),
            session_name: args.session.clone().or_else(|| resume.clone()),
            session_dir: args
                .session_dir
                .clone()
                .unwrap_or_else(crate::session::store::SessionStore::default_dir),
            extra_roots: match &args.ca_cert {
                Some(p) => super::remote::read_ca_file(p).map_err(crate::Error::Usage)?,
                None => Vec::new(),
            },
            connect_timeout: args.connect_timeout.map_or(
                super::remote::CONNECT_TIMEOUT,
                std::time::Duration::from_secs,
            ),
            read_timeout: args
                .read_timeout
                .map_or(super::remote::READ_TIMEOUT, std::time::Duration::from_secs),
        })
    } else {
        Worker::spawn(ChatConfig {
            model_dir: model_dir.clone(),
            model_label: if demo {
                "the demo model".to_string()
            } else {
                crate::stream::shown(&model_dir)
            },
            settings: settings.clone(),
            system: args.system.clone(),
            resume: resume.clone(),
            session_name: args.session.clone().or_else(|| resume.clone()),
            session_dir: args.session_dir.clone(),
            budget,
            trunk: args.budget.trunk.clone(),
            spec: args.spec,
            start_note,
            sources,
            flags,
        })
    };
    let model = if demo {
        "demo model".to_string()
    } else {
        model_dir.file_name().map_or_else(
            || crate::stream::shown(&model_dir),
            |n| crate::stream::shown(std::path::Path::new(n)),
        )
    };
    Ok(Started {
        worker,
        tui,
        jsonl: args.jsonl,
        model,
        session: args.session.clone().or_else(|| resume.clone()),
        resume: resume.is_some(),
        settings,
        budget_gb: cfg.memory.budget_gb,
        bindings,
        theme: cfg.theme,
        history_file: data_dir().map(|d| d.join("repl_history")),
        tui_history: data_dir().map(|d| d.join("input_history.json")),
    })
}
