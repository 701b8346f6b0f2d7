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
    /// Checkpoint directory.
    pub model_dir: PathBuf,
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
}

/// Memory bandwidth of one streaming pass over 2 × 128 MiB on every thread (bytes/s).
fn memory_bandwidth() -> f64 {
    let n = 32 << 20;
    let (a, b) = (vec![1.0f32; n], vec![0.5f32; n]);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = a
            .par_chunks(1 << 20)
            .zip(b.par_chunks(1 << 20))
            .map(|(x, y)| crate::kernels::dot(x, y))
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (2 * n * 4) as f64 / best
}

/// Read bandwidth of the checkpoint's device as the engine reads it: 4 MiB `O_DIRECT` reads
/// (buffered with the page cache dropped where direct reads are refused) spread over the
/// largest shards, one stream per I/O thread, about 2 GB in all. Returns (bytes/s, direct).
fn disk_bandwidth(dir: &Path) -> Option<(f64, bool)> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut shards: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
        .collect();
    shards.sort_by_key(|s| std::cmp::Reverse(s.0));
    let pool = crate::stream::checkpoint::io_pool()?;
    let streams = pool.current_num_threads().max(1);
    shards.truncate(streams);
    let chunk = 4usize << 20;
    let per_stream = 2_000_000_000 / streams as u64;
    let total = AtomicU64::new(0);
    let all_direct = AtomicBool::new(true);
    let t = Instant::now();
    let n_shards = shards.len().max(1);
    pool.scope(|sc| {
        for k in 0..streams {
            let Some((len, path)) = shards.get(k % n_shards).cloned() else {
                break;
            };
            let (total, all_direct) = (&total, &all_direct);
            sc.spawn(move |_| {
                let direct = crate::stream::checkpoint::open_direct(&path);
                all_direct.fetch_and(direct.is_some(), Ordering::Relaxed);
                let Some(f) = direct.or_else(|| std::fs::File::open(&path).ok()) else {
                    return;
                };
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                let mut buf = crate::stream::checkpoint::AlignedBuf::new(chunk);
                // Streams sharing a shard start at different offsets.
                let span = len / chunk as u64;
                let mut at = (k / n_shards) as u64 * (span / 4).max(1) * chunk as u64;
                let mut got = 0u64;
                while got < per_stream && span > 0 {
                    if at + chunk as u64 > len {
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

/// Run `k3 bench`.
pub fn run(args: &BenchArgs) -> Result<()> {
    if args.gen == 0 || args.prompt_len == 0 {
        return Err(Error::Usage(
            "--gen and --prompt-len must be at least 1".into(),
        ));
    }
    let disk_bw = disk_bandwidth(&args.model_dir);
    let req = args.budget.request(BudgetRequest::Resident)?;
    let t_open = Instant::now();
    let (model, info) = Model::open_with(
        &args.model_dir,
        &crate::engine::weights::OpenOptions {
            budget: req,
            context: args
                .context
                .unwrap_or((args.prompt_len + args.gen) as u64)
                .max((args.prompt_len + args.gen) as u64),
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
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Usage(format!("--prompt-file {}: {e}", path.display())))?;
            let tok = crate::session::tokenizer::Tokenizer::load_expecting(&args.model_dir, vocab)?;
            let mut ids = tok.encode(&text, true);
            ids.truncate(args.prompt_len);
            ids
        }
    };
    let read_now = || model.streamer().map_or(0, |s| s.stats().disk_bytes_read);
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
    let median_s = super::run::median_per_token(&steps);
    let read_per_tok = (read_now() - read0) as f64 / args.gen as f64;
    // Peak RSS before the bandwidth probe, whose 256 MiB of buffers are not the engine's.
    let peak = rss_bytes().1;
    let mem_bw = memory_bandwidth();
    let sizes = &info.sizes;
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
        "trunk": args.budget.trunk.as_ref().map(|t| t.display().to_string()),
        "direct_io": model.streamer().map(|s| s.checkpoint().is_direct(0)),
        "trunk_direct_io": model.streamer().and_then(|s| s.trunk()).map(|t| t.is_direct()),
        "prefetch": model.streamer().map(|s| {
            let st = s.stats();
            serde_json::json!({
                "reads": st.prefetch_reads,
                "used": st.prefetch_used,
                "predicted": st.predicted,
                "predicted_right": st.predicted_right,
                "cancelled": st.prefetch_cancelled,
                "accuracy_by_rank": st.prediction_accuracy_by_rank(),
                "early_accuracy_by_rank": st.early_prediction_accuracy_by_rank(),
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
        crate::kernels::row_order().map_or("still being timed", crate::kernels::RowOrder::name)
    );
    println!(
        "prefill              {:.1} tokens/s ({} tokens)",
        args.prompt_len as f64 / prefill_s,
        args.prompt_len
    );
    println!(
        "decode               {:.4} s/token mean, {:.4} median ({} tokens)",
        decode_s, median_s, args.gen
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
    println!("peak RSS             {:.1} MB", peak as f64 / 1e6);
    println!(
        "memory floor         {:.4} s/token ({:.1} MB touched at {:.1} GB/s); measured/floor {:.2}",
        mem_floor,
        touched / 1e6,
        mem_bw / 1e9,
        decode_s / mem_floor
    );
    match (io_floor, disk_bw) {
        (Some(f), Some((bw, direct))) if f > 0.0 => println!(
            "I/O floor            {f:.4} s/token at {:.2} GB/s parallel {} reads; measured/floor {:.2}",
            bw / 1e9,
            if direct { "direct" } else { "buffered" },
            decode_s / f
        ),
        _ => println!("I/O floor            none (nothing read per token)"),
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
