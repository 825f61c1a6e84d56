"""bench/gpu_check.py's checks, run on the CPU at a tiny size: what they record means what the results page says it
means (a cache's run against the recompute, its bytes against the formula, a refusal in one line, transformers, the
serving engine, decode speed), and a record with a problem lists it."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=256)


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_checks_record_what_the_page_says(capsys):
    gpu_check = load_bench("gpu_check")
    result = gpu_check.run_checks("cpu", caches=("none", "dense", "dense-f16", "int8", "tq4", "int9"), tiny=SMALL,
                                  prompt_tokens=40, steps=8, requests=((7, 3), (20, 4)), speed=(SMALL, 32, 2))
    rows = {r["cache"]: r for r in result["caches"]}
    for name in ("none", "dense"):                        # fp32 K/V: the recompute up to summation order
        assert rows[name]["max_abs_diff_vs_recompute"] < 1e-4, rows[name]
    assert 1e-4 < rows["dense-f16"]["max_abs_diff_vs_recompute"] < rows["tq4"]["max_abs_diff_vs_recompute"]
    for name in ("dense", "dense-f16", "int8", "tq4"):
        r = rows[name]
        assert r["status"] == "ok" and r["nbytes"] > 0 and r["nbytes"] == r["expected_nbytes"] and r["nbytes_equal"]
        assert r["first_difference_vs_cpu"] is None and len(r["tokens"]) == 8
        assert r["logit_scale"] > 1 and r["smallest_top2_gap"] >= 0
        assert "_run" not in r
    assert rows["none"]["nbytes"] == rows["none"]["expected_nbytes"] == 0
    assert rows["int9"]["status"] == "refused" and rows["int9"]["message"].startswith("ConfigError: ")
    assert "\n" not in rows["int9"]["message"]

    t = result["transformers"]
    assert t["max_abs_logit_diff"] < 1e-4 and t["first_difference"] is None and t["greedy_tokens"] == 8
    assert result["engine"]["status"] == "ok" and len(result["engine"]["requests"]) == 2
    assert all(r["first_difference"] is None for r in result["engine"]["requests"])
    speed = result["speed"]["results"]
    assert [r["cache"] for r in speed] == ["dense", "dense-f16", "tq4"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["context"] == 32 for r in speed)
    assert result["problems"] == []

    page = load_bench("results_page").gpu_check(result, None)
    assert "| `dense` | ok |" in page and "| `int9` | refused: ConfigError:" in page
    assert "32 greedy tokens" not in page and "8 greedy tokens equal" in page and "Problems found: 0." in page

    broken = copy.deepcopy(result)
    broken["caches"][1].update(nbytes=1, nbytes_equal=False, max_abs_diff_vs_recompute=0.5)
    broken["engine"]["requests"][0]["first_difference"] = 3
    assert gpu_check.problems_of(broken) == [
        f"dense: nbytes 1 but the formula says {rows['dense']['expected_nbytes']:,}",
        "dense: logits 5.00e-01 from the recompute",
        "engine: a 7-token request differs from its single-sequence run at token 3",
    ]
    assert "1. caches" in capsys.readouterr().out


def test_a_model_folder_loads_without_the_gguf_package(tmp_path):
    """The GPU machines have no `gguf`: the HF-folder path must not import it."""
    from .hybrid_models import build, save_folder, word_tokenizer

    folder = save_folder(build("llama", 64, **SMALL), tmp_path / "m", word_tokenizer(64))
    code = ("import sys; sys.modules['gguf'] = None\n"                  # `import gguf` raises ImportError
            "from kvlab.model.loader import load_model\n"
            f"print(load_model({str(folder)!r}).config.arch)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "llama", done.stderr[-2000:]
