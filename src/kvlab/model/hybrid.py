"""Decoders whose layers differ in kind: Gemma 3 (sliding and global attention) and Qwen3.5 / Qwen3-Next (Gated
DeltaNet layers between gated attention layers).

Beyond the llama family (model/llama.py, whose RMSNorm, Linear, RoPE and feed-forward this reuses):
  * a layer is full attention, sliding-window attention, or a Gated DeltaNet (model/deltanet.py);
  * sliding and full layers rotate with their own RoPE bases (Gemma 3), possibly only the first dims (Qwen3.5);
  * attention may scale queries by query_pre_attn_scalar (Gemma 3) and gate its output by sigmoid(q_proj's second
    half) (Qwen3.5); q and k are RMS-normed per head;
  * Gemma 3 multiplies embeddings by sqrt(d_model), norms after attention and after the feed-forward as well
    (sandwich norms) and uses GELU-tanh.
Norm weights are stored as the plain multiplier: the (1 + w) of Gemma and Qwen3.5 checkpoints is added at load.

The cache is a LayeredCache (model/layer_caches.py): the attention layers' K/V in the chosen kvlab cache, the
recurrent layers' fixed state beside it. The fused C decode step runs the llama family only (FUSED_OFF says why).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from .config import DecoderConfig
from .deltanet import GatedDeltaNet
from .layer_caches import LayeredCache
from .llama import FeedForward, Linear, RMSNorm, apply_rope
from .moe import SparseMoE
from ..rope import kind_frequencies

FUSED_OFF = "the fused C decode step runs the llama family only; {arch} runs on the torch path"


class HybridFeedForward(FeedForward):
    """The gated feed-forward with the config's activation: down(act(gate(x)) * up(x)), act silu or GELU-tanh."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gelu:
            return super().forward(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)                         # (B, T, F) views of (B, T, 2F)
        return self.down(F.gelu(gate, approximate="tanh").mul_(up))


class HybridAttention(nn.Module):
    """Attention through the cache with per-head q/k norms, partial RoPE, a query scale and an output gate."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim
        self.gated = cfg.attn_output_gate
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.split = (q_dim * (2 if self.gated else 1), kv_dim, kv_dim)     # gated: per head [q, gate] (HF's q_proj rows)
        self.qkv = Linear(cfg.d_model, sum(self.split), bias=cfg.qkv_bias)
        self.out = Linear(q_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        # the caches scale scores by head_dim ** -0.5: another scale is folded into the queries
        self.q_rescale = cfg.query_scale / cfg.head_dim ** -0.5 if cfg.query_scale else 1.0

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over the first rope_dim dims of each head (all of them unless partial): x (B, H, T, D)."""
        if self.rope_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat((apply_rope(x[..., :self.rope_dim], cos, sin), x[..., self.rope_dim:]), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)   # (B, T, H, D) each
            gate = gate.reshape(B, T, self.n_heads * self.head_dim)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)              # (B, H, T, D)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)           # (B, Hkv, T, D)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)           # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.q_rescale != 1.0:
            q = q * self.q_rescale
        cache.append(self.layer, k, v)
        del k, v
        y = cache.attend(self.layer, q)                                               # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.out(y)


class HybridBlock(nn.Module):
    """norm -> mixer (attention or Gated DeltaNet) [-> norm] -> residual; norm -> feed-forward [-> norm] -> residual."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = cfg.layer_kinds[layer]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.mixer = GatedDeltaNet(cfg, layer) if self.kind == "recurrent" else HybridAttention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps) if cfg.sandwich_norms else None
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn = SparseMoE(cfg) if layer in cfg.moe_layers else HybridFeedForward(cfg)
        self.post_ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor, ropes: dict, cache: LayeredCache) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.kind == "recurrent":
            h = cache.mix(self.layer, self.mixer, h)                        # the cache runs it over its state
        else:
            h = self.mixer(h, *ropes[self.kind], cache)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.ffn(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


class HybridDecoder(nn.Module):
    """tokens (B, T) + LayeredCache -> logits (B, T, vocab). Positions continue from `cache.length`."""

    def __init__(self, cfg: DecoderConfig, init_embedding: bool = True):
        super().__init__()
        self.config = cfg
        weight = None if init_embedding else torch.empty(cfg.vocab_size, cfg.d_model)    # (vocab, C)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=weight)
        self.blocks = nn.ModuleList(HybridBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for kind, freq in kind_frequencies(cfg).items():
            self.register_buffer(f"inv_freq_{kind}", freq.to(torch.get_default_device()), persistent=False)
        self.fused = None                    # the fused C step is the llama family's (model/fused.py)
        self.fused_off = FUSED_OFF.format(arch=cfg.arch)

    def _apply(self, fn, recurse=True):
        """As Decoder._apply: the RoPE frequencies stay fp32 whatever dtype the model is moved to."""
        super()._apply(fn, recurse)
        for kind, freq in kind_frequencies(self.config).items():
            setattr(self, f"inv_freq_{kind}", freq.to(self.inv_freq_full.device))
        return self

    def rope(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, rope_dim) of layer kind `kind` for absolute positions (N,) (any order: a ragged batch)."""
        freq = getattr(self, f"inv_freq_{kind}")
        angles = torch.outer(positions.to(device=freq.device, dtype=torch.float32), freq)  # (N, R/2)
        angles = torch.cat((angles, angles), dim=-1)                                     # (N, R)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, name: str = "dense", batch: int = 1, capacity: int | None = None) -> LayeredCache:
        """A cache of `name` for this model's layer kinds, in the model's dtype and device."""
        weight = self.embed.weight
        return LayeredCache(self.config, name, batch, capacity, weight.dtype, weight.device)

    def check_cache(self, cache) -> None:
        """One line unless `cache` is a LayeredCache made for this model's layer kinds and shapes."""
        cfg = self.config
        if not isinstance(cache, LayeredCache) or cache.config.layer_kinds != cfg.layer_kinds:
            raise ConfigError(f"a {cfg.arch} model needs the cache of its layer kinds (kvlab.model.layer_caches.model_cache), "
                              f"got {type(cache).__name__}")
        if cache.config.linear != cfg.linear:
            raise ConfigError(f"the cache's recurrent state is shaped for {cache.config.linear}, the model's Gated DeltaNet "
                              f"layers need {cfg.linear}")
        g = cache.geometry
        if (g.n_kv_heads, g.head_dim) != (cfg.n_kv_heads, cfg.head_dim) or cache.config.sliding_window != cfg.sliding_window:
            raise ConfigError(f"the cache holds {g.n_kv_heads} KV heads of head_dim {g.head_dim} (window "
                              f"{cache.config.sliding_window}), the model's attention layers {cfg.n_kv_heads} of "
                              f"{cfg.head_dim} (window {cfg.sliding_window})")

    def forward(self, tokens: torch.Tensor, cache: LayeredCache, last_only: bool = False) -> torch.Tensor:
        self.check_cache(cache)
        positions = torch.arange(cache.length, cache.length + tokens.shape[1])
        x = self.hidden_at(tokens, positions, cache)                        # (B, T, C)
        return self.logits(x[:, -1:] if last_only else x)

    def hidden_at(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens (B, T) at absolute positions (T,) through every layer -> (B, T, C) before the final norm. The serving
        engine passes one ragged row of several sequences (B = 1, positions restarting per sequence) and its batch
        view as `cache`."""
        cfg = self.config
        x = self.embed(tokens)                                              # (B, T, C)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        ropes = {kind: self.rope(kind, positions, x.dtype) for kind in ("full", "sliding") if cfg.layers_of(kind)}
        for block in self.blocks:
            x = block(x, ropes, cache)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x (B, T, C) after every layer -> (B, T, vocab): the final norm, the output head, the soft cap."""
        cap = self.config.final_logit_softcap
        x = self.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.output_weight())  # (B, T, vocab)
        return torch.tanh(logits / cap) * cap if cap else logits
