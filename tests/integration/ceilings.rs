//! Requests above a ceiling, through the real binary: each is refused before it costs anything
//! (no prefill, no weight read), with exit 2 and the numbers involved (docs/reliability.md#exit-codes).

use crate::common::{fixture, k3_command};
use std::path::Path;

/// Run `k3 ARGS`; returns (exit code, stderr). A panic is never acceptable.
fn k3(args: &[&str]) -> (i32, String) {
    let out = k3_command().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out.status.code().unwrap_or(-1), err)
}

fn tiny() -> String {
    fixture("tiny").to_str().unwrap().to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn run_prompt_above_the_context_is_refused_with_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let short = write(tmp.path(), "short.txt", &"a b ".repeat(10));
    let long = write(tmp.path(), "long.txt", &"a b ".repeat(200));
    let tiny = tiny();
    // Control: a prompt that fits runs.
    let base = [
        "run",
        &tiny,
        "--gen",
        "2",
        "--context",
        "64",
        "--prompt-file",
    ];
    let (code, err) = k3(&[&base[..], &[short.as_str()]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, err) = k3(&[&base[..], &[long.as_str()]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("exceed --context 64") && err.contains("--gen is 2"),
        "{err}"
    );
    // Ids count the same way, and the default context is a ceiling too.
    let ids = vec!["1"; 70].join(",");
    let (code, err) = k3(&["run", &tiny, "--ids", &ids, "--context", "64"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the prompt is 70 tokens"), "{err}");
    let (code, err) = k3(&["run", &tiny, "--ids", "1", "--context", "2000000"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("limit of 1048576"), "{err}");
}

#[test]
fn run_prompt_file_that_cannot_fit_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    // 4 MB can never be 16 tokens: refused from its size, before it is read or tokenized.
    let big = write(tmp.path(), "big.txt", &"a b ".repeat(1 << 20));
    let (code, err) = k3(&["run", &tiny(), "--prompt-file", &big, "--context", "16"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("4194304 bytes is more than") && err.contains("16 tokens of --context"),
        "{err}"
    );
}

#[test]
fn run_plan_holds_state_for_the_prompt_it_is_given() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny();
    // A budget that runs a short prompt but cannot hold the carried state of a long one.
    let short = write(tmp.path(), "short.txt", "a b a b");
    let long = write(tmp.path(), "long.txt", &"a b ".repeat(60_000));
    let base = [
        "run",
        &tiny,
        "--gen",
        "1",
        "--context",
        "1000000",
        "--mem",
        "0.07",
    ];
    let (code, err) = k3(&[&base[..], &["--prompt-file", short.as_str()]].concat());
    assert_eq!(code, 0, "{err}");
    let (code, err) = k3(&[&base[..], &["--prompt-file", long.as_str()]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("below the floor") && err.contains("positions"),
        "{err}"
    );
}

#[test]
fn threads_above_the_limit_are_refused() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = (cores * 8).min(1024);
    let tiny = tiny();
    let too_many = (max + 1).to_string();
    for n in [too_many.as_str(), "100000"] {
        let (code, err) = k3(&["run", &tiny, "--ids", "1", "--gen", "1", "--threads", n]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("limit of {max}")), "{err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = k3_command()
        .args([
            "chat",
            &tiny,
            "--plain",
            "--threads",
            "100000",
            "--session-dir",
        ])
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("limit of {max}")), "{err}");
    // The limit itself is accepted.
    let (code, err) = k3(&[
        "run",
        &tiny,
        "--ids",
        "1",
        "--gen",
        "1",
        "--threads",
        &max.to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn chat_context_above_the_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    let chat = |extra: &[&str]| {
        let out = k3_command()
            .args(["chat", &tiny(), "--plain", "--session-dir"])
            .arg(dir.path())
            .args(extra)
            .env("K3_CONFIG", &cfg)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().unwrap_or(-1), err)
    };
    let (code, err) = chat(&["--context", "2000000"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--context 2000000 is above the limit of 1048576"),
        "{err}"
    );
    std::fs::write(&cfg, "[sampling]\ncontext = 2000000\n").unwrap();
    let (code, err) = chat(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("config.toml:2:11: sampling.context"), "{err}");
}
