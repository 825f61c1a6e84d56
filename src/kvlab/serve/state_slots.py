"""Recurrent state slots: the Gated DeltaNet layers' fixed state of each running sequence, beside the KV blocks.

    conv  (L_rec, max_batch, channels, kernel - 1)    fp32
    delta (L_rec, max_batch, v_heads, k_dim, v_dim)   fp32

allocated once (model/layer_caches.RecurrentState with one row per batch slot: state_elements × 4 bytes per slot,
the planner's formula). A sequence takes a slot, zeroed, the first time it runs after admission; it gives it back
when its blocks are freed (finish, abort, preemption: a preempted sequence is recomputed from its first token, which
rebuilds its state); a fork copies its parent's state into a slot of its own. `mix` runs a layer over a step: the
decoding sequences' states gathered by slot into one batch, each prefill chunk on its own slot in place.
"""

from __future__ import annotations

import torch

from ..model.layer_caches import RecurrentState
from .rows import SequenceRows


class StateSlots:
    def __init__(self, config, max_batch: int, device="cpu"):
        self.state = RecurrentState(config, max_batch, torch.float32, device)
        self.slots = SequenceRows(max_batch, "state slots")      # sequence -> its slot

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    @property
    def n_used(self) -> int:
        return len(self.slots)

    def slots_for(self, seqs) -> list[int]:
        """Each sequence's slot, a fresh zeroed one for a sequence that has none."""
        slots, taken = self.slots.take(seqs)
        for slot in taken:
            self.state.conv[:, slot].zero_()
            self.state.delta[:, slot].zero_()
        return slots

    def release(self, seq) -> None:
        self.slots.release(seq)

    def fork(self, parent, child) -> None:
        """The child goes on from the parent's state (the prompt both have read)."""
        if parent in self.slots:
            src, dst = self.slots[parent], self.slots_for([child])[0]
            self.state.conv[:, dst] = self.state.conv[:, src]
            self.state.delta[:, dst] = self.state.delta[:, src]

    def mix(self, layer: int, mixer, h: torch.Tensor, slots: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        """Recurrent layer `layer` over one step's rows h (1, N, C): sequence i owns rows [starts[i], starts[i] + sizes[i])
        and state slot slots[i]. Returns (1, N, C); the slots are advanced."""
        conv, delta = self.state.of(layer)                                    # (max_batch, ...) views
        out = torch.empty_like(h)
        decode = [i for i, n in enumerate(sizes) if n == 1]
        if decode:                                                            # one batch: gather, run, scatter back
            rows = torch.tensor([starts[i] for i in decode], device=h.device)
            index = torch.tensor([slots[i] for i in decode], device=conv.device)
            c, d = conv.index_select(0, index), delta.index_select(0, index)    # (B, ...) copies
            out[0, rows] = mixer(h[0, rows][:, None], c, d)[:, 0]              # (B, 1, C) -> (B, C)
            conv.index_copy_(0, index, c)
            delta.index_copy_(0, index, d)
        for i, n in enumerate(sizes):
            if n > 1:                                                         # a prefill chunk: its slot's views, in place
                s, lo = slots[i], starts[i]
                out[:, lo:lo + n] = mixer(h[:, lo:lo + n], conv[s:s + 1], delta[s:s + 1])
        return out
