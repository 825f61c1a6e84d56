"""Grouped-query attention with the lower-right causal mask: the one place causality lives.

A chunk of T new queries at absolute positions [S-T, S) attends to keys [0, S-T+t] (t = 0..T-1).
PyTorch's `is_causal=True` aligns the mask upper-left when T != S, so it is never used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
    """(T, S) bool, True = may attend. Row t is query position S-T+t; it sees keys j <= S-T+t (and j > pos-window)."""
    return block_mask(n_keys - n_queries, n_queries, 0, n_keys, device, window)


def block_mask(first_query: int, n_queries: int, first_key: int, n_keys: int, device: torch.device | str = "cpu",
               window: int | None = None) -> torch.Tensor:
    """(T, K) bool, the causal mask's block for queries at positions first_query.. and keys at first_key..:
    True where key position j <= query position (and j > position - window)."""
    query_pos = torch.arange(first_query, first_query + n_queries, device=device)[:, None]  # (T, 1)
    key_pos = torch.arange(first_key, first_key + n_keys, device=device)[None, :]          # (1, K)
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v with KV heads shared by groups of query heads.

    q: (B, H, T, Dk) — the last T positions of the sequence
    k: (B, Hkv, S, Dk), v: (B, Hkv, S, Dv) with H % Hkv == 0; query head h reads KV head h // (H/Hkv)
    returns (B, H, T, Dv)
    """
    B, H, T, Dk = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = H // Hkv
    if causal and T == S > 1 and window is None:
        # a whole prompt: the upper-left causal mask is the right one, and without a mask tensor the kernel
        # skips the masked half instead of reading a (G·T, S) mask (K/V still read once per KV head)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)  # (B, H, T, Dv)
    # fold the group into the query axis so K/V are read once per KV head, never copied per query head
    qg = q.reshape(B, Hkv, group * T, Dk)                                          # (B, Hkv, G·T, Dk)
    mask = None
    if causal and (T > 1 or (window is not None and S > window)):
        mask = causal_mask(T, S, q.device, window).repeat(group, 1)               # (G·T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (B, Hkv, G·T, Dv)
    return out.reshape(B, H, T, v.shape[-1])


#: torch's CPU flash-attention kernel, which also returns each row's log-sum-exp (None where this torch lacks it)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale + mask)·v and each row's log Σ exp(q·kᵀ·scale + mask), for combining attention over
    parts of the keys (out = Σ_parts exp(lse_part - lse)·out_part).

    q: (B, H, R, D), k: (B, H, n, D), v: (B, H, n, Dv) float32; mask: (R, n) additive float (0 or -inf), None
    for none. A row whose keys are all masked gets lse = -inf (and an output of zeros).
    returns (B, H, R, Dv), (B, H, R)
    """
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    else:
        logits = (q @ k.transpose(-1, -2)) * scale                                    # (B, H, R, n)
        if mask is not None:
            logits = logits + mask
        lse = torch.logsumexp(logits, dim=-1)                                           # (B, H, R)
        out = torch.softmax(logits, dim=-1).nan_to_num_(0.0) @ v
    if mask is not None:
        lse = lse.masked_fill(~torch.isfinite(mask).any(dim=-1), float("-inf"))       # rows that see none of k
    return out, lse