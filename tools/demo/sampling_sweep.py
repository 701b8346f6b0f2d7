#!/usr/bin/env python3
"""Choose the demo model's sampling defaults by measurement (its generation_config.json).

    python3 tools/demo/sampling_sweep.py --k3 target/release/k3 \
        [--temperatures 1.0,0.8,0.6,0.4,0.2] [--top-ps 1.0,0.9,0.8] [--seeds 1-8] [--out FILE]

For every temperature × top-p × seed, drives `k3 chat assets/demo --plain --jsonl --seed S
--temperature T --top-p P` (thinking at its default, as a new user gets it) through the
held-out set (tests/fixtures/demo/heldout.json, which no training record contains):
  * introductions: the first turn of each recall conversation that gives a name; right when the
    reply names the person (the name as a whole word);
  * recalls: the third reply of each recall conversation, scored by the held-out rule;
  * facts: each fact question as the only turn of a fresh conversation.
The model directory is copied without its generation_config.json, so only the flags given
decide the sampling. Prints one Markdown table row per setting (sums over the seeds).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import corpus  # noqa: E402


def seeds(text):
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def run(k3, model, lines, args, env):
    cmd = [k3, "chat", model, "--plain", "--jsonl", "--threads", "1"] + args
    p = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True,
                       timeout=600, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"k3 exited with {p.returncode}")
    return [json.loads(x) for x in p.stdout.splitlines() if x.strip().startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", default=os.path.join(ROOT, "target", "release", "k3"))
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "demo"))
    ap.add_argument("--heldout",
                    default=os.path.join(ROOT, "tests", "fixtures", "demo", "heldout.json"))
    ap.add_argument("--temperatures", default="1.0,0.8,0.6,0.4,0.2")
    ap.add_argument("--top-ps", default="1.0,0.9,0.8")
    ap.add_argument("--seeds", default="1-8")
    ap.add_argument("--out")
    a = ap.parse_args()
    with open(a.heldout) as f:
        held = json.load(f)
    work = tempfile.mkdtemp(prefix="k3-sweep-")
    model = os.path.join(work, "model")
    os.mkdir(model)
    for name in os.listdir(a.model):
        if name != "generation_config.json":
            shutil.copy(os.path.join(a.model, name), model)
    env = dict(os.environ, K3_CONFIG=os.path.join(work, "no-config.toml"),
               K3_DATA_DIR=os.path.join(work, "data"))

    lines, plan = [], []
    for fct in held["facts"]:
        lines += [fct["question"], "/new"]
        plan.append(("fact", fct))
    for r in held["recall"]:
        lines += r["turns"] + ["/new"]
        plan.append(("recall", r))
    intro_total = sum(1 for r in held["recall"] if r["slot"] == "name")
    rows = []
    print("| temperature | top_p | introductions | recalls | facts | sample misses |")
    print("|---|---|---|---|---|---|")
    for t in [float(x) for x in a.temperatures.split(",")]:
        for p in [float(x) for x in a.top_ps.split(",")]:
            intro = rec = fac = 0
            misses = []
            ss = seeds(a.seeds)
            for s in ss:
                reps = run(a.k3, model, lines,
                           ["--seed", str(s), "--temperature", str(t), "--top-p", str(p)], env)
                want = len(held["facts"]) + 3 * len(held["recall"])
                if len(reps) != want:
                    raise SystemExit(f"expected {want} replies, got {len(reps)}")
                i = 0
                for kind, item in plan:
                    if kind == "fact":
                        r = reps[i]["reply"]
                        i += 1
                        fac += corpus.score_reply(r, item["expect"], item.get("mention", ()))
                        continue
                    three = [reps[i + j]["reply"] for j in range(3)]
                    i += 3
                    if item["slot"] == "name":
                        ok = item["value"].lower() in corpus.normalise(three[0]).split(" ")
                        intro += ok
                        if not ok and len(misses) < 2:
                            misses.append(three[0])
                    ok = corpus.score_reply(three[2], item["expect"], ())
                    rec += ok
                    if not ok and len(misses) < 3:
                        misses.append(three[2])
            n = len(ss)
            row = {"temperature": t, "top_p": p, "seeds": ss,
                   "introductions": [intro, intro_total * n],
                   "recalls": [rec, len(held["recall"]) * n],
                   "facts": [fac, len(held["facts"]) * n], "misses": misses}
            rows.append(row)
            print(f"| {t} | {p} | {intro}/{intro_total * n} | {rec}/{len(held['recall']) * n} "
                  f"| {fac}/{len(held['facts']) * n} | {'; '.join(repr(m) for m in misses)} |",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
