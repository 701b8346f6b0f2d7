#!/usr/bin/env python3
"""Score the demo model through the k3 binary (not through PyTorch).

    python3 tools/demo/eval_k3.py --k3 /work/target-demo/release/k3 --model assets/demo \
        [--think] [--out /tmp/demo/eval_k3.json]

Drives `k3 chat MODEL --plain --jsonl --greedy [--no-think]` with one input script:
  * each held-out fact question (tests/fixtures/demo/heldout.json) as the only turn of a fresh
    conversation (`/new` between them);
  * each recall conversation: three user turns, scored on the third reply;
  * the raw-mode prompts (`/raw`, `/set max_tokens 24`): the continuation must contain no special
    token and only words that occur in the training corpus (--corpus); capitalised words that
    do not are reported as new names (the corpus teaches the model to make names up).
Scoring rule: corpus.score_reply (see the `scoring` text in heldout.json).
"""

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import corpus  # noqa: E402


def run_script(k3, model, lines, think, extra=()):
    cmd = [k3, "chat", model, "--plain", "--jsonl", "--greedy"] + ([] if think else ["--no-think"]) + list(extra)
    p = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"k3 exited with {p.returncode}")
    out = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out, p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", default="/work/target-demo/release/k3")
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "demo"))
    ap.add_argument("--heldout", default=os.path.join(ROOT, "tests", "fixtures", "demo", "heldout.json"))
    ap.add_argument("--corpus", default="/tmp/demo/corpus.jsonl")
    ap.add_argument("--think", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    with open(a.heldout) as f:
        held = json.load(f)

    # facts and recall in one session, /new between conversations
    lines, expect = [], []
    for fct in held["facts"]:
        lines += [fct["question"], "/new"]
        expect.append(("fact", fct))
    for r in held["recall"]:
        lines += r["turns"] + ["/new"]
        expect.append(("recall", r))
    replies, _ = run_script(a.k3, a.model, lines, a.think)
    n_expected = len(held["facts"]) + 3 * len(held["recall"])
    if len(replies) != n_expected:
        raise SystemExit(f"expected {n_expected} turns, got {len(replies)}")
    i = 0
    facts, recall = [], []
    for kind, item in expect:
        if kind == "fact":
            rep = replies[i]["reply"]
            i += 1
            facts.append({"question": item["question"], "reply": rep, "expect": item["expect"],
                          "ok": corpus.score_reply(rep, item["expect"], item.get("mention", ()))})
        else:
            reps = [replies[i + j]["reply"] for j in range(3)]
            i += 3
            recall.append({"turns": item["turns"], "replies": reps, "expect": item["expect"],
                           "ok": corpus.score_reply(reps[2], item["expect"], item.get("mention", ()))})
    nf = sum(x["ok"] for x in facts)
    nr = sum(x["ok"] for x in recall)

    # raw mode
    raw = []
    if os.path.exists(a.corpus):
        words = set(corpus.corpus_words([a.corpus]))
        with open(os.path.join(a.model, "config.json")) as f:
            n_ranks = json.load(f)["text_config"]["vocab_size"] - 256
        lines = ["/raw", "/set max_tokens 24"]
        for p in held["raw_prompts"]:
            lines += [p, "/new"]
        reps, _ = run_script(a.k3, a.model, lines, a.think)
        specials = re.compile(r"<\|[^|]*\|>|\[(BOS|EOS|EOT|UNK|PAD|start_header_id|end_header_id)\]")
        for p, r in zip(held["raw_prompts"], reps):
            text = r["reply"]
            # every lowercase word must occur in lowercase in the training corpus (the rule of
            # tests/fixtures/demo/words.txt); capitalised ones that do not are new proper names,
            # which the corpus teaches the model to make up
            ws = re.findall(r"[A-Za-z]+", text)
            oov = [w for w in ws if w.lower() not in words and not w[0].isupper()]
            if oov and oov[-1] == ws[-1] and text[-1:].isalpha() and any(v.startswith(ws[-1]) for v in words):
                oov.pop()      # the token cap cut the last word: a fragment of a corpus word
            names = [w for w in ws if w.lower() not in words and w[0].isupper()]
            bad_ids = [t for t in r["generated_ids"] if t >= n_ranks]
            raw.append({"prompt": p, "continuation": text, "oov_words": oov, "new_names": names,
                        "special_ids": bad_ids, "ok": not oov and not bad_ids and not specials.search(text)})
    res = {"think": a.think, "facts_correct": nf, "facts_total": len(facts), "recall_correct": nr,
           "recall_total": len(recall), "raw_ok": sum(x["ok"] for x in raw), "raw_total": len(raw),
           "facts": facts, "recall": recall, "raw": raw}
    print(f"k3 {'think' if a.think else 'no-think'}: facts {nf}/{len(facts)}, recall {nr}/{len(recall)}, "
          f"raw {res['raw_ok']}/{len(raw)}")
    for x in facts:
        if not x["ok"]:
            print(f"  miss: {x['question']!r} -> {x['reply']!r} (want {x['expect']})")
    for x in recall:
        if not x["ok"]:
            print(f"  miss: {x['turns']} -> {x['replies']} (want {x['expect']})")
    for x in raw:
        print(f"  raw: {x['prompt']!r} -> {x['continuation']!r}{'' if x['ok'] else '  <-- ' + str(x['oov_words'] or x['special_ids'])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
