"""KVLayout: the bytes an engine allocates, layer by layer (K, V, recurrent state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerBytes:
    """One layer's cache as an engine allocates it.

    cells: token slots held for this layer over all sequences; k_row / v_row: bytes per slot
    (0 where the engine has no per-slot rows); state_bytes: recurrent state over all sequences.
    """

    index: int
    kind: str
    cells: int = 0
    k_row: int = 0
    v_row: int = 0
    state_bytes: int = 0
    k_total: int | None = None   # engines without per-slot rows give K and V bytes directly
    v_total: int | None = None

    @property
    def k_bytes(self) -> int:
        return self.cells * self.k_row if self.k_total is None else self.k_total

    @property
    def v_bytes(self) -> int:
        return self.cells * self.v_row if self.v_total is None else self.v_total


@dataclass(frozen=True)
class KVLayout:
    """Every layer's bytes plus the per-token rate; `kv_bytes` counts every K and V buffer
    (sliding-window ones included) and `recurrent_bytes` the recurrent state apart."""

    engine: str
    layers: tuple[LayerBytes, ...]
    bytes_per_token: int            # K+V bytes one token adds per sequence for good: full and MLA layers
    kv_type_k: str
    kv_type_v: str
    notes: tuple[str, ...] = ()
    sliding_bytes_per_token: int = 0   # what a token costs in the sliding-window layers while it is in their window

    @property
    def sliding_kv_bytes(self) -> int:
        """K+V of the sliding-window layers: a constant once the context passes their window."""
        return sum(layer.k_bytes + layer.v_bytes for layer in self.layers if layer.kind == "sliding")

    def per_token_by_kind(self) -> dict[str, int]:
        """K+V bytes per token of each layer kind (full, sliding, mla), where the engine has per-token rows."""
        split: dict[str, int] = {}
        for layer in self.layers:
            if layer.k_row or layer.v_row:
                split[layer.kind] = split.get(layer.kind, 0) + layer.k_row + layer.v_row
        return split

    @property
    def k_bytes(self) -> int:
        return sum(layer.k_bytes for layer in self.layers)

    @property
    def v_bytes(self) -> int:
        return sum(layer.v_bytes for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    @property
    def recurrent_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.recurrent_bytes

    def groups(self) -> list[tuple[str, int, LayerBytes]]:
        """(kind, how many layers, a representative) for runs of identical layers, in order of first use."""
        seen: dict[tuple, list] = {}
        for layer in self.layers:
            key = (layer.kind, layer.cells, layer.k_bytes, layer.v_bytes, layer.state_bytes)
            if key in seen:
                seen[key][1] += 1
            else:
                seen[key] = [layer.kind, 1, layer]
        return [tuple(v) for v in seen.values()]
