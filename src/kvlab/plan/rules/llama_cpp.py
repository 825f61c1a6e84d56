"""llama.cpp's allocation rules, as of ggml-org/llama.cpp@0c1e57098 (vendored by llama-cpp-python 0.3.36).

Sources read (src/): llama-context.cpp (n_ctx, n_ctx_seq, n_batch/n_ubatch, output buffer),
llama-kv-cache.cpp (one K and one V tensor per layer: row size × cells × streams),
llama-kv-cache-iswa.cpp (the sliding-window cache), llama-memory-recurrent.cpp (R and S state in f32),
llama-model.cpp create_memory (which cache each architecture gets).

Rules
- n_ctx = pad(-c, 256). Unified cache: one stream of n_ctx cells. Otherwise each of n_seq_max
  streams gets n_ctx_seq = pad(n_ctx / n_seq_max, 256) cells.
- K row = ggml_row_size(type_k, n_kv_heads × head_dim_k); V row likewise. Without flash attention
  V is stored transposed and, when V widths differ between layers, every layer's V row is padded to
  the widest. MLA layers store K only (latent + RoPE key) and need type_k == type_v.
- Sliding-window layers live in a second cache of pad(min(n_ctx_seq, window × (n_seq if unified
  else 1) + n_ubatch), 256) cells, unless swa_full. Llama 4's chunked layers are sliding layers of a
  window llama.cpp fixes at 8,192 (models/llama4.cpp), whatever attention_chunk_size says.
- Recurrent layers keep (n_embd_r + n_embd_s) f32 values per layer for max(1, n_seq_max) sequences.
- A quantized V cache requires flash attention; with flash attention a quantized K (V) type's block (32
  values) must divide the K (V) head dims.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...sources.layers import FIXED_WINDOWS
from ...sources.hf_folder import LLAMA4_TYPES
from ...spec import ModelSpec
from ..components import Component
from ..kv_types import KVType, kv_type
from ..layout import KVLayout, LayerBytes
from ..settings import PlanSettings
from .base import RuleSet, MiB, pad

CELL_PAD = 256          # n_ctx and SWA cells are padded to 256
DEFAULT_N_BATCH = 2048
DEFAULT_N_UBATCH = 512
RECURRENT_BYTES = 4     # R and S tensors are f32
#: architectures (HF model types and GGUF names) whose llama.cpp loader reads no sliding window: their sliding layers
#: (Mistral 7B v0.1's 4,096 window, Qwen2's use_sliding_window) get full caches, as kvlab's GGUF reader plans them
NO_SWA_ARCHS = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3moe", "mistral3",
                "deepseek2", "deepseek_v2", "deepseek_v3", "phi3"}
#: the sliding window llama.cpp's loader fixes per architecture (by HF model type and GGUF name)
FIXED_WINDOW_ARCHS = {**FIXED_WINDOWS, **{t: FIXED_WINDOWS["llama4"] for t in LLAMA4_TYPES}}
GPU_RUNTIME_BYTES = 400 * MiB   # CUDA context + cuBLAS workspace: typical, driver-dependent (estimate)


class LlamaCppRules(RuleSet):
    name = "llama.cpp"
    version = "llama.cpp 0c1e57098 (llama-cpp-python 0.3.36)"
    max_parallel = 256   # LLAMA_MAX_SEQ
    default_headroom = 1024 * MiB   # llama.cpp's --fit keeps --fit-target 1024 MiB free per device
    headroom_reason = "1 GiB, the margin llama.cpp's --fit keeps free per device (--fit-target 1024)"

    # -- sizes -------------------------------------------------------------------------------------
    def types(self, settings: PlanSettings) -> tuple[KVType, KVType]:
        k = kv_type(settings.kv_type_k or "f16")
        v = kv_type(settings.kv_type_v or "f16")  # K and V are independent in llama.cpp (-ctk / -ctv)
        for t in (k, v):
            if not t.ggml:
                raise ConfigError(f"llama.cpp has no {t.name} KV cache; use f16, bf16, f32, q8_0, q4_0, q4_1, q5_0, q5_1 or iq4_nl")
        if v.quantized and not settings.flash_attn:
            raise ConfigError(f"llama.cpp needs flash attention for a quantized V cache ({v.name}); drop --no-flash-attn")
        return k, v

    def contexts(self, settings: PlanSettings) -> tuple[int, int, int, int]:
        """(n_ctx, cells per stream, streams, n_ubatch) as llama_context computes them."""
        n_seq = settings.parallel
        requested = settings.n_ctx_total or settings.context * n_seq
        n_ctx = pad(requested, CELL_PAD)
        if settings.kv_unified or n_seq == 1:
            cells, streams = n_ctx, 1
        else:
            cells, streams = pad(n_ctx // n_seq, CELL_PAD), n_seq
            n_ctx = cells * n_seq   # llama.cpp rounds n_ctx to whole per-sequence caches
        n_batch = min(requested, DEFAULT_N_BATCH)
        n_ubatch = min(n_batch, settings.ubatch or DEFAULT_N_UBATCH)
        return n_ctx, cells, streams, n_ubatch

    def swa_cells(self, window: int, cells: int, settings: PlanSettings, n_ubatch: int) -> int:
        if settings.swa_full:
            return cells
        seqs = settings.parallel if settings.kv_unified else 1
        return pad(min(cells, window * seqs + n_ubatch), CELL_PAD)

    @staticmethod
    def check_head_blocks(spec: ModelSpec, settings: PlanSettings, type_k: KVType, type_v: KVType) -> None:
        """llama_init_from_model: with flash attention a quantized K (V) type's block must divide every head's K (V) dims."""
        if not settings.flash_attn:
            return
        for part, kv in (("K", type_k), ("V", type_v)):
            if kv.block_values == 1:
                continue
            for layer in spec.attention_layers:
                dims = (layer.k_elements_per_token if layer.kind == "mla" else layer.head_dim_k) if part == "K" else layer.head_dim_v
                if dims and dims % kv.block_values:
                    raise ConfigError(f"llama.cpp's {kv.name} {part} cache stores blocks of {kv.block_values} values, which does not "
                                      f"divide the {dims}-value heads of {spec.name}; use f16, bf16 or f32 for {part}")

    def layout(self, spec: ModelSpec, settings: PlanSettings) -> KVLayout:
        type_k, type_v = self.types(settings)
        if any(layer.kind == "mla" for layer in spec.layers) and type_k != type_v:
            raise ConfigError(f"llama.cpp's MLA cache needs one type for K and V, got {type_k.name} and {type_v.name}")
        self.check_head_blocks(spec, settings, type_k, type_v)
        _, cells, streams, n_ubatch = self.contexts(settings)
        attention = [layer for layer in spec.layers if layer.kind in ("full", "sliding")]
        widest_v = max((layer.v_elements_per_token for layer in attention), default=0)
        variable_v = len({layer.v_elements_per_token for layer in attention}) > 1
        rows = []
        per_token = sliding_per_token = 0
        ignores_window = spec.arch in NO_SWA_ARCHS
        fixed_window = FIXED_WINDOW_ARCHS.get(spec.arch)
        for i, layer in enumerate(spec.layers):
            kind = "full" if layer.kind == "sliding" and ignores_window else layer.kind
            if kind in ("full", "sliding", "mla"):
                k_row = type_k.row_bytes(layer.k_elements_per_token)
                v_elems = widest_v if (variable_v and not settings.flash_attn and kind != "mla") else layer.v_elements_per_token
                v_row = type_v.row_bytes(v_elems) if v_elems else 0
                window = fixed_window or layer.window
                layer_cells = self.swa_cells(window, cells, settings, n_ubatch) if kind == "sliding" else cells
                rows.append(LayerBytes(i, kind, layer_cells * streams, k_row, v_row))
                if kind == "sliding":
                    sliding_per_token += k_row + v_row
                else:
                    per_token += k_row + v_row
            elif layer.kind == "recurrent":
                state = layer.state_elements * RECURRENT_BYTES * max(1, settings.parallel)
                rows.append(LayerBytes(i, layer.kind, state_bytes=state))
            else:
                rows.append(LayerBytes(i, layer.kind))
        notes = []
        if ignores_window and any(layer.kind == "sliding" for layer in spec.layers):
            notes.append(f"llama.cpp reads no sliding window for {spec.arch}: its sliding layers get full caches")
        elif any(layer.kind == "sliding" for layer in spec.layers) and not settings.swa_full:
            notes.append("sliding-window layers keep pad(window + ubatch, 256) cells")
        if fixed_window and any(layer.kind == "sliding" and layer.window != fixed_window for layer in spec.layers):
            notes.append(f"llama.cpp chunks {spec.arch}'s attention at {fixed_window:,} tokens whatever the model's chunk size")
        return KVLayout(self.name, tuple(rows), per_token, type_k.name, type_v.name, tuple(notes), sliding_per_token)

    # -- the rest of the budget ---------------------------------------------------------------------
    def compute_buffer(self, spec: ModelSpec, settings: PlanSettings, logits: bool = True) -> Component:
        """A compute buffer as llama-server reserves it: the graph of a full ubatch with one output per sequence
        (server_output_limits: n_outputs_max = n_parallel). ggml-alloc reuses memory, so the largest phase counts
        (logits, feed-forward, attention scores without flash attention), plus what lives through the whole graph:
        the residual stream and the input embeddings (4 × ubatch × n_embd f32) and the KQ masks (a cell × token
        mask per cache, f16 under flash attention, f32 without). `logits`: the output layer runs on this device."""
        _, cells, streams, n_ubatch = self.contexts(settings)
        n_embd, n_vocab = spec.d_model, spec.vocab_size
        n_head = max((layer.n_heads for layer in spec.attention_layers), default=0)
        n_ff = int(spec.extra.get("n_ff", 0) or 0)
        outputs = min(settings.parallel, n_ubatch)
        mask_cells = 0
        if any(layer.kind in ("full", "mla") for layer in spec.layers):
            mask_cells += cells * streams
        window = max((layer.window or 0 for layer in spec.layers if layer.kind == "sliding"), default=0)
        if window:
            mask_cells += self.swa_cells(FIXED_WINDOW_ARCHS.get(spec.arch, window), cells, settings, n_ubatch) * streams
        mask_value = 2 if settings.flash_attn else 4
        phases = {"logits": n_vocab * outputs * 4 if logits else 0, "ffn": 3 * n_ubatch * n_ff * 4,
                  "scores": 0 if settings.flash_attn else n_head * n_ubatch * cells * 4}
        terms = ([f"logits {n_vocab}×{outputs}×4"] if logits else []) + [f"ffn 3×{n_ubatch}×{n_ff}×4"] + \
            ([] if settings.flash_attn else [f"scores {n_head}×{n_ubatch}×{cells}×4"])
        steady = 4 * n_ubatch * n_embd * 4 + mask_cells * n_ubatch * mask_value
        return Component("compute buffer", f"max({', '.join(terms)}) + 4×{n_ubatch}×{n_embd}×4 + masks {mask_cells}×{n_ubatch}×"
                         f"{mask_value}", steady + max(phases.values()), exact=False)

    def overheads(self, spec: ModelSpec, settings: PlanSettings, layout: KVLayout) -> list[Component]:
        n_vocab = spec.vocab_size
        output = n_vocab * settings.parallel * 4
        return [
            self.compute_buffer(spec, settings),
            Component("output buffer", f"{n_vocab} vocab × {settings.parallel} seq × 4 B", output, exact=False),
            Component("CUDA runtime", "CUDA context + cuBLAS workspace (typical)", GPU_RUNTIME_BYTES, exact=False),
        ]
