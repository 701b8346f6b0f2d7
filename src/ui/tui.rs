//! The terminal front end's driver: terminal set-up and restore (on exit, on error and on
//! panic), the threads that feed the one inbox, and the loop that blocks for an event, drains
//! the rest, updates the [`App`], runs its effects and draws at most once a frame, and only
//! when something visible changed.
//!
//! Threads: this one (inbox, `update`, draw); the input thread (crossterm events and a 10 Hz
//! tick); the bridge thread, which owns the [`Worker`], forwards requests to it at once and
//! its events into the inbox. The worker's handle offers only a blocking or a non-blocking
//! receive, so the bridge polls it, every millisecond while events flow and backing off to
//! 20 ms when idle.

use crate::app::protocol::{EngineEvent, Request};
use crate::app::state::{App, AppInit, Effect, Msg};
use crate::app::worker::Worker;
use crate::ui::input::{self, KeyMap};
use crate::ui::view::{self, Measure};
use crossterm::event::{
    DisableBracketedPaste, DisableMouseCapture, EnableBracketedPaste, EnableMouseCapture,
    KeyboardEnhancementFlags, PopKeyboardEnhancementFlags, PushKeyboardEnhancementFlags,
};
use crossterm::execute;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Everything the UI thread waits for, over one channel.
#[derive(Debug)]
pub enum Event {
    /// A terminal event (key, mouse, paste, resize) from the input thread.
    Input(crossterm::event::Event),
    /// The input thread's timer (10 Hz).
    Tick(Instant),
    /// An engine event forwarded by the bridge thread.
    Engine(EngineEvent),
    /// The worker thread ended without saying `Stopped` (it panicked).
    EngineGone,
}

/// Set by the panic hook: a thread panicked and the terminal has been restored, so the UI must
/// stop drawing and leave (exit status 101).
static PANICKED: AtomicBool = AtomicBool::new(false);

/// Exit status after a panic in any thread.
const PANIC_EXIT: i32 = 101;

/// Least time between two frames (about 60 per second).
const FRAME: Duration = Duration::from_millis(16);
/// Timer period of the input thread.
const TICK: Duration = Duration::from_millis(100);
/// Longest the bridge waits between two looks at the worker's events.
const BRIDGE_IDLE: Duration = Duration::from_millis(20);

/// What the driver needs besides the worker.
#[derive(Clone, Debug)]
pub struct TuiOptions {
    /// The model's initial state.
    pub init: AppInit,
    /// Key bindings.
    pub keys: KeyMap,
}

/// Terminal modes this client turned on, undone exactly once (drop, error or explicit).
struct TerminalGuard {
    terminal: Option<ratatui::DefaultTerminal>,
    keyboard_flags: bool,
}

fn leave_modes(keyboard_flags: bool) {
    let mut out = std::io::stdout();
    if keyboard_flags {
        let _ = execute!(out, PopKeyboardEnhancementFlags);
    }
    let _ = execute!(
        out,
        DisableMouseCapture,
        DisableBracketedPaste,
        crossterm::cursor::Show
    );
}

impl TerminalGuard {
    fn enter() -> std::io::Result<TerminalGuard> {
        // Raw mode, alternate screen, and a panic hook that restores both before printing.
        let terminal = ratatui::try_init()?;
        let keyboard_flags = crossterm::terminal::supports_keyboard_enhancement().unwrap_or(false);
        // Our hook runs first: it undoes mouse capture, bracketed paste and keyboard flags, then
        // hands over to ratatui's, which leaves raw mode and the alternate screen and prints.
        let ratatui_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICKED.store(true, Ordering::SeqCst);
            leave_modes(keyboard_flags);
            ratatui_hook(info);
        }));
        let mut guard = TerminalGuard {
            terminal: Some(terminal),
            keyboard_flags: false,
        };
        let mut out = std::io::stdout();
        execute!(out, EnableBracketedPaste, EnableMouseCapture)?;
        if keyboard_flags {
            execute!(
                out,
                PushKeyboardEnhancementFlags(KeyboardEnhancementFlags::DISAMBIGUATE_ESCAPE_CODES)
            )?;
            guard.keyboard_flags = true;
        }
        Ok(guard)
    }

    fn restore(&mut self) {
        if self.terminal.take().is_some() {
            leave_modes(self.keyboard_flags);
            ratatui::restore();
        }
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Owns the worker: forwards requests to it and its events into the inbox until told to stop
/// or the UI is gone.
fn bridge(worker: Worker, requests: &Receiver<Request>, inbox: &Sender<Event>) {
    // The worker thread holds one clone of the cancel flag for as long as it runs.
    let flag = worker.cancel_flag();
    let running = Arc::strong_count(&flag);
    let mut wait = Duration::from_millis(1);
    let mut stopped = false;
    loop {
        match requests.recv_timeout(wait) {
            // The UI is leaving: the worker finishes (a stopped turn is journaled) and what it
            // says last (what was not saved, how to resume it) goes to the inbox.
            Ok(Request::Shutdown) => {
                for ev in worker.finish() {
                    let _ = inbox.send(Event::Engine(ev));
                }
                return;
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Ok(r) => {
                let _ = worker.send(r);
                wait = Duration::from_millis(1);
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        let ended = Arc::strong_count(&flag) < running;
        let mut got = false;
        while let Some(ev) = worker.try_recv() {
            got = true;
            stopped |= matches!(ev, EngineEvent::Stopped { .. });
            if inbox.send(Event::Engine(ev)).is_err() {
                worker.shutdown();
                return;
            }
        }
        if ended && !stopped {
            stopped = true;
            if inbox.send(Event::EngineGone).is_err() {
                break;
            }
        }
        wait = if got {
            Duration::from_millis(1)
        } else {
            (wait * 2).min(BRIDGE_IDLE)
        };
    }
    drop(flag);
    worker.shutdown();
}

/// Reads terminal events and sends them, with a tick every [`TICK`], until `stop` is set or
/// the inbox is gone.
fn input_thread(inbox: &Sender<Event>, stop: &AtomicBool) {
    let mut next_tick = Instant::now() + TICK;
    while !stop.load(Ordering::Relaxed) {
        let timeout = next_tick.saturating_duration_since(Instant::now());
        match crossterm::event::poll(timeout) {
            Ok(true) => match crossterm::event::read() {
                Ok(ev) => {
                    if inbox.send(Event::Input(ev)).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            },
            Ok(false) => {}
            Err(_) => return,
        }
        let now = Instant::now();
        if now >= next_tick {
            next_tick = now + TICK;
            if inbox.send(Event::Tick(now)).is_err() {
                return;
            }
        }
    }
}

/// OSC 52: ask the terminal to put `text` on the clipboard.
fn copy_osc52(text: &str) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    let mut out = std::io::stdout();
    let _ = write!(out, "\x1b]52;c;{b64}\x07");
    let _ = out.flush();
}

/// The bell, and an OSC 9 desktop notification where the terminal shows them.
fn notify(text: &str) {
    let clean: String = text.chars().filter(|c| !c.is_control()).collect();
    let mut out = std::io::stdout();
    let _ = write!(out, "\x07\x1b]9;{clean}\x07");
    let _ = out.flush();
}

/// The UI thread's side of the channels.
struct Driver {
    app: App,
    keys: KeyMap,
    requests: Sender<Request>,
    cancel: Arc<AtomicBool>,
    answer_now: Arc<AtomicBool>,
    measure: Measure,
    quit: Option<i32>,
}

impl Driver {
    /// Apply a message and run its effects.
    fn apply(&mut self, msg: Msg) {
        for fx in self.app.update(msg) {
            match fx {
                Effect::Send(r) => {
                    let _ = self.requests.send(r);
                }
                Effect::Cancel => self.cancel.store(true, Ordering::Relaxed),
                Effect::AnswerNow => self.answer_now.store(true, Ordering::Relaxed),
                Effect::Copy(text) => copy_osc52(&text),
                Effect::Notify(text) => notify(&text),
                Effect::Quit { code } => self.quit = Some(code),
            }
        }
    }

    fn event(&mut self, ev: Event) {
        let msg = match ev {
            Event::Input(e) => input::translate(&e, &self.keys, &self.measure.regions),
            Event::Tick(t) => Some(Msg::Tick(t)),
            Event::Engine(e) => Some(Msg::Engine(e)),
            Event::EngineGone => Some(Msg::WorkerGone),
        };
        if let Some(m) = msg {
            self.apply(m);
        }
    }
}

/// How the terminal client ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Exit status.
    pub code: i32,
    /// The input history at the end, oldest first (for the caller to keep across runs).
    pub history: Vec<String>,
}

/// Run the terminal client until the user leaves. The terminal is restored before this
/// returns, whatever happened.
#[must_use]
pub fn run(worker: Worker, opts: TuiOptions) -> Outcome {
    let mut guard = match TerminalGuard::enter() {
        Ok(g) => g,
        Err(e) => {
            ratatui::restore();
            eprintln!("k3: cannot start the terminal interface: {e} (try --plain)");
            worker.shutdown();
            return Outcome {
                code: 1,
                history: opts.init.history,
            };
        }
    };
    let (inbox_tx, inbox) = channel::<Event>();
    let (req_tx, req_rx) = channel::<Request>();
    let cancel = worker.cancel_flag();
    let answer_now = worker.answer_now_flag();
    let stop_input = Arc::new(AtomicBool::new(false));
    let bridge_handle: Option<JoinHandle<()>> = {
        let tx = inbox_tx.clone();
        std::thread::Builder::new()
            .name("k3-bridge".into())
            .spawn(move || bridge(worker, &req_rx, &tx))
            .ok()
    };
    {
        let tx = inbox_tx.clone();
        let stop = Arc::clone(&stop_input);
        let _ = std::thread::Builder::new()
            .name("k3-input".into())
            .spawn(move || input_thread(&tx, &stop));
    }
    drop(inbox_tx);
    // The highlighter's grammars load off the UI thread while the model loads.
    let _ = std::thread::Builder::new()
        .name("k3-highlight".into())
        .spawn(view::markdown::warm_up);
    let signals = Signals::register();
    let mut d = Driver {
        app: App::new(opts.init),
        keys: opts.keys,
        requests: req_tx,
        cancel,
        answer_now,
        measure: Measure::default(),
        quit: None,
    };
    let code = match guard.terminal.as_mut() {
        Some(t) => event_loop(&mut d, t, &inbox, &signals),
        None => 1,
    };
    stop_input.store(true, Ordering::Relaxed);
    d.cancel.store(true, Ordering::Relaxed);
    let _ = d.requests.send(Request::Shutdown);
    guard.restore();
    if let Some(name) = signals.received() {
        eprintln!("k3: stopped by {name}");
    }
    if let Some(h) = bridge_handle {
        let _ = h.join();
    }
    // On the restored terminal: what was not saved and how to resume it.
    for ev in inbox.try_iter() {
        if let Event::Engine(EngineEvent::Notice { turn: 0, text }) = ev {
            eprintln!("k3: {}", crate::app::run::terminal_safe(&text));
        }
    }
    Outcome {
        code,
        history: d.app.history.entries().to_vec(),
    }
}

/// SIGTERM, SIGHUP and SIGINT sent to the client: the first ends the loop (the terminal is
/// restored, the worker finishes and journals, exit 128 + the signal); a second one while
/// leaving exits at once.
struct Signals {
    got: Arc<AtomicUsize>,
    leaving: Arc<AtomicBool>,
}

impl Signals {
    const ALL: [(i32, &'static str); 3] = [
        (signal_hook::consts::SIGTERM, "SIGTERM"),
        (signal_hook::consts::SIGHUP, "SIGHUP"),
        (signal_hook::consts::SIGINT, "SIGINT"),
    ];

    fn register() -> Signals {
        let s = Signals {
            got: Arc::new(AtomicUsize::new(0)),
            leaving: Arc::new(AtomicBool::new(false)),
        };
        for (sig, _) in Self::ALL {
            let _ = signal_hook::flag::register_conditional_shutdown(
                sig,
                128 + sig,
                Arc::clone(&s.leaving),
            );
            let _ = signal_hook::flag::register_usize(sig, Arc::clone(&s.got), sig as usize);
        }
        s
    }

    /// The exit status for a signal received, if one was (and arm the second-signal exit).
    fn exit_code(&self) -> Option<i32> {
        let sig = self.got.load(Ordering::SeqCst);
        (sig != 0).then(|| {
            self.leaving.store(true, Ordering::SeqCst);
            128 + sig as i32
        })
    }

    fn received(&self) -> Option<&'static str> {
        let sig = self.got.load(Ordering::SeqCst);
        Self::ALL
            .iter()
            .find(|(s, _)| *s as usize == sig)
            .map(|(_, n)| *n)
    }
}

fn event_loop(
    d: &mut Driver,
    terminal: &mut ratatui::DefaultTerminal,
    inbox: &Receiver<Event>,
    signals: &Signals,
) -> i32 {
    if let Ok(size) = terminal.size() {
        d.apply(Msg::Resize {
            width: size.width,
            height: size.height,
        });
    }
    let mut drawn = None;
    let mut last_draw: Option<Instant> = None;
    loop {
        let pending = drawn != Some(d.app.revision);
        let ev = if pending {
            let since = last_draw.map_or(FRAME, |t| t.elapsed());
            match inbox.recv_timeout(FRAME.saturating_sub(since)) {
                Ok(ev) => Some(ev),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return 1,
            }
        } else {
            // Wakes at least twice a second to notice a panic in another thread.
            match inbox.recv_timeout(Duration::from_millis(500)) {
                Ok(ev) => Some(ev),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return 1,
            }
        };
        if PANICKED.load(Ordering::SeqCst) {
            return PANIC_EXIT;
        }
        if let Some(code) = signals.exit_code() {
            return code;
        }
        if let Some(ev) = ev {
            d.event(ev);
            // Drain a burst (token streams) before drawing once.
            for ev in inbox.try_iter().take(4096) {
                d.event(ev);
                if d.quit.is_some() {
                    break;
                }
            }
        }
        if let Some(code) = d.quit {
            return code;
        }
        let due = last_draw.is_none_or(|t| t.elapsed() >= FRAME);
        if drawn != Some(d.app.revision) && due {
            let mut m = Measure::default();
            if terminal.draw(|f| m = view::draw(f, &d.app)).is_err() {
                return 1;
            }
            d.measure = m;
            drawn = Some(d.app.revision);
            last_draw = Some(Instant::now());
            d.apply(Msg::Viewport {
                max_scroll: m.max_scroll,
                page: m.page,
            });
        }
    }
}
