//! safetensors header parsing and validation over borrowed bytes (no I/O here).
//!
//! File = 8-byte little-endian header length N, N bytes of JSON, then the data region;
//! `data_offsets` are relative to the data region. Everything is checked before use: the length
//! against a cap and the file size, the JSON shape, duplicate names, dtypes, ranks, shape ×
//! dtype = span (checked arithmetic), and that the tensors cover the data region exactly, with no
//! overlap, hole or trailing byte.

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected,
    Visitor,
};
use std::borrow::Cow;
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

/// One validated header entry; the name borrows the header bytes where it has no escapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry<'a> {
    /// Tensor name exactly as decoded from the JSON.
    pub name: Cow<'a, str>,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions: the first `rank` of them.
    pub dims: [u64; MAX_RANK],
    /// Number of dimensions (0 for a scalar).
    pub rank: u8,
    /// Start of the data, relative to the data region.
    pub begin: u64,
    /// End (exclusive), relative to the data region.
    pub end: u64,
}

impl HeaderEntry<'_> {
    /// Dimensions (empty for a scalar).
    #[must_use]
    pub fn shape(&self) -> &[u64] {
        &self.dims[..usize::from(self.rank)]
    }
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

/// A JSON value described for a message (the parse does not keep values).
fn describe_number<E>(what: Unexpected<'_>) -> Result<NumberOrNot, E> {
    Ok(NumberOrNot::Not(match what {
        Unexpected::Signed(i) => i.to_string(),
        Unexpected::Float(f) => format!("{f:?}"),
        Unexpected::Str(s) => format!("{s:?}"),
        Unexpected::Bool(b) => b.to_string(),
        Unexpected::Unit => "null".into(),
        Unexpected::Seq => "an array".into(),
        Unexpected::Map => "an object".into(),
        other => other.to_string(),
    }))
}

/// A u64, or what stood in its place.
enum NumberOrNot {
    U64(u64),
    Not(String),
}

impl<'de> Deserialize<'de> for NumberOrNot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NumberOrNot;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an unsigned integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<NumberOrNot, E> {
                Ok(NumberOrNot::U64(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<NumberOrNot, E> {
                describe_number(Unexpected::Signed(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<NumberOrNot, E> {
                describe_number(Unexpected::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<NumberOrNot, E> {
                describe_number(Unexpected::Str(v))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<NumberOrNot, E> {
                describe_number(Unexpected::Bool(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<NumberOrNot, E> {
                describe_number(Unexpected::Unit)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<NumberOrNot, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                describe_number(Unexpected::Seq)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<NumberOrNot, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                describe_number(Unexpected::Map)
            }
        }
        d.deserialize_any(V)
    }
}

/// Up to `MAX_RANK + 1` numbers of an array (one more than allowed is enough to refuse it),
/// and the array's length.
struct Numbers {
    vals: [Option<Result<u64, String>>; MAX_RANK + 1],
    len: usize,
    is_array: bool,
}

impl<'de> Deserialize<'de> for Numbers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Numbers;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of unsigned integers")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Numbers, A::Error> {
                let mut out = Numbers {
                    vals: Default::default(),
                    len: 0,
                    is_array: true,
                };
                while let Some(n) = a.next_element::<NumberOrNot>()? {
                    if let Some(slot) = out.vals.get_mut(out.len) {
                        *slot = Some(match n {
                            NumberOrNot::U64(v) => Ok(v),
                            NumberOrNot::Not(s) => Err(s),
                        });
                    }
                    out.len += 1;
                }
                Ok(out)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Numbers, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Numbers::not_array())
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
            fn visit_unit<E: de::Error>(self) -> Result<Numbers, E> {
                Ok(Numbers::not_array())
            }
        }
        d.deserialize_any(V)
    }
}

impl Numbers {
    fn not_array() -> Numbers {
        Numbers {
            vals: Default::default(),
            len: 0,
            is_array: false,
        }
    }
}

/// A string, or `None` for any other JSON value.
pub(crate) struct MaybeStr<'a>(pub(crate) Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for MaybeStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MaybeStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(MaybeStr(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MaybeStr(Some(Cow::Owned(v.to_string()))))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MaybeStr(Some(Cow::Owned(v))))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MaybeStr(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields of one tensor entry as they were found (checked afterwards, in a fixed order).
#[derive(Default)]
struct RawEntry<'a> {
    is_object: bool,
    unknown: Option<String>,
    dtype: Option<MaybeStr<'a>>,
    shape: Option<Numbers>,
    offsets: Option<Numbers>,
}

impl<'de> Deserialize<'de> for RawEntry<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntry<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tensor entry object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawEntry<'de>, A::Error> {
                let mut e = RawEntry {
                    is_object: true,
                    ..RawEntry::default()
                };
                while let Some(MaybeStr(key)) = m.next_key::<MaybeStr<'de>>()? {
                    let key = key.unwrap_or_default();
                    match key.as_ref() {
                        "dtype" => e.dtype = Some(m.next_value()?),
                        "shape" => e.shape = Some(m.next_value()?),
                        "data_offsets" => e.offsets = Some(m.next_value()?),
                        other => {
                            if e.unknown.is_none() {
                                e.unknown = Some(other.to_string());
                            }
                            m.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(e)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<RawEntry<'de>, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(RawEntry::default())
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<RawEntry<'de>, E> {
                Ok(RawEntry::default())
            }
        }
        d.deserialize_any(V)
    }
}

/// `__metadata__`: whether it is an object whose values are all strings.
struct Metadata(bool);

impl<'de> Deserialize<'de> for Metadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Metadata;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Metadata, A::Error> {
                let mut ok = true;
                while let Some((_, MaybeStr(v))) = m.next_entry::<IgnoredAny, MaybeStr<'de>>()? {
                    ok &= v.is_some();
                }
                Ok(Metadata(ok))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Metadata, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Metadata(false))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Metadata, E> {
                Ok(Metadata(false))
            }
        }
        d.deserialize_any(V)
    }
}

/// The top-level object, parsed entry by entry straight into checked entries (no JSON value
/// tree): the first refusal is kept in `failed` and stops the parse.
struct Header<'a, 'f> {
    entries: Vec<HeaderEntry<'a>>,
    failed: &'f mut Option<HeaderError>,
}

impl<'de> DeserializeSeed<'de> for Header<'de, '_> {
    type Value = Vec<HeaderEntry<'de>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Header<'de, '_> {
    type Value = Vec<HeaderEntry<'de>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object mapping tensor names to entries")
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut metadata_seen = false;
        while let Some(MaybeStr(name)) = m.next_key::<MaybeStr<'de>>()? {
            let name = name.unwrap_or_default();
            if name == "__metadata__" {
                if std::mem::replace(&mut metadata_seen, true) {
                    *self.failed = Some(HeaderError::Duplicate(name.into_owned()));
                    return Err(de::Error::custom("refused"));
                }
                if !m.next_value::<Metadata>()?.0 {
                    *self.failed = Some(HeaderError::Json(
                        "`__metadata__` must be an object of strings".into(),
                    ));
                    return Err(de::Error::custom("refused"));
                }
                continue;
            }
            let raw: RawEntry<'de> = m.next_value()?;
            match check_entry(name, raw) {
                Ok(e) => self.entries.push(e),
                Err(e) => {
                    *self.failed = Some(e);
                    return Err(de::Error::custom("refused"));
                }
            }
        }
        Ok(self.entries)
    }
}

fn check_entry<'a>(name: Cow<'a, str>, raw: RawEntry<'a>) -> Result<HeaderEntry<'a>, HeaderError> {
    let bad = |reason: String| HeaderError::Entry {
        name: name.to_string(),
        reason,
    };
    if !raw.is_object {
        return Err(bad("entry is not an object".into()));
    }
    if let Some(key) = &raw.unknown {
        return Err(bad(format!("unknown field {key:?}")));
    }
    let dtype_s = raw
        .dtype
        .and_then(|d| d.0)
        .ok_or_else(|| bad("missing or non-string `dtype`".into()))?;
    let dtype =
        Dtype::parse(&dtype_s).ok_or_else(|| bad(format!("unsupported dtype {dtype_s:?}")))?;
    let shape_v = raw
        .shape
        .filter(|s| s.is_array)
        .ok_or_else(|| bad("missing or non-array `shape`".into()))?;
    if shape_v.len > MAX_RANK {
        return Err(bad(format!(
            "rank {} above the maximum {MAX_RANK}",
            shape_v.len
        )));
    }
    let mut dims = [0u64; MAX_RANK];
    for (d, v) in dims.iter_mut().zip(&shape_v.vals[..shape_v.len]) {
        match v {
            Some(Ok(x)) => *d = *x,
            Some(Err(s)) => return Err(bad(format!("shape entry {s} is not a u64"))),
            None => return Err(bad("shape entry missing".into())),
        }
    }
    let offs = raw
        .offsets
        .filter(|s| s.is_array)
        .ok_or_else(|| bad("missing or non-array `data_offsets`".into()))?;
    if offs.len != 2 {
        return Err(bad(format!(
            "`data_offsets` has {} values, expected 2",
            offs.len
        )));
    }
    let offset = |i: usize, which: &str| match &offs.vals[i] {
        Some(Ok(v)) => Ok(*v),
        Some(Err(s)) => Err(bad(format!("{which} offset {s} is not a u64"))),
        None => Err(bad(format!("{which} offset missing"))),
    };
    let begin = offset(0, "begin")?;
    let end = offset(1, "end")?;
    if end < begin {
        return Err(bad(format!(
            "end offset {end} is before begin offset {begin}"
        )));
    }
    let rank = shape_v.len;
    let shape = &dims[..rank];
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let want = numel
        .checked_mul(dtype.size())
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    if want != end - begin {
        return Err(HeaderError::SpanMismatch {
            name: name.into_owned(),
            shape: shape.to_vec(),
            dtype: dtype.name(),
            want,
            got: end - begin,
        });
    }
    Ok(HeaderEntry {
        name,
        dtype,
        dims,
        rank: rank as u8,
        begin,
        end,
    })
}

/// Parse and validate a header's JSON bytes for a data region of `data_len` bytes.
///
/// Entries come back in data order, names borrowed from `json` where they have no escapes.
/// `__metadata__` is skipped (it must be a string map). The JSON is read entry by entry into
/// the compact entries (no value tree of the whole header is built), so a header costs about
/// its own size again in entries.
pub fn parse_header(json: &[u8], data_len: u64) -> Result<Vec<HeaderEntry<'_>>, HeaderError> {
    let text = std::str::from_utf8(json).map_err(|e| {
        HeaderError::Json(format!(
            "not UTF-8 at byte {} of the header",
            e.valid_up_to()
        ))
    })?;
    // JSON whitespace may come before the object, as serde_json and the safetensors crate
    // accept; anything else must be the object itself.
    if !text
        .trim_start_matches([' ', '\t', '\n', '\r'])
        .starts_with('{')
    {
        return Err(HeaderError::Json(
            "the header must be a JSON object (`{` after any whitespace)".into(),
        ));
    }
    let mut failed = None;
    let mut de = serde_json::Deserializer::from_str(text.trim_end_matches(' '));
    let parsed = Header {
        entries: Vec::new(),
        failed: &mut failed,
    }
    .deserialize(&mut de)
    .and_then(|entries| de.end().map(|()| entries));
    let mut entries = match (parsed, failed) {
        (_, Some(refusal)) => return Err(refusal),
        (Err(e), None) => return Err(HeaderError::Json(format!("{e}"))),
        (Ok(entries), None) => entries,
    };
    check_duplicates(&entries)?;
    check_coverage(&mut entries, data_len)?;
    Ok(entries)
}

/// Refuse a name that appears twice (sorting indices, not copying names).
fn check_duplicates(entries: &[HeaderEntry<'_>]) -> Result<(), HeaderError> {
    let mut order: Vec<u32> = (0..entries.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| entries[a as usize].name.cmp(&entries[b as usize].name));
    for w in order.windows(2) {
        let (a, b) = (&entries[w[0] as usize], &entries[w[1] as usize]);
        if a.name == b.name {
            return Err(HeaderError::Duplicate(a.name.to_string()));
        }
    }
    Ok(())
}

/// Sort by offset and require exact, non-overlapping coverage of `[0, data_len)`.
fn check_coverage(entries: &mut [HeaderEntry<'_>], data_len: u64) -> Result<(), HeaderError> {
    entries.sort_unstable_by_key(|a| (a.begin, a.end));
    let mut covered = 0u64;
    let mut last: Option<&HeaderEntry<'_>> = None;
    for e in entries.iter() {
        if e.begin == e.end {
            continue; // empty tensors occupy no bytes
        }
        if e.begin < covered {
            let a = last.map_or_else(String::new, |l| l.name.to_string());
            return Err(HeaderError::Overlap {
                a,
                b: e.name.to_string(),
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

    fn parse(json: &str, data_len: u64) -> Result<Vec<HeaderEntry<'_>>, HeaderError> {
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
        let names: Vec<&str> = e.iter().map(|x| x.name.as_ref()).collect();
        assert_eq!(names, ["a", "b", "e"]);
        assert_eq!(e.len(), 3);
    }

    #[test]
    fn malformed_json_and_shapes_are_refused() {
        let cases: &[(&str, u64, &str)] = &[
            ("[1,2]", 0, "must be a JSON object"),
            (" \n[]", 0, "must be a JSON object"),
            ("\u{a0}{}", 0, "must be a JSON object"),
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
        // JSON whitespace before the object is accepted, as the safetensors crate does.
        assert_eq!(parse(" \n\t\r{}", 0).map(|e| e.len()).ok(), Some(0));
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
        let mut names: Vec<String> = e.into_iter().map(|x| x.name.into_owned()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 3);
    }
}
