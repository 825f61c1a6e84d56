"""Build tests/fixtures/llama_cpp_converted.json: tiny models converted by llama.cpp's own convert_hf_to_gguf.py.

Slow and never run in CI (it needs the llama.cpp that tools/llama_cpp_oracle.py --install builds); the tests only read
the JSON it writes.

    python tools/llama_cpp_converted.py [--build /work/llama-build/build] [--work /tmp/oracle_dl]

For each model (tiny Qwen3.5, Qwen3.5-MoE and Gemma 3 decoders made from transformers' own classes, seeded: the
builder of tests/hybrid_models.py, so a test can make the same weights again):
1. saves the Hugging Face folder (config.json, safetensors, SmolLM2's tokenizer) and converts it with the
   convert_hf_to_gguf.py vendored by llama-cpp-python's sdist, --outtype f32. The converter's classes write the
   hyperparameters and tensors; only its vocabulary step is replaced, by SmolLM2's tokenizer as the embedded GGUF
   holds it (the tiny models have no tokenizer of their own that the converter's hash table would know).
2. probes the converted file with llama.cpp (tools/llama_cpp_probe.cpp, FILE mode): its cache bytes per case;
3. decodes a short token sequence with llama.cpp (f32 KV cache) and records its logits compactly (top-k ids and
   values, and the first vocabulary entries, per position), and compares them with kvlab's logits of the very same
   converted file (kvlab.model.loader.load_model): the largest difference over the whole vocabulary is recorded.
The fixture keeps each config.json, the converted file's metadata (tokenizer arrays left out) and tensor table.

Last, tiny Gemma 3 vision-language models (SigLIP towers of 1,024, 196, 576 and 289 patches, VISIONS) are converted
with --mmproj (the first also as a text model, which the probe loads beside them); llama.cpp's mtmd loads each
projector on the CPU and reserves the compute buffer of its warm-up encode, without and with flash attention: its
bytes (mtmd_get_memory_usage). `--projectors-only` redoes just these (a minute) in the existing fixture.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tools.llama_cpp_oracle import LLAMA_CPP_COMMIT, PACKAGE, VERSION, build_probe, llama_cpp_source, probe  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "llama_cpp_converted.json"
SEED = 0
#: (transformers arch for tests/hybrid_models.build, its overrides). Qwen3.5's M-RoPE sections sum to half its rotary
#: dims (2 of 4 here; the converter writes [11, 11, 10] when the config has none, which only a 64-dim rope holds; for
#: text every section sees the same position, so the sections do not change the logits). Gemma 3 keeps its real period of 6 (5 sliding
#: layers, then a full one): the converter writes no pattern and llama.cpp's loader assumes 6; and its query scale is
#: 1/sqrt(head_dim) as in every Gemma 3 but the 27B (the converter writes no query_pre_attn_scalar).
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
MODELS = {
    "qwen35-tiny": ("qwen3_5", MROPE),
    "qwen35moe-tiny": ("qwen3_5_moe", MROPE),
    "gemma3-tiny": ("gemma3", {"num_hidden_layers": 7, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
                               "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]}),
}
TOKENS = [1, 17, 300, 4242, 9000, 12, 77, 31000, 5, 48000, 2024, 640]   # the decoded sequence (SmolLM2 ids)
TOP_K = 8
FIRST = 16    # first vocabulary entries recorded per position
#: tokenizer arrays the fixture leaves out (SmolLM2's, 49,152 entries each; the tests do not need them)
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")

CONVERT = r'''
import json, sys
from pathlib import Path
llama_cpp, folder, out, meta_path = sys.argv[1:5]
sys.path.insert(0, llama_cpp)
sys.path.insert(1, str(Path(llama_cpp) / "gguf-py"))
import convert_hf_to_gguf
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
meta = json.loads(Path(meta_path).read_text())

def set_vocab(self):
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])

hparams = ModelBase.load_hparams(Path(folder), False)
if "--mmproj" not in sys.argv:
    get_model_class(get_model_architecture(hparams, ModelType.TEXT)).set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32", *sys.argv[5:]]
convert_hf_to_gguf.main()
'''


def _cases() -> list[dict]:
    base = dict(n_ctx=1024, n_seq_max=1, type_k="f16", type_v="f16", flash_attn=1, kv_unified=0, swa_full=0, n_ubatch=512)
    variants = [{}, {"n_ctx": 300}, {"n_ctx": 5000, "n_ubatch": 64}, {"flash_attn": 0},
                {"type_k": "q8_0", "type_v": "q8_0"}, {"type_k": "q4_0", "type_v": "f16", "n_ctx": 2048},
                {"n_seq_max": 3}, {"n_seq_max": 3, "kv_unified": 1}, {"swa_full": 1}]
    return [{**base, **v} for v in variants]


def convert(model, tokenizer, tokenizer_meta: dict, work: Path, name: str, llama_cpp: Path, folder: Path | None = None,
            flags: list[str] | None = None) -> Path:
    """convert_hf_to_gguf.py of `model` (saved to work/name) or of a saved `folder`, f32, SmolLM2's vocabulary."""
    from tests.hybrid_models import save_folder

    folder = folder or save_folder(model, work / name, tokenizer)
    meta_path = work / "tokenizer_meta.json"
    meta_path.write_text(json.dumps({k: v for k, v in tokenizer_meta.items() if k.startswith("tokenizer.")}))
    out = work / f"{name}.gguf"
    if flags is None:
        flags = ["--no-mtp"] if name.startswith("qwen") else []   # the Qwen classes expect MTP layers unless told none
    subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(folder), str(out), str(meta_path), *flags],
                   check=True, capture_output=True, text=True)
    return out


def cache_bytes(result: dict) -> dict:
    """A probe's caches as bytes per role (base, swa: K + V; recurrent: R + S), or its error."""
    if "error" in result:
        return {"error": result["error"].rsplit(":", 1)[-1].strip()}   # llama_init_from_model's last words
    return {c["role"]: c.get("k_bytes", 0) + c.get("v_bytes", 0) + c.get("r_bytes", 0) + c.get("s_bytes", 0)
            for c in result["caches"]}


def compact_logits(logits: np.ndarray) -> dict:
    """Per position: the top-k ids and values and the first FIRST entries."""
    top = np.argsort(-logits, axis=1)[:, :TOP_K]
    return {"top_ids": top.tolist(), "top_values": np.take_along_axis(logits, top, axis=1).round(5).tolist(),
            "first": logits[:, :FIRST].round(5).tolist()}


def kvlab_logits(path: Path, tokens: list[int]) -> np.ndarray:
    import torch

    from kvlab.model.layer_caches import model_cache
    from kvlab.model.loader import load_model

    loaded = load_model(path)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return loaded.model(ids, model_cache(loaded.config, "dense", capacity=len(tokens)))[0].float().numpy()


#: tiny vision towers (SiglipVisionConfig) and the tokens per image of their Gemma 3 projector (image_seq_length,
#: from which the converter derives the average pool: (image_size / patch_size) / sqrt(tokens), written only when not
#: 4): patch grids of 32², 14², 24² and 17² (sizes that are no multiple of ggml's 32-byte alignment), head widths of
#: 8 to 32, 1 to 3 layers
VISIONS = [
    (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=448, patch_size=14), 256),
    (dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6, image_size=224, patch_size=16), 49),
    (dict(hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=2, image_size=336, patch_size=14), 36),
    (dict(hidden_size=36, intermediate_size=72, num_hidden_layers=2, num_attention_heads=3, image_size=238, patch_size=14), 16),
]
#: the mmproj metadata the fixture keeps (the preprocessing's mean and std left out)
CLIP_SKIPPED = ("clip.vision.image_mean", "clip.vision.image_std")


def measure_projector(binary: Path, llama_cpp: Path, work: Path, tokenizer, tokenizer_meta: dict, index: int) -> dict:
    """A tiny Gemma 3 VLM with tower VISIONS[index], converted with --mmproj (and, for the first, its text model, which
    the probe loads beside it): the mmproj's metadata and tensor table, and the bytes of the compute buffer llama.cpp's
    clip reserves for its warm-up image, without and with flash attention."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from kvlab.sources.gguf import gguf_metadata, open_gguf
    from tests.hybrid_models import save_folder

    vision, tokens = VISIONS[index]
    name = "gemma3-vlm" if index == 0 else f"gemma3-vlm{index}"
    torch.manual_seed(SEED)
    text = transformers.Gemma3TextConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                         max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=16)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
                                       mm_tokens_per_image=tokens)
    folder = save_folder(transformers.Gemma3ForConditionalGeneration(config).eval(), work / name, tokenizer)
    # the Hub's layout of Gemma 3 checkpoints (vision_tower.vision_model.*), which the converter maps
    weights = load_file(folder / "model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                                                                 "image_seq_length": tokens}))
    text_gguf = work / "gemma3-vlm.gguf"
    if index == 0 or not text_gguf.exists():
        text_gguf = convert(None, tokenizer, tokenizer_meta, work, "gemma3-vlm", llama_cpp, folder=folder)
    mmproj = convert(None, tokenizer, tokenizer_meta, work, f"{name}-mmproj", llama_cpp, folder=folder, flags=["--mmproj"])
    reader = open_gguf(mmproj)
    out = {"vision_config": vision, "image_seq_length": tokens,
           "metadata": {k: v for k, v in gguf_metadata(reader).items() if k not in CLIP_SKIPPED},
           "tensors": {t.name: [[int(n) for n in t.shape], t.tensor_type.name] for t in reader.tensors},   # ne order
           "mmproj_tensor_bytes": reader.tensor_bytes, "compute_bytes": {}, "graph_nodes": {}}
    for fa in (0, 1):
        result = probe(binary, text_gguf, "FILE", dict(n_ctx=512, n_seq_max=1, type_k="f16", type_v="f16", flash_attn=fa,
                                                       kv_unified=0, swa_full=0, n_ubatch=512), [f"mmproj={mmproj}"])
        assert result["mmproj"]["weight_bytes"] == reader.tensor_bytes
        key = "flash_attn" if fa else "no_flash_attn"
        out["compute_bytes"][key] = result["mmproj"]["compute_bytes"]
        out["graph_nodes"][key] = result["mmproj"]["graph_nodes"]
        assert result["mmproj"]["graph_splits"] == 1    # one backend: the scheduler passes the graph unchanged
    return out


def measure_projectors(binary: Path, llama_cpp: Path, work: Path, tokenizer, tokenizer_meta: dict) -> list[dict]:
    found = []
    for index in range(len(VISIONS)):
        found.append(measure_projector(binary, llama_cpp, work, tokenizer, tokenizer_meta, index))
        print("projector", found[-1]["vision_config"], found[-1]["compute_bytes"], flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=Path("/work/llama-build/build"), help="llama.cpp's cmake build folder")
    parser.add_argument("--work", type=Path, default=Path("/tmp/oracle_dl"))
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--projectors-only", action="store_true",
                        help="measure only the vision projectors and replace them in the existing fixture")
    args = parser.parse_args()
    from kvlab.session import cached_model
    from kvlab.sources.gguf import gguf_metadata, open_gguf
    from tests.hybrid_models import build

    binary = build_probe(args.build, args.work)
    llama_cpp = llama_cpp_source(args.work)
    smollm2 = cached_model(None, "fp32", "cpu")
    tokenizer_meta = gguf_metadata(open_gguf(smollm2.path))
    fixture = {"llama_cpp": {"package": f"{PACKAGE} {VERSION}", "commit": LLAMA_CPP_COMMIT, "backend": "CPU",
                             "converter": "convert_hf_to_gguf.py of the sdist, --outtype f32, SmolLM2's vocabulary"},
               "seed": SEED, "tokens": TOKENS, "models": {}}
    work = args.work / "converted"   # kept: tools/llama_cpp_offload.py probes these files too
    work.mkdir(parents=True, exist_ok=True)
    if args.projectors_only:
        fixture = json.loads(args.out.read_text())
        fixture.pop("projector", None)
        fixture["projectors"] = measure_projectors(binary, llama_cpp, work, smollm2.tokenizer, tokenizer_meta)
        args.out.write_text(json.dumps(fixture, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    for name, (arch, overrides) in MODELS.items():
        model = build(arch, smollm2.tokenizer.vocab_size, seed=SEED, **overrides)
        path = convert(model, smollm2.tokenizer, tokenizer_meta, work, name, llama_cpp)
        reader = open_gguf(path)
        metadata = {k: v for k, v in gguf_metadata(reader).items() if k not in TOKENIZER_ARRAYS}
        tensors = {t.name: [list(reversed(t.shape)), t.tensor_type.name] for t in reader.tensors}   # rows first
        entry = {"arch": arch, "overrides": overrides, "config": json.loads((work / name / "config.json").read_text()),
                 "gguf_metadata": metadata, "tensors": tensors, "cases": []}
        for case in _cases():
            entry["cases"].append({"settings": case, "llama_cpp": cache_bytes(probe(binary, path, "FILE", case))})
        logits_path = work / f"{name}.logits"
        run = dict(_cases()[0], n_ctx=256, type_k="f32", type_v="f32")
        probe(binary, path, "FILE", run, [f"logits={logits_path}", "tokens=" + ",".join(map(str, TOKENS))])
        ours_llama = np.fromfile(logits_path, dtype=np.float32).reshape(len(TOKENS), -1)
        ours_kvlab = kvlab_logits(path, TOKENS)
        entry["logits"] = {"settings": run, **compact_logits(ours_llama),
                           "kvlab_gguf_max_abs_diff": float(np.abs(ours_kvlab - ours_llama).max()),
                           "spread": float(np.abs(ours_llama).max())}
        print(name, "cases", len(entry["cases"]), "kvlab vs llama.cpp logits", entry["logits"]["kvlab_gguf_max_abs_diff"],
              flush=True)
        fixture["models"][name] = entry
    fixture["projectors"] = measure_projectors(binary, llama_cpp, work, smollm2.tokenizer, tokenizer_meta)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
