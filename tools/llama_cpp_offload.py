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

Last, llama-server itself runs the launch lines of a few kvlab plans of the SmolLM2 GGUF (with the RPC device and
--no-repack added), and its log's buffer sizes (MiB, two decimals) are recorded against each line.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
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


#: kvlab plans of the SmolLM2 GGUF whose launch lines llama-server runs (build_plan keyword arguments)
LAUNCH_PLANS = [
    {"ctx": "4096", "gpu_layers": 10},
    {"ctx": "8192", "parallel": 2, "kv_type": "q8_0"},
    {"ctx": "2048", "parallel": 3, "kv_unified": True, "flash_attn": False, "gpu_layers": 31},
    {"ctx": "3000", "gpu_layers": 1, "ubatch": 256},
]
#: the harness's own flags after the plan's line: the RPC "GPU", no CPU repacking (this VM faults on AMX tiles),
#: a port, no warm-up run, and the log level that prints the buffer sizes
HARNESS = ["--rpc", RPC, "--no-repack", "--host", "127.0.0.1", "--port", "18080", "--no-warmup", "-lv", "4"]
LOG_LINES = {  # llama.cpp's log lines (src/llama-model.cpp, llama-kv-cache.cpp, llama-memory-recurrent.cpp, llama-context.cpp)
    "model": re.compile(r"load_tensors: +(\S+) model buffer size = +([0-9.]+) MiB"),
    "kv": re.compile(r"llama_kv_cache: +(\S+) KV buffer size = +([0-9.]+) MiB"),
    "rs": re.compile(r"llama_memory_recurrent: +(\S+) RS buffer size = +([0-9.]+) MiB"),
    "compute": re.compile(r"sched_reserve: +(\S+) compute buffer size = +([0-9.]+) MiB"),
}


def run_launch_line(line: str, build: Path) -> dict:
    """Start llama-server with a plan's launch line (and the harness flags), read what it allocated from its log,
    stop it. MiB as the log prints them (two decimals), summed per side (RPC: the GPU; the rest: the host)."""
    words = shlex.split(line)
    with tempfile.TemporaryFile("w+") as log_file:
        server = subprocess.Popen([str(build / "bin" / words[0]), *words[1:], *HARNESS], stdout=log_file,
                                  stderr=subprocess.STDOUT, text=True)
        for _ in range(240):   # until it answers /health (its log reaches the file only when flushed)
            time.sleep(0.5)
            if server.poll() is not None:
                break
            try:
                with urllib.request.urlopen("http://127.0.0.1:18080/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                continue
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        log_file.seek(0)
        log = log_file.readlines()
    out: dict = {"n_ctx": None, "offloaded": None}
    for text in log:
        if m := re.search(r"llama_context: n_ctx += (\d+)", text):
            out["n_ctx"] = int(m.group(1))
        if m := re.search(r"offloaded (\d+)/(\d+) layers to GPU", text):
            out["offloaded"] = [int(m.group(1)), int(m.group(2))]
        for what, pattern in LOG_LINES.items():
            if m := pattern.search(text):
                side = "gpu" if m.group(1).startswith("RPC") else "host"
                key = f"{side}_{what}_mib"
                out[key] = round(out.get(key, 0.0) + float(m.group(2)), 2)
    if out["n_ctx"] is None:
        raise RuntimeError("llama-server did not start:\n" + "".join(log[-20:]))
    return out


def launch_entries(build: Path, model: Path) -> list[dict]:
    from kvlab.plan.command import build_plan
    from kvlab.plan.report import plan_json

    entries = []
    for options in LAUNCH_PLANS:
        line = plan_json(build_plan(str(model), **options))["launch"]
        entries.append({"plan": options, "launch": line.replace(str(model), "MODEL"), "llama_server": run_launch_line(line, build)})
        print(line, entries[-1]["llama_server"], flush=True)
    return entries


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
        fixture["launch"] = launch_entries(args.build, files["smollm2-135m"])
    finally:
        server.terminate()
        server.wait()
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
