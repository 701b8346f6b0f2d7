//! The crate-level error: one enum composed of each module's typed error, with the process exit
//! code each kind maps to (see docs/reliability.md#exit-codes).

use crate::engine::config::ConfigError;
use crate::engine::sampling::SampleError;
use crate::engine::weights::{BindError, LoadError};
use crate::session::tokenizer::TokenizerError;
use crate::stream::StreamError;

/// Any failure k3 reports to a user.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `config.json` is missing, unreadable, or refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A checkpoint file failed validation or could not be read.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The checkpoint's tensors do not fit the configured graph.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// A packed trunk could not be written or used.
    #[error(transparent)]
    Trunk(#[from] crate::stream::trunk::TrunkError),
    /// The tokenizer files were refused or a token could not be decoded.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Sampling failed (non-finite logits, bad settings).
    #[error(transparent)]
    Sample(#[from] SampleError),
    /// The model directory's `generation_config.json` was refused.
    #[error(transparent)]
    GenerationConfig(#[from] crate::session::defaults::GenerationConfigError),
    /// A bad command-line value or combination.
    #[error("{0}")]
    Usage(String),
    /// An output file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file being written.
        path: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
}

impl Error {
    /// Exit status for this error: 1 runtime failure, 2 usage/config refusal, 3 an input file
    /// failed validation.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(e) => e.exit_code(),
            Error::Stream(e) => e.exit_code(),
            Error::Bind(_) | Error::Tokenizer(_) => 3,
            Error::Trunk(e) => e.exit_code(),
            Error::GenerationConfig(e) => e.exit_code(),
            Error::Sample(_) => 4,
            Error::Write { .. } => 1,
            Error::Usage(_) => 2,
        }
    }
}

/// Result with the crate error.
pub type Result<T> = std::result::Result<T, Error>;

/// A model that could not be loaded: each cause as its own kind; a budget below what the model
/// needs is a usage error.
impl From<LoadError> for Error {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Config(e) => e.into(),
            LoadError::Stream(e) => e.into(),
            LoadError::Bind(e) => e.into(),
            LoadError::Budget(m) => Error::Usage(m),
            LoadError::Trunk(e) => e.into(),
        }
    }
}
