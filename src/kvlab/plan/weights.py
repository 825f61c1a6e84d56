"""Weight bytes: exact from a GGUF tensor table or safetensors headers (the model's own, or --weights-file), a
stated --weights-bytes, a GGUF quant scheme applied tensor by tensor (quants.py) where the architecture's tensors
are known, else parameters × bits.

Bits per weight of the non-GGUF formats a checkpoint may hold, scales included (AWQ/GPTQ int4 with group 128
scales and zeros, NVFP4 with its 16-value fp8 scales), and the GGUF schemes' averages for models whose tensors
kvlab cannot list (from llama.cpp's quantize table).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..sources.params import WeightTensor
from ..spec import ModelSpec
from .quants import (
    FTYPES,
    UD_BASES,
    SchemeBytes,
    canonical_scheme,
    scheme_bytes,
    unknown_scheme,
)

BITS_PER_WEIGHT: dict[str, float] = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.25, "awq": 4.25, "gptq": 4.25,
    "nvfp4": 4.5,
    # GGUF scheme averages, for architectures whose tensors are not listed
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q5_k_s": 5.54, "q5_0": 5.5, "q5_1": 6.0, "q4_k_m": 4.89,
    "q4_k_s": 4.58, "q4_0": 4.5, "q4_1": 5.0, "iq4_xs": 4.25, "iq4_nl": 4.5, "mxfp4_moe": 4.25, "q3_k_l": 4.27,
    "q3_k_m": 3.91, "q3_k_s": 3.5, "iq3_m": 3.66, "iq3_s": 3.44, "iq3_xs": 3.3, "iq3_xxs": 3.06, "q2_k": 2.96,
    "q2_k_s": 2.7, "iq2_m": 2.7, "iq2_s": 2.5, "iq2_xs": 2.31, "iq2_xxs": 2.06, "iq1_m": 1.75, "iq1_s": 1.56,
    "tq1_0": 1.69, "tq2_0": 2.06,
}
_ALIASES = {"float16": "f16", "fp16": "f16", "bfloat16": "bf16", "float32": "f32", "fp32": "f32", "fp8_e4m3": "fp8"}

@dataclass(frozen=True)
class WeightsEstimate:
    bytes: int
    formula: str
    exact: bool
    scheme: SchemeBytes | None = None   # the tensor-by-tensor split, when a GGUF scheme was applied
    known: bool = True                  # False: the architecture's parameters are unknown (bytes 0, no verdict)


def _key(quant: str) -> str:
    key = quant.strip().lower()
    return _ALIASES.get(key, key)


def check_quant(quant: str) -> str:
    """The quant's canonical name (a GGUF scheme in capitals, q4_k_m -> Q4_K_M, or a lower-case format); an unknown
    name is an error listing every known one."""
    scheme = canonical_scheme(quant)
    if scheme is not None:
        return scheme
    key = _key(quant)
    if key not in BITS_PER_WEIGHT:
        raise unknown_scheme(quant)
    return key


def weights_bytes(spec: ModelSpec, quant: str | None = None) -> WeightsEstimate:
    """Stored weights when the source knows them (and no --weights-quant overrides); else a GGUF quant scheme applied
    tensor by tensor to the architecture's tensors (spec.extra["weight_tensors"], where kvlab lists them); else
    params × the format's bits / 8."""
    if quant is None and (spec.weights_bytes or spec.extra.get("dtype") == "gguf"):
        return WeightsEstimate(spec.weights_bytes, "tensor table of the file", True)
    name = check_quant(quant or str(spec.extra.get("dtype", "bf16")))
    tensors: list[WeightTensor] = spec.extra.get("weight_tensors") or []
    if tensors and (name in FTYPES or name in UD_BASES) and name not in ("F32", "F16", "BF16"):
        attention = spec.attention_layers
        n_gqa = attention[0].n_heads // attention[0].n_kv_heads if attention and attention[0].n_kv_heads else 1
        split = scheme_bytes(name, tensors, spec.n_layers, int(spec.extra.get("n_expert", 0) or 0), n_gqa)
        types = " + ".join(f"{b / 1e9:.2f} GB {t}" for t, b in split.by_type.items() if b >= 1e7) or "tensors"
        ud = ", unsloth dynamic: estimated recipe" if name in UD_BASES else ""
        return WeightsEstimate(split.bytes, f"{name} tensor by tensor ({types}{ud})", False, split)
    if not spec.n_params:   # the KV and state still plan; the weights (and so the verdict) wait for a count
        return WeightsEstimate(0, f"unknown: kvlab cannot count the parameters of architecture {spec.arch!r}; give "
                               "--params N, --weights-bytes SIZE or --weights-file FILE", False, known=False)
    bits = BITS_PER_WEIGHT[UD_BASES.get(name, name).lower()]
    counted = " (counted from the architecture)" if spec.extra.get("n_params_source") == "architecture" else ""
    return WeightsEstimate(int(spec.n_params * bits / 8),
                           f"{spec.n_params / 1e9:.2f} B params{counted} × {bits:g} bits ({name}) / 8", False)


def file_weights(path: Path) -> int:
    """Tensor bytes of a weights file: a GGUF's tensor table, a safetensors header's tensors, else the file's size."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        from ..sources.gguf import open_gguf

        return open_gguf(path).tensor_bytes
    if path.suffix.lower() == ".safetensors":
        from ..sources.hf_folder import read_safetensors_header, safetensors_weights

        return safetensors_weights([read_safetensors_header(path)])[0]
    return path.stat().st_size
