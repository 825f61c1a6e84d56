"""The eval's text part (eval/continuations.py): its measures on known token lists, its prompt set, and greedy
continuations through caches compared with dense's on a tiny model with the real tokenizer."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from .conftest import tiny_model
from kvlab.eval.continuations import (QUESTIONS, TextProtocol, compare, continuations, distinct_ngrams, first_difference,
                                      longest_repeat_run)
from kvlab.eval.run import EvalSettings, quality_table
from kvlab.quality.perplexity import WindowProtocol


@pytest.fixture(scope="module")
def gguf_tokenizer():
    from kvlab.model.loader import _gguf_tokenizer, default_model_path, read_model

    _, gguf_file = read_model(default_model_path())
    return _gguf_tokenizer(gguf_file)


def test_longest_repeat_run():
    assert longest_repeat_run([5, 1, 2, 1, 2, 1, 2, 9]) == 6          # (1, 2) three times
    assert longest_repeat_run([7, 7, 7, 7]) == 4
    assert longest_repeat_run([1, 2, 3, 4, 5]) == 0                    # nothing repeats back to back
    assert longest_repeat_run([1, 2, 3, 1, 2, 3, 4]) == 6
    assert longest_repeat_run([]) == 0


def test_distinct_ngrams_and_first_difference():
    assert distinct_ngrams([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngrams([1, 1, 1, 1, 1, 1]) == pytest.approx(1 / 3)  # three 4-grams, all (1, 1, 1, 1)
    assert distinct_ngrams([1, 2]) == 1.0
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2], [1, 2, 3]) == 2                    # one ended (EOS) where the other went on


def test_the_prompt_set_has_every_kind_and_the_readme_examples():
    prompts = TextProtocol().prompts()
    assert len(prompts) >= 50 and len({p.text for p in prompts}) == len(prompts)
    texts = {p.text for p in prompts}
    assert {"Once upon a time", "What is the capital of France?"} <= texts
    assert sum(p.answer is not None for p in prompts) == len(QUESTIONS)
    quick = TextProtocol.quick().prompts()
    assert {(p.chat, p.answer is not None) for p in quick} == {(True, True), (False, False), (True, False)}


def test_compare_counts_answers_and_differences():
    reference = [{"prompt": "q", "ids": [1, 2, 3, 4], "text": "Paris", "right": True},
                 {"prompt": "o", "ids": [5, 6, 7, 8], "text": "x", "right": None}]
    runs = [{"prompt": "q", "ids": [1, 2, 9, 9], "text": "Lyon", "right": False},
            {"prompt": "o", "ids": [5, 6, 7, 8], "text": "x", "right": None}]
    text = compare(runs, reference)
    assert (text["same_text"], text["first_difference_median"]) == (1, 3)
    assert (text["answers_right"], text["answers_right_dense"], text["answers_as_dense"], text["questions"]) == (0, 1, 0, 1)
    assert text["repeat_run_mean"] == 1.0                               # (9, 9) in the first, nothing in the second
    assert [c["first_difference"] for c in text["continuations"]] == [2, 4]


@pytest.fixture(scope="module")
def tiny_loaded(gguf_tokenizer):
    model = tiny_model(vocab_size=gguf_tokenizer.vocab_size, max_seq_len=256, head_dim=0)
    return SimpleNamespace(model=model, config=model.config, dtype=torch.float32, device="cpu", tokenizer=gguf_tokenizer)


def test_dense_against_itself_is_the_same_text_and_a_cache_is_compared_token_by_token(tiny_loaded):
    from kvlab.backends import KvlabRuntime

    runtime = KvlabRuntime(tiny_loaded)
    protocol = TextProtocol(4, 12)
    dense = continuations(tiny_loaded, runtime, "dense", protocol)
    again = compare(continuations(tiny_loaded, runtime, "dense", protocol), dense)
    assert again["same_text"] == 4 and again["answers_as_dense"] == again["questions"]
    coded = continuations(tiny_loaded, runtime, "int4", protocol)
    text = compare(coded, dense)
    for run, ref, row in zip(coded, dense, text["continuations"]):   # the first difference is where the ids part
        f = row["first_difference"]
        assert run["ids"][:f] == ref["ids"][:f] and (f == min(len(run["ids"]), len(ref["ids"])) or run["ids"][f] != ref["ids"][f])


def test_eval_records_and_tabulates_the_text_part(tiny_loaded, monkeypatch):
    from rich.console import Console

    import kvlab.backends as backends
    from kvlab.eval import run as eval_run

    monkeypatch.setattr(backends, "load_runtime", lambda *a, **k: backends.KvlabRuntime(tiny_loaded))
    settings = EvalSettings(("int8",), WindowProtocol(length=40, prefill=8, chunk=8, n_windows=2), None, seeds=(0,),
                            text=TextProtocol(3, 8))
    records = eval_run.run_eval(settings, Console(file=io.StringIO()))
    dense, int8 = (r.to_json() for r in records)
    assert dense["text"]["same_text"] == 3 and dense["text_protocol"] == "3 prompts, 8 greedy tokens each"
    assert int8["text"]["prompts"] == 3 and len(int8["text"]["continuations"]) == 3
    out = io.StringIO()
    Console(file=out, width=400).print(quality_table(records))
    assert "text: 1st diff" in out.getvalue() and "8 (3/3)" in out.getvalue()


def test_the_cli_builds_the_text_protocol():
    assert EvalSettings.build("int8", quick=True, windows=None, passkey=False, passkey_lengths="1000").text == TextProtocol.quick()
    assert EvalSettings.build("int8", False, None, False, "1000").text == TextProtocol()
    assert EvalSettings.build("int8", False, None, False, "1000", text=False).text is None
