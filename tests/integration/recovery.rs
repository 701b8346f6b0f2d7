//! Nothing lost: the journal beside a session, through the real binary (`kill -9` after
//! turns, torn records, a conversation never saved), and the exit status of a turn abandoned
//! on a read error.

use crate::common::{fixture, k3_command};
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Stdio};

const BASE: [&str; 6] = [
    "--plain",
    "--jsonl",
    "--no-think",
    "--max-tokens",
    "9",
    "--session-dir",
];

fn chat_cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = k3_command();
    c.arg("chat")
        .arg(fixture("tiny"))
        .args(BASE)
        .arg(dir)
        .args(args);
    c
}

/// Run to the end of `input`; (exit code, JSON lines, stderr).
fn chat(dir: &Path, args: &[&str], input: &str) -> (i32, Vec<serde_json::Value>, String) {
    finish(chat_cmd(dir, args), input)
}

/// Run `cmd` to the end of `input`; (exit code, JSON lines, stderr).
fn finish(mut cmd: Command, input: &str) -> (i32, Vec<serde_json::Value>, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (out.status.code().unwrap_or(-1), lines, err)
}

/// Send `input`, wait for `turns` finished turns on stdout (the journal is durable before a
/// turn is reported), then SIGKILL the process with its stdin still open.
fn kill_9_after(dir: &Path, args: &[&str], input: &str, turns: usize) {
    kill_9(chat_cmd(dir, args), input, turns);
}

/// [`kill_9_after`] for any `k3 chat` command.
fn kill_9(mut cmd: Command, input: &str, turns: usize) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    stdin.flush().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..turns {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "ended before {turns} turns"
        );
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert_eq!(status.code(), None, "killed by a signal");
    drop(stdin);
}

fn same_turn(a: &serde_json::Value, b: &serde_json::Value, what: &str) {
    assert_eq!(a["generated_ids"], b["generated_ids"], "{what}");
    assert_eq!(a["prompt_ids"], b["prompt_ids"], "{what}");
}

#[test]
fn turns_before_a_kill_9_are_recovered_and_continue_exactly() {
    for sampling in [
        &["--greedy"][..],
        &["--temperature", "1", "--seed", "11"][..],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (code, whole, err) = chat(dir.path(), sampling, "Hello K3\nWhy?\nGo on.\n");
        assert_eq!((code, whole.len()), (0, 3), "{err}");

        // Never saved: the journal is the only copy.
        let mut args = sampling.to_vec();
        args.extend(["--session", "never"]);
        kill_9_after(dir.path(), &args, "Hello K3\nWhy?\n", 2);
        assert!(!dir.path().join("never.k3session").exists());
        assert!(dir.path().join("never.k3journal").is_file());
        let mut args = sampling.to_vec();
        args.extend(["--resume", "never"]);
        let (code, rest, err) = chat(dir.path(), &args, "Go on.\n");
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("recovered 2 unsaved turns from"), "{err}");
        assert!(err.contains("never.k3journal"), "{err}");
        same_turn(&whole[2], &rest[0], &format!("{sampling:?} never saved"));

        // Saved after one turn, killed after the next: the saved file is not changed by the
        // resume, and the recovered turn continues exactly.
        let mut args = sampling.to_vec();
        args.extend(["--session", "s"]);
        kill_9_after(dir.path(), &args, "Hello K3\n/save\nWhy?\n", 2);
        let saved = std::fs::read(dir.path().join("s.k3session")).unwrap();
        let mut args = sampling.to_vec();
        args.extend(["--resume", "s"]);
        let (code, rest, err) = chat(dir.path(), &args, "Go on.\n");
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("recovered 1 unsaved turn from"), "{err}");
        same_turn(
            &whole[2],
            &rest[0],
            &format!("{sampling:?} saved then killed"),
        );
        assert_eq!(
            std::fs::read(dir.path().join("s.k3session")).unwrap(),
            saved,
            "the saved session is replaced only by /save"
        );
        // A /save takes the recovered turns in and retires the journal.
        let (code, _, err) = chat(dir.path(), &args, "/save\n");
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("recovered 2 unsaved turns"), "{err}");
        assert!(!dir.path().join("s.k3journal").exists(), "{err}");
        let (code, rest, err) = chat(dir.path(), &args, "");
        assert_eq!((code, rest.len()), (0, 0), "{err}");
        assert!(!err.contains("recovered"), "{err}");
        assert!(err.contains("positions, no re-prefill needed"), "{err}");
    }
}

#[test]
fn a_torn_last_journal_record_is_ignored_with_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    let (code, whole, err) = chat(dir.path(), &["--greedy"], "Hello K3\nWhy?\n");
    assert_eq!((code, whole.len()), (0, 2), "{err}");
    kill_9_after(
        dir.path(),
        &["--greedy", "--session", "t"],
        "Hello K3\nWhy?\n",
        2,
    );
    let journal = dir.path().join("t.k3journal");
    let full = std::fs::read(&journal).unwrap();

    // A write cut short inside the last record: the turn before it is recovered.
    std::fs::write(&journal, &full[..full.len() - 7]).unwrap();
    let (code, rest, err) = chat(dir.path(), &["--greedy", "--resume", "t"], "Why?\n");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("recovered 1 unsaved turn from"), "{err}");
    assert!(err.contains("ignored a torn last record"), "{err}");
    same_turn(&whole[1], &rest[0], "after a torn record");

    // Garbage after complete records (a partial append): both turns are recovered.
    let mut garbage = full.clone();
    garbage.extend_from_slice(&[0x55; 13]);
    std::fs::write(&journal, &garbage).unwrap();
    let (code, rest, err) = chat(dir.path(), &["--greedy", "--resume", "t"], "");
    assert_eq!((code, rest.len()), (0, 0), "{err}");
    assert!(err.contains("recovered 2 unsaved turns from"), "{err}");
    assert!(
        err.contains("ignored a torn last record") && err.contains("(13 bytes at byte"),
        "{err}"
    );
    // The torn tail was cut off when the journal was taken up again.
    let (code, _, err) = chat(dir.path(), &["--greedy", "--resume", "t"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("recovered 2 unsaved turns from"), "{err}");
    assert!(!err.contains("torn"), "{err}");
}

#[test]
fn a_conversation_never_saved_is_named_at_its_first_turn_and_says_how_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let (code, whole, err) = chat(dir.path(), &["--greedy"], "Hello K3\nWhy?\n");
    assert_eq!((code, whole.len()), (0, 2), "{err}");
    let (code, _, err) = chat(dir.path(), &["--greedy"], "Hello K3\n");
    assert_eq!(code, 0, "{err}");
    let name = err
        .split("`k3 chat --resume ")
        .nth(1)
        .and_then(|s| s.split('`').next())
        .unwrap_or_else(|| panic!("no resume command in: {err}"))
        .to_string();
    assert!(name.starts_with("hello-k3-20"), "{name}");
    let (code, rest, err) = chat(dir.path(), &["--greedy", "--resume", &name], "Why?\n");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("was never saved"), "{err}");
    assert!(err.contains("recovered 1 unsaved turn"), "{err}");
    same_turn(&whole[1], &rest[0], "never saved, ended by EOF");
    // A journal that does not continue the saved version is kept aside, never applied.
    let (code, _, err) = chat(dir.path(), &["--greedy"], "Hello K3\n/save other\n");
    assert_eq!(code, 0, "{err}");
    std::fs::copy(
        dir.path().join(format!("{name}.k3journal")),
        dir.path().join("other.k3journal"),
    )
    .unwrap();
    let (code, _, err) = chat(dir.path(), &["--greedy", "--resume", "other"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("not applied (kept as"), "{err}");
    assert!(!dir.path().join("other.k3journal").exists());
}

#[test]
fn a_read_error_during_a_turn_exits_1_when_stdin_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    // Streamed under a small budget, so the turn reads weights; the first such read fails.
    let args = ["--greedy", "--mem", "0.05", "--context", "256"];
    let run = |fault: Option<&str>| {
        let mut cmd = chat_cmd(dir.path(), &args);
        if let Some(f) = fault {
            cmd.env("K3_FAULT", f);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let _ = child.stdin.take().unwrap().write_all(b"Hello K3\n");
        let out = child.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(None);
    assert_eq!(code, 0, "{err}");
    let (code, err) = run(Some("eio@0"));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("read error in") && err.contains("abandoned"),
        "{err}"
    );
    // A transient error is retried and the turn completes.
    let (code, err) = run(Some("eio-once@0"));
    assert_eq!(code, 0, "{err}");
    let (code, err) = run(Some("eio"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("K3_FAULT"), "{err}");
}

#[test]
fn new_lets_the_last_conversation_go_with_its_journal_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (code, lines, err) = chat(
        dir.path(),
        &["--greedy", "--session", "first"],
        "Hello K3\n/new\nWhy?\n",
    );
    assert_eq!((code, lines.len()), (0, 2), "{err}");
    assert!(
        err.contains("first.k3journal: --resume first recovers them"),
        "{err}"
    );
    // The new conversation has a name of its own, from its first words.
    assert!(err.contains("`k3 chat --resume why-20"), "{err}");
    let (code, _, err) = chat(dir.path(), &["--greedy", "--resume", "first"], "");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("recovered 1 unsaved turn from"), "{err}");
}

#[test]
fn a_stopped_reply_is_journaled_with_its_partial_text() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = k3_command()
        .arg("chat")
        .arg(fixture("tiny"))
        .args(["--plain", "--greedy", "--no-think", "--session", "cut"])
        .args(["--max-tokens", "1000000", "--raw-max-tokens", "1000000"])
        .arg("--raw-ignore-end")
        .args(["--context", "1048576"])
        .arg("--session-dir")
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"/raw\nOnce upon a time\n").unwrap();
    stdin.flush().unwrap();
    // Wait for the reply to stream, then Ctrl-C (SIGINT) stops it.
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut out, &mut first).unwrap();
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    drop(stdin);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    let journal = std::fs::read(dir.path().join("cut.k3journal")).unwrap();
    let text = String::from_utf8_lossy(&journal);
    assert!(text.contains("\"kind\":\"stopped\""), "{text}");
    assert!(text.contains("\"partial\":\""), "{text}");
    let (code, _, err) = chat(dir.path(), &["--greedy", "--resume", "cut"], "");
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("recovered 1 unsaved turn from") && err.contains("stopped part-way"),
        "{err}"
    );
}

/// `k3 chat` on the demo model (whose replies end, so turns are accepted as well as cut off).
fn demo_cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = k3_command();
    c.arg("chat")
        .arg(crate::common::demo_model())
        .args(["--plain", "--jsonl", "--max-tokens", "40", "--session-dir"])
        .arg(dir)
        .args(args);
    c
}

#[test]
fn after_a_kill_9_the_recovered_session_costs_what_an_uninterrupted_one_does() {
    use crate::session::{demo_sampling, same_work, DEMO_CASES};
    for (prefix, cut_off, after) in DEMO_CASES {
        // The other sampling than the resume test's for this case.
        let sampling = demo_sampling(!cut_off);
        let what = format!("{sampling:?} after {prefix:?}, kill -9");
        // Saved after the first turn; the later turns are only in the journal.
        let turns = prefix.lines().count();
        let (head, tail) = prefix.split_once('\n').unwrap();
        let input = format!("{head}\n/save\n{tail}");
        let dir = tempfile::tempdir().unwrap();
        let mut args = sampling.to_vec();
        args.extend(["--session", "k"]);
        kill_9(demo_cmd(dir.path(), &args), &input, turns);
        assert!(dir.path().join("k.k3journal").is_file());
        let scratch = tempfile::tempdir().unwrap();
        let (code, whole, err) = finish(
            demo_cmd(scratch.path(), sampling),
            &format!("{prefix}{after}"),
        );
        assert_eq!(code, 0, "{err}");
        let mut args = sampling.to_vec();
        args.extend(["--resume", "k"]);
        let (code, rest, err) = finish(demo_cmd(dir.path(), &args), after);
        assert_eq!(code, 0, "{err}");
        assert!(
            err.contains(&format!("recovered {} unsaved turns from", turns - 1)),
            "{err}"
        );
        assert_eq!(whole.len(), turns + rest.len(), "{what}");
        for (a, b) in whole[turns..].iter().zip(&rest) {
            same_work(a, b, &what);
        }
    }
}
