"""Every cache is causal in every schedule: a position's logits never depend on later tokens.

A random-weight decoder (head dim 32, GQA) runs a 168-token sequence in chunks; two sequences that share
their first 120 tokens and differ after them, inside the last chunk, must give bit-identical logits at
positions 0..119. The integer caches also read, for any chunk size, exactly what token-by-token decoding
reads (their open key group is read in full precision until it is complete, see cache/quantized.py).
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.cache.names import EXAMPLES

from .compressed_checks import GEOMETRY, check_attend_is_token_by_token
from .conftest import tiny_model

CHUNKS = (40, 64, 64)         # a prefill, then two chunks that each complete two 32-token key groups
SEQ = sum(CHUNKS)
SAME = 120                    # the two sequences agree on tokens [0, SAME); the last chunk starts at 104


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=SEQ)


def chunked_logits(model, tokens: torch.Tensor, name: str, chunks) -> torch.Tensor:
    """(B, T, vocab) logits of every position, the tokens fed through one new cache `name` in `chunks`."""
    cache = make_cache(name, CacheGeometry.for_model(model.config, batch=tokens.shape[0], capacity=tokens.shape[1]))
    return feed_chunks(model, tokens, cache, chunks)


def feed_chunks(model, tokens: torch.Tensor, cache, chunks) -> torch.Tensor:
    """(B, T, vocab) logits of every position, the tokens fed through `cache` in `chunks`."""
    out, start = [], 0
    with torch.no_grad():
        for size in chunks:
            out.append(model(tokens[:, start:start + size], cache, last_only=False))
            start += size
    assert start == tokens.shape[1]
    return torch.cat(out, dim=1)


def two_sequences() -> torch.Tensor:
    """(2, SEQ): the same first SAME tokens, different later ones."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 97, (2, SEQ), generator=gen)
    tokens[1, :SAME] = tokens[0, :SAME]
    assert (tokens[0, SAME:] != tokens[1, SAME:]).any()
    return tokens


@pytest.mark.parametrize("name", ["dense", "dense-f16", "dense-bf16", *EXAMPLES, "tq-k4v4+outliers2",
                                  "tq-k4v3.625+prerope+outliers1+sink1",
                                  "tq-k4v4+halloc=k3553v4444", "tq-k3v3+prerope+sink1+halloc=k2433v3342",  # 2 layers × 2 KV heads
                                  "tq-k3v3+vq+norms8", "tq-k3v3+prerope+sink1+halloc=k2433v3342+vq+norms8"])
def test_later_tokens_never_change_earlier_logits(model, name):
    tokens = two_sequences()
    # one sequence per run: batch rows could share per-batch statistics
    a = chunked_logits(model, tokens[:1], name, CHUNKS)
    b = chunked_logits(model, tokens[1:], name, CHUNKS)
    assert torch.equal(a[:, :SAME], b[:, :SAME]), (a[:, :SAME] - b[:, :SAME]).abs().max()
    assert not torch.equal(a[:, SAME:], b[:, SAME:])  # the test can see a difference where there is one


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("chunk", [7, 32, 64])  # chunk 1 is the reference; more names: test_quantized_cache.py
def test_every_chunk_reads_what_token_by_token_decoding_reads(name, chunk):
    """The same K/V appended in chunks of `chunk`: each query's attention == token-by-token's within 2e-5."""
    chunks = [chunk] * (GEOMETRY.capacity // chunk)
    check_attend_is_token_by_token(name, chunks=chunks + [GEOMETRY.capacity - sum(chunks)] if GEOMETRY.capacity % chunk else chunks)


@pytest.mark.parametrize("name", ["dense", "int8", "int4", "int4+g16+sink3", "int4+recent40"])
def test_chunked_prefill_equals_token_by_token(name):
    """A one-layer model (so float32 rounding cannot cascade into a flipped code in a later layer): any chunk
    size gives token-by-token's logits within 1e-5 of their scale (the dense cache's own rounding, matmuls of
    other shapes, is ~3e-6 of it); a key group quantized over tokens a query must not see moves them by > 1e-2."""
    model = tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=SEQ, n_layers=1)
    tokens = two_sequences()[:1, :136]
    step = chunked_logits(model, tokens, name, (1,) * tokens.shape[1])
    for chunk in (7, 32, 64):
        sizes = [chunk] * (tokens.shape[1] // chunk) + ([tokens.shape[1] % chunk] if tokens.shape[1] % chunk else [])
        got = chunked_logits(model, tokens, name, sizes)
        assert (got - step).abs().max().item() <= 1e-5 * step.abs().max().item(), (chunk, (got - step).abs().max().item())


def test_the_integer_caches_are_not_dense():
    """The equalities above are not vacuous: the integer caches' logits are not the dense cache's."""
    model = tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=SEQ)
    tokens = two_sequences()[:1, :72]
    dense = chunked_logits(model, tokens, "dense", (72,))
    for name in ("int8", "int4"):
        assert (dense - chunked_logits(model, tokens, name, (72,))).abs().max().item() > 1e-4


@pytest.mark.parametrize("name", ["int4", "tq-k4v4+center=none+kweights=none", "tq-k4v4", "tq-k4v4+prerope+sink1+recent8",
                                  "tq-k3v3+prerope+sink1+halloc=k2433v3342+vq+norms8"])
def test_the_first_chunk_is_causal_too(model, name):
    """Tokens 30..39 of a 40-token prefill replaced: positions 0..29 must not move."""
    a = two_sequences()[:1, :104]
    b = a.clone()
    b[:, 30:40] = (a[:, 30:40] + 1) % 97
    la, lb = chunked_logits(model, a, name, (40, 64)), chunked_logits(model, b, name, (40, 64))
    assert torch.equal(la[:, :30], lb[:, :30]), (la[:, :30] - lb[:, :30]).abs().max()
