"""Every cache path equals a plain full recompute (the causal mask makes the cache exact)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.cache.attention import causal_mask, grouped_attention
from kvlab.generate import prefill

from .conftest import tiny_model

HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


def full_logits(model, tokens):
    """Reference: the whole sequence in one pass through a throwaway cache."""
    cache = make_cache("none", CacheGeometry.for_model(model.config, batch=tokens.shape[0], capacity=tokens.shape[1]))
    with torch.no_grad():
        return model(tokens, cache)


def stepwise_logits(model, tokens, cache_name, first_chunk=1):
    """Prefill `first_chunk` tokens, then feed one token at a time through a persistent cache."""
    cache = make_cache(cache_name, CacheGeometry.for_model(model.config, batch=tokens.shape[0], capacity=tokens.shape[1]))
    out = []
    with torch.no_grad():
        out.append(model(tokens[:, :first_chunk], cache))
        for t in range(first_chunk, tokens.shape[1]):
            out.append(model(tokens[:, t:t + 1], cache))
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("kind", HEADS)
@pytest.mark.parametrize("cache_name", ["dense", "concat"])
def test_stepwise_decoding_equals_full_recompute(kind, cache_name):
    n_heads, n_kv = HEADS[kind]
    model = tiny_model(n_heads=n_heads, n_kv_heads=n_kv)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = full_logits(model, tokens)
    got, cache = stepwise_logits(model, tokens, cache_name, first_chunk=5)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
    assert cache.length == tokens.shape[1]


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_equals_one_shot(chunk):
    model = tiny_model(n_heads=4, n_kv_heads=2)
    tokens = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(2))
    one_shot = make_cache("dense", CacheGeometry.for_model(model.config, capacity=32))
    chunked = make_cache("dense", CacheGeometry.for_model(model.config, capacity=32))
    a = prefill(model, tokens, one_shot)
    b = prefill(model, tokens, chunked, chunk_size=chunk)
    assert torch.allclose(a, b, atol=1e-5, rtol=0)
    n = tokens.shape[1]
    assert torch.allclose(one_shot.k[:, :, :, :n], chunked.k[:, :, :, :n], atol=1e-5, rtol=0)
    assert torch.allclose(one_shot.v[:, :, :, :n], chunked.v[:, :, :, :n], atol=1e-5, rtol=0)


def test_lower_right_mask_is_not_upper_left():
    """A chunk of 2 queries over 5 keys sees keys 0..3 and 0..4 — not 0..0 and 0..1 (is_causal's alignment)."""
    mask = causal_mask(2, 5)
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    windowed = causal_mask(3, 6, window=2)
    assert windowed.tolist() == [
        [False, False, True, True, False, False],
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]


def test_grouped_attention_matches_repeated_heads():
    """Folding query groups onto shared KV heads equals the textbook repeat_interleave version."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 4, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    out = grouped_attention(q, k, v, scale=8 ** -0.5)
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = (q @ k_rep.transpose(-2, -1)) * 8 ** -0.5
    scores = scores.masked_fill(~causal_mask(4, 9), float("-inf"))
    ref = scores.softmax(-1) @ v_rep
    assert torch.allclose(out, ref, atol=1e-6)


def test_dense_cache_bytes_are_its_buffers():
    model = tiny_model(n_heads=4, n_kv_heads=2)
    geometry = CacheGeometry.for_model(model.config, batch=3, capacity=40)
    cache = make_cache("dense", geometry)
    assert cache.nbytes == 2 * 2 * 3 * 2 * 40 * 8 * 4  # K,V × layers × batch × kv_heads × capacity × head_dim × fp32
    assert cache.nbytes == cache.k.nbytes + cache.v.nbytes


def test_concat_cache_grows_with_tokens():
    model = tiny_model(n_heads=4, n_kv_heads=1)
    tokens = torch.randint(0, 97, (1, 10))
    _, cache = stepwise_logits(model, tokens, "concat")
    assert cache.nbytes == 2 * 2 * 1 * 1 * 10 * 8 * 4


def test_no_cache_holds_nothing_between_passes():
    model = tiny_model()
    cache = make_cache("none", CacheGeometry.for_model(model.config, capacity=16))
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 6)), cache)
    assert cache.nbytes == 0 and cache.length == 0
