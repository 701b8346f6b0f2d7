//! Bad inputs through the real binary: each refusal names its problem and exits with its code,
//! and nothing panics (docs/reliability.md#bad-input-files).

use crate::common::fixture;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A scratch copy of the tiny checkpoint.
pub(crate) fn copy_tiny() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("tiny");
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(fixture("tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    (tmp, dst)
}

pub(crate) fn shard(dir: &Path, k: usize) -> PathBuf {
    dir.join(format!("model-0000{k}-of-000003.safetensors"))
}

/// Run `k3 run DIR --ids 1,2 --gen 1`; returns (exit code, stderr).
fn run_k3(dir: &Path) -> (i32, String) {
    run_k3_with(dir, &[], &[])
}

/// [`run_k3`] with `extra` arguments and `envs` set.
fn run_k3_with(dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", dir.to_str().unwrap(), "--ids", "1,2", "--gen", "1"])
        .args(extra)
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out.status.code().unwrap_or(-1), err)
}

/// Split a shard into (header JSON, data).
pub(crate) fn split(path: &Path) -> (serde_json::Map<String, serde_json::Value>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let v: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (v.as_object().unwrap().clone(), bytes[8 + n..].to_vec())
}

pub(crate) fn join(path: &Path, header: &serde_json::Map<String, serde_json::Value>, data: &[u8]) {
    let json = serde_json::to_vec(header).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

#[test]
fn control_copy_loads() {
    let (_t, dir) = copy_tiny();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn truncated_shard_is_refused_at_open() {
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 2);
    let len = std::fs::metadata(&p).unwrap().len();
    for cut in [len - 1, len / 2, 100, 4] {
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(cut).unwrap();
        let (code, err) = run_k3(&dir);
        assert_eq!(code, 3, "cut at {cut}: {err}");
        assert!(err.contains("model-00002-of-000003.safetensors"), "{err}");
    }
}

#[test]
fn header_length_beyond_file_is_refused() {
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 1);
    let mut bytes = std::fs::read(&p).unwrap();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("exceeds the") && err.contains("after the 8-byte prefix"),
        "{err}"
    );
}

#[test]
fn git_lfs_pointer_gets_a_hint() {
    let (_t, dir) = copy_tiny();
    std::fs::write(
        shard(&dir, 3),
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 263448\n",
    )
    .unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("Git LFS pointer"), "{err}");
}

#[test]
fn overlapping_offsets_are_refused() {
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let a = "language_model.model.layers.0.input_layernorm.weight";
    let b = "language_model.model.layers.0.post_attention_layernorm.weight";
    let offs = h[a]["data_offsets"].clone();
    h.get_mut(b).unwrap()["data_offsets"] = offs;
    join(&p, &h, &data);
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("overlaps") || err.contains("unindexed"),
        "{err}"
    );
}

#[test]
fn dtype_shape_mismatch_is_refused() {
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let a = "language_model.model.layers.0.input_layernorm.weight";
    h.get_mut(a).unwrap()["dtype"] = serde_json::json!("F32");
    join(&p, &h, &data);
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("input_layernorm") && err.contains("span"),
        "{err}"
    );
}

/// A copy of the tiny checkpoint (no index file) whose layer 2 `dt_bias` is stored under
/// another name: one tensor missing, one unclaimed.
fn tiny_with_a_renamed_tensor() -> (tempfile::TempDir, PathBuf) {
    let (t, dir) = copy_tiny();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let a = "language_model.model.layers.2.self_attn.dt_bias";
    let v = h.remove(a).unwrap();
    h.insert(
        "language_model.model.layers.2.self_attn.dt_bias_renamed".into(),
        v,
    );
    join(&p, &h, &data);
    (t, dir)
}

#[test]
fn missing_tensor_is_named() {
    let (_t, dir) = tiny_with_a_renamed_tensor();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("missing tensor language_model.model.layers.2.self_attn.dt_bias"),
        "{err}"
    );
    assert!(err.contains("not used by the configured graph"), "{err}");
}

/// Under a budget the graph is validated while the plan's weights are read; a checkpoint it
/// refuses is refused with the validation's message, whichever weight the reading failed on
/// first, at every budget and in both read paths.
#[test]
fn a_refusal_under_a_budget_is_the_validations() {
    let (_t, dir) = tiny_with_a_renamed_tensor();
    let (code, resident) = run_k3(&dir);
    assert_eq!(code, 3, "{resident}");
    for mem in ["0.05", "1000"] {
        for mapped in ["1", "0"] {
            let (code, err) = run_k3_with(&dir, &["--mem", mem], &[("K3_MMAP", mapped)]);
            assert_eq!(code, 3, "--mem {mem}: {err}");
            // The loader alone would only miss the tensor; validation also names the
            // unclaimed one.
            assert!(
                err.contains("missing tensor language_model.model.layers.2.self_attn.dt_bias")
                    && err.contains("not used by the configured graph"),
                "--mem {mem}, K3_MMAP={mapped}: {err}"
            );
        }
    }
    // The control: the same budgets load the intact checkpoint.
    let (_t2, good) = copy_tiny();
    for mem in ["0.05", "1000"] {
        let (code, err) = run_k3_with(&good, &["--mem", mem], &[]);
        assert_eq!(code, 0, "--mem {mem}: {err}");
    }
}

#[test]
fn missing_shard_is_named() {
    let (_t, dir) = copy_tiny();
    std::fs::remove_file(shard(&dir, 2)).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("missing shard") && err.contains("model-00002-of-000003"),
        "{err}"
    );
}

#[test]
fn missing_config_keys_are_all_listed() {
    let (_t, dir) = copy_tiny();
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let tc = v["text_config"].as_object_mut().unwrap();
    tc.remove("hidden_size");
    tc.remove("kv_lora_rank");
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("hidden_size") && err.contains("kv_lora_rank"),
        "{err}"
    );
}

#[test]
fn corrupt_rank_file_is_refused_with_its_line() {
    let (_t, dir) = copy_tiny();
    let p = dir.join("tiktoken.model");
    let mut text = std::fs::read_to_string(&p).unwrap();
    text = text.replacen("JA== 3", "JA== x3", 1);
    std::fs::write(&p, text).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("line 4"), "{err}");
}

#[test]
fn out_of_vocabulary_id_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", fixture("tiny").to_str().unwrap(), "--ids", "1,99999"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("99999"));
}

/// Set the config value at `path` (dotted, from the root) in `dir/config.json`.
pub(crate) fn set_config(dir: &Path, path: &str, value: serde_json::Value) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let mut at = &mut v;
    let keys: Vec<&str> = path.split('.').collect();
    for k in &keys[..keys.len() - 1] {
        at = &mut at[*k];
    }
    at[keys[keys.len() - 1]] = value;
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn huge_config_dimensions_are_refused_before_anything_is_sized() {
    let cases = [
        ("text_config.num_hidden_layers", serde_json::json!(1e9)),
        (
            "text_config.num_hidden_layers",
            serde_json::json!(1_048_576),
        ),
        ("text_config.num_experts", serde_json::json!(1e9)),
        ("text_config.num_experts", serde_json::json!(100_000)),
        ("text_config.hidden_size", serde_json::json!(1e300)),
        ("text_config.vocab_size", serde_json::json!(1u64 << 40)),
        (
            "text_config.linear_attn_config.num_heads",
            serde_json::json!(1_048_576),
        ),
    ];
    for (key, value) in cases {
        let (_t, dir) = copy_tiny();
        set_config(&dir, key, value.clone());
        let (code, err) = run_k3(&dir);
        assert_eq!(code, 2, "{key} = {value}: {err}");
        assert!(
            err.contains(&format!("`{key}`")) && err.contains("above the limit"),
            "{key} = {value}: {err}"
        );
        assert!(err.len() < 1000, "{key} = {value}: {} bytes", err.len());
    }
}

#[test]
fn more_kda_heads_than_head_dim_is_a_refusal_not_a_panic() {
    let (_t, dir) = copy_tiny();
    set_config(
        &dir,
        "text_config.linear_attn_config.num_heads",
        serde_json::json!(17),
    );
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("A_log") && err.contains("17 heads"), "{err}");
}

#[test]
fn long_problem_lists_are_capped() {
    // Within the bounds, but the checkpoint holds 8 experts: a million missing tensors.
    let (_t, dir) = copy_tiny();
    set_config(&dir, "text_config.num_experts", serde_json::json!(14_336));
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("more") && err.contains("… and"), "{err}");
    assert!(err.lines().count() < 30, "{err}");
    // A layer list longer than the model, and one with a value too long to print whole.
    let (_t, dir) = copy_tiny();
    let many: Vec<u32> = (1..=100_000).collect();
    set_config(
        &dir,
        "text_config.linear_attn_config.full_attn_layers",
        serde_json::json!(many),
    );
    set_config(
        &dir,
        "text_config.hidden_act",
        serde_json::json!("x".repeat(1 << 20)),
    );
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("lists 100000 layers; the model has 13"),
        "{err}"
    );
    assert!(err.len() < 2000, "{} bytes", err.len());
}

#[test]
fn file_names_from_the_index_and_the_directory_are_printed_escaped() {
    let evil = "\u{1b}]0;owned\u{7}x.safetensors";
    // A weight_map entry naming a file that is not there.
    let (_t, dir) = copy_tiny();
    let p = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let map = v["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map[&first] = serde_json::json!(evil);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("missing shard"), "{err}");
    assert!(err.contains("\\u{1b}]0;owned\\u{7}x"), "{err}");
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    // A stray file in the model directory.
    let (_t, dir) = copy_tiny();
    std::fs::write(dir.join(evil), b"").unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("not named by the index"), "{err}");
    assert!(err.contains("\\u{1b}]0;owned\\u{7}x"), "{err}");
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    // Many strays are counted, not all listed.
    for i in 0..50 {
        std::fs::write(dir.join(format!("stray-{i}.safetensors")), b"").unwrap();
    }
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("51 shard file(s)") && err.contains("and 31 more"),
        "{err}"
    );
}

#[test]
fn misleading_messages_say_what_is_wrong() {
    // A header length of 0 is not "exceeding" anything.
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 1);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[..8].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("header length is 0") && !err.contains("exceeds"),
        "{err}"
    );
    // A FIFO where a shard should be is not "missing", and opening it must not block.
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 2);
    std::fs::remove_file(&p).unwrap();
    let status = Command::new("mkfifo").arg(&p).status().unwrap();
    assert!(status.success());
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("is a FIFO, not a regular file") && !err.contains("missing shard"),
        "{err}"
    );
    // A value too large is not "must be an integer ≥ 1".
    let (_t, dir) = copy_tiny();
    set_config(
        &dir,
        "text_config.intermediate_size",
        serde_json::json!(1e12),
    );
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("above the limit") && !err.contains("≥"),
        "{err}"
    );
}

#[test]
fn a_bad_session_name_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for flag in ["--session", "--resume"] {
        let out = Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("chat")
            .arg(fixture("tiny"))
            .args(["--plain", flag, "../x", "--session-dir"])
            .arg(dir.path())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(
            err.contains(flag) && err.contains("\"../x\""),
            "{flag}: {err}"
        );
        // Refused before the model was opened: no ready line.
        assert!(!err.contains("layers, vocabulary"), "{flag}: {err}");
    }
}

#[test]
fn a_bad_shard_with_a_hostile_name_is_named_escaped() {
    // The index names an existing shard whose name carries an escape sequence, and the shard
    // is truncated: the header refusal names it escaped.
    let evil = "\u{1b}]0;owned\u{7}.safetensors";
    let (_t, dir) = copy_tiny();
    let old = "model-00002-of-000003.safetensors";
    let bytes = std::fs::read(dir.join(old)).unwrap();
    std::fs::remove_file(dir.join(old)).unwrap();
    std::fs::write(dir.join(evil), &bytes[..bytes.len() / 2]).unwrap();
    let p = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for file in v["weight_map"].as_object_mut().unwrap().values_mut() {
        if file == old {
            *file = serde_json::json!(evil);
        }
    }
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("\\u{1b}]0;owned\\u{7}"), "{err}");
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
}

#[test]
fn an_oversized_or_ambiguous_index_is_refused_before_it_costs_anything() {
    // An index above the bound is refused from its size, before it is read (the file is
    // sparse: it costs no disk).
    let (_t, dir) = copy_tiny();
    let p = dir.join("model.safetensors.index.json");
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(k3::stream::weight_map::MAX_INDEX_LEN + 1)
        .unwrap();
    drop(f);
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!(
            "{} bytes, above the maximum of {} bytes for an index",
            k3::stream::weight_map::MAX_INDEX_LEN + 1,
            k3::stream::weight_map::MAX_INDEX_LEN
        )),
        "{err}"
    );
    // A tensor named twice, for two shards: which one holds it is ambiguous.
    let (_t, dir) = copy_tiny();
    let p = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let map = v["weight_map"].as_object().unwrap();
    let (tensor, file) = map.iter().next().unwrap();
    let other = map.values().find(|f| *f != file).unwrap().as_str().unwrap();
    let at = text.find("\"weight_map\"").unwrap();
    let brace = at + text[at..].find('{').unwrap() + 1;
    let text = format!(
        "{}\"{tensor}\": \"{other}\", {}",
        &text[..brace],
        &text[brace..]
    );
    std::fs::write(&p, text).unwrap();
    let (code, err) = run_k3(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("names tensor {tensor:?} twice")),
        "{err}"
    );
}

/// A speed knob with a value it does not take is refused at start, naming the variable
/// (exit 2), instead of quietly running with its default; a valid one runs.
#[test]
fn a_malformed_tuning_variable_is_refused_by_name() {
    let tiny = fixture("tiny");
    for (var, value) in [
        ("K3_PREFETCH", "lots"),
        ("K3_IO_THREADS", "0"),
        ("K3_KERNELS", "avx3"),
        ("K3_ROW_ORDER", "diagonal"),
        ("K3_MMAP", "yes"),
        ("K3_KEEP_WARM", "on"),
    ] {
        let (code, err) = run_k3_with(&tiny, &[], &[(var, value)]);
        assert_eq!(code, 2, "{var}={value}: {err}");
        assert!(err.contains(var) && err.contains(value), "{err}");
    }
    let (code, err) = run_k3_with(
        &tiny,
        &[],
        &[("K3_PREFETCH", "4"), ("K3_ROW_ORDER", "single")],
    );
    assert_eq!(code, 0, "{err}");
}

/// The tuning in force, as `k3 run --json` reports it, with `extra` flags, `envs` and a config
/// file holding `toml`.
fn tuning_in_force(extra: &[&str], envs: &[(&str, &str)], toml: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, toml).unwrap();
    let tiny = fixture("tiny");
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args([
            "run",
            tiny.to_str().unwrap(),
            "--ids",
            "1,2",
            "--gen",
            "1",
            "--json",
        ])
        .args(extra)
        .env("K3_CONFIG", &cfg)
        .env_remove("K3_IO_THREADS")
        .env_remove("K3_PREFETCH")
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.code().unwrap_or(-1), stdout, err)
}

#[test]
fn tuning_comes_from_flags_then_environment_then_the_config_file() {
    let knobs = |stdout: &str| -> (u64, u64) {
        let v: serde_json::Value = serde_json::from_str(stdout).expect("json");
        let t = &v["kernels"]["tuning"];
        (
            t["io_threads"].as_u64().expect("io_threads"),
            t["prefetch"].as_u64().expect("prefetch"),
        )
    };
    let file = "[tuning]\nio_threads = 3\nprefetch = 5\n";
    let (code, out, err) = tuning_in_force(&[], &[], file);
    assert_eq!(code, 0, "{err}");
    assert_eq!(knobs(&out), (3, 5));
    let (code, out, err) = tuning_in_force(&[], &[("K3_IO_THREADS", "4")], file);
    assert_eq!(code, 0, "{err}");
    assert_eq!(knobs(&out), (4, 5));
    let (code, out, err) = tuning_in_force(
        &["--tune", "io-threads=6", "--tune", "K3_PREFETCH=7"],
        &[("K3_IO_THREADS", "4")],
        file,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(knobs(&out), (6, 7));
}

#[test]
fn a_malformed_tuning_flag_or_table_entry_is_refused_by_name() {
    let (code, _, err) = tuning_in_force(&["--tune", "io_threads=0"], &[], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tune io_threads=\"0\""), "{err}");
    let (code, _, err) = tuning_in_force(&["--tune", "warp_speed=9"], &[], "");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("warp_speed") && err.contains("io_threads"),
        "{err}"
    );
    let (code, _, err) = tuning_in_force(&[], &[], "[tuning]\nkernels = \"avx3\"\n");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("config.toml:2:") && err.contains("tuning.kernels"),
        "{err}"
    );
    let (code, _, err) = tuning_in_force(&[], &[], "[tuning]\nturbo = true\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("turbo"), "{err}");
}
