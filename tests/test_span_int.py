"""Long chunks into the integer caches in bounded blocks over spans of codes (QuantizedCache._span_attend): the torch
path's way (no code kernel) and, with the kernel, a chunk's with a recent window; other chunks take the C read whole.

A chunk whose logits would exceed one block is read in query blocks × key spans joined by their log-sum-exps
(compressed.py), each span decoded into a transient (in C with the code kernel, kernels/intcache.c) and read
by the same per-query rule as the one-pass path (a key group in full precision until complete at the query,
spilled window tokens exact for the queries before the spill). The block sizes are shrunk here so short
sequences cross every case: the span path equals the one-pass path, token-by-token decoding, and stays causal.
intcache.c is also built here per instruction set (AVX-512, AVX2, plain C) and each build checked against torch.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvlab import kernels

from kvlab.cache import CacheGeometry, compressed, make_cache
from kvlab.cache import blocks, quantized
from kvlab.cache.attention import grouped_attention
from kvlab.errors import ConfigError
from kvlab.kernels import BlockKernel

from .compressed_checks import check_attend_is_token_by_token
from .kernel_checks import CPU_NEEDS, MARCH, build_variant, one_thread, require_kernel  # noqa: F401  (one_thread: autouse)
from .test_causal_caches import CHUNKS, SAME, chunked_logits, two_sequences
from .test_int_read_grouping import check_rows_alone_and_together
from .conftest import tiny_model

ROWS, KEYS = 45, 32           # shrunk blocks: a 70-token chunk is 5 query blocks × 3 key spans


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(compressed, "ATTEND_ROWS", ROWS)
    monkeypatch.setattr(compressed, "ATTEND_KEYS", KEYS)


def _pair(name: str, window: int | None, kernel: bool, chunks):
    """(blocked, one_pass) caches fed the same K/V; yields (blocked, one_pass, q) after each chunk."""
    g = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=64, batch=2, capacity=sum(chunks), n_heads=6, window=window)
    blocked, one_pass = make_cache(name, g), make_cache(name, g)
    if kernel and blocked.code_kernel is None:
        require_kernel()
    if not kernel:
        blocked.code_kernel = one_pass.code_kernel = None
    gen = torch.Generator().manual_seed(3)
    for T in chunks:
        k, v = torch.randn(2, 2, T, 64, generator=gen), torch.randn(2, 2, T, 64, generator=gen)
        blocked.append(0, k, v)
        one_pass.append(0, k, v)
        yield blocked, one_pass, torch.randn(2, 6, T, 64, generator=gen)


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("name, window", [("int8", None), ("int4", None), ("int4+g16+sink3", None), ("int4+recent40", None),
                                          ("int3+g8", None), ("int8+sink2+recent8", 11), ("int4+g64+recent5", None)])
def test_long_chunks_in_spans_equal_one_pass(name, window, kernel, monkeypatch):
    """Blocks of at most ROWS rows × spans of at most KEYS tokens == the one-pass read (within fp32 rounding),
    and == dense attention over the cache's own dequantized K/V for the last chunk's last query. With the code kernel
    no chunk is read in spans: the C read takes it whole (kvlab_int_attend), a recent window's spilled tokens too."""
    shapes = []
    span_attend = quantized.QuantizedCache._span_attend

    def recorded(self, layer, qg, lo, hi, mask, first_query):
        shapes.append((qg.shape[2], hi - lo))
        return span_attend(self, layer, qg, lo, hi, mask, first_query)

    for blocked, one_pass, q in _pair(name, window, kernel, (70, 60, 1, 12, 33)):
        reference = one_pass.attend(0, q)
        with monkeypatch.context() as patch:
            patch.setattr(compressed, "ATTEND_ROWS", ROWS)
            patch.setattr(compressed, "ATTEND_KEYS", KEYS)
            patch.setattr(quantized.QuantizedCache, "_span_attend", recorded)
            ours = blocked.attend(0, q)
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    keys, values = blocked.dequantized(0)   # after the last chunk (33 tokens) the last query reads everything as stored
    last = grouped_attention(q[:, :, -1:], keys, values, blocked.scale, window=window)
    torch.testing.assert_close(ours[:, :, -1:], last, atol=2e-5, rtol=1e-4)
    in_spans = not kernel or blocked.code_kernel is None                                # int3: no C read
    assert bool(shapes) == in_spans, (name, kernel, len(shapes))
    assert not shapes or (max(r for r, _ in shapes) <= ROWS and max(n for _, n in shapes) <= KEYS)


@pytest.mark.parametrize("name", ["int4", "int8+sink3", "int4+g16+recent40"])
def test_the_span_path_reads_what_token_by_token_decoding_reads(name, small_blocks):
    check_attend_is_token_by_token(name, chunks=(40, 1, 32, 23))


@pytest.mark.parametrize("name", ["int4", "int4+recent40"])
def test_later_tokens_never_change_earlier_logits_in_long_chunks(name, monkeypatch):
    model = tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=sum(CHUNKS))
    monkeypatch.setattr(compressed, "ATTEND_ROWS", 24)
    monkeypatch.setattr(compressed, "ATTEND_KEYS", 16)
    spans = []
    monkeypatch.setattr(quantized.QuantizedCache, "_span_attend",
                        lambda self, *args, _f=quantized.QuantizedCache._span_attend: spans.append(1) or _f(self, *args))
    tokens = two_sequences()
    a = chunked_logits(model, tokens[:1], name, CHUNKS)
    b = chunked_logits(model, tokens[1:], name, CHUNKS)
    assert spans or kernels.block_kernel() is not None                           # with the kernel: the C read
    assert torch.equal(a[:, :SAME], b[:, :SAME]), (a[:, :SAME] - b[:, :SAME]).abs().max()
    assert not torch.equal(a[:, SAME:], b[:, SAME:])


def test_with_the_kernel_a_long_chunk_is_read_in_c(monkeypatch, small_blocks):
    """With the code kernel, a long chunk of a cache with a sink and a recent window (tokens it pushes out of the
    window are read exact by its earlier queries) is read by the C read: never unpacked in torch, never decoded into a
    transient, never in spans, and equal to the torch path's read in spans."""
    require_kernel()
    windows = []
    original = BlockKernel.int_attention
    monkeypatch.setattr(BlockKernel, "int_attention",
                        lambda self, *a, **kw: windows.append(kw.get("recent", 0)) or original(self, *a, **kw))
    for blocked, one_pass, q in _pair("int4+sink2+recent8", None, True, (90, 70)):
        one_pass.code_kernel = None                                             # the torch path, in spans
        want = one_pass.attend(0, q)
        with monkeypatch.context() as patch:
            patch.setattr(BlockKernel, "int_decode", lambda *_: pytest.fail("decoded codes into a transient"))
            patch.setattr(blocks, "unpack", lambda *_: pytest.fail("torch unpacked the codes"))
            patch.setattr(quantized.QuantizedCache, "_span_attend", lambda *_: pytest.fail("read in spans"))
            got = blocked.attend(0, q)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert 8 in windows, windows


@pytest.mark.parametrize("bits, group, lo, n", [(4, 32, 0, 96), (8, 16, 5, 37), (4, 8, 31, 1), (8, 32, 64, 0)])
def test_the_c_decode_equals_the_torch_decode(bits, group, lo, n):
    kernel = require_kernel()
    g = CacheGeometry(n_layers=1, n_kv_heads=3, head_dim=64, batch=2, capacity=100, n_heads=3)
    cache = make_cache(f"int{bits}+g{group}", g)
    gen = torch.Generator().manual_seed(bits + group)
    cache.append(0, torch.randn(2, 3, 100, 64, generator=gen) * 3, torch.randn(2, 3, 100, 64, generator=gen))
    cache.code_kernel = None
    want_k, want_v = cache._coded_keys(0, lo, lo + n), cache._values(0, lo, lo + n)
    cache.code_kernel = kernel
    torch.testing.assert_close(cache._coded_keys(0, lo, lo + n), want_k, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(cache._values(0, lo, lo + n), want_v, atol=1e-5, rtol=1e-6)
    assert want_k.shape == (2, 3, n, 64)


def test_decode_arguments_that_do_not_fit_are_one_line_errors():
    kernel = require_kernel()
    codes = torch.zeros(1, 2, 8, 32, dtype=torch.uint8)
    meta = torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    assert kernel.int_decode(4, codes, meta, meta, 0, 8, 4, 1).shape == (1, 2, 8, 64)
    bad = {
        "past the slots": lambda: kernel.int_decode(4, codes, meta, meta, 4, 5, 4, 1),
        "past the metadata rows": lambda: kernel.int_decode(4, codes, meta, meta, 0, 8, 2, 1),
        "int3": lambda: kernel.int_decode(3, codes, meta, meta, 0, 8, 4, 1),
        "row bytes of int8": lambda: kernel.int_decode(8, codes, meta, meta, 0, 8, 4, 1),
        "negative start": lambda: kernel.int_decode(4, codes, meta, meta, -1, 2, 4, 1),
        "fp32 scales": lambda: kernel.int_decode(4, codes, meta.float(), meta, 0, 8, 4, 1),
        "zero group": lambda: kernel.int_decode(4, codes, meta, meta, 0, 8, 0, 1),
        "3-D codes": lambda: kernel.int_decode(4, codes[0], meta, meta, 0, 8, 4, 1),
    }
    for what, call in bad.items():
        with pytest.raises(ConfigError) as err:
            call()
        assert "\n" not in str(err.value), what


def test_without_the_code_kernel_reads_are_spans_too(monkeypatch, small_blocks):
    """int3 (no C kernel) or the torch reference: decode steps and short chunks score and mix span by span,
    never decoding more than ATTEND_KEYS tokens at once, and equal dense attention over the stored K/V."""
    spans = []
    for method in ("_coded_keys", "_values"):
        original = getattr(quantized.QuantizedCache, method)
        monkeypatch.setattr(quantized.QuantizedCache, method,
                            lambda self, layer, lo, hi, _f=original: spans.append(hi - lo) or _f(self, layer, lo, hi))
    for blocked, _, q in _pair("int3+g8+sink1", None, False, (90, 1, 1, 5, 1)):
        spans.clear()
        out = blocked.attend(0, q)
        assert spans and max(spans) <= KEYS, spans
        keys, values = blocked.dequantized(0)
        torch.testing.assert_close(out[:, :, -1:], grouped_attention(q[:, :, -1:], keys, values, blocked.scale), atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=list(MARCH))
def int_variant(request, tmp_path_factory) -> BlockKernel:
    """intcache.c alone, built for one instruction set (skipped only where that build cannot run here), behind the
    library's own front end (its int_* methods with the loaded library's argument types)."""
    name = request.param
    loaded = require_kernel()
    target = build_variant("intcache.c", name, [MARCH[name]], CPU_NEEDS[name], tmp_path_factory.mktemp("intcache"),
                           also=("codebook.c",))
    lib = ctypes.CDLL(str(target))
    variant = BlockKernel.__new__(BlockKernel)
    variant.lib = lib
    for fn in ("kvlab_int_decode", "kvlab_int_attention"):
        getattr(lib, fn).argtypes = getattr(loaded.lib, fn).argtypes
        getattr(lib, fn).restype = ctypes.c_int
    return variant


@pytest.mark.parametrize("name, dim", [("int4", 64), ("int8+g16", 64), ("int4+g8", 48), ("int8", 96)])
def test_each_variant_decodes_and_attends_like_torch(int_variant, name, dim):
    """Every function of intcache.c in each build (AVX-512 paths at head dim 64 and group 32, plain C elsewhere)
    against the torch decode, and the whole read (kvlab_int_attention) against the torch attention, on a cache with
    an open key group (batch 2, GQA)."""
    g = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=dim, batch=2, capacity=80, n_heads=6)
    cache = make_cache(name, g)
    gen = torch.Generator().manual_seed(dim)
    cache.append(0, torch.randn(2, 2, 75, dim, generator=gen) * 2, torch.randn(2, 2, 75, dim, generator=gen))
    cache.code_kernel = None
    complete = 75 // cache.config.group_size * cache.config.group_size
    keys, values = cache._coded_keys(0, 0, complete), cache._values(0, 0, 75)
    cache.code_kernel = int_variant
    torch.testing.assert_close(cache._coded_keys(0, 3, complete), keys[:, :, 3:], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(cache._values(0, 5, 75), values[:, :, 5:], atol=1e-5, rtol=1e-6)
    q = torch.randn(2, 6, 3, dim, generator=gen)                 # the 3 newest tokens' queries: the whole read in C
    cache.code_kernel = None
    want = cache.attend(0, q)
    cache.code_kernel = int_variant
    torch.testing.assert_close(cache.attend(0, q), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, head_dim, run", [("int8", 64, 1), ("int8+g8", 40, 1), ("int4+g16", 48, 2)])
def test_each_variant_reads_a_row_alone_as_in_a_chunk(int_variant, name, head_dim, run):
    """Each build's C read (AVX-512, AVX2, plain C: the compiler's contractions differ) gives a row of a prompt chunk
    the same bits read alone (the folding tile read) as read with the whole chunk (tiles transposed)."""
    check_rows_alone_and_together(name, head_dim, run, kernel=int_variant)


@pytest.mark.parametrize("name, window", [("int4+sink3", None), ("int8+recent8", None), ("int4+g8+sink2+recent8", None),
                                          ("int4+sink2", 24), ("int8+g16+recent8", 24)])
def test_the_c_read_with_sink_and_window_equals_the_torch_path(monkeypatch, name, window):
    """The coded tokens read in C (kvlab_int_attention) merged by log-sum-exp with the sink and the recent window
    equal the torch path's one softmax over every part, for decode steps and for chunks (the model's sliding window
    too), a chunk that pushes tokens out of the recent window included (its earlier queries read them exact)."""
    kernel = require_kernel()
    g = CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=64, batch=2, capacity=120, n_heads=6, window=window)
    cache = make_cache(name, g)
    gen = torch.Generator().manual_seed(len(name))
    calls = []
    monkeypatch.setattr(BlockKernel, "int_attention",
                        lambda self, *a, _f=BlockKernel.int_attention, **kw: calls.append(a[-4]) or _f(self, *a, **kw))
    for T in (40, 1, 1, 5, 1, 30, 1):
        cache.append(0, torch.randn(2, 2, T, 64, generator=gen) * 2, torch.randn(2, 2, T, 64, generator=gen))
        q = torch.randn(2, 6, T, 64, generator=gen)
        cache.code_kernel = None
        want = cache.attend(0, q)
        cache.code_kernel = kernel
        torch.testing.assert_close(cache.attend(0, q), want, atol=2e-5, rtol=1e-5)
    assert 1 in calls and 5 in calls, calls
