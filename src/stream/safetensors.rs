//! safetensors header parsing and validation over borrowed bytes (no I/O here).
//!
//! File = 8-byte little-endian header length N, N bytes of JSON, then the data region;
//! `data_offsets` are relative to the data region. Everything is checked before use: the length
//! against a cap and the file size, the JSON shape, duplicate names, dtypes, ranks, shape ×
//! dtype = span (checked arithmetic), and that the tensors cover the data region exactly, with no
//! overlap, hole or trailing byte.

use serde::de::{Deserializer, MapAccess, Visitor};
use std::fmt;

/// Largest header accepted (the `safetensors` crate's cap).
pub const MAX_HEADER_LEN: u64 = 100_000_000;
/// Largest tensor rank accepted.
pub const MAX_RANK: usize = 4;

/// Element types k3 reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// IEEE float32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE float16.
    F16,
    /// Unsigned bytes (MXFP4 packed nibbles and E8M0 scales).
    U8,
}

impl Dtype {
    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// The safetensors spelling.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::U8 => "U8",
        }
    }

    /// The dtype a safetensors spelling names, if k3 supports it.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => Dtype::F32,
            "BF16" => Dtype::Bf16,
            "F16" => Dtype::F16,
            "U8" => Dtype::U8,
            _ => return None,
        })
    }
}

/// One validated header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name exactly as decoded from the JSON.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions (empty for a scalar).
    pub shape: Vec<u64>,
    /// Start of the data, relative to the data region.
    pub begin: u64,
    /// End (exclusive), relative to the data region.
    pub end: u64,
}

/// Why a shard header was refused. Each carries enough to fix the file.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeaderError {
    /// The file is shorter than the 8-byte length prefix.
    #[error("file is {len} bytes, shorter than the 8-byte header length prefix")]
    TooShort {
        /// File size.
        len: u64,
    },
    /// The header length is zero, above the cap, or past the end of the file.
    #[error("{}{hint}", header_length_text(*.n, *.file_len, *.cap))]
    HeaderLength {
        /// Declared header length.
        n: u64,
        /// File size.
        file_len: u64,
        /// The cap.
        cap: u64,
        /// A hint when the bytes look like a Git LFS pointer or an HTML page.
        hint: String,
    },
    /// The header is not UTF-8 JSON of the expected form.
    #[error("header is not valid: {0}")]
    Json(String),
    /// The same tensor name appears twice.
    #[error("duplicate tensor {0:?} in the header")]
    Duplicate(String),
    /// A tensor entry is malformed (missing field, bad type, bad offsets).
    #[error("tensor {name:?}: {reason}")]
    Entry {
        /// Tensor name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// `shape × dtype` does not equal the byte span.
    #[error("tensor {name:?}: shape {shape:?} × {dtype} = {want} bytes, span is {got}")]
    SpanMismatch {
        /// Tensor name.
        name: String,
        /// Declared shape.
        shape: Vec<u64>,
        /// dtype name.
        dtype: &'static str,
        /// Expected byte count.
        want: u64,
        /// Span from the offsets.
        got: u64,
    },
    /// Tensor bytes overlap.
    #[error("tensor {b:?} overlaps {a:?} at [{start}, {end})")]
    Overlap {
        /// The earlier tensor.
        a: String,
        /// The later tensor.
        b: String,
        /// Overlap start.
        start: u64,
        /// Overlap end.
        end: u64,
    },
    /// A gap between tensors or before the first.
    #[error("{len} unindexed bytes at data offset {at}")]
    Hole {
        /// Where the gap starts.
        at: u64,
        /// Its length.
        len: u64,
    },
    /// Data region and tensors disagree at the end.
    #[error("tensors end at data byte {covered} but the data region is {data_len} bytes{detail}")]
    Coverage {
        /// End of the last tensor.
        covered: u64,
        /// Size of the data region.
        data_len: u64,
        /// "truncated" or "trailing bytes" explanation.
        detail: String,
    },
}

/// What is wrong with header length `n` in a file of `file_len` bytes, said plainly.
fn header_length_text(n: u64, file_len: u64, cap: u64) -> String {
    let room = file_len.saturating_sub(8);
    let size = format!("file is {file_len} bytes");
    if n == 0 {
        format!("header length is 0: a safetensors header is a non-empty JSON object ({size})")
    } else if n > cap {
        format!("header length {n} is above the cap of {cap} bytes ({size})")
    } else {
        format!("header length {n} exceeds the {room} bytes after the 8-byte prefix ({size})")
    }
}

/// Read the header length prefix and check it against the file size and the cap.
pub fn header_len(prefix: &[u8], file_len: u64) -> Result<u64, HeaderError> {
    if file_len < 8 || prefix.len() < 8 {
        return Err(HeaderError::TooShort { len: file_len });
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&prefix[..8]);
    let n = u64::from_le_bytes(b);
    if n == 0 || n > MAX_HEADER_LEN || n > file_len - 8 {
        let hint = if prefix.starts_with(b"version ") {
            " (this looks like a Git LFS pointer, not the weights: fetch the real file)"
        } else if prefix.starts_with(b"<") || prefix.to_ascii_lowercase().starts_with(b"<!doc") {
            " (this looks like an HTML page, not a safetensors file)"
        } else {
            ""
        };
        return Err(HeaderError::HeaderLength {
            n,
            file_len,
            cap: MAX_HEADER_LEN,
            hint: hint.to_string(),
        });
    }
    Ok(n)
}

/// Top-level JSON object kept as an ordered list so duplicate keys are seen.
struct RawHeader(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object mapping tensor names to entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawHeader, A::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(0));
                while let Some((k, v)) = m.next_entry::<String, serde_json::Value>()? {
                    out.push((k, v));
                }
                Ok(RawHeader(out))
            }
        }
        d.deserialize_map(V)
    }
}

fn as_u64(v: &serde_json::Value) -> Option<u64> {
    match v {
        serde_json::Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

fn parse_entry(name: &str, v: &serde_json::Value) -> Result<HeaderEntry, HeaderError> {
    let bad = |reason: String| HeaderError::Entry {
        name: name.to_string(),
        reason,
    };
    let obj = v
        .as_object()
        .ok_or_else(|| bad("entry is not an object".into()))?;
    for key in obj.keys() {
        if !matches!(key.as_str(), "dtype" | "shape" | "data_offsets") {
            return Err(bad(format!("unknown field {key:?}")));
        }
    }
    let dtype_s = obj
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("missing or non-string `dtype`".into()))?;
    let dtype =
        Dtype::parse(dtype_s).ok_or_else(|| bad(format!("unsupported dtype {dtype_s:?}")))?;
    let shape_v = obj
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("missing or non-array `shape`".into()))?;
    if shape_v.len() > MAX_RANK {
        return Err(bad(format!(
            "rank {} above the maximum {MAX_RANK}",
            shape_v.len()
        )));
    }
    let shape = shape_v
        .iter()
        .map(|d| as_u64(d).ok_or_else(|| bad(format!("shape entry {d} is not a u64"))))
        .collect::<Result<Vec<u64>, _>>()?;
    let offs = obj
        .get("data_offsets")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("missing or non-array `data_offsets`".into()))?;
    if offs.len() != 2 {
        return Err(bad(format!(
            "`data_offsets` has {} values, expected 2",
            offs.len()
        )));
    }
    let begin =
        as_u64(&offs[0]).ok_or_else(|| bad(format!("begin offset {} is not a u64", offs[0])))?;
    let end =
        as_u64(&offs[1]).ok_or_else(|| bad(format!("end offset {} is not a u64", offs[1])))?;
    if end < begin {
        return Err(bad(format!(
            "end offset {end} is before begin offset {begin}"
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let want = numel
        .checked_mul(dtype.size())
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if want != end - begin {
        return Err(HeaderError::SpanMismatch {
            name: name.to_string(),
            shape,
            dtype: dtype.name(),
            want,
            got: end - begin,
        });
    }
    Ok(HeaderEntry {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parse and validate a header's JSON bytes for a data region of `data_len` bytes.
///
/// Entries come back in data order. `__metadata__` is skipped (it must be a string map).
pub fn parse_header(json: &[u8], data_len: u64) -> Result<Vec<HeaderEntry>, HeaderError> {
    let text = std::str::from_utf8(json).map_err(|e| {
        HeaderError::Json(format!(
            "not UTF-8 at byte {} of the header",
            e.valid_up_to()
        ))
    })?;
    if !text.starts_with('{') {
        return Err(HeaderError::Json("the header must start with `{`".into()));
    }
    let raw: RawHeader = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|e| HeaderError::Json(format!("{e}")))?;
    let mut seen = std::collections::HashSet::with_capacity(raw.0.len());
    let mut entries = Vec::with_capacity(raw.0.len());
    for (name, v) in &raw.0 {
        if !seen.insert(name.as_str()) {
            return Err(HeaderError::Duplicate(name.clone()));
        }
        if name == "__metadata__" {
            let ok = v
                .as_object()
                .is_some_and(|m| m.values().all(serde_json::Value::is_string));
            if !ok {
                return Err(HeaderError::Json(
                    "`__metadata__` must be an object of strings".into(),
                ));
            }
            continue;
        }
        entries.push(parse_entry(name, v)?);
    }
    check_coverage(&mut entries, data_len)?;
    Ok(entries)
}

/// Sort by offset and require exact, non-overlapping coverage of `[0, data_len)`.
fn check_coverage(entries: &mut [HeaderEntry], data_len: u64) -> Result<(), HeaderError> {
    entries.sort_by_key(|a| (a.begin, a.end));
    let mut covered = 0u64;
    let mut last: Option<&HeaderEntry> = None;
    for e in entries.iter() {
        if e.begin == e.end {
            continue; // empty tensors occupy no bytes
        }
        if e.begin < covered {
            let a = last.map_or_else(String::new, |l| l.name.clone());
            return Err(HeaderError::Overlap {
                a,
                b: e.name.clone(),
                start: e.begin,
                end: covered.min(e.end),
            });
        }
        if e.begin > covered {
            return Err(HeaderError::Hole {
                at: covered,
                len: e.begin - covered,
            });
        }
        covered = e.end;
        last = Some(e);
    }
    if covered != data_len {
        let detail = if covered > data_len {
            format!(
                " (file truncated by {} bytes? re-download the shard)",
                covered - data_len
            )
        } else {
            format!(
                " ({} trailing bytes after the last tensor)",
                data_len - covered
            )
        };
        return Err(HeaderError::Coverage {
            covered,
            data_len,
            detail,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data_len: u64) -> Result<Vec<HeaderEntry>, HeaderError> {
        parse_header(json.as_bytes(), data_len)
    }

    #[test]
    fn header_length_bounds() {
        let mut p = [0u8; 16];
        assert_eq!(
            header_len(&p[..4], 4),
            Err(HeaderError::TooShort { len: 4 })
        );
        // Zero, beyond the file, beyond the cap, u64::MAX, exactly 8 bytes of file.
        for (n, file_len) in [
            (0u64, 100u64),
            (93, 100),
            (MAX_HEADER_LEN + 1, u64::MAX),
            (u64::MAX, 100),
            (1, 8),
        ] {
            p[..8].copy_from_slice(&n.to_le_bytes());
            assert!(
                matches!(
                    header_len(&p, file_len),
                    Err(HeaderError::HeaderLength { .. })
                ),
                "{n}"
            );
        }
        p[..8].copy_from_slice(&92u64.to_le_bytes());
        assert_eq!(header_len(&p, 100), Ok(92));
    }

    #[test]
    fn html_page_gets_a_hint() {
        let p = b"<!DOCTYPE html><html>";
        match header_len(p, 4000) {
            Err(HeaderError::HeaderLength { hint, .. }) => assert!(hint.contains("HTML")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn valid_header_with_metadata_padding_and_empty_tensor() {
        let j = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"e":{"dtype":"U8","shape":[0,3],"data_offsets":[8,8]}}   "#;
        let e = parse(j, 8).unwrap();
        let names: Vec<&str> = e.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "e"]);
        assert_eq!(e.len(), 3);
    }

    #[test]
    fn malformed_json_and_shapes_are_refused() {
        let cases: &[(&str, u64, &str)] = &[
            ("[1,2]", 0, "start with"),
            (" {}", 0, "start with"),
            (
                "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}",
                4,
                "EOF",
            ),
            (
                r#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#,
                8,
                "unsupported dtype",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}"#,
                4,
                "not a u64",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[-1,3]}}"#,
                4,
                "not a u64",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}}"#,
                4,
                "not a u64",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
                4,
                "before begin",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4,
                "span is 4",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4,9223372036854775807],"data_offsets":[0,4]}}"#,
                4,
                "overflows",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1,1,1,1,1],"data_offsets":[0,1]}}"#,
                1,
                "rank 5",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}"#,
                1,
                "unknown field",
            ),
            (r#"{"__metadata__":{"k":1}}"#, 0, "__metadata__"),
        ];
        for (j, len, needle) in cases {
            let err = parse(j, *len).unwrap_err().to_string();
            assert!(err.contains(needle), "{j}: {err}");
        }
        let err = parse_header(b"{\"a\xff\":1}", 0).unwrap_err();
        assert!(
            matches!(err, HeaderError::Json(ref m) if m.contains("UTF-8")),
            "{err}"
        );
    }

    #[test]
    fn duplicate_names_overlaps_holes_and_trailing_bytes_are_refused() {
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert_eq!(parse(dup, 2), Err(HeaderError::Duplicate("a".into())));
        let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        assert!(matches!(
            parse(overlap, 6),
            Err(HeaderError::Overlap { .. })
        ));
        let aliased = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(matches!(
            parse(aliased, 4),
            Err(HeaderError::Overlap { .. })
        ));
        let hole = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}}"#;
        assert_eq!(parse(hole, 10), Err(HeaderError::Hole { at: 4, len: 2 }));
        let late = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        assert_eq!(parse(late, 6), Err(HeaderError::Hole { at: 0, len: 2 }));
        let one = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(parse(one, 5)
            .unwrap_err()
            .to_string()
            .contains("1 trailing bytes"));
        assert!(parse(one, 3).unwrap_err().to_string().contains("truncated"));
    }

    #[test]
    fn escaped_names_stay_distinct() {
        let j = r#"{"a\u0000":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"a\u00e8":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}"#;
        let e = parse(j, 3).unwrap();
        let mut names: Vec<String> = e.into_iter().map(|x| x.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 3);
    }
}
