"""PlanSettings: how the model will be run (context, KV types, sequences, batch, parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class PlanSettings:
    """One serving configuration. `context` is tokens per sequence; `parallel` sequences at once.

    kv_type_k / kv_type_v: None means the engine's default (llama.cpp f16, vLLM the model dtype,
    kvlab its dense cache). ubatch: None means the engine's default (llama.cpp 512, vLLM's
    max_num_batched_tokens 8192). n_ctx_total overrides llama.cpp's `-c` (default context × parallel).
    """

    context: int = 4096
    kv_type_k: str | None = None
    kv_type_v: str | None = None
    flash_attn: bool = True
    parallel: int = 1
    ubatch: int | None = None
    tp: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    n_ctx_total: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        for name, flag in (("context", "--ctx"), ("parallel", "--parallel"), ("tp", "--tp"), ("block_size", "block size")):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.ubatch is not None and self.ubatch <= 0:
            raise ConfigError(f"--ubatch must be a positive integer, got {self.ubatch!r}")
        if self.n_ctx_total is not None and self.n_ctx_total <= 0:
            raise ConfigError(f"n_ctx must be positive, got {self.n_ctx_total!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
