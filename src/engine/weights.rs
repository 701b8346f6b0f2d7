//! Binding a checkpoint to the model graph: one table maps (layer, role) to tensor names, every
//! tensor is requested with the shape the config implies, and tensors nobody claims under
//! `language_model.` are refused. All problems are collected and reported together.

use super::config::{list_problems, ModelConfig, ProblemList};
use super::kda::KdaWeights;
use super::layer::{Attention, FeedForward, Layer};
use super::mla::MlaWeights;
use super::model::{Model, Weights};
use super::moe::{DenseMlp, Expert, MoeWeights};
use super::residency::Streamer;
use super::tensor::{Dense, DenseData, Matrix, Mxfp4};
use crate::stream::budget::{BudgetRequest, ModelSizes, Plan};
use crate::stream::bytes::{Bytes, U16s};
use crate::stream::trunk::{LayerRun, Trunk, TrunkError};
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
    fn one(dir: &Path, problem: &str) -> Self {
        let mut problems = ProblemList::default();
        problems.push(problem.to_string());
        BindError {
            dir: dir.to_path_buf(),
            problems,
        }
    }
}

/// Failure while loading a model.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Config refused.
    #[error(transparent)]
    Config(#[from] super::config::ConfigError),
    /// Files refused or unreadable.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// Graph mismatch.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The memory budget is below what the model needs to run.
    #[error("{0}")]
    Budget(String),
    /// The packed trunk is unusable.
    #[error(transparent)]
    Trunk(#[from] TrunkError),
}

impl From<LoadError> for crate::Error {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Config(e) => e.into(),
            LoadError::Stream(e) => e.into(),
            LoadError::Bind(e) => e.into(),
            LoadError::Budget(m) => crate::Error::Usage(m),
            LoadError::Trunk(e) => e.into(),
        }
    }
}

/// What loading read, and the plan it followed.
#[derive(Clone, Debug)]
pub struct LoadInfo {
    /// Tensor bytes read.
    pub bytes_read: u64,
    /// SHA-256 over every tensor's name, dtype, shape and offset.
    pub index_digest: [u8; 32],
    /// The memory plan.
    pub plan: Plan,
    /// The model's byte sizes.
    pub sizes: ModelSizes,
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
}

pub(crate) struct Binder<'a> {
    ck: &'a Checkpoint,
    claimed: HashSet<String>,
    problems: ProblemList,
    /// Read tensor data (else only check names, shapes and dtypes).
    read: bool,
    /// Bind routed experts with their layer (else they are fetched on demand).
    experts: bool,
    /// A packed trunk to read layers' non-expert tensors from, and the layer run read from it.
    trunk: Option<&'a Trunk>,
    run: Option<LayerRun>,
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
        }
    }

    /// Read layers' non-expert tensors from `trunk` (when reading).
    pub(crate) fn with_trunk(mut self, trunk: Option<&'a Trunk>) -> Self {
        self.trunk = trunk;
        self
    }

    /// Start binding layer `il`: with a trunk, its run is read in one pass.
    fn enter_layer(&mut self, il: usize) -> Result<(), StreamError> {
        self.run = match self.trunk {
            Some(t) if self.read => Some(t.read_layer(il)?),
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

impl Binder<'_> {
    /// Look up `name`, check it has one of `shapes` and an allowed dtype, and read it.
    fn fetch(
        &mut self,
        name: &str,
        shapes: &[&[usize]],
        dtypes: &[Dtype],
    ) -> Result<Option<TensorData>, StreamError> {
        self.claimed.insert(name.to_string());
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
            return Ok(Some(match info.dtype {
                Dtype::Bf16 => TensorData::Bf16(U16s::from_vec(&[])),
                Dtype::U8 => TensorData::U8(Bytes::default()),
                Dtype::F32 | Dtype::F16 => TensorData::F32(Vec::new()),
            }));
        }
        if let Some((dtype, raw)) = self.run.as_mut().and_then(|r| r.take(name)) {
            return Ok(Some(TensorData::from_bytes(dtype, raw)));
        }
        Ok(Some(self.ck.read(name)?.1))
    }

    fn dense(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Dense>, StreamError> {
        Ok(
            match self.fetch(
                name,
                &[&[rows, cols]],
                &[Dtype::Bf16, Dtype::F32, Dtype::F16],
            )? {
                Some(TensorData::Bf16(v)) => Some(Dense {
                    data: DenseData::Bf16(v),
                    rows,
                    cols,
                }),
                Some(TensorData::F32(v)) => Some(Dense {
                    data: DenseData::F32(v),
                    rows,
                    cols,
                }),
                _ => None,
            },
        )
    }

    /// A small vector stored as `[n]` or `[1, n]`, F32/BF16/F16, widened to f32.
    fn vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>, StreamError> {
        Ok(
            match self.fetch(
                name,
                &[&[n], &[1, n]],
                &[Dtype::F32, Dtype::Bf16, Dtype::F16],
            )? {
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
            match self.fetch(
                name,
                &[&[c, 1, k], &[c, k]],
                &[Dtype::F32, Dtype::Bf16, Dtype::F16],
            )? {
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
        let len = self.ck.info(name).map_or(heads, |i| i.numel());
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

    fn fold(&mut self, norm: &str, proj: &str, n: usize) -> Result<Option<Vec<f32>>, StreamError> {
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
    let streamed = b.read && b.experts && b.run.is_none();
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
type BoundModel = (Dense, Dense, Vec<f32>, Vec<f32>, Vec<Layer>);

/// Bind everything outside the layers, and optionally the layers, reading or just checking.
fn bind_model(
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
        experts_per_layer: cfg.num_experts as u64,
        moe_layers,
        top_k: cfg.num_experts_per_token as u64,
        embed: bytes(names::EMBED),
        head: bytes(names::LM_HEAD),
        small: bytes(names::NORM) + bytes(names::OUT_RES_NORM) + bytes(names::OUT_RES_PROJ),
        row_bytes: bytes(names::EMBED) / cfg.vocab_size.max(1) as u64,
        state_bytes: kda_layer * (cfg.num_hidden_layers as u64 - n_mla),
        kv_per_position: n_mla * super::state::SeqState::mla_floats_per_position(cfg) as u64 * 4,
        hidden: cfg.hidden_size as u64,
        vocab: cfg.vocab_size as u64,
    }
}

/// Check that the checkpoint binds to `cfg` (names, shapes, dtypes, nothing unclaimed)
/// without reading any weight.
pub fn check_graph(cfg: &ModelConfig, ck: &Checkpoint) -> Result<(), LoadError> {
    let mut check = Binder::new(ck, false, true);
    let ok = bind_model(&mut check, cfg, false)?.is_some();
    check.into_result()?;
    if ok {
        Ok(())
    } else {
        Err(BindError::one(ck.dir(), "incomplete graph").into())
    }
}

/// How [`Model::open_with`] opens a checkpoint.
#[derive(Clone)]
pub struct OpenOptions {
    /// The memory budget.
    pub budget: BudgetRequest,
    /// Context length the plan reserves state for.
    pub context: u64,
    /// Sequence states of that length the plan reserves room for (1 + a chat's snapshots).
    pub states: u64,
    /// A packed trunk directory (`k3 pack`) to read layers from.
    pub trunk: Option<PathBuf>,
    /// Read with `O_DIRECT` where the filesystem allows it (streamed weights and the trunk);
    /// off with `K3_NO_DIRECT=1`.
    pub direct: bool,
    /// Called with (bytes read, bytes to read) while loading.
    pub progress: Option<std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            budget: BudgetRequest::Resident,
            context: 4096,
            states: 1,
            trunk: None,
            direct: std::env::var_os("K3_NO_DIRECT").is_none_or(|v| v.is_empty() || v == "0"),
            progress: None,
        }
    }
}

impl Model {
    /// Load `dir/config.json` and every weight of the checkpoint in `dir`, resident.
    pub fn load(dir: &Path) -> Result<Model, LoadError> {
        Self::load_counted(dir).map(|(m, _)| m)
    }

    /// [`Model::load`], also returning the number of tensor bytes read.
    pub fn load_counted(dir: &Path) -> Result<(Model, u64), LoadError> {
        Self::load_full(dir).map(|(m, info)| (m, info.bytes_read))
    }

    /// [`Model::load`], also returning what was read and a digest of the tensor index.
    pub fn load_full(dir: &Path) -> Result<(Model, LoadInfo), LoadError> {
        Self::open(dir, BudgetRequest::Resident, 4096)
    }

    /// Open the checkpoint in `dir` under a memory budget: everything is validated first
    /// (names, shapes, dtypes, unclaimed tensors); a resident request reads everything, any
    /// other reads only what the plan pins and streams the rest. `context` sizes the state
    /// reserve of the plan.
    pub fn open(
        dir: &Path,
        req: BudgetRequest,
        context: u64,
    ) -> Result<(Model, LoadInfo), LoadError> {
        Self::open_with_progress(dir, req, context, None)
    }

    /// [`Model::open`], calling `progress(done, total)` as weight bytes are read.
    pub fn open_with_progress(
        dir: &Path,
        req: BudgetRequest,
        context: u64,
        progress: Option<std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>>,
    ) -> Result<(Model, LoadInfo), LoadError> {
        Self::open_with(
            dir,
            &OpenOptions {
                budget: req,
                context,
                progress,
                ..OpenOptions::default()
            },
        )
    }

    /// Open the checkpoint in `dir` as `opts` say (budget, packed trunk, direct I/O).
    pub fn open_with(dir: &Path, opts: &OpenOptions) -> Result<(Model, LoadInfo), LoadError> {
        let (req, context, progress) = (opts.budget, opts.context, opts.progress.clone());
        let cfg = ModelConfig::load(&dir.join("config.json"))?;
        let mut ck = Checkpoint::open(dir)?;
        let trunk = match &opts.trunk {
            Some(t) => {
                let mut t = Trunk::open(t, &ck, cfg.num_hidden_layers)?;
                t.set_direct(opts.direct);
                Some(std::sync::Arc::new(t))
            }
            None => None,
        };
        let digest = ck.index_digest();
        let sizes = model_sizes(&cfg, &ck);
        let plan = crate::stream::budget::plan_states(
            &sizes,
            req,
            context,
            opts.states,
            crate::stream::budget::cgroup_limit(),
        )
        .map_err(|e| LoadError::Budget(e.to_string()))?;
        if let Some(p) = progress {
            let total = if plan.budget_bytes.is_none() {
                sizes.model_bytes()
            } else {
                plan.pinned_bytes + if plan.head_resident { sizes.head } else { 0 } + sizes.small
            };
            ck.set_progress(Box::new(move |done| p(done.min(total), total)));
        }
        if plan.budget_bytes.is_none() {
            let model = Self::bind_with(cfg, &ck, trunk.as_deref())?;
            let info = LoadInfo {
                bytes_read: ck.bytes_read(),
                index_digest: digest,
                plan,
                sizes,
            };
            return Ok((model, info));
        }
        // Validate the whole graph without reading, then read what the plan keeps.
        let mut check = Binder::new(&ck, false, true);
        let ok = bind_model(&mut check, &cfg, false)?.is_some();
        check.into_result()?;
        if !ok {
            return Err(BindError::one(dir, "incomplete graph").into());
        }
        let mut b = Binder::new(&ck, true, false);
        let norm = b.vector(names::NORM, cfg.hidden_size)?;
        let fold = b.fold(names::OUT_RES_NORM, names::OUT_RES_PROJ, cfg.hidden_size)?;
        b.into_result()?;
        let (Some(norm), Some(out_res_fold)) = (norm, fold) else {
            return Err(BindError::one(dir, "final norm").into());
        };
        ck.set_drop_behind(true);
        ck.set_direct(opts.direct);
        let streamer = Streamer::new(
            cfg.clone(),
            std::sync::Arc::new(ck),
            trunk,
            sizes.clone(),
            plan.clone(),
        )?;
        let info = LoadInfo {
            bytes_read: streamer.stats().disk_bytes_read,
            index_digest: digest,
            plan,
            sizes,
        };
        let model = Model {
            cfg,
            out_res_fold,
            norm,
            weights: Weights::Streamed(Box::new(streamer)),
        };
        Ok((model, info))
    }

    /// Bind an open checkpoint to `cfg`, reading every weight.
    pub fn bind(cfg: ModelConfig, ck: &Checkpoint) -> Result<Model, LoadError> {
        Self::bind_with(cfg, ck, None)
    }

    /// [`Model::bind`], reading layers' non-expert tensors from `trunk` when given.
    pub fn bind_with(
        cfg: ModelConfig,
        ck: &Checkpoint,
        trunk: Option<&Trunk>,
    ) -> Result<Model, LoadError> {
        let mut b = Binder::new(ck, true, true).with_trunk(trunk);
        let bound = bind_model(&mut b, &cfg, true)?;
        match bound {
            Some((embed, lm_head, norm, out_res_fold, layers)) if b.problems.is_empty() => {
                let layers = layers.into_iter().map(std::sync::Arc::new).collect();
                Ok(Model {
                    cfg,
                    out_res_fold,
                    norm,
                    weights: Weights::Resident {
                        embed,
                        layers,
                        lm_head,
                    },
                })
            }
            _ => Err(BindError {
                dir: ck.dir().to_path_buf(),
                problems: b.problems,
            }
            .into()),
        }
    }
}
