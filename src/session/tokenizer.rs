//! placeholder (replaced by the tokenizer module)
/// e
#[derive(Debug, thiserror::Error)]
#[error("tokenizer")]
pub struct TokenizerError;
