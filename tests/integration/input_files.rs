//! Input files that are not regular files, or far too large, through the binary: a FIFO never
//! makes k3 wait, a device is never read, and a size known up front is refused before reading.

use crate::bad_inputs::copy_tiny;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run k3 with `args`, killing it (and failing) past 60 s; (exit code, stderr).
fn run_bounded(args: &[&str], envs: &[(&str, &std::ffi::OsStr)]) -> (i32, String) {
    let mut child = crate::common::k3_command()
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("k3 {args:?} still running after 60 s: it waits on its input");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out.status.code().unwrap_or(-1), err)
}

fn mkfifo(p: &Path) {
    let _ = std::fs::remove_file(p);
    assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
}

fn devzero(p: &Path) {
    let _ = std::fs::remove_file(p);
    std::os::unix::fs::symlink("/dev/zero", p).unwrap();
}

#[test]
fn a_fifo_or_a_device_in_place_of_a_model_file_is_refused_by_name() {
    // (file, exit code): config.json is a configuration refusal (2), the others bad model
    // input (3).
    let cases = [
        ("config.json", 2),
        ("tokenizer_config.json", 3),
        ("tiktoken.model", 3),
        ("model.safetensors.index.json", 3),
    ];
    for (file, code) in cases {
        for (what, make) in [
            ("a FIFO", mkfifo as fn(&Path)),
            ("a device", devzero as fn(&Path)),
        ] {
            let (_t, dir) = copy_tiny();
            make(&dir.join(file));
            // A text prompt, so that the tokenizer is needed.
            let (got, err) = run_bounded(
                &[
                    "run",
                    dir.to_str().unwrap(),
                    "--prompt",
                    "hello",
                    "--gen",
                    "1",
                ],
                &[],
            );
            assert_eq!(got, code, "{file} as {what}: {err}");
            assert!(
                err.contains(file) && err.contains(&format!("is {what}, not a regular file")),
                "{file} as {what}: {err}"
            );
            // Not the messages of a missing or empty file.
            assert!(
                !err.contains("use --ids") && !err.contains("found 0 bytes"),
                "{file} as {what}: {err}"
            );
        }
    }
}

#[test]
fn a_fifo_as_the_config_file_or_a_trunk_file_does_not_hang() {
    let cfg = tempfile::tempdir().unwrap();
    let k3dir = cfg.path().join("k3");
    std::fs::create_dir(&k3dir).unwrap();
    mkfifo(&k3dir.join("config.toml"));
    let (code, err) = run_bounded(
        &["config", "show"],
        &[("XDG_CONFIG_HOME", cfg.path().as_os_str())],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("config.toml") && err.contains("is a FIFO, not a regular file"),
        "{err}"
    );

    // A packed trunk whose manifest or data is a FIFO.
    let (_t, dir) = copy_tiny();
    let trunk = dir.parent().unwrap().join("trunk");
    let (code, err) = run_bounded(
        &["pack", dir.to_str().unwrap(), trunk.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    for file in ["trunk.json", "trunk.bin"] {
        let saved = std::fs::read(trunk.join(file)).unwrap();
        mkfifo(&trunk.join(file));
        let (code, err) = run_bounded(
            &[
                "run",
                dir.to_str().unwrap(),
                "--ids",
                "1,2",
                "--gen",
                "1",
                "--trunk",
                trunk.to_str().unwrap(),
            ],
            &[],
        );
        assert_ne!(code, 0, "{file}: {err}");
        assert!(
            err.contains(file) && err.contains("is a FIFO, not a regular file"),
            "{file}: {err}"
        );
        std::fs::remove_file(trunk.join(file)).unwrap();
        std::fs::write(trunk.join(file), saved).unwrap();
    }
}

#[test]
fn a_sparse_8_gb_rank_file_is_refused_by_its_size_without_reading_it() {
    let (_t, dir) = copy_tiny();
    let p = dir.join("tiktoken.model");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    let size: u64 = 8 << 30;
    f.set_len(size).unwrap();
    drop(f);
    let out = crate::common::k3_command()
        .arg("verify")
        .arg(&dir)
        .arg("--json")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = v["problems"].to_string();
    assert!(
        problems.contains(&format!("found {size} bytes")),
        "{problems}"
    );
    // Nothing near the 256 MiB cap was read into memory.
    let peak = v["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak > 0);
    assert!(peak < 128 << 20, "peak RSS {peak} bytes");
}

/// Rewrite shard `k` of `dir` with `lead` before its header's JSON (the length counts it).
fn lead_header(dir: &Path, k: usize, lead: &str) {
    let p = crate::bad_inputs::shard(dir, k);
    let (h, data) = crate::bad_inputs::split(&p);
    let mut json = lead.as_bytes().to_vec();
    json.extend_from_slice(&serde_json::to_vec(&h).unwrap());
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&data);
    std::fs::write(&p, out).unwrap();
}

/// `k3 run DIR --ids 1,2,3 --gen 4`: (exit code, stdout, stderr).
fn run_ids(dir: &Path) -> (i32, String, String) {
    let out = crate::common::k3_command()
        .args(["run", dir.to_str().unwrap(), "--ids", "1,2,3", "--gen", "4"])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_shard_header_may_start_with_json_whitespace() {
    let (_a, plain) = copy_tiny();
    let (code, want, err) = run_ids(&plain);
    assert_eq!(code, 0, "{err}");
    let (_b, dir) = copy_tiny();
    lead_header(&dir, 1, " \n\t\r ");
    let (code, got, err) = run_ids(&dir);
    assert_eq!(code, 0, "{err}");
    assert_eq!(got, want, "the same tokens as the untouched checkpoint");
    // Anything else before the object is still refused.
    let (_c, dir) = copy_tiny();
    lead_header(&dir, 1, " x");
    let (code, _, err) = run_ids(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("must be a JSON object"), "{err}");
}
