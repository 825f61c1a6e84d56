"""--engine vllm: block-rounded pages per layer kind, TP head split/replication, MLA, sliding windows."""

from __future__ import annotations

from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.report import plan_json
from kvlab.sources import load_spec


def plan(name, **kw):
    return plan_json(make_plan(load_spec(name), rules_for("vllm"), PlanSettings(**kw)))


def test_full_attention_blocks_and_auto_dtype():
    doc = plan("llama-3.1-8b", context=1000)
    assert doc["kv_type_k"] == "bf16"
    assert doc["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert doc["kv_bytes"] == 63 * 16 * doc["kv_bytes_per_token"]  # cdiv(1000, 16) blocks of 16


def test_tp_splits_kv_heads_and_replicates_beyond_them():
    full = plan("llama-3.1-8b", context=4096)["kv_bytes"]
    assert plan("llama-3.1-8b", context=4096, tp=2)["kv_bytes"] == full // 2
    assert plan("llama-3.1-8b", context=4096, tp=16)["kv_bytes"] == full // 8  # 1 head per GPU, replicated


def test_mla_latent_is_k_only_and_replicated():
    one = plan("deepseek-v3", context=4096)
    assert one["kv_bytes_per_token"] == 61 * 576 * 2 and one["v_bytes"] == 0
    assert plan("deepseek-v3", context=4096, tp=8)["kv_bytes"] == one["kv_bytes"]


def test_sliding_window_blocks():
    doc = plan("gpt-oss-20b", context=65536, ubatch=2048)
    window_blocks = -(-(128 - 1 + 2048) // 16) + 1
    per_layer = 8 * 64 * 2 * 2
    assert doc["kv_bytes"] == 12 * 4096 * 16 * per_layer + 12 * window_blocks * 16 * per_layer


def test_fp8_halves_bf16():
    assert plan("qwen3-8b", context=8192, kv_type_k="fp8")["kv_bytes"] * 2 == plan("qwen3-8b", context=8192)["kv_bytes"]
