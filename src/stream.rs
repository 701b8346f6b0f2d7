//! Everything that touches checkpoint files: shard discovery, header validation, the compact
//! tensor index, and positioned reads of tensor bytes.
//!
//! Weights are read with positioned reads (`pread`), never memory-mapped, so a file that is
//! truncated or shrinks while k3 runs produces an error, not a SIGBUS. Every shard is validated
//! in full when the checkpoint is opened.

pub mod alloc;
pub mod arena;
pub mod atomic;
pub mod budget;
pub mod bytes;
pub mod cache_policy;
pub mod checkpoint;
pub mod codec;
pub mod index;
pub mod mapped;
pub mod ring;
pub mod safetensors;
pub mod stats;
pub mod trial;
pub mod trunk;
pub mod verify;
pub mod weight_map;

pub use checkpoint::{Checkpoint, TensorData};
pub use index::{TensorIndex, TensorInfo};
pub use safetensors::{Dtype, HeaderError};

use std::path::PathBuf;

/// A path for a message, with control characters escaped (`\u{1b}`): shard names come from
/// the index and the directory listing, so they must not reach the terminal raw.
#[must_use]
pub fn shown(path: &std::path::Path) -> String {
    let text = path.display().to_string();
    if !text.chars().any(char::is_control) {
        return text;
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// What a non-regular file is, for messages.
#[must_use]
pub fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a plain file"
    }
}

/// The most entries an error message lists; the rest are counted.
pub const MAX_LISTED: usize = 20;

/// `items` joined with ", ", at most [`MAX_LISTED`] of them, then "and N more".
#[must_use]
pub fn join_listed(items: &[String]) -> String {
    let mut s = items
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > MAX_LISTED {
        s.push_str(&format!(" and {} more", items.len() - MAX_LISTED));
    }
    s
}

/// Open an input file for reading, refusing anything but a regular file: a FIFO, a socket, a
/// device or a directory is an `io::Error` of kind `InvalidInput` saying what it is. The open
/// never blocks (a FIFO without a writer would block a plain open forever): it is made with
/// `O_NONBLOCK`, and the kind is taken from the opened descriptor, so a file swapped between a
/// look and the open is still caught. Returns the file and its size.
pub fn open_regular(path: &std::path::Path) -> std::io::Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("is {}, not a regular file", file_kind(meta.file_type())),
        ));
    }
    Ok((file, meta.len()))
}

/// Read a whole small input file (a config, an index, a journal), refusing one that is not a
/// regular file ([`open_regular`]) and one above `limit` bytes by its size before reading (and
/// by reading at most one byte past the limit, should it grow meanwhile). The size refusal is
/// an `io::Error` of kind `FileTooLarge` with both numbers.
pub fn read_capped(path: &std::path::Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let too_large = |size: &str| {
        std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("{size}, above the limit of {limit} bytes"),
        )
    };
    let (file, len) = open_regular(path)?;
    if len > limit {
        return Err(too_large(&format!("the file is {len} bytes")));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_large("it holds more"));
    }
    Ok(bytes)
}

/// The layer index and the rest of a per-layer tensor name
/// (`language_model.model.layers.L.REST` → `(L, REST)`), or None for any other name.
#[must_use]
pub fn layer_tensor(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("language_model.model.layers.")?;
    let (il, tail) = rest.split_once('.')?;
    Some((il.parse().ok()?, tail))
}

/// A checkpoint file could not be opened, failed validation, or could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A file could not be opened or its size read.
    #[error("{}: {source}", shown(.path))]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A shard header failed validation.
    #[error("{}: {source}", shown(.path))]
    Header {
        /// The shard.
        path: PathBuf,
        /// What is wrong with its header.
        source: HeaderError,
    },
    /// `model.safetensors.index.json` is malformed or disagrees with the shards.
    #[error("{path}: {reason}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Shards named by the index are missing (the first [`MAX_LISTED`] listed, all counted).
    #[error("{dir}: {} missing shard(s): {}", .files.len(), join_listed(.files))]
    MissingShards {
        /// The model directory.
        dir: PathBuf,
        /// Every missing file (escaped), with how many tensors need it.
        files: Vec<String>,
    },
    /// A shard path exists but is not a regular file (a FIFO, a directory, a device...).
    #[error("{}: is {kind}, not a regular file; a shard must be a regular file", shown(.path))]
    NotRegular {
        /// The shard path.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a directory", ...).
        kind: &'static str,
    },
    /// No safetensors file was found.
    #[error("{dir}: no model.safetensors, model.safetensors.index.json or *.safetensors file")]
    NoShards {
        /// The model directory.
        dir: PathBuf,
    },
    /// The same tensor name appears in two shards.
    #[error("duplicate tensor {name:?} (in {first:?} and {second:?})")]
    DuplicateTensor {
        /// The tensor.
        name: String,
        /// First shard.
        first: String,
        /// Second shard.
        second: String,
    },
    /// A tensor name that is not in the checkpoint was requested.
    #[error("tensor {0:?} is not in the checkpoint")]
    NoSuchTensor(String),
    /// The index cannot represent an entry (a dimension above u32, too many shards or names).
    #[error("{}: tensor {name:?}: {reason}", shown(.path))]
    Unrepresentable {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Why.
        reason: String,
    },
    /// Bytes read back intact that do not decode (a corrupt encoded trunk block).
    #[error("{}: {what}: {reason}", shown(.path))]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was being decoded.
        what: String,
        /// Why it was refused.
        reason: String,
    },
    /// A read failed or came back short (file shrank, I/O error).
    #[error("read error in {} at byte {offset} ({len} bytes for {name:?}): {source}",
        shown(.path))]
    Read {
        /// The shard.
        path: PathBuf,
        /// Absolute offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u64,
        /// The tensor being read.
        name: String,
        /// The OS error (UnexpectedEof for a short read).
        source: std::io::Error,
    },
}

impl StreamError {
    /// Exit status: 1 for a runtime read failure, 3 for a file that failed validation.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            StreamError::Read { .. } => 1,
            _ => 3,
        }
    }
}
