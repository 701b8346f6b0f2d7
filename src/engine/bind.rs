//! Binding a checkpoint to the model graph: one table maps (layer, role) to tensor names, every
//! tensor is requested with the shape the config implies, and tensors nobody claims under
//! `language_model.` are refused. All problems are collected and reported together.

use super::config::{list_problems, ModelConfig, ProblemList};
use super::kda::KdaWeights;
use super::layer::{Attention, FeedForward, Layer};
use super::mla::MlaWeights;
use super::moe::{DenseMlp, Expert, MoeWeights};
use super::tensor::{Dense, DenseData, Matrix, Mxfp4};
use crate::stream::budget::ModelSizes;
use crate::stream::bytes::{Bytes, U16s};
use crate::stream::trunk::{LayerRun, Trunk};
use crate::stream::{Checkpoint, Dtype, StreamError, TensorData};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The checkpoint's tensors do not fit the graph the config describes.
#[derive(Debug, thiserror::Error)]
#[error("{dir}: the checkpoint does not match config.json ({} problem(s)):\n  - {}",
    .problems.total(), list_problems(&.problems.list, .problems.more))]
pub struct BindError {
    /// Model directory.
    pub dir: PathBuf,
    /// Missing, mis-shaped, mistyped or unclaimed tensors (the first few listed, all counted).
    pub problems: ProblemList,
}

impl BindError {
    /// A refusal with one problem.
    pub(crate) fn one(dir: &Path, problem: &str) -> Self {
        let mut problems = ProblemList::default();
        problems.push(problem.to_string());
        BindError {
            dir: dir.to_path_buf(),
            problems,
        }
    }
}

/// Tensor names of the released checkpoint.
pub mod names {
    /// Prefix of every decoder-layer tensor.
    #[must_use]
    pub fn layer(il: usize, rest: &str) -> String {
        format!("language_model.model.layers.{il}.{rest}")
    }
    /// Embedding.
    pub const EMBED: &str = "language_model.model.embed_tokens.weight";
    /// Output head (no `.model.`).
    pub const LM_HEAD: &str = "language_model.lm_head.weight";
    /// Final norm.
    pub const NORM: &str = "language_model.model.norm.weight";
    /// Output AttnRes norm.
    pub const OUT_RES_NORM: &str = "language_model.model.output_attn_res_norm.weight";
    /// Output AttnRes projection.
    pub const OUT_RES_PROJ: &str = "language_model.model.output_attn_res_proj.weight";

    /// Tensors a checkpoint of this configuration holds that the forward pass never reads
    /// (their values cannot change a token): the pre-attention mix of a layer that has no
    /// block before it (see [`crate::engine::ModelConfig::mixes_before_attention`]).
    #[must_use]
    pub fn unread(cfg: &crate::engine::ModelConfig) -> Vec<String> {
        (0..cfg.num_hidden_layers)
            .filter(|&il| !cfg.mixes_before_attention(il))
            .flat_map(|il| {
                [
                    layer(il, "self_attention_res_norm.weight"),
                    layer(il, "self_attention_res_proj.weight"),
                ]
            })
            .collect()
    }
}

pub(crate) struct Binder<'a> {
    ck: &'a Checkpoint,
    claimed: HashSet<String>,
    pub(crate) problems: ProblemList,
    /// Read tensor data (else only check names, shapes and dtypes).
    read: bool,
    /// Bind routed experts with their layer (else they are fetched on demand).
    experts: bool,
    /// A packed trunk to read layers' non-expert tensors from, and the layer run read from it.
    trunk: Option<&'a Trunk>,
    run: Option<LayerRun>,
    /// Keep the trunk's nibble-coded matrices as stored, to be multiplied coded: the layers'
    /// and the output head's (where the trunk holds it encoded).
    coded: (bool, bool),
    /// Take tensors from read-only mappings of the shards instead of reading them.
    mapped: bool,
    /// The names fetched, in order (the layout of a layer read into a ring slot).
    pub(crate) order: Vec<String>,
}

impl<'a> Binder<'a> {
    pub(crate) fn new(ck: &'a Checkpoint, read: bool, experts: bool) -> Self {
        Binder {
            ck,
            claimed: HashSet::new(),
            problems: ProblemList::default(),
            read,
            experts,
            trunk: None,
            run: None,
            coded: (false, false),
            mapped: false,
            order: Vec::new(),
        }
    }

    /// Take the next layer's tensors from `run` (already read) instead of reading them.
    pub(crate) fn with_run(mut self, run: LayerRun) -> Self {
        self.run = Some(run);
        self
    }

    /// Take tensors in place from mappings of the shards (resident weights).
    pub(crate) fn mapped(mut self, on: bool) -> Self {
        self.mapped = on;
        self
    }

    /// Read layers' non-expert tensors from `trunk` (when reading).
    pub(crate) fn with_trunk(mut self, trunk: Option<&'a Trunk>) -> Self {
        self.trunk = trunk;
        self
    }

    /// Keep the trunk's nibble-coded matrices coded (when reading from a trunk): the layers'
    /// where `layers`, the output head's where `head`.
    pub(crate) fn coded(mut self, layers: bool, head: bool) -> Self {
        self.coded = (layers, head);
        self
    }

    /// Start binding layer `il`: with a trunk, its run is read in one pass.
    fn enter_layer(&mut self, il: usize) -> Result<(), StreamError> {
        if self.run.as_ref().is_some_and(|r| r.layer() == il) {
            return Ok(());
        }
        self.run = match self.trunk {
            Some(t) if self.read => Some(t.read_layer(il, self.coded.0)?),
            _ => None,
        };
        Ok(())
    }

    /// Problems found so far, as an error.
    pub(crate) fn into_result(self) -> Result<(), BindError> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(BindError {
                dir: self.ck.dir().to_path_buf(),
                problems: self.problems,
            })
        }
    }
}

/// A tensor as [`Binder::fetch_as`] read it.
enum Fetched {
    /// Its values.
    Data(TensorData),
    /// A matrix held coded.
    Coded(crate::stream::trunk::CodedMatrix),
}

impl Binder<'_> {
    /// Look up `name`, check it has one of `shapes` and an allowed dtype, and read it (a
    /// matrix the run holds coded, decoded).
    fn fetch(
        &mut self,
        name: &str,
        shapes: &[&[usize]],
        dtypes: &[Dtype],
    ) -> Result<Option<TensorData>, StreamError> {
        Ok(self.fetch_as(name, shapes, dtypes)?.map(|f| match f {
            Fetched::Data(d) => d,
            Fetched::Coded(m) => TensorData::Bf16(m.decode()),
        }))
    }

    /// [`Binder::fetch`], a matrix the run holds coded kept so.
    fn fetch_as(
        &mut self,
        name: &str,
        shapes: &[&[usize]],
        dtypes: &[Dtype],
    ) -> Result<Option<Fetched>, StreamError> {
        if self.claimed.insert(name.to_string()) {
            self.order.push(name.to_string());
        }
        let Some(info) = self.ck.info(name) else {
            self.problems.push(format!(
                "missing tensor {name} (expected shape {:?})",
                shapes[0]
            ));
            return Ok(None);
        };
        if !shapes.contains(&info.shape.as_slice()) {
            self.problems.push(format!(
                "tensor {name}: shape {:?}, expected {:?}",
                info.shape, shapes[0]
            ));
            return Ok(None);
        }
        if !dtypes.contains(&info.dtype) {
            let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            self.problems.push(format!(
                "tensor {name}: dtype {}, expected {}",
                info.dtype.name(),
                want.join(" or ")
            ));
            return Ok(None);
        }
        if !self.read {
            return Ok(Some(Fetched::Data(match info.dtype {
                Dtype::Bf16 => TensorData::Bf16(U16s::from_vec(&[])),
                Dtype::U8 => TensorData::U8(Bytes::default()),
                Dtype::F32 | Dtype::F16 => TensorData::F32(Vec::new()),
            })));
        }
        if let Some(t) = self
            .trunk
            .filter(|_| self.coded.1 && name == names::LM_HEAD)
        {
            if let Some(m) = t.read_head_coded()? {
                return Ok(Some(Fetched::Coded(m)));
            }
        }
        if let Some(run) = self.run.as_mut() {
            if let Some(m) = run.take_coded(name) {
                return Ok(Some(Fetched::Coded(m)));
            }
            if let Some((dtype, raw)) = run.take(name) {
                return Ok(Some(Fetched::Data(TensorData::from_bytes(dtype, raw))));
            }
        }
        Ok(Some(Fetched::Data(
            self.ck.read_maybe_mapped(name, self.mapped)?.1,
        )))
    }

    fn dense(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Dense>, StreamError> {
        Ok(
            match self.fetch_as(name, &[&[rows, cols]], &[Dtype::Bf16, Dtype::F32])? {
                Some(Fetched::Coded(m)) => Some(Dense {
                    data: DenseData::Coded(Box::new(m)),
                    rows,
                    cols,
                }),
                Some(Fetched::Data(TensorData::Bf16(v))) => Some(Dense {
                    data: DenseData::Bf16(v),
                    rows,
                    cols,
                }),
                Some(Fetched::Data(TensorData::F32(v))) => Some(Dense {
                    data: DenseData::F32(v),
                    rows,
                    cols,
                }),
                _ => None,
            },
        )
    }

    /// A small vector stored as `[n]` or `[1, n]`, F32 or BF16 (widened to f32). F16 is refused:
    /// no role of the checkpoint is F16 (docs/model.md), so an F16 label is a relabelled tensor.
    pub(crate) fn vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>, StreamError> {
        Ok(
            match self.fetch(name, &[&[n], &[1, n]], &[Dtype::F32, Dtype::Bf16])? {
                Some(TensorData::F32(v)) => Some(v),
                Some(TensorData::Bf16(v)) => {
                    Some(v.iter().map(|&b| crate::kernels::bf16_to_f32(b)).collect())
                }
                _ => None,
            },
        )
    }

    fn conv(&mut self, name: &str, c: usize, k: usize) -> Result<Option<Vec<f32>>, StreamError> {
        Ok(
            match self.fetch(name, &[&[c, 1, k], &[c, k]], &[Dtype::F32, Dtype::Bf16])? {
                Some(TensorData::F32(v)) => Some(v),
                Some(TensorData::Bf16(v)) => {
                    Some(v.iter().map(|&b| crate::kernels::bf16_to_f32(b)).collect())
                }
                _ => None,
            },
        )
    }

    /// `A_log`: `[heads]`, or padded to `[head_dim]` with an exactly-zero tail.
    fn a_log(
        &mut self,
        name: &str,
        heads: usize,
        head_dim: usize,
    ) -> Result<Option<Vec<f32>>, StreamError> {
        let Some(len) = self.ck.info(name).map(|i| i.numel()) else {
            // Both shapes are accepted: name both, not only the unpadded one.
            self.claimed.insert(name.to_string());
            self.problems.push(format!(
                "missing tensor {name} (expected shape [{heads}], or [{head_dim}] with a zero \
                 tail after the first {heads} values)"
            ));
            return Ok(None);
        };
        let want = if len == heads { heads } else { head_dim };
        if want < heads {
            // Padding to head_dim cannot hold more heads than head_dim.
            self.problems.push(format!(
                "tensor {name:?}: {len} values for {heads} heads (head_dim {head_dim})"
            ));
            return Ok(None);
        }
        let Some(v) = self.vector(name, want)? else {
            return Ok(None);
        };
        if !self.read {
            return Ok(Some(v));
        }
        if v[heads..].iter().any(|&x| x != 0.0) {
            self.problems.push(format!(
                "tensor {name}: padding after the first {heads} values must be exactly zero"
            ));
            return Ok(None);
        }
        Ok(Some(v[..heads].to_vec()))
    }

    fn mxfp4(
        &mut self,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Matrix>, StreamError> {
        let pk = format!("{prefix}.weight_packed");
        let sc = format!("{prefix}.weight_scale");
        if !cols.is_multiple_of(32) {
            self.problems.push(format!(
                "{prefix}: logical width {cols} is not a multiple of 32"
            ));
            return Ok(None);
        }
        let (same_shard, p_info) = match (self.ck.info(&pk), self.ck.info(&sc)) {
            (Some(a), Some(b)) => (a.shard == b.shard, Some((a, b))),
            _ => (true, None),
        };
        if let Some((a, b)) = &p_info {
            if a.shape.len() == 2 && b.shape.len() == 2 && b.shape[1] * 32 != a.shape[1] * 2 {
                self.problems.push(format!(
                    "{prefix}: {} scale columns for {} packed columns: the group size is not 32",
                    b.shape[1], a.shape[1]
                ));
            }
        }
        if !same_shard {
            self.problems.push(format!(
                "{prefix}: packed and scale tensors are in different shards"
            ));
        }
        let packed = self.fetch(&pk, &[&[rows, cols / 2]], &[Dtype::U8])?;
        let scales = self.fetch(&sc, &[&[rows, cols / 32]], &[Dtype::U8])?;
        Ok(match (packed, scales) {
            (Some(TensorData::U8(packed)), Some(TensorData::U8(scales))) => {
                Some(Matrix::Mxfp4(Mxfp4 {
                    packed,
                    scales,
                    rows,
                    cols,
                }))
            }
            _ => None,
        })
    }

    pub(crate) fn fold(
        &mut self,
        norm: &str,
        proj: &str,
        n: usize,
    ) -> Result<Option<Vec<f32>>, StreamError> {
        let a = self.vector(norm, n)?;
        let b = self.vector(proj, n)?;
        Ok(a.zip(b)
            .map(|(a, b)| a.iter().zip(&b).map(|(x, y)| x * y).collect()))
    }
}

fn bind_kda(
    b: &mut Binder,
    cfg: &ModelConfig,
    il: usize,
) -> Result<Option<KdaWeights>, StreamError> {
    let (dm, p, dk, h, k) = (
        cfg.hidden_size,
        cfg.kda_width(),
        cfg.kda_head_dim,
        cfg.kda_num_heads,
        cfg.short_conv_kernel_size,
    );
    let n = |r: &str| names::layer(il, &format!("self_attn.{r}"));
    let q_proj = b.dense(&n("q_proj.weight"), p, dm)?;
    let k_proj = b.dense(&n("k_proj.weight"), p, dm)?;
    let v_proj = b.dense(&n("v_proj.weight"), p, dm)?;
    let q_conv = b.conv(&n("q_conv1d.weight"), p, k)?;
    let k_conv = b.conv(&n("k_conv1d.weight"), p, k)?;
    let v_conv = b.conv(&n("v_conv1d.weight"), p, k)?;
    let f_a = b.dense(&n("f_a_proj.weight"), dk, dm)?;
    let f_b = b.dense(&n("f_b_proj.weight"), p, dk)?;
    let a_log = b.a_log(&n("A_log"), h, dk)?;
    let dt_bias = b.vector(&n("dt_bias"), p)?;
    let b_proj = b.dense(&n("b_proj.weight"), h, dm)?;
    let g_proj = b.dense(&n("g_proj.weight"), p, dm)?;
    let o_norm = b.vector(&n("o_norm.weight"), dk)?;
    let o_proj = b.dense(&n("o_proj.weight"), dm, p)?;
    Ok((|| {
        Some(KdaWeights {
            q_proj: q_proj?,
            k_proj: k_proj?,
            v_proj: v_proj?,
            q_conv: q_conv?,
            k_conv: k_conv?,
            v_conv: v_conv?,
            f_a: f_a?,
            f_b: f_b?,
            a_log: a_log?,
            dt_bias: dt_bias?,
            b_proj: b_proj?,
            g_proj: g_proj?,
            o_norm: o_norm?,
            o_proj: o_proj?,
        })
    })())
}

fn bind_mla(
    b: &mut Binder,
    cfg: &ModelConfig,
    il: usize,
) -> Result<Option<MlaWeights>, StreamError> {
    let dm = cfg.hidden_size;
    let h = cfg.num_attention_heads;
    let n = |r: &str| names::layer(il, &format!("self_attn.{r}"));
    let q_a = b.dense(&n("q_a_proj.weight"), cfg.q_lora_rank, dm)?;
    let q_a_norm = b.vector(&n("q_a_layernorm.weight"), cfg.q_lora_rank)?;
    let q_b = b.dense(&n("q_b_proj.weight"), h * cfg.mla_q_head(), cfg.q_lora_rank)?;
    let kv_a = b.dense(
        &n("kv_a_proj_with_mqa.weight"),
        cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        dm,
    )?;
    let kv_a_norm = b.vector(&n("kv_a_layernorm.weight"), cfg.kv_lora_rank)?;
    let kv_b = b.dense(
        &n("kv_b_proj.weight"),
        h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
        cfg.kv_lora_rank,
    )?;
    let g_proj = b.dense(&n("g_proj.weight"), h * cfg.v_head_dim, dm)?;
    let o_proj = b.dense(&n("o_proj.weight"), dm, h * cfg.v_head_dim)?;
    Ok((|| {
        Some(MlaWeights {
            q_a: q_a?,
            q_a_norm: q_a_norm?,
            q_b: q_b?,
            kv_a: kv_a?,
            kv_a_norm: kv_a_norm?,
            kv_b: kv_b?,
            g_proj: g_proj?,
            o_proj: o_proj?,
        })
    })())
}

/// Bind routed expert `e` of layer `il`.
pub(crate) fn bind_expert(
    b: &mut Binder,
    cfg: &ModelConfig,
    il: usize,
    e: usize,
) -> Result<Option<Expert>, StreamError> {
    let n = |r: &str| names::layer(il, &format!("block_sparse_moe.experts.{e}.{r}"));
    let (lat, inter) = (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size);
    // An expert streamed on its own is read in one piece when its tensors are contiguous.
    let streamed = b.read && b.experts && b.run.is_none() && !b.mapped;
    if streamed {
        let all: Vec<String> = ["w1", "w2", "w3"]
            .iter()
            .flat_map(|w| {
                [
                    n(&format!("{w}.weight_packed")),
                    n(&format!("{w}.weight_scale")),
                ]
            })
            .collect();
        b.run = b.ck.read_group(&all)?.map(|p| LayerRun::from_parts(il, p));
    }
    let w1 = b.mxfp4(&n("w1"), inter, lat)?;
    let w2 = b.mxfp4(&n("w2"), lat, inter)?;
    let w3 = b.mxfp4(&n("w3"), inter, lat)?;
    if streamed {
        b.run = None;
    }
    Ok(match (w1, w2, w3) {
        (Some(w1), Some(w2), Some(w3)) => Some(Expert { w1, w2, w3 }),
        _ => None,
    })
}

fn bind_moe(
    b: &mut Binder,
    cfg: &ModelConfig,
    il: usize,
) -> Result<Option<MoeWeights>, StreamError> {
    let dm = cfg.hidden_size;
    let lat = cfg.routed_expert_hidden_size;
    let inter = cfg.moe_intermediate_size;
    let sh = cfg.shared_width();
    let n = |r: &str| names::layer(il, &format!("block_sparse_moe.{r}"));
    let gate = b.dense(&n("gate.weight"), cfg.num_experts, dm)?;
    let bias = b.vector(&n("gate.e_score_correction_bias"), cfg.num_experts)?;
    let down = b.dense(&n("routed_expert_down_proj.weight"), lat, dm)?;
    let up = b.dense(&n("routed_expert_up_proj.weight"), dm, lat)?;
    let norm = b.vector(&n("routed_expert_norm.weight"), lat)?;
    let shared_gate = b.dense(&n("shared_experts.gate_proj.weight"), sh, dm)?;
    let shared_up = b.dense(&n("shared_experts.up_proj.weight"), sh, dm)?;
    let shared_down = b.dense(&n("shared_experts.down_proj.weight"), dm, sh)?;
    let mut experts = Vec::with_capacity(cfg.num_experts);
    let mut all = true;
    let n_bind = if b.experts { cfg.num_experts } else { 0 };
    for e in 0..n_bind {
        let w1 = b.mxfp4(&n(&format!("experts.{e}.w1")), inter, lat)?;
        let w2 = b.mxfp4(&n(&format!("experts.{e}.w2")), lat, inter)?;
        let w3 = b.mxfp4(&n(&format!("experts.{e}.w3")), inter, lat)?;
        match (w1, w2, w3) {
            (Some(w1), Some(w2), Some(w3)) => {
                experts.push(std::sync::Arc::new(Expert { w1, w2, w3 }))
            }
            _ => all = false,
        }
    }
    Ok((|| {
        all.then_some(())?;
        Some(MoeWeights {
            gate: gate?,
            bias: bias?,
            down: down?,
            up: up?,
            norm: norm?,
            shared_gate: shared_gate?,
            shared_up: shared_up?,
            shared_down: shared_down?,
            experts,
        })
    })())
}

pub(crate) fn bind_layer(
    b: &mut Binder,
    cfg: &ModelConfig,
    il: usize,
) -> Result<Option<Layer>, StreamError> {
    let dm = cfg.hidden_size;
    let has_kda = b.ck.info(&names::layer(il, "self_attn.A_log")).is_some();
    let has_mla =
        b.ck.info(&names::layer(il, "self_attn.kv_a_proj_with_mqa.weight"))
            .is_some();
    let is_mla = cfg.is_mla[il];
    if (is_mla && has_kda) || (!is_mla && has_mla) {
        let (said, found) = if is_mla {
            ("MLA", "KDA")
        } else {
            ("KDA", "MLA")
        };
        b.problems.push(format!(
            "layer {il} (one-based {}) is {said} in config.json but holds {found} tensors",
            il + 1
        ));
    }
    b.enter_layer(il)?;
    let input_norm = b.vector(&names::layer(il, "input_layernorm.weight"), dm)?;
    let post_norm = b.vector(&names::layer(il, "post_attention_layernorm.weight"), dm)?;
    let attn_res_fold = b.fold(
        &names::layer(il, "self_attention_res_norm.weight"),
        &names::layer(il, "self_attention_res_proj.weight"),
        dm,
    )?;
    let mlp_res_fold = b.fold(
        &names::layer(il, "mlp_res_norm.weight"),
        &names::layer(il, "mlp_res_proj.weight"),
        dm,
    )?;
    let attn = if is_mla {
        bind_mla(b, cfg, il)?.map(Attention::Mla)
    } else {
        bind_kda(b, cfg, il)?.map(Attention::Kda)
    };
    let ffn = if cfg.is_dense(il) {
        let n = |r: &str| names::layer(il, &format!("mlp.{r}"));
        let gate = b.dense(&n("gate_proj.weight"), cfg.intermediate_size, dm)?;
        let up = b.dense(&n("up_proj.weight"), cfg.intermediate_size, dm)?;
        let down = b.dense(&n("down_proj.weight"), dm, cfg.intermediate_size)?;
        (|| {
            Some(FeedForward::Dense(DenseMlp {
                gate: gate?,
                up: up?,
                down: down?,
            }))
        })()
    } else {
        bind_moe(b, cfg, il)?.map(|m| FeedForward::Moe(Box::new(m)))
    };
    b.run = None;
    Ok((|| {
        Some(Layer {
            input_norm: input_norm?,
            post_norm: post_norm?,
            attn_res_fold: attn_res_fold?,
            mlp_res_fold: mlp_res_fold?,
            attn: attn?,
            ffn: ffn?,
        })
    })())
}

/// Embedding, output head, final norm, output aggregator vector, and the layers.
pub(crate) type BoundModel = (Dense, Dense, Vec<f32>, Vec<f32>, Vec<Layer>);

/// Bind everything outside the layers, and optionally the layers, reading or just checking.
pub(crate) fn bind_model(
    b: &mut Binder,
    cfg: &ModelConfig,
    with_layers: bool,
) -> Result<Option<BoundModel>, StreamError> {
    let dm = cfg.hidden_size;
    let embed = b.dense(names::EMBED, cfg.vocab_size, dm)?;
    let lm_head = b.dense(names::LM_HEAD, cfg.vocab_size, dm)?;
    let norm = b.vector(names::NORM, dm)?;
    let out_res_fold = b.fold(names::OUT_RES_NORM, names::OUT_RES_PROJ, dm)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    let mut complete = true;
    for il in 0..cfg.num_hidden_layers {
        match bind_layer(b, cfg, il)? {
            Some(l) if with_layers => layers.push(l),
            Some(_) => {}
            None => complete = false,
        }
    }
    let unclaimed: Vec<String> =
        b.ck.index()
            .names()
            .filter(|n| n.starts_with("language_model.") && !b.claimed.contains(n))
            .collect();
    if !unclaimed.is_empty() {
        b.problems.push(format!(
            "{} language-model tensor(s) not used by the configured graph, e.g. {:?}",
            unclaimed.len(),
            &unclaimed[..unclaimed.len().min(3)]
        ));
    }
    Ok(match (embed, lm_head, norm, out_res_fold) {
        (Some(e), Some(h), Some(n), Some(f)) if complete && b.problems.is_empty() => {
            Some((e, h, n, f, layers))
        }
        _ => None,
    })
}

/// Byte sizes the memory planner needs, from the config and the checkpoint index.
#[must_use]
pub fn model_sizes(cfg: &ModelConfig, ck: &Checkpoint) -> crate::stream::budget::ModelSizes {
    let bytes = |name: &str| ck.info(name).map_or(0, |i| i.n_bytes());
    let mut layer_trunk = vec![0u64; cfg.num_hidden_layers];
    let mut expert_bytes = 0u64;
    for name in ck.index().names() {
        let Some((il, tail)) = crate::stream::layer_tensor(&name) else {
            continue;
        };
        if il >= layer_trunk.len() {
            continue;
        }
        if tail.starts_with("block_sparse_moe.experts.") {
            if tail.starts_with("block_sparse_moe.experts.0.") {
                expert_bytes += bytes(&name);
            }
        } else {
            layer_trunk[il] += bytes(&name);
        }
    }
    let moe_layers = (0..cfg.num_hidden_layers)
        .filter(|&il| !cfg.is_dense(il))
        .count() as u64;
    let n_mla = cfg.is_mla.iter().filter(|&&m| m).count() as u64;
    let kp = super::layer::kda_params(cfg);
    let act = super::run_state::activation_sizes(cfg);
    let kda_layer = (kp.heads * kp.head_dim * kp.head_dim
        + 3 * kp.heads * kp.head_dim * (kp.kernel - 1)) as u64
        * 4;
    ModelSizes {
        expert_bytes: if moe_layers > 0 {
            expert_bytes / moe_layers.max(1)
        } else {
            0
        },
        layer_trunk,
        layer_staged: Vec::new(),
        layer_window: Vec::new(),
        layer_pinned: Vec::new(),
        layer_in_place: Vec::new(),
        experts_per_layer: cfg.num_experts as u64,
        moe_layers,
        top_k: cfg.num_experts_per_token as u64,
        embed: bytes(names::EMBED),
        head: bytes(names::LM_HEAD),
        head_stored: 0,
        head_pinned: 0,
        small: bytes(names::NORM) + bytes(names::OUT_RES_NORM) + bytes(names::OUT_RES_PROJ),
        row_bytes: bytes(names::EMBED) / cfg.vocab_size.max(1) as u64,
        state_bytes: kda_layer * (cfg.num_hidden_layers as u64 - n_mla),
        kv_per_position: n_mla * super::state::SeqState::mla_floats_per_position(cfg) as u64 * 4,
        kda_layer_state: if n_mla < cfg.num_hidden_layers as u64 {
            // The copy a chunk is computed on, and the replay's scratch.
            kda_layer + (2 * kp.heads * kp.head_dim) as u64 * 4
        } else {
            0
        },
        // Every KDA layer's record, and the replay's outputs (one layer at a time).
        kda_record_per_position: ((cfg.num_hidden_layers as u64 - n_mla)
            * super::kda::KdaRecord::floats_per_position(&kp) as u64
            + (kp.heads * kp.head_dim) as u64)
            * 4,
        hidden: cfg.hidden_size as u64,
        vocab: cfg.vocab_size as u64,
        activation_fixed: act.fixed,
        activation_per_token: act.per_token,
        activation_per_position: act.per_position,
        coded_first: crate::kernels::coded_outruns_bf16(),
    }
}
