"""Build tests/fixtures/llama_cpp_offload.json: where a real llama.cpp puts weights and caches under -ngl / --n-cpu-moe.

Slow and never run in CI (it needs the llama.cpp that tools/llama_cpp_oracle.py --install builds, and the converted
tiny models of tools/llama_cpp_converted.py); the tests only read the JSON it writes.

    python tools/llama_cpp_offload.py [--build /work/llama-build/build] [--work /tmp/oracle_dl]

There is no GPU here. llama.cpp's RPC backend stands in for one: a ggml-rpc-server on this machine (its memory is
host memory, its compute the CPU's) is a device of type GPU to llama.cpp, so -ngl, the output layer, tensor overrides
(--cpu-moe / --n-cpu-moe are `-ot <experts regex>=CPU`) and the caches with their layers are placed by the very code
that places them on a CUDA card. The probe reads, per buffer type, the weight tensors' bytes (ggml_nbytes) and
llama_get_memory_breakdown's model / context / compute bytes. What a CUDA build does differently and this cannot see:
pinned host buffers (CUDA_Host instead of CPU), the CUDA runtime, and the compute buffers' exact sizes (each backend
sizes its own graph split).

Models: the SmolLM2-135M GGUF (tied embeddings), and the converted tiny Qwen3.5-MoE (experts, recurrent layers) and
Gemma 3 (tied, sliding-window cache). The fixture keeps each model's metadata (tokenizer arrays left out) and tensor
table, so the tests rebuild the plan without the files; and, per case, -ngl, the expert overrides and what llama.cpp
placed on the "GPU" (the RPC device) and on the host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tools.llama_cpp_converted import TOKENIZER_ARRAYS  # noqa: E402
from tools.llama_cpp_oracle import (LLAMA_CPP_COMMIT, PACKAGE, VERSION, build_probe, probe, server_outputs,  # noqa: E402
                                    smollm2_gguf)

FIXTURE = ROOT / "tests" / "fixtures" / "llama_cpp_offload.json"
RPC = "127.0.0.1:50152"
#: common/common.h: --cpu-moe is LLM_FFN_EXPS_REGEX=CPU, --n-cpu-moe N one `blk\.i<regex>` per layer i < N
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
SETTINGS = dict(n_ctx=1024, n_seq_max=1, type_k="f16", type_v="f16", flash_attn=1, kv_unified=0, swa_full=0, n_ubatch=512)
#: (model, -ngl, experts of the first N layers on the host: None none, "all" --cpu-moe)
CASES = {
    "smollm2-135m": [(0, None), (1, None), (2, None), (10, None), (30, None), (31, None), (99, None)],
    "qwen35moe-tiny": [(0, None), (1, None), (3, None), (4, None), (99, None), (99, "all"), (99, 2), (3, 1)],
    "gemma3-tiny": [(0, None), (1, None), (4, None), (7, None), (99, None)],
}


def expert_overrides(cpu_moe) -> list[str]:
    if cpu_moe is None:
        return []
    if cpu_moe == "all":
        return [f"ot={EXPS_REGEX}"]
    return [f"ot=blk\\.{i}{EXPS_REGEX}" for i in range(cpu_moe)]


def placed(result: dict) -> dict:
    """The probe's buffers summed by side: the RPC device (the "GPU") and the host."""
    out = {f"{side}_{what}": 0 for side in ("gpu", "host") for what in ("weights", "context", "compute")}
    for name, nbytes in result["weights"].items():
        out["gpu_weights" if name.startswith("RPC") else "host_weights"] += nbytes
    for buf in result["buffers"]:
        side = "gpu" if buf["device"].startswith("RPC") else "host"
        out[f"{side}_context"] += buf["context"]
        out[f"{side}_compute"] += buf["compute"]
    return out


def model_entry(path: Path) -> dict:
    from kvlab.sources.gguf import gguf_metadata, open_gguf

    reader = open_gguf(path)
    metadata = gguf_metadata(reader)
    arch = metadata["general.architecture"]
    metadata.setdefault(f"{arch}.vocab_size", len(metadata["tokenizer.ggml.tokens"]))
    return {"metadata": {k: v for k, v in metadata.items() if k not in TOKENIZER_ARRAYS},
            "tensors": {t.name: [list(reversed(t.shape)), t.tensor_type.name] for t in reader.tensors}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=Path("/work/llama-build/build"), help="llama.cpp's cmake build folder")
    parser.add_argument("--work", type=Path, default=Path("/tmp/oracle_dl"))
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    binary = build_probe(args.build, args.work)
    files = {"smollm2-135m": smollm2_gguf(), "qwen35moe-tiny": args.work / "converted" / "qwen35moe-tiny.gguf",
             "gemma3-tiny": args.work / "converted" / "gemma3-tiny.gguf"}
    host, port = RPC.split(":")
    server = subprocess.Popen([str(args.build / "bin" / "ggml-rpc-server"), "-H", host, "-p", port],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)
    fixture = {"llama_cpp": {"package": f"{PACKAGE} {VERSION}", "commit": LLAMA_CPP_COMMIT,
                             "gpu": "ggml-rpc-server on the same machine (a GGML_BACKEND_DEVICE_TYPE_GPU device)",
                             "settings": SETTINGS}, "models": {}}
    try:
        for name, path in files.items():
            if path is None or not path.exists():
                raise SystemExit(f"{name}: {path} missing (run tools/llama_cpp_converted.py first)")
            entry = {**model_entry(path), "cases": []}
            for ngl, cpu_moe in CASES[name]:
                result = probe(binary, path, "FILE", SETTINGS, [f"rpc={RPC}", f"ngl={ngl}", *server_outputs(SETTINGS), *expert_overrides(cpu_moe)])
                entry["cases"].append({"ngl": ngl, "cpu_moe": cpu_moe, "llama_cpp": placed(result),
                                       "buffers": result["buffers"]})
                print(name, ngl, cpu_moe, placed(result), flush=True)
            fixture["models"][name] = entry
    finally:
        server.terminate()
        server.wait()
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
