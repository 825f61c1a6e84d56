"""Why one unprimed passkey trial was lost: the logit lead of each token of dense's answer, read back through each cache.

The trial (1,000 filler tokens, depth 0.5, the protocol's second key; rotation seed 1 in `kvlab eval`'s cycle) is the
one tq4-class recipes miss under the unprimed protocol (`--no-passkey-prime`). Each cache
prefills the prompt, then is fed dense's answer "The pass key is NNNNN." token by token; for each token the lead of
its logit over the best other token is printed (negative: greedy decoding leaves the answer there). Written to
bench/results/passkey_tie.json (docs/benchmarks.md).

    .venv/bin/python bench/passkey_tie.py "dense,tq4+seed0,tq4+seed1,tq4+seed2,tq-k4v4+seed1"     # ~30 s
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvlab.backends import KvlabRuntime
from kvlab.eval.needle import PasskeyProtocol, lead, passkey_prompt
from kvlab.generate import prefill
from kvlab.session import cached_model

LENGTH, DEPTH = 1000, 0.5


@torch.inference_mode()
def leads(loaded, name: str, ids: list[int], answer: list[int]) -> list[float]:
    cache = KvlabRuntime(loaded).make_cache(name, len(ids) + len(answer))
    logits = prefill(loaded.model, torch.tensor([ids]), cache, PasskeyProtocol().chunk)[0, -1]     # (V,)
    out = []
    for token in answer:
        out.append(round(lead(logits, token), 3))
        logits = loaded.model(torch.tensor([[token]]), cache, last_only=True)[0, -1]
    return out


def main() -> None:
    torch.set_num_threads(2)
    loaded = cached_model(None, "fp32", "cpu", "auto")
    tok = loaded.tokenizer
    key = PasskeyProtocol().keys()[1]   # the default protocol's second trial: (LENGTH, DEPTH)
    ids = passkey_prompt(tok, LENGTH, DEPTH, key, prime=False).ids
    answer = tok.encode(f"The pass key is {key}.", add_special=False)
    result = {"trial": {"filler": LENGTH, "depth": DEPTH, "key": key, "prompt_tokens": len(ids)},
              "answer_tokens": [tok.decode([t]) for t in answer], "leads": {}}
    for name in sys.argv[1].split(","):
        result["leads"][name] = leads(loaded, name, ids, answer)
        print(f"{name:16s}", " ".join(f"{t!r}:{lead:+.2f}" for t, lead in zip(result["answer_tokens"], result["leads"][name])))
    out = Path("bench/results/passkey_tie.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
