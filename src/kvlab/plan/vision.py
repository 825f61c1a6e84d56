"""A vision projector (llama.cpp's --mmproj): its weights and the compute buffer that encoding one image takes.

llama.cpp's mtmd/clip loads the projector GGUF onto the GPU beside the model and, at warm-up, reserves the
compute buffer of the vision graph for the largest image it accepts. llama-server hands -fa to the encoder too
(mtmd flash_attn_type).

For Gemma 3's projector (a SigLIP tower, projector type `gemma3`) the buffer is exact: kvlab builds the graph
clip builds (plan/clip_graph.py) and walks it as ggml's graph allocator does (plan/ggml_graph.py), at CUDA's
128-byte alignment. Checked byte for byte against llama.cpp's clip (at the CPU's 32-byte alignment) on four
converted tiny towers of 196 to 1,024 patches, with and without flash attention
(tests/fixtures/llama_cpp_converted.json). The tower's facts come from the mmproj file's metadata (clip.vision.*)
when --mmproj names one, else from the catalog.

Other towers (Qwen-VL's, whose graph adds rotary positions and the patch merger) keep an estimate.
Without flash attention the buffer is dominated by one layer's attention scores, f32 [n_head, P, P] for P
patches, next to the MLP's activations, f32 [P, ffn] twice; with it the scores never materialize and what remains
is the image itself (f32, 3 channels), the MLP's activations and the attention's own [P, hidden] tensors:

    image buffer ≈ n_head × P² × 4 + 2 × P × ffn × 4                          (-fa off)
    image buffer ≈ 3 × side² × 4 + 2 × P × ffn × 4 + 4 × P × hidden × 4      (-fa on)     P = (side / patch)²

(on the tiny SigLIP tower of 1,024 patches these give 16.50 MiB and 3.30 MiB where llama.cpp reserves 16.75 and
3.45, 2-5% low; on the smaller tiny towers they are between 7% low and 32% high).
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
from .clip_graph import SiglipShape, gemma3_graph
from .ggml_graph import TYPE_SIZE, compute_buffer
from .weights import file_weights

#: the buffer alignment of the backend the encoder runs on: CUDA's (ggml-cuda get_alignment); the CPU's is 32
GPU_ALIGNMENT = 128
#: Gemma 3's average pool over the patch grid (clip.cpp's n_merge), unless the file says otherwise
GEMMA3_POOL = 4


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
    projector: str = ""      # llama.cpp's projector type where kvlab builds its graph ("gemma3"), else ""

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

    def siglip(self) -> SiglipShape | None:
        """The graph's facts for a projector type kvlab builds (the converter's tensor types), else None."""
        if self.projector != "gemma3":
            return None
        return SiglipShape(depth=self.depth, hidden=self.hidden, heads=self.heads, ffn=self.ffn, patch=self.patch,
                           image_side=self.image_side, pool=GEMMA3_POOL, text_hidden=self.text_hidden)

    def image_buffer(self, flash_attn: bool = False) -> int:
        """The estimate (any tower); ImageBuffer.of gives the exact bytes where the graph is known."""
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
    return VisionTower(**values, **extra, projector=str(vision.get("projector", "")))


@dataclass(frozen=True)
class ImageBuffer:
    """The compute buffer of the warm-up image encode: bytes, how they were found, whether exact."""

    bytes: int
    formula: str
    exact: bool

    @classmethod
    def of(cls, tower: VisionTower | None, shape: SiglipShape | None, flash_attn: bool,
           alignment: int = GPU_ALIGNMENT) -> ImageBuffer:
        """Exact for a modelled graph (`shape`, or the tower's own), else the tower's estimate, else nothing."""
        shape = shape or (tower.siglip() if tower else None)
        if shape is not None:
            graph = gemma3_graph(shape, flash_attn)
            side = shape.image_side // shape.patch
            return cls(compute_buffer(graph, alignment),
                       f"ggml's allocator over clip's Gemma 3 graph ({len(graph.nodes)} ops, {shape.image_side}px image, "
                       f"{side * side:,} patches of {shape.patch}px, {shape.depth} layers, "
                       f"{'flash' if flash_attn else 'no flash'} attention in the encoder, {alignment}-byte alignment)", True)
        if tower is None:
            return cls(0, "no vision tower facts: image buffer not counted", False)
        return cls(tower.image_buffer(flash_attn), tower.buffer_formula(flash_attn), False)


def clip_shape(metadata: dict[str, Any], tensor_types: dict[str, str]) -> SiglipShape | None:
    """A Gemma 3 projector's graph facts from its mmproj GGUF (clip.* metadata, tensor types by name), else None."""
    if str(metadata.get("clip.projector_type", "")) != "gemma3" or not metadata.get("clip.has_vision_encoder"):
        return None
    key = "clip.vision."
    try:
        facts = {name: int(metadata[key + field]) for name, field in (
            ("depth", "block_count"), ("hidden", "embedding_length"), ("heads", "attention.head_count"),
            ("ffn", "feed_forward_length"), ("patch", "patch_size"), ("image_side", "image_size"),
            ("text_hidden", "projection_dim"))}
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the mmproj's metadata lacks a usable {exc.args[0] if exc.args else 'field'}") from None
    types = {name: tensor_types.get(tensor, default).lower() for name, tensor, default in (
        ("patch_type", "v.patch_embd.weight", "f32"), ("projection_type", "mm.input_projection.weight", "f16"))}
    if any(t not in TYPE_SIZE for t in types.values()):
        return None   # a quantized patch embedding or projection: not a graph kvlab builds
    return SiglipShape(**facts, pool=int(metadata.get(key + "projector.scale_factor", GEMMA3_POOL)), **types)


def _file_shape(path: Path) -> SiglipShape | None:
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            return None
    from ..sources.gguf import open_gguf

    gguf_file = open_gguf(path)
    return clip_shape(gguf_file.metadata, {t.name: t.tensor_type.name for t in gguf_file.tensors})


@dataclass(frozen=True)
class Projector:
    """The projector the plan loads: its bytes and where they came from, and the image-encoding buffer."""

    bytes: int
    formula: str
    buffer: ImageBuffer
    file: str | None = None
    exact: bool = False

    @property
    def image_buffer(self) -> int:
        return self.buffer.bytes


def projector(value: str, tower: VisionTower | None, flash_attn: bool = False, alignment: int = GPU_ALIGNMENT) -> Projector:
    """--mmproj FILE | SIZE | auto ('auto': the catalog's tower of this model); `flash_attn`: llama-server's -fa.
    A Gemma 3 mmproj file's own metadata decides its image buffer; otherwise the catalog's tower does."""
    if value.strip().lower() == "auto":
        if tower is None:
            raise ConfigError("--mmproj auto needs a catalog model with a vision tower; give the projector's file or size")
        return Projector(tower.n_params * 2, f"{tower.n_params / 1e6:,.0f} M params of the vision tower × 2 B (BF16 mmproj)",
                         ImageBuffer.of(tower, None, flash_attn, alignment))
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_file():
            raise ConfigError(f"--mmproj {value}: not a file")
        buffer = ImageBuffer.of(tower, _file_shape(path), flash_attn, alignment)
        return Projector(file_weights(path), f"tensor table of {path.name}", buffer, file=str(path), exact=True)
    if path.suffix.lower() == ".gguf":
        raise ConfigError(f"--mmproj {value}: no such file")
    return Projector(parse_size(value, "--mmproj"), f"--mmproj {value}", ImageBuffer.of(tower, None, flash_attn, alignment))
