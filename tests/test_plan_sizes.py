"""Real sizes: GGUF quant schemes tensor by tensor (byte-exact against a llama-quantize output, within 1% of
published files), stated sizes (--weights-bytes / --weights-file), the vision projector, and one-line errors."""

from __future__ import annotations

import builtins
import io
import json
import os
import struct
from pathlib import Path

import pytest
from rich.console import Console

from kvlab.errors import ConfigError
from kvlab.plan.command import build_plan, plan_command
from kvlab.plan.quants import FTYPES, UD_BASES, scheme_bytes
from kvlab.sources import catalog, default_model_path, load_spec, open_gguf
from kvlab.sources.hf_folder import text_config
from kvlab.sources.params import count_params, weight_tensors


def tensors_of(name):
    entry = catalog()[name]
    spec = entry.spec()
    return spec, weight_tensors(text_config(entry.config), list(spec.layers))


def run(*args, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = plan_command(*args, console=Console(file=out, width=100, color_system=None), err_console=Console(file=out, width=400),
                        **kwargs)
    return code, out.getvalue()


@pytest.mark.parametrize("name", sorted(catalog()))
def test_the_tensor_list_holds_every_parameter(name):
    spec, tensors = tensors_of(name)
    assert sum(t.numel for t in tensors) == count_params(text_config(catalog()[name].config), list(spec.layers))
    assert len({t.name for t in tensors}) == len(tensors)


def test_q4_1_scheme_is_byte_exact_against_the_embedded_gguf():
    """The embedded SmolLM2 GGUF is llama-quantize's Q4_1 (file_type 3): every tensor's type and the bytes agree."""
    gguf = open_gguf(default_model_path())
    spec, tensors = tensors_of("smollm2-135m")
    split = scheme_bytes("Q4_1", tensors, spec.n_layers, 0, 3)
    assert split.bytes == gguf.tensor_bytes == 96_576_768
    by_type: dict[str, int] = {}
    for t in gguf.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + t.n_bytes
    assert split.by_type == dict(sorted(by_type.items(), key=lambda kv: -kv[1]))


#: bartowski/Meta-Llama-3.1-8B-Instruct-GGUF, ggml-org/gpt-oss-20b-GGUF, unsloth/Qwen3-30B-A3B-GGUF: file sizes in GB
PUBLISHED = [("llama-3.1-8b", "Q8_0", 8.54), ("llama-3.1-8b", "Q6_K", 6.60), ("llama-3.1-8b", "Q5_K_M", 5.73),
             ("llama-3.1-8b", "Q4_K_M", 4.92), ("llama-3.1-8b", "Q4_K_S", 4.69), ("llama-3.1-8b", "Q3_K_M", 4.02),
             ("llama-3.1-8b", "Q2_K", 3.18), ("gpt-oss-20b", "MXFP4_MOE", 12.1), ("qwen3-30b-a3b", "Q4_K_M", 18.6),
             ("qwen3.5-9b", "UD-Q4_K_XL", 5.97)]


@pytest.mark.parametrize("name, scheme, gb", PUBLISHED)
def test_schemes_match_published_files(name, scheme, gb):
    plan = build_plan(name, weights_quant=scheme.lower())
    assert abs(plan.weights.bytes / (gb * 1e9) - 1) < 0.012, plan.weights.formula
    assert plan.weights.scheme is not None and scheme in plan.weights.formula


def test_a_plan_reads_each_model_file_once(tmp_path, monkeypatch):
    """The planner plans from the one description sources/ reads: config.json, each safetensors header and a GGUF are
    opened once, and the architecture's tensor list (for the quant schemes) comes with that description."""
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(catalog()["smollm2-135m"].config))
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [576], "data_offsets": [0, 2304]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2304))
    gguf = default_model_path()
    opened: list[Path] = []
    real_open = io.open

    def counted(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            opened.append(Path(file).resolve())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted)
    monkeypatch.setattr(io, "open", counted)
    planned = build_plan(str(folder), weights_quant="q4_k_m")
    build_plan(str(gguf))
    monkeypatch.undo()
    files = [folder / "config.json", folder / "model.safetensors", gguf]
    assert {f.name: opened.count(Path(f).resolve()) for f in files} == {f.name: 1 for f in files}
    assert planned.spec.extra["weight_tensors"] and planned.weights.scheme is not None     # Q4_K_M tensor by tensor
    assert planned.weights.bytes == build_plan("smollm2-135m", weights_quant="q4_k_m").weights.bytes


def test_every_scheme_name_plans_and_orders_sensibly():
    spec, tensors = tensors_of("llama-3.1-8b")
    sizes = {s: scheme_bytes(s, tensors, spec.n_layers, 0, 4).bytes for s in [*FTYPES, *UD_BASES]}
    assert sizes["IQ1_S"] < sizes["Q2_K"] < sizes["Q3_K_M"] < sizes["Q4_K_M"] < sizes["Q5_K_M"] < sizes["Q6_K"] < sizes["Q8_0"]
    assert sizes["Q4_K_M"] < sizes["UD-Q4_K_XL"] < sizes["Q5_K_M"]
    assert sizes["BF16"] == sizes["F16"] < sizes["F32"]


def test_unknown_quant_lists_the_known_ones():
    code, text = run("qwen3.5-9b", weights_quant="q4_x")
    assert code == 2 and len(text.strip().splitlines()) == 1
    assert "unknown --weights-quant 'q4_x'" in text and "UD-Q4_K_XL" in text and "IQ4_XS" in text and "fp8" in text


def test_weights_bytes_and_weights_file(tmp_path):
    assert build_plan("qwen3.5-9b", weights_bytes="5.97GB").weights.bytes == 5_970_000_000
    assert build_plan("qwen3.5-9b", weights_bytes="1GiB").weights.bytes == 1 << 30
    plan = build_plan("smollm2-135m", weights_file=str(default_model_path()))
    assert plan.weights.bytes == 96_576_768 and plan.weights.exact
    raw = tmp_path / "weights.bin"
    raw.write_bytes(b"\0" * 1234)
    assert build_plan("smollm2-135m", weights_file=str(raw)).weights.bytes == 1234
    for kwargs, message in ((dict(weights_bytes="lots"), "--weights-bytes must be a size"),
                            (dict(weights_file=str(tmp_path / "nope.gguf")), "no such file"),
                            (dict(weights_bytes="1GB", weights_file=str(raw)), "either --weights-bytes or --weights-file")):
        code, text = run("qwen3.5-9b", **kwargs)
        assert code == 2 and message in text and "Traceback" not in text


def test_mmproj_file_size_and_errors(tmp_path):
    projector = build_plan("qwen3.5-9b", mmproj=str(default_model_path())).mmproj   # any GGUF: its tensor table
    assert projector.bytes == 96_576_768 and projector.exact and projector.image_buffer > 0
    assert build_plan("llama-3.1-8b", mmproj="600MB").mmproj.image_buffer == 0   # no tower facts: stated bytes only
    for kwargs, message in ((dict(model="llama-3.1-8b", mmproj="auto"), "needs a catalog model with a vision tower"),
                            (dict(model="qwen3.5-9b", mmproj="auto", engine="vllm"), "llama.cpp's vision projector"),
                            (dict(model="qwen3.5-9b", mmproj="big"), "--mmproj must be a size")):
        code, text = run(**kwargs)
        assert code == 2 and message in text


def test_gemma_tower_counts_its_siglip():
    plan = build_plan("gemma-3-4b", mmproj="auto")
    assert 0.80e9 < plan.mmproj.bytes < 0.87e9          # mmproj-model-f16.gguf of gemma-3-4b-it: ~0.85 GB
    # its image buffer is ggml's allocator over clip's graph (exact: tests/test_plan_converted.py), the JSON says so
    code, text = run("gemma-3-4b", mmproj="auto", json_out=True)
    parts = {c["name"]: c for c in json.loads(text[text.index("{"):])["components"]}
    assert parts["image buffer"]["exact"] and "allocator" in parts["image buffer"]["formula"]
    assert parts["image buffer"]["bytes"] == plan.mmproj.image_buffer
    # without flash attention the scores of one layer, f32 [16, 4096, 4096], dominate: a little above 1 GiB
    no_fa = build_plan("gemma-3-4b", mmproj="auto", flash_attn=False).mmproj.buffer
    assert no_fa.exact and 16 * 4096 ** 2 * 4 < no_fa.bytes < 1.2 * 16 * 4096 ** 2 * 4


def test_clip_metadata_picks_the_graph():
    from kvlab.plan.vision import clip_shape

    meta = {"clip.projector_type": "gemma3", "clip.has_vision_encoder": True, "clip.vision.block_count": 2,
            "clip.vision.embedding_length": 32, "clip.vision.attention.head_count": 4, "clip.vision.feed_forward_length": 64,
            "clip.vision.patch_size": 14, "clip.vision.image_size": 448, "clip.vision.projection_dim": 64}
    shape = clip_shape(meta, {"v.patch_embd.weight": "F16", "mm.input_projection.weight": "F16"})
    assert (shape.pool, shape.patch_type, shape.projection_type, shape.text_hidden) == (4, "f16", "f16", 64)
    assert clip_shape({**meta, "clip.projector_type": "qwen3vl_merger"}, {}) is None          # not a graph kvlab builds
    assert clip_shape(meta, {"mm.input_projection.weight": "Q8_0"}) is None
    with pytest.raises(ConfigError, match="lacks a usable clip.vision.block_count"):
        clip_shape({k: v for k, v in meta.items() if k != "clip.vision.block_count"}, {})


def test_gguf_repo_names_resolve_offline():
    for repo, name in (("unsloth/Qwen3.5-9B-GGUF", "qwen3.5-9b"), ("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "llama-3.1-8b"),
                       ("unsloth/gemma-3-12b-it-GGUF", "gemma-3-12b"), ("ggml-org/gpt-oss-20b-GGUF", "gpt-oss-20b")):
        assert load_spec(repo).name == name
    code, text = run("unsloth/Qwen3.5-9B-GGUF", weights_quant="q4_k_m", json_out=True)
    doc = json.loads(text[text.index("{"):])
    assert doc["model"] == "qwen3.5-9b" and "-hf unsloth/Qwen3.5-9B-GGUF:Q4_K_M" in doc["launch"]
