//! Chat sessions on the tiny oracle model: carried state equals a fresh full forward, reuse
//! counts, regenerate/undo/edit, raw mode, and save → new process → resume.

use crate::common::fixture;
use k3::engine::model::Logits;
use k3::engine::sampling::Sampler;
use k3::engine::{Model, SeqState};
use k3::session::chat::{Mode, Session, Settings, TurnReport};
use k3::session::tokenizer::Tokenizer;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(&fixture("tiny")).unwrap())
}

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::load(&fixture("tiny")).unwrap())
}

fn settings(temperature: f32) -> Settings {
    Settings {
        sampler: k3::engine::sampling::SamplerConfig {
            temperature,
            seed: 7,
            ..Default::default()
        },
        max_tokens: 10,
        raw_max_tokens: 10,
        thinking: false,
        ..Settings::default()
    }
}

/// Replay a turn from scratch: fresh state, one forward over the whole prompt, then decode with
/// a sampler whose stream starts where the session's did.
fn replay(report: &TurnReport, s: &Settings, rng: u64) -> Vec<u32> {
    let m = model();
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m
        .forward(&mut st, &report.prompt_ids, Logits::Last)
        .unwrap();
    let mut sampler = Sampler::with_rng_state(s.sampler(), rng).unwrap();
    let mut history = report.prompt_ids.clone();
    let mut out = Vec::new();
    for _ in 0..report.generated_ids.len() {
        let next = sampler.sample(&logits, &history).unwrap();
        out.push(next);
        history.push(next);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
    }
    out
}

fn no_cancel() -> AtomicBool {
    AtomicBool::new(false)
}

#[test]
fn carried_state_equals_a_fresh_full_forward_greedy_and_seeded() {
    for temperature in [0.0, 1.0] {
        let s = settings(temperature);
        let mut sess = Session::new(model(), tok(), s.clone()).unwrap();
        for text in ["Hello K3", "Why?", "Tell me more."] {
            let rng = sess.rng_state();
            let r = sess.send(text, &no_cancel(), &mut |_, _| {}).unwrap();
            assert_eq!(r.reused_tokens + r.prefilled_tokens, r.prompt_ids.len());
            assert_eq!(
                r.generated_ids,
                replay(&r, &s, rng),
                "{text} at T={temperature}"
            );
        }
    }
}

#[test]
fn history_is_reused_and_only_the_tail_prefilled() {
    // Hand the session a well-formed history so the re-render extends what the engine saw.
    let s = settings(0.0);
    let mut sess = Session::new(model(), tok(), s).unwrap();
    let r1 = sess.send("Hello K3", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(
        (r1.reused_tokens, r1.prefilled_tokens),
        (0, r1.prompt_ids.len())
    );
    // The random model's reply is not well formed, so it is not added to the history; the next
    // turn reuses the state at the end of the first message (a snapshot), not from zero.
    assert!(!r1.accepted);
    let r2 = sess.send("Why?", &no_cancel(), &mut |_, _| {}).unwrap();
    let opts = k3::session::template::RenderOptions {
        thinking: false,
        ..Default::default()
    };
    let first_message = k3::session::template::render(
        tok(),
        &[k3::session::template::Message::user("Hello K3")],
        &opts,
        false,
    )
    .unwrap()
    .len();
    assert_eq!(r2.reused_tokens, first_message);
    // Regenerate: the whole prompt is reused, nothing prefilled, and the same tokens come out.
    let r3 = sess.regen(&no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(
        (r3.reused_tokens, r3.prefilled_tokens),
        (r3.prompt_ids.len(), 0)
    );
    assert_eq!(r3.generated_ids, r2.generated_ids);
    // Edit the last message: same tokens as a fresh session given the same history.
    let r4 = sess.edit("How?", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(
        r4.reused_tokens, r2.reused_tokens,
        "edit restarts after the first message"
    );
    let mut fresh = Session::new(model(), tok(), settings(0.0)).unwrap();
    fresh
        .send("Hello K3", &no_cancel(), &mut |_, _| {})
        .unwrap();
    let f = fresh.send("How?", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(f.prompt_ids, r4.prompt_ids);
    assert_eq!(f.generated_ids, r4.generated_ids);
    // Undo, then ask again: identical to the fresh session's second turn.
    sess.undo().unwrap();
    let r5 = sess.send("How?", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(r5.generated_ids, f.generated_ids);
    assert!(r5.reused_tokens > 0);
}

#[test]
fn raw_mode_continues_the_context_and_switching_keeps_state() {
    let s = settings(0.0);
    let mut sess = Session::new(model(), tok(), s.clone()).unwrap();
    sess.set_mode(Mode::Raw);
    let r1 = sess
        .send("Once upon a time", &no_cancel(), &mut |_, _| {})
        .unwrap();
    assert_eq!(r1.prompt_ids, tok().encode("Once upon a time", true));
    let r2 = sess.send(" there", &no_cancel(), &mut |_, _| {}).unwrap();
    // The second raw prompt is everything before plus the new text: only the tail is fed.
    assert!(r2.prompt_ids.starts_with(&r1.prompt_ids));
    assert_eq!(
        r2.reused_tokens,
        r1.prompt_ids.len() + r1.generated_ids.len() - 1
    );
    // Greedy: the random stream is not consumed, any start state replays it.
    assert_eq!(r2.generated_ids, replay(&r2, &s, 1));
    sess.set_mode(Mode::Chat);
    let r3 = sess.send("Hello K3", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(r3.generated_ids, replay(&r3, &s, 1));
    assert!(sess
        .entries
        .iter()
        .any(|e| matches!(e, k3::session::chat::Entry::Mode { mode: Mode::Raw })));
}

#[test]
fn raw_text_stays_in_the_context_of_the_next_chat_turn() {
    let s = settings(0.0);
    let mut sess = Session::new(model(), tok(), s.clone()).unwrap();
    sess.send("Hello K3", &no_cancel(), &mut |_, _| {}).unwrap();
    sess.send("Why?", &no_cancel(), &mut |_, _| {}).unwrap();
    sess.set_mode(Mode::Raw);
    let mut shown = String::new();
    let raw = sess
        .send(
            "Once upon a time there was a little fox",
            &no_cancel(),
            &mut |_, t| shown.push_str(t),
        )
        .unwrap();
    let held = sess.tokens().len();
    // The raw prompt continues the conversation as the template renders it.
    let opts = k3::session::template::RenderOptions {
        thinking: false,
        ..Default::default()
    };
    let (history, _) = sess.render_conversation(&opts, false).unwrap();
    assert!(
        history.ends_with(&raw.generated_ids),
        "the raw exchange is in the context"
    );
    // The limit is the raw one, and no special token reads as text.
    assert!(raw.generated_ids.len() <= s.raw_max_tokens);
    assert!(
        !shown.contains("<|") && !raw.reply.contains("<|"),
        "{shown:?}"
    );
    sess.set_mode(Mode::Chat);
    let chat = sess.send("Go on.", &no_cancel(), &mut |_, _| {}).unwrap();
    // Back in chat mode nothing is re-read: every position held is reused, and the prompt
    // holds the raw text and its continuation as generated.
    assert_eq!(chat.reused_tokens, held, "the position fell back");
    let raw_ids: Vec<u32> = raw.prompt_ids[raw.prompt_ids.len()
        - tok()
            .encode("Once upon a time there was a little fox", true)
            .len()..]
        .iter()
        .chain(&raw.generated_ids)
        .copied()
        .collect();
    assert!(chat
        .prompt_ids
        .windows(raw_ids.len())
        .any(|w| w == raw_ids.as_slice()));
    assert_eq!(chat.generated_ids, replay(&chat, &s, 1));
    // Undo removes the chat exchange, then the raw one.
    sess.undo().unwrap();
    sess.undo().unwrap();
    assert!(!sess
        .entries
        .iter()
        .any(|e| matches!(e, k3::session::chat::Entry::Raw { .. })));
}

/// Run `k3 chat --plain --jsonl` with `input` on stdin; returns the JSON lines.
fn chat(args: &[&str], input: &str, dir: &std::path::Path) -> Vec<serde_json::Value> {
    crate::common::jsonl_with_input(
        crate::common::k3_command()
            .arg("chat")
            .arg(fixture("tiny"))
            .args([
                "--plain",
                "--jsonl",
                "--no-think",
                "--max-tokens",
                "9",
                "--raw-max-tokens",
                "9",
                "--session-dir",
            ])
            .arg(dir)
            .args(args),
        input,
    )
}

#[test]
fn save_then_resume_in_a_new_process_continues_exactly() {
    for sampling in [
        &["--greedy"][..],
        &["--temperature", "1", "--seed", "11"][..],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let whole = chat(sampling, "Hello K3\nWhy?\nGo on.\nAnd then?\n", dir.path());
        assert_eq!(whole.len(), 4);
        let first = chat(sampling, "Hello K3\nWhy?\n/save resume-test\n", dir.path());
        assert_eq!(first.len(), 2);
        let mut args = sampling.to_vec();
        args.extend(["--resume", "resume-test"]);
        let rest = chat(&args, "Go on.\nAnd then?\n", dir.path());
        assert_eq!(rest.len(), 2);
        for (a, b) in whole[2..].iter().zip(&rest) {
            assert_eq!(a["generated_ids"], b["generated_ids"], "{sampling:?}");
            assert_eq!(a["prompt_ids"], b["prompt_ids"]);
            assert_eq!(
                b["reused_tokens"].as_u64().unwrap() + b["prefilled_tokens"].as_u64().unwrap(),
                b["prompt_ids"].as_array().unwrap().len() as u64
            );
        }
    }
}

#[test]
fn resumed_raw_session_reuses_the_saved_state() {
    let dir = tempfile::tempdir().unwrap();
    let whole = chat(
        &["--greedy"],
        "/raw\nOnce upon\n a time\n there\n",
        dir.path(),
    );
    let first = chat(
        &["--greedy"],
        "/raw\nOnce upon\n a time\n/save raw-test\n",
        dir.path(),
    );
    let rest = chat(
        &["--greedy", "--resume", "raw-test"],
        " there\n",
        dir.path(),
    );
    assert_eq!(first.len(), 2);
    assert_eq!(whole[2]["generated_ids"], rest[0]["generated_ids"]);
    assert_eq!(whole[2]["prompt_ids"], rest[0]["prompt_ids"]);
    // Nothing before the new text is read again.
    let prompt = rest[0]["prompt_ids"].as_array().unwrap().len() as u64;
    let new_text = k3::session::tokenizer::Tokenizer::load(&fixture("tiny"))
        .unwrap()
        .encode(" there", true)
        .len() as u64;
    assert_eq!(
        rest[0]["reused_tokens"].as_u64().unwrap(),
        prompt - new_text - 1
    );
}

#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_session() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny"))
        .args([
            "--plain",
            "--greedy",
            "--no-think",
            "--max-tokens",
            "1000000",
            "--raw-max-tokens",
            "1000000",
            "--raw-ignore-end",
            "--context",
            "1048576",
        ])
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
    // The continuation is streaming once its first bytes reach stdout (notices go to stderr);
    // the rest of stdout is drained so that the child never blocks on a full pipe.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    let drain = std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    stdin.write_all(b"/stats\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    drain.join().unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("; stopped]"), "{err}");
    assert!(
        err.contains("positions "),
        "the session answered after the interrupt: {err}"
    );
}

#[test]
fn the_context_limit_stops_generation_and_refuses_an_oversized_prompt() {
    let mut s = settings(0.0);
    s.context_limit = 90;
    s.max_tokens = 1000;
    let mut sess = Session::new(model(), tok(), s).unwrap();
    let r = sess.send("Hello K3", &no_cancel(), &mut |_, _| {}).unwrap();
    assert_eq!(r.stop, k3::session::chat::Stop::ContextFull);
    assert!(r.context_warning.is_some());
    assert!(r.prompt_ids.len() + r.generated_ids.len() <= 90);
    let e = sess.send(
        "And a much longer question than the first one?",
        &no_cancel(),
        &mut |_, _| {},
    );
    assert!(
        matches!(e, Err(k3::session::chat::TurnError::ContextFull { .. })),
        "{e:?}"
    );
}

#[test]
fn bad_commands_and_resumes_explain_without_exiting() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny"))
        .args([
            "--plain",
            "--greedy",
            "--no-think",
            "--max-tokens",
            "3",
            "--session-dir",
        ])
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(
                b"/frob\n/set top_p 7\n/load nope\n/load ../x\n/regen\n/think medium\nhi\n",
            )?;
            c.wait_with_output()
        })
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // The session goes on after each; the refused `/load`s end a piped run with 2.
    assert_eq!(out.status.code(), Some(2), "{err}");
    for needle in [
        "unknown command /frob",
        "top_p",
        "not found",
        "/regen",
        "medium",
        "tokens/s",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let missing = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny"))
        .args(["--plain", "--resume", "absent", "--session-dir"])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_ne!(missing.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("absent"));
}

#[test]
fn another_models_session_is_refused_and_its_transcript_offered() {
    let dir = tempfile::tempdir().unwrap();
    chat(&["--greedy"], "Hello K3\n/save other\n", dir.path());
    let before = std::fs::read(dir.path().join("other.k3session")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny2"))
        .args([
            "--plain",
            "--jsonl",
            "--greedy",
            "--no-think",
            "--max-tokens",
            "4",
            "--resume",
            "other",
        ])
        .arg("--session-dir")
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            let cmds = format!(
                "Why?\n/export md {0}/out.md\n/export json {0}/out.json\n",
                dir.path().display()
            );
            c.stdin.take().unwrap().write_all(cmds.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    let md = std::fs::read_to_string(dir.path().join("out.md")).unwrap();
    assert!(
        md.contains("**user**") && md.contains("Hello K3") && md.contains("Why?"),
        "{md}"
    );
    let js: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out.json")).unwrap()).unwrap();
    assert_eq!(js["entries"][0]["content"], "Hello K3");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("refused") && err.contains("re-reads the history"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("other.k3session")).unwrap(),
        before,
        "file untouched"
    );
    // The transcript came along: the first turn re-prefills it (nothing reused) and renders
    // the earlier user message before the new one.
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(line["reused_tokens"], 0);
    let t = Tokenizer::load(&fixture("tiny2")).unwrap();
    let ids: Vec<u32> = line["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let text = t.decode_lossy(&ids).unwrap();
    assert!(
        text.find("Hello K3").unwrap() < text.find("Why?").unwrap(),
        "{text}"
    );
}

#[test]
fn resume_is_held_to_the_context_limit() {
    let dir = tempfile::tempdir().unwrap();
    let plain = |args: &[&str], input: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("chat")
            .arg(fixture("tiny"))
            .args(["--plain", "--greedy", "--no-think", "--max-tokens", "9"])
            .arg("--session-dir")
            .arg(dir.path())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        (out.status.code().unwrap_or(-1), err)
    };
    let (code, err) = plain(&[], "Hello K3\n/save base\n");
    assert_eq!(code, 0, "{err}");
    let positions: usize = err
        .split("saved session \"base\" (")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no positions in: {err}"));
    let small = (positions - 1).to_string();
    let (code, err) = plain(&["--resume", "base", "--context", &small], "more\n");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("holds {positions} positions"))
            && err.contains(&format!("context limit of {small}")),
        "{err}"
    );
    // At the limit it resumes, and the saved limit does not replace the one given.
    let exact = positions.to_string();
    let (code, err) = plain(&["--resume", "base", "--context", &exact], "more\n");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("loaded session"), "{err}");
    assert!(err.contains("context"), "the limit was not applied: {err}");
}

#[test]
fn invalid_utf8_on_stdin_is_replaced_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny"))
        .args([
            "--plain",
            "--jsonl",
            "--greedy",
            "--no-think",
            "--max-tokens",
            "3",
        ])
        .arg("--session-dir")
        .arg(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello\nbad \xff line\n/save x\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("input line 2: invalid UTF-8"), "{err}");
    let turns: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(dir.path().join("x.k3session").is_file(), "{err}");
}

/// Run `k3 chat --plain` on the tiny model with `input` on stdin; (exit code, stderr).
fn plain(dir: &std::path::Path, args: &[&str], input: &str) -> (i32, String) {
    plain_on(&fixture("tiny"), dir, args, input)
}

/// [`plain`] on the model in `model`.
fn plain_on(
    model: &std::path::Path,
    dir: &std::path::Path,
    args: &[&str],
    input: &str,
) -> (i32, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(model)
        .args(["--plain", "--greedy", "--no-think", "--max-tokens", "4"])
        .arg("--session-dir")
        .arg(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A run refused at start may be gone before its input is written.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{err}");
    (out.status.code().unwrap_or(-1), err)
}

/// A `k3 chat --plain` process whose stdin stays open, with its stderr read as it comes.
struct Live {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    seen: String,
}

impl Live {
    fn spawn(dir: &std::path::Path, args: &[&str]) -> Live {
        use std::io::BufRead;
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("chat")
            .arg(fixture("tiny"))
            .args(["--plain", "--greedy", "--no-think", "--max-tokens", "4"])
            .arg("--session-dir")
            .arg(dir)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let err = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Live {
            child,
            stdin,
            lines,
            seen: String::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn send(&mut self, text: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(text.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// Wait until stderr has shown `needle` (at most a minute).
    fn wait_for(&mut self, needle: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !self.seen.contains(needle) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                }
                Err(_) => panic!("no {needle:?} on stderr: {}", self.seen),
            }
        }
    }

    /// Send SIGINT and wait (at most a minute) for the exit with stdin still open; (exit code,
    /// all of stderr).
    fn interrupt(mut self) -> (i32, String) {
        let pid = self.pid().to_string();
        assert!(Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("still running a minute after SIGINT: {}", self.seen);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        drop(self.stdin.take());
        while let Ok(line) = self.lines.recv() {
            self.seen.push_str(&line);
            self.seen.push('\n');
        }
        (status.code().unwrap_or(-1), self.seen)
    }

    /// Close stdin and wait for the exit; (exit code, all of stderr).
    fn finish(mut self) -> (i32, String) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        while let Ok(line) = self.lines.recv() {
            self.seen.push_str(&line);
            self.seen.push('\n');
        }
        (status.code().unwrap_or(-1), self.seen)
    }
}

#[test]
fn a_session_open_in_one_process_is_refused_to_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = plain(dir.path(), &[], "Hello K3\n/save shared\n");
    assert_eq!(code, 0, "{err}");
    let mut a = Live::spawn(dir.path(), &["--resume", "shared"]);
    a.wait_for("loaded session");
    let holder = format!("pid {}", a.pid());
    // B resumes the session A has open: refused before any work, naming A.
    let (code, err) = plain(dir.path(), &["--resume", "shared"], "from B\n/save\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("in use by") && err.contains(&holder), "{err}");
    // C, a new conversation, cannot save over it either.
    let (code, err) = plain(dir.path(), &[], "from C\n/save shared\n");
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("NOT saved") && err.contains(&holder), "{err}");
    a.send("from A\n/save\n");
    a.wait_for("saved session \"shared\"");
    let (code, err) = a.finish();
    assert_eq!(code, 0, "{err}");
    let file = std::fs::read(dir.path().join("shared.k3session")).unwrap();
    let has = |s: &str| file.windows(s.len()).any(|w| w == s.as_bytes());
    assert!(has("Hello K3") && has("from A"), "A's turns are kept");
    assert!(!has("from B") && !has("from C"), "nobody else wrote");
    // Once A has left, the session opens again.
    let (code, err) = plain(dir.path(), &["--resume", "shared"], "/stats\n");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("loaded session"), "{err}");
}

/// The session names saved in `dir`.
fn saved_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().ok()?;
            Some(name.strip_suffix(".k3session")?.to_string())
        })
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    names
}

#[test]
fn default_names_are_readable_and_never_replace_another_session() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    // Two runs at the same time, both saving under the default name.
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || plain(&path, &[], "Hello K3, how are you?\n/save\n"))
        })
        .collect();
    for r in runs {
        let (code, err) = r.join().unwrap();
        assert_eq!(code, 0, "{err}");
        assert!(
            err.contains("saved session \"hello-k3-how-are-you-"),
            "{err}"
        );
    }
    let names = saved_names(dir.path());
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("hello-k3-how-are-you-20")),
        "{names:?}"
    );
    assert!(names.iter().any(|n| n.ends_with("-2")), "{names:?}");

    // `/save keep` never replaces an unrelated `keep`; `/save! keep` does.
    let (code, err) = plain(dir.path(), &[], "first talk\n/save keep\n");
    assert_eq!(code, 0, "{err}");
    let keep = dir.path().join("keep.k3session");
    let before = std::fs::read(&keep).unwrap();
    let (code, err) = plain(dir.path(), &[], "second talk\n/save keep\n");
    assert_eq!(code, 5, "{err}");
    assert!(
        err.contains("NOT saved") && err.contains("/save! keep"),
        "{err}"
    );
    assert_eq!(std::fs::read(&keep).unwrap(), before, "keep untouched");
    let (code, err) = plain(dir.path(), &["--session", "keep"], "third talk\n/save\n");
    assert_eq!(code, 5, "{err}");
    assert!(
        err.contains("exists already") && err.contains("NOT saved"),
        "{err}"
    );
    assert_eq!(std::fs::read(&keep).unwrap(), before, "keep untouched");
    let (code, err) = plain(dir.path(), &[], "second talk\n/save! keep\n");
    assert_eq!(code, 0, "{err}");
    let has = |s: &str| {
        let file = std::fs::read(&keep).unwrap();
        file.windows(s.len()).any(|w| w == s.as_bytes())
    };
    assert!(has("second talk") && !has("first talk"), "replaced");
    // The session's own file is saved over without asking.
    let (code, err) = plain(dir.path(), &["--resume", "keep"], "more talk\n/save\n");
    assert_eq!(code, 0, "{err}");
    assert!(has("second talk") && has("more talk"), "{err}");
    assert_eq!(saved_names(dir.path()).len(), 3);
}

#[test]
fn failures_set_the_exit_status_when_stdin_is_not_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sessions");
    // 5: the answer was produced but the session was not saved. The session directory cannot
    // be created (its parent is a file), which fails the save whoever runs the test.
    let blocker = tmp.path().join("file");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let (code, err) = plain(&blocker.join("sessions"), &[], "Hello K3\n/save x\n");
    assert_eq!(code, 5, "{err}");
    assert!(
        err.contains("tokens/s") && err.contains("NOT saved"),
        "{err}"
    );
    // A later save that succeeds clears it.
    let (code, err) = plain(&dir, &[], "Hello K3\n/save ../x\n/save x\n");
    assert_eq!(code, 0, "{err}");

    // 3: a damaged session whose transcript verified is re-read, and the run reports it.
    let path = dir.join("x.k3session");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 5; // the last byte of the last layer's state
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let (code, err) = plain(&dir, &["--resume", "x"], "Why?\n");
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("checksum") && err.contains("re-reads the history"),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "file untouched");

    // 4: non-finite logits (the final norm's gains are NaN).
    let (_model_tmp, model) = crate::bad_inputs::copy_tiny();
    let key = "language_model.model.norm.weight";
    let shard = (1..=3)
        .map(|k| crate::bad_inputs::shard(&model, k))
        .find(|p| crate::bad_inputs::split(p).0.contains_key(key))
        .unwrap();
    let (header, mut data) = crate::bad_inputs::split(&shard);
    let span = &header[key]["data_offsets"];
    let (b, e) = (
        span[0].as_u64().unwrap() as usize,
        span[1].as_u64().unwrap() as usize,
    );
    for pair in data[b..e].chunks_exact_mut(2) {
        pair.copy_from_slice(&0x7fc0u16.to_le_bytes()); // BF16 NaN
    }
    crate::bad_inputs::join(&shard, &header, &data);
    let (code, err) = plain_on(&model, &dir, &[], "Hello K3\n");
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("finite"), "{err}");
}

#[test]
fn leaving_with_unsaved_turns_says_so_and_a_last_save_still_runs() {
    let dir = tempfile::tempdir().unwrap();
    // A /save right before the end of input runs, and then nothing is reported lost.
    let (code, err) = plain(dir.path(), &[], "Hello K3\n/save x\n");
    assert_eq!(code, 0, "{err}");
    assert!(dir.path().join("x.k3session").is_file(), "{err}");
    assert!(!err.contains("NOT saved"), "{err}");
    // The end of input after an unsaved turn says so.
    let (code, err) = plain(dir.path(), &[], "Hello K3\n");
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("this conversation (1 turn) was NOT saved"),
        "{err}"
    );
    let (code, err) = plain(dir.path(), &["--resume", "x"], "Why?\nGo on.\n");
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("session \"x\": 2 turns since it was last saved or loaded were NOT saved"),
        "{err}"
    );
    // Ctrl-C while waiting for input, after an unsaved turn: leaves with 130 and says so.
    let mut live = Live::spawn(dir.path(), &[]);
    live.wait_for("/help lists");
    live.send("Hello K3\n");
    live.wait_for("tokens/s");
    let (code, err) = live.interrupt();
    assert_eq!(code, 130, "{err}");
    assert!(err.contains("(1 turn) was NOT saved"), "{err}");
}

#[test]
fn continue_opens_the_most_recent_conversation_saved_or_not() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let chat = |extra: &[&str], input: &[u8]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
            .arg("chat")
            .arg(fixture("tiny"))
            .args(["--plain", "--greedy", "--no-think", "--max-tokens", "3"])
            .args(extra)
            .arg("--session-dir")
            .arg(dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input).unwrap();
        drop(stdin);
        child.wait_with_output().unwrap()
    };
    // Nothing saved yet: a usage error that says so.
    let out = chat(&["-c"], b"");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no saved session"));
    // `alpha` is saved first, `zeta` a second later: `--continue` takes `zeta`, the newer
    // one, although `alpha` sorts first by name.
    let out = chat(&[], b"one\ntwo\n/save alpha\n");
    assert!(out.status.success());
    // Save times are whole seconds: wait for the clock to pass the second `alpha` was saved in.
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let saved = now();
    while now() <= saved {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = chat(&[], b"hello\n/save zeta\n");
    assert!(out.status.success());
    let out = chat(&["--continue"], b"/stats\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("loaded session \"zeta\""), "{err}");
    // A conversation never saved, newer than `zeta`, is the last one: `-c` continues it from
    // its journal.
    let saved = now();
    while now() <= saved {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = chat(&[], b"an unsaved chat\n");
    assert!(out.status.success());
    let out = chat(&["-c"], b"/stats\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("session \"an-unsaved-chat-") && err.contains("was never saved"),
        "{err}"
    );
    assert!(err.contains("recovered 1 unsaved turn"), "{err}");
    // It conflicts with --resume.
    let out = chat(&["-c", "--resume", "alpha"], b"");
    assert_eq!(out.status.code(), Some(2));
}

/// Run `k3 chat` on the demo model (`--plain --jsonl`, replies of at most 40 tokens) in
/// `dir`; the JSON lines of its turns.
fn demo_chat(dir: &std::path::Path, args: &[&str], input: &str) -> Vec<serde_json::Value> {
    crate::common::jsonl_with_input(
        crate::common::k3_command()
            .arg("chat")
            .arg(crate::common::demo_model())
            .args(["--plain", "--jsonl", "--max-tokens", "40", "--session-dir"])
            .arg(dir)
            .args(args),
        input,
    )
}

/// Reply lengths of the demo model that reach `--max-tokens 40`: the reply was cut off.
const DEMO_LIMIT: usize = 40;

/// Both runs' turns agree: the same prompt, the same tokens, and the same work (reused and
/// prefilled counts).
pub fn same_work(a: &serde_json::Value, b: &serde_json::Value, what: &str) {
    for key in [
        "prompt_ids",
        "generated_ids",
        "reused_tokens",
        "prefilled_tokens",
    ] {
        assert_eq!(a[key], b[key], "{key}: {what}");
    }
}

/// The conversations the resume tests start from (three turns whose last reply ended, four
/// whose last reply was cut off at the token limit), and what is done after the resume, in
/// one run: the first command is the one that depends most on what was saved (a regenerate
/// after a reply that ended; the next turn after one cut off), then the others follow (an
/// undo and a new message, an edit, a regenerate, a next turn), each from the states the
/// earlier ones left, the saved snapshots included.
pub const DEMO_CASES: [(&str, bool, &str); 2] = [
    (
        "Hello\nWhat is 2+2?\nThanks!\n",
        false,
        "/regen\n/undo\nSomething else\n/edit Changed my mind\nTell me more\n",
    ),
    (
        "Hello\nWhat is 2+2?\nThanks!\nWho are you?\n",
        true,
        "Tell me more\n/undo\n/regen\n/undo\nSomething else\n/edit Changed my mind\n",
    ),
];

/// The sampling each case runs with: greedy for one, seeded for the other (the generic
/// kernels run these tests too, and every turn of the demo model costs there); the recovery
/// test takes them the other way round.
pub fn demo_sampling(cut_off: bool) -> &'static [&'static str] {
    if cut_off {
        &["--temperature", "1", "--seed", "5"]
    } else {
        &["--greedy"]
    }
}

#[test]
fn after_resume_the_next_turn_regen_undo_and_edit_cost_what_they_cost_uninterrupted() {
    for (prefix, cut_off, after) in DEMO_CASES {
        let sampling = demo_sampling(cut_off);
        let what = format!("{sampling:?} after {prefix:?}");
        // Uninterrupted: the conversation, a save, and what follows, in one process.
        let saved = tempfile::tempdir().unwrap();
        let turns = prefix.lines().count();
        let whole = demo_chat(saved.path(), sampling, &format!("{prefix}/save s\n{after}"));
        let last = whole[turns - 1]["generated_ids"].as_array().unwrap().len();
        assert_eq!(last == DEMO_LIMIT, cut_off, "{what}: {last}");
        // Resumed in a new process from the saved file.
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            saved.path().join("s.k3session"),
            dir.path().join("s.k3session"),
        )
        .unwrap();
        let mut args = sampling.to_vec();
        args.extend(["--resume", "s"]);
        let rest = demo_chat(dir.path(), &args, after);
        assert_eq!(whole.len(), turns + rest.len(), "{what}");
        for (a, b) in whole[turns..].iter().zip(&rest) {
            same_work(a, b, &what);
        }
        if !cut_off {
            // The regenerate reuses the whole prompt and reads nothing again.
            assert_eq!(rest[0]["prefilled_tokens"], 0, "{what}");
        }
    }
}

/// Bit-for-bit equality of two states.
fn same_bits(a: &SeqState, b: &SeqState) -> bool {
    use k3::engine::state::LayerState;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    a.n_pos == b.n_pos
        && a.layers.len() == b.layers.len()
        && a.layers.iter().zip(&b.layers).all(|(x, y)| match (x, y) {
            (LayerState::Kda(p), LayerState::Kda(q)) => {
                bits(&p.s) == bits(&q.s) && (0..3).all(|i| bits(&p.conv[i]) == bits(&q.conv[i]))
            }
            (LayerState::Mla(p), LayerState::Mla(q)) => bits(p) == bits(q),
            _ => false,
        })
}

#[test]
fn rebuilt_snapshots_and_saved_ones_equal_the_originals_bit_for_bit() {
    use k3::session::store::{self, ModelIdentity, SessionRecord, Summary};
    let s = settings(1.0);
    let mut a = Session::new(model(), tok(), s.clone()).unwrap();
    let nothing = no_cancel();
    a.send("Hello K3", &nothing, &mut |_, _| {}).unwrap();
    a.send("Why?", &nothing, &mut |_, _| {}).unwrap();
    a.regen(&nothing, &mut |_, _| {}).unwrap();
    a.undo().unwrap();
    a.send("How?", &nothing, &mut |_, _| {}).unwrap();
    a.send("Go on.", &nothing, &mut |_, _| {}).unwrap();
    let snaps: Vec<Vec<u32>> = a.snapshots().iter().map(|s| s.tokens.clone()).collect();
    assert_eq!(snaps.len(), k3::session::chat::SNAPSHOTS);
    // Not every snapshot is a prefix of the live ids (the undo branched).
    assert!(snaps.iter().any(|t| !a.tokens().starts_with(t)));

    // Rebuilt from the ids alone, as a journal recovery does.
    let mut b = Session::new(model(), tok(), s.clone()).unwrap();
    b.rebuild(a.tokens(), a.pending(), a.rng_state(), &snaps)
        .unwrap();
    assert_eq!(b.tokens(), a.tokens());
    assert!(same_bits(b.state(), a.state()));
    assert_eq!(b.snapshots().len(), a.snapshots().len());
    for (x, y) in a.snapshots().iter().zip(b.snapshots()) {
        assert_eq!(x.tokens, y.tokens);
        assert!(same_bits(&x.state, &y.state), "{} ids", x.tokens.len());
        let bits = |l: &[f32]| l.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.logits), bits(&y.logits));
    }

    // Saved and loaded: the live state and every snapshot come back bit for bit.
    let rec = SessionRecord {
        name: "bits".into(),
        created_unix: 1,
        saved_unix: 2,
        identity: ModelIdentity { hash: [7; 32] },
        summary: Summary {
            turns: 0,
            mode: "chat".into(),
        },
        transcript_json: b"{}".to_vec(),
        settings_json: b"{}".to_vec(),
        tokens: a.tokens().to_vec(),
        state: a.state().clone(),
        snapshots: a.snapshots().to_vec(),
        sampler: s.sampler(),
        rng_state: a.rng_state(),
    };
    let bytes = store::encode(&rec).unwrap();
    let back = store::decode(
        &mut &bytes[..],
        bytes.len() as u64,
        &model().cfg,
        &rec.identity,
    )
    .unwrap();
    assert!(same_bits(&back.state, a.state()));
    assert_eq!(back.snapshots.len(), a.snapshots().len());
    for (x, y) in a.snapshots().iter().zip(&back.snapshots) {
        assert_eq!(x.tokens, y.tokens);
        assert!(same_bits(&x.state, &y.state));
        assert_eq!(
            x.logits.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
            y.logits.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
        );
    }
    // The rows a snapshot shares with the live state are stored once: the file is smaller than
    // five whole states.
    let whole = a.state().bytes() + a.snapshots().iter().map(|s| s.state.bytes()).sum::<usize>();
    assert!(
        bytes.len() < whole,
        "{} bytes for {whole} of state",
        bytes.len()
    );
}

#[test]
fn the_worker_renames_and_deletes_saved_sessions_and_refuses_the_open_one() {
    use k3::app::protocol::{EngineEvent, Request};
    use k3::app::worker::{ChatConfig, Worker};
    use k3::session::store::SessionStore;
    let dir = tempfile::tempdir().unwrap();
    chat(&[], "Hello K3\n/save one\n", dir.path());
    chat(&[], "Hello K3\n/save two\n", dir.path());
    let store = SessionStore::new(dir.path());
    assert!(store.exists("one") && store.exists("two"));
    let w = Worker::spawn(ChatConfig {
        model_dir: fixture("tiny"),
        model_label: "tiny".into(),
        settings: settings(0.0),
        system: None,
        resume: Some("two".into()),
        session_name: Some("two".into()),
        session_dir: Some(dir.path().to_path_buf()),
        budget: k3::stream::budget::BudgetRequest::Resident,
        trunk: None,
        spec: k3::engine::spec::SpecMode::Off,
        start_note: None,
        sources: k3::session::defaults::Sources::default(),
        flags: Default::default(),
    });
    // The answer to turn `t`: Ok(notice) or Err(failure).
    let answer = |t: u64| loop {
        match w.recv().expect("the worker answers") {
            EngineEvent::Notice { turn, text } if turn == t => break Ok(text),
            EngineEvent::Failed { turn, message } if turn == t => break Err(message),
            EngineEvent::Stopped { .. } => panic!("the worker stopped"),
            _ => {}
        }
    };
    let rename = |turn: u64, from: &str, to: &str| {
        assert!(w.send(Request::RenameSession {
            turn,
            from: from.into(),
            to: to.into(),
        }));
        answer(turn)
    };
    let ok = rename(1, "one", "uno").unwrap();
    assert!(ok.contains("renamed"), "{ok}");
    assert!(store.exists("uno") && !store.exists("one"));
    for (turn, from, to, why) in [
        (2, "uno", "two", "exists already"),
        (3, "two", "dos", "open here"),
        (4, "uno", "../x", ""),
        (5, "nothing", "x", "no saved session"),
    ] {
        let e = rename(turn, from, to).expect_err(to);
        assert!(e.contains(why), "{from} -> {to}: {e}");
    }
    assert!(store.exists("uno") && store.exists("two"));
    assert!(w.send(Request::DeleteSession {
        turn: 6,
        name: "two".into(),
    }));
    assert!(answer(6).unwrap_err().contains("open here"));
    assert!(w.send(Request::DeleteSession {
        turn: 7,
        name: "uno".into(),
    }));
    assert!(answer(7).unwrap().contains("deleted"));
    assert!(!store.exists("uno") && store.exists("two"));
    w.shutdown();
}
