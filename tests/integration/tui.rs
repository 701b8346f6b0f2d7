//! The terminal client end to end, driven through tmux: the real `k3 chat` on the tiny
//! checkpoint in a detached session of fixed size. Type a message and see the streamed reply
//! and a non-zero tokens/s; move the budget slider and see the engine's answer; `/save`; quit;
//! check that the terminal is sane again (`stty -a` in the pane: echo and icanon); resume and
//! see the history; and measure input-to-screen latency while a long reply streams.
//!
//! tmux is required: without it this test fails and says how to install it.

use crate::common::fixture;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const WIDTH: u16 = 160;
const HEIGHT: u16 = 48;

/// A private tmux server (its own socket) with one detached session.
struct Tmux {
    socket: PathBuf,
    session: String,
}

/// The terminal-client tests need tmux; without it they fail with how to get it.
fn require_tmux() {
    let found = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "tmux is required for the terminal-client end-to-end test; install it \
         (apt-get install -y tmux) and run the tests again"
    );
}

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux")
    }

    /// Start `command` (a shell command line) in a new detached session.
    fn start(socket: &Path, session: &str, command: &str) -> Tmux {
        let t = Tmux {
            socket: socket.to_path_buf(),
            session: session.to_string(),
        };
        let (w, h) = (WIDTH.to_string(), HEIGHT.to_string());
        let out = t.run(&[
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            &w,
            "-y",
            &h,
            command,
        ]);
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        t
    }

    /// The pane's text (wrapped lines joined).
    fn capture(&self) -> String {
        let out = self.run(&["capture-pane", "-p", "-J", "-t", &self.session]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Send keys by tmux name (`Enter`, `Escape`, `C-q`, `[`).
    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", &self.session];
        args.extend_from_slice(keys);
        let out = self.run(&args);
        assert!(out.status.success(), "send-keys {keys:?}");
    }

    /// Type text literally.
    fn type_text(&self, text: &str) {
        let out = self.run(&["send-keys", "-t", &self.session, "-l", text]);
        assert!(out.status.success(), "send-keys -l {text:?}");
    }

    /// Poll the pane until `ok` holds; panics with the last capture after `secs`.
    fn wait_for(&self, what: &str, secs: u64, ok: impl Fn(&str) -> bool) -> String {
        self.poll(what, secs, Duration::from_millis(20), ok)
    }

    /// [`Tmux::wait_for`] with a chosen polling interval.
    fn poll(&self, what: &str, secs: u64, every: Duration, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let screen = self.capture();
            if ok(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the screen was:\n{screen}"
            );
            std::thread::sleep(every);
        }
    }
}

impl Tmux {
    /// Ctrl-Q, answer the unsaved-session question with `q`, and see the client exit 0.
    fn quit_unsaved(&self) {
        self.keys(&["C-q"]);
        self.wait_for("the unsaved question", 10, |s| {
            s.contains("unsaved changes")
        });
        self.keys(&["q"]);
        let screen = self.wait_for("the exit", 30, |s| s.contains("K3-EXIT="));
        assert!(screen.contains("K3-EXIT=0"), "{screen}");
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

fn chat_command(dir: &Path, extra: &str) -> String {
    format!(
        "env K3_DATA_DIR={data} K3_CONFIG={data}/no-config.toml TERM=xterm-256color {bin} chat \
         {model} --session-dir {data}/sessions --greedy --no-think --max-tokens 40 {extra}; \
         echo K3-EXIT=$?; stty -a; sleep 60",
        data = dir.display(),
        bin = env!("CARGO_BIN_EXE_k3"),
        model = fixture("tiny").display(),
    )
}

/// The status bar says the client is idle.
fn ready(screen: &str) -> bool {
    screen
        .lines()
        .any(|l| l.starts_with(" k3 │") && l.contains("│ ready"))
}

/// The number after `key` on the first line that has it (`avg 1234.5`).
fn number_after(screen: &str, key: &str) -> Option<f64> {
    screen.lines().find_map(|l| {
        let rest = &l[l.find(key)? + key.len()..];
        let n: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        n.parse().ok()
    })
}

/// The text row of the input box (the line under its top border).
fn input_row(screen: &str) -> String {
    let lines: Vec<&str> = screen.lines().collect();
    lines
        .iter()
        .rposition(|l| {
            l.starts_with("┌ message")
                || l.starts_with("┌ generating")
                || l.starts_with("┌ raw text")
        })
        .and_then(|i| lines.get(i + 1))
        .map_or_else(String::new, |l| (*l).to_string())
}

fn stty_flags(screen: &str) -> Vec<String> {
    let after = screen.find("K3-EXIT=").map_or("", |i| &screen[i..]);
    after.split_whitespace().map(str::to_string).collect()
}

#[test]
fn chat_in_tmux_streams_saves_resumes_and_restores_the_terminal() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();

    // 1. Start, type a message, see the streamed reply and a non-zero tokens/s.
    let t = Tmux::start(
        &dir.path().join("tmux-a.sock"),
        "k3a",
        &chat_command(dir.path(), ""),
    );
    t.wait_for("the ready status bar", 60, ready);
    t.type_text("hello there");
    t.keys(&["Enter"]);
    let screen = t.wait_for("the finished reply", 60, |s| {
        s.contains("tokens/s · prompt") && ready(s)
    });
    assert!(screen.contains("hello there"), "{screen}");
    let reply_tps = number_after(&screen, "40 tokens · ").unwrap_or(0.0);
    assert!(
        reply_tps > 0.0,
        "no tokens/s in the reply summary:\n{screen}"
    );
    let pane_avg = number_after(&screen, "avg ").unwrap_or(0.0);
    assert!(
        pane_avg > 0.0,
        "the tokens/s pane shows no average:\n{screen}"
    );
    assert!(screen.contains("┌ tokens/s") && screen.contains("┌ memory"));
    assert!(screen.contains("┌ disk") && screen.contains("┌ experts"));

    // 2. The budget slider: a step down and back up, each answered by the engine (a new
    // plan, or a refusal that says why).
    let answered =
        |s: &str| (s.contains("engine: ") || s.contains("refused: ")) && !s.contains("asking for");
    t.keys(&["["]);
    let first = t.wait_for("the budget answer", 30, answered);
    assert!(first.contains("┌ budget"), "{first}");
    let slider = |s: &str| {
        s.lines()
            .find_map(|l| l.find("│slider ").map(|i| l[i..].to_string()))
            .unwrap_or_default()
    };
    let before = slider(&first);
    t.keys(&["]"]);
    t.wait_for("the second budget answer", 30, |s| {
        answered(s) && slider(s) != before
    });

    // 3. Quitting with unsaved turns asks first; Esc stays.
    t.keys(&["C-q"]);
    t.wait_for("the unsaved-session question", 10, |s| {
        s.contains("unsaved changes")
    });
    t.keys(&["Escape"]);
    t.wait_for("the question closed", 10, |s| !s.contains("save and quit"));

    // 4. Save, then quit (no question now), and the terminal is sane again.
    t.type_text("/save t1");
    t.keys(&["Enter"]);
    t.wait_for("the save confirmation", 30, |s| {
        s.contains("saved session \"t1\"")
    });
    t.keys(&["C-q"]);
    let screen = t.wait_for("the exit and stty", 30, |s| {
        s.contains("K3-EXIT=") && s.contains("icanon")
    });
    assert!(screen.contains("K3-EXIT=0"), "{screen}");
    let flags = stty_flags(&screen);
    for flag in ["echo", "icanon", "isig"] {
        assert!(
            flags.iter().any(|f| f == flag) && !flags.iter().any(|f| *f == format!("-{flag}")),
            "{flag} not restored after exit:\n{screen}"
        );
    }
    assert!(
        !screen.contains("┌ tokens/s"),
        "the alternate screen was not left:\n{screen}"
    );
    drop(t);

    // 5. Resume: the history is shown.
    let t = Tmux::start(
        &dir.path().join("tmux-b.sock"),
        "k3b",
        &chat_command(dir.path(), "--resume t1"),
    );
    let screen = t.wait_for("the resumed history", 60, |s| {
        s.contains("history of t1") && s.contains("hello there") && ready(s)
    });
    assert!(screen.contains("session \"t1\""), "{screen}");

    // 6. Input-to-screen latency while a long reply streams (raw mode past the end-of-text
    // ids stops only at the length limit).
    t.type_text("/raw");
    t.keys(&["Enter"]);
    t.wait_for("raw mode", 30, |s| s.contains("raw mode:") && ready(s));
    t.type_text("/set raw_max_tokens 20000");
    t.keys(&["Enter"]);
    t.wait_for("the setting", 30, |s| s.contains("raw_max_tokens = 20000"));
    t.type_text("/set raw_ignore_end 1");
    t.keys(&["Enter"]);
    t.wait_for("the setting", 30, |s| s.contains("raw_ignore_end = 1"));
    t.type_text("Once upon a time");
    t.keys(&["Enter"]);
    t.wait_for("the reply streaming", 30, |s| s.contains("┌ generating"));
    let mut samples = Vec::new();
    let mut still_streaming = true;
    for typed in 1..=20 {
        let t0 = Instant::now();
        t.type_text("q");
        let screen = t.poll("the typed key", 10, Duration::from_millis(2), |s| {
            input_row(s).matches('q').count() >= typed
        });
        samples.push(t0.elapsed());
        still_streaming &= screen.contains("┌ generating");
        std::thread::sleep(Duration::from_millis(30));
    }
    samples.sort();
    // Every key reached the input box, each well within the poll's timeout.
    assert_eq!(samples.len(), 20);
    assert!(
        samples[samples.len() / 2] < Duration::from_secs(2),
        "median input-to-screen latency {:?}",
        samples[samples.len() / 2]
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "input-to-screen latency while streaming ({} keys, tmux send-keys → capture-pane, \
         polling every 2 ms): median {:.1} ms, max {:.1} ms, min {:.1} ms{}",
        samples.len(),
        ms(samples[samples.len() / 2]),
        ms(samples[samples.len() - 1]),
        ms(samples[0]),
        if still_streaming {
            ""
        } else {
            " (the reply ended during the measurement)"
        }
    );
    // Esc stops the reply within a token and keeps the session.
    t.keys(&["Escape"]);
    let screen = t.wait_for("the stopped reply", 30, |s| {
        s.contains("stopped; the session is kept") && ready(s)
    });
    assert!(screen.contains("┌ raw text"), "{screen}");
    t.keys(&["C-c"]);
    t.wait_for("the clear input", 10, |s| {
        input_row(s).matches('q').count() == 0
    });
    t.quit_unsaved();
}

#[test]
fn without_a_terminal_or_with_term_dumb_chat_falls_back_to_the_plain_repl() {
    let dir = tempfile::tempdir().unwrap();
    // Pipes: the REPL, and no terminal control sequences at all.
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .arg("chat")
        .arg(fixture("tiny"))
        .args([
            "--greedy",
            "--no-think",
            "--max-tokens",
            "5",
            "--session-dir",
        ])
        .arg(dir.path().join("sessions"))
        .env("K3_DATA_DIR", dir.path())
        .env("K3_CONFIG", dir.path().join("no-config.toml"))
        .env("TERM", "xterm-256color")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"hello\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("/help lists the commands"), "{err}");
    assert!(err.contains("5 tokens"), "{err}");
    for stream in [&out.stdout, &out.stderr] {
        assert!(
            !String::from_utf8_lossy(stream).contains("\u{1b}["),
            "terminal control sequences on a pipe"
        );
    }
    // TERM=dumb on a real terminal: the REPL too.
    require_tmux();
    let cmd = format!(
        "env K3_DATA_DIR={data} K3_CONFIG={data}/no-config.toml TERM=dumb {bin} chat {model} \
         --session-dir {data}/sessions --greedy --no-think --max-tokens 5; echo K3-EXIT=$?; \
         sleep 60",
        data = dir.path().display(),
        bin = env!("CARGO_BIN_EXE_k3"),
        model = fixture("tiny").display(),
    );
    let t = Tmux::start(&dir.path().join("tmux-dumb.sock"), "k3d", &cmd);
    t.wait_for("the REPL banner", 60, |s| {
        s.contains("/help lists the commands")
    });
    let screen = t.capture();
    assert!(
        !screen.contains("┌ tokens/s"),
        "TERM=dumb opened the TUI:\n{screen}"
    );
    t.type_text("/quit");
    t.keys(&["Enter"]);
    let screen = t.wait_for("the exit", 30, |s| s.contains("K3-EXIT="));
    assert!(screen.contains("K3-EXIT=0"), "{screen}");
}

#[test]
fn config_file_path_init_show_and_refusal_with_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("k3").join("config.toml");
    let k3 = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_k3"))
            .args(args)
            .env("K3_CONFIG", &file)
            .env("K3_DATA_DIR", dir.path())
            .output()
            .unwrap()
    };
    let out = k3(&["config", "path"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        file.display().to_string()
    );
    let out = k3(&["config", "init"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read_to_string(&file).unwrap().contains("[keys]"));
    let again = k3(&["config", "init"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let out = k3(&["config", "show"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("theme = \"dark\""));
    // An unknown key is refused with its line and column, by `show` and by `chat`.
    std::fs::write(&file, "theme = \"dark\"\n[sampling]\n  temprature = 0.5\n").unwrap();
    for args in [&["config", "show"][..], &["chat", "--plain"][..]] {
        let out = k3(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("config.toml:3:3"), "{args:?}: {err}");
        assert!(err.contains("temprature"), "{args:?}: {err}");
    }
}

#[test]
fn chat_with_no_model_opens_the_demo_and_answers() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let command = format!(
        "env K3_DATA_DIR={data} K3_CACHE_DIR={data}/cache K3_CONFIG={data}/no-config.toml \
         TERM=xterm-256color {bin} chat --greedy --no-think; echo K3-EXIT=$?; sleep 60",
        data = dir.path().display(),
        bin = env!("CARGO_BIN_EXE_k3"),
    );
    let t = Tmux::start(&dir.path().join("tmux-d.sock"), "k3d", &command);
    let screen = t.wait_for("the ready status bar", 60, ready);
    assert!(screen.contains("demo model"), "{screen}");
    // The start-up line names the demo model, not the cache folder it was written to.
    assert!(screen.contains("k3: the demo model ("), "{screen}");
    assert!(!screen.contains("/cache/"), "{screen}");
    t.type_text("What is the capital of Japan?");
    t.keys(&["Enter"]);
    let screen = t.wait_for("the answer", 60, |s| {
        s.contains("tokens/s · prompt") && ready(s)
    });
    assert!(screen.contains("Tokyo"), "{screen}");
    assert!(
        !screen.contains("<|"),
        "a template marker on screen:\n{screen}"
    );
    // The first run streams the demo under a budget below what holding it takes, says so,
    // and the panes show it: weight bytes read in the turn, experts not all resident.
    assert!(screen.contains("streamed"), "{screen}");
    assert!(
        screen
            .lines()
            .any(|l| l.contains("│turn ") && !l.contains("│turn 0 B")),
        "no disk reads in the turn:\n{screen}"
    );
    let resident = number_after(&screen, "· resident ").unwrap_or(100.0);
    assert!(resident < 100.0, "every expert resident:\n{screen}");
    t.quit_unsaved();
}

#[test]
fn plain_mode_on_a_terminal_stops_a_reply_on_ctrl_c_and_takes_sigint_at_the_prompt() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("k3.pid");
    // `exec` keeps the shell's pid, so the test can signal k3 itself.
    let command = format!(
        "env K3_DATA_DIR={data} K3_CONFIG={data}/no-config.toml TERM=xterm-256color sh -c \
         'echo $$ > {pid}; exec {bin} chat {model} --plain --session-dir {data}/sessions \
         --greedy --no-think --max-tokens 20000 --raw-max-tokens 20000 --raw-ignore-end'; echo K3-EXIT=$?; sleep 60",
        data = dir.path().display(),
        pid = pid_file.display(),
        bin = env!("CARGO_BIN_EXE_k3"),
        model = fixture("tiny").display(),
    );
    let t = Tmux::start(&dir.path().join("tmux-p.sock"), "k3p", &command);
    t.wait_for("the REPL banner", 60, |s| {
        s.contains("/help lists the commands")
    });
    // A raw continuation runs to the length limit unless stopped.
    t.type_text("/raw");
    t.keys(&["Enter"]);
    t.wait_for("raw mode", 30, |s| s.contains("raw mode:"));
    t.type_text("Once upon a time");
    t.keys(&["Enter"]);
    // Streaming has begun once text follows the typed line.
    t.wait_for("the continuation streaming", 30, |s| {
        let lines: Vec<&str> = s.lines().collect();
        lines
            .iter()
            .rposition(|l| l.contains("Once upon a time"))
            .and_then(|i| lines.get(i + 1))
            .is_some_and(|next| !next.trim().is_empty())
    });
    t.keys(&["C-c"]);
    let screen = t.wait_for("the stopped reply", 30, |s| s.contains("; stopped]"));
    assert!(!screen.contains("K3-EXIT="), "{screen}");
    let pid = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .to_string();
    let kill = || {
        let out = Command::new("kill").args(["-INT", &pid]).output().unwrap();
        assert!(out.status.success(), "kill -INT {pid}");
    };
    // At the prompt, an external SIGINT is a Ctrl-C there: the client leaves, saying what
    // was not saved (exit status 130).
    t.wait_for("the prompt", 30, |s| s.trim_end().ends_with('>'));
    t.type_text("half typed");
    t.wait_for("the typed text", 10, |s| s.contains("> half typed"));
    kill();
    let screen = t.wait_for("the exit", 30, |s| s.contains("K3-EXIT="));
    assert!(screen.contains("K3-EXIT=130"), "{screen}");
    assert!(screen.contains("NOT saved"), "{screen}");
}

#[test]
fn plain_mode_on_a_terminal_runs_every_line_typed_ahead_in_one_burst() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let command = format!(
        "env K3_DATA_DIR={data} K3_CONFIG={data}/no-config.toml TERM=xterm-256color {bin} chat \
         {model} --plain --session-dir {data}/sessions --greedy --no-think; echo K3-EXIT=$?; \
         sleep 60",
        data = dir.path().display(),
        bin = env!("CARGO_BIN_EXE_k3"),
        model = fixture("tiny").display(),
    );
    let t = Tmux::start(&dir.path().join("tmux-b.sock"), "k3b", &command);
    t.wait_for("the prompt", 60, |s| {
        s.contains("/help lists the commands") && s.trim_end().ends_with('>')
    });
    // Three lines in one write to the terminal, as a fast typist or a paste without
    // bracketed paste sends them: the line editor's first read takes all three.
    t.type_text("/set seed 5\r/set max_tokens 100\r/stats\r");
    let screen = t.wait_for("all three lines answered", 30, |s| {
        s.contains("seed 5 (/set), max_tokens 100 (/set)")
    });
    let answers: Vec<&str> = screen
        .lines()
        .map(str::trim_end)
        .filter(|l| {
            ["seed = 5", "max_tokens = 100", "positions 0 / "]
                .iter()
                .any(|a| l.starts_with(a))
        })
        .collect();
    assert_eq!(answers.len(), 3, "{screen}");
    assert!(
        answers[0] == "seed = 5" && answers[1] == "max_tokens = 100",
        "{screen}"
    );
    assert!(!screen.contains("K3-EXIT="), "{screen}");
    // The one editor's history has all three: Up recalls the last, and the file keeps them.
    t.keys(&["Up"]);
    t.wait_for("the recalled line", 10, |s| {
        s.trim_end().ends_with("> /stats")
    });
    t.keys(&["C-u"]);
    t.type_text("/quit\r");
    let screen = t.wait_for("the exit", 30, |s| s.contains("K3-EXIT="));
    assert!(screen.contains("K3-EXIT=0"), "{screen}");
    let history = std::fs::read_to_string(dir.path().join("repl_history")).unwrap();
    let lines: Vec<&str> = history.lines().filter(|l| l.starts_with('/')).collect();
    assert_eq!(
        lines,
        ["/set seed 5", "/set max_tokens 100", "/stats", "/quit"],
        "{history}"
    );
}

#[test]
fn a_budget_below_the_floor_is_refused_before_the_terminal_is_taken() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let t = Tmux::start(
        &dir.path().join("tmux-f.sock"),
        "k3f",
        &chat_command(dir.path(), "--mem 0.0001"),
    );
    let screen = t.wait_for("the exit", 60, |s| s.contains("K3-EXIT="));
    assert!(screen.contains("K3-EXIT=2"), "{screen}");
    assert!(screen.contains("floor"), "{screen}");
    assert!(screen.contains("context of 32768 positions"), "{screen}");
    assert!(!screen.contains("┌ tokens/s"), "{screen}");
}

#[test]
fn an_input_burst_reaches_the_screen_without_waiting_for_another_key() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let t = Tmux::start(
        &dir.path().join("tmux-i.sock"),
        "k3i",
        &chat_command(dir.path(), ""),
    );
    t.wait_for("the ready status bar", 60, ready);
    // Far more bytes than one read of the terminal takes: the last one must show without
    // another key.
    let burst = format!("{}E", "x".repeat(2999));
    t.type_text(&burst);
    t.wait_for("the end of the burst in the input box", 20, |s| {
        s.contains("xE ") || s.contains("xE│")
    });
    // A longer burst with Enter is sent at once.
    t.keys(&["C-u"]);
    t.wait_for("the cleared input", 10, |s| !s.contains("xxxxxxxxxx"));
    let long = format!("{}Z", "y".repeat(7088));
    t.type_text(&long);
    t.keys(&["Enter"]);
    // Sent: the engine reads it (its reply is not needed here) and the input box is empty.
    t.wait_for("the long message sent", 30, |s| {
        (s.contains("reading prompt") || s.contains("tokens/s · prompt"))
            && !input_row(s).contains('y')
    });
    // Dropping the tmux server ends the client (its prompt of 7,000 tokens is not waited for).
}

#[test]
fn the_input_history_is_kept_across_runs() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    let t = Tmux::start(
        &dir.path().join("tmux-h1.sock"),
        "k3h1",
        &chat_command(dir.path(), ""),
    );
    t.wait_for("the ready status bar", 60, ready);
    t.type_text("/stats");
    t.keys(&["Enter"]);
    t.wait_for("the stats answer", 30, |s| s.contains("positions 0 /"));
    t.keys(&["C-q"]);
    t.wait_for("the exit", 30, |s| s.contains("K3-EXIT=0"));
    drop(t);
    assert!(dir.path().join("input_history.json").exists());
    let t = Tmux::start(
        &dir.path().join("tmux-h2.sock"),
        "k3h2",
        &chat_command(dir.path(), ""),
    );
    t.wait_for("the ready status bar", 60, ready);
    t.keys(&["Up"]);
    t.wait_for("the recalled input", 10, |s| {
        input_row(s).contains("/stats")
    });
}

/// The pid of the `k3` the pane's shell started (the shell's only child).
fn k3_pid(t: &Tmux) -> String {
    let out = t.run(&["display-message", "-p", "-t", &t.session, "#{pane_pid}"]);
    let shell = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let children =
        std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children")).unwrap_or_default();
    let pid = children
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(!pid.is_empty(), "no child of the pane's shell {shell}");
    pid
}

#[test]
fn a_signal_to_the_terminal_client_restores_the_terminal_and_keeps_the_conversation() {
    require_tmux();
    for (signal, code) in [("TERM", 143), ("HUP", 129), ("INT", 130)] {
        let dir = tempfile::tempdir().unwrap();
        let name = format!("sig-{}", signal.to_lowercase());
        let t = Tmux::start(
            &dir.path().join("tmux-s.sock"),
            "k3s",
            &chat_command(dir.path(), &format!("--session {name}")),
        );
        t.wait_for("the ready status bar", 60, ready);
        t.type_text("hello there");
        t.keys(&["Enter"]);
        t.wait_for("the finished reply", 60, |s| {
            s.contains("tokens/s · prompt") && ready(s)
        });
        let pid = k3_pid(&t);
        assert!(Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap()
            .success());
        let screen = t.wait_for("the exit and stty", 30, |s| {
            s.contains("K3-EXIT=") && s.contains("icanon")
        });
        assert!(
            screen.contains(&format!("K3-EXIT={code}")),
            "SIG{signal}:\n{screen}"
        );
        let flags = stty_flags(&screen);
        for flag in ["echo", "icanon", "isig"] {
            assert!(
                flags.iter().any(|f| f == flag) && !flags.iter().any(|f| *f == format!("-{flag}")),
                "SIG{signal}: {flag} not restored:\n{screen}"
            );
        }
        assert!(
            !screen.contains("┌ tokens/s"),
            "SIG{signal}: the alternate screen was not left:\n{screen}"
        );
        assert!(
            screen.contains(&format!("stopped by SIG{signal}"))
                && screen.contains(&format!("k3 chat --resume {name}")),
            "SIG{signal}: no line saying how to resume:\n{screen}"
        );
        // The conversation is kept: resuming recovers the turn.
        let out = crate::common::k3_command()
            .arg("chat")
            .arg(fixture("tiny"))
            .args(["--plain", "--greedy", "--no-think", "--resume", &name])
            .arg("--session-dir")
            .arg(dir.path().join("sessions"))
            .env("K3_CONFIG", dir.path().join("no-config.toml"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "SIG{signal}: {err}");
        assert!(
            err.contains("recovered 1 unsaved turn"),
            "SIG{signal}: {err}"
        );
    }
}

/// Make `reply` the last reply of saved session `name` (under `dir/sessions`): it replaces the
/// last assistant message, or follows the last user message when the model's own reply was not
/// kept (the demo's replies stop at the token limit). Everything else of the file is kept; the
/// engine state does not hold this text, which only matters to a next turn, and the test only
/// looks at how the history is shown.
fn put_reply(dir: &Path, name: &str, reply: &str) {
    use k3::engine::config::ModelConfig;
    use k3::session::store::{ModelIdentity, Refusal, SessionStore};
    let store = SessionStore::new(dir.join("sessions"));
    let cfg = ModelConfig::load(&fixture("tiny/config.json")).expect("tiny config");
    // The file names the model it was saved with; a wrong guess is refused with that name.
    let guess = ModelIdentity { hash: [0; 32] };
    let identity = match store.load(name, &cfg, &guess) {
        Ok(_) => guess,
        Err(e) => match e.refusal() {
            Some(Refusal::Identity { file, .. }) => **file,
            _ => panic!("session {name}: {e}"),
        },
    };
    let mut rec = store.load(name, &cfg, &identity).expect("load the session");
    let mut t: serde_json::Value = serde_json::from_slice(&rec.transcript_json).expect("json");
    let entries = t["entries"].as_array_mut().expect("entries");
    if entries.last().is_some_and(|e| e["role"] == "assistant") {
        entries.pop();
    }
    entries.push(serde_json::json!({"kind": "message", "role": "assistant", "content": reply}));
    rec.transcript_json = serde_json::to_vec(&t).expect("json");
    store.save(&rec).expect("save the session");
}

const MARKDOWN_REPLY: &str = "\
## Reading a checkpoint

1. Open the **index** with *serde*
   - check `weight_map`
2. Map the shards, see [the docs](https://docs.rs/memmap2)

| shard | tensors | bytes |
|:------|:-------:|------:|
| 1 | 412 | 4.1 GB |

```rust
fn open(dir: &Path) -> io::Result<Index> {
    let text = fs::read_to_string(dir.join(\"index.json\"))?;
    Ok(serde_json::from_str(&text)?)
}
```
";

#[test]
fn a_resumed_markdown_reply_is_rendered_and_its_code_block_copied_through_osc_52() {
    require_tmux();
    let dir = tempfile::tempdir().unwrap();
    // A saved session whose reply is Markdown with a code block.
    let t = Tmux::start(
        &dir.path().join("tmux-md.sock"),
        "k3md",
        &chat_command(dir.path(), "--session md"),
    );
    t.wait_for("the ready status bar", 60, ready);
    t.type_text("hello");
    t.keys(&["Enter"]);
    t.wait_for("the reply", 60, |s| {
        s.contains("tokens/s · prompt") && ready(s)
    });
    t.type_text("/save md");
    t.keys(&["Enter"]);
    t.wait_for("the save", 30, |s| s.contains("saved session \"md\""));
    t.keys(&["C-q"]);
    t.wait_for("the exit", 30, |s| s.contains("K3-EXIT=0"));
    drop(t);
    put_reply(dir.path(), "md", MARKDOWN_REPLY);

    let t = Tmux::start(
        &dir.path().join("tmux-md2.sock"),
        "k3md2",
        &chat_command(dir.path(), "--resume md"),
    );
    // The pane's OSC 52 writes go to tmux's paste buffer.
    assert!(t
        .run(&["set", "-g", "set-clipboard", "on"])
        .status
        .success());
    let screen = t.wait_for("the rendered history", 60, |s| {
        s.contains("Reading a checkpoint") && s.contains("▎ rust") && ready(s)
    });
    eprintln!("{screen}");
    // Rendered, not shown as source: no heading marks, fences, table pipes or emphasis stars.
    for markup in ["## ", "```", "|:---", "**index**", "*serde*", "](https://"] {
        assert!(!screen.contains(markup), "{markup:?} shown:\n{screen}");
    }
    for shown in [
        "1. Open the index with serde",
        "◦ check weight_map",
        "see the docs (https://docs.rs/memmap2)",
        "shard │ tensors │  bytes",
        "▎ fn open(dir: &Path) -> io::Result<Index> {",
    ] {
        assert!(screen.contains(shown), "{shown:?} missing:\n{screen}");
    }
    // The code is highlighted: its keyword and its type in two different 24-bit colours.
    let coloured = t.run(&["capture-pane", "-p", "-e", "-t", "k3md2"]);
    let coloured = String::from_utf8_lossy(&coloured.stdout).into_owned();
    let code_row = coloured
        .lines()
        .find(|l| l.contains("open") && l.contains("Result"))
        .unwrap_or_default()
        .to_string();
    let mut colours: Vec<&str> = code_row
        .split("\u{1b}[")
        .filter(|p| p.starts_with("38;2;"))
        .map(|p| p.split('m').next().unwrap_or(""))
        .collect();
    colours.sort_unstable();
    colours.dedup();
    assert!(colours.len() >= 3, "{code_row:?}");
    eprintln!("{coloured}");

    // Select mode: the newest message first, Down onto its code block, y copies the code.
    t.keys(&["C-o"]);
    t.wait_for("select mode", 10, |s| s.contains("┌ select"));
    t.keys(&["Down"]);
    let screen = t.wait_for("the code block highlighted", 10, |s| {
        s.contains("▌ ▎ fn open(dir: &Path)") && !s.contains("▌ 1. Open the index")
    });
    eprintln!("{screen}");
    t.keys(&["y"]);
    t.wait_for("the copy", 10, |s| s.contains("copied the code block"));
    let buffer = t.run(&["show-buffer"]);
    let code = "fn open(dir: &Path) -> io::Result<Index> {\n    let text = \
                fs::read_to_string(dir.join(\"index.json\"))?;\n    Ok(serde_json::from_str(&text)?)\n}\n";
    assert_eq!(String::from_utf8_lossy(&buffer.stdout), code);
    t.keys(&["C-q"]);
    let screen = t.wait_for("the exit", 30, |s| s.contains("K3-EXIT="));
    assert!(screen.contains("K3-EXIT=0"), "{screen}");
}
