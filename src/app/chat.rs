//! `k3 chat`: a conversation with carried state, in the plain REPL.

use super::worker::{ChatConfig, Worker};
use crate::session::chat::Settings;
use crate::ui::repl::{self, ReplOptions};
use clap::Args;
use std::path::PathBuf;

/// Arguments of `k3 chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    /// Checkpoint directory (config.json, safetensors shards, tokenizer files).
    pub model_dir: PathBuf,
    /// Use the plain line-mode client (automatic when stdin or stdout is not a terminal).
    #[arg(long)]
    pub plain: bool,
    /// Print one JSON line per finished turn (prompt ids, generated ids, reply, reuse counts).
    #[arg(long)]
    pub jsonl: bool,
    /// Resume a saved session (no re-prefill).
    #[arg(long, value_name = "NAME")]
    pub resume: Option<String>,
    /// Name to save the session under.
    #[arg(long, value_name = "NAME")]
    pub session: Option<String>,
    /// Directory for saved sessions (default: the user data directory).
    #[arg(long, value_name = "DIR")]
    pub session_dir: Option<PathBuf>,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Turn the thinking channel off.
    #[arg(long)]
    pub no_think: bool,
    /// Thinking effort: low, high or max.
    #[arg(long, default_value = "max")]
    pub effort: String,
    /// Greedy decoding (overrides the sampling flags).
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature (K3 recommends 1.0; 0 is greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus threshold in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Longest reply in tokens.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Most positions a session may hold.
    #[arg(long, default_value_t = 32_768)]
    pub context: usize,
    /// Extra stop id (repeatable; raw mode stops only on these).
    #[arg(long = "stop-id", value_name = "ID")]
    pub stop_ids: Vec<u32>,
    /// Compute threads (default: all cores). Output does not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Run `k3 chat`; returns the exit status.
pub fn run(args: &ChatArgs) -> crate::Result<i32> {
    super::run::set_threads(args.threads)?;
    let settings = Settings {
        temperature: if args.greedy { 0.0 } else { args.temperature },
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens.max(1),
        thinking: !args.no_think,
        effort: args.effort.clone(),
        context_limit: args.context.max(2),
        stop_ids: args.stop_ids.clone(),
    };
    settings.render_options().map_err(crate::Error::Usage)?;
    crate::engine::sampling::Sampler::new(settings.sampler())
        .map_err(|e| crate::Error::Usage(e.to_string()))?;
    let worker = Worker::spawn(ChatConfig {
        model_dir: args.model_dir.clone(),
        settings,
        system: args.system.clone(),
        resume: args.resume.clone(),
        session_name: args.session.clone().or_else(|| args.resume.clone()),
        session_dir: args.session_dir.clone(),
    });
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
