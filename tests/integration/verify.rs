//! `k3 verify` through the real binary: a clean synthetic checkpoint passes; each kind of
//! damage (an all-zero tensor, NaN and Inf values, NaN MXFP4 scales, a tokenizer with swapped,
//! repeated or missing ranks, a wrong SHA-256 line, a flipped byte in a packed trunk) fails
//! with exit 3 and names what is wrong.

use crate::common::k3_command;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// A scratch copy of a checkpoint written by `k3 synth tiny`.
fn synth_tiny() -> (tempfile::TempDir, PathBuf) {
    static SRC: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let src = SRC.get_or_init(|| {
        let dir = crate::common::process_scratch("verify-tiny");
        crate::common::run_ok(k3_command().args(["synth", "tiny"]).arg(dir.join("tiny")));
        dir
    });
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("tiny");
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(src.join("tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    (tmp, dst)
}

/// `k3 verify ARGS`: (exit code, stdout, stderr).
fn verify(args: &[&str]) -> (i32, String, String) {
    let out = k3_command().arg("verify").args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        err,
    )
}

/// Where tensor `name` lies: (shard path, absolute offset, byte length, dtype).
fn locate(dir: &Path, name: &str) -> (PathBuf, usize, usize, String) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let shard = dir.join(index["weight_map"][name].as_str().unwrap());
    let bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let o = &h[name]["data_offsets"];
    let (a, b) = (
        o[0].as_u64().unwrap() as usize,
        o[1].as_u64().unwrap() as usize,
    );
    let dtype = h[name]["dtype"].as_str().unwrap().to_string();
    (shard, 8 + n + a, b - a, dtype)
}

/// The first tensor name in the index ending with `suffix`.
fn first_ending(dir: &Path, suffix: &str) -> String {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let mut names: Vec<&String> = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.ends_with(suffix))
        .collect();
    names.sort();
    names[0].clone()
}

/// Overwrite bytes of tensor `name` in place, starting `at` bytes into it.
fn poke(dir: &Path, name: &str, at: usize, new: &[u8]) {
    let (shard, off, len, _) = locate(dir, name);
    assert!(at + new.len() <= len);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[off + at..off + at + new.len()].copy_from_slice(new);
    std::fs::write(&shard, &bytes).unwrap();
}

fn sha256_hex(path: &Path) -> String {
    let d = Sha256::digest(std::fs::read(path).unwrap());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_clean_synthetic_checkpoint_passes() {
    let (_t, dir) = synth_tiny();
    let d = dir.to_str().unwrap();
    let (code, out, err) = verify(&[d]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("all checks passed"), "{out}");
    let (code, out, err) = verify(&[d, "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["problem_count"], 0);
    assert_eq!(v["all_zero_tensors"], 0);
    assert_eq!(v["non_finite_tensors"], 0);
    assert_eq!(v["shards"].as_u64().unwrap(), shards(&dir).len() as u64);
    assert!(v["tensors"].as_u64().unwrap() > 100, "{v}");
    // Every shard's bytes are read once: the tensor bytes are all of the data.
    let total: u64 = shards(&dir)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(v["shard_bytes"].as_u64().unwrap(), total);
    assert!(v["tensor_bytes"].as_u64().unwrap() < total);
    assert!(v["tokenizer_ranks"].as_u64().unwrap() >= 256);
    assert_eq!(v["tokenizer_unmerged"], 0);
}

#[test]
fn an_all_zero_tensor_fails_naming_it() {
    let (_t, dir) = synth_tiny();
    let name = first_ending(&dir, "post_attention_layernorm.weight");
    let (_, _, len, dtype) = locate(&dir, &name);
    assert_eq!(dtype, "BF16");
    poke(&dir, &name, 0, &vec![0u8; len]);
    let (code, out, err) = verify(&[dir.to_str().unwrap()]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains(&format!("{name:?}")), "{out}");
    assert!(out.contains("all zeros"), "{out}");
    assert!(out.contains("FAILED, 1 problem"), "{out}");
}

#[test]
fn non_finite_values_and_nan_scales_fail() {
    let (_t, dir) = synth_tiny();
    // A BF16 NaN, an F32 +Inf, an E8M0 scale byte of 255.
    let bf16 = first_ending(&dir, "input_layernorm.weight");
    poke(&dir, &bf16, 2 * 3, &0x7fc0u16.to_le_bytes());
    let f32n = first_ending(&dir, "dt_bias");
    assert_eq!(locate(&dir, &f32n).3, "F32");
    poke(&dir, &f32n, 4, &f32::INFINITY.to_le_bytes());
    let scale = first_ending(&dir, "weight_scale");
    assert_eq!(locate(&dir, &scale).3, "U8");
    poke(&dir, &scale, 5, &[255]);
    let (code, out, err) = verify(&[dir.to_str().unwrap(), "--json"]);
    assert_eq!(code, 3, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["non_finite_tensors"], 2, "{v}");
    assert_eq!(v["non_finite_values"], 2, "{v}");
    assert_eq!(v["nan_scale_tensors"], 1, "{v}");
    let problems = v["problems"].to_string();
    assert!(
        problems.contains(&bf16) && problems.contains("1 NaN"),
        "{problems}"
    );
    assert!(problems.contains("element 3"), "{problems}");
    assert!(
        problems.contains(&f32n) && problems.contains("1 infinite"),
        "{problems}"
    );
    assert!(
        problems.contains(&scale) && problems.contains("NaN scales"),
        "{problems}"
    );
}

#[test]
fn a_tokenizer_with_swapped_repeated_or_missing_ranks_fails() {
    let (_t, dir) = synth_tiny();
    let d = dir.to_str().unwrap();
    let path = dir.join("tiktoken.model");
    let orig = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = orig.lines().collect();
    assert!(lines[3].ends_with(" 3") && lines[4].ends_with(" 4"));
    let token = |l: &str| l.split(' ').next().unwrap().to_string();
    let write = |ls: &[String]| std::fs::write(&path, ls.join("\n") + "\n").unwrap();
    let owned: Vec<String> = lines.iter().map(|s| (*s).to_string()).collect();

    // Ranks 3 and 4 swapped: every line still well-formed, no duplicate, no hole.
    let mut swapped = owned.clone();
    swapped[3] = format!("{} 3", token(lines[4]));
    swapped[4] = format!("{} 4", token(lines[3]));
    write(&swapped);
    let (code, out, err) = verify(&[d]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(
        out.contains("rank 3 holds") && out.contains("rank 4 holds"),
        "{out}"
    );
    assert!(out.contains("ranks swapped?"), "{out}");

    // A token repeated (rank 5 given rank 4's bytes).
    let mut dup = owned.clone();
    dup[5] = format!("{} 5", token(lines[4]));
    write(&dup);
    let (code, out, err) = verify(&[d]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("found token bytes"), "{out}");
    assert!(out.contains("again (rank 4"), "{out}");

    // A rank repeated and a hole: rank 7 written as 6.
    let mut hole = owned.clone();
    hole[7] = format!("{} 6", token(lines[7]));
    write(&hole);
    let (code, out, err) = verify(&[d]);
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("found rank 6 again"), "{out}");
    assert!(out.contains("rank 7 is missing"), "{out}");

    std::fs::write(&path, &orig).unwrap();
    let (code, out, err) = verify(&[d]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn sha256_sums_are_checked_per_shard() {
    let (tmp, dir) = synth_tiny();
    let d = dir.to_str().unwrap();
    let shards = shards(&dir);
    let mut lines: Vec<String> = shards
        .iter()
        .map(|p| {
            format!(
                "{}  {}",
                sha256_hex(p),
                p.file_name().unwrap().to_string_lossy()
            )
        })
        .collect();
    lines.push(format!(
        "{} *./config.json",
        sha256_hex(&dir.join("config.json"))
    ));
    let sums = tmp.path().join("SHA256SUMS");
    std::fs::write(&sums, lines.join("\n") + "\n").unwrap();
    let s = sums.to_str().unwrap();
    let (code, out, err) = verify(&[d, "--sha256", s, "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let n = shards.len() as u64 + 1;
    assert_eq!(v["sha256"]["checked"].as_u64().unwrap(), n, "{v}");
    assert_eq!(v["sha256"]["matched"].as_u64().unwrap(), n, "{v}");

    // One wrong digit in the second shard's line.
    let mut wrong = lines.clone();
    let first = if wrong[1].starts_with('0') { "1" } else { "0" };
    wrong[1].replace_range(..1, first);
    std::fs::write(&sums, wrong.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&[d, "--sha256", s]);
    assert_eq!(code, 3, "{out}{err}");
    let name = shards[1]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(out.contains(&format!("{name}: SHA-256")), "{out}");
    assert!(out.contains("FAILED, 1 problem"), "{out}");

    // A shard without a line, and a line that is not a sums line.
    let mut short = lines[1..].to_vec();
    short.push("not a sums line".into());
    std::fs::write(&sums, short.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&[d, "--sha256", s]);
    assert_eq!(code, 3, "{out}{err}");
    let name = shards[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(out.contains(&format!("shard {name} has no line")), "{out}");
    assert!(out.contains("expected `<64 hex digits>"), "{out}");
}

#[test]
fn a_trunk_with_one_byte_flipped_fails() {
    let (tmp, dir) = synth_tiny();
    let d = dir.to_str().unwrap();
    for (raw, codec) in [(true, ""), (false, "entropy"), (false, "nibble")] {
        let t = tmp.path().join(format!("trunk-{raw}-{codec}"));
        let ts = t.to_str().unwrap();
        let mut pack = k3_command();
        pack.args(["pack", d, ts]);
        if !raw {
            pack.args(["--encode", "--codec", codec]);
        }
        crate::common::run_ok(&mut pack);
        let (code, out, err) = verify(&[d, "--trunk", ts, "--json"]);
        assert_eq!(code, 0, "{out}{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(v["trunk"]["layers"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(v["trunk"]["differing_tensors"], 0);
        // Each of these trunks is encoded (the first by default): it holds the output head
        // too, and the head is compared.
        assert_eq!(v["trunk"]["head"], true, "{v}");

        // Flip one byte of the first tensor of layer 1 (raw), or inside the blocks of its
        // first encoded tensor.
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(t.join("trunk.json")).unwrap()).unwrap();
        let l1 = &m["layers"][1];
        let (name, first) = l1["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, t)| raw || t["encoding"] != "raw")
            .min_by_key(|(_, t)| t["off"].as_u64().unwrap())
            .unwrap();
        let within = if raw {
            1
        } else {
            first["stored"].as_u64().unwrap() / 2
        };
        let at =
            (l1["file_off"].as_u64().unwrap() + first["off"].as_u64().unwrap() + within) as usize;
        let bin = t.join("trunk.bin");
        let mut bytes = std::fs::read(&bin).unwrap();
        bytes[at] ^= 0x01;
        // And one inside the output head's first block.
        let at = m["head"]["file_off"].as_u64().unwrap() as usize + 16 + 100;
        bytes[at] ^= 0x01;
        std::fs::write(&bin, &bytes).unwrap();
        let (code, out, err) = verify(&[d, "--trunk", ts]);
        assert_eq!(code, 3, "{out}{err}");
        let says = if raw {
            format!("trunk layer 1: tensor {name:?} differs from its source at byte 1")
        } else {
            format!("trunk layer 1: tensor {name:?} does not decode: block 0: checksum")
        };
        assert!(out.contains(&says), "{out}");
        assert!(out.contains("trunk layer 1: trunk.bin checksum"), "{out}");
        let head = "trunk output head: tensor \"language_model.lm_head.weight\" does not \
                    decode: block 0: checksum";
        assert!(out.contains(head), "{out}");
        assert!(
            out.contains("trunk output head: trunk.bin checksum"),
            "{out}"
        );
    }
}

#[test]
fn the_demo_model_passes_its_unread_zero_tensor_is_counted_apart() {
    // The demo model's layer 0 `self_attention_res_proj` is all zeros: the graph never reads
    // it (no block precedes layer 0), so it is not a problem.
    let demo = crate::common::demo_model().to_str().unwrap();
    let (code, out, err) = verify(&[demo]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("all checks passed"), "{out}");
    let (code, out, err) = verify(&[demo, "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["all_zero_tensors"], 0, "{v}");
    assert_eq!(v["all_zero_unread_tensors"], 1, "{v}");
}

/// The logits `k3 run` dumps for a short prompt on `dir`.
fn logits(dir: &Path) -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("logits.bin");
    crate::common::run_ok(
        k3_command()
            .args([
                "run",
                "--ids",
                "1,2,3",
                "--gen",
                "2",
                "--spec",
                "off",
                "--dump-logits",
            ])
            .arg(&path)
            .arg(dir),
    );
    std::fs::read(&path).unwrap()
}

#[test]
fn only_the_tensors_the_graph_reads_must_not_be_all_zero() {
    // Layer 0's pre-attention mix is never read: zeroing it passes and changes no logit.
    let (_t, dir) = synth_tiny();
    let clean = logits(&dir);
    for suffix in [
        "self_attention_res_proj.weight",
        "self_attention_res_norm.weight",
    ] {
        let name = format!("language_model.model.layers.0.{suffix}");
        let (_, _, len, _) = locate(&dir, &name);
        poke(&dir, &name, 0, &vec![0u8; len]);
    }
    let (code, out, err) = verify(&[dir.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["all_zero_tensors"], &v["all_zero_unread_tensors"]),
        (&serde_json::json!(0), &serde_json::json!(2)),
        "{v}"
    );
    assert_eq!(
        logits(&dir),
        clean,
        "a tensor counted unread changed the logits"
    );
    // The same tensor of layer 1 is read (a block precedes it) and layer 0's MLP mix is read:
    // all zeros there is a problem.
    for name in [
        "language_model.model.layers.1.self_attention_res_proj.weight",
        "language_model.model.layers.0.mlp_res_proj.weight",
    ] {
        let (_t, dir) = synth_tiny();
        let (_, _, len, _) = locate(&dir, name);
        poke(&dir, name, 0, &vec![0u8; len]);
        let (code, out, err) = verify(&[dir.to_str().unwrap()]);
        assert_eq!(code, 3, "{name}: {out}{err}");
        assert!(out.contains(&format!("{name:?}")), "{out}");
        assert!(out.contains("all zeros"), "{out}");
        assert_ne!(logits(&dir), clean, "{name} is read but changed nothing");
    }
}
