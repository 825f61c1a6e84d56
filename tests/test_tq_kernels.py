"""TurboQuant attention straight from the codes in C (kernels/codebook.c) against the torch path, for every width.

Each build variant of codebook.c is compiled here from the same flags as the library with only -march changed
(x86-64-v4: AVX-512, haswell: AVX2, x86-64: plain C) and checked on its own; a build that fails where a compiler
exists is a failure. The cache-level checks swap each variant into real caches (batch 2, MHA/GQA/MQA, head dims
64, 96 and 128, ragged chunks, sink and recent windows) and compare attend() with the torch path
(`code_kernel = None`: decode, then matmul), and the long-chunk path (query blocks x key chunks, online
softmax) with the one-pass path.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvlab.cache import CacheGeometry, attention, compressed, make_cache
from kvlab.cache.attention import grouped_attention
from kvlab.cache import tq_codec
from kvlab.cache.tq_codec import RotatedCodes
from kvlab.errors import ConfigError
from kvlab.kernels.codebook import CodebookKernel, CodeLayout

from .kernel_checks import MARCH, library_variant, one_thread, require_kernel  # noqa: F401  (one_thread: autouse)



@pytest.fixture(scope="module", params=list(MARCH))
def variant(request) -> CodebookKernel:
    """The kernels (codebook.c among them) built for one instruction set (skipped only where that build cannot run here)."""
    name = request.param
    target = library_variant(name)
    kernel = CodebookKernel(ctypes.CDLL(str(target)), target)
    assert kernel.variant == name
    return kernel


def random_codes(gen: torch.Generator, B: int, H: int, slots: int, row_bytes: int) -> torch.Tensor:
    """Any byte string is a valid row: every plane's bits decode to a code below 2^bits."""
    return torch.randint(0, 256, (B, H, slots, row_bytes), generator=gen, dtype=torch.uint8)


#: every width at head dim 64 (1..8 bits: one- and two-register permutes and gathers), the cache widths elsewhere
#: (AVX-512 reads parts that end inside a 16-channel block in registers too: 4.125 at 64 is 8 channels at 5 bits and 56
#: at 4, 3.5 at 80 is 40 and 40, 1.25 at 72 is 18 and 54)
WIDTHS = {64: [1, 2, 3, 4, 5, 6, 7, 8, 2.5, 3.5, 4.25, 4.125, 2.875], 72: [1.25, 3, 4], 80: [3, 4, 5, 3.5],
          96: [2, 3, 4, 5, 2.5], 128: [3, 4, 5, 3.5, 4.125]}


@pytest.mark.parametrize("dim", list(WIDTHS))
def test_each_variant_scores_mixes_and_decodes_like_torch(variant, dim):
    """dots, mix and decode of every width (fractional ones: two parts) against RotatedCodes.decode + matmul,
    on ragged spans [start, start + n) of a (2, 3, slots) buffer; and the QJL signs as 1-bit codes of ±1."""
    gen = torch.Generator().manual_seed(dim)
    for bits in WIDTHS[dim]:
        try:
            codes = RotatedCodes(dim, bits)
        except ConfigError:
            continue  # e.g. 4.25 bits do not split 80 channels
        layout = codes.layout
        buf = random_codes(gen, 2, 3, 53, layout.row_bytes)
        assert variant.dots(buf, 7, 0, layout, torch.randn(2, 3, 5, dim)).shape == (2, 3, 5, 0)
        assert torch.equal(variant.mix(buf, 7, 0, layout, torch.rand(2, 3, 5, 0)), torch.zeros(2, 3, 5, dim))
        for start, n in ((0, 53), (5, 17), (50, 3)):
            values = codes.decode(buf[:, :, start:start + n])                     # (2, 3, n, d) the reference
            q = torch.randn(2, 3, 5, dim, generator=gen)
            w = torch.rand(2, 3, 5, n, generator=gen)
            torch.testing.assert_close(variant.decode(buf, start, n, layout), values, atol=0, rtol=0)
            torch.testing.assert_close(variant.dots(buf, start, n, layout, q), q @ values.transpose(-1, -2), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(variant.mix(buf, start, n, layout, w), w @ values, atol=1e-5, rtol=1e-5)
    signs = CodeLayout.of([(0, dim, 1)], [torch.tensor([-1.0, 1.0])], dim // 8)
    buf = random_codes(gen, 1, 2, 9, dim // 8)
    bits = (buf[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1                  # (1, 2, 9, d/8, 8)
    pm = bits.reshape(1, 2, 9, dim).float() * 2 - 1
    q = torch.randn(1, 2, 4, dim, generator=gen)
    torch.testing.assert_close(variant.dots(buf, 0, 9, signs, q), q @ pm.transpose(-1, -2), atol=1e-5, rtol=1e-5)


#: +vq widths whose block parts hold block counts that are not a multiple of 16 (AVX-512 reads blocks in groups of 16,
#: the last partial): at 64, 3.5 bits is 8 blocks at 3 bits beside 32 channels at 4 and 3.125 is 14 blocks beside 8
#: channels at 4; at 128, 28 blocks (16 + 12); 2.5 bits a 3-bit and a 2-bit block part; 40 and 72 have dpad > d
VQ_WIDTHS = {64: [3.5, 3.125, 3, 2.5, 2], 128: [3.5, 3.125, 2.5, 2], 40: [3, 2], 72: [3, 2.5]}


def _random_points(dim: int, bits: int) -> torch.Tensor:
    """(K, 4) made-up magnitude points: the readers must return whatever the table holds (no k-means to wait for)."""
    return torch.rand(1 << (4 * bits - 4), 4, generator=torch.Generator().manual_seed(10 * dim + bits))


@pytest.mark.parametrize("dim", list(VQ_WIDTHS))
def test_each_variant_reads_block_codes_like_torch(variant, dim, monkeypatch):
    """+vq block parts read by each build: decode bit for bit as RotatedCodes.decode (torch), dots and mix as its
    values times the queries / weights, on random rows (any byte string is a valid row) over ragged spans."""
    monkeypatch.setattr(tq_codec, "magnitude_codebook", _random_points)
    gen = torch.Generator().manual_seed(dim)
    for bits in VQ_WIDTHS[dim]:
        codes = RotatedCodes(dim, bits, vector=True)
        assert codes.vector, bits
        layout = codes.layout
        buf = random_codes(gen, 2, 3, 53, layout.row_bytes)
        for start, n in ((0, 53), (5, 17), (50, 3), (9, 1)):
            values = codes.decode(buf[:, :, start:start + n])                     # (2, 3, n, d) the reference
            q = torch.randn(2, 3, 5, dim, generator=gen)
            w = torch.rand(2, 3, 5, n, generator=gen)
            assert torch.equal(variant.decode(buf, start, n, layout), values), (bits, start, n)
            torch.testing.assert_close(variant.dots(buf, start, n, layout, q), q @ values.transpose(-1, -2), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(variant.mix(buf, start, n, layout, w), w @ values, atol=1e-5, rtol=1e-5)


def test_the_mix_is_the_same_for_any_thread_count():
    kernel = _native()
    codes = RotatedCodes(64, 3)
    buf = random_codes(torch.Generator().manual_seed(1), 1, 3, 1500, codes.layout.row_bytes)
    w = torch.rand(1, 3, 3, 1500)
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(kernel.mix(buf, 0, 1500, codes.layout, w))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


GEOMETRIES = {  # (n_heads, n_kv_heads, head_dim)
    "MHA-96": (4, 4, 96),
    "GQA-64": (6, 2, 64),
    "MQA-128": (4, 1, 128),
}
#: every name once per build variant, the geometries taking turns (each sees every geometry over the list)
CASES = [("tq-k4v4", "GQA-64"), ("tq-k3v3", "MHA-96"), ("tq5", "MQA-128"), ("tq3.5", "GQA-64"), ("tq-k5v3", "MHA-96"),
         ("tq-k4v4+qjl", "MQA-128"), ("tq-k3v3+sink3+recent8", "GQA-64"), ("tq-k5v3+sink1", "MQA-128"), ("tq2.5+recent16", "MHA-96"),
         ("tq-k4.125v4.125", "GQA-64")]     # 56 channels at 4 bits, 8 at 5: no whole block of 16
CHUNKS = (21, 1, 5, 37, 1)


def _geometry(key: str, capacity: int = 96, window: int | None = None) -> CacheGeometry:
    n_heads, n_kv, dim = GEOMETRIES[key]
    return CacheGeometry(n_layers=1, n_kv_heads=n_kv, head_dim=dim, batch=2, capacity=capacity, n_heads=n_heads, window=window)


def _feed_pair(name: str, geometry: CacheGeometry, kernel, chunks=CHUNKS, seed: int = 0):
    """Two caches fed the same K/V in `chunks`, one reading through `kernel`, one through torch; yields the
    two attend() outputs of every layer after every chunk."""
    direct, reference = make_cache(name, geometry), make_cache(name, geometry)
    direct.code_kernel, reference.code_kernel = kernel, None
    gen = torch.Generator().manual_seed(seed)
    g = geometry
    for T in chunks:
        for layer in range(g.n_layers):
            k = torch.randn(g.batch, g.n_kv_heads, T, g.head_dim, generator=gen)
            v = torch.randn(g.batch, g.n_kv_heads, T, g.head_dim, generator=gen)
            q = torch.randn(g.batch, g.n_heads, T, g.head_dim, generator=gen)
            direct.append(layer, k, v)
            reference.append(layer, k, v)
            yield direct.attend(layer, q), reference.attend(layer, q)


@pytest.mark.parametrize("name, geometry", CASES)
def test_every_width_attends_from_codes_like_the_torch_path(variant, name, geometry):
    for ours, reference in _feed_pair(name, _geometry(geometry), variant):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tq-k4v4", "tq3.5+sink2+recent8", "tq-k5v3+qjl"])
def test_the_kernel_path_never_decodes_the_whole_context(name, monkeypatch):
    """With the kernel, reading never calls torch's decode (the full (n, d) tensor per head): the codes are read in C
    in place (kernels/paged.c kvlab_tq_attention), +qjl's sketched residuals too."""
    kernel = _native()
    spans = []
    original = CodebookKernel.decode

    def counted(self, codes, start, n, layout):
        spans.append(n)
        return original(self, codes, start, n, layout)

    monkeypatch.setattr(RotatedCodes, "decode", lambda *_: pytest.fail("torch decoded the codes"))
    monkeypatch.setattr(CodebookKernel, "decode", counted)
    monkeypatch.setattr(compressed, "ATTEND_KEYS", 16)
    monkeypatch.setattr(compressed, "ATTEND_ROWS", 24)
    g = _geometry("GQA-64")
    cache = make_cache(name, g)
    cache.code_kernel = kernel
    gen = torch.Generator().manual_seed(2)
    for T in (40, 1, 30, 1):
        k, v = torch.randn(2, 2, T, 64, generator=gen), torch.randn(2, 2, T, 64, generator=gen)
        cache.append(0, k, v)
        assert torch.isfinite(cache.attend(0, torch.randn(2, 6, T, 64, generator=gen))).all()
    assert not spans


@pytest.mark.parametrize("name, window, flash", [("tq-k4v4", None, True), ("tq-k3v3+sink3+recent8", 11, True),
                                                  ("tq-k5v3+qjl+sink1", None, True), ("tq3.5+sink2+recent8", 11, False)])
def test_long_chunks_in_bounded_blocks_equal_one_pass(name, window, flash, monkeypatch):
    """A chunk whose logits exceed one block is read in query blocks x key chunks joined by their log-sum-exps
    (torch's flash kernel, or the plain softmax where it is missing): the same as the one-pass read (both with
    the C kernel) and as dense attention over the stored K/V; every block stays within ATTEND_ROWS x ATTEND_KEYS."""
    kernel = _native()
    if not flash:
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    g = _geometry("GQA-64", capacity=160, window=window)
    blocked, one_pass = make_cache(name, g), make_cache(name, g)
    blocked.code_kernel = one_pass.code_kernel = kernel
    shapes = []
    span_attend = type(blocked)._span_attend

    def recorded(self, layer, qg, lo, hi, mask, first_query):
        shapes.append((qg.shape[2], hi - lo))
        return span_attend(self, layer, qg, lo, hi, mask, first_query)

    gen = torch.Generator().manual_seed(3)
    for T in (70, 60, 12):
        k, v = torch.randn(2, 2, T, 64, generator=gen), torch.randn(2, 2, T, 64, generator=gen)
        q = torch.randn(2, 6, T, 64, generator=gen)
        blocked.append(0, k, v)
        one_pass.append(0, k, v)
        reference = one_pass.attend(0, q)
        first_read = blocked.awaits_queries(0)                      # the first chunk is read exactly, then coded
        with monkeypatch.context() as patch:
            patch.setattr(compressed, "ATTEND_ROWS", 45)
            patch.setattr(compressed, "ATTEND_KEYS", 32)
            patch.setattr(type(blocked), "_span_attend", recorded)
            ours = blocked.attend(0, q)
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
        keys, values = (k, v) if first_read else blocked.dequantized(0)
        torch.testing.assert_close(ours, grouped_attention(q, keys, values, blocked.scale, window=window), atol=2e-5, rtol=1e-4)
    assert shapes and max(r for r, _ in shapes) <= 45 and max(n for _, n in shapes) <= 32


def test_buffers_that_do_not_match_the_layout_are_one_line_errors():
    kernel = _native()
    layout = RotatedCodes(64, 3).layout
    codes = torch.zeros(1, 2, 8, layout.row_bytes, dtype=torch.uint8)
    q, w = torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 8)
    assert kernel.dots(codes, 0, 8, layout, q).shape == (1, 2, 3, 8)
    bad = {
        "row bytes of another width": lambda: kernel.dots(codes[..., :-1].contiguous(), 0, 8, layout, q),
        "span past the slots": lambda: kernel.dots(codes, 4, 5, layout, q),
        "negative start": lambda: kernel.mix(codes, -1, 8, layout, w),
        "query of another head dim": lambda: kernel.dots(codes, 0, 8, layout, torch.zeros(1, 2, 3, 32)),
        "weights shorter than the span": lambda: kernel.mix(codes, 0, 8, layout, w[..., :4]),
        "fp64 query": lambda: kernel.dots(codes, 0, 8, layout, q.double()),
        "3-D codes": lambda: kernel.decode(codes[0], 0, 8, layout),
    }
    for what, call in bad.items():
        with pytest.raises(ConfigError) as err:
            call()
        assert "\n" not in str(err.value), what


def _native() -> CodebookKernel:
    """The codebook kernels of the library the caches load (fails where a compiler exists but it did not build)."""
    from kvlab.kernels.codebook import codebook_kernel_for

    require_kernel()
    kernel = codebook_kernel_for(torch.device("cpu"))
    assert kernel is not None
    return kernel
