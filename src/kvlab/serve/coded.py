"""Compressed block pools: int and TurboQuant codes in the blocks, read back the way the single caches read.

Token slot = block · block_size + offset indexes every buffer:
    int   the integer formats' blocks (cache/blocks.py IntBlocks, QuantizedCache's storage too), head-major inside a
          block: k_codes, v_codes (L, n_blocks, Hkv, block_size, ⌈D·b/8⌉), k_scale, k_zero (L, n_blocks, Hkv,
          block_size/G, Dk) and v_scale, v_zero (L, n_blocks, Hkv, block_size, Dv/Gv) fp16; plus
          stage   (groups·L, max_batch, G, Hkv, Dk) fp32: each running sequence's open key group (its row), per
                  layer of each layer group (state_layer)
    tq    TurboQuant's blocks (cache/blocks.py TqBlocks, TurboQuantCache's storage too), head-major inside a block,
          one tensor per layer: k_codes, v_codes (n_blocks, Hkv, block_size, bytes), k_norm, v_norm (n_blocks, Hkv,
          block_size) 16-bit, or uint8 log codes (+norms8, read against the codec's centres) [+ qjl signs, ‖r‖];
          +alloc: each layer's codes at its width, +halloc: one row per token, (n_blocks, 1, block_size, Σ_h bytes_h),
          its heads' codes side by side at their widths
          + one TqCodec `codec` (cache/tq_codec.py) holding the per-layer state all sequences share
and a block copy (copy-on-write) copies every buffer's rows of that block.

Reading. The torch reference, per sequence: gather its slots, dequantize them, then run
cache.attention.grouped_attention, the same causal attention every cache uses. TurboQuant pools with
use_kernel (on CPU, where the codec reads codes in C) run each layer of a step in one C call (kernels/paged.c
kvlab_tq_pool_layer, `layers_in_c`): `append` keeps the step's K/V, and `attend` codes them into their slots (sink
positions into the sink rows), reads the codes in place through the block tables and returns the output in the
model's domain (inverse rotation, value offset, sink merge done in C). With `layers_in_c` off the same step runs as
the C coder, kvlab_tq_attention (the read the one call makes, output in the rotated domain) and torch for the rest:
the path the one call is tested against (tests/test_tq_pool_step.py). These are the paths the tests hold equal to the
reference. The int formats keep the single cache's rule for key groups (cache/quantized.py): the query of the token at
position p reads codes for the groups complete at p and full-precision keys for the rest, so a chunk's queries before
a group's completion read that group exactly (from the stage and the chunk's own keys, kept for the step like the
single cache's `_fresh`). The reference splits the chunk's queries into runs between group completions, each
one grouped_attention over the keys it reads; with use_kernel (CPU) the whole step is one C call per layer
(kernels/paged.c kvlab_paged_int_attention) that reads the codes in place and the `_fresh` keys exact, each query
through the function the single int8/int4 cache reads with (kernels/intcache.h): bitwise the single cache's output.
The engine's fused step (serve/fused_batch.py) runs both per layer in one C call (kernels/paged.c
kvlab_int_pool_layer: the step's exact keys from each stage and the rows, the C coder, that read).

TurboQuant's per-layer state: rotations and codebooks are data-independent; the key offset, the key
channel weights and the +norms8 scale centres are calibrated once, at pool construction, by running the model on
`calibration_ids` (CALIBRATION_TEXT in the chat template, or fixed ids without a tokenizer) with a
single TurboQuantCache (which calibrates on its first chunk as it always does), and then shared by every
sequence: the pool's `codec` (a TqCodec). A single TurboQuantCache given the same state (`use_calibration(codec)`)
stores and reads every token exactly as the pool does, whatever the chunking: that is the single-sequence
reference for the tq formats (a plain `tq-k4v4` cache calibrates on each sequence's own prompt instead).
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from ..cache import CacheGeometry
from ..cache.attention import grouped_attention
from ..cache.blocks import IntBlocks, TqBlocks
from ..cache import int_kernel
from ..cache.int_kernel import pool_layer
from ..cache.tq_kernel import CodedLayers, code_tokens
from ..cache.tq_codec import TqCodec
from ..cache.turboquant import TurboQuantCache
from ..errors import ConfigError
from ..kernels import kernel_for
from ..kernels.paged import TqPoolLayer, TqStep, paged_int_attention, tq_attention, tq_pool_layer
from ..model.layer_caches import model_cache
from ..rope import apply_rope
from .formats import BlockFormat
from .rows import SequenceRows
from .sinks import SinkRows

#: tokens of the TurboQuant pools' calibration prompt (`calibration_ids`)
CALIBRATION_TOKENS = 64


#: what the pools calibrate on when the model's tokenizer is at hand: plain prose (not the evaluation's plays) as a user
#: message in the model's chat template, so the key offsets and channel weights see text opening as served requests
#: open (the first tokens' keys weigh heavily in the offset); fixed ids spread over the vocabulary, or the prose without
#: the template's opening, gave SmolLM2 offsets under which a `tq-k4v4+prerope` pool answered "What is the capital of
#: France?" with noise (tests/test_serve_compressed.py)
CALIBRATION_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five books "
    "at a time, and most of them return within two weeks. On rainy days the reading room is full: students work on "
    "their essays, an old man reads the newspaper, and a child asks the librarian where the books about the sea are. "
    "She smiles, walks to the third shelf and hands him a large book with a blue whale on the cover.")


def calibration_ids(vocab_size: int, tokenizer=None) -> list[int]:
    """CALIBRATION_TOKENS ids: CALIBRATION_TEXT's first ones through the tokenizer, or fixed ids without one."""
    if tokenizer is not None:
        if getattr(tokenizer, "chat_template", None):
            text, special = tokenizer.apply_chat_template([{"role": "user", "content": CALIBRATION_TEXT}]), False
        else:   # no chat template: the prose after the tokenizer's own opening (BOS)
            text, special = CALIBRATION_TEXT, True
        ids = [i for i in tokenizer.encode(text, add_special=special) if 0 <= i < vocab_size]
        if len(ids) >= CALIBRATION_TOKENS:
            return ids[:CALIBRATION_TOKENS]
    return [(1 + 7919 * i) % vocab_size for i in range(CALIBRATION_TOKENS)]


class CodedPool:
    """What the compressed pools share: their `blocks` (cache/blocks.py), block copies, rows for running sequences."""

    def __init__(self, geometry: CacheGeometry, plan, fmt: BlockFormat, device):
        self.geometry, self.plan, self.format = geometry, plan, fmt
        self.block_size = plan.block_size
        self.slots = plan.n_blocks * plan.block_size
        self._device = torch.device(device)
        self.blocks = None                                     # the subclass's IntBlocks or TqBlocks
        self.rows = SequenceRows(plan.max_batch, "the pool has rows")   # running sequence -> its row
        self.n_groups = plan.n_groups                          # layer groups: per-layer state for each group's layers
        self._kernel = kernel_for(self._device)                # the C coders' library, None off the CPU or without it
        self._coders: dict[tuple[int, int], object] = {}       # (pool layer, state layer) -> its C description

    def state_layer(self, layer: int, view) -> int:
        """Where pool layer `layer` of the view's group keeps its per-layer state (group g's layers after the g
        groups before it): the buffers of codes are indexed by slot, and a block belongs to one group, but the
        per-layer state (the open key group, TurboQuant's calibration) is each model layer's own."""
        return view.group * self.geometry.n_layers + layer

    @property
    def device(self) -> torch.device:
        return self._device

    # -- rows: per-sequence state of the running sequences ------------------------------------------------
    def rows_for(self, seqs) -> list[int]:
        return self.rows.take(seqs)[0]

    def release(self, seq) -> None:
        self.rows.release(seq)

    def fork(self, parent, child) -> None:
        """The child shares the parent's blocks (BlockManager.fork): it gets the parent's per-sequence state too."""

    # -- blocks -------------------------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's codes of block `src` into block `dst` (copy-on-write)."""
        self.blocks.copy_block(src, dst)

    def block_parts(self, block: int) -> list[tuple[str, torch.Tensor]]:
        """Views of every buffer's part of `block`, in a fixed order (what the KV store writes and reads back): the
        codes of a full block are all of its K/V (a key group never straddles two blocks; +sinkN is refused)."""
        return self.blocks.block_parts(block)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self._state_nbytes()

    def _state_nbytes(self) -> int:
        raise NotImplementedError

    def _row_sequences(self, view) -> torch.Tensor:
        """(N,) the sequence (its index in the step) each of the step's tokens belongs to."""
        layout = view.layout
        counts = (layout.query_start[1:] - layout.query_start[:-1]).long()                # (S,) tokens per sequence
        return torch.repeat_interleave(torch.arange(counts.numel()), counts).to(self._device)

    def _positions(self, view, seq: torch.Tensor) -> torch.Tensor:
        """(N,) the position of each of the step's tokens in its sequence (seq: _row_sequences)."""
        layout = view.layout
        rows = torch.arange(seq.numel(), device=self._device)
        ends = layout.context_len.long().to(self._device)[seq]                             # (N,) its sequence's context
        last_rows = layout.query_start[1:].long().to(self._device)[seq]                    # (N,) one past its last row
        return ends - (last_rows - rows)

    def _token_rows(self, view) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(positions (N,), rows (N,)): each of the step's tokens' position in its sequence and its sequence's row of
        per-sequence state (None without rows); made at the step's first layer and kept on its view."""
        held = getattr(view, "token_rows", None)
        if held is None:
            seq = self._row_sequences(view)                                                # (N,)
            rows = None if view.rows is None else torch.tensor(view.rows, dtype=torch.int64, device=self._device)[seq]
            held = view.token_rows = (self._positions(view, seq), rows)
        return held

    def _coder(self, layer: int, view):
        """Pool layer `layer`'s codes as its format's C coder writes them (cache/tq_kernel.py, cache/int_kernel.py),
        described once per layer and layer group; None where this step codes in torch (the reference): no kernel,
        view.use_kernel off, or what `_codes_in_c` refuses."""
        return self._coder_at(layer, self.state_layer(layer, view)) if view.use_kernel else None

    def _coder_at(self, layer: int, at: int):
        """`_coder` of pool layer `layer` with state layer `at`, for a step that runs the kernels."""
        if self._kernel is None or not self._codes_in_c():
            return None
        coder = self._coders.get((layer, at))
        if coder is None:
            coder = self._coders[layer, at] = self._describe(layer, at)
        return coder

    def _codes_in_c(self) -> bool:
        raise NotImplementedError

    def _describe(self, layer: int, at: int):
        raise NotImplementedError

    def layer_structs(self):
        """Every layer's C description (a model of one layer group, `_layer_struct`) as the engine's fused step reads
        them: a ctypes array of pointers (L,), made once; None where a layer does not run in C."""
        held = getattr(self, "_layer_array", None)
        if held is None:
            structs = [self._layer_struct(layer) for layer in range(self.geometry.n_layers)]
            if any(s is None for s in structs):
                return None
            held = (ctypes.POINTER(type(structs[0])) * len(structs))(*(ctypes.pointer(s) for s in structs))
            held.structs = structs
            self._layer_array = held
        return held

    def _layer_struct(self, layer: int):
        raise NotImplementedError

    # -- reading ------------------------------------------------------------------------------------------
    @staticmethod
    def sequences(view):
        """(s, query rows lo:hi, chunk start, context length) of each sequence of the step."""
        layout = view.layout
        for s in range(layout.context_len.numel()):
            lo, hi = int(layout.query_start[s]), int(layout.query_start[s + 1])
            ctx = int(layout.context_len[s])
            yield s, lo, hi, ctx - (hi - lo), ctx


class IntPool(CodedPool):
    """int<b>+g<G> blocks (G divides the block size): the integer formats' blocks (cache/blocks.py IntBlocks), the
    storage QuantizedCache holds its codes in, with many sequences in it."""

    def __init__(self, geometry: CacheGeometry, plan, fmt: BlockFormat, device="cpu"):
        super().__init__(geometry, plan, fmt, device)
        g, cfg = geometry, fmt.config
        self.bits, self.group = cfg.bits, cfg.group_size
        self.value_group = cfg.value_group(g.head_dim_v)
        self.blocks = IntBlocks(g, g.n_layers, self.bits, self.group, self.value_group, plan.n_blocks, self.block_size,
                                self._device)
        self.stage = torch.zeros(self.n_groups * g.n_layers, plan.max_batch, self.group, g.n_kv_heads, g.head_dim,
                                 dtype=fmt.dtype, device=self._device)   # (groups·L, rows, G, Hkv, Dk): state_layer
        self._fresh: list[tuple[int, torch.Tensor]] = []                  # per sequence of the step: (first, keys)

    def _state_nbytes(self) -> int:
        return self.stage.nbytes

    def fork(self, parent, child) -> None:
        """The child's row starts as a copy of the parent's open key group (the keys its shared blocks lack)."""
        if parent in self.rows:
            self.stage[:, self.rows_for([child])[0]] = self.stage[:, self.rows[parent]]   # (groups·L, G, Hkv, Dk)

    def append(self, layer: int, view, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (N, Hkv, D), v (N, Hkv, Dv) of the step's tokens: values coded per token, keys per complete group; in C
        (kvlab_int_code_tokens, the fused step's coder) where the kernel builds, else in torch (the reference)."""
        G = self.group
        stage = self.stage[self.state_layer(layer, view)]                              # (rows, G, Hkv, Dk)
        self._fresh = []                  # each sequence's keys from its open group on, exact, for this step's reads
        for s, lo, hi, start, ctx in self.sequences(view):
            have, row = start % G, view.rows[s]
            self._fresh.append((start - have, self.blocks.open_keys(stage[row:row + 1], have, k[None, lo:hi])[0]))
        coder = self._coder(layer, view)
        if coder is not None:
            positions, rows = self._token_rows(view)                                   # (N,) each; rows: stage rows
            if int_kernel.code_tokens(self._kernel, coder, k, v, view.slots, positions, rows):
                return
        self._append_reference(stage, layer, view, v)

    def _codes_in_c(self) -> bool:
        """The C coder takes fp32 stages and value heads as wide as key heads."""
        return self.stage.dtype == torch.float32 and self.geometry.head_dim == self.geometry.head_dim_v

    def _describe(self, layer: int, at: int):
        """Pool layer `layer`'s blocks with state layer `at`'s stages (cache/int_kernel.py)."""
        return pool_layer(self.blocks.layer(layer), self.stage[at], self.bits, self.group, self.value_group, "integer pool")

    def _layer_struct(self, layer: int):
        """Layer `layer`'s codes and stages as kvlab_int_pool_layer codes and reads them (the C coder's description)."""
        return self._coder_at(layer, layer)

    def _append_reference(self, stage: torch.Tensor, layer: int, view, v: torch.Tensor) -> None:
        """append in torch: the blocks' coders (cache/blocks.py IntBlocks, QuantizedCache's too) on the step's values
        and on each sequence's keys from its open group on (`_fresh`, which `append` has just gathered)."""
        self.blocks.code_values(layer, view.slots, v)
        for (s, lo, hi, start, ctx), (first, keys) in zip(self.sequences(view), self._fresh):   # keys (have + T, Hkv, D)
            row = view.rows[s]
            slots = view.layout.slots(s)[first:first + len(keys)].to(self._device)         # (have + T,)
            self.blocks.code_open_keys(layer, stage[row:row + 1], keys[None], slots[None])

    def attend(self, layer: int, view, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) fp32 -> (N, H, Dv) fp32. With view.use_kernel on CPU: the whole batch in one C call on the pool's
        codes (`_attend_ragged`); otherwise the torch reference (dequantize, grouped_attention per run of queries)."""
        G = self.group
        kernel = kernel_for(self._device) if view.use_kernel else None
        if kernel is not None:
            return self._attend_ragged(kernel, layer, view, q)
        out = q.new_empty(q.shape[0], q.shape[1], self.geometry.head_dim_v)          # (N, H, Dv)
        for s, lo, hi, start, ctx in self.sequences(view):
            slots = view.layout.slots(s).to(self._device)                            # (ctx,)
            coded = self.blocks.keys(layer, slots[:ctx // G * G])                    # (complete, Hkv, Dk)
            values = self.blocks.values(layer, slots).transpose(0, 1)[None]          # (1, Hkv, ctx, Dv)
            first, exact = self._fresh[s]                                            # keys [first, ctx) in full precision
            a = start
            while a < ctx:                       # a run of queries that read the same complete groups
                c = (a + 1) // G * G             # tokens of the groups complete at position a
                b = min(ctx, c + G - 1)          # the next group completes at position c + G - 1 (> a)
                keys = torch.cat([coded[:c], exact[c - first:b - first].float()]).transpose(0, 1)[None]  # (1, Hkv, b, Dk)
                qs = q[lo + a - start:lo + b - start].transpose(0, 1)[None]          # (1, H, b - a, Dk)
                o = grouped_attention(qs, keys, values[:, :, :b], view.scale, window=view.window)
                out[lo + a - start:lo + b - start] = o[0].transpose(0, 1)
                a = b
        return out

    def _attend_ragged(self, kernel, layer: int, view, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, Dk) -> (N, H, Dv): every sequence of the step in one C call on the pool's codes through the block
        tables, with the rule of `attend`: each sequence's step keys from its open group on (`_fresh`) go in exact.
        Each query reads as the single cache reads it (kernels/intcache.h): the same bits as QuantizedCache."""
        exact = torch.cat([keys for _, keys in self._fresh]).float().contiguous()      # (Σ ctx - first, Hkv, Dk)
        counts = torch.tensor([0] + [len(keys) for _, keys in self._fresh], dtype=torch.int64)
        codes, layout = self.blocks.layer(layer), view.layout
        return paged_int_attention(kernel, q.contiguous(), self.bits, codes["k_codes"], codes["k_scale"], codes["k_zero"],
                                   codes["v_codes"], codes["v_scale"], codes["v_zero"], exact, counts.cumsum(0),
                                   layout.block_tables, layout.query_start, layout.context_len, self.group, view.scale,
                                   view.window or 0, self.geometry.head_dim_v)


class TurboPool(CodedPool):
    """TurboQuant blocks (cache/blocks.py TqBlocks, the storage TurboQuantCache holds its codes in, with many
    sequences in it); the per-layer state lives in `codec`."""

    def __init__(self, geometry: CacheGeometry, plan, fmt: BlockFormat, codec: TqCodec, device="cpu"):
        super().__init__(geometry, plan, fmt, device)
        self.codec = codec                                     # calibrated_codec(...): the shared per-layer state
        # blocks of the pool's layers (a layer group's); the codec holds every group's layers' state
        self.blocks = TqBlocks(codec.token_shapes(range(geometry.n_layers)), plan.n_blocks, self.block_size, self._device)
        self.sink = fmt.config.full.sink                                # +sinkN: the first N tokens exact, apart
        if codec.sink != self.sink:   # the codec's reads place coded slot i at position sink + i (+prerope)
            raise ConfigError(f"TurboQuant pool: its codec keeps {codec.sink} sink tokens, the format {self.sink}")
        self.sinks = SinkRows(geometry, plan.max_batch, self.sink, fmt.dtype, self._device) if self.sink else None
        self._c_layers = CodedLayers("TurboQuant pool")     # what the C coder's layer descriptions point at
        self._pool_layers: dict[tuple[int, int], TqPoolLayer] = {}   # (pool layer, state layer) -> its C descriptor
        # a layer of a step in one C call where the coder runs in C (kvlab_tq_pool_layer: code, attend, turn back, merge
        # the sink rows); False: the coder and the paged codes attention apart, the rest in torch (the reference)
        self.layers_in_c = True

    # -- +sinkN: per-sequence state -------------------------------------------------------------------------
    def rows_for(self, seqs) -> list[int]:
        """With +sinkN each sequence's sink entry (sinks.py), else a row as every coded pool gives."""
        return [self.sinks.entry_for(seq) for seq in seqs] if self.sinks else super().rows_for(seqs)

    def release(self, seq) -> None:
        super().release(seq)
        if self.sinks:
            self.sinks.release(seq)

    def fork(self, parent, child) -> None:
        if self.sinks:
            self.sinks.fork(parent, child)

    def prefix_state_parts(self, ids, adopt: bool = False) -> list[tuple[str, torch.Tensor]] | None:
        """+sinkN: the sink rows of sequences starting with `ids` (SinkRows.rows); [] without sinks."""
        return self.sinks.rows(ids, adopt) if self.sinks else []

    @property
    def prefix_state_layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of prefix_state_parts' views."""
        if not self.sinks:
            return []
        return [(name, t.dtype, tuple(t.shape[:1] + t.shape[2:])) for name, t in (("sink.k", self.sinks.k), ("sink.v", self.sinks.v))]

    def holds_prefix_state(self, seq) -> bool:
        """Whether cached prefix blocks are all the sequence needs of its first tokens (+sinkN: its sink rows are
        here too; BlockManager asks before it hands out cached blocks)."""
        return self.sinks is None or self.sinks.holds(seq)

    def _rope_rows(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (ctx, D) of positions 0 .. the step's longest context (+prerope, +ropemean; a slot's position is its token's
        place in its sequence): made at the step's first layer and kept on its view, a step's transient, not the pool's."""
        if getattr(view, "rope", None) is None:
            view.rope = self.rope_table(view.layout)
        return view.rope

    def rope_table(self, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (ctx, D) of positions 0 .. the layout's longest context."""
        return tuple(t.contiguous() for t in self.codec.position_rope(0, int(layout.context_len.max())))

    def _state_nbytes(self) -> int:
        return self.codec.state_nbytes() + (self.sinks.nbytes if self.sinks else 0)

    def _step(self, view) -> "_StepRows":
        """What every layer of the step reads about its rows, made at its first layer and kept on its view."""
        step = getattr(view, "coded_rows", None)
        if step is None:
            step = view.coded_rows = _StepRows.build(self, view)
        return step

    def _codes_in_c(self) -> bool:
        """Every TurboQuant format codes in C (+qjl's sketch and +outliersN's entries too)."""
        return True

    def _describe(self, layer: int, at: int):
        """Pool layer `layer`'s codes with the codec's layer `at` (cache/tq_kernel.py)."""
        return self._c_layers.layer(self.codec, at, self.blocks.layer(layer), (self.blocks.n_blocks, self.block_size))

    # -- a layer in one C call ----------------------------------------------------------------------------------
    def pool_layer(self, layer: int, view) -> TqPoolLayer | None:
        """Pool layer `layer` of the view's group as kvlab_tq_pool_layer codes and reads it (its Coded and sink rows);
        None where the view's steps do not run it in C (view.use_kernel or `layers_in_c` off, no C coder)."""
        return self.layer_struct(layer, self.state_layer(layer, view)) if view.use_kernel else None

    def layer_struct(self, layer: int, at: int) -> TqPoolLayer | None:
        """Pool layer `layer` with state layer `at` as C reads it, made once; None where it does not run in C."""
        coder = self._coder_at(layer, at) if self.layers_in_c else None
        if coder is None:
            return None
        described = self._pool_layers.get((layer, at))
        if described is None:
            sinks = (self.sinks.k[layer], self.sinks.v[layer]) if self.sinks else (None, None)   # (entries, sink, Hkv, D)
            described = self._pool_layers[layer, at] = self._c_layers.pool_layer(coder, *sinks)
        return described

    def _layer_struct(self, layer: int) -> TqPoolLayer | None:
        return self.layer_struct(layer, layer)

    def step_struct(self, layout, rows: list[int] | None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> TqStep:
        """What every layer of a step reads in C beside its descriptor: each sequence's sink entry (+sinkN) and the RoPE
        table of positions 0 .. its longest context (+prerope, +ropemean: `rope`, or made here), checked; it holds them."""
        entries = torch.tensor(rows, dtype=torch.int32) if self.sinks else None                      # (S,)
        if self.codec.config.turns_keys:
            rope = rope if rope is not None else self.rope_table(layout)
        else:
            rope = None
        step = TqStep.of(entries, rope, layout.context_len.numel(), self.geometry.head_dim)
        step.held = (entries, rope)
        return step

    def sinks_written(self, layer: int, layout, rows: list[int] | None) -> None:
        """+sinkN: the sink positions of the step's chunks are in their entries' rows of `layer` (C wrote them)."""
        if self.sinks:
            for s in range(layout.context_len.numel()):
                start = int(layout.context_len[s]) - int(layout.query_start[s + 1] - layout.query_start[s])
                if start < self.sink:
                    self.sinks.wrote(layer, rows[s], min(int(layout.context_len[s]), self.sink))

    def _tq_step(self, view) -> TqStep:
        """`step_struct` of the view's step, made at its first layer and kept on its view."""
        step = getattr(view, "tq_step", None)
        if step is None:
            step = view.tq_step = self.step_struct(view.layout, view.rows,
                                                   self._rope_rows(view) if self.codec.config.turns_keys else None)
        return step

    def _layer_in_c(self, layer: int, view, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """q (N, H, D), k, v (N, Hkv, D) -> (N, H, D): the step's K/V coded and every row attended in one C call; None
        when a scale is not finite (nothing attended)."""
        layout = view.layout
        out = tq_pool_layer(self._kernel, self.pool_layer(layer, view), q.contiguous(), k.float().contiguous(),
                            v.float().contiguous(), layout.block_tables, layout.query_start, layout.context_len,
                            layout.block_size, self._tq_step(view), view.scale, view.window or 0)
        if out is not None:
            self.sinks_written(layer, layout, view.rows)
        return out

    def append(self, layer: int, view, k: torch.Tensor, v: torch.Tensor) -> None:
        """k (N, Hkv, D), v (N, Hkv, D) of the step's tokens: coded into their slots; with +sinkN the tokens at
        positions below N go to their sequence's sink rows instead. Where the layer runs in one C call (`pool_layer`)
        they are kept for its `attend`, which codes them before it reads."""
        self._flush(view)
        if view.layout is not None and self.pool_layer(layer, view) is not None:
            view.pending_kv = (layer, k, v)
            return
        self._append(layer, view, k, v)

    def _flush(self, view) -> None:
        """Code the K/V an `append` kept and no `attend` took."""
        pending = getattr(view, "pending_kv", None)
        if pending is not None:
            view.pending_kv = None
            self._append(pending[0], view, pending[1], pending[2])

    def _append(self, layer: int, view, k: torch.Tensor, v: torch.Tensor) -> None:
        """append through the C coder (or the torch reference) and the sink rows in torch."""
        at = self.state_layer(layer, view)                                                # the codec's layer
        step = self._step(view)
        for entry, start, lo, hi in step.sink_writes:                                     # +sinkN: the chunks' sink tokens
            self.sinks.write(layer, entry, start, k[lo:hi], v[lo:hi])
        slots, rope = step.coded_slots, step.coded_rope                           # (n,), +prerope/+ropemean (n, D) each
        if step.coded is not None:
            k, v = k[step.coded], v[step.coded]
        if not len(slots):
            return
        coder = self._coder(layer, view)
        if coder is not None and code_tokens(self._kernel, coder, k, v, slots, rope):
            return
        if rope is not None:   # the torch reference (and, for a scale that is not finite, its one-line error)
            k = apply_rope(k.float(), rope[0][:, None], -rope[1][:, None])                 # (N, Hkv, D)
        coded = self.codec.code(at, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                rope if self.codec.config.rope_mean else None)            # (1, Hkv, N, ...)
        self.blocks.write_slots(layer, slots, {name: t[0].transpose(0, 1)                  # (N, Hkv, ...)
                                               for name, t in self.codec.stored_scales(at, coded).items()})

    def attend(self, layer: int, view, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) fp32 -> (N, H, D). After an `append` that kept the layer's K/V: the layer in one C call
        (`_layer_in_c`). Else, with view.use_kernel where the codec reads codes in C (CPU): the whole batch in one
        ragged call on the pool's codes (kernels/paged.c); else the torch reference (gather, dequantize,
        grouped_attention per sequence)."""
        pending = getattr(view, "pending_kv", None)
        if pending is not None and pending[0] == layer:   # the layer in one C call
            view.pending_kv = None
            out = self._layer_in_c(layer, view, q, pending[1], pending[2])
            if out is not None:
                return out
            self._append(layer, view, pending[1], pending[2])   # a scale not finite: the torch reference names it
        self._flush(view)
        at = self.state_layer(layer, view)                                           # the codec's layer
        kernel = kernel_for(self._device) if view.use_kernel else None
        if kernel is not None:       # (every width of +halloc too: paged.c reads a layout per head)
            return self._attend_ragged(kernel, layer, view, q)
        out = q.new_empty(q.shape[0], q.shape[1], self.geometry.head_dim)            # (N, H, D)
        for s, lo, hi, start, ctx in self.sequences(view):
            slots = view.layout.slots(s)[self.sink:].to(self._device)                # (ctx - sink,) the coded ones
            stored = self.codec.read_scales(at, self.blocks.gather(layer, slots))    # (1, Hkv, n[, bytes])
            qs = q[lo:hi].transpose(0, 1)[None]                                      # (1, H, T, D)
            k, v = self.codec.decode(at, stored)                                     # (1, Hkv, n, D)
            if self.sinks:   # the sink rows first, exact: (1, Hkv, ctx, D)
                sink_k, sink_v = self.sinks.held(layer, view.rows[s], min(ctx, self.sink))     # (held, Hkv, D)
                k = torch.cat([sink_k.transpose(0, 1)[None], k], dim=2)
                v = torch.cat([sink_v.transpose(0, 1)[None], v], dim=2)
            out[lo:hi] = grouped_attention(qs, k, v, view.scale, window=view.window)[0].transpose(0, 1)
        return out

    def _attend_ragged(self, kernel, layer: int, view, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) -> (N, H, D): every sequence of the step in one C call on the pool's codes through the block
        tables. The queries go in as the codes are read (Π(q⊙w), TqCodec.rotated_queries); the kernel's
        output is in the rotated domain: one inverse rotation and the value offset for the whole batch. The key
        offset's q·μ is the same for every key of a query, so the softmax does not see it. +sinkN: the kernel reads
        the coded keys from position N on and gives each row's log-sum-exp (plus q·μ: now it counts), which merges
        its output with the sink rows' (`_merge_sinks`)."""
        N, H, D = q.shape
        Hkv = self.geometry.n_kv_heads
        codec, layout = self.codec, view.layout
        at = self.state_layer(layer, view)                                                # the codec's layer
        if codec.config.turns_keys:   # C takes the plain queries: it rebuilds the keys (or turns the offset) at their positions
            queries = q
        else:
            qg = q.reshape(N, Hkv, H // Hkv, D).transpose(0, 1).reshape(1, Hkv, -1, D)   # (1, Hkv, N·G, D)
            queries = codec.rotated_queries(at, qg).reshape(Hkv, N, H // Hkv, D).transpose(0, 1).reshape(N, H, D)
        rotated = tq_attention(kernel, self._coder(layer, view), queries.contiguous(), layout.block_tables,
                               layout.query_start, layout.context_len, self._tq_step(view), view.scale, view.window or 0,
                               first_key=self.sink, with_lse=bool(self.sinks))                # (N, H, D)
        rotated, lse = rotated if self.sinks else (rotated, None)                         # (N, H, D), (N, H)
        out, lse = codec.read_output(at, rotated, q, view.scale, lse)
        return self._merge_sinks(layer, view, q, out, lse) if self.sinks else out

    def _merge_sinks(self, layer: int, view, q: torch.Tensor, coded: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """One softmax over each row's sink rows and its coded keys: q (N, H, D), coded (N, H, D) the coded keys'
        normalized output and lse (N, H) their log-sum-exp (-inf: none read) -> (N, H, D). Every row of the batch at
        once: its sequence's entry of sink rows, masked to the positions it sees (rows past a short sequence's
        context hold zeros or an earlier sequence's finite rows, weighted 0)."""
        N, H, D = q.shape
        Hkv = self.geometry.n_kv_heads
        step = self._step(view)
        keys, values = self.sinks.held(layer, step.entry, self.sink)                     # (N, sink, Hkv, D), (N, sink, Hkv, Dv)
        qg = q.reshape(N, Hkv, H // Hkv, D)
        scores = torch.einsum("nkgd,nskd->nkgs", qg, keys).reshape(N, H, -1) * view.scale   # (N, H, sink)
        scores = scores.masked_fill(~step.sink_seen[:, None], float("-inf"))
        top = torch.maximum(lse, scores.amax(dim=-1))                                    # (N, H)
        w_coded = torch.exp(lse - top)                                                   # (N, H): 0 where none read
        w_sink = torch.exp(scores - top[..., None])                                      # (N, H, sink)
        total = w_coded + w_sink.sum(dim=-1)
        held = torch.einsum("nkgs,nskd->nkgd", w_sink.reshape(N, Hkv, H // Hkv, -1), values).reshape(N, H, -1)
        return (w_coded[..., None] * coded + held) / total[..., None]


class _StepRows:
    """A TurboQuant pool's facts about one step's rows, the same for every layer: each row's sequence and position,
    its sequence's sink entry, the sink tokens each chunk writes, the rows coded into blocks (their slots and, with
    +prerope or +ropemean, their RoPE rows) and the sink rows each row sees."""

    __slots__ = ("entry", "positions", "sink_writes", "coded", "coded_slots", "coded_rope", "sink_seen")

    @classmethod
    def build(cls, pool: "TurboPool", view) -> "_StepRows":
        step = cls()
        step.sink_writes = []                                                             # (entry, start, lo, hi)
        step.coded, step.coded_slots, step.coded_rope, step.sink_seen = None, view.slots, None, None
        step.positions = step.entry = None
        if not (pool.sinks or pool.codec.config.turns_keys):   # every row coded where its slot says, no position needed
            return step
        step.positions, rows = pool._token_rows(view)                                     # (N,) each
        if pool.sinks:
            step.entry = rows                                                             # (N,) its sequence's sink rows
            for s, lo, hi, start, ctx in pool.sequences(view):
                exact = min(ctx, pool.sink) - start                                       # this chunk's sink tokens
                if exact > 0:
                    step.sink_writes.append((view.rows[s], start, lo, lo + exact))
            if step.sink_writes:
                step.coded = step.positions >= pool.sink                                   # (N,)
                step.coded_slots = view.slots[step.coded.to(view.slots.device)]
            sink = torch.arange(pool.sink, device=pool.device)[None]                      # (1, sink)
            seen = sink <= step.positions[:, None]                                        # (N, sink)
            if view.window:
                seen &= sink > step.positions[:, None] - view.window
            step.sink_seen = seen
        if pool.codec.config.turns_keys:   # each coded key turned back from its position before it is coded
            cos, sin = pool._rope_rows(view)
            coded = step.positions if step.coded is None else step.positions[step.coded]
            step.coded_rope = cos[coded].contiguous(), sin[coded].contiguous()           # (n, D) each
        return step


def calibrated_codec(model, geometry: CacheGeometry, config, device, tokenizer=None, groups=None,
                     name: str | None = None) -> TqCodec:
    """A TqCodec of one row whose offsets, key weights and +norms8 centres come from the model on `calibration_ids`
    (the calibration text, with the tokenizer), read off a single TurboQuantCache that calibrated on them. With layer
    groups (LayerGroups, a model whose layers differ in kind) the codec holds every group's layers (pool layer j of
    group g at g·size + j, IntPool.state_layer) and calibrates through the model's own cache of the format `name`
    (model_cache: a cache per layer kind), each layer taking the state of the model layer it stands for."""
    one = replace(geometry, batch=1)
    if groups is not None:
        one = replace(one, n_layers=len(groups.members) * groups.size)
    codec = TqCodec(config, one, range(one.n_layers), 1, device, sink=config.full.sink)
    if config.center or config.key_weights or config.log_norms:
        if model is None:
            raise ConfigError("TurboQuant blocks are calibrated on the model: give the pool the model")
        if groups is None:
            probe = TurboQuantCache(replace(one, capacity=CALIBRATION_TOKENS), config=config, device=device)
        else:
            probe = model_cache(model.config, name, capacity=CALIBRATION_TOKENS, device=device)
        ids = torch.tensor([calibration_ids(model.config.vocab_size, tokenizer)], device=device)
        with torch.inference_mode():
            model(ids, probe, last_only=True)
        if groups is None:
            codec.take_calibration(probe.codec)
        else:   # model layer members[g][j] -> (its kind's cache, its index there)
            codec.take_calibration(None, {g * groups.size + j: (probe.where[layer][0].codec, probe.where[layer][1])
                                          for g, members in enumerate(groups.members) for j, layer in enumerate(members)})
    return codec


def make_pool(geometry: CacheGeometry, plan, device="cpu", model=None, tokenizer=None):
    """The pool for the plan's block format: dense (blocks.BlockPool), int or TurboQuant codes."""
    from .blocks import BlockPool
    from .formats import block_format

    fmt = block_format(plan.format, geometry, plan.block_size)
    if fmt.kind == "dense":
        return BlockPool(geometry, plan, device)
    if fmt.kind == "int":
        return IntPool(geometry, plan, fmt, device)
    layered = model is not None and len(set(model.config.layer_kinds)) > 1     # Gemma 3, Qwen3.5: the model's caches
    codec = calibrated_codec(model, geometry, fmt.config, device, tokenizer, plan.groups if layered else None,
                             fmt.cache_name)
    return TurboPool(geometry, plan, fmt, codec, device)
