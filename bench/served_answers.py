"""What a served default answers: five chat questions through the serving engine (greedy, 10 tokens) for each block
format given, printed and written to bench/results/served_answers.json (docs/benchmarks.md).

    .venv/bin/python bench/served_answers.py "dense,tq4,tq4+halloc,tq-k4v4"     # ~1 min (+ a +halloc calibration)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlab.serve import Engine, SamplingParams
from kvlab.session import cached_model

QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "Name the largest planet in the solar system.",
             "What is 12 times 12?", "Who wrote Romeo and Juliet?"]


def main() -> None:
    loaded = cached_model(None, "fp32", "cpu", "auto")
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False) for q in QUESTIONS]
    answers = {}
    for name in sys.argv[1].split(","):
        engine = Engine(loaded, cache=name, kv_budget="16MiB", max_batch=len(prompts))
        outputs = engine.generate(prompts, SamplingParams(max_tokens=10), progress=False)
        answers[name] = [out.text for out in outputs]
        print(name, answers[name])
    out = Path("bench/results/served_answers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"questions": QUESTIONS, "answers": answers}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
