//! `k3 synth`: synthetic checkpoints load, run, are deterministic in the seed, route across
//! many experts, and the sparse `k3` replica is header-true and tiny on disk.

use k3::engine::{Logits, Model, ModelConfig, SeqState, Trace};
use k3::session::tokenizer::Tokenizer;
use k3::stream::Checkpoint;
use k3::synth::{self, Shape};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Write `shape` into `dir` and report what it took.
fn write(shape: Shape, dir: &Path, seed: u64) -> synth::Summary {
    let t = Instant::now();
    let s = synth::write(shape, dir, seed, &|_, _| {}).unwrap();
    println!(
        "synth {} seed {seed}: {} shards, {} tensors, {} tensor bytes, {} file bytes, {} on disk, {:.2} s",
        shape.name(),
        s.shards,
        s.tensors,
        s.tensor_bytes,
        s.file_bytes,
        s.disk_bytes,
        t.elapsed().as_secs_f64()
    );
    s
}

/// SHA-256 of every file in `dir`, by name.
fn hashes(dir: &Path) -> BTreeMap<String, [u8; 32]> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let bytes = std::fs::read(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                Sha256::digest(&bytes).into(),
            )
        })
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding: the prompt's logits, then `n` generated tokens; every logit finite.
fn greedy(m: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last).unwrap();
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..n {
        assert!(logits.iter().all(|x| x.is_finite()), "non-finite logits");
        let id = argmax(&logits);
        out.push(id);
        logits = m.forward(&mut st, &[id], Logits::Last).unwrap();
    }
    assert!(logits.iter().all(|x| x.is_finite()), "non-finite logits");
    (out, first)
}

#[test]
fn tiny_loads_runs_and_is_deterministic_in_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    let sa = write(Shape::Tiny, &a, 7);
    write(Shape::Tiny, &b, 7);
    write(Shape::Tiny, &c, 8);
    assert_eq!(sa.shards, 14);
    // 13 layers: layer 0 (23) + 8 KDA-MoE (28 + 8·6) + 4 MLA-MoE (22 + 8·6) + 5 model-level.
    assert_eq!(sa.tensors, 23 + 8 * 76 + 4 * 70 + 5);
    let (ha, hb, hc) = (hashes(&a), hashes(&b), hashes(&c));
    assert_eq!(ha, hb, "same seed must give byte-identical files");
    for (name, h) in &ha {
        if name.ends_with(".safetensors") {
            assert_ne!(
                Some(h),
                hc.get(name),
                "{name}: another seed must give other weights"
            );
        }
    }
    assert_eq!(ha["tiktoken.model"], hc["tiktoken.model"]);

    let cfg = ModelConfig::load(&a.join("config.json")).unwrap();
    assert_eq!(
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size),
        (128, 13, 512)
    );
    let mla: Vec<usize> = (0..13).filter(|&l| cfg.is_mla[l]).collect();
    assert_eq!(mla, vec![3, 7, 11, 12]);
    let tok = Tokenizer::load_expecting(&a, 512).unwrap();
    assert_eq!(tok.special_id("[BOS]"), Some(256));
    assert_eq!(tok.special_id("[PAD]"), Some(511));

    let prompt = tok.encode("hello, world", false);
    let ma = Model::load(&a).unwrap();
    let mb = Model::load(&b).unwrap();
    let mc = Model::load(&c).unwrap();
    let (ga, la) = greedy(&ma, &prompt, 6);
    let (gb, lb) = greedy(&mb, &prompt, 6);
    let (_, lc) = greedy(&mc, &prompt, 6);
    assert_eq!(ga, gb);
    assert_eq!(
        la.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        lb.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_ne!(la, lc);
    println!("tiny greedy ids: {ga:?}");
}

#[test]
fn small_loads_generates_and_spreads_routing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("small");
    let s = write(Shape::Small, &dir, 1);
    assert!(
        (300_000_000..500_000_000).contains(&s.file_bytes),
        "{} bytes",
        s.file_bytes
    );
    let t = Instant::now();
    let m = Model::load(&dir).unwrap();
    println!("small: loaded in {:.2} s", t.elapsed().as_secs_f64());
    let cfg = &m.cfg;
    assert_eq!((cfg.hidden_size, cfg.num_experts), (512, 64));
    let tok = Tokenizer::load_expecting(&dir, cfg.vocab_size as u32).unwrap();
    let text = "the quick brown fox jumps over the lazy dog while seven wizards quietly \
                vex the jumbled folk of a distant town";
    let mut prompt = tok.encode(text, false);
    prompt.truncate(32);
    assert_eq!(prompt.len(), 32, "the prompt should be at least 32 tokens");

    let mut st = SeqState::new(cfg);
    let mut trace = Trace::default();
    let logits = m
        .forward_traced(&mut st, &prompt, Logits::Last, Some(&mut trace))
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let mut used_min = usize::MAX;
    let mut per_layer = Vec::new();
    let mut total = vec![0usize; cfg.num_experts];
    for (l, r) in trace.routing.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        let mut hist = vec![0usize; cfg.num_experts];
        for (idx, w) in r {
            assert_eq!(idx.len(), cfg.num_experts_per_token);
            assert!(w.iter().all(|x| x.is_finite() && *x > 0.0));
            for &e in idx {
                hist[e] += 1;
                total[e] += 1;
            }
        }
        let used = hist.iter().filter(|&&c| c > 0).count();
        per_layer.push((l, used, hist.iter().copied().max().unwrap_or(0)));
        used_min = used_min.min(used);
    }
    println!("small routing over 32 tokens, (layer, experts used, busiest count): {per_layer:?}");
    println!("small routing histogram, all layers: {total:?}");
    assert_eq!(per_layer.len(), cfg.num_hidden_layers - 1);
    assert!(
        used_min >= cfg.num_experts / 2,
        "a layer used only {used_min} of {} experts",
        cfg.num_experts
    );

    let (ids, _) = greedy(&m, &prompt, 8);
    println!(
        "small greedy ids: {ids:?} = {:?}",
        String::from_utf8_lossy(&tok.decode_bytes(&ids).unwrap_or_default())
    );
}

#[test]
fn k3_sparse_replica_is_header_true_and_small_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("k3");
    let s = write(Shape::K3, &dir, 1);
    assert_eq!(s.shards, 96);
    let mut blocks = 0u64;
    for e in std::fs::read_dir(&dir).unwrap() {
        blocks += e.unwrap().metadata().unwrap().blocks();
    }
    let disk = blocks * 512;
    println!(
        "k3 replica: {} bytes apparent, {disk} bytes on disk",
        s.file_bytes
    );
    assert!(disk < 200_000_000, "{disk} bytes on disk");
    // File sizes are the released ones (docs/model.md#tensors-and-shards); data = file − 8 − header.
    let (mut shard_bytes, mut header_bytes) = (0u64, 0u64);
    for k in 1..=96 {
        let f =
            std::fs::File::open(dir.join(format!("model-{k:05}-of-000096.safetensors"))).unwrap();
        let mut len = [0u8; 8];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut len, 0).unwrap();
        header_bytes += 8 + u64::from_le_bytes(len);
        shard_bytes += f.metadata().unwrap().len();
    }
    assert_eq!(shard_bytes, 1_560_936_091_448);
    assert_eq!(shard_bytes - header_bytes, s.tensor_bytes);

    let cfg = ModelConfig::load(&dir.join("config.json")).unwrap();
    assert_eq!(
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size),
        (7168, 93, 163_840)
    );
    assert_eq!(cfg.is_mla.iter().filter(|&&m| m).count(), 24);

    let t = Instant::now();
    let ck = Checkpoint::open(&dir).unwrap();
    let idx = ck.index();
    let per = idx.memory_bytes() as f64 / idx.len() as f64;
    println!(
        "k3 replica: Checkpoint::open indexed {} tensors in {:.2} s; index {} bytes = {per:.1} bytes per tensor",
        idx.len(),
        t.elapsed().as_secs_f64(),
        idx.memory_bytes()
    );
    assert_eq!(idx.len(), 497_220);
    assert_eq!(
        idx.names()
            .filter(|n| n.starts_with("language_model."))
            .count(),
        497_052
    );
    let info = ck
        .info("language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_packed")
        .unwrap();
    assert_eq!(info.shape, vec![3584, 1536]);
    let a_log = ck
        .info("language_model.model.layers.0.self_attn.A_log")
        .unwrap();
    assert_eq!(
        (a_log.shape.clone(), a_log.dtype.name()),
        (vec![128], "F32")
    );
    let tok = Tokenizer::load_expecting(&dir, 163_840).unwrap();
    assert_eq!(tok.special_id("[BOS]"), Some(163_584));
    assert_eq!(tok.special_id("<|media_pad|>"), Some(163_605));

    // The memory plan for the released shape at a laptop-class budget, before any weight is
    // read: it fits in 6 GB; 3 GB is refused with the floor, the budget and the shortfall.
    let plan = |gb: &str| {
        Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("plan")
            .arg(&dir)
            .args(["--mem", gb, "--json"])
            .output()
            .unwrap()
    };
    let out = plan("6");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["model_bytes"], 1_559_965_606_912u64);
    assert_eq!(j["fits"], true);
    let planned = j["planned_bytes"].as_u64().unwrap();
    assert!(planned <= 6_000_000_000, "{planned}");
    println!(
        "k3 replica plan at 6 GB: floor {} bytes, {} pinned, {} expert slots, planned {planned}, index {} B/tensor",
        j["floor_bytes"],
        j["pinned"].as_array().unwrap().iter().filter(|p| p.as_bool() == Some(true)).count(),
        j["expert_slots"],
        j["index_bytes"].as_u64().unwrap() / j["tensors"].as_u64().unwrap()
    );
    let out = plan("3");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("floor") && err.contains("budget of 3.00 GB") && err.contains("short by"),
        "{err}"
    );
}

#[test]
fn cli_writes_atomically_and_refuses_with_exit_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t");
    let k3 = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("synth")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        (o.status.code().unwrap_or(-1), err)
    };
    let o = out.to_str().unwrap();
    let (code, err) = k3(&["tiny", o, "--seed", "3"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("wrote tiny"), "{err}");
    assert!(Model::load(&out).is_ok());
    // Nothing but the output directory is left beside it.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1);

    let (code, err) = k3(&["tiny", o]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not an empty directory"), "{err}");

    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, err) = k3(&["tiny", empty.to_str().unwrap()]);
    assert_eq!(code, 0, "an empty directory is filled: {err}");

    let (code, err) = k3(&["huge", tmp.path().join("h").to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let (code, err) = k3(&[
        "tiny",
        tmp.path().join("s").to_str().unwrap(),
        "--seed",
        "x",
    ]);
    assert_eq!(code, 2, "{err}");

    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let (code, err) = k3(&["tiny", file.join("sub").to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("file/sub"), "{err}");
}
