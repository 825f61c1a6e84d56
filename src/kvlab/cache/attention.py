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


#: keys per chunk of chunked_attention on a GPU: the CPU's 256 made a 4k-token decode step 16 chunks of a dozen kernel
#: launches per layer (dense-f16 at 19 tok/s against dense's 132 on an H200, bench/gpu_check.py)
ACCELERATOR_KEY_CHUNK = 8192


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    key_chunk: int = 256,
    query_block: int = 128,
) -> torch.Tensor:
    """grouped_attention (causal, lower-right) over K/V stored in a narrower dtype (f16, bf16).

    K/V are read `key_chunk` positions at a time and upcast to q's dtype chunk by chunk; a running maximum,
    sum and output per query (the online softmax) combine the chunks, so no full-context K/V copy in q's
    dtype is ever made. Queries go `query_block` at a time, each reading only the keys it may see. One score block
    (B·Hkv, G·query_block, key_chunk) is alive at a time: 1.2 MB for SmolLM2, the size of a prompt chunk's other
    transients (a 512 x 512 block was 9 MB, two of them alive across an iteration); at 1 thread no slower than 512 x 512.
    Chunk edges sit on a fixed grid of absolute positions: later tokens never change earlier results.

    q: (B, H, T, Dk) in the compute dtype; k: (B, Hkv, S, Dk), v: (B, Hkv, S, Dv) in the storage dtype
    returns (B, H, T, Dv) in q's dtype
    """
    B, H, T, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    group = H // Hkv
    scale = Dk ** -0.5 if scale is None else scale
    if q.device.type != "cpu":   # an accelerator: a dozen kernel launches per chunk cost more than a larger block
        key_chunk = max(key_chunk, ACCELERATOR_KEY_CHUNK)
    out = q.new_empty(B, H, T, Dv)
    for a in range(0, T, query_block):
        b = min(T, a + query_block)
        rows = group * (b - a)                                                          # G·Tq query rows per KV head
        positions = torch.arange(S - T + a, S - T + b, device=q.device)               # (Tq,) absolute
        qb = (q[:, :, a:b] * scale).reshape(B * Hkv, rows, Dk)                          # (B·Hkv, G·Tq, Dk), scaled once
        top = q.new_full((B * Hkv, rows, 1), float("-inf"))                             # running max score
        total = q.new_zeros(B * Hkv, rows, 1)                                           # running Σ e^(s - top)
        acc = q.new_zeros(B * Hkv, rows, Dv)                                            # running Σ e^(s - top) v
        first = 0 if window is None else max(0, S - T + a - window + 1)
        last = S - T + b                                                                # keys [first, last)
        for s0 in range(first // key_chunk * key_chunk, last, key_chunk):
            s0, s1 = max(s0, first), min(last, s0 + key_chunk)
            kc = k[:, :, s0:s1].to(q.dtype).reshape(B * Hkv, s1 - s0, Dk)              # (B·Hkv, C, Dk) this chunk only
            vc = v[:, :, s0:s1].to(q.dtype).reshape(B * Hkv, s1 - s0, Dv)              # (B·Hkv, C, Dv)
            scores = torch.bmm(qb, kc.transpose(1, 2))                                  # (B·Hkv, G·Tq, C)
            # every key of the chunk seen by every query of the block: decided from the positions, not by reading
            # the mask back (on a GPU that read would wait for the device at every chunk)
            seen_by_all = s1 - 1 <= S - T + a and (window is None or s0 > last - 1 - window)
            if not seen_by_all:
                keys = torch.arange(s0, s1, device=q.device)[None, :]                   # (1, C)
                visible = keys <= positions[:, None]                                    # (Tq, C)
                if window is not None:
                    visible &= keys > positions[:, None] - window
                scores.masked_fill_(~visible.repeat(group, 1), float("-inf"))
            new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
            shift = new_top.masked_fill(new_top == float("-inf"), 0.0)                  # a query that sees nothing yet
            weights = scores.sub_(shift).exp_()                                         # in place: e^(s - top)
            rescale = torch.exp(top - shift)
            total = total * rescale + weights.sum(-1, keepdim=True)
            acc.mul_(rescale).baddbmm_(weights, vc)                                      # (B·Hkv, G·Tq, Dv) in place
            top = new_top
            del scores, weights  # before the next chunk's scores exist: one (G·Tq, C) block alive, not two
        out[:, :, a:b] = (acc / total).reshape(B, H, b - a, Dv)
    return out


def merge_attention(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                    part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts of one softmax by their log-sum-exps (attend_with_lse's): out, part_out (..., R, Dv) each part's
    normalized output, lse, part_lse (..., R) -> the output and log-sum-exp over both (a row that saw nothing in either
    keeps lse -inf and an output of zeros)."""
    new_lse = torch.logaddexp(lse, part_lse)
    shift = new_lse.masked_fill(new_lse == float("-inf"), 0.0)                   # rows that have seen nothing yet
    merged = out * (lse - shift).exp_()[..., None] + part_out * (part_lse - shift).exp_()[..., None]
    return merged, new_lse


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
    if mask is not None and mask.shape[-1]:  # rows that see none of k (a float max: one read of the mask, no bool copy)
        lse = lse.masked_fill(mask.amax(dim=-1) == float("-inf"), float("-inf"))
    return out, lse
