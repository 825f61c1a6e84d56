"""Gemma 3 and Qwen3.5 through the commands beyond generate and serve: eval's perplexity (kvlab's engine and
transformers'), kvlab.hf's caches inside transformers, and bench decode's tables."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from kvlab.backends import load_runtime
from kvlab.bench.contexts import run_context_bench
from kvlab.bench.decode import run_decode_bench
from kvlab.eval.suite import perplexity_suite
from kvlab.hf import KVLabCache, read_queries
from kvlab.model.layer_caches import RecurrentState
from kvlab.quality.perplexity import WindowProtocol
from kvlab.session import cached_model

from .hybrid_models import WINDOW, build, save_folder

ARCHS = ("qwen3_5", "gemma3")
PROTOCOL = WindowProtocol(length=48, prefill=16, chunk=8, n_windows=1)   # chunks cross Gemma 3's window of 8


@pytest.fixture(scope="module", params=ARCHS)
def folder(request, smollm2, tmp_path_factory):
    reference = build(request.param, smollm2.tokenizer.vocab_size)
    return request.param, reference, save_folder(reference, tmp_path_factory.mktemp(request.param), smollm2.tokenizer)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, 5000, (1, n), generator=torch.Generator().manual_seed(seed))   # (1, n)


def recomputed_ppl(reference, window: torch.Tensor, prefill: int) -> float:
    """Perplexity of window[prefill+1:] from one full pass of transformers' model, no cache."""
    with torch.no_grad():
        logits = reference(window).logits[0]                                # (T, V)
    return math.exp(F.cross_entropy(logits[prefill:-1], window[0, prefill + 1:]).item())


def test_eval_perplexity_of_dense_equals_a_full_recompute_in_both_backends(folder):
    arch, reference, path = folder
    window = tokens(PROTOCOL.length)
    expected = recomputed_ppl(reference, window, PROTOCOL.prefill)
    for backend, caches in (("kvlab", ["int8", "tq-k4v4"]), ("transformers", ["int8"])):
        engine = load_runtime(backend, str(path))
        dense, *compressed = perplexity_suite(engine.loaded, caches, PROTOCOL, token_windows=[window], engine=engine)
        assert dense.cache == engine.reference
        assert dense.ppl == pytest.approx(expected, rel=1e-4), backend
        assert [r.cache for r in compressed] == caches
        for record in compressed:                                         # close to dense, really run, smaller
            assert abs(record.ppl_delta_pct) < 2.0 and 0 < record.bytes_per_token < dense.bytes_per_token


def test_kvlab_caches_in_transformers_give_its_own_greedy_tokens(folder):
    arch, reference, _ = folder
    ids = tokens(2 * WINDOW + 3, seed=1)
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        own = reference.generate(ids, **options)
        for name in ("dense", "int8"):
            cache = KVLabCache.from_name(name, reference.config)
            assert reference.generate(ids, cache=cache, **options).tolist() == own.tolist(), name
    if arch == "qwen3_5":     # the recurrent layers' state (transformers' conv keeps `kernel` columns) is counted
        cfg = reference.config
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        per_layer = (cfg.linear_conv_kernel_dim * channels
                     + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim) * 4
        assert cache.state_nbytes == cfg.layer_types.count("linear_attention") * per_layer
        assert cache.nbytes == cache.store.nbytes + cache.state_nbytes


def test_a_query_hand_off_no_attention_took_is_not_read_by_another_cache(smollm2):
    """Eval's bytes walk fills a TurboQuant cache with no attention after it; a later pass with another cache
    (Gemma 3: its first layer is sliding, so no update of kvlab's replaces the waiting read) must not read it."""
    from transformers import DynamicCache

    model = build("gemma3", smollm2.tokenizer.vocab_size)
    ids = tokens(12, seed=2)
    with torch.no_grad():
        before = model(ids, cache=DynamicCache(config=model.config)).logits
        read_queries(model)
        walk = KVLabCache.from_name("tq-k4v4", model.config)
        full = model.config.layer_types.index("full_attention")
        walk.update(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), full)   # waits for queries that never come
        after = model(ids, cache=DynamicCache(config=model.config)).logits
    assert torch.allclose(before, after, atol=1e-5)


def test_bench_decode_runs_their_caches_on_the_modules(folder, tmp_path):
    arch, _, path = folder
    out = tmp_path / "decode.json"
    run_decode_bench(str(path), 16, 4, ["fp32"], 1, ["kvlab:dense", "kvlab:int8"], str(out), False,
                     Console(file=open(tmp_path / "table.txt", "w"), width=200))
    record = json.loads(out.read_text())
    assert [(r["cache"], r["step"]) for r in record["results"]] == [("dense", "modules"), ("int8", "modules")]
    assert "modules" in (tmp_path / "table.txt").read_text()
    config = cached_model(str(path), "fp32", "cpu").config
    context = 16 + 4 / 2
    per_layer = config.n_kv_heads * 2 * config.head_dim * 4
    attention = len(config.layers_of("full")) * context + len(config.layers_of("sliding")) * min(context, WINDOW)
    expected = per_layer * attention + RecurrentState.expected_nbytes(config, 1)
    assert record["results"][0]["kv_bytes_read_per_step"] == pytest.approx(expected)

    contexts = run_context_bench(str(path), [24], ["dense", "int8"], 1, 2, 1, 0, "auto", None, True,
                                 Console(file=open(tmp_path / "contexts.txt", "w")))
    assert [(r["cache"], r["step"]) for r in contexts["results"]] == [("dense", "modules"), ("int8", "modules")]
    assert all(r["tokens_per_s"] > 0 for r in contexts["results"])
