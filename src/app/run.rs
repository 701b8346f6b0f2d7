//! `k3 run`: load a checkpoint, prefill a prompt, generate, report.

use crate::engine::model::Logits;
use crate::engine::sampling::{Sampler, SamplerConfig};
use crate::engine::spec::{SpecMode, SpecStats, Speculator};
use crate::engine::{Model, SeqState};
use crate::session::chat::PREFILL_CHUNK;
use crate::session::tokenizer::{Tokenizer, Utf8Stream};
use crate::stream::stats::CpuTicks;
use crate::{Error, Result};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `k3 run`.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "ids", "prompts"]))]
pub struct RunArgs {
    /// Checkpoint directory (config.json, safetensors shards, tokenizer files); default: the
    /// small demo model built into k3.
    pub model_dir: Option<PathBuf>,
    /// Prompt text (special-token names are recognised, as in raw mode).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Read the prompt text from a file (bytes verbatim; use for non-ASCII).
    #[arg(long, value_name = "PATH")]
    pub prompt_file: Option<PathBuf>,
    /// Token ids, separated by commas or whitespace (no tokenizer needed).
    #[arg(long, value_name = "1,2,3")]
    pub ids: Option<String>,
    /// Many prompts, one per line: text, or a JSON object with "prompt" or "ids" and its own
    /// "max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed",
    /// "stop_ids". Decoded --parallel at a time in one pass over the weights; one JSON line
    /// per prompt, in input order, on stdout (docs/batching.md#k3-run---prompts).
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// With --prompts: how many prompts are decoded together in one pass [default: 4].
    #[arg(long, value_name = "N")]
    pub parallel: Option<usize>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub gen: usize,
    /// Most positions the run may hold: prompt tokens plus `--gen` (at most 1048576).
    #[arg(long, default_value_t = 32_768)]
    pub context: usize,
    #[command(flatten)]
    pub sampling: super::sampling_args::SamplingArgs,
    /// Stop after emitting this id (repeatable).
    #[arg(long = "stop-id", value_name = "ID")]
    pub stop_ids: Vec<u32>,
    /// Compute threads (default: all cores). Output does not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object instead of text and a summary.
    #[arg(long)]
    pub json: bool,
    /// Write the float32 little-endian logits of every step (row 0 = after the prompt).
    #[arg(long, value_name = "PATH")]
    pub dump_logits: Option<PathBuf>,
    /// Speculative decoding: `off`, `auto` (draft when it measurably pays) or a fixed draft
    /// length 1..=8. Tokens do not depend on it. `K3_NOSPEC=1` forces `off`.
    #[arg(long, default_value = "auto", value_parser = SpecMode::parse, value_name = "off|auto|N")]
    pub spec: SpecMode,
    /// How drafts are accepted when sampling: `tokens` (a draft is used when it equals the
    /// token the sampler draws, so the tokens are those of decoding without speculation) or
    /// `distribution` (docs/runtime.md#speculative-decoding: accepted with probability p(draft), else a token drawn
    /// from p without the draft: the same distribution, not the same seeded tokens; needs a
    /// fixed `--spec N`). Greedy decoding is the same either way.
    #[arg(long, value_enum, default_value = "tokens")]
    pub spec_sampling: SpecSampling,
    /// Memory budget (default: the whole model resident). Tokens do not depend on it.
    #[command(flatten)]
    pub budget: super::budget_args::BudgetArgs,
}

/// How speculative drafts are accepted when sampling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecSampling {
    /// Token-identical to decoding without speculation.
    Tokens,
    /// Distribution-preserving rejection sampling (docs/runtime.md#speculative-decoding).
    Distribution,
}

/// Seed of the acceptance stream of distribution-preserving speculation, from the run's seed.
const ACCEPT_STREAM: u64 = 0x5350_4543_4143_4350;

/// Stolen CPU time, as a fraction, from which `k3 run` and `k3 bench` say that the host
/// disturbed their figures.
pub const STEAL_NOTE: f64 = 0.05;

/// What `k3 run` and `k3 bench` add to a timing taken while at least [`STEAL_NOTE`] of the
/// CPU time was stolen.
pub const STEAL_MEANING: &str =
    "a hypervisor ran other work on these CPUs, so the times vary with it";

/// The fraction of the machine's CPU time a hypervisor took away since `before` (None where
/// `/proc/stat` is not there): timings taken while it is high say more about the host than
/// about k3.
#[must_use]
pub fn steal_since(before: Option<CpuTicks>) -> Option<f64> {
    CpuTicks::now()?.steal_fraction_since(&before?)
}

/// The kernel path and the one-token row order in use (`"probing"` until it is chosen).
pub(crate) fn kernels_json() -> serde_json::Value {
    serde_json::json!({
        "isa": crate::kernels::isa().name(),
        "row_order": crate::kernels::row_order().map_or("not chosen", crate::kernels::RowOrder::name),
        "tuning": crate::tuning::Tuning::get(),
    })
}

/// The median of `v` (0 when empty).
#[must_use]
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Median seconds per generated token, where a speculative pass's time is shared equally by
/// the tokens it yielded: `steps` holds (pass number, seconds) per decoding step.
#[must_use]
pub fn median_per_token(steps: &[(u64, f64)]) -> f64 {
    let mut per_token = Vec::with_capacity(steps.len());
    let mut i = 0;
    while i < steps.len() {
        let pass = steps[i].0;
        let j = steps[i..]
            .iter()
            .position(|&(p, _)| p != pass)
            .map_or(steps.len(), |n| i + n);
        let total: f64 = steps[i..j].iter().map(|&(_, s)| s).sum();
        let n = (j - i) as f64;
        per_token.extend(std::iter::repeat_n(total / n, j - i));
        i = j;
    }
    median(&mut per_token)
}

/// Speculation figures for `--json`: passes, proposals, acceptance, tokens per pass, and
/// bytes read per generated token.
#[must_use]
pub fn spec_json(
    mode: SpecMode,
    st: &SpecStats,
    bytes_read: u64,
    tokens: usize,
) -> serde_json::Value {
    serde_json::json!({
        "mode": mode.to_string(),
        "passes": st.passes,
        "draft_passes": st.draft_passes,
        "proposed": st.proposed,
        "accepted": st.accepted,
        "acceptance": st.acceptance(),
        "tokens_per_pass": st.tokens_per_pass(),
        "bytes_read_per_token": if tokens == 0 { 0.0 } else { bytes_read as f64 / tokens as f64 },
    })
}

/// Parse `--ids`.
fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| Error::Usage(format!("--ids: {t:?} is not a token id")))
        })
        .collect()
}

/// Make model output safe for a terminal: control characters other than newline and tab
/// (which could start escape sequences) are shown escaped.
#[must_use]
pub fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// Peak resident set size of this process, from /proc (0 where unavailable).
#[must_use]
pub fn peak_rss_bytes() -> u64 {
    crate::stream::stats::rss_bytes().1
}

pub use crate::session::chat::MAX_CONTEXT;

/// Largest `--prompt-file` read, whatever the context: 256 MiB.
const MAX_PROMPT_FILE_BYTES: u64 = 256 << 20;

pub(crate) fn load_tokenizer(dir: &Path, vocab: u32) -> Result<Option<Tokenizer>> {
    // Anything at that path (a FIFO, a device...) is loaded, so that it is refused by name;
    // only a missing file means "no tokenizer".
    if std::fs::metadata(dir.join("tiktoken.model")).is_ok() {
        Ok(Some(Tokenizer::load_expecting(dir, vocab)?))
    } else {
        Ok(None)
    }
}

/// Read `path`, refusing (without reading it whole) a file above `limit` bytes; `why` says
/// where the limit comes from.
fn read_prompt_file(path: &Path, limit: u64, why: &str) -> Result<String> {
    use std::io::Read;
    let shown = crate::stream::shown(path);
    let file = std::fs::File::open(path)
        .map_err(|e| Error::Usage(format!("--prompt-file {shown}: {e}")))?;
    let too_big = |size: String| {
        Error::Usage(format!(
            "--prompt-file {shown}: {size} is more than {limit} bytes ({why})"
        ))
    };
    if let Ok(m) = file.metadata() {
        if m.is_file() && m.len() > limit {
            return Err(too_big(format!("{} bytes", m.len())));
        }
    }
    // A pipe or a file that grows has no size up front: read at most one byte past the limit.
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| Error::Usage(format!("--prompt-file {shown}: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(too_big("the input".into()));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::Usage(format!(
            "--prompt-file {shown}: not UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The prompt as token ids. A `--prompt-file` that cannot fit in `context` tokens even at the
/// longest token's length is refused before it is read whole.
fn prompt_ids(args: &RunArgs, tok: Option<&Tokenizer>, context: usize) -> Result<Vec<u32>> {
    if let Some(ids) = &args.ids {
        return parse_ids(ids);
    }
    let need_tok = || {
        tok.ok_or_else(|| {
            Error::Usage(
                "a text prompt needs tiktoken.model in the model directory; use --ids".into(),
            )
        })
    };
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(path)) => {
            let longest = need_tok()?.longest_token_bytes();
            let fit = (context as u64).saturating_mul(longest as u64);
            let (limit, why) = if fit < MAX_PROMPT_FILE_BYTES {
                (
                    fit,
                    format!(
                        "{context} tokens of --context at most {longest} bytes each; \
                         raise --context or shorten the prompt"
                    ),
                )
            } else {
                (MAX_PROMPT_FILE_BYTES, "the prompt-file cap".to_string())
            };
            read_prompt_file(path, limit, &why)?
        }
        (None, None) => return Err(Error::Usage("give --prompt, --prompt-file or --ids".into())),
    };
    Ok(need_tok()?.encode(&text, true))
}

/// The most compute threads `--threads` accepts: 8 per available core, and never above 1024.
#[must_use]
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    cores.saturating_mul(8).min(1024)
}

/// Size the compute pool (`--threads`); `None` keeps one thread per core.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            return Err(Error::Usage("--threads must be at least 1".into()));
        }
        let max = max_threads();
        if n > max {
            return Err(Error::Usage(format!(
                "--threads {n} is above the limit of {max} (8 per available core, at most 1024)"
            )));
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| Error::Usage(format!("--threads: {e}")))?;
    }
    Ok(())
}

/// The engine's figures for `--json`.
fn run_stats(model: &Model, info: &crate::engine::weights::LoadInfo) -> serde_json::Value {
    let plan = &info.plan;
    let mut j = serde_json::json!({
        "budget_bytes": plan.budget_bytes,
        "model_bytes": plan.model_bytes,
        "pinned_layers": plan.n_pinned(),
        "expert_slots": plan.expert_slots,
        "load_bytes_read": info.bytes_read,
    });
    // A model under a plan reports what it read and how its cache and predictions did.
    let streamed = model.store().planned().is_some();
    if let (true, Some(o)) = (streamed, j.as_object_mut()) {
        let st = model.stats();
        o.insert("disk_bytes_read".into(), st.disk_bytes_read.into());
        o.insert("expert_hits".into(), st.expert_hits.into());
        o.insert("expert_misses".into(), st.expert_misses.into());
        o.insert("expert_hit_rate".into(), st.expert_hit_rate().into());
        o.insert("io_wait_seconds".into(), st.io_wait_seconds.into());
        o.insert("prefetch_reads".into(), st.prefetch_reads.into());
        o.insert("prefetch_used".into(), st.prefetch_used.into());
        o.insert("predicted".into(), st.predicted.into());
        o.insert("predicted_right".into(), st.predicted_right.into());
        o.insert("prefetch_cancelled".into(), st.prefetch_cancelled.into());
        o.insert("ring_bytes".into(), st.ring_bytes.into());
        o.insert("stage_bytes".into(), st.stage_bytes.into());
        o.insert("predictions".into(), st.predictions.into());
        o.insert(
            "prediction_accuracy_by_rank".into(),
            st.prediction_accuracy_by_rank().into(),
        );
        o.insert("early_predictions".into(), st.early_predictions.into());
        o.insert(
            "early_prediction_accuracy_by_rank".into(),
            st.early_prediction_accuracy_by_rank().into(),
        );
        if let Ok(e) = serde_json::to_value(&st.early) {
            o.insert("early_prediction".into(), e);
        }
        if let Ok(a) = serde_json::to_value(&st.arena) {
            o.insert("expert_arena".into(), a);
        }
    }
    j
}

/// The sampler of `k3 run`: the flags over the user config file's `[sampling]` over the model's
/// `generation_config.json` over greedy decoding; and the line saying where each value came from.
pub(crate) fn sampling(args: &RunArgs, model_dir: &Path) -> Result<(SamplerConfig, String)> {
    use crate::session::defaults::{self, SamplingLayer, Source};
    let user = super::config::Config::load().map_err(|e| Error::Usage(e.to_string()))?;
    let gen = defaults::GenerationConfig::load(model_dir)?;
    for note in gen.iter().flat_map(|g| &g.notes) {
        eprintln!("k3: {note}");
    }
    let flags = args.sampling.layer();
    // Only the sampler's keys: --gen and --context set the length here.
    let user = SamplingLayer {
        max_tokens: None,
        raw_max_tokens: None,
        context: None,
        ..user.sampling
    };
    let none = SamplingLayer::default();
    let gen_layer = gen.as_ref().map_or(none, |g| SamplingLayer {
        max_tokens: None,
        ..g.layer.clone()
    });
    let (s, sources) = defaults::resolve(
        crate::session::chat::Settings::default(),
        &[
            (Source::Model, &gen_layer),
            (Source::UserConfig, &user),
            (Source::Flag, &flags),
        ],
    );
    let mut line = sources.line(&s);
    // max_tokens is --gen here.
    if let Some(i) = line.find(", max_tokens ") {
        line.truncate(i);
    }
    Ok((s.sampler, line))
}

/// What `k3 run` (one prompt or `--prompts`) checks first: the model directory (the demo
/// model's when none is given), the budget asked for, the context, and the model's config.
pub(crate) fn model_of(
    args: &RunArgs,
) -> Result<(
    PathBuf,
    crate::stream::budget::BudgetRequest,
    crate::engine::ModelConfig,
)> {
    let model_dir = match &args.model_dir {
        Some(d) => d.clone(),
        None => super::demo::materialise()?,
    };
    let req = args
        .budget
        .request(crate::stream::budget::BudgetRequest::Resident)?;
    if args.context > MAX_CONTEXT {
        return Err(Error::Usage(format!(
            "--context {} is above the limit of {MAX_CONTEXT} positions",
            args.context
        )));
    }
    let cfg = crate::engine::ModelConfig::load(&model_dir.join("config.json"))?;
    Ok((model_dir, req, cfg))
}

/// The tokenizer of the model in `dir` whose config is `cfg` (None where it ships none).
pub(crate) fn tokenizer_of(
    dir: &Path,
    cfg: &crate::engine::ModelConfig,
) -> Result<Option<Tokenizer>> {
    let vocab =
        u32::try_from(cfg.vocab_size).map_err(|_| Error::Usage("vocab_size above u32".into()))?;
    load_tokenizer(dir, vocab)
}

/// Run `k3 run`.
/// Over 100 lines: `k3 run` is one pass in order (check, open, prefill, decode, report) whose
/// figures are gathered along the way and reported together at the end.
pub fn run(args: &RunArgs) -> Result<()> {
    if args.parallel.is_some() {
        return Err(Error::Usage(
            "--parallel sets how many --prompts are decoded together; give --prompts FILE".into(),
        ));
    }
    set_threads(args.threads)?;
    // The prompt is measured before any weight is read: the config gives the vocabulary, the
    // tokenizer the length.
    let (model_dir, req, cfg) = model_of(args)?;
    // The model's config.json is checked first, then the files that choose the sampler.
    let (sampler_cfg, sampling_line) = sampling(args, &model_dir)?;
    let mut sampler = Sampler::new(sampler_cfg).map_err(|e| Error::Usage(e.to_string()))?;
    let vocab = cfg.vocab_size;
    let tok = tokenizer_of(&model_dir, &cfg)?;
    let prompt = prompt_ids(args, tok.as_ref(), args.context)?;
    if prompt.is_empty() {
        return Err(Error::Usage("the prompt is empty".into()));
    }
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Usage(format!(
            "token id {bad} is outside the vocabulary (0..{vocab})"
        )));
    }
    let positions = prompt.len().saturating_add(args.gen);
    if positions > args.context {
        return Err(Error::Usage(format!(
            "the prompt is {} token{} and --gen is {}: {positions} positions exceed --context \
             {} (raise --context or shorten the prompt)",
            prompt.len(),
            if prompt.len() == 1 { "" } else { "s" },
            args.gen,
            args.context
        )));
    }
    // The plan reserves carried state for exactly the positions this run holds.
    let t_open = Instant::now();
    let (model, info) = Model::open_with(
        &model_dir,
        &crate::engine::weights::OpenOptions {
            budget: req,
            context: positions as u64,
            trunk: args.budget.trunk.clone(),
            ..Default::default()
        },
    )
    .map_err(|e| match e {
        crate::engine::weights::LoadError::Budget(m) => Error::Usage(format!(
            "{m} (the plan holds state for {positions} positions: {} + --gen {})",
            super::words::count(prompt.len() as u64, "prompt token"),
            args.gen
        )),
        e => e.into(),
    })?;
    let load_bytes = info.bytes_read;
    let load_s = t_open.elapsed().as_secs_f64();
    let mut dump = match &args.dump_logits {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).map_err(
            |e| Error::Write {
                path: p.display().to_string(),
                source: e,
            },
        )?)),
        None => None,
    };
    let mut state = SeqState::new(&model.cfg);
    state.reserve(positions, &model.cfg);
    let t0 = Instant::now();
    // Prefill in the chunks the plan's activation reserve is sized for; only the last chunk's
    // distribution is needed.
    let mut logits = Vec::new();
    let chunk_len = usize::try_from(info.plan.prefill_chunk)
        .unwrap_or(PREFILL_CHUNK)
        .max(1);
    let n_chunks = prompt.len().div_ceil(chunk_len);
    for (i, chunk) in prompt.chunks(chunk_len).enumerate() {
        logits = model.forward(&mut state, chunk, Logits::for_chunk(i, n_chunks))?;
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut history = prompt.clone();
    let mut generated = Vec::new();
    let mut stream = Utf8Stream::default();
    let mut text = String::new();
    let stdout = std::io::stdout();
    let t1 = Instant::now();
    let mut steps = Vec::with_capacity(args.gen);
    let spec_mode = args.spec.or_env_off();
    let by_distribution =
        args.spec_sampling == SpecSampling::Distribution && !sampler.config().is_greedy();
    if by_distribution && spec_mode == SpecMode::Auto {
        return Err(Error::Usage(
            "--spec-sampling distribution needs a fixed draft length (--spec N): an adaptive \
             length would change which random draws are used"
                .into(),
        ));
    }
    let mut accept = crate::engine::sampling::Rng::from_seed(sampler_cfg.seed ^ ACCEPT_STREAM);
    let mut spec = Speculator::new(spec_mode);
    let read_before = model.stats().disk_bytes_read;
    let cpu_before = CpuTicks::now();
    for step in 0..args.gen {
        if let Some(w) = dump.as_mut() {
            let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
            let path = args
                .dump_logits
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            w.write_all(&bytes)
                .map_err(|e| Error::Write { path, source: e })?;
        }
        let next = match spec.proposal().filter(|_| by_distribution) {
            Some(draft) => {
                sampler
                    .accept_or_correct(&logits, &history, draft, &mut accept)?
                    .0
            }
            None => sampler.sample(&logits, &history)?,
        };
        generated.push(next);
        history.push(next);
        if let Some(t) = &tok {
            let piece = stream.push(&t.decode_bytes(&[next])?);
            if !args.json {
                let mut out = stdout.lock();
                let _ = out.write_all(terminal_safe(&piece).as_bytes());
                let _ = out.flush();
            }
            text.push_str(&piece);
        }
        if args.stop_ids.contains(&next) || step + 1 == args.gen {
            break;
        }
        let ts = Instant::now();
        // Drafts never reach past the last position this run needs.
        let room = args.gen.saturating_sub(step + 2);
        let step_logits = spec.advance(&model, &mut state, &history, next, room)?;
        logits.clear();
        logits.extend_from_slice(step_logits);
        steps.push((spec.stats().passes, ts.elapsed().as_secs_f64()));
    }
    spec.settle(&model, &mut state);
    let steal = steal_since(cpu_before);
    let decode_read = model.stats().disk_bytes_read.saturating_sub(read_before);
    let tail = stream.finish();
    text.push_str(&tail);
    if let Some(mut w) = dump {
        let path = args
            .dump_logits
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        w.flush().map_err(|e| Error::Write { path, source: e })?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let s_per_tok = if generated.len() > 1 {
        decode_s / (generated.len() - 1) as f64
    } else {
        0.0
    };
    let median_s = median_per_token(&steps);
    let prefill_tps = prompt.len() as f64 / prefill_s.max(1e-9);
    let peak = peak_rss_bytes();
    if args.json {
        let j = serde_json::json!({
            "prompt_ids": prompt,
            "generated_ids": generated,
            "text": text,
            "load_seconds": load_s,
            "prefill_tokens_per_second": prefill_tps,
            "decode_seconds_per_token": s_per_tok,
            "decode_median_seconds_per_token": median_s,
            "peak_rss_bytes": peak,
            // The store's counter already holds the bytes its load read.
            "bytes_read": model.stats().disk_bytes_read.max(load_bytes),
            "stats": run_stats(&model, &info),
            "spec": spec_json(spec_mode, &spec.stats(), decode_read, generated.len().saturating_sub(1)),
            "kernels": kernels_json(),
            "cpu_steal_fraction": steal,
            "sampling": sampling_line,
        });
        println!("{j}");
    } else {
        print!("{}", terminal_safe(&tail));
        println!();
        eprintln!("k3: {sampling_line}");
        eprintln!(
            "k3: loaded in {load_s:.1} s; {} at {:.1} tokens/s; {} generated at {:.4} s/token ({:.4} median); peak RSS {:.1} MB",
            super::words::count(prompt.len() as u64, "prompt token"),
            prefill_tps,
            generated.len(),
            s_per_tok,
            median_s,
            peak as f64 / 1e6
        );
        if let Some(f) = steal.filter(|&f| f >= STEAL_NOTE) {
            eprintln!(
                "k3: {:.0}% of the machine's CPU time was stolen while decoding: {STEAL_MEANING}",
                100.0 * f
            );
        }
        let ss = spec.stats();
        if ss.proposed > 0 {
            eprintln!(
                "k3: speculation {spec_mode}: {:.2} tokens per pass, {} of {} proposals used",
                ss.tokens_per_pass(),
                ss.accepted,
                ss.proposed
            );
        }
    }
    Ok(())
}
