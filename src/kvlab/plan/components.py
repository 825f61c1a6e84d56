"""Component: one line of the memory budget (what, the formula with the model's numbers, bytes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    formula: str
    bytes: int
    exact: bool = True      # False for estimates (compute buffers, CUDA context, activations)
    per_gpu: bool = False   # already divided across tensor-parallel GPUs
