//! The tokenizer's errors: every refusal of a damaged rank file or configuration, named with its
//! file, line and what was expected, and the decoding errors.

use super::NUM_SPECIAL_TOKENS;
use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer or decoding ids.
///
/// File-derived text is quoted with Rust escaping (`{:?}`), so control
/// characters and odd bytes in a damaged file cannot garble the terminal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The file could not be opened or read (including "not found").
    #[error("{}: cannot read file: {source}", .path.display())]
    Io {
        /// File involved.
        path: PathBuf,
        /// Underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// The file is larger than any legitimate tokenizer file.
    #[error("{}: expected at most {limit} bytes, found {size} bytes", .path.display())]
    FileTooLarge {
        /// File involved.
        path: PathBuf,
        /// Size limit in bytes.
        limit: u64,
        /// Actual size in bytes.
        size: u64,
    },

    /// The file is empty or holds only blank lines.
    #[error("{}: expected {expected}, found an empty file", .path.display())]
    EmptyFile {
        /// File involved.
        path: PathBuf,
        /// What the file should contain.
        expected: &'static str,
    },

    /// The file is a Git LFS pointer, not the real content.
    #[error(
        "{}: line {line}: expected {expected}, found a Git LFS pointer \
         (fetch the real file, e.g. `git lfs pull`)",
        .path.display()
    )]
    LfsPointer {
        /// File involved.
        path: PathBuf,
        /// Line of the LFS header.
        line: usize,
        /// What the file should contain.
        expected: &'static str,
    },

    /// The file is an HTML page (typically an error or login page saved by
    /// a failed download).
    #[error(
        "{}: line {line}: expected {expected}, found an HTML page \
         (the download probably failed; fetch the raw file)",
        .path.display()
    )]
    HtmlPage {
        /// File involved.
        path: PathBuf,
        /// Line where the HTML starts.
        line: usize,
        /// What the file should contain.
        expected: &'static str,
    },

    /// A rank-file line is longer than any token could need.
    #[error(
        "{}: line {line}: expected at most {limit} bytes per line, found {found} bytes",
        .path.display()
    )]
    LineTooLong {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
        /// Limit in bytes.
        limit: usize,
        /// Actual line length in bytes.
        found: usize,
    },

    /// A rank-file line lacks the single space between token and rank.
    #[error(
        "{}: line {line}: expected `<base64 token> <decimal rank>` separated by one space, \
         found {found:?}",
        .path.display()
    )]
    MissingSeparator {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
        /// The offending line (possibly shortened).
        found: String,
    },

    /// The token field is not valid standard padded base64.
    #[error(
        "{}: line {line}: expected standard padded base64 token bytes, found {found:?} ({reason})",
        .path.display()
    )]
    BadBase64 {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
        /// The token field (possibly shortened).
        found: String,
        /// Decoder diagnosis.
        reason: String,
    },

    /// The token field decodes to zero bytes.
    #[error("{}: line {line}: expected at least one token byte, found an empty token", .path.display())]
    EmptyToken {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
    },

    /// The rank field is not an unsigned decimal integer.
    #[error("{}: line {line}: expected {expected}, found rank {found:?}", .path.display())]
    BadRank {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
        /// What a rank must look like.
        expected: &'static str,
        /// The rank field (possibly shortened).
        found: String,
    },

    /// The rank is too large to be a token id.
    #[error("{}: line {line}: expected a rank of at most {limit}, found rank {found}", .path.display())]
    RankOutOfRange {
        /// File involved.
        path: PathBuf,
        /// One-based line number.
        line: usize,
        /// Largest accepted rank.
        limit: u64,
        /// The rank field as written.
        found: String,
    },

    /// Two lines carry the same rank.
    #[error(
        "{}: line {line}: expected each rank once, found rank {rank} again (first on line {first_line})",
        .path.display()
    )]
    DuplicateRank {
        /// File involved.
        path: PathBuf,
        /// Line of the repeated rank.
        line: usize,
        /// The repeated rank.
        rank: u32,
        /// Line where the rank first appeared.
        first_line: usize,
    },

    /// Two lines carry the same token bytes.
    #[error(
        "{}: line {line}: expected each token once, found token bytes {found} again \
         (rank {first_rank} on line {first_line})",
        .path.display()
    )]
    DuplicateToken {
        /// File involved.
        path: PathBuf,
        /// Line of the repeated token.
        line: usize,
        /// The token bytes, escaped.
        found: String,
        /// Rank the token first received.
        first_rank: u32,
        /// Line where the token first appeared.
        first_line: usize,
    },

    /// Ranks are unique but do not cover 0..N-1 for N entries.
    #[error(
        "{}: line {line}: expected ranks dense over 0..={} ({entries} entries), \
         found rank {found}; rank {missing} is missing",
        .path.display(),
        .entries.saturating_sub(1)
    )]
    RankGap {
        /// File involved.
        path: PathBuf,
        /// Line of the first rank that lies outside 0..N-1.
        line: usize,
        /// Number of entries in the file.
        entries: usize,
        /// That rank.
        found: u32,
        /// Smallest rank in 0..N-1 that no line carries.
        missing: u32,
    },

    /// One of the 256 single bytes has no token, so byte fallback fails.
    #[error(
        "{}: expected a token for every single byte, found none for byte 0x{byte:02x} \
         ({entries} entries over {lines} lines)",
        .path.display()
    )]
    MissingByte {
        /// File involved.
        path: PathBuf,
        /// The byte without a token.
        byte: u8,
        /// Number of entries in the file.
        entries: usize,
        /// Number of lines read.
        lines: usize,
    },

    /// The vocabulary size differs from the one the caller expected.
    #[error(
        "{}: expected {expected} ids ({} ranks + {} specials), found {found} ids",
        .path.display(),
        .expected.saturating_sub(NUM_SPECIAL_TOKENS),
        NUM_SPECIAL_TOKENS
    )]
    VocabMismatch {
        /// Rank file involved.
        path: PathBuf,
        /// Expected total vocabulary size.
        expected: u32,
        /// Actual total vocabulary size.
        found: u32,
    },

    /// The configuration is not valid JSON or lacks a required field.
    #[error("{}: expected {expected}: {message}", .path.display())]
    ConfigJson {
        /// File involved.
        path: PathBuf,
        /// One-based line of the parse error.
        line: usize,
        /// One-based column of the parse error.
        column: usize,
        /// What the file should contain.
        expected: &'static str,
        /// Parser diagnosis, including line and column.
        message: String,
    },

    /// An `added_tokens_decoder` key is not a canonical decimal id.
    #[error(
        "{}: added_tokens_decoder: expected a decimal token id as key, found {found:?}",
        .path.display()
    )]
    SpecialBadKey {
        /// File involved.
        path: PathBuf,
        /// The key as written (possibly shortened).
        found: String,
    },

    /// An `added_tokens_decoder` key appears twice.
    #[error(
        "{}: added_tokens_decoder: expected each id once, found id {id} again (content {found:?})",
        .path.display()
    )]
    SpecialDuplicateId {
        /// File involved.
        path: PathBuf,
        /// The repeated id.
        id: u64,
        /// Content of the repeated entry (possibly shortened).
        found: String,
    },

    /// A special token id lies outside the special range N..N+256.
    #[error(
        "{}: added_tokens_decoder: expected ids in {start}..{end}, found id {id} (content {found:?})",
        .path.display()
    )]
    SpecialOutOfRange {
        /// File involved.
        path: PathBuf,
        /// The offending id.
        id: u64,
        /// First special id (N).
        start: u32,
        /// One past the last special id (N + 256).
        end: u32,
        /// Content of the entry (possibly shortened).
        found: String,
    },

    /// A special token has empty content.
    #[error("{}: added_tokens_decoder: expected non-empty content for id {id}, found \"\"", .path.display())]
    SpecialEmptyName {
        /// File involved.
        path: PathBuf,
        /// The offending id.
        id: u32,
    },

    /// Two special slots end up with the same string.
    #[error(
        "{}: special tokens: expected unique strings, found {found:?} for both id {first_id} and id {id}",
        .path.display()
    )]
    SpecialDuplicateName {
        /// File involved.
        path: PathBuf,
        /// The shared string (possibly shortened).
        found: String,
        /// First id with that string.
        first_id: u32,
        /// Second id with that string.
        id: u32,
    },

    /// A special token's string equals the bytes of a BPE rank.
    #[error(
        "{}: special tokens: expected strings distinct from BPE tokens, found {found:?} \
         for id {id}, which is also rank {rank}",
        .path.display()
    )]
    SpecialCollidesWithRank {
        /// File involved.
        path: PathBuf,
        /// The special id.
        id: u32,
        /// Its string (possibly shortened).
        found: String,
        /// The BPE rank with the same bytes.
        rank: u32,
    },

    /// The BPE core could not be built (pattern compilation failure).
    #[error("tokenizer core: {message}")]
    Core {
        /// Diagnosis from the BPE core.
        message: String,
    },

    /// A token id outside the vocabulary was given for decoding.
    #[error("token id {id} is outside the vocabulary (expected an id below {vocab_size})")]
    UnknownId {
        /// The offending id.
        id: u32,
        /// Total vocabulary size.
        vocab_size: u32,
    },
}
