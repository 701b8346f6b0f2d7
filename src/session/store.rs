//! Saved sessions: one conversation's history text, render settings, token ids, carried engine
//! state, sampler settings and generator word, in a versioned and checksummed file, plus the
//! directory store that writes those files atomically under an advisory lock (RELIABILITY §3.5,
//! RUNTIME §4.6).
//!
//! # File format, version 2
//!
//! Integers and floats are little-endian; there is no padding.
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `89 4B 33 53 45 53 53 0A` (`\x89K3SESS\n`) |
//! | 8 | 4 | format version (2; 1 is still read) |
//! | 12 | 4 | flags (0) |
//! | 16 | 8 | total file size in bytes |
//! | 24 | 8 | section count (8 + layers + snapshots; v1: 7 + layers) |
//! | 32 | 8 | `n_pos`, positions the state covers |
//! | 40 | 8 | layers |
//! | 48 | 8 | bytes each further position adds (0 when `n_pos` is 0) |
//! | 56 | 8 | created, Unix seconds |
//! | 64 | 8 | saved, Unix seconds |
//! | 72 | 4 | CRC32 of bytes 0..72 |
//!
//! Then the sections, in this order, each `tag[4] · index u32 · length u64 · payload · CRC32`
//! where the CRC covers the 16-byte section header and the payload:
//!
//! | tag | index | payload |
//! |---|---|---|
//! | `IDEN` | 0 | 32-byte model identity (SHA-256) |
//! | `SUMM` | 0 | turns u32, name length u32, name, mode length u32, mode |
//! | `TRAN` | 0 | conversation JSON text (UTF-8), readable on its own |
//! | `SETT` | 0 | settings JSON text (UTF-8) |
//! | `TOKS` | 0 | `n_pos` token ids, u32 each |
//! | `SAMP` | 0 | temperature f32, top_k u64, top_p f32, min_p f32, repeat_penalty f32, seed u64, rng state u64 |
//! | `STAT` | 0 | per layer 40 bytes: kind u32 (0 KDA, 1 MLA latent), 0 u32, four u64 float counts (KDA: S, conv q, conv k, conv v; MLA: rows, floats, 0, 0) |
//! | `LAYR` | layer | KDA: S then the three conv windows; MLA: the `n_pos` occupied latent rows; f32 each |
//! | `SNAP` | 0 | snapshot count u32, 0 u32, then per snapshot: positions u64, shared u64, logits u64 |
//! | `SNPS` | snapshot | the ids after the shared ones u32 each, the logits f32 each, then per layer: KDA: S and the three conv windows; MLA: the latent rows after the shared ones; f32 each |
//!
//! The live state (`TOKS`, `LAYR`) is what the conversation's next turn continues; the snapshots
//! (at most [`MAX_SNAPSHOTS`], oldest first) are the states a chat keeps at the end of its recent
//! prompts and histories, so that a regenerate, an undo, an edit or a reply cut off costs after
//! a resume what it costs without one. A snapshot's first `shared` ids are the live state's, and
//! so are its first `shared` latent rows in every MLA layer (bit for bit; the writer checks), so
//! they are not stored twice: a snapshot costs its KDA state, its logits and its rows past the
//! shared prefix. Version 1 files are version 2 without the `SNAP` and `SNPS` sections (no
//! snapshots).
//!
//! Every length is a u64 and is checked, with checked arithmetic, against the size the *current*
//! config implies before anything is allocated; the header's total must equal the file's size and
//! trailing bytes are refused. Loading streams through a fixed 64 KiB buffer.

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::engine::config::{ModelConfig, MAX_LAYERS};
use crate::engine::kda::KdaState;
use crate::engine::layer::{kda_params, mla_params};
use crate::engine::sampling::{self, SamplerConfig};
use crate::engine::state::{LayerState, SeqState, Snapshot};

/// First eight bytes of every session file.
pub const MAGIC: [u8; 8] = *b"\x89K3SESS\n";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest format version this build reads (version 1: no snapshots).
pub const OLDEST_VERSION: u32 = 1;
/// Most snapshots a file may hold: those a chat keeps, which the engine's plan reserves room
/// for.
pub const MAX_SNAPSHOTS: usize = super::chat::SNAPSHOTS;
/// Size of the fixed file header.
pub const HEADER_LEN: u64 = 76;
/// File-name extension of session files inside the store.
pub const EXTENSION: &str = "k3session";
/// Environment variable that replaces the per-user data directory.
pub const DATA_DIR_ENV: &str = "K3_DATA_DIR";
/// Longest session name, in bytes.
pub const MAX_NAME_LEN: usize = 64;
/// Longest summary mode string, in bytes.
pub const MAX_MODE_LEN: usize = 256;

const SECTION_HEAD: u64 = 16;
const SECTION_CRC: u64 = 4;
const IDENTITY_LEN: u64 = 32;
const SAMPLER_LEN: u64 = 40;
const LAYER_DESC_LEN: u64 = 40;
const SUMMARY_MIN: u64 = 12;
const SUMMARY_MAX: u64 = SUMMARY_MIN + MAX_NAME_LEN as u64 + MAX_MODE_LEN as u64;
const FIXED_SECTIONS: u64 = 7;
const SNAP_DIR_HEAD: u64 = 8;
const SNAP_DESC_LEN: u64 = 24;
const IO_CHUNK: usize = 64 * 1024;
const KIND_KDA: u32 = 0;
const KIND_MLA: u32 = 1;

// ---------------------------------------------------------------------------------------------
// Identity and record
// ---------------------------------------------------------------------------------------------

/// What a session's state was computed with: a SHA-256 over the model's config, tokenizer files
/// and checkpoint index. Two checkpoints of the same shape but different weights differ here.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelIdentity {
    /// The digest.
    pub hash: [u8; 32],
}

impl ModelIdentity {
    /// Hashes the parts, each prefixed by its length so that no two splits collide.
    #[must_use]
    pub fn compute(config_json: &[u8], tokenizer_files: &[&[u8]], index_digest: &[u8]) -> Self {
        fn part(h: &mut Sha256, bytes: &[u8]) {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        let mut h = Sha256::new();
        h.update(b"k3 model identity v1\0");
        part(&mut h, config_json);
        h.update((tokenizer_files.len() as u64).to_le_bytes());
        for f in tokenizer_files {
            part(&mut h, f);
        }
        part(&mut h, index_digest);
        ModelIdentity {
            hash: h.finalize().into(),
        }
    }

    /// The first six bytes in hex, for messages.
    #[must_use]
    pub fn short(&self) -> String {
        hex(&self.hash[..6])
    }

    /// The whole digest in hex.
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex(&self.hash)
    }
}

impl fmt::Debug for ModelIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelIdentity({})", self.to_hex())
    }
}

impl fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What `list` shows without reading the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Completed user turns.
    pub turns: u32,
    /// Interaction mode (for example `chat` or `raw`), at most [`MAX_MODE_LEN`] bytes.
    pub mode: String,
}

/// Everything a saved session holds.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionRecord {
    /// Session name (also the file name inside the store).
    pub name: String,
    /// When the session was first saved, Unix seconds.
    pub created_unix: u64,
    /// When this version was saved, Unix seconds.
    pub saved_unix: u64,
    /// The model the state was computed with.
    pub identity: ModelIdentity,
    /// Turn count and mode.
    pub summary: Summary,
    /// The conversation as JSON text (UTF-8), kept readable on its own.
    pub transcript_json: Vec<u8>,
    /// Render and client settings as JSON text (UTF-8).
    pub settings_json: Vec<u8>,
    /// The ids whose effect is in `state`; exactly `state.n_pos` of them.
    pub tokens: Vec<u32>,
    /// Carried engine state.
    pub state: SeqState,
    /// The snapshots held beside the live state, oldest first (at most [`MAX_SNAPSHOTS`]).
    pub snapshots: Vec<Snapshot>,
    /// Sampler settings.
    pub sampler: SamplerConfig,
    /// Generator word to resume the sampled stream (non-zero).
    pub rng_state: u64,
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A session name that cannot be used as a file name inside the store.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name is empty.
    #[error("session name is empty")]
    Empty,
    /// The name is longer than [`MAX_NAME_LEN`] bytes.
    #[error("session name {name:?}… is {len} bytes; at most {MAX_NAME_LEN} are allowed")]
    TooLong {
        /// The first characters of the name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A character outside `A-Z a-z 0-9 . _ -`.
    #[error("session name {name:?}: {ch:?} at byte {at} is not allowed (use A-Z a-z 0-9 . _ -)")]
    BadChar {
        /// The name.
        name: String,
        /// The character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
    /// The name starts with a dot (reserved for temporary and lock files).
    #[error("session name {name:?} starts with '.'")]
    LeadingDot {
        /// The name.
        name: String,
    },
    /// The name contains `..`.
    #[error("session name {name:?} contains \"..\"")]
    DotDot {
        /// The name.
        name: String,
    },
}

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

fn magic_hint(found: &[u8]) -> &'static str {
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

fn io_cause(e: &io::Error, need: u64) -> String {
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

fn aftermath(replaced: bool) -> &'static str {
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

// ---------------------------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------------------------

/// Checks `name` against `[A-Za-z0-9._-]{1,64}`, not starting with `.`, without `..`.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            name: name.chars().take(MAX_NAME_LEN).collect(),
            len: name.len(),
        });
    }
    if let Some((at, ch)) = name
        .char_indices()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar {
            name: name.to_string(),
            ch,
            at,
        });
    }
    if name.starts_with('.') {
        return Err(NameError::LeadingDot {
            name: name.to_string(),
        });
    }
    if name.contains("..") {
        return Err(NameError::DotDot {
            name: name.to_string(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sect {
    Identity,
    Summary,
    Transcript,
    Settings,
    Tokens,
    Sampler,
    State,
    Layer,
    SnapDir,
    Snap,
}

impl Sect {
    fn tag(self) -> [u8; 4] {
        match self {
            Sect::Identity => *b"IDEN",
            Sect::Summary => *b"SUMM",
            Sect::Transcript => *b"TRAN",
            Sect::Settings => *b"SETT",
            Sect::Tokens => *b"TOKS",
            Sect::Sampler => *b"SAMP",
            Sect::State => *b"STAT",
            Sect::Layer => *b"LAYR",
            Sect::SnapDir => *b"SNAP",
            Sect::Snap => *b"SNPS",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Sect::Identity => "identity",
            Sect::Summary => "summary",
            Sect::Transcript => "transcript",
            Sect::Settings => "settings",
            Sect::Tokens => "tokens",
            Sect::Sampler => "sampler",
            Sect::State => "state layout",
            Sect::Layer => "layer",
            Sect::SnapDir => "snapshot directory",
            Sect::Snap => "snapshot",
        }
    }
}

/// Float counts of one layer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerDesc {
    Kda { s: u64, conv: [u64; 3] },
    Mla { rows: u64, floats: u64 },
}

impl LayerDesc {
    fn kind(self) -> &'static str {
        match self {
            LayerDesc::Kda { .. } => "KDA",
            LayerDesc::Mla { .. } => "MLA",
        }
    }

    fn floats(self) -> Option<u64> {
        match self {
            LayerDesc::Kda { s, conv } => s
                .checked_add(conv[0])?
                .checked_add(conv[1])?
                .checked_add(conv[2]),
            LayerDesc::Mla { floats, .. } => Some(floats),
        }
    }

    fn bytes(self) -> Option<u64> {
        self.floats()?.checked_mul(4)
    }

    fn encode(self) -> [u8; LAYER_DESC_LEN as usize] {
        let (kind, v) = match self {
            LayerDesc::Kda { s, conv } => (KIND_KDA, [s, conv[0], conv[1], conv[2]]),
            LayerDesc::Mla { rows, floats } => (KIND_MLA, [rows, floats, 0, 0]),
        };
        let mut b = [0u8; LAYER_DESC_LEN as usize];
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        for (i, x) in v.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    fn parse(b: &[u8]) -> Result<Self, String> {
        let mut c = Cursor::new(b);
        let (Some(kind), Some(reserved), Some(a), Some(bb), Some(cc), Some(d)) =
            (c.u32(), c.u32(), c.u64(), c.u64(), c.u64(), c.u64())
        else {
            return Err("short layer descriptor".into());
        };
        if reserved != 0 {
            return Err(format!("reserved field is {reserved}, expected 0"));
        }
        match kind {
            KIND_KDA => Ok(LayerDesc::Kda {
                s: a,
                conv: [bb, cc, d],
            }),
            KIND_MLA if cc == 0 && d == 0 => Ok(LayerDesc::Mla {
                rows: a,
                floats: bb,
            }),
            KIND_MLA => Err("unused MLA descriptor fields are not 0".into()),
            k => Err(format!(
                "unknown layer kind {k} (0 KDA, 1 MLA latent cache)"
            )),
        }
    }
}

/// Sizes of a record about to be written.
struct Plan {
    n_pos: u64,
    layers: Vec<LayerDesc>,
    bpp: u64,
    summary_len: u64,
    snaps: Vec<SnapPlan>,
    total: u64,
}

/// One snapshot as it is written: its positions, those it shares with the live state, its
/// logits, the MLA width of each layer (0 for KDA) and its section's length.
struct SnapPlan {
    positions: u64,
    shared: u64,
    logits: u64,
    widths: Vec<usize>,
    len: u64,
}

/// Leading positions of `snap` whose ids and MLA rows equal the live state's, bit for bit.
fn shared_prefix(rec: &SessionRecord, snap: &Snapshot, widths: &[usize]) -> usize {
    let mut n = snap
        .tokens
        .iter()
        .zip(&rec.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    for ((a, b), &w) in snap.state.layers.iter().zip(&rec.state.layers).zip(widths) {
        if let (LayerState::Mla(a), LayerState::Mla(b)) = (a, b) {
            if w == 0 {
                continue;
            }
            let same = a
                .iter()
                .zip(b)
                .take(n * w)
                .take_while(|(x, y)| x.to_bits() == y.to_bits())
                .count();
            n = n.min(same / w);
        }
    }
    n
}

fn plan_snapshot(
    rec: &SessionRecord,
    index: usize,
    snap: &Snapshot,
) -> Result<SnapPlan, RecordError> {
    let bad = |what: String| RecordError::Snapshot { index, what };
    let positions = snap.state.n_pos;
    if positions == 0 || snap.tokens.len() != positions {
        return Err(bad(format!(
            "{} token ids for a state of {positions} positions (at least 1)",
            snap.tokens.len()
        )));
    }
    if snap.state.layers.len() != rec.state.layers.len() {
        return Err(bad(format!(
            "{} layers, the live state has {}",
            snap.state.layers.len(),
            rec.state.layers.len()
        )));
    }
    let mut widths = Vec::with_capacity(snap.state.layers.len());
    let mut floats: u64 = 0;
    let mut row_floats: u64 = 0;
    for (layer, (a, b)) in snap.state.layers.iter().zip(&rec.state.layers).enumerate() {
        match (a, b) {
            (LayerState::Kda(k), LayerState::Kda(l)) => {
                if k.s.len() != l.s.len() || (0..3).any(|j| k.conv[j].len() != l.conv[j].len()) {
                    return Err(bad(format!(
                        "layer {layer}: KDA sizes differ from the live state's"
                    )));
                }
                widths.push(0);
                let n = k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>();
                floats = floats.checked_add(n as u64).ok_or(RecordError::TooLarge)?;
            }
            (LayerState::Mla(c), LayerState::Mla(l)) => {
                let w = c.len() / positions;
                let live_w = l.len().checked_div(rec.state.n_pos).unwrap_or(w);
                if c.len() % positions != 0 || w != live_w {
                    return Err(bad(format!(
                        "layer {layer}: MLA cache of {} floats is not {positions} rows of {live_w}",
                        c.len()
                    )));
                }
                widths.push(w);
                row_floats = row_floats
                    .checked_add(w as u64)
                    .ok_or(RecordError::TooLarge)?;
            }
            _ => return Err(bad(format!("layer {layer}: a different layer kind"))),
        }
    }
    let shared = shared_prefix(rec, snap, &widths) as u64;
    let tail = positions as u64 - shared;
    let logits = snap.logits.len() as u64;
    let len = row_floats
        .checked_add(1)
        .and_then(|f| f.checked_mul(tail))
        .and_then(|f| f.checked_add(floats))
        .and_then(|f| f.checked_add(logits))
        .and_then(|f| f.checked_mul(4))
        .ok_or(RecordError::TooLarge)?;
    Ok(SnapPlan {
        positions: positions as u64,
        shared,
        logits,
        widths,
        len,
    })
}

fn section_size(len: u64) -> Option<u64> {
    SECTION_HEAD.checked_add(len)?.checked_add(SECTION_CRC)
}

fn plan_record(rec: &SessionRecord) -> Result<Plan, RecordError> {
    validate_name(&rec.name)?;
    if rec.summary.mode.len() > MAX_MODE_LEN {
        return Err(RecordError::ModeTooLong {
            len: rec.summary.mode.len(),
        });
    }
    if rec.summary.mode.chars().any(char::is_control) {
        return Err(RecordError::ModeNotPrintable);
    }
    for (what, text) in [
        ("transcript", &rec.transcript_json),
        ("settings", &rec.settings_json),
    ] {
        if let Err(e) = std::str::from_utf8(text) {
            return Err(RecordError::NotUtf8 {
                what,
                at: e.valid_up_to(),
            });
        }
    }
    rec.sampler.validate().map_err(RecordError::Sampler)?;
    if rec.rng_state == 0 {
        return Err(RecordError::ZeroRngState);
    }
    let n_pos = rec.state.n_pos;
    if rec.tokens.len() != n_pos {
        return Err(RecordError::TokensMismatch {
            tokens: rec.tokens.len(),
            n_pos,
        });
    }
    if rec.state.layers.len() > MAX_LAYERS {
        return Err(RecordError::TooManyLayers {
            n: rec.state.layers.len(),
        });
    }
    let mut layers = Vec::with_capacity(rec.state.layers.len());
    let mut row_floats: u64 = 0;
    for (layer, l) in rec.state.layers.iter().enumerate() {
        layers.push(match l {
            LayerState::Kda(k) => LayerDesc::Kda {
                s: k.s.len() as u64,
                conv: [
                    k.conv[0].len() as u64,
                    k.conv[1].len() as u64,
                    k.conv[2].len() as u64,
                ],
            },
            LayerState::Mla(c) => {
                let whole = if n_pos == 0 {
                    c.is_empty()
                } else {
                    c.len() % n_pos == 0
                };
                if !whole {
                    return Err(RecordError::MlaRows {
                        layer,
                        floats: c.len(),
                        n_pos,
                    });
                }
                if let Some(width) = c.len().checked_div(n_pos) {
                    row_floats = row_floats
                        .checked_add(width as u64)
                        .ok_or(RecordError::TooLarge)?;
                }
                LayerDesc::Mla {
                    rows: n_pos as u64,
                    floats: c.len() as u64,
                }
            }
        });
    }
    let n_pos = n_pos as u64;
    let bpp = if n_pos == 0 {
        0
    } else {
        row_floats
            .checked_add(1)
            .and_then(|f| f.checked_mul(4))
            .ok_or(RecordError::TooLarge)?
    };
    let summary_len = SUMMARY_MIN + rec.name.len() as u64 + rec.summary.mode.len() as u64;
    let mut lens = vec![
        IDENTITY_LEN,
        summary_len,
        rec.transcript_json.len() as u64,
        rec.settings_json.len() as u64,
        n_pos.checked_mul(4).ok_or(RecordError::TooLarge)?,
        SAMPLER_LEN,
        LAYER_DESC_LEN * layers.len() as u64,
    ];
    for d in &layers {
        lens.push(d.bytes().ok_or(RecordError::TooLarge)?);
    }
    if rec.snapshots.len() > MAX_SNAPSHOTS {
        return Err(RecordError::TooManySnapshots {
            n: rec.snapshots.len(),
        });
    }
    let snaps = rec
        .snapshots
        .iter()
        .enumerate()
        .map(|(i, sn)| plan_snapshot(rec, i, sn))
        .collect::<Result<Vec<_>, _>>()?;
    lens.push(SNAP_DIR_HEAD + SNAP_DESC_LEN * snaps.len() as u64);
    lens.extend(snaps.iter().map(|p| p.len));
    let total = lens.iter().try_fold(HEADER_LEN, |acc, &l| {
        section_size(l).and_then(|s| acc.checked_add(s))
    });
    Ok(Plan {
        n_pos,
        layers,
        bpp,
        summary_len,
        snaps,
        total: total.ok_or(RecordError::TooLarge)?,
    })
}

/// The fixed header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    version: u32,
    total: u64,
    sections: u64,
    n_pos: u64,
    n_layers: u64,
    bpp: u64,
    created: u64,
    saved: u64,
}

fn header_bytes(h: &Header) -> [u8; HEADER_LEN as usize] {
    let mut b = [0u8; HEADER_LEN as usize];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&h.version.to_le_bytes());
    // 12..16: flags, zero.
    let fields = [
        h.total, h.sections, h.n_pos, h.n_layers, h.bpp, h.created, h.saved,
    ];
    for (i, x) in fields.iter().enumerate() {
        b[16 + 8 * i..24 + 8 * i].copy_from_slice(&x.to_le_bytes());
    }
    let crc = crc32fast::hash(&b[..72]);
    b[72..76].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Bounds-checked little-endian reads over a byte slice.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(b: &'a [u8]) -> Self {
        Cursor { b, at: 0 }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    fn f32(&mut self) -> Option<f32> {
        self.u32().map(f32::from_bits)
    }

    fn done(&self) -> bool {
        self.at == self.b.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// Buffered section writer: keeps the running CRC and the bytes left in the open section.
struct Out<'w, W: Write + ?Sized> {
    w: &'w mut W,
    buf: Vec<u8>,
    crc: crc32fast::Hasher,
    left: u64,
    count: u64,
}

fn internal(what: &str) -> io::Error {
    io::Error::other(format!("internal session encoder error: {what}"))
}

impl<'w, W: Write + ?Sized> Out<'w, W> {
    fn new(w: &'w mut W) -> Self {
        Out {
            w,
            buf: Vec::with_capacity(IO_CHUNK + 64),
            crc: crc32fast::Hasher::new(),
            left: 0,
            count: 0,
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.w.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    fn raw(&mut self, b: &[u8]) -> io::Result<()> {
        self.buf.extend_from_slice(b);
        self.count += b.len() as u64;
        if self.buf.len() >= IO_CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    fn take_left(&mut self, n: usize) -> io::Result<()> {
        self.left = self
            .left
            .checked_sub(n as u64)
            .ok_or_else(|| internal("section overrun"))?;
        Ok(())
    }

    fn begin(&mut self, s: Sect, index: u32, len: u64) -> io::Result<()> {
        let mut h = [0u8; SECTION_HEAD as usize];
        h[0..4].copy_from_slice(&s.tag());
        h[4..8].copy_from_slice(&index.to_le_bytes());
        h[8..16].copy_from_slice(&len.to_le_bytes());
        self.crc = crc32fast::Hasher::new();
        self.crc.update(&h);
        self.left = len;
        self.raw(&h)
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        for chunk in b.chunks(IO_CHUNK) {
            self.take_left(chunk.len())?;
            self.crc.update(chunk);
            self.raw(chunk)?;
        }
        Ok(())
    }

    fn put_words<T: Copy>(&mut self, xs: &[T], bytes: impl Fn(T) -> [u8; 4]) -> io::Result<()> {
        for chunk in xs.chunks(IO_CHUNK / 4) {
            self.take_left(chunk.len() * 4)?;
            let start = self.buf.len();
            for &x in chunk {
                self.buf.extend_from_slice(&bytes(x));
            }
            self.crc.update(&self.buf[start..]);
            self.count += (chunk.len() * 4) as u64;
            if self.buf.len() >= IO_CHUNK {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn end(&mut self) -> io::Result<()> {
        if self.left != 0 {
            return Err(internal("section shorter than declared"));
        }
        let crc = std::mem::replace(&mut self.crc, crc32fast::Hasher::new()).finalize();
        self.raw(&crc.to_le_bytes())
    }
}

fn f32_le(x: f32) -> [u8; 4] {
    x.to_bits().to_le_bytes()
}

fn write_planned<W: Write + ?Sized>(
    rec: &SessionRecord,
    plan: &Plan,
    w: &mut W,
) -> io::Result<u64> {
    let mut out = Out::new(w);
    out.raw(&header_bytes(&Header {
        version: FORMAT_VERSION,
        total: plan.total,
        sections: FIXED_SECTIONS + 1 + plan.layers.len() as u64 + plan.snaps.len() as u64,
        n_pos: plan.n_pos,
        n_layers: plan.layers.len() as u64,
        bpp: plan.bpp,
        created: rec.created_unix,
        saved: rec.saved_unix,
    }))?;

    out.begin(Sect::Identity, 0, IDENTITY_LEN)?;
    out.put(&rec.identity.hash)?;
    out.end()?;

    out.begin(Sect::Summary, 0, plan.summary_len)?;
    out.put(&rec.summary.turns.to_le_bytes())?;
    out.put(&(rec.name.len() as u32).to_le_bytes())?;
    out.put(rec.name.as_bytes())?;
    out.put(&(rec.summary.mode.len() as u32).to_le_bytes())?;
    out.put(rec.summary.mode.as_bytes())?;
    out.end()?;

    for (s, text) in [
        (Sect::Transcript, &rec.transcript_json),
        (Sect::Settings, &rec.settings_json),
    ] {
        out.begin(s, 0, text.len() as u64)?;
        out.put(text)?;
        out.end()?;
    }

    out.begin(Sect::Tokens, 0, plan.n_pos * 4)?;
    out.put_words(&rec.tokens, u32::to_le_bytes)?;
    out.end()?;

    let sc = &rec.sampler;
    out.begin(Sect::Sampler, 0, SAMPLER_LEN)?;
    out.put(&f32_le(sc.temperature))?;
    out.put(&(sc.top_k as u64).to_le_bytes())?;
    out.put(&f32_le(sc.top_p))?;
    out.put(&f32_le(sc.min_p))?;
    out.put(&f32_le(sc.repeat_penalty))?;
    out.put(&sc.seed.to_le_bytes())?;
    out.put(&rec.rng_state.to_le_bytes())?;
    out.end()?;

    out.begin(Sect::State, 0, LAYER_DESC_LEN * plan.layers.len() as u64)?;
    for d in &plan.layers {
        out.put(&d.encode())?;
    }
    out.end()?;

    for (i, (layer, d)) in rec.state.layers.iter().zip(&plan.layers).enumerate() {
        let bytes = d.bytes().ok_or_else(|| internal("layer size"))?;
        let index = u32::try_from(i).map_err(|_| internal("layer index"))?;
        out.begin(Sect::Layer, index, bytes)?;
        match layer {
            LayerState::Kda(k) => {
                out.put_words(&k.s, f32_le)?;
                for c in &k.conv {
                    out.put_words(c, f32_le)?;
                }
            }
            LayerState::Mla(c) => out.put_words(c, f32_le)?,
        }
        out.end()?;
    }

    out.begin(
        Sect::SnapDir,
        0,
        SNAP_DIR_HEAD + SNAP_DESC_LEN * plan.snaps.len() as u64,
    )?;
    out.put(&(plan.snaps.len() as u32).to_le_bytes())?;
    out.put(&0u32.to_le_bytes())?;
    for p in &plan.snaps {
        for x in [p.positions, p.shared, p.logits] {
            out.put(&x.to_le_bytes())?;
        }
    }
    out.end()?;
    for (i, (snap, p)) in rec.snapshots.iter().zip(&plan.snaps).enumerate() {
        let index = u32::try_from(i).map_err(|_| internal("snapshot index"))?;
        let shared = usize::try_from(p.shared).map_err(|_| internal("snapshot size"))?;
        out.begin(Sect::Snap, index, p.len)?;
        out.put_words(&snap.tokens[shared..], u32::to_le_bytes)?;
        out.put_words(&snap.logits, f32_le)?;
        for (layer, &w) in snap.state.layers.iter().zip(&p.widths) {
            match layer {
                LayerState::Kda(k) => {
                    out.put_words(&k.s, f32_le)?;
                    for c in &k.conv {
                        out.put_words(c, f32_le)?;
                    }
                }
                LayerState::Mla(c) => out.put_words(&c[shared * w..], f32_le)?,
            }
        }
        out.end()?;
    }
    out.flush()?;
    if out.count != plan.total {
        return Err(internal("file size differs from the plan"));
    }
    Ok(out.count)
}

impl SessionRecord {
    /// Streams the encoded file into `w` (through a 64 KiB buffer) and returns its size. The
    /// record is checked for consistency first; nothing is written if it fails.
    pub fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<u64, WriteError> {
        let plan = plan_record(self)?;
        Ok(write_planned(self, &plan, w)?)
    }

    /// The size [`SessionRecord::write_to`] would write.
    pub fn encoded_len(&self) -> Result<u64, RecordError> {
        Ok(plan_record(self)?.total)
    }
}

/// Encodes a record into memory (for small states; use [`SessionRecord::write_to`] for large).
pub fn encode(rec: &SessionRecord) -> Result<Vec<u8>, RecordError> {
    let plan = plan_record(rec)?;
    let mut v = Vec::with_capacity(usize::try_from(plan.total).unwrap_or(0));
    match write_planned(rec, &plan, &mut v) {
        Ok(_) => Ok(v),
        // Writing into a Vec only fails on an encoder inconsistency.
        Err(_) => Err(RecordError::TooLarge),
    }
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

enum Fail {
    Refused(Refusal),
    Io(io::Error),
    NoMemory(u64),
}

impl From<Refusal> for Fail {
    fn from(r: Refusal) -> Self {
        Fail::Refused(r)
    }
}

fn len_err(what: impl Into<String>, found: u64, expected: impl Into<String>) -> Fail {
    Fail::Refused(Refusal::Length {
        what: what.into(),
        found,
        expected: expected.into(),
    })
}

fn malformed(at: u64, what: impl Into<String>) -> Fail {
    Fail::Refused(Refusal::Malformed {
        at,
        what: what.into(),
    })
}

/// Streaming reader with position tracking and the running CRC of the open section.
struct Decoder<'r, R: Read + ?Sized> {
    r: &'r mut R,
    pos: u64,
    total: u64,
    crc: crc32fast::Hasher,
    scratch: Vec<u8>,
}

impl<'r, R: Read + ?Sized> Decoder<'r, R> {
    fn new(r: &'r mut R, total: u64) -> Self {
        Decoder {
            r,
            pos: 0,
            total,
            crc: crc32fast::Hasher::new(),
            scratch: Vec::new(),
        }
    }

    /// Reads until `buf` is full or the stream ends; returns the bytes read.
    fn fill(&mut self, buf: &mut [u8]) -> Result<usize, Fail> {
        let mut got = 0;
        while got < buf.len() {
            let rest = buf.get_mut(got..).unwrap_or_default();
            match self.r.read(rest) {
                Ok(0) => break,
                Ok(n) => got += n.min(rest.len()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fail::Io(e)),
            }
        }
        self.pos += got as u64;
        Ok(got)
    }

    fn exact(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        let got = self.fill(buf)?;
        if got < buf.len() {
            return Err(Refusal::Truncated {
                at: self.pos,
                of: self.total,
            }
            .into());
        }
        Ok(())
    }

    /// Reads a section header, checks its tag and index, and bounds its length by the bytes
    /// left in the file.
    fn open(&mut self, s: Sect, index: u32, name: &str) -> Result<u64, Fail> {
        let at = self.pos;
        let mut h = [0u8; SECTION_HEAD as usize];
        self.exact(&mut h)?;
        self.crc = crc32fast::Hasher::new();
        self.crc.update(&h);
        let mut c = Cursor::new(&h);
        let tag: [u8; 4] = c.array().unwrap_or_default();
        let idx = c.u32().unwrap_or_default();
        let len = c.u64().unwrap_or_default();
        if tag != s.tag() || idx != index {
            return Err(malformed(
                at,
                format!(
                    "expected the {name} section (tag {}, index {index}), found tag \"{}\" index {idx}",
                    s.tag().escape_ascii(),
                    tag.escape_ascii()
                ),
            ));
        }
        let room = self
            .total
            .saturating_sub(self.pos)
            .saturating_sub(SECTION_CRC);
        if len > room {
            return Err(len_err(
                format!("{name} section length (at byte {})", at + 8),
                len,
                format!("at most {room}, the bytes left in the file"),
            ));
        }
        Ok(len)
    }

    fn payload(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        self.exact(buf)?;
        self.crc.update(buf);
        Ok(())
    }

    /// Reads `len` payload bytes, growing the buffer as data arrives.
    fn bytes(&mut self, len: u64) -> Result<Vec<u8>, Fail> {
        let n = usize::try_from(len).map_err(|_| Fail::NoMemory(len))?;
        let mut v = Vec::new();
        v.try_reserve_exact(n.min(1 << 20))
            .map_err(|_| Fail::NoMemory(len))?;
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(IO_CHUNK, 0);
        let mut left = n;
        let res = loop {
            if left == 0 {
                break Ok(());
            }
            let k = left.min(IO_CHUNK);
            let chunk = buf.get_mut(..k).unwrap_or_default();
            if let Err(e) = self.payload(chunk) {
                break Err(e);
            }
            if v.try_reserve(k).is_err() {
                break Err(Fail::NoMemory(len));
            }
            v.extend_from_slice(chunk);
            left -= k;
        };
        self.scratch = buf;
        res.map(|()| v)
    }

    /// Reads `n` 4-byte words into a vector reserved once at its exact, already checked size.
    fn words<T>(&mut self, n: u64, conv: impl Fn([u8; 4]) -> T) -> Result<Vec<T>, Fail> {
        let bytes = n.saturating_mul(4);
        let count = usize::try_from(n).map_err(|_| Fail::NoMemory(bytes))?;
        let mut v = Vec::new();
        v.try_reserve_exact(count)
            .map_err(|_| Fail::NoMemory(bytes))?;
        self.words_into(&mut v, n, conv)?;
        Ok(v)
    }

    /// Appends `n` 4-byte words to `v` (reserved by the caller at its checked size).
    fn words_into<T>(
        &mut self,
        v: &mut Vec<T>,
        n: u64,
        conv: impl Fn([u8; 4]) -> T,
    ) -> Result<(), Fail> {
        let count = usize::try_from(n).map_err(|_| Fail::NoMemory(n.saturating_mul(4)))?;
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(IO_CHUNK, 0);
        let mut left = count;
        let res = loop {
            if left == 0 {
                break Ok(());
            }
            let k = left.min(IO_CHUNK / 4);
            let chunk = buf.get_mut(..k * 4).unwrap_or_default();
            if let Err(e) = self.payload(chunk) {
                break Err(e);
            }
            v.extend(
                chunk
                    .chunks_exact(4)
                    .map(|w| conv([w[0], w[1], w[2], w[3]])),
            );
            left -= k;
        };
        self.scratch = buf;
        res
    }

    fn f32s(&mut self, n: u64) -> Result<Vec<f32>, Fail> {
        self.words(n, |w| f32::from_bits(u32::from_le_bytes(w)))
    }

    /// Reads the stored CRC and compares it with the bytes read since `open`.
    fn close(&mut self, name: &str) -> Result<(), Fail> {
        let computed = std::mem::replace(&mut self.crc, crc32fast::Hasher::new()).finalize();
        let mut c = [0u8; 4];
        self.exact(&mut c)?;
        let stored = u32::from_le_bytes(c);
        if stored != computed {
            return Err(Refusal::Checksum {
                section: name.to_string(),
                stored,
                computed,
            }
            .into());
        }
        Ok(())
    }

    fn header(&mut self, file_len: u64) -> Result<Header, Fail> {
        let want = usize::try_from(file_len.min(HEADER_LEN)).unwrap_or(0);
        let mut b = [0u8; HEADER_LEN as usize];
        let got = self.fill(b.get_mut(..want).unwrap_or_default())?;
        let present = b.get(..got).unwrap_or_default();
        let mut c = Cursor::new(&b);
        let magic: [u8; 8] = c.array().unwrap_or_default();
        if got < MAGIC.len() {
            return Err(if MAGIC.starts_with(present) {
                Refusal::Truncated {
                    at: got as u64,
                    of: HEADER_LEN,
                }
            } else {
                Refusal::BadMagic {
                    found: present.to_vec(),
                }
            }
            .into());
        }
        if magic != MAGIC {
            return Err(Refusal::BadMagic {
                found: magic.to_vec(),
            }
            .into());
        }
        if got < 12 {
            return Err(Refusal::Truncated {
                at: got as u64,
                of: HEADER_LEN,
            }
            .into());
        }
        let version = c.u32().unwrap_or_default();
        let flags = c.u32().unwrap_or_default();
        let fields: [u64; 7] = std::array::from_fn(|_| c.u64().unwrap_or_default());
        let stored_crc = c.u32().unwrap_or_default();
        let computed_crc = crc32fast::hash(&b[..72]);
        if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
            // A damaged version field: the checksum matches once a version read here is
            // restored.
            for v in OLDEST_VERSION..=FORMAT_VERSION {
                let mut fixed = b;
                fixed[8..12].copy_from_slice(&v.to_le_bytes());
                if got == HEADER_LEN as usize && crc32fast::hash(&fixed[..72]) == stored_crc {
                    return Err(Refusal::Checksum {
                        section: "header".into(),
                        stored: stored_crc,
                        computed: computed_crc,
                    }
                    .into());
                }
            }
            return Err(Refusal::Version { found: version }.into());
        }
        if got < HEADER_LEN as usize {
            let of = if got >= 24 {
                fields[0].max(HEADER_LEN)
            } else {
                HEADER_LEN
            };
            return Err(Refusal::Truncated { at: got as u64, of }.into());
        }
        if stored_crc != computed_crc {
            return Err(Refusal::Checksum {
                section: "header".into(),
                stored: stored_crc,
                computed: computed_crc,
            }
            .into());
        }
        let [total, sections, n_pos, n_layers, bpp, created, saved] = fields;
        if flags != 0 {
            return Err(malformed(12, format!("flags are {flags:#x}, expected 0")));
        }
        if file_len < total {
            return Err(Refusal::Truncated {
                at: file_len,
                of: total,
            }
            .into());
        }
        if file_len > total {
            return Err(Refusal::Trailing {
                declared: total,
                actual: file_len,
            }
            .into());
        }
        self.total = total;
        if n_layers > MAX_LAYERS as u64 {
            return Err(len_err(
                "layer count (header byte 40)",
                n_layers,
                format!("at most {MAX_LAYERS}"),
            ));
        }
        if version == 1 && sections != FIXED_SECTIONS + n_layers {
            return Err(len_err(
                "section count (header byte 24)",
                sections,
                format!("{} (7 + {n_layers} layers)", FIXED_SECTIONS + n_layers),
            ));
        }
        let least = FIXED_SECTIONS + 1 + n_layers;
        if version > 1 && !(least..=least + MAX_SNAPSHOTS as u64).contains(&sections) {
            return Err(len_err(
                "section count (header byte 24)",
                sections,
                format!(
                    "between {least} and {} (8 + {n_layers} layers + at most {MAX_SNAPSHOTS} \
                     snapshots)",
                    least + MAX_SNAPSHOTS as u64
                ),
            ));
        }
        if n_pos > total / 4 {
            return Err(len_err(
                "position count (header byte 32)",
                n_pos,
                format!("at most {} for a file of {total} bytes", total / 4),
            ));
        }
        Ok(Header {
            version,
            total,
            sections,
            n_pos,
            n_layers,
            bpp,
            created,
            saved,
        })
    }

    fn identity(&mut self) -> Result<ModelIdentity, Fail> {
        let name = Sect::Identity.label();
        let len = self.open(Sect::Identity, 0, name)?;
        if len != IDENTITY_LEN {
            return Err(len_err(
                "identity section length",
                len,
                format!("exactly {IDENTITY_LEN}"),
            ));
        }
        let mut hash = [0u8; 32];
        self.payload(&mut hash)?;
        self.close(name)?;
        Ok(ModelIdentity { hash })
    }

    fn summary(&mut self) -> Result<(String, Summary), Fail> {
        let name = Sect::Summary.label();
        let at = self.pos;
        let len = self.open(Sect::Summary, 0, name)?;
        if !(SUMMARY_MIN..=SUMMARY_MAX).contains(&len) {
            return Err(len_err(
                "summary section length",
                len,
                format!("between {SUMMARY_MIN} and {SUMMARY_MAX}"),
            ));
        }
        let b = self.bytes(len)?;
        self.close(name)?;
        let mut c = Cursor::new(&b);
        let turns = c.u32();
        let name_bytes = c.u32().and_then(|n| c.take(usize::try_from(n).ok()?));
        let mode_bytes = c.u32().and_then(|n| c.take(usize::try_from(n).ok()?));
        let (Some(turns), Some(name_bytes), Some(mode_bytes)) = (turns, name_bytes, mode_bytes)
        else {
            return Err(malformed(at, "summary fields overrun the section"));
        };
        if !c.done() {
            return Err(malformed(at, "summary section has unused bytes"));
        }
        let session_name = std::str::from_utf8(name_bytes)
            .ok()
            .filter(|n| validate_name(n).is_ok())
            .ok_or_else(|| {
                malformed(
                    at,
                    format!("stored name \"{}\" is not valid", name_bytes.escape_ascii()),
                )
            })?;
        let mode = std::str::from_utf8(mode_bytes)
            .ok()
            .filter(|m| m.len() <= MAX_MODE_LEN && !m.chars().any(char::is_control))
            .ok_or_else(|| malformed(at, "summary mode is not printable UTF-8"))?;
        Ok((
            session_name.to_string(),
            Summary {
                turns,
                mode: mode.to_string(),
            },
        ))
    }

    fn text(&mut self, s: Sect) -> Result<Vec<u8>, Fail> {
        let at = self.pos;
        let len = self.open(s, 0, s.label())?;
        let t = self.bytes(len)?;
        self.close(s.label())?;
        if let Err(e) = std::str::from_utf8(&t) {
            return Err(malformed(
                at,
                format!(
                    "{} text is not UTF-8 (invalid byte at {})",
                    s.label(),
                    e.valid_up_to()
                ),
            ));
        }
        Ok(t)
    }
}

/// What verified before a refusal and can still be offered.
#[derive(Default)]
struct Recovered {
    transcript: Option<Vec<u8>>,
    settings: Option<Vec<u8>>,
}

/// The layer sizes the current config implies for `n_pos` positions.
fn expected_layers(cfg: &ModelConfig, n_pos: u64) -> Result<(Vec<LayerDesc>, u64), Fail> {
    let overflow = || {
        Fail::Refused(Refusal::Layout {
            problems: vec![format!(
                "{n_pos} positions overflow the sizes the current config implies"
            )],
        })
    };
    let kp = kda_params(cfg);
    let heads = kp.heads as u64;
    let hd = kp.head_dim as u64;
    let s = heads
        .checked_mul(hd)
        .and_then(|x| x.checked_mul(hd))
        .ok_or_else(overflow)?;
    let conv = heads
        .checked_mul(hd)
        .and_then(|x| x.checked_mul((kp.kernel as u64).saturating_sub(1)))
        .ok_or_else(overflow)?;
    let width = mla_params(cfg).cache_width() as u64;
    let floats = n_pos.checked_mul(width).ok_or_else(overflow)?;
    let layers: Vec<LayerDesc> = cfg
        .is_mla
        .iter()
        .map(|&m| {
            if m {
                LayerDesc::Mla {
                    rows: n_pos,
                    floats,
                }
            } else {
                LayerDesc::Kda { s, conv: [conv; 3] }
            }
        })
        .collect();
    let n_mla = cfg.is_mla.iter().filter(|&&m| m).count() as u64;
    let bpp = if n_pos == 0 {
        0
    } else {
        n_mla
            .checked_mul(width)
            .and_then(|f| f.checked_add(1))
            .and_then(|f| f.checked_mul(4))
            .ok_or_else(overflow)?
    };
    Ok((layers, bpp))
}

fn layout_problems(file: &[LayerDesc], want: &[LayerDesc], n_pos: u64) -> Vec<String> {
    let mut out = Vec::new();
    for (i, (f, w)) in file.iter().zip(want).enumerate() {
        match (*f, *w) {
            (LayerDesc::Kda { s, conv }, LayerDesc::Kda { s: ws, conv: wc }) => {
                if s != ws {
                    out.push(format!(
                        "layer {i} (KDA): recurrent state of {s} floats, the config implies {ws}"
                    ));
                }
                for (j, (c, wcj)) in conv.iter().zip(wc).enumerate() {
                    if *c != wcj {
                        out.push(format!(
                            "layer {i} (KDA): conv window {j} of {c} floats, the config implies {wcj}"
                        ));
                    }
                }
            }
            (LayerDesc::Mla { rows, floats }, LayerDesc::Mla { floats: wf, .. }) => {
                if rows != n_pos {
                    out.push(format!(
                        "layer {i} (MLA): {rows} cache rows for {n_pos} positions"
                    ));
                } else if floats != wf {
                    out.push(format!(
                        "layer {i} (MLA): cache of {floats} floats, the config implies {wf} \
                         ({n_pos} rows × {} wide)",
                        wf.checked_div(n_pos).unwrap_or(0)
                    ));
                }
            }
            _ => out.push(format!(
                "layer {i}: the file holds a {} layer, the config has {} (different layer map)",
                f.kind(),
                w.kind()
            )),
        }
    }
    const SHOWN: usize = 8;
    if out.len() > SHOWN {
        let more = out.len() - SHOWN;
        out.truncate(SHOWN);
        out.push(format!("and {more} more"));
    }
    out
}

fn decode_inner<R: Read + ?Sized>(
    r: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
    rec: &mut Recovered,
) -> Result<SessionRecord, Fail> {
    let mut d = Decoder::new(r, file_len);
    let h = d.header(file_len)?;
    let file_identity = d.identity()?;
    let (name, summary) = d.summary()?;
    rec.transcript = Some(d.text(Sect::Transcript)?);
    if file_identity != *identity {
        return Err(Refusal::Identity {
            file: Box::new(file_identity),
            current: Box::new(*identity),
        }
        .into());
    }
    rec.settings = Some(d.text(Sect::Settings)?);

    // Tokens.
    let label = Sect::Tokens.label();
    let at = d.pos;
    let len = d.open(Sect::Tokens, 0, label)?;
    let want = h.n_pos.saturating_mul(4);
    if len != want {
        return Err(len_err(
            "tokens section length",
            len,
            format!("exactly {want} ({} positions × 4)", h.n_pos),
        ));
    }
    let tokens = d.words(h.n_pos, u32::from_le_bytes)?;
    d.close(label)?;
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= expect.vocab_size)
    {
        return Err(malformed(
            at,
            format!(
                "token {i} is id {t}, outside the vocabulary of {}",
                expect.vocab_size
            ),
        ));
    }

    // Sampler.
    let label = Sect::Sampler.label();
    let at = d.pos;
    let len = d.open(Sect::Sampler, 0, label)?;
    if len != SAMPLER_LEN {
        return Err(len_err(
            "sampler section length",
            len,
            format!("exactly {SAMPLER_LEN}"),
        ));
    }
    let mut sb = [0u8; SAMPLER_LEN as usize];
    d.payload(&mut sb)?;
    d.close(label)?;
    let mut c = Cursor::new(&sb);
    let (Some(temperature), Some(top_k), Some(top_p), Some(min_p), Some(repeat_penalty)) =
        (c.f32(), c.u64(), c.f32(), c.f32(), c.f32())
    else {
        return Err(malformed(at, "short sampler section"));
    };
    let (Some(seed), Some(rng_state)) = (c.u64(), c.u64()) else {
        return Err(malformed(at, "short sampler section"));
    };
    let top_k = usize::try_from(top_k)
        .map_err(|_| malformed(at, format!("sampler top_k {top_k} does not fit")))?;
    let sampler = SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        seed,
    };
    if let Err(e) = sampler.validate() {
        return Err(malformed(at, format!("sampler settings refused: {e}")));
    }
    if rng_state == 0 {
        return Err(malformed(at, "sampler rng state is 0"));
    }

    // State layout, checked against the current config before any float is allocated.
    let label = Sect::State.label();
    let n_cfg = expect.is_mla.len() as u64;
    if h.n_layers != n_cfg {
        return Err(Refusal::Layout {
            problems: vec![format!(
                "the file holds {} layers, the config has {n_cfg}",
                h.n_layers
            )],
        }
        .into());
    }
    let at = d.pos;
    let len = d.open(Sect::State, 0, label)?;
    let want_len = LAYER_DESC_LEN * h.n_layers;
    if len != want_len {
        return Err(len_err(
            "state layout section length",
            len,
            format!(
                "exactly {want_len} ({} layers × {LAYER_DESC_LEN})",
                h.n_layers
            ),
        ));
    }
    let descs = d.bytes(len)?;
    d.close(label)?;
    let mut file_layers = Vec::new();
    for (i, chunk) in descs.chunks_exact(LAYER_DESC_LEN as usize).enumerate() {
        let desc = LayerDesc::parse(chunk).map_err(|e| {
            malformed(
                at + SECTION_HEAD + LAYER_DESC_LEN * i as u64,
                format!("layer {i} descriptor: {e}"),
            )
        })?;
        file_layers.push(desc);
    }
    let (want_layers, want_bpp) = expected_layers(expect, h.n_pos)?;
    let mut problems = layout_problems(&file_layers, &want_layers, h.n_pos);
    if problems.is_empty() && h.bpp != want_bpp {
        problems.push(format!(
            "the header's {} bytes per position differ from the {want_bpp} the config implies",
            h.bpp
        ));
    }
    if !problems.is_empty() {
        return Err(Refusal::Layout { problems }.into());
    }

    // Layers.
    let n_pos = usize::try_from(h.n_pos).map_err(|_| Fail::NoMemory(h.n_pos))?;
    let mut layers = Vec::with_capacity(want_layers.len());
    for (i, desc) in want_layers.iter().enumerate() {
        let label = format!("layer {i} ({})", desc.kind());
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let len = d.open(Sect::Layer, index, &label)?;
        let want = desc.bytes().unwrap_or(u64::MAX);
        if len != want {
            return Err(len_err(
                format!("{label} section length"),
                len,
                format!("exactly {want}, as the config implies"),
            ));
        }
        let state = match *desc {
            LayerDesc::Kda { s, conv } => {
                let s = d.f32s(s)?;
                let c0 = d.f32s(conv[0])?;
                let c1 = d.f32s(conv[1])?;
                let c2 = d.f32s(conv[2])?;
                LayerState::Kda(KdaState {
                    s,
                    conv: [c0, c1, c2],
                })
            }
            LayerDesc::Mla { floats, .. } => LayerState::Mla(d.f32s(floats)?),
        };
        d.close(&label)?;
        layers.push(state);
    }
    let state = SeqState { n_pos, layers };
    let snapshots = if h.version >= 2 {
        read_snapshots(&mut d, &h, expect, &want_layers, &tokens, &state)?
    } else {
        Vec::new()
    };
    if d.pos != d.total {
        return Err(malformed(
            d.pos,
            format!(
                "the sections end at byte {} but the header declares {}",
                d.pos, d.total
            ),
        ));
    }
    let mut probe = [0u8; 1];
    if d.fill(&mut probe)? > 0 {
        return Err(Refusal::Trailing {
            declared: d.total,
            actual: d.pos,
        }
        .into());
    }
    Ok(SessionRecord {
        name,
        created_unix: h.created,
        saved_unix: h.saved,
        identity: file_identity,
        summary,
        transcript_json: rec.transcript.take().unwrap_or_default(),
        settings_json: rec.settings.take().unwrap_or_default(),
        tokens,
        state,
        snapshots,
        sampler,
        rng_state,
    })
}

/// One snapshot's entry in the directory, checked.
struct SnapDesc {
    positions: u64,
    shared: u64,
    logits: u64,
    len: u64,
}

/// Reads the snapshot directory and the snapshots (format 2). Every count is checked against
/// the config and the live state, and the sections' lengths together against the bytes left
/// in the file, before anything is allocated; the shared ids and rows are copied from the live
/// state.
fn read_snapshots<R: Read + ?Sized>(
    d: &mut Decoder<'_, R>,
    h: &Header,
    expect: &ModelConfig,
    want_layers: &[LayerDesc],
    live_tokens: &[u32],
    live: &SeqState,
) -> Result<Vec<Snapshot>, Fail> {
    let count = h.sections.saturating_sub(FIXED_SECTIONS + 1 + h.n_layers);
    let label = Sect::SnapDir.label();
    let at = d.pos;
    let len = d.open(Sect::SnapDir, 0, label)?;
    let want = SNAP_DIR_HEAD + SNAP_DESC_LEN * count;
    if len != want {
        return Err(len_err(
            "snapshot directory length",
            len,
            format!("exactly {want} ({count} snapshots × {SNAP_DESC_LEN} + {SNAP_DIR_HEAD})"),
        ));
    }
    let dir = d.bytes(len)?;
    d.close(label)?;
    let mut c = Cursor::new(&dir);
    let (Some(n), Some(reserved)) = (c.u32(), c.u32()) else {
        return Err(malformed(at, "short snapshot directory"));
    };
    if u64::from(n) != count {
        return Err(malformed(
            at,
            format!("the directory lists {n} snapshots, the header's section count {count}"),
        ));
    }
    if reserved != 0 {
        return Err(malformed(
            at,
            format!("snapshot directory reserved field is {reserved}, expected 0"),
        ));
    }
    let overflow = || len_err("snapshot size", u64::MAX, "a size that fits in 64 bits");
    let width = mla_params(expect).cache_width() as u64;
    let n_mla = want_layers
        .iter()
        .filter(|l| matches!(l, LayerDesc::Mla { .. }))
        .count() as u64;
    let kda_floats = want_layers
        .iter()
        .filter(|l| matches!(l, LayerDesc::Kda { .. }))
        .try_fold(0u64, |acc, l| acc.checked_add(l.floats()?))
        .ok_or_else(overflow)?;
    let row = n_mla
        .checked_mul(width)
        .and_then(|f| f.checked_add(1))
        .ok_or_else(overflow)?;
    let vocab = expect.vocab_size as u64;
    let mut descs = Vec::new();
    let mut need: u64 = 0;
    for j in 0..count {
        let entry = at + SECTION_HEAD + SNAP_DIR_HEAD + SNAP_DESC_LEN * j;
        let (Some(positions), Some(shared), Some(logits)) = (c.u64(), c.u64(), c.u64()) else {
            return Err(malformed(entry, "short snapshot directory"));
        };
        if positions == 0 {
            return Err(malformed(
                entry,
                format!("snapshot {j} covers no positions"),
            ));
        }
        if shared > positions || shared > h.n_pos {
            return Err(malformed(
                entry,
                format!(
                    "snapshot {j} shares {shared} positions with the live state, which has {}, \
                     and covers {positions}",
                    h.n_pos
                ),
            ));
        }
        if logits != vocab {
            return Err(len_err(
                format!("snapshot {j} logits"),
                logits,
                format!("exactly {vocab}, the vocabulary"),
            ));
        }
        let len = row
            .checked_mul(positions - shared)
            .and_then(|f| f.checked_add(kda_floats))
            .and_then(|f| f.checked_add(logits))
            .and_then(|f| f.checked_mul(4))
            .ok_or_else(overflow)?;
        need = section_size(len)
            .and_then(|l| need.checked_add(l))
            .ok_or_else(overflow)?;
        descs.push(SnapDesc {
            positions,
            shared,
            logits,
            len,
        });
    }
    let left = d.total.saturating_sub(d.pos);
    if need != left {
        return Err(len_err(
            "the snapshot sections' length",
            need,
            format!("exactly {left}, the bytes left in the file"),
        ));
    }
    let no_memory = |n: u64| Fail::NoMemory(n.saturating_mul(4));
    let mut out = Vec::with_capacity(descs.len());
    for (j, desc) in descs.iter().enumerate() {
        let label = format!("snapshot {j}");
        let index = u32::try_from(j).unwrap_or(u32::MAX);
        let at = d.pos;
        let len = d.open(Sect::Snap, index, &label)?;
        if len != desc.len {
            return Err(len_err(
                format!("{label} section length"),
                len,
                format!(
                    "exactly {}, as its directory entry and the config imply",
                    desc.len
                ),
            ));
        }
        let positions = usize::try_from(desc.positions).map_err(|_| no_memory(desc.positions))?;
        let shared = usize::try_from(desc.shared).map_err(|_| no_memory(desc.shared))?;
        let tail = desc.positions - desc.shared;
        let mut tokens: Vec<u32> = Vec::new();
        tokens
            .try_reserve_exact(positions)
            .map_err(|_| no_memory(desc.positions))?;
        tokens.extend_from_slice(live_tokens.get(..shared).unwrap_or_default());
        d.words_into(&mut tokens, tail, u32::from_le_bytes)?;
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .skip(shared)
            .find(|&(_, &t)| u64::from(t) >= vocab)
        {
            return Err(malformed(
                at,
                format!("{label}: token {i} is id {t}, outside the vocabulary of {vocab}"),
            ));
        }
        let logits = d.f32s(desc.logits)?;
        let mut layers = Vec::with_capacity(want_layers.len());
        for (i, l) in want_layers.iter().enumerate() {
            layers.push(match *l {
                LayerDesc::Kda { s, conv } => {
                    let s = d.f32s(s)?;
                    let c0 = d.f32s(conv[0])?;
                    let c1 = d.f32s(conv[1])?;
                    let c2 = d.f32s(conv[2])?;
                    LayerState::Kda(KdaState {
                        s,
                        conv: [c0, c1, c2],
                    })
                }
                LayerDesc::Mla { .. } => {
                    let floats = desc.positions.saturating_mul(width);
                    let n = usize::try_from(floats).map_err(|_| no_memory(floats))?;
                    let mut v: Vec<f32> = Vec::new();
                    v.try_reserve_exact(n).map_err(|_| no_memory(floats))?;
                    if let Some(LayerState::Mla(c)) = live.layers.get(i) {
                        let w = usize::try_from(width).unwrap_or(usize::MAX);
                        v.extend_from_slice(c.get(..shared.saturating_mul(w)).unwrap_or_default());
                    }
                    d.words_into(&mut v, tail.saturating_mul(width), |w| {
                        f32::from_bits(u32::from_le_bytes(w))
                    })?;
                    LayerState::Mla(v)
                }
            });
        }
        d.close(&label)?;
        out.push(Snapshot {
            tokens,
            state: SeqState {
                n_pos: positions,
                layers,
            },
            logits,
        });
    }
    Ok(out)
}

fn decode_labeled<R: Read + ?Sized>(
    r: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
    label: &str,
) -> Result<SessionRecord, LoadError> {
    let mut rec = Recovered::default();
    let res = decode_inner(r, file_len, expect, identity, &mut rec);
    res.map_err(|f| match f {
        Fail::Io(source) => LoadError::Io {
            name: label.to_string(),
            source,
        },
        Fail::NoMemory(bytes) => LoadError::OutOfMemory {
            name: label.to_string(),
            bytes,
        },
        Fail::Refused(reason) => match rec.transcript.take() {
            Some(transcript_json) => LoadError::StateRefused {
                reason: Box::new(reason),
                transcript_json,
            },
            None => LoadError::Refused {
                name: label.to_string(),
                reason: Box::new(reason),
            },
        },
    })
}

/// Decodes a session file of `file_len` bytes from `reader`, streaming, and checks it against
/// the current model: every length is checked against what `expect` implies before anything is
/// allocated, every section's CRC32 is verified, and trailing bytes are refused. A refusal after
/// the transcript verified is [`LoadError::StateRefused`], which carries the transcript.
pub fn decode<R: Read + ?Sized>(
    reader: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
) -> Result<SessionRecord, LoadError> {
    decode_labeled(reader, file_len, expect, identity, "(stream)")
}

// ---------------------------------------------------------------------------------------------
// File operations of a save
// ---------------------------------------------------------------------------------------------

/// The file operations a save performs, in order: create the temporary file, write it (one or
/// more calls), fsync it, rename it over the session file, fsync the directory; `remove` deletes
/// the temporary file after a failure. [`OsIo`] is the real implementation; tests substitute one
/// that fails or stops at any step.
pub trait SaveIo {
    /// An open temporary file.
    type File;
    /// Creates `path`, which must not exist yet (never following a link), readable by the owner
    /// only.
    fn create_new(&mut self, path: &Path) -> io::Result<Self::File>;
    /// Writes all of `buf`.
    fn write(&mut self, file: &mut Self::File, buf: &[u8]) -> io::Result<()>;
    /// Flushes the file's data and metadata to the device.
    fn sync(&mut self, file: &mut Self::File) -> io::Result<()>;
    /// Atomically replaces `to` (a link there is replaced, not followed) with `from`.
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    /// Flushes the directory entry changes of `dir`.
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()>;
    /// Deletes `path`.
    fn remove(&mut self, path: &Path) -> io::Result<()>;
}

/// The operating system's file operations.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsIo;

impl SaveIo for OsIo {
    type File = File;

    fn create_new(&mut self, path: &Path) -> io::Result<File> {
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        o.open(path)
    }

    fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
        file.write_all(buf)
    }

    fn sync(&mut self, file: &mut File) -> io::Result<()> {
        file.sync_all()
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        #[cfg(unix)]
        {
            File::open(dir)?.sync_all()
        }
        #[cfg(not(unix))]
        {
            let _ = dir;
            Ok(())
        }
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
}

/// `Write` over a [`SaveIo`] file, so the encoder's buffered output goes through the trait.
struct IoWriter<'a, I: SaveIo> {
    io: &'a mut I,
    file: &'a mut I::File,
}

impl<I: SaveIo> Write for IoWriter<'_, I> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io.write(self.file, buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------------------------

/// One session as `list` shows it, read from the header and summary only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// Session name (from the file name).
    pub name: String,
    /// When it was saved, Unix seconds.
    pub saved_unix: u64,
    /// Completed turns.
    pub turns: u32,
    /// Interaction mode.
    pub mode: String,
    /// File size.
    pub bytes: u64,
    /// Positions the state covers.
    pub positions: u64,
    /// Bytes each further position adds (token id plus MLA cache rows); 0 with no positions.
    pub bytes_per_position: u64,
    /// The model it was saved with.
    pub identity: Option<ModelIdentity>,
    /// Why the header or summary could not be read, if so (the other fields are then 0).
    pub problem: Option<String>,
}

/// A directory of session files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionStore {
    dir: PathBuf,
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn sessions_dir_from(data_dir_env: Option<OsString>) -> PathBuf {
    let base = match data_dir_env {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => directories::ProjectDirs::from("", "", "k3")
            .map_or_else(|| PathBuf::from(".k3"), |p| p.data_dir().to_path_buf()),
    };
    base.join("sessions")
}

#[cfg(unix)]
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &fs::Metadata, _: &fs::Metadata) -> bool {
    true
}

/// Opens (creating if needed) a lock file without following a link planted at its path.
fn open_lock_file(path: &Path) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    match o.open(path) {
        Ok(f) => return Ok(f),
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        Err(_) => {}
    }
    let meta = fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other(format!(
            "lock file {path:?} is not a regular file"
        )));
    }
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    if !same_file(&meta, &f.metadata()?) {
        return Err(io::Error::other(format!(
            "lock file {path:?} changed while it was opened"
        )));
    }
    Ok(f)
}

enum Lock {
    Held(File),
    InUse(String),
    Unsupported,
}

fn holder_of(f: &File) -> String {
    let mut s = String::new();
    let parsed = f.take(64).read_to_string(&mut s).ok().and_then(|_| {
        let rest = s.trim_end().strip_prefix("pid=")?;
        let (pid, since) = rest.split_once(" since=")?;
        Some((pid.parse::<u32>().ok()?, since.parse::<u64>().ok()?))
    });
    match parsed {
        Some((pid, since)) => format!("pid {pid} since unix time {since}"),
        None => "another process".into(),
    }
}

fn acquire_lock(path: &Path) -> io::Result<Lock> {
    let f = open_lock_file(path)?;
    match f.try_lock() {
        Ok(()) => {
            // Best effort: who holds it, for the second writer's message.
            let stamp = format!("pid={} since={}\n", std::process::id(), now_unix());
            if f.set_len(0).is_ok() {
                let mut w = &f;
                let _ = w.write_all(stamp.as_bytes());
            }
            Ok(Lock::Held(f))
        }
        Err(fs::TryLockError::WouldBlock) => Ok(Lock::InUse(holder_of(&f))),
        Err(fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
            Ok(Lock::Unsupported)
        }
        Err(fs::TryLockError::Error(e)) => Err(e),
    }
}

/// A process's claim on one session name, held from the moment the process opens the session
/// (resumes, loads or first saves it) until it lets go of it: an exclusive advisory lock
/// (`flock`) on the hidden file `.NAME.lock` beside the session, which records the holder's pid
/// and start time for the message a second process gets. The kernel drops the lock however the
/// process ends (`kill -9` included), so a lock never goes stale; the small file stays, because
/// removing a lock file races with a process that is opening it.
#[derive(Debug)]
pub struct SessionLock {
    name: String,
    /// `None` where the file system offers no locks (saves are then atomic but unguarded).
    file: Option<File>,
}

impl SessionLock {
    /// A claim on `name` that holds no lock, for a session that is open where no lock could be
    /// taken (a read-only session directory): saves through it are still atomic.
    pub fn unlocked(name: &str) -> Result<SessionLock, NameError> {
        validate_name(name)?;
        Ok(SessionLock {
            name: name.to_string(),
            file: None,
        })
    }

    /// The session name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether an advisory lock is held (false where none could be taken).
    #[must_use]
    pub fn is_held(&self) -> bool {
        self.file.is_some()
    }
}

/// The session name and writer pid of one of our temporary files.
fn parse_temp_name(file_name: &str) -> Option<(&str, u32)> {
    let rest = file_name.strip_prefix('.')?;
    let marker = format!(".{EXTENSION}.tmp.");
    let (name, tail) = rest.split_once(marker.as_str())?;
    let (pid, seq) = tail.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(seq) || validate_name(name).is_err() {
        return None;
    }
    Some((name, pid.parse().ok()?))
}

impl SessionStore {
    /// A store over `dir` (created on the first save).
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SessionStore { dir: dir.into() }
    }

    /// The per-user default: `$K3_DATA_DIR/sessions` when that variable is set and non-empty,
    /// else the platform data directory for `k3` plus `sessions` (on Linux
    /// `~/.local/share/k3/sessions`); `.k3/sessions` under the working directory when no home
    /// directory can be determined.
    #[must_use]
    pub fn default_dir() -> PathBuf {
        sessions_dir_from(std::env::var_os(DATA_DIR_ENV))
    }

    /// The store's directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file a session of this name lives in.
    pub fn path_of(&self, name: &str) -> Result<PathBuf, NameError> {
        validate_name(name)?;
        Ok(self.dir.join(format!("{name}.{EXTENSION}")))
    }

    /// The journal of session `name` (see [`crate::session::journal`]): unsaved changes, kept
    /// beside the session file.
    pub fn journal_path(&self, name: &str) -> Result<PathBuf, NameError> {
        validate_name(name)?;
        Ok(self
            .dir
            .join(format!("{name}.{}", crate::session::journal::EXTENSION)))
    }

    /// Whether session `name` has a journal (unsaved changes of a process that ended).
    #[must_use]
    pub fn has_journal(&self, name: &str) -> bool {
        self.journal_path(name)
            .is_ok_and(|p| fs::symlink_metadata(p).is_ok())
    }

    fn lock_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".{name}.lock"))
    }

    /// Saves `rec` under `rec.name` atomically; returns the bytes written.
    pub fn save(&self, rec: &SessionRecord) -> Result<u64, SaveError> {
        self.save_with(rec, &mut OsIo)
    }

    /// [`SessionStore::save`] through the given file operations: lock, temporary file in the
    /// same directory, write, fsync, rename, fsync of the directory. On failure the temporary
    /// file is removed and the previous session file is left as it was (unless the failure is
    /// the directory fsync after the rename, which the error reports).
    pub fn save_with<I: SaveIo>(&self, rec: &SessionRecord, io: &mut I) -> Result<u64, SaveError> {
        self.save_inner(rec, None, io)
    }

    /// [`SessionStore::save`] for a process that holds the session's lock (see
    /// [`SessionStore::lock`]): the save goes through that lock instead of taking its own.
    /// A lock on another name is not used; the save then takes its own as `save` does.
    pub fn save_locked(&self, rec: &SessionRecord, lock: &SessionLock) -> Result<u64, SaveError> {
        self.save_inner(rec, Some(lock), &mut OsIo)
    }

    /// [`SessionStore::save_locked`] through the given file operations.
    pub fn save_locked_with<I: SaveIo>(
        &self,
        rec: &SessionRecord,
        lock: &SessionLock,
        io: &mut I,
    ) -> Result<u64, SaveError> {
        self.save_inner(rec, Some(lock), io)
    }

    fn save_inner<I: SaveIo>(
        &self,
        rec: &SessionRecord,
        held: Option<&SessionLock>,
        io: &mut I,
    ) -> Result<u64, SaveError> {
        let target = self.path_of(&rec.name)?;
        let name = rec.name.clone();
        let plan = plan_record(rec).map_err(|problem| SaveError::Record {
            name: name.clone(),
            problem,
        })?;
        let need = plan.total;
        let fail = |step: SaveStep, replaced: bool, source: io::Error| SaveError::Io {
            name: name.clone(),
            step,
            need,
            replaced,
            source,
        };
        let mut db = fs::DirBuilder::new();
        db.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            db.mode(0o700);
        }
        db.create(&self.dir)
            .map_err(|e| fail(SaveStep::CreateDir, false, e))?;
        let held = held.filter(|l| l.name == rec.name);
        let _lock = match held {
            Some(_) => None,
            None => match acquire_lock(&self.lock_path(&rec.name)) {
                Ok(Lock::Held(f)) => Some(f),
                Ok(Lock::Unsupported) => None,
                Ok(Lock::InUse(holder)) => {
                    return Err(SaveError::InUse {
                        name: name.clone(),
                        holder,
                    })
                }
                Err(e) => return Err(fail(SaveStep::Lock, false, e)),
            },
        };

        let (tmp, mut file) = self
            .create_temp(&rec.name, io)
            .map_err(|e| fail(SaveStep::CreateTemp, false, e))?;
        let written = {
            let mut w = IoWriter {
                io: &mut *io,
                file: &mut file,
            };
            write_planned(rec, &plan, &mut w)
        };
        let synced = match written {
            Ok(_) => io.sync(&mut file).map_err(|e| (SaveStep::SyncFile, e)),
            Err(e) => Err((SaveStep::Write, e)),
        };
        drop(file);
        let renamed =
            synced.and_then(|()| io.rename(&tmp, &target).map_err(|e| (SaveStep::Rename, e)));
        if let Err((step, e)) = renamed {
            // Never retry an fsync or a rename; drop the partial file and keep the old one.
            let _ = io.remove(&tmp);
            return Err(fail(step, false, e));
        }
        io.sync_dir(&self.dir)
            .map_err(|e| fail(SaveStep::SyncDir, true, e))?;
        Ok(need)
    }

    /// Takes the lock of session `name` for as long as the returned claim lives (see
    /// [`SessionLock`]), creating the session directory if needed. Refused with the holder's pid
    /// when another process has the session open; where the file system has no locks the claim
    /// holds none.
    pub fn lock(&self, name: &str) -> Result<SessionLock, LockError> {
        validate_name(name)?;
        let io_err = |step, source| LockError::Io {
            name: name.to_string(),
            step,
            source,
        };
        let mut db = fs::DirBuilder::new();
        db.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            db.mode(0o700);
        }
        db.create(&self.dir)
            .map_err(|e| io_err(SaveStep::CreateDir, e))?;
        let file = match acquire_lock(&self.lock_path(name)) {
            Ok(Lock::Held(f)) => Some(f),
            Ok(Lock::Unsupported) => None,
            Ok(Lock::InUse(holder)) => {
                return Err(LockError::InUse {
                    name: name.to_string(),
                    holder,
                })
            }
            Err(e) => return Err(io_err(SaveStep::Lock, e)),
        };
        Ok(SessionLock {
            name: name.to_string(),
            file,
        })
    }

    /// Claims the first free name of `base`, `base-2`, … `base-999` (see
    /// [`crate::session::naming`]); `None` when all are taken. Free means that no session file
    /// or journal of that name exists and no other process has it locked. The lock is taken
    /// before the name is checked, so two processes never pick the same one.
    pub fn claim_new(&self, base: &str) -> Result<Option<SessionLock>, LockError> {
        use crate::session::naming::{with_suffix, MAX_SUFFIX};
        validate_name(&with_suffix(base, MAX_SUFFIX))?;
        for k in 1..=MAX_SUFFIX {
            let name = with_suffix(base, k);
            match self.lock(&name) {
                Ok(lock) if !self.exists(&name) && !self.has_journal(&name) => {
                    return Ok(Some(lock))
                }
                Ok(_) | Err(LockError::InUse { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Whether something (a session file, or anything else) is at session `name`'s path.
    #[must_use]
    pub fn exists(&self, name: &str) -> bool {
        self.path_of(name)
            .is_ok_and(|p| fs::symlink_metadata(p).is_ok())
    }

    fn create_temp<I: SaveIo>(&self, name: &str, io: &mut I) -> io::Result<(PathBuf, I::File)> {
        let mut last = None;
        for _ in 0..16 {
            let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
            let tmp = self.dir.join(format!(
                ".{name}.{EXTENSION}.tmp.{}.{seq}",
                std::process::id()
            ));
            match io.create_new(&tmp) {
                Ok(f) => return Ok((tmp, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free temporary file name")))
    }

    /// Loads the session `name` and checks it against the current model (see [`decode`]). The
    /// returned record's `name` is `name` (the file may have been copied from another name). A
    /// symbolic link or other non-regular file at the session's path is refused.
    pub fn load(
        &self,
        name: &str,
        expect: &ModelConfig,
        identity: &ModelIdentity,
    ) -> Result<SessionRecord, LoadError> {
        let path = self.path_of(name)?;
        let (file, len) = self.open_regular(name, &path)?;
        let mut r = io::BufReader::with_capacity(IO_CHUNK, file);
        let mut rec = decode_labeled(&mut r, len, expect, identity, name)?;
        rec.name = name.to_string();
        Ok(rec)
    }

    /// Open the session file, checking it is a regular file and not a link. A save that
    /// renames a new version into place between the check and the open is retried: the
    /// reader then sees the new, complete file.
    fn open_regular(&self, name: &str, path: &Path) -> Result<(File, u64), LoadError> {
        let mut attempt = 0;
        loop {
            match self.open_regular_once(name, path) {
                Err(LoadError::NotRegular { what, .. })
                    if what.contains("replaced") && attempt < 8 =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn open_regular_once(&self, name: &str, path: &Path) -> Result<(File, u64), LoadError> {
        let io_err = |source| LoadError::Io {
            name: name.to_string(),
            source,
        };
        let not_regular = |what| LoadError::NotRegular {
            name: name.to_string(),
            path: path.to_path_buf(),
            what,
        };
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(LoadError::NotFound {
                    name: name.to_string(),
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err(e)),
        };
        if meta.file_type().is_symlink() {
            return Err(not_regular("a symbolic link"));
        }
        if !meta.is_file() {
            return Err(not_regular("not a regular file"));
        }
        let file = File::open(path).map_err(io_err)?;
        let fmeta = file.metadata().map_err(io_err)?;
        if !fmeta.is_file() || !same_file(&meta, &fmeta) {
            return Err(not_regular("a file that was replaced while it was opened"));
        }
        Ok((file, fmeta.len()))
    }

    /// Every session file in the store, newest first, read from headers and summaries only.
    /// A file that cannot be read is listed with `problem` set. A missing directory is empty.
    pub fn list(&self) -> io::Result<Vec<SessionInfo>> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let suffix = format!(".{EXTENSION}");
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry?;
            let file_name = entry.file_name();
            let Some(name) = file_name
                .to_str()
                .and_then(|f| f.strip_suffix(suffix.as_str()))
                .filter(|n| validate_name(n).is_ok())
            else {
                continue;
            };
            out.push(self.info(name));
        }
        out.sort_by(|a, b| {
            b.saved_unix
                .cmp(&a.saved_unix)
                .then_with(|| a.name.cmp(&b.name))
        });
        Ok(out)
    }

    fn info(&self, name: &str) -> SessionInfo {
        let mut info = SessionInfo {
            name: name.to_string(),
            saved_unix: 0,
            turns: 0,
            mode: String::new(),
            bytes: 0,
            positions: 0,
            bytes_per_position: 0,
            identity: None,
            problem: None,
        };
        let path = self.dir.join(format!("{name}.{EXTENSION}"));
        let (file, len) = match self.open_regular(name, &path) {
            Ok(x) => x,
            Err(e) => {
                info.problem = Some(e.to_string());
                return info;
            }
        };
        info.bytes = len;
        let mut r = io::BufReader::with_capacity(4096, file);
        let mut d = Decoder::new(&mut r, len);
        let read = d
            .header(len)
            .and_then(|h| Ok((h, d.identity()?, d.summary()?)));
        match read {
            Ok((h, id, (_, summary))) => {
                info.saved_unix = h.saved;
                info.turns = summary.turns;
                info.mode = summary.mode;
                info.positions = h.n_pos;
                info.bytes_per_position = h.bpp;
                info.identity = Some(id);
            }
            Err(Fail::Refused(r)) => info.problem = Some(r.to_string()),
            Err(Fail::Io(e)) => info.problem = Some(format!("read failed: {e}")),
            Err(Fail::NoMemory(b)) => info.problem = Some(format!("cannot allocate {b} bytes")),
        }
        info
    }

    /// Deletes temporary files left by interrupted saves (a crash or kill during a save) and
    /// returns how many were removed. A temporary file whose session is locked by a running
    /// save is left alone.
    pub fn remove_stale_temps(&self) -> io::Result<usize> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut removed = 0;
        for entry in rd {
            let entry = entry?;
            let file_name = entry.file_name();
            let Some((name, pid)) = file_name.to_str().and_then(parse_temp_name) else {
                continue;
            };
            let _guard = match acquire_lock(&self.lock_path(name))? {
                Lock::Held(f) => Some(f),
                Lock::InUse(_) => continue,
                Lock::Unsupported if pid == std::process::id() => continue,
                Lock::Unsupported => None,
            };
            match fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    const TINY: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny/config.json"
    );

    fn tiny() -> ModelConfig {
        ModelConfig::load(Path::new(TINY)).expect("tiny config")
    }

    /// splitmix64, for reproducible test data.
    struct Prng(u64);

    impl Prng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        fn f32(&mut self) -> f32 {
            f32::from_bits(self.next() as u32)
        }
    }

    fn identity() -> ModelIdentity {
        ModelIdentity::compute(b"{\"tiny\":1}", &[b"ranks", b"tokenizer_config"], b"index")
    }

    fn record(cfg: &ModelConfig, name: &str, n_pos: usize, seed: u64) -> SessionRecord {
        let mut rng = Prng(seed);
        let mut state = SeqState::new(cfg);
        state.n_pos = n_pos;
        let width = SeqState::mla_floats_per_position(cfg);
        for layer in &mut state.layers {
            match layer {
                LayerState::Kda(k) => {
                    for x in k.s.iter_mut().chain(k.conv.iter_mut().flatten()) {
                        *x = rng.f32();
                    }
                }
                LayerState::Mla(c) => *c = (0..n_pos * width).map(|_| rng.f32()).collect(),
            }
        }
        let Some(LayerState::Kda(k)) = state.layers.first_mut() else {
            panic!("layer 0 of the tiny config is KDA");
        };
        k.s[0] = -0.0;
        k.s[1] = f32::from_bits(0x7fa0_0001); // signalling NaN with a payload
        k.s[2] = f32::from_bits(0xffc1_2345); // negative quiet NaN with a payload
        k.s[3] = f32::INFINITY;
        k.s[4] = f32::from_bits(1); // smallest subnormal
        SessionRecord {
            name: name.into(),
            created_unix: 1_700_000_000 + seed,
            saved_unix: 1_700_000_100 + seed,
            identity: identity(),
            summary: Summary {
                turns: 3,
                mode: "chat".into(),
            },
            transcript_json: format!(
                r#"{{"messages":[{{"role":"user","content":"hello {seed}"}}]}}"#
            )
            .into_bytes(),
            settings_json: br#"{"thinking":true,"effort":"high"}"#.to_vec(),
            tokens: (0..n_pos)
                .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                .collect(),
            state,
            snapshots: Vec::new(),
            sampler: SamplerConfig {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                repeat_penalty: 1.1,
                seed,
            },
            rng_state: rng.next() | 1,
        }
    }

    /// `rec` with four snapshots: a prefix of the live state (every row shared), one that
    /// leaves the live ids after 2 positions, one longer than the live state, and one whose ids
    /// are a prefix but whose rows differ after position 1 (so only 1 is shared).
    fn with_snapshots(mut rec: SessionRecord, cfg: &ModelConfig, seed: u64) -> SessionRecord {
        let mut rng = Prng(seed ^ 0x5eed);
        let width = SeqState::mla_floats_per_position(cfg);
        let n = rec.state.n_pos;
        assert!(n >= 4, "the live state has at least 4 positions");
        let mut make = |len: usize, keep: usize, rows_kept: usize| {
            let mut tokens = rec.tokens[..keep].to_vec();
            while tokens.len() < len {
                let t = if tokens.len() < n {
                    // Another id than the live state's at this position.
                    (rec.tokens[tokens.len()] + 1) % cfg.vocab_size as u32
                } else {
                    rng.below(cfg.vocab_size as u64) as u32
                };
                tokens.push(t);
            }
            let mut state = SeqState::new(cfg);
            state.n_pos = len;
            for (l, live) in state.layers.iter_mut().zip(&rec.state.layers) {
                match (l, live) {
                    (LayerState::Kda(k), _) => {
                        for x in k.s.iter_mut().chain(k.conv.iter_mut().flatten()) {
                            *x = rng.f32();
                        }
                    }
                    (LayerState::Mla(c), LayerState::Mla(lc)) => {
                        *c = lc[..rows_kept * width].to_vec();
                        c.extend((rows_kept * width..len * width).map(|_| rng.f32()));
                    }
                    _ => unreachable!("same layer map"),
                }
            }
            let logits = (0..cfg.vocab_size).map(|_| rng.f32()).collect();
            Snapshot {
                tokens,
                state,
                logits,
            }
        };
        let snaps = vec![
            make(3, 3, 3),
            make(n, 2, 2),
            make(n + 2, n, n),
            make(4, 4, 1),
        ];
        rec.snapshots = snaps;
        rec
    }

    fn bits(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    /// Bit-for-bit equality of two states.
    fn same_state(a: &SeqState, b: &SeqState) -> bool {
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

    /// Field-by-field equality with floats compared by their bits.
    fn same(a: &SessionRecord, b: &SessionRecord) -> bool {
        let layers = same_state(&a.state, &b.state)
            && a.snapshots.len() == b.snapshots.len()
            && a.snapshots.iter().zip(&b.snapshots).all(|(x, y)| {
                x.tokens == y.tokens
                    && bits(&x.logits) == bits(&y.logits)
                    && same_state(&x.state, &y.state)
            });
        let s = |c: &SamplerConfig| {
            (
                c.temperature.to_bits(),
                c.top_k,
                c.top_p.to_bits(),
                c.min_p.to_bits(),
                c.repeat_penalty.to_bits(),
                c.seed,
            )
        };
        layers
            && a.state.n_pos == b.state.n_pos
            && a.name == b.name
            && a.created_unix == b.created_unix
            && a.saved_unix == b.saved_unix
            && a.identity == b.identity
            && a.summary == b.summary
            && a.transcript_json == b.transcript_json
            && a.settings_json == b.settings_json
            && a.tokens == b.tokens
            && s(&a.sampler) == s(&b.sampler)
            && a.rng_state == b.rng_state
    }

    fn dec(bytes: &[u8], cfg: &ModelConfig) -> Result<SessionRecord, LoadError> {
        decode(&mut &bytes[..], bytes.len() as u64, cfg, &identity())
    }

    fn refusal(e: &LoadError) -> Refusal {
        e.refusal()
            .cloned()
            .unwrap_or_else(|| panic!("not a refusal: {e}"))
    }

    fn sha(path: &Path) -> [u8; 32] {
        Sha256::digest(fs::read(path).expect("read")).into()
    }

    /// `(start, tag, payload length)` of every section.
    fn sections(bytes: &[u8]) -> Vec<(usize, [u8; 4], usize)> {
        let mut out = Vec::new();
        let mut pos = HEADER_LEN as usize;
        while pos < bytes.len() {
            let tag: [u8; 4] = bytes[pos..pos + 4].try_into().unwrap();
            let len = u64::from_le_bytes(bytes[pos + 8..pos + 16].try_into().unwrap()) as usize;
            out.push((pos, tag, len));
            pos += 16 + len + 4;
        }
        assert_eq!(pos, bytes.len());
        out
    }

    /// The name a refusal uses for section `k` of a tiny-config file.
    fn section_name(cfg: &ModelConfig, k: usize) -> String {
        let fixed = [
            "identity",
            "summary",
            "transcript",
            "settings",
            "tokens",
            "sampler",
            "state layout",
        ];
        let layers = cfg.is_mla.len();
        match fixed.get(k) {
            Some(n) => n.to_string(),
            None if k < fixed.len() + layers => {
                let i = k - fixed.len();
                format!("layer {i} ({})", if cfg.is_mla[i] { "MLA" } else { "KDA" })
            }
            None if k == fixed.len() + layers => "snapshot directory".to_string(),
            None => format!("snapshot {}", k - fixed.len() - layers - 1),
        }
    }

    fn fix_header_crc(b: &mut [u8]) {
        let crc = crc32fast::hash(&b[..72]);
        b[72..76].copy_from_slice(&crc.to_le_bytes());
    }

    fn setup() -> (tempfile::TempDir, SessionStore, ModelConfig) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SessionStore::new(dir.path().join("sessions"));
        fs::create_dir_all(store.dir()).unwrap();
        (dir, store, tiny())
    }

    fn temps(store: &SessionStore) -> Vec<String> {
        fs::read_dir(store.dir())
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().into_string().ok())
            .filter(|n| parse_temp_name(n).is_some())
            .collect()
    }

    #[test]
    fn round_trip_is_bit_exact() {
        let cfg = tiny();
        for n_pos in [0, 1, 7] {
            let rec = record(&cfg, "alpha", n_pos, 11 + n_pos as u64);
            let bytes = encode(&rec).unwrap();
            assert_eq!(bytes.len() as u64, rec.encoded_len().unwrap());
            let mut streamed = Vec::new();
            assert_eq!(rec.write_to(&mut streamed).unwrap(), bytes.len() as u64);
            assert_eq!(streamed, bytes);
            let back = dec(&bytes, &cfg).unwrap();
            assert!(same(&rec, &back), "n_pos {n_pos}");
            assert_eq!(encode(&back).unwrap(), bytes);
        }
        let (_dir, store, cfg) = setup();
        let rec = record(&cfg, "alpha", 7, 5);
        let n = store.save(&rec).unwrap();
        assert_eq!(
            n,
            fs::metadata(store.path_of("alpha").unwrap()).unwrap().len()
        );
        let back = store.load("alpha", &cfg, &identity()).unwrap();
        assert!(same(&rec, &back));
        fs::copy(
            store.path_of("alpha").unwrap(),
            store.path_of("beta").unwrap(),
        )
        .unwrap();
        let copy = store.load("beta", &cfg, &identity()).unwrap();
        assert_eq!(copy.name, "beta");
        let LayerState::Kda(k) = &back.state.layers[0] else {
            panic!("layer 0 is KDA")
        };
        assert_eq!(k.s[0].to_bits(), 0x8000_0000);
        assert_eq!(k.s[1].to_bits(), 0x7fa0_0001);
        assert_eq!(k.s[2].to_bits(), 0xffc1_2345);
    }

    #[test]
    fn snapshots_round_trip_bit_exact_and_store_shared_rows_once() {
        let cfg = tiny();
        let rec = with_snapshots(record(&cfg, "snaps", 7, 21), &cfg, 21);
        let bytes = encode(&rec).unwrap();
        assert_eq!(bytes.len() as u64, rec.encoded_len().unwrap());
        let back = dec(&bytes, &cfg).unwrap();
        assert!(same(&rec, &back));
        assert_eq!(encode(&back).unwrap(), bytes);
        // Each snapshot section holds its KDA state, its logits and only the ids and rows past
        // what it shares with the live state: 3, 2, 7 and 1 positions shared.
        let width = SeqState::mla_floats_per_position(&cfg);
        let n_mla = cfg.is_mla.iter().filter(|&&m| m).count();
        let kda: usize = match &rec.state.layers[0] {
            LayerState::Kda(k) => k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>(),
            LayerState::Mla(_) => unreachable!("layer 0 is KDA"),
        } * (cfg.is_mla.len() - n_mla);
        let secs = sections(&bytes);
        assert_eq!(secs.len(), 8 + cfg.is_mla.len() + 4);
        let snap_lens: Vec<usize> = secs[secs.len() - 4..].iter().map(|s| s.2).collect();
        let want = |tail: usize| 4 * (kda + cfg.vocab_size + tail * (1 + n_mla * width));
        assert_eq!(snap_lens, vec![want(0), want(5), want(2), want(3)]);
        let without = encode(&record(&cfg, "snaps", 7, 21)).unwrap();
        assert_eq!(
            bytes.len() - without.len(),
            snap_lens.iter().map(|l| l + 20).sum::<usize>() + 4 * 24
        );
        // Through the store as well.
        let (_dir, store, cfg) = setup();
        store.save(&rec).unwrap();
        assert!(same(&rec, &store.load("snaps", &cfg, &identity()).unwrap()));
    }

    #[test]
    fn a_version_1_file_written_before_snapshots_is_read() {
        // Written by the build before format 2 (`k3 chat` on the tiny model, two turns).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sessions/v1-tiny.k3session"
        );
        let bytes = fs::read(path).unwrap();
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 1);
        let cfg = tiny();
        let mut id = [0u8; 32];
        id.copy_from_slice(&bytes[92..124]);
        let rec = decode(
            &mut &bytes[..],
            bytes.len() as u64,
            &cfg,
            &ModelIdentity { hash: id },
        )
        .unwrap();
        assert_eq!(rec.name, "v1-tiny");
        assert_eq!(rec.tokens.len(), 118);
        assert_eq!(rec.state.n_pos, 118);
        assert!(rec.snapshots.is_empty());
        // Written again, it is a version 2 file that reads back the same.
        let again = encode(&rec).unwrap();
        assert_eq!(u32::from_le_bytes(again[8..12].try_into().unwrap()), 2);
        let back = decode(
            &mut &again[..],
            again.len() as u64,
            &cfg,
            &ModelIdentity { hash: id },
        )
        .unwrap();
        assert!(same(&rec, &back));
        // A version 1 header with a snapshot directory after its layers is refused.
        let mut b = again.clone();
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&(7 + cfg.is_mla.len() as u64 + 1).to_le_bytes());
        fix_header_crc(&mut b);
        assert!(matches!(
            refusal(
                &decode(
                    &mut &b[..],
                    b.len() as u64,
                    &cfg,
                    &ModelIdentity { hash: id }
                )
                .unwrap_err()
            ),
            Refusal::Length { .. }
        ));
    }

    #[test]
    fn lying_snapshot_directories_are_refused_before_allocating() {
        let cfg = tiny();
        let rec = with_snapshots(record(&cfg, "lie", 7, 8), &cfg, 8);
        let bytes = encode(&rec).unwrap();
        let secs = sections(&bytes);
        let (dir_at, tag, dir_len) = secs[7 + cfg.is_mla.len()];
        assert_eq!(&tag, b"SNAP");
        let entry = dir_at + 16 + 8;
        let patched = |field: usize, snap: usize, v: u64| {
            let mut b = bytes.clone();
            let at = entry + 24 * snap + 8 * field;
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            let end = dir_at + 16 + dir_len;
            let crc = crc32fast::hash(&b[dir_at..end]);
            b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
            b
        };
        for (field, values) in [
            (0usize, vec![0u64, 6, 8, 1 << 40, u64::MAX]),
            (1, vec![4, 8, 1 << 40, u64::MAX]),
            (2, vec![0, 511, 513, u64::MAX]),
        ] {
            for v in values {
                let e = dec(&patched(field, 0, v), &cfg).unwrap_err();
                let r = refusal(&e);
                assert!(
                    matches!(r, Refusal::Length { .. } | Refusal::Malformed { .. }),
                    "field {field} = {v}: {r}"
                );
                assert!(e.transcript_json().is_some(), "{e}");
            }
        }
        // The count in the directory must match the header's section count.
        let mut b = bytes.clone();
        b[dir_at + 16] = 3;
        let end = dir_at + 16 + dir_len;
        let crc = crc32fast::hash(&b[dir_at..end]);
        b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            refusal(&dec(&b, &cfg).unwrap_err()),
            Refusal::Malformed { .. }
        ));
        // More snapshots than a session keeps.
        let mut b = bytes.clone();
        let n = 8 + cfg.is_mla.len() as u64 + MAX_SNAPSHOTS as u64 + 1;
        b[24..32].copy_from_slice(&n.to_le_bytes());
        fix_header_crc(&mut b);
        assert!(matches!(
            refusal(&dec(&b, &cfg).unwrap_err()),
            Refusal::Length { .. }
        ));
        // A record with too many snapshots, or one that does not fit the live state, is not
        // written.
        let mut r = rec.clone();
        r.snapshots.push(r.snapshots[0].clone());
        assert_eq!(
            encode(&r).unwrap_err(),
            RecordError::TooManySnapshots { n: 5 }
        );
        let mut r = rec.clone();
        r.snapshots[1].tokens.pop();
        assert!(matches!(
            encode(&r).unwrap_err(),
            RecordError::Snapshot { index: 1, .. }
        ));
        let mut r = rec;
        r.snapshots[2].state.layers.swap(0, 3);
        assert!(matches!(
            encode(&r).unwrap_err(),
            RecordError::Snapshot { index: 2, .. }
        ));
    }

    #[test]
    fn write_to_streams_in_bounded_chunks() {
        struct Largest(usize, u64);
        impl Write for Largest {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0 = self.0.max(buf.len());
                self.1 += buf.len() as u64;
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let cfg = tiny();
        let mut rec = record(&cfg, "big", 300, 9);
        rec.transcript_json = vec![b' '; 3 << 20];
        let mut w = Largest(0, 0);
        let n = rec.write_to(&mut w).unwrap();
        assert_eq!(n, w.1);
        assert!(w.0 <= 2 * IO_CHUNK, "largest write {}", w.0);
        assert_eq!(n, rec.encoded_len().unwrap());
    }

    #[test]
    fn wrong_magic_refused_and_file_unchanged() {
        let (_dir, store, cfg) = setup();
        let bytes = encode(&record(&cfg, "m", 7, 1)).unwrap();
        let path = store.path_of("m").unwrap();
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for magic in [
            &b"K3ST\x01\0\0\0"[..],
            b"\x89K3SESS\r",
            &[0u8; 8],
            b"\x89K3SESs\n",
        ] {
            let mut b = bytes.clone();
            b[..8].copy_from_slice(magic);
            cases.push(b);
        }
        cases.push(b"{}".to_vec());
        cases.push(b"\x89K3X".to_vec());
        for b in cases {
            fs::write(&path, &b).unwrap();
            let before = sha(&path);
            let e = store.load("m", &cfg, &identity()).unwrap_err();
            assert!(matches!(refusal(&e), Refusal::BadMagic { .. }), "{e}");
            assert!(e.to_string().contains("not a k3 session file"), "{e}");
            assert_eq!(e.exit_code(), 3);
            assert_eq!(sha(&path), before);
        }
        let mut k3st = bytes.clone();
        k3st[..4].copy_from_slice(b"K3ST");
        let e = dec(&k3st, &cfg).unwrap_err();
        assert!(e.to_string().contains("raw engine state file"), "{e}");
        fs::write(&path, b"").unwrap();
        let e = store.load("m", &cfg, &identity()).unwrap_err();
        assert_eq!(
            refusal(&e),
            Refusal::Truncated {
                at: 0,
                of: HEADER_LEN
            }
        );
        assert!(fs::read(&path).unwrap().is_empty());
    }

    #[test]
    fn every_truncation_is_refused() {
        let (_dir, store, cfg) = setup();
        let bytes = encode(&record(&cfg, "t", 7, 3)).unwrap();
        let secs = sections(&bytes);
        let (start, _, len) = secs[6];
        let limit = start + 16 + len + 4 + 64;
        let mut lens: Vec<usize> = (0..=limit).collect();
        let mut rng = Prng(99);
        for _ in 0..200 {
            lens.push(limit + rng.below((bytes.len() - limit) as u64) as usize);
        }
        let path = store.path_of("t").unwrap();
        for (i, &n) in lens.iter().enumerate() {
            // The file as the OS reports it.
            let e = decode(&mut &bytes[..n], n as u64, &cfg, &identity()).unwrap_err();
            match refusal(&e) {
                Refusal::Truncated { at, of } => {
                    assert_eq!(at, n as u64);
                    assert!(of > at);
                }
                r => panic!("length {n}: {r}"),
            }
            assert!(
                e.to_string()
                    .contains(&format!("truncated at byte {n} of ")),
                "{e}"
            );
            // A stream that ends before the length it was announced with.
            let e = decode(&mut &bytes[..n], bytes.len() as u64, &cfg, &identity()).unwrap_err();
            assert!(
                matches!(refusal(&e), Refusal::Truncated { at, .. } if at == n as u64),
                "short stream {n}: {e}"
            );
            if i % 16 == 0 || n > limit {
                fs::write(&path, &bytes[..n]).unwrap();
                let before = sha(&path);
                let e = store.load("t", &cfg, &identity()).unwrap_err();
                assert!(matches!(refusal(&e), Refusal::Truncated { .. }), "{e}");
                assert_eq!(e.exit_code(), 3);
                assert_eq!(sha(&path), before);
            }
        }
    }

    #[test]
    fn bit_flips_are_refused_and_name_the_section() {
        let (_dir, store, cfg) = setup();
        let rec = with_snapshots(record(&cfg, "f", 7, 4), &cfg, 4);
        let bytes = encode(&rec).unwrap();
        let secs = sections(&bytes);
        assert_eq!(secs.len(), 8 + cfg.num_hidden_layers + 4);
        let path = store.path_of("f").unwrap();
        for (k, &(start, _, len)) in secs.iter().enumerate() {
            let name = section_name(&cfg, k);
            let mut spots = vec![start + 16 + len / 2, start + 16 + len + 1];
            if len > 0 {
                spots.push(start + 16);
            }
            for at in spots {
                let mut b = bytes.clone();
                b[at] ^= 0x10;
                fs::write(&path, &b).unwrap();
                let before = sha(&path);
                let e = store.load("f", &cfg, &identity()).unwrap_err();
                assert_eq!(sha(&path), before);
                match refusal(&e) {
                    Refusal::Checksum { section, .. } => assert_eq!(section, name, "byte {at}"),
                    r => panic!("section {name} byte {at}: {r}"),
                }
                assert!(e.to_string().contains("checksum mismatch (stored "), "{e}");
                if k >= 3 {
                    assert_eq!(e.transcript_json(), Some(&rec.transcript_json[..]));
                } else {
                    assert!(e.transcript_json().is_none());
                }
            }
            // The section header itself: tag and length.
            for at in [start, start + 9] {
                let mut b = bytes.clone();
                b[at] ^= 0x01;
                assert!(dec(&b, &cfg).is_err(), "section {name} header byte {at}");
            }
        }
        for at in 0..HEADER_LEN as usize {
            for bit in [0, 7] {
                let mut b = bytes.clone();
                b[at] ^= 1 << bit;
                assert!(dec(&b, &cfg).is_err(), "header byte {at} bit {bit}");
            }
        }
        let mut rng = Prng(2024);
        for _ in 0..2000 {
            let at = rng.below(bytes.len() as u64) as usize;
            let mut b = bytes.clone();
            b[at] ^= 1 << rng.below(8);
            assert!(dec(&b, &cfg).is_err(), "flip at {at}");
        }
        for _ in 0..300 {
            let at = rng.below(bytes.len() as u64) as usize;
            let n = 1 + rng.below(64.min((bytes.len() - at) as u64)) as usize;
            let mut b = bytes.clone();
            for x in &mut b[at..at + n] {
                *x = rng.next() as u8;
            }
            if b != bytes {
                assert!(dec(&b, &cfg).is_err(), "overwrite {at}+{n}");
            }
        }
    }

    #[test]
    fn arbitrary_bytes_are_refused_without_panicking() {
        let cfg = tiny();
        let valid = encode(&record(&cfg, "r", 2, 12)).unwrap();
        let mut rng = Prng(31337);
        for i in 0..3000 {
            let n = rng.below(400) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            match i % 3 {
                // Random bytes after a valid magic and version.
                0 if n >= 12 => b[..12].copy_from_slice(&valid[..12]),
                // A valid header followed by noise, with the size field matching.
                1 if n >= HEADER_LEN as usize => {
                    b[..HEADER_LEN as usize].copy_from_slice(&valid[..HEADER_LEN as usize]);
                    b[16..24].copy_from_slice(&(n as u64).to_le_bytes());
                    fix_header_crc(&mut b);
                }
                _ => {}
            }
            assert!(dec(&b, &cfg).is_err(), "input {i}");
        }
    }

    #[test]
    fn a_damaged_version_field_is_reported_as_damage() {
        let cfg = tiny();
        let mut b = encode(&record(&cfg, "v", 7, 4)).unwrap();
        b[8] ^= 0x02;
        let e = dec(&b, &cfg).unwrap_err();
        assert!(
            matches!(refusal(&e), Refusal::Checksum { ref section, .. } if section == "header"),
            "{e}"
        );
    }

    #[test]
    fn lying_lengths_are_refused_before_allocating() {
        let cfg = tiny();
        let bytes = encode(&with_snapshots(record(&cfg, "l", 7, 5), &cfg, 5)).unwrap();
        let variants = |v: u64| {
            let mut out = vec![
                v.wrapping_add(1),
                v.wrapping_sub(1),
                v.wrapping_add(4),
                0,
                v.wrapping_mul(2),
                1 << 62,
                1 << 63,
                u64::MAX,
            ];
            out.retain(|&x| x != v);
            out
        };
        // Header fields: total size, section count, positions, layers, bytes per position.
        for at in [16usize, 24, 32, 40, 48] {
            let v = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
            for x in variants(v) {
                let mut b = bytes.clone();
                b[at..at + 8].copy_from_slice(&x.to_le_bytes());
                fix_header_crc(&mut b);
                let e = dec(&b, &cfg).unwrap_err();
                let r = refusal(&e);
                assert!(
                    !matches!(r, Refusal::Checksum { .. }),
                    "header byte {at} = {x}: {r}"
                );
            }
        }
        // Section length fields, with the section checksum recomputed over the original payload.
        for (k, &(start, _, len)) in sections(&bytes).iter().enumerate() {
            for x in variants(len as u64) {
                let mut b = bytes.clone();
                b[start + 8..start + 16].copy_from_slice(&x.to_le_bytes());
                let end = start + 16 + len;
                let crc = crc32fast::hash(&b[start..end]);
                b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
                let e = dec(&b, &cfg).unwrap_err();
                let r = refusal(&e);
                let fixed_size = !matches!(k, 1..=3);
                if fixed_size || x > len as u64 + 1_000_000 {
                    assert!(
                        matches!(r, Refusal::Length { .. }),
                        "section {k} length {x}: {r}"
                    );
                }
            }
        }
        // The stored flags word.
        let mut b = bytes.clone();
        b[12] = 1;
        fix_header_crc(&mut b);
        assert!(matches!(
            refusal(&dec(&b, &cfg).unwrap_err()),
            Refusal::Malformed { at: 12, .. }
        ));
    }

    #[test]
    fn a_different_config_refuses_the_state_but_offers_the_transcript() {
        let cfg = tiny();
        let rec = record(&cfg, "c", 7, 6);
        let bytes = encode(&rec).unwrap();
        let mut variants = Vec::new();
        let mut c = cfg.clone();
        c.is_mla.swap(0, 3);
        variants.push(("layer map", c));
        let mut c = cfg.clone();
        c.kv_lora_rank += 1;
        variants.push(("MLA width", c));
        let mut c = cfg.clone();
        c.kda_head_dim = 8;
        variants.push(("KDA head dim", c));
        let mut c = cfg.clone();
        c.short_conv_kernel_size = 3;
        variants.push(("conv taps", c));
        let mut c = cfg.clone();
        c.num_hidden_layers += 1;
        c.is_mla.push(false);
        variants.push(("layer count", c));
        for (what, c) in variants {
            let e = dec(&bytes, &c).unwrap_err();
            assert!(matches!(refusal(&e), Refusal::Layout { .. }), "{what}: {e}");
            assert_eq!(
                e.transcript_json(),
                Some(&rec.transcript_json[..]),
                "{what}"
            );
            assert_eq!(e.exit_code(), 3);
            assert!(e.to_string().contains("re-prefilled"), "{e}");
        }
        let mut c = cfg.clone();
        c.vocab_size = 1;
        let e = dec(&bytes, &c).unwrap_err();
        assert!(
            matches!(refusal(&e), Refusal::Malformed { ref what, .. } if what.contains("vocabulary")),
            "{e}"
        );
    }

    #[test]
    fn another_models_session_is_refused_with_both_identities() {
        let (_dir, store, cfg) = setup();
        let rec = record(&cfg, "other", 7, 7);
        store.save(&rec).unwrap();
        let path = store.path_of("other").unwrap();
        let before = sha(&path);
        let current =
            ModelIdentity::compute(b"{\"tiny\":2}", &[b"ranks", b"tokenizer_config"], b"index");
        let e = store.load("other", &cfg, &current).unwrap_err();
        assert!(matches!(refusal(&e), Refusal::Identity { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains(&identity().short()), "{text}");
        assert!(text.contains(&current.short()), "{text}");
        assert!(
            text.contains("restoring would produce fluent, wrong output"),
            "{text}"
        );
        assert_eq!(e.transcript_json(), Some(&rec.transcript_json[..]));
        assert_eq!(e.exit_code(), 3);
        assert_eq!(sha(&path), before);
    }

    #[test]
    fn other_format_versions_are_refused() {
        let (_dir, store, cfg) = setup();
        let bytes = encode(&record(&cfg, "ver", 7, 8)).unwrap();
        let path = store.path_of("ver").unwrap();
        for v in [0u32, 3, 4, u32::MAX] {
            let mut b = bytes.clone();
            b[8..12].copy_from_slice(&v.to_le_bytes());
            fix_header_crc(&mut b);
            fs::write(&path, &b).unwrap();
            let before = sha(&path);
            let e = store.load("ver", &cfg, &identity()).unwrap_err();
            assert_eq!(refusal(&e), Refusal::Version { found: v });
            assert!(
                e.to_string().contains(&format!(
                    "written by format v{v}, this build reads v1 to v2"
                )),
                "{e}"
            );
            assert_eq!(e.exit_code(), 3);
            assert_eq!(sha(&path), before);
        }
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let cfg = tiny();
        let bytes = encode(&record(&cfg, "tr", 7, 9)).unwrap();
        let mut longer = bytes.clone();
        longer.push(0);
        let e = dec(&longer, &cfg).unwrap_err();
        assert_eq!(
            refusal(&e),
            Refusal::Trailing {
                declared: bytes.len() as u64,
                actual: longer.len() as u64
            }
        );
        // A stream with more bytes than announced.
        let e = decode(&mut &longer[..], bytes.len() as u64, &cfg, &identity()).unwrap_err();
        assert!(matches!(refusal(&e), Refusal::Trailing { .. }), "{e}");
    }

    #[test]
    fn inconsistent_records_are_not_written() {
        let (_dir, store, cfg) = setup();
        let good = record(&cfg, "bad", 7, 10);
        let mut cases = Vec::new();
        let mut r = good.clone();
        r.tokens.pop();
        cases.push(r);
        let mut r = good.clone();
        r.rng_state = 0;
        cases.push(r);
        let mut r = good.clone();
        r.summary.mode = "x".repeat(MAX_MODE_LEN + 1);
        cases.push(r);
        let mut r = good.clone();
        r.summary.mode = "chat\u{1b}[2J".into();
        cases.push(r);
        let mut r = good.clone();
        r.transcript_json = vec![0xff, 0xfe];
        cases.push(r);
        let mut r = good.clone();
        r.sampler.top_p = 0.0;
        cases.push(r);
        let mut r = good.clone();
        if let Some(LayerState::Mla(c)) = r.state.layers.get_mut(3) {
            c.pop();
        }
        cases.push(r);
        for r in cases {
            assert!(encode(&r).is_err());
            let e = store.save(&r).unwrap_err();
            assert!(matches!(e, SaveError::Record { .. }), "{e}");
            assert_eq!(e.exit_code(), 5);
            assert!(!store.path_of("bad").unwrap().exists());
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Fault {
        None,
        Fail {
            at: usize,
            errno: i32,
            persistent: bool,
        },
        Crash {
            at: usize,
        },
        CrashAtByte(u64),
    }

    /// Real file operations that fail, or stop for good ("crash"), at a chosen point.
    struct FaultIo {
        fault: Fault,
        ops: usize,
        bytes: u64,
        dead: bool,
        renamed: bool,
        log: Vec<&'static str>,
    }

    impl FaultIo {
        fn new(fault: Fault) -> Self {
            FaultIo {
                fault,
                ops: 0,
                bytes: 0,
                dead: false,
                renamed: false,
                log: Vec::new(),
            }
        }

        fn step(&mut self, what: &'static str) -> io::Result<()> {
            if self.dead {
                return Err(io::Error::other("crashed"));
            }
            let k = self.ops;
            self.ops += 1;
            self.log.push(what);
            match self.fault {
                Fault::Fail {
                    at,
                    errno,
                    persistent,
                } if k == at || (persistent && k > at) => Err(io::Error::from_raw_os_error(errno)),
                Fault::Crash { at } if k == at => {
                    self.dead = true;
                    Err(io::Error::other("crashed"))
                }
                _ => Ok(()),
            }
        }
    }

    impl SaveIo for FaultIo {
        type File = File;

        fn create_new(&mut self, path: &Path) -> io::Result<File> {
            self.step("create")?;
            OsIo.create_new(path)
        }

        fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
            self.step("write")?;
            if let Fault::CrashAtByte(off) = self.fault {
                if self.bytes + buf.len() as u64 > off {
                    file.write_all(&buf[..(off - self.bytes) as usize])?;
                    self.dead = true;
                    return Err(io::Error::other("crashed"));
                }
            }
            file.write_all(buf)?;
            self.bytes += buf.len() as u64;
            Ok(())
        }

        fn sync(&mut self, file: &mut File) -> io::Result<()> {
            self.step("sync")?;
            file.sync_all()
        }

        fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
            self.step("rename")?;
            fs::rename(from, to)?;
            self.renamed = true;
            Ok(())
        }

        fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
            self.step("sync_dir")?;
            OsIo.sync_dir(dir)
        }

        fn remove(&mut self, path: &Path) -> io::Result<()> {
            self.step("remove")?;
            fs::remove_file(path)
        }
    }

    #[test]
    fn failed_or_interrupted_saves_leave_the_old_or_the_new_session() {
        let (_dir, store, cfg) = setup();
        let old = record(&cfg, "run", 7, 1);
        let new = record(&cfg, "run", 150, 2);
        store.save(&old).unwrap();
        let mut probe = FaultIo::new(Fault::None);
        store.save_with(&new, &mut probe).unwrap();
        let n_ops = probe.ops;
        assert_eq!(probe.log.first(), Some(&"create"));
        assert_eq!(&probe.log[n_ops - 3..], &["sync", "rename", "sync_dir"]);
        let mut cases = Vec::new();
        for at in 0..n_ops {
            for errno in [28, 5] {
                for persistent in [false, true] {
                    cases.push(Fault::Fail {
                        at,
                        errno,
                        persistent,
                    });
                }
            }
            cases.push(Fault::Crash { at });
        }
        let total = new.encoded_len().unwrap();
        let mut rng = Prng(77);
        for _ in 0..200 {
            cases.push(Fault::CrashAtByte(rng.below(total)));
        }
        let (mut olds, mut news, mut removed_total) = (0, 0, 0);
        for fault in cases {
            store.save(&old).unwrap();
            let mut io = FaultIo::new(fault);
            let e = store.save_with(&new, &mut io).unwrap_err();
            assert_eq!(e.exit_code(), 5);
            let text = e.to_string();
            assert!(text.contains("NOT saved"), "{text}");
            if let Fault::Fail { errno: 28, .. } = fault {
                assert!(text.contains("disk full (need "), "{text}");
            }
            let loaded = store
                .load("run", &cfg, &identity())
                .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
            if io.renamed {
                assert!(same(&loaded, &new), "{fault:?}: expected the new session");
                news += 1;
            } else {
                assert!(same(&loaded, &old), "{fault:?}: expected the old session");
                assert!(
                    text.contains("the previous session file is intact"),
                    "{text}"
                );
                olds += 1;
            }
            if let Fault::Fail {
                persistent: false, ..
            } = fault
            {
                assert!(temps(&store).is_empty(), "{fault:?}: temp file left");
            }
            let removed = store.remove_stale_temps().unwrap();
            assert!(removed <= 1);
            if let Fault::CrashAtByte(_) = fault {
                assert_eq!(
                    removed, 1,
                    "{fault:?}: the partial file should be left behind"
                );
            }
            removed_total += removed;
            assert!(temps(&store).is_empty(), "{fault:?}: temp file left");
        }
        assert!(olds > 200 && news > 0, "old {olds}, new {news}");
        eprintln!(
            "{n_ops} save steps; {olds} faults left the old session, {news} the new; \
             {removed_total} stale temporary files removed"
        );
    }

    #[test]
    #[cfg(unix)]
    fn a_link_at_the_target_is_replaced_not_followed() {
        let (dir, store, cfg) = setup();
        let sentinel = dir.path().join("sentinel.txt");
        fs::write(&sentinel, b"outside the session directory").unwrap();
        let before = sha(&sentinel);
        let target = store.path_of("victim").unwrap();
        std::os::unix::fs::symlink(&sentinel, &target).unwrap();
        let e = store.load("victim", &cfg, &identity()).unwrap_err();
        assert!(matches!(e, LoadError::NotRegular { .. }), "{e}");
        let rec = record(&cfg, "victim", 7, 3);
        store.save(&rec).unwrap();
        assert_eq!(sha(&sentinel), before);
        assert!(fs::symlink_metadata(&target).unwrap().file_type().is_file());
        assert!(same(
            &store.load("victim", &cfg, &identity()).unwrap(),
            &rec
        ));
        // A link planted at the lock file is not written through either.
        std::os::unix::fs::symlink(&sentinel, store.dir().join(".victim2.lock")).unwrap();
        let mut rec2 = rec.clone();
        rec2.name = "victim2".into();
        let e = store.save(&rec2).unwrap_err();
        assert!(
            matches!(
                e,
                SaveError::Io {
                    step: SaveStep::Lock,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(sha(&sentinel), before);
    }

    #[test]
    fn bad_names_are_refused() {
        let (_dir, store, cfg) = setup();
        let long = "a".repeat(65);
        for name in [
            "",
            "a/b",
            "/etc/passwd",
            "..",
            "../x",
            "a..b",
            ".hidden",
            "a\0b",
            "a b",
            "é",
            "a\u{1b}[31m",
            "a\\b",
            &long,
        ] {
            assert!(validate_name(name).is_err(), "{name:?}");
            let mut rec = record(&cfg, "x", 1, 1);
            rec.name = name.to_string();
            let e = store.save(&rec).unwrap_err();
            assert!(matches!(e, SaveError::BadName(_)), "{name:?}: {e}");
            assert_eq!(e.exit_code(), 2);
            assert!(!e.to_string().contains('\u{1b}'));
            let e = store.load(name, &cfg, &identity()).unwrap_err();
            assert!(matches!(e, LoadError::BadName(_)), "{name:?}: {e}");
        }
        assert!(fs::read_dir(store.dir()).unwrap().next().is_none());
        for name in ["a", "my-session_1.v2", &"z".repeat(64)] {
            assert!(validate_name(name).is_ok(), "{name:?}");
        }
        let e = store.load("absent", &cfg, &identity()).unwrap_err();
        assert!(matches!(e, LoadError::NotFound { .. }), "{e}");
        assert_eq!(e.exit_code(), 2);
    }

    /// Runs a second save of the same session while the first holds the lock.
    struct NestedSave<'a> {
        store: &'a SessionStore,
        other: &'a SessionRecord,
        result: Option<Result<u64, SaveError>>,
    }

    impl SaveIo for NestedSave<'_> {
        type File = File;

        fn create_new(&mut self, path: &Path) -> io::Result<File> {
            self.result = Some(self.store.save(self.other));
            OsIo.create_new(path)
        }

        fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
            OsIo.write(file, buf)
        }

        fn sync(&mut self, file: &mut File) -> io::Result<()> {
            OsIo.sync(file)
        }

        fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
            OsIo.rename(from, to)
        }

        fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
            OsIo.sync_dir(dir)
        }

        fn remove(&mut self, path: &Path) -> io::Result<()> {
            OsIo.remove(path)
        }
    }

    #[test]
    fn a_second_writer_gets_session_in_use() {
        let (_dir, store, cfg) = setup();
        let first = record(&cfg, "shared", 7, 1);
        let second = record(&cfg, "shared", 8, 2);
        let mut io = NestedSave {
            store: &store,
            other: &second,
            result: None,
        };
        store.save_with(&first, &mut io).unwrap();
        let e = io.result.unwrap().unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, SaveError::InUse { .. }), "{text}");
        assert!(text.contains("session in use by pid "), "{text}");
        assert!(text.contains(&std::process::id().to_string()), "{text}");
        assert_eq!(e.exit_code(), 5);
        assert!(same(
            &store.load("shared", &cfg, &identity()).unwrap(),
            &first
        ));
    }

    #[test]
    fn a_held_session_lock_refuses_every_other_claim_until_dropped() {
        let (_dir, store, cfg) = setup();
        let first = record(&cfg, "held", 7, 1);
        let lock = store.lock("held").unwrap();
        assert_eq!(lock.name(), "held");
        // Saves through the claim go through; everyone else is refused with the holder's pid.
        store.save_locked(&first, &lock).unwrap();
        let e = store.lock("held").unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, LockError::InUse { .. }), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        assert_eq!(e.exit_code(), 2);
        let e = store.save(&record(&cfg, "held", 8, 2)).unwrap_err();
        assert!(matches!(e, SaveError::InUse { .. }), "{e}");
        // A claim on another name does not cover this one.
        let other = store.lock("other").unwrap();
        let e = store
            .save_locked(&record(&cfg, "held", 8, 2), &other)
            .unwrap_err();
        assert!(matches!(e, SaveError::InUse { .. }), "{e}");
        assert!(same(
            &store.load("held", &cfg, &identity()).unwrap(),
            &first
        ));
        drop(lock);
        let again = store.lock("held").unwrap();
        assert!(again.is_held());
        assert!(store.exists("held") && !store.exists("other"));
        let bad = store.lock("../x").unwrap_err();
        assert_eq!(bad.exit_code(), 2);
    }

    #[test]
    fn new_names_skip_saved_and_locked_sessions() {
        let (_dir, store, cfg) = setup();
        store.save(&record(&cfg, "talk", 3, 1)).unwrap();
        let held = store.lock("talk-2").unwrap();
        let first = store.claim_new("talk").unwrap().unwrap();
        assert_eq!(first.name(), "talk-3");
        let second = store.claim_new("talk").unwrap().unwrap();
        assert_eq!(second.name(), "talk-4");
        drop((held, first));
        let third = store.claim_new("talk").unwrap().unwrap();
        assert_eq!(third.name(), "talk-2");
        assert!(store.claim_new("../up").is_err());
    }

    #[test]
    fn racing_writers_and_readers_see_only_whole_sessions() {
        let (_dir, store, cfg) = setup();
        let store = Arc::new(store);
        let cfg = Arc::new(cfg);
        let records: Arc<Vec<SessionRecord>> = Arc::new(
            (0..4u64)
                .flat_map(|t| (0..8u64).map(move |i| (t, i)))
                .map(|(t, i)| record(&cfg, "race", 5 + (i as usize % 3), 100 * t + i))
                .collect(),
        );
        store.save(&records[0]).unwrap();
        let barrier = Arc::new(Barrier::new(5));
        let mut handles = Vec::new();
        for t in 0..4usize {
            let (store, records, barrier) = (store.clone(), records.clone(), barrier.clone());
            handles.push(std::thread::spawn(move || {
                barrier.wait();
                let mut wins = 0;
                for rec in &records[t * 8..t * 8 + 8] {
                    match store.save(rec) {
                        Ok(_) => wins += 1,
                        Err(SaveError::InUse { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                wins
            }));
        }
        let reader = {
            let (store, records, cfg, barrier) =
                (store.clone(), records.clone(), cfg.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..100 {
                    let got = store.load("race", &cfg, &identity()).unwrap();
                    assert!(records.iter().any(|r| same(r, &got)));
                }
            })
        };
        let wins: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        reader.join().unwrap();
        assert!(wins >= 1);
        let last = store.load("race", &cfg, &identity()).unwrap();
        assert!(records.iter().any(|r| same(r, &last)));
        assert!(temps(&store).is_empty());
    }

    #[test]
    fn list_reports_size_per_position() {
        let (_dir, store, cfg) = setup();
        store.save(&record(&cfg, "a", 7, 1)).unwrap();
        store.save(&record(&cfg, "b", 8, 2)).unwrap();
        store.save(&record(&cfg, "c", 0, 3)).unwrap();
        fs::write(store.dir().join("junk.k3session"), b"not a session").unwrap();
        fs::write(store.dir().join(".a.k3session.tmp.1.1"), b"partial").unwrap();
        let list = store.list().unwrap();
        let names: Vec<&str> = list.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names.len(), 4, "{names:?}");
        let get = |n: &str| list.iter().find(|i| i.name == n).unwrap();
        let (a, b, c) = (get("a"), get("b"), get("c"));
        let width = SeqState::mla_floats_per_position(&cfg) as u64;
        let n_mla = cfg.is_mla.iter().filter(|&&m| m).count() as u64;
        let per_position = 4 + 4 * n_mla * width;
        assert_eq!(per_position, 644);
        assert_eq!(a.bytes_per_position, per_position);
        assert_eq!(b.bytes - a.bytes, per_position);
        assert_eq!(a.bytes - c.bytes, 7 * per_position);
        assert_eq!((a.positions, b.positions, c.positions), (7, 8, 0));
        assert_eq!(c.bytes_per_position, 0);
        assert_eq!(a.turns, 3);
        assert_eq!(a.mode, "chat");
        assert_eq!(a.identity, Some(identity()));
        assert_eq!(
            a.bytes,
            fs::metadata(store.path_of("a").unwrap()).unwrap().len()
        );
        assert!(a.problem.is_none());
        assert_eq!(b.saved_unix, 1_700_000_102);
        assert!(get("junk")
            .problem
            .as_deref()
            .unwrap()
            .contains("not a k3 session"));
        eprintln!(
            "tiny config: {} bytes at 0 positions, {} at 7, {} bytes per position",
            c.bytes, a.bytes, a.bytes_per_position
        );
    }

    #[test]
    fn stale_temps_are_removed_unless_their_session_is_locked() {
        let (_dir, store, _cfg) = setup();
        let d = store.dir().to_path_buf();
        for f in [
            ".x.k3session.tmp.123.4",
            ".y.k3session.tmp.1.2",
            ".z.k3session.tmp.9.9",
            ".hidden",
            "foo.tmp",
            ".x.k3session.tmp.abc.1",
        ] {
            fs::write(d.join(f), b"partial").unwrap();
        }
        let held = acquire_lock(&store.lock_path("z")).unwrap();
        assert!(matches!(held, Lock::Held(_)));
        assert_eq!(store.remove_stale_temps().unwrap(), 2);
        assert!(d.join(".z.k3session.tmp.9.9").exists());
        assert!(d.join(".hidden").exists());
        assert!(d.join("foo.tmp").exists());
        assert!(d.join(".x.k3session.tmp.abc.1").exists());
        drop(held);
        assert_eq!(store.remove_stale_temps().unwrap(), 1);
        assert_eq!(
            SessionStore::new(d.join("missing"))
                .remove_stale_temps()
                .unwrap(),
            0
        );
    }

    #[test]
    fn default_dir_honours_the_environment_override() {
        assert_eq!(
            sessions_dir_from(Some("/data/k3".into())),
            PathBuf::from("/data/k3/sessions")
        );
        let platform = sessions_dir_from(None);
        assert!(platform.ends_with("sessions"));
        assert_eq!(sessions_dir_from(Some(OsString::new())), platform);
    }

    #[test]
    fn identity_is_length_prefixed() {
        let a = ModelIdentity::compute(b"ab", &[b"c"], b"");
        assert_ne!(a, ModelIdentity::compute(b"a", &[b"bc"], b""));
        assert_ne!(a, ModelIdentity::compute(b"ab", &[b"c", b""], b""));
        assert_ne!(a, ModelIdentity::compute(b"ab", &[], b"c"));
        assert_eq!(a, ModelIdentity::compute(b"ab", &[b"c"], b""));
        assert_eq!(a.short().len(), 12);
        assert!(a.to_hex().starts_with(&a.short()));
    }
}
