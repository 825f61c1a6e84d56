"""docs/benchmarks.md is generated from bench/results/*.json: the committed page is what the generator writes, and every
results file is on it, as a table or as raw data."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_what_the_results_say():
    page = load_generator().page()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page, "run: python bench/results_page.py"


def test_every_results_file_is_on_the_page_or_listed_as_raw_data():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    files = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    assert files
    for name in files:
        assert f"`bench/results/{name}`" in text or f"- `{name}`:" in text, name


def test_every_table_has_a_command():
    gen = load_generator()
    for section in gen.SECTIONS:
        for t in section.tables:
            data = {} if gen.absent(t) else json.loads((gen.RESULTS / t.file).read_text())
            assert gen.command_of(data, t), t.file
    for name, (cmd, _) in gen.RAW.items():
        assert gen.command_of(json.loads((gen.RESULTS / name).read_text()), gen.Table(name, None, cmd)), name


def test_a_results_file_the_generator_does_not_know_is_refused(tmp_path, monkeypatch):
    gen = load_generator()
    results = tmp_path / "results"
    results.mkdir()
    for p in gen.RESULTS.glob("*.json"):
        (results / p.name).write_bytes(p.read_bytes())
    (results / "stray.json").write_text("{}")
    monkeypatch.setattr(gen, "RESULTS", results)
    with pytest.raises(SystemExit, match="not on the page: stray.json"):
        gen.page()


def test_old_names_print_as_today():
    gen = load_generator()
    assert gen.current_name("tq4+sink1", gen.BOTH) == "tq-k4v4+sink1"          # before the presets: the bare method
    assert gen.current_name("pool:tq4", gen.BOTH) == "pool:tq-k4v4"
    assert gen.current_name("tq3+sink1", gen.TQ3) == "tq-k3v3+sink1"
    assert gen.current_name("tq4.5", gen.BOTH) == "tq4.5"
    assert gen.current_name("tq4+halloc", gen.TQ3) == gen.TQ4_125 + "+halloc"   # tq4's 4.125-bit recipe
    assert gen.current_name("tq3", gen.PRESETS_125) == gen.TQ3_PREROPE                # tq3's recipe before RoPE
    assert gen.current_name("tq3+halloc", gen.TQ3_BEFORE_ROPEMEAN) == gen.TQ3_PREROPE + "+halloc"
    assert gen.current_name("tq4+halloc", gen.CURRENT) == "tq4+halloc"


def test_a_file_that_needs_a_gpu_may_be_absent_and_no_other(tmp_path, monkeypatch):
    gen = load_generator()
    (needs_gpu,) = [t for s in gen.SECTIONS for t in s.tables if t.needs]
    results = tmp_path / "results"
    results.mkdir()
    for p in gen.RESULTS.glob("*.json"):
        if p.name != needs_gpu.file:
            (results / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(gen, "RESULTS", results)
    assert f"`bench/results/{needs_gpu.file}`: not measured yet (it needs {needs_gpu.needs})" in gen.page()
    (results / "plan_speed.json").unlink()
    with pytest.raises(SystemExit, match="named but missing: plan_speed.json"):
        gen.page()
