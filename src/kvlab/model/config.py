"""DecoderConfig: the runnable decoders: the Llama family (llama, mistral, qwen2, qwen3), Gemma 3, and the Gated
DeltaNet hybrids Qwen3.5 and Qwen3-Next (model/hybrid.py runs the last three)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, UnsupportedArchitectureError
from ..spec import LinearAttentionFacts, ModelSpec, MoEFacts, RopeScaling

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
HYBRID_FAMILY = ("gemma3", "qwen3_5", "qwen3_next")     # model/hybrid.py: layer kinds, gates, sandwich norms
SUPPORTED_ARCHS = LLAMA_FAMILY + HYBRID_FAMILY
#: the names model files give these architectures (transformers' model_type, llama.cpp's general.architecture)
ARCH_NAMES = {
    **{arch: arch for arch in SUPPORTED_ARCHS},
    "gemma3_text": "gemma3",
    "qwen3_5_text": "qwen3_5", "qwen35": "qwen3_5",
    "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "qwen35moe": "qwen3_5",   # + a MoE feed-forward
    "qwen3next": "qwen3_next",
}
#: what a layer of each kind is in these decoders
LAYER_KINDS = ("full", "sliding", "recurrent")
ACTIVATIONS = ("silu", "gelu_tanh")

__all__ = ["SUPPORTED_ARCHS", "LLAMA_FAMILY", "HYBRID_FAMILY", "RopeScaling", "DecoderConfig", "decoder_config"]


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
    # -- Gemma 3 and the Gated DeltaNet hybrids (defaults: the llama family) --------------------------------
    layer_kinds: tuple[str, ...] = ()   # per layer: full | sliding | recurrent (empty: every layer full, or sliding)
    rope_dim: int = 0                   # dims rotated per head, the first ones (0: all; Qwen3.5: a quarter)
    rope_theta_local: float = 0.0       # RoPE base of the sliding layers (0: rope_theta; Gemma 3: 10,000)
    rope_linear_factor: float = 0.0     # full layers' positions divided by this (Gemma 3 4B+: 8; 0: none)
    query_scale: float = 0.0            # attention scale (0: head_dim ** -0.5; Gemma 3: query_pre_attn_scalar ** -0.5)
    embed_scale: float = 1.0            # embeddings multiplied by this (Gemma 3: sqrt(d_model))
    sandwich_norms: bool = False        # RMSNorm after attention and after the feed-forward too (Gemma 3)
    hidden_act: str = "silu"            # feed-forward activation: silu | gelu_tanh (Gemma 3)
    attn_output_gate: bool = False      # q_proj gives a sigmoid gate per head on the attention output (Qwen3.5)
    final_logit_softcap: float = 0.0    # logits = cap·tanh(logits/cap) (0: none)
    linear: LinearAttentionFacts | None = None  # the Gated DeltaNet layers' shapes (layers of kind recurrent)
    moe: MoEFacts | None = None         # the mixture-of-experts feed-forward of the layers `moe_layers` names

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
            raise ConfigError(f"unknown architecture {self.arch!r}; kvlab runs {', '.join(SUPPORTED_ARCHS)}")
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", ("sliding" if self.sliding_window else "full",) * self.n_layers)
        if len(self.layer_kinds) != self.n_layers:
            raise ConfigError(f"layer_kinds lists {len(self.layer_kinds)} kinds for {self.n_layers} layers")
        for i, kind in enumerate(self.layer_kinds):
            if kind not in LAYER_KINDS:
                raise ConfigError(f"layer {i} is of kind {kind!r}; kvlab runs {', '.join(LAYER_KINDS)} layers")
        if "sliding" in self.layer_kinds and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if "recurrent" in self.layer_kinds and self.linear is None:
            raise ConfigError("recurrent layers need the Gated DeltaNet shapes (linear_num_value_heads, linear_key_head_dim, ...)")
        if self.linear is not None and self.linear.v_heads % self.linear.k_heads:
            raise ConfigError(f"linear_num_value_heads={self.linear.v_heads} is not a multiple of "
                              f"linear_num_key_heads={self.linear.k_heads}")
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ConfigError(f"rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"feed-forward activation {self.hidden_act!r} cannot be run (kvlab runs {', '.join(ACTIVATIONS)})")
        if self.arch in LLAMA_FAMILY and (self.rope_dim != self.head_dim or "recurrent" in self.layer_kinds
                                          or self.attn_output_gate or self.sandwich_norms or self.hidden_act != "silu"
                                          or self.moe is not None or len(set(self.layer_kinds)) > 1):
            raise ConfigError(f"architecture {self.arch!r} has none of partial RoPE, recurrent or mixed layer kinds, output "
                              "gates, sandwich norms, a GELU feed-forward or experts (model/llama.py runs it)")

    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 = MHA, n_heads = MQA, in between = GQA."""
        return self.n_heads // self.n_kv_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose feed-forward is the mixture of experts (transformers' decoder_sparse_step / mlp_only_layers)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.n_layers) if (i + 1) % self.moe.every == 0 and i not in self.moe.dense_layers)

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        """Indices of the layers of these kinds, in order."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in kinds)


def require_runnable(arch: str, source: str) -> None:
    """UnsupportedArchitectureError unless kvlab runs `arch` (checked before anything else is parsed)."""
    if arch not in ARCH_NAMES:
        raise UnsupportedArchitectureError(
            f"{source}: architecture {arch!r} cannot be run by kvlab (it runs {', '.join(SUPPORTED_ARCHS)}); "
            "`kvlab plan` still plans it"
        )


def decoder_config(spec: ModelSpec) -> DecoderConfig:
    """The runnable decoder a ModelSpec (with its RuntimeFacts, from sources/) describes, or a one-line error
    saying what kvlab cannot run. This is the only way from a model file to a DecoderConfig."""
    source = spec.source or spec.name
    require_runnable(spec.arch, source)
    facts = spec.runtime
    if facts is None or facts.format not in ("gguf", "safetensors"):
        raise ConfigError(f"{source}: no weights known for {spec.name!r}; kvlab runs a GGUF file or a folder with safetensors")
    if ARCH_NAMES[spec.arch] in HYBRID_FAMILY:
        return _hybrid_config(spec, facts, source)
    first = spec.layers[0]
    shapes = {(l.kind, l.n_heads, l.n_kv_heads, l.head_dim_k, l.head_dim_v, l.window) for l in spec.layers}
    if len(shapes) != 1 or first.kind not in ("full", "sliding"):
        raise UnsupportedArchitectureError(
            f"{source}: layers differ in kind, head counts, head dims or window; kvlab runs identical "
            "full or sliding-window attention layers (`kvlab plan` plans the others)"
        )
    if first.head_dim_k != first.head_dim_v:
        raise UnsupportedArchitectureError(f"{source}: key head dim {first.head_dim_k} differs from value head dim {first.head_dim_v}")
    if isinstance(facts.d_ff, tuple):
        raise UnsupportedArchitectureError(f"{source}: per-layer feed-forward widths cannot be run by kvlab")
    if facts.rope_scaling_type is not None:
        raise UnsupportedArchitectureError(f"{source}: RoPE scaling {facts.rope_scaling_type!r} cannot be run by kvlab")
    if facts.rope_dim and facts.rope_dim != first.head_dim_k:
        raise UnsupportedArchitectureError(
            f"{source}: RoPE over {facts.rope_dim} of {first.head_dim_k} head dims (partial rotary) cannot be run by kvlab")
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


def _hybrid_config(spec: ModelSpec, facts, source: str) -> DecoderConfig:
    """The DecoderConfig of a Gemma 3, Qwen3.5 or Qwen3-Next text decoder (model/hybrid.py), or one line saying why not."""
    arch = ARCH_NAMES[spec.arch]
    kinds = tuple(layer.kind for layer in spec.layers)
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise UnsupportedArchitectureError(f"{source}: layer {i} is of kind {kind!r}; kvlab runs {', '.join(LAYER_KINDS)} layers")
    attention = [layer for layer in spec.layers if layer.kind in ("full", "sliding")]
    if not attention:
        raise UnsupportedArchitectureError(f"{source}: no attention layer; kvlab runs hybrids with at least one")
    shapes = {(l.n_heads, l.n_kv_heads, l.head_dim_k, l.head_dim_v) for l in attention}
    if len(shapes) != 1:
        raise UnsupportedArchitectureError(f"{source}: attention layers differ in head counts or head dims {sorted(shapes)}")
    n_heads, n_kv_heads, head_dim, head_dim_v = shapes.pop()
    if head_dim != head_dim_v:
        raise UnsupportedArchitectureError(f"{source}: key head dim {head_dim} differs from value head dim {head_dim_v}")
    windows = {l.window for l in attention if l.kind == "sliding"}
    if len(windows) > 1:
        raise UnsupportedArchitectureError(f"{source}: sliding layers of different windows {sorted(windows)}")
    if spec.extra.get("n_expert") and facts.moe is None:
        raise UnsupportedArchitectureError(f"{source}: a mixture-of-experts feed-forward ({spec.extra['n_expert']} experts) "
                                           f"cannot be run by kvlab for {arch}")
    if facts.moe is not None and facts.moe.top_k > facts.moe.n_experts:
        raise ConfigError(f"{source}: {facts.moe.top_k} experts per token of {facts.moe.n_experts}")
    if isinstance(facts.d_ff, tuple):
        raise UnsupportedArchitectureError(f"{source}: per-layer feed-forward widths cannot be run by kvlab")
    if facts.rope_scaling_type is not None or facts.rope_scaling is not None:
        scaling = facts.rope_scaling_type or "llama3"
        raise UnsupportedArchitectureError(f"{source}: RoPE scaling {scaling!r} cannot be run by kvlab for {arch}")
    if "recurrent" in kinds and facts.linear_attention is None:
        raise ConfigError(f"{source}: recurrent layers but no Gated DeltaNet shapes (linear_num_value_heads / ssm.* keys)")
    if spec.d_model <= 0 or spec.vocab_size <= 0:
        raise ConfigError(f"{source}: embedding length {spec.d_model} and vocabulary {spec.vocab_size} must be positive")
    gemma = arch == "gemma3"
    try:
        return DecoderConfig(
            arch=arch, vocab_size=spec.vocab_size, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=n_heads,
            n_kv_heads=n_kv_heads, d_ff=facts.d_ff or (facts.moe.d_ff_expert if facts.moe else 0), head_dim=head_dim, rope_theta=facts.rope_theta, rms_eps=facts.rms_eps,
            tie_embeddings=facts.tie_embeddings, qk_norm=facts.qk_norm, qkv_bias=facts.qkv_bias,
            max_seq_len=spec.context_length or 2048, sliding_window=windows.pop() if windows else None, name=spec.name,
            layer_kinds=kinds, rope_dim=facts.rope_dim, rope_theta_local=facts.rope_theta_local,
            rope_linear_factor=facts.rope_scaling_factor,
            query_scale=facts.query_pre_attn_scalar ** -0.5 if facts.query_pre_attn_scalar else 0.0,
            embed_scale=spec.d_model ** 0.5 if gemma else 1.0, sandwich_norms=gemma, hidden_act=facts.hidden_act,
            attn_output_gate=facts.attn_output_gate, final_logit_softcap=facts.final_logit_softcap,
            linear=facts.linear_attention if "recurrent" in kinds else None, moe=facts.moe,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
