//! Why a session could not be loaded, saved, locked or written.

use super::format::*;
use crate::session::naming::NameError;
use std::fmt;
use std::io;
use std::path::PathBuf;

use crate::engine::config::MAX_LAYERS;
use crate::engine::sampling::{self};

/// Why a session file was refused. The file itself is never modified.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The file does not start with [`MAGIC`].
    #[error("not a k3 session file: it starts with \"{}\", expected \"{}\"{}",
        .found.escape_ascii(), MAGIC.escape_ascii(), magic_hint(.found))]
    BadMagic {
        /// The first bytes found.
        found: Vec<u8>,
    },
    /// The file ends before its declared size.
    #[error("truncated at byte {at} of {of}")]
    Truncated {
        /// Bytes present.
        at: u64,
        /// Bytes expected.
        of: u64,
    },
    /// The file is longer than its header declares.
    #[error(
        "the file has {actual} bytes but its header declares {declared}: trailing bytes refused"
    )]
    Trailing {
        /// Size in the header.
        declared: u64,
        /// Size found.
        actual: u64,
    },
    /// Written by another format version.
    #[error("written by format v{found}, this build reads v{OLDEST_VERSION} to v{FORMAT_VERSION}")]
    Version {
        /// The version in the file.
        found: u32,
    },
    /// A section's bytes do not match their checksum.
    #[error("section {section} checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    Checksum {
        /// The section.
        section: String,
        /// CRC32 in the file.
        stored: u32,
        /// CRC32 of the bytes read.
        computed: u32,
    },
    /// A length or count outside what the file or the current config allows.
    #[error("{what} is {found}, expected {expected}")]
    Length {
        /// The field.
        what: String,
        /// Its value in the file.
        found: u64,
        /// What was acceptable.
        expected: String,
    },
    /// A structural rule broken at a byte offset.
    #[error("at byte {at}: {what}")]
    Malformed {
        /// Byte offset of the offending field or section.
        at: u64,
        /// The rule and what was found.
        what: String,
    },
    /// The saved state's layer map or sizes differ from the current model config.
    #[error("the saved state does not fit the current model config: {}", .problems.join("; "))]
    Layout {
        /// Every difference found.
        problems: Vec<String>,
    },
    /// Saved with another model.
    #[error("saved with model {}, the loaded model is {}: restoring would produce fluent, wrong output",
        .file.short(), .current.short())]
    Identity {
        /// Identity in the file.
        file: Box<ModelIdentity>,
        /// Identity of the loaded model.
        current: Box<ModelIdentity>,
    },
}

impl Refusal {
    /// Whether the file is damaged or unreadable by this build, as opposed to intact but
    /// written for another model or model config.
    #[must_use]
    pub fn is_damage(&self) -> bool {
        !matches!(self, Refusal::Identity { .. } | Refusal::Layout { .. })
    }
}

pub(super) fn magic_hint(found: &[u8]) -> &'static str {
    if found.starts_with(b"K3ST") {
        " (this is a raw engine state file, not a session)"
    } else {
        ""
    }
}

/// A session could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The name is not a valid session name.
    #[error(transparent)]
    BadName(#[from] NameError),
    /// No session of that name exists.
    #[error("session {name}: not found ({path:?})")]
    NotFound {
        /// Session name.
        name: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The path is a symbolic link, a directory or another non-regular file.
    #[error("session {name}: {path:?} is {what}; refusing to read it")]
    NotRegular {
        /// Session name.
        name: String,
        /// The path.
        path: PathBuf,
        /// What was found.
        what: &'static str,
    },
    /// Reading failed.
    #[error("session {name}: read failed: {source}")]
    Io {
        /// Session name.
        name: String,
        /// OS error.
        source: io::Error,
    },
    /// The state fits the config but memory for it could not be reserved.
    #[error("session {name}: cannot allocate {bytes} bytes to restore the state")]
    OutOfMemory {
        /// Session name.
        name: String,
        /// Bytes requested.
        bytes: u64,
    },
    /// The file was refused before its conversation text could be verified.
    #[error("session {name}: {reason}; the file was left untouched")]
    Refused {
        /// Session name.
        name: String,
        /// Why.
        reason: Box<Refusal>,
    },
    /// The saved state was refused, but the conversation text verified and is returned so that
    /// the caller can offer a re-prefill.
    #[error(
        "saved state refused: {reason}; the file was left untouched, and its conversation \
             text verified and can be re-prefilled instead"
    )]
    StateRefused {
        /// Why.
        reason: Box<Refusal>,
        /// The verified conversation JSON.
        transcript_json: Vec<u8>,
    },
}

impl LoadError {
    /// Exit status: 2 for a bad or unknown name, 3 for a refused file, 1 for I/O and memory.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            LoadError::BadName(_) | LoadError::NotFound { .. } => 2,
            LoadError::NotRegular { .. }
            | LoadError::Refused { .. }
            | LoadError::StateRefused { .. } => 3,
            LoadError::Io { .. } | LoadError::OutOfMemory { .. } => 1,
        }
    }

    /// The validation rule that refused the file, if that is what happened.
    #[must_use]
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            LoadError::Refused { reason, .. } | LoadError::StateRefused { reason, .. } => {
                Some(reason)
            }
            _ => None,
        }
    }

    /// The verified conversation JSON, when the state was refused but the history was not.
    #[must_use]
    pub fn transcript_json(&self) -> Option<&[u8]> {
        match self {
            LoadError::StateRefused {
                transcript_json, ..
            } => Some(transcript_json),
            _ => None,
        }
    }
}

/// A record that cannot be written because it is inconsistent (so it could not be read back).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RecordError {
    /// The record's name is not valid.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The summary mode is longer than [`MAX_MODE_LEN`].
    #[error("summary mode is {len} bytes; at most {MAX_MODE_LEN} are allowed")]
    ModeTooLong {
        /// Its length.
        len: usize,
    },
    /// The summary mode holds a control character.
    #[error("summary mode holds a control character")]
    ModeNotPrintable,
    /// The transcript or settings text is not UTF-8.
    #[error("{what} is not UTF-8 (invalid byte at {at})")]
    NotUtf8 {
        /// Which text.
        what: &'static str,
        /// First invalid byte.
        at: usize,
    },
    /// The sampler settings are out of range.
    #[error("sampler settings: {0}")]
    Sampler(sampling::ConfigError),
    /// The generator word is 0 (xorshift cannot resume from 0).
    #[error("rng state is 0")]
    ZeroRngState,
    /// The token count differs from the state's positions.
    #[error("{tokens} token ids for a state of {n_pos} positions")]
    TokensMismatch {
        /// Token ids held.
        tokens: usize,
        /// Positions in the state.
        n_pos: usize,
    },
    /// More layers than any config allows.
    #[error("{n} layers; at most {MAX_LAYERS} are allowed")]
    TooManyLayers {
        /// Layer count.
        n: usize,
    },
    /// An MLA cache that is not `n_pos` whole rows.
    #[error("layer {layer}: MLA cache of {floats} floats is not {n_pos} whole rows")]
    MlaRows {
        /// Layer index.
        layer: usize,
        /// Floats held.
        floats: usize,
        /// Positions in the state.
        n_pos: usize,
    },
    /// More snapshots than a file may hold.
    #[error("{n} snapshots; at most {MAX_SNAPSHOTS} are allowed")]
    TooManySnapshots {
        /// Snapshot count.
        n: usize,
    },
    /// A snapshot that does not fit the live state's layout.
    #[error("snapshot {index}: {what}")]
    Snapshot {
        /// Its index, oldest first.
        index: usize,
        /// What does not fit.
        what: String,
    },
    /// The file size would overflow a u64.
    #[error("the record is too large to encode")]
    TooLarge,
}

/// A streaming write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The record is inconsistent.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The writer failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The step of a save that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStep {
    /// Creating the session directory.
    CreateDir,
    /// Taking the session lock.
    Lock,
    /// Creating the temporary file.
    CreateTemp,
    /// Writing the temporary file.
    Write,
    /// Flushing the temporary file to disk.
    SyncFile,
    /// Renaming the temporary file over the session file.
    Rename,
    /// Flushing the directory entry to disk.
    SyncDir,
}

impl fmt::Display for SaveStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SaveStep::CreateDir => "creating the session directory",
            SaveStep::Lock => "taking the session lock",
            SaveStep::CreateTemp => "creating the temporary file",
            SaveStep::Write => "writing",
            SaveStep::SyncFile => "fsync of the temporary file",
            SaveStep::Rename => "renaming into place",
            SaveStep::SyncDir => "fsync of the session directory",
        })
    }
}

/// A session could not be saved. Unless `replaced` is set, the previous file is intact.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The name is not a valid session name.
    #[error(transparent)]
    BadName(#[from] NameError),
    /// The record is inconsistent; nothing was written.
    #[error("session {name} NOT saved: {problem}; the previous file is unchanged")]
    Record {
        /// Session name.
        name: String,
        /// What is wrong.
        problem: RecordError,
    },
    /// Another writer holds the session's lock; nothing was written.
    #[error(
        "session {name} NOT saved: session in use by {holder}; the previous file is unchanged"
    )]
    InUse {
        /// Session name.
        name: String,
        /// Who holds it, as recorded in the lock file.
        holder: String,
    },
    /// A file operation failed.
    #[error("session {name} NOT saved: {step} failed: {}; {}", io_cause(.source, *.need),
        aftermath(*.replaced))]
    Io {
        /// Session name.
        name: String,
        /// The failing step.
        step: SaveStep,
        /// Bytes the file needs.
        need: u64,
        /// Whether the rename had already replaced the previous file.
        replaced: bool,
        /// OS error.
        source: io::Error,
    },
}

/// The lock on a session could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The name is not a valid session name.
    #[error(transparent)]
    BadName(#[from] NameError),
    /// Another process has the session open.
    #[error(
        "session {name:?} is in use by {holder}: another k3 has it open, and two processes on \
         one session would overwrite each other's turns; leave it there first"
    )]
    InUse {
        /// Session name.
        name: String,
        /// Who holds it, as recorded in the lock file.
        holder: String,
    },
    /// Creating the directory or the lock file, or locking it, failed.
    #[error("session {name:?}: {step} failed: {source}")]
    Io {
        /// Session name.
        name: String,
        /// [`SaveStep::CreateDir`] or [`SaveStep::Lock`].
        step: SaveStep,
        /// OS error.
        source: io::Error,
    },
}

impl LockError {
    /// Exit status: 2 for a bad name or a session in use (refused before any work), 1 for I/O.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            LockError::BadName(_) | LockError::InUse { .. } => 2,
            LockError::Io { .. } => 1,
        }
    }

    /// The same failure as a save error (the session was not saved).
    #[must_use]
    pub fn into_save_error(self) -> SaveError {
        match self {
            LockError::BadName(e) => SaveError::BadName(e),
            LockError::InUse { name, holder } => SaveError::InUse { name, holder },
            LockError::Io { name, step, source } => SaveError::Io {
                name,
                step,
                need: 0,
                replaced: false,
                source,
            },
        }
    }
}

pub(super) fn io_cause(e: &io::Error, need: u64) -> String {
    let need = if need > 0 {
        format!(" (need {need} bytes)")
    } else {
        String::new()
    };
    match e.kind() {
        io::ErrorKind::StorageFull => format!("disk full{need}: {e}"),
        io::ErrorKind::QuotaExceeded => format!("disk quota exceeded{need}: {e}"),
        io::ErrorKind::FileTooLarge => format!("file too large{need}: {e}"),
        _ => e.to_string(),
    }
}

pub(super) fn aftermath(replaced: bool) -> &'static str {
    if replaced {
        "the new file is in place but may not survive a power loss"
    } else {
        "the previous session file is intact"
    }
}

impl SaveError {
    /// Exit status: 2 for a bad name, otherwise 5 (the answer stands, the session is not saved).
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            SaveError::BadName(_) => 2,
            _ => 5,
        }
    }
}
