"""Weight bytes: exact from a GGUF tensor table or safetensors headers, else parameters × bits.

Bits per weight of llama.cpp / common quant formats, scales included (averages for the K-quant
mixes, from llama.cpp's quantize table; AWQ/GPTQ int4 with group 128 scales and zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..spec import ModelSpec

BITS_PER_WEIGHT: dict[str, float] = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "fp8": 8.0, "int8": 8.0,
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q5_k_s": 5.54, "q5_0": 5.5, "q5_1": 6.0,
    "q4_k_m": 4.89, "q4_k_s": 4.58, "q4_0": 4.5, "q4_1": 5.0, "iq4_xs": 4.25, "iq4_nl": 4.5, "mxfp4": 4.25,
    "q3_k_m": 3.91, "q3_k_s": 3.5, "iq3_xxs": 3.06, "q2_k": 2.96, "iq2_xxs": 2.06,
    "int4": 4.25, "awq": 4.25, "gptq": 4.25, "nvfp4": 4.5,
}
_ALIASES = {"float16": "f16", "fp16": "f16", "bfloat16": "bf16", "float32": "f32", "fp32": "f32", "q4_k": "q4_k_m",
            "q5_k": "q5_k_m", "q3_k": "q3_k_m", "ud-q4_k_xl": "q4_k_m"}


@dataclass(frozen=True)
class WeightsEstimate:
    bytes: int
    formula: str
    exact: bool


def weights_bytes(spec: ModelSpec, quant: str | None = None) -> WeightsEstimate:
    """Stored weights when the source knows them (and no --weights-quant overrides), else params × bits / 8."""
    if quant is None and (spec.weights_bytes or spec.extra.get("dtype") == "gguf"):
        return WeightsEstimate(spec.weights_bytes, "tensor table of the file", True)
    key = (quant or str(spec.extra.get("dtype", "bf16"))).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in BITS_PER_WEIGHT:
        raise ConfigError(f"unknown --weights-quant {quant!r}; choose one of: {', '.join(BITS_PER_WEIGHT)}")
    if not spec.n_params:
        raise ConfigError(f"{spec.name}: parameter count unknown for architecture {spec.arch!r}, so weights cannot be "
                          "estimated; give a GGUF or safetensors")
    bits = BITS_PER_WEIGHT[key]
    counted = " (counted from the architecture)" if spec.extra.get("n_params_source") == "architecture" else ""
    return WeightsEstimate(int(spec.n_params * bits / 8),
                           f"{spec.n_params / 1e9:.2f} B params{counted} × {bits:g} bits ({key}) / 8", False)
