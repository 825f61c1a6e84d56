"""Weights: GGUF tensors (dequantized) or safetensors, mapped onto the Decoder's parameter names.

GGUF files from llama.cpp store the Q and K projections of `llama` models permuted for interleaved
(pairwise) RoPE. The Decoder rotates halves (i, i + D/2) like Hugging Face, so those rows are permuted
back here; qwen2/qwen3 GGUFs already use the half layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ModelFileError
from ..paths import cache_dir
from ..sources.tensor_names import GGUF, HF  # noqa: F401  (the name schemes, importable from here)
from ..sources.tensor_names import GLOBAL_NAMES as _GLOBAL_NAMES
from ..sources.tensor_names import LAYER_NAMES as _LAYER_NAMES

WEIGHTS_FORMAT = 1  # bump when the canonical layout changes, to invalidate cached conversions


#: safetensors dtypes the engine reads (converted to fp32); GGUF integer types are never weights
SAFETENSORS_FLOATS = ("F32", "F16", "BF16", "F64")
_GGUF_NOT_WEIGHTS = ("I8", "I16", "I32", "I64")


def expected_shapes(cfg, scheme: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the Decoder reads for `cfg`: name -> (shape in PyTorch order, what sizes it)."""
    d, hd, ff, vocab = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        _GLOBAL_NAMES["embed"][scheme]: ((vocab, d), "(vocab, d_model)"),
        _GLOBAL_NAMES["norm"][scheme]: ((d,), "(d_model,)"),
    }
    if not cfg.tie_embeddings:
        shapes[_GLOBAL_NAMES["lm_head"][scheme]] = ((vocab, d), "(vocab, d_model)")
    per_layer = {
        "attn_norm": ((d,), "(d_model,)"), "ffn_norm": ((d,), "(d_model,)"),
        "q": ((q, d), "(n_head·head_dim, d_model)"), "k": ((kv, d), "(n_kv_head·head_dim, d_model)"),
        "v": ((kv, d), "(n_kv_head·head_dim, d_model)"), "o": ((d, q), "(d_model, n_head·head_dim)"),
        "gate": ((ff, d), "(d_ff, d_model)"), "up": ((ff, d), "(d_ff, d_model)"), "down": ((d, ff), "(d_model, d_ff)"),
    }
    if cfg.qkv_bias:
        per_layer.update({"q_bias": ((q,), "(n_head·head_dim,)"), "k_bias": ((kv,), "(n_kv_head·head_dim,)"),
                          "v_bias": ((kv,), "(n_kv_head·head_dim,)")})
    if cfg.qk_norm:
        per_layer.update({"q_norm": ((hd,), "(head_dim,)"), "k_norm": ((hd,), "(head_dim,)")})
    for i in range(cfg.n_layers):
        for part, shape in per_layer.items():
            shapes[_LAYER_NAMES[part][scheme].format(i=i)] = shape
    return shapes


def check_tensors(cfg, tensors: dict, scheme: int, source: str) -> None:
    """Every tensor the Decoder reads is in the file's table with exactly the shape the config gives it and a
    type the engine reads; checked on the header alone, before any weight is read, installed or given to C.
    One line names the tensor, the shape found and the shape expected."""
    values = config_values(cfg)
    for name, (shape, meaning) in expected_shapes(cfg, scheme).items():
        check_tensor(tensors, name, shape, meaning, scheme, source, values)


def config_values(cfg) -> str:
    """The config values a tensor's expected shape comes from, for the error that names a wrong one."""
    return (f"n_head={cfg.n_heads}, n_kv_head={cfg.n_kv_heads}, head_dim={cfg.head_dim}, d_model={cfg.d_model}, "
            f"d_ff={cfg.d_ff}, vocab={cfg.vocab_size}")


def check_tensor(tensors: dict, name: str, shape: tuple, meaning: str, scheme: int, source: str, values: str,
                 needed_by: str = "") -> None:
    """Tensor `name` of a file's table has `shape` (= `meaning` for the config `values`) and a weight type; else one
    line naming it (`needed_by`: which part of the model reads it, said when it is missing)."""
    info = tensors.get(name)
    if info is None:
        why = f" ({needed_by})" if needed_by else ""
        raise ModelFileError(f"{source}: tensor {name!r} is missing from the model file{why}")
    if tuple(info.shape) != shape:
        raise ModelFileError(f"{source}: tensor {name!r} has shape {tuple(info.shape)}, expected {shape} = {meaning} "
                             f"for {values}")
    if (scheme == HF and info.dtype not in SAFETENSORS_FLOATS) or (scheme == GGUF and info.dtype in _GGUF_NOT_WEIGHTS):
        raise ModelFileError(f"{source}: tensor {name!r} has type {info.dtype}, not a floating-point or block-quantized weight")


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (0,1),(2,3)… pairs -> halves (i, i + D/2)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def build_state_dict(get: Callable[[str], torch.Tensor | None], scheme: int, cfg, permute_qk: bool,
                     skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Assemble the Decoder's state dict from a source's tensors (`get(name)` -> tensor or None).

    `skip`: modules (e.g. "blocks.0.attn.qkv", "embed") whose weight is held another way (GGUF blocks,
    kvlab.model.blockquant); their weights are neither read nor assembled.
    """

    def need(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor is None:
            raise ModelFileError(f"tensor {name!r} is missing from the model file")
        return tensor

    state: dict[str, torch.Tensor] = {}
    if "embed" not in skip:
        state["embed.weight"] = need(_GLOBAL_NAMES["embed"][scheme])
    state["norm.weight"] = need(_GLOBAL_NAMES["norm"][scheme])
    if not cfg.tie_embeddings and "lm_head" not in skip:
        state["lm_head.weight"] = need(_GLOBAL_NAMES["lm_head"][scheme])
    for i in range(cfg.n_layers):
        def part(key: str, required: bool = True):
            name = _LAYER_NAMES[key][scheme].format(i=i)
            return need(name) if required else get(name)

        prefix = f"blocks.{i}."
        state[prefix + "attn_norm.weight"] = part("attn_norm")
        if prefix + "attn.qkv" not in skip:
            q, k, v = part("q"), part("k"), part("v")
            if permute_qk:
                q, k = unpermute_rope_rows(q, cfg.n_heads), unpermute_rope_rows(k, cfg.n_kv_heads)
            state[prefix + "attn.qkv.weight"] = torch.cat([q, k, v], dim=0)
        if cfg.qkv_bias:
            qb, kb, vb = part("q_bias"), part("k_bias"), part("v_bias")
            if permute_qk:
                qb, kb = unpermute_rope_rows(qb, cfg.n_heads), unpermute_rope_rows(kb, cfg.n_kv_heads)
            state[prefix + "attn.qkv.bias"] = torch.cat([qb, kb, vb], dim=0)
        if prefix + "attn.out" not in skip:
            state[prefix + "attn.out.weight"] = part("o")
        if cfg.qk_norm:
            state[prefix + "attn.q_norm.weight"] = part("q_norm")
            state[prefix + "attn.k_norm.weight"] = part("k_norm")
        state[prefix + "ffn_norm.weight"] = part("ffn_norm")
        if prefix + "ffn.gate_up" not in skip:
            state[prefix + "ffn.gate_up.weight"] = torch.cat([part("gate"), part("up")], dim=0)
        if prefix + "ffn.down" not in skip:
            state[prefix + "ffn.down.weight"] = part("down")
    return state


def dequantize_gguf_tensor(tensor) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in PyTorch's (rows, cols) order."""
    from gguf import quants

    try:
        values = quants.dequantize(tensor.read(), tensor.tensor_type)  # read, not mapped: see GGUFTensor.read
    except (NotImplementedError, ValueError) as exc:
        raise ModelFileError(f"tensor {tensor.name!r}: cannot dequantize {tensor.tensor_type.name} ({exc})") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest-moving dim first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy


def gguf_permutes_qk(cfg) -> bool:
    """llama.cpp stores Q/K rows permuted for interleaved RoPE in `llama`-style GGUFs only."""
    return cfg.arch in ("llama", "mistral")


def gguf_state_dict(reader, cfg, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str):
        return dequantize_gguf_tensor(tensors[name]) if name in tensors else None

    return build_state_dict(get, GGUF, cfg, permute_qk=gguf_permutes_qk(cfg), skip=skip)


def safetensors_state_dict(folder: Path, cfg) -> dict[str, torch.Tensor]:
    return build_state_dict(safetensors_getter(folder), HF, cfg, permute_qk=False)


def safetensors_getter(folder: Path) -> Callable[[str], torch.Tensor | None]:
    """name -> that tensor of the folder's safetensors files in fp32 (None where no file holds it)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors weights")
    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                where.update({name: path for name in handle.keys()})
        except Exception as exc:
            raise ModelFileError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None

    def get(name: str):
        if name not in where:
            return None
        with safe_open(str(where[name]), framework="pt") as handle:
            return handle.get_tensor(name).float()

    return get


# -- the dequantized-weights cache --------------------------------------------------------------
def converted_weights_path(model_file: Path) -> Path:
    """Where the dequantized copy of `model_file` lives: keyed by path, size and mtime."""
    stat = model_file.stat()
    key = json.dumps([str(model_file.resolve()), stat.st_size, stat.st_mtime_ns, WEIGHTS_FORMAT])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / "weights" / f"{model_file.stem}-{digest}.safetensors"


def load_or_convert(model_file: Path, convert: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dequantized weights from the safetensors cache, converting (and saving) on first use."""
    from safetensors.torch import load_file, save_file

    target = converted_weights_path(model_file)
    if target.is_file():
        try:
            return load_file(str(target))
        except Exception:
            target.unlink(missing_ok=True)  # a torn write from an interrupted run: convert again
    state = convert()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        os.replace(tmp, target)  # atomic: readers never see a half-written file
    except OSError:
        pass  # a read-only cache folder only costs speed
    return state
