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
use std::path::Path;

use base64::Engine as _;
use rustc_hash::FxHashMap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use tiktoken_rs::CoreBPE;

mod error;
mod files;
#[cfg(test)]
mod tests;

pub use error::TokenizerError;
use files::*;
pub(crate) use files::{
    excerpt_bytes, parse_rank_line, read_limited, sniff_wrong_content, RANK_FILE_EXPECTED,
};
pub use files::{gpt2_byte_order, parse_ranks};

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

    /// Over 100 lines: the special table, the id-to-bytes table and the BPE core are built in
    /// one pass from the checked files, each step using the counts of the one before.
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
