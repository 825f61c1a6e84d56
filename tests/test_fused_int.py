"""The fused decode step on integer caches (kernels/decode.c's integer layers, model/fused_int.py): it stores codes,
scales, zero points and the key stage bit for bit as QuantizedCache._store does from the same K/V, equals the module
path for every width and option it serves, keeps greedy SmolLM2 text, gives the same logits for any thread count
(AVX-512, AVX2 and plain-C builds alike), and K/V it cannot store are the module path's one-line errors.

Tolerances. From the same K/V, the C store and `_store` are the same IEEE operations (min/max, f16 rounding to
nearest even, one fp32 subtraction and division, round half to even, clamp): every stored byte is identical
(test_store_is_the_module_paths_bit_for_bit). In a model step the two paths compute the new token's K/V in another
order (~1e-7 relative), so the stage rows agree to fp32 rounding and, rarely, a value lying that close to a rounding
edge takes the neighbouring code or f16 scale. Attention sums the same dequantized values in another order (chunks
combined in C against one torch softmax; the module path's int8/int4 kernels fold the scales into the query):
logits agree within ~1e-5 of their scale when both stored the same codes, up to ~6e-5 at a position where this random
model is ill-conditioned (the dense cache's fused step differs from its modules by ~3e-5 there too): held to 1e-4,
and to 1e-5 against the torch reference at other positions; within 5e-3 when a code flipped (one code of one vector
moves them by up to ~1e-3).
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.cache.quantized import QuantizedCache
from kvlab.errors import NonFiniteError
from kvlab.kernels import check_buffer
from kvlab.model import fused_int
from kvlab.model.fused import FusedDecodeStep, decode_step_kind, fused_step_off

from .kernel_checks import MARCH, one_thread  # noqa: F401  (one_thread: autouse)
from . import test_fused_codes as codes_checks
from .test_fused_codes import GEOMETRIES, assert_held_rows_agree, copied, model_for, native, variants  # noqa: F401  (fixtures)

#: widths, groups and options the step serves (each at least once): groups of 8..64 tokens cross chunk boundaries
NAMES = ["int8", "int4", "int4+g16", "int3+g8", "int2+g16+sink3", "int4+sink1+recent8", "int8+recent5+fp-first-last",
         "int5+g64"]


def checked(t: torch.Tensor, shape: tuple[int, ...], what: str, dtype: torch.dtype) -> int:
    check_buffer("test", what, t, dtype, shape)
    return t.data_ptr()


def awkward_rows(t: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads, d) keys and values of token t that exercise every rounding rule: small integers (codes exactly half
    way between two levels: ties to even), constant channels (a zero scale), ranges near float16's largest value and
    below its smallest normal (subnormal scales), and plain normal values (zero points rounded above the minimum)."""
    g = torch.Generator().manual_seed(t)
    kind = t % 4
    if kind == 0:
        k, v = torch.randint(0, 31, (2, heads, d), generator=g).float()
    elif kind == 1:
        k, v = torch.randn(2, heads, d, generator=g) * 6e4 / 5
    elif kind == 2:
        k, v = torch.randn(2, heads, d, generator=g) * 1e-6 + 3e-4
    else:
        k, v = torch.randn(2, heads, d, generator=g) * 3
    k[:, : d // 4] = 1.25                                             # constant channels over a whole key group
    v[:, : 8] = -2.5                                                  # a constant value group (8 channels)
    return k.clamp(-65504, 65504).contiguous(), v.clamp(-65504, 65504).contiguous()


def store_append(lib):
    lib.kvlab_int_append.argtypes = [ctypes.POINTER(fused_int.Quantized), ctypes.c_int, ctypes.c_int, ctypes.c_int32,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.kvlab_int_append.restype = ctypes.c_int
    return lib.kvlab_int_append


@pytest.mark.parametrize("name", ["int8", "int4", "int4+g16", "int3+g8", "int1+g4", "int6+g8", "int7"])
def test_store_is_the_module_paths_bit_for_bit(name, native):
    """70 tokens one at a time (groups complete every G tokens, several times) into the C store and into
    QuantizedCache.append from the same K/V: codes, scales, zero points and the stage are identical after each."""
    heads, d = 2, 64
    geometry = CacheGeometry(n_layers=1, n_kv_heads=heads, head_dim=d, capacity=72)
    modules, fused = make_cache(name, geometry), make_cache(name, geometry)
    q = fused_int.quantized(fused, 0, d, checked)
    append = store_append(native.lib)
    for t in range(70):
        k, v = awkward_rows(t, heads, d)
        modules.append(0, k[None, :, None], v[None, :, None])
        assert append(ctypes.byref(q), heads, d, t, k.data_ptr(), v.data_ptr()) == 0
        for buffer in QuantizedCache.BUFFERS:
            assert torch.equal(getattr(fused, buffer)[0], getattr(modules, buffer)[0]), (name, t, buffer)


@pytest.mark.parametrize(("what", "at"), [("key", 0), ("value", 1)])
def test_store_refuses_kv_beyond_float16_like_the_module_path(what, at, native):
    """A key or value past float16's range: the module path's one-line error, nothing written."""
    heads, d = 2, 64
    geometry = CacheGeometry(n_layers=1, n_kv_heads=heads, head_dim=d, capacity=8)
    modules, fused = make_cache("int4", geometry), make_cache("int4", geometry)
    q = fused_int.quantized(fused, 0, d, checked)
    kv = list(awkward_rows(3, heads, d))
    kv[at][1, 5] = -7e4
    with pytest.raises(NonFiniteError) as want:
        modules.append(0, kv[0][None, :, None], kv[1][None, :, None])
    assert store_append(native.lib)(ctypes.byref(q), heads, d, 0, kv[0].data_ptr(), kv[1].data_ptr()) == 1
    with pytest.raises(NonFiniteError) as got:
        fused_int.raise_range_error(q)
    assert str(got.value) == str(want.value) and str(want.value).startswith(f"{what} magnitude 7e+04")
    assert all(not getattr(fused, buffer)[0].any() for buffer in QuantizedCache.BUFFERS)


def compare_stored(fused, modules) -> bool:
    """Both caches hold the same tokens; True when every code, scale and zero point is identical. A tiny fraction may
    differ (a value at a rounding edge, see the module docstring); full-precision rows agree to fp32 rounding."""
    assert fused._lengths == modules._lengths and fused._n_comp == modules._n_comp
    identical = True
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        for layer, want in getattr(modules, name).items():
            got = getattr(fused, name)[layer]
            if not torch.equal(got, want):
                identical = False
                assert (got != want).float().mean().item() < 0.01, (name, layer)
    assert_held_rows_agree(fused, modules, ("k_stage", "_sink_k", "_sink_v", "_win_k", "_win_v"))
    return identical


def assert_fused_equals_modules(model, name: str, first: int, steps: int, lib, torch_reference: bool = False,
                                exact_logits: float = 1e-4):
    """test_fused_codes' step-by-step check with the integer caches' comparison and logit tolerance."""
    codes_checks.assert_fused_equals_modules(model, name, first, steps, lib, torch_reference, exact_logits, compare_stored)


@pytest.mark.parametrize("name", NAMES)
def test_fused_step_equals_modules(name, native):
    """Two key chunks of codes (256 + the rest); steps that complete key groups; sinks and windows fill and spill."""
    assert_fused_equals_modules(model_for("GQA-128"), name, 262, 10, native.lib)


@pytest.mark.parametrize("variant", list(MARCH))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_every_isa_variant_stores_and_attends_like_torch(variant, geometry, variants):  # noqa: F811
    """Each build (AVX-512, AVX2, plain C), MHA/GQA/MQA at head dims 64/128/96, against the modules reading the codes
    in torch: int4 across a group boundary, int3 with a sink and a window."""
    if variant not in variants:
        pytest.skip(f"no {variant} build on this CPU")
    model = model_for(geometry)
    for name in ("int4+g8", "int3+g16+sink3+recent5"):
        assert_fused_equals_modules(model, name, 259, 6, variants[variant], torch_reference=True, exact_logits=5e-5)


def test_fused_step_is_the_same_for_any_thread_count(native):
    """1 and 2 threads give bit-identical logits over three key chunks of codes."""
    codes_checks.assert_same_logits_for_any_thread_count(native, "int4+g16+recent8")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_smollm2_greedy_text_is_the_modules(name, smollm2):
    """16 greedy tokens with and without the fused step: the same tokens."""
    from kvlab.generate import generate

    model = smollm2.model
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")])
    results = []
    for off in (False, True):
        with fused_step_off(model, off):
            cache = make_cache(name, CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1] + 16))
            assert decode_step_kind(model, cache) == ("modules" if off else "fused")
            results.append(generate(model, ids, cache, 16).token_ids[0])
    assert results[0] == results[1]


def test_what_it_does_not_serve_takes_the_modules(native):
    """Batches and bf16 caches take the modules; a short prompt's tokens fill the sink and the window in C."""
    model = model_for("MQA-96", max_seq_len=40)
    step = FusedDecodeStep(model, native.lib)
    geometry = CacheGeometry.for_model(model.config, capacity=40)
    assert step.serves(make_cache("int4+g16+sink2+recent4+fp-first-last", geometry))
    assert not step.serves(make_cache("int4", CacheGeometry.for_model(model.config, batch=2, capacity=40)))
    assert not step.serves(make_cache("int4", geometry, dtype=torch.bfloat16))
    one = torch.tensor([[3]])
    cache = make_cache("int4+g4+sink2+recent3", geometry)
    with torch.no_grad():
        model.fused = None
        model(torch.tensor([[1, 2]]), cache)
        for _ in range(12):
            assert step.accepts(one, cache)
            step(one, cache)
    assert cache._n_comp == [9] * model.config.n_layers and cache.layer_length(0) == 14


@pytest.mark.parametrize(("bad", "expect"), [(float("nan"), "NaN or Inf in the keys/values appended to layer 1"),
                                             (1e9, "value magnitude")])
def test_bad_kv_is_the_module_paths_error(bad, expect, native):
    """A NaN value, or one past float16's range, in layer 1: the module path's one-line NonFiniteError, layer 0
    written, layer 1 not."""
    model = model_for("GQA-128", max_seq_len=20)
    cfg = model.config
    v_row = cfg.n_heads * cfg.head_dim + cfg.n_kv_heads * cfg.head_dim   # the first value row of qkv
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    messages = []
    for fused in (True, False):
        model.fused = FusedDecodeStep(model, native.lib) if fused else None
        cache = make_cache("int4+g4", CacheGeometry.for_model(cfg, capacity=16))
        weight = model.blocks[1].attn.qkv.weight
        with torch.no_grad():
            model(tokens[:, :11], cache)
            assert not fused or model.fused.accepts(tokens[:, 11:12], cache)
            saved = weight[v_row].clone()
            weight[v_row] = bad
            with pytest.raises(NonFiniteError) as err:
                model(tokens[:, 11:12], cache)
            weight[v_row] = saved
        messages.append(str(err.value))
        assert [cache.layer_length(0), cache.layer_length(1)] == [12, 11] and cache._n_comp[:2] == [12, 11]
    model.fused = None
    assert all(expect in m and "\n" not in m for m in messages), messages
    number = re.compile(r"\d[\d.e+]*")                      # the magnitudes: each path's own fp32 values
    assert number.sub("#", messages[0]) == number.sub("#", messages[1])
