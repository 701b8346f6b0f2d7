//! The only types that cross the thread boundary between a front end (TUI or REPL) and the
//! engine worker: requests in, events out. Every event names the turn it belongs to, so a front
//! end can drop events from a turn it has already cancelled.

use crate::session::chat::TurnReport;
use crate::session::commands::Command;
use crate::stream::stats::StatsSnapshot;

/// Identifies one request/turn; assigned by the front end, increasing.
pub type TurnId = u64;

/// Front end → worker.
#[derive(Clone, Debug)]
pub enum Request {
    /// Send text: a user message (chat mode) or text to continue (raw mode).
    Send {
        /// Turn id for the events it produces.
        turn: TurnId,
        /// The text.
        text: String,
    },
    /// Run a slash command.
    Command {
        /// Turn id for the events it produces.
        turn: TurnId,
        /// The parsed command.
        command: Command,
    },
    /// Stop the worker.
    Shutdown,
}

/// Worker → front end.
#[derive(Clone, Debug)]
pub enum EngineEvent {
    /// Weights are being read while the model opens.
    Loading {
        /// Bytes read so far.
        done: u64,
        /// Bytes the load reads in all.
        total: u64,
    },
    /// The model is loaded and the session ready; `info` describes it.
    Ready {
        /// One line: model, layers, vocabulary, session name.
        info: String,
    },
    /// A generating turn starts: how its tokens are to be read (raw continuation, or a chat
    /// completion starting in the thinking channel or in the answer).
    TurnStarted {
        /// Turn.
        turn: TurnId,
        /// Raw mode.
        raw: bool,
        /// The completion starts inside the thinking channel.
        thinking: bool,
    },
    /// Text of one generated token (may be empty while a UTF-8 sequence is incomplete).
    Token {
        /// Turn.
        turn: TurnId,
        /// The token id.
        id: u32,
        /// Printable text.
        text: String,
    },
    /// A turn finished (possibly cancelled or rejected; see the report).
    TurnDone {
        /// Turn.
        turn: TurnId,
        /// What happened.
        report: Box<TurnReport>,
    },
    /// Engine figures, sent a few times a second while a turn runs and once when it ends.
    Stats {
        /// Turn (0 outside a turn).
        turn: TurnId,
        /// The figures.
        stats: Box<StatsSnapshot>,
    },
    /// A command's answer, as text.
    Notice {
        /// Turn.
        turn: TurnId,
        /// The text (one or more lines).
        text: String,
    },
    /// A request failed; the session is still usable.
    Failed {
        /// Turn.
        turn: TurnId,
        /// What went wrong.
        message: String,
    },
    /// The worker stopped (after `/quit`, `Shutdown`, or a fatal error).
    Stopped {
        /// Exit status the process should use.
        exit_code: i32,
    },
}
