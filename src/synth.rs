//! Synthetic checkpoints in the released format (`k3 synth`).
//!
//! A written directory holds what the released model ships, laid out the same way
//! (docs/model.md#configjson, docs/model.md#tensors-and-shards): a nested `config.json` (root → `text_config` → `linear_attn_config`,
//! both one-based layer lists, `quantization_config` mxfp4-pack-quantized with group size 32);
//! one safetensors shard per decoder layer (`model-NNNNN-of-MMMMMM.safetensors`, shard k holds
//! layer k−1) plus one for the five model-level tensors; `model.safetensors.index.json`; and a
//! tokenizer (`tiktoken.model` with the 256 single bytes in the GPT-2 order followed by merges,
//! `tokenizer_config.json` with the 16 named specials at the released offsets above the ranks).
//! Tensor names, shapes and dtypes are the released ones: BF16 matrices, norms and router gate;
//! F32 conv taps, `A_log` (padded with exact zeros to `head_dim`), `dt_bias`, KDA `o_norm` and the
//! router bias; MXFP4 routed experts (U8 packed nibbles + U8 E8M0 scales). Headers are compact
//! JSON padded with spaces to a multiple of 8, no `__metadata__`, tensors in the standard writer's
//! order (F32, then BF16, then U8, each by name).
//!
//! Weights are deterministic in the seed: every tensor (every MXFP4 matrix) draws from its own
//! splitmix64 stream keyed by the seed and its name, split into fixed chunks of [`CHUNK`]
//! elements with a stream each, so chunks are generated in parallel and the bytes do not depend
//! on the thread count. Draws are approximately normal (the sum of four 16-bit uniforms, scaled
//! to unit variance; bounded at ±3.46). Each matrix's standard deviation is `c / sqrt(fan_in)`
//! with a per-role `c` chosen so that activations keep the same magnitude at every width and
//! the fixture rules of docs/model.md#numerics hold: SiTU gate/up weights large enough that both caps
//! engage, a permuted router bias `linspace(-r, r)` that reorders the top-k (r = 0.15 at 8
//! experts, as the C fixtures, shrinking as `sqrt(8 / experts)` so that with many experts the
//! bias still changes most selections without piling the load onto the high-bias ones), `A_log`
//! spread `linspace(-0.4, 1.2)` over the heads with a zero tail, norm gains `1 ± 0.02`. MXFP4
//! experts are quantised with the rule of docs/model.md#mxfp4-experts: per 32-group `e = floor(log2(max|w|)) − 2`,
//! scale byte `e + 127`, each element the nearest E2M1 magnitude of `|w|/2^e` (ties to the
//! smaller code, above 6 saturating to 6), sign bit set for negatives.
//!
//! The `k3` shape has the released dimensions and is written **sparse**: every header (and the
//! index, config and tokenizer) is written for real, every data region is a hole made by
//! `set_len`, so the replica is header-true (same tensor count, header lengths and file sizes as
//! the release, shards 95/96 holding placeholder vision tensors) and takes about 150 MB of disk.
//!
//! Output is atomic: everything is written into a temporary directory beside `OUT_DIR` and
//! renamed into place (`stream::atomic::PendingDir`).

use crate::kernels::f32_to_bf16;
use crate::session::tokenizer::gpt2_byte_order;
use crate::stream::atomic::PendingDir;
use crate::stream::safetensors::Dtype;
use rayon::prelude::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

mod files;
mod random;
mod shards;
mod specs;

use files::*;
use random::*;
use shards::*;
use specs::*;

/// Elements per random stream: tensors are generated in chunks of this many elements, each
/// with its own stream (a multiple of 32, so an MXFP4 group never straddles two chunks).
pub const CHUNK: usize = 1 << 14;

/// Number of special-token slots after the BPE ranks.
const SPECIALS: usize = 256;

/// Tensors generated together before being written (bytes).
const BATCH_BYTES: u64 = 64 << 20;

/// The named special tokens: offset above the ranks, content, `special` flag (as released).
const NAMED_SPECIALS: [(usize, &str, bool); 16] = [
    (0, "[BOS]", true),
    (1, "[EOS]", true),
    (2, "<|end_of_msg|>", true),
    (3, "<|open|>", false),
    (4, "<|close|>", false),
    (5, "<|sep|>", false),
    (6, "[start_header_id]", true),
    (7, "[end_header_id]", true),
    (9, "[EOT]", true),
    (18, "<|media_begin|>", true),
    (19, "<|media_content|>", true),
    (20, "<|media_end|>", true),
    (21, "<|media_pad|>", true),
    (65, "<osagent_mode>", true),
    (254, "[UNK]", true),
    (255, "[PAD]", true),
];

/// File sizes of the released vision shards 95 and 96 (docs/model.md#tensors-and-shards).
const K3_VISION_SHARD_BYTES: [u64; 2] = [92_289_328, 802_448_352];

/// The shapes `k3 synth` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The oracle's shape (hidden 128, 13 layers, 8 experts): a few MB, seconds to write.
    Tiny,
    /// About 400 MB (hidden 512, 25 layers, 64 experts top-4), for tests.
    Small,
    /// About 6 GB (hidden 2048, 21 layers, 128 experts top-8), for benchmarks.
    Bench,
    /// The released dimensions, written as sparse files (a header-true replica).
    K3,
}

impl Shape {
    /// Every shape.
    pub const ALL: [Shape; 4] = [Shape::Tiny, Shape::Small, Shape::Bench, Shape::K3];

    /// The command-line name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Shape::Tiny => "tiny",
            Shape::Small => "small",
            Shape::Bench => "bench",
            Shape::K3 => "k3",
        }
    }

    /// The shape with this command-line name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|x| x.name() == s)
    }

    /// The model dimensions of this shape (over 100 lines: one table of values per shape).
    #[must_use]
    pub fn dims(self) -> Dims {
        match self {
            Shape::Tiny => Dims {
                hidden: 128,
                layers: 13,
                ranks: 256,
                rms_norm_eps: 1e-5,
                kda_heads: 4,
                kda_head_dim: 16,
                conv_kernel: 4,
                gate_lower_bound: -5.0,
                mla_heads: 4,
                q_lora: 64,
                kv_lora: 32,
                nope: 24,
                rope: 8,
                v_dim: 16,
                experts: 8,
                top_k: 2,
                shared: 2,
                latent: 64,
                expert_inter: 64,
                dense_inter: 96,
                block: 3,
                full_attn: vec![4, 8, 12, 13],
                sparse: false,
                cycle: None,
            },
            Shape::Small => Dims {
                hidden: 512,
                layers: 25,
                ranks: 3840,
                rms_norm_eps: 2e-6,
                kda_heads: 6,
                kda_head_dim: 64,
                conv_kernel: 4,
                gate_lower_bound: -5.0,
                mla_heads: 8,
                q_lora: 192,
                kv_lora: 128,
                nope: 64,
                rope: 32,
                v_dim: 48,
                experts: 64,
                top_k: 4,
                shared: 1,
                latent: 256,
                expert_inter: 448,
                dense_inter: 1536,
                block: 6,
                full_attn: k3_layer_map(25),
                sparse: false,
                cycle: None,
            },
            Shape::Bench => Dims {
                hidden: 2048,
                layers: 21,
                ranks: 32512,
                rms_norm_eps: 1e-5,
                kda_heads: 12,
                kda_head_dim: 128,
                conv_kernel: 4,
                gate_lower_bound: -5.0,
                mla_heads: 12,
                q_lora: 512,
                kv_lora: 256,
                nope: 128,
                rope: 64,
                v_dim: 128,
                experts: 128,
                top_k: 8,
                shared: 1,
                latent: 1024,
                expert_inter: 1152,
                dense_inter: 5632,
                block: 6,
                full_attn: k3_layer_map(21),
                sparse: false,
                cycle: None,
            },
            Shape::K3 => Dims {
                hidden: 7168,
                layers: 93,
                ranks: 163_584,
                rms_norm_eps: 1e-5,
                kda_heads: 96,
                kda_head_dim: 128,
                conv_kernel: 4,
                gate_lower_bound: -5.0,
                mla_heads: 96,
                q_lora: 1536,
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v_dim: 128,
                experts: 896,
                top_k: 16,
                shared: 2,
                latent: 3584,
                expert_inter: 3072,
                dense_inter: 33792,
                block: 12,
                full_attn: k3_layer_map(93),
                sparse: true,
                cycle: None,
            },
        }
    }
}

/// The K3 layer map for `n` layers: every 4th one-based layer is MLA, and so is the last.
fn k3_layer_map(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (4..n).step_by(4).collect();
    v.push(n);
    v
}

/// Dimensions of a synthetic model (the values that go into `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    /// Hidden width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// BPE ranks; the vocabulary is this plus 256 special ids.
    pub ranks: usize,
    /// Default RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// KDA heads.
    pub kda_heads: usize,
    /// KDA head dimension.
    pub kda_head_dim: usize,
    /// KDA short-convolution taps.
    pub conv_kernel: usize,
    /// KDA decay lower bound.
    pub gate_lower_bound: f64,
    /// MLA heads.
    pub mla_heads: usize,
    /// MLA query LoRA rank.
    pub q_lora: usize,
    /// MLA key/value latent rank.
    pub kv_lora: usize,
    /// MLA no-position dims per head.
    pub nope: usize,
    /// MLA "rope" dims per head.
    pub rope: usize,
    /// MLA value dims per head.
    pub v_dim: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Shared experts (fused into one MLP of width `shared × expert_inter`).
    pub shared: usize,
    /// Latent width of the routed experts.
    pub latent: usize,
    /// Routed-expert intermediate width.
    pub expert_inter: usize,
    /// Dense MLP (layer 0) intermediate width.
    pub dense_inter: usize,
    /// AttnRes block size.
    pub block: usize,
    /// One-based MLA layers (`full_attn_layers`).
    pub full_attn: Vec<usize>,
    /// Whether data regions are left as holes (the `k3` replica).
    pub sparse: bool,
    /// A checkpoint whose continuation repeats: every id continues with the next id of its
    /// cycle of this many ids ([`Dims::successor`]). The output head is the embedding with
    /// its rows permuted along the cycles, and the projections back into the residual stream
    /// are damped by [`CYCLE_DAMP`], so that the last position's hidden state is its own
    /// embedding to within a small error and the greedy choice is its successor. `None`: the
    /// ordinary random checkpoint.
    pub cycle: Option<usize>,
}

impl Dims {
    /// Vocabulary size (ranks + 256 specials).
    #[must_use]
    pub fn vocab(&self) -> usize {
        self.ranks + SPECIALS
    }

    /// Whether zero-based layer `l` is MLA.
    #[must_use]
    pub fn is_mla(&self, l: usize) -> bool {
        self.full_attn.contains(&(l + 1))
    }

    /// KDA projection width.
    #[must_use]
    pub fn kda_width(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }

    /// The id a cycled checkpoint continues `id` with: ids are cut into runs of
    /// `cycle` consecutive ids (the last run may be shorter), and each run is a cycle
    /// `a → a+1 → … → a+cycle−1 → a`. Without a cycle, `id` itself.
    #[must_use]
    pub fn successor(&self, id: usize) -> usize {
        self.cycle
            .map_or(id, |p| cycle_successor(id, p, self.vocab()))
    }

    /// The scale of a projection back into the residual stream (`c` as drawn, damped in a
    /// cycled checkpoint).
    fn out_scale(&self, c: f32) -> f32 {
        if self.cycle.is_some() {
            c * CYCLE_DAMP
        } else {
            c
        }
    }
}

/// [`Dims::successor`] for cycles of `cycle` ids in a vocabulary of `vocab`.
fn cycle_successor(id: usize, cycle: usize, vocab: usize) -> usize {
    let cycle = cycle.max(1);
    let start = id / cycle * cycle;
    let len = cycle.min(vocab - start);
    start + (id - start + 1) % len
}

/// How much a cycled checkpoint damps the projections back into the residual stream.
pub const CYCLE_DAMP: f32 = 1.0 / 1024.0;

/// What a finished write produced.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The shape written.
    pub shape: Shape,
    /// Its dimensions.
    pub dims: Dims,
    /// The seed.
    pub seed: u64,
    /// Shard files.
    pub shards: usize,
    /// Tensors over all shards.
    pub tensors: usize,
    /// Tensor data bytes over all shards (`metadata.total_size` of the index).
    pub tensor_bytes: u64,
    /// Sizes of all written files together.
    pub file_bytes: u64,
    /// Bytes the files occupy on disk (allocated blocks; far below `file_bytes` when sparse).
    pub disk_bytes: u64,
}

/// Why a synthetic checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// The output directory exists and is not empty (or is not a directory).
    #[error("{}: already exists and is not an empty directory; refusing to overwrite it", .path.display())]
    Exists {
        /// The output directory.
        path: PathBuf,
    },
    /// A file could not be created, written or renamed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl SynthError {
    /// Exit status: 2 for a refused output directory (usage), 1 for an I/O failure.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            SynthError::Exists { .. } => 2,
            SynthError::Io { .. } => 1,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Everything a shape writes, into `dir` (which exists and is empty).
fn write_into(
    shape: Shape,
    d: &Dims,
    dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<Summary, SynthError> {
    let n = shard_count(d);
    let files: Vec<String> = (1..=n).map(|k| shard_name(k, n)).collect();
    // Sizes first (headers are cheap to build), so the progress total is exact.
    let mut total = 0u64;
    let mut tensor_bytes = 0u64;
    for (k, file) in files.iter().enumerate() {
        let sh = build_shard(d, k).map_err(|m| SynthError::Io {
            path: dir.join(file),
            source: std::io::Error::other(m),
        })?;
        total += 8 + sh.header.len() as u64 + if d.sparse { 0 } else { sh.data_bytes };
        tensor_bytes += sh.data_bytes;
    }
    progress(0, total);
    let mut done = 0u64;
    let mut names: Vec<(String, u16)> = Vec::new();
    // Generation (rayon) overlaps with writing and syncing (one writer thread, at most two
    // batches queued).
    let (tx, rx) = std::sync::mpsc::sync_channel::<Msg>(2);
    let (generated, written) = std::thread::scope(|scope| {
        let w = scope.spawn(move || writer(&rx));
        let generated = (|| {
            for (k, file) in files.iter().enumerate() {
                let sh = build_shard(d, k).map_err(|m| SynthError::Io {
                    path: dir.join(file),
                    source: std::io::Error::other(m),
                })?;
                let ok = send_shard(&tx, dir.join(file), &sh, seed, d.sparse, |b| {
                    done += b;
                    progress(done, total);
                });
                if !ok {
                    break;
                }
                names.extend(sh.specs.into_iter().map(|s| (s.name, k as u16)));
            }
            Ok(())
        })();
        drop(tx);
        let written = w.join().unwrap_or_else(|_| {
            Err(SynthError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::other("the writer thread panicked"),
            })
        });
        (generated, written)
    });
    generated?;
    written?;
    let tensors = names.len();
    write_index(dir, &mut names, &files, tensor_bytes)?;
    drop(names);
    write_file(
        &dir.join("config.json"),
        &pretty(&config_json(shape, d, seed)),
    )?;
    write_file(
        &dir.join("tiktoken.model"),
        tiktoken_model(&rank_table(d.ranks)).as_bytes(),
    )?;
    write_file(
        &dir.join("tokenizer_config.json"),
        &pretty(&tokenizer_config(d.ranks)),
    )?;
    let (mut file_bytes, mut disk_bytes) = (0u64, 0u64);
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        let m = e.metadata().map_err(io_err(&e.path()))?;
        file_bytes += m.len();
        disk_bytes += std::os::unix::fs::MetadataExt::blocks(&m) * 512;
    }
    Ok(Summary {
        shape,
        dims: d.clone(),
        seed,
        shards: n,
        tensors,
        tensor_bytes,
        file_bytes,
        disk_bytes,
    })
}

/// Write a synthetic checkpoint of `shape` to `out_dir` (which must not exist, or be an empty
/// directory). `progress(done, total)` is called with bytes written as the write advances.
pub fn write(
    shape: Shape,
    out_dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<Summary, SynthError> {
    write_dims(shape, &shape.dims(), out_dir, seed, progress)
}

/// [`write`] with the dimensions of `shape` changed (a cycled checkpoint: [`Dims::cycle`]).
pub fn write_dims(
    shape: Shape,
    d: &Dims,
    out_dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<Summary, SynthError> {
    let exists = |p: &Path| SynthError::Exists {
        path: p.to_path_buf(),
    };
    match std::fs::symlink_metadata(out_dir) {
        Ok(m) if m.is_dir() => {
            let mut it = std::fs::read_dir(out_dir).map_err(io_err(out_dir))?;
            if it.next().is_some() {
                return Err(exists(out_dir));
            }
        }
        Ok(_) => return Err(exists(out_dir)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(out_dir)(e)),
    }
    if out_dir.file_name().is_none() {
        return Err(exists(out_dir));
    }
    if let Some(parent) = out_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let tmp = PendingDir::new(out_dir).map_err(io_err(out_dir))?;
    let summary = write_into(shape, d, tmp.path(), seed, progress)?;
    tmp.commit().map_err(io_err(out_dir))?;
    Ok(summary)
}

/// The tensors of a synthetic checkpoint drawn on request, one at a time, as [`write`]
/// draws them: for the sparse `k3` replica, whose data regions are holes, the bytes a
/// written-out replica would hold (what `benches/released_trunk.rs` encodes). A layer's
/// tensor list is built once, on the first request for one of its tensors.
pub struct Draws {
    dims: Dims,
    seed: u64,
    layer: Option<(usize, Vec<Spec>)>,
    model: Vec<Spec>,
}

impl Draws {
    /// The draws of a checkpoint with dimensions `d` written with `seed`.
    #[must_use]
    pub fn new(d: &Dims, seed: u64) -> Draws {
        Draws {
            dims: d.clone(),
            seed,
            layer: None,
            model: model_specs(d),
        }
    }

    /// The bytes of the tensor `name` (for an MXFP4 matrix, of the half it names); `None`
    /// when the checkpoint has no such tensor (nor the vision placeholders, which are zeros).
    pub fn tensor(&mut self, name: &str) -> Option<Vec<u8>> {
        let specs = match crate::stream::layer_tensor(name) {
            Some((il, _)) if il < self.dims.layers => {
                if self.layer.as_ref().is_none_or(|(l, _)| *l != il) {
                    self.layer = Some((il, layer_specs(&self.dims, il)));
                }
                &self.layer.as_ref()?.1
            }
            _ => &self.model,
        };
        let at = specs.iter().position(|s| s.name == name)?;
        let s = &specs[at];
        if !matches!(s.init, Init::Mx { .. }) {
            return Some(gen_dense(self.seed, s));
        }
        // The two halves of an MXFP4 matrix are drawn together.
        let stem = (s.name.strip_suffix(".weight_packed"))
            .or_else(|| s.name.strip_suffix(".weight_scale"))?;
        let find = |suffix: &str| specs.iter().find(|t| t.name == format!("{stem}{suffix}"));
        let (packed, scale) = gen_mx(self.seed, find(".weight_packed")?, find(".weight_scale")?);
        Some(if s.name.ends_with(".weight_packed") {
            packed
        } else {
            scale
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::mxfp4::E2M1;

    #[test]
    fn a_cycled_head_is_the_embedding_with_each_row_moved_to_its_successor() {
        let mut d = Shape::Tiny.dims();
        d.cycle = Some(24);
        // Runs of 24 ids, each a cycle; 512 ids leave a last run of 8.
        assert_eq!(
            (d.successor(0), d.successor(23), d.successor(24)),
            (1, 0, 25)
        );
        assert_eq!(
            (d.successor(503), d.successor(504), d.successor(511)),
            (480, 505, 504)
        );
        let mut hit = vec![false; d.vocab()];
        for id in 0..d.vocab() {
            let s = d.successor(id);
            assert!(!hit[s], "{s} is the successor of two ids");
            hit[s] = true;
        }
        let specs = model_specs(&d);
        let find = |suffix: &str| specs.iter().find(|s| s.name.ends_with(suffix)).unwrap();
        let embed = gen_dense(7, find("embed_tokens.weight"));
        let head = gen_dense(7, find("lm_head.weight"));
        let row = d.hidden * 2;
        for id in 0..d.vocab() {
            let to = d.successor(id);
            assert_eq!(
                head[to * row..(to + 1) * row],
                embed[id * row..(id + 1) * row],
                "row {to}"
            );
        }
        // The projections into the residual stream are damped, the others are not.
        let std = |specs: &[Spec], name: &str| match specs.iter().find(|s| s.name.ends_with(name)) {
            Some(Spec {
                init: Init::Normal { std, .. },
                ..
            }) => *std,
            _ => panic!("{name}"),
        };
        let plain = layer_specs(&Shape::Tiny.dims(), 2);
        let damped = layer_specs(&d, 2);
        for name in [
            "self_attn.o_proj.weight",
            "shared_experts.down_proj.weight",
            "routed_expert_up_proj.weight",
        ] {
            assert_eq!(std(&damped, name), std(&plain, name) * CYCLE_DAMP, "{name}");
        }
        assert_eq!(
            std(&damped, "self_attn.q_proj.weight"),
            std(&plain, "self_attn.q_proj.weight")
        );
    }

    #[test]
    fn quantisation_rule() {
        // max 1.0 → e = −2, so elements are coded in units of 0.25.
        let mut w = [0f32; 32];
        w[0] = 1.0; // 4 units → code 6 (4.0)
        w[1] = -0.0625; // 0.25 units: a tie between 0 and 0.5 → the smaller, with the sign
        w[2] = 0.07; // 0.28 units → 0.5 (code 1)
        w[3] = 0.3125; // 1.25 units: tie between 1 and 1.5 → 1 (code 2)
        w[4] = 0.9; // 3.6 units → 4 (code 6)
        w[5] = -0.875; // 3.5 units: tie between 3 and 4 → 3 (code 5), negative
        let mut p = [0u8; 16];
        let s = quantise_group(&w, &mut p);
        assert_eq!(s, 125);
        assert_eq!(p[0], 6 | (8 << 4));
        assert_eq!(p[1], 1 | (2 << 4));
        assert_eq!(p[2], 6 | (13 << 4));
        // Saturation: max 1.99 → e = −2, 7.96 units → 6.
        let mut w = [0.1f32; 32];
        w[31] = 1.99;
        let s = quantise_group(&w, &mut p);
        assert_eq!(s, 125);
        assert_eq!(p[15] >> 4, 7);
        assert_eq!(E2M1[7], 6.0);
    }

    #[test]
    fn normal_draws_have_unit_variance() {
        let mut r = Rng(7);
        let n = 200_000;
        let v: Vec<f64> = (0..n / 2)
            .flat_map(|_| r.normal2())
            .map(f64::from)
            .collect();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.01, "{var}");
    }

    #[test]
    fn k3_headers_match_the_release() {
        let d = Shape::K3.dims();
        // docs/model.md#tensors-and-shards: header lengths and file sizes of the released shards.
        for (k, header, file) in [
            (0, 2_920, 2_341_216_112u64),
            (1, 818_696, 16_990_911_504),
            (3, 817_608, 16_567_501_776),
            (10, 824_104, 16_990_916_912),
            (11, 823_008, 16_567_507_176),
            (93, 576, 4_697_664_072),
        ] {
            let sh = build_shard(&d, k).unwrap();
            assert_eq!(sh.header.len(), header, "shard {}", k + 1);
            assert_eq!(sh.file_bytes(), file, "shard {}", k + 1);
        }
        let sizes: Vec<u64> = (0..shard_count(&d))
            .map(|k| build_shard(&d, k).unwrap().file_bytes())
            .collect();
        assert_eq!(sizes.len(), 96);
        assert_eq!(sizes[94], 92_289_328);
        assert_eq!(sizes[95], 802_448_352);
        assert_eq!(sizes.iter().sum::<u64>(), 1_560_936_091_448);
    }

    #[test]
    fn rank_table_is_unique_and_starts_with_bytes() {
        let t = rank_table(4000);
        assert_eq!(t.len(), 4000);
        let set: HashSet<&Vec<u8>> = t.iter().collect();
        assert_eq!(set.len(), 4000);
        assert_eq!(t[0], b"!");
        assert!(t[256..].iter().all(|x| x.len() >= 2));
    }

    #[test]
    fn shapes_respect_the_fixture_lessons() {
        for s in Shape::ALL {
            let d = s.dims();
            assert_ne!(d.kv_lora, d.nope, "{s:?}");
            assert_ne!(2 * d.expert_inter, d.latent, "{s:?}");
            assert_ne!(d.hidden, d.dense_inter, "{s:?}");
            assert_ne!(d.hidden, d.kda_width(), "{s:?}");
            assert!(d.latent % 32 == 0 && d.expert_inter % 32 == 0, "{s:?}");
            assert!(d.is_mla(d.layers - 1) && !d.is_mla(0), "{s:?}");
        }
    }
}
