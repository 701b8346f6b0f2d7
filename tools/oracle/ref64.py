#!/usr/bin/env python3
"""Independent float64 NumPy reference of the Kimi K3 text forward pass.

Written from docs/spec MODEL.md (sections 1-4, 7) only; it shares no code with the Rust
engine. Everything is computed in float64: BF16 weights are widened exactly, MXFP4 experts
are dequantised exactly, and every intermediate stays float64.

It reads a checkpoint directory in the released layout:
  * config.json, nested (text_config / text_config.linear_attn_config) or flat (keys at
    the root or under "config", with the kda_num_heads / kda_head_dim / situ_beta /
    situ_linear_beta aliases);
  * sharded safetensors through model.safetensors.index.json, or every *.safetensors file
    in sorted order when there is no index;
  * dtypes F32, BF16, F16, U8 (MXFP4 routed experts: weight_packed U8 [rows, cols/2] with
    the LOW nibble = even element, weight_scale U8 [rows, cols/32], E8M0 bias 127).

Library use:
    m = Model.load(dir)
    st = m.new_state()
    out = m.forward(st, ids, want_layers=True, want_routing=True)   # one chunk
    out["logits"]  -> [T, vocab] float64
Helpers: teacher_forced(m, ids), greedy(m, prompt, n), multi_turn(...).

CLI:
    ref64.py CKPT_DIR --ids 1,2,3 [--generate N]
    ref64.py CKPT_DIR --check-oracle [ORACLE_JSON]   (defaults to CKPT_DIR/oracle.json)
"""

import argparse
import glob
import json
import math
import os
import struct
import sys

import numpy as np

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"

# --------------------------------------------------------------------------------------
# safetensors reading (own parser: 8-byte LE header length, JSON header, data region)
# --------------------------------------------------------------------------------------

_DT = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (None, 2), "U8": (np.uint8, 1),
       "F64": (np.float64, 8)}


def read_safetensors(path):
    """Return {name: (dtype_str, shape, raw numpy array in its stored dtype)}."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: too short")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise ValueError(f"{path}: header past end of file")
    hdr = json.loads(buf[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        dt = e["dtype"]
        if dt not in _DT:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        shape = [int(s) for s in e["shape"]]
        b, en = e["data_offsets"]
        numel = int(np.prod(shape)) if shape else 1
        if en < b or en - b != numel * _DT[dt][1] or base + en > len(buf):
            raise ValueError(f"{path}: tensor {name}: bad data_offsets {b},{en}")
        raw = buf[base + b: base + en]
        if dt == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_DT[dt][0]).newbyteorder("<"))
        out[name] = (dt, shape, arr.reshape(shape) if shape else arr.reshape(()))
    return out


def load_tensors(ckpt):
    idx = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        files = sorted(set(wm.values()))
    else:
        wm = None
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ckpt, "*.safetensors")))
    if not files:
        raise ValueError(f"{ckpt}: no safetensors files")
    tensors = {}
    for fn in files:
        for name, v in read_safetensors(os.path.join(ckpt, fn)).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in two shards")
            if wm is not None and wm.get(name) != fn:
                raise ValueError(f"tensor {name} is in {fn} but the index says {wm.get(name)}")
            tensors[name] = v
    if wm is not None:
        missing = [k for k in wm if k not in tensors]
        if missing:
            raise ValueError(f"index names tensors not found in shards: {missing[:5]}")
    return tensors


# --------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)


def mxfp4_dequant(packed, scale):
    """packed U8 [rows, cols/2] (low nibble = element 2j), scale U8 [rows, cols/32]."""
    if packed.dtype != np.uint8 or scale.dtype != np.uint8 or packed.ndim != 2 or scale.ndim != 2:
        raise ValueError("MXFP4 tensors must be 2-D U8")
    rows, half = packed.shape
    if scale.shape[0] != rows or scale.shape[1] * 32 != half * 2:
        raise ValueError(f"MXFP4 geometry: packed {packed.shape} scale {scale.shape} (group 32)")
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.empty((rows, half * 2), dtype=np.uint8)
    codes[:, 0::2] = lo
    codes[:, 1::2] = hi
    vals = E2M1[codes]
    s = scale.astype(np.int64)
    mult = np.ldexp(1.0, s - 127).astype(np.float64)   # exact, incl. 2^-127
    mult[s == 255] = 0.0                               # NaN scale: group contributes nothing
    return vals * np.repeat(mult, 32, axis=1)


# --------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------

class Config:
    pass


def load_config(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        root = json.load(f)
    if "config" in root and isinstance(root["config"], dict) and "text_config" not in root:
        root = root["config"]
    tc = root.get("text_config") if isinstance(root.get("text_config"), dict) else {}
    lac = tc.get("linear_attn_config") if isinstance(tc.get("linear_attn_config"), dict) else {}
    if not lac and isinstance(root.get("linear_attn_config"), dict):
        lac = root["linear_attn_config"]
    missing = []

    def look(*names, required=True, default=None, where=("tc", "lac", "root")):
        for nm in names:
            for w in where:
                d = {"tc": tc, "lac": lac, "root": root}[w]
                if nm in d and d[nm] is not None:
                    return d[nm]
        if required:
            missing.append(names[0])
        return default

    c = Config()
    c.hidden = look("hidden_size")
    c.n_layers = look("num_hidden_layers")
    c.vocab = look("vocab_size")
    c.eps = look("rms_norm_eps")
    # KDA shape only from linear_attn_config or the flat kda_* aliases
    c.kda_heads = lac.get("num_heads") if "num_heads" in lac else look("kda_num_heads", where=("tc", "root"))
    c.kda_dim = lac.get("head_dim") if "head_dim" in lac else look("kda_head_dim", where=("tc", "root"))
    c.conv_k = look("short_conv_kernel_size")
    c.g_min = look("gate_lower_bound")
    c.mla_heads = look("num_attention_heads")
    c.q_lora = look("q_lora_rank")
    c.kv_lora = look("kv_lora_rank")
    c.nope = look("qk_nope_head_dim")
    c.rope = look("qk_rope_head_dim")
    c.v_dim = look("v_head_dim")
    c.n_experts = look("num_experts")
    c.top_k = look("num_experts_per_token")
    c.n_shared = look("num_shared_experts")
    c.latent = look("routed_expert_hidden_size")
    c.moe_inter = look("moe_intermediate_size")
    c.rsf = look("routed_scaling_factor")
    c.first_dense = look("first_k_dense_replace")
    c.inter = look("intermediate_size")
    c.block = look("attn_res_block_size")
    c.beta1 = look("activation_situ_beta", "situ_beta")
    c.beta2 = look("activation_situ_linear_beta", "situ_linear_beta")
    fal = look("full_attn_layers")
    c.renorm = bool(look("moe_renormalize", required=False, default=True))
    c.latent_norm = bool(look("latent_moe_use_norm", required=False, default=True))
    c.mla_gate = bool(look("mla_use_output_gate", required=False, default=True))
    c.moe_freq = look("moe_layer_freq", required=False, default=1)
    if missing:
        raise ValueError("config.json: missing required keys: " + ", ".join(missing))
    if not isinstance(fal, list) or not fal or len(set(fal)) != len(fal) or \
            any((not isinstance(v, int)) or v < 1 or v > c.n_layers for v in fal) or len(fal) >= c.n_layers:
        raise ValueError(f"bad full_attn_layers {fal}")
    kda = lac.get("kda_layers")
    comp = [i for i in range(1, c.n_layers + 1) if i not in fal]
    if kda is not None and sorted(kda) != comp:
        raise ValueError("kda_layers is not the complement of full_attn_layers")
    c.is_mla = [(L + 1) in fal for L in range(c.n_layers)]
    c.full_attn_layers = list(fal)
    if c.block <= 0 or c.conv_k < 1 or c.top_k > c.n_experts:
        raise ValueError("bad block/conv/top_k")
    if c.moe_freq != 1:
        raise ValueError("moe_layer_freq != 1 not supported")
    for k, v in (("hidden_act", "situ"), ("moe_router_activation_func", "sigmoid")):
        got = look(k, required=False)
        if got is not None and got != v:
            raise ValueError(f"{k} = {got!r} not supported")
    if look("mla_use_nope", required=False, default=True) is False:
        raise ValueError("mla_use_nope false not supported")
    if lac.get("use_full_rank_gate", True) is False:
        raise ValueError("use_full_rank_gate false not supported")
    return c


# --------------------------------------------------------------------------------------
# primitives (float64)
# --------------------------------------------------------------------------------------

def sigmoid(x):
    x = np.asarray(x)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def silu(x):
    return x * sigmoid(x)


def rmsnorm(x, w, eps):
    """x [..., n]; statistics over the last axis; eps inside the root; gain w (or None)."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    y = x / np.sqrt(ms + eps)
    return y * w if w is not None else y


def l2n(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ(g, u, b1, b2):
    return (b1 * np.tanh(g / b1) * sigmoid(g)) * (b2 * np.tanh(u / b2))


def attnres(sources, fold, eps):
    """sources: list of [T, H] arrays (oldest first, prefix last); returns the raw mix."""
    V = np.stack(sources, axis=0)                     # [n, T, H]
    K = rmsnorm(V, None, eps)
    s = np.einsum("nth,h->nt", K, fold)
    s = s - s.max(axis=0, keepdims=True)
    e = np.exp(s)
    a = e / e.sum(axis=0, keepdims=True)
    return np.einsum("nt,nth->th", a, V)


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------

class State:
    def __init__(self, m):
        c = m.cfg
        P = c.kda_heads * c.kda_dim
        dt = m.dt
        self.pos = 0
        self.kda_S = {}
        self.conv = {}
        self.mla = {}
        for L in range(c.n_layers):
            if c.is_mla[L]:
                self.mla[L] = {"k": [], "v": [], "r": []}
            else:
                self.kda_S[L] = np.zeros((c.kda_heads, c.kda_dim, c.kda_dim), dtype=dt)
                self.conv[L] = {x: np.zeros((P, c.conv_k - 1), dtype=dt) for x in "qkv"}

    def copy(self):
        import copy
        return copy.deepcopy(self)


class Model:
    MLA_LORA_EPS = 1e-6
    L2_EPS = 1e-6

    @classmethod
    def load(cls, ckpt, mla_lora_eps=1e-6, dtype=np.float64):
        """dtype=np.float32 gives a plain float32 emulation (robustness checks only)."""
        m = cls()
        m.MLA_LORA_EPS = mla_lora_eps
        m.dt = dtype
        m.cfg = c = load_config(ckpt)
        t = load_tensors(ckpt)
        m.used = set()

        def g(name, shape=None):
            if name not in t:
                raise KeyError(f"missing tensor {name}")
            m.used.add(name)
            dt, shp, arr = t[name]
            if dt == "U8":
                raise ValueError(f"{name}: expected a float tensor")
            a = np.asarray(arr, dtype=m.dt)
            if shape is not None:
                if a.size != int(np.prod(shape)):
                    raise ValueError(f"{name}: {shp} does not match expected {shape}")
                a = a.reshape(shape)
            return a

        def q4(name, rows, cols):
            pk, sc = name + ".weight_packed", name + ".weight_scale"
            for n in (pk, sc):
                if n not in t or t[n][0] != "U8":
                    raise KeyError(f"missing U8 tensor {n}")
                m.used.add(n)
            W = mxfp4_dequant(np.asarray(t[pk][2]), np.asarray(t[sc][2]))
            if W.shape != (rows, cols):
                raise ValueError(f"{name}: logical {W.shape} != {(rows, cols)}")
            if not np.any(W != 0):
                raise ValueError(f"{name}: quantises to all zeros")
            return W.astype(m.dt)

        H = c.hidden
        P = c.kda_heads * c.kda_dim
        m.embed = g(PREFIX + "embed_tokens.weight", (c.vocab, H))
        m.lm_head = g(LM_HEAD, (c.vocab, H))
        m.norm = g(PREFIX + "norm.weight", (H,))
        m.out_fold = g(PREFIX + "output_attn_res_norm.weight", (H,)) * \
            g(PREFIX + "output_attn_res_proj.weight", (H,))
        m.layers = []
        for L in range(c.n_layers):
            p = f"{PREFIX}layers.{L}."
            d = {}
            d["in_norm"] = g(p + "input_layernorm.weight", (H,))
            d["post_norm"] = g(p + "post_attention_layernorm.weight", (H,))
            d["attn_fold"] = g(p + "self_attention_res_norm.weight", (H,)) * g(p + "self_attention_res_proj.weight", (H,))
            d["mlp_fold"] = g(p + "mlp_res_norm.weight", (H,)) * g(p + "mlp_res_proj.weight", (H,))
            a = p + "self_attn."
            if c.is_mla[L]:
                nh, qh = c.mla_heads, c.nope + c.rope
                d["q_a"] = g(a + "q_a_proj.weight", (c.q_lora, H))
                d["q_a_norm"] = g(a + "q_a_layernorm.weight", (c.q_lora,))
                d["q_b"] = g(a + "q_b_proj.weight", (nh * qh, c.q_lora))
                d["kv_a"] = g(a + "kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, H))
                d["kv_a_norm"] = g(a + "kv_a_layernorm.weight", (c.kv_lora,))
                d["kv_b"] = g(a + "kv_b_proj.weight", (nh * (c.nope + c.v_dim), c.kv_lora))
                if c.mla_gate:
                    d["g"] = g(a + "g_proj.weight", (nh * c.v_dim, H))
                d["o"] = g(a + "o_proj.weight", (H, nh * c.v_dim))
            else:
                for x in "qkv":
                    d[x] = g(a + f"{x}_proj.weight", (P, H))
                    d[x + "conv"] = g(a + f"{x}_conv1d.weight", (P, c.conv_k))
                d["f_a"] = g(a + "f_a_proj.weight", (c.kda_dim, H))
                d["f_b"] = g(a + "f_b_proj.weight", (P, c.kda_dim))
                alog = g(a + "A_log").reshape(-1)
                if alog.size < c.kda_heads or np.any(alog[c.kda_heads:] != 0):
                    raise ValueError(f"{a}A_log: size {alog.size} / nonzero tail")
                d["A_log"] = alog[:c.kda_heads]
                d["dt_bias"] = g(a + "dt_bias", (P,))
                d["b"] = g(a + "b_proj.weight", (c.kda_heads, H))
                d["g"] = g(a + "g_proj.weight", (P, H))
                d["o_norm"] = g(a + "o_norm.weight", (c.kda_dim,))
                d["o"] = g(a + "o_proj.weight", (H, P))
            if L < c.first_dense:
                f = p + "mlp."
                d["dense"] = True
                d["gate"] = g(f + "gate_proj.weight", (c.inter, H))
                d["up"] = g(f + "up_proj.weight", (c.inter, H))
                d["down"] = g(f + "down_proj.weight", (H, c.inter))
            else:
                f = p + "block_sparse_moe."
                S = c.moe_inter * c.n_shared
                d["dense"] = False
                d["router"] = g(f + "gate.weight", (c.n_experts, H))
                d["bias"] = g(f + "gate.e_score_correction_bias", (c.n_experts,))
                d["ldown"] = g(f + "routed_expert_down_proj.weight", (c.latent, H))
                if c.latent_norm:
                    d["lnorm"] = g(f + "routed_expert_norm.weight", (c.latent,))
                d["lup"] = g(f + "routed_expert_up_proj.weight", (H, c.latent))
                if c.n_shared > 0:
                    d["sg"] = g(f + "shared_experts.gate_proj.weight", (S, H))
                    d["su"] = g(f + "shared_experts.up_proj.weight", (S, H))
                    d["sd"] = g(f + "shared_experts.down_proj.weight", (H, S))
                d["experts"] = []
                for e in range(c.n_experts):
                    ep = f + f"experts.{e}."
                    d["experts"].append((q4(ep + "w1", c.moe_inter, c.latent),
                                         q4(ep + "w2", c.latent, c.moe_inter),
                                         q4(ep + "w3", c.moe_inter, c.latent)))
            m.layers.append(d)
        m.unused = sorted(k for k in t if k not in m.used and k.startswith("language_model."))
        return m

    def new_state(self):
        return State(self)

    # ---------------------------------------------------------------- sub-layers
    def _kda(self, L, d, x, st):
        c = self.cfg
        T = x.shape[0]
        nh, D, K = c.kda_heads, c.kda_dim, c.conv_k
        proj = {n: x @ d[n].T for n in "qkv"}           # [T, P] pre-conv
        conv = {}
        for n in "qkv":
            hist = np.concatenate([st.conv[L][n].T, proj[n]], axis=0)   # [(K-1)+T, P]
            y = np.zeros((T, nh * D), dtype=self.dt)
            for j in range(K):
                y += d[n + "conv"][:, j][None, :] * hist[j:j + T]
            conv[n] = silu(y)
            st.conv[L][n] = hist[T:].T.copy() if K > 1 else st.conv[L][n]
        q = l2n(conv["q"].reshape(T, nh, D), self.L2_EPS) * (D ** -0.5)
        k = l2n(conv["k"].reshape(T, nh, D), self.L2_EPS)
        v = conv["v"].reshape(T, nh, D)
        beta = sigmoid(x @ d["b"].T)                                  # [T, nh]
        z = (x @ d["f_a"].T) @ d["f_b"].T                             # [T, P]
        scale = np.repeat(np.exp(d["A_log"]), D)[None, :]
        gdec = c.g_min * sigmoid(scale * (z + d["dt_bias"][None, :]))
        alpha = np.exp(gdec).reshape(T, nh, D)
        S = st.kda_S[L]
        o = np.empty((T, nh, D), dtype=self.dt)
        for t in range(T):
            S = alpha[t][:, :, None] * S                                # decay key rows
            u = np.einsum("hi,hij->hj", k[t], S)                        # read
            S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
            o[t] = np.einsum("hi,hij->hj", q[t], S)
        st.kda_S[L] = S
        o = rmsnorm(o, d["o_norm"], c.eps).reshape(T, nh * D)
        o = o * sigmoid(x @ d["g"].T)
        return o @ d["o"].T

    def _mla(self, L, d, x, st):
        c = self.cfg
        T = x.shape[0]
        nh, nope, rope, vd = c.mla_heads, c.nope, c.rope, c.v_dim
        cq = rmsnorm(x @ d["q_a"].T, d["q_a_norm"], self.MLA_LORA_EPS)
        q = (cq @ d["q_b"].T).reshape(T, nh, nope + rope)
        kv = x @ d["kv_a"].T
        lat = rmsnorm(kv[:, :c.kv_lora], d["kv_a_norm"], self.MLA_LORA_EPS)
        r = kv[:, c.kv_lora:]
        kvb = (lat @ d["kv_b"].T).reshape(T, nh, nope + vd)
        cache = st.mla[L]
        scale = (nope + rope) ** -0.5
        o = np.empty((T, nh, vd), dtype=self.dt)
        for t in range(T):
            cache["k"].append(kvb[t, :, :nope])
            cache["v"].append(kvb[t, :, nope:])
            cache["r"].append(r[t])
            Kn = np.stack(cache["k"], axis=1)         # [nh, n, nope]
            Vv = np.stack(cache["v"], axis=1)         # [nh, n, vd]
            R = np.stack(cache["r"], axis=0)          # [n, rope]
            s = (np.einsum("hd,hnd->hn", q[t, :, :nope], Kn) + q[t, :, nope:] @ R.T) * scale
            s = s - s.max(axis=1, keepdims=True)
            e = np.exp(s)
            a = e / e.sum(axis=1, keepdims=True)
            o[t] = np.einsum("hn,hnd->hd", a, Vv)
        o = o.reshape(T, nh * vd)
        if c.mla_gate:
            o = o * sigmoid(x @ d["g"].T)
        return o @ d["o"].T

    def _dense(self, d, x):
        c = self.cfg
        return situ(x @ d["gate"].T, x @ d["up"].T, c.beta1, c.beta2) @ d["down"].T

    def _moe(self, d, x, routing):
        c = self.cfg
        T = x.shape[0]
        logits = x @ d["router"].T
        s = sigmoid(logits)
        choice = s + d["bias"][None, :]
        z = x @ d["ldown"].T
        u = np.zeros((T, c.latent), dtype=self.dt)
        idx_all = np.empty((T, c.top_k), dtype=np.int64)
        margins = np.empty(T)
        for t in range(T):
            # descending biased score, ties -> lower expert index
            order = sorted(range(c.n_experts), key=lambda e: (-choice[t, e], e))
            idx = order[:c.top_k]
            idx_all[t] = idx
            margins[t] = choice[t, order[c.top_k - 1]] - choice[t, order[c.top_k]] \
                if c.top_k < c.n_experts else np.inf
            w = s[t, idx]
            if c.renorm and c.top_k > 1:
                w = w / (w.sum() + 1e-20)
            w = w * c.rsf
            for j, e in enumerate(idx):
                W1, W2, W3 = d["experts"][e]
                u[t] += w[j] * (W2 @ situ(W1 @ z[t], W3 @ z[t], c.beta1, c.beta2))
        if c.latent_norm:
            u = rmsnorm(u, d["lnorm"], c.eps)
        y = u @ d["lup"].T
        if c.n_shared > 0:
            y = y + situ(x @ d["sg"].T, x @ d["su"].T, c.beta1, c.beta2) @ d["sd"].T
        if routing is not None:
            routing.append({"topk_idx": idx_all, "margin": margins, "choice": choice})
        return y

    # ---------------------------------------------------------------- whole model
    def forward(self, st, ids, want_layers=False, want_routing=False, want_hidden=False):
        """Process one chunk of ids on top of state st (mutated). Returns dict."""
        c = self.cfg
        ids = list(ids)
        h = self.embed[ids]                       # [T, H]
        res = {"embed": h.copy()}
        B = []
        p = None
        layer_out = []
        routing = {} if want_routing else None
        for L in range(c.n_layers):
            d = self.layers[L]
            p = h
            if B:
                h = attnres(B + [p], d["attn_fold"], c.eps)
            if L % c.block == 0:
                B.append(p)
                p = None
            x = rmsnorm(h, d["in_norm"], c.eps)
            a = self._mla(L, d, x, st) if c.is_mla[L] else self._kda(L, d, x, st)
            p = a if p is None else p + a
            h = attnres(B + [p], d["mlp_fold"], c.eps)
            x = rmsnorm(h, d["post_norm"], c.eps)
            if d["dense"]:
                f = self._dense(d, x)
            else:
                rl = [] if want_routing else None
                f = self._moe(d, x, rl)
                if want_routing:
                    routing[L] = rl[0]
            p = p + f
            h = p
            if want_layers:
                layer_out.append(p.copy())
        hout = attnres(B + [p], self.out_fold, c.eps)
        n = rmsnorm(hout, self.norm, c.eps)
        res["logits"] = n @ self.lm_head.T
        st.pos += len(ids)
        if want_layers:
            res["layer_out"] = np.stack(layer_out, axis=1)   # [T, layers, H]
        if want_hidden:
            res["final_hidden"] = n
        if want_routing:
            res["routing"] = routing
        return res


# --------------------------------------------------------------------------------------
# drivers
# --------------------------------------------------------------------------------------

def top2_gap(row):
    s = np.sort(row)
    return float(s[-1] - s[-2])


def argmax(row):
    return int(np.argmax(row))     # first index of the maximum


def teacher_forced(m, ids, **kw):
    st = m.new_state()
    return m.forward(st, ids, **kw)


def greedy(m, prompt, n, st=None):
    """Prefill prompt as one chunk, then decode n tokens one at a time (carried state).
    Returns (generated ids, gaps, logits rows that chose them, state). The last generated id
    is NOT forwarded."""
    st = st if st is not None else m.new_state()
    out = m.forward(st, prompt)
    row = out["logits"][-1]
    gen, gaps, rows = [], [], []
    for i in range(n):
        tok = argmax(row)
        gen.append(tok)
        gaps.append(top2_gap(row))
        rows.append(row)
        if i + 1 < n:
            row = m.forward(st, [tok])["logits"][-1]
    return gen, gaps, rows, st


def f32_bits(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).view(np.uint32).tolist()


def from_bits(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32).astype(np.float64)


def rel_err(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_oracle(m, o, log=print):
    """Compare against an oracle.json dict. Returns (ok, figures)."""
    fig = {}
    ok = True

    def chk(name, cond):
        nonlocal ok
        fig[name] = bool(cond)
        if not cond:
            ok = False
        log(f"  {name}: {'OK' if cond else 'MISMATCH'}")

    prompt = o["prompt_ids"]
    n = o["n_generated"]
    gen, gaps, rows, _ = greedy(m, prompt, n)
    chk("greedy full_ids", prompt + gen == o["full_ids"])
    fig["greedy_gap_max_abs_diff"] = float(np.max(np.abs(np.array(gaps) - np.array(o["top2_gap"]))))
    # the first generated row is the last-prompt logits (prefill)
    fig["rel_logits_last_prompt_vs_f32bits"] = rel_err(rows[0], from_bits(o["logits_last_prompt_f32_bits"]))
    full = o["full_ids"]
    tf = teacher_forced(m, full, want_layers=True, want_routing=True, want_hidden=True)
    L = tf["logits"]
    chk("tf_pred", [argmax(r) for r in L] == o["tf_pred"])
    fig["tf_gap_max_abs_diff"] = float(np.max(np.abs(np.array([top2_gap(r) for r in L]) - np.array(o["tf_top2_gap"]))))
    P = len(prompt) - 1
    fig["rel_tf_logits_last_prompt"] = rel_err(L[P], from_bits(o["logits_last_prompt_f32_bits"]))
    fig["rel_tf_logits_last"] = rel_err(L[-1], from_bits(o["logits_last_f32_bits"]))
    chk("bits logits_last_prompt exact", f32_bits(L[P]) == o["logits_last_prompt_f32_bits"])
    chk("bits logits_last exact", f32_bits(L[-1]) == o["logits_last_f32_bits"])
    fig["rel_incremental_vs_tf_last_prompt"] = rel_err(rows[0], L[P])
    if "trace" in o:
        tr = o["trace"]
        worst = 0.0
        exact = True
        for i, pos in enumerate(tr["positions"]):
            for key, arr in (("layer_out_f32_bits", tf["layer_out"][pos]),
                             ("embed_f32_bits", tf["embed"][pos]),
                             ("final_hidden_f32_bits", tf["final_hidden"][pos])):
                if key not in tr:
                    continue
                want = np.asarray(tr[key][i], dtype=np.uint32)
                worst = max(worst, rel_err(arr.reshape(-1), from_bits(want.reshape(-1))))
                exact &= f32_bits(arr.reshape(-1)) == want.reshape(-1).tolist()
        fig["rel_trace_worst"] = worst
        fig["trace_bits_exact"] = bool(exact)
    if "routing" in o:
        rok = True
        mworst = 0.0
        for r in o["routing"]:
            got = tf["routing"][r["layer"]]
            rok &= got["topk_idx"].tolist() == r["topk_idx"]
            mworst = max(mworst, float(np.max(np.abs(got["margin"] - np.array(r["margin"])) /
                                           np.maximum(np.abs(np.array(r["margin"])), 1e-300))))
        chk("routing topk_idx", rok)
        fig["routing_margin_max_rel_diff"] = mworst   # stored margins may be rounded
    mt = o.get("multi_turn")
    if mt:
        t1 = mt["turn1_ids"]
        r1, g1, rows1, st = greedy(m, t1, len(mt["turn1_reply_ids"]))
        chk("multi_turn turn1_reply_ids", r1 == mt["turn1_reply_ids"])
        fig["rel_mt_logits_end_turn1"] = rel_err(rows1[0], from_bits(mt["logits_end_turn1_f32_bits"]))
        # the last reply id has not been forwarded: it leads the turn-2 chunk
        chunk = [r1[-1]] + mt["turn2_ids"]
        out = m.forward(st, chunk)
        start = len(t1) + len(r1)
        chk("multi_turn chunk argmaxes == tf_pred slice",
            [argmax(r) for r in out["logits"][1:]] == mt["tf_pred"][start:start + len(mt["turn2_ids"])])
        fig["rel_mt_logits_end_turn2_prompt"] = rel_err(out["logits"][-1], from_bits(mt["logits_end_turn2_prompt_f32_bits"]))
        row = out["logits"][-1]
        r2, g2 = [], []
        for i in range(len(mt["turn2_reply_ids"])):
            tok = argmax(row)
            r2.append(tok)
            g2.append(top2_gap(row))
            if i + 1 < len(mt["turn2_reply_ids"]):
                row = m.forward(st, [tok])["logits"][-1]
        chk("multi_turn turn2_reply_ids", r2 == mt["turn2_reply_ids"])
        chk("multi_turn full_ids", t1 + r1 + mt["turn2_ids"] + r2 == mt["full_ids"])
        fig["mt_gap_max_abs_diff"] = float(np.max(np.abs(np.array(g1 + g2) - np.array(mt["top2_gap"]))))
        tfm = teacher_forced(m, mt["full_ids"])["logits"]
        chk("multi_turn tf_pred", [argmax(r) for r in tfm] == mt["tf_pred"])
        fig["rel_mt_tf_logits_end_turn1"] = rel_err(tfm[len(t1) - 1], from_bits(mt["logits_end_turn1_f32_bits"]))
        fig["rel_mt_tf_logits_end_turn2_prompt"] = rel_err(tfm[start + len(mt["turn2_ids"]) - 1],
                                                          from_bits(mt["logits_end_turn2_prompt_f32_bits"]))
        fig["rel_mt_tf_logits_last"] = rel_err(tfm[-1], from_bits(mt["logits_last_f32_bits"]))
        chk("multi_turn bits logits_last exact", f32_bits(tfm[-1]) == mt["logits_last_f32_bits"])
    for k, v in fig.items():
        if isinstance(v, float):
            log(f"  {k}: {v:.3e}")
        elif k == "trace_bits_exact":
            log(f"  {k}: {v}")
    return ok, fig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--generate", type=int, default=0)
    ap.add_argument("--check-oracle", nargs="?", const="", default=None, metavar="ORACLE_JSON")
    ap.add_argument("--mla-lora-eps", type=float, default=1e-6)
    ap.add_argument("--float32", action="store_true", help="plain float32 emulation instead of float64")
    ap.add_argument("--json-out", help="write check figures here")
    a = ap.parse_args()
    m = Model.load(a.ckpt, mla_lora_eps=a.mla_lora_eps,
                   dtype=np.float32 if a.float32 else np.float64)
    if m.unused:
        print(f"warning: {len(m.unused)} language_model tensors unused, e.g. {m.unused[:3]}", file=sys.stderr)
    if a.check_oracle is not None:
        path = a.check_oracle or os.path.join(a.ckpt, "oracle.json")
        with open(path) as f:
            o = json.load(f)
        print(f"checking {path}")
        ok, fig = check_oracle(m, o)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(fig, f, indent=1)
        print("PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)
    if a.ids:
        ids = [int(s) for s in a.ids.split(",")]
        if a.generate:
            gen, gaps, _, _ = greedy(m, ids, a.generate)
            print(json.dumps({"generated": gen, "top2_gap": gaps}))
        else:
            L = teacher_forced(m, ids)["logits"]
            print(json.dumps({"argmax": [argmax(r) for r in L], "top2_gap": [top2_gap(r) for r in L]}))


if __name__ == "__main__":
    main()
