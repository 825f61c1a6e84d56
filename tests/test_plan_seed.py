"""The seed's own figures (Korean VRAM budget for Qwen3.5-9B on an RTX 3060 12 GB, and Qwen3-VL-4B)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.sources import load_spec
from kvlab.sources.gguf import write_gguf

MiB, GiB = 1 << 20, 1 << 30


def kv(spec, context, kv_type="bf16", engine="llama.cpp"):
    plan = make_plan(spec, rules_for(engine), PlanSettings(context=context, kv_type_k=kv_type, kv_type_v=kv_type))
    return plan_json(plan)


def test_qwen3_vl_4b_language_model():
    spec = load_spec("qwen3-vl-4b")
    attention = spec.attention_layers
    assert (len(attention), attention[0].n_kv_heads, attention[0].head_dim_k) == (36, 8, 128)
    assert kv(spec, 512)["kv_bytes_per_token"] == 147_456
    assert kv(spec, 512)["kv_bytes"] == 72 * MiB
    assert kv(spec, 32_768)["kv_bytes"] == int(4.5 * GiB)


@pytest.mark.parametrize("kv_heads, ratio", [(32, 4), (1, 1 / 8)])
def test_mha_is_four_times_and_mqa_an_eighth(kv_heads, ratio):
    spec = load_spec("qwen3-vl-4b")
    variant = replace(spec, layers=tuple(replace(layer, n_kv_heads=kv_heads) for layer in spec.layers))
    assert kv(variant, 4096)["kv_bytes_per_token"] == 147_456 * ratio
    assert kv(variant, 4096)["kv_bytes"] == kv(spec, 4096)["kv_bytes"] * ratio


def test_qwen35_9b_keeps_kv_in_8_of_32_layers():
    spec = load_spec("qwen3.5-9b")
    attention = spec.attention_layers
    assert spec.n_layers == 32 and len(attention) == 8
    assert {(layer.n_kv_heads, layer.head_dim_k) for layer in attention} == {(4, 256)}
    assert spec.kv_elements_per_token() == 16_384
    plan = kv(spec, 4096, "q8_0")
    assert plan["kv_bytes_per_token"] == 17_408
    assert plan["kv_bytes"] == 17_408 * 4096
    assert plan["recurrent_bytes"] > 0  # the 24 DeltaNet layers: fixed state, in f32


def test_qwen35_9b_from_gguf_keys(tmp_path):
    """The same answer from GGUF metadata keys alone (full_attention_interval + ssm.* keys)."""
    arch = "qwen35"
    md = {"general.architecture": arch, f"{arch}.block_count": 32, f"{arch}.embedding_length": 4096,
          f"{arch}.attention.head_count": 16, f"{arch}.attention.head_count_kv": 4, f"{arch}.attention.key_length": 256,
          f"{arch}.attention.value_length": 256, f"{arch}.full_attention_interval": 4, f"{arch}.ssm.conv_kernel": 4,
          f"{arch}.ssm.inner_size": 4096, f"{arch}.ssm.state_size": 128, f"{arch}.ssm.group_count": 16,
          f"{arch}.ssm.time_step_rank": 32, f"{arch}.context_length": 262144}
    spec = load_spec(str(write_gguf(tmp_path / "q35.gguf", md)))
    assert [layer.kind for layer in spec.layers] == (["recurrent"] * 3 + ["full"]) * 8
    assert kv(spec, 4096, "q8_0")["kv_bytes_per_token"] == 17_408
    assert kv(spec, 4096, "q8_0")["recurrent_bytes"] == load_spec("qwen3.5-9b").layers[0].state_elements * 4 * 24


def test_seed_budget_on_rtx_3060():
    """UD-Q4_K_XL-class weights, q8_0 KV: the seed's 32k scenario fits in 12 GB."""
    from kvlab.plan import find_gpu

    spec = load_spec("qwen3.5-9b")
    plan = make_plan(spec, rules_for("llama.cpp"), PlanSettings(context=32_768, kv_type_k="q8_0", kv_type_v="q8_0"),
                     "q4_k_m", find_gpu("RTX 3060 12GB"))
    assert plan.fits
    assert plan.max_context >= 32_768


# -- the seed's scenario end to end: unsloth/Qwen3.5-9B-GGUF UD-Q4_K_XL, q8_0 KV, RTX 3060 12 GB, with and without the mmproj


def seed_plan(**options):
    from kvlab.plan.command import build_plan

    return build_plan("unsloth/Qwen3.5-9B-GGUF", ctx="max", kv_type="q8_0", weights_quant="UD-Q4_K_XL", gpu="RTX 3060",
                      **options)


def assert_solved(plan):
    """The solved context is the largest whose total stays inside the budget less the headroom."""
    from kvlab.plan.budget import make_plan

    room = plan.budget_bytes - plan.headroom_bytes
    assert plan.total_bytes <= room
    more = make_plan(plan.spec, plan.engine, replace(plan.settings, context=plan.max_context + 1), plan.weights_quant,
                     solve=False, weights=plan.weights, extras=plan.extras)
    assert more.total_bytes > room


def test_seed_scenario_text_only():
    plan = seed_plan()
    doc = plan_json(plan)
    assert plan.spec.name == "qwen3.5-9b" and plan.alias_of == "unsloth/Qwen3.5-9B-GGUF"
    assert abs(doc["weights_bytes"] / 5.97e9 - 1) < 0.01            # the UD-Q4_K_XL file is 5.97 GB
    assert plan.weights.scheme is not None and not plan.weights.exact
    assert doc["kv_bytes_per_token"] == 16 * 1024 * 17 // 16 == 17_408    # 16 KiB of values × 8.5/8 bits (q8_0)
    assert doc["recurrent_bytes"] == 24 * 548_864 * 4                    # 50.2 MiB of DeltaNet state
    assert f"{doc['recurrent_bytes'] / MiB:.1f}" == "50.2"
    assert doc["headroom_bytes"] == GiB                                  # llama.cpp's --fit margin
    assert plan.settings.context == plan.max_context == 254_464
    assert doc["max_context_limited_by"] == "memory"
    assert_solved(plan)
    assert doc["launch"].endswith("-hf unsloth/Qwen3.5-9B-GGUF:UD-Q4_K_XL -c 254464 -np 1 -ctk q8_0 -ctv q8_0 -fa on -ngl 99 "
                                  "--no-mmproj")   # -hf would fetch the repo's projector by itself


def test_seed_scenario_with_the_vision_projector():
    text = seed_plan()
    plan = seed_plan(mmproj="auto")
    parts = {c.name: c for c in plan.components}
    assert abs(parts["vision projector"].bytes / 0.92e9 - 1) < 0.02      # mmproj-BF16.gguf: 0.92 GB
    assert 0.2e9 < parts["image buffer"].bytes < 0.3e9                   # -fa on reaches the encoder: no scores kept
    assert not parts["image buffer"].exact
    assert plan.max_context == 192_256 < text.max_context
    from kvlab.plan.command import build_plan

    no_fa = build_plan("unsloth/Qwen3.5-9B-GGUF", ctx="8192", kv_type="f16", weights_quant="UD-Q4_K_XL", gpu="RTX 3060",
                       mmproj="auto", flash_attn=False)
    assert 0.9e9 < no_fa.component("image buffer").bytes < 1.3e9           # -fa off: the ~1 GB spike of the scores
    assert_solved(plan)
    assert "mmproj" not in plan_json(plan)["launch"]   # -hf loads the repo's projector by default
    stated = seed_plan(mmproj="0.92GB")
    assert stated.components[[c.name for c in stated.components].index("vision projector")].bytes == 920_000_000


def test_seed_scenario_with_the_real_file_size():
    plan = seed_plan(weights_bytes="5.97GB")
    assert plan.weights.bytes == 5_970_000_000 and plan.weights.exact
    assert abs(plan.max_context - seed_plan().max_context) < 4096       # the scheme is within 0.5% of the file
    assert_solved(plan)
