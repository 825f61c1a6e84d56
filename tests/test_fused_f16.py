"""The fused decode step on dense-f16 / dense-bf16 caches (kernels/decode.c reading 16-bit K/V): it equals
the module path, keeps greedy SmolLM2 text, and its AVX-512, AVX2 and plain-C builds all do."""

from __future__ import annotations

import copy
import ctypes
import platform
import subprocess
from ctypes import c_int, c_int64, c_void_p

import numpy as np
import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.model.llama import Decoder
from kvlab.model.fused import FusedDecodeStep, decode_step_kind, fused_decode_step, fused_step_off

from .conftest import tiny_model
from .kernel_checks import library_variant, require_kernel

NAMES = {"dense-f16": (1, torch.float16), "dense-bf16": (2, torch.bfloat16)}   # name: (decode.c KV type, dtype)
CONFIGS = {
    "MHA": dict(n_heads=4, n_kv_heads=4),
    "GQA": dict(n_heads=4, n_kv_heads=2),
    "MQA": dict(n_heads=4, n_kv_heads=1),
    "window": dict(n_heads=4, n_kv_heads=2, sliding_window=5),
    "head-dim-16": dict(n_heads=4, n_kv_heads=2, d_model=64),   # 16-lane chunks of the 16-bit loads; head dim 8 has a tail
}


@pytest.fixture(scope="module")
def native():
    return require_kernel()


@pytest.fixture(scope="module")
def variants(native):
    """{"native": lib, "avx2": lib, "plain-c": lib}: the library built for this CPU, for Haswell (AVX2 + F16C,
    no AVX-512) and for baseline x86-64 (no F16C: the plain-C conversions). Off x86, only the native one."""
    libs = {"native": native.lib}
    if platform.machine() not in ("x86_64", "AMD64"):
        return libs
    for label, variant in (("avx2", "avx2"), ("plain-c", "plain")):
        libs[label] = ctypes.CDLL(str(library_variant(variant)))     # a failed build fails the tests
    return libs


def decode(model, tokens, name, first_chunk, step=None):
    """Prefill `first_chunk` tokens with the modules, then one token at a time through `step` (None: the
    modules); logits (1, T, V) and the cache."""
    cache = make_cache(name, CacheGeometry.for_model(model.config, capacity=tokens.shape[1]))
    model.fused = None
    with torch.no_grad():
        out = [model(tokens[:, :first_chunk], cache, last_only=False)]
        model.fused = step
        for t in range(first_chunk, tokens.shape[1]):
            if step is not None:
                assert step.accepts(tokens[:, t:t + 1], cache)   # the fused step really runs
            out.append(model(tokens[:, t:t + 1], cache))
    model.fused = None
    return torch.cat(out, dim=1), cache


def assert_fused_equals_modules(model, tokens, name, first_chunk, lib):
    """Prefill with the modules, then at every later position one fused step and one module step from the
    same cache: logits within 1e-5 of their scale, the stored K/V bit-identical.

    Except where fp32 rounding (C against torch, ~1e-7) puts one of the new token's K/V values on the other
    side of a 16-bit rounding edge: the stored values then differ by an ulp (2^-11 relative in f16, 2^-8 in
    bf16) and that moves the logits by up to ~1e-3 of their scale; such steps are held to 2e-3 and must be
    the exception (from step to step the two paths never drift apart: both start from the same cache)."""
    step = FusedDecodeStep(model, lib)
    cache = make_cache(name, CacheGeometry.for_model(model.config, capacity=tokens.shape[1]))
    model.fused = None
    exact = 0
    with torch.no_grad():
        model(tokens[:, :first_chunk], cache)
        for t in range(first_chunk, tokens.shape[1]):
            token, fused_cache = tokens[:, t:t + 1], copy.deepcopy(cache)
            assert step.accepts(token, fused_cache)                     # the fused step really runs
            fused = step(token, fused_cache)
            modules = model(token, cache)
            same_kv = torch.equal(fused_cache.k, cache.k) and torch.equal(fused_cache.v, cache.v)
            exact += same_kv
            scale = modules.abs().max().item()
            assert (fused - modules).abs().max().item() < (1e-5 if same_kv else 2e-3) * scale, (t, same_kv)
            assert fused_cache.length == cache.length == t + 1
    assert exact >= (tokens.shape[1] - first_chunk) // 2, f"only {exact} steps stored bit-identical K/V"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", CONFIGS)
def test_fused_step_equals_modules(name, kind, native):
    model = tiny_model(**CONFIGS[kind])
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    assert_fused_equals_modules(model, tokens, name, 3, native.lib)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("variant", ["native", "avx2", "plain-c"])
def test_every_isa_variant_over_several_key_chunks(name, variant, variants):
    """600 positions (three key chunks of 256, a window's edge off their grid) through each build."""
    if variant not in variants:
        pytest.skip(f"no {variant} build off x86")
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, sliding_window=300, max_seq_len=600)
    tokens = torch.randint(0, 97, (1, 600), generator=torch.Generator().manual_seed(8))
    assert_fused_equals_modules(model, tokens, name, 580, variants[variant])


def as_multi_head(model):
    """The model with each KV head repeated for every query head of its group (MHA): the same K/V rows, each query
    reading them alone."""
    config = model.config
    group, d = config.n_heads // config.n_kv_heads, config.d_model // config.n_heads
    mha = Decoder(type(config)(**{**vars(config), "n_kv_heads": config.n_heads})).eval()
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("qkv.weight"):
            q, k, v = value.split([config.n_heads * d, config.n_kv_heads * d, config.n_kv_heads * d])
            repeat = lambda w: w.view(config.n_kv_heads, d, -1).repeat_interleave(group, 0).reshape(-1, w.shape[1])
            value = torch.cat([q, repeat(k), repeat(v)])
        state[key] = value
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(4, 2, 64), (4, 1, 64), (2, 1, 128), (6, 2, 64)])
def test_a_group_reading_its_rows_together_is_each_query_reading_alone(name, n_heads, n_kv_heads, head_dim, native):
    """A GQA group's queries read their KV head's 16-bit rows in one call (AVX2: in passes of up to three queries a
    row); the same model with every KV head repeated per query (MHA: each query reads alone) gives the same logits to
    the bit, over full key tiles, partial ones and a chain's last rows, and the modules' logits."""
    model = tiny_model(n_heads=n_heads, n_kv_heads=n_kv_heads, d_model=n_heads * head_dim, max_seq_len=80)
    tokens = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(n_heads + head_dim))
    # every position after the first through the fused step: torch's products of a prompt chunk may sum in another
    # order for the wider K/V projection
    grouped = decode(model, tokens, name, 1, FusedDecodeStep(model, native.lib))[0]
    mha = as_multi_head(model)
    alone = decode(mha, tokens, name, 1, FusedDecodeStep(mha, native.lib))[0]
    assert torch.equal(grouped, alone)
    modules = decode(model, tokens, name, 1)[0]   # K/V stored by torch: a value may round to the next 16-bit step,
    tolerance = {"dense-f16": 2e-3, "dense-bf16": 1e-2}[name]   # which the next positions carry on (bf16: 2^-8 steps)
    assert (grouped - modules).abs().max() < tolerance * modules.abs().max()


@pytest.mark.parametrize("variant", ["native", "avx2", "plain-c"])
def test_conversions_round_as_torch_does(variant, variants):
    """Every 16-bit pattern reads back exactly; random, tie, subnormal and out-of-range floats round to
    nearest-even as torch's .to() (and a value rounding to Inf is reported)."""
    if variant not in variants:
        pytest.skip(f"no {variant} build off x86")
    lib = variants[variant]
    lib.kvlab_kv_store.argtypes = lib.kvlab_kv_load.argtypes = [c_int, c_void_p, c_int64, c_void_p]
    gen = torch.Generator().manual_seed(2)
    finite = torch.cat([torch.randn(4096, generator=gen) * 10 ** torch.randint(-9, 5, (4096,), generator=gen).float(),
                        torch.tensor([65504.0, 65519.9, -65519.0, 6e-8, 3e-8, 2.9802322e-08, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                                      1 + 2 ** -8, 1 + 3 * 2 ** -8, 0.0, -0.0, 1e-40])])
    for kv_type, dtype in NAMES.values():
        bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        out = torch.empty(65536)
        assert lib.kvlab_kv_load(kv_type, bits.data_ptr(), 65536, out.data_ptr()) == 0
        want = bits.float()
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~want.isnan()], want[~want.isnan()])
        stored = torch.empty(finite.numel(), dtype=dtype)
        expect_inf = not torch.isfinite(finite.to(dtype)).all()
        assert lib.kvlab_kv_store(kv_type, finite.data_ptr(), finite.numel(), stored.data_ptr()) == int(expect_inf)
        assert np.array_equal(stored.view(torch.int16).numpy(), finite.to(dtype).view(torch.int16).numpy())
    big = torch.tensor([1.0, 65520.0])
    assert lib.kvlab_kv_store(1, big.data_ptr(), 2, torch.empty(2, dtype=torch.float16).data_ptr()) == 1   # f16: Inf


@pytest.mark.parametrize("name", NAMES)
def test_fused_step_is_the_same_for_any_thread_count(name, native):
    model = tiny_model(n_heads=4, n_kv_heads=2, max_seq_len=300)
    tokens = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            runs.append(decode(model, tokens, name, 290, FusedDecodeStep(model, native.lib))[0][:, 290:])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("name", NAMES)
def test_smollm2_fused_greedy_text_is_the_modules(smollm2, name):
    """48 greedy tokens into each 16-bit cache with and without the fused step: the same tokens."""
    from kvlab.generate import generate

    model = smollm2.model
    assert isinstance(model.fused, FusedDecodeStep)
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")])
    results = []
    for off in (False, True):
        with fused_step_off(model, off):
            cache = make_cache(name, CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1] + 48))
            assert decode_step_kind(model, cache) == ("modules" if off else "fused")
            results.append(generate(model, ids, cache, 48).token_ids[0])
    assert results[0] == results[1]
    assert fused_decode_step(model) is not None


@pytest.mark.parametrize("env, expected", [({}, "passive"), ({"OMP_WAIT_POLICY": "active"}, "active"),
                                           ({"GOMP_SPINCOUNT": "5000"}, None)])
def test_openmp_threads_wait_passively_unless_the_user_chose(env, expected):
    """`import kvlab` (before torch) sets OMP_WAIT_POLICY=passive for libgomp, leaving any user choice alone."""
    import os
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, kvlab; print(os.environ.get('OMP_WAIT_POLICY'))"
    run = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == str(expected)
