"""The catalog as a user meets it: --list (filtered), "did you mean" for a misspelled name, GGUF repo ids,
and several candidates compared side by side for one card and workload."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvlab.cli import app


def invoke(*args):
    result = CliRunner().invoke(app, ["plan", *args])
    return result.exit_code, result.output


def test_list_and_filter():
    code, text = invoke("--list", "--json")
    rows = json.loads(text)
    assert code == 0 and {"qwen3.5-9b", "llama-3.1-8b", "gpt-oss-20b"} <= {r["name"] for r in rows}
    code, text = invoke("--list", "gemma", "--json")
    assert code == 0 and {r["name"] for r in json.loads(text)} == {"gemma-2-9b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b"}
    code, text = invoke("--list", "qwen3_moe")
    assert code == 0 and "qwen3-30b-a3b" in text and "llama-3" not in text and "1 models" in text
    code, text = invoke("--list", "no-such-family")
    assert code == 1 and "no catalog model matches" in text


def test_a_misspelled_name_gets_suggestions():
    code, text = invoke("qwen-3.5-9b")
    assert code == 2 and "did you mean qwen3.5-9b" in text and "Traceback" not in text
    code, text = invoke("lama-3.1-8b", "--gpu", "RTX 3060")
    assert code == 2 and "did you mean llama-3.1-8b" in text


def test_compare_ranks_what_fits_by_room_left():
    code, text = invoke("llama-3.1-8b", "qwen3.5-9b", "gpt-oss-20b", "--gpu", "RTX 3060", "--ctx", "32768", "--parallel", "4",
                        "--weights-quant", "q4_k_m", "--kv-type", "q8_0", "--json")
    rows = json.loads(text)
    assert code == 0 and [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["model"] == "qwen3.5-9b" and rows[0]["fits"]       # 8 attention layers of 32: the least KV
    assert all(not r["fits"] for r in rows[1:])
    assert rows[1]["free_bytes"] > rows[2]["free_bytes"]
    assert all(r["launch"].startswith("llama-server ") for r in rows)
    code, text = invoke("llama-3.1-8b", "qwen3.5-9b", "--gpu", "RTX 3060", "--weights-quant", "q4_k_m")
    assert code == 0 and "2 candidates on RTX 3060" in text and "fits" in text


def test_compare_names_the_model_in_errors():
    code, text = invoke("llama-3.1-8b", "nonsense-model", "--gpu", "RTX 3060")
    assert code == 2 and "nonsense-model" in text and len(text.strip().splitlines()) == 1


def test_compare_at_ctx_max_ranks_by_the_longest_context_and_keeps_what_fits_nowhere():
    code, text = invoke("llama-3.1-8b", "qwen3.5-9b", "qwen3-30b-a3b", "--gpu", "RTX 3060", "--ctx", "max",
                        "--weights-quant", "q4_k_m", "--kv-type", "q8_0", "--json")
    rows = json.loads(text)
    assert code == 0 and [r["model"] for r in rows] == ["qwen3.5-9b", "llama-3.1-8b", "qwen3-30b-a3b"]
    assert rows[0]["max_context"] > rows[1]["max_context"] > 0 and rows[2]["max_context"] == 0 and not rows[2]["fits"]
