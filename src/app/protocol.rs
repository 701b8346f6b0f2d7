//! The only types that cross the thread boundary between a front end (TUI or REPL) and the
//! engine worker: requests in, events out. Every event names the turn it belongs to, so a front
//! end can drop events from a turn it has already cancelled.

use crate::session::chat::{Entry, Mode, TurnReport};
use crate::session::commands::Command;
/// The engine's figures as the front ends receive them (`EngineEvent::Stats`).
pub use crate::stream::stats::{rss_bytes, LayerResidency, Residency, StatsSnapshot};

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
    /// Send the conversation as it stands ([`EngineEvent::History`]): a front end shows a
    /// resumed or loaded session with it.
    History {
        /// Turn id of the answer.
        turn: TurnId,
    },
    /// List the saved sessions ([`EngineEvent::Sessions`], or `Failed` when the session
    /// directory cannot be read). Answered between tokens too.
    ListSessions {
        /// Turn id of the answer.
        turn: TurnId,
    },
    /// Rename a saved session (answered with `Notice` or `Failed`; between tokens too). A name
    /// that `/save` would refuse is refused, as are a name taken and the session this process
    /// has open.
    RenameSession {
        /// Turn id of the answer.
        turn: TurnId,
        /// The session's name.
        from: String,
        /// Its new name.
        to: String,
    },
    /// Delete a saved session and its journal (answered with `Notice` or `Failed`; between
    /// tokens too). The session this process has open, or another process has, is refused.
    DeleteSession {
        /// Turn id of the answer.
        turn: TurnId,
        /// The session's name.
        name: String,
    },
    /// Stop the worker.
    Shutdown,
}

/// The conversation as the session holds it, for display.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryView {
    /// The session's name, once it has one.
    pub name: Option<String>,
    /// System message.
    pub system: Option<String>,
    /// Chat or raw.
    pub mode: Mode,
    /// The transcript, oldest first.
    pub entries: Vec<Entry>,
    /// It holds changes that are not saved (turns recovered from a journal, or made since the
    /// last save): the client marks it unsaved and asks before quitting.
    pub unsaved: bool,
}

/// One session, saved or journaled only, as listed by the worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionRow {
    /// Name.
    pub name: String,
    /// When it was saved (Unix seconds).
    pub saved_unix: u64,
    /// When it was saved, as a local date and time.
    pub saved: String,
    /// Completed turns.
    pub turns: u32,
    /// File size in bytes.
    pub bytes: u64,
    /// Why the file could not be read, if so.
    pub problem: Option<String>,
    /// It has changes that are not saved, kept in its journal: all of it when it was never
    /// saved (then `saved_unix` is when the journal was last written, and `saved` says so).
    pub unsaved: bool,
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
        /// The most tokens this reply may have (the chat or the raw-mode limit in force).
        max_tokens: u64,
    },
    /// Text of one generated token (may be empty while a UTF-8 sequence is incomplete).
    Token {
        /// Turn.
        turn: TurnId,
        /// The token id.
        id: u32,
        /// Printable text.
        text: String,
        /// Positions the conversation holds with this token (0: not known).
        position: u64,
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
    /// The conversation (answer to [`Request::History`]).
    History {
        /// Turn.
        turn: TurnId,
        /// What the session holds.
        history: Box<HistoryView>,
    },
    /// The saved sessions, newest first (answer to [`Request::ListSessions`]).
    Sessions {
        /// Turn.
        turn: TurnId,
        /// One row per session file.
        rows: Vec<SessionRow>,
    },
    /// The conversation has a name now: its first turn named it (a new conversation is
    /// journaled under its first words and the date from then on). Front ends show it and
    /// offer it as the name to save under.
    Named {
        /// The conversation's name.
        name: String,
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
