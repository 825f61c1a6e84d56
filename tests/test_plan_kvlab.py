"""--engine kvlab predicts exactly the nbytes kvlab's own caches report."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import CacheGeometry, cache_names, make_cache
from kvlab.errors import ConfigError
from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.sources import load_spec

SMOLLM2 = dict(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9)
CACHES = [name for name in cache_names() if name != "none"]  # NoCache keeps nothing between passes


def real_nbytes(name: str, dtype: torch.dtype, context: int, batch: int) -> int:
    geometry = CacheGeometry(batch=batch, capacity=context, rope_inv_freq=tuple(10000.0 ** (-i / 32) for i in range(32)),
                             **SMOLLM2)                                    # RoPE frequencies: the tq4 preset's +prerope
    cache = make_cache(name, geometry, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for start in range(0, context, 64):  # a prefill chunk, then more
        n = min(64, context - start)
        for layer in range(geometry.n_layers):
            k = torch.randn(batch, 3, n, 64, generator=gen)
            v = torch.randn(batch, 3, n, 64, generator=gen)
            cache.append(layer, k, v)
    return cache.nbytes


PLAIN = [name for name in CACHES if name in ("dense", "concat")]
COMPRESSED = [name for name in CACHES if name not in PLAIN]
# every plain cache at several contexts, batches and dtypes; the (slower) compressed ones at two shapes
CASES = ([(name, ctx, batch, dtype) for name in PLAIN for ctx, batch in ((1, 1), (100, 1), (257, 2)) for dtype in ("f32", "f16")]
         + [(name, ctx, batch, "f32") for name in COMPRESSED for ctx, batch in ((1, 1), (33, 2))])


@pytest.mark.parametrize("name, context, batch, dtype", CASES)
def test_kvlab_engine_equals_cache_nbytes(name, context, batch, dtype):
    spec = load_spec("smollm2-135m")
    settings = PlanSettings(context=context, parallel=batch, kv_type_k=f"{name}@{dtype}")
    plan = plan_json(make_plan(spec, rules_for("kvlab"), settings))
    torch_dtype = {"f32": torch.float32, "f16": torch.float16}[dtype]
    assert plan["kv_bytes"] == real_nbytes(name, torch_dtype, context, batch)
    assert plan["recurrent_bytes"] == 0


def test_bare_dtype_means_dense():
    spec = load_spec("smollm2-135m")
    plan = plan_json(make_plan(spec, rules_for("kvlab"), PlanSettings(context=128, kv_type_k="f16")))
    assert plan["kv_bytes"] == 30 * 2 * 3 * 64 * 2 * 128


def test_unknown_cache_name_is_one_line_config_error():
    with pytest.raises(ConfigError) as err:
        make_plan(load_spec("smollm2-135m"), rules_for("kvlab"), PlanSettings(context=8, kv_type_k="nope"))
    assert "\n" not in str(err.value)


def test_kvlab_refuses_layers_it_cannot_cache():
    with pytest.raises(ConfigError, match="mla"):
        make_plan(load_spec("deepseek-v2-lite"), rules_for("kvlab"), PlanSettings(context=8))


def test_kvlab_counts_recurrent_state_per_sequence():
    """Qwen3.5-9B: 8 full-attention layers of K/V, 24 Gated DeltaNet layers of fp32 state_elements × 4 B each."""
    spec = load_spec("qwen3.5-9b")
    plan = plan_json(make_plan(spec, rules_for("kvlab"), PlanSettings(context=4096, parallel=2)))
    recurrent = [layer for layer in spec.layers if layer.kind == "recurrent"]
    assert plan["recurrent_bytes"] == sum(layer.state_elements for layer in recurrent) * 4 * 2 > 0
    full = [layer for layer in spec.layers if layer.kind == "full"]
    assert plan["kv_bytes"] == sum(2 * layer.n_kv_heads * layer.head_dim_k * 4 for layer in full) * 4096 * 2


def test_kvlab_engine_weights_are_what_the_engine_holds(smollm2):
    """A GGUF planned as-is: the native weights kvlab holds (Q4_1/Q8_0 blocks + fp32 norms), as the loaded
    model reports; with --weights-quant f32/bf16 the dequantized parameters × 4 or × 2."""
    from kvlab.plan.command import build_plan
    from kvlab.session import cached_model
    from kvlab.sources.gguf import open_gguf

    plan = build_plan(str(smollm2.path), ctx="512", engine="kvlab")
    if smollm2.weights == "native":
        assert plan.weights.bytes == smollm2.weight_bytes == open_gguf(smollm2.path).tensor_bytes
    plan32 = build_plan(str(smollm2.path), ctx="512", engine="kvlab", weights_quant="f32")
    assert plan32.weights.bytes == cached_model(None, "fp32", "cpu", "dense").weight_bytes == 134_515_008 * 4
    plan16 = build_plan(str(smollm2.path), ctx="512", engine="kvlab", weights_quant="bf16")
    assert plan16.weights.bytes == 134_515_008 * 2


def test_kvlab_plan_without_a_compiler_counts_dequantized_weights(smollm2, monkeypatch):
    """No compiler, no block kernel: `--weights auto` loads dense fp32, and the plan says so."""
    from kvlab.plan.command import build_plan

    monkeypatch.setenv("KVLAB_NO_KERNEL", "1")
    plan = build_plan(str(smollm2.path), ctx="512", engine="kvlab")
    assert plan.weights.bytes == 134_515_008 * 4
