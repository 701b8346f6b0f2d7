//! The terminal client's model: a pure state machine, `App::update(Msg) -> Vec<Effect>`.
//!
//! It never performs I/O, reads no clock, touches no terminal and starts no thread: the driver
//! in `ui::tui` turns key presses, timer ticks and engine events into [`Msg`]s and runs the
//! [`Effect`]s that come back (requests to the worker, the cancel flag, the clipboard, quit).
//! Everything the client shows of the session (its history, the saved sessions) arrives as
//! engine events. Rendering reads `&App` only.
//!
//! Every request carries a fresh [`TurnId`]; events for a turn the user cancelled, or for a turn
//! this model never asked for, are dropped.

pub mod editor;
mod events;
mod keys;
mod select;
#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod tests;

use crate::app::config::{Cmd, ThemeName};
pub use crate::app::protocol::SessionRow;
use crate::app::protocol::{EngineEvent, Request, TurnId};
use crate::session::chat::{Mode, Stop, TurnReport};
use crate::session::commands::{Command, Think};
use crate::session::template::TolerantParser;
use crate::stream::stats::StatsSnapshot;
use editor::{Editor, History};
pub use keys::think_word;
pub use select::{code_blocks, markdown_options, Target};
use std::collections::VecDeque;
use std::time::Instant;

/// What the conversation is doing.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    /// The worker is loading the model.
    Loading,
    /// Waiting for input.
    Idle,
    /// A reply was asked for and the prompt is being read (`done` of `total` tokens).
    Prefill {
        /// The reply's turn.
        turn: TurnId,
        /// Prompt tokens read.
        done: u64,
        /// Prompt tokens to read (0 until the engine says).
        total: u64,
    },
    /// Reply tokens are arriving.
    Streaming {
        /// The reply's turn.
        turn: TurnId,
        /// Tokens received.
        tokens: u64,
    },
    /// The engine stopped; any key leaves with `code`.
    Failed {
        /// Why, as the engine said it.
        message: String,
        /// Exit status to leave with.
        code: i32,
    },
    /// Leaving: the driver is shutting the worker down.
    Exiting,
}

/// How a reply ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyState {
    /// Tokens are still arriving.
    Live,
    /// Finished (the summary says how).
    Done,
    /// Stopped by the user.
    Stopped,
}

/// One reply of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The turn that produced it (0 for replies loaded from a saved session).
    pub turn: TurnId,
    /// Thinking-channel text (raw, unescaped: the view escapes it).
    pub reasoning: String,
    /// Answer text (raw, unescaped).
    pub content: String,
    /// A raw-mode continuation (no template, no channels).
    pub raw: bool,
    /// Live, done or stopped.
    pub state: ReplyState,
    /// One line of figures once it is done (tokens, tokens/s, why it stopped).
    pub summary: Option<String>,
    /// Why the reply was not added to the history, if it was not.
    pub note: Option<String>,
}

/// One entry of the conversation pane.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// A line from the client or the engine (start-up info, command answers).
    Info(String),
    /// A message from the user (or, `raw`, text given to continue).
    User {
        /// The text.
        text: String,
        /// Raw mode.
        raw: bool,
    },
    /// A reply.
    Reply(Reply),
    /// An error, shown in the error style.
    Error(String),
}

/// The session dialog's state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionDialog {
    /// The listing; `None` while it is being read.
    pub rows: Option<Result<Vec<SessionRow>, String>>,
    /// Selected row.
    pub selected: usize,
    /// The name being typed for "save as", if the user pressed `s`.
    pub naming: Option<Editor>,
    /// The name in `naming` is the prefilled one, untouched: the first character typed
    /// replaces it (Backspace and the arrows edit it instead).
    pub prefilled: bool,
    /// A refusal to show in the dialog (bad name, busy engine).
    pub message: Option<String>,
    /// Rows shown are those whose name contains this (case-insensitively).
    pub filter: String,
    /// Typed characters go to `filter` (after `/`).
    pub filtering: bool,
    /// Renaming a session: its name, and the new name being typed (prefilled as in save as).
    pub renaming: Option<(String, Editor)>,
    /// Deleting this session, once the user says yes.
    pub deleting: Option<String>,
}

impl SessionDialog {
    /// The rows the filter lets through, in the listing's order.
    #[must_use]
    pub fn visible(&self) -> Vec<&SessionRow> {
        let want = self.filter.to_lowercase();
        match &self.rows {
            Some(Ok(rows)) => rows
                .iter()
                .filter(|r| r.name.to_lowercase().contains(&want))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// A popup over the main screen.
#[derive(Clone, Debug, PartialEq)]
pub enum Dialog {
    /// Every key and slash command.
    Help,
    /// Save / load / new.
    Sessions(SessionDialog),
    /// Quitting with unsaved turns.
    ConfirmQuit,
    /// Starting a new conversation with unsaved turns.
    ConfirmNew,
    /// Saving over a different saved session of this name (`s` in the session dialog).
    ConfirmReplace(String),
    /// Loading this session over unsaved turns (`/load`, or Enter in the session dialog).
    ConfirmLoad(String),
    /// Changing thinking (F2, `/think`) in a conversation that has turns: the change re-reads
    /// it. Enter applies it now; Esc keeps it for the next new conversation.
    ConfirmThink(Think),
}

/// Where keys go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Focus {
    /// The input box.
    Input,
    /// The budget slider (arrows and `[` `]` move it).
    Budget,
}

/// Positions of the budget slider above its lowest (0).
pub const BUDGET_STEPS: u32 = 24;

/// The memory-budget slider and the engine's answer to it.
///
/// The slider is logarithmic: from a sixteenth of the model's weight bytes up to the larger of
/// 1.25 × the model and the budget in force, so that both a budget far below the model and one
/// that holds it all are a few steps away, whatever the model's size.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Budget {
    /// Slider position, 0 ..= [`BUDGET_STEPS`].
    pub step: u32,
    /// Bytes at position 0 (0 until the engine's figures arrive).
    pub low_bytes: u64,
    /// Bytes at the top position (0 until the engine's figures arrive).
    pub high_bytes: u64,
    /// The checkpoint's weight bytes, as the engine reports them.
    pub model_bytes: u64,
    /// Budget in force as the engine reports it; `None` when the model is held resident.
    pub in_force: Option<u64>,
    /// The slider was moved by the user since start.
    pub touched: bool,
    /// Request in flight: turn and bytes asked for.
    pub asked: Option<(TurnId, u64)>,
    /// The engine's last answer: bytes asked, and its text (`Err` for a refusal).
    pub answer: Option<(u64, Result<String, String>)>,
    /// The exact bytes the slider stands for: the budget in force while nothing is asked,
    /// else the (rounded) value asked for. `None` until known: the step's value then.
    pub exact: Option<u64>,
}

impl Budget {
    /// True once the engine's figures gave the slider its scale.
    #[must_use]
    pub fn ready(&self) -> bool {
        self.high_bytes > 0
    }

    /// Bytes at slider position `step`.
    #[must_use]
    pub fn bytes_at(&self, step: u32) -> u64 {
        if !self.ready() {
            return 0;
        }
        let (lo, hi) = (self.low_bytes as f64, self.high_bytes as f64);
        let f = f64::from(step.min(BUDGET_STEPS)) / f64::from(BUDGET_STEPS);
        (lo * (hi / lo).powf(f)).round() as u64
    }

    /// The slider's value in bytes: one number with the budget in force and the engine's
    /// answer (the value asked for while a request is in flight).
    #[must_use]
    pub fn value_bytes(&self) -> u64 {
        self.exact.unwrap_or_else(|| self.bytes_at(self.step))
    }

    /// The bytes a request for slider position `step` asks for: its value to three
    /// significant digits of a GB, as `/budget` takes it.
    #[must_use]
    pub fn asked_at(&self, step: u32) -> u64 {
        (round_sig3(self.bytes_at(step) as f64 / 1e9) * 1e9).round() as u64
    }

    /// The position nearest to `bytes`.
    #[must_use]
    pub fn step_of(&self, bytes: u64) -> u32 {
        if !self.ready() || bytes <= self.low_bytes {
            return 0;
        }
        let f = (bytes as f64 / self.low_bytes as f64).ln()
            / (self.high_bytes as f64 / self.low_bytes as f64).ln();
        ((f * f64::from(BUDGET_STEPS)).round() as u32).min(BUDGET_STEPS)
    }

    /// Take the engine's figures: the model's size, the budget in force and the plan's floor
    /// (0 when unknown or resident). The slider runs from the floor (a sixteenth of the model
    /// when there is none) to 1.25 × the model, where everything is held: below the floor
    /// nothing runs and above the top nothing more helps. A budget in force above the top
    /// shows at the top.
    pub fn observe(&mut self, model_bytes: u64, in_force: Option<u64>, floor: u64) {
        if model_bytes == 0 {
            return;
        }
        self.model_bytes = model_bytes;
        self.in_force = in_force;
        self.low_bytes = if floor > 0 {
            floor
        } else {
            (model_bytes / 16).max(1)
        };
        self.high_bytes = model_bytes
            .saturating_add(model_bytes / 4)
            .max(self.low_bytes.saturating_mul(2));
        // At rest the slider is the budget in force, exactly; while a request is in flight it
        // stays on the value asked for.
        if self.asked.is_none() {
            self.step = self.in_force_step();
            self.exact = in_force;
        }
    }

    /// The slider position of the budget in force (the top when the model is resident).
    #[must_use]
    pub fn in_force_step(&self) -> u32 {
        self.in_force.map_or(BUDGET_STEPS, |b| self.step_of(b))
    }
}

/// Tokens/s and disk figures over time, for the sparklines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatsView {
    /// The latest snapshot.
    pub last: Option<StatsSnapshot>,
    /// Recent tokens/s figures, oldest first.
    pub tps: VecDeque<f64>,
    /// Recent disk MB/s figures, oldest first.
    pub disk: VecDeque<f64>,
}

/// Points kept for each sparkline.
pub const SPARK_POINTS: usize = 120;

/// Why a request was sent, so its answer can be routed.
#[derive(Clone, Debug, PartialEq)]
enum Purpose {
    /// A reply: a message, `/regen` or `/edit`.
    Reply(ReplyKind),
    /// A slash command (other than the reply-producing ones).
    Command(Command),
    /// The budget slider.
    Budget,
    /// The session's history, to show a resumed or loaded session.
    History,
    /// The saved sessions, for the session dialog.
    Sessions,
    /// Renaming or deleting a saved session from the dialog.
    SessionFile,
}

/// What produced a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplyKind {
    /// A message (or raw text).
    Send,
    /// `/regen`: replaces the last reply.
    Regen,
    /// `/edit`: replaces the last message and its reply.
    Edit,
}

/// Key names shown in the help popup and the status bar, by command.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLabels(pub Vec<(Cmd, String)>);

impl KeyLabels {
    /// The label of `cmd`'s key ("?" if unbound).
    #[must_use]
    pub fn of(&self, cmd: Cmd) -> &str {
        self.0
            .iter()
            .find(|(c, _)| *c == cmd)
            .map_or("?", |(_, l)| l.as_str())
    }
}

/// What the driver knows at start.
#[derive(Clone, Debug, PartialEq)]
pub struct AppInit {
    /// Model name for the status bar (the checkpoint directory's name).
    pub model: String,
    /// Session name given on the command line, if any.
    pub session: Option<String>,
    /// A session is being resumed: show its history once the engine is ready.
    pub resume: bool,
    /// Thinking channel on at start.
    pub thinking: bool,
    /// Thinking effort at start.
    pub effort: String,
    /// Context limit in positions.
    pub context_limit: u64,
    /// Budget to ask for at start (from the config file).
    pub budget_gb: Option<f64>,
    /// Key labels.
    pub keys: KeyLabels,
    /// Colour scheme.
    pub theme: ThemeName,
    /// Longest reply in tokens (for the estimate of the time left).
    pub max_tokens: u64,
    /// Inputs sent in earlier runs, oldest first (Up recalls them).
    pub history: Vec<String>,
}

/// A key or mouse gesture, mapped by the front end; `App` decides what it means in context.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// A bound key was pressed (see the `[keys]` config table).
    Cmd(Cmd),
    /// A bound printable key was pressed: its command while the input box is empty, else typed.
    CharOr(char, Cmd),
    /// A printable character was typed.
    Char(char),
    /// Enter was pressed.
    Submit,
    /// Backspace was pressed.
    Backspace,
    /// Delete was pressed.
    Delete,
    /// Left arrow was pressed.
    Left,
    /// Right arrow was pressed.
    Right,
    /// Home (or Ctrl-A) was pressed.
    Home,
    /// End (or Ctrl-E) was pressed.
    End,
    /// Up arrow was pressed.
    Up,
    /// Down arrow was pressed.
    Down,
    /// Ctrl-U was pressed.
    ClearInput,
    /// Page Up was pressed.
    PageUp,
    /// Page Down was pressed.
    PageDown,
    /// The mouse wheel turned over the conversation (positive: up, in lines).
    Scroll(i32),
    /// The mouse wheel turned over the budget slider (positive: up, in steps).
    BudgetWheel(i32),
    /// The mouse clicked or dragged on the budget slider at this fraction of its width.
    BudgetAt(f64),
    /// Ctrl-C was pressed.
    Interrupt,
}

/// Input to [`App::update`].
#[derive(Clone, Debug)]
pub enum Msg {
    /// The user pressed a key or used the mouse (mapped by `ui::input`).
    Action(Action),
    /// The terminal delivered a bracketed paste.
    Paste(String),
    /// The terminal was resized.
    Resize {
        /// Columns.
        width: u16,
        /// Rows.
        height: u16,
    },
    /// The driver's timer fired (about ten times a second).
    Tick(Instant),
    /// The engine worker sent an event.
    Engine(EngineEvent),
    /// The view measured the conversation after drawing it.
    Viewport {
        /// Lines above the visible ones when scrolled to the bottom.
        max_scroll: usize,
        /// Visible lines.
        page: usize,
    },
    /// The worker's channel closed without a `Stopped` event.
    WorkerGone,
}

/// Output of [`App::update`]: what the driver must do.
#[derive(Clone, Debug)]
pub enum Effect {
    /// Send a request to the worker (on submit, a slash command, a slider move, a dialog choice).
    Send(Request),
    /// Set the worker's cancel flag (on Esc or Ctrl-C while a reply is generated).
    Cancel,
    /// Put text on the clipboard with OSC 52 (on the copy key).
    Copy(String),
    /// Tell the user a long reply finished: the terminal bell and an OSC 9 notification.
    Notify(String),
    /// Set the worker's "answer now" flag: the reply's thinking channel closes at the next
    /// token and the model answers.
    AnswerNow,
    /// Shut the worker down, restore the terminal and exit with `code` (on quit).
    Quit {
        /// Exit status.
        code: i32,
    },
}

/// A reply that took at least this long (prefill and decode) rings the bell when it ends.
pub const NOTIFY_AFTER_S: f64 = 10.0;

/// Ticks a transient status message stays up.
const TOAST_TICKS: u32 = 30;
/// Cancelled turns remembered (for dropping their late events).
const CANCELLED_KEEP: usize = 64;

/// The terminal client's whole state.
#[derive(Clone, Debug)]
pub struct App {
    /// Model name.
    pub model: String,
    /// Session name (once known).
    pub session: Option<String>,
    /// Turns or settings changed since the last save or load.
    pub dirty: bool,
    /// A message typed and sent while a reply was being written: sent when that reply ends,
    /// put back in the input box if it is stopped or fails.
    pub queued: Option<String>,
    /// Chat or raw.
    pub mode: Mode,
    /// Thinking channel on for new replies.
    pub thinking: bool,
    /// Thinking effort for new replies (`low`, `high` or `max`).
    pub effort: String,
    /// Show reasoning text (otherwise one collapsed line per reply).
    pub show_thinking: bool,
    /// The live panes are hidden: the conversation takes their room.
    pub hide_panes: bool,
    /// What the conversation is doing.
    pub phase: Phase,
    /// The conversation.
    pub items: Vec<Item>,
    /// The input box.
    pub input: Editor,
    /// Sent inputs.
    pub history: History,
    /// Lines scrolled up from the bottom (0: following the newest text).
    pub scroll: usize,
    /// Largest useful `scroll`, as last measured by the view.
    pub max_scroll: usize,
    /// Visible conversation lines, as last measured by the view.
    pub page: usize,
    /// Open popup.
    pub dialog: Option<Dialog>,
    /// Lines the help popup is scrolled down.
    pub help_scroll: usize,
    /// Keyboard focus.
    pub focus: Focus,
    /// Select mode's highlight, while select mode is on.
    pub selected: Option<Target>,
    /// Engine figures.
    pub stats: StatsView,
    /// The memory-budget slider.
    pub budget: Budget,
    /// A transient message for the status bar, and the ticks it has left.
    pub toast: Option<(String, u32)>,
    /// Timer ticks seen (drives the spinner).
    pub ticks: u64,
    /// Context limit in positions.
    pub context_limit: u64,
    /// Longest reply in tokens.
    pub max_tokens: u64,
    /// Key labels.
    pub keys: KeyLabels,
    /// Colour scheme.
    pub theme: ThemeName,
    /// Terminal size in cells.
    pub size: (u16, u16),
    /// Counts visible changes; the driver redraws when it moves.
    pub revision: u64,
    next_turn: TurnId,
    pending: Vec<(TurnId, Purpose)>,
    cancelled: VecDeque<TurnId>,
    parser: Option<(TurnId, TolerantParser)>,
    resume: bool,
    budget_gb: Option<f64>,
    quit_after_save: Option<TurnId>,
    last_error: Option<String>,
    /// Disk bytes the engine had read when the live reply started (its figures at the time).
    disk_at_start: Option<u64>,
    /// Weight bytes read / to read while the model opens (from `EngineEvent::Loading`).
    pub loading: Option<(u64, u64)>,
    /// The remote engine's figures (`k3 chat --remote`), in place of the local panes.
    pub remote: Option<RemoteView>,
    /// Prompt tokens read per second by the last reply that read a prompt, measured under the
    /// budget in force (`None` before any, and again after the budget changes).
    pub prefill_rate: Option<f64>,
    /// A thinking change kept for the next new conversation (Esc in its confirmation).
    pub next_think: Option<Think>,
}

/// What the remote pane shows: the server, and the last reply's figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RemoteView {
    /// The server's base URL.
    pub server: String,
    /// Seconds to the last reply's first token.
    pub first_token_seconds: f64,
    /// Prompt tokens of the last reply the server reused from its cache.
    pub cached_tokens: usize,
    /// Prompt tokens of the last reply.
    pub prompt_tokens: usize,
}

/// The server and the model in a remote worker's `Ready` line
/// (`k3: remote URL (model "NAME"), …`).
fn remote_in(info: &str) -> Option<(String, String)> {
    let rest = info.strip_prefix("k3: remote ")?;
    let (server, rest) = rest.split_once(" (model ")?;
    let model: String = serde_json::from_str(rest.split_once("),")?.0).ok()?;
    Some((server.to_owned(), model))
}

/// `1062` → `1,062`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Rounds to three significant digits (for budgets asked in GB).
fn round_sig3(x: f64) -> f64 {
    if x <= 0.0 || !x.is_finite() {
        return 0.0;
    }
    let scale = 10f64.powi(2 - x.log10().floor() as i32);
    (x * scale).round() / scale
}

fn stop_words(stop: &Stop) -> &'static str {
    match stop {
        Stop::End(_) => "end of message",
        Stop::MaxTokens => "token limit",
        Stop::Cancelled => "stopped",
        Stop::ContextFull => "context full",
    }
}

/// Bytes in a short human form (`0 B`, `12.3 MB`, `4.56 GB`).
fn short_bytes(b: u64) -> String {
    let x = b as f64;
    if b < 1_000 {
        format!("{b} B")
    } else if b < 1_000_000 {
        format!("{:.1} KB", x / 1e3)
    } else if b < 1_000_000_000 {
        format!("{:.1} MB", x / 1e6)
    } else {
        format!("{:.2} GB", x / 1e9)
    }
}

/// One line of figures for a finished reply: what the engine did (tokens generated, speed,
/// prompt tokens reused and read, the turn's time, the weight bytes it read from disk) and
/// why it stopped. `disk_read` is `None` when the engine's figures did not say.
fn summary(r: &TurnReport, disk_read: Option<u64>) -> String {
    let n = r.generated_tokens;
    let tps = if r.decode_seconds > 0.0 {
        n as f64 / r.decode_seconds
    } else {
        0.0
    };
    let disk = disk_read.map_or(String::new(), |b| format!(" · {} read", short_bytes(b)));
    format!(
        "{} · {tps:.1} tokens/s · prompt {} reused + {} read · {:.1} s{disk} · {}",
        super::words::count(n as u64, "token"),
        r.reused_tokens,
        r.prefilled_tokens,
        r.prefill_seconds + r.decode_seconds,
        stop_words(&r.stop)
    )
}

/// The session name in the worker's `Ready` line (`session "NAME"`).
fn session_in(info: &str) -> Option<String> {
    let rest = &info[info.find("session \"")? + 9..];
    Some(rest[..rest.find('"')?].to_string())
}

impl App {
    /// A fresh model, waiting for the engine.
    #[must_use]
    pub fn new(init: AppInit) -> App {
        App {
            model: init.model,
            session: init.session,
            dirty: false,
            queued: None,
            mode: Mode::Chat,
            thinking: init.thinking,
            effort: init.effort,
            show_thinking: true,
            hide_panes: false,
            phase: Phase::Loading,
            loading: None,
            remote: None,
            items: Vec::new(),
            input: Editor::default(),
            history: {
                let mut h = History::default();
                for e in &init.history {
                    h.push(e);
                }
                h
            },
            scroll: 0,
            max_scroll: 0,
            page: 10,
            dialog: None,
            help_scroll: 0,
            focus: Focus::Input,
            selected: None,
            stats: StatsView::default(),
            budget: Budget {
                step: BUDGET_STEPS,
                ..Budget::default()
            },
            toast: None,
            ticks: 0,
            context_limit: init.context_limit,
            max_tokens: init.max_tokens,
            keys: init.keys,
            theme: init.theme,
            size: (80, 24),
            revision: 0,
            next_turn: 1,
            pending: Vec::new(),
            cancelled: VecDeque::new(),
            parser: None,
            resume: init.resume,
            budget_gb: init.budget_gb,
            quit_after_save: None,
            last_error: None,
            disk_at_start: None,
            prefill_rate: None,
            next_think: None,
        }
    }

    /// Apply one message; returns what the driver must do.
    pub fn update(&mut self, msg: Msg) -> Vec<Effect> {
        let mut fx = Vec::new();
        let visible = match msg {
            Msg::Action(a) => {
                self.action(a, &mut fx);
                true
            }
            Msg::Paste(text) => {
                self.paste(&text);
                true
            }
            Msg::Resize { width, height } => {
                self.size = (width, height);
                true
            }
            Msg::Tick(_) => self.tick(),
            Msg::Engine(ev) => self.engine(ev, &mut fx),
            Msg::Viewport { max_scroll, page } => self.viewport(max_scroll, page),
            Msg::WorkerGone => {
                self.worker_stopped(1);
                true
            }
        };
        if visible {
            self.revision += 1;
        }
        fx
    }

    /// True while a reply is being generated.
    #[must_use]
    pub fn busy(&self) -> bool {
        matches!(self.phase, Phase::Prefill { .. } | Phase::Streaming { .. })
    }

    /// The reply being generated, if any.
    #[must_use]
    pub fn live_turn(&self) -> Option<TurnId> {
        match self.phase {
            Phase::Prefill { turn, .. } | Phase::Streaming { turn, .. } => Some(turn),
            _ => None,
        }
    }

    /// While a reply streams: seconds per token (from the engine's last figure) and an upper
    /// bound on the seconds left, at that pace, before the reply reaches its token limit.
    #[must_use]
    pub fn pace(&self) -> Option<(f64, f64)> {
        let Phase::Streaming { tokens, .. } = self.phase else {
            return None;
        };
        let tps = self.stats.last.as_ref()?.tokens_per_second;
        if tokens < 2 || !tps.is_finite() || tps <= 0.0 {
            return None;
        }
        let left = self.max_tokens.saturating_sub(tokens) as f64;
        Some((1.0 / tps, left / tps))
    }

    /// Positions the conversation holds (0 before its first turn): what a thinking change
    /// re-reads.
    #[must_use]
    pub fn held_positions(&self) -> u64 {
        self.stats.last.as_ref().map_or(0, |s| s.positions)
    }

    /// What a thinking change costs before the next reply: the conversation is read again.
    #[must_use]
    pub fn think_cost(&self) -> String {
        let n = self.held_positions();
        let time = match self.prefill_rate {
            Some(rate) => {
                let s = n as f64 / rate;
                if s < 10.0 {
                    format!("about {s:.1} s at this budget")
                } else {
                    format!("about {s:.0} s at this budget")
                }
            }
            None => "time unknown until a prompt has been read under this budget".into(),
        };
        format!(
            "re-reads {} {}, {time}",
            thousands(n),
            super::words::plural(n, "token")
        )
    }

    /// The text of the newest reply.
    #[must_use]
    pub fn last_reply(&self) -> Option<&str> {
        self.items.iter().rev().find_map(|i| match i {
            Item::Reply(r) if !r.content.is_empty() => Some(r.content.as_str()),
            _ => None,
        })
    }

    fn toast(&mut self, text: impl Into<String>) {
        self.toast = Some((text.into(), TOAST_TICKS));
    }

    fn turn(&mut self, purpose: Purpose) -> TurnId {
        let t = self.next_turn;
        self.next_turn += 1;
        self.pending.push((t, purpose));
        t
    }

    fn take_pending(&mut self, turn: TurnId) -> Option<Purpose> {
        let i = self.pending.iter().position(|(t, _)| *t == turn)?;
        Some(self.pending.remove(i).1)
    }

    fn is_cancelled(&self, turn: TurnId) -> bool {
        self.cancelled.contains(&turn)
    }
}
