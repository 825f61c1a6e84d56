"""Weight bytes of a GGUF quant *scheme*, tensor by tensor: which ggml type llama-quantize gives each tensor.

A scheme name (Q4_K_M, IQ3_XXS, MXFP4_MOE, unsloth's UD-Q4_K_XL ...) is not one bit width: llama.cpp's
`llama_tensor_get_type` (src/llama-quant.cpp) upgrades some tensors (the output matrix to Q6_K, half of the
attn_v and ffn_down matrices to Q6_K in Q4_K_M, the V projection of 8-expert MoEs to Q8_0, ...), keeps norms,
biases, routers and convolutions in F32, and falls back to a legacy type when a row is not a whole number of
256-value super-blocks. The bytes of each tensor are then ggml_row_size(type, row) × rows, as in the file.

unsloth's dynamic quants (UD-*) are per-model recipes published only as files. kvlab models them as the
llama.cpp scheme of the same name with the tensors unsloth keeps at higher precision raised (see UD_RAISES):
the token embedding and output at Q6_K (Q8_0 from Q5_K_XL up) and the softmax-attention projections one step up.
That recipe is calibrated against published UD files (unsloth/Qwen3.5-9B-GGUF UD-Q4_K_XL: 5.97 GB), so it is
an estimate; a GGUF on disk (`kvlab plan FILE.gguf`) or `--weights-file` / `--weights-bytes` is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..sources.params import WeightTensor

#: ggml types: (values per block, bytes per block), from ggml's type traits (ggml.c)
GGML_TYPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18), "MXFP4": (32, 17),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ4_XS": (256, 136), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
}

#: llama.cpp file types (llama-quantize's names) -> the default type of their quantized tensors
FTYPES: dict[str, str] = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS",
    "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0", "MXFP4_MOE": "MXFP4",
}
#: unsloth's dynamic quants: the llama.cpp scheme each one starts from
UD_BASES: dict[str, str] = {
    "UD-IQ1_S": "IQ1_S", "UD-IQ1_M": "IQ1_M", "UD-IQ2_XXS": "IQ2_XXS", "UD-IQ2_M": "IQ2_M", "UD-IQ3_XXS": "IQ3_XXS",
    "UD-Q2_K_XL": "Q2_K", "UD-Q3_K_XL": "Q3_K_M", "UD-Q4_K_XL": "Q4_K_M", "UD-Q5_K_XL": "Q5_K_M",
    "UD-Q6_K_XL": "Q6_K", "UD-Q8_K_XL": "Q8_0",
}
#: one step up the K-quant ladder (what a UD recipe gives the tensors it protects)
_STEP_UP = {"IQ1_S": "IQ2_XXS", "IQ1_M": "IQ2_XXS", "IQ2_XXS": "IQ3_XXS", "IQ2_XS": "IQ3_XXS", "IQ2_S": "IQ3_S",
            "IQ3_XXS": "Q4_K", "IQ3_S": "Q4_K", "Q2_K": "Q4_K", "Q3_K": "Q5_K", "Q4_K": "Q6_K", "Q5_K": "Q8_0",
            "Q6_K": "Q8_0", "Q8_0": "BF16", "IQ4_XS": "Q6_K", "IQ4_NL": "Q6_K", "Q4_0": "Q6_K", "Q5_0": "Q8_0"}
#: tensors a UD recipe raises one step: the softmax-attention projections (small, quality-critical)
UD_RAISES = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_kv_b")

#: tensors llama.cpp never quantizes (kept F32 by convert_hf_to_gguf and skipped by llama-quantize)
_KEPT_F32 = ("ffn_gate_inp", "ssm_conv1d", "ssm_a", "ssm_d", "ssm_dt", "ssm_x", "exp_probs_b", "attn_sinks")
#: a legacy type for rows that are not whole 256-value super-blocks (llama-quant.cpp's fallback)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_FALLBACK_NL = {"Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}

_ALIASES = {"FLOAT16": "F16", "FP16": "F16", "BFLOAT16": "BF16", "FLOAT32": "F32", "FP32": "F32", "Q4_K": "Q4_K_M",
            "Q5_K": "Q5_K_M", "Q3_K": "Q3_K_M", "MXFP4": "MXFP4_MOE"}


def scheme_names() -> list[str]:
    return [*FTYPES, *UD_BASES]


def canonical_scheme(name: str) -> str | None:
    """Q4_K_M for 'q4_k_m', UD-Q4_K_XL for 'ud-q4_k_xl' or 'UD_Q4_K_XL'; None when it is no GGUF scheme."""
    key = name.strip().upper().replace(" ", "")
    key = "UD-" + key[3:] if key.startswith("UD_") else key
    key = _ALIASES.get(key, key)
    return key if key in FTYPES or key in UD_BASES else None


def row_bytes(ggml_type: str, n: int) -> int:
    values, size = GGML_TYPES[ggml_type]
    return n // values * size


@dataclass
class _Counters:
    """What llama-quantize counts while it walks the tensors (attn_v tensors seen so far, and how many in all)."""

    n_attention_wv: int
    tied: bool                      # no output tensor: token_embd is quantized by the output's rule
    i_attention_wv: int = 0


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's pattern for the layers that get more bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_quant_type(ftype: str, default: str, t: WeightTensor, n_layer: int, n_expert: int, n_gqa: int,
                  counters: _Counters) -> str:
    """llama_tensor_get_type for the K-quant and legacy schemes (the IQ schemes keep their default, except output)."""
    role = "output" if t.role == "token_embd" and counters.tied else t.role   # a tied embedding is the output too
    i = t.layer or 0
    if role == "output":
        return "Q8_0" if ftype == "MXFP4_MOE" or default == "Q8_0" else "Q6_K"
    if role == "token_embd":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if ftype in ("TQ1_0", "TQ2_0"):
            return "Q4_K"
        return "Q8_0" if ftype == "MXFP4_MOE" else default
    if ftype == "MXFP4_MOE":
        return "MXFP4" if t.is_expert else "Q8_0"
    if role == "attn_v":
        j = counters.i_attention_wv
        counters.i_attention_wv += 1
        if n_expert == 8:
            return "Q8_0"
        if ftype == "Q2_K":
            return "Q4_K" if n_gqa >= 4 else "Q3_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if j < 2 else "Q4_K"
        if ftype == "Q3_K_L":
            return "Q5_K"
        if ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(j, counters.n_attention_wv):
            return "Q6_K"
        if ftype == "Q4_K_S" and j < 4:
            return "Q5_K"
        if ftype in ("IQ3_XXS", "IQ2_S", "IQ2_M") and n_gqa >= 4:
            return "Q4_K" if ftype != "IQ3_XXS" else "IQ3_S"
        return default
    if role == "attn_k" and n_expert == 8:
        return "Q8_0"
    if role in ("ffn_down", "ffn_down_exps"):
        if ftype == "Q2_K":
            return "Q3_K"
        if ftype == "Q2_K_S" and i < n_layer // 8:
            return "Q4_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if i < n_layer // 16 else "Q4_K"
        if ftype == "Q3_K_L":
            return "Q5_K"
        if ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n_layer):
            return "Q6_K"
        if ftype == "Q4_K_S" and i < n_layer // 8:
            return "Q5_K"
        return default
    if role == "attn_output":
        if n_expert == 8 and ftype in ("Q2_K", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S", "IQ3_M"):
            return "Q5_K"
        if n_expert != 8:
            return {"Q2_K": "Q3_K", "IQ3_M": "Q4_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, default)
        return default
    if role == "attn_qkv":
        return {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(ftype, default)
    return default


def tensor_type(scheme: str, t: WeightTensor, n_layer: int, n_expert: int, n_gqa: int, counters: _Counters) -> str:
    """The ggml type `scheme` stores tensor `t` in."""
    ud = scheme in UD_BASES
    ftype = UD_BASES.get(scheme, scheme)
    default = FTYPES[ftype]
    if len(t.shape) == 1 or t.role.endswith("_norm") or t.role.endswith(".bias") or t.role in _KEPT_F32:
        return "F32"
    if default in ("F32", "F16", "BF16"):
        return default
    chosen = _k_quant_type(ftype, default, t, n_layer, n_expert, n_gqa, counters)
    if ud:
        if t.role in ("token_embd", "output"):
            chosen = "Q8_0" if ftype in ("Q5_K_M", "Q6_K", "Q8_0") else "Q6_K"
        elif t.role in UD_RAISES:
            chosen = _STEP_UP.get(chosen, chosen)
    row = t.shape[-1]
    values = GGML_TYPES[chosen][0]
    if row % values:
        chosen = "IQ4_NL" if chosen in _FALLBACK_NL else _FALLBACK.get(chosen, chosen)
        if row % GGML_TYPES[chosen][0]:
            chosen = "F16"
    return chosen


@dataclass(frozen=True)
class SchemeBytes:
    scheme: str
    bytes: int
    by_type: dict[str, int]            # ggml type -> bytes
    layer_bytes: tuple[int, ...]       # bytes of each block (what -ngl moves)
    layer_expert_bytes: tuple[int, ...]  # of which its routed experts (what --n-cpu-moe moves to the host)
    embedding_bytes: int               # token_embd
    output_bytes: int                  # output + output_norm
    tied: bool = False                 # no output tensor: token_embd is the output matrix too


def scheme_bytes(scheme: str, tensors: list[WeightTensor], n_layer: int, n_expert: int = 0, n_gqa: int = 1) -> SchemeBytes:
    """The bytes of every tensor in `scheme`'s types, summed (and split by type, by block, experts apart)."""
    counters = _Counters(n_attention_wv=sum(1 for t in tensors if t.role in ("attn_v", "attn_qkv", "attn_kv_b")),
                         tied=not any(t.role == "output" for t in tensors))
    by_type: dict[str, int] = {}
    layers, experts = [0] * n_layer, [0] * n_layer
    embedding = output = 0
    for t in tensors:
        kind = tensor_type(scheme, t, n_layer, n_expert, n_gqa, counters)
        nbytes = row_bytes(kind, t.shape[-1]) * (t.numel // t.shape[-1])
        by_type[kind] = by_type.get(kind, 0) + nbytes
        if t.layer is not None:
            layers[t.layer] += nbytes
            experts[t.layer] += nbytes if t.is_expert else 0
        elif t.role == "token_embd":
            embedding += nbytes
        else:
            output += nbytes
    return SchemeBytes(scheme, sum(by_type.values()), dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
                       tuple(layers), tuple(experts), embedding, output, counters.tied)


def unknown_scheme(name: str) -> ConfigError:
    return ConfigError(f"unknown --weights-quant {name!r}; GGUF schemes: {', '.join(scheme_names())}; "
                       "or fp8, int8, int4, awq, gptq, nvfp4 for safetensors checkpoints")
