#!/usr/bin/env python3
"""Byte-level BPE for the k3 demo model, written in the released `tiktoken.model` format.

    python3 tools/demo/bpe.py --corpus /tmp/demo/corpus.jsonl --ranks 4096 --out assets/demo
    python3 tools/demo/bpe.py --check assets/demo --corpus /tmp/demo/corpus.jsonl

* Pre-tokenisation uses the release's split regex (RUNTIME.md 1.4, `PAT_STR` in
  src/session/tokenizer.rs), so k3's tokenizer encodes identically.
* Ranks 0..255 are the 256 single bytes (GPT-2 byte order: printable first), then one rank per
  merge in merge order. Digits are never merged (numbers are encoded one digit per token,
  which lets the model add and subtract digit by digit).
* The 256 special slots follow right after the ranks, with the released strings at the
  released offsets (e.g. `<|end_of_msg|>` = n_ranks + 2, `<|open|>` = n_ranks + 3);
  `tokenizer_config.json` carries them in `added_tokens_decoder` like the release.
* `--check` encodes sample texts with the Python `tiktoken` package and with this module's own
  encoder and asserts they agree; it also round-trips every sample.
"""

import argparse
import base64
import collections
import json
import os
import sys

import regex

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402

PAT_STR = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
_SPLIT = regex.compile(PAT_STR, flags=regex.V1)

N_SPECIAL = 256
# offset from the first special id -> (content, "special" flag), as in the release
NAMED_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True), 3: ("<|open|>", False),
    4: ("<|close|>", False), 5: ("<|sep|>", False), 6: ("[start_header_id]", True),
    7: ("[end_header_id]", True), 9: ("[EOT]", True), 18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True), 254: ("[UNK]", True), 255: ("[PAD]", True),
}


def gpt2_byte_order():
    first = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    rest = [b for b in range(256) if b not in set(first)]
    return first + rest


def special_names(n_ranks):
    """{string: id} for all 256 slots (named ones + <|reserved_token_N|>)."""
    out = {}
    for off in range(N_SPECIAL):
        i = n_ranks + off
        name = NAMED_SPECIALS[off][0] if off in NAMED_SPECIALS else f"<|reserved_token_{i}|>"
        out[name] = i
    return out


def split(text):
    return _SPLIT.findall(text)


def corpus_texts(records):
    """Ordinary-text segments (what the BPE sees): chat text segments and raw text."""
    for r in records:
        if r["kind"] == "raw":
            yield r["text"]
        else:
            for t, sp in corpus.render_segments(r["messages"], r["thinking"], r.get("effort", "max")):
                if not sp:
                    yield t


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------

def train(texts, n_ranks, log=print):
    counts = collections.Counter()
    for t in texts:
        counts.update(split(t))
    words = []      # [symbols list, count]
    for piece, c in counts.items():
        b = piece.encode("utf-8")
        if piece.isdigit():
            continue                      # digits are never merged
        if len(b) >= 2:
            words.append([[bytes([x]) for x in b], c])
    vocab = [bytes([b]) for b in gpt2_byte_order()]
    have = set(vocab)
    pair_cnt = collections.Counter()
    where = collections.defaultdict(set)
    for wi, (sym, c) in enumerate(words):
        for a, b in zip(sym, sym[1:]):
            pair_cnt[(a, b)] += c
            where[(a, b)].add(wi)
    while len(vocab) < n_ranks and pair_cnt:
        best = max(pair_cnt.items(), key=lambda kv: (kv[1], kv[0]))
        (a, b), c = best
        if c <= 0:
            break
        new = a + b
        for wi in list(where[(a, b)]):
            sym, wc = words[wi]
            for x, y in zip(sym, sym[1:]):
                pair_cnt[(x, y)] -= wc
                if pair_cnt[(x, y)] <= 0:
                    del pair_cnt[(x, y)]
                where[(x, y)].discard(wi)
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            words[wi][0] = out
            for x, y in zip(out, out[1:]):
                pair_cnt[(x, y)] += wc
                where[(x, y)].add(wi)
        pair_cnt.pop((a, b), None)
        if new not in have:
            vocab.append(new)
            have.add(new)
    log(f"bpe: {len(vocab)} ranks from {len(counts)} distinct pieces")
    return vocab


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------

def write_tiktoken(path, vocab):
    with open(path, "w") as f:
        for i, tok in enumerate(vocab):
            f.write(base64.b64encode(tok).decode("ascii") + f" {i}\n")


def read_tiktoken(path):
    ranks = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            b64, r = line.split(" ")
            ranks[base64.b64decode(b64)] = int(r)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(bytes([b]) in ranks for b in range(256))
    return ranks


def write_tokenizer_config(path, n_ranks):
    dec = {}
    for off in sorted(NAMED_SPECIALS):
        content, special = NAMED_SPECIALS[off]
        dec[str(n_ranks + off)] = {"content": content, "lstrip": False, "normalized": False,
                                   "rstrip": False, "single_word": False, "special": special}
    cfg = {
        "added_tokens_decoder": dec,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------

class Tok:
    """The demo tokenizer through the Python `tiktoken` package, plus a reference encoder."""

    def __init__(self, model_dir):
        import tiktoken
        self.ranks = read_tiktoken(os.path.join(model_dir, "tiktoken.model"))
        self.n_ranks = len(self.ranks)
        self.specials = special_names(self.n_ranks)
        self.enc = tiktoken.Encoding(name="k3demo", pat_str=PAT_STR, mergeable_ranks=self.ranks,
                                     special_tokens=self.specials)
        self.id_bytes = {v: k for k, v in self.ranks.items()}
        for s, i in self.specials.items():
            self.id_bytes[i] = s.encode("utf-8")
        self.vocab = self.n_ranks + N_SPECIAL
        self.end_of_msg = self.specials["<|end_of_msg|>"]
        self.eos = self.specials["[EOS]"]
        self.open, self.close, self.sep = (self.specials[x] for x in ("<|open|>", "<|close|>", "<|sep|>"))

    def encode(self, text, allow_special):
        if not text:
            return []
        if allow_special:
            return self.enc.encode(text, allowed_special="all", disallowed_special=())
        return self.enc.encode_ordinary(text)

    def encode_segments(self, segs):
        ids = []
        for t, sp in segs:
            part = self.encode(t, sp)
            if sp:
                assert len(part) == 1 and part[0] >= self.n_ranks, (t, part)
            ids += part
        return ids

    def decode(self, ids):
        return b"".join(self.id_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def ref_encode_ordinary(self, text):
        """Independent encoder: regex split, then lowest-rank merging (RUNTIME 1.6)."""
        out = []
        for piece in split(text):
            b = piece.encode("utf-8")
            if b in self.ranks:
                out.append(self.ranks[b])
                continue
            parts = [bytes([x]) for x in b]
            while len(parts) > 1:
                best, bi = None, -1
                for i in range(len(parts) - 1):
                    r = self.ranks.get(parts[i] + parts[i + 1])
                    if r is not None and (best is None or r < best):
                        best, bi = r, i
                if best is None:
                    break
                parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
            out += [self.ranks[p] for p in parts]
        return out


def check(model_dir, records, n=3000, log=print):
    tok = Tok(model_dir)
    texts = list(corpus_texts(records[:n]))
    extra = ["Hi!", "What is the capital of France?", "My name is Ada.", "What is 7 plus 5?",
             "What is my name?", "Bartholomew and Wilhelmina walked 4817 steps.", "word   x  ",
             "  leading spaces\n\nand\r\nCRLF\ttab", "I'm here, you're there; they'd go.",
             "ALLCAPS camelCase snake_case 1234567890", "naïve café 中文 😀 Привет",
             "<|open|> literal specials <|end_of_msg|>", "$%&'(", "473, 921, 235"]
    bad = 0
    for t in texts + extra:
        a = tok.encode(t, False)
        b = tok.ref_encode_ordinary(t)
        if a != b:
            bad += 1
            if bad < 5:
                log(f"MISMATCH {t!r}: tiktoken {a} ref {b}")
        assert tok.decode(a).encode() == t.encode() or "\ufffd" in tok.decode(a), t
    # specials: structural markers are single ids; user text never produces them
    for name in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"):
        assert tok.encode(name, True) == [tok.specials[name]], name
        assert all(i < tok.n_ranks for i in tok.encode(name, False)), name
    digits = [tok.id_bytes[i] for i in tok.encode("12345 67 8", False)]
    assert all(len(d) == 1 for d in digits), digits
    n_tok = sum(len(tok.encode(t, False)) for t in texts)
    n_chr = sum(len(t) for t in texts)
    log(f"check: {len(texts) + len(extra)} texts, {bad} mismatches between tiktoken and the "
        f"reference encoder; {n_chr / max(n_tok, 1):.2f} chars/token")
    return bad == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--train-records", type=int, default=60000)
    ap.add_argument("--out")
    ap.add_argument("--check")
    a = ap.parse_args()
    records = []
    with open(a.corpus) as f:
        for line in f:
            records.append(json.loads(line))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        vocab = train(corpus_texts(records[:a.train_records]), a.ranks)
        write_tiktoken(os.path.join(a.out, "tiktoken.model"), vocab)
        write_tokenizer_config(os.path.join(a.out, "tokenizer_config.json"), len(vocab))
        print(f"wrote {a.out}/tiktoken.model ({len(vocab)} ranks) and tokenizer_config.json")
    if a.check or a.out:
        ok = check(a.check or a.out, records)
        print("tokenizer check:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
