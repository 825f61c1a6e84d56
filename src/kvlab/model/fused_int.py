"""The fused decode step's view of an integer cache (kernels/decode.c `Quantized`): a QuantizedCache layer read and
written in C, in the same step as the dense caches and TurboQuant caches (model/fused_codes.py holds the rest of the
view: the layer's sink and recent window, where the new token goes).

Attention reads a key chunk of codes once, dequantized into the thread's fp32 tile as `_coded_keys` / `_values`
read them (zero + code·scale: per channel per group of G tokens for keys, the open group's keys from the fp32
stage; per Gv channels per token for values), then the dense cache's fp32 arithmetic for every query head of the
group. The new token (or the row leaving the recent window) is stored as `QuantizedCache._store` stores one token:
values coded at once, the key staged, and the whole group coded when this key completes it (f16 scale/zero from
the group's min/max per channel, codes rounded half to even and clamped); K/V beyond float16's range are refused
with the module path's one-line error, nothing of that layer written.

Served: every width (int1..int8, packed as cache/packing.py packs them), any +gN, +sinkN, +recentN,
+fp-first-last. Not served (the modules run them): batches, other dtypes and devices, a sliding-window model,
value head dims other than the key head dim, and head dims past 1024.
"""

from __future__ import annotations


import torch

from ..cache.int_kernel import Quantized, single_layout
from ..cache.packing import packed_nbytes
from ..errors import NonFiniteError



def serves_int(cache, cfg) -> bool:
    """Whether the fused step reads this integer cache in C (see the module docstring)."""
    g = cache.geometry
    return (
        cache.kernel_format == "int" and cache.dtype == torch.float32 and cache.device.type == "cpu"
        and g.window is None and cfg.sliding_window is None and cfg.head_dim <= 1024
        and (g.batch, g.n_layers, g.n_kv_heads, g.head_dim, g.head_dim_v) == (1, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim)
    )


def quantized(cache, layer: int, hd: int, ptr) -> Quantized:
    """Layer `layer`'s codes as the C struct; ptr(tensor, shape, what, dtype): a checked address (CacheView._ptr)."""
    H, S, G, b = cache.geometry.n_kv_heads, cache.slots, cache.config.group_size, cache.config.bits
    Gv, row = cache.value_group, packed_nbytes(hd, b)
    at = f"layer {layer}"
    q = Quantized(bits=b, group=G, value_group=Gv, slots=S, k_row_bytes=row, v_row_bytes=row)
    shapes = {"k_codes": ((H, S, row), torch.uint8), "k_scale": ((H, -(-S // G), hd), torch.float16),
              "k_zero": ((H, -(-S // G), hd), torch.float16), "k_stage": ((G, H, hd), torch.float32),
              "v_codes": ((H, S, row), torch.uint8), "v_scale": ((H, S, hd // Gv), torch.float16),
              "v_zero": ((H, S, hd // Gv), torch.float16)}
    for name in cache.BUFFERS:
        shape, dtype = shapes[name]
        setattr(q, name, ptr(getattr(cache, name)[layer][0], shape, f"{at} {name}", dtype))
    return single_layout(q, H)


def raise_range_error(q: Quantized) -> None:
    """The module path's one-line error for the K/V the C step found beyond float16's range (check_range)."""
    from ..cache.int_codes import check_range

    what = "key" if q.overflow_what == 0 else "value"
    check_range(torch.tensor([q.overflow]), what)
    raise NonFiniteError(f"{what} of the integer cache refused by the fused decode step")   # not reached
