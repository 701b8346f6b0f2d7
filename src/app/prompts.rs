//! `k3 run --prompts FILE`: many prompts, decoded `--parallel` at a time in one pass over the
//! weights per step (docs/batching.md#k3-run---prompts). Each prompt is prefilled alone, then
//! joins the batch at the next step and leaves it when it has its tokens; every prompt's ids
//! are those `k3 run` gives it alone. One JSON line per prompt goes to stdout, in input order.

use super::run::{
    model_of, sampling as run_sampling, set_threads, terminal_safe, tokenizer_of, RunArgs,
};
use crate::engine::model::Logits;
use crate::engine::sampling::{Sampler, SamplerConfig};
use crate::engine::{Model, RunState, SeqState};
use crate::session::chat::PREFILL_CHUNK;
use crate::session::tokenizer::{Tokenizer, Utf8Stream};
use crate::{Error, Result};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// Largest `--prompts` file read: 256 MiB.
const MAX_PROMPTS_FILE_BYTES: u64 = 256 << 20;

/// Sequences decoded together when `--parallel` is not given.
pub const DEFAULT_PARALLEL: usize = 4;

/// Most sequences `--parallel` accepts: the rows whose activations the plan reserves (a
/// batched step is a pass of one row per sequence).
pub const MAX_PARALLEL: usize = crate::stream::budget::MIN_PREFILL_CHUNK as usize;

/// One JSONL line of a `--prompts` file: the prompt (text or ids) and its own settings, each
/// over the command's.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    /// Prompt text (special-token names are recognised, as in raw mode).
    prompt: Option<String>,
    /// Prompt token ids (instead of `prompt`).
    ids: Option<Vec<u32>>,
    /// Tokens to generate (`--gen`).
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    seed: Option<u64>,
    /// Ids after which this prompt stops (besides `--stop-id`).
    stop_ids: Option<Vec<u32>>,
}

/// One prompt of the file, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// Its line in the file (from 1).
    pub line: usize,
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Its sampler.
    pub sampler: SamplerConfig,
    /// Ids after which it stops.
    pub stop_ids: Vec<u32>,
}

/// What the file's lines hold, checked against the model: `vocab` ids, `context` positions.
pub struct Limits<'a> {
    /// The tokenizer, where the model has one (a text prompt needs it).
    pub tok: Option<&'a Tokenizer>,
    /// Vocabulary size.
    pub vocab: usize,
    /// Most positions a prompt and its tokens may hold.
    pub context: usize,
    /// Tokens to generate where a line does not say.
    pub max_tokens: usize,
    /// The sampler where a line does not say.
    pub sampler: SamplerConfig,
    /// Stop ids of every prompt.
    pub stop_ids: &'a [u32],
}

/// Parse a `--prompts` file: one prompt per line, as text, or as a JSON object (a line that
/// starts with `{`) with `prompt` or `ids` and optional settings. Blank lines are skipped.
/// Every problem names its line.
///
/// # Errors
/// A line is not valid JSON, has no prompt or both, an unknown key, an id outside the
/// vocabulary, a setting out of range, or more positions than `context`; the file has no
/// prompt.
pub fn parse(text: &str, lim: &Limits<'_>) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let bad = |what: String| Error::Usage(format!("--prompts line {line}: {what}"));
        if raw.trim().is_empty() {
            continue;
        }
        let p: PromptLine = if raw.trim_start().starts_with('{') {
            serde_json::from_str(raw).map_err(|e| bad(format!("not a valid prompt object: {e}")))?
        } else {
            PromptLine {
                prompt: Some(raw.to_string()),
                ..PromptLine::default()
            }
        };
        let prompt = match (p.prompt, p.ids) {
            (Some(_), Some(_)) => return Err(bad("give \"prompt\" or \"ids\", not both".into())),
            (None, None) => return Err(bad("no \"prompt\" or \"ids\"".into())),
            (None, Some(ids)) => ids,
            (Some(t), None) => lim
                .tok
                .ok_or_else(|| {
                    bad(
                        "a text prompt needs tiktoken.model in the model directory; give \"ids\""
                            .into(),
                    )
                })?
                .encode(&t, true),
        };
        if prompt.is_empty() {
            return Err(bad("the prompt is empty".into()));
        }
        let vocab = lim.vocab;
        let stop_ids = p.stop_ids.unwrap_or_default();
        if let Some(id) = prompt
            .iter()
            .chain(&stop_ids)
            .find(|&&id| id as usize >= vocab)
        {
            return Err(bad(format!(
                "token id {id} is outside the vocabulary (0..{vocab})"
            )));
        }
        let max_tokens = p.max_tokens.unwrap_or(lim.max_tokens);
        let positions = prompt.len().saturating_add(max_tokens);
        if positions > lim.context {
            return Err(bad(format!(
                "the prompt is {} and max_tokens is {max_tokens}: {positions} positions exceed \
                 --context {} (raise --context or shorten the prompt)",
                super::words::count(prompt.len() as u64, "token"),
                lim.context
            )));
        }
        let mut s = lim.sampler;
        s.temperature = p.temperature.unwrap_or(s.temperature);
        s.top_k = p.top_k.unwrap_or(s.top_k);
        s.top_p = p.top_p.unwrap_or(s.top_p);
        s.min_p = p.min_p.unwrap_or(s.min_p);
        s.repeat_penalty = p.repeat_penalty.unwrap_or(s.repeat_penalty);
        s.seed = p.seed.unwrap_or(s.seed);
        s.validate().map_err(|e| bad(e.to_string()))?;
        let mut stops = lim.stop_ids.to_vec();
        stops.extend(stop_ids);
        jobs.push(Job {
            line,
            prompt,
            max_tokens,
            sampler: s,
            stop_ids: stops,
        });
    }
    if jobs.is_empty() {
        return Err(Error::Usage("--prompts: the file holds no prompt".into()));
    }
    Ok(jobs)
}

/// Read the `--prompts` file (at most [`MAX_PROMPTS_FILE_BYTES`]), as UTF-8.
fn read(path: &Path) -> Result<String> {
    use std::io::Read;
    let shown = crate::stream::shown(path);
    let file =
        std::fs::File::open(path).map_err(|e| Error::Usage(format!("--prompts {shown}: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_PROMPTS_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::Usage(format!("--prompts {shown}: {e}")))?;
    if bytes.len() as u64 > MAX_PROMPTS_FILE_BYTES {
        return Err(Error::Usage(format!(
            "--prompts {shown}: more than {MAX_PROMPTS_FILE_BYTES} bytes"
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::Usage(format!(
            "--prompts {shown}: not UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Why a prompt's generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// It has its `max_tokens`.
    Length,
    /// It emitted one of its stop ids.
    StopId,
}

/// A prompt in flight.
struct Live {
    /// Index into the jobs.
    job: usize,
    state: SeqState,
    sampler: Sampler,
    /// The prompt and the ids generated so far.
    history: Vec<u32>,
    generated: Vec<u32>,
}

impl Live {
    /// Take the next id from `logits`; whether the prompt is done, and why.
    fn take(&mut self, job: &Job, logits: &[f32]) -> Result<Option<Stop>> {
        let next = self.sampler.sample(logits, &self.history)?;
        self.generated.push(next);
        self.history.push(next);
        Ok(if job.stop_ids.contains(&next) {
            Some(Stop::StopId)
        } else if self.generated.len() >= job.max_tokens {
            Some(Stop::Length)
        } else {
            None
        })
    }
}

/// The output line of a finished prompt.
fn result_json(job: &Job, ids: &[u32], stop: Stop, tok: Option<&Tokenizer>) -> Result<String> {
    let text = match tok {
        Some(t) => {
            let mut s = Utf8Stream::default();
            let mut text = String::new();
            for &id in ids {
                text.push_str(&s.push(&t.decode_bytes(&[id])?));
            }
            text.push_str(&s.finish());
            Some(text)
        }
        None => None,
    };
    let j = serde_json::json!({
        "line": job.line,
        "prompt_tokens": job.prompt.len(),
        "generated_tokens": ids.len(),
        "generated_ids": ids,
        "text": text,
        "stop": match stop {
            Stop::Length => "length",
            Stop::StopId => "stop_id",
        },
    });
    Ok(j.to_string())
}

/// A progress bar over the prompts, drawn on stderr when it is a terminal.
fn progress_bar(n: usize) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let bar = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("prompts [{bar:40}] {pos}/{len} {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}

/// Run `k3 run --prompts FILE`.
///
/// Over 100 lines: check every line, open the model with room for `--parallel` states, then
/// one loop that admits prompts (prefilled alone), steps the batch, and writes the finished
/// prompts in input order.
pub fn run(args: &RunArgs, path: &Path) -> Result<()> {
    set_threads(args.threads)?;
    let parallel = args.parallel.unwrap_or(DEFAULT_PARALLEL);
    if parallel == 0 || parallel > MAX_PARALLEL {
        return Err(Error::Usage(format!(
            "--parallel {parallel}: expected 1 to {MAX_PARALLEL} sequences"
        )));
    }
    if args.dump_logits.is_some() {
        return Err(Error::Usage(
            "--dump-logits writes one run's logits; it does not go with --prompts".into(),
        ));
    }
    let (model_dir, req, cfg) = model_of(args)?;
    let (sampler, sampling_line) = run_sampling(args, &model_dir)?;
    sampler
        .validate()
        .map_err(|e| Error::Usage(e.to_string()))?;
    let vocab = cfg.vocab_size;
    let tok = tokenizer_of(&model_dir, &cfg)?;
    if let Some(bad) = args.stop_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Usage(format!(
            "--stop-id {bad} is outside the vocabulary (0..{vocab})"
        )));
    }
    let jobs = parse(
        &read(path)?,
        &Limits {
            tok: tok.as_ref(),
            vocab,
            context: args.context,
            max_tokens: args.gen,
            sampler,
            stop_ids: &args.stop_ids,
        },
    )?;
    let parallel = parallel.min(jobs.len());
    let positions = jobs
        .iter()
        .map(|j| j.prompt.len() + j.max_tokens)
        .max()
        .unwrap_or(1);
    let (model, info) = Model::open_with(
        &model_dir,
        &crate::engine::weights::OpenOptions {
            budget: req,
            context: positions as u64,
            states: parallel as u64,
            trunk: args.budget.trunk.clone(),
            ..Default::default()
        },
    )
    .map_err(|e| match e {
        crate::engine::weights::LoadError::Budget(m) => Error::Usage(format!(
            "{m} (the plan holds state for {parallel} sequences of {positions} positions; \
             lower --parallel or --gen)"
        )),
        e => e.into(),
    })?;
    let chunk_len = usize::try_from(info.plan.prefill_chunk)
        .unwrap_or(PREFILL_CHUNK)
        .max(1);
    let bar = progress_bar(jobs.len());
    let stdout = std::io::stdout();
    let write_err = |e| Error::Write {
        path: "stdout".into(),
        source: e,
    };
    let mut done: Vec<Option<String>> = vec![None; jobs.len()];
    let mut written = 0;
    let mut admitted = 0;
    let mut live: Vec<Live> = Vec::with_capacity(parallel);
    let mut run = RunState::new();
    let mut prefill = RunState::new();
    let (mut steps, mut generated_total, mut widest) = (0u64, 0usize, 0usize);
    let t0 = Instant::now();
    let read_before = model.stats().disk_bytes_read;
    loop {
        // Admit prompts into free places, each prefilled alone.
        while live.len() < parallel && admitted < jobs.len() {
            let (i, job) = (admitted, &jobs[admitted]);
            admitted += 1;
            if job.max_tokens == 0 {
                done[i] = Some(result_json(job, &[], Stop::Length, tok.as_ref())?);
                continue;
            }
            let mut state = SeqState::new(&model.cfg);
            state.reserve(job.prompt.len() + job.max_tokens, &model.cfg);
            let n_chunks = job.prompt.len().div_ceil(chunk_len);
            let mut logits: &[f32] = &[];
            for (c, chunk) in job.prompt.chunks(chunk_len).enumerate() {
                logits = model.forward_run(
                    &mut state,
                    &mut prefill,
                    chunk,
                    Logits::for_chunk(c, n_chunks),
                )?;
            }
            let mut l = Live {
                job: i,
                state,
                sampler: Sampler::new(job.sampler).map_err(|e| Error::Usage(e.to_string()))?,
                history: job.prompt.clone(),
                generated: Vec::with_capacity(job.max_tokens),
            };
            generated_total += 1;
            match l.take(job, logits)? {
                Some(stop) => done[i] = Some(result_json(job, &l.generated, stop, tok.as_ref())?),
                None => live.push(l),
            }
        }
        // Write what is finished, in input order.
        let mut out = stdout.lock();
        while let Some(Some(line)) = done.get_mut(written).map(Option::take) {
            writeln!(out, "{line}").map_err(write_err)?;
            written += 1;
            bar.inc(1);
        }
        out.flush().map_err(write_err)?;
        drop(out);
        if live.is_empty() {
            break;
        }
        // One step of every prompt in flight.
        widest = widest.max(live.len());
        steps += 1;
        let tokens: Vec<u32> = live
            .iter()
            .map(|l| l.history[l.history.len() - 1])
            .collect();
        let mut seqs: Vec<&mut SeqState> = live.iter_mut().map(|l| &mut l.state).collect();
        let logits = model.forward_batch(&mut seqs, &mut run, &tokens)?;
        let mut k = 0;
        for row in logits.chunks(vocab) {
            let l = &mut live[k];
            let job = &jobs[l.job];
            generated_total += 1;
            if let Some(stop) = l.take(job, row)? {
                done[l.job] = Some(result_json(job, &l.generated, stop, tok.as_ref())?);
                live.remove(k);
            } else {
                k += 1;
            }
        }
        bar.set_message(format!("{} in flight", live.len()));
    }
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let read = model.stats().disk_bytes_read.saturating_sub(read_before);
    eprintln!("k3: {}", terminal_safe(&sampling_line));
    eprintln!(
        "k3: {} and {} generated in {secs:.1} s ({:.2} tokens/s); {} of up to {widest} \
         sequences; {:.1} MB read per generated token",
        super::words::count(jobs.len() as u64, "prompt"),
        super::words::count(generated_total as u64, "token"),
        generated_total as f64 / secs.max(1e-9),
        super::words::count(steps, "batched step"),
        read as f64 / generated_total.max(1) as f64 / 1e6,
    );
    Ok(())
}
