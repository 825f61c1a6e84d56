"""The C coder of a token's K/V (kernels/decode.c kvlab_tq_code_tokens, cache/tq_kernel.py): the codes and scales it
writes equal TqCodec.code's (the torch reference) in a single cache's one block and in the serving pool's
many (cache/blocks.py TqBlocks), for every option the presets use; slots it does not hold and a description the call does
not match are refused, and a scale that is not finite is reported, not stored as if it were.

Tolerance (see tests/test_fused_codes.py): C and torch compute y = Π(x-μ)/‖x-μ‖ in another order (~1e-7 apart), so
a coordinate that close to a bucket boundary may take the neighbouring code; such flips must stay a tiny fraction,
and a scale must be within one 16-bit step (or one 8-bit log step) wherever its vector's codes agree.
"""

from __future__ import annotations


import pytest
import torch

from kvlab.cache import CacheGeometry
from kvlab.cache.blocks import TqBlocks
from kvlab.cache.tq_codec import TqCodec
from kvlab.cache.tq_kernel import CodedLayers, code_tokens
from kvlab.errors import ConfigError
from kvlab.rope import apply_rope

from .kernel_checks import one_thread, require_kernel  # noqa: F401  (one_thread: autouse)

NAMES = ["tq-k4v4", "tq-k3v3", "tq4", "tq-k4v4+prerope+sink1", "tq-k4v4+ropemean+sink1+norms8+kscale=lsq", "tq-k3v3+vq+norms8", "tq-k4.25v4+prerope+norms8",
         "tq-k4v4+halloc=k3553v4444", "tq-k3v3+prerope+rot=haar+kweights=none", "tq-k4v3+alloc=k53v24+bf16norms",
         "tq-k4v3+qjl", "tq-k4v4+qjl+prerope+bf16norms", "tq-k4v4+outliers2", "tq-k4v3.625+prerope+outliers1+sink1+norms8",
         "tq-k4v4+qjl+outliers3+kscale=lsq", "tq-k4v4+ropemean+qjl"]
N_TOKENS = 40


@pytest.fixture(scope="module")
def kernel():
    return require_kernel()


def calibrated_codec(name: str, head_dim: int = 64, n_kv_heads: int = 2, n_layers: int = 2, seed: int = 0):
    """A codec of one row, as the pool's, calibrated on random keys with a common component."""
    from kvlab.cache import make_cache

    gen = torch.Generator().manual_seed(seed)
    inv_freq = tuple(10000.0 ** (-i / (head_dim // 2)) for i in range(head_dim // 2))
    geometry = CacheGeometry(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, n_heads=2 * n_kv_heads,
                             capacity=32, rope_inv_freq=inv_freq)
    probe = make_cache(name, geometry)
    for layer in range(n_layers):
        k = torch.randn(1, n_kv_heads, 32, head_dim, generator=gen) + 2.0
        probe.append(layer, k, torch.randn(k.shape, generator=gen))
        probe.attend(layer, torch.randn(1, 2 * n_kv_heads, 32, head_dim, generator=gen))
    codec = TqCodec(probe.config, geometry, range(n_layers), 1, "cpu", probe.config.full.sink)   # as calibrated_codec
    codec.take_calibration(probe.codec)
    return codec


def reference(codec, layer: int, k: torch.Tensor, v: torch.Tensor, rope) -> dict[str, torch.Tensor]:
    """The codec's codes and stored scales of k, v (n, Hkv, d): {name: (n, Hkv[, bytes])}."""
    if rope is not None:
        k = apply_rope(k, rope[0][:, None], -rope[1][:, None])
    turn = rope if codec.config.rope_mean else None                          # (n, d) cos, sin: turned forward again
    coded = codec.stored_scales(layer, codec.code(layer, k.transpose(0, 1)[None], v.transpose(0, 1)[None], turn))
    return {name: coded[name][0].transpose(0, 1) for name in codec.token_shapes()}


def empty_buffers(codec, layer: int, slots: int, block_rows: int) -> dict[str, torch.Tensor]:
    """Zeroed blocks of `block_rows` rows (cache/blocks.py TqBlocks), (slots / block_rows, Hkv, block_rows[, bytes]):
    a pool's many blocks, or a single cache's one (block_rows = slots)."""
    return TqBlocks(codec.token_shapes(), slots // block_rows, block_rows).layer(layer)


def rows_of(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows (n, Hkv|1[, bytes]) of the slots (n,) in blocks (n_blocks, Hkv|1, block_rows[, bytes])."""
    rows = buffer.shape[2]
    return buffer[slots // rows, :, slots % rows]


def assert_codes_agree(codec, got: dict, want: dict) -> None:
    """Codes equal but for a tiny fraction of flipped bytes; scales (+qjl: the residuals' norms) within one step and
    +qjl's signs equal but for a few bits where the codes agree; +outliersN's entries equal."""
    assert set(got) == set(want)
    for name in ("k_codes", "v_codes", *(("k_out_idx",) if "k_out_idx" in got else ())):
        assert (got[name] != want[name]).float().mean().item() < 0.01, name
    for name, codes in (("k_norm", "k_codes"), ("v_norm", "v_codes"), ("k_rnorm", "k_codes"), ("k_signs", "k_codes"),
                        ("k_out_val", "k_out_idx")):
        if name not in got:
            continue
        same = (got[codes] == want[codes]).all(dim=-1)   # (n, Hkv|1)
        a, b = got[name], want[name]
        if name == "k_signs":
            assert (a[same] != b[same]).float().mean().item() < 0.01, name
            continue
        if name == "k_out_val":
            assert torch.equal(a[same], b[same]), name
            continue
        if a.dtype == torch.uint8:
            steps = (a.int() - b.int()).abs()
        else:
            steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        if same.shape != steps.shape:    # +halloc: one row holds every head's codes
            same = same.expand_as(steps)
        assert steps[same].max().item() <= 1, name
        assert (steps > 0).float().mean().item() < 0.05, name


@pytest.mark.parametrize("block_rows", [16, 64], ids=["pool", "single"])
@pytest.mark.parametrize("name", NAMES)
def test_c_coder_writes_what_torch_codes(kernel, name, block_rows):
    codec = calibrated_codec(name)
    gen = torch.Generator().manual_seed(7)
    H, d = codec.geometry.n_kv_heads, codec.geometry.head_dim
    slots = 64
    order = torch.randperm(slots, generator=gen)[:N_TOKENS]                       # the tokens' slots, in any order
    for layer in range(codec.geometry.n_layers):
        k = torch.randn(N_TOKENS, H, d, generator=gen) * 3 + 1.0
        v = torch.randn(N_TOKENS, H, d, generator=gen)
        rope = None
        if codec.config.turns_keys:
            positions = torch.randint(0, 500, (N_TOKENS,), generator=gen)
            cos, sin = codec.position_rope(0, 500)                                # (500, d) each
            rope = cos[positions], sin[positions]
        buffers = empty_buffers(codec, layer, slots, block_rows)
        coded = CodedLayers("test").layer(codec, layer, buffers, (slots // block_rows, block_rows))
        assert code_tokens(kernel, coded, k, v, order, rope)
        got = {n: rows_of(b, order) for n, b in buffers.items()}
        assert_codes_agree(codec, got, reference(codec, layer, k, v, rope))
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[order] = False
        for b in buffers.values():   # nothing written outside the tokens' slots
            assert not rows_of(b, untouched.nonzero()[:, 0]).any()


def test_the_coder_refuses_what_it_does_not_hold_and_reports_an_overflow(kernel):
    codec = calibrated_codec("tq-k4v4")
    H, d = codec.geometry.n_kv_heads, codec.geometry.head_dim
    buffers = empty_buffers(codec, 0, 8, block_rows=4)
    coded = CodedLayers("test").layer(codec, 0, buffers, (2, 4))
    k = v = torch.randn(2, H, d)
    with pytest.raises(ConfigError, match="refused"):
        code_tokens(kernel, coded, k, v, torch.tensor([3, 8]))                   # slot 8 of 8
    with pytest.raises(ConfigError, match="refused"):                            # RoPE for a layer coded after RoPE
        code_tokens(kernel, coded, k, v, torch.tensor([0, 1]), (torch.ones(2, d), torch.zeros(2, d)))
    with pytest.raises(ConfigError, match="keys"):                              # more KV heads than it was checked for
        code_tokens(kernel, coded, torch.randn(2, H + 1, d), torch.randn(2, H + 1, d), torch.tensor([0, 1]))
    assert not buffers["k_codes"].any()
    huge = torch.full((1, H, d), 1e30)                                           # its norm overflows float16
    assert code_tokens(kernel, coded, huge, huge, torch.tensor([5])) is False
