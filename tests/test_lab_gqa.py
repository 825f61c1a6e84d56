"""Lab experiment 3: measured cache bytes equal the formula exactly; ratios 1, 1/2, 1/4, 1/8; weights resume."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvlab.measure import torch_threads
from kvlab.lab.gqa import PROMPT, TrainSettings, lab_gpt_config, run_gqa, theoretical_bytes, weights_path
from kvlab.lab.corpus import encode, splits


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab-weights")
    settings = TrainSettings().quick()
    with torch_threads(1):
        first = run_gqa(settings, new_tokens=12, repeats=1, weights_dir=folder)
        second = run_gqa(settings, new_tokens=12, repeats=1, weights_dir=folder)
    return folder, settings, first, second


def test_measured_bytes_equal_theory_and_ratios_are_exact(runs):
    _, _, records, _ = runs
    assert [r.n_kv_head for r in records] == [8, 4, 2, 1]
    for r in records:
        assert r.cache_bytes == r.theoretical_bytes
        assert r.cache_tokens == len(encode(PROMPT)) + 12 - 1
        assert r.n_head == 8
    assert [Fraction(r.ratio_text) for r in records] == [1, Fraction(1, 2), Fraction(1, 4), Fraction(1, 8)]
    assert [r.ratio for r in records] == [1.0, 0.5, 0.25, 0.125]


def test_theoretical_formula_is_the_seed_formula():
    cfg = lab_gpt_config(2)
    assert theoretical_bytes(cfg, batch=3, tokens=100) == 2 * cfg.n_layers * 3 * 100 * 2 * 32 * 4


def test_weights_are_saved_as_safetensors_and_resumed(runs):
    folder, settings, first, second = runs
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) == 4 and all(name.endswith(".safetensors") for name in files)
    assert weights_path(folder, lab_gpt_config(4, settings.n_layers, settings.d_ff), settings).is_file()
    assert not any(r.resumed for r in first) and all(r.resumed for r in second)
    assert [r.val_loss for r in first] == [r.val_loss for r in second]
    assert [r.cache_bytes for r in first] == [r.cache_bytes for r in second]


def test_records_carry_the_issue_fields(runs):
    record = runs[2][0].record()
    for key in ("n_kv_head", "cache_bytes", "theoretical_bytes", "ratio", "tokens_per_s", "val_loss"):
        assert key in record
    assert 0 < record["val_loss"] < 6


def test_corpus_split_is_bytes():
    train, val = splits()
    assert train.max() < 256 and val.numel() > 10_000 and train.numel() > 10 * val.numel()
