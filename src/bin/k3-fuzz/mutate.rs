//! A seeded, structure-aware mutator: byte edits, the target's dictionary of tokens, numbers
//! that sit on the parsers' boundaries (in text and as little-endian integers), splices of two
//! inputs, truncation. Deterministic for a given seed.

/// xorshift64* — small, fast and reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Numbers written as text where the input has digits.
const TEXT_NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "-0",
    "1.5",
    "1e3",
    "1e400",
    "-1e400",
    "255",
    "256",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "100000000",
    "1048576",
    "99999999999999999999999999",
];

/// Bytes that matter to JSON, TOML, base64 and line formats.
const BYTES: &[u8] = &[
    0, 0xff, 0x7f, 0x80, 0xc0, 0xef, b'"', b'{', b'}', b'[', b']', b',', b':', b'\\', b'\n', b'\r',
    b' ', b'=', b'#', b'\'', b'.', b'-', b'+', b'/', b'e',
];

fn interesting_u64(len: usize, r: &mut Rng) -> u64 {
    let len = len as u64;
    [
        0,
        1,
        2,
        0x7f,
        0xff,
        0xffff,
        u64::from(u32::MAX),
        1 << 32,
        i64::MAX as u64,
        1 << 63,
        u64::MAX,
        len,
        len + 1,
        len.saturating_sub(1),
        len.saturating_sub(8),
    ][r.below(15)]
}

/// One mutation of `input` (which may be the input itself unchanged only when it is empty).
fn mutate_once(out: &mut Vec<u8>, other: &[u8], dict: &[&[u8]], r: &mut Rng) {
    let len = out.len();
    let pos = if len == 0 { 0 } else { r.below(len) };
    match r.below(11) {
        0 if len > 0 => out[pos] ^= 1 << r.below(8),
        1 if len > 0 => out[pos] = BYTES[r.below(BYTES.len())],
        2 if len > 0 => {
            let span = if r.below(4) == 0 { len } else { 16 };
            let n = 1 + r.below((len - pos).min(span));
            out.drain(pos..pos + n);
        }
        3 if len > 0 => {
            let n = 1 + r.below((len - pos).min(64));
            let piece = out[pos..pos + n].to_vec();
            let at = r.below(len + 1);
            out.splice(at..at, piece);
        }
        4 | 5 if !dict.is_empty() => {
            let tok = dict[r.below(dict.len())];
            if r.below(2) == 0 || len == 0 {
                out.splice(pos..pos, tok.iter().copied());
            } else {
                let n = 1 + r.below((len - pos).min(tok.len() + 4));
                out.splice(pos..pos + n, tok.iter().copied());
            }
        }
        6 => {
            // The digit run at or after `pos`, or an insertion there.
            let start = (pos..len).find(|&i| out[i].is_ascii_digit()).unwrap_or(pos);
            let end = (start..len)
                .find(|&i| !out[i].is_ascii_digit())
                .unwrap_or(len);
            let num = TEXT_NUMBERS[r.below(TEXT_NUMBERS.len())];
            out.splice(start..end, num.bytes());
        }
        7 if len >= 4 => {
            let v = interesting_u64(len, r);
            if len >= 8 && r.below(2) == 0 {
                let at = r.below(len - 7);
                out[at..at + 8].copy_from_slice(&v.to_le_bytes());
            } else {
                let at = r.below(len - 3);
                out[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
            }
        }
        8 if !other.is_empty() => {
            let cut = r.below(len + 1);
            let from = r.below(other.len());
            out.truncate(cut);
            out.extend_from_slice(&other[from..]);
        }
        9 if len > 0 => out.truncate(pos),
        _ => {
            let b = BYTES[r.below(BYTES.len())];
            out.insert(pos.min(len), b);
        }
    }
}

/// A mutant of `input` written into `out` (whose capacity is reused from one input to the
/// next): one to eight stacked mutations, at most `max_len` bytes.
pub fn mutate(
    out: &mut Vec<u8>,
    input: &[u8],
    other: &[u8],
    dict: &[&[u8]],
    max_len: usize,
    r: &mut Rng,
) {
    out.clear();
    out.extend_from_slice(input);
    let stack = if r.below(4) == 0 { 8 } else { 2 };
    let n = 1 + r.below(stack);
    for _ in 0..n {
        mutate_once(out, other, dict, r);
    }
    out.truncate(max_len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutation_is_deterministic_and_bounded() {
        let run = |seed| {
            let mut r = Rng::new(seed);
            let mut out = Vec::new();
            (0..2000)
                .map(|_| {
                    mutate(
                        &mut out,
                        b"{\"a\":[1,2]}",
                        b"xyz",
                        &[b"\"shape\""],
                        64,
                        &mut r,
                    );
                    out.clone()
                })
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        assert!(a.iter().all(|m| m.len() <= 64));
        assert!(a.iter().any(|m| m.windows(7).any(|w| w == b"\"shape\"")));
    }
}
