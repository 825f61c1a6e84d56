"""`kvlab plan`: a catalog alias is announced (text and JSON); a KV type given for K alone or V alone behaves
symmetrically in every engine."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.plan.command import build_plan
from kvlab.plan.report import plan_json


def plan_doc(*args) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_an_alias_is_announced_in_one_line_and_in_json():
    result = CliRunner().invoke(app, ["plan", "llama-3.1-70b", "--ctx", "8192"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("note: llama-3.1-70b") and "planned llama-3.3-70b" in first
    doc = plan_doc("llama-3.1-70b")
    assert doc["model"] == "llama-3.3-70b"
    assert doc["alias"]["requested"] == "llama-3.1-70b" and doc["alias"]["planned"] == "llama-3.3-70b"


@pytest.mark.parametrize("name", ["llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "LLAMA-3.3-70B"])
def test_the_models_own_names_are_not_aliases(name):
    assert plan_doc(name)["alias"] is None
    assert "note:" not in CliRunner().invoke(app, ["plan", name]).output


def kv(engine: str, **types) -> tuple[int, int]:
    doc = plan_json(build_plan("qwen3-8b", ctx="8192", engine=engine, **types))
    return doc["k_bytes"], doc["v_bytes"]


def test_llama_cpp_k_alone_and_v_alone_are_mirror_images():
    default_k, default_v = kv("llama.cpp")
    k_only = kv("llama.cpp", kv_type_k="q4_0")
    v_only = kv("llama.cpp", kv_type_v="q4_0")
    assert k_only == (kv("llama.cpp", kv_type="q4_0")[0], default_v)   # V stays f16, as llama.cpp's -ctk alone
    assert v_only == (default_k, k_only[0])                            # K stays f16, as -ctv alone
    assert k_only[0] < default_k


@pytest.mark.parametrize("engine, name", [("vllm", "fp8"), ("kvlab", "int8")])
def test_one_type_engines_take_a_lone_k_or_v_type_for_both(engine, name):
    both = kv(engine, kv_type=name)
    assert kv(engine, kv_type_k=name) == both == kv(engine, kv_type_v=name)
    assert both != kv(engine)
