//! Kimi K3 tokenizer: loading and validating `tiktoken.model` and
//! `tokenizer_config.json`, the vocabulary layout (N BPE ranks followed by
//! 256 special ids), encoding with the release's input chunking and
//! pre-tokenizer pattern, byte-level decoding, and incremental UTF-8
//! decoding for streamed output.
//!
//! The BPE merge loop and the pre-tokenizer regex run inside
//! `tiktoken_rs::CoreBPE`. This module adds what that core does not do:
//! strict rank-file validation, the 256-slot special table (named and
//! `<|reserved_token_N|>` slots), longest-first special-token scanning, the
//! 400,000-character / 25,000-same-class-run input chunking, and decoding
//! that reports unknown ids instead of skipping them.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustc_hash::FxHashMap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use tiktoken_rs::CoreBPE;

/// File name of the BPE rank table inside a model directory.
pub const RANK_FILE: &str = "tiktoken.model";

/// File name of the tokenizer configuration inside a model directory.
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// Number of special-token slots that follow the BPE ranks.
pub const NUM_SPECIAL_TOKENS: u32 = 256;

/// Maximum number of characters (Unicode scalar values) handed to the
/// pre-tokenizer in one piece.
pub const MAX_ENCODE_CHARS: usize = 400_000;

/// Maximum number of consecutive characters of one class (whitespace or
/// not, in the sense of Python `str.isspace`) inside one encoded piece.
pub const MAX_SAME_CLASS_RUN: usize = 25_000;

/// The pre-tokenizer pattern of the release, the `|`-join of its eight
/// branches in order.
pub const PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Largest rank file accepted (the released one is a few MiB).
pub(crate) const MAX_RANK_FILE_BYTES: u64 = 256 << 20;

/// Largest tokenizer configuration accepted.
const MAX_CONFIG_FILE_BYTES: u64 = 16 << 20;

/// Longest rank-file line accepted, in bytes (without the line ending).
const MAX_LINE_BYTES: usize = 4096;

/// Longest excerpt of file content quoted in an error message, in chars.
pub(crate) const EXCERPT_CHARS: usize = 80;

/// Largest rank that still leaves room for the special slots in `u32`.
const MAX_RANK: u64 = (u32::MAX - NUM_SPECIAL_TOKENS) as u64;

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

/// One of the 256 special-token slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    /// Token id (N ≤ id < N + 256).
    pub id: u32,
    /// The token's string; encodes to this id when specials are allowed and
    /// decodes to these UTF-8 bytes.
    pub name: String,
    /// The `special` flag from `tokenizer_config.json` (true for unnamed
    /// reserved slots). Only "skip special tokens" decoding looks at it.
    pub special: bool,
    /// Whether the slot is named in `added_tokens_decoder` (false for
    /// `<|reserved_token_N|>` fill-ins).
    pub named: bool,
}

/// A loaded, validated Kimi K3 tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    bpe: CoreBPE,
    n_base: u32,
    /// Concatenated bytes of every id, indexed through `offsets`.
    table: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` is the byte range of `id` in `table`.
    offsets: Vec<usize>,
    specials: Vec<SpecialToken>,
    special_ids: FxHashMap<String, u32>,
    /// Special ids grouped by the first byte of their string, longest
    /// string first (then lower id).
    specials_by_first_byte: Vec<Vec<u32>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_base", &self.n_base)
            .field("vocab_size", &self.vocab_size())
            .field(
                "named_specials",
                &self.specials.iter().filter(|s| s.named).count(),
            )
            .finish_non_exhaustive()
    }
}

/// One parsed rank-file entry.
pub(crate) struct RankEntry {
    pub(crate) line: usize,
    pub(crate) rank: u32,
    pub(crate) bytes: Vec<u8>,
}

/// Result of the rank-file pass.
struct RankTable {
    /// Token bytes by rank (dense, rank = index).
    by_rank: Vec<Vec<u8>>,
    /// Token bytes to rank.
    encoder: FxHashMap<Vec<u8>, u32>,
}

/// One `added_tokens_decoder` entry (other fields are ignored).
#[derive(Deserialize)]
struct AddedToken {
    content: String,
    special: bool,
}

/// `added_tokens_decoder`, kept as written so that repeated keys are seen.
struct AddedTokens(Vec<(String, AddedToken)>);

impl<'de> Deserialize<'de> for AddedTokens {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = AddedTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object mapping decimal ids to token objects")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<AddedTokens, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, AddedToken>()? {
                    entries.push(entry);
                }
                Ok(AddedTokens(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// The part of `tokenizer_config.json` the tokenizer needs.
#[derive(Deserialize)]
struct ConfigFile {
    added_tokens_decoder: AddedTokens,
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a model
    /// directory, validating both; the vocabulary size is whatever the rank
    /// file implies (number of ranks + 256).
    pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let rank_path = dir.join(RANK_FILE);
        let config_path = dir.join(CONFIG_FILE);
        let ranks = parse_rank_file(&rank_path)?;
        let added = parse_config_file(&config_path)?;
        Self::build(ranks, added, &config_path)
    }

    /// Like [`Tokenizer::load`], and additionally requires the total
    /// vocabulary size (ranks + 256 specials) to equal `vocab_size`, e.g.
    /// the model config's `vocab_size`.
    pub fn load_expecting(dir: &Path, vocab_size: u32) -> Result<Tokenizer, TokenizerError> {
        let tok = Self::load(dir)?;
        if tok.vocab_size() != vocab_size {
            return Err(TokenizerError::VocabMismatch {
                path: dir.join(RANK_FILE),
                expected: vocab_size,
                found: tok.vocab_size(),
            });
        }
        Ok(tok)
    }

    fn build(
        ranks: RankTable,
        added: Vec<(String, AddedToken)>,
        config_path: &Path,
    ) -> Result<Tokenizer, TokenizerError> {
        let n_entries = ranks.by_rank.len();
        let n_base = u32::try_from(n_entries).map_err(|_| TokenizerError::Core {
            message: format!("{n_entries} ranks do not fit in a u32 id space"),
        })?;
        let start = n_base;
        let end = n_base
            .checked_add(NUM_SPECIAL_TOKENS)
            .ok_or_else(|| TokenizerError::Core {
                message: format!("{n_base} ranks leave no room for {NUM_SPECIAL_TOKENS} specials"),
            })?;

        let mut slots: Vec<Option<(String, bool)>> = vec![None; NUM_SPECIAL_TOKENS as usize];
        for (key, token) in added {
            let id = parse_decimal_key(&key).ok_or_else(|| TokenizerError::SpecialBadKey {
                path: config_path.to_path_buf(),
                found: excerpt_str(&key),
            })?;
            if id < u64::from(start) || id >= u64::from(end) {
                return Err(TokenizerError::SpecialOutOfRange {
                    path: config_path.to_path_buf(),
                    id,
                    start,
                    end,
                    found: excerpt_str(&token.content),
                });
            }
            // In range, so the id fits in u32 and the slot index is < 256.
            let slot_index = (id - u64::from(start)) as usize;
            let Some(slot) = slots.get_mut(slot_index) else {
                return Err(TokenizerError::SpecialOutOfRange {
                    path: config_path.to_path_buf(),
                    id,
                    start,
                    end,
                    found: excerpt_str(&token.content),
                });
            };
            if slot.is_some() {
                return Err(TokenizerError::SpecialDuplicateId {
                    path: config_path.to_path_buf(),
                    id,
                    found: excerpt_str(&token.content),
                });
            }
            if token.content.is_empty() {
                return Err(TokenizerError::SpecialEmptyName {
                    path: config_path.to_path_buf(),
                    id: start + slot_index as u32,
                });
            }
            *slot = Some((token.content, token.special));
        }

        let mut specials = Vec::with_capacity(NUM_SPECIAL_TOKENS as usize);
        let mut special_ids: FxHashMap<String, u32> = FxHashMap::default();
        for (id, slot) in (start..end).zip(slots) {
            let (name, special, named) = match slot {
                Some((name, special)) => (name, special, true),
                None => (format!("<|reserved_token_{id}|>"), true, false),
            };
            if let Some(&first_id) = special_ids.get(&name) {
                return Err(TokenizerError::SpecialDuplicateName {
                    path: config_path.to_path_buf(),
                    found: excerpt_str(&name),
                    first_id,
                    id,
                });
            }
            if let Some(&rank) = ranks.encoder.get(name.as_bytes()) {
                return Err(TokenizerError::SpecialCollidesWithRank {
                    path: config_path.to_path_buf(),
                    id,
                    found: excerpt_str(&name),
                    rank,
                });
            }
            special_ids.insert(name.clone(), id);
            specials.push(SpecialToken {
                id,
                name,
                special,
                named,
            });
        }

        let mut specials_by_first_byte: Vec<Vec<u32>> = vec![Vec::new(); 256];
        for tok in &specials {
            if let Some(&first) = tok.name.as_bytes().first() {
                if let Some(bucket) = specials_by_first_byte.get_mut(usize::from(first)) {
                    bucket.push(tok.id);
                }
            }
        }
        for bucket in &mut specials_by_first_byte {
            bucket.sort_by(|&a, &b| {
                let la = special_name_len(&specials, start, a);
                let lb = special_name_len(&specials, start, b);
                lb.cmp(&la).then(a.cmp(&b))
            });
        }

        let total_bytes: usize = ranks.by_rank.iter().map(Vec::len).sum::<usize>()
            + specials.iter().map(|s| s.name.len()).sum::<usize>();
        let mut table = Vec::with_capacity(total_bytes);
        let mut offsets = Vec::with_capacity(n_entries + NUM_SPECIAL_TOKENS as usize + 1);
        offsets.push(0);
        for bytes in &ranks.by_rank {
            table.extend_from_slice(bytes);
            offsets.push(table.len());
        }
        for tok in &specials {
            table.extend_from_slice(tok.name.as_bytes());
            offsets.push(table.len());
        }

        let bpe = CoreBPE::new(ranks.encoder, FxHashMap::default(), PAT_STR).map_err(|e| {
            TokenizerError::Core {
                message: e.to_string(),
            }
        })?;

        Ok(Tokenizer {
            bpe,
            n_base,
            table,
            offsets,
            specials,
            special_ids,
            specials_by_first_byte,
        })
    }

    /// Number of BPE ranks (N); special ids start here.
    pub fn n_base(&self) -> u32 {
        self.n_base
    }

    /// Total number of ids: N ranks plus 256 special slots.
    pub fn vocab_size(&self) -> u32 {
        self.n_base + NUM_SPECIAL_TOKENS
    }

    /// Bytes of the longest token (special strings included): a text of more than
    /// `n × longest_token_bytes()` bytes cannot encode to `n` tokens or fewer.
    #[must_use]
    pub fn longest_token_bytes(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Id of the special token with exactly this string (named or
    /// `<|reserved_token_N|>`), if any.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    /// Whether `id` lies in the special range N..N+256.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base && id < self.vocab_size()
    }

    /// The special slot for `id`, if `id` is a special id.
    pub fn special_token(&self, id: u32) -> Option<&SpecialToken> {
        let index = id.checked_sub(self.n_base)?;
        self.specials.get(index as usize)
    }

    /// All 256 special slots in id order.
    pub fn special_tokens(&self) -> &[SpecialToken] {
        &self.specials
    }

    /// Raw bytes of one id (BPE bytes, or the special string's UTF-8), or
    /// `None` when the id is outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = usize::try_from(id).ok()?;
        let start = *self.offsets.get(i)?;
        let end = *self.offsets.get(i.checked_add(1)?)?;
        self.table.get(start..end)
    }

    /// Encodes text. With `allow_special`, every occurrence of any of the
    /// 256 special strings (longest match first) becomes its id; without
    /// it, special strings are ordinary text. No BOS/EOS is added.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for piece in chunk_text(text) {
            if allow_special {
                self.encode_with_specials(piece, &mut out);
            } else {
                self.encode_ordinary_into(piece, &mut out);
            }
        }
        out
    }

    /// BPE-encodes text containing no special tokens.
    ///
    /// The core's regex matcher has a backtracking budget (one million
    /// steps per match). Every character starts a match of some branch of
    /// [`PAT_STR`], so each match needs only a handful of backtracking steps
    /// whatever the input, far below that budget.
    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) {
        if !text.is_empty() {
            out.extend(self.bpe.encode_ordinary(text));
        }
    }

    /// Splits one chunk at special-token occurrences and encodes the parts.
    fn encode_with_specials(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let mut plain_start = 0;
        let mut i = 0;
        while i < bytes.len() {
            if text.is_char_boundary(i) {
                if let Some((id, len)) = self.special_at(bytes, i) {
                    if let Some(plain) = text.get(plain_start..i) {
                        self.encode_ordinary_into(plain, out);
                    }
                    out.push(id);
                    i += len;
                    plain_start = i;
                    continue;
                }
            }
            i += 1;
        }
        if let Some(plain) = text.get(plain_start..) {
            self.encode_ordinary_into(plain, out);
        }
    }

    /// Longest special string starting at byte `i`, as (id, byte length).
    fn special_at(&self, bytes: &[u8], i: usize) -> Option<(u32, usize)> {
        let rest = bytes.get(i..)?;
        let first = *rest.first()?;
        let bucket = self.specials_by_first_byte.get(usize::from(first))?;
        bucket.iter().find_map(|&id| {
            let name = self.token_bytes(id)?;
            rest.starts_with(name).then_some((id, name.len()))
        })
    }

    /// Concatenated raw bytes of `ids`; an id outside the vocabulary is an
    /// error.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.bytes_or_error(id)?);
        }
        Ok(out)
    }

    /// Like [`Tokenizer::decode_bytes`], dropping ids whose `special` flag is
    /// set (XTML markers flagged `special: false` still decode).
    pub fn decode_bytes_skip_special(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let bytes = self.bytes_or_error(id)?;
            if self.special_token(id).is_some_and(|s| s.special) {
                continue;
            }
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Decodes to text, replacing invalid UTF-8 with U+FFFD; an id outside
    /// the vocabulary is an error.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    fn bytes_or_error(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.token_bytes(id).ok_or(TokenizerError::UnknownId {
            id,
            vocab_size: self.vocab_size(),
        })
    }
}

fn special_name_len(specials: &[SpecialToken], start: u32, id: u32) -> usize {
    id.checked_sub(start)
        .and_then(|i| specials.get(i as usize))
        .map_or(0, |s| s.name.len())
}

/// Incremental UTF-8 decoder for streamed token bytes.
///
/// [`Utf8Stream::push`] returns the longest prefix of the accumulated bytes
/// that is complete UTF-8 and holds back at most 3 trailing bytes of a
/// sequence that may still be completed. Bytes that can never become valid
/// are replaced with U+FFFD immediately, exactly as a whole-text lossy
/// decode would replace them. [`Utf8Stream::finish`] flushes the held-back
/// bytes with replacement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes and returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        let mut keep_from = self.pending.len();
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    break;
                }
                Err(e) => {
                    let (valid, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = tail.get(bad..).unwrap_or_default();
                        }
                        None => {
                            keep_from = self.pending.len() - tail.len();
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..keep_from);
        out
    }

    /// Bytes held back because they may start an incomplete sequence.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Flushes held-back bytes, replacing an incomplete sequence with U+FFFD,
    /// and leaves the stream empty.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Python `str.isspace()`: Unicode `White_Space` plus U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Splits text into the pieces that are encoded independently: slices of
/// at most [`MAX_ENCODE_CHARS`] chars, each further cut so that no piece
/// holds more than [`MAX_SAME_CLASS_RUN`] consecutive chars of one class.
/// Empty text yields no pieces.
fn chunk_text(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut piece_start = 0;
    let mut chars_in_slice = 0usize;
    let mut run_is_space = false;
    let mut run_len = 0usize;
    for (idx, c) in text.char_indices() {
        if chars_in_slice == MAX_ENCODE_CHARS {
            pieces.push(&text[piece_start..idx]);
            piece_start = idx;
            chars_in_slice = 0;
        }
        let space = is_python_space(c);
        if chars_in_slice == 0 {
            run_is_space = space;
            run_len = 0;
        }
        if space != run_is_space {
            run_is_space = space;
            run_len = 1;
        } else {
            run_len += 1;
            if run_len > MAX_SAME_CLASS_RUN {
                pieces.push(&text[piece_start..idx]);
                piece_start = idx;
                run_len = 1;
            }
        }
        chars_in_slice += 1;
    }
    if piece_start < text.len() {
        pieces.push(&text[piece_start..]);
    }
    pieces
}

/// Parses a canonical unsigned decimal (no sign, no leading zeros).
fn parse_decimal_key(key: &str) -> Option<u64> {
    let canonical = !key.is_empty()
        && key.bytes().all(|b| b.is_ascii_digit())
        && (key == "0" || !key.starts_with('0'));
    if canonical {
        key.parse().ok()
    } else {
        None
    }
}

/// Escaped, shortened rendering of file bytes for error messages.
pub(crate) fn excerpt_bytes(bytes: &[u8]) -> String {
    excerpt_str(&String::from_utf8_lossy(bytes))
}

/// Shortened copy of file text for error messages (escaped when printed).
fn excerpt_str(text: &str) -> String {
    let mut chars = text.chars();
    let mut out: String = chars.by_ref().take(EXCERPT_CHARS).collect();
    if chars.next().is_some() {
        out.push('…');
    }
    out
}

/// Reads a whole file, refusing anything but a regular file, and one above `limit` bytes by its
/// size before reading it.
pub(crate) fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, TokenizerError> {
    let io_err = |source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    };
    let (file, size) = crate::stream::open_regular(path).map_err(io_err)?;
    let too_large = |size| TokenizerError::FileTooLarge {
        path: path.to_path_buf(),
        limit,
        size,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let mut data = Vec::with_capacity(size as usize);
    file.take(limit + 1)
        .read_to_end(&mut data)
        .map_err(io_err)?;
    if data.len() as u64 > limit {
        return Err(too_large(data.len() as u64));
    }
    Ok(data)
}

/// Refuses Git LFS pointers and HTML pages with a hint.
pub(crate) fn sniff_wrong_content(
    path: &Path,
    data: &[u8],
    expected: &'static str,
) -> Result<(), TokenizerError> {
    let body = data.strip_prefix(b"\xef\xbb\xbf").unwrap_or(data);
    let lead_ws = body.iter().take_while(|b| b.is_ascii_whitespace()).count();
    let line = 1 + body
        .get(..lead_ws)
        .map_or(0, |ws| ws.iter().filter(|&&b| b == b'\n').count());
    let trimmed = body.get(lead_ws..).unwrap_or_default();
    if trimmed.starts_with(b"version https://git-lfs.github.com/spec/") {
        return Err(TokenizerError::LfsPointer {
            path: path.to_path_buf(),
            line,
            expected,
        });
    }
    let head: Vec<u8> = trimmed
        .iter()
        .take(16)
        .map(|b| b.to_ascii_lowercase())
        .collect();
    if head.starts_with(b"<!doctype html")
        || head.starts_with(b"<html")
        || head.starts_with(b"<head")
    {
        return Err(TokenizerError::HtmlPage {
            path: path.to_path_buf(),
            line,
            expected,
        });
    }
    Ok(())
}

pub(crate) const RANK_FILE_EXPECTED: &str = "a tiktoken rank file (`<base64> <rank>` lines)";

/// The 256 bytes in the order of the byte-level BPE alphabet (GPT-2's): the printable bytes
/// 33–126, 161–172, 174–255 first, then the rest; the released rank file holds them at ranks
/// 0..=255 in this order.
#[must_use]
pub fn gpt2_byte_order() -> Vec<u8> {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut v: Vec<u8> = (0..=255u8).filter(|&b| printable(b)).collect();
    v.extend((0..=255u8).filter(|&b| !printable(b)));
    v
}

/// Parses and validates a rank file.
fn parse_rank_file(path: &Path) -> Result<RankTable, TokenizerError> {
    let data = read_limited(path, MAX_RANK_FILE_BYTES)?;
    parse_rank_bytes(path, &data)
}

/// Parses and validates the bytes of a rank file (`path` is named in messages); the number of
/// ranks it holds.
pub fn parse_ranks(path: &Path, data: &[u8]) -> Result<usize, TokenizerError> {
    parse_rank_bytes(path, data).map(|t| t.by_rank.len())
}

fn parse_rank_bytes(path: &Path, data: &[u8]) -> Result<RankTable, TokenizerError> {
    sniff_wrong_content(path, data, RANK_FILE_EXPECTED)?;

    let mut entries: Vec<RankEntry> = Vec::new();
    let mut rank_lines: FxHashMap<u32, usize> = FxHashMap::default();
    let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
    let mut lines = 0usize;
    for (index, raw) in data.split(|&b| b == b'\n').enumerate() {
        let line_no = index + 1;
        lines = line_no;
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.is_empty() {
            continue;
        }
        let entry = parse_rank_line(path, line_no, line)?;
        if let Some(&first_line) = rank_lines.get(&entry.rank) {
            return Err(TokenizerError::DuplicateRank {
                path: path.to_path_buf(),
                line: line_no,
                rank: entry.rank,
                first_line,
            });
        }
        if let Some(&first_rank) = encoder.get(&entry.bytes) {
            let first_line = rank_lines.get(&first_rank).copied().unwrap_or(0);
            return Err(TokenizerError::DuplicateToken {
                path: path.to_path_buf(),
                line: line_no,
                found: format!("{:?}", excerpt_bytes(&entry.bytes)),
                first_rank,
                first_line,
            });
        }
        rank_lines.insert(entry.rank, line_no);
        encoder.insert(entry.bytes.clone(), entry.rank);
        entries.push(entry);
    }
    if entries.is_empty() {
        return Err(TokenizerError::EmptyFile {
            path: path.to_path_buf(),
            expected: RANK_FILE_EXPECTED,
        });
    }

    let n = entries.len();
    let mut by_rank: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut first_outside: Option<(usize, u32)> = None;
    for entry in entries {
        match by_rank.get_mut(entry.rank as usize) {
            Some(slot) => *slot = entry.bytes,
            None => {
                if first_outside.is_none() {
                    first_outside = Some((entry.line, entry.rank));
                }
            }
        }
    }
    if let Some((line, found)) = first_outside {
        let missing = by_rank
            .iter()
            .position(Vec::is_empty)
            .and_then(|r| u32::try_from(r).ok())
            .unwrap_or(0);
        return Err(TokenizerError::RankGap {
            path: path.to_path_buf(),
            line,
            entries: n,
            found,
            missing,
        });
    }

    for byte in 0..=u8::MAX {
        if !encoder.contains_key([byte].as_slice()) {
            return Err(TokenizerError::MissingByte {
                path: path.to_path_buf(),
                byte,
                entries: n,
                lines,
            });
        }
    }
    Ok(RankTable { by_rank, encoder })
}

/// Parses one non-blank rank-file line.
pub(crate) fn parse_rank_line(
    path: &Path,
    line_no: usize,
    line: &[u8],
) -> Result<RankEntry, TokenizerError> {
    if line.len() > MAX_LINE_BYTES {
        return Err(TokenizerError::LineTooLong {
            path: path.to_path_buf(),
            line: line_no,
            limit: MAX_LINE_BYTES,
            found: line.len(),
        });
    }
    let Some(space) = line.iter().position(|&b| b == b' ') else {
        return Err(TokenizerError::MissingSeparator {
            path: path.to_path_buf(),
            line: line_no,
            found: excerpt_bytes(line),
        });
    };
    let (token_field, rank_field) = line.split_at(space);
    let rank_field = rank_field.get(1..).unwrap_or_default();

    let bytes = base64::engine::general_purpose::STANDARD
        .decode(token_field)
        .map_err(|e| TokenizerError::BadBase64 {
            path: path.to_path_buf(),
            line: line_no,
            found: excerpt_bytes(token_field),
            reason: e.to_string(),
        })?;
    if bytes.is_empty() {
        return Err(TokenizerError::EmptyToken {
            path: path.to_path_buf(),
            line: line_no,
        });
    }

    let bad_rank = |expected| TokenizerError::BadRank {
        path: path.to_path_buf(),
        line: line_no,
        expected,
        found: excerpt_bytes(rank_field),
    };
    match rank_field.first() {
        None => return Err(bad_rank("a decimal rank after the space")),
        Some(b'+' | b'-') => return Err(bad_rank("an unsigned decimal rank (no sign)")),
        Some(_) => {}
    }
    if !rank_field.iter().all(u8::is_ascii_digit) {
        return Err(bad_rank(
            "a decimal rank (digits 0-9 only, nothing after it)",
        ));
    }
    let out_of_range = || TokenizerError::RankOutOfRange {
        path: path.to_path_buf(),
        line: line_no,
        limit: MAX_RANK,
        found: excerpt_bytes(rank_field),
    };
    let mut value: u64 = 0;
    for &digit in rank_field {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(digit - b'0')))
            .filter(|&v| v <= MAX_RANK)
            .ok_or_else(out_of_range)?;
    }
    let rank = u32::try_from(value).map_err(|_| out_of_range())?;
    Ok(RankEntry {
        line: line_no,
        rank,
        bytes,
    })
}

const CONFIG_FILE_EXPECTED: &str =
    "a JSON tokenizer configuration with an `added_tokens_decoder` object";

/// Parses `tokenizer_config.json` into its `added_tokens_decoder` entries.
fn parse_config_file(path: &Path) -> Result<Vec<(String, AddedToken)>, TokenizerError> {
    let data = read_limited(path, MAX_CONFIG_FILE_BYTES)?;
    let expected = CONFIG_FILE_EXPECTED;
    if data.iter().all(u8::is_ascii_whitespace) {
        return Err(TokenizerError::EmptyFile {
            path: path.to_path_buf(),
            expected,
        });
    }
    sniff_wrong_content(path, &data, expected)?;
    let config: ConfigFile =
        serde_json::from_slice(&data).map_err(|e| TokenizerError::ConfigJson {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            expected: CONFIG_FILE_EXPECTED,
            message: e.to_string(),
        })?;
    Ok(config.added_tokens_decoder.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

    #[derive(Deserialize)]
    struct Case {
        name: String,
        text: String,
        allow_special: bool,
        ids: Vec<u32>,
    }

    #[derive(Deserialize)]
    struct CaseFile {
        cases: Vec<Case>,
        #[serde(default)]
        num_base_tokens: Option<u32>,
    }

    fn fixture(rel: &str) -> PathBuf {
        PathBuf::from(format!("{FIXTURES}/{rel}"))
    }

    fn tiny() -> Tokenizer {
        Tokenizer::load(&fixture("tiny")).expect("tiny fixture loads")
    }

    fn merges() -> Tokenizer {
        Tokenizer::load(&fixture("tokenizer/merges")).expect("merges fixture loads")
    }

    fn read_cases(rel: &str) -> CaseFile {
        let text = fs::read_to_string(fixture(rel)).expect("case file readable");
        serde_json::from_str(&text).expect("case file is valid JSON")
    }

    fn tiny_rank_lines() -> Vec<String> {
        fs::read_to_string(fixture("tiny/tiktoken.model"))
            .expect("tiny rank file readable")
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn tiny_config_text() -> String {
        fs::read_to_string(fixture("tiny/tokenizer_config.json")).expect("tiny config readable")
    }

    fn join_lines(lines: &[String]) -> Vec<u8> {
        let mut out = lines.join("\n").into_bytes();
        out.push(b'\n');
        out
    }

    fn write_dir(rank_file: &[u8], config: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(RANK_FILE), rank_file).expect("write rank file");
        fs::write(dir.path().join(CONFIG_FILE), config).expect("write config");
        dir
    }

    fn refuse_ranks(rank_file: &[u8]) -> TokenizerError {
        let dir = write_dir(rank_file, &tiny_config_text());
        Tokenizer::load(dir.path()).expect_err("rank file must be refused")
    }

    fn refuse_mutated_line(line_no: usize, replacement: &str) -> TokenizerError {
        let mut lines = tiny_rank_lines();
        lines[line_no - 1] = replacement.to_owned();
        refuse_ranks(&join_lines(&lines))
    }

    fn assert_names_line(err: &TokenizerError, line: usize) {
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("line {line}:")),
            "message lacks line {line}: {msg}"
        );
        assert!(msg.contains(RANK_FILE), "message lacks file name: {msg}");
    }

    fn config_with_specials(
        edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    ) -> String {
        let mut config: serde_json::Value =
            serde_json::from_str(&tiny_config_text()).expect("tiny config is JSON");
        let decoder = config
            .get_mut("added_tokens_decoder")
            .and_then(serde_json::Value::as_object_mut)
            .expect("added_tokens_decoder object");
        edit(decoder);
        serde_json::to_string_pretty(&config).expect("serialize config")
    }

    fn special_entry(content: &str, special: bool) -> serde_json::Value {
        serde_json::json!({
            "content": content,
            "lstrip": false,
            "normalized": false,
            "rstrip": false,
            "single_word": false,
            "special": special
        })
    }

    fn refuse_config(config: &str) -> TokenizerError {
        let rank_file = fs::read(fixture("tiny/tiktoken.model")).expect("tiny rank file");
        let dir = write_dir(&rank_file, config);
        Tokenizer::load(dir.path()).expect_err("config must be refused")
    }

    fn load_with_config(config: &str) -> Tokenizer {
        let rank_file = fs::read(fixture("tiny/tiktoken.model")).expect("tiny rank file");
        let dir = write_dir(&rank_file, config);
        Tokenizer::load(dir.path()).expect("config accepted")
    }

    fn byte_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
        text.bytes()
            .map(|b| {
                *tok.bpe_rank_of(&[b])
                    .as_ref()
                    .expect("every byte has a rank")
            })
            .collect()
    }

    impl Tokenizer {
        fn bpe_rank_of(&self, bytes: &[u8]) -> Option<u32> {
            (0..self.n_base).find(|&id| self.token_bytes(id) == Some(bytes))
        }

        fn encode_pieces_unchunked(&self, pieces: &[&str]) -> Vec<u32> {
            pieces
                .iter()
                .flat_map(|p| self.bpe.encode_ordinary(p))
                .collect()
        }
    }

    /// Straightforward transcription of the chunking rule, for comparison.
    fn reference_chunks(text: &str) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for slice in chars.chunks(MAX_ENCODE_CHARS) {
            let mut run_len = 0;
            let mut run_space = slice.first().is_some_and(|&c| is_python_space(c));
            let mut start = 0;
            for (i, &c) in slice.iter().enumerate() {
                let now_space = is_python_space(c);
                if run_space != now_space {
                    run_len = 1;
                    run_space = now_space;
                } else {
                    run_len += 1;
                    if run_len > MAX_SAME_CLASS_RUN {
                        out.push(slice[start..i].iter().collect());
                        start = i;
                        run_len = 1;
                    }
                }
            }
            out.push(slice[start..].iter().collect());
        }
        out
    }

    #[test]
    fn tokenizer_and_stream_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<Utf8Stream>();
        check::<TokenizerError>();
    }

    // ---- fixtures against stored ids -------------------------------------

    #[test]
    fn tiny_oracle_cases_match() {
        let tok = tiny();
        let file = read_cases("tokenizer/tiny_cases.json");
        assert_eq!(file.cases.len(), 7);
        for case in &file.cases {
            assert_eq!(
                tok.encode(&case.text, case.allow_special),
                case.ids,
                "case {}",
                case.name
            );
            let decoded = tok.decode_bytes(&case.ids).expect("decodes");
            assert_eq!(
                decoded,
                case.text.as_bytes(),
                "round trip of case {}",
                case.name
            );
        }
    }

    #[test]
    fn merges_fixture_matches_python_tiktoken() {
        let tok = merges();
        let file = read_cases("tokenizer/merges/expected.json");
        assert_eq!(Some(tok.n_base()), file.num_base_tokens);
        assert!(file.cases.len() >= 40);
        let mut merged = 0;
        for case in &file.cases {
            let ids = tok.encode(&case.text, case.allow_special);
            assert_eq!(ids, case.ids, "case {} ({:?})", case.name, case.text);
            assert_eq!(
                tok.decode_bytes(&ids).expect("decodes"),
                case.text.as_bytes(),
                "round trip of case {}",
                case.name
            );
            if ids.len() < case.text.len() {
                merged += 1;
            }
        }
        assert!(merged >= 30, "fixture should exercise merges, got {merged}");
    }

    #[test]
    fn pattern_is_the_one_in_the_fixtures() {
        let tiny_cases: serde_json::Value = serde_json::from_str(
            &fs::read_to_string(fixture("tokenizer/tiny_cases.json")).expect("readable"),
        )
        .expect("JSON");
        assert_eq!(tiny_cases["pat_str"].as_str(), Some(PAT_STR));
        let merges_cases: serde_json::Value = serde_json::from_str(
            &fs::read_to_string(fixture("tokenizer/merges/expected.json")).expect("readable"),
        )
        .expect("JSON");
        assert_eq!(merges_cases["pat_str"].as_str(), Some(PAT_STR));
    }

    // ---- vocabulary layout and specials ----------------------------------

    #[test]
    fn tiny_layout() {
        let tok = tiny();
        assert_eq!(tok.n_base(), 256);
        assert_eq!(tok.vocab_size(), 512);
        assert_eq!(tok.special_tokens().len(), 256);
        assert!(!tok.is_special(255));
        assert!(tok.is_special(256));
        assert!(tok.is_special(511));
        assert!(!tok.is_special(512));
        assert_eq!(tok.token_bytes(512), None);
        assert_eq!(tok.token_bytes(220), Some(&b" "[..]));
        assert_eq!(tok.token_bytes(0), Some(&b"!"[..]));
        assert_eq!(tok.token_bytes(259), Some(&b"<|open|>"[..]));
        assert_eq!(tok.special_tokens().iter().filter(|s| s.named).count(), 16);
        let debug = format!("{tok:?}");
        assert!(debug.contains("vocab_size: 512"), "{debug}");
    }

    #[test]
    fn tiny_named_special_ids() {
        let tok = tiny();
        let expected = [
            (256, "[BOS]", true),
            (257, "[EOS]", true),
            (258, "<|end_of_msg|>", true),
            (259, "<|open|>", false),
            (260, "<|close|>", false),
            (261, "<|sep|>", false),
            (262, "[start_header_id]", true),
            (263, "[end_header_id]", true),
            (265, "[EOT]", true),
            (274, "<|media_begin|>", true),
            (275, "<|media_content|>", true),
            (276, "<|media_end|>", true),
            (277, "<|media_pad|>", true),
            (321, "<osagent_mode>", true),
            (510, "[UNK]", true),
            (511, "[PAD]", true),
        ];
        for (id, name, special) in expected {
            assert_eq!(tok.special_id(name), Some(id), "{name}");
            let slot = tok.special_token(id).expect("special slot");
            assert_eq!(slot.name, name);
            assert_eq!(slot.special, special, "{name}");
            assert!(slot.named);
            assert_eq!(tok.encode(name, true), vec![id], "{name}");
        }
        let reserved = tok.special_token(264).expect("slot 264");
        assert_eq!(reserved.name, "<|reserved_token_264|>");
        assert!(reserved.special && !reserved.named);
    }

    #[test]
    fn open_marker_is_plain_text_without_allow_special() {
        let tok = tiny();
        let ids = tok.encode("<|open|>", false);
        assert_eq!(ids, byte_ids(&tok, "<|open|>"));
        assert!(ids.iter().all(|&id| !tok.is_special(id)));
        assert_eq!(tok.encode("<|open|>", true), vec![259]);
    }

    #[test]
    fn reserved_token_300_maps_to_300() {
        let tok = tiny();
        assert_eq!(tok.special_id("<|reserved_token_300|>"), Some(300));
        assert_eq!(tok.encode("<|reserved_token_300|>", true), vec![300]);
        assert_eq!(
            tok.decode_bytes(&[300]).expect("decodes"),
            b"<|reserved_token_300|>"
        );
        assert_eq!(tok.special_id("<|reserved_token_511|>"), None);
        assert_eq!(tok.special_id("<|reserved_token_512|>"), None);
    }

    #[test]
    fn specials_are_matched_longest_first() {
        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("<|x|>", true));
            d.insert("301".into(), special_entry("<|x|>y", true));
        });
        let tok = load_with_config(&config);
        assert_eq!(tok.encode("<|x|>y", true), vec![301]);
        let mut expected = vec![300];
        expected.extend(byte_ids(&tok, "z"));
        assert_eq!(tok.encode("<|x|>z", true), expected);
    }

    #[test]
    fn non_ascii_special_names_work_both_ways() {
        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("é<|e|>", false));
        });
        let tok = load_with_config(&config);
        let mut expected = byte_ids(&tok, "aé");
        expected.push(300);
        expected.extend(byte_ids(&tok, "é"));
        assert_eq!(tok.encode("aéé<|e|>é", true), expected);
        assert_eq!(tok.encode("é<|e|>", false), byte_ids(&tok, "é<|e|>"));
    }

    // ---- decoding ----------------------------------------------------------

    #[test]
    fn decode_rejects_unknown_ids() {
        let tok = tiny();
        let err = tok.decode_bytes(&[39, 512]).expect_err("512 is outside");
        assert!(matches!(
            err,
            TokenizerError::UnknownId {
                id: 512,
                vocab_size: 512
            }
        ));
        assert!(err.to_string().contains("512"));
        assert!(tok.decode_lossy(&[u32::MAX]).is_err());
        assert!(tok.decode_bytes_skip_special(&[600]).is_err());
    }

    #[test]
    fn decode_lossy_replaces_partial_sequences() {
        let tok = tiny();
        let ids = tok.encode("你好", false);
        assert_eq!(ids.len(), 6);
        assert_eq!(tok.decode_lossy(&ids).expect("decodes"), "你好");
        assert_eq!(tok.decode_lossy(&ids[..4]).expect("decodes"), "你\u{FFFD}");
    }

    #[test]
    fn skip_special_decoding_follows_the_flag() {
        let tok = tiny();
        let ids = tok.encode(
            "<|open|>hi<|sep|>[EOS]<|end_of_msg|><|reserved_token_300|>",
            true,
        );
        let kept = tok.decode_bytes_skip_special(&ids).expect("decodes");
        assert_eq!(kept, b"<|open|>hi<|sep|>");
    }

    // ---- round trips ---------------------------------------------------------

    fn roundtrip_texts() -> Vec<String> {
        let mut texts: Vec<String> = [
            "",
            "The capital of France is Paris.",
            "plain ASCII with punctuation!? (yes) [no] {maybe} <tag/> a+b=c",
            "中文和English混合，还有标点。",
            "日本語のテキスト、한국어 문장, Привет мир, مرحبا, Γειά σου",
            "emoji 😀🚀 and ZWJ 👩‍💻 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
            "accents: Café naïve e\u{301} a\u{308} Ångström",
            "whitespace  \t\t  \n\n\r\n \u{a0}\u{3000}\u{2009}\u{1c}\u{1f} end   ",
            "\u{0}\u{1}\u{7f}\u{85}\u{feff}\u{10ffff}",
            "<|open|>[EOS]<|reserved_token_300|> specials as text",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        texts.push(" ".repeat(30_000));
        texts.push(format!("x{}y", "\n".repeat(25_001)));
        texts.push("a".repeat(60_001));
        texts.push("中".repeat(26_000));
        texts.push(format!("{}!{}", "Ab".repeat(13_000), "\t ".repeat(13_000)));
        texts
    }

    #[test]
    fn round_trips_are_byte_exact() {
        for tok in [tiny(), merges()] {
            for text in roundtrip_texts() {
                for allow_special in [false, true] {
                    let ids = tok.encode(&text, allow_special);
                    let back = tok.decode_bytes(&ids).expect("decodes");
                    assert!(
                        back == text.as_bytes(),
                        "round trip failed for {:?}",
                        excerpt_str(&text)
                    );
                    assert_eq!(tok.decode_lossy(&ids).expect("decodes"), text);
                }
            }
        }
    }

    // ---- chunking ------------------------------------------------------------

    fn lens(pieces: &[&str]) -> Vec<usize> {
        pieces.iter().map(|p| p.chars().count()).collect()
    }

    #[test]
    fn python_isspace_table() {
        let expected: Vec<u32> = vec![
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000,
            0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028,
            0x2029, 0x202f, 0x205f, 0x3000,
        ];
        let found: Vec<u32> = (0..=0x10ffff_u32)
            .filter_map(char::from_u32)
            .filter(|&c| is_python_space(c))
            .map(u32::from)
            .collect();
        assert_eq!(found, expected);
    }

    #[test]
    fn chunking_splits_long_same_class_runs() {
        assert!(chunk_text("").is_empty());
        assert_eq!(lens(&chunk_text(&"a".repeat(25_000))), vec![25_000]);
        assert_eq!(lens(&chunk_text(&"a".repeat(25_001))), vec![25_000, 1]);
        assert_eq!(
            lens(&chunk_text(&" ".repeat(50_001))),
            vec![25_000, 25_000, 1]
        );
        let mixed = format!("{} {}", "a".repeat(24_999), "b".repeat(25_001));
        assert_eq!(lens(&chunk_text(&mixed)), vec![50_000, 1]);
        // U+001C..U+001F count as whitespace: alternating never forms a run.
        let alternating = "a\u{1c}b\u{1f}".repeat(10_000);
        assert_eq!(lens(&chunk_text(&alternating)), vec![40_000]);
        let unit_sep_run = "\u{1e}".repeat(25_001);
        assert_eq!(lens(&chunk_text(&unit_sep_run)), vec![25_000, 1]);
    }

    #[test]
    fn chunking_slices_at_400k_chars() {
        let text = "ab 中".repeat(100_001);
        let pieces = chunk_text(&text);
        assert_eq!(lens(&pieces), vec![400_000, 4]);
        assert_eq!(pieces.concat(), text);
        let reference = reference_chunks(&text);
        assert_eq!(
            pieces,
            reference.iter().map(String::as_str).collect::<Vec<_>>()
        );
    }

    #[test]
    fn chunking_matches_reference_transcription() {
        let texts = [
            format!(
                "{}{}{}",
                " ".repeat(30_000),
                "x".repeat(51_000),
                "\u{3000}".repeat(25_000)
            ),
            format!("{}é{}", "\u{1d}".repeat(25_000), "\u{2003}".repeat(25_002)),
            "héllo wörld ".repeat(5_000),
        ];
        for text in &texts {
            let pieces = chunk_text(text);
            let reference = reference_chunks(text);
            assert_eq!(
                pieces,
                reference.iter().map(String::as_str).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn long_runs_are_encoded_per_chunk() {
        let tok = merges();
        let spaces = " ".repeat(25_001);
        let pieces = chunk_text(&spaces);
        assert_eq!(lens(&pieces), vec![25_000, 1]);
        let chunked = tok.encode(&spaces, false);
        assert_eq!(chunked, tok.encode_pieces_unchunked(&pieces));
        assert_eq!(chunked.len(), 12_501);
        assert_eq!(
            tok.encode_pieces_unchunked(&[spaces.as_str()]).len(),
            12_500
        );

        let letters = format!("x{}", "ab".repeat(15_000));
        let pieces = chunk_text(&letters);
        assert_eq!(lens(&pieces), vec![25_000, 5_001]);
        let chunked = tok.encode(&letters, false);
        assert_eq!(chunked, tok.encode_pieces_unchunked(&pieces));
        assert_ne!(chunked, tok.encode_pieces_unchunked(&[letters.as_str()]));

        let newlines = format!("{}x", "\n".repeat(25_001));
        let chunked = tok.encode(&newlines, false);
        assert_eq!(chunked, tok.encode_pieces_unchunked(&chunk_text(&newlines)));
        assert_ne!(chunked, tok.encode_pieces_unchunked(&[newlines.as_str()]));
    }

    #[test]
    fn special_scanning_restarts_at_chunk_cuts() {
        let tok = tiny();
        let split = format!("{}[EOS]", "a".repeat(24_998));
        assert_eq!(tok.encode(&split, true), byte_ids(&tok, &split));
        let whole = format!("{}[EOS]", "a".repeat(24_995));
        let ids = tok.encode(&whole, true);
        assert_eq!(ids.len(), 24_996);
        assert_eq!(ids.last(), Some(&257));
    }

    // ---- streaming decode ------------------------------------------------------

    #[test]
    fn utf8_stream_holds_back_incomplete_sequences() {
        let text = "héllo 你好 👩‍💻 ok";
        let mut stream = Utf8Stream::new();
        let mut out = String::new();
        for &b in text.as_bytes() {
            let piece = stream.push(&[b]);
            assert!(!piece.contains('\u{FFFD}'));
            assert!(stream.pending().len() <= 3);
            out.push_str(&piece);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, text);

        let mut stream = Utf8Stream::new();
        assert_eq!(stream.push(&[0xe4, 0xbd]), "");
        assert_eq!(stream.pending(), &[0xe4, 0xbd]);
        assert_eq!(stream.push(&[0xa0, b'!']), "你!");
        assert_eq!(stream.push(&[0xf0, 0x9f]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert!(stream.pending().is_empty());
    }

    #[test]
    fn utf8_stream_replaces_invalid_bytes_immediately() {
        let mut stream = Utf8Stream::new();
        assert_eq!(stream.push(&[b'a', 0xff, b'b']), "a\u{FFFD}b");
        assert_eq!(stream.push(&[0xe4, b'x']), "\u{FFFD}x");
        assert_eq!(stream.push(&[0xc0]), "\u{FFFD}");
        assert!(stream.pending().is_empty());
    }

    #[test]
    fn utf8_stream_matches_whole_lossy_decode() {
        let mut state: u64 = 0x1234_5678;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize
        };
        let alphabet: &[&[u8]] = &[
            b"a",
            b" ",
            "é".as_bytes(),
            "你".as_bytes(),
            "😀".as_bytes(),
            &[0xff],
            &[0xe4, 0xbd],
            &[0xf0, 0x9f, 0x98],
            &[0x80],
            &[0xed, 0xa0, 0x80],
        ];
        for _ in 0..500 {
            let mut bytes = Vec::new();
            for _ in 0..(next() % 40) {
                bytes.extend_from_slice(alphabet[next() % alphabet.len()]);
            }
            let mut stream = Utf8Stream::new();
            let mut out = String::new();
            let mut rest = bytes.as_slice();
            while !rest.is_empty() {
                let take = (next() % 5 + 1).min(rest.len());
                let (head, tail) = rest.split_at(take);
                out.push_str(&stream.push(head));
                assert!(stream.pending().len() <= 3);
                rest = tail;
            }
            out.push_str(&stream.finish());
            assert_eq!(out, String::from_utf8_lossy(&bytes), "bytes {bytes:?}");
        }
    }

    // ---- rank-file refusals -------------------------------------------------

    #[test]
    fn crlf_and_blank_lines_are_accepted() {
        let lines = tiny_rank_lines();
        let mut crlf = lines.join("\r\n").into_bytes();
        crlf.extend_from_slice(b"\r\n\r\n\n");
        let dir = write_dir(&crlf, &tiny_config_text());
        let tok = Tokenizer::load(dir.path()).expect("CRLF accepted");
        assert_eq!(
            tok.encode("Hello, K3!", false),
            tiny().encode("Hello, K3!", false)
        );

        let mut spaced = lines.clone();
        spaced.insert(10, String::new());
        spaced.insert(0, String::new());
        let dir = write_dir(&join_lines(&spaced), &tiny_config_text());
        assert_eq!(
            Tokenizer::load(dir.path())
                .expect("blank lines skipped")
                .n_base(),
            256
        );
    }

    #[test]
    fn refuses_missing_rank_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(CONFIG_FILE), tiny_config_text()).expect("write config");
        let err = Tokenizer::load(dir.path()).expect_err("missing file refused");
        assert!(
            matches!(&err, TokenizerError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(err.to_string().contains(RANK_FILE));
    }

    #[test]
    fn refuses_empty_rank_file() {
        assert!(matches!(
            refuse_ranks(b""),
            TokenizerError::EmptyFile { .. }
        ));
        let err = refuse_ranks(b"\n\r\n\n");
        assert!(matches!(err, TokenizerError::EmptyFile { .. }));
        assert!(err.to_string().contains("empty"));
    }

    #[test]
    fn refuses_lfs_pointer() {
        let pointer = b"version https://git-lfs.github.com/spec/v1\n\
oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 2795286\n";
        let err = refuse_ranks(pointer);
        assert!(matches!(err, TokenizerError::LfsPointer { line: 1, .. }));
        assert_names_line(&err, 1);
        assert!(err.to_string().contains("git lfs pull"));
    }

    #[test]
    fn refuses_html_page() {
        let err = refuse_ranks(b"\n<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n");
        assert!(matches!(err, TokenizerError::HtmlPage { line: 2, .. }));
        assert_names_line(&err, 2);
        assert!(err.to_string().contains("HTML"));
    }

    #[test]
    fn refuses_line_without_space_separator() {
        let err = refuse_mutated_line(10, "KQ==\t9");
        assert!(matches!(
            err,
            TokenizerError::MissingSeparator { line: 10, .. }
        ));
        assert_names_line(&err, 10);
        assert!(err.to_string().contains(r#""KQ==\t9""#), "{err}");
    }

    #[test]
    fn refuses_truncated_last_line() {
        let mut lines = tiny_rank_lines();
        let last = lines.pop().expect("non-empty");
        let cut = &last[..2];
        lines.push(cut.to_owned());
        let err = refuse_ranks(lines.join("\n").as_bytes());
        assert!(matches!(
            err,
            TokenizerError::MissingSeparator { line: 256, .. }
        ));
        assert_names_line(&err, 256);
    }

    #[test]
    fn refuses_bad_base64() {
        let err = refuse_mutated_line(5, "J!== 4");
        assert!(matches!(err, TokenizerError::BadBase64 { line: 5, .. }));
        assert_names_line(&err, 5);
        let err = refuse_mutated_line(6, "Jg 5");
        assert!(matches!(err, TokenizerError::BadBase64 { line: 6, .. }));
    }

    #[test]
    fn refuses_empty_token() {
        let err = refuse_mutated_line(6, " 5");
        assert!(matches!(err, TokenizerError::EmptyToken { line: 6, .. }));
        assert_names_line(&err, 6);
    }

    #[test]
    fn refuses_non_decimal_rank() {
        let err = refuse_mutated_line(7, "Jw== abc");
        assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
        assert_names_line(&err, 7);
        assert!(err.to_string().contains(r#"rank "abc""#), "{err}");
        let err = refuse_mutated_line(7, "Jw== 6.0");
        assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
        let err = refuse_mutated_line(7, "Jw== ");
        assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
    }

    #[test]
    fn refuses_signed_rank() {
        let err = refuse_mutated_line(8, "KA== -7");
        assert!(matches!(err, TokenizerError::BadRank { line: 8, .. }));
        assert!(err.to_string().contains("no sign"), "{err}");
        let err = refuse_mutated_line(8, "KA== +7");
        assert!(matches!(err, TokenizerError::BadRank { line: 8, .. }));
        assert_names_line(&err, 8);
    }

    #[test]
    fn refuses_trailing_garbage() {
        let err = refuse_mutated_line(9, "KQ== 8 extra");
        assert!(matches!(err, TokenizerError::BadRank { line: 9, .. }));
        assert_names_line(&err, 9);
        let err = refuse_mutated_line(9, "KQ==  8");
        assert!(matches!(err, TokenizerError::BadRank { line: 9, .. }));
    }

    #[test]
    fn refuses_rank_out_of_range() {
        let err = refuse_mutated_line(11, "Kw== 99999999999999999999999");
        assert!(matches!(
            err,
            TokenizerError::RankOutOfRange { line: 11, .. }
        ));
        assert_names_line(&err, 11);
        let err = refuse_mutated_line(11, "Kw== 4294967295");
        assert!(matches!(
            err,
            TokenizerError::RankOutOfRange { line: 11, .. }
        ));
    }

    #[test]
    fn refuses_duplicate_rank() {
        let err = refuse_mutated_line(20, "NA== 3");
        assert!(matches!(
            err,
            TokenizerError::DuplicateRank {
                line: 20,
                rank: 3,
                first_line: 4,
                ..
            }
        ));
        assert_names_line(&err, 20);
    }

    #[test]
    fn refuses_duplicate_token_bytes() {
        let lines = tiny_rank_lines();
        let token_of_line_4 = lines[3].split(' ').next().expect("token field").to_owned();
        let err = refuse_mutated_line(20, &format!("{token_of_line_4} 19"));
        assert!(matches!(
            err,
            TokenizerError::DuplicateToken {
                line: 20,
                first_rank: 3,
                first_line: 4,
                ..
            }
        ));
        assert_names_line(&err, 20);
    }

    #[test]
    fn refuses_rank_gap() {
        let mut lines = tiny_rank_lines();
        lines.push("QUI= 300".to_owned());
        let err = refuse_ranks(&join_lines(&lines));
        assert!(matches!(
            err,
            TokenizerError::RankGap {
                line: 257,
                entries: 257,
                found: 300,
                missing: 256,
                ..
            }
        ));
        assert_names_line(&err, 257);

        let mut lines = tiny_rank_lines();
        lines.remove(99);
        let err = refuse_ranks(&join_lines(&lines));
        assert!(matches!(
            err,
            TokenizerError::RankGap {
                line: 255,
                missing: 99,
                ..
            }
        ));
    }

    #[test]
    fn refuses_missing_single_byte() {
        let lines = tiny_rank_lines();
        let mut kept: Vec<String> = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            if i == 99 {
                continue;
            }
            let token = line.split(' ').next().expect("token field");
            kept.push(format!("{token} {}", kept.len()));
        }
        kept.push(format!("QUI= {}", kept.len()));
        let missing_byte = base64::engine::general_purpose::STANDARD
            .decode(lines[99].split(' ').next().expect("token field"))
            .expect("valid base64")[0];
        let err = refuse_ranks(&join_lines(&kept));
        assert!(matches!(err, TokenizerError::MissingByte { byte, .. } if byte == missing_byte));
        assert!(err.to_string().contains(&format!("0x{missing_byte:02x}")));
    }

    #[test]
    fn refuses_overlong_line() {
        let err = refuse_mutated_line(12, &format!("{} 11", "A".repeat(MAX_LINE_BYTES + 4)));
        assert!(matches!(err, TokenizerError::LineTooLong { line: 12, .. }));
        assert_names_line(&err, 12);
    }

    #[test]
    fn error_messages_escape_file_content() {
        let err = refuse_mutated_line(3, "\u{1b}[31mred 2");
        let msg = err.to_string();
        assert!(!msg.contains('\u{1b}'), "{msg}");
        assert!(msg.contains("\\u{1b}"), "{msg}");
        assert_names_line(&err, 3);
    }

    #[test]
    fn expected_vocab_size_is_enforced() {
        let dir = fixture("tiny");
        assert_eq!(
            Tokenizer::load_expecting(&dir, 512)
                .expect("matches")
                .vocab_size(),
            512
        );
        let err = Tokenizer::load_expecting(&dir, 163_840).expect_err("mismatch refused");
        assert!(matches!(
            err,
            TokenizerError::VocabMismatch {
                expected: 163_840,
                found: 512,
                ..
            }
        ));
    }

    // ---- config refusals -----------------------------------------------------

    #[test]
    fn refuses_missing_or_broken_config() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(
            dir.path().join(RANK_FILE),
            fs::read(fixture("tiny/tiktoken.model")).expect("read"),
        )
        .expect("write");
        let err = Tokenizer::load(dir.path()).expect_err("missing config refused");
        assert!(matches!(err, TokenizerError::Io { .. }));
        assert!(err.to_string().contains(CONFIG_FILE));

        let err = refuse_config("{\n  \"added_tokens_decoder\": {\n    \"256\": \n}");
        assert!(
            matches!(err, TokenizerError::ConfigJson { line: 4, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("line 4"));

        let err = refuse_config("{\"bos_token\": \"[BOS]\"}");
        assert!(matches!(err, TokenizerError::ConfigJson { .. }));
        assert!(err.to_string().contains("added_tokens_decoder"));

        let err = refuse_config("<html><head><title>Sign in</title></head></html>");
        assert!(matches!(err, TokenizerError::HtmlPage { .. }));
        assert!(matches!(
            refuse_config(" \n"),
            TokenizerError::EmptyFile { .. }
        ));
    }

    #[test]
    fn refuses_special_outside_special_range() {
        let config = config_with_specials(|d| {
            d.insert("100".into(), special_entry("<|low|>", true));
        });
        let err = refuse_config(&config);
        assert!(matches!(
            err,
            TokenizerError::SpecialOutOfRange {
                id: 100,
                start: 256,
                end: 512,
                ..
            }
        ));
        assert!(err.to_string().contains("<|low|>"));

        let config = config_with_specials(|d| {
            d.insert("163846".into(), special_entry("<|im_end|>", true));
        });
        let err = refuse_config(&config);
        assert!(matches!(
            err,
            TokenizerError::SpecialOutOfRange { id: 163_846, .. }
        ));
    }

    #[test]
    fn refuses_non_decimal_special_key() {
        let config = config_with_specials(|d| {
            d.insert("0300".into(), special_entry("<|x|>", true));
        });
        assert!(matches!(
            refuse_config(&config),
            TokenizerError::SpecialBadKey { .. }
        ));
        let config = config_with_specials(|d| {
            d.insert("-1".into(), special_entry("<|x|>", true));
        });
        assert!(matches!(
            refuse_config(&config),
            TokenizerError::SpecialBadKey { .. }
        ));
    }

    #[test]
    fn refuses_duplicated_special_id() {
        let text = tiny_config_text().replacen(
            "\"256\": {",
            "\"300\": {\"content\": \"<|dup|>\", \"special\": true},\n    \"300\": {",
            1,
        );
        let err = refuse_config(&text);
        assert!(
            matches!(err, TokenizerError::SpecialDuplicateId { id: 300, .. }),
            "{err}"
        );
    }

    #[test]
    fn refuses_duplicated_special_name() {
        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("[EOS]", true));
        });
        let err = refuse_config(&config);
        assert!(matches!(
            err,
            TokenizerError::SpecialDuplicateName {
                first_id: 257,
                id: 300,
                ..
            }
        ));
        assert!(err.to_string().contains("[EOS]"));

        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("<|reserved_token_301|>", true));
        });
        let err = refuse_config(&config);
        assert!(matches!(
            err,
            TokenizerError::SpecialDuplicateName {
                first_id: 300,
                id: 301,
                ..
            }
        ));
    }

    #[test]
    fn refuses_special_colliding_with_bpe_bytes() {
        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("A", true));
        });
        let err = refuse_config(&config);
        assert!(matches!(
            err,
            TokenizerError::SpecialCollidesWithRank {
                id: 300,
                rank: 32,
                ..
            }
        ));
    }

    #[test]
    fn refuses_empty_special_name() {
        let config = config_with_specials(|d| {
            d.insert("300".into(), special_entry("", true));
        });
        assert!(matches!(
            refuse_config(&config),
            TokenizerError::SpecialEmptyName { id: 300, .. }
        ));
    }
}
