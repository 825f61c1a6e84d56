"""QuantizedCache: KIVI-style asymmetric integer codes (int8, int4, any 1..8 bits).

x ≈ zero + code·scale with code in [0, 2^b), scale = (max - min)/(2^b - 1), zero = min, both float16.
  keys    per channel: one (scale, zero) per channel for each group of G consecutive tokens
          (keys have channel-wise outliers; grouping along tokens keeps an outlier channel from
          spending the range of the others);
  values  per token: one (scale, zero) per group of G channels of one token.
Codes are bit-packed (int4: two per byte). On CPU, int8 and int4 attention reads the packed codes
directly in C, scores, softmax and mix (`_coded_read`: kernels/intcache.h kvlab_int_attend, each tile
of sixteen tokens decoded once for every query), the function the fused decode step and the serving
pool's integer blocks read with: their output is this cache's, to the bit. The sink and the recent
window are merged with it by log-sum-exp. `code_kernel = None` selects the torch path (the reference).
The codes live in cache/blocks.py IntBlocks (one block per sequence), the storage of the serving pool too, and
a chunk's tokens are coded on CPU by kvlab_int_code_tokens, the C coder the fused step and the pool store with
(`_coded_in_c`; `codes_in_c = False`: by torch, int_codes.py, the reference it is held to bit for bit).

Causal in every schedule (KIVI's rule): a key group is coded only once its G tokens are all there, from
their original keys; until then those keys wait in the "stage" (G tokens × Dk in the cache dtype,
counted in `nbytes`) and attention reads them from there in full precision. The rule, per query, is
what token-by-token decoding reads: the query of the token at compressed index t reads codes for the
groups complete at t (all G tokens ≤ t) and full-precision keys for the rest, so a chunk of any size
gives token-by-token's result and no query reads a scale or zero point set by a later token. Within a
chunk that completes a group, the earlier queries still read that group in full precision: the
append keeps its full-precision keys (from the open group's first token) until the next append of
the layer, and `_scores` takes, per query row, the coded score of a key whose group was complete at
that query and the exact score otherwise (one `where` over the groups the chunk completed; every
other key is read one way by all rows). This is a split of the scores by group-completion position,
not a second attention: the softmax and the values are shared. With `+recentN` the same holds for
tokens the chunk pushed out of the window: a query before the push read them in full precision
(keys by the rule above, values from the append's copy in `_mix`). Values are coded per token, so they
never depend on a later token. The append's copy is working memory of one chunk (like the chunk's K/V
the model already holds), replaced by the layer's next append and not part of `nbytes`.

Long chunks on the torch path (no code kernel: the reference, other widths; `reads_spans`, compressed.py's
blocks): a block of queries reads spans of at most ATTEND_KEYS tokens, each decoded into a transient by torch and
attended with its log-sum-exp; the rule above is kept by offering each token of the chunk's open groups in its
versions (coded, exact key, exact key and value), each visible only to the rows that read it so (`_span_attend`).
No (rows × context) scores and no whole-context decoded K/V are ever held. With the code kernel every chunk, however
long, is read by kvlab_int_attend as a decode step is (a call's queries hold one row of scores each; a recent
window's spilled tokens exact for the queries before the spill), so a prompt gives the serving pool's bits.

Bytes per compressed layer (B sequences, Hkv heads, `slots` tokens, fp16 metadata):
  keys:   B·Hkv·[slots·⌈Dk·b/8⌉ + ⌈slots/G⌉·Dk·2·2 + G·Dk·elem]
  values: B·Hkv·slots·[⌈Dv·b/8⌉ + (Dv/Gv)·2·2]          with Gv = min(G, Dv)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..errors import ConfigError
from ..kernels import kernel_for
from .base import CacheGeometry, copy_prefix, tensors_nbytes
from .attention import attend_with_lse
from . import compressed
from .compressed import CompressedCache
from .blocks import IntBlocks
from .format import CacheSpec, FullPrecision
from .int_codes import check_range
from .int_kernel import blocks_layer, code_tokens
from .packing import packed_nbytes


@dataclass(frozen=True)
class QuantizedConfig:
    """`int<bits>[+g<G>][+sinkN][+recentN][+fp-first-last]`."""

    bits: int = 4
    group_size: int = 32        # tokens per key group, channels per value group
    full: FullPrecision = field(default_factory=FullPrecision)

    def __post_init__(self) -> None:
        self.spec  # the format's checks (format.py), one line each

    @cached_property
    def spec(self) -> CacheSpec:
        """This config as its format: the name and the bytes formula live there."""
        return CacheSpec.from_config(self)

    @property
    def name(self) -> str:
        return self.spec.name

    def value_group(self, head_dim_v: int) -> int:
        return self.spec.value_group(head_dim_v)


class QuantizedCache(CompressedCache):
    """Integer codes with per-group scale and zero point; attention dequantizes on the fly."""

    kernel_format = "int"   # the fused C steps read and write it in place

    def __init__(self, geometry: CacheGeometry, dtype: torch.dtype = torch.float32, device="cpu",
                 config: QuantizedConfig | None = None):
        config = config or QuantizedConfig()
        super().__init__(geometry, dtype, device, config.full)
        self.config = config
        g, b, G = geometry, config.bits, config.group_size
        self.value_group = config.value_group(g.head_dim_v)
        B, H, dev = g.batch, g.n_kv_heads, self.device
        # the codes: the integer formats' blocks (cache/blocks.py), one block of `slots` rows per sequence; per coded
        # layer, views (B, Hkv, slots, ...) of them: codes and value scales per token, key scales per group of G
        self.blocks = IntBlocks(g, len(self.compressed_layers), b, G, self.value_group, B, self.slots, dev)
        for name in IntBlocks.BUFFERS:
            setattr(self, name, dict(zip(self.compressed_layers, getattr(self.blocks, name))))
        self._block_layer = {layer: i for i, layer in enumerate(self.compressed_layers)}   # its layer in `blocks`
        # per coded layer, each sequence's open key group (B, G, Hkv, Dk), token-major as the pool's stages
        self.k_stage = {l: torch.zeros(B, G, H, g.head_dim, dtype=dtype, device=dev) for l in self.compressed_layers}
        self.code_kernel = kernel_for(self.device) if b in (4, 8) else None
        # chunks coded by kvlab_int_code_tokens (`_coded_in_c`) where the kernel library is at hand; False: by torch
        # (the reference); per layer, its blocks and stage as the C coder takes them
        self.codes_in_c = kernel_for(self.device) is not None
        self._coders: dict[tuple, object] = {}
        # per layer, the last append's (open group's first token, its full-precision keys from there,
        # first token of the append, its values if there is a recent window): read by the same chunk only
        self._fresh: dict[int, tuple] = {}

    # -- storing ------------------------------------------------------------------------------------
    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        G, T = self.config.group_size, k.shape[2]
        check_range(k, "key")
        # keys: re-open the incomplete group (if any) from the stage, so groups start aligned
        have = start % G
        first = start - have                                                    # first token of the open group
        block = self.blocks.open_keys(self.k_stage[layer], have, k.transpose(1, 2))   # (B, have+T, Hkv, Dk)
        # this append's full-precision keys (and, with a recent window, values) for the queries of the
        # same chunk that precede a group's completion (or a token's spill): see `_scores` and `_mix`
        self._fresh[layer] = (first, block, start, v.to(self.dtype) if self.window else None)
        if self._coded_in_c(layer, k, v, start):
            return
        slots = self._slots(first, first + have + T).view(self.geometry.batch, -1)    # (B, have+T)
        self.blocks.code_open_keys(self._block_layer[layer], self.k_stage[layer], block, slots)
        # values: groups of channels within each token
        self.blocks.code_values(self._block_layer[layer], self._slots(start, start + T), _by_token(v))

    def _coded_in_c(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> bool:
        """Code compressed tokens [start, start+T) of `layer` (k, v: (B, H, T, D)) with kvlab_int_code_tokens, the coder
        of the fused step and of the serving pool (int_kernel.py), each sequence into its block and its stage: True
        when stored. False where torch codes them (the reference): `codes_in_c` off, a stage that is not fp32 or value
        heads not as wide as key heads (what the C coder takes), several sequences in blocks that key groups do not
        tile, or K/V that are not finite or beyond float16's range (the torch path names them in one line)."""
        g, G, T = self.geometry, self.config.group_size, k.shape[2]
        kernel = kernel_for(self.device)
        if (not self.codes_in_c or kernel is None or self.dtype != torch.float32 or g.head_dim != g.head_dim_v
                or (g.batch > 1 and self.slots % G)):
            return False
        held = (layer, self.k_stage[layer].data_ptr())   # (a copy of the cache has buffers of its own)
        coder = self._coders.get(held)
        if coder is None:
            i = self._block_layer[layer]
            coder = self._coders[held] = blocks_layer(self.blocks.layer(i), self.k_stage[layer], self.config.bits, G,
                                                       self.value_group, "integer cache")
        positions = torch.arange(start, start + T, device=self.device).repeat(g.batch)          # (B·T,)
        sequences = torch.arange(g.batch, device=self.device).repeat_interleave(T)               # (B·T,) stage rows
        return code_tokens(kernel, coder, _by_token(k), _by_token(v), self._slots(start, start + T), positions, sequences)

    def _slots(self, lo: int, hi: int) -> torch.Tensor:
        """(B·(hi-lo),) the slots of compressed tokens [lo, hi) of every sequence (sequence b's block is b), b-major."""
        rows = torch.arange(lo, hi, device=self.device)
        return (torch.arange(self.geometry.batch, device=self.device)[:, None] * self.slots + rows).flatten()

    # -- reading ------------------------------------------------------------------------------------
    def _coded_keys(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """(B, H, hi-lo, Dk) float32 for tokens of complete groups: zero + code·scale, one (scale, zero) per channel
        per G tokens; in C (a span's transient) with the code kernel, else by torch (the reference)."""
        b, G = self.config.bits, self.config.group_size
        if self.code_kernel is not None:
            return self.code_kernel.int_decode(b, self.k_codes[layer], self.k_scale[layer], self.k_zero[layer], lo, hi - lo, G, 1)
        return _by_sequence(self.blocks.keys(self._block_layer[layer], self._slots(lo, hi)), self.geometry.batch)

    def _keys(self, layer: int, n: int) -> torch.Tensor:
        """(B, H, n, Dk) float32 as the next query reads them: codes of the complete groups, then the stage."""
        complete = n // self.config.group_size * self.config.group_size
        stage = self.k_stage[layer][:, :n - complete].transpose(1, 2).float()    # (B, H, n - complete, Dk)
        return torch.cat([self._coded_keys(layer, 0, complete), stage], dim=2) if complete else stage

    def _values(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """(B, H, hi-lo, Dv) float32 of tokens [lo, hi): zero + code·scale with one (scale, zero) per G channels of a
        token; in C (a span's transient) with the code kernel, else by torch (the reference)."""
        b, Gv = self.config.bits, self.value_group
        if self.code_kernel is not None:
            return self.code_kernel.int_decode(b, self.v_codes[layer], self.v_scale[layer], self.v_zero[layer], lo, hi - lo, 1, Gv)
        return _by_sequence(self.blocks.values(self._block_layer[layer], self._slots(lo, hi)), self.geometry.batch)

    def _restore(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys(layer, n), self._values(layer, 0, n)

    def _stored_counts(self, n: int, n_rows: int) -> torch.Tensor:
        """(G·T,) for each grouped query row: how many compressed tokens the store held when that query's
        token was appended one at a time. The T queries are the newest tokens, so row h·T + t gets
        n - (T-1-t) (zero or less while the recent window was still filling)."""
        T = n_rows // (self.geometry.n_heads // self.geometry.n_kv_heads)
        return (torch.arange(n - T + 1, n + 1, device=self.device)).repeat(n_rows // T)  # (G·T,)

    def _fresh_keys(self, layer: int, lo: int, n: int) -> torch.Tensor:
        """(B, H, n - lo, Dk) float32: the full-precision keys of compressed tokens [lo, n)."""
        complete = n // self.config.group_size * self.config.group_size
        if lo >= complete:
            return self.k_stage[layer][:, lo - complete:n - complete].transpose(1, 2).float()
        first, block, _, _ = self._fresh.get(layer, (n, None, n, None))   # block (B, n - first, Hkv, Dk)
        if first > lo or block is None or first + block.shape[1] != n:
            raise ConfigError(f"layer {layer}: attention over more queries than the tokens just appended to the integer cache")
        return block[:, lo - first:].transpose(1, 2).float()

    def _coded_read(self, layer: int, qg: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With the code kernel, the compressed tokens' attention in C, scores, softmax and mix (kvlab_int_attention),
        through kvlab_int_attend, the function the fused step and the serving pool read codes with (kernels/intcache.h),
        so they give the same bits; `_with_exact_parts` merges the sink and the window. qg (B, Hkv, G·T, Dk) -> the
        normalized output (B, Hkv, G·T, Dv) and log-sum-exp (B, Hkv, G·T). Chunks of any length: the C read holds
        one row of scores per query of a call, never (G·T, n). With a recent window (+recentN) a chunk's earlier
        queries read the tokens it pushed out of the window exact, keys and values (as `_scores` and `_mix` do): the
        append's copy of their values goes along. None where the torch path reads them: no kernel (the reference,
        other widths)."""
        n = self._n_comp[layer]
        if self.code_kernel is None:
            return None
        B, Hkv, rows, Dk = qg.shape
        G = self.config.group_size
        first_count = n - T + 1                               # compressed tokens when the chunk's first token came
        first = max(0, first_count) // G * G                  # the earliest query's open group starts here
        exact = self._fresh_keys(layer, first, n).contiguous() if first < n else qg.new_zeros(B, Hkv, 0, Dk)
        window = self.geometry.window
        first_lo = n + self._held(layer) - T - window + 1 if window else -n - T   # the model's window, in coded tokens
        recent = self.window if T > 1 else 0           # a chunk's earlier queries: the tokens it pushed out, exact
        exact_values = self._fresh_values(layer, max(0, first_count), n).contiguous() if recent else None
        return self.code_kernel.int_attention(self.config.bits, self.k_codes[layer], self.k_scale[layer], self.k_zero[layer],
                                              self.v_codes[layer], self.v_scale[layer], self.v_zero[layer], n,
                                              self.geometry.head_dim_v, G, exact, qg.contiguous(), T, first_count, first_lo,
                                              self.scale, recent=recent, exact_values=exact_values)

    def _scores(self, layer: int, qg: torch.Tensor, n: int) -> torch.Tensor:
        G = self.config.group_size
        complete = n // G * G
        if not complete:
            coded = qg.new_zeros(*qg.shape[:3], 0)
        else:
            coded = qg.new_empty(*qg.shape[:3], complete)                           # (B, H, G·T, complete)
            for a in range(0, complete, compressed.ATTEND_KEYS):                    # a span's keys at a time
                b = min(complete, a + compressed.ATTEND_KEYS)
                coded[..., a:b] = qg @ self._coded_keys(layer, a, b).transpose(-1, -2)
            coded.mul_(self.scale)
        counts = self._stored_counts(n, qg.shape[2])                                # (G·T,)
        lo = max(0, int(counts[0])) // G * G        # the earliest query's open group starts here
        if lo >= n:
            return coded
        fresh = self._fresh_keys(layer, lo, n)                                      # (B, H, n - lo, Dk)
        exact = (qg @ fresh.transpose(-1, -2)) * self.scale                         # (B, H, G·T, n - lo)
        if lo == complete:
            return torch.cat([coded, exact], dim=-1)                                # (B, H, G·T, n)
        # groups completed inside this chunk: codes only for the queries at or after the completion
        group_end = (torch.arange(lo, complete, device=self.device) // G + 1) * G   # (complete - lo,)
        done = group_end[None, :] <= counts[:, None]                                # (G·T, complete - lo)
        mixed = torch.where(done, coded[..., lo:], exact[..., :complete - lo])       # (B, H, G·T, complete - lo)
        return torch.cat([coded[..., :lo], mixed, exact[..., complete - lo:]], dim=-1)  # (B, H, G·T, n)

    def _mix(self, layer: int, p: torch.Tensor, n: int) -> torch.Tensor:
        late = None
        if self.window:  # tokens this chunk pushed out of the window: earlier queries still read them exact
            counts = self._stored_counts(n, p.shape[2])                             # (G·T,)
            lo = max(0, int(counts[0]))
            if lo < n:
                late = torch.arange(lo, n, device=self.device)[None, :] >= counts[:, None]  # (G·T, n - lo)
                v_late = self._fresh_values(layer, lo, n)                          # (B, H, n - lo, Dv)
                p_late = p[..., lo:] * late                                         # (B, H, G·T, n - lo)
                p = torch.cat([p[..., :lo], p[..., lo:] * ~late], dim=-1)            # (B, H, G·T, n)
        out = 0.0
        for a in range(0, n, compressed.ATTEND_KEYS):                               # a span's values at a time
            b = min(n, a + compressed.ATTEND_KEYS)
            out = out + p[..., a:b] @ self._values(layer, a, b)                     # (B, H, G·T, Dv)
        if late is not None:
            out = out + p_late @ v_late                                             # (B, H, G·T, Dv)
        return out

    def _fresh_values(self, layer: int, lo: int, n: int) -> torch.Tensor:
        """(B, H, n - lo, Dv) float32: the full-precision values of compressed tokens [lo, n) (with a recent window)."""
        _, _, start, v_fresh = self._fresh.get(layer, (n, None, n, None))
        if start > lo or v_fresh is None or start + v_fresh.shape[2] != n:
            raise ConfigError(f"layer {layer}: attention over more queries than the tokens just appended to the integer cache")
        return v_fresh[:, :, lo - start:].float()

    # -- long chunks: spans of codes (compressed.py's blocks) -----------------------------------------
    reads_spans = True

    def _span_attend(self, layer: int, qg: torch.Tensor, lo: int, hi: int, mask: torch.Tensor | None,
                     first_query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of a query block over compressed tokens [lo, hi), by the same per-query rule as `_scores` and
        `_mix`: the span is decoded (in C with the code kernel: a transient of at most the span) and each token is
        offered in up to three versions, each visible only to the rows that read it so:
          coded key, coded value   tokens whose key group was complete at the row's token,
          exact key, coded value   tokens of a group still open there (the append's keys or the stage),
          exact key, exact value   with a recent window, tokens still in the window there (spilled by this chunk),
        so every row sees each token it may see exactly once, in one softmax (attend_with_lse). Only tokens at or
        after the block's first open group have more than one version."""
        G = self.config.group_size
        n = self._n_comp[layer]
        counts = self._row_counts(layer, first_query, qg.shape[2])              # (R,) stored at each row's token
        first_count, last_count = int(counts.min()), int(counts.max())
        hi = min(hi, last_count + self.window)                                  # later tokens: seen by no row
        mixed = max(lo, min(hi, first_count // G * G))                          # from here rows read tokens differently
        if mixed == hi:                                                         # every row: coded keys and values
            mask = None if mask is None else mask[:, :hi - lo]
            return attend_with_lse(qg, self._coded_keys(layer, lo, hi), self._values(layer, lo, hi), self.scale, mask)
        seen = torch.zeros(qg.shape[2], hi - lo, device=self.device) if mask is None else mask[:, :hi - lo]  # (R, hi-lo)

        def only(rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
            """The mask columns of tokens [a, b) for the rows where `rows` (R, b-a) is True."""
            return seen[:, a - lo:b - lo].masked_fill(~rows, float("-inf"))

        keys, values, masks = [], [], []
        if mixed > lo:                                                          # every row: coded key and value
            keys.append(self._coded_keys(layer, lo, mixed))                     # (B, H, mixed-lo, Dk)
            values.append(self._values(layer, lo, mixed))                       # (B, H, mixed-lo, Dv)
            masks.append(seen[:, :mixed - lo])
        token = torch.arange(mixed, hi, device=self.device)[None, :]            # (1, hi-mixed)
        key_coded = token < (counts // G * G)[:, None]                          # (R, hi-mixed) its group complete there
        value_coded = token < counts[:, None]                                   # stored (not in the window) there
        coded_values = self._values(layer, mixed, hi)                           # (B, H, hi-mixed, Dv)
        complete = min(hi, n // G * G)
        if complete > mixed and bool(key_coded.any()):
            keys.append(self._coded_keys(layer, mixed, complete))
            values.append(coded_values[:, :, :complete - mixed])
            masks.append(only(key_coded[:, :complete - mixed], mixed, complete))
        exact_keys = self._fresh_keys(layer, mixed, n)[:, :, :hi - mixed]       # (B, H, hi-mixed, Dk)
        keys.append(exact_keys)
        values.append(coded_values)
        masks.append(only(~key_coded & value_coded, mixed, hi))
        late = max(mixed, first_count)                                          # tokens in some row's window
        if self.window and late < hi:
            keys.append(exact_keys[:, :, late - mixed:])
            values.append(self._fresh_values(layer, late, n)[:, :, :hi - late])
            masks.append(only(~value_coded[:, late - mixed:], late, hi))
        return attend_with_lse(qg, torch.cat(keys, dim=2), torch.cat(values, dim=2), self.scale, torch.cat(masks, dim=-1))

    def _row_counts(self, layer: int, first_query: int, n_rows: int) -> torch.Tensor:
        """(R,) for the rows of a query block (G heads × R/G positions from `first_query`): how many compressed tokens
        the store held right after that row's token was appended (`_stored_counts` for a block of the chunk)."""
        group = self.geometry.n_heads // self.geometry.n_kv_heads
        first = first_query + 1 - self._n_sink(layer) - self._held(layer)
        return torch.arange(first, first + n_rows // group, device=self.device).repeat(group)  # (R,)

    def reset(self) -> None:
        super().reset()
        self._fresh = {}

    def _copy_into(self, bigger: "QuantizedCache") -> None:
        super()._copy_into(bigger)
        for name in ("k_codes", "k_scale", "k_zero", "k_stage", "v_codes", "v_scale", "v_zero"):
            copy_prefix(getattr(self, name), getattr(bigger, name))   # tokens / key groups along axis 2
        bigger._fresh = dict(self._fresh)   # the last append's full-precision K/V, read by the same chunk

    # -- bytes --------------------------------------------------------------------------------------
    #: the store's buffers, per compressed layer
    BUFFERS = ("k_codes", "k_scale", "k_zero", "k_stage", "v_codes", "v_scale", "v_zero")

    def _store_nbytes(self) -> int:
        return tensors_nbytes(*self._store_buffers())

    def _store_buffers(self) -> list[torch.Tensor]:
        return [t for name in self.BUFFERS for t in getattr(self, name).values()]

    def record_written(self, layers, n_new: int = 1) -> None:
        super().record_written(layers, n_new)
        for layer in layers:   # its last append's full-precision copy is no longer the last append
            self._fresh.pop(layer, None)

    @staticmethod
    def describe(config: QuantizedConfig, geometry: CacheGeometry, dtype: torch.dtype) -> str:
        g, b, G = geometry, config.bits, config.group_size
        Gv = config.value_group(g.head_dim_v)
        k_vec = packed_nbytes(g.head_dim, b) + g.head_dim * 4 / G
        v_vec = packed_nbytes(g.head_dim_v, b) + g.head_dim_v // Gv * 4
        return (f"per key vector: {g.head_dim}×{b}-bit codes + fp16 scale+zero per channel per {G} tokens = {k_vec:g} B; "
                f"per value vector: {g.head_dim_v}×{b}-bit codes + fp16 scale+zero per {Gv} channels = {v_vec:g} B; "
                f"plus a stage of {G} full-precision keys per layer and head")


def _by_token(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B·T, H, D): tokens b-major, as `_slots` lists their slots."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _by_sequence(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(B·T, H, D) -> (B, H, T, D): the inverse of `_by_token`."""
    return x.reshape(batch, -1, *x.shape[1:]).transpose(1, 2)
