//! The command line: parses it (clap), hands each subcommand to its module in [`crate::app`],
//! and starts the front end `k3 chat` asks for ([`crate::ui`]). This is the one layer that knows
//! both the front ends and the work below them; it turns errors into exit statuses.

pub mod chat;

use crate::app::{bench, config, pack, plan, prompts, run, serve, synth, verify};
use clap::{Parser, Subcommand};

/// k3 — Kimi K3 inference engine.
#[derive(Debug, Parser)]
#[command(name = "k3", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
    /// Set a speed knob for this run: NAME is a K3_* variable's name with or without the
    /// prefix (`--tune io_threads=4`, `--tune K3_KERNELS=generic`); it wins over the variable
    /// and the config file's [tuning] table. Repeatable. See docs/tuning.md.
    #[arg(long, global = true, value_name = "NAME=VALUE", value_parser = parse_tune)]
    pub tune: Vec<(&'static str, String)>,
}

/// One `--tune NAME=VALUE`: the variable it sets and the value (checked with the others).
fn parse_tune(s: &str) -> Result<(&'static str, String), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=VALUE"))?;
    let var = crate::tuning::Tuning::variable(name).ok_or_else(|| {
        format!(
            "{name:?} is no speed knob: expected one of {}",
            crate::tuning::VARIABLES
                .iter()
                .map(|v| v.trim_start_matches("K3_").to_ascii_lowercase())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    Ok((var, value.to_string()))
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a continuation of a prompt and print it (raw mode: no chat template).
    ///
    /// Text goes to stdout as it is generated; a summary (tokens, s/token, prefill tokens/s,
    /// peak RSS) goes to stderr. Exit status: 0 ok, 1 runtime failure, 2 usage or config
    /// refusal, 3 an input file failed validation, 4 the output is unsound (non-finite logits).
    Run(run::RunArgs),
    /// Chat with a model: the K3 template, state carried across turns, raw mode, saved sessions.
    ///
    /// Lines starting with `/` are commands (`/help`); end a line with `\` to continue it.
    /// Ctrl-C stops a reply and keeps the session.
    Chat(Box<crate::app::chat::ChatArgs>),
    /// Show or create the user configuration file (`path`, `show`, `init`).
    Config(config::ConfigArgs),
    /// Write a synthetic checkpoint in the released format (deterministic random weights).
    ///
    /// Shapes: tiny (the oracle's), small (~400 MB), bench (~6 GB), k3 (the released
    /// dimensions as sparse files). Exit status: 0 ok, 1 write failure, 2 usage (including an
    /// existing non-empty OUT_DIR).
    Synth(synth::SynthArgs),
    /// Pack a checkpoint's trunk (every layer's non-expert tensors) into one 4096-aligned
    /// file for fast sequential streaming; use it with `--trunk DIR`.
    ///
    /// Writes TRUNK_DIR/trunk.bin and trunk.json (per-layer offsets, sizes, CRC-32, and the
    /// source checkpoint's identity) atomically. Exit status: 0 ok, 1 write failure, 2 an
    /// existing trunk without --force, 3 a checkpoint that fails validation.
    Pack(pack::PackArgs),
    /// Check a checkpoint's files: every shard read once, all-zero and non-finite tensors,
    /// optional SHA-256 sums, the tokenizer's ranks, a packed trunk byte for byte.
    ///
    /// Every problem is listed (the first 20 in the report, all counted). Exit status: 0 all
    /// checks pass, 3 a check failed (or the checkpoint is refused at open).
    Verify(verify::VerifyArgs),
    /// Print the memory plan for a checkpoint and a budget, before loading any weight.
    ///
    /// A budget below the floor is refused with the floor, the budget and the shortfall
    /// (exit 2). `--json` prints `model_bytes`, `budget_bytes`, `floor_bytes`, `fits` and the
    /// whole plan.
    Plan(plan::PlanArgs),
    /// Measure prefill and decode speed under a budget, next to this machine's floors.
    ///
    /// Floors: bytes read per token over the read bandwidth the disk gives the engine's reads
    /// (the best of expert-sized random and 4 and 16 MiB sequential reads, four in flight per
    /// I/O thread, measured after the timed passes), and bytes touched per token over the
    /// measured memory bandwidth; each printed with the ratio of the measured time to it.
    Bench(bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and raw completions, SSE
    /// streaming, tool calls, prefix reuse across requests, /metrics).
    ///
    /// Listens on 127.0.0.1:8000 unless told otherwise; another address needs an API key
    /// (--api-key-env VAR). Requests are served one at a time in arrival order; past the queue
    /// they get 429. SIGTERM finishes the request in progress and exits 0.
    Serve(serve::ServeArgs),
}

/// Parse the command line, run, and return the process exit status.
#[must_use]
pub fn main() -> i32 {
    crate::stream::alloc::keep_rss_inside_the_plan();
    let cli = Cli::parse();
    // The speed knobs (flags, environment, config file), checked once before anything reads
    // them. `k3 config` manages the file itself (it must be able to replace a broken one).
    let file = if matches!(cli.command, Command::Config(_)) {
        crate::app::config::Config::default()
    } else {
        match crate::app::config::Config::load() {
            Ok(c) => {
                // Read once: the command reads its own settings from this copy.
                c.keep();
                c
            }
            Err(e) => {
                eprintln!(
                    "k3: error: {}",
                    crate::app::run::terminal_safe(&e.to_string())
                );
                return crate::Error::Usage(String::new()).exit_code();
            }
        }
    };
    if let Err(e) = crate::tuning::Tuning::init_layered(&cli.tune, |var| file.tuning.value(var)) {
        let from = if cli.tune.iter().any(|(v, _)| *v == e.var) {
            format!("--tune {}", crate::app::config::TuningConfig::key_of(e.var))
        } else if std::env::var(e.var).is_ok_and(|v| !v.trim().is_empty()) {
            e.var.to_string()
        } else {
            format!(
                "[tuning] {}",
                crate::app::config::TuningConfig::key_of(e.var)
            )
        };
        eprintln!(
            "k3: error: {}",
            crate::app::run::terminal_safe(&format!(
                "{from}={:?} is not valid: expected {}",
                e.value, e.expected
            ))
        );
        return crate::Error::Usage(String::new()).exit_code();
    }
    let result = match cli.command {
        Command::Run(args) => match &args.prompts {
            Some(path) => prompts::run(&args, path).map(|()| 0),
            None => run::run(&args).map(|()| 0),
        },
        Command::Plan(args) => plan::run(&args).map(|()| 0),
        Command::Bench(args) => bench::run(&args).map(|()| 0),
        Command::Chat(args) => chat::run(&args),
        Command::Config(args) => config::run(&args),
        Command::Synth(args) => synth::run(&args).map(|()| 0),
        Command::Pack(args) => pack::run(&args).map(|()| 0),
        Command::Verify(args) => verify::run(&args),
        Command::Serve(args) => serve::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // Paths and names in a message come from the user and the disk: no control
            // character reaches the terminal raw (docs/reliability.md#conventions).
            eprintln!(
                "k3: error: {}",
                crate::app::run::terminal_safe(&e.to_string())
            );
            e.exit_code()
        }
    }
}
