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
//! Output is atomic: everything is written into `OUT_DIR.tmp-<pid>` and renamed into place.

use crate::kernels::f32_to_bf16;
use crate::session::tokenizer::gpt2_byte_order;
use crate::stream::safetensors::Dtype;
use rayon::prelude::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

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

// ------------------------------------------------------------------------------------ random

/// splitmix64 finaliser.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 generator.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Two approximately standard normal draws from one 64-bit output: each is the sum of four
    /// 8-bit uniforms, centred and scaled to unit variance (Irwin–Hall with n = 4; bounded at
    /// ±3.46, steps of 0.0068). Pure integer and float arithmetic: the same on every platform.
    #[inline]
    fn normal2(&mut self) -> [f32; 2] {
        const M: u64 = 0x00ff_00ff_00ff_00ff;
        let r = self.next_u64();
        // Four 16-bit lanes of byte-pair sums, then two 32-bit lanes of four-byte sums.
        let p = (r & M) + ((r >> 8) & M);
        let q = (p & 0x0000_ffff_0000_ffff) + ((p >> 16) & 0x0000_ffff_0000_ffff);
        // Each uniform is (x + 0.5) / 256, so a sum is (s + 2) / 256 with mean 2, variance 1/3.
        let z = |s: u64| ((s as f32 + 2.0) * (1.0 / 256.0) - 2.0) * 1.732_050_8;
        [z(q & 0xffff_ffff), z(q >> 32)]
    }

    /// Uniform in 0..n (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// FNV-1a over a name.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The stream key of a tensor (or MXFP4 matrix) under a seed.
fn tensor_key(seed: u64, name: &str) -> u64 {
    mix64(mix64(seed ^ 0x6b33_5f73_796e_7468) ^ fnv1a(name))
}

/// The generator of chunk `k` of a tensor.
fn chunk_rng(key: u64, k: usize) -> Rng {
    Rng(mix64(
        key ^ (k as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
    ))
}

// ------------------------------------------------------------------------------------ MXFP4

/// Quantise one group of 32 values with the rule of docs/model.md#mxfp4-experts; writes 16 packed bytes
/// (low nibble = even element) and returns the scale byte.
pub fn quantise_group(w: &[f32; 32], packed: &mut [u8]) -> u8 {
    let max = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    // floor(log2(max)) of a normal float is its unbiased exponent.
    let e = if max > 0.0 {
        ((max.to_bits() >> 23) & 0xff) as i32 - 127 - 2
    } else {
        0
    };
    let e = e.clamp(-126, 127);
    // 1/2^e exactly (1 ≤ 127 − e ≤ 253).
    let inv = f32::from_bits(((127 - e) as u32) << 23);
    let code = |x: f32| -> u8 {
        let a = x.abs() * inv;
        // Nearest E2M1 magnitude, ties to the smaller code; above 6 saturates to 6 (code 7).
        let m = u8::from(a > 0.25)
            + u8::from(a > 0.75)
            + u8::from(a > 1.25)
            + u8::from(a > 1.75)
            + u8::from(a > 2.5)
            + u8::from(a > 3.5)
            + u8::from(a > 5.0);
        m | if x < 0.0 { 8 } else { 0 }
    };
    for (j, byte) in packed.iter_mut().take(16).enumerate() {
        *byte = code(w[2 * j]) | (code(w[2 * j + 1]) << 4);
    }
    (e + 127) as u8
}

// ------------------------------------------------------------------------------------ tensors

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// `mean + std·z`.
    Normal { mean: f32, std: f32 },
    /// Row-split normal: elements before `at` use `std`, the rest `std2`.
    Split { at: u64, std: f32, std2: f32 },
    /// Norm gain `1 + 0.02·z`.
    Gain,
    /// `linspace(-r, r, n)` in a seeded random order, r = 0.15·sqrt(8/n) (at most 0.15).
    RouterBias,
    /// `linspace(-0.4, 1.2, heads)` followed by exact zeros.
    ALog { heads: usize },
    /// One half of an MXFP4 matrix drawn as `std·z` and quantised.
    Mx { std: f32 },
    /// Zeros (placeholder tensors; never generated for the sparse replica).
    Zero,
    /// The output head of a cycled checkpoint: row `j` is the embedding row of the id that
    /// `j` succeeds ([`Dims::successor`]), so the head scores each id's successor highest.
    CycledHead { cycle: usize },
}

/// One tensor of a shard.
#[derive(Clone, Debug)]
struct Spec {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    init: Init,
}

impl Spec {
    fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size()
    }
}

/// Output-scale coefficients: a matrix's std is `c / sqrt(fan_in)`.
mod scale {
    /// Ordinary projections (q/k/v, output, down/up projections).
    pub const PROJ: f32 = 0.226;
    /// Sigmoid output gates (`g_proj`).
    pub const GATE: f32 = 1.0;
    /// MLA `q_a_proj` and the latent rows of `kv_a_proj_with_mqa` (normalised right after).
    pub const LORA_A: f32 = 0.0226;
    /// The shared "rope" key rows of `kv_a_proj_with_mqa` (never normalised).
    pub const ROPE_KEY: f32 = 3.4;
    /// `q_b_proj`.
    pub const Q_B: f32 = 2.4;
    /// `kv_b_proj`.
    pub const KV_B: f32 = 1.7;
    /// KDA decay low-rank down (`f_a_proj`).
    pub const F_A: f32 = 1.13;
    /// KDA decay low-rank up (`f_b_proj`).
    pub const F_B: f32 = 0.8;
    /// KDA β logits (`b_proj`).
    pub const BETA: f32 = 2.26;
    /// Router logits.
    pub const ROUTER: f32 = 1.13;
    /// `routed_expert_down_proj`.
    pub const LATENT_DOWN: f32 = 0.9;
    /// Routed-expert gate/up (w1, w3): both SiTU caps engage.
    pub const EXPERT_GATE_UP: f32 = 9.6;
    /// Dense and shared-expert gate/up.
    pub const DENSE_GATE_UP: f32 = 13.6;
    /// Routed-expert down (w2).
    pub const EXPERT_DOWN: f32 = 0.3;
    /// AttnRes score vectors (`*_res_proj`).
    pub const RES_PROJ: f32 = 0.5;
    /// Output head.
    pub const LM_HEAD: f32 = 1.0;
    /// Embedding rows (absolute std).
    pub const EMBED_STD: f32 = 1.0;
    /// Conv taps (absolute std).
    pub const CONV_STD: f32 = 0.4;
}

/// Collects the tensors of one group (a layer or the model-level set).
struct Builder {
    prefix: String,
    out: Vec<Spec>,
}

impl Builder {
    fn new(prefix: String) -> Self {
        Builder {
            prefix,
            out: Vec::new(),
        }
    }

    fn push(&mut self, rest: &str, dtype: Dtype, shape: &[usize], init: Init) {
        self.out.push(Spec {
            name: format!("{}{rest}", self.prefix),
            dtype,
            shape: shape.iter().map(|&d| d as u64).collect(),
            init,
        });
    }

    /// A BF16 `[rows, cols]` matrix with std `c / sqrt(cols)`.
    fn mat(&mut self, rest: &str, rows: usize, cols: usize, c: f32) {
        let std = c / (cols as f32).sqrt();
        self.push(
            rest,
            Dtype::Bf16,
            &[rows, cols],
            Init::Normal { mean: 0.0, std },
        );
    }

    fn gain(&mut self, rest: &str, n: usize, dtype: Dtype) {
        self.push(rest, dtype, &[n], Init::Gain);
    }

    /// An MXFP4 matrix with logical shape `[rows, cols]`: `prefix.weight_packed` and
    /// `prefix.weight_scale`.
    fn mx(&mut self, rest: &str, rows: usize, cols: usize, c: f32) {
        let init = Init::Mx {
            std: c / (cols as f32).sqrt(),
        };
        self.push(
            &format!("{rest}.weight_packed"),
            Dtype::U8,
            &[rows, cols / 2],
            init,
        );
        self.push(
            &format!("{rest}.weight_scale"),
            Dtype::U8,
            &[rows, cols / 32],
            init,
        );
    }
}

/// Every tensor of decoder layer `l` (over 100 lines: the released tensor list, one entry
/// per tensor).
fn layer_specs(d: &Dims, l: usize) -> Vec<Spec> {
    let h = d.hidden;
    let mut b = Builder::new(format!("language_model.model.layers.{l}."));
    b.gain("input_layernorm.weight", h, Dtype::Bf16);
    b.gain("post_attention_layernorm.weight", h, Dtype::Bf16);
    b.gain("self_attention_res_norm.weight", h, Dtype::Bf16);
    b.mat("self_attention_res_proj.weight", 1, h, scale::RES_PROJ);
    b.gain("mlp_res_norm.weight", h, Dtype::Bf16);
    b.mat("mlp_res_proj.weight", 1, h, scale::RES_PROJ);
    if d.is_mla(l) {
        let mh = d.mla_heads;
        b.mat("self_attn.q_a_proj.weight", d.q_lora, h, scale::LORA_A);
        b.gain("self_attn.q_a_layernorm.weight", d.q_lora, Dtype::Bf16);
        b.mat(
            "self_attn.q_b_proj.weight",
            mh * (d.nope + d.rope),
            d.q_lora,
            scale::Q_B,
        );
        let fan = (h as f32).sqrt();
        b.push(
            "self_attn.kv_a_proj_with_mqa.weight",
            Dtype::Bf16,
            &[d.kv_lora + d.rope, h],
            Init::Split {
                at: (d.kv_lora * h) as u64,
                std: scale::LORA_A / fan,
                std2: scale::ROPE_KEY / fan,
            },
        );
        b.gain("self_attn.kv_a_layernorm.weight", d.kv_lora, Dtype::Bf16);
        b.mat(
            "self_attn.kv_b_proj.weight",
            mh * (d.nope + d.v_dim),
            d.kv_lora,
            scale::KV_B,
        );
        b.mat("self_attn.g_proj.weight", mh * d.v_dim, h, scale::GATE);
        b.mat(
            "self_attn.o_proj.weight",
            h,
            mh * d.v_dim,
            d.out_scale(scale::PROJ),
        );
    } else {
        let (p, dk, k) = (d.kda_width(), d.kda_head_dim, d.conv_kernel);
        for x in ["q", "k", "v"] {
            b.mat(&format!("self_attn.{x}_proj.weight"), p, h, scale::PROJ);
            b.push(
                &format!("self_attn.{x}_conv1d.weight"),
                Dtype::F32,
                &[p, 1, k],
                Init::Normal {
                    mean: 0.0,
                    std: scale::CONV_STD,
                },
            );
        }
        b.mat("self_attn.f_a_proj.weight", dk, h, scale::F_A);
        b.mat("self_attn.f_b_proj.weight", p, dk, scale::F_B);
        b.push(
            "self_attn.A_log",
            Dtype::F32,
            &[dk],
            Init::ALog { heads: d.kda_heads },
        );
        b.push(
            "self_attn.dt_bias",
            Dtype::F32,
            &[p],
            Init::Normal {
                mean: -2.0,
                std: 0.5,
            },
        );
        b.mat("self_attn.b_proj.weight", d.kda_heads, h, scale::BETA);
        b.mat("self_attn.g_proj.weight", p, h, scale::GATE);
        b.gain("self_attn.o_norm.weight", dk, Dtype::F32);
        b.mat("self_attn.o_proj.weight", h, p, d.out_scale(scale::PROJ));
    }
    if l == 0 {
        let di = d.dense_inter;
        b.mat("mlp.gate_proj.weight", di, h, scale::DENSE_GATE_UP);
        b.mat("mlp.up_proj.weight", di, h, scale::DENSE_GATE_UP);
        b.mat("mlp.down_proj.weight", h, di, d.out_scale(scale::PROJ));
    } else {
        let (lat, inter, sh) = (d.latent, d.expert_inter, d.shared * d.expert_inter);
        b.mat("block_sparse_moe.gate.weight", d.experts, h, scale::ROUTER);
        b.push(
            "block_sparse_moe.gate.e_score_correction_bias",
            Dtype::F32,
            &[d.experts],
            Init::RouterBias,
        );
        b.mat(
            "block_sparse_moe.routed_expert_down_proj.weight",
            lat,
            h,
            scale::LATENT_DOWN,
        );
        b.gain(
            "block_sparse_moe.routed_expert_norm.weight",
            lat,
            Dtype::Bf16,
        );
        b.mat(
            "block_sparse_moe.routed_expert_up_proj.weight",
            h,
            lat,
            d.out_scale(scale::PROJ),
        );
        b.mat(
            "block_sparse_moe.shared_experts.gate_proj.weight",
            sh,
            h,
            scale::DENSE_GATE_UP,
        );
        b.mat(
            "block_sparse_moe.shared_experts.up_proj.weight",
            sh,
            h,
            scale::DENSE_GATE_UP,
        );
        b.mat(
            "block_sparse_moe.shared_experts.down_proj.weight",
            h,
            sh,
            d.out_scale(scale::PROJ),
        );
        for e in 0..d.experts {
            let p = format!("block_sparse_moe.experts.{e}.");
            b.mx(&format!("{p}w1"), inter, lat, scale::EXPERT_GATE_UP);
            b.mx(&format!("{p}w2"), lat, inter, scale::EXPERT_DOWN);
            b.mx(&format!("{p}w3"), inter, lat, scale::EXPERT_GATE_UP);
        }
    }
    b.out
}

/// The five model-level tensors.
fn model_specs(d: &Dims) -> Vec<Spec> {
    let (h, v) = (d.hidden, d.vocab());
    let mut b = Builder::new("language_model.".into());
    b.push(
        "model.embed_tokens.weight",
        Dtype::Bf16,
        &[v, h],
        Init::Normal {
            mean: 0.0,
            std: scale::EMBED_STD,
        },
    );
    if let Some(cycle) = d.cycle {
        b.push(
            "lm_head.weight",
            Dtype::Bf16,
            &[v, h],
            Init::CycledHead { cycle },
        );
    } else {
        b.mat("lm_head.weight", v, h, scale::LM_HEAD);
    }
    b.gain("model.norm.weight", h, Dtype::Bf16);
    b.gain("model.output_attn_res_norm.weight", h, Dtype::Bf16);
    b.mat("model.output_attn_res_proj.weight", 1, h, scale::RES_PROJ);
    b.out
}

/// Placeholder vision tensors for released shards 95 (projector) and 96 (tower): 5 + 163 = 168
/// tensors, the last of each sized so that the file has the released size.
fn vision_specs(which: usize) -> (Vec<Spec>, String) {
    let mut b = Builder::new(String::new());
    let z = Init::Zero;
    if which == 0 {
        b.push("mm_projector.pre_norm.weight", Dtype::Bf16, &[4096], z);
        b.push("mm_projector.pre_norm.bias", Dtype::Bf16, &[4096], z);
        b.push("mm_projector.proj.0.weight", Dtype::Bf16, &[4096, 4096], z);
        b.push("mm_projector.proj.0.bias", Dtype::Bf16, &[4096], z);
        (b.out, "mm_projector.proj.2.weight".into())
    } else {
        for i in 0..27 {
            let p = format!("vision_tower.encoder.blocks.{i}.");
            b.push(&format!("{p}norm0.weight"), Dtype::Bf16, &[1024], z);
            b.push(&format!("{p}norm1.weight"), Dtype::Bf16, &[1024], z);
            b.push(&format!("{p}wqkv.weight"), Dtype::Bf16, &[3072, 1024], z);
            b.push(&format!("{p}wo.weight"), Dtype::Bf16, &[1024, 1024], z);
            b.push(&format!("{p}mlp.fc0.weight"), Dtype::Bf16, &[4096, 1024], z);
            b.push(&format!("{p}mlp.fc1.weight"), Dtype::Bf16, &[1024, 4096], z);
        }
        (b.out, "vision_tower.patch_embed.pos_emb.weight".into())
    }
}

// ------------------------------------------------------------------------------------ shards

fn dtype_rank(d: Dtype) -> u8 {
    match d {
        Dtype::F32 => 0,
        Dtype::Bf16 | Dtype::F16 => 1,
        Dtype::U8 => 2,
    }
}

/// Sort into the standard writer's order: F32, then BF16, then U8, each by name.
fn sort_specs(specs: &mut [Spec]) {
    specs.sort_by(|a, b| (dtype_rank(a.dtype), &a.name).cmp(&(dtype_rank(b.dtype), &b.name)));
}

/// The compact header JSON of sorted `specs`, padded with spaces to a multiple of 8.
fn header_json(specs: &[Spec]) -> Vec<u8> {
    let mut s = String::with_capacity(specs.len() * 120 + 2);
    s.push('{');
    let mut off = 0u64;
    for (i, t) in specs.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let end = off + t.bytes();
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        // Names are plain ASCII; serde_json escapes anything else correctly.
        let name = serde_json::to_string(&t.name).unwrap_or_default();
        s.push_str(&format!(
            "{name}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            t.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    s.push('}');
    while !s.len().is_multiple_of(8) {
        s.push(' ');
    }
    s.into_bytes()
}

/// One shard ready to write.
struct Shard {
    specs: Vec<Spec>,
    header: Vec<u8>,
    data_bytes: u64,
}

impl Shard {
    fn new(mut specs: Vec<Spec>) -> Shard {
        sort_specs(&mut specs);
        let header = header_json(&specs);
        let data_bytes = specs.iter().map(Spec::bytes).sum();
        Shard {
            specs,
            header,
            data_bytes,
        }
    }

    fn file_bytes(&self) -> u64 {
        8 + self.header.len() as u64 + self.data_bytes
    }

    /// A placeholder shard whose last (1-D BF16) tensor is sized so that the file is exactly
    /// `target` bytes.
    fn sized(fixed: Vec<Spec>, filler: &str, target: u64) -> Option<Shard> {
        let mut n = 1u64;
        for _ in 0..16 {
            let mut specs = fixed.clone();
            specs.push(Spec {
                name: filler.to_string(),
                dtype: Dtype::Bf16,
                shape: vec![n],
                init: Init::Zero,
            });
            let s = Shard::new(specs);
            if s.file_bytes() == target {
                return Some(s);
            }
            let rest = s.data_bytes - 2 * n;
            let room = target.checked_sub(8 + s.header.len() as u64 + rest)?;
            if room < 2 || room % 2 != 0 {
                return None;
            }
            n = room / 2;
        }
        None
    }
}

/// Shard file name in the released spelling (five digits, then six).
fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:06}.safetensors")
}

/// Number of shard files of a shape.
fn shard_count(d: &Dims) -> usize {
    d.layers + 1 + if d.sparse { 2 } else { 0 }
}

/// Shard `k` (zero-based) of a shape.
fn build_shard(d: &Dims, k: usize) -> Result<Shard, String> {
    if k < d.layers {
        Ok(Shard::new(layer_specs(d, k)))
    } else if k == d.layers {
        Ok(Shard::new(model_specs(d)))
    } else {
        let which = k - d.layers - 1;
        let (fixed, filler) = vision_specs(which);
        Shard::sized(fixed, &filler, K3_VISION_SHARD_BYTES[which])
            .ok_or_else(|| "cannot size the vision placeholder shard".to_string())
    }
}

// ------------------------------------------------------------------------------------ data

/// A unit of generation: one tensor, or both halves of an MXFP4 matrix.
enum Item<'a> {
    One(&'a Spec),
    Pair(&'a Spec, &'a Spec),
}

impl Item<'_> {
    fn bytes(&self) -> u64 {
        match self {
            Item::One(s) => s.bytes(),
            Item::Pair(a, b) => a.bytes() + b.bytes(),
        }
    }
}

fn items(specs: &[Spec]) -> Vec<Item<'_>> {
    let mut out = Vec::with_capacity(specs.len());
    let mut i = 0;
    while i < specs.len() {
        let s = &specs[i];
        let pair = matches!(s.init, Init::Mx { .. })
            && s.name.ends_with(".weight_packed")
            && specs.get(i + 1).is_some_and(|t| {
                t.name.strip_suffix(".weight_scale") == s.name.strip_suffix(".weight_packed")
            });
        if pair {
            out.push(Item::Pair(s, &specs[i + 1]));
            i += 2;
        } else {
            out.push(Item::One(s));
            i += 1;
        }
    }
    out
}

/// Bytes of a non-MXFP4 tensor.
fn gen_dense(seed: u64, s: &Spec) -> Vec<u8> {
    let n = s.numel() as usize;
    let es = s.dtype.size() as usize;
    let key = tensor_key(seed, &s.name);
    let mut out = vec![0u8; n * es];
    let put = |o: &mut [u8], v: f32| match s.dtype {
        Dtype::F32 => o.copy_from_slice(&v.to_le_bytes()),
        Dtype::Bf16 | Dtype::F16 => o.copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
        Dtype::U8 => o[0] = 0,
    };
    match s.init {
        Init::RouterBias | Init::ALog { .. } => {
            let vals: Vec<f32> = match s.init {
                Init::RouterBias => {
                    let r = 0.15 * (8.0 / n.max(1) as f64).sqrt().min(1.0);
                    let mut v = linspace(-r, r, n);
                    let mut r = chunk_rng(key, 0);
                    for i in (1..n).rev() {
                        v.swap(i, r.below(i + 1));
                    }
                    v
                }
                Init::ALog { heads } => {
                    let mut v = linspace(-0.4, 1.2, heads.min(n));
                    v.resize(n, 0.0);
                    v
                }
                _ => Vec::new(),
            };
            for (o, v) in out.chunks_exact_mut(es).zip(vals) {
                put(o, v);
            }
        }
        Init::CycledHead { cycle } => {
            let (v, h) = (s.shape[0] as usize, s.shape[1] as usize);
            let embed = Spec {
                name: s
                    .name
                    .replace("lm_head.weight", "model.embed_tokens.weight"),
                dtype: s.dtype,
                shape: s.shape.clone(),
                init: Init::Normal {
                    mean: 0.0,
                    std: scale::EMBED_STD,
                },
            };
            let rows = gen_dense(seed, &embed);
            let row = h * es;
            for from in 0..v {
                let to = cycle_successor(from, cycle, v);
                out[to * row..(to + 1) * row].copy_from_slice(&rows[from * row..(from + 1) * row]);
            }
        }
        Init::Zero | Init::Mx { .. } => {}
        Init::Normal { .. } | Init::Split { .. } | Init::Gain => {
            out.par_chunks_mut(CHUNK * es)
                .enumerate()
                .for_each(|(k, buf)| {
                    let mut r = chunk_rng(key, k);
                    let base = (k * CHUNK) as u64;
                    let mut spare: Option<f32> = None;
                    for (j, o) in buf.chunks_exact_mut(es).enumerate() {
                        let z = spare.take().unwrap_or_else(|| {
                            let [a, b] = r.normal2();
                            spare = Some(b);
                            a
                        });
                        let v = match s.init {
                            Init::Normal { mean, std } => mean + std * z,
                            Init::Split { at, std, std2 } => {
                                if base + (j as u64) < at {
                                    std * z
                                } else {
                                    std2 * z
                                }
                            }
                            _ => 1.0 + 0.02 * z,
                        };
                        put(o, v);
                    }
                });
        }
    }
    out
}

fn linspace(lo: f64, hi: f64, n: usize) -> Vec<f32> {
    match n {
        0 => Vec::new(),
        1 => vec![lo as f32],
        _ => (0..n)
            .map(|i| (lo + (hi - lo) * i as f64 / (n - 1) as f64) as f32)
            .collect(),
    }
}

/// Packed and scale bytes of an MXFP4 matrix (`packed` names the pair's stream).
fn gen_mx(seed: u64, packed: &Spec, scale_spec: &Spec) -> (Vec<u8>, Vec<u8>) {
    let std = match packed.init {
        Init::Mx { std } => std,
        _ => 0.0,
    };
    let prefix = packed
        .name
        .strip_suffix(".weight_packed")
        .unwrap_or(&packed.name);
    let key = tensor_key(seed, prefix);
    let mut p = vec![0u8; packed.bytes() as usize];
    let mut s = vec![0u8; scale_spec.bytes() as usize];
    p.par_chunks_mut(CHUNK / 2)
        .zip(s.par_chunks_mut(CHUNK / 32))
        .enumerate()
        .for_each(|(k, (pc, sc))| {
            let mut r = chunk_rng(key, k);
            let mut w = [0f32; 32];
            for (g, sb) in sc.iter_mut().enumerate() {
                for pair in w.chunks_exact_mut(2) {
                    let [a, b] = r.normal2();
                    pair[0] = std * a;
                    pair[1] = std * b;
                }
                *sb = quantise_group(&w, &mut pc[16 * g..16 * g + 16]);
            }
        });
    (p, s)
}

fn gen_item(seed: u64, it: &Item) -> Vec<Vec<u8>> {
    match it {
        Item::One(s) => vec![gen_dense(seed, s)],
        Item::Pair(a, b) => {
            let (p, s) = gen_mx(seed, a, b);
            vec![p, s]
        }
    }
}

/// What the generating thread hands the writer thread.
enum Msg {
    /// Create this file; later bytes go into it.
    Open(PathBuf),
    /// Append these buffers.
    Bytes(Vec<Vec<u8>>),
    /// Finish the file: extend it to this length (a hole) if given, then sync it.
    Close(Option<u64>),
}

/// The writer thread: performs the file operations in order; stops at the first failure (the
/// generating side then sees its channel closed and collects this error).
fn writer(rx: &std::sync::mpsc::Receiver<Msg>) -> Result<(), SynthError> {
    let mut cur: Option<(PathBuf, BufWriter<File>)> = None;
    for m in rx {
        match m {
            Msg::Open(path) => {
                let f = File::create(&path).map_err(io_err(&path))?;
                cur = Some((path, BufWriter::with_capacity(4 << 20, f)));
            }
            Msg::Bytes(bufs) => {
                if let Some((path, w)) = cur.as_mut() {
                    for b in &bufs {
                        w.write_all(b).map_err(io_err(path))?;
                    }
                }
            }
            Msg::Close(len) => {
                if let Some((path, w)) = cur.take() {
                    let f = w.into_inner().map_err(|e| SynthError::Io {
                        path: path.clone(),
                        source: e.into_error(),
                    })?;
                    if let Some(len) = len {
                        f.set_len(len).map_err(io_err(&path))?;
                    }
                    f.sync_all().map_err(io_err(&path))?;
                }
            }
        }
    }
    Ok(())
}

/// Generate one shard (header, then data, or a hole when sparse) and queue it for the writer.
/// Returns false when the writer has stopped (its error is collected by the caller).
fn send_shard(
    tx: &std::sync::mpsc::SyncSender<Msg>,
    path: PathBuf,
    sh: &Shard,
    seed: u64,
    sparse: bool,
    mut advance: impl FnMut(u64),
) -> bool {
    let mut head = (sh.header.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&sh.header);
    let head_len = head.len() as u64;
    if tx.send(Msg::Open(path)).is_err() || tx.send(Msg::Bytes(vec![head])).is_err() {
        return false;
    }
    advance(head_len);
    if !sparse {
        let all = items(&sh.specs);
        let mut rest: &[Item] = &all;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0;
            while take < rest.len() && (take == 0 || bytes + rest[take].bytes() <= BATCH_BYTES) {
                bytes += rest[take].bytes();
                take += 1;
            }
            let (batch, tail) = rest.split_at(take);
            let bufs: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|it| gen_item(seed, it))
                .collect::<Vec<_>>()
                .into_iter()
                .flatten()
                .collect();
            if tx.send(Msg::Bytes(bufs)).is_err() {
                return false;
            }
            advance(bytes);
            rest = tail;
        }
    }
    tx.send(Msg::Close(sparse.then(|| sh.file_bytes()))).is_ok()
}

// ------------------------------------------------------------------------------------ tokenizer

/// Rank table: the 256 single bytes, then `n − 256` merges that build lower-case words (with
/// and without a leading space) from earlier tokens, so that English-like text merges.
/// Fixed (independent of the weight seed).
fn rank_table(n: usize) -> Vec<Vec<u8>> {
    let mut ranks: Vec<Vec<u8>> = gpt2_byte_order().into_iter().map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = ranks.iter().cloned().collect();
    let mut words: Vec<Vec<u8>> = b"etaoinshrdlcumwfgypbvkjxqz"
        .iter()
        .map(|&c| vec![c])
        .collect();
    let mut spaced: Vec<Vec<u8>> = Vec::new();
    let mut r = Rng(0x6b33_746f_6b65_6e73);
    let mut misses = 0u32;
    while ranks.len() < n {
        // Favour early (frequent) tokens, unless candidates keep colliding.
        let pick = |r: &mut Rng, len: usize| {
            let a = r.below(len);
            if misses > 64 {
                a
            } else {
                a.min(r.below(len))
            }
        };
        let cand: Vec<u8> = match r.below(4) {
            0 => {
                let w = &words[pick(&mut r, words.len())];
                [b" ".as_slice(), w].concat()
            }
            1 if !spaced.is_empty() => {
                let a = &spaced[pick(&mut r, spaced.len())];
                let b = &words[pick(&mut r, words.len())];
                [a.as_slice(), b].concat()
            }
            _ => {
                let a = &words[pick(&mut r, words.len())];
                let b = &words[pick(&mut r, words.len())];
                [a.as_slice(), b].concat()
            }
        };
        if cand.len() > 12 || seen.contains(&cand) {
            misses += 1;
            continue;
        }
        misses = 0;
        seen.insert(cand.clone());
        if cand[0] == b' ' {
            spaced.push(cand.clone());
        } else {
            words.push(cand.clone());
        }
        ranks.push(cand);
    }
    ranks.truncate(n);
    ranks
}

fn tiktoken_model(ranks: &[Vec<u8>]) -> String {
    use base64::Engine as _;
    let mut s = String::with_capacity(ranks.len() * 24);
    for (i, t) in ranks.iter().enumerate() {
        s.push_str(&base64::engine::general_purpose::STANDARD.encode(t));
        s.push(' ');
        s.push_str(&i.to_string());
        s.push('\n');
    }
    s
}

fn tokenizer_config(n: usize) -> Value {
    let mut dec = serde_json::Map::new();
    for (off, content, special) in NAMED_SPECIALS {
        dec.insert(
            (n + off).to_string(),
            json!({
                "content": content, "lstrip": false, "normalized": false, "rstrip": false,
                "single_word": false, "special": special,
            }),
        );
    }
    json!({
        "added_tokens_decoder": dec,
        "auto_map": { "AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null] },
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1_048_576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    })
}

// ------------------------------------------------------------------------------------ config

/// The nested `config.json` of a shape (docs/model.md#configjson); over 100 lines because it
/// is the document itself.
#[must_use]
pub fn config_json(shape: Shape, d: &Dims, seed: u64) -> Value {
    let n = d.ranks;
    let (bos, eos, pad, media) = (n, n + 2, n + 255, n + 21);
    let kda_layers: Vec<usize> = (1..=d.layers).filter(|l| !d.is_mla(l - 1)).collect();
    let quant = json!({
        "config_groups": { "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": null,
            "output_activations": null,
            "targets": ["Linear"],
            "weights": {
                "actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": true,
                "type": "float", "zp_dtype": null,
            },
        }},
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": null,
        "ignore": [
            "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    });
    let text = json!({
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": d.block,
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": d.hidden,
        "intermediate_size": d.dense_inter,
        "kv_lora_rank": d.kv_lora,
        "latent_moe_use_norm": true,
        "linear_attn_config": {
            "full_attn_layers": d.full_attn,
            "gate_lower_bound": d.gate_lower_bound,
            "head_dim": d.kda_head_dim,
            "kda_layers": kda_layers,
            "num_heads": d.kda_heads,
            "short_conv_kernel_size": d.conv_kernel,
            "use_full_rank_gate": true,
        },
        "max_position_embeddings": 1_048_576,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "model_type": "kimi_linear",
        "moe_intermediate_size": d.expert_inter,
        "moe_layer_freq": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": d.mla_heads,
        "num_expert_group": 1,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.mla_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": d.shared,
        "pad_token_id": pad,
        "q_lora_rank": d.q_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "quantization_config": quant,
        "rms_norm_eps": d.rms_norm_eps,
        "routed_expert_hidden_size": d.latent,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": true,
        "use_grouped_topk": true,
        "v_head_dim": d.v_dim,
        "vocab_size": d.vocab(),
    });
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "k3_synth": { "shape": shape.name(), "seed": seed, "version": 1 },
        "media_placeholder_token_id": media,
        "model_type": "kimi_k3",
        "pad_token_id": pad,
        "text_config": text,
        "tie_word_embeddings": false,
        "vision_config": {
            "merge_kernel_size": [2, 2],
            "mm_hidden_size": 1024,
            "mm_projector_type": "patchmergerv2",
            "patch_size": 14,
            "text_hidden_size": d.hidden,
            "vt_hidden_size": 1024,
            "vt_intermediate_size": 4096,
            "vt_num_attention_heads": 16,
            "vt_num_hidden_layers": 27,
        },
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), SynthError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn pretty(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s.into_bytes()
}

/// The HF index: `metadata.total_size` and a name-sorted `weight_map` (indent 2).
fn write_index(
    dir: &Path,
    names: &mut [(String, u16)],
    files: &[String],
    total: u64,
) -> Result<(), SynthError> {
    names.sort_unstable();
    let path = dir.join("model.safetensors.index.json");
    let f = File::create(&path).map_err(io_err(&path))?;
    let mut w = BufWriter::with_capacity(4 << 20, f);
    let mut body = format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": {total}\n  }},\n  \"weight_map\": {{\n"
    );
    for (i, (name, k)) in names.iter().enumerate() {
        let sep = if i + 1 < names.len() { "," } else { "" };
        let key = serde_json::to_string(name).unwrap_or_default();
        body.push_str(&format!("    {key}: \"{}\"{sep}\n", files[usize::from(*k)]));
        if body.len() > (1 << 20) {
            w.write_all(body.as_bytes()).map_err(io_err(&path))?;
            body.clear();
        }
    }
    body.push_str("  }\n}\n");
    w.write_all(body.as_bytes()).map_err(io_err(&path))?;
    let f = w.into_inner().map_err(|e| SynthError::Io {
        path: path.clone(),
        source: e.into_error(),
    })?;
    f.sync_all().map_err(io_err(&path))
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

/// The temporary directory a write goes into: `OUT_DIR.tmp-<pid>` beside `out_dir`.
#[must_use]
pub fn temp_dir_for(out_dir: &Path) -> PathBuf {
    let mut name = out_dir
        .file_name()
        .map(|s| s.to_os_string())
        .unwrap_or_else(|| "synth".into());
    name.push(format!(".tmp-{}", std::process::id()));
    out_dir.with_file_name(name)
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
    let tmp = temp_dir_for(out_dir);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = write_into(shape, d, &tmp, seed, progress).and_then(|s| {
        std::fs::rename(&tmp, out_dir).map_err(io_err(out_dir))?;
        if let Some(parent) = out_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(f) = File::open(parent) {
                // Best effort: make the rename durable.
                let _ = f.sync_all();
            }
        }
        Ok(s)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
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
