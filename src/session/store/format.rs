//! What a session file holds: the model identity, the record, and the format's constants.
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

use crate::session::naming::MAX_NAME_LEN;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::engine::sampling::SamplerConfig;
use crate::engine::state::{SeqState, Snapshot};

/// First eight bytes of every session file.
pub const MAGIC: [u8; 8] = *b"\x89K3SESS\n";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest format version this build reads (version 1: no snapshots).
pub const OLDEST_VERSION: u32 = 1;
/// Most snapshots a file may hold: those a chat keeps, which the engine's plan reserves room
/// for.
pub const MAX_SNAPSHOTS: usize = crate::session::chat::SNAPSHOTS;
/// Size of the fixed file header.
pub const HEADER_LEN: u64 = 76;
/// File-name extension of session files inside the store.
pub const EXTENSION: &str = "k3session";
/// Environment variable that replaces the per-user data directory.
pub const DATA_DIR_ENV: &str = "K3_DATA_DIR";
/// Longest summary mode string, in bytes.
pub const MAX_MODE_LEN: usize = 256;

pub(super) const SECTION_HEAD: u64 = 16;
pub(super) const SECTION_CRC: u64 = 4;
pub(super) const IDENTITY_LEN: u64 = 32;
pub(super) const SAMPLER_LEN: u64 = 40;
pub(super) const LAYER_DESC_LEN: u64 = 40;
pub(super) const SUMMARY_MIN: u64 = 12;
pub(super) const SUMMARY_MAX: u64 = SUMMARY_MIN + MAX_NAME_LEN as u64 + MAX_MODE_LEN as u64;
pub(super) const FIXED_SECTIONS: u64 = 7;
pub(super) const SNAP_DIR_HEAD: u64 = 8;
pub(super) const SNAP_DESC_LEN: u64 = 24;
pub(super) const IO_CHUNK: usize = 64 * 1024;
pub(super) const KIND_KDA: u32 = 0;
pub(super) const KIND_MLA: u32 = 1;

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

pub(super) fn hex(bytes: &[u8]) -> String {
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

pub(super) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
