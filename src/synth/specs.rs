//! The tensors each shape writes: their names, shapes, dtypes and how each is initialised
//! (the per-role output scales that keep activations the same magnitude at every width).

use super::*;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Init {
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
pub(super) struct Spec {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<u64>,
    pub(super) init: Init,
}

impl Spec {
    pub(super) fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    pub(super) fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size()
    }
}

/// Output-scale coefficients: a matrix's std is `c / sqrt(fan_in)`.
pub(super) mod scale {
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
pub(super) struct Builder {
    pub(super) prefix: String,
    pub(super) out: Vec<Spec>,
}

impl Builder {
    pub(super) fn new(prefix: String) -> Self {
        Builder {
            prefix,
            out: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, rest: &str, dtype: Dtype, shape: &[usize], init: Init) {
        self.out.push(Spec {
            name: format!("{}{rest}", self.prefix),
            dtype,
            shape: shape.iter().map(|&d| d as u64).collect(),
            init,
        });
    }

    /// A BF16 `[rows, cols]` matrix with std `c / sqrt(cols)`.
    pub(super) fn mat(&mut self, rest: &str, rows: usize, cols: usize, c: f32) {
        let std = c / (cols as f32).sqrt();
        self.push(
            rest,
            Dtype::Bf16,
            &[rows, cols],
            Init::Normal { mean: 0.0, std },
        );
    }

    pub(super) fn gain(&mut self, rest: &str, n: usize, dtype: Dtype) {
        self.push(rest, dtype, &[n], Init::Gain);
    }

    /// An MXFP4 matrix with logical shape `[rows, cols]`: `prefix.weight_packed` and
    /// `prefix.weight_scale`.
    pub(super) fn mx(&mut self, rest: &str, rows: usize, cols: usize, c: f32) {
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
pub(super) fn layer_specs(d: &Dims, l: usize) -> Vec<Spec> {
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
pub(super) fn model_specs(d: &Dims) -> Vec<Spec> {
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
pub(super) fn vision_specs(which: usize) -> (Vec<Spec>, String) {
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
