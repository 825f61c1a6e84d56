"""Every CLI number is bounded: a value out of range is one line naming the option, exit 2, no traceback;
and a generation past the model's context or the cache's capacity is refused before any work (API too)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import CacheCapacityError, InputLimitError
from kvlab.generate import SamplingConfig, generate
from kvlab.limits import MAX_SEED, check_threads, max_threads

from .conftest import cli_error, tiny_model


def one_line_error(args) -> str:
    line = cli_error(args)
    assert line.startswith("error:"), line
    return line


HUGE = str(2**70)

# refused before any model is loaded or any work starts
FAST_CASES = [
    (["generate", "hi", "--seed", HUGE], "--seed"),
    (["generate", "hi", "--seed", "-1"], "--seed"),
    (["generate", "hi", "--device", "bogus"], "--device"),
    (["generate", "hi", "--device", "cuda:99"], "--device"),
    (["generate", "hi", "--max-new-tokens", "1e12"], "--max-new-tokens"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--temperature", "inf"], "--temperature"),
    (["generate", "hi", "--top-p", "nan"], "top_p"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "decode", "--threads", "100000"], "--threads"),
    (["bench", "decode", "--repeats", "100000"], "--repeats"),
    (["bench", "decode", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["eval", "--windows", "1e9"], "--windows"),
    (["eval", "--windows", "0"], "--windows"),
    (["eval", "--threads", "100000"], "--threads"),
    (["eval", "--passkey-lengths", "0,5"], "--passkey-lengths"),
    (["lab", "counts", "--n", "1e9"], "--n"),
    (["lab", "counts", "--n", "1000000000"], "--n"),
    (["lab", "counts", "--threads", "100000"], "--threads"),
    (["lab", "invariance", "--tokens", "1000"], "--tokens"),
    (["lab", "invariance", "--steps", "1000"], "--steps"),
    (["lab", "invariance", "--seed", HUGE], "--seed"),
    (["lab", "gqa", "--new-tokens", "100000"], "--new-tokens"),
    (["lab", "gqa", "--repeats", "100000"], "--repeats"),
    (["lab", "gqa", "--steps", "1000000000000"], "--steps"),
    (["lab", "speed", "--run-budget", "inf"], "--run-budget"),
    (["lab", "speed", "--run-budget", "-1"], "--run-budget"),
    (["lab", "all", "--threads", "100000"], "--threads"),
    (["plan", "smollm2-135m", "--vram", "nan"], "--vram"),
    (["plan", "smollm2-135m", "--vram", "inf"], "--vram"),
    (["plan", "smollm2-135m", "--vram", "-1"], "--vram"),
    (["plan", "smollm2-135m", "--ctx", "lots"], "--ctx"),
    (["plan", "smollm2-135m", "--parallel", "0"], "--parallel"),
    (["info", "--bogus"], "--bogus"),
]


@pytest.mark.parametrize("args, option", FAST_CASES, ids=[" ".join(a)[:60] for a, _ in FAST_CASES])
def test_out_of_range_numbers_are_one_line_naming_the_option(args, option):
    assert option in one_line_error(args)


def test_usage_errors_are_one_line_too():
    assert "Missing argument" in one_line_error(["generate"])
    assert "No such option" in one_line_error(["plan", "smollm2-135m", "--nope"])


def test_threads_bound_is_a_multiple_of_the_cores():
    assert check_threads(0) == 0 and check_threads(max_threads()) == max_threads()
    with pytest.raises(InputLimitError, match="--threads must be between 0 and"):
        check_threads(max_threads() + 1)
    with pytest.raises(InputLimitError, match="--threads must be between 1 and"):
        check_threads(0, allow_default=False)


def test_seed_bound_is_what_torch_accepts():
    torch.Generator().manual_seed(SamplingConfig(seed=MAX_SEED).seed)  # the largest accepted seed works in torch
    with pytest.raises(InputLimitError, match="seed"):
        SamplingConfig(seed=MAX_SEED + 1)


# -- the generation path: refused before any work, from the API ----------------------------------------------------

class CountingModel(torch.nn.Module):
    """Wraps a decoder and counts forward passes: a refused generation must not run one."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_generation_past_the_models_context_is_refused_before_any_work():
    model = CountingModel(tiny_model(max_seq_len=32))
    cache = make_cache("dense", CacheGeometry.for_model(model.config, batch=1, capacity=32))
    with pytest.raises(InputLimitError, match="exceeds the model's context of 32 tokens"):
        generate(model, torch.zeros(1, 40, dtype=torch.long), cache, 1)
    with pytest.raises(InputLimitError, match="use --max-new-tokens 13 or less"):
        generate(model, torch.zeros(1, 20, dtype=torch.long), cache, 14)  # 20 + 14 - 1 = 33 positions
    assert model.calls == 0 and cache.length == 0
    assert len(generate(model, torch.zeros(1, 20, dtype=torch.long), cache, 13).token_ids[0]) == 13  # exactly full


def test_generation_past_the_caches_capacity_is_refused_before_any_work():
    model = CountingModel(tiny_model(max_seq_len=64))
    cache = make_cache("dense", CacheGeometry.for_model(model.config, batch=1, capacity=16))
    with pytest.raises(CacheCapacityError, match="needs a cache of 20 tokens, more than its capacity of 16"):
        generate(model, torch.zeros(1, 8, dtype=torch.long), cache, 13)
    assert model.calls == 0 and cache.length == 0
    no_cache = make_cache("none", CacheGeometry.for_model(model.config, batch=1, capacity=16))
    with pytest.raises(InputLimitError, match="context of 64"):  # the no-cache baseline is bounded by the context
        generate(model, torch.zeros(1, 60, dtype=torch.long), no_cache, 6)
    assert model.calls == 0


# -- the same through the CLI with the real model (loaded once per process) ----------------------------------------

def test_cli_generation_past_the_context_is_refused(smollm2):
    line = one_line_error(["generate", "hi", "--max-new-tokens", "1000000000000"])
    assert "--max-new-tokens" in line and "context of 8,192" in line
    line = one_line_error(["generate", "hello " * 9000, "--max-new-tokens", "1"])
    assert "exceeds the model's context of 8,192 tokens" in line
    assert "--capacity" in one_line_error(["generate", "hi", "--capacity", "100000000"])


def test_cli_eval_sizes_are_refused_before_the_run(smollm2):
    line = one_line_error(["eval", "--caches", "int8", "--windows", "1000000000", "--no-passkey"])
    assert "--windows" in line and "the corpus holds" in line
    line = one_line_error(["eval", "--quick", "--caches", "int8", "--passkey-lengths", "100000"])
    assert "--passkey-lengths" in line and "context of 8,192" in line


def test_cli_bench_prompt_past_the_context_is_refused(smollm2, tmp_path):
    line = one_line_error(["bench", "decode", "--prompt-tokens", "1000000000000", "--contenders", "kvlab:dense",
                           "--dtypes", "fp32", "--out", str(tmp_path / "d.json")])
    assert "--prompt-tokens" in line
    assert not (tmp_path / "d.json").exists()
