//! The packed trunk (`k3 pack`): the same logits with and without it at every budget, with
//! direct and buffered reads, for verbatim and gathered layers; every bad trunk refused with
//! its reason and exit code; read faults on `trunk.bin` retried or failing the step.

use crate::bad_inputs::{copy_tiny, join, shard, split};
use crate::common::{argmax, fixture, json, u32s};
use k3::engine::model::Logits;
use k3::engine::weights::OpenOptions;
use k3::engine::{Model, SeqState};
use k3::stream::budget::{self, BudgetRequest};
use k3::stream::checkpoint::Fault;
use k3::stream::codec::Coding;
use k3::stream::trunk;
use k3::stream::Checkpoint;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Greedy generation: the logits of every step, `between(step)` called before each token.
fn generate(
    m: &Model,
    prompt: &[u32],
    n: usize,
    mut between: impl FnMut(usize),
) -> Result<Vec<Vec<f32>>, k3::stream::StreamError> {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last)?;
    let mut out = vec![logits.clone()];
    for step in 0..n {
        between(step);
        let next = argmax(&logits);
        logits = m.forward(&mut st, &[next], Logits::Last)?;
        out.push(logits.clone());
    }
    Ok(out)
}

fn pack_into(model: &Path, out: &Path, encode: Option<Coding>) -> trunk::PackReport {
    let ck = Checkpoint::open(model).unwrap();
    let cfg = k3::engine::config::ModelConfig::load(&model.join("config.json")).unwrap();
    trunk::pack(
        &ck,
        cfg.num_hidden_layers,
        Some(k3::engine::bind::names::LM_HEAD),
        out,
        false,
        encode,
        &|_, _| {},
    )
    .unwrap()
}

fn open(model: &Path, budget: BudgetRequest, trunk: Option<&Path>, direct: bool) -> Model {
    Model::open_with(
        model,
        &OpenOptions {
            budget,
            context: 512,
            states: 1,
            trunk: trunk.map(Path::to_path_buf),
            direct,
            progress: None,
            ..OpenOptions::default()
        },
    )
    .unwrap()
    .0
}

/// What opening `model` with `trunk` plans and reads when resident: the floor and the sizes
/// it plans with (an encoded trunk's floor counts the staging of its largest run).
fn info_with(model: &Path, trunk: Option<&Path>) -> k3::engine::weights::LoadInfo {
    let opts = OpenOptions {
        budget: BudgetRequest::Resident,
        context: 512,
        trunk: trunk.map(Path::to_path_buf),
        ..OpenOptions::default()
    };
    Model::open_with(model, &opts).unwrap().1
}

fn k3(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        err,
    )
}

#[test]
fn with_or_without_the_trunk_every_budget_gives_the_same_logits() {
    for (set, coding) in [
        ("tiny", None),
        ("tiny2", None),
        ("tiny", Some(Coding::Entropy)),
        ("tiny2", Some(Coding::Entropy)),
        ("tiny", Some(Coding::Nibble)),
        ("tiny2", Some(Coding::Nibble)),
    ] {
        let encode = coding.is_some();
        let dir = fixture(set);
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().join("trunk");
        let r = pack_into(&dir, &t, coding);
        if let Some(c) = coding {
            // Every BF16 tensor encoded, the others raw; the stored size below the raw one.
            for t in r.manifest.layers.iter().flat_map(|l| l.tensors.values()) {
                assert_eq!(t.is_encoded(), t.dtype == "BF16", "{t:?}");
                assert!(!t.is_encoded() || t.encoding == c.name(), "{t:?}");
            }
            assert!(r.bf16.1 < r.bf16.0, "{:?}", r.bf16);
            assert!(r.manifest.total_bytes <= r.raw_bytes);
            // The output head is packed encoded too.
            let (name, head, _) = r.manifest.head_tensor().expect("the head is packed");
            assert_eq!(name, k3::engine::bind::names::LM_HEAD);
            assert_eq!(head.encoding, c.name());
        } else {
            assert_eq!(
                r.verbatim, r.manifest.n_layers,
                "{set}: runs are contiguous"
            );
        }
        for l in &r.manifest.layers {
            assert_eq!(l.file_off % 4096, 0);
            assert_eq!(l.nbytes % 4096, 0);
        }
        let prompt = u32s(&json(&format!("{set}/oracle.json"))["prompt_ids"]);
        let resident = open(&dir, BudgetRequest::Resident, None, true);
        let want = generate(&resident, &prompt, 10, |_| {}).unwrap();
        let info = info_with(&dir, Some(&t));
        let (floor, model) = (info.plan.floor_bytes, info.sizes.model_bytes());
        let plain = info_with(&dir, None);
        let staged = info.sizes.layer_window.iter().max().copied().unwrap_or(0);
        assert_eq!(staged > 0, encode, "{set}: encoded layers are staged");
        // Staged and decoded, an entropy-coded trunk's floor counts its staging (a
        // nibble-coded one's layers may be read in place: `layers_read_in_place_…`).
        if coding == Some(Coding::Entropy) {
            assert_eq!(floor, plain.plan.floor_bytes + staged, "{set}");
        }
        assert_eq!(info.sizes.head_stored > 0, encode, "{set}");
        for direct in [true, false] {
            for req in [
                BudgetRequest::Resident,
                BudgetRequest::Total(floor),
                BudgetRequest::Total(floor + model / 2),
            ] {
                let m = open(&dir, req, Some(&t), direct);
                let got = generate(&m, &prompt, 10, |_| {}).unwrap();
                for (a, b) in got.iter().zip(&want) {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "{set} {req:?} direct {direct} coding {coding:?}"
                    );
                }
                if let Some(st) = m.streamer() {
                    let tr = st.trunk().expect("streaming from the trunk");
                    assert!(tr.bytes_read() > 0);
                    println!(
                        "{set} {req:?}: {} B read from trunk.bin, direct I/O {}",
                        tr.bytes_read(),
                        tr.is_direct()
                    );
                }
            }
        }
        // Two budget changes in the middle of a generation, streaming from the trunk.
        let m = open(&dir, BudgetRequest::Total(floor), Some(&t), true);
        let st = m.streamer().unwrap();
        let sizes = info.sizes.clone();
        let got = generate(&m, &prompt, 10, |step| {
            let total = match step {
                3 => floor + model,
                7 => floor,
                _ => return,
            };
            st.set_plan(budget::plan(&sizes, BudgetRequest::Total(total), 512, None).unwrap())
                .unwrap();
        })
        .unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(bits(a), bits(b), "{set}: plan changes with the trunk");
        }
    }
}

/// A copy of tiny whose shards hold their tensors in reverse-name order, so every layer's
/// trunk tensors are interleaved with other layers' and with experts.
fn scrambled_tiny() -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = copy_tiny();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let (h, data) = split(&p);
            let mut names: Vec<&String> = h.keys().filter(|k| *k != "__metadata__").collect();
            names.sort_by(|a, b| b.chars().rev().cmp(a.chars().rev()));
            let mut out_h = serde_json::Map::new();
            let mut out = Vec::new();
            for n in names {
                let mut v = h[n].clone();
                let o = &v["data_offsets"];
                let (a, b) = (
                    o[0].as_u64().unwrap() as usize,
                    o[1].as_u64().unwrap() as usize,
                );
                let start = out.len();
                out.extend_from_slice(&data[a..b]);
                v["data_offsets"] = serde_json::json!([start, out.len()]);
                out_h.insert(n.clone(), v);
            }
            join(&p, &out_h, &out);
        }
    }
    (tmp, dir)
}

#[test]
fn scattered_layers_are_gathered_and_give_the_same_logits() {
    let (_tmp, dir) = scrambled_tiny();
    let t = dir.parent().unwrap().join("trunk");
    let r = pack_into(&dir, &t, None);
    assert!(r.gathered > 0, "the scrambled layout needs gathering");
    let prompt = u32s(&json("tiny/oracle.json")["prompt_ids"]);
    let want = generate(
        &open(&fixture("tiny"), BudgetRequest::Resident, None, true),
        &prompt,
        8,
        |_| {},
    )
    .unwrap();
    let (_, info) = Model::open(&dir, BudgetRequest::Resident, 512).unwrap();
    for req in [
        BudgetRequest::Resident,
        BudgetRequest::Total(info.plan.floor_bytes),
    ] {
        let got = generate(&open(&dir, req, Some(&t), true), &prompt, 8, |_| {}).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(bits(a), bits(b), "{req:?}");
        }
    }
}

#[test]
fn bad_trunks_are_refused_with_their_reason() {
    let tiny = fixture("tiny");
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("trunk");
    let ts = t.to_str().unwrap();
    let tiny_s = tiny.to_str().unwrap();
    let (code, _, err) = k3(&["pack", tiny_s, ts]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("13 layers"), "{err}");
    let run = |model: &str, extra: &[&str]| {
        let mut a = vec!["run", model, "--ids", "1,2,3", "--gen", "2", "--trunk", ts];
        a.extend_from_slice(extra);
        k3(&a)
    };
    let (code, good, err) = run(tiny_s, &["--mem", "0.05"]);
    assert_eq!(code, 0, "{err}");

    // An existing trunk is kept unless --force.
    let before = std::fs::read(t.join("trunk.json")).unwrap();
    let (code, _, err) = k3(&["pack", tiny_s, ts]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(t.join("trunk.json")).unwrap(), before);
    let (code, _, err) = k3(&["pack", tiny_s, ts, "--force"]);
    assert_eq!(code, 0, "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A trunk packed from another checkpoint.
    let (code, _, err) = run(fixture("tiny2").to_str().unwrap(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("different checkpoint"), "{err}");

    // A flipped byte in trunk.bin: the layer's checksum fails the step, nothing is printed
    // as if it were good.
    let bin = t.join("trunk.bin");
    let orig = std::fs::read(&bin).unwrap();
    let mut bad = orig.clone();
    bad[4096 * 3 + 100] ^= 0x40;
    std::fs::write(&bin, &bad).unwrap();
    let (code, out, err) = run(tiny_s, &["--mem", "0.05"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("checksum"), "{err}");
    assert_ne!(out, good);

    // A truncated trunk.bin is refused before anything runs.
    std::fs::write(&bin, &orig[..orig.len() - 4096]).unwrap();
    let (code, _, err) = run(tiny_s, &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("truncated"), "{err}");
    std::fs::write(&bin, &orig).unwrap();

    // A malformed or tampered manifest.
    let json_path = t.join("trunk.json");
    let text = std::fs::read_to_string(&json_path).unwrap();
    for (from, to, says) in [
        ("\"align\":4096", "\"align\":512", "align"),
        (
            "\"format\":\"k3-trunk/4\"",
            "\"format\":\"k3-trunk/9\"",
            "format",
        ),
        (
            "\"format\":\"k3-trunk/4\"",
            "\"format\":\"k3-trunk/1\"",
            "re-pack it with `k3 pack --force",
        ),
        (
            "\"format\":\"k3-trunk/4\"",
            "\"format\":\"k3-trunk/2\"",
            "re-pack it with `k3 pack --force",
        ),
        ("\"file_off\":0,", "\"file_off\":100,", "aligned"),
        ("{\"format\"", "[{\"format\"", "not a k3 trunk manifest"),
        (
            "\"n_layers\":13",
            "\"n_layers\":12",
            "declares 12 layers and lists 13; the model has 13",
        ),
    ] {
        assert!(text.contains(from), "{from}");
        std::fs::write(&json_path, text.replacen(from, to, 1)).unwrap();
        let (code, _, err) = run(tiny_s, &[]);
        assert_eq!(code, 3, "{from}: {err}");
        assert!(err.contains(says), "{from}: {err}");
    }
    std::fs::remove_file(&json_path).unwrap();
    let (code, _, err) = run(tiny_s, &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("k3 pack"), "{err}");

    // A source that cannot be packed: nothing is written.
    let (_ctmp, broken) = copy_tiny();
    let cfg = broken.join("config.json");
    let c = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, c.replacen("\"hidden_size\"", "\"hidden_size_x\"", 1)).unwrap();
    let out2 = tmp.path().join("never");
    let (code, _, err) = k3(&["pack", broken.to_str().unwrap(), out2.to_str().unwrap()]);
    assert_ne!(code, 0, "{err}");
    assert!(!out2.join("trunk.bin").exists());
    // An output path that is a file.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let (code, _, err) = k3(&["pack", tiny_s, file.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
}

#[test]
fn trunk_read_faults_are_retried_or_fail_the_step() {
    let dir = fixture("tiny");
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("trunk");
    pack_into(&dir, &t, Some(Coding::Entropy));
    let prompt = u32s(&json("tiny/oracle.json")["prompt_ids"]);
    let want = generate(
        &open(&dir, BudgetRequest::Resident, None, true),
        &prompt,
        4,
        |_| {},
    )
    .unwrap();
    let floor = BudgetRequest::Total(info_with(&dir, Some(&t)).plan.floor_bytes);
    let mut failed = 0;
    for n in [0u64, 1, 5, 13, 30] {
        for fault in [
            Fault::Interrupted,
            Fault::Short,
            Fault::TransientIo,
            Fault::Io,
        ] {
            let m = open(&dir, floor, Some(&t), true);
            let tr = m.streamer().unwrap().trunk().unwrap();
            tr.inject_fault(tr.reads_issued() + n, fault);
            match (fault, generate(&m, &prompt, 4, |_| {})) {
                (Fault::Io, Err(e)) => {
                    let e2 = e.to_string();
                    assert!(
                        e2.contains("trunk layer") || e2.contains("trunk output head"),
                        "{e}"
                    );
                    assert_eq!(e.exit_code(), 1);
                    failed += 1;
                }
                (_, got) => {
                    let got = got.unwrap_or_else(|e| panic!("{fault:?} at read {n}: {e}"));
                    for (a, b) in got.iter().zip(&want) {
                        assert_eq!(bits(a), bits(b), "{fault:?} at read {n}");
                    }
                }
            }
        }
    }
    assert!(failed >= 3, "{failed} EIO faults failed their step");
}

/// Flip one byte of tensor `name` in the shard at `path`, in place: the file keeps its size
/// and its header, so the checkpoint's tensor index (and its digest) is unchanged.
pub(crate) fn flip_tensor_byte(path: &Path, name: &str, at: usize) {
    let (h, _) = split(path);
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let begin = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + begin + at] ^= 0x10;
    std::fs::write(path, &bytes).unwrap();
}

#[test]
fn a_trunk_whose_source_changed_is_refused_until_repacked() {
    let (_tmp, dir) = copy_tiny();
    let t = dir.parent().unwrap().join("trunk");
    let (ds, ts) = (dir.to_str().unwrap(), t.to_str().unwrap());
    let (code, _, err) = k3(&["pack", ds, ts]);
    assert_eq!(code, 0, "{err}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.join("trunk.json")).unwrap()).unwrap();
    assert_eq!(manifest["format"], "k3-trunk/4");
    // The shards holding layer tensors (the third holds only the model-level ones).
    let recorded: Vec<&str> = manifest["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(
        recorded.contains(&"model-00001-of-000003.safetensors"),
        "{recorded:?}"
    );
    assert!(manifest["shards"][0]["size"].as_u64().unwrap() > 0);
    assert!(manifest["layers"][0]["source_crc32"].is_u64());
    let run = |trunk: bool| {
        let mut a = vec!["run", ds, "--ids", "1,2,3", "--gen", "2", "--mem", "0.05"];
        if trunk {
            a.extend(["--trunk", ts]);
        }
        k3(&a)
    };
    let (code, _, err) = run(true);
    assert_eq!(code, 0, "{err}");

    // Only layer-0 weights change: one byte of a trunk tensor, same size, a new mtime.
    let p = shard(&dir, 1);
    let meta = std::fs::metadata(&p).unwrap();
    flip_tensor_byte(
        &p,
        "language_model.model.layers.0.self_attn.q_proj.weight",
        6,
    );
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_modified(meta.modified().unwrap() + std::time::Duration::from_secs(7))
        .unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), meta.len());

    let (code, out, err) = run(true);
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("changed since it was packed"), "{err}");
    assert!(err.contains("model-00001-of-000003.safetensors"), "{err}");
    assert!(err.contains("k3 pack --force"), "{err}");
    // `plan` opens the trunk too.
    let (code, _, err) = k3(&["plan", ds, "--mem", "0.05", "--trunk", ts]);
    assert_eq!(code, 3, "{err}");
    // Without the trunk the changed checkpoint runs; re-packed, the trunk gives the same.
    let (code, plain, err) = run(false);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = k3(&["pack", ds, ts, "--force"]);
    assert_eq!(code, 0, "{err}");
    let (code, packed, err) = run(true);
    assert_eq!(code, 0, "{err}");
    assert_eq!(packed, plain);
}

/// The shard's modification time as `touch -r` sees it.
fn mtime(p: &Path) -> std::time::SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

#[test]
fn a_shard_edited_in_place_keeping_its_size_and_mtime_is_refused() {
    let (tmp, dir) = copy_tiny();
    let t = tmp.path().join("trunk");
    let (ds, ts) = (dir.to_str().unwrap(), t.to_str().unwrap());
    let (code, _, err) = k3(&["pack", ds, ts]);
    assert_eq!(code, 0, "{err}");
    let run = |trunk: bool| {
        let mut a = vec!["run", ds, "--ids", "1,2,3", "--gen", "2", "--mem", "0.05"];
        if trunk {
            a.extend(["--trunk", ts]);
        }
        k3(&a)
    };
    let (code, packed, err) = run(true);
    assert_eq!(code, 0, "{err}");

    // An edited copy of shard 1 with the original's mtime, copied over it with `cp -p`, as a
    // user re-syncing a fine-tuned checkpoint would. The byte (12000 of a 24576-byte tensor)
    // lies outside the four sampled windows, so only the full check of a rewritten shard
    // sees it.
    let p = shard(&dir, 1);
    let before = (std::fs::metadata(&p).unwrap().len(), mtime(&p));
    let name = "language_model.model.layers.0.mlp.down_proj.weight";
    let (h, _) = split(&p);
    let span = &h[name]["data_offsets"];
    assert_eq!(
        span[1].as_u64().unwrap() - span[0].as_u64().unwrap(),
        24576,
        "{span}"
    );
    assert!(trunk::sample_spans(24576)
        .iter()
        .all(|&(o, l)| !(o..o + l).contains(&12000)));
    let edited = tmp.path().join("edited.safetensors");
    std::fs::copy(&p, &edited).unwrap();
    flip_tensor_byte(&edited, name, 12000);
    let ok = |c: &mut Command| assert!(c.status().unwrap().success());
    ok(Command::new("touch").arg("-r").arg(&p).arg(&edited));
    ok(Command::new("cp").arg("-p").arg(&edited).arg(&p));
    assert_eq!((std::fs::metadata(&p).unwrap().len(), mtime(&p)), before);

    let (code, out, err) = run(true);
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("changed since it was packed"), "{err}");
    assert!(err.contains("edited in place"), "{err}");
    assert!(err.contains(&format!("layer 0: tensor {name:?}")), "{err}");
    assert!(err.contains("model-00001-of-000003.safetensors"), "{err}");
    assert!(err.contains("k3 pack --force"), "{err}");
    let (code, _, err) = k3(&["plan", ds, "--mem", "0.05", "--trunk", ts]);
    assert_eq!(code, 3, "{err}");
    let (code, out, _) = k3(&["verify", ds, "--trunk", ts]);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains(name), "{out}");

    // The same edit reverted, again keeping the mtime: the shard was rewritten but holds the
    // packed bytes, so the full check passes and the trunk gives what it gave.
    flip_tensor_byte(&edited, name, 12000);
    ok(Command::new("touch").arg("-r").arg(&p).arg(&edited));
    ok(Command::new("cp").arg("-p").arg(&edited).arg(&p));
    let (code, again, err) = run(true);
    assert_eq!(code, 0, "{err}");
    assert_eq!(again, packed);

    // An edit inside a sampled window is refused the same way.
    flip_tensor_byte(&edited, name, 3);
    ok(Command::new("touch").arg("-r").arg(&p).arg(&edited));
    ok(Command::new("cp").arg("-p").arg(&edited).arg(&p));
    let (code, _, err) = run(true);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("layer 0: tensor {name:?}")), "{err}");
    // Re-packed, the trunk gives the edited checkpoint's tokens.
    let (code, plain, err) = run(false);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = k3(&["pack", ds, ts, "--force"]);
    assert_eq!(code, 0, "{err}");
    let (code, repacked, err) = run(true);
    assert_eq!(code, 0, "{err}");
    assert_eq!(repacked, plain);

    // The output head, packed encoded, is checked the same way: an edit of it in place is
    // refused, naming it.
    let head = k3::engine::bind::names::LM_HEAD;
    let p = shard(&dir, 3);
    assert!(split(&p).0.get(head).is_some(), "the head lies in shard 3");
    let edited = tmp.path().join("edited-head.safetensors");
    std::fs::copy(&p, &edited).unwrap();
    flip_tensor_byte(&edited, head, 3);
    ok(Command::new("touch").arg("-r").arg(&p).arg(&edited));
    ok(Command::new("cp").arg("-p").arg(&edited).arg(&p));
    let (code, _, err) = run(true);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("the output head: tensor {head:?}")),
        "{err}"
    );
}

/// An encoded block that does not decode, though the layer's checksum was made to match (a
/// block corrupted after the layer was first verified, or a buggy writer): refused with exit 3
/// naming the layer and the tensor, never run on different weights; a head run that does not
/// match the checkpoint is refused at open. A raw (`--raw`) trunk, an encoded one, and one
/// without its head run give the same tokens.
#[test]
fn corrupt_encoded_blocks_are_refused_naming_the_layer_and_tensor() {
    let tiny = fixture("tiny");
    let tmp = tempfile::tempdir().unwrap();
    let (t, traw) = (tmp.path().join("trunk"), tmp.path().join("raw"));
    let (ts, tiny_s) = (t.to_str().unwrap(), tiny.to_str().unwrap());
    let (code, _, err) = k3(&["pack", tiny_s, ts, "--codec", "entropy"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("BF16 tensors encoded"), "{err}");
    let (code, _, err) = k3(&["pack", tiny_s, traw.to_str().unwrap(), "--raw"]);
    assert_eq!(code, 0, "{err}");
    let run = |trunk: &str| {
        k3(&[
            "run", tiny_s, "--ids", "1,2,3", "--gen", "3", "--mem", "0.05", "--trunk", trunk,
        ])
    };
    let (code, good, err) = run(ts);
    assert_eq!(code, 0, "{err}");
    let (code, raw_out, err) = run(traw.to_str().unwrap());
    assert_eq!(code, 0, "{err}");
    assert_eq!(good, raw_out);

    let json_path = t.join("trunk.json");
    let bin = t.join("trunk.bin");
    let (orig_json, orig_bin) = (
        std::fs::read(&json_path).unwrap(),
        std::fs::read(&bin).unwrap(),
    );
    let m: serde_json::Value = serde_json::from_slice(&orig_json).unwrap();
    // The largest encoded tensor of layer 2.
    let layer = &m["layers"][2];
    let (name, tensor) = layer["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| v["encoding"] == "k3h1")
        .max_by_key(|(_, v)| v["stored"].as_u64().unwrap())
        .unwrap();
    let file_off = layer["file_off"].as_u64().unwrap() as usize;
    let (off, stored) = (
        tensor["off"].as_u64().unwrap() as usize,
        tensor["stored"].as_u64().unwrap() as usize,
    );
    let nbytes = layer["nbytes"].as_u64().unwrap() as usize;
    // Flip a byte inside the tensor's blocks and re-seal the layer's checksum.
    let mut bad = orig_bin.clone();
    bad[file_off + off + stored / 2] ^= 0x20;
    let mut m2 = m.clone();
    m2["layers"][2]["crc32"] =
        serde_json::json!(crc32fast::hash(&bad[file_off..file_off + nbytes]));
    std::fs::write(&bin, &bad).unwrap();
    std::fs::write(&json_path, serde_json::to_vec(&m2).unwrap()).unwrap();
    let (code, out, err) = run(ts);
    assert_eq!(code, 3, "{err}");
    assert_ne!(out, good);
    assert!(
        err.contains(&format!("trunk layer 2, tensor \"{name}\"")),
        "{err}"
    );
    assert!(
        err.contains("checksum") && err.contains("k3 pack --force"),
        "{err}"
    );
    // The manifest says the tensor's blocks are shorter than they are.
    std::fs::write(&bin, &orig_bin).unwrap();
    let mut m3 = m.clone();
    m3["layers"][2]["tensors"][name]["stored"] = serde_json::json!(stored - 8);
    std::fs::write(&json_path, serde_json::to_vec(&m3).unwrap()).unwrap();
    let (code, _, err) = run(ts);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("trunk layer 2, tensor \"{name}\"")),
        "{err}"
    );
    // An encoding the reader does not know, or on a tensor that is not BF16: refused at open.
    let mut m4 = m.clone();
    m4["layers"][2]["tensors"][name]["encoding"] = serde_json::json!("zstd");
    std::fs::write(&json_path, serde_json::to_vec(&m4).unwrap()).unwrap();
    let (code, _, err) = run(ts);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("\"zstd\""), "{err}");
    let head = &m["head"];
    let hname = head["tensors"].as_object().unwrap().keys().next().unwrap();
    assert_eq!(hname, k3::engine::bind::names::LM_HEAD);
    // A head run that is not the checkpoint's head, or lies past trunk.bin: refused at open.
    std::fs::write(&bin, &orig_bin).unwrap();
    let mut m6 = m.clone();
    m6["head"]["tensors"][hname]["shape"] = serde_json::json!([1, 2]);
    std::fs::write(&json_path, serde_json::to_vec(&m6).unwrap()).unwrap();
    let (code, _, err) = run(ts);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("the head"), "{err}");
    let mut m7 = m.clone();
    m7["head"]["file_off"] = serde_json::json!(orig_bin.len());
    std::fs::write(&json_path, serde_json::to_vec(&m7).unwrap()).unwrap();
    let (code, _, err) = run(ts);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("trunk.bin is"), "{err}");
    // Without its head run (as an earlier pack wrote it), the head is read from the checkpoint.
    let mut m8 = m.clone();
    m8.as_object_mut().unwrap().remove("head");
    std::fs::write(&json_path, serde_json::to_vec(&m8).unwrap()).unwrap();
    let (code, out, err) = run(ts);
    assert_eq!((code, out), (0, good.clone()), "{err}");
    // Restored, it runs as before.
    std::fs::write(&json_path, &orig_json).unwrap();
    let (code, out, err) = run(ts);
    assert_eq!((code, out), (0, good), "{err}");
}

/// A streamed encoded layer whose tensors span several codec blocks, decoded while every
/// compute thread waits for it (`--threads 1` and `2`, one I/O thread, everything streamed):
/// the read-ahead ring's reader decodes on threads of its own, so the run finishes, with the
/// raw trunk's tokens, with either coding. (A reader that queued the blocks on the compute pool would wait
/// forever: that pool's threads are all waiting for this very layer.)
#[test]
fn encoded_layers_of_several_blocks_stream_while_every_compute_thread_waits() {
    let small = crate::streaming::small().join("small");
    let tmp = tempfile::tempdir().unwrap();
    let (enc, raw) = (tmp.path().join("enc"), tmp.path().join("raw"));
    let r = pack_into(&small, &enc, Some(Coding::Entropy));
    pack_into(&small, &raw, None);
    let nib = tmp.path().join("nibble");
    pack_into(&small, &nib, Some(Coding::Nibble));
    let block = 2 * k3::stream::codec::BLOCK_ELEMS as u64;
    let multi: Vec<usize> = (r.manifest.layers.iter())
        .filter(|l| {
            l.tensors
                .values()
                .any(|t| t.is_encoded() && t.nbytes > 2 * block)
        })
        .map(|l| l.layer)
        .collect();
    assert!(!multi.is_empty(), "a layer holds a tensor of 3+ blocks");
    let small_s = small.to_str().unwrap();
    let mut outs = Vec::new();
    for t in [&raw, &enc, &nib] {
        let ts = t.to_str().unwrap();
        let (code, plan, err) = k3(&["plan", small_s, "--trunk", ts, "--json"]);
        assert_eq!(code, 0, "{err}");
        let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
        // The floor, rounded up to a kB: nothing pinned, every layer streamed.
        let floor = plan["floor_bytes"].as_u64().unwrap().div_ceil(1000);
        let mem = format!("{}", floor as f64 / 1e6);
        let (code, at_floor, err) = k3(&["plan", small_s, "--trunk", ts, "--mem", &mem, "--json"]);
        assert_eq!(code, 0, "{err}");
        let at_floor: serde_json::Value = serde_json::from_str(&at_floor).unwrap();
        let pinned = at_floor["pinned"].as_array().unwrap();
        assert!(pinned.iter().all(|p| p == false), "{at_floor}");
        for threads in ["1", "2"] {
            let (code, out, err) = k3(&[
                "run",
                small_s,
                "--ids",
                "1,2,3",
                "--gen",
                "4",
                "--mem",
                &mem,
                "--trunk",
                ts,
                "--threads",
                threads,
                "--tune",
                "io_threads=1",
            ]);
            assert_eq!(code, 0, "{} with {threads} thread(s): {err}", t.display());
            outs.push(out);
        }
    }
    assert!(outs.iter().all(|o| *o == outs[0]), "{outs:?}");
}

/// `k3 pack` writes the encoded trunk unless given `--raw` (`--encode` names the default, and
/// the two together are refused); a trunk packed raw still runs, in this format and as
/// `k3-trunk/3` (written before tensors had an encoding), with the tokens of the encoded one
/// and of no trunk at all.
#[test]
fn pack_encodes_by_default_and_raw_trunks_of_either_format_still_run() {
    let tiny = fixture("tiny");
    let tiny_s = tiny.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let manifest = |t: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(t.join("trunk.json")).unwrap()).unwrap()
    };
    let encoded = |m: &serde_json::Value| -> usize {
        m["layers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l["tensors"].as_object().unwrap().values())
            .filter(|t| t["encoding"] == "k3h1" || t["encoding"] == "k3n1")
            .count()
    };
    for (name, flags) in [
        ("default", &[][..]),
        ("encode", &["--encode"][..]),
        ("raw", &["--raw"][..]),
        ("entropy", &["--codec", "entropy"][..]),
    ] {
        let t = dir(name);
        let mut a = vec!["pack", tiny_s, t.to_str().unwrap()];
        a.extend_from_slice(flags);
        let (code, _, err) = k3(&a);
        assert_eq!(code, 0, "{name}: {err}");
        assert_eq!(
            err.contains("BF16 tensors encoded"),
            name != "raw",
            "{name}: {err}"
        );
        assert_eq!(encoded(&manifest(&t)) > 0, name != "raw", "{name}");
    }
    assert_eq!(
        std::fs::read(dir("default").join("trunk.bin")).unwrap(),
        std::fs::read(dir("encode").join("trunk.bin")).unwrap()
    );
    let names = |t: &str| -> Vec<String> {
        let m = manifest(&dir(t));
        let mut v: Vec<String> = (m["layers"].as_array().unwrap().iter())
            .flat_map(|l| l["tensors"].as_object().unwrap().values())
            .map(|t| t["encoding"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    assert_eq!(names("default"), ["k3n1", "raw"]);
    assert_eq!(names("entropy"), ["k3h1", "raw"]);
    for (what, flags) in [
        ("raw and encode", &["--raw", "--encode"][..]),
        ("raw and a codec", &["--raw", "--codec", "nibble"][..]),
        ("an unknown codec", &["--codec", "zstd"][..]),
    ] {
        let both = dir("both");
        let mut a = vec!["pack", tiny_s, both.to_str().unwrap()];
        a.extend_from_slice(flags);
        let (code, _, err) = k3(&a);
        assert_eq!(code, 2, "{what}: {err}");
        assert!(!both.join("trunk.json").exists(), "{what}");
    }
    // The raw trunk as an earlier k3 wrote it: format 3, no encoding or stored length.
    let old = dir("old");
    std::fs::create_dir(&old).unwrap();
    std::fs::copy(dir("raw").join("trunk.bin"), old.join("trunk.bin")).unwrap();
    let mut m = manifest(&dir("raw"));
    m["format"] = "k3-trunk/3".into();
    for l in m["layers"].as_array_mut().unwrap() {
        for t in l["tensors"].as_object_mut().unwrap().values_mut() {
            let t = t.as_object_mut().unwrap();
            assert!(t.remove("encoding").is_some() && t.remove("stored").is_some());
        }
    }
    std::fs::write(old.join("trunk.json"), serde_json::to_vec(&m).unwrap()).unwrap();
    let run = |trunk: Option<&Path>| {
        let mut a = vec![
            "run", tiny_s, "--ids", "1,2,3", "--gen", "4", "--mem", "0.05",
        ];
        if let Some(t) = trunk {
            a.extend(["--trunk", t.to_str().unwrap()]);
        }
        let (code, out, err) = k3(&a);
        assert_eq!(code, 0, "{trunk:?}: {err}");
        out
    };
    let want = run(None);
    for t in ["default", "raw", "old", "entropy"] {
        assert_eq!(run(Some(&dir(t))), want, "{t}");
    }
}

/// The `small` model's trunk packed entropy-coded into a directory of its own (kept while
/// the first value lives), opened: its directory, the model config and the trunk.
fn small_encoded_trunk() -> (
    tempfile::TempDir,
    PathBuf,
    k3::engine::ModelConfig,
    trunk::Trunk,
) {
    let small = crate::streaming::small().join("small");
    let tmp = tempfile::tempdir().unwrap();
    let enc = tmp.path().join("enc");
    pack_into(&small, &enc, Some(Coding::Entropy));
    let ck = Checkpoint::open(&small).unwrap();
    let cfg = k3::engine::ModelConfig::load(&small.join("config.json")).unwrap();
    let t = trunk::Trunk::open(&enc, &ck, cfg.num_hidden_layers).unwrap();
    (tmp, enc, cfg, t)
}

/// `n` slots of memory, each as large as the largest encoded layer of `t`, stored or decoded.
fn largest_layer_slots(
    cfg: &k3::engine::ModelConfig,
    t: &trunk::Trunk,
    n: usize,
) -> Vec<k3::stream::arena::Slot> {
    let most = (0..cfg.num_hidden_layers)
        .filter_map(|il| t.decoded_len(il))
        .map(|(stored, len)| stored.max(len))
        .max()
        .expect("an encoded layer");
    let arena = k3::stream::arena::Arena::new(most);
    arena.set_slots(n).unwrap();
    (0..n).map(|_| arena.take().unwrap()).collect()
}

#[test]
fn a_layer_read_and_decoded_a_segment_at_a_time_gives_the_bytes_of_reading_then_decoding() {
    let (_tmp, _, cfg, t) = small_encoded_trunk();
    // The stored run, and the layer decoded both ways, each in a slot of its own.
    let mut slots = largest_layer_slots(&cfg, &t, 3);
    let [staged, want, got] = &mut slots[..] else {
        unreachable!()
    };
    let fill = |s: &mut k3::stream::arena::Slot, v: u8| {
        for b in s.area() {
            b.write(v);
        }
    };
    let mut scratch = t.decode_scratch();
    let mut layers = 0;
    for il in 0..cfg.num_hidden_layers {
        let Some((stored, len)) = t.decoded_len(il) else {
            continue;
        };
        // Unwritten bytes keep the pattern the slots were filled with: two patterns show
        // that the two ways write the same bytes, and the same ones.
        for pattern in [0xAA, 0x55] {
            fill(want, pattern);
            t.read_run_into(il, staged.area()).unwrap();
            let run = staged.as_slice()[..stored].to_vec();
            t.decode_run_into(il, &run, &mut want.area()[..len], &mut scratch)
                .unwrap();
            // Checked now: the overlapped read takes its segments.
            assert!(t.is_checked(il));
            for segment in [4096, 3 * 4096, stored / 2, stored, usize::MAX / 2] {
                // Nothing of the run left from the read above: a tensor decoded before its
                // bytes arrived would decode the pattern.
                fill(staged, pattern);
                fill(got, pattern);
                t.read_decode_by(il, staged, &mut got.area()[..len], &mut scratch, segment)
                    .unwrap();
                assert!(
                    got.as_slice() == want.as_slice(),
                    "layer {il}: read {segment} bytes ahead, the decoded layer differs"
                );
            }
            // A read that fails part way fails the layer, naming it; one retried gives the
            // same bytes.
            for (fault, fails) in [(Fault::Io, true), (Fault::Short, false)] {
                fill(got, pattern);
                t.inject_fault(t.reads_issued() + 2, fault);
                let r = t.read_decode_by(il, staged, &mut got.area()[..len], &mut scratch, 4096);
                match (r, fails) {
                    (Err(e), true) => {
                        assert!(e.to_string().contains(&format!("trunk layer {il}")), "{e}");
                    }
                    (Ok(()), false) => assert!(got.as_slice() == want.as_slice(), "{fault:?}"),
                    (r, _) => panic!("layer {il}, {fault:?} at the third read: {r:?}"),
                }
            }
        }
        layers += 1;
    }
    assert!(layers > 1, "{layers} encoded layers");
}

#[test]
fn a_block_corrupted_after_its_layer_was_checked_fails_the_overlapped_read() {
    let (_tmp, enc, cfg, t) = small_encoded_trunk();
    // The encoded layer with the longest stored run, and its last encoded tensor.
    let il = (0..cfg.num_hidden_layers)
        .filter(|&il| t.decoded_len(il).is_some())
        .max_by_key(|&il| t.decoded_len(il).unwrap().0)
        .unwrap();
    let (stored, len) = t.decoded_len(il).unwrap();
    let l = &t.manifest().layers[il];
    let last = l
        .tensors
        .values()
        .filter(|x| x.is_encoded())
        .max_by_key(|x| x.off)
        .unwrap();
    let at = l.file_off + last.off + last.stored / 2;
    let arena = k3::stream::arena::Arena::new(stored.max(len));
    arena.set_slots(2).unwrap();
    let (mut staged, mut out) = (arena.take().unwrap(), arena.take().unwrap());
    let mut scratch = t.decode_scratch();
    t.read_decode_by(il, &mut staged, &mut out.area()[..len], &mut scratch, 4096)
        .unwrap();
    assert!(t.is_checked(il));
    // A byte in the middle of the last encoded tensor's blocks, changed on disk now that the
    // layer is checked: its block's checksum refuses it, naming the layer and the tensor.
    let bin = enc.join("trunk.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[at as usize] ^= 0x5a;
    std::fs::write(&bin, &bytes).unwrap();
    let e = t
        .read_decode_by(il, &mut staged, &mut out.area()[..len], &mut scratch, 4096)
        .unwrap_err();
    assert!(
        e.to_string().contains(&format!("trunk layer {il}, tensor")),
        "{e}"
    );
    assert_eq!(e.exit_code(), 3, "{e}");
}

/// A layer read through a staging smaller than its run (a window of it, as the planner sizes
/// the staging for large layers) gives the bytes of reading the run whole and decoding it,
/// whether the run was checked before or is checked as it arrives. A staging too small for
/// one of the layer's tensors is refused, and a run whose raw tensor changed on disk is
/// refused by the run's checksum at the end of its first read, never handed out.
#[test]
fn a_layer_read_through_a_window_of_its_run_gives_the_bytes_of_reading_it_whole() {
    let (_tmp, enc, cfg, t) = small_encoded_trunk();
    let small = crate::streaming::small().join("small");
    let ck = Checkpoint::open(&small).unwrap();
    let seg = 4096;
    let windows = t.manifest().window_lens_by(seg as u64);
    let mut slots = largest_layer_slots(&cfg, &t, 2).into_iter();
    let (mut whole, mut want) = (slots.next().unwrap(), slots.next().unwrap());
    let mut scratch = t.decode_scratch();
    let mut windowed = Vec::new();
    for (il, &w) in windows.iter().enumerate() {
        let Some((stored, len)) = t.decoded_len(il) else {
            assert_eq!(w, 0, "layer {il} is stored raw");
            continue;
        };
        let w = usize::try_from(w).unwrap();
        assert!(
            w > 0 && w <= stored && w % 4096 == 0,
            "layer {il}: {w} of {stored}"
        );
        if w == stored {
            continue;
        }
        t.read_run_into(il, whole.area()).unwrap();
        let run = whole.as_slice()[..stored].to_vec();
        t.decode_run_into(il, &run, &mut want.area()[..len], &mut scratch)
            .unwrap();
        let window = k3::stream::arena::Arena::new(w);
        window.set_slots(1).unwrap();
        let mut staged = window.take().unwrap();
        assert_eq!(staged.len(), w);
        // Opened afresh, the run is checked as it arrives; then it is read checked.
        let fresh = trunk::Trunk::open(&enc, &ck, cfg.num_hidden_layers).unwrap();
        for checked in [false, true] {
            assert_eq!(fresh.is_checked(il), checked);
            for pattern in [0xAA, 0x55] {
                for b in whole.area() {
                    b.write(pattern);
                }
                fresh
                    .read_decode_by(il, &mut staged, &mut whole.area()[..len], &mut scratch, seg)
                    .unwrap();
                assert!(
                    whole.as_slice()[..len] == want.as_slice()[..len],
                    "layer {il}: through a window of {w} of {stored} bytes (checked {checked})"
                );
            }
        }
        windowed.push(il);
    }
    assert!(windowed.len() > 1, "{windowed:?}");
    // A staging smaller than a tensor's share of the run is refused.
    let il = windowed[0];
    let (_, len) = t.decoded_len(il).unwrap();
    let tiny = k3::stream::arena::Arena::new(4096);
    tiny.set_slots(1).unwrap();
    let mut staged = tiny.take().unwrap();
    let e = t
        .read_decode_by(il, &mut staged, &mut whole.area()[..len], &mut scratch, seg)
        .unwrap_err();
    assert!(e.to_string().contains("smaller than a tensor"), "{e}");
    // A raw tensor's byte changed on disk (no block checksum covers it): the first read
    // through a window is refused by the run's checksum, naming the layer.
    let l = &t.manifest().layers[il];
    let raw = (l.tensors.values().find(|x| !x.is_encoded())).expect("a raw tensor");
    let at = l.file_off + raw.off;
    let path = enc.join("trunk.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let fresh = trunk::Trunk::open(&enc, &ck, cfg.num_hidden_layers).unwrap();
    let w = usize::try_from(windows[il]).unwrap();
    let window = k3::stream::arena::Arena::new(w);
    window.set_slots(1).unwrap();
    let mut staged = window.take().unwrap();
    let e = fresh
        .read_decode_by(il, &mut staged, &mut whole.area()[..len], &mut scratch, seg)
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("checksum") && msg.contains(&format!("trunk layer {il}")),
        "{msg}"
    );
    assert!(!fresh.is_checked(il));
}

/// The `small` model's trunk packed nibble-coded and entropy-coded, each into a directory of
/// its own (kept while the first value lives): the directory, the model, the two trunks.
fn small_nibble_and_entropy() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let small = crate::streaming::small().join("small");
    let tmp = tempfile::tempdir().unwrap();
    let (nib, ent) = (tmp.path().join("nib"), tmp.path().join("ent"));
    pack_into(&small, &nib, Some(Coding::Nibble));
    pack_into(&small, &ent, Some(Coding::Entropy));
    (tmp, small, nib, ent)
}

/// The `small` model's trunk packed nibble-coded: every layer's run is laid out as a pinned
/// layer holds it (its matrices as stored, in order), so it can be read in place and
/// multiplied there; an entropy-coded one cannot. A read in place gives the run's bytes as
/// they lie; it is checked against the run's checksum on every read, so a byte changed on
/// disk after the layer was first read (and bound) is refused, naming the layer, with exit 3;
/// a failing read fails the layer, a short one is retried to the same bytes. The layer bound
/// there holds its matrices coded, each decoding to the decoded layer's bytes, and its other
/// tensors with the decoded layer's bytes.
#[test]
fn a_layer_read_in_place_is_checked_on_every_read() {
    let (_tmp, small, nib, ent) = small_nibble_and_entropy();
    let ck = Checkpoint::open(&small).unwrap();
    let cfg = k3::engine::ModelConfig::load(&small.join("config.json")).unwrap();
    let n = cfg.num_hidden_layers;
    let t = trunk::Trunk::open(&nib, &ck, n).unwrap();
    let e = trunk::Trunk::open(&ent, &ck, n).unwrap();
    assert!((0..n).all(|il| e.in_place_len(il).is_none()));
    let lens: Vec<usize> = (0..n)
        .map(|il| {
            t.in_place_len(il)
                .expect("a nibble-coded layer is read in place")
        })
        .collect();
    let decoded = (0..n).filter_map(|il| t.decoded_len(il)).map(|(_, d)| d);
    let most = lens.iter().copied().chain(decoded).max().unwrap();
    let arena = k3::stream::arena::Arena::new(most);
    arena.set_slots(3).unwrap();
    let (mut want, mut got, mut dec) = (
        arena.take().unwrap(),
        arena.take().unwrap(),
        arena.take().unwrap(),
    );
    let mut scratch = t.decode_scratch();
    for (il, &len) in lens.iter().enumerate() {
        assert_eq!(len as u64, t.manifest().layers[il].nbytes);
        t.read_run_into(il, want.area()).unwrap();
        for pattern in [0xAA, 0x55] {
            for b in got.area() {
                b.write(pattern);
            }
            t.read_in_place_into(il, got.area()).unwrap();
            assert!(
                got.as_slice()[..len] == want.as_slice()[..len],
                "layer {il}"
            );
        }
        // Every matrix held coded decodes to the decoded layer's tensor.
        let dlen = t.decoded_len(il).unwrap().1;
        let run = want.as_slice()[..len].to_vec();
        t.decode_run_into(il, &run, &mut dec.area()[..dlen], &mut scratch)
            .unwrap();
        let bytes = k3::stream::bytes::Bytes::copy_from(&got.as_slice()[..len]);
        let mut held = t.in_place_layer_run(il, &bytes).unwrap();
        let dbytes = k3::stream::bytes::Bytes::copy_from(&dec.as_slice()[..dlen]);
        let mut plain = t.decoded_layer_run(il, &dbytes).unwrap();
        let mut coded = 0;
        for (name, tensor) in &t.manifest().layers[il].tensors {
            let (_, want_bytes) = plain.take(name).unwrap();
            match held.take_coded(name) {
                Some(m) => {
                    let got: Vec<u8> = (m.decode().as_slice().iter())
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    assert!(got == want_bytes.as_slice(), "layer {il} {name}");
                    coded += 1;
                }
                None => {
                    // Raw, or encoded but not multiplied coded (a vector): decoded when bound.
                    assert!(
                        !trunk::holds_coded(tensor),
                        "layer {il} {name}: not held coded"
                    );
                    let (_, b) = held.take(name).unwrap();
                    assert!(b.as_slice() == want_bytes.as_slice(), "layer {il} {name}");
                }
            }
        }
        assert!(coded > 0, "layer {il}");
    }
    // A failing read fails the layer, naming it; a short one is retried to the same bytes.
    let il = n - 1;
    let len = lens[il];
    t.read_run_into(il, want.area()).unwrap();
    t.inject_fault(t.reads_issued(), Fault::Io);
    let err = t.read_in_place_into(il, got.area()).unwrap_err();
    assert!(
        err.to_string().contains(&format!("trunk layer {il}")),
        "{err}"
    );
    t.inject_fault(t.reads_issued(), Fault::Short);
    t.read_in_place_into(il, got.area()).unwrap();
    assert!(got.as_slice()[..len] == want.as_slice()[..len]);
    // A byte of the last tensor changed on disk after the layer was read and checked.
    let l = &t.manifest().layers[il];
    let last = l.tensors.values().max_by_key(|x| x.off).unwrap();
    let at = (l.file_off + last.off + last.stored / 2) as usize;
    let bin = nib.join("trunk.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[at] ^= 0x5a;
    std::fs::write(&bin, &bytes).unwrap();
    let err = t.read_in_place_into(il, got.area()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&format!("trunk layer {il}")), "{msg}");
    assert!(
        msg.contains("checksum") && msg.contains("k3 pack --force"),
        "{msg}"
    );
    assert_eq!(err.exit_code(), 3, "{msg}");
}

/// Where pinned layers are held coded, `k3 plan` on a nibble-coded trunk reads every layer in
/// place (no staging, a lower floor than the entropy-coded trunk's), and `k3 run` gives the
/// same ids and logits streaming every layer so, pinning some, and holding everything, as
/// with the entropy-coded trunk (whose layers are staged and decoded).
#[test]
fn layers_read_in_place_give_the_ids_of_layers_decoded() {
    let (tmp, small, nib, ent) = small_nibble_and_entropy();
    let (s, n, e) = (
        small.to_str().unwrap(),
        nib.to_str().unwrap(),
        ent.to_str().unwrap(),
    );
    let plan = |trunk: &str, mem: &str| {
        let (code, out, err) = k3(&["plan", s, "--trunk", trunk, "--mem", mem, "--json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (pn, pe) = (plan(n, "0.3"), plan(e, "0.3"));
    assert!(
        pn["floor_bytes"].as_u64() < pe["floor_bytes"].as_u64(),
        "{pn} {pe}"
    );
    let floor = pn["floor_bytes"].as_u64().unwrap() as f64 / 1e9;
    let model = pn["model_bytes"].as_u64().unwrap() as f64 / 1e9;
    let dump = tmp.path().join("logits.bin");
    let run = |trunk: &str, mem: Option<f64>| {
        let mem = mem.map(|m| format!("{m:.4}"));
        let mut args = vec!["run", s, "--ids", "1,2,3,4", "--gen", "6", "--trunk", trunk];
        args.extend(["--dump-logits", dump.to_str().unwrap()]);
        if let Some(m) = &mem {
            args.extend(["--mem", m]);
        }
        let (code, out, err) = k3(&args);
        assert_eq!(code, 0, "{err}");
        (out, std::fs::read(&dump).unwrap())
    };
    let want = run(e, None);
    let mut coded = 0;
    for mem in [Some(floor + 0.002), Some(floor + model / 3.0), None] {
        if let Some(m) = mem {
            let p = plan(n, &format!("{m:.4}"));
            if p["ring_coded"] == true {
                assert_eq!(p["stage_bytes"].as_u64(), Some(0), "{p}");
                coded += 1;
            }
        }
        assert_eq!(run(n, mem), want, "{mem:?} GB");
        assert_eq!(run(e, mem), want, "{mem:?} GB");
    }
    assert!(coded > 0, "some budget streams layers read in place");
    let (code, out, err) = k3(&[
        "plan",
        s,
        "--trunk",
        n,
        "--mem",
        &format!("{:.4}", floor + 0.002),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("multiplied coded") && out.contains("staging      none"),
        "{out}"
    );
}

/// `trunk::encoded_manifest` on bytes drawn by `synth::Draws` (as the released-shape
/// benchmark sizes the trunk of the sparse replica) gives the manifest `k3 pack` writes from
/// the checkpoint `k3 synth` wrote with the same seed: every layer's and the head's layout,
/// stored lengths and checksums, with either codec. A tensor the source cannot give fails it
/// with the tensor's name; a drawing of another seed stores other bytes; the drawn halves of
/// an MXFP4 expert are the written ones.
#[test]
fn a_trunk_sized_from_drawn_tensors_is_the_trunk_packed_from_the_written_checkpoint() {
    use k3::synth::{Draws, Shape};
    let (_tmp, small, nib, ent) = small_nibble_and_entropy();
    let ck = Checkpoint::open(&small).unwrap();
    let cfg = k3::engine::config::ModelConfig::load(&small.join("config.json")).unwrap();
    let head = Some(k3::engine::bind::names::LM_HEAD);
    let sized = |coding: Coding, seed: u64, skip: &str| {
        let mut draws = Draws::new(&Shape::Small.dims(), seed);
        let mut read = |name: &str, at: u64, len: u64, piece: &mut Vec<u8>| {
            let t = (name != skip)
                .then(|| draws.tensor(name))
                .flatten()
                .ok_or_else(|| k3::stream::StreamError::NoSuchTensor(name.into()))?;
            piece.clear();
            piece.extend_from_slice(&t[at as usize..(at + len) as usize]);
            Ok(())
        };
        trunk::encoded_manifest(
            &ck,
            cfg.num_hidden_layers,
            head,
            coding,
            &mut read,
            &|_, _| {},
        )
    };
    for (coding, dir) in [(Coding::Nibble, &nib), (Coding::Entropy, &ent)] {
        let packed = trunk::read_manifest(dir).unwrap();
        let m = sized(coding, 1, "").unwrap();
        assert_eq!(m.layers, packed.layers, "{coding:?}");
        assert_eq!(m.head, packed.head, "{coding:?}");
        assert!(m.head.is_some());
        assert_eq!(m.total_bytes, packed.total_bytes, "{coding:?}");
        let other = sized(coding, 2, "").unwrap();
        assert_ne!(other.layers[0].crc32, packed.layers[0].crc32);
    }
    // Drawn expert halves are the written ones too (they are not in the trunk).
    let mut draws = Draws::new(&Shape::Small.dims(), 1);
    for half in ["weight_packed", "weight_scale"] {
        let name = (ck.index().names().into_iter())
            .find(|n| n.contains(".experts.3.") && n.ends_with(half))
            .unwrap();
        let mut written = Vec::new();
        let n = ck.info(&name).unwrap().n_bytes();
        ck.read_span(&name, 0, n, &mut written).unwrap();
        assert_eq!(draws.tensor(&name).unwrap(), written, "{name}");
    }
    assert!(draws
        .tensor("language_model.model.layers.1.no_such.weight")
        .is_none());
    let name = (ck.index().names().into_iter())
        .find(|n| n.starts_with("language_model.model.layers.1.") && !n.contains(".experts."))
        .unwrap();
    let e = sized(Coding::Nibble, 1, &name).unwrap_err();
    assert!(e.to_string().contains(&name), "{e}");
    assert_eq!(e.exit_code(), 3, "{e}");
}
