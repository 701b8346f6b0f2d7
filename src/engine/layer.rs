//! One decoder layer's weights as the forward pass takes them, and the block constants a
//! config implies. Both the resident model and the streamer hand out these; neither the
//! forward pass nor the state needs to know which did.

use super::config::ModelConfig;
use super::kda::{KdaParams, KdaWeights};
use super::mla::{MlaParams, MlaWeights};
use super::moe::{DenseMlp, MoeParams, MoeWeights};

/// The attention block of a layer.
#[derive(Clone, Debug)]
pub enum Attention {
    /// Kimi Delta Attention.
    Kda(KdaWeights),
    /// Gated MLA.
    Mla(MlaWeights),
}

/// The feed-forward block of a layer.
#[derive(Clone, Debug)]
pub enum FeedForward {
    /// Dense SiTU MLP (leading layers).
    Dense(DenseMlp),
    /// Latent MoE.
    Moe(Box<MoeWeights>),
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub struct Layer {
    /// `[hidden]` gain before attention.
    pub input_norm: Vec<f32>,
    /// `[hidden]` gain before the FFN.
    pub post_norm: Vec<f32>,
    /// `[hidden]` pre-attention AttnRes score vector (norm ⊙ proj).
    pub attn_res_fold: Vec<f32>,
    /// `[hidden]` pre-FFN AttnRes score vector.
    pub mlp_res_fold: Vec<f32>,
    /// Attention.
    pub attn: Attention,
    /// Feed-forward.
    pub ffn: FeedForward,
}

/// KDA constants from a config.
#[must_use]
pub fn kda_params(cfg: &ModelConfig) -> KdaParams {
    KdaParams {
        heads: cfg.kda_num_heads,
        head_dim: cfg.kda_head_dim,
        kernel: cfg.short_conv_kernel_size,
        lower_bound: cfg.gate_lower_bound,
        rms_eps: cfg.rms_norm_eps,
        l2_eps: cfg.kda_l2norm_eps,
    }
}

/// MLA constants from a config.
#[must_use]
pub fn mla_params(cfg: &ModelConfig) -> MlaParams {
    MlaParams {
        heads: cfg.num_attention_heads,
        nope: cfg.qk_nope_head_dim,
        rope: cfg.qk_rope_head_dim,
        v: cfg.v_head_dim,
        kv_lora: cfg.kv_lora_rank,
        lora_eps: cfg.mla_lora_norm_eps,
    }
}

/// MoE constants from a config.
#[must_use]
pub fn moe_params(cfg: &ModelConfig) -> MoeParams {
    MoeParams {
        top_k: cfg.num_experts_per_token,
        renormalize: cfg.moe_renormalize,
        scaling: cfg.routed_scaling_factor,
        rms_eps: cfg.rms_norm_eps,
        beta1: cfg.situ_beta,
        beta2: cfg.situ_linear_beta,
    }
}
