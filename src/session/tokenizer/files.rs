//! Reading and validating the tokenizer's two files: `tiktoken.model` (the BPE ranks) and
//! `tokenizer_config.json` (the special tokens), with size limits, sniffing of Git LFS pointers
//! and HTML pages, and line-exact refusals.

use super::*;

/// Parses a canonical unsigned decimal (no sign, no leading zeros).
pub(super) fn parse_decimal_key(key: &str) -> Option<u64> {
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
pub(super) fn excerpt_str(text: &str) -> String {
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
pub(super) fn parse_rank_file(path: &Path) -> Result<RankTable, TokenizerError> {
    let data = read_limited(path, MAX_RANK_FILE_BYTES)?;
    parse_rank_bytes(path, &data)
}

/// Parses and validates the bytes of a rank file (`path` is named in messages); the number of
/// ranks it holds.
pub fn parse_ranks(path: &Path, data: &[u8]) -> Result<usize, TokenizerError> {
    parse_rank_bytes(path, data).map(|t| t.by_rank.len())
}

pub(super) fn parse_rank_bytes(path: &Path, data: &[u8]) -> Result<RankTable, TokenizerError> {
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

pub(super) const CONFIG_FILE_EXPECTED: &str =
    "a JSON tokenizer configuration with an `added_tokens_decoder` object";

/// Parses `tokenizer_config.json` into its `added_tokens_decoder` entries.
pub(super) fn parse_config_file(path: &Path) -> Result<Vec<(String, AddedToken)>, TokenizerError> {
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
