//! Saved sessions: one conversation's history text, render settings, token ids, carried engine
//! state, sampler settings and generator word, in a versioned and checksummed file, plus the
//! directory store that writes those files atomically under an advisory lock (docs/sessions.md#session-file-format,
//! docs/runtime.md#state-between-turns).
//!
//! [`format`] holds the record and the file format's constants, [`encode`] and [`decode`] the
//! codec, [`error`] the errors, [`lock`] the advisory locks and [`dir`] the directory store.

pub mod decode;
pub mod dir;
pub mod encode;
pub mod error;
pub mod format;
pub mod lock;

pub use super::naming::{validate_name, NameError, MAX_NAME_LEN};
pub use decode::decode;
pub use dir::{JournalInfo, OsIo, SaveIo, SessionInfo, SessionStore};
pub use encode::encode;
pub use error::{LoadError, LockError, RecordError, Refusal, SaveError, SaveStep, WriteError};
pub use format::{
    ModelIdentity, SessionRecord, Summary, DATA_DIR_ENV, EXTENSION, FORMAT_VERSION, HEADER_LEN,
    MAGIC, MAX_MODE_LEN, MAX_SNAPSHOTS, OLDEST_VERSION,
};
pub use lock::SessionLock;

#[cfg(test)]
mod tests;
