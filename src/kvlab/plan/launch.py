"""The command line that reproduces a plan: every assumption the plan made, spelled as the engine's own flags.

llama.cpp (`llama-server`, flags of common/arg.cpp):
  -m FILE | -hf REPO:QUANT   the model (a GGUF path, or the Hub repo and quant tag the plan was sized for)
  -c N                       n_ctx over all sequences (llama.cpp pads it to 256 and splits it per sequence)
  -np P                      sequences; -kvu / -no-kvu: one shared KV buffer or one per sequence (llama-server
                             turns -kvu on by itself only when -np is left on auto)
  -ctk T -ctv T              the K and V cache types (f16 unless given: the default llama.cpp would pick)
  -fa on|off                 flash attention (a quantized V cache needs it)
  -ngl N                     layers on the GPU (99 = all); --n-cpu-moe N: the experts of the first N layers on the CPU
  -ub N                      the micro-batch, when not the default 512; --swa-full
  --mmproj FILE | --no-mmproj the vision projector (-hf fetches the repo's own unless told --no-mmproj)
vLLM (`vllm serve`): --max-model-len, --gpu-memory-utilization, --kv-cache-dtype, --tensor-parallel-size,
  --max-num-seqs, --max-num-batched-tokens, --block-size, and --quantization fp8 for fp8 weights of a 16-bit checkpoint.
kvlab (`kvlab serve`): --cache, --ctx with --max-seqs (the pool sized for them), --dtype, --block-size.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from ..cache import CacheSpec
from .budget import Plan
from .rules.llama_cpp import DEFAULT_N_UBATCH, LlamaCppRules

ALL_LAYERS = 99   # what llama.cpp users write for "every layer on the GPU"


def launch_line(plan: Plan) -> str:
    """The engine's command for this plan (one line, shell-quoted)."""
    words = {"llama.cpp": _llama_server, "vllm": _vllm_serve, "kvlab": _kvlab_serve}[plan.engine.name](plan)
    return " ".join(shlex.quote(str(w)) if not str(w).startswith("-") else str(w) for w in words)


def _model_ref(plan: Plan) -> str:
    return plan.model_ref or plan.spec.name


def _llama_model(plan: Plan) -> list[str]:
    source = plan.spec.source
    if source and Path(source).suffix.lower() == ".gguf":
        return ["-m", source]
    repo = plan.gguf_repo
    quant = (plan.weights_quant or "").upper()
    if repo and quant:
        return ["-hf", f"{repo}:{quant}"]
    if repo:
        return ["-hf", repo]
    stored = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(plan.spec.extra.get("dtype")), "BF16")
    return ["-m", f"{plan.spec.name}-{quant or stored}.gguf"]


def _llama_server(plan: Plan) -> list[str]:
    s, engine = plan.settings, plan.engine
    assert isinstance(engine, LlamaCppRules)
    n_ctx, _, _, _ = engine.contexts(s)
    type_k, type_v = engine.types(s)
    words = ["llama-server", *_llama_model(plan), "-c", n_ctx, "-np", s.parallel]
    if s.parallel > 1:
        words.append("-kvu" if s.kv_unified else "-no-kvu")
    words += ["-ctk", type_k.name, "-ctv", type_v.name, "-fa", "on" if s.flash_attn else "off"]
    gpu_layers = plan.offload.gpu_layers if plan.offload else None
    if gpu_layers is None or gpu_layers > plan.spec.n_layers:    # every layer, and the output layer
        gpu_layers = ALL_LAYERS if plan.spec.n_layers < ALL_LAYERS else plan.spec.n_layers + 1
    words += ["-ngl", gpu_layers]
    if plan.offload and plan.offload.cpu_moe_layers >= plan.spec.n_layers:
        words.append("--cpu-moe")
    elif plan.offload and plan.offload.cpu_moe_layers:
        words += ["--n-cpu-moe", plan.offload.cpu_moe_layers]
    if s.ubatch and s.ubatch != DEFAULT_N_UBATCH:
        words += ["-ub", s.ubatch]
    if s.swa_full:
        words.append("--swa-full")
    from_hub = words[1] == "-hf"
    if plan.mmproj and (plan.mmproj.file or not from_hub):
        words += ["--mmproj", plan.mmproj.file or "mmproj.gguf"]
    elif from_hub and not plan.mmproj:
        words.append("--no-mmproj")   # -hf fetches the repo's projector by default: a text-only plan says no
    return words


_VLLM_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def _vllm_serve(plan: Plan) -> list[str]:
    s, spec = plan.settings, plan.spec
    model_dtype = plan.engine.kv_dtype(spec, replace(s, kv_type_k=None, kv_type_v=None)).name   # what "auto" means here
    kv = plan.layout.kv_type_k
    words = ["vllm", "serve", _model_ref(plan), "--max-model-len", s.context, "--max-num-seqs", s.parallel,
             "--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
    if kv == model_dtype or kv != "fp8":   # a 16/32-bit cache is the model's dtype: vLLM sets it with --dtype
        words += (["--dtype", _VLLM_DTYPES[kv]] if kv != model_dtype else []) + ["--kv-cache-dtype", "auto"]
    else:
        words += ["--kv-cache-dtype", "fp8"]
    if s.tp > 1:
        words += ["--tensor-parallel-size", s.tp]
    if s.ubatch:
        words += ["--max-num-batched-tokens", s.ubatch]
    if s.block_size != 16:
        words += ["--block-size", s.block_size]
    if (plan.weights_quant or "").lower() == "fp8" and model_dtype in ("bf16", "f16"):
        words += ["--quantization", "fp8"]
    return words


def _kvlab_serve(plan: Plan) -> list[str]:
    s = plan.settings
    cache, dtype = CacheSpec.parse_with_dtype(plan.layout.kv_type_k)   # the layout's label: tq4@float32, dense@float16
    if cache.base == "dense" and not cache.storage and dtype != "float32":
        cache = CacheSpec("dense", dtype)     # dense@f16 serves as the block format dense-f16
    words = ["kvlab", "serve"]
    if plan.model_ref and Path(plan.model_ref).expanduser().exists():
        words.append(plan.model_ref)
    elif plan.model_ref:
        words.append(f"PATH/TO/{plan.spec.name}")   # kvlab serves local files: the folder or GGUF of this model
    words += ["--cache", cache.label, "--ctx", s.context, "--max-seqs", s.parallel]
    if (plan.weights_quant or "").lower() in ("bf16", "bfloat16"):
        words += ["--dtype", "bf16"]
    if s.block_size != 16:
        words += ["--block-size", s.block_size]
    return words
