"""DecoderConfig: the runnable Llama-family decoder (llama, mistral, qwen2, qwen3)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UnsupportedArchitectureError
from ..spec import RopeScaling, ModelSpec

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

__all__ = ["SUPPORTED_ARCHS", "RopeScaling", "DecoderConfig", "decoder_config"]


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


def require_runnable(arch: str, source: str) -> None:
    """UnsupportedArchitectureError unless the engine runs `arch` (checked before anything else is parsed)."""
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {arch!r} cannot be run by the engine (it runs {', '.join(SUPPORTED_ARCHS)}); "
            "`kvlab plan` still plans it"
        )


def decoder_config(spec: ModelSpec) -> DecoderConfig:
    """The runnable decoder a ModelSpec (with its EngineFacts, from sources/) describes, or a one-line error
    saying what the engine cannot run. This is the only way from a model file to a DecoderConfig."""
    source = spec.source or spec.name
    require_runnable(spec.arch, source)
    facts = spec.engine
    if facts is None or facts.format not in ("gguf", "safetensors"):
        raise ConfigError(f"{source}: no weights known for {spec.name!r}; the engine runs a GGUF file or a folder with safetensors")
    first = spec.layers[0]
    shapes = {(l.kind, l.n_heads, l.n_kv_heads, l.head_dim_k, l.head_dim_v, l.window) for l in spec.layers}
    if len(shapes) != 1 or first.kind not in ("full", "sliding"):
        raise UnsupportedArchitectureError(
            f"{source}: layers differ in kind, head counts, head dims or window; the engine runs identical "
            "full or sliding-window attention layers (`kvlab plan` plans the others)"
        )
    if first.head_dim_k != first.head_dim_v:
        raise UnsupportedArchitectureError(f"{source}: key head dim {first.head_dim_k} differs from value head dim {first.head_dim_v}")
    if isinstance(facts.d_ff, tuple):
        raise UnsupportedArchitectureError(f"{source}: per-layer feed-forward widths cannot be run by the engine")
    if facts.rope_scaling_type is not None:
        raise UnsupportedArchitectureError(f"{source}: RoPE scaling {facts.rope_scaling_type!r} cannot be run by the engine")
    if facts.rope_dim and facts.rope_dim != first.head_dim_k:
        raise UnsupportedArchitectureError(
            f"{source}: RoPE over {facts.rope_dim} of {first.head_dim_k} head dims (partial rotary) cannot be run by the engine")
    if spec.d_model <= 0 or spec.vocab_size <= 0:
        raise ConfigError(f"{source}: embedding length {spec.d_model} and vocabulary {spec.vocab_size} must be positive")
    try:
        return DecoderConfig(
            arch=spec.arch,
            vocab_size=spec.vocab_size,
            d_model=spec.d_model,
            n_layers=spec.n_layers,
            n_heads=first.n_heads,
            n_kv_heads=first.n_kv_heads,
            d_ff=facts.d_ff,
            head_dim=first.head_dim_k,
            rope_theta=facts.rope_theta,
            rope_scaling=facts.rope_scaling,
            rope_freq_factors=facts.rope_freq_factors,
            rms_eps=facts.rms_eps,
            tie_embeddings=facts.tie_embeddings,
            qk_norm=facts.qk_norm,
            qkv_bias=facts.qkv_bias,
            max_seq_len=spec.context_length or 2048,
            sliding_window=first.window if first.kind == "sliding" else None,
            name=spec.name,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
