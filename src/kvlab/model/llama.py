"""A readable Llama-family decoder: RMSNorm, RoPE, GQA/MQA/MHA attention through a KV cache, SwiGLU.

Each attention layer projects q, k, v, rotates q and k, hands k/v to the cache and asks the cache
for the attention output; the cache decides how K/V are stored and read.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache.base import KVCache
from ..rope import apply_rope, rope_inv_freq  # noqa: F401  (the decoder's RoPE, kept importable from here)
from .config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose single-row case (batch-1 decode) runs as a matrix-vector product.

    On CPU, torch.mv streams a bf16 weight about 1.6× faster than the GEMM path F.linear takes for
    one row (measured in docs/benchmarks.md); the arithmetic is the same dot products.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1] or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        y = torch.mv(self.weight, x.reshape(-1))                            # (N,)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)                                    # (..., N)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv = Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)  # q, k, v fused in one matmul
        self.out = Linear(q_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.append(self.layer, k, v)
        del k, v  # v is a view of the qkv projection: without it the (B, T, q + 2 kv) tensor is freed before attending
        y = cache.attend(self.layer, q)                                   # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.out(y)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_up = Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)                         # (B, T, F) views of (B, T, 2F)
        h = F.silu(gate).mul_(up)                                           # (B, T, F)
        del gate, up  # the (B, T, 2F) projection is freed before down runs (a long prompt's chunk: 6 MB)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """tokens (B, T) + cache -> logits (B, T, vocab). Positions continue from `cache.length`."""

    def __init__(self, cfg: DecoderConfig, init_embedding: bool = True):
        """`init_embedding` False leaves the embedding's weight uninitialised, for a loader that fills it (on the
        meta device its random init would import torch's Python decompositions, ~70 MiB resident)."""
        super().__init__()
        self.config = cfg
        weight = None if init_embedding else torch.empty(cfg.vocab_size, cfg.d_model)    # (vocab, C)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=weight)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(torch.get_default_device()), persistent=False)
        self.fused = None  # a FusedDecodeStep (model/fused.py), set by the loader where it can run

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) would round the RoPE frequencies; they are always recomputed in fp32.
        The fused step points into the old buffers, so it is dropped (the loader builds it last)."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        self.fused = None
        return self

    def rope(self, start: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (n, D) for absolute positions [start, start + n)."""
        return self.rope_at(torch.arange(start, start + n, device=self.inv_freq.device), dtype)

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (N, D) for any absolute positions (N,) (a batch of sequences at different lengths)."""
        angles = torch.outer(positions.to(torch.float32), self.inv_freq)    # (N, D/2)
        angles = torch.cat((angles, angles), dim=-1)                        # (N, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden_at(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens (B, T) at absolute positions (T,) through every layer -> (B, T, C) before the final norm (the serving
        engine: one ragged row of several sequences, its batch view as `cache`)."""
        x = self.embed(tokens)                                              # (B, T, C)
        cos, sin = self.rope_at(positions, x.dtype)                         # (T, D)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x (B, T, C) after every layer -> (B, T, vocab): the final norm and the output projection."""
        x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.output_weight())

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        logits = None if self.fused is None else self.fused.try_step(tokens, cache)   # (1, 1, vocab): one C call, or None
        if logits is not None:
            return logits
        B, T = tokens.shape
        x = self.embed(tokens)                                              # (B, T, C)
        cos, sin = self.rope(cache.length, T, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        if last_only:
            x = x[:, -1:]                                                   # (B, 1, C): decode needs one row
        x = self.norm(x)
        if self.lm_head is not None:  # a Linear, or a BlockQuantLinear (native weights; tied ones share the embedding's blocks)
            return self.lm_head(x)                                          # (B, T, vocab)
        if x.shape[0] * x.shape[1] == 1 and x.device.type == "cpu":
            return torch.mv(self.output_weight(), x.reshape(-1)).view(1, 1, -1)  # (1, 1, vocab): see Linear
        return F.linear(x, self.output_weight())                           # (B, T, vocab)
