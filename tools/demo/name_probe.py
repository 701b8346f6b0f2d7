#!/usr/bin/env python3
"""How faithfully does a demo checkpoint copy a name it has never seen?

    /tmp/dv/bin/python tools/demo/name_probe.py assets/demo

24 conversations (12 real names that are in no list of corpus.py, 12 letter-by-letter made-up
names from a fixed seed): the name is stated in turn 1, a fact is asked in turn 2, the name is
asked back in turn 3, and the answer "Your name is NAME." is teacher-forced. Reports, over the
name's BPE pieces, how often the greedy choice is right for the first piece and for the later
pieces (the multi-piece copy), the mean negative log-likelihood of the later pieces, and how
many names are right in every piece (what greedy decoding would produce).
"""

import random
import sys
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe      # noqa: E402
import corpus   # noqa: E402
import model as M   # noqa: E402
import train as T   # noqa: E402

REAL = ["Leonora", "Ambrose", "Cassius", "Evangeline", "Horatio", "Isolde", "Lysander",
        "Millicent", "Peregrine", "Rowena", "Tristram", "Ottoline"]


def conversations(tok, seed=99):
    rng = random.Random(seed)
    names = REAL + [corpus.pseudo_name(rng) for _ in range(12)]
    out = []
    for i, name in enumerate(names):
        hist = [{"role": "user", "content": ["My name is {}.", "Hi, I am {}.", "Call me {}."][i % 3].format(name)},
                {"role": "assistant", "content": f"Nice to meet you, {name}!"},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."},
                {"role": "user", "content": "What is my name?"}]
        prompt = T.chat_prompt(tok, hist, False)
        lead = tok.encode("Your name is", True)
        answer = tok.encode(f"Your name is {name}.", True)
        # the name's pieces are answer[len(lead):-1] (the final "." is not scored)
        out.append((prompt + answer, len(prompt) + len(lead), len(prompt) + len(answer) - 1))
    return out


@torch.no_grad()
def probe(m, tok):
    first = later = first_ok = later_ok = exact = 0
    nll = 0.0
    convs = conversations(tok)
    for ids, a, b in convs:
        logits = m(torch.tensor([ids[:-1]]))[0].float()
        logp = torch.log_softmax(logits, -1)
        whole = True
        for j in range(a, b):                 # logits[j - 1] predict ids[j]
            ok = int(logits[j - 1].argmax()) == ids[j]
            whole &= ok
            if j == a:
                first, first_ok = first + 1, first_ok + ok
            else:
                later, later_ok = later + 1, later_ok + ok
                nll -= float(logp[j - 1, ids[j]])
        exact += whole
    return {"first_piece": f"{first_ok}/{first}", "later_pieces": f"{later_ok}/{later}",
            "later_nll": round(nll / later, 3), "names_exact": f"{exact}/{len(convs)}"}


def main():
    torch.set_num_threads(2)
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "assets", "demo")
    m = M.load_checkpoint(model_dir, torch.float32)
    m.eval()
    print(probe(m, bpe.Tok(model_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
