"""The fused decode step on TurboQuant caches (kernels/decode.c coding the new token and attending from the codes,
model/fused_codes.py): it equals the module path for every cache name it serves, keeps greedy SmolLM2 text, gives
the same logits for any thread count, and its AVX-512, AVX2 and plain-C builds all do; what it does not serve takes
the modules, and bad K/V are the module path's one-line errors.

Tolerances. The fused step and the modules compute the same thing in another order (the rotation as a matrix
product instead of Hadamard / Haar products, the norms applied after the dot products, the chunks' softmax sums
combined in C): on these models the logits agree within ~2e-5 of their scale when both stored the same codes, one
step in 216 at 7e-5 (a Haar-rotated tq-k3v3 on a Zen 5 CPU; held to 1e-4, fifty times under a flipped code's effect). The new token's codes come from two computations of y = Π(x-μ)/‖x-μ‖ that differ by fp32
rounding (~1e-7): a coordinate lying that close to a bucket boundary takes the neighbouring code, and a scale
that close to a 16-bit rounding edge rounds to the neighbouring value. Such a step is held to 5e-3 of the scale
(one code of one vector moves the logits by up to a few 1e-3), stored codes must agree but for a tiny fraction,
scales within one 16-bit step where their codes agree (a flipped code changes the renormalized scale), and the
flips must be the exception.
"""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import ConfigError, NonFiniteError
from kvlab.model.fused import FusedDecodeStep, decode_step_kind, fused_step_off

from .conftest import tiny_model
from .kernel_checks import CPU_NEEDS, MARCH, cpu_flags, library_variant, one_thread, require_kernel  # noqa: F401  (one_thread: autouse)

#: every width and option the step serves (each option at least once)
NAMES = ["tq-k4v4", "tq-k3v3", "tq5", "tq3.5", "tq-k5v3", "tq-k3v3+sink4+recent8", "tq-k4v4+recent16+fp-first-last",
         "tq-k4v4+center=kv+kscale=lsq+vscale=unbiased+bf16norms", "tq-k3v3+rot=haar+kweights=none+center=none+kscale=norm",
         "tq-k4v4+prerope+sink1", "tq-k3v3+prerope+recent8", "tq-k4v4+prerope+rot=haar+center=none+kweights=none",
         # a width per layer, per (layer, KV head): 2 layers × 2 KV heads, each head its own packing
         "tq-k4v4+alloc=k35v44+recent4", "tq-k3v3+prerope+sink1+halloc=k2433v3342", "tq-k4v4+prerope+sink1+halloc=k3553v4444+kscale=lsq",
         # 8-bit log scales around each head's centre
         "tq3.5+norms8+recent8", "tq-k4v4+prerope+sink1+halloc=k3553v4444+kscale=lsq+norms8",
         # the tq4 preset; its levers before RoPE at 4.125 bits, a part of d/8 channels at 5 bits (8 at d = 64: no whole
         # block of 16); 4.25-bit keys
         "tq4", "tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq", "tq-k4.25v4+prerope+norms8",
         # keys after RoPE around their offset turned to each position
         "tq-k4v4+ropemean+sink1+norms8+kscale=lsq+vscale=lsq", "tq-k3v3+ropemean+recent8", "tq-k4v4+ropemean+rot=haar+halloc=k3553v4444",
         # the residual's sketch (+qjl) and exact key entries (+outliersN), on the codes and with keys rebuilt before RoPE
         "tq-k4v3+qjl+sink1", "tq-k4v4+qjl+prerope+recent8", "tq-k4v4+outliers2+recent4", "tq-k4v3.625+prerope+outliers1+sink1",
         "tq-k4v4+qjl+outliers1+rot=haar", "tq-k4v4+ropemean+qjl+sink1"]
#: (n_heads, n_kv_heads, head_dim): MHA, GQA, MQA; head dims 64, 128 and 96 (not a power of two: a dense rotation)
GEOMETRIES = {"MHA-64": (4, 4, 64), "GQA-128": (4, 2, 128), "MQA-96": (3, 1, 96)}


@pytest.fixture(scope="module")
def native():
    return require_kernel()


#: what the fused step links: the step (decode.c), its matrix rows (blockgemv.c) and the codes (codebook.c)
@pytest.fixture(scope="module")
def variants(native):
    """{"avx512": lib, "avx2": lib, "plain": lib}: the kernels built for each instruction set this CPU runs (a
    failed build is a failure where a compiler exists); off x86 only the native library."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {"native": native.lib}
    libs = {}
    for label in MARCH:
        if CPU_NEEDS[label] and CPU_NEEDS[label] not in cpu_flags():
            continue
        libs[label] = ctypes.CDLL(str(library_variant(label)))
        libs[label].kvlab_codebook_variant.restype = ctypes.c_int
        assert libs[label].kvlab_codebook_variant() == {"avx512": 512, "avx2": 256, "plain": 0}[label]
    return libs


def model_for(geometry: str = "GQA-128", max_seq_len: int = 300):
    n_heads, n_kv, hd = GEOMETRIES[geometry]
    return tiny_model(n_heads=n_heads, n_kv_heads=n_kv, d_model=n_heads * hd, max_seq_len=max_seq_len)


def copied(cache):
    """An independent copy of a cache (its codes, norms, calibration and full-precision parts)."""
    return cache.grown(cache.geometry.capacity)


def compare_stored(fused, modules) -> bool:
    """Both caches hold the same tokens; True when every code and scale is identical. Codes may differ in a tiny
    fraction of bytes and scales by one 16-bit step (see the module docstring)."""
    assert fused._lengths == modules._lengths and fused._n_comp == modules._n_comp
    identical = True
    for name in modules.token_buffer_names():
        for layer, want in getattr(modules, name).items():
            got = getattr(fused, name)[layer]
            if torch.equal(got, want):
                continue
            identical = False
            if want.dtype == torch.uint8:
                assert (got != want).float().mean().item() < 0.01, (name, layer)
            else:  # a scale within one 16-bit step, where its vector's codes agree (a flipped code changes ‖ŷ‖)
                codes = name.replace("norm", "codes")
                same_codes = (getattr(fused, codes)[layer] == getattr(modules, codes)[layer]).all(dim=-1)
                steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
                assert steps[same_codes].max().item() <= 1, (name, layer)
    assert_held_rows_agree(fused, modules)
    return identical


def assert_held_rows_agree(fused, modules, parts=("_sink_k", "_sink_v", "_win_k", "_win_v")) -> None:
    """Full-precision rows (sinks, windows, dense layers, and any other `parts`): the new token's K/V as C and torch
    compute them, equal but for fp32 rounding (relative to their scale: up to 1.01e-5 seen on a Zen 5 CPU, held to 3e-5)."""
    held = [(getattr(fused, part)[layer], want) for part in parts for layer, want in getattr(modules, part).items()]
    held += [(getattr(fused._dense[layer], name), getattr(dense, name)) for layer, dense in modules._dense.items() for name in "kv"]
    for got, want in (pair for pair in held if pair[1].numel()):
        assert (got - want).abs().max().item() <= 3e-5 * max(1.0, want.abs().max().item())


def assert_fused_equals_modules(model, name: str, first: int, steps: int, lib, torch_reference: bool = False,
                                exact_logits: float = 1e-4, compare=compare_stored):
    """Prefill `first` tokens with the modules, then at each of `steps` positions one fused step and one module step
    from the same cache (the modules reading the codes in torch when `torch_reference`). `compare(fused, modules)`
    checks what both stored and says whether it is identical; the logits are held to `exact_logits` of their scale
    then, to 5e-3 where a code flipped (the module docstrings say why)."""
    step = FusedDecodeStep(model, lib)
    tokens = torch.randint(0, 97, (1, first + steps), generator=torch.Generator().manual_seed(first))
    cache = make_cache(name, CacheGeometry.for_model(model.config, capacity=first + steps))
    if torch_reference:
        cache.code_kernel = None
    model.fused = None
    identical = 0
    with torch.no_grad():
        model(tokens[:, :first], cache)
        for t in range(first, first + steps):
            token, fused_cache = tokens[:, t:t + 1], copied(cache)
            assert step.accepts(token, fused_cache)                     # the fused step really runs
            fused = step(token, fused_cache)
            modules = model(token, cache)
            same = compare(fused_cache, cache)
            identical += same
            scale = modules.abs().max().item()
            assert (fused - modules).abs().max().item() < (exact_logits if same else 5e-3) * scale, (name, t, same)
    assert identical >= steps // 2, f"{name}: only {identical} of {steps} steps stored identical codes"


@pytest.mark.parametrize("name", NAMES)
def test_fused_step_equals_modules(name, native):
    """Two key chunks of codes (256 + the rest), every width and option; sinks and windows fill and spill."""
    assert_fused_equals_modules(model_for("GQA-128"), name, 270, 6, native.lib)


@pytest.mark.parametrize("variant", list(MARCH))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_every_isa_variant_codes_and_attends_like_torch(variant, geometry, variants):
    """Each build (AVX-512, AVX2, plain C), MHA/GQA/MQA at head dims 64/128/96, against the modules reading the codes
    in torch (a ragged second chunk of codes; a fractional width with a sink and a window)."""
    if variant not in variants:
        pytest.skip(f"no {variant} build on this CPU")
    model = model_for(geometry)
    for name in ("tq-k4v4", "tq3.5+sink3+recent5"):
        assert_fused_equals_modules(model, name, 262, 3, variants[variant], torch_reference=True, exact_logits=5e-5)
    # pre-RoPE keys are rebuilt through the rotation and RoPE in another order than torch's: the module-wide 1e-4
    assert_fused_equals_modules(model, "tq-k4v4+prerope+sink1", 262, 3, variants[variant], torch_reference=True)
    if geometry == "MHA-64":   # block codes and 8-bit log scales (the points of one head dim, trained once)
        assert_fused_equals_modules(model, "tq-k3v3+vq+norms8", 262, 3, variants[variant], torch_reference=True, exact_logits=5e-5)


def assert_same_logits_for_any_thread_count(native, cache_name: str, first: int = 550, geometry: str = "GQA-128") -> None:
    """Ten fused steps after a `first`-token prefill (550: three key chunks of codes) give bit-identical logits at 1
    and 2 threads."""
    model = model_for(geometry, max_seq_len=first + 50)
    step = FusedDecodeStep(model, native.lib)
    tokens = torch.randint(0, 97, (1, first + 10), generator=torch.Generator().manual_seed(3))
    runs = []
    for threads in (1, 2):
        cache = make_cache(cache_name, CacheGeometry.for_model(model.config, capacity=first + 10))
        model.fused = None
        with torch.no_grad():
            model(tokens[:, :first], cache)
            torch.set_num_threads(threads)
            runs.append(torch.cat([step(tokens[:, t:t + 1], cache) for t in range(first, first + 10)], dim=1))
    assert torch.equal(runs[0], runs[1])


def test_fused_step_reads_tq4_at_head_dim_64(native):
    """The tq4 preset's read at head dim 64 (SmolLM2's): its 64-channel 4-bit keys and values scored and mixed by their
    own register kernels, its turned offsets 64 keys per turn of the coefficients, against the modules."""
    assert_fused_equals_modules(model_for("MHA-64"), "tq4", 270, 6, native.lib)


def test_fused_step_reads_a_long_context_in_longer_chunks(native):
    """From 2,048 coded keys on, a TurboQuant layer's keys are read 512 to a chunk (decode.c CODED_LONG): 2,300 tokens
    make four such chunks and a ragged fifth, against the modules and alike at 1 and 2 threads."""
    assert_fused_equals_modules(model_for("MHA-64", max_seq_len=2400), "tq4", 2300, 3, native.lib)
    assert_same_logits_for_any_thread_count(native, "tq4", first=2300, geometry="MHA-64")


@pytest.mark.parametrize("name", ["tq-k3v3+vq", "tq-k3v2.5+vq+norms8+prerope+sink1+recent4"])
def test_fused_step_codes_and_reads_block_codes(name, native):
    """+vq block parts (3 and 2 bits) at head dim 64: the new token's block index chosen in C (nearest magnitude point,
    signs) and the blocks decoded in C, as the modules do (a head dim of 64: the points trained once, ~1 min each)."""
    assert_fused_equals_modules(model_for("MHA-64"), name, 270, 6, native.lib)


def test_fused_step_is_the_same_for_any_thread_count(native):
    """Threads share (KV head, key chunk) items; the chunks' sums are combined in a fixed order."""
    assert_same_logits_for_any_thread_count(native, "tq3.5+recent8")
    assert_same_logits_for_any_thread_count(native, "tq-k4v4+prerope+sink1")


def test_smollm2_greedy_text_is_the_modules(smollm2):
    """16 greedy tokens into tq4 with and without the fused step: the same tokens."""
    from kvlab.generate import generate

    model = smollm2.model
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")])
    results = []
    for off in (False, True):
        with fused_step_off(model, off):
            cache = make_cache("tq-k4v4", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1] + 16))
            assert decode_step_kind(model, cache) == ("modules" if off else "fused")
            results.append(generate(model, ids, cache, 16).token_ids[0])
    assert results[0] == results[1]


def test_caches_it_does_not_serve_take_the_modules(native):
    model = model_for("MQA-96", max_seq_len=40)
    step = FusedDecodeStep(model, native.lib)
    geometry = CacheGeometry.for_model(model.config, capacity=40)
    one = torch.tensor([[3]])
    with torch.no_grad():
        model.fused = step
        assert decode_step_kind(model, make_cache("concat", geometry)) == "modules"
        assert decode_step_kind(model, make_cache("tq3.5+sink4+recent8+fp-first-last", geometry)) == "fused"
        assert decode_step_kind(model, make_cache("tq-k4v4+prerope+sink1", geometry)) == "fused"
        assert not step.serves(make_cache("tq-k4v4", CacheGeometry.for_model(model.config, batch=2, capacity=40)))
        cache = make_cache("tq-k4v4", geometry)
        assert step.serves(cache)
        cache.append(0, torch.randn(1, 1, 9, 96), torch.randn(1, 1, 9, 96))   # a first chunk, never attended
        assert cache.awaits_queries(0) and not step.accepts(one, cache)
        # a short prompt: tokens fill the sink and the window in C; the first coded token (a calibration) takes
        # the modules, every later one the fused step
        cache = make_cache("tq-k4v4+sink2+recent3", geometry)
        model(torch.tensor([[1, 2]]), cache)
        taken = []
        for t in range(8):
            taken.append(step.accepts(one, cache))
            model(one, cache)
        assert taken == [True, True, True, False, True, True, True, True]
    model.fused = None


def test_non_finite_kv_is_the_module_paths_error(native):
    """A NaN key in layer 1: the one-line NonFiniteError of the module path, layer 0 written, layer 1 not; a key too
    large for the 16-bit norms: a one-line NonFiniteError too."""
    model = model_for("GQA-128", max_seq_len=20)
    cfg = model.config
    q_dim = cfg.n_heads * cfg.head_dim
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    for bad, expect in ((float("nan"), "NaN or Inf"), (1e9, "overflows")):
        messages = []
        for fused in (True, False):
            model.fused = FusedDecodeStep(model, native.lib) if fused else None
            cache = make_cache("tq-k4v4", CacheGeometry.for_model(cfg, capacity=16))
            weight = model.blocks[1].attn.qkv.weight
            with torch.no_grad():
                model(tokens[:, :11], cache)
                assert not fused or model.fused.accepts(tokens[:, 11:12], cache)
                saved = weight[q_dim].clone()
                weight[q_dim] = bad                                     # a key row of layer 1
                with pytest.raises(NonFiniteError) as err:
                    model(tokens[:, 11:12], cache)
                weight[q_dim] = saved
            messages.append(str(err.value))
            assert [cache.layer_length(0), cache.layer_length(1)] == [12, 11]
            assert cache._n_comp == [12, 11]
        model.fused = None
        assert all(expect in m and "\n" not in m for m in messages) and "layer 1" in messages[0], messages
        if expect == "NaN or Inf":
            assert messages[0] == messages[1]


def _narrow_dense_keys(cache):
    cache.k = cache.k[:, :, :, :-1]                                  # (L, B, Hkv, capacity - 1, D), same address


def _narrow_int_scales(cache):
    cache.k_scale[0] = cache.k_scale[0][..., :1]                     # (B, Hkv, groups, 1), same address


def _stepped_once(geometry: str, name: str, native):
    """A model of `geometry` with the fused step and a `name` cache after a 9-token prompt and one fused step (its C
    view built and used): (model, cache, the next token)."""
    model = model_for(geometry, max_seq_len=40)
    model.fused = FusedDecodeStep(model, native.lib)
    cache = make_cache(name, CacheGeometry.for_model(model.config, capacity=40))
    one = torch.tensor([[3]])
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1)), cache)
        model.fused(one, cache)
    return model, cache, one


def _narrow_tq_norms(cache):
    cache.k_norm[0] = cache.k_norm[0][..., :-1]                      # (B, Hkv, slots - 1), same address


@pytest.mark.parametrize(("name", "narrow", "what"), [("dense", _narrow_dense_keys, "layer 0 keys"),
                                                      ("int4+g4", _narrow_int_scales, "layer 0 k_scale"),
                                                      ("tq-k4v4", _narrow_tq_norms, "layer 0 k norms")])
def test_a_buffer_replaced_in_place_is_checked_again(name, narrow, what, native):
    """A buffer swapped for a smaller view at the same address (as a freed buffer's address can be reused) is not the
    buffer the step's C structs were checked against: the next step checks it again and refuses it in one line."""
    model, cache, one = _stepped_once("GQA-128", name, native)
    with torch.no_grad():
        narrow(cache)
        with pytest.raises(ConfigError, match=what) as err:
            model.fused(one, cache)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["dense-f16", "int4", "tq4"])
def test_a_view_is_kept_while_its_buffers_stay(name, native):
    """The step's C structs are built once and kept while the cache holds the same buffers; a buffer swapped for a copy
    (another address) gets a new view, pointing at the copy."""
    model, cache, one = _stepped_once("GQA-128", name, native)
    view = model.fused._view_for(cache)
    with torch.no_grad():
        model.fused(one, cache)
    assert model.fused._view_for(cache) is view
    if name == "dense-f16":
        cache.k = cache.k.clone()
    else:
        held = cache.k_scale if name == "int4" else cache.k_norm
        held[0] = held[0].clone()
    new = model.fused._view_for(cache)
    assert new is not view and new.buffers != view.buffers
    assert model.fused._view_for(cache) is new


@pytest.mark.parametrize(("name", "field"), [("tq-k4v4+ropemean", "rope_cos"), ("tq-k4v4+ropemean", "rope_steps"),
                                             ("tq-k4v4+prerope", "rope_sin")])
def test_a_layer_without_its_rope_rows_is_refused(name, field, native):
    """A layer that turns keys by their positions (+prerope, +ropemean) reads each slot's RoPE row (and +ropemean its
    16 step rows): a description without them is refused in one line, not read through a null pointer."""
    model, cache, one = _stepped_once("MHA-64", name, native)
    with torch.no_grad():
        view = model.fused._view_for(cache)
        setattr(view.coded[0], field, None)
        with pytest.raises(ConfigError, match="refused") as err:
            model.fused(one, cache)
    assert "\n" not in str(err.value)
