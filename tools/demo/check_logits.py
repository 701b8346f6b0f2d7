#!/usr/bin/env python3
"""Logit agreement of the exported demo model: PyTorch vs the float64 NumPy oracle vs k3.

    python3 tools/demo/check_logits.py --model assets/demo --k3 /work/target-demo/release/k3 \
        --expected tests/fixtures/demo/expected_logits.json

For each committed prompt (chat-rendered and raw), computes the last-position logits with
  * the PyTorch model (model.py) loaded from the exported files, float32, sequential KDA,
  * the same in float64,
  * tools/oracle/ref64.py (independent float64 NumPy reference),
  * `k3 run MODEL --ids ... --dump-logits FILE --gen 1` (row 0 = after the prompt),
and reports max|a-b| / max|b| per pair, the argmax agreement and the top-2 gap. Writes the
float32 PyTorch logits with the prompt ids and the measured tolerance to --expected.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "oracle"))
sys.dont_write_bytecode = True
import bpe      # noqa: E402
import corpus   # noqa: E402
import model as M   # noqa: E402
import ref64    # noqa: E402


def prompts(tok):
    def chat(msgs, thinking):
        return tok.encode_segments(corpus.render_segments(msgs, thinking, "max", add_generation_prompt=True))
    return [
        ("chat_hi", "chat, thinking off: 'Hi!'", chat([{"role": "user", "content": "Hi!"}], False)),
        ("chat_capital_france", "chat, thinking off: 'What is the capital of France?'",
         chat([{"role": "user", "content": "What is the capital of France?"}], False)),
        ("chat_recall_turn3", "chat, thinking off, third turn of a recall conversation",
         chat([{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": "Nice to meet you, Ada!"},
               {"role": "user", "content": "What is 7 plus 5?"},
               {"role": "assistant", "content": "7 plus 5 is 12."},
               {"role": "user", "content": "What is my name?"}], False)),
        ("chat_think_sum", "chat, thinking on (effort max): 'What is 47 plus 38?'",
         chat([{"role": "user", "content": "What is 47 plus 38?"}], True)),
        ("raw_story", "raw text: 'Once upon a time, there was a tiny turtle named'",
         tok.encode("Once upon a time, there was a tiny turtle named", True)),
    ]


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / np.max(np.abs(b)))


def k3_logits(k3, model, ids, vocab):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "l.bin")
        p = subprocess.run([k3, "run", model, "--ids", ",".join(map(str, ids)), "--dump-logits", path,
                            "--gen", "1", "--threads", "1"], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(p.stderr)
        x = np.fromfile(path, dtype="<f4")
    assert x.size == vocab, x.size
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "demo"))
    ap.add_argument("--k3", default="/work/target-demo/release/k3")
    ap.add_argument("--expected")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = bpe.Tok(a.model)
    m32 = M.load_checkpoint(a.model, torch.float32).eval()
    m64 = M.load_checkpoint(a.model, torch.float64).eval()
    r64 = ref64.Model.load(a.model)
    assert not r64.unused
    rows, out = [], []
    worst = {"torch32_vs_ref64": 0.0, "torch64_vs_ref64": 0.0, "torch32_chunked_vs_ref64": 0.0,
             "k3_vs_torch32": 0.0, "k3_vs_ref64": 0.0}
    for name, desc, ids in prompts(tok):
        x = torch.tensor([ids])
        with torch.no_grad():
            t32 = m32(x, mode="sequential")[0, -1].numpy()
            t32c = m32(x, mode="chunked")[0, -1].numpy()
            t64 = m64(x, mode="sequential")[0, -1].numpy()
        o = ref64.teacher_forced(r64, ids)["logits"][-1]
        kk = k3_logits(a.k3, a.model, ids, tok.vocab)
        f = {"torch32_vs_ref64": rel(t32, o), "torch64_vs_ref64": rel(t64, o),
             "torch32_chunked_vs_ref64": rel(t32c, o), "k3_vs_torch32": rel(kk, t32), "k3_vs_ref64": rel(kk, o)}
        for k, v in f.items():
            worst[k] = max(worst[k], v)
        am = {"ref64": int(np.argmax(o)), "torch32": int(np.argmax(t32)), "k3": int(np.argmax(kk))}
        gap = float(np.sort(o)[-1] - np.sort(o)[-2])
        print(f"{name:22s} T={len(ids):3d} argmax {am} '{tok.decode([am['ref64']])}' gap {gap:.3f} "
              + " ".join(f"{k} {v:.2e}" for k, v in f.items()))
        rows.append({"name": name, "what": desc, "ids": ids, "argmax": am, "top2_gap": gap, **f})
        out.append({"name": name, "what": desc, "ids": ids, "argmax": am["torch32"], "top2_gap": gap,
                    "logits_last": [float(np.format_float_positional(np.float32(v), unique=True)) for v in t32]})
    print("worst:", json.dumps({k: float(f"{v:.3e}") for k, v in worst.items()}))
    if a.expected:
        measured = worst["k3_vs_torch32"]
        doc = {
            "format": "k3-demo-expected-logits/1",
            "model": "assets/demo",
            "source": "tools/demo/model.py (PyTorch, float32, sequential KDA) on the exported files",
            "metric": "max_i |k3[i] - expected[i]| / max_i |expected[i]| over all logits of the last "
                      "prompt position, plus equal argmax",
            "measured": {k: float(f"{v:.3e}") for k, v in worst.items()},
            "tolerance": 1e-4,
            "tolerance_note": "about 10x the largest k3-vs-torch relative error measured when this file "
                              "was written; the float64 oracle sits between the two",
            "prompts": out,
        }
        with open(a.expected, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))
            fh.write("\n")
        print(f"wrote {a.expected}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"worst": worst, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
