"""Lab experiment 4: the speed table's plumbing (no timing assertions: the machine is shared)."""

from __future__ import annotations

import pytest

from kvlab.measure import torch_threads
from kvlab.lab.speed import (ESTIMATE_NOTE, SpeedCheck, SpeedResult, StepProfile, runs_affordable, run_speed, speed_markdown,
                             step_grid)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_step_grid_covers_first_and_last_step():
    ks = step_grid(2048)
    assert ks[0] == 1 and ks[-1] == 2047 and ks == sorted(set(ks))
    assert step_grid(1) == []


def test_total_time_is_prompt_pass_plus_every_step():
    prof = StepProfile("none", prompt_seconds=0.5, contexts=[17, 33], seconds=[1.0, 3.0])
    assert prof.total(1) == 0.5
    # steps at L = 17..32 for n = 17: linear from 1.0 to 2.875
    expected = 0.5 + sum(1.0 + (L - 17) * 2.0 / 16 for L in range(17, 33))
    assert prof.total(17) == pytest.approx(expected)


def test_quick_speed_records(tmp_path):
    result = run_speed(("lab",), lengths=(4, 8), repeats=1, quick=True, weights_dir=tmp_path)
    records = [r.record() for r in result.records]
    assert {(r["new_tokens"], r["cache"]) for r in records} == {(4, "dense"), (8, "dense"), (4, "none"), (8, "none")}
    for r in records:
        assert r["model"].startswith("lab GPT") and r["tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0
        # short runs fit the budget: every cell is real generate() runs, its seconds those runs' median
        assert r["method"] == "measured" and r["runs"] == 1 and r["estimated_seconds"] > 0
    (summary,) = result.summaries
    assert summary.predicted_speedup > 1                    # the MACs always favour the cache
    assert summary.speedup_method == "measured"
    # every real run is set beside its estimate, and the table's seconds are the real ones
    assert {(c.new_tokens, c.cache) for c in result.checks} == {(r["new_tokens"], r["cache"]) for r in records}
    by_cell = {(r.new_tokens, r.cache): r for r in result.records}
    for c in result.checks:
        assert by_cell[c.new_tokens, c.cache].seconds == round(c.measured_seconds, 4)
    assert ESTIMATE_NOTE not in speed_markdown(result)


def test_cells_over_the_run_budget_are_estimated_and_labelled(tmp_path):
    result = run_speed(("lab",), lengths=(4, 8), repeats=1, quick=True, weights_dir=tmp_path, run_budget_s=0.0)
    assert result.checks == []
    for r in result.records:
        assert r.method == "estimated" and r.runs == 0 and r.seconds == r.estimated_seconds
    assert result.summaries[0].speedup_method == "estimated"
    table = speed_markdown(result)
    assert ESTIMATE_NOTE in table and "| ≈" in table     # every estimated number carries the mark


def test_runs_affordable():
    assert runs_affordable(10.0, 3, 150.0) == 3
    assert runs_affordable(60.0, 3, 150.0) == 2
    assert runs_affordable(151.0, 3, 150.0) == 0
    assert runs_affordable(0.0, 3, 0.0) == 3


def test_an_estimate_far_from_its_real_run_is_printed():
    checks = [SpeedCheck("m", 64, "none", measured_seconds=1.0, estimated_seconds=1.98),
              SpeedCheck("m", 64, "dense", measured_seconds=1.0, estimated_seconds=1.05)]
    result = SpeedResult(records=[], checks=checks, summaries=[], lengths=(64,), repeats=1)
    assert result.disagreements() == checks[:1]
    assert "estimate off by +98% for m, 64 tokens, no cache" in speed_markdown(result)


@pytest.mark.slow
def test_quick_speed_on_smollm2(smollm2):
    result = run_speed(("smollm2",), lengths=(3, 6), repeats=1)
    assert {r.cache for r in result.records} == {"dense", "none"}
    assert result.summaries[0].model.startswith("SmolLM2")
