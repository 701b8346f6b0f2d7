//! Messages that used to mislead, through the binary: each now names what is wrong.

use crate::bad_inputs::{copy_tiny, join, shard, split};

#[test]
fn a_budget_too_large_is_not_called_non_positive() {
    let out = crate::common::k3_command()
        .args(["run"])
        .arg(crate::common::fixture("tiny"))
        .args(["--ids", "1,2", "--gen", "1", "--mem", "1e30"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--mem") && err.contains("above the largest budget"),
        "{err}"
    );
    assert!(!err.contains("not a positive number"), "{err}");
}

#[test]
fn a_missing_a_log_names_both_shapes_it_may_have() {
    let (_t, dir) = copy_tiny();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let name = "language_model.model.layers.0.self_attn.A_log";
    let v = h.remove(name).unwrap();
    h.insert(format!("{name}_renamed"), v);
    join(&p, &h, &data);
    let out = crate::common::k3_command()
        .arg("run")
        .arg(&dir)
        .args(["--ids", "1,2", "--gen", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    // The tiny model: 4 KDA heads of dimension 16.
    assert!(
        err.contains(&format!(
            "missing tensor {name} (expected shape [4], or [16]"
        )),
        "{err}"
    );
}

#[test]
fn an_infinite_temperature_in_the_config_file_is_refused_with_its_line() {
    let cfg = tempfile::tempdir().unwrap();
    let k3dir = cfg.path().join("k3");
    std::fs::create_dir(&k3dir).unwrap();
    std::fs::write(k3dir.join("config.toml"), "[sampling]\ntemperature = inf\n").unwrap();
    let out = crate::common::k3_command()
        .args(["config", "show"])
        .env("XDG_CONFIG_HOME", cfg.path())
        .env_remove("K3_CONFIG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config.toml:2:") && err.contains("sampling.temperature: must be a finite"),
        "{err}"
    );
}

/// `k3 chat --plain --jsonl` on the tiny model with `args`, fed `input`: the exit status, the
/// turns' reports and stderr.
fn chat_tiny(
    model: &std::path::Path,
    args: &[&str],
    input: &str,
    dir: &std::path::Path,
) -> (Option<i32>, Vec<serde_json::Value>, String) {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = crate::common::k3_command()
        .arg("chat")
        .arg(model)
        .args([
            "--plain",
            "--jsonl",
            "--no-think",
            "--greedy",
            "--session-dir",
        ])
        .arg(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    let turns = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (out.status.code(), turns, err)
}

fn generated(turn: &serde_json::Value) -> usize {
    turn["generated_ids"].as_array().unwrap().len()
}

#[test]
fn a_flag_given_with_resume_wins_over_the_saved_setting_and_says_so() {
    let tiny = crate::common::fixture("tiny");
    let dir = tempfile::tempdir().unwrap();
    let (code, turns, err) = chat_tiny(
        &tiny,
        &["--max-tokens", "10"],
        "Hello K3\n/save s\n",
        dir.path(),
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(turns.len(), 1, "{err}");
    // Without a flag the session's 10 applies (the greedy reply runs to it).
    let (code, turns, err) = chat_tiny(&tiny, &["--resume", "s"], "Go on.\n", dir.path());
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("max_tokens 10 (saved session)"), "{err}");
    assert_eq!(generated(&turns[0]), 10, "{err}");
    // With one, the flag's value applies, and the start-up lines say so.
    let (code, turns, err) = chat_tiny(
        &tiny,
        &["--resume", "s", "--max-tokens", "3"],
        "Go on.\n",
        dir.path(),
    );
    assert_eq!(code, Some(0), "{err}");
    let said = err
        .lines()
        .find(|l| l.starts_with("the command line's flags win over the session's settings: "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(said.contains("max_tokens 3"), "{err}");
    assert!(err.contains("max_tokens 3 (flag)"), "{err}");
    assert_eq!(generated(&turns[0]), 3, "{err}");
    // `/load` puts the flags over the loaded session too.
    let (code, turns, err) = chat_tiny(
        &tiny,
        &["--max-tokens", "4"],
        "/load s\nGo on.\n",
        dir.path(),
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(generated(&turns[0]), 4, "{err}");
}

#[test]
fn a_load_of_a_missing_session_fails_a_piped_run_with_2() {
    let tiny = crate::common::fixture("tiny");
    let dir = tempfile::tempdir().unwrap();
    let (code, turns, err) = chat_tiny(
        &tiny,
        &["--max-tokens", "2"],
        "Hello\n/load nope\nAgain\n",
        dir.path(),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("session nope: not found"), "{err}");
    // The conversation went on around the refusal.
    assert_eq!(turns.len(), 2, "{err}");
    // A load that succeeds leaves the status at 0.
    let (code, _, err) = chat_tiny(&tiny, &["--max-tokens", "2"], "Hi\n/save x\n", dir.path());
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = chat_tiny(&tiny, &["--max-tokens", "2"], "/load x\nHi\n", dir.path());
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_model_dir_holding_escape_sequences_is_printed_escaped() {
    let (tmp, plain) = copy_tiny();
    let dir = tmp.path().join("m\u{1b}[31mred\u{7}");
    std::fs::rename(&plain, &dir).unwrap();
    let shown = "m\\u{1b}[31mred\\u{7}";
    let raw = |s: &str| s.contains('\u{1b}') || s.contains('\u{7}');
    let sessions = tempfile::tempdir().unwrap();
    let (code, _, err) = chat_tiny(&dir, &["--max-tokens", "2"], "Hi\n", sessions.path());
    assert_eq!(code, Some(0), "{err}");
    assert!(!raw(&err), "{err:?}");
    assert!(err.contains(shown), "{err}");
    // An error naming the directory.
    let missing = tmp.path().join("gone\u{1b}[2J");
    let out = crate::common::k3_command()
        .arg("run")
        .arg(&missing)
        .args(["--ids", "1", "--gen", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!raw(&err), "{err:?}");
    assert!(err.contains("gone\\u{1b}[2J"), "{err}");
    // What `k3 pack` and `k3 plan` print.
    let trunk = tmp.path().join("t\u{1b}[31m");
    let out = crate::common::k3_command()
        .arg("pack")
        .arg(&dir)
        .arg(&trunk)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!raw(&err) && err.contains("t\\u{1b}[31m"), "{err:?}");
    let out = crate::common::k3_command()
        .arg("plan")
        .arg(&dir)
        .arg("--trunk")
        .arg(&trunk)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(!raw(&text) && text.contains("t\\u{1b}[31m"), "{text:?}");
}
