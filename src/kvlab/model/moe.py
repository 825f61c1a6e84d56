"""The mixture-of-experts feed-forward of Qwen3-Next and Qwen3.5-MoE: top-k routed SwiGLU experts plus a gated
shared expert.

    p = softmax(router·x);  the top_k experts e by p (their p renormalised to sum 1 when norm_topk)
    y = Σ_e p_e · down_e(silu(gate_e·x) ⊙ up_e·x) + sigmoid(shared_gate·x) · shared(x)

Tokens are grouped by the expert they chose: a Python loop over the experts some token uses (at most n_experts per
call), every token of that expert in one matmul; never a loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import DecoderConfig
from .llama import FeedForward, Linear


class SparseMoE(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk = moe.top_k, moe.norm_topk
        self.router = Linear(cfg.d_model, moe.n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(moe.n_experts, 2 * moe.d_ff_expert, cfg.d_model))  # (E, 2F, C): gate, up
        self.down = nn.Parameter(torch.empty(moe.n_experts, cfg.d_model, moe.d_ff_expert))         # (E, C, F)
        self.shared = FeedForward(_shared_config(cfg)) if moe.d_ff_shared else None
        self.shared_gate = Linear(cfg.d_model, 1, bias=False) if moe.d_ff_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                       # (N, C)
        probs = F.softmax(self.router(flat).float(), dim=-1)                    # (N, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)                 # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():
            rows, slot = torch.nonzero(chosen == expert, as_tuple=True)        # the tokens that chose it, and where
            gate, up = F.linear(flat[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return out.view_as(x)


def _shared_config(cfg: DecoderConfig):
    """The shared expert is a SwiGLU feed-forward of width d_ff_shared (llama.FeedForward reads d_model and d_ff)."""
    from dataclasses import replace

    return replace(cfg, d_ff=cfg.moe.d_ff_shared)
