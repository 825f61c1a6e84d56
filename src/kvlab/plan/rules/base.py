"""RuleSet: the allocation rules of one inference engine (llama.cpp, vLLM, kvlab)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...spec import ModelSpec
from ..components import Component
from ..layout import KVLayout
from ..settings import PlanSettings
from ..weights import WeightsEstimate, weights_bytes

GiB = 1 << 30
MiB = 1 << 20


def pad(value: int, multiple: int) -> int:
    """Round up to a multiple (GGML_PAD)."""
    return -(-value // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RuleSet(ABC):
    """What an engine allocates for a model and settings."""

    name: str = ""
    version: str = ""          # the engine version whose source these rules follow
    max_parallel: int = 4096   # upper bound when solving for sequences
    default_headroom: int = 0  # bytes the solvers keep free unless --headroom says otherwise
    headroom_reason: str = "none kept: the budget is the card's usable memory"

    @abstractmethod
    def layout(self, spec: ModelSpec, settings: PlanSettings) -> KVLayout:
        """KV and recurrent bytes, per layer."""

    @abstractmethod
    def overheads(self, spec: ModelSpec, settings: PlanSettings, layout: KVLayout) -> list[Component]:
        """Everything besides weights and caches: compute buffers, runtime, activations."""

    def weights(self, spec: ModelSpec, quant: str | None) -> WeightsEstimate:
        """The weights as this engine holds them: by default as stored (or params × the quant's bits)."""
        return weights_bytes(spec, quant)

    def budget_bytes(self, vram_bytes: int, usable_bytes: int, settings: PlanSettings) -> int:
        """Bytes this engine may use on a GPU of `vram_bytes` of which `usable_bytes` are free."""
        return usable_bytes
