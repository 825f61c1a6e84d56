"""DecoderConfig: the runnable Llama-family decoder (llama, mistral, qwen2, qwen3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int = 0               # 0: d_model // n_heads
    arch: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # llama.cpp's rope_freqs tensor (Llama 3.x GGUFs)
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qk_norm: bool = False           # qwen3: RMSNorm over each head's q and k
    qkv_bias: bool = False          # qwen2: bias on the q, k, v projections
    max_seq_len: int = 2048
    sliding_window: int | None = None
    name: str = "decoder"

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field_name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_head={self.n_heads} is not a multiple of n_kv_head={self.n_kv_heads} "
                "(each KV head must serve a whole group of query heads)"
            )
        if self.head_dim == 0:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_head={self.n_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ConfigError(f"rope_freqs has {len(self.rope_freq_factors)} factors, expected head_dim/2 = {self.head_dim // 2}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"unknown architecture {self.arch!r}; the engine runs {', '.join(SUPPORTED_ARCHS)}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 = MHA, n_heads = MQA, in between = GQA."""
        return self.n_heads // self.n_kv_heads
