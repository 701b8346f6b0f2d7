//! `model.safetensors.index.json`: which shard file holds each tensor, parsed over borrowed
//! bytes (no I/O here).
//!
//! The file is read entry by entry, like a shard header (`safetensors.rs`), straight into one
//! compact record per tensor (a name borrowed from the file's bytes and a shard number): no
//! JSON value tree of the whole map is built, so an index costs about its own size plus
//! [`BYTES_PER_ENTRY`] per tensor. Its size and its number of entries are bounded before
//! anything grows with them.

use super::safetensors::MaybeStr;
use rustc_hash::FxHashMap;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// Largest index file read (about ten times the released checkpoint's).
pub const MAX_INDEX_LEN: u64 = 512 << 20;
/// Most `weight_map` entries accepted (about ten times the released checkpoint's 497,220).
pub const MAX_INDEX_ENTRIES: usize = 5_000_000;
/// Most distinct shard files (the tensor index numbers shards with 16 bits).
pub const MAX_INDEX_SHARDS: usize = u16::MAX as usize;
/// What each entry costs beyond the file's own bytes (one record).
pub const BYTES_PER_ENTRY: usize = std::mem::size_of::<(u32, Cow<'static, str>)>();

/// The shard files an index names, each with the tensors it should hold.
#[derive(Debug, Default)]
pub struct WeightMap<'a> {
    /// Distinct shard file names, sorted.
    files: Vec<Cow<'a, str>>,
    /// (file number, tensor name), sorted by file, then name.
    entries: Vec<(u32, Cow<'a, str>)>,
    /// Where each file's run of entries starts in `entries` (one more than `files`).
    starts: Vec<usize>,
}

impl<'a> WeightMap<'a> {
    /// Number of distinct shard files.
    #[must_use]
    pub fn n_files(&self) -> usize {
        self.files.len()
    }

    /// Number of tensors.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map names no tensor.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every shard file, sorted, with the tensors mapped to it (sorted, never empty).
    pub fn files(&self) -> impl Iterator<Item = (&str, Tensors<'_, 'a>)> + '_ {
        self.files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.as_ref(), self.run(i)))
    }

    /// The tensors mapped to `file`, if the map names it.
    #[must_use]
    pub fn tensors(&self, file: &str) -> Option<Tensors<'_, 'a>> {
        self.files
            .binary_search_by(|f| f.as_ref().cmp(file))
            .ok()
            .map(|i| self.run(i))
    }

    /// Whether the map names `file`.
    #[must_use]
    pub fn contains_file(&self, file: &str) -> bool {
        self.tensors(file).is_some()
    }

    fn run(&self, i: usize) -> Tensors<'_, 'a> {
        Tensors(&self.entries[self.starts[i]..self.starts[i + 1]])
    }
}

/// The tensors one shard file should hold, sorted by name.
#[derive(Clone, Copy, Debug)]
pub struct Tensors<'m, 'a>(&'m [(u32, Cow<'a, str>)]);

impl<'m> Tensors<'m, '_> {
    /// How many.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none (never, for a file the map names).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The first, by name.
    #[must_use]
    pub fn first(&self) -> Option<&'m str> {
        self.0.first().map(|(_, n)| n.as_ref())
    }

    /// The names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &'m str> + 'm {
        self.0.iter().map(|(_, n)| n.as_ref())
    }
}

/// Parse the bytes of a `model.safetensors.index.json`: the shard files its `weight_map`
/// names, each with the tensors it should hold, names borrowed from `bytes` where they have
/// no escapes; the reason when it is refused. Other top-level keys (`metadata`) are skipped.
pub fn parse(bytes: &[u8]) -> Result<WeightMap<'_>, String> {
    parse_within(
        bytes,
        Limits {
            len: MAX_INDEX_LEN,
            entries: MAX_INDEX_ENTRIES,
            shards: MAX_INDEX_SHARDS,
        },
    )
}

/// The bounds [`parse`] applies (smaller ones in tests).
#[derive(Clone, Copy)]
struct Limits {
    len: u64,
    entries: usize,
    shards: usize,
}

fn parse_within(bytes: &[u8], limits: Limits) -> Result<WeightMap<'_>, String> {
    if bytes.len() as u64 > limits.len {
        return Err(format!(
            "{} bytes, above the maximum of {} bytes for an index",
            bytes.len(),
            limits.len
        ));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|e| format!("not UTF-8 (at byte {})", e.valid_up_to()))?;
    let mut failed = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Level {
        object: Object::Top,
        failed: &mut failed,
        limits,
    }
    .deserialize(&mut de)
    .and_then(|found| de.end().map(|()| found));
    let found = match (parsed, failed) {
        (_, Some(refusal)) => return Err(refusal),
        (Err(e), None) => return Err(format!("not valid JSON: {e}")),
        (Ok(found), None) => found,
    };
    let Some((names, mut entries)) = found else {
        return Err("no `weight_map` object".into());
    };
    // Number the files in name order, then sort the entries by file and name.
    let mut order: Vec<u32> = (0..names.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| names[a as usize].cmp(&names[b as usize]));
    let mut rank = vec![0u32; names.len()];
    for (r, &i) in order.iter().enumerate() {
        rank[i as usize] = r as u32;
    }
    for e in &mut entries {
        e.0 = rank[e.0 as usize];
    }
    drop(rank);
    let mut files: Vec<Option<Cow<'_, str>>> = names.into_iter().map(Some).collect();
    let files: Vec<Cow<'_, str>> = order
        .iter()
        .filter_map(|&i| files[i as usize].take())
        .collect();
    drop(order);
    entries.sort_unstable_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    check_duplicates(&entries, &files)?;
    let mut starts = Vec::with_capacity(files.len() + 1);
    let mut at = 0;
    for f in 0..files.len() as u32 {
        starts.push(at);
        at += entries[at..].iter().take_while(|e| e.0 == f).count();
    }
    starts.push(at);
    Ok(WeightMap {
        files,
        entries,
        starts,
    })
}

/// Refuse a tensor named twice, in one file or in two (sorting indices, not copying names).
fn check_duplicates(entries: &[(u32, Cow<'_, str>)], files: &[Cow<'_, str>]) -> Result<(), String> {
    let mut order: Vec<u32> = (0..entries.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| entries[a as usize].1.cmp(&entries[b as usize].1));
    for w in order.windows(2) {
        let (a, b) = (&entries[w[0] as usize], &entries[w[1] as usize]);
        if a.1 == b.1 {
            let (fa, fb) = (&files[a.0 as usize], &files[b.0 as usize]);
            return Err(if fa == fb {
                format!("weight_map names tensor {:?} twice", a.1)
            } else {
                format!(
                    "weight_map names tensor {:?} twice, in {fa:?} and {fb:?}",
                    a.1
                )
            });
        }
    }
    Ok(())
}

/// Distinct file names in first-seen order, and (file number, tensor) per entry.
type Found<'a> = Option<(Vec<Cow<'a, str>>, Vec<(u32, Cow<'a, str>)>)>;

/// Which object a [`Level`] reads.
#[derive(Clone, Copy)]
enum Object {
    /// The top level: `weight_map` read entry by entry, other keys skipped.
    Top,
    /// The `weight_map` object: tensor name → shard file name.
    WeightMap,
}

/// One visitor for both objects of the index, so that any other shape, at either level,
/// reads as "no `weight_map` object" (`None`) the same way. The first refusal is left in
/// `failed`, in words; the error returned only stops the parse.
struct Level<'f> {
    object: Object,
    failed: &'f mut Option<String>,
    limits: Limits,
}

impl Level<'_> {
    /// Record why the index is refused, and stop the parse.
    fn refuse<E: de::Error>(&mut self, why: String) -> E {
        *self.failed = Some(why);
        E::custom("refused")
    }

    /// The top-level object: its `weight_map`, read once; other keys skipped.
    fn top<'de, A: MapAccess<'de>>(mut self, mut m: A) -> Result<Found<'de>, A::Error> {
        let mut found: Found<'de> = None;
        let mut seen = false;
        while let Some(MaybeStr(key)) = m.next_key::<MaybeStr<'de>>()? {
            if key.as_deref() != Some("weight_map") {
                m.next_value::<IgnoredAny>()?;
                continue;
            }
            if std::mem::replace(&mut seen, true) {
                return Err(self.refuse("`weight_map` appears twice".into()));
            }
            found = m.next_value_seed(Level {
                object: Object::WeightMap,
                failed: &mut *self.failed,
                limits: self.limits,
            })?;
        }
        Ok(found)
    }

    /// The `weight_map` entries: each shard file numbered as first seen, one record per
    /// tensor, within the entry and shard bounds.
    fn entries<'de, A: MapAccess<'de>>(mut self, mut m: A) -> Result<Found<'de>, A::Error> {
        let mut names: Vec<Cow<'de, str>> = Vec::new();
        let mut number: FxHashMap<Cow<'de, str>, u32> = FxHashMap::default();
        let mut entries: Vec<(u32, Cow<'de, str>)> = Vec::new();
        while let Some(MaybeStr(tensor)) = m.next_key::<MaybeStr<'de>>()? {
            let tensor = tensor.unwrap_or_default();
            if entries.len() == self.limits.entries {
                let why = format!("weight_map has more than {} entries", self.limits.entries);
                return Err(self.refuse(why));
            }
            let Some(file) = m.next_value::<MaybeStr<'de>>()?.0 else {
                return Err(self.refuse(format!("weight_map[{tensor:?}] is not a string")));
            };
            if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
                return Err(self.refuse(format!(
                    "weight_map[{tensor:?}] names {file:?}, not a plain file name"
                )));
            }
            let f = match number.get(&file) {
                Some(&f) => f,
                None => {
                    if names.len() == self.limits.shards {
                        let why = format!(
                            "weight_map names more than {} shard files",
                            self.limits.shards
                        );
                        return Err(self.refuse(why));
                    }
                    let f = names.len() as u32;
                    names.push(file.clone());
                    number.insert(file, f);
                    f
                }
            };
            entries.push((f, tensor));
        }
        Ok(Some((names, entries)))
    }
}

impl<'de> DeserializeSeed<'de> for Level<'_> {
    type Value = Found<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Level<'_> {
    type Value = Found<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self.object {
            Object::Top => "a JSON object with a `weight_map`",
            Object::WeightMap => "an object mapping tensor names to shard files",
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<Self::Value, A::Error> {
        match self.object {
            Object::Top => self.top(m),
            Object::WeightMap => self.entries(m),
        }
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        while a.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(m: &WeightMap<'_>) -> Vec<(String, Vec<String>)> {
        m.files()
            .map(|(f, t)| (f.to_string(), t.names().map(str::to_string).collect()))
            .collect()
    }

    #[test]
    fn groups_tensors_by_file_sorted_and_borrows_plain_names() {
        let text = br#"{"metadata": {"total_size": 12, "x": [1, {"y": null}]},
            "weight_map": {"b.w": "s2.safetensors", "a.w": "s1.safetensors",
                           "c\u0041": "s2.safetensors", "a.v": "s2.safetensors"}}"#;
        let m = parse(text).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m.n_files(), 2);
        assert_eq!(
            files(&m),
            vec![
                ("s1.safetensors".into(), vec!["a.w".into()]),
                (
                    "s2.safetensors".into(),
                    vec!["a.v".into(), "b.w".into(), "cA".into()]
                ),
            ]
        );
        assert!(m.contains_file("s1.safetensors"));
        assert!(!m.contains_file("s3.safetensors"));
        assert_eq!(m.tensors("s2.safetensors").unwrap().first(), Some("a.v"));
        // Names without escapes are borrowed from the bytes, not copied.
        assert!(m
            .entries
            .iter()
            .any(|e| matches!(e.1, Cow::Borrowed("b.w"))));
        assert!(m.entries.iter().any(|e| matches!(e.1, Cow::Owned(_))));
        // An empty map parses (the checkpoint then has no shards).
        assert!(parse(br#"{"weight_map": {}}"#).unwrap().is_empty());
    }

    #[test]
    fn refusals_name_the_problem() {
        let cases: &[(&[u8], &str)] = &[
            (b"\xff{}", "not UTF-8 (at byte 0)"),
            (b"{\"weight_map\": {", "not valid JSON"),
            (b"{\"weight_map\": {}} x", "not valid JSON"),
            (b"[1, 2]", "no `weight_map` object"),
            (b"\"weight_map\"", "no `weight_map` object"),
            (b"{\"metadata\": {}}", "no `weight_map` object"),
            (b"{\"weight_map\": [1]}", "no `weight_map` object"),
            (b"{\"weight_map\": 3}", "no `weight_map` object"),
            (
                b"{\"weight_map\": {}, \"weight_map\": {}}",
                "`weight_map` appears twice",
            ),
            (
                b"{\"weight_map\": {\"a\": 1}}",
                "weight_map[\"a\"] is not a string",
            ),
            (
                b"{\"weight_map\": {\"a\": {\"b\": \"c\"}}}",
                "weight_map[\"a\"] is not a string",
            ),
            (
                b"{\"weight_map\": {\"a\": \"../s\"}}",
                "weight_map[\"a\"] names \"../s\", not a plain file name",
            ),
            (
                b"{\"weight_map\": {\"a\": \"..\"}}",
                "not a plain file name",
            ),
            (b"{\"weight_map\": {\"a\": \"\"}}", "not a plain file name"),
            (
                b"{\"weight_map\": {\"a\": \"x\\\\y\"}}",
                "not a plain file name",
            ),
            (
                b"{\"weight_map\": {\"a\": \"s\", \"a\": \"s\"}}",
                "weight_map names tensor \"a\" twice",
            ),
            (
                b"{\"weight_map\": {\"a\": \"s\", \"\\u0061\": \"t\"}}",
                "weight_map names tensor \"a\" twice, in \"s\" and \"t\"",
            ),
        ];
        for (text, want) in cases {
            let err = parse(text).unwrap_err();
            assert!(
                err.contains(want),
                "{:?}: {err:?} lacks {want:?}",
                String::from_utf8_lossy(text)
            );
        }
        // Control characters in names are escaped in messages.
        let err = parse(b"{\"weight_map\": {\"\\u001b]0;x\\u0007\": 1}}").unwrap_err();
        assert!(!err.chars().any(char::is_control), "{err:?}");
    }

    #[test]
    fn size_entry_and_shard_counts_are_bounded() {
        let limits = Limits {
            len: 1 << 20,
            entries: 100,
            shards: 10,
        };
        let map = |n: usize, files: usize| {
            let body: Vec<String> = (0..n)
                .map(|i| format!("\"t{i}\": \"s{}\"", i % files))
                .collect();
            format!("{{\"weight_map\": {{{}}}}}", body.join(", "))
        };
        assert_eq!(
            parse_within(map(100, 10).as_bytes(), limits).unwrap().len(),
            100
        );
        assert_eq!(
            parse_within(map(101, 10).as_bytes(), limits).unwrap_err(),
            "weight_map has more than 100 entries"
        );
        assert_eq!(
            parse_within(map(11, 11).as_bytes(), limits).unwrap_err(),
            "weight_map names more than 10 shard files"
        );
        let big = format!("{{\"metadata\": \"{}\"}}", "x".repeat(1 << 20));
        assert_eq!(
            parse_within(big.as_bytes(), limits).unwrap_err(),
            format!(
                "{} bytes, above the maximum of {} bytes for an index",
                big.len(),
                1 << 20
            )
        );
        // The real bounds are generous multiples of the released checkpoint.
        const { assert!(MAX_INDEX_ENTRIES >= 10 * 497_220 && MAX_INDEX_SHARDS >= 96) };
    }
}
