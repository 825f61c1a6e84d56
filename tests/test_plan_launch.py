"""The launch line spells every assumption of the plan as the engine's own flags, and read back it plans the same bytes."""

from __future__ import annotations

import io
import json
import shlex

import pytest
from rich.console import Console

from kvlab.plan import PlanSettings, rules_for, make_plan
from kvlab.plan.command import build_plan, plan_command
from kvlab.plan.launch import launch_line


def run(*args, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = plan_command(*args, console=Console(file=out, width=100, color_system=None), **kwargs)
    return code, out.getvalue()


def llama_settings(line: str) -> PlanSettings:
    """What llama-server would run with, read from its command line (the flags launch_line writes)."""
    words = shlex.split(line)
    assert words[0] == "llama-server"
    values: dict = {}
    parallel = 1
    i = 1
    while i < len(words):
        w = words[i]
        if w in ("-kvu", "-no-kvu", "--swa-full"):
            values.update(kv_unified=True) if w == "-kvu" else values.update(swa_full=True) if w == "--swa-full" else None
            i += 1
            continue
        value = words[i + 1]
        if w == "-c":
            n_ctx = int(value)
        elif w == "-np":
            parallel = int(value)
        elif w == "-ctk":
            values["kv_type_k"] = value
        elif w == "-ctv":
            values["kv_type_v"] = value
        elif w == "-fa":
            values["flash_attn"] = value == "on"
        elif w == "-ub":
            values["ubatch"] = int(value)
        i += 2
    return PlanSettings(context=max(1, n_ctx // parallel), parallel=parallel, n_ctx_total=n_ctx, **values)


@pytest.mark.parametrize("model, kwargs", [
    ("qwen3.5-9b", dict(ctx="32768", kv_type="q8_0", weights_quant="q4_k_m", gpu="RTX 3060")),
    ("gemma-3-12b", dict(ctx="16384", kv_type_k="q8_0", kv_type_v="q4_0", parallel=3, weights_quant="q4_k_m")),
    ("llama-3.1-8b", dict(ctx="8192", parallel=4, kv_unified=True, ubatch=256)),
    ("gpt-oss-20b", dict(ctx="max", gpu="RTX 4090", swa_full=True, weights_quant="mxfp4")),
    ("llama-3.1-8b", dict(ctx="5000", parallel=3, flash_attn=False)),
])
def test_llama_server_line_replans_the_same_bytes(model, kwargs):
    plan = build_plan(model, **kwargs)
    line = launch_line(plan)
    for flag in ("-c", "-np", "-ctk", "-ctv", "-fa", "-ngl"):
        assert f" {flag} " in line
    again = make_plan(plan.spec, rules_for("llama.cpp"), llama_settings(line), plan.weights_quant, solve=False)
    assert again.layout == plan.layout
    assert [c.bytes for c in again.components] == [c.bytes for c in plan.components]


def test_the_seed_line_carries_the_kv_types():
    _, text = run("qwen3.5-9b", ctx="32768", kv_type="q8_0", weights_quant="q4_k_m", gpu="RTX 3060")
    line = next(line for line in text.splitlines() if line.startswith("launch: "))
    assert "-c 32768 -np 1 -ctk q8_0 -ctv q8_0 -fa on -ngl 99" in line


def test_parallel_says_whether_the_buffer_is_shared():
    assert " -no-kvu " in launch_line(build_plan("llama-3.1-8b", parallel=4))
    assert " -kvu " in launch_line(build_plan("llama-3.1-8b", parallel=4, kv_unified=True))


def test_vllm_line():
    plan = build_plan("qwen3-32b", ctx="32768", engine="vllm", tp=2, parallel=8, kv_type="fp8", weights_quant="fp8", gpu="RTX 4090")
    words = shlex.split(launch_line(plan))
    assert words[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    pairs = dict(zip(words[3::2], words[4::2]))
    assert pairs["--max-model-len"] == "32768" and pairs["--max-num-seqs"] == "8"
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--kv-cache-dtype"] == "fp8"
    assert pairs["--gpu-memory-utilization"] == "0.9" and pairs["--quantization"] == "fp8"
    auto = shlex.split(launch_line(build_plan("qwen3-8b", engine="vllm")))
    assert "auto" in auto and "--dtype" not in auto and "--tensor-parallel-size" not in auto
    f16 = launch_line(build_plan("qwen3-8b", engine="vllm", kv_type="f16"))
    assert "--dtype float16 --kv-cache-dtype auto" in f16


def test_kvlab_line_and_the_default_model():
    """README's example: no model argument plans the embedded SmolLM2, as the other commands do."""
    code, text = run(None, ctx="4096", engine="kvlab", kv_type="tq4", kv_budget="512MiB")
    assert code == 0
    assert "launch: kvlab serve --cache tq4 --ctx 4096 --max-seqs 1" in text
    assert "concurrent sequences" in text


def test_json_has_the_launch_line():
    code, text = run("smollm2-135m", json_out=True)
    assert json.loads(text)["launch"].startswith("llama-server ")
