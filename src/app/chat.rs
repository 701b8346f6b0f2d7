//! `k3 chat`: a conversation with carried state, in the terminal interface (when stdin and
//! stdout are terminals and TERM is not `dumb`) or the plain REPL (otherwise, or `--plain`).
//! Settings come from the flags, then the user config file, then the built-in defaults.

use super::config::Config;
use super::state::{AppInit, KeyLabels};
use super::worker::{ChatConfig, Worker};
use crate::session::chat::Settings;
use crate::session::store::SessionStore;
use crate::ui::input::KeyMap;
use crate::ui::repl::{self, ReplOptions};
use crate::ui::tui::{self, TuiOptions};
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
    /// Sampling temperature (K3 recommends 1.0; 0 is greedy) [default: 1.0, or the config
    /// file's; likewise for the sampling flags below].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Top-k (0 = off) [default: 0].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus threshold in (0, 1] [default: 1.0].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Min-p (0 = off) [default: 0].
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repetition penalty (1 = off) [default: 1.0].
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// Random seed [default: 1].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Longest reply in tokens [default: 512].
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Most positions a session may hold [default: 32768].
    #[arg(long)]
    pub context: Option<usize>,
    /// Extra stop id (repeatable; raw mode stops only on these).
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
    /// Memory budget (default: 80% of the memory available). Tokens do not depend on it;
    /// `/budget GB` changes it while chatting.
    #[command(flatten)]
    pub budget: super::budget_args::BudgetArgs,
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

/// The settings: flags over the config file over the defaults.
fn settings(args: &ChatArgs, cfg: &Config) -> Settings {
    let s = &cfg.sampling;
    let temperature = args.temperature.unwrap_or(s.temperature);
    Settings {
        temperature: if args.greedy { 0.0 } else { temperature },
        top_k: args.top_k.unwrap_or(s.top_k),
        top_p: args.top_p.unwrap_or(s.top_p),
        min_p: args.min_p.unwrap_or(s.min_p),
        repeat_penalty: args.repeat_penalty.unwrap_or(s.repeat_penalty),
        seed: args.seed.unwrap_or(s.seed),
        max_tokens: args.max_tokens.unwrap_or(s.max_tokens).max(1),
        thinking: if args.no_think {
            false
        } else {
            args.think || cfg.thinking.enabled
        },
        effort: args
            .effort
            .clone()
            .unwrap_or_else(|| cfg.thinking.effort.clone()),
        context_limit: args.context.unwrap_or(s.context).max(2),
        stop_ids: args.stop_ids.clone(),
    }
}

/// Run `k3 chat`; returns the exit status.
pub fn run(args: &ChatArgs) -> crate::Result<i32> {
    let cfg = Config::load().map_err(|e| crate::Error::Usage(e.to_string()))?;
    // A session name is checked now, not at the first `/save`.
    for (flag, name) in [("--session", &args.session), ("--resume", &args.resume)] {
        if let Some(name) = name {
            crate::session::store::validate_name(name)
                .map_err(|e| crate::Error::Usage(format!("{flag}: {e}")))?;
        }
    }
    if let Some(n) = args.context.filter(|&n| n > super::run::MAX_CONTEXT) {
        return Err(crate::Error::Usage(format!(
            "--context {n} is above the limit of {} positions",
            super::run::MAX_CONTEXT
        )));
    }
    if let Some(url) = &args.remote {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(crate::Error::Usage(format!(
                "--remote {url}: expected an http:// URL"
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
    let settings = settings(args, &cfg);
    settings.render_options().map_err(crate::Error::Usage)?;
    crate::engine::sampling::Sampler::new(settings.sampler())
        .map_err(|e| crate::Error::Usage(e.to_string()))?;
    let tui = !args.plain && !args.jsonl && terminal_usable();
    let keys = match cfg.keys.bindings() {
        Ok(b) => KeyMap::new(b),
        Err((field, msg)) => return Err(crate::Error::Usage(format!("{field}: {msg}"))),
    };
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
            system: args.system.clone(),
            resume: args.resume.clone(),
            session_name: args.session.clone().or_else(|| args.resume.clone()),
            session_dir: args
                .session_dir
                .clone()
                .unwrap_or_else(SessionStore::default_dir),
        })
    } else {
        Worker::spawn(ChatConfig {
            model_dir: model_dir.clone(),
            settings: settings.clone(),
            system: args.system.clone(),
            resume: args.resume.clone(),
            session_name: args.session.clone().or_else(|| args.resume.clone()),
            session_dir: args.session_dir.clone(),
            budget: args.budget.request(super::budget_args::auto_request())?,
            trunk: args.budget.trunk.clone(),
            spec: args.spec,
        })
    };
    if tui {
        let session_dir = args
            .session_dir
            .clone()
            .unwrap_or_else(SessionStore::default_dir);
        let model = if demo {
            "demo model".to_string()
        } else {
            model_dir.file_name().map_or_else(
                || model_dir.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            )
        };
        let labels: KeyLabels = keys.labels();
        let init = AppInit {
            model,
            session: args.session.clone().or_else(|| args.resume.clone()),
            resume: args.resume.is_some(),
            thinking: settings.thinking,
            context_limit: settings.context_limit as u64,
            // The worker exports the transcript here for the pane to show a loaded session; it
            // is read and removed at once. The session directory is private to the user.
            history_path: session_dir.join(format!(".transcript-view-{}.json", std::process::id())),
            budget_gb: cfg.memory.budget_gb,
            keys: labels,
            theme: cfg.theme,
        };
        return Ok(tui::run(
            worker,
            TuiOptions {
                init,
                keys,
                session_dir,
            },
        ));
    }
    let history_file =
        directories::ProjectDirs::from("", "", "k3").map(|d| d.data_dir().join("repl_history"));
    Ok(repl::run(
        worker,
        &ReplOptions {
            jsonl: args.jsonl,
            history_file,
        },
    ))
}
