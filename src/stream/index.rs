//! A compact, sorted index of every tensor in a checkpoint.
//!
//! The released checkpoint has 497,220 tensors, so per-entry cost matters: names live in one
//! string arena with their common prefix replaced by a one-byte code, and each entry is a fixed
//! 40-byte record (offset, shard, dtype, rank, four u32 dimensions). Lookup is a binary search.

use super::safetensors::Dtype;

/// Prefixes stripped from names before they enter the arena (longest first).
const PREFIXES: [&str; 3] = [
    "language_model.model.layers.",
    "language_model.model.",
    "language_model.",
];

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Absolute byte offset of the data in its shard.
    offset: u64,
    name_start: u32,
    shape: [u32; 4],
    name_len: u16,
    shard: u16,
    dtype: Dtype,
    rank: u8,
    prefix: u8,
}

/// What the index knows about one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Shard number (position in [`TensorIndex::shard_names`]).
    pub shard: usize,
    /// Absolute offset of the first byte in the shard.
    pub offset: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorInfo {
    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Number of bytes.
    #[must_use]
    pub fn n_bytes(&self) -> u64 {
        self.numel() as u64 * self.dtype.size()
    }
}

/// Sorted tensor index over all shards.
#[derive(Debug, Default)]
pub struct TensorIndex {
    arena: String,
    entries: Vec<Entry>,
    shard_names: Vec<String>,
}

/// Why an entry cannot be indexed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    /// A dimension above u32::MAX, a name above 65,535 bytes, or too many shards.
    #[error("{0}")]
    Unrepresentable(String),
    /// The same name was added twice.
    #[error("duplicate tensor {name:?} (in {first} and {second})")]
    Duplicate {
        /// Tensor.
        name: String,
        /// Shard of the first.
        first: String,
        /// Shard of the second.
        second: String,
    },
}

impl TensorIndex {
    /// Register a shard name; returns its number.
    pub fn add_shard(&mut self, name: &str) -> Result<usize, IndexError> {
        if self.shard_names.len() >= usize::from(u16::MAX) {
            return Err(IndexError::Unrepresentable(
                "more than 65,535 shards".into(),
            ));
        }
        self.shard_names.push(name.to_string());
        Ok(self.shard_names.len() - 1)
    }

    /// Add one tensor (call [`TensorIndex::finish`] when done).
    pub fn push(
        &mut self,
        shard: usize,
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        offset: u64,
    ) -> Result<(), IndexError> {
        let (prefix, rest) = PREFIXES
            .iter()
            .enumerate()
            .find_map(|(i, p)| name.strip_prefix(p).map(|r| (i as u8 + 1, r)))
            .unwrap_or((0, name));
        let name_len = u16::try_from(rest.len())
            .map_err(|_| IndexError::Unrepresentable(format!("name {name:?} is too long")))?;
        let name_start = u32::try_from(self.arena.len())
            .map_err(|_| IndexError::Unrepresentable("name arena above 4 GiB".into()))?;
        let mut dims = [0u32; 4];
        if shape.len() > 4 {
            return Err(IndexError::Unrepresentable(format!(
                "{name:?} has rank above 4"
            )));
        }
        for (d, &s) in dims.iter_mut().zip(shape) {
            *d = u32::try_from(s).map_err(|_| {
                IndexError::Unrepresentable(format!("{name:?} has a dimension above u32"))
            })?;
        }
        self.arena.push_str(rest);
        self.entries.push(Entry {
            offset,
            name_start,
            shape: dims,
            name_len,
            shard: shard as u16,
            dtype,
            rank: shape.len() as u8,
            prefix,
        });
        Ok(())
    }

    fn key(&self, e: &Entry) -> (u8, &str) {
        let s = e.name_start as usize;
        (e.prefix, &self.arena[s..s + usize::from(e.name_len)])
    }

    fn split_name(name: &str) -> (u8, &str) {
        PREFIXES
            .iter()
            .enumerate()
            .find_map(|(i, p)| name.strip_prefix(p).map(|r| (i as u8 + 1, r)))
            .unwrap_or((0, name))
    }

    /// Sort for lookup and refuse duplicate names.
    pub fn finish(&mut self) -> Result<(), IndexError> {
        let mut entries = std::mem::take(&mut self.entries);
        entries.sort_unstable_by(|a, b| self.key(a).cmp(&self.key(b)));
        for w in entries.windows(2) {
            if self.key(&w[0]) == self.key(&w[1]) {
                return Err(IndexError::Duplicate {
                    name: self.full_name(&w[0]),
                    first: self.shard_names[usize::from(w[0].shard)].clone(),
                    second: self.shard_names[usize::from(w[1].shard)].clone(),
                });
            }
        }
        entries.shrink_to_fit();
        self.entries = entries;
        self.arena.shrink_to_fit();
        Ok(())
    }

    fn full_name(&self, e: &Entry) -> String {
        let (p, rest) = self.key(e);
        match p {
            0 => rest.to_string(),
            k => format!("{}{rest}", PREFIXES[usize::from(k) - 1]),
        }
    }

    /// Look a tensor up by its full name.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<TensorInfo> {
        let key = Self::split_name(name);
        let i = self
            .entries
            .binary_search_by(|e| self.key(e).cmp(&key))
            .ok()?;
        let e = &self.entries[i];
        Some(TensorInfo {
            shard: usize::from(e.shard),
            offset: e.offset,
            dtype: e.dtype,
            shape: e.shape[..usize::from(e.rank)]
                .iter()
                .map(|&d| d as usize)
                .collect(),
        })
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.entries.iter().map(|e| self.full_name(e))
    }

    /// Number of tensors.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the index is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Shard file names by number.
    #[must_use]
    pub fn shard_names(&self) -> &[String] {
        &self.shard_names
    }

    /// Heap and inline bytes held by the index (for the per-tensor memory figure).
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.arena.capacity()
            + self.entries.capacity() * std::mem::size_of::<Entry>()
            + self
                .shard_names
                .iter()
                .map(|s| s.capacity() + 24)
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released checkpoint's tensor names, layer by layer (experts included).
    fn real_names() -> Vec<(String, Vec<u64>)> {
        let mut v = Vec::new();
        for l in 0..93u32 {
            let p = format!("language_model.model.layers.{l}.");
            for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
                v.push((format!("{p}{n}"), vec![7168]));
            }
            if l > 0 {
                for e in 0..896 {
                    for w in ["w1", "w2", "w3"] {
                        v.push((
                            format!("{p}block_sparse_moe.experts.{e}.{w}.weight_packed"),
                            vec![3072, 1792],
                        ));
                        v.push((
                            format!("{p}block_sparse_moe.experts.{e}.{w}.weight_scale"),
                            vec![3072, 112],
                        ));
                    }
                }
            }
        }
        v
    }

    #[test]
    fn index_costs_under_150_bytes_per_tensor_at_real_scale() {
        let names = real_names();
        let mut idx = TensorIndex::default();
        let s = idx.add_shard("model-00001-of-000096.safetensors").unwrap();
        for (i, (n, shape)) in names.iter().enumerate() {
            idx.push(s, n, Dtype::U8, shape, i as u64 * 16).unwrap();
        }
        idx.finish().unwrap();
        let per = idx.memory_bytes() as f64 / idx.len() as f64;
        println!("index: {} tensors, {:.1} bytes per tensor", idx.len(), per);
        assert!(per <= 150.0, "{per} bytes per tensor");
        let info = idx
            .get("language_model.model.layers.92.block_sparse_moe.experts.895.w3.weight_scale")
            .unwrap();
        assert_eq!(info.shape, vec![3072, 112]);
        assert!(idx
            .get("language_model.model.layers.93.input_layernorm.weight")
            .is_none());
    }

    #[test]
    fn prefixes_are_distinct_keys() {
        let mut idx = TensorIndex::default();
        let s = idx.add_shard("a").unwrap();
        idx.push(s, "language_model.lm_head.weight", Dtype::Bf16, &[4, 2], 0)
            .unwrap();
        idx.push(
            s,
            "language_model.model.lm_head.weight",
            Dtype::Bf16,
            &[4, 2],
            16,
        )
        .unwrap();
        idx.push(s, "lm_head.weight", Dtype::Bf16, &[4, 2], 32)
            .unwrap();
        idx.finish().unwrap();
        assert_eq!(idx.get("language_model.lm_head.weight").unwrap().offset, 0);
        assert_eq!(
            idx.get("language_model.model.lm_head.weight")
                .unwrap()
                .offset,
            16
        );
        assert_eq!(idx.get("lm_head.weight").unwrap().offset, 32);
        let mut names: Vec<String> = idx.names().collect();
        names.sort();
        assert_eq!(names.len(), 3);
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut idx = TensorIndex::default();
        let a = idx.add_shard("a").unwrap();
        let b = idx.add_shard("b").unwrap();
        idx.push(a, "x", Dtype::U8, &[1], 0).unwrap();
        idx.push(b, "x", Dtype::U8, &[1], 0).unwrap();
        assert!(matches!(idx.finish(), Err(IndexError::Duplicate { .. })));
    }
}
