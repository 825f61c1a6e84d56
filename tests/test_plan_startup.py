"""`kvlab --help`, `--version` and `kvlab plan` of a catalog name stay light: no torch, numpy or matplotlib
is imported on the planner's path (the whole answer is arithmetic on the catalog's config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "matplotlib", "transformers", "gguf", "fastapi")

PROBE = """
import json, sys
from kvlab.cli import app
code = 0
try:
    app(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("PROBE " + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def run_cli(*args: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=120)
    line = next(line for line in done.stderr.splitlines() if line.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")), done.stdout


@pytest.mark.parametrize("args", [
    ("--help",),
    ("--version",),
    ("plan", "qwen3.5-9b", "--gpu", "RTX 3060", "--weights-quant", "q4_k_m", "--kv-type", "q8_0"),
    ("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "RTX 4090", "--ctx", "max", "--weights-quant", "fp8"),
    ("plan", "gemma-3-12b", "--gpu", "RTX 3060", "--json", "--weights-quant", "q4_k_m"),
    ("plan", "gemma-3-4b", "--gpu", "RTX 3060", "--mmproj", "auto", "--weights-quant", "q4_k_m"),   # clip's graph
])
def test_no_heavy_import(args):
    probe, out = run_cli(*args)
    assert probe["heavy"] == [], f"{' '.join(args)} imported {probe['heavy']}"
    assert probe["code"] in (0, 1, None)
    assert out.strip()


def test_version_and_lazy_listing():
    _, out = run_cli("--version")
    assert out.strip().startswith("kvlab ")
    _, listing = run_cli("--help")
    for name in ("plan", "eval", "lab", "serve", "bench", "generate"):
        assert name in listing


def test_lazy_command_still_resolves():
    """A placeholder in the listing loads its real command when it runs (here only its --help)."""
    probe, out = run_cli("lab", "--help")
    assert probe["code"] in (0, None) and "invariance" in out
    probe, out = run_cli("bench", "--help")
    assert "throughput" in out and "decode" in out
