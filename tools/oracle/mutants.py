#!/usr/bin/env python3
"""How strongly an oracle fixture pins down the traps of MODEL.md section 7.

    python3 tools/oracle/mutants.py tests/fixtures/tiny2

Runs ref64 with one deliberate mistake at a time (a "mutant") on the fixture's full_ids and
reports, per mutant: the relative logit error against the fixture's stored float32 logits
(max|got - want| / max|want| at the two stored positions), how many teacher-forced argmaxes
differ from tf_pred, and whether greedy decoding still reproduces full_ids. A mutant an
engine-level check would not notice shows up as rel_err below the float32-engine noise
(~1e-5) with no argmax change.
"""

import copy
import json
import os
import sys

import numpy as np

sys.dont_write_bytecode = True   # keep tools/oracle free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref64  # noqa: E402


def run(m, o):
    full = o["full_ids"]
    L = ref64.teacher_forced(m, full)["logits"]
    P = len(o["prompt_ids"]) - 1
    err = max(ref64.rel_err(L[P], ref64.from_bits(o["logits_last_prompt_f32_bits"])),
              ref64.rel_err(L[-1], ref64.from_bits(o["logits_last_f32_bits"])))
    diff = sum(int(np.argmax(r)) != t for r, t in zip(L, o["tf_pred"]))
    gen, _, _, _ = ref64.greedy(m, o["prompt_ids"], o["n_generated"])
    return err, diff, o["prompt_ids"] + gen == o["full_ids"]


def main():
    ckpt = sys.argv[1]
    with open(os.path.join(ckpt, "oracle.json")) as f:
        o = json.load(f)
    base = ref64.Model.load(ckpt)
    c = base.cfg
    muts = {}

    def mutant(name):
        def deco(fn):
            muts[name] = fn
            return fn
        return deco

    @mutant("none (reference)")
    def _(m):
        pass

    @mutant("MLA LoRA-norm eps = 1e-5")
    def _(m):
        m.MLA_LORA_EPS = 1e-5

    @mutant("MLA LoRA-norm eps = rms_norm_eps")
    def _(m):
        m.MLA_LORA_EPS = m.cfg.eps

    @mutant("rms_norm_eps hard-coded 1e-5")
    def _(m):
        m.cfg.eps = 1e-5

    @mutant("rms_norm_eps hard-coded 1e-6")
    def _(m):
        m.cfg.eps = 1e-6

    @mutant("gate_lower_bound hard-coded -5")
    def _(m):
        m.cfg.g_min = -5.0

    @mutant("attn_res_block_size hard-coded 3")
    def _(m):
        m.cfg.block = 3

    @mutant("MXFP4 nibbles swapped")
    def _(m):
        for d in m.layers:
            if not d["dense"]:
                d["experts"] = [tuple(W.reshape(W.shape[0], -1, 2)[:, :, ::-1].reshape(W.shape) for W in ws)
                                for ws in d["experts"]]

    @mutant("routing bias ignored")
    def _(m):
        for d in m.layers:
            if not d["dense"]:
                d["bias"] = np.zeros_like(d["bias"])

    @mutant("routed_scaling_factor ignored")
    def _(m):
        m.cfg.rsf = 1.0

    @mutant("no top-k renormalisation")
    def _(m):
        m.cfg.renorm = False

    @mutant("A_log ignored (exp(A)=1)")
    def _(m):
        for d in m.layers:
            if "A_log" in d:
                d["A_log"] = np.zeros_like(d["A_log"])

    @mutant("KDA conv kernel truncated to last tap")
    def _(m):
        for d in m.layers:
            for x in "qkv":
                if x + "conv" in d:
                    d[x + "conv"][:, :-1] = 0.0

    @mutant("SiTU without caps")
    def _(m):
        ref64.situ = lambda g, u, b1, b2: g * ref64.sigmoid(g) * u

    @mutant("MLA softmax scale nope^-0.5 instead of (nope+rope)^-0.5")
    def _(m):
        k = np.sqrt((c.nope + c.rope) / c.nope)     # scaling q scales every score by k
        for d in m.layers:
            if "q_b" in d:
                d["q_b"] = d["q_b"] * k

    @mutant("MoE combine weights from biased scores")
    def _(m):
        m.biased_weights = True

    @mutant("MLA rope slot dropped (q_r . r not scored)")
    def _(m):
        qh = c.nope + c.rope
        for d in m.layers:
            if "q_b" in d:
                q = d["q_b"].copy().reshape(c.mla_heads, qh, -1)
                q[:, c.nope:, :] = 0.0
                d["q_b"] = q.reshape(c.mla_heads * qh, -1)

    @mutant("shared experts dropped")
    def _(m):
        m.cfg.n_shared = 0

    orig_situ = ref64.situ
    orig_sigmoid = ref64.sigmoid
    print(f"{'mutant':45s} {'rel_err':>10s} {'tf argmax diffs':>16s} {'greedy ok':>10s}")
    for name, fn in muts.items():
        m = copy.copy(base)
        m.cfg = copy.copy(base.cfg)
        m.layers = [dict(d) for d in base.layers]
        for d in m.layers:
            for x in "qkv":
                if x + "conv" in d:
                    d[x + "conv"] = d[x + "conv"].copy()
        fn(m)
        if getattr(m, "biased_weights", False):
            # the weights are read as s[idx]; shift the router's sigmoid by the bias so that
            # s itself becomes the biased score (selection is unchanged, weights drift)
            def moe(d, x, routing, _m=m):
                d2 = dict(d)
                d2["bias"] = np.zeros_like(d["bias"])
                saved = ref64.sigmoid
                ref64.sigmoid = lambda z, _b=d["bias"], _x=x: (orig_sigmoid(z) + _b) \
                    if np.shape(z) == (x.shape[0], len(_b)) else orig_sigmoid(z)
                try:
                    return ref64.Model._moe(_m, d2, x, routing)
                finally:
                    ref64.sigmoid = saved
            m._moe = moe
        err, diff, ok = run(m, o)
        ref64.situ = orig_situ
        ref64.sigmoid = orig_sigmoid
        print(f"{name:45s} {err:10.2e} {diff:16d} {str(ok):>10s}")


if __name__ == "__main__":
    main()
