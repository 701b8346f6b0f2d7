//! The plain REPL: one line (or a `\`-continued block) per message, replies streamed as they
//! are generated, Ctrl-C stops the reply and keeps the session, a second Ctrl-C while idle
//! leaves. Used for `k3 chat --plain` and whenever stdin or stdout is not a terminal. A request
//! that has started (a `/save` included) is always answered before the REPL leaves, and
//! leaving with unsaved changes, at the end of input or on Ctrl-C, says they were not saved.

use crate::app::protocol::StatsSnapshot;
use crate::app::protocol::{EngineEvent, Request, TurnId};
use crate::app::words::count;
use crate::app::worker::Worker;
use crate::session::chat::{Stop, TurnReport};
use crate::session::commands::{self, Command};
use crate::session::template::TolerantParser;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

/// How often a REPL waiting for a stdin line checks for Ctrl-C.
const SIGINT_POLL: Duration = Duration::from_millis(50);

/// REPL options.
#[derive(Clone, Debug, Default)]
pub struct ReplOptions {
    /// Print one JSON line per finished turn instead of streamed text.
    pub jsonl: bool,
    /// Where to keep the line history (interactive only).
    pub history_file: Option<PathBuf>,
}

/// Where input lines come from.
enum Input {
    /// The line editor, one for the REPL's life, its history holding the inputs entered so far
    /// (after those loaded from the history file). One editor keeps what it read ahead: lines
    /// typed or pasted in one burst reach the terminal together, the editor's first read takes
    /// them all, and the next `readline` answers from what is left. While it waits for a line
    /// it owns SIGINT (an external `kill -INT` reads as Ctrl-C at the prompt); between lines
    /// the REPL's own handler is back, so a Ctrl-C while a reply streams stops it.
    Editor(Box<rustyline::DefaultEditor>),
    /// Lines of plain stdin read by a thread, so that a Ctrl-C while waiting for one is seen
    /// here; and the number of lines received so far.
    Lines(Receiver<(String, bool)>, usize),
    /// Plain stdin read here (when no thread could be started), and the lines read so far.
    Stdin(std::io::StdinLock<'static>, usize),
}

/// One line from `r` without its `\n` or `\r\n`; invalid UTF-8 is replaced with U+FFFD and
/// reported by the flag. `None` at the end of input or on a read error.
fn read_lossy_line(r: &mut impl BufRead) -> Option<(String, bool)> {
    let mut buf = Vec::new();
    match r.read_until(b'\n', &mut buf) {
        Ok(0) | Err(_) => return None,
        Ok(_) => {}
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    }
    match String::from_utf8(buf) {
        Ok(line) => Some((line, false)),
        Err(e) => Some((String::from_utf8_lossy(e.as_bytes()).into_owned(), true)),
    }
}

impl Input {
    fn new(opts: &ReplOptions) -> Input {
        if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
            if let Ok(mut ed) = rustyline::DefaultEditor::new() {
                if let Some(h) = &opts.history_file {
                    let _ = ed.load_history(h);
                }
                return Input::Editor(Box::new(ed));
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::Builder::new()
            .name("k3-stdin".into())
            .spawn(move || {
                let mut stdin = std::io::stdin().lock();
                while let Some(line) = read_lossy_line(&mut stdin) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        match reader {
            Ok(_) => Input::Lines(rx, 0),
            Err(_) => Input::Stdin(std::io::stdin().lock(), 0),
        }
    }

    /// Whether a Ctrl-C while waiting for input is seen by [`Input::read`] (else it must end
    /// the process from the signal handler).
    fn sees_sigint(&self) -> bool {
        matches!(self, Input::Lines(..) | Input::Editor(_))
    }

    /// One logical input: lines ending in `\` continue. `None` at end of input, or when
    /// Ctrl-C was pressed (then `interrupted` is set); `sigint` is the flag the signal sets.
    fn read(&mut self, interrupted: &AtomicBool, sigint: &AtomicBool) -> Option<String> {
        let mut text = String::new();
        let mut prompt = "> ";
        loop {
            let line = match self {
                Input::Editor(ed) => match ed.readline(prompt) {
                    Ok(l) => l,
                    Err(rustyline::error::ReadlineError::Interrupted) => {
                        if text.is_empty() {
                            interrupted.store(true, Ordering::Relaxed);
                            return None;
                        }
                        text.clear();
                        prompt = "> ";
                        continue;
                    }
                    Err(_) => return None,
                },
                Input::Lines(rx, n) => match next_line(rx, sigint) {
                    Err(()) => {
                        interrupted.store(true, Ordering::Relaxed);
                        return None;
                    }
                    Ok(Some((l, lossy))) => {
                        *n += 1;
                        if lossy {
                            eprintln!(
                                "k3: input line {n}: invalid UTF-8, the bad bytes were replaced \
                                 with U+FFFD"
                            );
                        }
                        l
                    }
                    Ok(None) => return (!text.is_empty()).then_some(text),
                },
                Input::Stdin(stdin, n) => match read_lossy_line(stdin) {
                    Some((l, lossy)) => {
                        *n += 1;
                        if lossy {
                            eprintln!(
                                "k3: input line {n}: invalid UTF-8, the bad bytes were replaced \
                                 with U+FFFD"
                            );
                        }
                        l
                    }
                    None => return (!text.is_empty()).then_some(text),
                },
            };
            if let Some(head) = line.strip_suffix('\\') {
                text.push_str(head);
                text.push('\n');
                prompt = ". ";
                continue;
            }
            text.push_str(&line);
            if let Input::Editor(ed) = self {
                // Up recalls the whole input, continued lines included; a repeat is kept once.
                let _ = ed.add_history_entry(text.as_str());
            }
            return Some(text);
        }
    }

    fn save_history(&mut self, opts: &ReplOptions) {
        if let (Input::Editor(ed), Some(h)) = (self, &opts.history_file) {
            if let Some(dir) = h.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = ed.save_history(h);
        }
    }
}

/// The next line from the stdin thread; `Ok(None)` at the end of input, `Err` when Ctrl-C came
/// first.
fn next_line(
    rx: &Receiver<(String, bool)>,
    sigint: &AtomicBool,
) -> Result<Option<(String, bool)>, ()> {
    loop {
        if sigint.load(Ordering::Relaxed) {
            return Err(());
        }
        match rx.recv_timeout(SIGINT_POLL) {
            Ok(line) => return Ok(Some(line)),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
        }
    }
}

/// Printed before the first reasoning text of a reply.
pub const THINKING_MARK: &str = "[thinking]\n";
/// Printed between the reasoning and the answer.
pub const ANSWER_MARK: &str = "\n[answer]\n";

/// The part of a parsed completion not shown yet: [`THINKING_MARK`] and new reasoning, then
/// (once the answer starts) [`ANSWER_MARK`] after any reasoning, then new answer text.
/// Control characters from model output are escaped by the caller, never sent to the terminal.
fn show_new(p: &TolerantParser, r_at: &mut usize, c_at: &mut usize) -> String {
    let mut s = String::new();
    let r = p.reasoning();
    if let Some(new) = r.get(*r_at..).filter(|n| !n.is_empty()) {
        if *r_at == 0 {
            s.push_str(THINKING_MARK);
        }
        s.push_str(new);
    }
    *r_at = r.len();
    let c = p.content();
    if let Some(new) = c.get(*c_at..).filter(|n| !n.is_empty()) {
        if *c_at == 0 && *r_at > 0 {
            s.push_str(ANSWER_MARK);
        }
        s.push_str(new);
    }
    *c_at = c.len();
    s
}

fn safe(text: &str) -> String {
    crate::app::run::terminal_safe(text)
}

fn jsonl_line(turn: TurnId, r: &TurnReport, stats: Option<&StatsSnapshot>) -> String {
    let spec = stats.map(|s| {
        serde_json::json!({
            "passes": s.spec_passes,
            "proposed": s.spec_proposed,
            "accepted": s.spec_accepted,
            "tokens_per_pass": s.tokens_per_pass(),
        })
    });
    serde_json::json!({
        "spec": spec,
        "turn": turn,
        "mode": r.mode.name(),
        "prompt_ids": r.prompt_ids,
        "generated_ids": r.generated_ids,
        "generated_tokens": r.generated_tokens,
        "stop": format!("{:?}", r.stop),
        "reply": r.reply,
        "reasoning": r.reasoning.clone().unwrap_or_default(),
        "reused_tokens": r.reused_tokens,
        "prefilled_tokens": r.prefilled_tokens,
        "rss_bytes": crate::app::protocol::rss_bytes().0,
        "peak_rss_bytes": crate::app::protocol::rss_bytes().1,
    })
    .to_string()
}

fn summary(r: &TurnReport) -> String {
    let stop = match r.stop {
        Stop::End(_) => "end of message".to_string(),
        Stop::MaxTokens => "token limit".to_string(),
        Stop::Cancelled => "stopped".to_string(),
        Stop::ContextFull => "context full".to_string(),
    };
    let n = r.generated_tokens;
    let tps = if r.decode_seconds > 0.0 {
        n as f64 / r.decode_seconds
    } else {
        0.0
    };
    let mut s = format!(
        "[{}, {:.1} tokens/s; prompt {} reused + {} prefilled; {}]",
        count(n as u64, "token"),
        tps,
        r.reused_tokens,
        r.prefilled_tokens,
        stop
    );
    if let Some(why) = &r.rejected_because {
        s.push_str(&format!("\n[reply not added to the history: {why}]"));
    }
    if let Some(w) = &r.context_warning {
        s.push_str(&format!("\n[{w}]"));
    }
    s
}

/// Run the REPL until the input ends or `/quit`; returns the exit status.
/// Over 100 lines: the REPL's one loop (wait for the model, read a line, send it, print its
/// turn's events) over the signal flags it shares.
#[must_use]
pub fn run(worker: Worker, opts: &ReplOptions) -> i32 {
    let cancel = worker.cancel_flag();
    // Ctrl-C while a request is served stops the reply. While the model loads it ends the
    // process at once (status 130); while waiting for input the read loop sees it and leaves
    // after saying what was not saved (the line editor reports it as a key instead).
    let exit_now = Arc::new(AtomicBool::new(true));
    let sigint = Arc::new(AtomicBool::new(false));
    let _ = signal_hook::flag::register_conditional_shutdown(
        signal_hook::consts::SIGINT,
        130,
        Arc::clone(&exit_now),
    );
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&cancel));
    let _ = signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&sigint));
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    loop {
        match worker.recv() {
            Some(EngineEvent::Ready { info }) => {
                let _ = writeln!(
                    err,
                    "{}\n/help lists the commands; end a line with \\ to continue it.",
                    safe(&info)
                );
                break;
            }
            Some(EngineEvent::Failed { message, .. }) => {
                let _ = writeln!(err, "k3: error: {}", safe(&message));
            }
            Some(EngineEvent::Stopped { exit_code }) => return exit_code,
            Some(_) => {}
            None => return 1,
        }
    }
    let mut input = Input::new(opts);
    let exit_when_idle = !input.sees_sigint();
    let interrupted = AtomicBool::new(false);
    let mut turn: TurnId = 0;
    let mut exit_code = 0;
    loop {
        exit_now.store(exit_when_idle, Ordering::Relaxed);
        let Some(line) = input.read(&interrupted, &sigint) else {
            break;
        };
        if line.trim().is_empty() {
            continue;
        }
        turn += 1;
        let request = match commands::parse(&line) {
            Some(Ok(Command::Quit)) => break,
            Some(Ok(command)) => Request::Command { turn, command },
            Some(Err(msg)) => {
                let _ = writeln!(err, "{msg}");
                continue;
            }
            None => {
                // `//text` sends a literal `/text`.
                let text = line
                    .strip_prefix('/')
                    .filter(|l| l.starts_with('/'))
                    .unwrap_or(&line);
                Request::Send {
                    turn,
                    text: text.to_string(),
                }
            }
        };
        exit_now.store(false, Ordering::Relaxed);
        // `send` clears the cancel flag for the new turn.
        if !worker.send(request) {
            exit_code = 1;
            break;
        }
        // Chat completions are shown through the tolerant parser: the reasoning, a blank line,
        // then the answer, never the channel markers. Raw continuations are shown as they come.
        let mut view: Option<(TolerantParser, usize, usize)> = None;
        let mut last_stats: Option<Box<StatsSnapshot>> = None;
        loop {
            match worker.recv() {
                Some(EngineEvent::Stats { turn: t, stats }) if t == turn => {
                    last_stats = Some(stats)
                }
                Some(EngineEvent::TurnStarted {
                    turn: t,
                    raw,
                    thinking,
                    ..
                }) if t == turn => {
                    view = (!raw).then(|| (TolerantParser::new(thinking), 0, 0));
                }
                Some(EngineEvent::Token { turn: t, text, .. }) if t == turn => {
                    if !opts.jsonl {
                        let shown = match &mut view {
                            None => text,
                            Some((p, r_at, c_at)) => {
                                p.push(&text);
                                show_new(p, r_at, c_at)
                            }
                        };
                        let _ = out.write_all(safe(&shown).as_bytes());
                        let _ = out.flush();
                    }
                }
                Some(EngineEvent::TurnDone { turn: t, report }) if t == turn => {
                    // A Ctrl-C up to the answer stopped this request; only a later one leaves.
                    sigint.store(false, Ordering::Relaxed);
                    if let Some((p, r_at, c_at)) = view.as_mut().filter(|_| !opts.jsonl) {
                        p.finish();
                        let _ = out.write_all(safe(&show_new(p, r_at, c_at)).as_bytes());
                    }
                    if opts.jsonl {
                        let _ =
                            writeln!(out, "{}", jsonl_line(turn, &report, last_stats.as_deref()));
                    } else {
                        let _ = writeln!(out);
                        let _ = writeln!(err, "{}", summary(&report));
                    }
                    break;
                }
                Some(EngineEvent::Notice { turn: t, text }) if t == turn => {
                    sigint.store(false, Ordering::Relaxed);
                    let _ = writeln!(err, "{}", safe(&text));
                    break;
                }
                Some(EngineEvent::Failed { turn: t, message }) if t == turn => {
                    sigint.store(false, Ordering::Relaxed);
                    let _ = writeln!(err, "error: {}", safe(&message));
                    break;
                }
                Some(EngineEvent::Stopped { exit_code: c }) => return c,
                Some(_) => {}
                None => return 1,
            }
        }
    }
    input.save_history(opts);
    let mut reported = 0;
    for ev in worker.finish() {
        match ev {
            EngineEvent::Notice { text, .. } => {
                let _ = writeln!(err, "k3: {}", safe(&text));
            }
            EngineEvent::Stopped { exit_code: c } => reported = c,
            _ => {}
        }
    }
    if interrupted.load(Ordering::Relaxed) {
        exit_code = 130;
    } else if exit_code == 0 && !std::io::stdin().is_terminal() {
        // A script learns what went wrong: 5 not saved, 1 a turn abandoned on a read error,
        // 4 unsound output, 3 a damaged file.
        exit_code = reported;
    }
    exit_code
}

#[cfg(test)]
mod tests {
    use super::{read_lossy_line, show_new, summary, ANSWER_MARK, THINKING_MARK};
    use crate::session::chat::{Stop, TurnReport};
    use crate::session::template::TolerantParser;

    #[test]
    fn the_thinking_channel_and_the_answer_are_marked() {
        let mut p = TolerantParser::new(true);
        let (mut r, mut c) = (0, 0);
        let mut shown = String::new();
        // Streamed piece by piece, as tokens arrive.
        for piece in [
            "let me ",
            "see",
            "<|close|>think<|sep|>",
            "<|open|>response<|sep|>",
            "Hi",
            " there",
        ] {
            p.push(piece);
            shown.push_str(&show_new(&p, &mut r, &mut c));
        }
        p.finish();
        shown.push_str(&show_new(&p, &mut r, &mut c));
        let reasoning = p.reasoning().to_string();
        let content = p.content().to_string();
        assert!(!reasoning.is_empty() && !content.is_empty(), "{shown:?}");
        assert_eq!(
            shown,
            format!("{THINKING_MARK}{reasoning}{ANSWER_MARK}{content}")
        );
        // No thinking: the answer alone, no marks.
        let mut p = TolerantParser::new(false);
        let (mut r, mut c) = (0, 0);
        p.push("Hello");
        assert_eq!(show_new(&p, &mut r, &mut c), "Hello");
    }

    #[test]
    fn the_summary_counts_one_token_in_the_singular() {
        let mut r = TurnReport {
            mode: crate::session::chat::Mode::Chat,
            prompt_ids: vec![1, 2],
            generated_ids: vec![3],
            generated_tokens: 1,
            reply: "x".into(),
            reasoning: None,
            reused_tokens: 0,
            prefilled_tokens: 2,
            stop: Stop::MaxTokens,
            accepted: true,
            rejected_because: None,
            prefill_seconds: 0.1,
            decode_seconds: 0.5,
            context_warning: None,
        };
        assert_eq!(
            summary(&r),
            "[1 token, 2.0 tokens/s; prompt 0 reused + 2 prefilled; token limit]"
        );
        r.generated_tokens = 2;
        assert!(
            summary(&r).starts_with("[2 tokens, 4.0 tokens/s;"),
            "{}",
            summary(&r)
        );
    }

    #[test]
    fn lines_are_split_like_lines_and_bad_bytes_replaced() {
        let mut r = &b"a\r\nb \xff c\nlast"[..];
        assert_eq!(read_lossy_line(&mut r), Some(("a".into(), false)));
        assert_eq!(read_lossy_line(&mut r), Some(("b \u{fffd} c".into(), true)));
        assert_eq!(read_lossy_line(&mut r), Some(("last".into(), false)));
        assert_eq!(read_lossy_line(&mut r), None);
    }
}
