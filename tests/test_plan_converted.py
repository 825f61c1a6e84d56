"""Tiny Qwen3.5, Qwen3.5-MoE and Gemma 3 models after llama.cpp's own convert_hf_to_gguf.py, against llama.cpp itself.

The fixture (tools/llama_cpp_converted.py, outside CI) holds each config.json, the converted file's metadata and
tensor table, llama.cpp's cache bytes per case, and llama.cpp's logits for a short token sequence (top-k and the first
vocabulary entries per position). Here:
- `kvlab plan --engine llama.cpp` of the config.json and of the converted file's metadata give llama.cpp's bytes
  (or its refusal);
- kvlab's GGUF writer of the tests (tests/hybrid_models.py) names and shapes every tensor as the real converter does;
- kvlab's logits of the same seeded weights equal llama.cpp's. The converted GGUFs themselves (12-15 MB, f32, the
  49,152-token vocabulary) are not shipped: transformers remakes the weights from the seed and kvlab runs them from
  the saved folder; the tool compared kvlab on the converted file itself (kvlab_gguf_max_abs_diff)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import ConfigError
from kvlab.plan.rules import LlamaCppRules
from kvlab.plan.settings import PlanSettings
from kvlab.sources import load_spec, spec_from_config
from kvlab.sources.gguf import write_gguf

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_converted.json").read_text())
ROLES = {"full": "base", "mla": "base", "sliding": "swa", "recurrent": "recurrent"}
VOCAB = 49152            # SmolLM2's vocabulary, which the converted files carry
#: llama.cpp's CPU kernels (GELU by an f16 table, f16 rounding inside flash attention) against kvlab's f32: the
#: largest difference measured was 5.5e-3 (Gemma 3) on logits spread over ±3
LOGIT_TOLERANCE = 1e-2


def _settings(s: dict) -> PlanSettings:
    return PlanSettings(context=math.ceil(s["n_ctx"] / s["n_seq_max"]), parallel=s["n_seq_max"], n_ctx_total=s["n_ctx"],
                        kv_type_k=s["type_k"], kv_type_v=s["type_v"], flash_attn=bool(s["flash_attn"]),
                        kv_unified=bool(s["kv_unified"]), swa_full=bool(s["swa_full"]), ubatch=s["n_ubatch"])


def _planned(spec, settings: PlanSettings) -> dict:
    out: dict[str, int] = {}
    for row in LlamaCppRules().layout(spec, settings).layers:
        if ROLES.get(row.kind) and (row.k_bytes or row.v_bytes or row.state_bytes):
            out[ROLES[row.kind]] = out.get(ROLES[row.kind], 0) + row.k_bytes + row.v_bytes + row.state_bytes
    return out


@functools.cache
def _seeded(name: str):
    """The transformers model the tool converted: the same class, sizes and seed."""
    from .hybrid_models import build

    model = FIXTURE["models"][name]
    return build(model["arch"], VOCAB, seed=FIXTURE["seed"], **model["overrides"])


def test_fixture_covers_both_families():
    archs = {m["gguf_metadata"]["general.architecture"] for m in FIXTURE["models"].values()}
    assert archs == {"qwen35", "qwen35moe", "gemma3"}
    assert sum(len(m["cases"]) for m in FIXTURE["models"].values()) >= 12


@pytest.mark.parametrize("name", sorted(FIXTURE["models"]))
def test_plan_of_the_config_and_of_the_converted_file_equal_llama_cpp(name, tmp_path):
    model = FIXTURE["models"][name]
    specs = {"config": spec_from_config(model["config"]),
             "gguf": load_spec(str(write_gguf(tmp_path / f"{name}.gguf", model["gguf_metadata"])))}
    for case in model["cases"]:
        settings, real = _settings(case["settings"]), case["llama_cpp"]
        for source, spec in specs.items():
            if "error" in real:
                with pytest.raises(ConfigError, match="does not divide"):
                    LlamaCppRules().layout(spec, settings)
            else:
                assert _planned(spec, settings) == real, (source, case["settings"])


@pytest.mark.parametrize("name", sorted(FIXTURE["models"]))
def test_the_tests_gguf_writer_lays_tensors_out_as_the_converter(name):
    from .hybrid_models import gguf_tensors

    model = FIXTURE["models"][name]
    ours = gguf_tensors(_seeded(name), model["arch"])
    assert {n: list(a.shape) for n, a in ours.items()} == {n: shape for n, (shape, _) in model["tensors"].items()}


@pytest.mark.parametrize("name", sorted(FIXTURE["models"]))
def test_kvlab_logits_equal_llama_cpps(name, smollm2, tmp_path):
    """The same seeded weights: llama.cpp ran the converted file (f32 weights and KV), kvlab runs the saved folder."""
    import torch

    from kvlab.model.layer_caches import model_cache
    from kvlab.model.loader import load_model

    from .hybrid_models import save_folder

    model = FIXTURE["models"][name]
    loaded = load_model(save_folder(_seeded(name), tmp_path / name, smollm2.tokenizer))
    tokens = FIXTURE["tokens"]
    with torch.no_grad():
        ours = loaded.model(torch.tensor([tokens]), model_cache(loaded.config, "dense", capacity=len(tokens)))[0].numpy()
    real = model["logits"]
    assert real["spread"] > 1.0                                             # logits spread over units, not a zero model
    assert np.abs(ours[:, :len(real["first"][0])] - np.array(real["first"])).max() < LOGIT_TOLERANCE
    top_values = np.take_along_axis(ours, np.array(real["top_ids"]), axis=1)
    assert np.abs(top_values - np.array(real["top_values"])).max() < LOGIT_TOLERANCE
    llama_first = np.take_along_axis(ours, np.array(real["top_ids"])[:, :1], axis=1)[:, 0]
    assert (llama_first >= ours.max(axis=1) - LOGIT_TOLERANCE).all()   # llama.cpp's next token is kvlab's (up to near-ties)
    assert real["kvlab_gguf_max_abs_diff"] < LOGIT_TOLERANCE                 # and kvlab on the converted file itself


def _mmproj_file(real: dict, path: Path) -> Path:
    """The converted mmproj again: its metadata and its tensor table (ne order), zero-filled."""
    dtypes = {"F32": np.float32, "F16": np.float16}
    tensors = {name: np.zeros(tuple(reversed(ne)), dtypes[kind]) for name, (ne, kind) in real["tensors"].items()}
    return write_gguf(path, real["metadata"], tensors)


@pytest.mark.parametrize("index", range(len(FIXTURE["projectors"])))
def test_planned_image_buffer_equals_llama_cpps_clip(index, tmp_path):
    """Tiny Gemma 3 projectors converted with --mmproj and loaded by llama.cpp's mtmd on the CPU: `--mmproj FILE`
    plans the compute buffer of their warm-up encode byte for byte (at the CPU's 32-byte alignment), with and without
    flash attention (which llama-server hands to the encoder with -fa), and their weights from the tensor table; the
    graph kvlab builds has as many ops as the one clip logs."""
    from kvlab.plan.clip_graph import gemma3_graph
    from kvlab.plan.vision import clip_shape, projector

    real = FIXTURE["projectors"][index]
    path = _mmproj_file(real, tmp_path / "mmproj.gguf")
    shape = clip_shape(real["metadata"], {name: kind for name, (_, kind) in real["tensors"].items()})
    for flash_attn, key in ((False, "no_flash_attn"), (True, "flash_attn")):
        assert len(gemma3_graph(shape, flash_attn).nodes) == real["graph_nodes"][key]
        planned = projector(str(path), None, flash_attn, alignment=32)
        assert (planned.bytes, planned.exact) == (real["mmproj_tensor_bytes"], True)
        assert (planned.buffer.bytes, planned.buffer.exact) == (real["compute_bytes"][key], True), (real["vision_config"], key)


def test_the_projectors_cover_several_tower_shapes():
    shapes = [p["vision_config"] for p in FIXTURE["projectors"]]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size"):
        assert len({s[field] for s in shapes}) >= 3, field
    pools = {p["metadata"].get("clip.vision.projector.scale_factor", 4) for p in FIXTURE["projectors"]}
    assert pools == {2, 4}      # the file's scale factor and clip's default
    assert all(p["compute_bytes"]["flash_attn"] < p["compute_bytes"]["no_flash_attn"] for p in FIXTURE["projectors"])


def test_the_image_buffer_estimate_of_other_towers_against_llama_cpps_clip():
    """The estimate kept for towers whose graph kvlab does not build (Qwen-VL's), on the first tiny SigLIP tower:
    within 10% of llama.cpp's buffer (2-5% low); the weights counted from the tower's dimensions (× 4: an f32 file)
    within 5% of the file's tensors."""
    from kvlab.plan.vision import VisionTower

    real = FIXTURE["projectors"][0]
    v = real["vision_config"]
    tower = VisionTower(depth=v["num_hidden_layers"], hidden=v["hidden_size"], heads=v["num_attention_heads"],
                        ffn=v["intermediate_size"], patch=v["patch_size"], image_side=v["image_size"], text_hidden=64)
    for flash_attn, key in ((False, "no_flash_attn"), (True, "flash_attn")):
        assert tower.image_buffer(flash_attn) == pytest.approx(real["compute_bytes"][key], rel=0.1)
        assert tower.image_buffer(flash_attn) < real["compute_bytes"][key]
    assert tower.n_params * 4 == pytest.approx(real["mmproj_tensor_bytes"], rel=0.05)
