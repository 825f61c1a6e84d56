"""`kvlab plan` as a function and as a typer command: tables, JSON, plot, and one-line errors."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from kvlab.plan.command import plan_command, register
from kvlab.sources.gguf import write_gguf


def run(*args, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = plan_command(*args, console=Console(file=out, width=400, color_system=None), **kwargs)
    return code, out.getvalue()


def test_table_and_verdict_for_the_seed():
    code, text = run("qwen3.5-9b", ctx="32768", kv_type="q8_0", weights_quant="q4_k_m", gpu="RTX 3060")
    assert code == 0
    assert "8 full × 32,768 cells × 1088 B" in text
    assert "recurrent state" in text and "fits" in text and "longest context" in text


def test_json_has_the_required_keys():
    code, text = run("smollm2-135m", ctx="2048", json_out=True, vram=4)
    doc = json.loads(text)
    for key in ("kv_bytes_per_token", "kv_bytes", "k_bytes", "v_bytes", "recurrent_bytes", "weights_bytes",
                "total_bytes", "fits", "max_context", "max_sequences"):
        assert key in doc
    assert doc["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert doc["kv_bytes"] == doc["k_bytes"] + doc["v_bytes"] == 30 * 2 * 3 * 64 * 2 * 2048
    assert doc["fits"] is True and code == 0


def test_layers_breakdown_and_sliding_windows():
    code, text = run("gemma-3-1b", ctx="8192", layers=True)
    assert code == 0 and "sliding" in text and "per layer" in text


def test_does_not_fit_exit_code():
    code, text = run("llama-3.3-70b", ctx="131072", gpu="RTX 3060")
    assert code == 1 and "does not fit" in text


def test_ctx_max_and_tp():
    code, text = run("qwen3-32b", ctx="max", engine="vllm", tp=2, gpu="RTX 4090", weights_quant="int4", json_out=True)
    doc = json.loads(text)
    assert doc["per_gpu"] and doc["context"] == doc["max_context"] > 0


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "mem.png"
    code, _ = run("qwen3.5-9b", ctx="32768", kv_type="q8_0", weights_quant="q4_k_m", gpu="RTX 3060", plot=str(path))
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def bad_inputs(tmp_path):
    trunc = tmp_path / "trunc.gguf"
    write_gguf(trunc, {"general.architecture": "llama", "llama.block_count": 2})
    trunc.write_bytes(trunc.read_bytes()[:30])
    (tmp_path / "notgguf.gguf").write_bytes(b"\x89PNG not a model")
    (tmp_path / "nohead").mkdir()
    (tmp_path / "nohead" / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    zero = tmp_path / "zero.gguf"
    write_gguf(zero, {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
                      "llama.attention.head_count": 0})
    return tmp_path


@pytest.mark.parametrize("model, kwargs, message", [
    ("trunc.gguf", {}, "is truncated"),
    ("notgguf.gguf", {}, "is not a GGUF file"),
    ("nohead", {}, "no attention head count"),
    ("zero.gguf", {}, "positive head counts"),
    ("smollm2-135m", {"ctx": "-5"}, "--ctx must be a positive"),
    ("smollm2-135m", {"parallel": 0}, "--parallel must be a positive"),
    ("smollm2-135m", {"kv_type": "q3_x"}, "unknown KV type"),
    ("smollm2-135m", {"engine": "tgi"}, "unknown engine"),
    ("smollm2-135m", {"gpu": "Voodoo 2"}, "unknown GPU"),
    ("smollm2-135m", {"kv_type": "q8_0", "flash_attn": False}, "needs flash attention"),
    ("smollm2-135m", {"engine": "vllm", "kv_type": "q4_0"}, "vLLM has no q4_0"),
])
def test_bad_input_is_one_line_error(bad_inputs, model, kwargs, message):
    target = str(bad_inputs / model) if ("." in model and model.endswith("gguf")) or model == "nohead" else model
    code, text = run(target, **kwargs)
    assert code == 2
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_register_adds_the_typer_command():
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    register(app)

    @app.command("other")
    def other() -> None:  # a second command so typer keeps `plan` as a subcommand
        pass

    result = CliRunner().invoke(app, ["plan", "qwen3-vl-4b", "--ctx", "512", "--kv-type", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_bytes"] == 72 * 1024 * 1024
    bad = CliRunner().invoke(app, ["plan", "qwen3-vl-4b", "--ctx", "0"])
    assert bad.exit_code == 2 and bad.output.startswith("error: ")
