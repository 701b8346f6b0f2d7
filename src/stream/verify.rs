//! The reads of `k3 verify`: every shard read once from its first byte to its last in bounded
//! pieces (the SHA-256 of the whole file when asked, statistics over each tensor's span), and
//! a packed trunk compared byte for byte with the tensors it was packed from.
//!
//! Data buffers are at most two pieces of [`PIECE`] bytes whatever the model's size, and the
//! page cache is dropped behind every read. Problems are collected, never the first one only;
//! this module never prints.

use super::checkpoint::Checkpoint;
use super::index::TensorInfo;
use super::safetensors::Dtype;
use super::trunk::{Trunk, TrunkTensor};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Size of one read (and of each of the at most two data buffers).
pub const PIECE: usize = 16 << 20;

/// Problems kept in full; beyond this they are only counted.
pub const KEPT_PROBLEMS: usize = 1000;

/// Problems found so far: the first [`KEPT_PROBLEMS`] kept, all counted.
#[derive(Debug, Default)]
pub struct Problems {
    kept: Vec<String>,
    total: usize,
}

impl Problems {
    /// Record one problem.
    pub fn push(&mut self, p: String) {
        if self.kept.len() < KEPT_PROBLEMS {
            self.kept.push(p);
        }
        self.total += 1;
    }

    /// Problems recorded in all.
    #[must_use]
    pub fn total(&self) -> usize {
        self.total
    }

    /// The problems kept, in the order found.
    #[must_use]
    pub fn kept(&self) -> &[String] {
        &self.kept
    }
}

/// What every tensor's bytes held, summed over the checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorTotals {
    /// Tensors read.
    pub tensors: u64,
    /// Tensor bytes read.
    pub tensor_bytes: u64,
    /// Tensors whose every element is zero (±0 for floats, byte 0 for U8), among those the
    /// forward pass reads.
    pub all_zero: u64,
    /// All-zero tensors the forward pass never reads (not a problem).
    pub all_zero_unread: u64,
    /// F32/BF16/F16 tensors holding a NaN or an infinity.
    pub non_finite: u64,
    /// NaN and infinite values in all.
    pub non_finite_values: u64,
    /// MXFP4 scale tensors holding a scale byte of 255 (NaN in E8M0).
    pub nan_scale_tensors: u64,
    /// Scale bytes of 255 in all.
    pub nan_scales: u64,
}

/// One tensor's statistics, accumulated over pieces that may split an element.
struct Acc {
    dtype: Dtype,
    scale: bool,
    elements: u64,
    zeros: u64,
    nan: u64,
    inf: u64,
    nan_scales: u64,
    first_bad: Option<u64>,
    carry: [u8; 4],
    carry_len: usize,
}

impl Acc {
    fn new(name: &str, dtype: Dtype) -> Acc {
        Acc {
            dtype,
            scale: dtype == Dtype::U8 && name.ends_with("weight_scale"),
            elements: 0,
            zeros: 0,
            nan: 0,
            inf: 0,
            nan_scales: 0,
            first_bad: None,
            carry: [0; 4],
            carry_len: 0,
        }
    }

    fn feed(&mut self, mut b: &[u8]) {
        let w = usize::try_from(self.dtype.size()).unwrap_or(1).clamp(1, 4);
        if self.carry_len > 0 {
            let take = (w - self.carry_len).min(b.len());
            self.carry[self.carry_len..self.carry_len + take].copy_from_slice(&b[..take]);
            self.carry_len += take;
            b = &b[take..];
            if self.carry_len < w {
                return;
            }
            let c = self.carry;
            self.elements_of(&c[..w]);
            self.carry_len = 0;
        }
        let full = b.len() / w * w;
        self.elements_of(&b[..full]);
        let rest = &b[full..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carry_len = rest.len();
    }

    /// Classify one float: `exp` is the exponent mask, `abs` the mask without the sign.
    fn float(&mut self, bits: u32, exp: u32, abs: u32) {
        if bits & abs == 0 {
            self.zeros += 1;
        } else if bits & exp == exp {
            if bits & abs == exp {
                self.inf += 1;
            } else {
                self.nan += 1;
            }
            if self.first_bad.is_none() {
                self.first_bad = Some(self.elements);
            }
        }
        self.elements += 1;
    }

    fn elements_of(&mut self, b: &[u8]) {
        match self.dtype {
            Dtype::U8 => {
                self.elements += b.len() as u64;
                self.zeros += b.iter().filter(|&&x| x == 0).count() as u64;
                if self.scale {
                    let n = b.iter().filter(|&&x| x == 0xff).count() as u64;
                    if n > 0 && self.first_bad.is_none() {
                        let at = b.iter().position(|&x| x == 0xff).unwrap_or(0) as u64;
                        self.first_bad = Some(self.elements - b.len() as u64 + at);
                    }
                    self.nan_scales += n;
                }
            }
            Dtype::Bf16 => {
                for c in b.chunks_exact(2) {
                    self.float(u32::from(u16::from_le_bytes([c[0], c[1]])), 0x7f80, 0x7fff);
                }
            }
            Dtype::F16 => {
                for c in b.chunks_exact(2) {
                    self.float(u32::from(u16::from_le_bytes([c[0], c[1]])), 0x7c00, 0x7fff);
                }
            }
            Dtype::F32 => {
                for c in b.chunks_exact(4) {
                    self.float(
                        u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                        0x7f80_0000,
                        0x7fff_ffff,
                    );
                }
            }
        }
    }

    /// Add this tensor to `totals` and record what is wrong with it.
    fn finish(
        self,
        name: &str,
        info: &TensorInfo,
        unread: &dyn Fn(&str) -> bool,
        totals: &mut TensorTotals,
        p: &mut Problems,
    ) {
        totals.tensors += 1;
        let what = format!("tensor {name:?} ({} {:?})", info.dtype.name(), info.shape);
        if self.elements == 0 {
            return;
        }
        if self.zeros == self.elements && unread(name) {
            totals.all_zero_unread += 1;
        } else if self.zeros == self.elements {
            totals.all_zero += 1;
            p.push(format!(
                "{what} is all zeros (a preallocated or unfinished download?)"
            ));
        }
        if self.nan + self.inf > 0 {
            totals.non_finite += 1;
            totals.non_finite_values += self.nan + self.inf;
            p.push(format!(
                "{what} holds {} NaN and {} infinite value(s), the first at element {}",
                self.nan,
                self.inf,
                self.first_bad.unwrap_or(0)
            ));
        }
        if self.nan_scales > 0 {
            totals.nan_scale_tensors += 1;
            totals.nan_scales += self.nan_scales;
            p.push(format!(
                "{what} holds {} scale byte(s) of 255 (NaN scales in E8M0), the first at \
                 element {}",
                self.nan_scales,
                self.first_bad.unwrap_or(0)
            ));
        }
    }
}

/// Drop the page cache behind a read (a hint).
fn drop_behind(file: &File, at: u64, len: usize) {
    if let Some(n) = std::num::NonZeroU64::new(len as u64) {
        let _ = rustix::fs::fadvise(file, at, Some(n), rustix::fs::Advice::DontNeed);
    }
}

/// Every tensor of `ck` with its information, grouped by shard number (one pass over the
/// index).
#[must_use]
pub fn tensors_by_shard(ck: &Checkpoint) -> Vec<Vec<(String, TensorInfo)>> {
    let mut out = vec![Vec::new(); ck.index().shard_names().len()];
    for n in ck.index().names() {
        if let Some(i) = ck.info(&n) {
            if let Some(v) = out.get_mut(i.shard) {
                v.push((n, i));
            }
        }
    }
    out
}

/// Read shard number `shard` of `ck` once from start to end: the statistics of each of its
/// `tensors` go into `totals` and `p` (a tensor for which `unread` is true, one the forward
/// pass never reads, is not a problem for being all zeros); with `sha`, the SHA-256 of the
/// whole file is returned. `progress` gets the bytes of each piece read. An I/O error ends
/// this shard's scan with a problem.
#[allow(clippy::too_many_arguments)]
pub fn scan_shard(
    ck: &Checkpoint,
    shard: usize,
    mut tensors: Vec<(String, TensorInfo)>,
    unread: &dyn Fn(&str) -> bool,
    sha: bool,
    buf: &mut Vec<u8>,
    totals: &mut TensorTotals,
    p: &mut Problems,
    progress: &mut dyn FnMut(u64),
) -> Option<[u8; 32]> {
    let Some(path) = ck.shard_path(shard) else {
        p.push(format!("shard number {shard} is not in the checkpoint"));
        return None;
    };
    let shown = super::shown(path);
    tensors.sort_by_key(|(_, i)| i.offset);
    let file = match super::open_regular(path).map(|(f, _)| f) {
        Ok(f) => f,
        Err(e) => {
            p.push(format!("{shown}: cannot open: {e}"));
            return None;
        }
    };
    let len = match (file.metadata(), ck.shard_stat(shard)) {
        (Ok(now), Ok(then)) if now.len() == then.size => now.len(),
        (Ok(now), Ok(then)) => {
            p.push(format!(
                "{shown}: {} bytes now, {} bytes when the checkpoint was opened (changing \
                 while it is checked?)",
                now.len(),
                then.size
            ));
            return None;
        }
        (Err(e), _) | (_, Err(e)) => {
            p.push(format!("{shown}: cannot stat: {e}"));
            return None;
        }
    };
    let mut hasher = sha.then(Sha256::new);
    let mut ti = 0usize;
    let mut cur: Option<Acc> = None;
    let mut pos = 0u64;
    while pos < len {
        let take = usize::try_from(len - pos).unwrap_or(PIECE).min(PIECE);
        buf.clear();
        buf.resize(take, 0);
        if let Err(e) = file.read_exact_at(buf, pos) {
            p.push(format!(
                "{shown}: read error at byte {pos} ({take} bytes): {e}"
            ));
            return None;
        }
        drop_behind(&file, pos, take);
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[..]);
        }
        let end = pos + take as u64;
        while let Some((name, info)) = tensors.get(ti) {
            let (a, b) = (info.offset, info.offset + info.n_bytes());
            if a >= end && a != b {
                break;
            }
            let acc = cur.get_or_insert_with(|| Acc::new(name, info.dtype));
            let (lo, hi) = (a.max(pos), b.min(end));
            if lo < hi {
                acc.feed(&buf[(lo - pos) as usize..(hi - pos) as usize]);
            }
            if b > end {
                break;
            }
            if let Some(acc) = cur.take() {
                acc.finish(name, info, unread, totals, p);
            }
            totals.tensor_bytes += b - a;
            ti += 1;
        }
        progress(take as u64);
        pos = end;
    }
    for (name, info) in tensors.iter().skip(ti) {
        if info.n_bytes() == 0 {
            totals.tensors += 1;
        } else {
            p.push(format!(
                "{shown}: tensor {name:?} lies past the end of the file ({len} bytes)"
            ));
        }
    }
    hasher.map(|h| h.finalize().into())
}

/// SHA-256 of the file at `path`, read in pieces into `buf`.
pub fn sha256_file(path: &Path, buf: &mut Vec<u8>) -> std::io::Result<[u8; 32]> {
    use std::io::Read;
    let (mut file, _) = super::open_regular(path)?;
    let mut h = Sha256::new();
    buf.clear();
    buf.resize(PIECE, 0);
    loop {
        match file.read(buf) {
            Ok(0) => break,
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(h.finalize().into())
}

/// What comparing a trunk with its source found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrunkTotals {
    /// Layers compared.
    pub layers: u64,
    /// Whether the trunk's encoded output head was compared.
    pub head: bool,
    /// Bytes of `trunk.bin` read.
    pub trunk_bytes: u64,
    /// Tensors whose bytes differ from their source.
    pub differing_tensors: u64,
    /// Layers whose run checksum differs from the manifest's.
    pub bad_checksums: u64,
}

/// Read `len` bytes of `trunk.bin` at `at` into `buf`, feeding `run`.
fn trunk_piece(
    file: &File,
    at: u64,
    len: usize,
    buf: &mut Vec<u8>,
    run: &mut crc32fast::Hasher,
) -> std::io::Result<()> {
    buf.clear();
    buf.resize(len, 0);
    file.read_exact_at(buf, at)?;
    drop_behind(file, at, len);
    run.update(buf);
    Ok(())
}

/// Rows of the head compared at a time by [`compare_head`].
const HEAD_ROWS_BYTES: usize = 32 << 20;

/// Compare the encoded head `name` (tensor `t` of run `l`) with its source, decoding it rows at
/// a time (`trunk::decode_rows`) so neither it nor its source is held whole: its stored bytes
/// feed `run`, its source's `source`. Returns the stored bytes read and what differs, if
/// anything (a block that does not decode, or the first byte that differs).
#[allow(clippy::too_many_arguments)]
fn compare_head(
    ck: &Checkpoint,
    file: &File,
    l: &super::trunk::TrunkLayer,
    name: &str,
    t: &TrunkTensor,
    enc: &mut Vec<u8>,
    src: &mut Vec<u8>,
    run: &mut crc32fast::Hasher,
    source: &mut crc32fast::Hasher,
    progress: &mut dyn FnMut(u64),
) -> std::io::Result<(u64, Option<String>)> {
    use super::trunk::{decode_rows, RowShape, RowsError};
    let cols = t.shape.last().copied().unwrap_or(1).max(1);
    let stored = usize::try_from(t.stored).unwrap_or(usize::MAX);
    let base = l.file_off + t.off;
    let mut fed = 0usize;
    let read = |at: usize, area: &mut [u8]| -> std::io::Result<()> {
        file.read_exact_at(area, base + at as u64)?;
        drop_behind(file, base + at as u64, area.len());
        run.update(area);
        fed = at + area.len();
        Ok(())
    };
    let shape = RowShape {
        values: t.nbytes as usize / 2,
        stored,
        rows: (HEAD_ROWS_BYTES / (2 * cols)).max(1),
        cols,
    };
    let mut dec = Vec::new();
    let mut differs: Option<String> = None;
    let mut failed: Option<std::io::Error> = None;
    let got = decode_rows(shape, read, enc, &mut dec, |r0, rows| {
        if failed.is_some() {
            return;
        }
        let (at, len) = ((r0 * cols * 2) as u64, rows.len() * 2);
        if let Err(e) = ck.read_span(name, at, len as u64, src) {
            failed = Some(std::io::Error::other(e.to_string()));
            return;
        }
        source.update(src);
        progress(len as u64);
        if differs.is_none() {
            let dec_bytes = rows.iter().flat_map(|v| v.to_le_bytes());
            if let Some(i) = dec_bytes.zip(src.iter()).position(|(a, &b)| a != b) {
                differs = Some(format!(
                    "decodes to bytes that differ from its source at byte {}",
                    at + i as u64
                ));
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    // The stored bytes, once read (the rows gave their source's).
    progress(t.stored);
    let problem = match got {
        Ok(()) => differs,
        Err(RowsError::Read(e)) => return Err(e),
        Err(RowsError::Corrupt(why)) => {
            // The rest of its stored bytes still belong to the run's checksum.
            let mut at = fed;
            while at < stored {
                let take = (stored - at).min(PIECE);
                trunk_piece(file, base + at as u64, take, enc, run)?;
                at += take;
            }
            Some(format!("does not decode: {why}"))
        }
    };
    Ok((t.stored, problem))
}

/// Compare every tensor of `trunk` byte for byte with its source in `ck`, and recompute each
/// run's checksum (the layers' and the encoded head's) and source checksum against the
/// manifest.
///
/// Over 100 lines: one pass over the layers with the read buffers and report it shares.
pub fn compare_trunk(
    ck: &Checkpoint,
    trunk: &Trunk,
    bufs: (&mut Vec<u8>, &mut Vec<u8>),
    p: &mut Problems,
    progress: &mut dyn FnMut(u64),
) -> TrunkTotals {
    let (tb, sb) = bufs;
    let mut totals = TrunkTotals::default();
    let bin = trunk.dir().join("trunk.bin");
    let file = match super::open_regular(&bin).map(|(f, _)| f) {
        Ok(f) => f,
        Err(e) => {
            p.push(format!("{}: cannot open: {e}", super::shown(&bin)));
            return totals;
        }
    };
    let n_layers = trunk.manifest().n_layers;
    for l in trunk.manifest().runs() {
        let what = if l.layer < n_layers {
            format!("trunk layer {}", l.layer)
        } else {
            "trunk output head".to_string()
        };
        let mut run = crc32fast::Hasher::new();
        let mut source = crc32fast::Hasher::new();
        let mut order: Vec<(&String, &TrunkTensor)> = l.tensors.iter().collect();
        order.sort_by_key(|(_, t)| t.off);
        let mut at = 0u64;
        let result = (|| -> std::io::Result<()> {
            for (name, t) in order {
                // Padding before the tensor belongs to the run's checksum only.
                while at < t.off {
                    let take = usize::try_from(t.off - at).unwrap_or(PIECE).min(PIECE);
                    trunk_piece(&file, l.file_off + at, take, tb, &mut run)?;
                    at += take as u64;
                    totals.trunk_bytes += take as u64;
                }
                if t.is_encoded() && l.layer >= n_layers {
                    // The head: decoded rows at a time, never held whole.
                    let (read, problem) = compare_head(
                        ck,
                        &file,
                        l,
                        name,
                        t,
                        tb,
                        sb,
                        &mut run,
                        &mut source,
                        progress,
                    )?;
                    totals.trunk_bytes += read;
                    at = at.max(t.off + t.stored);
                    if let Some(why) = problem {
                        totals.differing_tensors += 1;
                        p.push(format!("{what}: tensor {name:?} {why}"));
                    }
                    continue;
                }
                if t.is_encoded() {
                    let stored = usize::try_from(t.stored).unwrap_or(usize::MAX);
                    trunk_piece(&file, l.file_off + t.off, stored, tb, &mut run)?;
                    totals.trunk_bytes += t.stored;
                    at = at.max(t.off + t.stored);
                    ck.read_span(name, 0, t.nbytes, sb)
                        .map_err(|e| std::io::Error::other(e.to_string()))?;
                    source.update(sb);
                    progress(t.stored + t.nbytes);
                    match super::codec::decode_to_vec(tb, sb.len()) {
                        Err(e) => {
                            totals.differing_tensors += 1;
                            p.push(format!(
                                "{what}: tensor {name:?} does not decode: {e} \
                                 (trunk.bin offset {})",
                                l.file_off + t.off
                            ));
                        }
                        Ok(dec) => {
                            if let Some(i) = dec.iter().zip(sb.iter()).position(|(a, b)| a != b) {
                                totals.differing_tensors += 1;
                                p.push(format!(
                                    "{what}: tensor {name:?} decodes to bytes that \
                                     differ from its source at byte {i}"
                                ));
                            }
                        }
                    }
                    continue;
                }
                let mut differs = false;
                let mut k = 0u64;
                while k < t.nbytes {
                    let take = usize::try_from(t.nbytes - k).unwrap_or(PIECE).min(PIECE);
                    trunk_piece(&file, l.file_off + t.off + k, take, tb, &mut run)?;
                    ck.read_span(name, k, take as u64, sb)
                        .map_err(|e| std::io::Error::other(e.to_string()))?;
                    source.update(sb);
                    if !differs {
                        if let Some(i) = tb.iter().zip(sb.iter()).position(|(a, b)| a != b) {
                            differs = true;
                            totals.differing_tensors += 1;
                            p.push(format!(
                                "{what}: tensor {name:?} differs from its source at \
                                 byte {} (trunk.bin offset {})",
                                k + i as u64,
                                l.file_off + t.off + k + i as u64
                            ));
                        }
                    }
                    k += take as u64;
                    totals.trunk_bytes += take as u64;
                    progress(2 * take as u64);
                }
                at = at.max(t.off + t.nbytes);
            }
            while at < l.nbytes {
                let take = usize::try_from(l.nbytes - at).unwrap_or(PIECE).min(PIECE);
                trunk_piece(&file, l.file_off + at, take, tb, &mut run)?;
                at += take as u64;
                totals.trunk_bytes += take as u64;
            }
            Ok(())
        })();
        if let Err(e) = result {
            p.push(format!("{what}: read error: {e}"));
            continue;
        }
        if l.layer < n_layers {
            totals.layers += 1;
        } else {
            totals.head = true;
        }
        let got = run.finalize();
        if got != l.crc32 {
            totals.bad_checksums += 1;
            p.push(format!(
                "{what}: trunk.bin checksum {got:08x}, the manifest says {:08x} \
                 (re-pack with `k3 pack --force`)",
                l.crc32
            ));
        }
        let got = source.finalize();
        if got != l.source_crc32 {
            p.push(format!(
                "{what}: the source tensors' checksum is {got:08x}, {:08x} when \
                 packed (the checkpoint changed since; re-pack with `k3 pack --force`)",
                l.source_crc32
            ));
        }
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Statistics do not depend on where the pieces split the elements.
    #[test]
    fn pieces_that_split_elements_give_the_same_statistics() {
        let mut bytes = Vec::new();
        for (i, v) in [1.5f32, 0.0, -0.0, f32::NAN, 2.0, f32::INFINITY, 0.0]
            .iter()
            .enumerate()
        {
            let v = if i == 6 { -3.0 } else { *v };
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        for step in [1usize, 3, 5, 28] {
            let mut acc = Acc::new("t", Dtype::F32);
            for c in bytes.chunks(step) {
                acc.feed(c);
            }
            assert_eq!(acc.elements, 7, "step {step}");
            assert_eq!(acc.zeros, 2, "step {step}");
            assert_eq!((acc.nan, acc.inf), (1, 1), "step {step}");
            assert_eq!(acc.first_bad, Some(3), "step {step}");
        }
        let mut acc = Acc::new("x.weight_scale", Dtype::U8);
        acc.feed(&[0, 127, 255]);
        acc.feed(&[255]);
        assert_eq!((acc.nan_scales, acc.first_bad, acc.zeros), (2, Some(2), 1));
    }
}
