"""Honest labels: why the longest context stops, KV per token by layer kind, the headroom --ctx max keeps, the
quant hint, the engines' own window and state rules, and tables that keep every column when piped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvlab.plan.command import build_plan
from kvlab.plan.report import plan_json, verdict
from kvlab.sources import load_spec

GiB = 1 << 30


def test_longest_context_says_it_stopped_at_the_model_maximum():
    plan = build_plan("qwen3-8b", ctx="max", weights_quant="q4_k_m", gpu="RTX 4090")
    assert plan.max_context == load_spec("qwen3-8b").context_length
    assert plan_json(plan)["max_context_limited_by"] == "model"
    assert "the model's own maximum (40,960); memory would allow more" in verdict(plan)
    tight = build_plan("qwen3-8b", ctx="max", weights_quant="q4_k_m", gpu="RTX 3060", parallel=4)
    assert plan_json(tight)["max_context_limited_by"] == "memory" and "limited by memory" in verdict(tight)


def test_sliding_layers_are_not_counted_as_full():
    spec = load_spec("gemma-3-12b")
    full = [layer for layer in spec.layers if layer.kind == "full"]
    sliding = [layer for layer in spec.layers if layer.kind == "sliding"]
    for engine in ("llama.cpp", "vllm"):
        doc = plan_json(build_plan("gemma-3-12b", ctx="32768", engine=engine, kv_type="bf16"))
        assert doc["kv_bytes_per_token"] == sum(2 * layer.n_kv_heads * layer.head_dim_k * 2 for layer in full)
        assert doc["sliding_kv_bytes_per_token"] == sum(2 * layer.n_kv_heads * layer.head_dim_k * 2 for layer in sliding)
        assert doc["kv_bytes_per_token_by_kind"] == {"sliding": doc["sliding_kv_bytes_per_token"], "full": doc["kv_bytes_per_token"]}
        assert 0 < doc["sliding_kv_bytes"] < doc["kv_bytes"]
        # beyond the window only full layers grow: 8 more tokens cost 8 × the per-token figure (llama.cpp pads cells)
    a = plan_json(build_plan("gpt-oss-20b", ctx="65536", weights_quant="mxfp4"))
    b = plan_json(build_plan("gpt-oss-20b", ctx="131072", weights_quant="mxfp4"))
    assert b["kv_bytes"] - a["kv_bytes"] == 65536 * a["kv_bytes_per_token"]
    assert "sliding layers only while a token is in their window (128 tokens): a constant" in verdict(build_plan("gpt-oss-20b"))


def test_ctx_max_keeps_the_engines_headroom():
    plan = build_plan("llama-3.1-8b", ctx="max", weights_quant="q4_k_m", gpu="RTX 3060", parallel=4)
    step = 4 * 256 * plan.layout.bytes_per_token * 1.01   # llama.cpp grows 4 caches by 256 cells at a time (+ the masks)
    free = plan.budget_bytes - plan.total_bytes
    assert plan.headroom_bytes == GiB and GiB <= free < GiB + step
    filled = build_plan("llama-3.1-8b", ctx="max", weights_quant="q4_k_m", gpu="RTX 3060", parallel=4, headroom="0")
    assert filled.max_context > plan.max_context and filled.budget_bytes - filled.total_bytes < step
    two = build_plan("llama-3.1-8b", ctx="max", weights_quant="q4_k_m", gpu="RTX 3060", parallel=4, headroom="2GiB")
    assert two.budget_bytes - two.total_bytes >= 2 * GiB
    vllm = build_plan("llama-3.1-8b", ctx="max", weights_quant="fp8", gpu="RTX 3060", engine="vllm", parallel=4)
    assert vllm.headroom_bytes == 0   # --gpu-memory-utilization 0.9 is vLLM's margin
    assert "less than the 1.00 GiB headroom" in verdict(build_plan("llama-3.1-8b", ctx="max", weights_quant="q4_k_m",
                                                                   gpu="RTX 3060", headroom="0"))


def test_bf16_default_that_does_not_fit_gets_a_quant_hint():
    plan = build_plan("qwen3.5-9b", ctx="32768", kv_type="q8_0", gpu="RTX 3060")
    assert plan.fits is False
    assert plan.hints and "--weights-quant q8_0 it fits at 32,768 tokens" in plan.hints[0] and "default" in plan.hints[0]
    fitting = build_plan("qwen3.5-9b", ctx=plan.hints and 32768, kv_type="q8_0", gpu="RTX 3060", weights_quant="q8_0")
    assert fitting.fits and fitting.max_context >= 32768


def test_mistral_v01_window_is_ignored_by_llama_cpp_not_by_vllm():
    llama = plan_json(build_plan("mistral-7b-v0.1", ctx="16384"))
    assert llama["sliding_kv_bytes"] == 0 and llama["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2
    assert llama["kv_bytes"] == 16384 * llama["kv_bytes_per_token"]
    assert any("reads no sliding window" in note for note in llama["notes"])
    vllm = plan_json(build_plan("mistral-7b-v0.1", ctx="16384", engine="vllm"))
    assert vllm["kv_bytes_per_token"] == 0 and vllm["sliding_kv_bytes"] > 0   # vLLM honours the 4,096 window


def test_vllm_recurrent_state_stays_in_the_model_dtype():
    spec = load_spec("qwen3.5-9b")
    state = spec.layers[0].state_elements
    for kv in ("fp8", "bf16"):
        doc = plan_json(build_plan("qwen3.5-9b", engine="vllm", kv_type=kv, parallel=2))
        assert doc["recurrent_bytes"] == 24 * state * 2 * 2   # bf16, two sequences


def test_tables_keep_every_column_when_piped():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "plan", "gemma-3-12b", "--layers", "--gpu", "RTX 3060",
                          "--weights-quant", "q4_k_m"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "sliding" in out.stdout and "state bytes" in out.stdout
    launch = next(line for line in out.stdout.splitlines() if line.startswith("launch: "))
    assert launch.rstrip().endswith("-ngl 99")   # one line, whatever the width
    doc = json.loads(subprocess.run([sys.executable, "-m", "kvlab.cli", "plan", "gemma-3-12b", "--json"], capture_output=True,
                                    text=True, env=env, timeout=120, check=False).stdout)
    assert doc["model"] == "gemma-3-12b"


def test_parallel_max_replans_with_the_most_sequences():
    plan = build_plan("llama-3.1-8b", ctx="32768", parallel="max", weights_quant="q4_k_m", gpu="RTX 4090")
    assert plan.settings.parallel == plan.max_sequences == 4 and plan.fits
    more = build_plan("llama-3.1-8b", ctx="32768", parallel=5, weights_quant="q4_k_m", gpu="RTX 4090")
    assert more.budget_bytes - more.total_bytes < more.headroom_bytes      # a fifth sequence eats the headroom
    assert " -np 4 " in plan_json(plan)["launch"]
    moe = build_plan("qwen3-30b-a3b", ctx="16384", parallel="max", weights_quant="q4_k_m", gpu="RTX 3060", cpu_moe=True)
    assert moe.settings.parallel > 1 and "--cpu-moe" in plan_json(moe)["launch"]
