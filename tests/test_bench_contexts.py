"""`kvlab bench decode --contexts`: decode tokens/s and bandwidth per cache at each context length."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.bench import contexts as bench_contexts
from kvlab.bench.contexts import parse_contexts
from kvlab.cache import CacheSpec
from kvlab.cli import app
from kvlab.errors import ConfigError

from .conftest import cli_error


def test_contexts_parse_like_plan_ctx():
    assert parse_contexts("512, 2k,4K,8k") == [512, 2048, 4096, 8192]
    for bad in ("", "512,,4k", "0", "4x", "max"):
        with pytest.raises(ConfigError, match="--contexts"):
            parse_contexts(bad)


def test_smoke_run_records_every_cache_at_every_context(smollm2, tmp_path, monkeypatch):
    """Two tiny contexts (the second past a 40-token model context: lowered to fit the steps), three caches."""
    monkeypatch.setattr(bench_contexts, "model_context", lambda model: 40)
    out = tmp_path / "contexts.json"
    result = CliRunner().invoke(app, ["bench", "decode", "--contexts", "16,64", "--caches", "dense,dense-f16,tq-k4v4+qjl",
                                      "--repeats", "2", "--steps", "2", "--warmup", "1", "--threads", "1",
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["benchmark"] == "decode_contexts" and record["baseline"] == "dense-f16" and record["threads"] == 1
    rows = {(r["asked"], r["cache"]): r for r in record["results"]}
    assert set(rows) == {(a, c) for a in (16, 64) for c in ("dense", "dense-f16", "tq-k4v4+qjl")}
    assert rows[16, "dense"]["context"] == 16 and rows[64, "dense"]["context"] == 40 - 1 - 2 * 2
    for (asked, cache), r in rows.items():
        assert len(r["samples"]) == 2 and r["tokens_per_s"] > 0 and r["bandwidth_gb_s"] > 0
        assert r["step"] == "fused"
        # bytes read per step: the cache's per-token bytes × tokens at mid-run (dense: 30 × 3 × 128 × 4 B per token)
        mid = r["context"] + 1 + 2
        if CacheSpec.parse(cache).base == "dense":
            assert r["kv_bytes_read_per_step"] == 30 * 3 * 128 * (4 if cache == "dense" else 2) * mid
        assert r["bandwidth_gb_s"] == pytest.approx((r["weight_bytes"] + r["kv_bytes_read_per_step"]) * r["tokens_per_s"] / 1e9)
    assert rows[16, "dense-f16"]["ratio_vs_baseline"] == 1.0
    assert json.loads(result.output.strip().splitlines()[-1]) == record


def test_a_name_that_needs_a_recipe_runs_with_the_recipe_calibrated_for_the_model(smollm2, tmp_path, monkeypatch):
    """`tq4+alloc` is built as the model's recipe spelled out (eval/calibrate.resolve, stubbed here with a uniform
    recipe instead of a minutes-long calibration) and reported under the name asked for."""
    from kvlab.quality import calibrate

    monkeypatch.setattr(bench_contexts, "model_context", lambda model: 40)
    spelled = "tq-k4v4+alloc=k" + "4" * 30 + "v" + "4" * 30
    asked = []
    monkeypatch.setattr(calibrate, "resolve", lambda name, loaded: asked.append(name) or (spelled if "alloc" in name else name))
    out = tmp_path / "contexts.json"
    result = CliRunner().invoke(app, ["bench", "decode", "--contexts", "16", "--caches", "dense,tq-k4v4+alloc", "--repeats", "1",
                                      "--steps", "2", "--warmup", "1", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "tq-k4v4+alloc" in asked
    rows = {r["cache"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"dense", "tq-k4v4+alloc"} and rows["tq-k4v4+alloc"]["tokens_per_s"] > 0
    assert rows["tq-k4v4+alloc"]["step"] == "fused"                       # +alloc: the fused step reads it


def test_bad_cache_is_one_line_error():
    line = cli_error(["bench", "decode", "--contexts", "16", "--caches", "dense,nope", "--out", ""])
    assert "nope" in line


# -- llama.cpp as a contender: the real worker protocol, driven through a stand-in llama_cpp module ----------
FAKE_LLAMA_CPP = '''
import ctypes
GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0 = 1, 8, 2
def llama_print_system_info():
    return b"fake"
class _Ctx:
    def __init__(self, vocab):
        self.logits = (ctypes.c_float * vocab)()
    def get_logits_ith(self, i):
        return self.logits
class Llama:
    def __init__(self, model_path, n_ctx, type_k, type_v, flash_attn, **kw):
        assert type_k == type_v and flash_attn == (type_k != GGML_TYPE_F16)
        self.n_ctx, self.n_tokens, self._ctx = n_ctx, 0, _Ctx(50)
    def n_vocab(self):
        return 50
    def reset(self):
        self.n_tokens = 0
    def eval(self, tokens):
        self.n_tokens += len(tokens)
        if self.n_tokens > self.n_ctx:
            raise ValueError("past n_ctx")
        self._ctx.logits[(tokens[-1] + 1) % 50] = float(self.n_tokens)   # next greedy token: last + 1
'''


def test_llama_cpp_contenders_run_interleaved_through_the_worker(smollm2, tmp_path, monkeypatch):
    """The worker (bench/llama_worker.py, run by another Python) answers prefill and steps; the bench records
    llama.cpp rows next to kvlab's with llama.cpp's K/V type sizes."""
    import sys

    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(bench_contexts, "model_context", lambda model: 40)
    out = tmp_path / "contexts.json"
    result = CliRunner().invoke(app, ["bench", "decode", "--contexts", "16", "--caches", "dense-f16,llama.cpp:f16,llama.cpp:q8_0",
                                      "--llama-cpp", str(python), "--repeats", "2", "--steps", "2", "--warmup", "1",
                                      "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["cache"]: r for r in json.loads(out.read_text())["results"]}
    mid = 16 + 1 + 2
    for kv, value_bytes in (("f16", 2), ("q8_0", 34 / 32)):
        r = rows[f"llama.cpp:{kv}"]
        assert r["step"] == "llama.cpp" and len(r["samples"]) == 2 and r["tokens_per_s"] > 0
        assert r["kv_bytes_read_per_step"] == int(30 * 3 * 64 * 2 * value_bytes * mid)
    assert rows["llama.cpp:f16"]["kv_bytes_read_per_step"] == rows["dense-f16"]["kv_bytes_read_per_step"]


def test_peers_run_without_the_wait_policy_kvlab_chose_for_itself(monkeypatch):
    import kvlab
    from kvlab.bench.llama_peer import peer_environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.setattr(kvlab, "WAIT_POLICY_SET_BY_KVLAB", True)
    assert "OMP_WAIT_POLICY" not in peer_environment()
    monkeypatch.setattr(kvlab, "WAIT_POLICY_SET_BY_KVLAB", False)   # the user's own choice is kept
    assert peer_environment()["OMP_WAIT_POLICY"] == "passive"


def test_llama_cpp_contenders_need_a_python_with_llama_cpp(tmp_path):
    assert "--llama-cpp" in cli_error(["bench", "decode", "--contexts", "16", "--caches", "llama.cpp:f16", "--out", ""])
    line = cli_error(["bench", "decode", "--contexts", "16", "--caches", "llama.cpp:f16", "--llama-cpp",
                      str(tmp_path / "no-python"), "--out", ""])
    assert "--llama-cpp" in line
    assert "q3_k" in cli_error(["bench", "decode", "--contexts", "16", "--caches", "llama.cpp:q3_k", "--llama-cpp",
                                "python3", "--out", ""])
