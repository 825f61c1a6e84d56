"""`kvlab lab all --quick` end to end, and the lab commands' JSON and errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvlab.cli import app

runner = CliRunner()


def test_lab_all_quick_end_to_end(tmp_path):
    out = tmp_path / "report"
    result = runner.invoke(app, ["lab", "all", "--quick", "--out", str(out), "--weights-dir", str(tmp_path / "w"),
                                 "--threads", "1"])
    assert result.exit_code == 0, result.output
    for name in ("report.md", "lab.json", "invariance.png", "counts.png", "gqa.png", "speed.png"):
        assert (out / name).is_file(), name
    payload = json.loads((out / "lab.json").read_text())
    inv = payload["invariance"]
    assert inv["masked_max_diff"] < 1e-5 < 1e-2 < inv["unmasked_max_diff"]
    assert all(r["matches_formula"] for r in payload["counts"])
    for r in payload["counts"]:
        assert {"n", "scores_no_cache", "scores_cache", "kv_proj_no_cache", "kv_proj_cache"} <= r.keys()
    for r in payload["gqa"]:
        assert {"n_kv_head", "cache_bytes", "theoretical_bytes", "ratio", "tokens_per_s", "val_loss"} <= r.keys()
        assert r["cache_bytes"] == r["theoretical_bytes"]
    speed = [r for r in payload["speed"] if r["experiment"] == "speed"]
    assert speed and all({"model", "new_tokens", "cache", "tokens_per_s"} <= r.keys() for r in speed)
    report = (out / "report.md").read_text()
    assert "kvlab lab all" in report and "![speed](speed.png)" in report and payload["machine"]["cpu_count"]


def test_counts_json_takes_several_n():
    result = runner.invoke(app, ["lab", "counts", "--n", "10", "20", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["n"] for r in records] == [10, 20]
    assert records[1]["scores_no_cache"] == 2870 and records[1]["kv_proj_cache"] == 20


def test_invariance_json():
    result = runner.invoke(app, ["lab", "invariance", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert record["masked_max_diff"] < 1e-5 and record["unmasked_max_diff"] > 1e-2


@pytest.mark.parametrize("args, words", [
    (["lab", "speed", "--models", "nope", "--quick"], "unknown model 'nope'"),
    (["lab", "counts", "--n", "x"], "--n takes whole numbers"),
    (["lab", "speed", "--lengths", "1"], "at least 2"),
    (["lab", "invariance", "--plot", "a.txt"], ".png"),
])
def test_errors_are_one_line(args, words):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert words in result.output and "Traceback" not in result.output
