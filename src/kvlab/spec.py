"""ModelSpec / LayerSpec: one description of a model's layers, shared by the planner and the model runtime.

The planner turns a ModelSpec into bytes; kvlab's caches allocate exactly those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError

LayerKind = Literal["full", "sliding", "mla", "recurrent", "none"]

#: More layers than any real model; a larger count is a corrupt or hostile file (and would allocate per layer).
MAX_LAYERS = 4096


@dataclass(frozen=True)
class LayerSpec:
    """What one layer keeps per token (and per sequence) in its cache.

    kind:
      full       standard attention: K (n_kv_heads × head_dim_k) and V (n_kv_heads × head_dim_v) per token
      sliding    like full but only the last `window` tokens are needed
      mla        multi-head latent attention: one latent of kv_lora_rank + rope_dim per token
      recurrent  linear attention / SSM: a fixed state of `state_elements` values per sequence
      none       no cache of its own (e.g. reuses another layer's KV)
    """

    kind: LayerKind
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    window: int | None = None
    kv_lora_rank: int = 0
    rope_dim: int = 0
    state_elements: int = 0  # recurrent state values per sequence (conv + ssm/delta state)

    def __post_init__(self) -> None:
        if self.kind in ("full", "sliding"):
            if self.n_heads <= 0 or self.n_kv_heads <= 0:
                raise ConfigError(f"layer needs positive head counts, got n_head={self.n_heads} n_kv_head={self.n_kv_heads}")
            if self.n_heads % self.n_kv_heads != 0:
                raise ConfigError(f"n_head={self.n_heads} is not a multiple of n_kv_head={self.n_kv_heads}")
            if self.head_dim_k <= 0 or self.head_dim_v <= 0:
                raise ConfigError(f"head dims must be positive, got k={self.head_dim_k} v={self.head_dim_v}")
        if self.kind == "sliding" and (self.window is None or self.window <= 0):
            raise ConfigError(f"sliding layer needs a positive window, got {self.window}")
        if self.kind == "mla" and self.kv_lora_rank <= 0:
            raise ConfigError(f"MLA layer needs kv_lora_rank > 0, got {self.kv_lora_rank}")

    @property
    def k_elements_per_token(self) -> int:
        """K values stored per token (MLA: the latent plus the shared RoPE key)."""
        if self.kind in ("full", "sliding"):
            return self.n_kv_heads * self.head_dim_k
        if self.kind == "mla":
            return self.kv_lora_rank + self.rope_dim
        return 0

    @property
    def v_elements_per_token(self) -> int:
        if self.kind in ("full", "sliding"):
            return self.n_kv_heads * self.head_dim_v
        return 0  # MLA keeps only the latent (stored as K)

    def cached_tokens(self, context: int) -> int:
        """Tokens this layer must keep for a context of `context` tokens."""
        if self.kind in ("full", "mla"):
            return context
        if self.kind == "sliding":
            return min(context, self.window or context)
        return 0


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model file as its header lists it (nothing of its data is read)."""

    name: str
    shape: tuple[int, ...]   # PyTorch order: rows first (GGUF lists the fastest dimension first: reversed here)
    dtype: str               # GGUF type name (F32, Q4_1, ...) or safetensors dtype (F32, BF16, ...)


@dataclass(frozen=True)
class LinearAttentionFacts:
    """A Gated DeltaNet layer's shapes (Qwen3-Next, Qwen3.5): key/query heads, value heads, their dims, the conv width."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    @property
    def conv_channels(self) -> int:
        """Channels of the causal depthwise conv: q, k (k_heads × k_dim each) and v (v_heads × v_dim)."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True)
class MoEFacts:
    """A mixture-of-experts feed-forward with one shared expert (Qwen3-Next, Qwen3.5-MoE): the router's softmax picks
    `top_k` of `n_experts` SwiGLU experts per token (their weights renormalised when `norm_topk`); a shared expert,
    gated by sigmoid(shared_gate·x), is added. Layers i with (i + 1) % every == 0 and i not in dense_layers use it."""

    n_experts: int
    top_k: int
    d_ff_expert: int
    d_ff_shared: int
    norm_topk: bool = True
    every: int = 1
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class RuntimeFacts:
    """What only kvlab's model runtime needs beyond the layers' cache shapes, read once by sources/.

    `decoder_config` (model/config.py) checks these against what kvlab can run; nothing
    else parses a model file a second time.
    """

    format: str                                  # "gguf" or "safetensors" (or "config": no tensors known)
    d_ff: int | tuple[int, ...] = 0              # feed-forward width (per layer when the file lists several)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None      # llama3 scaling (HF configs)
    rope_scaling_type: str | None = None         # any other scaling type named by the file (kvlab refuses it)
    rope_dim: int = 0                            # rotated dims per head when the file says (0: all of head_dim)
    rope_freq_factors: tuple[float, ...] | None = None  # llama.cpp's rope_freqs tensor (Llama 3.x GGUFs)
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qk_norm: bool = False
    qkv_bias: bool = False
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # -- Gemma 3 and Qwen3.5 / Qwen3-Next (0 / None / False: the llama family's behaviour) --
    rope_theta_local: float = 0.0                # RoPE base of sliding-window layers when it differs (Gemma 3)
    rope_scaling_factor: float = 0.0             # linear RoPE scaling of the full-attention layers (Gemma 3: 8)
    query_pre_attn_scalar: float = 0.0           # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim) (Gemma 3)
    final_logit_softcap: float = 0.0             # logits = cap · tanh(logits / cap) (Gemma 2/3 when set)
    hidden_act: str = "silu"                     # feed-forward activation: silu or gelu_tanh
    attn_output_gate: bool = False               # q_proj also gives a per-head sigmoid gate on the output (Qwen3.5)
    linear_attention: LinearAttentionFacts | None = None   # Gated DeltaNet layer shapes (kind "recurrent")
    moe: MoEFacts | None = None                  # the mixture-of-experts feed-forward (Qwen3-Next, Qwen3.5-MoE)
    tensors: dict[str, TensorInfo] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model as the planner and the caches see it."""

    name: str
    arch: str
    layers: tuple[LayerSpec, ...]
    d_model: int = 0
    vocab_size: int = 0
    context_length: int = 0
    n_params: int = 0           # total parameters (0 = unknown)
    weights_bytes: int = 0      # exact bytes of stored weights when known (GGUF/safetensors), else 0
    source: str = ""            # where the facts came from (file path, config, catalog citation)
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    runtime: RuntimeFacts | None = field(default=None, compare=False, hash=False)  # None: a catalog entry

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError(f"model {self.name!r} has no layers")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.kind in ("full", "sliding", "mla"))

    def kv_elements_per_token(self) -> int:
        """K+V values per token over all layers that cache every token (sliding layers counted too)."""
        return sum(layer.k_elements_per_token + layer.v_elements_per_token for layer in self.layers)
