"""vLLM's (v1 engine) allocation rules, as of vllm-project/vllm@001cabc1 (vllm/v1/kv_cache_interface.py).

- KV lives in blocks of `block_size` tokens (default 16). One block of a layer holds
  full / sliding attention:  block_size × kv_heads × (head_dim_k + head_dim_v) × dtype bytes
  MLA:                       block_size × (kv_lora_rank + rope_dim) × dtype bytes  (K only)
- A request of C tokens needs per layer cdiv(C, block) blocks (full, MLA) or
  cdiv(min(window - 1 + max_num_batched_tokens, C), block) + 1 blocks (sliding window);
  a Mamba / linear-attention layer needs one state page per request (conv + SSM state in the model's dtype,
  whatever --kv-cache-dtype says: mamba_ssm_cache_dtype defaults to the model's).
- Tensor parallelism splits KV heads: max(1, kv_heads / tp) per GPU (replicated when tp > kv_heads);
  the MLA latent is replicated on every GPU; recurrent state is split.
- vLLM takes gpu_memory_utilization × total VRAM; what weights, activations and the CUDA runtime
  leave of it becomes the KV pool; max concurrency = pool / one request's blocks.
KV dtypes: auto (the model's dtype), float16, bfloat16, float32, fp8.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...spec import ModelSpec
from ..components import Component
from ..kv_types import KVType, kv_type
from ..layout import KVLayout, LayerBytes
from ..settings import PlanSettings
from .base import GiB, RuleSet, cdiv

DEFAULT_MAX_BATCHED_TOKENS = 8192
RUNTIME_BYTES = GiB // 2      # CUDA context, NCCL, CUDA graphs: typical (estimate)
_VLLM_TYPES = ("f32", "f16", "bf16", "fp8")


def _model_dtype(spec: ModelSpec) -> str:
    dtype = str(spec.extra.get("dtype", "bfloat16")).lower()
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype, "bf16" if dtype != "gguf" else "f16")


class VllmRules(RuleSet):
    name = "vllm"
    version = "vLLM v1 @ 001cabc1 (kv_cache_interface.py)"
    headroom_reason = "none beyond --gpu-memory-utilization 0.9, which already leaves 10% of the card to others"

    def kv_dtype(self, spec: ModelSpec, settings: PlanSettings) -> KVType:
        # vLLM has one kv_cache_dtype: a type given for K alone or V alone is that dtype, for both
        name_k = settings.kv_type_k or settings.kv_type_v or "auto"
        name_v = settings.kv_type_v or settings.kv_type_k or "auto"
        if name_k != name_v:
            raise ConfigError(f"vLLM uses one KV cache dtype, got K={name_k} V={name_v}")
        t = kv_type(_model_dtype(spec) if name_k.lower() == "auto" else name_k)
        if t.name not in _VLLM_TYPES:
            raise ConfigError(f"vLLM has no {t.name} KV cache; choose auto, f16, bf16, f32 or fp8")
        return t

    def max_batched(self, settings: PlanSettings) -> int:
        return settings.ubatch or DEFAULT_MAX_BATCHED_TOKENS

    def layout(self, spec: ModelSpec, settings: PlanSettings) -> KVLayout:
        t = self.kv_dtype(spec, settings)
        size, block, tp, n_seq = t.block_bytes, settings.block_size, settings.tp, settings.parallel
        state_size = kv_type(_model_dtype(spec)).block_bytes
        blocks_full = cdiv(settings.context, block)
        rows, per_token, sliding_per_token = [], 0, 0
        for i, layer in enumerate(spec.layers):
            if layer.kind in ("full", "sliding"):
                heads = max(1, cdiv(layer.n_kv_heads, tp))
                blocks = blocks_full
                if layer.kind == "sliding":
                    blocks = cdiv(min(layer.window - 1 + self.max_batched(settings), settings.context), block) + 1
                k_row, v_row = heads * layer.head_dim_k * size, heads * layer.head_dim_v * size
                rows.append(LayerBytes(i, layer.kind, blocks * block * n_seq, k_row, v_row))
                if layer.kind == "sliding":
                    sliding_per_token += k_row + v_row
                else:
                    per_token += k_row + v_row
            elif layer.kind == "mla":
                k_row = (layer.kv_lora_rank + layer.rope_dim) * size
                rows.append(LayerBytes(i, layer.kind, blocks_full * block * n_seq, k_row, 0))
                per_token += k_row
            elif layer.kind == "recurrent":   # conv + SSM state in the model's dtype (mamba_ssm_cache_dtype auto), not the KV's
                rows.append(LayerBytes(i, layer.kind, state_bytes=cdiv(layer.state_elements, tp) * state_size * n_seq))
            else:
                rows.append(LayerBytes(i, layer.kind))
        notes = [f"blocks of {block} tokens; per GPU with --tp {tp}"] if tp > 1 else [f"blocks of {block} tokens"]
        return KVLayout(self.name, tuple(rows), per_token, t.name, t.name, tuple(notes), sliding_per_token)

    def overheads(self, spec: ModelSpec, settings: PlanSettings, layout: KVLayout) -> list[Component]:
        tokens = self.max_batched(settings)
        n_ff = int(spec.extra.get("n_ff", 0) or 0)
        hidden = spec.d_model
        # profiling run: a batch of max_num_batched_tokens through one layer plus the sampler's logits
        activations = tokens * (4 * hidden + 2 * n_ff // settings.tp) * 2 + 256 * spec.vocab_size * 4
        return [
            Component("activations (profile peak)", f"{tokens}×(4×{hidden} + 2×{n_ff}/{settings.tp})×2 + 256×{spec.vocab_size}×4",
                      activations, exact=False, per_gpu=True),
            Component("CUDA runtime", "CUDA context, NCCL, CUDA graphs (typical)", RUNTIME_BYTES, exact=False, per_gpu=True),
        ]

    def budget_bytes(self, vram_bytes: int, usable_bytes: int, settings: PlanSettings) -> int:
        return min(usable_bytes, int(vram_bytes * settings.gpu_memory_utilization))
