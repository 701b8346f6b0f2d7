#!/usr/bin/env python3
"""Speculative against serial decoding through `k3 run`, side by side.

Runs `k3 run --json` with `--spec off` and with each mode given, alternated, for a number of
rounds (page cache dropped before each run where permitted), and prints per mode the median
decode seconds per token, the ratio of serial to it (tokens/s speed-up), tokens per pass,
acceptance and bytes read per generated token. The generated ids of every run must be equal;
the script fails otherwise.

    tools/bench_spec.py --k3 target/release/k3 [--model DIR] (--prompt-file P | --ids 1,2,3) \
        [--mem GB] [--gen N] [--rounds R] [--modes auto,4]
"""

import argparse
import json
import statistics
import subprocess
import sys


def drop_caches():
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def run(args, mode):
    cmd = [args.k3, "run"]
    if args.model:
        cmd.append(args.model)
    if args.ids:
        cmd += ["--ids", args.ids]
    else:
        cmd += ["--prompt-file", args.prompt_file]
    cmd += ["--gen", str(args.gen), "--json", "--spec", mode]
    if args.mem:
        cmd += ["--mem", args.mem]
    drop_caches()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k3", required=True)
    p.add_argument("--model")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-file")
    prompt.add_argument("--ids", help="prompt token ids, comma-separated")
    p.add_argument("--mem")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="auto")
    args = p.parse_args()
    modes = ["off"] + [m for m in args.modes.split(",") if m != "off"]
    results = {m: [] for m in modes}
    ids = None
    for _ in range(args.rounds):
        for m in modes:
            j = run(args, m)
            if ids is None:
                ids = j["generated_ids"]
            elif j["generated_ids"] != ids:
                sys.exit(f"--spec {m} generated different ids: {j['generated_ids']} vs {ids}")
            results[m].append(j)
    serial = statistics.median(j["decode_seconds_per_token"] for j in results["off"])
    print(f"model {args.model or 'demo'}  budget {args.mem or 'resident'}  "
          f"prompt {args.prompt_file}  gen {args.gen}  rounds {args.rounds}")
    print(f"{'mode':>6} {'s/token':>10} {'speed-up':>9} {'tok/pass':>9} {'accept':>7} "
          f"{'bytes/token':>12}")
    for m in modes:
        s = statistics.median(j["decode_seconds_per_token"] for j in results[m])
        sp = results[m][-1]["spec"]
        bpt = statistics.median(j["spec"]["bytes_read_per_token"] for j in results[m])
        print(f"{m:>6} {s:>10.5f} {serial / s:>8.2f}x {sp['tokens_per_pass']:>9.2f} "
              f"{sp['acceptance']:>7.2f} {bpt:>12.0f}")


if __name__ == "__main__":
    main()
