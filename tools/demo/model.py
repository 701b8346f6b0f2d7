#!/usr/bin/env python3
"""The Kimi K3 text graph in PyTorch (MODEL.md section 3), small, for the k3 demo model.

Exactly the released graph: attention residuals with block snapshots (3.2, 3.3), Kimi Delta
Attention with short convolutions, L2-normalised q/k, per-channel decay with the lower bound
multiplying a sigmoid, the delta rule and a norm-then-gate output (3.4), gated NoPE MLA with
1e-6 LoRA norms and the 192-style scale over nope+rope (3.5), latent MoE with a sigmoid router,
selection-only bias, renormalised weights, SiTU experts in the latent, a norm on the weighted
aggregate and shared experts at full width (3.6), a dense SiTU layer 0 (3.7), the output
AttnRes, final norm and lm_head (3.8).

Two KDA evaluation forms: `chunked` (training; WY/UT form per chunk, exact in exact
arithmetic) and `sequential` (the token-by-token recurrence of 3.4 step 6, used to check the
chunked form). Routed experts can be fake-quantised to MXFP4 (straight-through) for
quantisation-aware fine-tuning; the quantiser is the one the exporter uses.

Checkpoint I/O: `export(model, out_dir)` writes the released layout (nested config.json,
sharded safetensors + index, BF16 trunk, F32 small vectors where the release has F32,
MXFP4 routed experts, A_log [head_dim] F32 with a zero tail); `load_checkpoint(dir)` reads
it back into this module.
"""

import json
import math
import os
import struct
from dataclasses import dataclass, field, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"


@dataclass
class Cfg:
    hidden_size: int = 256
    num_hidden_layers: int = 8
    vocab_size: int = 4352
    rms_norm_eps: float = 1e-5
    kda_num_heads: int = 4
    kda_head_dim: int = 32
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    full_attn_layers: list = field(default_factory=lambda: [4, 7, 8])   # one-based
    num_attention_heads: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 1
    routed_expert_hidden_size: int = 128
    moe_intermediate_size: int = 128
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    intermediate_size: int = 640
    attn_res_block_size: int = 3
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    mla_lora_eps: float = 1e-6
    l2_eps: float = 1e-6
    n_ranks: int = 4096

    def is_mla(self, L):
        return (L + 1) in self.full_attn_layers

    @classmethod
    def from_dict(cls, d):
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# ---------------------------------------------------------------------------------------------
# primitives
# ---------------------------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def l2n(x, eps):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(g, u, b1, b2):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def attnres(sources, fold, eps):
    """sources: list of [..., H] (oldest first, prefix last). Raw-value softmax mix."""
    V = torch.stack(sources, 0)
    s = (rmsnorm(V, None, eps) * fold).sum(-1)          # [n, ...]
    a = torch.softmax(s, dim=0)
    return (a.unsqueeze(-1) * V).sum(0)


def inv_rms(v, eps):
    return torch.rsqrt(v.pow(2).mean(-1) + eps)


def attnres_cached(srcs, fold, eps):
    """Same as attnres; srcs: list of (value, inverse RMS) pairs, the inverse RMS of a block
    snapshot computed once when it is pushed."""
    scores = torch.stack([(v @ fold.to(v.dtype)) * inv for v, inv in srcs], 0)
    a = torch.softmax(scores, dim=0).to(srcs[0][0].dtype)
    out = a[0].unsqueeze(-1) * srcs[0][0]
    for i in range(1, len(srcs)):
        out = out + a[i].unsqueeze(-1) * srcs[i][0]
    return out


E2M1_MAG = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MID = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def mxfp4_codes(W):
    """MODEL.md 1.6 rule on a [rows, cols] float tensor: per 32-group along cols,
    e = floor(log2(max|w|)) - 2; nearest E2M1 magnitude of |w|/2^e, ties to the smaller code,
    saturating at 6. Returns (codes uint8 [rows, cols] with sign bit 8, exponent e int [rows, groups])."""
    rows, cols = W.shape[-2:]
    assert cols % 32 == 0
    G = W.detach().double().reshape(*W.shape[:-1], cols // 32, 32)
    mx = G.abs().amax(-1)
    if torch.any(mx <= 0):
        raise ValueError("an MXFP4 group is all zeros")
    e = torch.floor(torch.log2(mx)).to(torch.int64) - 2
    a = (G.abs() / torch.pow(2.0, e.double()).unsqueeze(-1)).clamp(max=6.0)
    code = torch.bucketize(a, E2M1_MID.double(), right=False)     # number of midpoints < a
    code = code | torch.where(G < 0, 8, 0)
    return code.reshape(W.shape).to(torch.uint8), e


def mxfp4_dequant_codes(code, e):
    mag = E2M1_MAG.double()[(code & 7).long()]
    val = torch.where((code & 8) != 0, -mag, mag)
    G = val.reshape(*code.shape[:-1], code.shape[-1] // 32, 32) * torch.pow(2.0, e.double()).unsqueeze(-1)
    return G.reshape(code.shape)


def mxfp4_fake(W):
    """Quantise-dequantise (same rule as the exporter), straight-through gradient.
    W: [..., rows, cols]; groups of 32 along cols."""
    with torch.no_grad():
        flat = W.reshape(-1, W.shape[-1])
        code, e = mxfp4_codes(flat)
        Q = mxfp4_dequant_codes(code, e).reshape(W.shape).to(W.dtype)
    return W + (Q - W).detach()


# ---------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------

def kda_sequential(q, k, v, g, beta, S0=None):
    """q,k,v,g: [B, H, T, D] (q already scaled, g = log-decay <= 0); beta [B, H, T].
    Returns o [B, H, T, D], final S [B, H, D, D]."""
    B, H, T, D = q.shape
    S = torch.zeros(B, H, D, v.shape[-1], dtype=q.dtype, device=q.device) if S0 is None else S0
    alpha = torch.exp(g)
    outs = []
    for t in range(T):
        S = alpha[:, :, t, :, None] * S                                   # decay key rows
        u = torch.einsum("bhi,bhij->bhj", k[:, :, t], S)                  # read
        S = S + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - u))[:, :, None, :]
        outs.append(torch.einsum("bhi,bhij->bhj", q[:, :, t], S))        # from the updated state
    return torch.stack(outs, 2), S


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] with C a power of two:
    sum_{k<C} (-A)^k = (I - A)(I + A^2)(I + A^4)... (exact, A is nilpotent)."""
    C = A.shape[-1]
    P = -A
    R = torch.eye(C, dtype=A.dtype, device=A.device) + P
    k = 2
    while k < C:
        P = P @ P
        R = R + R @ P
        k *= 2
    return R


def kda_chunked(q, k, v, g, beta, chunk=16, S0=None):
    """Same maths as kda_sequential, per chunk of `chunk` tokens:
    W = (I + A)^-1 (beta V - beta (e^G K) S0), o = (e^G Q) S0 + Bm W,
    S' = e^{G_C} S0 + (e^{G_C - G} K)^T W, with A_ts = beta_t sum_d k_t k_s e^{G_t - G_s} (s < t),
    Bm_ts = sum_d q_t k_s e^{G_t - G_s} (s <= t), G = within-chunk inclusive cumulative g.
    e^{G_t - G_s} is factored as e^{G_t} e^{-G_s}: with g >= -5 and 16-token chunks G >= -80,
    so both factors stay finite and normal in float32."""
    B, H, T, D = q.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        z = lambda x: F.pad(x, (0, 0, 0, pad))
        q, k, v, g = z(q), z(k), z(v), z(g)
        beta = F.pad(beta, (0, pad))
    N = q.shape[2] // chunk
    C = chunk
    q = q.reshape(B, H, N, C, D)
    k = k.reshape(B, H, N, C, D)
    v = v.reshape(B, H, N, C, Dv)
    G = torch.cumsum(g.reshape(B, H, N, C, D), dim=3)
    beta = beta.reshape(B, H, N, C, 1)
    eG = torch.exp(G)
    Kn = k * torch.exp(-G)                                    # k_s e^{-G_s}
    Kp = k * eG                                               # k_t e^{G_t}
    Qg = q * eG
    tri_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    tri_strict = tri_incl.tril(-1)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    A = torch.where(tri_strict, Kp @ Kn.transpose(-1, -2), zero) * beta
    Bm = torch.where(tri_incl, Qg @ Kn.transpose(-1, -2), zero)
    Tinv = unit_lower_inverse(A)
    U = Tinv @ (beta * v)
    Wk = Tinv @ (beta * Kp)
    GC = G[:, :, :, -1:, :]                                   # [B,H,N,1,D]
    Kend = torch.exp(GC - G) * k                              # e^{G_C - G_s} k_s
    dC = torch.exp(GC[:, :, :, 0, :]).unsqueeze(-1)           # [B,H,N,D,1]
    S = torch.zeros(B, H, D, Dv, dtype=q.dtype, device=q.device) if S0 is None else S0
    outs = []
    # unbind once (indexing inside the loop would make every backward step zero-fill the whole tensor)
    Us, Wks, Qgs, Bms, dCs = U.unbind(2), Wk.unbind(2), Qg.unbind(2), Bm.unbind(2), dC.unbind(2)
    KendT = Kend.transpose(-1, -2).unbind(2)
    for n in range(N):
        W = Us[n] - Wks[n] @ S
        outs.append(Qgs[n] @ S + Bms[n] @ W)
        S = dCs[n] * S + KendT[n] @ W
    o = torch.stack(outs, 2).reshape(B, H, N * C, Dv)[:, :, :T]
    return o, S


class KDA(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, D, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        P = nh * D
        self.c = c
        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = nn.Parameter(torch.zeros(P, 1, K))
        self.k_conv1d = nn.Parameter(torch.zeros(P, 1, K))
        self.v_conv1d = nn.Parameter(torch.zeros(P, 1, K))
        self.f_a_proj = nn.Linear(H, D, bias=False)
        self.f_b_proj = nn.Linear(D, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(nh))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = nn.Linear(H, nh, bias=False)
        self.g_proj = nn.Linear(H, P, bias=False)
        self.o_norm = nn.Parameter(torch.ones(D))
        self.o_proj = nn.Linear(P, H, bias=False)

    def forward(self, x, mode="chunked"):
        c = self.c
        B, T, _ = x.shape
        nh, D, K = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        P = nh * D

        # q, k, v projections and their depthwise causal convolutions, fused (same maths):
        # tap K-1 multiplies the current input, tap 0 the oldest; then SiLU
        Wqkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], 0)
        wc = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d], 0)[:, 0, :]   # [3P, K]
        y = F.linear(x, Wqkv)
        yp = F.pad(y, (0, 0, K - 1, 0))
        acc = yp[:, K - 1:] * wc[:, K - 1]
        for j in range(K - 1):
            acc = acc + yp[:, j:j + T] * wc[:, j]
        qkv = F.silu(acc)
        q = qkv[..., :P].reshape(B, T, nh, D)
        k = qkv[..., P:2 * P].reshape(B, T, nh, D)
        v = qkv[..., 2 * P:].reshape(B, T, nh, D)
        q = l2n(q, c.l2_eps) * (D ** -0.5)
        k = l2n(k, c.l2_eps)
        beta = torch.sigmoid(self.b_proj(x))                                  # [B,T,nh]
        z = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, nh, D)
        g = c.gate_lower_bound * torch.sigmoid(
            torch.exp(self.A_log)[:, None] * (z + self.dt_bias.reshape(nh, D)))
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        tr = lambda a: a.permute(0, 2, 1, 3).to(dt)
        with torch.autocast("cpu", enabled=False):          # the recurrence stays float32
            if mode == "sequential":
                o, _ = kda_sequential(tr(q), tr(k), tr(v), tr(g), beta.permute(0, 2, 1).to(dt))
            else:
                o, _ = kda_chunked(tr(q), tr(k), tr(v), tr(g), beta.permute(0, 2, 1).to(dt))
        o = rmsnorm(tr(o), self.o_norm, c.rms_norm_eps).reshape(B, T, P)
        o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class MLA(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh = c.hidden_size, c.num_attention_heads
        self.c = c
        self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.Parameter(torch.ones(c.q_lora_rank))
        self.q_b_proj = nn.Linear(c.q_lora_rank, nh * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(c.kv_lora_rank))
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.g_proj = nn.Linear(H, nh * c.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, H, bias=False)

    def forward(self, x, mode=None):
        c = self.c
        B, T, _ = x.shape
        nh, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        cq = rmsnorm(self.q_a_proj(x), self.q_a_layernorm, c.mla_lora_eps)
        q = self.q_b_proj(cq).reshape(B, T, nh, nope + rope).transpose(1, 2)
        kv = self.kv_a_proj_with_mqa(x)
        lat = rmsnorm(kv[..., :c.kv_lora_rank], self.kv_a_layernorm, c.mla_lora_eps)
        r = kv[..., c.kv_lora_rank:]                                          # shared, unrotated
        kvb = self.kv_b_proj(lat).reshape(B, T, nh, nope + vd).transpose(1, 2)
        kk = torch.cat([kvb[..., :nope], r[:, None].expand(B, nh, T, rope)], -1)
        vv = kvb[..., nope:]
        o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=(nope + rope) ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, nh * vd)
        o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class DenseMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        c = self.c
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x),
                                   c.activation_situ_beta, c.activation_situ_linear_beta))


class LatentMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, E, lat, mi = c.hidden_size, c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
        S = mi * c.num_shared_experts
        self.c = c
        self.gate = nn.Linear(H, E, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.routed_expert_down_proj = nn.Linear(H, lat, bias=False)
        self.routed_expert_norm = nn.Parameter(torch.ones(lat))
        self.routed_expert_up_proj = nn.Linear(lat, H, bias=False)
        self.w1 = nn.Parameter(torch.zeros(E, mi, lat))     # gate
        self.w2 = nn.Parameter(torch.zeros(E, lat, mi))     # down
        self.w3 = nn.Parameter(torch.zeros(E, mi, lat))     # up
        self.shared_gate = nn.Linear(H, S, bias=False)
        self.shared_up = nn.Linear(H, S, bias=False)
        self.shared_down = nn.Linear(S, H, bias=False)
        self.quant = False
        self.last_load = None

    def expert_weights(self):
        if self.quant:
            return mxfp4_fake(self.w1), mxfp4_fake(self.w2), mxfp4_fake(self.w3)
        return self.w1, self.w2, self.w3

    def forward(self, x):
        c = self.c
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        N = x.shape[0]
        with torch.autocast("cpu", enabled=False):          # router in float32 (or float64)
            xr = x if x.dtype == torch.float64 else x.float()
            s = torch.sigmoid(F.linear(xr, self.gate.weight.to(xr.dtype)))
        choice = s + self.e_score_correction_bias
        idx = torch.topk(choice.detach(), c.num_experts_per_token, dim=-1).indices       # [N, k]
        w = s.gather(1, idx)
        if c.num_experts_per_token > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * c.routed_scaling_factor
        z = self.routed_expert_down_proj(x)
        u = torch.zeros(N, c.routed_expert_hidden_size, dtype=x.dtype, device=x.device)
        W1, W2, W3 = self.expert_weights()
        b1, b2 = c.activation_situ_beta, c.activation_situ_linear_beta
        with torch.no_grad():
            self.last_load = torch.bincount(idx.reshape(-1), minlength=c.num_experts).float()
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // c.num_experts_per_token
        cnt = torch.bincount(flat, minlength=c.num_experts).tolist()
        zs = z[tok]
        ws = w.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        ys, o = [], 0
        for e in range(c.num_experts):
            ze = zs[o:o + cnt[e]]
            o += cnt[e]
            ys.append(situ(ze @ W1[e].T, ze @ W3[e].T, b1, b2) @ W2[e].T)
        u = u.index_add(0, tok, (torch.cat(ys, 0) * ws).to(u.dtype))
        u = rmsnorm(u, self.routed_expert_norm, c.rms_norm_eps)
        y = self.routed_expert_up_proj(u)
        y = y + self.shared_down(situ(self.shared_gate(x), self.shared_up(x), b1, b2))
        return y.reshape(shp)


class Layer(nn.Module):
    def __init__(self, c, L):
        super().__init__()
        H = c.hidden_size
        self.L = L
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.self_attention_res_norm = nn.Parameter(torch.ones(H))
        self.self_attention_res_proj = nn.Parameter(torch.zeros(H))
        self.mlp_res_norm = nn.Parameter(torch.ones(H))
        self.mlp_res_proj = nn.Parameter(torch.zeros(H))
        self.self_attn = MLA(c) if c.is_mla(L) else KDA(c)
        self.ffn = DenseMLP(c) if L < c.first_k_dense_replace else LatentMoE(c)


class K3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        H, V = c.hidden_size, c.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList([Layer(c, L) for L in range(c.num_hidden_layers)])
        self.norm = nn.Parameter(torch.ones(H))
        self.output_attn_res_norm = nn.Parameter(torch.ones(H))
        self.output_attn_res_proj = nn.Parameter(torch.zeros(H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def init_weights(self, seed):
        gen = torch.Generator().manual_seed(seed)
        c = self.c
        n = c.num_hidden_layers
        out_std = 0.02 / math.sqrt(2 * n)

        def nrm(t, std):
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=gen) * std)

        nrm(self.embed_tokens.weight, 0.02)
        nrm(self.lm_head.weight, 0.02)
        for lay in self.layers:
            a = lay.self_attn
            for name, mod in a.named_children():
                if isinstance(mod, nn.Linear):
                    nrm(mod.weight, out_std if name == "o_proj" else 0.02)
            if isinstance(a, KDA):
                nrm(a.q_conv1d, 0.3)
                nrm(a.k_conv1d, 0.3)
                nrm(a.v_conv1d, 0.3)
                with torch.no_grad():
                    for cv in (a.q_conv1d, a.k_conv1d, a.v_conv1d):
                        cv[:, 0, -1] += 1.0                       # start near identity
                    a.A_log.copy_(torch.linspace(-0.5, 0.5, c.kda_num_heads))
                    a.dt_bias.copy_(torch.rand(a.dt_bias.shape, generator=gen) * -7.0)
                nrm(a.f_a_proj.weight, 0.02)
                nrm(a.f_b_proj.weight, 0.02)
            f = lay.ffn
            for name, mod in f.named_children():
                if isinstance(mod, nn.Linear):
                    nrm(mod.weight, out_std if name in ("down_proj", "shared_down", "routed_expert_up_proj") else 0.02)
            if isinstance(f, LatentMoE):
                nrm(f.w1, 0.05)
                nrm(f.w3, 0.05)
                nrm(f.w2, 0.05 / math.sqrt(2 * n))

    # ------------------------------------------------------------------------ forward
    def forward(self, ids, mode="chunked", return_hidden=False, positions=None):
        """ids [B, T] -> logits [B, T, V] (or, with `positions` (a bool mask [B, T]),
        logits of the selected positions only, [n, V])."""
        c = self.c
        h = self.embed_tokens(ids)
        B = []                       # (snapshot, its inverse RMS)
        p = None
        eps = c.rms_norm_eps
        for L, lay in enumerate(self.layers):
            p = h
            if B:
                h = attnres_cached(B + [(p, inv_rms(p, eps))],
                                   lay.self_attention_res_norm * lay.self_attention_res_proj, eps)
            if L % c.attn_res_block_size == 0:
                B.append((p, inv_rms(p, eps)))
                p = None
            x = rmsnorm(h, lay.input_layernorm, eps)
            a = lay.self_attn(x, mode)
            p = a if p is None else p + a
            h = attnres_cached(B + [(p, inv_rms(p, eps))], lay.mlp_res_norm * lay.mlp_res_proj, eps)
            x = rmsnorm(h, lay.post_attention_layernorm, eps)
            p = p + lay.ffn(x)
            h = p
        hout = attnres_cached(B + [(p, inv_rms(p, eps))],
                              self.output_attn_res_norm * self.output_attn_res_proj, eps)
        n = rmsnorm(hout, self.norm, eps)
        if return_hidden:
            return n
        if positions is not None:
            n = n[positions]
        return self.lm_head(n)

    def moe_layers(self):
        return [lay.ffn for lay in self.layers if isinstance(lay.ffn, LatentMoE)]

    def set_quant(self, on):
        for m in self.moe_layers():
            m.quant = on

    # ------------------------------------------------------------------------ tensors
    def released_tensors(self):
        """{name: (dtype, np.ndarray float64 or uint8)} in the released naming and dtypes.
        Floats are returned unrounded; `export` rounds them to BF16 / F32."""
        c = self.c
        t = {}
        f = lambda x: x.detach().double().cpu().numpy()
        t[PREFIX + "embed_tokens.weight"] = ("BF16", f(self.embed_tokens.weight))
        t[LM_HEAD] = ("BF16", f(self.lm_head.weight))
        t[PREFIX + "norm.weight"] = ("BF16", f(self.norm))
        t[PREFIX + "output_attn_res_norm.weight"] = ("BF16", f(self.output_attn_res_norm))
        t[PREFIX + "output_attn_res_proj.weight"] = ("BF16", f(self.output_attn_res_proj)[None, :])
        for L, lay in enumerate(self.layers):
            p = f"{PREFIX}layers.{L}."
            t[p + "input_layernorm.weight"] = ("BF16", f(lay.input_layernorm))
            t[p + "post_attention_layernorm.weight"] = ("BF16", f(lay.post_attention_layernorm))
            t[p + "self_attention_res_norm.weight"] = ("BF16", f(lay.self_attention_res_norm))
            t[p + "self_attention_res_proj.weight"] = ("BF16", f(lay.self_attention_res_proj)[None, :])
            t[p + "mlp_res_norm.weight"] = ("BF16", f(lay.mlp_res_norm))
            t[p + "mlp_res_proj.weight"] = ("BF16", f(lay.mlp_res_proj)[None, :])
            a = lay.self_attn
            ap = p + "self_attn."
            if isinstance(a, MLA):
                for nm in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"):
                    t[ap + nm + ".weight"] = ("BF16", f(getattr(a, nm).weight))
                t[ap + "q_a_layernorm.weight"] = ("BF16", f(a.q_a_layernorm))
                t[ap + "kv_a_layernorm.weight"] = ("BF16", f(a.kv_a_layernorm))
            else:
                for nm in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"):
                    t[ap + nm + ".weight"] = ("BF16", f(getattr(a, nm).weight))
                for nm in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    t[ap + nm + ".weight"] = ("F32", f(getattr(a, nm)))
                alog = np.zeros(c.kda_head_dim)
                alog[:c.kda_num_heads] = f(a.A_log)
                t[ap + "A_log"] = ("F32", alog)
                t[ap + "dt_bias"] = ("F32", f(a.dt_bias))
                t[ap + "o_norm.weight"] = ("F32", f(a.o_norm))
            fm = lay.ffn
            if isinstance(fm, DenseMLP):
                for nm in ("gate_proj", "up_proj", "down_proj"):
                    t[p + "mlp." + nm + ".weight"] = ("BF16", f(getattr(fm, nm).weight))
            else:
                mp = p + "block_sparse_moe."
                t[mp + "gate.weight"] = ("BF16", f(fm.gate.weight))
                t[mp + "gate.e_score_correction_bias"] = ("F32", f(fm.e_score_correction_bias))
                t[mp + "routed_expert_down_proj.weight"] = ("BF16", f(fm.routed_expert_down_proj.weight))
                t[mp + "routed_expert_norm.weight"] = ("BF16", f(fm.routed_expert_norm))
                t[mp + "routed_expert_up_proj.weight"] = ("BF16", f(fm.routed_expert_up_proj.weight))
                t[mp + "shared_experts.gate_proj.weight"] = ("BF16", f(fm.shared_gate.weight))
                t[mp + "shared_experts.up_proj.weight"] = ("BF16", f(fm.shared_up.weight))
                t[mp + "shared_experts.down_proj.weight"] = ("BF16", f(fm.shared_down.weight))
                for e in range(c.num_experts):
                    for wn in ("w1", "w2", "w3"):
                        code, ex = mxfp4_codes(getattr(fm, wn)[e])
                        code = code.numpy()
                        packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
                        scale = (ex.numpy() + 127)
                        if np.any(scale < 1) or np.any(scale > 254):
                            raise ValueError("MXFP4 scale out of range")
                        t[mp + f"experts.{e}.{wn}.weight_packed"] = ("U8", packed)
                        t[mp + f"experts.{e}.{wn}.weight_scale"] = ("U8", scale.astype(np.uint8))
        return t


# ---------------------------------------------------------------------------------------------
# safetensors I/O (own writer, as tools/oracle/gen_tiny2.py)
# ---------------------------------------------------------------------------------------------

def to_bf16_bits(x):
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def encode_tensor(dt, arr):
    if dt == "BF16":
        return to_bf16_bits(arr).astype("<u2").tobytes()
    if dt == "F32":
        return np.asarray(arr, dtype="<f4").tobytes()
    if dt == "U8":
        return np.asarray(arr, dtype=np.uint8).tobytes()
    raise ValueError(dt)


_ORDER = {"F32": 0, "BF16": 1, "U8": 2}


def write_shard(path, tensors):
    """tensors: list of (name, dtype, shape, bytes) in write order."""
    header, blobs, off = {}, [], 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((-len(hj)) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    return off


def read_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    hdr = json.loads(buf[8:8 + n])
    out = {}
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        b, en = e["data_offsets"]
        raw = buf[8 + n + b: 8 + n + en]
        dt = e["dtype"]
        if dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dt == "U8":
            arr = np.frombuffer(raw, dtype=np.uint8)
        else:
            raise ValueError(dt)
        out[name] = (dt, arr.reshape(e["shape"]))
    return out


def config_json(c, template_path):
    """The released nested config shape, from a template (tests/fixtures/tiny/config.json)."""
    with open(template_path) as f:
        cfg = json.load(f)
    tc = cfg["text_config"]
    n = c.num_hidden_layers
    for k in ("hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "num_attention_heads",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "num_experts", "num_experts_per_token", "num_shared_experts", "routed_expert_hidden_size",
              "moe_intermediate_size", "routed_scaling_factor", "first_k_dense_replace",
              "intermediate_size", "attn_res_block_size", "activation_situ_beta",
              "activation_situ_linear_beta"):
        tc[k] = getattr(c, k)
    tc["moe_renormalize"] = True
    tc["latent_moe_use_norm"] = True
    tc["mla_use_output_gate"] = True
    tc["mla_use_nope"] = True
    tc["num_key_value_heads"] = c.num_attention_heads
    tc["linear_attn_config"] = {
        "full_attn_layers": list(c.full_attn_layers),
        "gate_lower_bound": c.gate_lower_bound,
        "head_dim": c.kda_head_dim,
        "kda_layers": [i for i in range(1, n + 1) if i not in c.full_attn_layers],
        "num_heads": c.kda_num_heads,
        "short_conv_kernel_size": c.short_conv_kernel_size,
        "use_full_rank_gate": True,
    }
    ids = {"bos_token_id": c.n_ranks + 0, "eos_token_id": c.n_ranks + 2, "pad_token_id": c.n_ranks + 255}
    for k, v in ids.items():
        cfg[k] = v
        tc[k] = v
    cfg["media_placeholder_token_id"] = c.n_ranks + 21
    cfg["vision_config"]["text_hidden_size"] = c.hidden_size
    return cfg


def export(model, out_dir, template_config, shards=2):
    """Write the released layout. Shard k holds a contiguous range of layers (each layer's
    non-expert tensors, then its experts); the model-level tensors go into the last shard."""
    c = model.c
    os.makedirs(out_dir, exist_ok=True)
    t = model.released_tensors()
    n = c.num_hidden_layers
    per = math.ceil(n / shards)
    groups = [list(range(i * per, min(n, (i + 1) * per))) for i in range(shards)]
    for fn in os.listdir(out_dir):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, fn))
    wm, total = {}, 0
    for si, layers in enumerate(groups):
        fn = f"model-{si + 1:05d}-of-{shards:06d}.safetensors"
        items = []
        for L in layers:
            p = f"{PREFIX}layers.{L}."
            names = [k for k in t if k.startswith(p)]
            trunk = sorted((k for k in names if ".experts." not in k), key=lambda k: (_ORDER[t[k][0]], k))
            exps = sorted((k for k in names if ".experts." in k),
                          key=lambda k: (int(k.split(".experts.")[1].split(".")[0]), k))
            items += trunk + exps
        if si == shards - 1:
            items += sorted((k for k in t if not k.startswith(PREFIX + "layers.")),
                            key=lambda k: (_ORDER[t[k][0]], k))
        rows = [(k, t[k][0], t[k][1].shape, encode_tensor(*t[k])) for k in items]
        total += write_shard(os.path.join(out_dir, fn), rows)
        for k in items:
            wm[k] = fn
    assert len(wm) == len(t)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(c, template_config), f, indent=2, sort_keys=True)
        f.write("\n")
    return total


def load_checkpoint(ckpt, dtype=torch.float32):
    """Build a K3 from a released-format directory (our export), weights exactly as stored."""
    with open(os.path.join(ckpt, "config.json")) as f:
        root = json.load(f)
    tc = root["text_config"]
    lac = tc["linear_attn_config"]
    d = {k: tc[k] for k in tc if k in Cfg.__dataclass_fields__}
    d["kda_num_heads"] = lac["num_heads"]
    d["kda_head_dim"] = lac["head_dim"]
    d["short_conv_kernel_size"] = lac["short_conv_kernel_size"]
    d["gate_lower_bound"] = lac["gate_lower_bound"]
    d["full_attn_layers"] = lac["full_attn_layers"]
    d["n_ranks"] = tc["vocab_size"] - 256
    c = Cfg.from_dict(d)
    m = K3(c)
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    t = {}
    for fn in files:
        t.update(read_safetensors(os.path.join(ckpt, fn)))
    used = set()

    def g(name):
        used.add(name)
        return torch.from_numpy(np.array(t[name][1], dtype=np.float64))

    def setp(param, name, shape=None):
        v = g(name)
        with torch.no_grad():
            param.copy_(v.reshape(param.shape))

    setp(m.embed_tokens.weight, PREFIX + "embed_tokens.weight")
    setp(m.lm_head.weight, LM_HEAD)
    setp(m.norm, PREFIX + "norm.weight")
    setp(m.output_attn_res_norm, PREFIX + "output_attn_res_norm.weight")
    setp(m.output_attn_res_proj, PREFIX + "output_attn_res_proj.weight")
    for L, lay in enumerate(m.layers):
        p = f"{PREFIX}layers.{L}."
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                   "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"):
            setp(getattr(lay, nm), p + nm + ".weight")
        a = lay.self_attn
        ap = p + "self_attn."
        if isinstance(a, MLA):
            for nm in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"):
                setp(getattr(a, nm).weight, ap + nm + ".weight")
            setp(a.q_a_layernorm, ap + "q_a_layernorm.weight")
            setp(a.kv_a_layernorm, ap + "kv_a_layernorm.weight")
        else:
            for nm in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"):
                setp(getattr(a, nm).weight, ap + nm + ".weight")
            for nm in ("q_conv1d", "k_conv1d", "v_conv1d"):
                setp(getattr(a, nm), ap + nm + ".weight")
            alog = g(ap + "A_log")
            assert torch.all(alog[c.kda_num_heads:] == 0)
            with torch.no_grad():
                a.A_log.copy_(alog[:c.kda_num_heads])
            setp(a.dt_bias, ap + "dt_bias")
            setp(a.o_norm, ap + "o_norm.weight")
        fm = lay.ffn
        if isinstance(fm, DenseMLP):
            for nm in ("gate_proj", "up_proj", "down_proj"):
                setp(getattr(fm, nm).weight, p + "mlp." + nm + ".weight")
        else:
            mp = p + "block_sparse_moe."
            setp(fm.gate.weight, mp + "gate.weight")
            setp(fm.e_score_correction_bias, mp + "gate.e_score_correction_bias")
            setp(fm.routed_expert_down_proj.weight, mp + "routed_expert_down_proj.weight")
            setp(fm.routed_expert_norm, mp + "routed_expert_norm.weight")
            setp(fm.routed_expert_up_proj.weight, mp + "routed_expert_up_proj.weight")
            setp(fm.shared_gate.weight, mp + "shared_experts.gate_proj.weight")
            setp(fm.shared_up.weight, mp + "shared_experts.up_proj.weight")
            setp(fm.shared_down.weight, mp + "shared_experts.down_proj.weight")
            for e in range(c.num_experts):
                for wn in ("w1", "w2", "w3"):
                    pk = t[mp + f"experts.{e}.{wn}.weight_packed"][1]
                    sc = t[mp + f"experts.{e}.{wn}.weight_scale"][1]
                    used.add(mp + f"experts.{e}.{wn}.weight_packed")
                    used.add(mp + f"experts.{e}.{wn}.weight_scale")
                    code = np.empty((pk.shape[0], pk.shape[1] * 2), dtype=np.uint8)
                    code[:, 0::2] = pk & 15
                    code[:, 1::2] = pk >> 4
                    W = mxfp4_dequant_codes(torch.from_numpy(code), torch.from_numpy(sc.astype(np.int64) - 127))
                    with torch.no_grad():
                        getattr(fm, wn)[e].copy_(W)
    unused = [k for k in t if k not in used]
    assert not unused, unused[:5]
    return m.to(dtype)
