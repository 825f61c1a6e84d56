"""llama.cpp's partial offload: -ngl layers, MoE experts on the host (--cpu-moe / --n-cpu-moe), the token embedding
always on the host, caches with their layers, --gpu-layers auto, --ram; and the launch line that says so."""

from __future__ import annotations

import shlex

import pytest

from kvlab.plan.command import build_plan
from kvlab.plan.offload import split_from_tensors
from kvlab.plan.report import plan_json, verdict
from kvlab.sources import default_model_path, load_spec, open_gguf


def gpu(plan, name):
    return next(c.bytes for c in plan.components if c.name == name)


def host(plan, name):
    return next((c.bytes for c in plan.host if c.name == name), 0)


@pytest.mark.parametrize("layers", [0, 1, 20, 32, 33, 99])
def test_layers_and_their_caches_move_together(layers):
    plan = build_plan("llama-3.1-8b", ctx="8192", weights_quant="q4_k_m", gpu_layers=layers)
    split = plan.weights.scheme
    n = plan.spec.n_layers
    on_gpu = [i for i in range(n) if i >= n + 1 - layers]   # llama.cpp: i_gpu_start = n_layer + 1 - n_gpu_layers
    expected = sum(split.layer_bytes[i] for i in on_gpu) + (split.output_bytes if layers >= 1 else 0)
    assert gpu(plan, "weights") == expected
    assert gpu(plan, "weights") + host(plan, "weights (host)") == plan.weights.bytes
    assert host(plan, "weights (host)") >= split.embedding_bytes          # token_embd never leaves the host
    per_layer_kv = 8192 * 2 * 8 * 128 * 2
    assert gpu(plan, "K cache") + gpu(plan, "V cache") == len(on_gpu) * per_layer_kv
    assert host(plan, "KV + state (host)") == (n - len(on_gpu)) * per_layer_kv
    ngl = int(shlex.split(plan_json(plan)["launch"])[shlex.split(plan_json(plan)["launch"]).index("-ngl") + 1])
    assert ngl == (99 if layers > n else layers)


def test_cpu_moe_keeps_the_experts_on_the_host():
    """The issue's case: qwen3-30b-a3b does not fit a 12 GB card, with its experts in host RAM it does."""
    plain = build_plan("qwen3-30b-a3b", ctx="32768", weights_quant="q4_k_m", gpu="RTX 3060")
    assert plain.fits is False and any("--cpu-moe" in hint for hint in plain.hints)
    plan = build_plan("qwen3-30b-a3b", ctx="max", weights_quant="q4_k_m", gpu="RTX 3060", cpu_moe=True, ram=32)
    split = plan.weights.scheme
    assert gpu(plan, "weights") == plan.weights.bytes - split.embedding_bytes - sum(split.layer_expert_bytes)
    assert plan.fits and plan.max_context == 40_960 and plan.context_limited_by_model
    assert plan_json(plan)["launch"].endswith("-ngl 99 --cpu-moe")
    text = verdict(plan)
    assert "where: 48 of 48 layers on the GPU, experts of all layers on the host" in text and "within the 32.00 GiB of --ram" in text
    some = build_plan("qwen3-30b-a3b", ctx="32768", weights_quant="q4_k_m", n_cpu_moe=30)
    assert gpu(some, "weights") == plan.weights.bytes - split.embedding_bytes - sum(split.layer_expert_bytes[:30])
    assert "--n-cpu-moe 30" in plan_json(some)["launch"]


def test_gpu_layers_auto_takes_the_most_that_fit():
    plan = build_plan("llama-3.3-70b", ctx="8192", weights_quant="q4_k_m", gpu="RTX 4090", gpu_layers="auto")
    layers = plan.offload.gpu_layers
    assert 0 < layers < plan.spec.n_layers and plan.fits
    more = build_plan("llama-3.3-70b", ctx="8192", weights_quant="q4_k_m", gpu="RTX 4090", gpu_layers=layers + 1)
    assert (more.max_context or 0) < 8192                    # one layer more and 8k no longer fits with the headroom
    assert f"-ngl {layers}" in plan_json(plan)["launch"]
    small = build_plan("smollm2-135m", ctx="2048", gpu="RTX 3060", gpu_layers="auto")
    assert small.offload.gpu_layers == 99                    # everything fits: all layers


def test_ram_is_checked():
    plan = build_plan("qwen3-30b-a3b", ctx="8192", weights_quant="q4_k_m", gpu="RTX 3060", cpu_moe=True, ram=8)
    assert plan.fits is False and plan.host_bytes > 8 * (1 << 30)
    assert "more than the 8.00 GiB of --ram" in verdict(plan)


def test_a_gguf_files_tensor_table_splits_exactly():
    spec = load_spec(str(default_model_path()))
    split = split_from_tensors(spec.runtime.tensors, spec.n_layers)
    assert split.total == open_gguf(default_model_path()).tensor_bytes
    plan = build_plan(str(default_model_path()), gpu_layers=10)
    assert split.tied                                        # SmolLM2 has no output.weight
    moved = sum(split.layers[21:]) + split.output            # 9 layers and the output layer ...
    assert gpu(plan, "weights") == moved + split.embedding   # ... which holds its own copy of token_embd
    assert host(plan, "weights (host)") == split.total - moved


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="llama-3.1-8b", cpu_moe=True), "apply to MoE models"),
    (dict(model="llama-3.1-8b", engine="vllm", gpu_layers=10), "plan llama.cpp's offload"),
    (dict(model="qwen3-30b-a3b", cpu_moe=True, n_cpu_moe=3), "either --cpu-moe or --n-cpu-moe"),
    (dict(model="llama-3.1-8b", gpu_layers="many"), "--gpu-layers must be"),
    (dict(model="llama-3.1-8b", gpu_layers="auto"), "needs --gpu or --vram"),
    (dict(model="llama-3.1-8b", gpu_layers=-1), "0 or more"),
])
def test_offload_errors_are_one_line(kwargs, message):
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_plan(**kwargs)
