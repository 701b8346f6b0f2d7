//! The packed trunk: every layer's non-expert tensors as one contiguous, 4096-aligned run in
//! `trunk.bin`, described by `trunk.json` (docs/runtime.md#packed-trunk), so a streamed layer is one
//! sequential read that can bypass the page cache.
//!
//! A layer whose trunk tensors already form one gap-free run in one shard is copied verbatim;
//! otherwise its tensors are gathered in offset order, each at a 64-byte aligned offset of the
//! run, so no expert byte is ever copied. The manifest names the source by the digest of its
//! tensor index, records the size, modification time, inode and change time of every shard it
//! was packed from (a shard whose size or modification time changed since is refused at open),
//! carries two CRC-32 per layer: of the run in `trunk.bin`, checked the first time each layer
//! is read, and of the layer's source bytes as read from the shards, which `k3 verify`
//! recomputes; and two per tensor of its source bytes: of all of them, and of a sample of four
//! 4 KiB windows (the whole tensor when smaller). At open every tensor's sample is read back
//! from the shards and checked, and the tensors of a shard whose inode or change time differs
//! (a write that restored the modification time, as `cp -p` or `rsync -a` of an edited file
//! does) are read back in full and checked, so stale weights are refused at open, not run.

use super::atomic::PendingFile;
use super::bytes::{Bytes, Filling, Pool};
use super::checkpoint::{
    io_pool, open_direct, pread_counted, pread_seen, Checkpoint, FaultSlot, ShardStat, DIRECT_ALIGN,
};
use super::safetensors::Dtype;
use super::StreamError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Manifest format written in `trunk.json`.
pub const FORMAT: &str = "k3-trunk/4";
/// Earlier manifest formats still read: every tensor stored raw.
const RAW_FORMATS: [&str; 1] = ["k3-trunk/3"];
/// [`TrunkTensor::encoding`] of a tensor stored as in the checkpoint.
pub const RAW: &str = "raw";
/// Earlier manifest formats: refused with a request to re-pack (they do not record enough to
/// tell a shard edited in place from the one packed).
const OLD_FORMATS: [&str; 2] = ["k3-trunk/1", "k3-trunk/2"];
/// Bytes of one sampled window of a tensor's source.
const SAMPLE_WINDOW: u64 = 4096;
/// Windows sampled per tensor: the first, the last and two evenly between.
const SAMPLE_WINDOWS: u64 = 4;
/// Largest `trunk.json` read (the released model's is well under a megabyte).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Alignment of runs in `trunk.bin`.
pub const ALIGN: u64 = DIRECT_ALIGN as u64;
/// Offset alignment of gathered tensors inside a run.
const GATHER_ALIGN: u64 = 64;

/// One tensor of a layer run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkTensor {
    /// Byte offset within the run.
    pub off: u64,
    /// Byte length.
    pub nbytes: u64,
    /// Element type name (`BF16`, `F32`, `F16`, `U8`).
    pub dtype: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// CRC-32 of the tensor's source bytes in its shard.
    pub source_crc32: u32,
    /// CRC-32 of the sampled windows of the tensor's source bytes ([`sample_spans`]).
    pub source_sample: u32,
    /// How the tensor is stored: [`RAW`] (its bytes as in the checkpoint),
    /// [`super::codec::NAME`] or [`super::codec::NAME_NIBBLE`] (BF16, docs/trunk-codec.md).
    #[serde(default = "raw_encoding")]
    pub encoding: String,
    /// Bytes stored in the run (`nbytes` when raw).
    #[serde(default)]
    pub stored: u64,
}

fn raw_encoding() -> String {
    RAW.into()
}

impl TrunkTensor {
    /// Whether the tensor is stored encoded.
    #[must_use]
    pub fn is_encoded(&self) -> bool {
        self.encoding != RAW
    }
}

/// The windows `(offset, length)` of a tensor of `n` bytes whose CRC-32 is its
/// [`TrunkTensor::source_sample`]: the whole tensor up to four windows' worth, else four
/// 4 KiB windows, the first at the start, the last at the end, two evenly between.
#[must_use]
pub fn sample_spans(n: u64) -> Vec<(u64, u64)> {
    if n <= SAMPLE_WINDOW * SAMPLE_WINDOWS {
        return vec![(0, n)];
    }
    (0..SAMPLE_WINDOWS)
        .map(|i| {
            (
                (n - SAMPLE_WINDOW) * i / (SAMPLE_WINDOWS - 1),
                SAMPLE_WINDOW,
            )
        })
        .collect()
}

/// The CRC-32 of `tensor`'s sampled windows.
fn sample_crc(tensor: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (o, l) in sample_spans(tensor.len() as u64) {
        h.update(&tensor[o as usize..(o + l) as usize]);
    }
    h.finalize()
}

/// One layer of the trunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkLayer {
    /// Layer index.
    pub layer: usize,
    /// Source shard (informational).
    pub shard: String,
    /// Absolute offset of the run in the shard (informational; the first tensor's when
    /// gathered).
    pub run_start: u64,
    /// Run length rounded up to 4096.
    pub nbytes: u64,
    /// Offset in `trunk.bin` (a multiple of 4096).
    pub file_off: u64,
    /// Whether the run was gathered tensor by tensor (the source run was not contiguous).
    #[serde(default)]
    pub gathered: bool,
    /// CRC-32 of the `nbytes` bytes at `file_off`.
    pub crc32: u32,
    /// CRC-32 of the layer's source bytes: its tensors' bytes as read from the shards,
    /// concatenated in the order of their offsets in the run (no padding).
    pub source_crc32: u32,
    /// The layer's tensors.
    pub tensors: BTreeMap<String, TrunkTensor>,
}

/// A shard the trunk was packed from, as it was then.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceShard {
    /// File name in the model directory.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, whole seconds since the Unix epoch.
    pub mtime_sec: i64,
    /// Modification time, nanoseconds within the second.
    pub mtime_nsec: i64,
    /// Inode number.
    pub ino: u64,
    /// Status change time, whole seconds since the Unix epoch.
    pub ctime_sec: i64,
    /// Status change time, nanoseconds within the second.
    pub ctime_nsec: i64,
}

impl SourceShard {
    fn stat(&self) -> ShardStat {
        ShardStat {
            size: self.size,
            mtime_sec: self.mtime_sec,
            mtime_nsec: self.mtime_nsec,
            ino: self.ino,
            ctime_sec: self.ctime_sec,
            ctime_nsec: self.ctime_nsec,
        }
    }
}

/// `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// Number of layers.
    pub n_layers: usize,
    /// Run alignment (4096).
    pub align: u64,
    /// SHA-256 (hex) of the source checkpoint's tensor index (names, shards, dtypes,
    /// shapes, offsets): the trunk is used only with the checkpoint it was packed from.
    pub source_digest: String,
    /// The source directory when packed (informational).
    pub source_dir: String,
    /// Size of `trunk.bin`.
    pub total_bytes: u64,
    /// Every shard holding a trunk tensor, with its size and modification time when packed.
    pub shards: Vec<SourceShard>,
    /// Layers in order.
    pub layers: Vec<TrunkLayer>,
    /// The output head encoded, in one run after the layers' (its `layer` is `n_layers`);
    /// absent from trunks stored raw and from earlier packs, whose head is read from the
    /// checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<TrunkLayer>,
}

impl Manifest {
    /// Every run: the layers', then the head's.
    pub fn runs(&self) -> impl Iterator<Item = &TrunkLayer> {
        self.layers.iter().chain(&self.head)
    }

    /// Bytes the tensor `name` is stored in where it is the encoded head; 0 otherwise.
    #[must_use]
    pub fn head_stored(&self, name: &str) -> u64 {
        self.head_tensor()
            .filter(|(n, _, _)| *n == name)
            .map_or(0, |(_, t, _)| t.stored)
    }

    /// Bytes the output head `name` takes held coded as pinned layers hold their matrices
    /// (its run and the kernels' index; [`Trunk::read_head_coded`]) where it is stored
    /// nibble-coded; 0 otherwise.
    #[must_use]
    pub fn head_held(&self, name: &str) -> u64 {
        self.head_tensor()
            .filter(|(n, t, _)| *n == name && holds_coded(t))
            .map_or(0, |(_, t, l)| {
                l.nbytes + super::codec::NibbleIndex::bytes_for(t.shape[0], t.shape[1]) as u64
            })
    }

    /// Set what the planner knows of a trunk in `s`: each layer's staging, window and
    /// pinned bytes, and how the output head `head` is stored and held.
    pub fn sizes_into(&self, s: &mut super::budget::ModelSizes, head: &str) {
        s.layer_staged = self.staged_lens();
        s.layer_window = self.window_lens();
        s.layer_pinned = self.held_lens();
        s.layer_in_place = self.in_place_lens();
        s.head_stored = self.head_stored(head);
        s.head_pinned = self.head_held(head);
    }

    /// The encoded output head: its name and how it is stored, with its run.
    #[must_use]
    pub fn head_tensor(&self) -> Option<(&str, &TrunkTensor, &TrunkLayer)> {
        let l = self.head.as_ref()?;
        let (name, t) = l.tensors.iter().next()?;
        Some((name, t, l))
    }
}

/// A trunk could not be packed or used.
#[derive(Debug, thiserror::Error)]
pub enum TrunkError {
    /// The source checkpoint cannot be packed.
    #[error("cannot pack {dir}: {reason}")]
    Source {
        /// The model directory.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// The output directory cannot be written.
    #[error("{path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The output directory already holds a trunk.
    #[error("{0} already holds a packed trunk (pass --force to replace it)")]
    Exists(PathBuf),
    /// `trunk.json` or `trunk.bin` is malformed or does not belong to this checkpoint.
    #[error("trunk {dir}: {reason}")]
    Invalid {
        /// The trunk directory.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// Reading the source failed.
    #[error(transparent)]
    Stream(#[from] StreamError),
}

impl TrunkError {
    /// Exit status: 1 for an I/O failure while packing, 3 for an unusable source or trunk.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            TrunkError::Write { .. } => 1,
            TrunkError::Exists(_) => 2,
            TrunkError::Stream(e) => e.exit_code(),
            TrunkError::Source { .. } | TrunkError::Invalid { .. } => 3,
        }
    }
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The trunk tensor names of each of `n_layers` layers: every tensor under
/// `language_model.model.layers.L.` that is not a routed expert.
fn layer_tensors(ck: &Checkpoint, n_layers: usize) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new(); n_layers];
    for name in ck.index().names() {
        let Some((il, tail)) = super::layer_tensor(&name) else {
            continue;
        };
        if il < n_layers && !tail.contains("block_sparse_moe.experts.") {
            out[il].push(name);
        }
    }
    out
}

/// The shards holding the trunk tensors `per_layer`, in shard order, with their size and
/// modification time now.
fn source_shards(ck: &Checkpoint, per_layer: &[Vec<String>]) -> Result<Vec<SourceShard>, String> {
    let used: std::collections::BTreeSet<usize> = per_layer
        .iter()
        .flatten()
        .filter_map(|n| ck.info(n).map(|i| i.shard))
        .collect();
    let mut out = Vec::with_capacity(used.len());
    for k in used {
        let name = ck.index().shard_names()[k].clone();
        let st = ck
            .shard_stat(k)
            .map_err(|e| format!("cannot stat {}: {e}", super::shown(Path::new(&name))))?;
        out.push(SourceShard {
            name,
            size: st.size,
            mtime_sec: st.mtime_sec,
            mtime_nsec: st.mtime_nsec,
            ino: st.ino,
            ctime_sec: st.ctime_sec,
            ctime_nsec: st.ctime_nsec,
        });
    }
    Ok(out)
}

/// Size and modification time (UTC; to the nanosecond when `fine`, for two times within one
/// second).
fn describe(st: &ShardStat, fine: bool) -> String {
    let nsec = u32::try_from(st.mtime_nsec).unwrap_or(0);
    let when = match chrono::DateTime::from_timestamp(st.mtime_sec, nsec) {
        Some(t) if fine => t.format("%Y-%m-%d %H:%M:%S%.9f UTC").to_string(),
        Some(t) => t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        None => format!("{}.{:09} s after 1970", st.mtime_sec, st.mtime_nsec),
    };
    format!("{} bytes, modified {when}", st.size)
}

/// Refuse a trunk whose source shards are not the ones it was packed from: a recorded shard
/// missing from the checkpoint, a shard holding trunk tensors that is not recorded, or one
/// whose size or modification time differs. Returns the shards (by number) whose inode or
/// change time differs: written since, or copied; their trunk tensors are checked in full.
fn check_sources(
    m: &Manifest,
    ck: &Checkpoint,
    want: &[Vec<String>],
    dir: &Path,
) -> Result<Vec<usize>, String> {
    let names = ck.index().shard_names();
    let mut changed = Vec::new();
    let mut rewritten = Vec::new();
    for s in &m.shards {
        let shown = super::shown(Path::new(&s.name));
        let Some(k) = names.iter().position(|n| *n == s.name) else {
            return Err(format!(
                "the manifest names shard {shown}, which this checkpoint does not have"
            ));
        };
        let now = ck
            .shard_stat(k)
            .map_err(|e| format!("cannot stat {shown}: {e}"))?;
        let was = s.stat();
        if (now.ino, now.ctime_sec, now.ctime_nsec) != (was.ino, was.ctime_sec, was.ctime_nsec) {
            rewritten.push(k);
        }
        if (now.size, now.mtime_sec, now.mtime_nsec) != (was.size, was.mtime_sec, was.mtime_nsec) {
            changed.push(format!(
                "{shown} was {} when packed and is {} now",
                describe(&s.stat(), now.mtime_sec == was.mtime_sec),
                describe(&now, now.mtime_sec == was.mtime_sec)
            ));
        }
    }
    for n in want.iter().flatten() {
        if let Some(i) = ck.info(n) {
            let shard = &names[i.shard];
            if !m.shards.iter().any(|s| s.name == *shard) {
                return Err(format!(
                    "the manifest does not record shard {}, which holds trunk tensor {n:?}",
                    super::shown(Path::new(shard))
                ));
            }
        }
    }
    if changed.is_empty() {
        return Ok(rewritten);
    }
    Err(format!(
        "the checkpoint changed since it was packed: {}; the trunk may no longer match its \
         source; run `k3 pack --force {} {}` to re-pack it",
        super::join_listed(&changed),
        super::shown(ck.dir()),
        super::shown(dir)
    ))
}

/// Read and parse `trunk.json` in `dir`: older formats and foreign files are refused before
/// any field is looked at.
/// Read and parse `dir/trunk.json` (its format and fields; [`Trunk::open`] checks the rest).
pub fn read_manifest(dir: &Path) -> Result<Manifest, String> {
    let json = dir.join("trunk.json");
    let bytes = super::read_capped(&json, MAX_MANIFEST_BYTES)
        .map_err(|e| format!("cannot read trunk.json: {e} (run `k3 pack` first)"))?;
    parse_manifest(&bytes, dir)
}

/// Parse the bytes of a `trunk.json` (`dir` is named in messages): older formats and foreign
/// files are refused before any field is looked at. The layers are checked against the
/// checkpoint when the trunk is opened.
pub fn parse_manifest(bytes: &[u8], dir: &Path) -> Result<Manifest, String> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| format!("trunk.json is not a k3 trunk manifest: {e}"))?;
    if !v.is_object() {
        return Err("trunk.json is not a k3 trunk manifest: not a JSON object".into());
    }
    match v.get("format").and_then(serde_json::Value::as_str) {
        Some(FORMAT) => {}
        Some(f) if RAW_FORMATS.contains(&f) => {}
        Some(f) if OLD_FORMATS.contains(&f) => {
            return Err(format!(
                "trunk.json is format {f:?}, written by an earlier k3 that did not record \
                 enough to tell a shard edited in place from the one packed; re-pack it with \
                 `k3 pack --force MODEL_DIR {}`",
                super::shown(dir)
            ));
        }
        Some(f) => return Err(format!("format {f:?}, expected {FORMAT:?}")),
        None => {
            return Err("trunk.json is not a k3 trunk manifest: no \"format\" string".into());
        }
    }
    let mut m: Manifest = serde_json::from_value(v)
        .map_err(|e| format!("trunk.json is not a k3 trunk manifest: {e}"))?;
    // A raw tensor's stored length is its length (earlier formats do not record it).
    for t in m.layers.iter_mut().flat_map(|l| l.tensors.values_mut()) {
        if t.encoding == RAW && t.stored == 0 {
            t.stored = t.nbytes;
        }
    }
    Ok(m)
}

/// What [`pack`] did.
#[derive(Clone, Debug)]
pub struct PackReport {
    /// The manifest written.
    pub manifest: Manifest,
    /// Layers copied as one verbatim run.
    pub verbatim: usize,
    /// Layers gathered tensor by tensor.
    pub gathered: usize,
    /// Size `trunk.bin` would have with every tensor it holds stored raw (`k3 pack --raw`
    /// writes the layers only: the head is then read from the checkpoint).
    pub raw_bytes: u64,
    /// Bytes of the BF16 tensors, and what they are stored in.
    pub bf16: (u64, u64),
}

/// Where a layer's run comes from and how its tensors sit in it.
struct Layout {
    shard: usize,
    run_start: u64,
    gathered: bool,
    tensors: BTreeMap<String, TrunkTensor>,
    raw: u64,
}

/// Plan the layout of layer `il`.
fn layout(ck: &Checkpoint, il: usize, names: &[String]) -> Result<Layout, String> {
    if names.is_empty() {
        return Err(format!("layer {il} has no trunk tensors"));
    }
    let mut infos: Vec<(String, super::TensorInfo)> = names
        .iter()
        .map(|n| (n.clone(), ck.info(n).expect("name from the index")))
        .collect();
    infos.sort_by_key(|(_, i)| (i.shard, i.offset));
    let shard = infos[0].1.shard;
    let start = infos[0].1.offset;
    let one_shard = infos.iter().all(|(_, i)| i.shard == shard);
    let mut end = start;
    let mut contiguous = one_shard;
    for (_, i) in &infos {
        if i.shard != shard || i.offset != end {
            contiguous = false;
        }
        end = end.max(i.offset + i.n_bytes()).max(i.offset);
    }
    let mut tensors = BTreeMap::new();
    let mut at = 0u64;
    for (n, i) in &infos {
        let off = if contiguous {
            i.offset - start
        } else {
            at.div_ceil(GATHER_ALIGN) * GATHER_ALIGN
        };
        at = off + i.n_bytes();
        tensors.insert(
            n.clone(),
            TrunkTensor {
                off,
                nbytes: i.n_bytes(),
                dtype: i.dtype.name().to_string(),
                shape: i.shape.clone(),
                source_crc32: 0,
                source_sample: 0,
                encoding: RAW.into(),
                stored: i.n_bytes(),
            },
        );
    }
    Ok(Layout {
        shard,
        run_start: start,
        gathered: !contiguous,
        tensors,
        raw: at,
    })
}

/// Reads `len` bytes at offset `at` of the source tensor named, replacing the buffer's
/// contents: the checkpoint's files when packing, drawn bytes in [`encoded_manifest`].
pub type ReadSpan<'a> = dyn FnMut(&str, u64, u64, &mut Vec<u8>) -> Result<(), StreamError> + 'a;

/// Every layer's run laid out raw and back to back from offset 0, from each layer's trunk
/// tensor names (its checksums are filled in when it is packed).
fn layer_runs(ck: &Checkpoint, per_layer: &[Vec<String>]) -> Result<Vec<TrunkLayer>, String> {
    let mut layers = Vec::with_capacity(per_layer.len());
    let mut file_off = 0u64;
    for (il, names) in per_layer.iter().enumerate() {
        let lay = layout(ck, il, names)?;
        let nbytes = lay.raw.div_ceil(ALIGN) * ALIGN;
        layers.push(TrunkLayer {
            layer: il,
            shard: ck.index().shard_names()[lay.shard].clone(),
            run_start: lay.run_start,
            nbytes,
            file_off,
            gathered: lay.gathered,
            crc32: 0,
            source_crc32: 0,
            tensors: lay.tensors,
        });
        file_off += nbytes;
    }
    Ok(layers)
}

/// The encoded head's run (its layer index `n_layers`) at `file_off`, before it is written.
fn head_run(ck: &Checkpoint, n_layers: usize, lay: Layout, file_off: u64) -> TrunkLayer {
    TrunkLayer {
        layer: n_layers,
        shard: ck.index().shard_names()[lay.shard].clone(),
        run_start: lay.run_start,
        nbytes: 0,
        file_off,
        gathered: true,
        crc32: 0,
        source_crc32: 0,
        tensors: lay.tensors,
    }
}

/// The manifest [`pack`] would write for the checkpoint `ck` encoded with `coding` (its
/// `n_layers` layers and, when BF16, the output head `head`), with every tensor's bytes taken
/// from `read` instead of the checkpoint's files and nothing written: what a trunk would
/// store that does not fit the disk, or whose checkpoint is a sparse replica (the released
/// shape, in `benches/released_trunk.rs`, from the bytes `k3 synth` draws for it). Stored
/// sizes, offsets and checksums are those [`pack`] computes; `source_dir` and `shards` are
/// left empty. `progress(done, total)` is called as source bytes are encoded.
pub fn encoded_manifest(
    ck: &Checkpoint,
    n_layers: usize,
    head: Option<&str>,
    coding: super::codec::Coding,
    read: &mut ReadSpan,
    progress: &dyn Fn(u64, u64),
) -> Result<Manifest, TrunkError> {
    let bad = |reason: String| TrunkError::Source {
        dir: ck.dir().to_path_buf(),
        reason,
    };
    let head = head.filter(|n| {
        ck.info(n)
            .is_some_and(|i| i.dtype == Dtype::Bf16 && i.n_bytes() > 0)
    });
    let mut layers = layer_runs(ck, &layer_tensors(ck, n_layers)).map_err(&bad)?;
    let head_layout = match head {
        Some(name) => Some(layout(ck, n_layers, &[name.to_string()]).map_err(&bad)?),
        None => None,
    };
    let total =
        layers.iter().map(|l| l.nbytes).sum::<u64>() + head_layout.as_ref().map_or(0, |h| h.raw);
    let (mut buf, mut piece) = (Vec::new(), Vec::new());
    let (mut done, mut file_off) = (0u64, 0u64);
    for l in &mut layers {
        let raw_len = l.nbytes;
        pack_encoded(read, l, coding, &mut buf, &mut piece)?;
        l.file_off = file_off;
        file_off += l.nbytes;
        done += raw_len;
        progress(done, total);
    }
    let head = match (head, head_layout) {
        (Some(name), Some(lay)) => {
            let mut l = head_run(ck, n_layers, lay, file_off);
            let at = |d| progress(done + d, total);
            // Written to a sink, which never fails: only reading can.
            pack_head(
                read,
                name,
                &mut l,
                coding,
                &mut std::io::sink(),
                &mut piece,
                &at,
            )
            .map_err(|e| e.or_write(ck.dir()))?;
            file_off += l.nbytes;
            Some(l)
        }
        _ => None,
    };
    Ok(Manifest {
        format: FORMAT.into(),
        n_layers,
        align: ALIGN,
        source_digest: hex(&ck.index_digest()),
        source_dir: String::new(),
        total_bytes: file_off,
        shards: Vec::new(),
        layers,
        head,
    })
}

/// Pack the trunk of the checkpoint in `ck` (with `n_layers` layers) into `out`:
/// `trunk.bin` and `trunk.json` are written under temporary names, synced, and renamed into
/// place (the manifest last). With `encode`, every BF16 tensor is stored with that
/// [`super::codec::Coding`] and each layer's tensors are gathered one by one, and the output
/// head `head` (when BF16) is stored encoded too, in a run after the layers'.
/// `progress(done, total)` is called as source bytes are packed.
/// Over 100 lines: one sequential pass over the layers writes the trunk, then the manifest; the
/// checksums and the check of the shards share the pass's state.
pub fn pack(
    ck: &Checkpoint,
    n_layers: usize,
    head: Option<&str>,
    out: &Path,
    force: bool,
    encode: Option<super::codec::Coding>,
    progress: &dyn Fn(u64, u64),
) -> Result<PackReport, TrunkError> {
    let src = ck.dir().to_path_buf();
    let bad = |reason: String| TrunkError::Source {
        dir: src.clone(),
        reason,
    };
    let per_layer = layer_tensors(ck, n_layers);
    let head = head.filter(|n| {
        encode.is_some()
            && ck
                .info(n)
                .is_some_and(|i| i.dtype == Dtype::Bf16 && i.n_bytes() > 0)
    });
    let head_layout = match head {
        Some(name) => Some(layout(ck, n_layers, &[name.to_string()]).map_err(&bad)?),
        None => None,
    };
    let sources: Vec<Vec<String>> = (per_layer.iter().cloned())
        .chain(head.map(|n| vec![n.to_string()]))
        .collect();
    let before = source_shards(ck, &sources).map_err(&bad)?;
    let mut layers = layer_runs(ck, &per_layer).map_err(&bad)?;
    let file_off: u64 = layers.iter().map(|l| l.nbytes).sum();
    let total = file_off + head_layout.as_ref().map_or(0, |h| h.raw);
    let raw_bytes = file_off
        + head_layout
            .as_ref()
            .map_or(0, |h| h.raw.next_multiple_of(ALIGN));
    let wr = |path: &Path| {
        let path = path.to_path_buf();
        move |e| TrunkError::Write {
            path: path.clone(),
            source: e,
        }
    };
    std::fs::create_dir_all(out).map_err(wr(out))?;
    let bin = out.join("trunk.bin");
    let json = out.join("trunk.json");
    if !force && (bin.exists() || json.exists()) {
        return Err(TrunkError::Exists(out.to_path_buf()));
    }
    // Both files are written under temporary names and renamed into place at the end; an
    // error drops them, which removes them.
    let result = (|| {
        let mut tmp_bin = PendingFile::shared(&bin).map_err(wr(&bin))?;
        let f = tmp_bin.file();
        let mut done = 0u64;
        let mut buf = Vec::new();
        let mut piece = Vec::new();
        let mut file_off = 0u64;
        let mut read = |name: &str, at: u64, len: u64, piece: &mut Vec<u8>| {
            ck.read_span(name, at, len, piece).map(|_| ())
        };
        for l in &mut layers {
            let raw_len = l.nbytes;
            if let Some(coding) = encode {
                pack_encoded(&mut read, l, coding, &mut buf, &mut piece)?;
                l.file_off = file_off;
                file_off += l.nbytes;
                f.write_all(&buf).map_err(wr(&bin))?;
                done += raw_len;
                progress(done, total);
                continue;
            }
            l.file_off = file_off;
            file_off += l.nbytes;
            buf.clear();
            buf.resize(l.nbytes as usize, 0);
            if l.gathered {
                let mut source = crc32fast::Hasher::new();
                let mut order: Vec<(&String, &TrunkTensor)> = l.tensors.iter().collect();
                order.sort_by_key(|(_, t)| t.off);
                for (name, t) in order {
                    ck.read_span(name, 0, t.nbytes, &mut piece)?;
                    source.update(&piece);
                    buf[t.off as usize..(t.off + t.nbytes) as usize].copy_from_slice(&piece);
                }
                l.source_crc32 = source.finalize();
            } else {
                // One read of the whole run: the first tensor's span widened to the run.
                let first = l
                    .tensors
                    .iter()
                    .min_by_key(|(_, t)| t.off)
                    .map(|(n, _)| n.clone())
                    .expect("non-empty layer");
                let raw: u64 = l
                    .tensors
                    .values()
                    .map(|t| t.off + t.nbytes)
                    .max()
                    .unwrap_or(0);
                ck.read_run(&first, raw, &mut piece)?;
                buf[..raw as usize].copy_from_slice(&piece);
                // A verbatim run is its tensors back to back.
                l.source_crc32 = crc32fast::hash(&piece);
            }
            l.crc32 = crc32fast::hash(&buf);
            for t in l.tensors.values_mut() {
                let src = &buf[t.off as usize..(t.off + t.nbytes) as usize];
                t.source_crc32 = crc32fast::hash(src);
                t.source_sample = sample_crc(src);
            }
            f.write_all(&buf).map_err(wr(&bin))?;
            done += l.nbytes;
            progress(done, total);
        }
        let head = match (head, head_layout, encode) {
            (Some(name), Some(lay), Some(coding)) => {
                let mut l = head_run(ck, n_layers, lay, file_off);
                let mut f = tmp_bin.file();
                let at = |d| progress(done + d, total);
                pack_head(&mut read, name, &mut l, coding, &mut f, &mut piece, &at)
                    .map_err(|e| e.or_write(&bin))?;
                file_off += l.nbytes;
                Some(l)
            }
            _ => None,
        };
        let after = source_shards(ck, &sources).map_err(&bad)?;
        if after != before {
            return Err(bad(
                "a shard changed while it was being packed (size or modification time); \
                 pack again once it is complete"
                    .into(),
            ));
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            n_layers,
            align: ALIGN,
            source_digest: hex(&ck.index_digest()),
            source_dir: src.display().to_string(),
            total_bytes: file_off,
            shards: before.clone(),
            layers: layers.clone(),
            head,
        };
        let text = serde_json::to_string(&manifest).expect("manifest serialises");
        let mut tmp_json = PendingFile::shared(&json).map_err(wr(&json))?;
        tmp_json
            .file()
            .write_all(text.as_bytes())
            .map_err(wr(&json))?;
        tmp_bin.commit().map_err(wr(&bin))?;
        tmp_json.commit().map_err(wr(&json))?;
        Ok(manifest)
    })();
    let manifest = result?;
    let gathered = manifest.layers.iter().filter(|l| l.gathered).count();
    let bf16 = manifest
        .runs()
        .flat_map(|l| l.tensors.values())
        .filter(|t| t.dtype == "BF16")
        .fold((0, 0), |(a, b), t| (a + t.nbytes, b + t.stored));
    Ok(PackReport {
        verbatim: manifest.layers.len() - gathered,
        gathered,
        raw_bytes,
        bf16,
        manifest,
    })
}

/// Lay out layer `l` encoded in `buf` (its length a multiple of [`ALIGN`]): its tensors in the
/// order of their source offsets, each at a [`GATHER_ALIGN`]-aligned offset, BF16 ones
/// encoded; the layer's and the tensors' checksums and stored lengths are filled in.
fn pack_encoded(
    read: &mut ReadSpan,
    l: &mut TrunkLayer,
    coding: super::codec::Coding,
    buf: &mut Vec<u8>,
    piece: &mut Vec<u8>,
) -> Result<(), TrunkError> {
    let mut order: Vec<(String, u64)> = l.tensors.iter().map(|(n, t)| (n.clone(), t.off)).collect();
    order.sort_by_key(|(_, off)| *off);
    buf.clear();
    let mut source = crc32fast::Hasher::new();
    for (name, _) in order {
        let Some(t) = l.tensors.get_mut(&name) else {
            continue;
        };
        read(&name, 0, t.nbytes, piece)?;
        source.update(piece);
        t.source_crc32 = crc32fast::hash(piece);
        t.source_sample = sample_crc(piece);
        let at = buf.len().next_multiple_of(GATHER_ALIGN as usize);
        buf.resize(at, 0);
        t.off = at as u64;
        if t.dtype == "BF16" && super::codec::encode_as(coding, piece, buf) {
            t.encoding = coding.name().into();
        } else {
            buf.extend_from_slice(piece);
            t.encoding = RAW.into();
        }
        t.stored = (buf.len() - at) as u64;
    }
    buf.resize(buf.len().next_multiple_of(ALIGN as usize), 0);
    l.source_crc32 = source.finalize();
    l.crc32 = crc32fast::hash(buf);
    l.nbytes = buf.len() as u64;
    l.gathered = true;
    Ok(())
}

/// Stored bytes of the encoded head read ahead of its decoding at a time.
const HEAD_SEGMENT: u64 = 8 << 20;

/// The buffers [`Trunk::stream_head`] uses for a head of `values` values stored in `stored`
/// bytes, decoded `rows` rows of `cols` at a time: (decoded values, stored bytes). The decoded
/// buffer holds the rows of one call and the block that completes them; the stored one a
/// segment read and what is left of the block before it.
#[must_use]
pub fn head_scratch(rows: u64, cols: u64, values: u64, stored: u64) -> (u64, u64) {
    let block = super::codec::BLOCK_ELEMS as u64;
    let span = super::codec::MAX_BLOCK_SPAN as u64;
    (
        (rows.max(1) * cols + block).min(values),
        (HEAD_SEGMENT + span).min(stored),
    )
}

/// What went wrong writing the head: reading the source, or writing `trunk.bin`.
enum HeadFailure {
    Source(StreamError),
    Write(std::io::Error),
}

impl HeadFailure {
    fn or_write(self, bin: &Path) -> TrunkError {
        match self {
            HeadFailure::Source(e) => TrunkError::Stream(e),
            HeadFailure::Write(source) => TrunkError::Write {
                path: bin.to_path_buf(),
                source,
            },
        }
    }
}

/// Source values of the head encoded per piece: a whole number of codec blocks, so the pieces'
/// encodings put together are the encoding of the whole tensor (blocks are independent).
const HEAD_PIECE: u64 = 64 * super::codec::BLOCK_ELEMS as u64 * 2;

/// Write the output head `name` encoded with `coding` to `f` as run `l` (one tensor at offset
/// 0, padded to [`ALIGN`]), a piece at a time so packing holds no more of it than a piece;
/// fills in the run's and the tensor's checksums and lengths. `progress(d)`: `d` source
/// bytes of it done.
fn pack_head(
    read: &mut ReadSpan,
    name: &str,
    l: &mut TrunkLayer,
    coding: super::codec::Coding,
    f: &mut dyn Write,
    piece: &mut Vec<u8>,
    progress: &dyn Fn(u64),
) -> Result<(), HeadFailure> {
    let n = l
        .tensors
        .get(name)
        .ok_or_else(|| HeadFailure::Source(StreamError::NoSuchTensor(name.into())))?
        .nbytes;
    let mut run = crc32fast::Hasher::new();
    let mut source = crc32fast::Hasher::new();
    let mut enc = Vec::new();
    let mut stored = 0u64;
    for at in (0..n).step_by(HEAD_PIECE as usize) {
        let len = HEAD_PIECE.min(n - at);
        read(name, at, len, piece).map_err(HeadFailure::Source)?;
        source.update(piece);
        enc.clear();
        super::codec::encode_as(coding, piece, &mut enc);
        run.update(&enc);
        f.write_all(&enc).map_err(HeadFailure::Write)?;
        stored += enc.len() as u64;
        progress(at + len);
    }
    let mut sample = crc32fast::Hasher::new();
    for (o, len) in sample_spans(n) {
        read(name, o, len, piece).map_err(HeadFailure::Source)?;
        sample.update(piece);
    }
    let padded = stored.next_multiple_of(ALIGN);
    let pad = vec![0u8; (padded - stored) as usize];
    run.update(&pad);
    f.write_all(&pad).map_err(HeadFailure::Write)?;
    let t = l.tensors.get_mut(name).expect("looked up above");
    t.off = 0;
    t.encoding = coding.name().into();
    t.stored = stored;
    t.source_crc32 = source.finalize();
    t.source_sample = sample.finalize();
    l.source_crc32 = t.source_crc32;
    l.crc32 = run.finalize();
    l.nbytes = padded;
    Ok(())
}

impl Manifest {
    /// Per layer, the least staging [`Trunk::read_decode_into`] reads and decodes it
    /// through: 0 for a layer stored raw; else, for the tensor that needs most, the bytes
    /// from the 4 KiB boundary at or before its start to the segment boundary at or after its
    /// end (what the window must hold to decode it), and one segment more, so a read is in
    /// flight while it decodes; the whole run when that is smaller.
    #[must_use]
    pub fn window_lens(&self) -> Vec<u64> {
        self.window_lens_by(segment() as u64)
    }

    /// [`Manifest::window_lens`] for reads of `seg` bytes ahead of the decoder (a multiple of
    /// 4 KiB; [`Trunk::read_decode_by`]).
    #[must_use]
    pub fn window_lens_by(&self, seg: u64) -> Vec<u64> {
        let seg = seg.max(1).next_multiple_of(4096);
        (self.layers.iter())
            .map(|l| {
                if !l.tensors.values().any(TrunkTensor::is_encoded) {
                    return 0;
                }
                let need = (l.tensors.values())
                    .map(|t| {
                        ((t.off + t.stored).next_multiple_of(seg)).min(l.nbytes)
                            - t.off / 4096 * 4096
                    })
                    .max()
                    .unwrap_or(0);
                (need + seg).min(l.nbytes)
            })
            .collect()
    }

    /// Per layer, the bytes it holds when pinned, for a layer stored encoded: where it is read
    /// in place ([`placed_layout`]), its run and what it keeps beside ([`placed_extra`]); else
    /// its tensors laid out with the nibble-coded matrices kept as stored ([`holds_coded`])
    /// and the others decoded, and the kernels' index of each kept one; 0 for a layer stored
    /// raw (pinned as it lies).
    #[must_use]
    pub fn held_lens(&self) -> Vec<u64> {
        (self.layers.iter())
            .map(|l| {
                if placed_layout(l).is_some() {
                    return l.nbytes + placed_extra(l);
                }
                decoded_layout(l, true).map_or(0, |d| {
                    let index: usize = (l.tensors.values())
                        .filter(|t| holds_coded(t))
                        .map(|t| super::codec::NibbleIndex::bytes_for(t.shape[0], t.shape[1]))
                        .sum();
                    (d.len + index) as u64
                })
            })
            .collect()
    }

    /// Per layer, the bytes its run takes where it is read in place, to be multiplied coded
    /// as it lies (see [`placed_layout`]); 0 for a layer that is not.
    #[must_use]
    pub fn in_place_lens(&self) -> Vec<u64> {
        (self.layers.iter())
            .map(|l| placed_layout(l).map_or(0, |_| l.nbytes))
            .collect()
    }

    /// Per layer, the bytes a streamed read of it stages before decoding: its run when it
    /// holds encoded tensors, else 0 (see [`Trunk::staged_lens`]).
    #[must_use]
    pub fn staged_lens(&self) -> Vec<u64> {
        (self.layers.iter())
            .map(|l| {
                let encoded = l.tensors.values().any(TrunkTensor::is_encoded);
                if encoded {
                    l.nbytes
                } else {
                    0
                }
            })
            .collect()
    }
}

/// One layer's tensors read from the trunk, as raw bytes until taken.
#[derive(Debug)]
pub struct LayerRun {
    layer: usize,
    tensors: std::collections::HashMap<String, (Dtype, Bytes)>,
    /// Matrices a pinned layer holds coded.
    coded: std::collections::HashMap<String, CodedMatrix>,
}

/// A BF16 matrix a pinned layer holds nibble-coded, as stored, with the index the kernels
/// multiply it through ([`crate::kernels::NibbleMatrix`]; every block checked when it was
/// loaded).
#[derive(Clone, Debug)]
pub struct CodedMatrix {
    bytes: Bytes,
    index: std::sync::Arc<super::codec::NibbleIndex>,
    rows: usize,
    cols: usize,
}

impl CodedMatrix {
    /// `bytes` (a `[rows, cols]` tensor as `k3 pack` encoded it) checked and located: None
    /// when it cannot be multiplied coded (a Huffman-coded block), an error when a block does
    /// not decode.
    ///
    /// # Errors
    /// A block does not decode.
    pub fn new(
        bytes: Bytes,
        rows: usize,
        cols: usize,
        scratch: &mut Vec<u8>,
    ) -> Result<Option<CodedMatrix>, super::codec::CodecError> {
        let Some(index) = super::codec::nibble_index(bytes.as_slice(), rows, cols, scratch)? else {
            return Ok(None);
        };
        let m = CodedMatrix {
            bytes,
            index: std::sync::Arc::new(index),
            rows,
            cols,
        };
        let i = &m.index;
        let checked = crate::kernels::NibbleMatrix::new(
            m.bytes.as_slice(),
            &i.blocks,
            &i.row_esc,
            rows,
            cols,
        )
        .is_some();
        Ok(checked.then_some(m))
    }

    /// The matrix for the kernels: a view of parts checked when this was made (so it is cheap
    /// enough to take for every product and every MLA row).
    #[must_use]
    pub fn matrix(&self) -> crate::kernels::NibbleMatrix<'_> {
        let i = &self.index;
        crate::kernels::NibbleMatrix::from_checked(
            self.bytes.as_slice(),
            &i.blocks,
            &i.row_esc,
            self.rows,
            self.cols,
        )
    }

    /// Bytes held: the coded tensor and its index.
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        self.bytes.len() + super::codec::NibbleIndex::bytes_for(self.rows, self.cols)
    }

    /// The decoded values (a new allocation).
    #[must_use]
    pub fn decode(&self) -> super::bytes::U16s {
        let m = self.matrix();
        let mut v = vec![0u16; self.rows * self.cols];
        for (r, row) in v.chunks_exact_mut(self.cols).enumerate() {
            m.decode_row(r, row);
        }
        super::bytes::U16s::from_vec(&v)
    }
}

impl LayerRun {
    /// A run of already-read tensors (e.g. an expert read in one piece).
    #[must_use]
    pub fn from_parts(layer: usize, parts: Vec<super::checkpoint::RawTensor>) -> LayerRun {
        LayerRun {
            layer,
            tensors: parts.into_iter().map(|(n, d, b)| (n, (d, b))).collect(),
            coded: std::collections::HashMap::new(),
        }
    }

    /// The layer.
    #[must_use]
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Take tensor `name`'s dtype and bytes out of the run, if it holds it.
    pub fn take(&mut self, name: &str) -> Option<(Dtype, Bytes)> {
        self.tensors.remove(name)
    }

    /// Take matrix `name` out of the run, if it holds it coded.
    pub fn take_coded(&mut self, name: &str) -> Option<CodedMatrix> {
        self.coded.remove(name)
    }
}

/// Size of the pieces a run is read in, several at once: the run is read straight into the
/// one allocation its tensors then borrow.
const PIECE: usize = 8 << 20;

/// Run `f` on the I/O pool (where there is one): decoding may be asked for on a compute pool's
/// worker while the others wait for this very layer, so work queued on the compute pool would
/// never run.
fn on_io_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match io_pool() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Bytes of a stored run read ahead of the decoder ([`Trunk::read_decode_into`]): by default
/// four pieces, so four reads are in flight while the tensors before them are decoded
/// (`K3_TRUNK_SEGMENT_KB`, a multiple of 4 KiB).
fn segment() -> usize {
    (crate::tuning::Tuning::get().trunk_segment_kb << 10).next_multiple_of(4096)
}

/// An open packed trunk, checked against the checkpoint it serves.
#[derive(Debug)]
pub struct Trunk {
    dir: PathBuf,
    manifest: Manifest,
    file: File,
    direct: Option<File>,
    direct_off: AtomicBool,
    verified: Vec<AtomicBool>,
    bytes_read: AtomicU64,
    reads: AtomicU64,
    fault: FaultSlot,
    /// Allocations of streamed layers, reused by the next read.
    pool: std::sync::Arc<Pool>,
    /// Allocations of decoded layers, reused by the next decode.
    decoded_pool: std::sync::Arc<Pool>,
    /// Per layer, where its tensors go when it holds encoded ones.
    decoded: Vec<Option<Decoded>>,
    /// The same for a pinned layer, which keeps nibble-coded matrices as stored.
    held: Vec<Option<Decoded>>,
    /// Per layer, its tensors where they lie in its run, where it can be read in place (see
    /// [`placed_layout`]): read as it lies, it is multiplied coded with no decoding.
    placed: Vec<Option<Decoded>>,
    source_check: SourceCheck,
}

/// Where a layer holding encoded tensors is decoded to: every tensor (raw ones copied, so the
/// read allocation is freed at once) at a [`GATHER_ALIGN`]-aligned offset of one allocation.
/// In the layout of a pinned layer, the tensors the kernels multiply coded are kept as stored
/// (copied, not decoded; [`holds_coded`]).
#[derive(Debug)]
struct Decoded {
    /// Bytes of the allocation.
    len: usize,
    /// Tensors by offset in the allocation: name, offset.
    tensors: Vec<(String, usize)>,
    /// Where each tensor's bytes end in the allocation.
    ends: Vec<usize>,
    /// Whether each tensor is kept as stored.
    kept: Vec<bool>,
    /// Pieces the layer decodes in: a block of an encoded tensor, or a raw tensor.
    pieces: usize,
}

/// Why a run whose bytes hash to `got` is refused, its manifest saying `want`.
fn checksum_mismatch(got: u32, want: u32) -> String {
    format!(
        "checksum {got:08x}, the manifest says {want:08x} (trunk.bin is corrupt; run `k3 pack \
         --force`)"
    )
}

/// Whether a pinned layer holds tensor `t` as stored, multiplied coded
/// ([`crate::kernels::NibbleMatrix`]): a nibble-coded BF16 matrix of at least two rows whose
/// rows are a multiple of 32 values (docs/trunk-codec.md).
#[must_use]
pub fn holds_coded(t: &TrunkTensor) -> bool {
    t.encoding == super::codec::NAME_NIBBLE
        && t.dtype == "BF16"
        && matches!(t.shape[..], [rows, cols] if rows >= 2 && cols > 0 && cols % 32 == 0)
}

/// The decoded layout of `l` (`hold`: a pinned layer's, with the tensors [`holds_coded`]
/// kept as stored), None when every tensor is raw.
fn decoded_layout(l: &TrunkLayer, hold: bool) -> Option<Decoded> {
    if !l.tensors.values().any(TrunkTensor::is_encoded) {
        return None;
    }
    let mut order: Vec<(&String, &TrunkTensor)> = l.tensors.iter().collect();
    order.sort_by_key(|(_, t)| t.off);
    let mut at = 0usize;
    let mut pieces = 0usize;
    let mut tensors = Vec::with_capacity(order.len());
    let (mut ends, mut kept) = (Vec::new(), Vec::new());
    for (name, t) in order {
        let off = at.next_multiple_of(GATHER_ALIGN as usize);
        tensors.push((name.clone(), off));
        let keep = hold && holds_coded(t);
        at = off + if keep { t.stored } else { t.nbytes } as usize;
        ends.push(at);
        kept.push(keep);
        pieces += if t.is_encoded() && !keep {
            (t.nbytes as usize / 2)
                .div_ceil(super::codec::BLOCK_ELEMS)
                .max(1)
        } else {
            1
        };
    }
    Some(Decoded {
        len: at,
        tensors,
        ends,
        kept,
        pieces,
    })
}

/// Layer `l`'s tensors as they lie in its stored run, where the run can be read into memory
/// as it lies and bound there (None where it cannot): every encoded tensor nibble-coded, so
/// the kernels multiply its matrices as stored, and every tensor at a [`GATHER_ALIGN`]-aligned
/// offset of the run (as `k3 pack` lays them out), every encoded matrix one the kernels
/// multiply coded ([`holds_coded`]). Each encoded tensor is "kept": bound to its stored bytes,
/// a matrix held coded, a vector (a norm's gains, a matrix of one row) decoded into an
/// allocation of its own when the layer is bound.
fn placed_layout(l: &TrunkLayer) -> Option<Decoded> {
    let mut order: Vec<(&String, &TrunkTensor)> = l.tensors.iter().collect();
    order.sort_by_key(|(_, t)| t.off);
    let any_encoded = order.iter().any(|(_, t)| t.is_encoded());
    // Only vectors are decoded beside the run: a layer with a matrix the kernels cannot
    // multiply coded (rows not a multiple of 32 values) is staged and decoded instead.
    let vector = |t: &TrunkTensor| t.shape.len() == 1 || t.shape.first() == Some(&1);
    let placeable = order.iter().all(|(_, t)| {
        t.off.is_multiple_of(GATHER_ALIGN)
            && (!t.is_encoded()
                || (t.encoding == super::codec::NAME_NIBBLE && (holds_coded(t) || vector(t))))
    });
    if !any_encoded || !placeable {
        return None;
    }
    Some(Decoded {
        len: usize::try_from(l.nbytes).ok()?,
        tensors: (order.iter())
            .map(|(name, t)| ((*name).clone(), t.off as usize))
            .collect(),
        ends: order
            .iter()
            .map(|(_, t)| (t.off + t.stored) as usize)
            .collect(),
        kept: order.iter().map(|(_, t)| t.is_encoded()).collect(),
        pieces: 0,
    })
}

/// What a layer read in place keeps beside its run once bound: the kernels' index of each
/// matrix held coded, and the decoded values of its other encoded tensors.
fn placed_extra(l: &TrunkLayer) -> u64 {
    (l.tensors.values())
        .filter(|t| t.is_encoded())
        .map(|t| {
            if holds_coded(t) {
                super::codec::NibbleIndex::bytes_for(t.shape[0], t.shape[1]) as u64
            } else {
                t.nbytes
            }
        })
        .sum()
}

/// One piece of a layer's decoding: a block of an encoded tensor, or a raw tensor copied.
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// The tensor's index in [`Decoded::tensors`].
    tensor: usize,
    /// Where its bytes start in the decoded layer, after `gap` zero bytes (the alignment
    /// padding before a tensor's first piece).
    dst: usize,
    gap: usize,
    /// The block, None for a raw tensor.
    block: Option<super::codec::Block>,
}

impl Piece {
    /// Where the piece's share of the decoded layer starts (its padding included).
    fn start(&self) -> usize {
        self.dst - self.gap
    }
}

/// A layer's stored run as read into memory: its bytes from byte `from` of the run on (the
/// whole run from 0, or the window of it a staging smaller than the run holds).
#[derive(Clone, Copy)]
struct RunBytes<'a> {
    bytes: &'a [u8],
    from: usize,
}

impl<'a> RunBytes<'a> {
    /// Tensor `t`'s stored bytes; None when they are not all here.
    fn stored(&self, t: &TrunkTensor) -> Option<&'a [u8]> {
        let at = usize::try_from(t.off).ok()?.checked_sub(self.from)?;
        self.bytes
            .get(at..at.checked_add(usize::try_from(t.stored).ok()?)?)
    }
}

/// The list of pieces one layer decodes in, made once and refilled for every layer
/// ([`Trunk::decode_scratch`]), so decoding a layer allocates nothing.
#[derive(Debug, Default)]
pub struct DecodeScratch {
    pieces: Vec<Piece>,
}

/// What [`Trunk::open`] read back from the shards to check the trunk still matches them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceCheck {
    /// Tensors whose sampled windows were checked.
    pub sampled: usize,
    /// Tensors checked in full (their shard's inode or change time differs from when packed).
    pub full: usize,
    /// Bytes read from the shards for the check.
    pub bytes: u64,
    /// The shards whose inode or change time differs from when packed.
    pub rewritten: Vec<String>,
}

/// Read back every trunk tensor's source from the shards and compare it with the manifest:
/// the sampled windows of each, and every byte of those in the `rewritten` shards. A tensor
/// that differs refuses the trunk, each named.
fn check_source_bytes(
    m: &Manifest,
    ck: &Checkpoint,
    rewritten: &[usize],
    dir: &Path,
) -> Result<SourceCheck, TrunkError> {
    use rayon::prelude::*;
    let names = ck.index().shard_names();
    let mut jobs = Vec::new();
    for l in m.runs() {
        for (name, t) in &l.tensors {
            let i = ck
                .info(name)
                .ok_or_else(|| StreamError::NoSuchTensor(name.clone()))?;
            jobs.push((l.layer, name, t, rewritten.contains(&i.shard), i));
        }
    }
    let check = |(il, name, t, full, i): &(
        usize,
        &String,
        &TrunkTensor,
        bool,
        super::TensorInfo,
    )|
     -> Result<(u64, Option<String>), StreamError> {
        let spans = if *full {
            let n = i.n_bytes();
            (0..n.div_ceil(PIECE as u64))
                .map(|k| (k * PIECE as u64, (n - k * PIECE as u64).min(PIECE as u64)))
                .collect()
        } else {
            sample_spans(i.n_bytes())
        };
        let mut h = crc32fast::Hasher::new();
        let mut buf = Vec::new();
        let mut read = 0u64;
        for (o, len) in spans {
            buf.resize(len as usize, 0);
            ck.pread_plain(i.shard, i.offset + o, &mut buf)
                .map_err(|source| StreamError::Read {
                    path: ck.dir().join(&names[i.shard]),
                    offset: i.offset + o,
                    len,
                    name: (*name).clone(),
                    source,
                })?;
            h.update(&buf);
            read += len;
        }
        let (got, want, what) = if *full {
            (h.finalize(), t.source_crc32, "bytes")
        } else {
            (h.finalize(), t.source_sample, "sampled bytes")
        };
        Ok((
            read,
            (got != want).then(|| {
                let run = if *il < m.n_layers {
                    format!("layer {il}")
                } else {
                    "the output head".to_string()
                };
                format!(
                    "{run}: tensor {name:?} in {} (its {what} hash to {got:08x}, \
                     {want:08x} when packed)",
                    super::shown(Path::new(&names[i.shard]))
                )
            }),
        ))
    };
    let results: Vec<Result<(u64, Option<String>), StreamError>> = match io_pool() {
        Some(pool) => pool.install(|| jobs.par_iter().map(check).collect()),
        None => jobs.par_iter().map(check).collect(),
    };
    let mut out = SourceCheck {
        rewritten: rewritten.iter().map(|&k| names[k].clone()).collect(),
        ..SourceCheck::default()
    };
    let mut differ = Vec::new();
    for (r, job) in results.into_iter().zip(&jobs) {
        let (read, bad) = r?;
        out.bytes += read;
        if job.3 {
            out.full += 1;
        } else {
            out.sampled += 1;
        }
        differ.extend(bad);
    }
    if differ.is_empty() {
        return Ok(out);
    }
    Err(TrunkError::Invalid {
        dir: dir.to_path_buf(),
        reason: format!(
            "the checkpoint changed since it was packed, though its shards kept their size and \
             modification time (edited in place?): {}; the trunk holds the old weights; run \
             `k3 pack --force {} {}` to re-pack it",
            super::join_listed(&differ),
            super::shown(ck.dir()),
            super::shown(dir)
        ),
    })
}

/// A matrix stored encoded, to be decoded rows at a time by [`decode_rows`].
#[derive(Clone, Copy, Debug)]
pub struct RowShape {
    /// Values of the matrix.
    pub values: usize,
    /// Bytes its encoding takes.
    pub stored: usize,
    /// Rows at most per call.
    pub rows: usize,
    /// Values per row.
    pub cols: usize,
}

/// Why [`decode_rows`] stopped.
#[derive(Debug)]
pub enum RowsError<E> {
    /// The reader failed.
    Read(E),
    /// The encoding does not decode: why.
    Corrupt(String),
}

/// Decode an encoded matrix in order: `rows_done(first, values)` is called with whole rows of
/// `shape.cols` BF16 values, at most `shape.rows` rows a call. `read(at, area)` fills `area`
/// with the encoding's bytes from `at`; they are read [`HEAD_SEGMENT`] at a time into `enc`
/// and decoded a block at a time into `dec` (both grown to [`head_scratch`]'s sizes, never
/// shrunk). A block that does not decode (a bad header, code or checksum), or blocks that do
/// not add up to the stored length, stop it before any of their values reach `rows_done`.
pub fn decode_rows<E>(
    shape: RowShape,
    mut read: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    enc: &mut Vec<u8>,
    dec: &mut Vec<u16>,
    mut rows_done: impl FnMut(usize, &[u16]),
) -> Result<(), RowsError<E>> {
    use super::codec;
    let RowShape {
        values,
        stored,
        rows,
        cols,
    } = shape;
    let (rows, cols) = (rows.max(1), cols.max(1));
    if !values.is_multiple_of(cols) {
        return Err(RowsError::Corrupt(format!(
            "{values} values are no whole rows of {cols}"
        )));
    }
    let (dec_len, enc_len) = head_scratch(rows as u64, cols as u64, values as u64, stored as u64);
    if dec.len() < dec_len as usize {
        dec.resize(dec_len as usize, 0);
    }
    if enc.len() < enc_len as usize {
        enc.resize(enc_len as usize, 0);
    }
    let bad = |e: codec::CodecError| RowsError::Corrupt(Trunk::repack(&e));
    // enc[lo..hi] holds stored bytes not yet decoded; `got` of them have been read.
    let (mut lo, mut hi, mut got) = (0usize, 0usize, 0usize);
    // dec[..filled] holds decoded values from row `row0` on.
    let (mut filled, mut row0) = (0usize, 0usize);
    let count = values.div_ceil(codec::BLOCK_ELEMS);
    for b in 0..count {
        while got < stored {
            let span = codec::stated_span(&enc[lo..hi]).map(|n| n.min(codec::MAX_BLOCK_SPAN));
            if span.is_some_and(|n| n <= hi - lo) {
                break;
            }
            enc.copy_within(lo..hi, 0);
            (lo, hi) = (0, hi - lo);
            let take = (enc.len() - hi).min(stored - got);
            if take == 0 {
                break;
            }
            read(got, &mut enc[hi..hi + take]).map_err(RowsError::Read)?;
            (hi, got) = (hi + take, got + take);
        }
        let blk = codec::block_at(&enc[lo..hi], b, 2 * values).map_err(bad)?;
        let n = blk.decoded_len() / 2;
        let Some(out) = dec.get_mut(filled..filled + n) else {
            return Err(RowsError::Corrupt(format!(
                "block {b} decodes past the matrix"
            )));
        };
        blk.decode(&enc[lo..hi], bytemuck::cast_slice_mut::<u16, u8>(out))
            .map_err(bad)?;
        (lo, filled) = (lo + blk.span(), filled + n);
        if filled >= rows * cols || b + 1 == count {
            let whole = filled / cols;
            for part in dec[..whole * cols].chunks(rows * cols) {
                rows_done(row0, part);
                row0 += part.len() / cols;
            }
            dec.copy_within(whole * cols..filled, 0);
            filled -= whole * cols;
        }
    }
    if lo != hi || got != stored {
        return Err(RowsError::Corrupt(format!(
            "{stored} stored bytes, the blocks take {}",
            got - (hi - lo)
        )));
    }
    Ok(())
}

/// Check the head's run `h` of a trunk whose layers end at `end`: one BF16 tensor of the
/// checkpoint, encoded, inside its aligned run, which follows the layers'. Returns where it ends.
fn check_head(h: &TrunkLayer, ck: &Checkpoint, n_layers: usize, end: u64) -> Result<u64, String> {
    if h.layer != n_layers {
        return Err(format!(
            "the head's run is numbered {}, expected {n_layers}",
            h.layer
        ));
    }
    let next = h.file_off.checked_add(h.nbytes);
    if !h.file_off.is_multiple_of(ALIGN)
        || !h.nbytes.is_multiple_of(ALIGN)
        || h.file_off < end
        || next.is_none()
    {
        return Err(format!(
            "the head's run: file_off {} / nbytes {} not 4096-aligned or overlapping",
            h.file_off, h.nbytes
        ));
    }
    let mut tensors = h.tensors.iter();
    let (Some((name, t)), None) = (tensors.next(), tensors.next()) else {
        return Err(format!(
            "the head's run holds {} tensors, expected one",
            h.tensors.len()
        ));
    };
    let Some(i) = ck.info(name) else {
        return Err(format!(
            "the head's run holds {name:?}, which the checkpoint does not have"
        ));
    };
    if t.dtype != "BF16"
        || i.dtype != Dtype::Bf16
        || t.shape != i.shape
        || t.nbytes != i.n_bytes()
        || super::codec::Coding::from_name(&t.encoding).is_none()
    {
        return Err(format!(
            "the head {name:?} is {} {:?} stored as {:?} in the trunk, {} {:?} in the checkpoint",
            t.dtype,
            t.shape,
            t.encoding,
            i.dtype.name(),
            i.shape
        ));
    }
    if t.off.checked_add(t.stored).is_none_or(|e| e > h.nbytes) {
        return Err(format!("the head {name:?} lies outside its run"));
    }
    Ok(next.unwrap_or(u64::MAX))
}

impl Trunk {
    /// Open the trunk in `dir` for the checkpoint `ck` with `n_layers` layers: the manifest is
    /// validated in full (format, alignment, every offset and size, `trunk.bin`'s length) and
    /// must describe exactly this checkpoint's trunk tensors with their dtypes and shapes.
    ///
    /// Over 100 lines: one check per manifest field, in the order the manifest is read.
    pub fn open(dir: &Path, ck: &Checkpoint, n_layers: usize) -> Result<Trunk, TrunkError> {
        let bad = |reason: String| TrunkError::Invalid {
            dir: dir.to_path_buf(),
            reason,
        };
        let m = read_manifest(dir).map_err(bad)?;
        if m.align != ALIGN {
            return Err(bad(format!("align {}, expected {ALIGN}", m.align)));
        }
        let digest = hex(&ck.index_digest());
        if m.source_digest != digest {
            return Err(bad(format!(
                "packed from a different checkpoint ({}…, this one is {}…); run `k3 pack` again",
                &m.source_digest.get(..12).unwrap_or(&m.source_digest),
                &digest[..12]
            )));
        }
        let want = layer_tensors(ck, n_layers);
        let with_head: Vec<Vec<String>> = (want.iter().cloned())
            .chain(m.head.iter().map(|h| h.tensors.keys().cloned().collect()))
            .collect();
        let rewritten = check_sources(&m, ck, &with_head, dir).map_err(bad)?;
        if m.n_layers != n_layers || m.layers.len() != n_layers {
            return Err(bad(format!(
                "the manifest declares {} layers and lists {}; the model has {n_layers}",
                m.n_layers,
                m.layers.len()
            )));
        }
        let mut end = 0u64;
        for (il, (l, names)) in m.layers.iter().zip(&want).enumerate() {
            if l.layer != il {
                return Err(bad(format!("entry {il} is layer {}", l.layer)));
            }
            let next = l.file_off.checked_add(l.nbytes);
            if l.file_off % ALIGN != 0
                || l.nbytes % ALIGN != 0
                || l.file_off < end
                || next.is_none()
            {
                return Err(bad(format!(
                    "layer {il}: file_off {} / nbytes {} not 4096-aligned or overlapping",
                    l.file_off, l.nbytes
                )));
            }
            end = next.unwrap_or(u64::MAX);
            if l.tensors.len() != names.len() {
                return Err(bad(format!(
                    "layer {il}: {} tensors, the checkpoint has {}",
                    l.tensors.len(),
                    names.len()
                )));
            }
            for n in names {
                let i = ck.info(n).expect("name from the index");
                let Some(t) = l.tensors.get(n) else {
                    return Err(bad(format!("layer {il}: tensor {n} is missing")));
                };
                if t.dtype != i.dtype.name() || t.shape != i.shape || t.nbytes != i.n_bytes() {
                    return Err(bad(format!(
                        "layer {il}: tensor {n} is {} {:?} in the trunk, {} {:?} in the checkpoint",
                        t.dtype,
                        t.shape,
                        i.dtype.name(),
                        i.shape
                    )));
                }
                match t.encoding.as_str() {
                    RAW if t.stored == t.nbytes => {}
                    e if t.dtype == "BF16" && super::codec::Coding::from_name(e).is_some() => {}
                    e => {
                        return Err(bad(format!(
                            "layer {il}: tensor {n} ({}, {} bytes) is stored as {e:?} in {} \
                             bytes",
                            t.dtype, t.nbytes, t.stored
                        )));
                    }
                }
                if t.off.checked_add(t.stored).is_none_or(|e| e > l.nbytes) {
                    return Err(bad(format!("layer {il}: tensor {n} lies outside its run")));
                }
            }
        }
        if let Some(h) = &m.head {
            end = check_head(h, ck, n_layers, end).map_err(bad)?;
        }
        let decoded = m.layers.iter().map(|l| decoded_layout(l, false)).collect();
        let held = m.layers.iter().map(|l| decoded_layout(l, true)).collect();
        let placed = m.layers.iter().map(placed_layout).collect();
        let source_check = check_source_bytes(&m, ck, &rewritten, dir)?;
        let bin = dir.join("trunk.bin");
        let (file, len) =
            super::open_regular(&bin).map_err(|e| bad(format!("cannot open trunk.bin: {e}")))?;
        if len != m.total_bytes || len < end {
            return Err(bad(format!(
                "trunk.bin is {len} bytes, the manifest says {} (truncated or from another pack?)",
                m.total_bytes
            )));
        }
        Ok(Trunk {
            dir: dir.to_path_buf(),
            direct: None,
            direct_off: AtomicBool::new(false),
            verified: (0..n_layers).map(|_| AtomicBool::new(false)).collect(),
            bytes_read: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            fault: FaultSlot::default(),
            pool: Pool::new(1),
            decoded_pool: Pool::new(1),
            decoded,
            held,
            placed,
            manifest: m,
            file,
            source_check,
        })
    }

    /// Decode the encoded output head ([`Manifest::head`]) in order with [`decode_rows`]: the
    /// stored bytes are read from `trunk.bin` [`HEAD_SEGMENT`] at a time. Returns the time
    /// spent reading. A block that does not decode is refused as corrupt.
    pub fn stream_head(
        &self,
        rows: usize,
        cols: usize,
        enc: &mut Vec<u8>,
        dec: &mut Vec<u16>,
        rows_done: impl FnMut(usize, &[u16]),
    ) -> Result<std::time::Duration, StreamError> {
        // Errors only build their path and names: a token's read allocates nothing.
        let Some((_, t, l)) = self.manifest.head_tensor() else {
            return Err(self.head_corrupt("the trunk holds no encoded head".into()));
        };
        let base = l.file_off + t.off;
        let mut reading = std::time::Duration::ZERO;
        let read = |at: usize, area: &mut [u8]| {
            let at = base + at as u64;
            let t0 = std::time::Instant::now();
            let take = area.len();
            let r = pread_counted(
                &self.reads,
                &self.fault,
                &self.file,
                super::bytes::as_uninit(area),
                at,
                take,
            );
            reading += t0.elapsed();
            r.map(|_| ()).map_err(|source| StreamError::Read {
                path: self.dir.join("trunk.bin"),
                offset: at,
                len: take as u64,
                name: "trunk output head".into(),
                source,
            })
        };
        let shape = RowShape {
            values: t.nbytes as usize / 2,
            stored: t.stored as usize,
            rows,
            cols,
        };
        decode_rows(shape, read, enc, dec, rows_done).map_err(|e| match e {
            RowsError::Read(e) => e,
            RowsError::Corrupt(reason) => self.head_corrupt(reason),
        })?;
        self.drop_cached(l);
        self.bytes_read.fetch_add(t.stored, Ordering::Relaxed);
        Ok(reading)
    }

    /// The encoded output head read whole from its run to be held coded and multiplied so
    /// ([`CodedMatrix`]; [`Manifest::head_held`] bytes): the run's checksum and every block
    /// checked. None where the head is not stored nibble-coded.
    ///
    /// # Errors
    /// A read fails, the run's checksum does not match, or a block does not decode.
    pub fn read_head_coded(&self) -> Result<Option<CodedMatrix>, StreamError> {
        let Some((_, t, l)) = self
            .manifest
            .head_tensor()
            .filter(|(_, t, _)| holds_coded(t))
        else {
            return Ok(None);
        };
        let (Ok(len), Ok(off), Ok(stored)) = (
            usize::try_from(l.nbytes),
            usize::try_from(t.off),
            usize::try_from(t.stored),
        ) else {
            return Err(self.head_corrupt("larger than this machine can address".into()));
        };
        let mut fill = Filling::new(len);
        self.read_run_part(l, 0, fill.area(), false)?;
        self.read_run_done(l);
        let mut run = fill.finish(len);
        let got = crc32fast::hash(run.as_slice());
        if got != l.crc32 {
            return Err(self.head_corrupt(checksum_mismatch(got, l.crc32)));
        }
        if !run.reslice(off, stored) {
            return Err(self.head_corrupt("the head lies outside its run".into()));
        }
        let mut scratch = Vec::new();
        CodedMatrix::new(run, t.shape[0], t.shape[1], &mut scratch)
            .map_err(|e| self.head_corrupt(Self::repack(&e)))
    }

    /// The encoded output head refused as corrupt, for `reason`.
    fn head_corrupt(&self, reason: String) -> StreamError {
        StreamError::Corrupt {
            path: self.dir.join("trunk.bin"),
            what: self.run_name(self.manifest.layers.len()),
            reason,
        }
    }

    /// What the check of the source bytes at open read.
    #[must_use]
    pub fn source_check(&self) -> &SourceCheck {
        &self.source_check
    }

    /// Free the idle layer allocation kept for the next read (after a smaller plan).
    pub fn release_pooled(&self) {
        self.pool.release();
        self.decoded_pool.release();
    }

    /// Read with `O_DIRECT` where the filesystem allows it; returns whether it does.
    pub fn set_direct(&mut self, on: bool) -> bool {
        self.direct = if on {
            open_direct(&self.dir.join("trunk.bin"))
        } else {
            None
        };
        self.direct.is_some()
    }

    /// Whether reads bypass the page cache.
    #[must_use]
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && !self.direct_off.load(Ordering::Relaxed)
    }

    /// The manifest.
    #[must_use]
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The trunk directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes read from `trunk.bin` so far.
    #[must_use]
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Reads of `trunk.bin` issued so far.
    #[must_use]
    pub fn reads_issued(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Inject `fault` into the `n`-th read of `trunk.bin` (counting from 0), for tests.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self, n: u64, fault: super::checkpoint::Fault) {
        self.fault.arm(n, fault);
    }

    /// Read layer `il`'s run in large pieces, several in flight (direct where allowed),
    /// straight into one allocation whose ranges become the tensors (decoded first where the
    /// layer holds encoded ones; with `coded`, its nibble-coded matrices kept as stored, as a
    /// pinned layer holds them: [`LayerRun::take_coded`]); the run's checksum is verified the
    /// first time the layer is read.
    pub fn read_layer(&self, il: usize, coded: bool) -> Result<LayerRun, StreamError> {
        let l = &self.manifest.layers[il];
        let total = usize::try_from(l.nbytes).map_err(|_| {
            self.read_error(
                il,
                l.file_off,
                l.nbytes,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "run too large"),
            )
        })?;
        let layout = match coded {
            true => self.held[il].as_ref().or(self.decoded[il].as_ref()),
            false => self.decoded[il].as_ref(),
        };
        // A raw run becomes the layer's tensors: pooled, for the next read of a streamed
        // layer. An encoded one is only decoded from: an allocation of its own, given back
        // to the system once decoded (a pooled one would stay resident beside the layer it
        // decoded to, outside the plan).
        let mut fill = match layout {
            Some(_) => Filling::new(total),
            None => Filling::new_in(total, &self.pool),
        };
        self.read_run_into(il, fill.area())?;
        let run = fill.finish(total);
        self.check_run(il, &run)?;
        match layout {
            Some(d) => {
                let run = self.decode_layer(il, &run, d)?;
                on_io_pool(|| self.layer_run_as(il, Some(d), &run))
            }
            None => self.layer_run(il, &run),
        }
    }

    /// The bytes layer `il`'s run takes when it holds no encoded tensor (what
    /// [`Trunk::read_run_into`] writes and [`Trunk::raw_layer_run`] binds); None when it
    /// holds encoded ones (see [`Trunk::decoded_len`]).
    #[must_use]
    pub fn raw_run_len(&self, il: usize) -> Option<usize> {
        let l = self.manifest.layers.get(il)?;
        if self.decoded.get(il)?.is_some() {
            return None;
        }
        usize::try_from(l.nbytes).ok()
    }

    /// For a layer holding encoded tensors: the bytes its run takes as stored (what
    /// [`Trunk::read_run_into`] reads, to be decoded from), and the bytes it decodes to (what
    /// [`Trunk::decode_run_into`] writes and [`Trunk::decoded_layer_run`] binds). None for a
    /// layer stored raw.
    #[must_use]
    pub fn decoded_len(&self, il: usize) -> Option<(usize, usize)> {
        let l = self.manifest.layers.get(il)?;
        let d = self.decoded.get(il)?.as_ref()?;
        Some((usize::try_from(l.nbytes).ok()?, d.len))
    }

    /// Per layer, the bytes a streamed read of it stages before decoding: its stored run
    /// when it holds encoded tensors, 0 when it is read as it lies (the planner's
    /// `ModelSizes::layer_staged`).
    #[must_use]
    pub fn staged_lens(&self) -> Vec<u64> {
        self.manifest.staged_lens()
    }

    /// Per layer, the least staging a read of it decodes through (see
    /// [`Manifest::window_lens`]; the planner's `ModelSizes::layer_window`).
    #[must_use]
    pub fn window_lens(&self) -> Vec<u64> {
        self.manifest.window_lens()
    }

    /// A list of decoding pieces long enough for any layer of the trunk.
    #[must_use]
    pub fn decode_scratch(&self) -> DecodeScratch {
        let most = (self.decoded.iter().chain(&self.held))
            .flatten()
            .map(|d| d.pieces)
            .max();
        DecodeScratch {
            pieces: Vec::with_capacity(most.unwrap_or(0)),
        }
    }

    fn read_error(&self, il: usize, at: u64, len: u64, source: std::io::Error) -> StreamError {
        StreamError::Read {
            path: self.dir.join("trunk.bin"),
            offset: at,
            len,
            name: self.run_name(il),
            source,
        }
    }

    /// How errors name run `il`: a layer's, or the output head's (numbered `n_layers`).
    fn run_name(&self, il: usize) -> String {
        if il == self.manifest.layers.len() {
            "trunk output head".into()
        } else {
            format!("trunk layer {il}")
        }
    }

    /// Read layer `il`'s run (as stored) into the first bytes of `area`, in large pieces,
    /// several in flight (direct where allowed), counted as read.
    pub fn read_run_into(
        &self,
        il: usize,
        area: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), StreamError> {
        let total = usize::try_from(self.manifest.layers[il].nbytes).unwrap_or(usize::MAX);
        let Some(area) = area.get_mut(..total) else {
            let l = &self.manifest.layers[il];
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "run too large");
            return Err(self.read_error(il, l.file_off, l.nbytes, e));
        };
        let l = &self.manifest.layers[il];
        self.read_run_part(l, 0, area, false)?;
        self.read_run_done(l);
        Ok(())
    }

    /// The bytes layer `il`'s run takes where it is read in place, to be multiplied coded as
    /// it lies ([`Trunk::read_in_place_into`]); None where it cannot be ([`placed_layout`]: a
    /// layer stored raw or entropy-coded, or with a matrix the coded kernels do not take).
    #[must_use]
    pub fn in_place_len(&self, il: usize) -> Option<usize> {
        let l = self.manifest.layers.get(il)?;
        self.placed.get(il)?.as_ref()?;
        usize::try_from(l.nbytes).ok()
    }

    /// Read layer `il`'s run as it lies into the first [`Trunk::in_place_len`] bytes of
    /// `area`, like [`Trunk::read_run_into`], and check it against the manifest's checksum
    /// on **every** read: each piece is hashed by the thread that read it as it arrives, and
    /// the pieces' sums are combined in order. A layer read in place is bound once per slot
    /// and its kernels' index kept (`stream::ring`), so a run changed on disk since must
    /// never reach them: it is refused here, naming the layer, instead.
    pub fn read_in_place_into(
        &self,
        il: usize,
        area: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), StreamError> {
        let l = &self.manifest.layers[il];
        let refuse = |why: &str| {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string());
            self.read_error(il, l.file_off, l.nbytes, e)
        };
        let len = (self.in_place_len(il)).ok_or_else(|| refuse("not read in place"))?;
        let area = area.get_mut(..len).ok_or_else(|| refuse("run too large"))?;
        let got = self.read_run_part(l, 0, area, true)?.unwrap_or_default();
        self.read_run_done(l);
        if got != l.crc32 {
            return Err(StreamError::Corrupt {
                path: self.dir.join("trunk.bin"),
                what: self.run_name(il),
                reason: checksum_mismatch(got, l.crc32),
            });
        }
        self.verified[il].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Layer `il`'s tensors as ranges of `mem`, where [`Trunk::read_in_place_into`] read its
    /// run: its nibble-coded matrices checked block by block and located for the kernels
    /// (the checks of [`CodedMatrix::new`]), the others as they lie.
    pub fn in_place_layer_run(&self, il: usize, mem: &Bytes) -> Result<LayerRun, StreamError> {
        on_io_pool(|| self.layer_run_as(il, self.placed[il].as_ref(), mem))
    }

    /// Layer `il`, read in place ([`Trunk::in_place_len`]) into an allocation of its own and
    /// bound there, to be pinned held coded: no staging and no second copy, so loading it
    /// takes the bytes the planner counts for it and no more.
    pub fn read_in_place_layer(&self, il: usize) -> Result<LayerRun, StreamError> {
        let l = &self.manifest.layers[il];
        let Some(len) = self.in_place_len(il) else {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not read in place");
            return Err(self.read_error(il, l.file_off, l.nbytes, e));
        };
        let mut fill = Filling::new_in(len, &self.decoded_pool);
        on_io_pool(|| self.read_in_place_into(il, fill.area()))?;
        let bytes = fill.finish(len);
        self.in_place_layer_run(il, &bytes)
    }

    /// Read bytes `from..from + area.len()` of layer `il`'s run into `area` (`from` a
    /// multiple of the read piece), in pieces, several in flight; with `hash`, the CRC-32 of
    /// the bytes read, each piece hashed on the thread that read it.
    fn read_run_part(
        &self,
        l: &TrunkLayer,
        from: usize,
        area: &mut [std::mem::MaybeUninit<u8>],
        hash: bool,
    ) -> Result<Option<u32>, StreamError> {
        use rayon::prelude::*;
        let il = l.layer;
        let direct = self.direct.as_ref().filter(|_| self.is_direct());
        let read_piece = |k: usize, piece: &mut [std::mem::MaybeUninit<u8>]| {
            let at = l.file_off + (from + k * PIECE) as u64;
            let take = piece.len();
            let read = |f: &File, piece: &mut [std::mem::MaybeUninit<u8>]| {
                let mut h = hash.then(crc32fast::Hasher::new);
                pread_seen(&self.reads, &self.fault, f, piece, at, take, |b| {
                    if let Some(h) = &mut h {
                        h.update(b);
                    }
                })
                .map(|_| h)
            };
            let r = match direct {
                Some(f) => match read(f, piece) {
                    Err(e)
                        if rustix::io::Errno::from_io_error(&e)
                            == Some(rustix::io::Errno::INVAL) =>
                    {
                        self.direct_off.store(true, Ordering::Relaxed);
                        read(&self.file, piece)
                    }
                    r => r,
                },
                None => read(&self.file, piece),
            };
            r.map_err(|e| self.read_error(il, at, take as u64, e))
        };
        // The lowest failing piece's error, whichever thread saw it first. The pieces' sums
        // are combined in order (a reduction keeps the pieces' order).
        let read_all = |area: &mut [std::mem::MaybeUninit<u8>]| {
            area.par_chunks_mut(PIECE)
                .enumerate()
                .map(|(k, piece)| read_piece(k, piece))
                .try_reduce(
                    || hash.then(crc32fast::Hasher::new),
                    |a, b| {
                        Ok(match (a, b) {
                            (Some(mut a), Some(b)) => {
                                a.combine(&b);
                                Some(a)
                            }
                            _ => None,
                        })
                    },
                )
        };
        // Inside a pool (the read-ahead ring's reader), on that pool; else on the I/O pool.
        let sum = match io_pool().filter(|_| rayon::current_thread_index().is_none()) {
            Some(pool) => pool.install(|| read_all(area)),
            None => read_all(area),
        }?;
        Ok(sum.map(crc32fast::Hasher::finalize))
    }

    /// What follows a whole run read: the page cache told to drop it (buffered reads), the
    /// bytes counted.
    fn read_run_done(&self, l: &TrunkLayer) {
        if self.direct.as_ref().filter(|_| self.is_direct()).is_none() {
            self.drop_cached(l);
        }
        self.bytes_read.fetch_add(l.nbytes, Ordering::Relaxed);
    }

    /// Tell the page cache to drop run `l`'s bytes (read through it, and not needed again).
    fn drop_cached(&self, l: &TrunkLayer) {
        if let Some(n) = std::num::NonZeroU64::new(l.nbytes) {
            let _ = rustix::fs::fadvise(
                &self.file,
                l.file_off,
                Some(n),
                rustix::fs::Advice::DontNeed,
            );
        }
    }

    /// Whether layer `il`'s run has been checked against the manifest's checksum.
    #[must_use]
    pub fn is_checked(&self, il: usize) -> bool {
        self.verified[il].load(Ordering::Relaxed)
    }

    /// [`Trunk::read_run_into`] and [`Trunk::decode_run_into`] overlapped, for a layer whose
    /// run has been checked ([`Trunk::is_checked`]; else, or where its tensors are not stored
    /// in the order they are decoded, one after the other): the run is read into `staged` a
    /// segment at a time, and the tensors that have arrived are decoded into `area` while the
    /// next segment is read, so a streamed encoded layer costs about the longer of its read
    /// and its decoding rather than their sum. The bytes are those of the two calls.
    pub fn read_decode_into(
        &self,
        il: usize,
        staged: &mut super::arena::Slot,
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
    ) -> Result<(), StreamError> {
        self.read_decode_by(il, staged, area, scratch, segment())
    }

    /// [`Trunk::read_decode_into`] reading `segment` bytes ahead of the decoder (rounded up
    /// to a multiple of 4 KiB, the alignment a direct read keeps).
    pub fn read_decode_by(
        &self,
        il: usize,
        staged: &mut super::arena::Slot,
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
        segment: usize,
    ) -> Result<(), StreamError> {
        self.read_layout_by(
            il,
            self.decoded[il].as_ref(),
            staged,
            area,
            scratch,
            segment,
        )
    }

    /// [`Trunk::read_decode_by`] into layout `d` (the layer's decoded one, or a pinned
    /// layer's).
    fn read_layout_by(
        &self,
        il: usize,
        d: Option<&Decoded>,
        staged: &mut super::arena::Slot,
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
        segment: usize,
    ) -> Result<(), StreamError> {
        let segment = segment.max(1).next_multiple_of(4096);
        let l = &self.manifest.layers[il];
        let total = usize::try_from(l.nbytes).unwrap_or(usize::MAX);
        let in_order = d.is_some_and(|d| {
            d.tensors
                .iter()
                .map(|(name, _)| l.tensors.get(name).map(|t| t.off))
                .try_fold(0u64, |end, off| off.filter(|&o| o >= end))
                .is_some()
        });
        // A checked run, or one longer than the staging, is read and decoded overlapped;
        // a run read for the first time into a staging that holds it is read whole and
        // checked before anything is decoded.
        if in_order && (staged.len() < total || self.is_checked(il)) {
            if let Some(d) = d {
                return self.read_decode_window(il, d, staged, area, scratch, segment);
            }
        }
        self.read_run_into(il, staged.area())?;
        let run = staged.as_slice().get(..total).unwrap_or_default();
        self.decode_run_as(il, d, run, area, scratch)
    }

    /// [`Trunk::read_decode_by`] overlapped, through a staging that holds the run or a window
    /// of it (`staged`, at least [`Manifest::window_lens`] of the layer): from the start of the
    /// first tensor not yet decoded to what has arrived. When the next segment does not fit,
    /// the bytes of the tensors decoded are dropped and the rest moved to the front (never,
    /// where the staging holds the run). A run not yet checked is checked as it arrives, and
    /// the layer is refused at the end when its checksum does not match (each encoded block
    /// is checked by its own before it is decoded).
    fn read_decode_window(
        &self,
        il: usize,
        d: &Decoded,
        staged: &mut super::arena::Slot,
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
        segment: usize,
    ) -> Result<(), StreamError> {
        let l = &self.manifest.layers[il];
        let total = usize::try_from(l.nbytes).unwrap_or(usize::MAX);
        let bad = |what: &str| {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
            self.read_error(il, l.file_off, l.nbytes, e)
        };
        let Some(area) = area.get_mut(..d.len) else {
            return Err(bad("run too large"));
        };
        let window = staged.len();
        let n = d.tensors.len();
        let tensor = |k: usize| l.tensors.get(&d.tensors[k].0);
        let start = |k: usize| tensor(k).map_or(usize::MAX, |t| t.off as usize);
        let stored_end = |k: usize| tensor(k).map_or(usize::MAX, |t| (t.off + t.stored) as usize);
        let check = !self.is_checked(il);
        let mut crc = crc32fast::Hasher::new();
        // The window holds bytes `from..arrived` of the run; tensors before `next` are
        // decoded, into `area` up to `decoded_to`.
        let (mut from, mut arrived, mut next, mut decoded_to) = (0usize, 0usize, 0usize, 0usize);
        while next < n || (check && arrived < total) {
            let ready = (next..n)
                .take_while(|&k| stored_end(k) <= arrived)
                .last()
                .map_or(next, |k| k + 1);
            let upto = (arrived + segment).min(total);
            let read_now = upto > arrived && upto - from <= window;
            if ready == next && !read_now {
                if upto == arrived {
                    // Nothing left to read, and the tensors left are not all here.
                    return Err(bad("bad layout"));
                }
                // Make room: keep what the tensors left need, from a 4 KiB boundary (where a
                // direct read may land).
                let keep = if next < n { start(next) } else { arrived };
                let to = (keep / 4096 * 4096).clamp(from, arrived);
                if to == from {
                    return Err(bad("the staging is smaller than a tensor of the layer"));
                }
                staged.area().copy_within(to - from..arrived - from, 0);
                from = to;
                continue;
            }
            let end = if ready == n {
                area.len()
            } else {
                self.decoded_start(d, ready)
            };
            let end = end.clamp(decoded_to, area.len());
            let (run, rest) = staged.split_at_mut(arrived - from);
            let (_, tail) = area.split_at_mut(decoded_to);
            let (part, _) = tail.split_at_mut(end - decoded_to);
            let read_next = || {
                if read_now {
                    self.read_run_part(l, arrived, &mut rest[..upto - arrived], false)
                        .map(|_| ())
                } else {
                    Ok(())
                }
            };
            let run = RunBytes { bytes: run, from };
            let decode = || self.decode_tensors(il, d, run, next..ready, part, decoded_to, scratch);
            let (r, x) = rayon::join(read_next, decode);
            r.and(x)?;
            if read_now {
                if check {
                    crc.update(&staged.as_slice()[arrived - from..upto - from]);
                }
                arrived = upto;
            }
            (next, decoded_to) = (ready, end);
        }
        if check {
            let got = crc.finalize();
            if got != l.crc32 {
                return Err(bad(&checksum_mismatch(got, l.crc32)));
            }
            self.verified[il].store(true, Ordering::Relaxed);
        }
        self.read_run_done(l);
        Ok(())
    }

    /// Verify layer `il`'s run (as stored, at the start of `run`) against the manifest's
    /// checksum, the first time the layer is read.
    pub fn check_run(&self, il: usize, run: &Bytes) -> Result<(), StreamError> {
        self.check_stored(il, run.as_slice())
    }

    /// [`Trunk::check_run`] on the stored bytes at the start of `run`.
    fn check_stored(&self, il: usize, run: &[u8]) -> Result<(), StreamError> {
        if self.verified[il].load(Ordering::Relaxed) {
            return Ok(());
        }
        let l = &self.manifest.layers[il];
        let stored = run.get(..l.nbytes as usize).unwrap_or_default();
        let got = crc32fast::hash(stored);
        if got != l.crc32 {
            return Err(self.read_error(
                il,
                l.file_off,
                l.nbytes,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    checksum_mismatch(got, l.crc32),
                ),
            ));
        }
        self.verified[il].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Layer `il`'s tensors as ranges of `run`: its raw run as read by
    /// [`Trunk::read_run_into`] (checked first, when it has not been yet), for a layer
    /// without encoded tensors.
    pub fn raw_layer_run(&self, il: usize, run: &Bytes) -> Result<LayerRun, StreamError> {
        self.check_run(il, run)?;
        self.layer_run(il, run)
    }

    /// Layer `il`'s tensors as ranges of `run` (decoded, where the layer holds encoded
    /// tensors).
    fn layer_run(&self, il: usize, run: &Bytes) -> Result<LayerRun, StreamError> {
        self.layer_run_as(il, self.decoded[il].as_ref(), run)
    }

    /// [`Trunk::layer_run`] of `run` laid out by `d` (None: the run as stored). Tensors kept
    /// as stored are checked block by block and located for the kernels, on the current
    /// rayon pool.
    fn layer_run_as(
        &self,
        il: usize,
        d: Option<&Decoded>,
        run: &Bytes,
    ) -> Result<LayerRun, StreamError> {
        use rayon::prelude::*;
        let l = &self.manifest.layers[il];
        let path = self.dir.join("trunk.bin");
        let mut tensors = std::collections::HashMap::with_capacity(l.tensors.len());
        let mut keep = Vec::new();
        for (name, t) in &l.tensors {
            let bad = |reason: String| StreamError::Unrepresentable {
                path: path.clone(),
                name: name.clone(),
                reason,
            };
            let dtype = Dtype::parse(&t.dtype).ok_or_else(|| bad(format!("dtype {}", t.dtype)))?;
            // `Trunk::open` checked every tensor lies inside its run; a decoded layer's
            // tensors are where `decoded_layout` put them.
            let (off, kept) = match d {
                Some(d) => d
                    .tensors
                    .iter()
                    .position(|(n, _)| n == name)
                    .map_or((usize::MAX, false), |k| (d.tensors[k].1, d.kept[k])),
                None => (t.off as usize, false),
            };
            let len = if kept { t.stored } else { t.nbytes } as usize;
            let b = run
                .slice(off, len)
                .ok_or_else(|| bad("outside its run".into()))?;
            if kept {
                keep.push((name, t, b));
            } else {
                tensors.insert(name.clone(), (dtype, b));
            }
        }
        let coded: Vec<(String, Result<Option<CodedMatrix>, StreamError>, Bytes)> = keep
            .into_par_iter()
            .map_init(Vec::new, |scratch, (name, t, b)| {
                // A tensor the kernels do not multiply coded (read in place: a vector, a
                // matrix of one row) is decoded below.
                if !holds_coded(t) {
                    return (name.clone(), Ok(None), b);
                }
                let (rows, cols) = (t.shape[0], t.shape[1]);
                let m = CodedMatrix::new(b.clone(), rows, cols, scratch).map_err(|e| {
                    StreamError::Corrupt {
                        path: path.clone(),
                        what: format!("trunk layer {il}, tensor {name:?}"),
                        reason: Self::repack(&e),
                    }
                });
                (name.clone(), m, b)
            })
            .collect();
        let mut held = std::collections::HashMap::with_capacity(coded.len());
        for (name, m, b) in coded {
            match m? {
                Some(m) => {
                    held.insert(name, m);
                }
                // Not multiplied coded: decoded into an allocation of its own.
                None => {
                    let n = l.tensors.get(&name).map_or(0, |t| t.nbytes as usize);
                    let mut v = vec![0u16; n / 2];
                    let out: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
                    super::codec::decode(b.as_slice(), out).map_err(|e| StreamError::Corrupt {
                        path: path.clone(),
                        what: format!("trunk layer {il}, tensor {name:?}"),
                        reason: Self::repack(&e),
                    })?;
                    tensors.insert(name, (Dtype::Bf16, Bytes::from_u16(&v)));
                }
            }
        }
        Ok(LayerRun {
            layer: il,
            tensors,
            coded: held,
        })
    }

    /// Layer `il`'s tensors as ranges of `mem`, where [`Trunk::decode_run_into`] decoded
    /// them, for a layer holding encoded tensors.
    pub fn decoded_layer_run(&self, il: usize, mem: &Bytes) -> Result<LayerRun, StreamError> {
        self.layer_run(il, mem)
    }

    /// Decode layer `il`'s tensors from `run` (its bytes in `trunk.bin`) into one pooled
    /// allocation laid out by `d`, on the I/O pool.
    fn decode_layer(&self, il: usize, run: &Bytes, d: &Decoded) -> Result<Bytes, StreamError> {
        let mut scratch = self.decode_scratch();
        self.decode_layer_with(il, run.as_slice(), d, &mut scratch)
    }

    /// Layer `il`, stored encoded, read through `staged` (the whole run, or a window of it
    /// as [`Trunk::read_decode_into`] reads it) and decoded into one pooled allocation of its
    /// own, on the I/O pool: a pinned layer loaded through the ring's staging. With `coded`,
    /// its nibble-coded matrices are kept as stored and located for the kernels that multiply
    /// them so ([`holds_coded`], [`LayerRun::take_coded`]).
    ///
    /// # Errors
    /// The layer is stored raw, it cannot be read, or a block does not decode.
    pub fn read_decode_layer(
        &self,
        il: usize,
        staged: &mut super::arena::Slot,
        scratch: &mut DecodeScratch,
        coded: bool,
    ) -> Result<LayerRun, StreamError> {
        let layouts = if coded { &self.held } else { &self.decoded };
        let Some(d) = layouts.get(il).and_then(Option::as_ref) else {
            return Err(StreamError::Corrupt {
                path: self.dir.join("trunk.bin"),
                what: format!("trunk layer {il}"),
                reason: "the layer holds no encoded tensor".into(),
            });
        };
        let mut fill = Filling::new_in(d.len, &self.decoded_pool);
        // On the I/O pool, as in `decode_layer_with`.
        on_io_pool(|| self.read_layout_by(il, Some(d), staged, fill.area(), scratch, segment()))?;
        let bytes = fill.finish(d.len);
        on_io_pool(|| self.layer_run_as(il, Some(d), &bytes))
    }

    fn decode_layer_with(
        &self,
        il: usize,
        run: &[u8],
        d: &Decoded,
        scratch: &mut DecodeScratch,
    ) -> Result<Bytes, StreamError> {
        let mut fill = Filling::new_in(d.len, &self.decoded_pool);
        // On the I/O pool: this may run on a compute pool's worker while the others are
        // blocked waiting for this very layer, so blocks queued on the compute pool would
        // never be decoded.
        on_io_pool(|| self.decode_run_as(il, Some(d), run, fill.area(), scratch))?;
        Ok(fill.finish(d.len))
    }

    /// Decode layer `il` from `run` (its stored run as [`Trunk::read_run_into`] read it,
    /// checked against the manifest the first time) into the first bytes of `area`, laid out
    /// as [`Trunk::decoded_layer_run`] binds it: encoded tensors decoded
    /// (docs/trunk-codec.md), raw ones copied, the alignment padding between them zeroed. The
    /// blocks are decoded on the current rayon pool, several at once; nothing is allocated
    /// when `scratch` came from [`Trunk::decode_scratch`]. A block that does not decode is
    /// refused naming the layer and the tensor (the lowest such block when several fail).
    pub fn decode_run_into(
        &self,
        il: usize,
        run: &[u8],
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
    ) -> Result<(), StreamError> {
        self.decode_run_as(il, self.decoded[il].as_ref(), run, area, scratch)
    }

    /// [`Trunk::decode_run_into`] into layout `d`.
    fn decode_run_as(
        &self,
        il: usize,
        d: Option<&Decoded>,
        run: &[u8],
        area: &mut [std::mem::MaybeUninit<u8>],
        scratch: &mut DecodeScratch,
    ) -> Result<(), StreamError> {
        let corrupt = |name: &str, reason: String| StreamError::Corrupt {
            path: self.dir.join("trunk.bin"),
            what: format!("trunk layer {il}, tensor {name:?}"),
            reason,
        };
        let Some(d) = d else {
            return Err(corrupt("", "the layer holds no encoded tensor".into()));
        };
        let Some(area) = area.get_mut(..d.len) else {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "run too large");
            return Err(self.read_error(il, 0, d.len as u64, e));
        };
        self.check_stored(il, run)?;
        let run = RunBytes {
            bytes: run,
            from: 0,
        };
        self.decode_tensors(il, d, run, 0..d.tensors.len(), area, 0, scratch)
    }

    /// Where the decoded bytes of tensor `k` of `d` begin, the padding before it included
    /// (the end of tensor `k - 1`).
    fn decoded_start(&self, d: &Decoded, k: usize) -> usize {
        k.checked_sub(1).map_or(0, |j| d.ends[j])
    }

    /// Decode tensors `ks` of layer `il` from `run` (the stored run, or the part of it that
    /// holds their bytes) into `area`, which holds the decoded layer from byte `base` on
    /// (`base` is where tensor `ks.start`'s padding begins), on the current rayon pool.
    #[allow(clippy::too_many_arguments)]
    fn decode_tensors(
        &self,
        il: usize,
        d: &Decoded,
        run: RunBytes<'_>,
        ks: std::ops::Range<usize>,
        area: &mut [std::mem::MaybeUninit<u8>],
        base: usize,
        scratch: &mut DecodeScratch,
    ) -> Result<(), StreamError> {
        let corrupt = |name: &str, reason: String| StreamError::Corrupt {
            path: self.dir.join("trunk.bin"),
            what: format!("trunk layer {il}, tensor {name:?}"),
            reason,
        };
        let l = &self.manifest.layers[il];
        let pieces = &mut scratch.pieces;
        pieces.clear();
        let mut end = base;
        for k in ks {
            let (name, off) = &d.tensors[k];
            let t = l
                .tensors
                .get(name)
                .ok_or_else(|| corrupt(name, "not in the manifest".into()))?;
            let gap = off - end;
            end = d.ends[k];
            if !t.is_encoded() || d.kept[k] {
                pieces.push(Piece {
                    tensor: k,
                    dst: *off,
                    gap,
                    block: None,
                });
                continue;
            }
            // `Trunk::open` checked the stored bytes lie inside the run.
            let stored = run
                .stored(t)
                .ok_or_else(|| corrupt(name, "outside its run".into()))?;
            let mut first = true;
            super::codec::locate(stored, t.nbytes as usize, |b| {
                pieces.push(Piece {
                    tensor: k,
                    dst: off + b.decoded_at(),
                    gap: if first { gap } else { 0 },
                    block: Some(b),
                });
                first = false;
            })
            .map_err(|e| corrupt(name, Self::repack(&e)))?;
        }
        self.decode_pieces(il, d, run, pieces, area, base)
    }

    fn repack(e: &super::codec::CodecError) -> String {
        format!("{e}; trunk.bin is corrupt: run `k3 pack --force` to re-pack it")
    }

    /// Decode `pieces` (in order, the first starting at `base` of the decoded layer) into
    /// `area`, which runs to the end of the last: halves at once, down to single pieces.
    fn decode_pieces(
        &self,
        il: usize,
        d: &Decoded,
        run: RunBytes<'_>,
        pieces: &[Piece],
        area: &mut [std::mem::MaybeUninit<u8>],
        base: usize,
    ) -> Result<(), StreamError> {
        match pieces {
            [] => Ok(()),
            [p] => self.decode_piece(il, d, run, p, area),
            _ => {
                let (left, right) = pieces.split_at(pieces.len() / 2);
                let cut = right[0].start() - base;
                if cut > area.len() {
                    let e = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad layout");
                    return Err(self.read_error(il, 0, d.len as u64, e));
                }
                let (a, b) = area.split_at_mut(cut);
                let (x, y) = rayon::join(
                    || self.decode_pieces(il, d, run, left, a, base),
                    || self.decode_pieces(il, d, run, right, b, base + cut),
                );
                x.and(y)
            }
        }
    }

    /// Decode one piece into `area`: its padding, then its bytes.
    fn decode_piece(
        &self,
        il: usize,
        d: &Decoded,
        run: RunBytes<'_>,
        p: &Piece,
        area: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), StreamError> {
        let name = &d.tensors[p.tensor].0;
        let corrupt = |reason: String| StreamError::Corrupt {
            path: self.dir.join("trunk.bin"),
            what: format!("trunk layer {il}, tensor {name:?}"),
            reason,
        };
        let t = self.manifest.layers[il]
            .tensors
            .get(name)
            .ok_or_else(|| corrupt("not in the manifest".into()))?;
        let (gap, dst) = area.split_at_mut(p.gap.min(area.len()));
        for b in gap {
            b.write(0);
        }
        let stored = run
            .stored(t)
            .ok_or_else(|| corrupt("outside its run".into()))?;
        match &p.block {
            Some(b) => {
                let dst = dst
                    .get_mut(..b.decoded_len())
                    .ok_or_else(|| corrupt("a block runs past the layer".into()))?;
                b.decode(stored, dst).map_err(|e| corrupt(Self::repack(&e)))
            }
            None => {
                let dst = dst
                    .get_mut(..stored.len())
                    .ok_or_else(|| corrupt("runs past the layer".into()))?;
                for (d, &s) in dst.iter_mut().zip(stored) {
                    d.write(s);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod describe_tests {
    use super::*;

    #[test]
    fn shard_times_are_shown_in_utc() {
        let st = ShardStat {
            size: 5,
            mtime_sec: 1_796_380_267,
            mtime_nsec: 25,
            ino: 1,
            ctime_sec: 0,
            ctime_nsec: 0,
        };
        assert_eq!(
            describe(&st, false),
            "5 bytes, modified 2026-12-04 10:31:07 UTC"
        );
        assert_eq!(
            describe(&st, true),
            "5 bytes, modified 2026-12-04 10:31:07.000000025 UTC"
        );
    }
}

#[cfg(test)]
mod rows_tests {
    use super::*;
    use crate::stream::codec::{self, Coding, BLOCK_ELEMS};

    /// BF16 values as trained weights look: a few exponents, a random mantissa.
    fn weights(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut out = Vec::with_capacity(2 * n);
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v =
                f32::from_bits(((x >> 40) as u32 & 0x807f_ffff) | ((118 + (x % 5) as u32) << 23));
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        out
    }

    fn u16s(b: &[u8]) -> Vec<u16> {
        b.chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]))
            .collect()
    }

    /// Decode `enc` (of `src`) `rows` rows of `cols` at a time; the rows given, in order.
    fn rows_of(
        enc: &[u8],
        values: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<(usize, Vec<u16>)>, RowsError<()>> {
        let mut calls = Vec::new();
        let shape = RowShape {
            values,
            stored: enc.len(),
            rows,
            cols,
        };
        let read = |at: usize, area: &mut [u8]| {
            area.copy_from_slice(&enc[at..at + area.len()]);
            Ok(())
        };
        let (mut e, mut d) = (Vec::new(), Vec::new());
        decode_rows(shape, read, &mut e, &mut d, |r0, v| {
            calls.push((r0, v.to_vec()))
        })?;
        let (dl, el) = head_scratch(rows as u64, cols as u64, values as u64, enc.len() as u64);
        assert!(
            d.len() as u64 <= dl.max(1) && e.len() as u64 <= el,
            "scratch as sized"
        );
        Ok(calls)
    }

    #[test]
    fn rows_that_straddle_blocks_decode_to_the_source_at_every_chunk_size() {
        // 7168 values a row, as the released head: rows run over block boundaries.
        let (cols, nrows) = (7168, 80);
        let src = weights(cols * nrows, 7);
        let want = u16s(&src);
        assert!(cols * nrows > 2 * BLOCK_ELEMS && !BLOCK_ELEMS.is_multiple_of(cols));
        for coding in [Coding::Nibble, Coding::Entropy] {
            let mut enc = Vec::new();
            assert!(codec::encode_as(coding, &src, &mut enc));
            for rows in [1, 3, 36, 37, 80, 1000] {
                let calls = rows_of(&enc, cols * nrows, rows, cols).unwrap();
                let mut next = 0;
                let mut got = Vec::new();
                for (r0, v) in &calls {
                    assert_eq!(*r0, next, "{coding:?} {rows}: rows in order");
                    assert_eq!(v.len() % cols, 0);
                    assert!(v.len() / cols <= rows, "at most {rows} rows a call");
                    next += v.len() / cols;
                    got.extend_from_slice(v);
                }
                assert_eq!(got, want, "{coding:?} {rows}");
            }
        }
        // More than a segment of stored bytes: the reads carry a block over.
        let big = 5 * BLOCK_ELEMS * 16 + 3 * 7168;
        let src = weights(big - big % 7168, 9);
        let mut enc = Vec::new();
        codec::encode_as(Coding::Nibble, &src, &mut enc);
        assert!(enc.len() > HEAD_SEGMENT as usize);
        let calls = rows_of(&enc, src.len() / 2, 1024, 7168).unwrap();
        let got: Vec<u16> = calls.into_iter().flat_map(|(_, v)| v).collect();
        assert_eq!(got, u16s(&src));
    }

    #[test]
    fn a_corrupt_or_misfit_encoding_is_refused() {
        let (cols, nrows) = (7168, 40);
        let src = weights(cols * nrows, 3);
        let mut enc = Vec::new();
        codec::encode_as(Coding::Nibble, &src, &mut enc);
        let n = cols * nrows;
        let corrupt = |r: Result<Vec<(usize, Vec<u16>)>, RowsError<()>>| match r {
            Err(RowsError::Corrupt(reason)) => reason,
            other => panic!("not refused: {:?}", other.map(|c| c.len())),
        };
        // A payload byte flipped: the block's checksum.
        let mut bad = enc.clone();
        bad[codec::HEADER + 1000] ^= 0x10;
        assert!(corrupt(rows_of(&bad, n, 8, cols)).contains("checksum"));
        // A header whose payload runs past the end, or is impossible.
        let mut bad = enc.clone();
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(corrupt(rows_of(&bad, n, 8, cols)).contains("truncated"));
        // Truncated, one byte short; and a byte too many.
        assert!(!corrupt(rows_of(&enc[..enc.len() - 1], n, 8, cols)).is_empty());
        let mut long = enc.clone();
        long.extend_from_slice(&[0; 8]);
        assert!(corrupt(rows_of(&long, n, 8, cols)).contains("stored bytes"));
        // Values that are no whole rows; fewer values than the blocks hold.
        assert!(corrupt(rows_of(&enc, n, 8, cols + 1)).contains("whole rows"));
        assert!(!corrupt(rows_of(&enc, n - cols, 8, cols)).is_empty());
        // A read error is passed on as it is.
        let shape = RowShape {
            values: n,
            stored: enc.len(),
            rows: 8,
            cols,
        };
        let (mut e, mut d) = (Vec::new(), Vec::new());
        let r = decode_rows(shape, |_, _| Err("eio"), &mut e, &mut d, |_, _| {});
        assert!(matches!(r, Err(RowsError::Read("eio"))));
    }
}
