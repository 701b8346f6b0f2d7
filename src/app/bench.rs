//! `k3 bench`: prefill and decode speed under a memory budget, next to the floors this machine
//! sets — bytes that had to come off disk over its measured parallel read bandwidth, and
//! bytes touched over its measured memory bandwidth.

use super::budget_args::BudgetArgs;
use crate::engine::model::Logits;
use crate::engine::spec::{SpecMode, Speculator};
use crate::engine::{Model, SeqState};
use crate::stream::budget::BudgetRequest;
use crate::stream::stats::rss_bytes;
use crate::{Error, Result};
use clap::Args;
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `k3 bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Checkpoint directory; default: the small demo model built into k3.
    pub model_dir: Option<PathBuf>,
    /// Memory budget (default: the whole model resident).
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Tokens to decode.
    #[arg(long, default_value_t = 8)]
    pub gen: usize,
    /// Prompt tokens to prefill.
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// Positions of carried state the plan reserves; default: the prompt and the generated
    /// tokens, as `k3 run` plans, so the plan is the one `k3 run` makes at the same budget.
    #[arg(long)]
    pub context: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Speculative decoding while decoding (`off`, `auto`, or a draft length 1..=8), as
    /// `k3 run --spec`; `K3_NOSPEC=1` forces `off`.
    #[arg(long, default_value = "auto", value_parser = SpecMode::parse, value_name = "off|auto|N")]
    pub spec: SpecMode,
    /// Prompt: the first `--prompt-len` tokens of this file's text (needs the tokenizer)
    /// instead of a fixed id pattern; a prompt the model continues by repeating it measures
    /// what speculation gains.
    #[arg(long, value_name = "PATH")]
    pub prompt_file: Option<PathBuf>,
    /// Also decode this many sequences together, one pass over the weights per step
    /// (docs/batching.md#k3-bench---sequences): aggregate and per-sequence tokens/s and bytes
    /// read per generated token. Sequence `i`'s prompt is the prompt with `i` added to each id.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub sequences: usize,
}

/// Most sequences `--sequences` accepts: the rows whose activations the plan reserves.
const MAX_SEQUENCES: usize = crate::stream::budget::MIN_PREFILL_CHUNK as usize;

/// What `k3 bench --sequences N` measured: N prompts prefilled alone, then `gen` batched
/// greedy steps.
struct BatchFigures {
    /// Seconds of the batched steps.
    seconds: f64,
    /// Bytes read during them.
    bytes_read: u64,
    /// Each sequence's generated ids.
    ids: Vec<Vec<u32>>,
}

/// Decode `n` sequences together for `gen` greedy steps after prompts derived from `prompt`
/// (sequence `i` adds `i` to each id, modulo the vocabulary).
fn bench_batch(model: &Model, prompt: &[u32], n: usize, gen: usize) -> Result<BatchFigures> {
    let vocab = model.cfg.vocab_size;
    let mut states = Vec::with_capacity(n);
    let mut ids: Vec<Vec<u32>> = Vec::with_capacity(n);
    for i in 0..n {
        let p: Vec<u32> = prompt
            .iter()
            .map(|&t| ((t as usize + i) % vocab) as u32)
            .collect();
        let mut st = SeqState::new(&model.cfg);
        let logits = model.forward(&mut st, &p, Logits::Last)?;
        states.push(st);
        ids.push(vec![crate::kernels::argmax(&logits)]);
    }
    let mut run = crate::engine::RunState::new();
    let read0 = model.stats().disk_bytes_read;
    let t = Instant::now();
    // The first ids came from the prefills; each step feeds the last and yields the next.
    for _ in 1..gen {
        let tokens: Vec<u32> = ids.iter().map(|v| v[v.len() - 1]).collect();
        let mut seqs: Vec<&mut SeqState> = states.iter_mut().collect();
        let logits = model.forward_batch(&mut seqs, &mut run, &tokens)?;
        for (v, row) in ids.iter_mut().zip(logits.chunks(vocab)) {
            v.push(crate::kernels::argmax(row));
        }
    }
    Ok(BatchFigures {
        seconds: t.elapsed().as_secs_f64(),
        bytes_read: model.stats().disk_bytes_read - read0,
        ids,
    })
}

/// Memory read bandwidth as the shared harness's probe (`membw`, its "read" figure) takes it:
/// one streaming read over a 512 MiB array split among every thread, the best of eight passes
/// (bytes/s). Each 1 MiB piece is reduced by the dot-product kernel against itself, so the
/// array is read once and the arithmetic keeps up with memory.
fn memory_bandwidth() -> f64 {
    let n = 128 << 20;
    let a = vec![1.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..8 {
        let t = Instant::now();
        let s: f32 = a
            .par_chunks(1 << 18)
            .map(|x| crate::kernels::dot(x, x))
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 4) as f64 / best
}

/// One way of reading the checkpoint's device that the bandwidth probe times.
#[derive(Clone, Copy, Debug)]
struct ReadPattern {
    /// Bytes per read (a multiple of 4096, as `O_DIRECT` needs).
    chunk: usize,
    /// Each read at a random aligned offset of its shard (as routed experts are read), or
    /// each one right after the last (as a packed trunk's layers are).
    random: bool,
}

impl ReadPattern {
    fn name(&self) -> String {
        let kind = if self.random { "random" } else { "sequential" };
        if self.chunk.is_multiple_of(1 << 20) {
            format!("{kind} {} MiB", self.chunk >> 20)
        } else {
            format!("{kind} {} B", self.chunk)
        }
    }
}

/// What the disk probe measured: the best pattern's bytes/s (the floor), whether every read
/// was direct, and every pattern's figure.
struct DiskProbe {
    best: f64,
    direct: bool,
    patterns: Vec<(String, f64)>,
}

/// Read bandwidth of the checkpoint's device as the engine reads it, with four reads in
/// flight per I/O thread (fewer for large reads) over the largest shards, in the ways the
/// engine reads: expert-sized reads at random offsets (a routed expert is one read), and
/// sequential 4 and 16 MiB reads (layers and packed trunks). `O_DIRECT` where the filesystem allows it,
/// buffered with the file's cached pages dropped otherwise. The floor is the best pattern,
/// as the external harness takes its best fio job.
fn disk_bandwidth(dir: &Path, expert_bytes: u64) -> Option<DiskProbe> {
    let align = crate::stream::checkpoint::DIRECT_ALIGN;
    let expert = (expert_bytes > 0).then(|| ReadPattern {
        chunk: (expert_bytes as usize)
            .clamp(align, 16 << 20)
            .div_ceil(align)
            * align,
        random: true,
    });
    let sequential = [4 << 20, 16 << 20].map(|chunk| ReadPattern {
        chunk,
        random: false,
    });
    let mut probe = DiskProbe {
        best: 0.0,
        direct: true,
        patterns: Vec::new(),
    };
    for p in expert.into_iter().chain(sequential) {
        if let Some((bw, direct)) = time_reads(dir, p, 1_000_000_000) {
            probe.best = probe.best.max(bw);
            probe.direct &= direct;
            probe.patterns.push((p.name(), bw));
        }
    }
    (!probe.patterns.is_empty()).then_some(probe)
}

/// The most memory the disk probe's read buffers take at once.
const PROBE_BUFFERS: usize = 128 << 20;

/// The longest one pattern of the disk probe reads for.
const MAX_PATTERN_TIME: std::time::Duration = std::time::Duration::from_secs(3);

/// Bytes/s of about `bytes` (or [`MAX_PATTERN_TIME`] of reads) read in `pattern` by up to
/// four streams per I/O thread over the largest shards, and whether every stream read
/// directly.
fn time_reads(dir: &Path, pattern: ReadPattern, bytes: u64) -> Option<(f64, bool)> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut shards: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
        .collect();
    shards.sort_by_key(|s| std::cmp::Reverse(s.0));
    // Four reads in flight per I/O thread: the floor is what the device gives parallel reads
    // (the harness's best fio jobs keep 16 to 32 in flight), not what one queue gets. At most
    // `PROBE_BUFFERS` of buffers in all, so large reads keep fewer in flight.
    let io_threads = crate::stream::checkpoint::io_pool()?.current_num_threads();
    let streams = (4 * io_threads)
        .min(PROBE_BUFFERS / pattern.chunk)
        .clamp(1, 64);
    shards.truncate(streams);
    let chunk = pattern.chunk;
    let per_stream = bytes / streams as u64;
    let total = AtomicU64::new(0);
    let all_direct = AtomicBool::new(true);
    let t = Instant::now();
    let t = &t;
    let n_shards = shards.len().max(1);
    std::thread::scope(|sc| {
        for k in 0..streams {
            let Some((len, path)) = shards.get(k % n_shards).cloned() else {
                break;
            };
            let (total, all_direct) = (&total, &all_direct);
            sc.spawn(move || {
                let direct = crate::stream::checkpoint::open_direct(&path);
                all_direct.fetch_and(direct.is_some(), Ordering::Relaxed);
                let Some(f) = direct.or_else(|| std::fs::File::open(&path).ok()) else {
                    return;
                };
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                let mut buf = crate::stream::checkpoint::AlignedBuf::new(chunk);
                // Whole aligned reads that fit in the shard.
                let span = len.saturating_sub(chunk as u64) / 4096;
                // Streams sharing a shard start at different offsets.
                let mut at = ((k / n_shards) % 4) as u64 * (span / 4).max(1) * 4096;
                // A fixed sequence of offsets per stream.
                let mut rng = crate::engine::sampling::Rng::from_seed(k as u64 + 1);
                let mut got = 0u64;
                // Bytes or seconds, whichever runs out first (small reads are slow).
                while got < per_stream && len >= chunk as u64 && t.elapsed() < MAX_PATTERN_TIME {
                    if pattern.random {
                        at = (rng.next_u64() % (span + 1)) * 4096;
                    } else if at + chunk as u64 > len {
                        at = 0;
                    }
                    match f.read_at(buf.as_mut_slice(), at) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            got += n as u64;
                            at += n as u64;
                        }
                    }
                }
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                total.fetch_add(got, Ordering::Relaxed);
            });
        }
    });
    let s = t.elapsed().as_secs_f64();
    let total = total.load(Ordering::Relaxed);
    (total > 0 && s > 0.0).then(|| (total as f64 / s, all_direct.load(Ordering::Relaxed)))
}

/// Run `k3 bench`.
/// Over 100 lines: one measurement in order (open, prefill, decode, the bandwidth probes) and
/// the one report of its figures, as JSON or as the text table.
pub fn run(args: &BenchArgs) -> Result<()> {
    if args.gen == 0 || args.prompt_len == 0 {
        return Err(Error::Usage(
            "--gen and --prompt-len must be at least 1".into(),
        ));
    }
    if args.sequences == 0 || args.sequences > MAX_SEQUENCES {
        return Err(Error::Usage(format!(
            "--sequences {}: expected 1 to {MAX_SEQUENCES}",
            args.sequences
        )));
    }
    let model_dir = match &args.model_dir {
        Some(d) => d.clone(),
        None => super::demo::materialise()?,
    };
    let req = args.budget.request(BudgetRequest::Resident)?;
    let t_open = Instant::now();
    let (model, info) = Model::open_with(
        &model_dir,
        &crate::engine::weights::OpenOptions {
            budget: req,
            context: args
                .context
                .unwrap_or((args.prompt_len + args.gen) as u64)
                .max((args.prompt_len + args.gen) as u64),
            states: args.sequences as u64,
            trunk: args.budget.trunk.clone(),
            ..Default::default()
        },
    )?;
    let open_s = t_open.elapsed().as_secs_f64();
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = match &args.prompt_file {
        None => (0..args.prompt_len as u32)
            .map(|i| (i * 7 + 3) % vocab)
            .collect(),
        Some(path) => {
            let text = crate::stream::read_capped(path, 256 << 20)
                .map_err(|e| e.to_string())
                .and_then(|b| String::from_utf8(b).map_err(|e| e.to_string()))
                .map_err(|e| Error::Usage(format!("--prompt-file {}: {e}", path.display())))?;
            let tok = crate::session::tokenizer::Tokenizer::load_expecting(&model_dir, vocab)?;
            let mut ids = tok.encode(&text, true);
            ids.truncate(args.prompt_len);
            ids
        }
    };
    let read_now = || model.stats().disk_bytes_read;
    let mut st = SeqState::new(&model.cfg);
    let t0 = Instant::now();
    let mut logits = model.forward(&mut st, &prompt, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let read0 = read_now();
    let cpu_before = crate::stream::stats::CpuTicks::now();
    let t1 = Instant::now();
    let mut steps = Vec::with_capacity(args.gen);
    let spec_mode = args.spec.or_env_off();
    let mut spec = Speculator::new(spec_mode);
    let mut history = prompt.clone();
    for i in 0..args.gen {
        let ts = Instant::now();
        let next = crate::kernels::argmax(&logits);
        history.push(next);
        let room = args.gen - i - 1;
        let step_logits = spec.advance(&model, &mut st, &history, next, room)?;
        logits.clear();
        logits.extend_from_slice(step_logits);
        steps.push((spec.stats().passes, ts.elapsed().as_secs_f64()));
    }
    spec.settle(&model, &mut st);
    let steal = super::run::steal_since(cpu_before);
    let decode_s = t1.elapsed().as_secs_f64() / args.gen as f64;
    let batch = if args.sequences > 1 {
        drop(st);
        Some(bench_batch(&model, &prompt, args.sequences, args.gen)?)
    } else {
        None
    };
    // Tokens the batched steps generated (the first of each sequence came from its prefill).
    let batch_json = batch.as_ref().map(|b| {
        let n = args.sequences;
        let tokens = (n * (args.gen - 1)) as f64;
        let tps = if b.seconds > 0.0 {
            tokens / b.seconds
        } else {
            0.0
        };
        serde_json::json!({
            "sequences": n,
            "steps": args.gen - 1,
            "seconds": b.seconds,
            "aggregate_tokens_per_second": tps,
            "per_sequence_tokens_per_second": tps / n as f64,
            "one_sequence_tokens_per_second": 1.0 / decode_s,
            "speedup": tps * decode_s,
            "bytes_read_per_token": if tokens > 0.0 { b.bytes_read as f64 / tokens } else { 0.0 },
            "generated_ids": b.ids,
        })
    });
    let median_s = super::run::median_per_token(&steps);
    let read_per_tok = (read_now() - read0) as f64 / args.gen as f64;
    // Peak RSS before the bandwidth probes, whose buffers (512 MiB for the memory, at most
    // `PROBE_BUFFERS` for the disk) are not the engine's.
    let peak = rss_bytes().1;
    let mem_bw = memory_bandwidth();
    let sizes = &info.sizes;
    // After the timed passes, so the engine's reads and the probe's do not share the disk.
    let disk = disk_bandwidth(&model_dir, sizes.expert_bytes);
    let disk_bw = disk.as_ref().map(|d| (d.best, d.direct));
    let touched = sizes.layer_trunk.iter().sum::<u64>() as f64
        + sizes.head as f64
        + (sizes.top_k * sizes.moe_layers * sizes.expert_bytes) as f64;
    let mem_floor = touched / mem_bw;
    let io_floor = disk_bw.map(|(bw, _)| read_per_tok / bw);
    let j = serde_json::json!({
        "budget_bytes": info.plan.budget_bytes,
        "model_bytes": info.plan.model_bytes,
        "pinned_layers": info.plan.n_pinned(),
        "expert_slots": info.plan.expert_slots,
        "open_seconds": open_s,
        "prefill_tokens_per_second": args.prompt_len as f64 / prefill_s,
        "decode_seconds_per_token": decode_s,
        "decode_median_seconds_per_token": median_s,
        "bytes_read_per_token": read_per_tok,
        "disk_mb_per_s": if decode_s > 0.0 { read_per_tok / decode_s / 1e6 } else { 0.0 },
        "peak_rss_bytes": peak,
        "memory_bandwidth_gb_per_s": mem_bw / 1e9,
        "disk_read_gb_per_s": disk_bw.map(|(b, _)| b / 1e9),
        "disk_probe_direct": disk_bw.map(|(_, d)| d),
        "disk_probe_patterns": disk.as_ref().map(|d| {
            d.patterns
                .iter()
                .map(|(name, bw)| serde_json::json!({"pattern": name, "gb_per_s": bw / 1e9}))
                .collect::<Vec<_>>()
        }),
        "trunk": args.budget.trunk.as_ref().map(|t| t.display().to_string()),
        "direct_io": model.store().checkpoint().map(|c| c.is_direct(0)),
        "trunk_direct_io": model.store().trunk().map(|t| t.is_direct()),
        "prefetch": model.store().planned().map(|_| {
            let st = model.stats();
            serde_json::json!({
                "reads": st.prefetch_reads,
                "used": st.prefetch_used,
                "predicted": st.predicted,
                "predicted_right": st.predicted_right,
                "cancelled": st.prefetch_cancelled,
                "accuracy_by_rank": st.prediction_accuracy_by_rank(),
                "early_accuracy_by_rank": st.early_prediction_accuracy_by_rank(),
                "early": st.early,
            })
        }),
        "generated_ids": &history[prompt.len()..],
        "spec": super::run::spec_json(spec_mode, &spec.stats(), read_now() - read0, args.gen),
        "bytes_touched_per_token": touched,
        "memory_floor_seconds_per_token": mem_floor,
        "io_floor_seconds_per_token": io_floor,
        "ratio_to_memory_floor": decode_s / mem_floor,
        "ratio_to_io_floor": io_floor.filter(|f| *f > 0.0).map(|f| decode_s / f),
        "kernels": super::run::kernels_json(),
        "cpu_steal_fraction": steal,
        "batch": batch_json,
    });
    if args.json {
        println!("{j}");
        return Ok(());
    }
    println!(
        "budget               {}",
        info.plan
            .budget_bytes
            .map_or("resident".into(), crate::stream::budget::gb)
    );
    println!(
        "plan                 {} of {} layers pinned, {} expert slots",
        info.plan.n_pinned(),
        info.plan.pinned.len(),
        info.plan.expert_slots
    );
    println!(
        "kernels              {}, one-token rows {}",
        crate::kernels::isa().name(),
        crate::kernels::row_order().map_or("not chosen", crate::kernels::RowOrder::name)
    );
    println!(
        "tuning               {}",
        serde_json::to_string(crate::tuning::Tuning::get()).unwrap_or_default()
    );
    println!(
        "prefill              {:.1} tokens/s ({} token{})",
        args.prompt_len as f64 / prefill_s,
        args.prompt_len,
        if args.prompt_len == 1 { "" } else { "s" }
    );
    println!(
        "decode               {:.4} s/token mean, {:.4} median ({} token{})",
        decode_s,
        median_s,
        args.gen,
        if args.gen == 1 { "" } else { "s" }
    );
    println!(
        "read per token       {:.1} MB ({:.1} MB/s)",
        read_per_tok / 1e6,
        if decode_s > 0.0 {
            read_per_tok / decode_s / 1e6
        } else {
            0.0
        }
    );
    let ss = spec.stats();
    println!(
        "speculation          {spec_mode}: {:.2} tokens/pass, {} of {} proposals used",
        ss.tokens_per_pass(),
        ss.accepted,
        ss.proposed
    );
    if model.store().planned().is_some() {
        println!("early prediction     {}", model.stats().early.describe());
    }
    if let Some(b) = &batch_json {
        println!(
            "batched decode       {} sequences: {:.2} tokens/s together, {:.2} each ({:.2}x one \
             sequence); {:.1} MB read per token",
            args.sequences,
            b["aggregate_tokens_per_second"].as_f64().unwrap_or(0.0),
            b["per_sequence_tokens_per_second"].as_f64().unwrap_or(0.0),
            b["speedup"].as_f64().unwrap_or(0.0),
            b["bytes_read_per_token"].as_f64().unwrap_or(0.0) / 1e6,
        );
    }
    println!("peak RSS             {:.1} MB", peak as f64 / 1e6);
    println!(
        "memory floor         {:.4} s/token ({:.1} MB touched at {:.1} GB/s); measured/floor {:.2}",
        mem_floor,
        touched / 1e6,
        mem_bw / 1e9,
        decode_s / mem_floor
    );
    match (io_floor, disk_bw) {
        (Some(f), Some((bw, direct))) if f > 0.0 => {
            println!(
                "I/O floor            {f:.4} s/token at {:.2} GB/s parallel {} reads; measured/floor {:.2}",
                bw / 1e9,
                if direct { "direct" } else { "buffered" },
                decode_s / f
            );
            if let Some(d) = &disk {
                let each: Vec<String> = d
                    .patterns
                    .iter()
                    .map(|(name, bw)| format!("{name} {:.2}", bw / 1e9))
                    .collect();
                println!("disk probe           GB/s, best taken: {}", each.join(", "));
            }
        }
        _ if read_per_tok == 0.0 => println!("I/O floor            none (nothing read per token)"),
        _ => println!("I/O floor            not measured (the probe read nothing from the shards)"),
    }
    if let Some(f) = steal {
        println!(
            "cpu steal            {:.1}% of the machine's CPU time while decoding{}",
            100.0 * f,
            if f >= super::run::STEAL_NOTE {
                format!(": {}", super::run::STEAL_MEANING)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
