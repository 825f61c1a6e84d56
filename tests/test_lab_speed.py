"""Lab experiment 4: the speed table's plumbing (no timing assertions: the machine is shared)."""

from __future__ import annotations

import pytest

from kvlab.measure import torch_threads
from kvlab.lab.speed import StepProfile, run_speed, step_grid


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
    result = run_speed(("lab",), lengths=(4, 8), repeats=1, check_ns=(4,), quick=True, weights_dir=tmp_path)
    records = [r.record() for r in result.records]
    assert {(r["new_tokens"], r["cache"]) for r in records} == {(4, "dense"), (8, "dense"), (4, "none"), (8, "none")}
    for r in records:
        assert r["model"].startswith("lab GPT") and r["tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0
    (summary,) = result.summaries
    assert summary.predicted_speedup > 1                    # the MACs always favour the cache
    assert {c.cache for c in result.checks} == {"dense", "none"}


@pytest.mark.slow
def test_quick_speed_on_smollm2(smollm2):
    result = run_speed(("smollm2",), lengths=(3, 6), repeats=1, check_ns=(3,))
    assert {r.cache for r in result.records} == {"dense", "none"}
    assert result.summaries[0].model.startswith("SmolLM2")
