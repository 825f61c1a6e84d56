"""KV element types and their exact storage: values are stored in blocks of `block_values`.

llama.cpp's quantized types (ggml block formats) pack 32 values with their scale(s):
  q8_0   32 int8 + f16 scale                     = 34 bytes / 32 values
  q4_0   32 4-bit + f16 scale                    = 18 bytes / 32
  q4_1   32 4-bit + f16 scale + f16 min          = 20 bytes / 32
  q5_0   32 5-bit (16 B + 4 B high bits) + scale = 22 bytes / 32
  q5_1   as q5_0 + f16 min                       = 24 bytes / 32
  iq4_nl 32 4-bit non-linear codes + f16 scale   = 18 bytes / 32
A row of n values takes n / block_values × block_bytes bytes (n must be a whole number of blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class KVType:
    """One element format: `block_bytes` bytes hold `block_values` values."""

    name: str
    block_values: int
    block_bytes: int
    ggml: bool = True         # llama.cpp can store it (fp8 is a vLLM format)
    quantized: bool = False

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_values

    def row_bytes(self, n_values: int) -> int:
        """Bytes of one row of `n_values` values (ggml_row_size)."""
        if n_values % self.block_values:
            raise ConfigError(
                f"KV type {self.name} stores blocks of {self.block_values} values; "
                f"a row of {n_values} values is not a whole number of blocks"
            )
        return n_values // self.block_values * self.block_bytes

    def formula(self) -> str:
        if self.block_values == 1:
            return f"{self.block_bytes} B"
        return f"{self.block_bytes}/{self.block_values} B"


KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", 1, 4),
        KVType("f16", 1, 2),
        KVType("bf16", 1, 2),
        KVType("fp8", 1, 1, ggml=False, quantized=True),
        KVType("q8_0", 32, 34, quantized=True),
        KVType("q4_0", 32, 18, quantized=True),
        KVType("q4_1", 32, 20, quantized=True),
        KVType("q5_0", 32, 22, quantized=True),
        KVType("q5_1", 32, 24, quantized=True),
        KVType("iq4_nl", 32, 18, quantized=True),
    )
}

_ALIASES = {"fp16": "f16", "float16": "f16", "half": "f16", "fp32": "f32", "float32": "f32", "float": "f32",
            "bfloat16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def kv_type(name: str) -> KVType:
    """Look up a KV type by name (case-insensitive; common aliases accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in KV_TYPES:
        raise ConfigError(f"unknown KV type {name!r}; choose one of: {', '.join(KV_TYPES)}")
    return KV_TYPES[key]
