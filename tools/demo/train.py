#!/usr/bin/env python3
"""Train the k3 demo model on the synthetic corpus and export it in the released format.

    nice -n 10 /tmp/dv/bin/python tools/demo/train.py --out assets/demo --work /tmp/demo

Steps (each timed; the times go to WORK/train_log.json):
  1. corpus     corpus.generate(seed) -> WORK/corpus.jsonl (held-out material checked per record)
  2. tokenizer  bpe.train on the corpus -> WORK/tok/{tiktoken.model,tokenizer_config.json}
  3. tokenise   chat records rendered exactly as src/session/template.rs; raw text packed
  4. train      AdamW, bf16 autocast for the matmuls (KDA recurrence and router in float32),
                routing-bias updates (aux-loss-free balancing), cosine schedule
  5. qat        the last --qat-steps run with MXFP4 fake-quantised routed experts
                (straight-through), the exporter's exact quantiser
  6. export     OUT/: config.json (nested, released shape), model-0000k-of-00000n.safetensors,
                model.safetensors.index.json, tiktoken.model, tokenizer_config.json
  7. eval       the exported checkpoint, read back, answers tests/fixtures/demo/heldout.json
                (Python greedy driver of the same template)
"""

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import bpe      # noqa: E402
import corpus   # noqa: E402
import model as M   # noqa: E402

TEMPLATE_CONFIG = os.path.join(ROOT, "tests", "fixtures", "tiny", "config.json")
HELDOUT = os.path.join(ROOT, "tests", "fixtures", "demo", "heldout.json")


# ---------------------------------------------------------------------------------------------
# tokenisation and batching
# ---------------------------------------------------------------------------------------------

def tokenise_chat(tok, r, max_len, user_w):
    """ids and per-token loss weights of one conversation, cut after the last complete
    assistant message that fits in max_len tokens. Assistant messages (from the generation
    prompt on) get weight 1, everything else user_w."""
    msgs = r["messages"]
    segs = corpus.render_segments([], r["thinking"], r["effort"])
    ids = tok.encode_segments(segs)
    w = [user_w] * len(ids)
    best = None
    for m in msgs:
        pre = corpus.render_segments([], r["thinking"], r["effort"])
        one = corpus.render_segments([m], r["thinking"], r["effort"])[len(pre):]
        part = tok.encode_segments(one)
        if m["role"] == "assistant":
            # the generation prompt (open message, open channel) is context: weight user_w
            gp = corpus.render_segments([], r["thinking"], r["effort"], add_generation_prompt=True)
            gp = gp[len(corpus.render_segments([], r["thinking"], r["effort"])):]
            ngp = len(tok.encode_segments(gp))
            pw = [user_w] * ngp + [1.0] * (len(part) - ngp)
        else:
            pw = [user_w] * len(part)
        if len(ids) + len(part) > max_len:
            break
        ids += part
        w += pw
        if m["role"] == "assistant":
            best = len(ids)
    if best is None:
        return None
    return ids[:best], w[:best]


def build_rows(tok, records, seq, user_w, log):
    chat, raw_stream = [], []
    for r in records:
        if r["kind"] == "chat":
            t = tokenise_chat(tok, r, seq + 1, user_w)
            if t is not None:
                chat.append(t)
        else:
            raw_stream += tok.encode(r["text"] + "\n\n", True)
    raw = []
    for i in range(0, len(raw_stream) - (seq + 1), seq + 1):
        ids = raw_stream[i:i + seq + 1]
        raw.append((ids, [1.0] * len(ids)))
    log(f"rows: {len(chat)} chat, {len(raw)} raw; chat tokens {sum(len(c[0]) for c in chat)}, "
        f"raw tokens {len(raw) * (seq + 1)}")
    return chat + raw


def make_batches(rows, batch_tokens, rng, chunk=16):
    """Bucket rows by length; pad each batch to its longest row (rounded up to the KDA chunk)."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]), i))
    batches, cur, cur_len = [], [], 0
    for i in order:
        L = len(rows[i][0])
        Lp = ((L - 1 + chunk - 1) // chunk) * chunk
        if cur and (len(cur) + 1) * max(cur_len, Lp) > batch_tokens:
            batches.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len = max(cur_len, Lp)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(rows, idx, pad_id, chunk=16):
    L = max(len(rows[i][0]) for i in idx)
    T = ((L - 1 + chunk - 1) // chunk) * chunk
    x = torch.full((len(idx), T), pad_id, dtype=torch.long)
    y = torch.full((len(idx), T), pad_id, dtype=torch.long)
    w = torch.zeros((len(idx), T))
    for b, i in enumerate(idx):
        ids, ws = rows[i]
        n = len(ids) - 1
        x[b, :n] = torch.tensor(ids[:-1])
        y[b, :n] = torch.tensor(ids[1:])
        w[b, :n] = torch.tensor(ws[1:])
    return x, y, w


# ---------------------------------------------------------------------------------------------
# greedy chat driver (Python, same template as k3) for evaluation
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def greedy_batch(m, tok, prompts, max_new, stop_ids, mode="chunked"):
    """prompts: list of id lists. Full recompute each step (tiny model); right padding only."""
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    outs = [[] for _ in seqs]
    for _ in range(max_new):
        live = [i for i in range(len(seqs)) if not done[i]]
        if not live:
            break
        L = max(len(seqs[i]) for i in live)
        x = torch.full((len(live), L), 0, dtype=torch.long)
        for b, i in enumerate(live):
            x[b, :len(seqs[i])] = torch.tensor(seqs[i])
        logits = m(x, mode=mode)
        for b, i in enumerate(live):
            nxt = int(torch.argmax(logits[b, len(seqs[i]) - 1]))
            seqs[i].append(nxt)
            outs[i].append(nxt)
            if nxt in stop_ids:
                done[i] = True
    return outs


def parse_reply(tok, gen, thinking):
    """Content of the response channel (tolerant): text up to <|close|>response."""
    text = tok.decode([i for i in gen])
    if thinking:
        k = text.find("<|close|>think<|sep|><|open|>response<|sep|>")
        text = text[k + len("<|close|>think<|sep|><|open|>response<|sep|>"):] if k >= 0 else ""
    for mk in ("<|close|>", "<|end_of_msg|>", "[EOS]"):
        j = text.find(mk)
        if j >= 0:
            text = text[:j]
    return text


def chat_prompt(tok, history, thinking):
    return tok.encode_segments(corpus.render_segments(history, thinking, "max", add_generation_prompt=True))


def evaluate(m, tok, held, thinking=False, log=print, max_new=48):
    m.eval()
    stop = {tok.end_of_msg, tok.eos}
    facts = held["facts"]
    prompts = [chat_prompt(tok, [{"role": "user", "content": f["question"]}], thinking) for f in facts]
    gens = greedy_batch(m, tok, prompts, max_new + (40 if thinking else 0), stop)
    fact_ok, fact_rows = 0, []
    for f, g in zip(facts, gens):
        rep = parse_reply(tok, g, thinking)
        ok = corpus.score_reply(rep, f["expect"], f.get("mention", ()))
        fact_ok += ok
        fact_rows.append({"q": f["question"], "reply": rep, "expect": f["expect"], "ok": ok})
    # recall: three user turns, history re-rendered from parsed replies
    rec = held["recall"]
    hist = [[] for _ in rec]
    replies = [[] for _ in rec]
    for turn in range(3):
        prompts = []
        for i, r in enumerate(rec):
            hist[i].append({"role": "user", "content": r["turns"][turn]})
            prompts.append(chat_prompt(tok, hist[i], thinking))
        gens = greedy_batch(m, tok, prompts, max_new + (40 if thinking else 0), stop)
        for i, g in enumerate(gens):
            rep = parse_reply(tok, g, thinking)
            text = tok.decode(g)
            reasoning = None
            if thinking:
                k = text.find("<|close|>think<|sep|>")
                reasoning = text[:k] if k >= 0 else text
            msg = {"role": "assistant", "content": rep}
            if thinking:
                msg["reasoning"] = reasoning
            hist[i].append(msg)
            replies[i].append(rep)
    rec_ok = 0
    rec_rows = []
    for r, reps in zip(rec, replies):
        ok = corpus.score_reply(reps[2], r["expect"], r.get("mention", ()))
        rec_ok += ok
        rec_rows.append({"turns": r["turns"], "replies": reps, "expect": r["expect"], "ok": ok})
    log(f"eval ({'think' if thinking else 'no-think'}): facts {fact_ok}/{len(facts)}, recall {rec_ok}/{len(rec)}")
    m.train()
    return fact_ok, rec_ok, fact_rows, rec_rows


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "assets", "demo"))
    ap.add_argument("--work", default="/tmp/demo")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--records", type=int, default=60000)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=320)
    ap.add_argument("--batch-tokens", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--user-weight", type=float, default=0.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=400)
    ap.add_argument("--no-amp", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--name-focus", type=float, default=0.0,
                    help="share of records that are name dialogues (corpus.gen_name_chat)")
    ap.add_argument("--copy-share", type=float, default=0.0,
                    help="share of raw records that are copy drills (corpus.copy_drill)")
    ap.add_argument("--blend-share", type=float, default=0.0,
                    help="share of made-up names spliced from pieces of real words (corpus.blend_name)")
    ap.add_argument("--people-share", type=float, default=0.0,
                    help="share of story heroes and sentence subjects that are people (corpus.PEOPLE)")
    ap.add_argument("--init", help="start from this exported checkpoint (its weights and its "
                    "tokenizer) instead of a fresh tokenizer and random weights")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    os.makedirs(a.work, exist_ok=True)
    logf = open(os.path.join(a.work, "train.log"), "a")

    def log(s):
        line = f"[{time.strftime('%H:%M:%S')}] {s}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    times = {}
    t_all = time.time()

    # 1. corpus
    t0 = time.time()
    records = corpus.generate(a.seed, a.records, a.name_focus, a.copy_share, a.blend_share, a.people_share)
    for r in records:
        corpus.check_record(r)
    with open(os.path.join(a.work, "corpus.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.makedirs(os.path.dirname(HELDOUT), exist_ok=True)
    held = corpus.heldout_set()
    with open(HELDOUT, "w") as f:
        json.dump(held, f, indent=1)
        f.write("\n")
    times["corpus_s"] = time.time() - t0
    log(f"corpus: {len(records)} records in {times['corpus_s']:.1f}s")

    # 2. tokenizer
    t0 = time.time()
    tokdir = os.path.join(a.work, "tok")
    os.makedirs(tokdir, exist_ok=True)
    if a.init:
        for fn in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(a.init, fn), os.path.join(tokdir, fn))
        log(f"tokenizer: reused from {a.init}")
    else:
        vocab = bpe.train(bpe.corpus_texts(records[:60000]), a.ranks, log=log)
        bpe.write_tiktoken(os.path.join(tokdir, "tiktoken.model"), vocab)
        bpe.write_tokenizer_config(os.path.join(tokdir, "tokenizer_config.json"), len(vocab))
    assert bpe.check(tokdir, records, log=log)
    tok = bpe.Tok(tokdir)
    times["tokenizer_s"] = time.time() - t0

    # 3. tokenise
    t0 = time.time()
    rows = build_rows(tok, records, a.seq, a.user_weight, log)
    times["tokenise_s"] = time.time() - t0

    # 4. model
    if a.init:
        m = M.load_checkpoint(a.init, torch.float32)
        c = m.c
        assert c.vocab_size == tok.vocab and c.n_ranks == tok.n_ranks
        log(f"weights: initialised from {a.init}")
    else:
        c = M.Cfg(vocab_size=tok.vocab, n_ranks=tok.n_ranks, hidden_size=a.hidden)
        m = M.K3(c)
        m.init_weights(a.seed)
    n_par = sum(p.numel() for p in m.parameters())
    log(f"model: {n_par / 1e6:.2f}M parameters; cfg {json.dumps(c.__dict__)}")
    decay, no_decay = [], []
    for n, p in m.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    total = a.steps + a.qat_steps
    sched = lambda s: min(1.0, (s + 1) / a.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    rng = random.Random(a.seed)
    pad = tok.specials["[PAD]"]
    batches = []
    t_train = time.time()
    tokens_seen = 0
    tokens_proc = 0
    cur_threads, best, retry_at = a.threads, {}, 0
    win_t, win_tok = time.time(), 0
    ema = None
    step = 0
    history = []
    pre = None
    while step < total:
        if not batches:
            batches = make_batches(rows, a.batch_tokens, rng)
        idx = batches.pop()
        x, y, w = collate(rows, idx, pad)
        if step == a.steps and a.qat_steps > 0:
            # how much does plain MXFP4 export of the routed experts lose? (same quantiser)
            pre = {}
            for q in (False, True):
                m.set_quant(q)
                fo, ro, _, _ = evaluate(m, tok, held, False, log)
                pre["mxfp4" if q else "float"] = {"facts": fo, "recall": ro}
            log(f"before QAT: {json.dumps(pre)}")
            win_t = time.time()
            m.set_quant(True)
            log("qat: routed experts now fake-quantised to MXFP4")
        for gph in opt.param_groups:
            gph["lr"] = a.lr * sched(step)
        sel = w > 0                      # the head runs only where the loss has weight
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.no_amp):
            logits = m(x, positions=sel)
        lossv = F.cross_entropy(logits.float(), y[sel], reduction="none")
        loss = (lossv * w[sel]).sum() / w[sel].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for f in m.moe_layers():
                ld = f.last_load
                f.e_score_correction_bias += a.bias_rate * torch.sign(ld.mean() - ld)
        tokens_seen += int((w > 0).sum())
        tokens_proc += x.numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % 20 == 0:
            # adaptive threads: on a shared machine two OpenMP threads collapse when the other
            # core is busy; fall back to one thread for a while when throughput drops
            now = time.time()
            rate = (tokens_proc - win_tok) / max(now - win_t, 1e-9)
            win_t, win_tok = now, tokens_proc
            best[cur_threads] = max(best.get(cur_threads, 0.0), rate)
            if cur_threads > 1 and rate < 0.6 * best[cur_threads]:
                cur_threads, retry_at = 1, step + 200
                torch.set_num_threads(1)
                log(f"throughput {rate:.0f} tok/s < 60% of the best with {a.threads} threads: using 1 thread")
            elif cur_threads == 1 and a.threads > 1 and step >= retry_at:
                cur_threads = a.threads
                torch.set_num_threads(a.threads)
                best.pop(a.threads, None)
                log(f"trying {a.threads} threads again")
        if step % 20 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{total} loss {loss.item():.4f} ema {ema:.4f} lr {a.lr * sched(step):.2e} "
                f"loss-tok {tokens_seen} all-tok {tokens_proc} ({tokens_proc / el:.0f}/s) elapsed {el / 60:.1f} min")
            history.append({"step": step, "loss": loss.item(), "ema": ema, "elapsed_s": el})
        if a.eval_every and step % a.eval_every == 0 and step < total:
            evaluate(m, tok, held, False, log)
            win_t = time.time()                  # keep evaluation time out of the throughput window
    times["train_s"] = time.time() - t_train
    log(f"trained {total} steps ({a.qat_steps} QAT) in {times['train_s'] / 60:.1f} min, {tokens_seen} tokens")
    torch.save({"state": m.state_dict(), "cfg": c.__dict__}, os.path.join(a.work, "model.pt"))

    # 6. export
    t0 = time.time()
    m.set_quant(False)
    nbytes = M.export(m, a.out, TEMPLATE_CONFIG)
    for fn in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokdir, fn), os.path.join(a.out, fn))
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    times["export_s"] = time.time() - t0
    log(f"export: {a.out}, tensor bytes {nbytes}, directory {size} bytes")

    # 7. eval on the exported checkpoint
    t0 = time.time()
    me = M.load_checkpoint(a.out, torch.float32)
    res = {}
    for th in (False, True):
        fo, ro, fr, rr = evaluate(me, bpe.Tok(a.out), held, th, log)
        res["think" if th else "no_think"] = {"facts": fo, "recall": ro, "fact_rows": fr, "recall_rows": rr}
    times["eval_s"] = time.time() - t0
    times["total_s"] = time.time() - t_all
    with open(os.path.join(a.work, "train_log.json"), "w") as f:
        json.dump({"args": vars(a), "times": times, "params": n_par, "export_bytes": size,
                   "history": history, "eval": res, "before_qat": pre}, f, indent=1)
    log(f"times: {json.dumps({k: round(v, 1) for k, v in times.items()})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
