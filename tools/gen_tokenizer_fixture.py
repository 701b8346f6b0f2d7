#!/usr/bin/env python3
"""Build the "merges" tokenizer fixture used by the Rust tokenizer tests.

Writes, under tests/fixtures/tokenizer/merges/ (relative to the crate root):

  tiktoken.model         rank file: 256 single bytes, then BPE tokens learned
                         from the small mixed-language corpus below
  tokenizer_config.json  added_tokens_decoder with the Kimi K3 special names
                         placed at the same offsets from N as in the release
  expected.json          ids computed by the Python `tiktoken` package for
                         a list of texts (see CASES)

Usage (needs `pip install tiktoken`, which also brings the `regex` module):

    python3 tools/gen_tokenizer_fixture.py [--merges 1200]

The output is deterministic for a given corpus, merge count and tiktoken
version.
"""

import argparse
import base64
import json
import os
import sys
from collections import Counter

import regex
import tiktoken

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Named special tokens, as offsets from N (the number of BPE ranks).
NAMED_SPECIALS = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False),
    4: ("<|close|>", False),
    5: ("<|sep|>", False),
    6: ("[start_header_id]", True),
    7: ("[end_header_id]", True),
    9: ("[EOT]", True),
    18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True),
    20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}
NUM_SPECIAL = 256

CORPUS = """
The quick brown fox jumps over the lazy dog. The capital of France is Paris.
You are a helpful assistant. What were the other two? Numbers: 473, 921, 235.
It's a test; they're here, we've seen it, I'm sure you'll agree, he'd said so.
DON'T SHOUT, but THE HTTP SERVER returned an ERROR. camelCaseName and
snake_case_name and kebab-case-name and PascalCaseName appear in code.
Hello world! hello again, Hello, HELLO. The message role is user or assistant.
def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text if not c.isspace()]

fn main() {
    let mut total: u64 = 0;
    for i in 0..10 { total += i * i; }
    println!("total = {}", total);
}

#include <stdio.h>
int main(void) { printf("hello, world\\n"); return 0; }

{"name": "kimi", "version": 3, "tags": ["chat", "code"], "ok": true, "n": null}
https://example.com/path/to/page?query=value&lang=en#section
C:\\Users\\Public\\Documents\\report.txt and /usr/local/bin/python3
# Heading

* item one
* item two with **bold** and _italic_ and `code`

> a quoted line
"Typographic quotes" and ‘single quotes’ — em dash – en dash … ellipsis.
Café, naïve, façade, résumé, Zürich, São Paulo, Ångström, crème brûlée.
我们今天去北京。你好，世界！这是一个测试句子，用来训练分词器。中文和English混合。
人工智能正在改变世界。模型的参数数量是一万亿。
日本語のテキストです。東京は大きな都市です。ひらがなとカタカナ。
한국어 문장입니다. 서울은 대한민국의 수도입니다.
Привет, мир! Это тестовое предложение на русском языке.
مرحبا بالعالم. هذه جملة تجريبية باللغة العربية.
Γειά σου κόσμε. Αυτή είναι μια δοκιμή.
Emoji: 😀 😃 🚀 🎉 👍🏽 👩‍💻 👨‍👩‍👧‍👦 ❤️ 🇫🇷
Math: ∑ x² + y² ≤ z², α β γ δ ∞ ≠ ≈ ±
Tabs\tand\tspaces   and    runs\r\nWindows line\r\nendings\n\n\nblank lines
1234567890 3.14159 2024-06-01 12:34:56 $19.99 100% #42 @user
""" * 3

CASES = [
    ("prose", "The capital of France is Paris.", False),
    ("leading_space", " leading space", False),
    ("trailing_spaces", "word   ", False),
    ("inner_spaces", "word   x", False),
    ("double_space", "two  spaces here", False),
    ("single_space", " ", False),
    ("single_char", "a", False),
    ("tab", "a\tb\t\tc", False),
    ("newline_runs", "line1\n\n\nline2\n", False),
    ("crlf", "first\r\nsecond\r\n\r\nthird", False),
    ("space_run_17", "x" + " " * 17 + "y", False),
    ("digits", "1234567890", False),
    ("digits_commas", "473, 921, 235", False),
    ("mixed_alnum", "abc123def456 v2.0.1", False),
    ("punct_soup", "$%&'( !?.,;: ...!!! ---", False),
    ("contractions", "It's they're we've I'm you'll he'd IT'S", False),
    ("allcaps", "THE HTTP SERVER RETURNED AN ERROR", False),
    ("camel_case", "camelCaseName PascalCaseName XMLHttpRequest", False),
    ("snake_case", "snake_case_name __init__", False),
    ("han_only", "世界", False),
    ("han_ascii", "中文和English混合", False),
    ("ascii_han", "Hello世界", False),
    ("han_sentence", "我们今天去北京。你好，世界！", False),
    ("han_digits", "一万亿2024年", False),
    ("japanese", "日本語のテキストです。", False),
    ("korean", "한국어 문장입니다.", False),
    ("cyrillic", "Привет, мир!", False),
    ("arabic", "مرحبا بالعالم.", False),
    ("greek", "Γειά σου κόσμε.", False),
    ("accents", "Café naïve façade Ångström", False),
    ("combining", "e\u0301 a\u0308 n\u0303", False),
    ("emoji", "😀🚀🎉", False),
    ("emoji_text", "Launch 🚀 now!", False),
    ("emoji_zwj", "👩‍💻 👨‍👩‍👧‍👦", False),
    ("flag_skin", "🇫🇷 👍🏽", False),
    ("c_code", "int main(void) { return 0; }", False),
    ("python_code", "def f(x):\n    return x * 2\n", False),
    ("json", '{"name": "kimi", "n": [1, 2, 3], "ok": true}', False),
    ("url", "https://example.com/path/to/page?query=value&lang=en#top", False),
    ("windows_path", "C:\\Users\\Public\\report.txt", False),
    ("unix_path", "/usr/local/bin/python3", False),
    ("markdown", "# Title\n\n* **bold** and `code`\n> quote", False),
    ("repeated_letter", "a" * 20, False),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis", False),
    ("mixed_script", "Hello мир 世界 こんにちは 🌍", False),
    ("latin1_high", "ÿþýüûúùø ©®±µ¶", False),
    ("math_symbols", "∑ x² + y² ≤ z², α ≠ ∞", False),
    ("typographic_quotes", "“quoted” ‘single’ „low“", False),
    ("dashes", "em — en – minus − hyphen -", False),
    ("control_chars", "a\x1cb\x1fc\x00d\x7f", False),
    ("nbsp_and_ideographic_space", "a\u00a0b\u3000c\u2009d", False),
    ("special_as_text", "<|open|>message<|sep|>", False),
    (
        "specials_allowed",
        '<|open|>message role="user"<|sep|>hi 你好<|close|>message<|sep|><|end_of_msg|>',
        True,
    ),
    ("reserved_allowed", "x<|reserved_token_{R}|>y[EOS]", True),
    ("empty", "", False),
]


def bpe_encode(word, ranks):
    parts = [word[i : i + 1] for i in range(len(word))]
    while len(parts) > 1:
        best = None
        best_i = -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best = r
                best_i = i
        if best is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def byte_order():
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    rest = [b for b in range(256) if b not in set(printable)]
    return printable + rest


def train(corpus, n_merges):
    splitter = regex.compile(PAT_STR, flags=regex.V1)
    words = Counter(m.group(0).encode("utf-8") for m in splitter.finditer(corpus))
    ranks = {}
    for b in byte_order():
        ranks[bytes([b])] = len(ranks)
    enc = {w: bpe_encode(w, ranks) for w in words}
    for _ in range(n_merges):
        pairs = Counter()
        for w, count in words.items():
            parts = enc[w]
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0][0] + kv[0][1], kv[0][0]))
        token = a + b
        assert token not in ranks
        ranks[token] = len(ranks)
        for w in words:
            parts = enc[w]
            if any(x == a and y == b for x, y in zip(parts, parts[1:])):
                enc[w] = bpe_encode(w, ranks)
    return ranks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--merges", type=int, default=1200)
    args = ap.parse_args()

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = os.path.join(root, "tests", "fixtures", "tokenizer", "merges")
    os.makedirs(out_dir, exist_ok=True)

    ranks = train(CORPUS, args.merges)
    n = len(ranks)

    specials = {}
    for slot in range(NUM_SPECIAL):
        name = NAMED_SPECIALS.get(slot, (f"<|reserved_token_{n + slot}|>", True))[0]
        specials[name] = n + slot

    with open(os.path.join(out_dir, "tiktoken.model"), "w", encoding="ascii", newline="\n") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")

    config = {
        "added_tokens_decoder": {
            str(n + slot): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for slot, (name, special) in sorted(NAMED_SPECIALS.items())
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")

    enc = tiktoken.Encoding(
        "k3-merges-fixture",
        pat_str=PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    cases = []
    for name, text, allow_special in CASES:
        text = text.replace("{R}", str(n + 40))
        if allow_special:
            ids = enc.encode(text, allowed_special="all", disallowed_special=())
        else:
            ids = enc.encode(text, allowed_special=set(), disallowed_special=())
        assert enc.decode_bytes(ids) == text.encode("utf-8"), name
        cases.append({"name": name, "text": text, "allow_special": allow_special, "ids": ids})

    expected = {
        "generator": "tools/gen_tokenizer_fixture.py",
        "tiktoken_version": tiktoken.__version__,
        "python_version": sys.version.split()[0],
        "num_base_tokens": n,
        "num_special_tokens": NUM_SPECIAL,
        "pat_str": PAT_STR,
        "cases": cases,
    }
    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    multi = sum(1 for c in cases if len(c["ids"]) < len(c["text"].encode("utf-8")))
    print(f"wrote {n} ranks, {len(cases)} cases ({multi} use merges) to {out_dir}")


if __name__ == "__main__":
    main()
