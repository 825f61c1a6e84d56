"""A vision projector (llama.cpp's --mmproj): its weights and the compute buffer that encoding one image takes.

llama.cpp's mtmd/clip loads the projector GGUF onto the GPU beside the model and, at warm-up, reserves the
compute buffer of the vision graph for the largest image it accepts. llama-server hands -fa to the encoder too
(mtmd flash_attn_type). Without flash attention that buffer is dominated by one layer's attention scores,
f32 [n_head, P, P] for P patches, next to the MLP's activations, f32 [P, ffn] twice; with it the scores never
materialize and what remains is the image itself (f32, 3 channels), the MLP's activations and the attention's
own [P, hidden] tensors:

    image buffer ≈ n_head × P² × 4 + 2 × P × ffn × 4                          (-fa off)
    image buffer ≈ 3 × side² × 4 + 2 × P × ffn × 4 + 4 × P × hidden × 4      (-fa on)     P = (side / patch)²

(measured with llama.cpp's clip on a converted tiny SigLIP tower of 1,024 patches: 16.75 MiB without flash
attention, 3.45 MiB with; these formulas give 16.50 and 3.30: tests/fixtures/llama_cpp_converted.json).
The weights of a catalog tower are counted from its dimensions (ViT blocks, patch and position embeddings,
the merger into the language model) at 2 bytes (the BF16/F16 mmproj files); a file given with --mmproj is
measured from its tensor table, and a size (0.92GB) is taken as stated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sources.layers import as_int
from ..limits import parse_size
from .weights import file_weights


@dataclass(frozen=True)
class VisionTower:
    """A ViT encoder as the catalog describes it (the `vision` block of an entry)."""

    depth: int
    hidden: int
    heads: int
    ffn: int
    patch: int
    image_side: int          # pixels of the largest (warm-up) image
    merge: int = 1           # spatial merge (Qwen-VL: 2×2 patches -> one token)
    text_hidden: int = 0     # the language model's width the projector maps into
    channels_time: int = 1   # Qwen-VL's patch embedding spans 2 frames

    @property
    def patches(self) -> int:
        return (self.image_side // self.patch) ** 2

    @property
    def n_params(self) -> int:
        h, f = self.hidden, self.ffn
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h       # q k v o (+ biases), fc1 fc2 (+ biases), 2 norms
        merged = h * self.merge * self.merge
        projector = merged * merged + merged + merged * self.text_hidden + self.text_hidden
        embeddings = 3 * self.channels_time * self.patch * self.patch * h + h + self.patches * h
        return self.depth * block + embeddings + projector

    def image_buffer(self, flash_attn: bool = False) -> int:
        p = self.patches
        mlp = 2 * p * self.ffn * 4
        if flash_attn:
            return 3 * self.image_side ** 2 * 4 + mlp + 4 * p * self.hidden * 4
        return self.heads * p * p * 4 + mlp

    def buffer_formula(self, flash_attn: bool = False) -> str:
        p = self.patches
        where = f"({self.image_side}px image, {p:,} patches of {self.patch}px, "
        if flash_attn:
            return (f"image 3×{self.image_side}²×4 + mlp 2×{p}×{self.ffn}×4 + attention 4×{p}×{self.hidden}×4 "
                    + where + "flash attention in the encoder)")
        return f"scores {self.heads}×{p}²×4 + mlp 2×{p}×{self.ffn}×4 " + where + "no flash attention in the encoder)"


def tower_from_catalog(vision: dict[str, Any]) -> VisionTower:
    what = "catalog vision"
    keys = ("depth", "hidden", "heads", "ffn", "patch", "image_side")
    try:
        values = {k: as_int(vision[k], f"{what}.{k}", 1) for k in keys}
    except KeyError as exc:
        raise ConfigError(f"{what} lacks {exc.args[0]!r}") from None
    extra = {k: as_int(vision.get(k, 1 if k != "text_hidden" else 0), f"{what}.{k}") for k in ("merge", "text_hidden", "channels_time")}
    return VisionTower(**values, **extra)


@dataclass(frozen=True)
class Projector:
    """The projector the plan loads: its bytes and where they came from, and the image-encoding buffer."""

    bytes: int
    formula: str
    image_buffer: int
    buffer_formula: str
    file: str | None = None
    exact: bool = False


def projector(value: str, tower: VisionTower | None, flash_attn: bool = False) -> Projector:
    """--mmproj FILE | SIZE | auto ('auto': the catalog's tower of this model); `flash_attn`: llama-server's -fa."""
    buffer = tower.image_buffer(flash_attn) if tower else 0
    buffer_formula = tower.buffer_formula(flash_attn) if tower else "no vision tower facts: image buffer not counted"
    if value.strip().lower() == "auto":
        if tower is None:
            raise ConfigError("--mmproj auto needs a catalog model with a vision tower; give the projector's file or size")
        return Projector(tower.n_params * 2, f"{tower.n_params / 1e6:,.0f} M params of the vision tower × 2 B (BF16 mmproj)",
                         buffer, buffer_formula)
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"--mmproj {value}: not a file")
        return Projector(file_weights(path), f"tensor table of {path.name}", buffer, buffer_formula, file=str(path), exact=True)
    if path.suffix.lower() == ".gguf":
        raise ConfigError(f"--mmproj {value}: no such file")
    return Projector(parse_size(value, "--mmproj"), f"--mmproj {value}", buffer, buffer_formula)
