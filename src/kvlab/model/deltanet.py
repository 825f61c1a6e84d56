"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a causal depthwise conv, then the gated delta rule over a fixed-size state.

Per value head the state S is a (Dk, Dv) matrix; each token decays it, corrects what it predicts for the token's key
and writes the new value (the delta rule), and the token's query reads it:

    S ← exp(g_t) · S                          g_t ≤ 0: the gate (per head)
    S ← S + k_t ⊗ β_t (v_t − kᵀ_t S)          β_t ∈ (0, 1): the write strength
    o_t = qᵀ_t S

`delta_rule_step` is that recurrence for one token (decode); `delta_rule_chunked` gives the same outputs and final
state for a prompt with a few matmuls per chunk of 64 tokens (the WY / UT form of the DeltaNet papers), every head
at once, and a Python loop over chunks only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Linear

CHUNK = 64  # tokens per chunk of the prompt form (the one transformers and fla use)
#: decays below exp(-80) ≈ 1.8e-35 are taken as exp(-80): a cumulative decay over a chunk easily reaches e^-100, whose
#: subnormal floats make every exp and matmul on them ~10x slower on x86, for a change far below any fp32 rounding
LOG_TINY = -80.0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log decays x ≤ 0, never subnormal (see LOG_TINY)."""
    return torch.exp(x.clamp(min=LOG_TINY))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (the normalisation fla and transformers apply to q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for every head.

    q, k: (B, H, Dk) normalised (q also scaled), v: (B, H, Dv), g, beta: (B, H), state: (B, H, Dk, Dv) fp32
    returns o (B, H, Dv), the new state (B, H, Dk, Dv)
    """
    state = state * decay_exp(g)[..., None, None]                           # decay
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)                     # (B, H, Dv): what S gives for k
    delta = (v - predicted) * beta[..., None]                               # (B, H, Dv)
    state = state + k[..., :, None] * delta[..., None, :]                   # rank-1 write
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, chunk by chunk; the same as T calls of delta_rule_step.

    q, k: (B, H, T, Dk) normalised (q also scaled), v: (B, H, T, Dv), g, beta: (B, H, T), state: (B, H, Dk, Dv) fp32
    returns o (B, H, T, Dv), the final state (B, H, Dk, Dv)
    """
    B, H, T, _ = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk              # padded tokens: β = 0 and g = 0, so they write nothing and decay nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))   # (B, H, n, C, D)
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)       # (B, H, n, C)
    decay = g.cumsum(-1)                                                    # (B, H, n, C): log decay since chunk start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = decay_exp(decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, 0.0)  # (B, H, n, C, C): i ≥ j
    k_beta = k * beta[..., None]                                            # (B, H, n, C, Dk)
    # the writes of a chunk interact through (I + L), L the strictly lower β_i (k_i·k_j) decay_ij: solve once per chunk
    system = (k_beta @ k.transpose(-1, -2)) * pair                          # (B, H, n, C, C); the diagonal is taken as 1
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)   # (B, H, n, C, Dv)
    w = torch.linalg.solve_triangular(system, k_beta * decay_exp(decay)[..., None], upper=False, unitriangular=True)  # (.., Dk)
    inner = (q @ k.transpose(-1, -2)) * pair                                # (B, H, n, C, C): causal within the chunk
    q_decayed = q * decay_exp(decay)[..., None]                             # reads the state as it was at chunk start
    k_decayed = k * decay_exp(decay[..., -1:] - decay)[..., None]           # writes decayed to the chunk end
    chunk_decay = decay_exp(decay[..., -1])[..., None, None]                # (B, H, n, 1, 1)
    out = torch.empty(B, H, n, chunk, Dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state                             # (B, H, C, Dv): the corrections written
        out[:, :, c] = q_decayed[:, :, c] @ state + inner[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_decayed[:, :, c].transpose(-1, -2) @ v_new
    return out.reshape(B, H, n * chunk, Dv)[:, :, :T], state


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer: x (B, T, C) and the layer's state -> (B, T, C), the state advanced by T tokens.

    The input projections are one matmul: rows [q, k, v (the conv's channels), z (output gate), b (β), a (decay)].
    Value heads are in Hugging Face's grouped order: value head h reads query/key head h // (v_heads / k_heads).
    """

    def __init__(self, cfg, layer: int):
        super().__init__()
        la = cfg.linear
        self.layer = layer
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = la.k_heads, la.v_heads, la.k_dim, la.v_dim
        self.kernel = la.conv_kernel
        self.channels = la.conv_channels
        self.split = (self.channels, la.v_heads * la.v_dim, la.v_heads, la.v_heads)
        self.in_proj = Linear(cfg.d_model, sum(self.split), bias=False)
        self.conv = nn.Parameter(torch.empty(self.channels, self.kernel))             # (channels, kernel): depthwise
        self.dt_bias = nn.Parameter(torch.empty(la.v_heads))
        self.a = nn.Parameter(torch.empty(la.v_heads))                                  # -exp(A_log): the decay rate
        self.norm = nn.Parameter(torch.empty(la.v_dim))                                 # gated RMSNorm weight
        self.out = Linear(la.v_heads * la.v_dim, cfg.d_model, bias=False)
        self.eps = cfg.rms_eps

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, delta_state: torch.Tensor) -> torch.Tensor:
        """conv_state (B, channels, kernel-1) and delta_state (B, v_heads, k_dim, v_dim) are updated in place."""
        B, T, _ = x.shape
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        history = torch.cat((conv_state.to(mixed.dtype), mixed.transpose(1, 2)), dim=-1)   # (B, channels, kernel-1+T)
        if self.kernel > 1:
            conv_state.copy_(history[..., -(self.kernel - 1):])
        mixed = F.silu(F.conv1d(history, self.conv[:, None, :], groups=self.channels))    # (B, channels, T)
        q, k, v = mixed.transpose(1, 2).split((self.k_heads * self.k_dim,) * 2 + (self.v_heads * self.v_dim,), dim=-1)
        group = self.v_heads // self.k_heads
        q = q.reshape(B, T, self.k_heads, self.k_dim).float().repeat_interleave(group, dim=2).transpose(1, 2)  # (B, Hv, T, Dk)
        k = k.reshape(B, T, self.k_heads, self.k_dim).float().repeat_interleave(group, dim=2).transpose(1, 2)
        v = v.reshape(B, T, self.v_heads, self.v_dim).float().transpose(1, 2)               # (B, Hv, T, Dv)
        q = l2_normalize(q) * self.k_dim ** -0.5
        k = l2_normalize(k)
        beta = b.float().sigmoid().transpose(1, 2)                                           # (B, Hv, T)
        g = (self.a.float() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)  # (B, Hv, T), ≤ 0
        if T == 1:
            o, state = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], delta_state)
            o = o[:, :, None]                                                                 # (B, Hv, 1, Dv)
        else:
            o, state = delta_rule_chunked(q, k, v, g, beta, delta_state)
        delta_state.copy_(state)
        o = o.transpose(1, 2).to(x.dtype)                                                     # (B, T, Hv, Dv)
        z = z.reshape(B, T, self.v_heads, self.v_dim)
        o = F.rms_norm(o.float(), (self.v_dim,), eps=self.eps).to(x.dtype) * self.norm * F.silu(z.float()).to(x.dtype)
        return self.out(o.reshape(B, T, self.v_heads * self.v_dim))
