//! `k3 verify`'s rank-file check: unlike loading, which stops at the first problem, it reports
//! every problem of the tokenizer's rank file.

use crate::session::tokenizer::{
    excerpt_bytes, gpt2_byte_order, parse_rank_line, read_limited, sniff_wrong_content,
    TokenizerError, EXCERPT_CHARS, MAX_RANK_FILE_BYTES, RANK_FILE_EXPECTED,
};
use rustc_hash::FxHashMap;
use std::path::Path;

/// What [`check_rank_file`] found besides the problems it reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankCheck {
    /// Entries (lines with a distinct rank) read.
    pub entries: usize,
    /// Tokens of two or more bytes that no split makes from two lower-ranked tokens (a BPE
    /// rank file builds every token from two earlier ones; ranks swapped?).
    pub unmerged: usize,
    /// Up to five of them, as `rank R (line L)`.
    pub unmerged_examples: Vec<String>,
}

/// Check a rank file the way `k3 verify` does: unlike loading, every problem is reported
/// (each bad line, each repeated rank or token, each hole in the ranks, each single byte
/// without a token, each of ranks 0..=255 not holding the single byte the byte-level order
/// puts there), through `report`. Over 100 lines: one pass over the lines, then one check
/// after another over the table it built.
pub fn check_rank_file(path: &Path, report: &mut dyn FnMut(String)) -> RankCheck {
    let mut out = RankCheck::default();
    let data = match read_limited(path, MAX_RANK_FILE_BYTES)
        .and_then(|d| sniff_wrong_content(path, &d, RANK_FILE_EXPECTED).map(|()| d))
    {
        Ok(d) => d,
        Err(e) => {
            report(e.to_string());
            return out;
        }
    };
    let shown = path.display();
    let mut by_rank: FxHashMap<u32, (usize, Vec<u8>)> = FxHashMap::default();
    let mut by_bytes: FxHashMap<Vec<u8>, (u32, usize)> = FxHashMap::default();
    for (index, raw) in data.split(|&b| b == b'\n').enumerate() {
        let line_no = index + 1;
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.is_empty() {
            continue;
        }
        let entry = match parse_rank_line(path, line_no, line) {
            Ok(e) => e,
            Err(e) => {
                report(e.to_string());
                continue;
            }
        };
        if let Some(&(first_line, _)) = by_rank.get(&entry.rank) {
            report(
                TokenizerError::DuplicateRank {
                    path: path.to_path_buf(),
                    line: line_no,
                    rank: entry.rank,
                    first_line,
                }
                .to_string(),
            );
            continue;
        }
        if let Some(&(first_rank, first_line)) = by_bytes.get(&entry.bytes) {
            report(
                TokenizerError::DuplicateToken {
                    path: path.to_path_buf(),
                    line: line_no,
                    found: format!("{:?}", excerpt_bytes(&entry.bytes)),
                    first_rank,
                    first_line,
                }
                .to_string(),
            );
        } else {
            by_bytes.insert(entry.bytes.clone(), (entry.rank, line_no));
        }
        by_rank.insert(entry.rank, (line_no, entry.bytes));
    }
    out.entries = by_rank.len();
    if by_rank.is_empty() {
        report(
            TokenizerError::EmptyFile {
                path: path.to_path_buf(),
                expected: RANK_FILE_EXPECTED,
            }
            .to_string(),
        );
        return out;
    }
    let mut ranks: Vec<u32> = by_rank.keys().copied().collect();
    ranks.sort_unstable();
    let mut next = 0u32;
    for &r in &ranks {
        if r > next {
            let range = if r - 1 == next {
                format!("rank {next} is")
            } else {
                format!("ranks {next}..={} are", r - 1)
            };
            report(format!(
                "{shown}: {range} missing (ranks must run from 0 without holes; the file has \
                 {} entries, the highest rank is {})",
                ranks.len(),
                ranks.last().copied().unwrap_or(0)
            ));
        }
        next = r.saturating_add(1);
    }
    let missing: Vec<String> = (0..=u8::MAX)
        .filter(|b| !by_bytes.contains_key([*b].as_slice()))
        .map(|b| format!("0x{b:02x}"))
        .collect();
    if !missing.is_empty() {
        report(format!(
            "{shown}: {} single byte(s) have no token: {}",
            missing.len(),
            crate::stream::join_listed(&missing)
        ));
    }
    for (r, want) in (0u32..).zip(gpt2_byte_order()) {
        let misplaced = by_rank
            .get(&r)
            .filter(|(_, bytes)| bytes.as_slice() != [want].as_slice());
        if let Some((line, bytes)) = misplaced {
            report(format!(
                "{shown}: line {line}: rank {r} holds {}, the byte-level order puts byte \
                 0x{want:02x} there (the single bytes sit at ranks 0..=255 in that order; \
                 ranks swapped?)",
                escape_token(bytes)
            ));
        }
    }
    for &r in &ranks {
        let Some((line, bytes)) = by_rank.get(&r) else {
            continue;
        };
        if bytes.len() < 2 {
            continue;
        }
        let lower = |part: &[u8]| by_bytes.get(part).is_some_and(|&(pr, _)| pr < r);
        if !(1..bytes.len()).any(|k| lower(&bytes[..k]) && lower(&bytes[k..])) {
            out.unmerged += 1;
            if out.unmerged_examples.len() < 5 {
                out.unmerged_examples
                    .push(format!("rank {r} {} (line {line})", escape_token(bytes)));
            }
        }
    }
    out
}

/// Token bytes for a message: as text when they are printable UTF-8, else as bytes, escaped.
fn escape_token(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if bytes.len() <= EXCERPT_CHARS => format!("{s:?}"),
        _ => format!(
            "b\"{}\"",
            bytes[..bytes.len().min(EXCERPT_CHARS)].escape_ascii()
        ),
    }
}
