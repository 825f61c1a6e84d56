"""dense-f16 / dense-bf16: the dense cache storing K/V in f16 / bf16 in a fp32 run, attention in fp32.

The reference is a full recompute whose K/V are rounded to the storage dtype (RoundedConcat below): the
cache must equal it, stepwise and chunked, and hold exactly the bytes the planner's formula says."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, ConcatCache, expected_nbytes, make_cache
from kvlab.cache.attention import chunked_attention, grouped_attention
from kvlab.errors import NonFiniteError
from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.sources import load_spec

from .conftest import tiny_model
from .test_causal_caches import feed_chunks

STORAGE = {"dense-f16": torch.float16, "dense-bf16": torch.bfloat16}
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


class RoundedConcat(ConcatCache):
    """A concat cache whose K/V are rounded to `storage` and back: full precision math on rounded K/V."""

    storage = torch.float16

    def append(self, layer, k, v):
        super().append(layer, k.to(self.storage).to(k.dtype), v.to(self.storage).to(v.dtype))


def rounded_full_logits(model, tokens, storage):
    cache = RoundedConcat(CacheGeometry.for_model(model.config, batch=tokens.shape[0], capacity=tokens.shape[1]))
    cache.storage = storage
    with torch.no_grad():
        return model(tokens, cache, last_only=False)


@pytest.mark.parametrize("name", STORAGE)
@pytest.mark.parametrize("kind", [*HEADS, "window"])
def test_equals_full_recompute_on_rounded_kv(name, kind):
    """Batch 2: a 5-token prefill, then token by token, then chunks of 7; the stored K/V are the rounded ones.
    One layer: with more, fp32 rounding differences (chunked vs one-shot attention, ~1e-7) can round a later
    layer's K/V to a neighbouring f16/bf16 value and move the logits by ~1e-4, which says nothing about the cache."""
    n_heads, n_kv = HEADS.get(kind, (4, 2))
    model = tiny_model(n_heads=n_heads, n_kv_heads=n_kv, sliding_window=6 if kind == "window" else None, n_layers=1)
    tokens = torch.randint(0, 97, (2, 26), generator=torch.Generator().manual_seed(1))
    ref = rounded_full_logits(model, tokens, STORAGE[name])
    cache = make_cache(name, CacheGeometry.for_model(model.config, batch=tokens.shape[0], capacity=tokens.shape[1]))
    got = feed_chunks(model, tokens, cache, [5] + [1] * 7 + [7, 7])
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert cache.k.dtype == cache.v.dtype == STORAGE[name] and cache.length == 26
    unrounded = rounded_full_logits(model, tokens, torch.float32)
    assert not torch.allclose(unrounded, ref, atol=1e-6, rtol=0)   # the rounding is visible: the test can tell


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_chunked_attention_equals_grouped_attention(storage, window):
    """Key chunks of 8 and query blocks of 5 (edges off each other's grid), GQA, a query chunk of 13 over 40 keys."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 13, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g).to(storage), torch.randn(2, 2, 40, 12, generator=g).to(storage)
    want = grouped_attention(q, k.float(), v.float(), scale=0.3, window=window)
    got = chunked_attention(q, k, v, scale=0.3, window=window, key_chunk=8, query_block=5)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5
    one = chunked_attention(q[:, :, -1:], k, v, scale=0.3, window=window, key_chunk=8)   # a decode step
    assert (one - want[:, :, -1:]).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", STORAGE)
def test_nbytes_is_exact_and_the_planners(name):
    geometry = CacheGeometry(n_layers=30, n_kv_heads=3, head_dim=64, batch=2, capacity=257, n_heads=9)
    cache = make_cache(name, geometry)
    assert cache.nbytes == 2 * 30 * 2 * 3 * 257 * 64 * 2 == cache.k.nbytes + cache.v.nbytes
    assert cache.nbytes == expected_nbytes(name, geometry, torch.float32, 257)
    assert cache.nbytes * 2 == make_cache("dense", geometry).nbytes
    plan = plan_json(make_plan(load_spec("smollm2-135m"), rules_for("kvlab"), PlanSettings(context=257, parallel=2, kv_type_k=name)))
    assert plan["kv_bytes"] == cache.nbytes


def test_a_value_beyond_float16_is_the_non_finite_error():
    geometry = CacheGeometry(n_layers=1, n_kv_heads=1, head_dim=4, capacity=4)
    k = torch.full((1, 1, 1, 4), 70000.0)
    with pytest.raises(NonFiniteError, match="layer 0"):
        make_cache("dense-f16", geometry).append(0, k, torch.zeros_like(k))
    make_cache("dense-bf16", geometry).append(0, k, torch.zeros_like(k))   # bf16 has fp32's range
