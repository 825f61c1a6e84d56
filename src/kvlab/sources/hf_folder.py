"""Hugging Face models: config.json → ModelSpec; weights from safetensors headers only.

The per-layer kinds come from the config's own keys, in this order:
  layer_types            ["full_attention", "sliding_attention", "linear_attention", "mamba", ...]
  layers_block_type      ["attention", "mamba", ...] (Jamba, Granite 4)
  hybrid_override_pattern "M-M*-..." (Nemotron-H: M mamba, * attention, - MLP only)
  full_attention_interval every n-th layer full, the rest linear attention (Qwen3-Next, Qwen3.5)
  sliding_window_pattern  n-1 sliding layers then one full (Gemma 3)
  no_rope_layers + attention_chunk_size  Llama 4: the RoPE layers attend within chunks (a window of the chunk
                         size), the NoPE layers to everything; by default every 4th layer is NoPE and chunks are 8,192
  sliding_window (+ use_sliding_window)  every layer sliding (Mistral 7B v0.1)
then num_kv_shared_layers (the last n layers reuse earlier KV) and kv_lora_rank (MLA).

A safetensors header is an 8-byte little-endian length and that many bytes of JSON; nothing
else of the file is read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KvlabError, ModelFileError, OfflineError
from ..spec import LinearAttentionFacts, ModelSpec, MoEFacts, RopeScaling, RuntimeFacts, TensorInfo
from .layers import (LayerFacts, as_float, as_int, build_layers, check_number_keys, interval_kinds, layer_count, pattern_kinds, per_layer,
                     short, ssm_state_elements)
from .params import weight_tensors

#: bytes per element of safetensors dtypes
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}
_MAX_HEADER = 100 * 1024 * 1024

_LAYER_TYPE_KINDS = {
    "full_attention": "full", "attention": "full", "global": "full", "full": "full",
    "sliding_attention": "sliding", "sliding": "sliding", "local": "sliding", "chunked_attention": "sliding",
    "linear_attention": "recurrent", "mamba": "recurrent", "mamba2": "recurrent", "recurrent": "recurrent",
    "conv": "recurrent", "deltanet": "recurrent", "gated_deltanet": "recurrent",
    "none": "none", "mlp": "none", "moe": "none",
}


#: transformers model types whose sliding_window applies only when use_sliding_window is true (default false),
#: and then only to layers from max_window_layers on (default 28). Every other type: the window applies when
#: sliding_window is set, unless use_sliding_window is false.
_WINDOW_SWITCHED = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
_QWEN_MAX_WINDOW_LAYERS = 28
#: Where a model type keeps its KV head count. transformers' classes read num_key_value_heads (None: as many
#: as query heads); only Falcon names it otherwise.
_KV_HEAD_KEYS = {"falcon": ("num_kv_heads", "n_head_kv")}
#: Keys holding a count (a per-layer list allowed where True); checked for type before any is used.
_INT_KEYS = {
    "num_attention_heads": True, "num_key_value_heads": True, "num_kv_heads": True,
    "n_head_kv": True, "hidden_size": False, "intermediate_size": True, "vocab_size": False, "head_dim": False,
    "max_position_embeddings": False, "sliding_window": False, "max_window_layers": False,
    "sliding_window_pattern": False, "num_kv_shared_layers": False, "kv_lora_rank": False, "qk_rope_head_dim": False,
    "qk_nope_head_dim": False, "v_head_dim": False, "full_attention_interval": False, "attention_chunk_size": False,
    "num_experts": False, "num_local_experts": False, "n_routed_experts": False, "num_experts_per_tok": False,
    "linear_num_key_heads": False, "linear_num_value_heads": False, "linear_key_head_dim": False,
    "linear_value_head_dim": False, "linear_conv_kernel_dim": False, "moe_intermediate_size": False,
    "shared_expert_intermediate_size": False, "decoder_sparse_step": False,
}
_FLOAT_KEYS = ("rope_theta", "rms_norm_eps", "partial_rotary_factor", "rope_local_base_freq", "query_pre_attn_scalar")
#: model types of the Gemma 3 text decoder and of the hybrid Gated DeltaNet decoders (Qwen3.5, Qwen3-Next)
GEMMA3_TYPES = ("gemma3", "gemma3_text")
DELTANET_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
#: Llama 4's text decoder and transformers' defaults for its chunked attention (Llama4TextConfig)
LLAMA4_TYPES = ("llama4", "llama4_text")
LLAMA4_CHUNK = 8192
LLAMA4_NOPE_INTERVAL = 4
#: transformers' names of the feed-forward activations kvlab runs -> kvlab's
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _check_types(cfg: dict[str, Any], source: str) -> None:
    """A string, list or object where a number belongs is one ConfigError naming the key."""
    check_number_keys(cfg, _INT_KEYS, _FLOAT_KEYS, source)
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {short(cfg[key])}")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f"{source}: {key} must be an object, got {short(cfg[key])}")


def _token_ids(cfg: dict[str, Any], key: str, vocab: int, source: str) -> tuple[int, ...]:
    value = cfg.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    ids = tuple(as_int(v, f"{source}: {key}") for v in values)
    for i in ids:
        if vocab and i >= vocab:
            raise ConfigError(f"{source}: {key}={i} is outside the vocabulary of {vocab:,} tokens")
    return ids


def _runtime_facts(cfg: dict[str, Any], arch: str, vocab: int, head_dim: int, source: str,
                   tensors: dict[str, TensorInfo] | None) -> RuntimeFacts:
    """RoPE, norm, bias and head facts kvlab's model runtime needs, read with transformers' defaults for the model type."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    local = {}
    if isinstance(scaling.get("full_attention"), dict):  # per layer type (transformers 5's Gemma 3 configs)
        local = scaling.get("sliding_attention") or {}
        scaling = scaling["full_attention"]
    rope_type = scaling.get("rope_type", scaling.get("type"))
    rope_scaling = None
    if rope_type == "llama3":
        what = f"{source}: rope_scaling"
        try:
            rope_scaling = RopeScaling(
                factor=as_float(scaling["factor"], f"{what}.factor"),
                low_freq_factor=as_float(scaling["low_freq_factor"], f"{what}.low_freq_factor"),
                high_freq_factor=as_float(scaling["high_freq_factor"], f"{what}.high_freq_factor"),
                original_max_position=as_int(scaling["original_max_position_embeddings"], f"{what}.original_max_position_embeddings", 1),
            )
        except KeyError as exc:
            raise ConfigError(f"{what} of type llama3 lacks {exc.args[0]!r}") from None
    theta = cfg.get("rope_theta") or scaling.get("rope_theta") or (1_000_000.0 if arch in GEMMA3_TYPES else 10000.0)
    partial = _first(cfg, "partial_rotary_factor", default=scaling.get("partial_rotary_factor"))
    if partial is None and arch in DELTANET_TYPES:
        partial = 0.25                                   # transformers' default for these types
    family = _family_facts(cfg, arch, local, source)
    if arch in GEMMA3_TYPES and rope_type == "linear":   # Gemma 3's global layers: positions / factor
        family["rope_scaling_factor"] = as_float(scaling.get("factor"), f"{source}: rope_scaling.factor")
        rope_type = None
    bos = _token_ids(cfg, "bos_token_id", vocab, source)
    return RuntimeFacts(
        format="safetensors" if tensors else "config",
        d_ff=_first(cfg, "intermediate_size", default=0),
        rope_theta=as_float(theta, f"{source}: rope_theta"),
        rope_scaling=rope_scaling,
        rope_scaling_type=None if rope_type in (None, "default", "llama3") else str(rope_type),
        rope_dim=int(head_dim * as_float(partial, f"{source}: partial_rotary_factor")) if partial is not None else 0,
        rms_eps=as_float(cfg.get("rms_norm_eps", 1e-6), f"{source}: rms_norm_eps"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA3_TYPES)),
        qk_norm=arch == "qwen3" or arch in GEMMA3_TYPES or arch in DELTANET_TYPES,
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_id=bos[0] if bos else None,
        eos_ids=tuple(sorted(set(_token_ids(cfg, "eos_token_id", vocab, source)))),
        tensors=tensors or {},
        **family,
    )


def _family_facts(cfg: dict[str, Any], arch: str, local_rope: dict[str, Any], source: str) -> dict[str, Any]:
    """The RuntimeFacts fields only Gemma 3 and the Gated DeltaNet hybrids set (transformers' defaults for absent keys)."""
    act = str(_first(cfg, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh" if arch in GEMMA3_TYPES else "silu"))
    facts: dict[str, Any] = {"hidden_act": _ACTIVATIONS.get(act, act)}
    if arch in GEMMA3_TYPES:
        local_theta = _first(cfg, "rope_local_base_freq", default=local_rope.get("rope_theta", 10000.0))
        facts["rope_theta_local"] = as_float(local_theta, f"{source}: rope_local_base_freq")
        facts["query_pre_attn_scalar"] = as_float(cfg.get("query_pre_attn_scalar", 256), f"{source}: query_pre_attn_scalar")
    if cfg.get("final_logit_softcapping") is not None:
        facts["final_logit_softcap"] = as_float(cfg["final_logit_softcapping"], f"{source}: final_logit_softcapping")
    if arch in DELTANET_TYPES:
        facts["attn_output_gate"] = True
        if cfg.get("linear_num_value_heads") is not None:
            what = lambda key: f"{source}: {key}"  # noqa: E731
            v_heads = as_int(cfg["linear_num_value_heads"], what("linear_num_value_heads"), 1)
            facts["linear_attention"] = LinearAttentionFacts(
                k_heads=as_int(cfg.get("linear_num_key_heads", v_heads), what("linear_num_key_heads"), 1),
                v_heads=v_heads,
                k_dim=as_int(cfg.get("linear_key_head_dim", 128), what("linear_key_head_dim"), 1),
                v_dim=as_int(cfg.get("linear_value_head_dim", 128), what("linear_value_head_dim"), 1),
                conv_kernel=as_int(cfg.get("linear_conv_kernel_dim", 4), what("linear_conv_kernel_dim"), 1),
            )
        if cfg.get("num_experts"):
            what = lambda key: f"{source}: {key}"  # noqa: E731
            dense = cfg.get("mlp_only_layers") or []
            if not isinstance(dense, list):
                raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {short(dense)}")
            facts["moe"] = MoEFacts(
                n_experts=as_int(cfg["num_experts"], what("num_experts"), 1),
                top_k=as_int(cfg.get("num_experts_per_tok", 1), what("num_experts_per_tok"), 1),
                d_ff_expert=as_int(cfg.get("moe_intermediate_size"), what("moe_intermediate_size"), 1),
                d_ff_shared=as_int(cfg.get("shared_expert_intermediate_size", 0), what("shared_expert_intermediate_size")),
                norm_topk=bool(cfg.get("norm_topk_prob", True)),
                every=as_int(cfg.get("decoder_sparse_step", 1), what("decoder_sparse_step"), 1),
                dense_layers=tuple(as_int(i, what("mlp_only_layers")) for i in dense),
            )
    return facts


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (multimodal configs nest it under text_config / llm_config)."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and "num_hidden_layers" not in config:
            merged = {k: v for k, v in config.items() if k != key}
            merged.update(sub)
            return merged
    return config


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _recurrent_state(cfg: dict[str, Any]) -> int:
    """Recurrent state values per layer and sequence, from linear-attention or Mamba keys."""
    if cfg.get("linear_num_value_heads"):  # gated DeltaNet (Qwen3-Next, Qwen3.5)
        n_v = int(cfg["linear_num_value_heads"])
        n_k = int(cfg.get("linear_num_key_heads", n_v))
        d_k = int(cfg["linear_key_head_dim"])
        d_v = int(cfg["linear_value_head_dim"])
        return ssm_state_elements(int(cfg.get("linear_conv_kernel_dim", 4)), n_v * d_v, d_k, n_k)
    d_state = _first(cfg, "ssm_state_size", "mamba_d_state", "state_size")
    if d_state:  # Mamba-1/2 layers
        hidden = int(cfg["hidden_size"])
        heads = _first(cfg, "mamba_n_heads", "mamba_num_heads")
        head_dim = _first(cfg, "mamba_d_head", "mamba_head_dim")
        if heads and head_dim:                      # Mamba-2: heads × head dim
            d_inner = int(heads) * int(head_dim)
        elif cfg.get("state_size") and cfg.get("intermediate_size"):
            d_inner = int(cfg["intermediate_size"])  # Mamba-1 (transformers MambaConfig)
        else:
            d_inner = int(_first(cfg, "mamba_expand", "expand", default=2)) * hidden
        n_groups = int(_first(cfg, "mamba_n_groups", "n_groups", default=0))
        kernel = int(_first(cfg, "mamba_d_conv", "conv_kernel", "mamba_conv_kernel", "d_conv", default=4))
        return ssm_state_elements(kernel, d_inner, int(d_state), n_groups)
    return 0


def _kinds(cfg: dict[str, Any], n_layers: int, source: str) -> list[str]:
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) < n_layers:
            raise ConfigError(f"{source}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {n_layers}")
        kinds = []
        for t in layer_types[:n_layers]:
            if str(t) not in _LAYER_TYPE_KINDS:
                raise ConfigError(f"{source}: unknown layer type {t!r} in layer_types")
            kinds.append(_LAYER_TYPE_KINDS[str(t)])
        return kinds
    if cfg.get("model_type") in LLAMA4_TYPES:
        return _llama4_kinds(cfg, n_layers, source)
    block_types = cfg.get("layers_block_type")
    if isinstance(block_types, list) and block_types:
        return [_LAYER_TYPE_KINDS.get(str(t), "full") for t in block_types[:n_layers]]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return [{"M": "recurrent", "*": "full"}.get(c, "none") for c in pattern[:n_layers]]
    if cfg.get("attn_layer_period"):  # Jamba's older keys
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        return ["full" if i % period == offset else "recurrent" for i in range(n_layers)]
    if cfg.get("full_attention_interval"):
        return interval_kinds(n_layers, int(cfg["full_attention_interval"]))
    window = cfg.get("sliding_window")
    model_type = cfg.get("model_type")
    if window and model_type in _WINDOW_SWITCHED:
        if cfg.get("use_sliding_window") is not True:
            return ["full"] * n_layers
        first = as_int(cfg.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS), f"{source}: max_window_layers")
        return ["sliding" if i >= first else "full" for i in range(n_layers)]
    uses_window = window and cfg.get("use_sliding_window", True) is not False
    if uses_window and cfg.get("sliding_window_pattern"):
        return pattern_kinds(n_layers, as_int(cfg["sliding_window_pattern"], f"{source}: sliding_window_pattern"))
    if uses_window:
        return ["sliding"] * n_layers
    if _first(cfg, "ssm_state_size", "mamba_d_state", "state_size") and not cfg.get("num_attention_heads"):
        return ["recurrent"] * n_layers
    return ["full"] * n_layers


def _llama4_kinds(cfg: dict[str, Any], n_layers: int, source: str) -> list[str]:
    """Llama4TextConfig's layer_types: a layer with RoPE (no_rope_layers[i] = 1) attends within chunks unless
    attention_chunk_size is null; the default no_rope_layers puts NoPE (full attention) on every 4th layer."""
    if "attention_chunk_size" in cfg and cfg["attention_chunk_size"] is None:
        return ["full"] * n_layers
    rope = cfg.get("no_rope_layers")
    if not rope:
        interval = as_int(cfg.get("no_rope_layer_interval", LLAMA4_NOPE_INTERVAL), f"{source}: no_rope_layer_interval", 1)
        rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(rope, list) or len(rope) < n_layers or any(r not in (0, 1, True, False) for r in rope):
        raise ConfigError(f"{source}: no_rope_layers must list 0 or 1 for each of the {n_layers} layers")
    return ["sliding" if r else "full" for r in rope[:n_layers]]


def spec_from_config(config: dict[str, Any], name: str = "", source: str = "config.json",
                     weights_bytes: int = 0, n_params: int = 0,
                     tensors: dict[str, TensorInfo] | None = None, list_weights: bool = True) -> ModelSpec:
    """A ModelSpec from a transformers config dict (top level or nested text_config), with the runtime's facts.

    `tensors`: the safetensors headers' table, when the config comes with weights. `list_weights`: the architecture's
    tensor list (GGUF names and shapes, sources/params.py) goes in extra["weight_tensors"], where kvlab can list it,
    so the planner sizes GGUF quant schemes tensor by tensor without reading the config again.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: config must be a JSON object, got {type(config).__name__}")
    try:
        return _spec_from_config(config, name, source, weights_bytes, n_params, tensors, list_weights)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:  # a value the checks did not foresee
        raise ConfigError(f"{source}: malformed config ({type(exc).__name__}: {str(exc)[:200]})") from None


def _spec_from_config(config: dict[str, Any], name: str, source: str, weights_bytes: int, n_params: int,
                      tensors: dict[str, TensorInfo] | None, list_weights: bool) -> ModelSpec:
    cfg = text_config(config)
    _check_types(cfg, source)
    n_layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    if n_layers is None:
        raise ConfigError(f"{source}: no num_hidden_layers in the config")
    n_layers = layer_count(n_layers, f"{source}: num_hidden_layers")
    kinds = _kinds(cfg, n_layers, source)
    arch = str(_first(cfg, "model_type", default=config.get("model_type", "unknown")))

    n_heads_raw = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    attention_kinds = {"full", "sliding", "mla"}
    if n_heads_raw is None:
        if any(k in attention_kinds for k in kinds):
            raise ConfigError(f"{source}: no attention head count (num_attention_heads) in the config")
        n_heads_raw = 0
    n_heads = per_layer(n_heads_raw, n_layers, f"{source}: num_attention_heads")
    kv_keys = _KV_HEAD_KEYS.get(arch, ("num_key_value_heads",))
    n_kv_heads = per_layer(_first(cfg, *kv_keys, default=n_heads_raw), n_layers, f"{source}: {kv_keys[0]}")
    hidden = as_int(_first(cfg, "hidden_size", "n_embd", "d_model", default=0), f"{source}: hidden_size")
    max_heads = max(n_heads) if n_heads else 0
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = hidden // max_heads if max_heads and hidden else 0
    head_dim_v = int(cfg.get("v_head_dim") or head_dim) if not cfg.get("kv_lora_rank") else head_dim

    facts = LayerFacts(n_layers, kinds, n_heads, n_kv_heads, int(head_dim), int(head_dim_v),
                       window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None)
    chunk = cfg.get("attention_chunk_size", LLAMA4_CHUNK if arch in LLAMA4_TYPES else None)
    if chunk and "sliding" in kinds and not facts.window:
        facts.window = as_int(chunk, f"{source}: attention_chunk_size", 1)
    if cfg.get("kv_lora_rank"):  # multi-head latent attention: one latent + one RoPE key per token
        facts.kinds = ["mla" if k == "full" else k for k in facts.kinds]
        facts.kv_lora_rank = int(cfg["kv_lora_rank"])
        facts.rope_dim = int(cfg.get("qk_rope_head_dim", 64))
        facts.head_dim_k = int(cfg.get("qk_nope_head_dim", 128)) + facts.rope_dim
        facts.head_dim_v = int(cfg.get("v_head_dim", 128))
    if any(k == "recurrent" for k in facts.kinds):
        facts.state_elements = _recurrent_state(cfg)
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared:
        if not 0 < shared < n_layers:
            raise ConfigError(f"{source}: num_kv_shared_layers={shared} with {n_layers} layers")
        facts.kinds = facts.kinds[: n_layers - shared] + ["none"] * shared

    layers = build_layers(facts, source)
    n_ff = _first(cfg, "intermediate_size", "ffn_hidden_size", default=0) or 0
    extra = {
        "n_ff": int(max(n_ff) if isinstance(n_ff, list) and n_ff else n_ff or 0),
        "n_expert": int(_first(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0),
        "n_expert_used": int(_first(cfg, "num_experts_per_tok", "num_experts_per_token", default=0) or 0),
        "dtype": str(_first(cfg, "torch_dtype", "dtype", default="bfloat16")),
    }
    vocab = as_int(_first(cfg, "vocab_size", default=config.get("vocab_size", 0)) or 0, f"{source}: vocab_size")
    if tensors:
        _check_kv_projections(layers, tensors, source)
    listed = weight_tensors(cfg, list(layers))   # [] when kvlab does not know the family
    if list_weights and listed:
        extra["weight_tensors"] = listed
    if not n_params and not weights_bytes:  # a bare config.json: count the parameters from the architecture
        n_params = sum(t.numel for t in listed)
        extra["n_params_source"] = "architecture" if n_params else None
    return ModelSpec(
        name=name or str(_first(config, "_name_or_path", "model_type", default="model")),
        arch=arch,
        layers=layers,
        d_model=hidden,
        vocab_size=vocab,
        context_length=as_int(_first(cfg, "max_position_embeddings", "n_positions", "max_seq_len", default=0) or 0,
                              f"{source}: max_position_embeddings"),
        n_params=n_params,
        weights_bytes=weights_bytes,
        source=source,
        extra=extra,
        runtime=_runtime_facts(cfg, arch, vocab, int(head_dim), source, tensors),
    )


def _check_kv_projections(layers, tensors: dict[str, TensorInfo], source: str) -> None:
    """The K/V projections the safetensors hold (standard names) have the rows the config's KV heads need:
    otherwise the cache the planner sizes is not the model's."""
    for i, layer in enumerate(layers):
        if layer.kind not in ("full", "sliding"):
            continue
        for proj, dim in (("k_proj", layer.head_dim_k), ("v_proj", layer.head_dim_v)):
            info = tensors.get(f"model.layers.{i}.self_attn.{proj}.weight")
            if info is not None and (len(info.shape) != 2 or info.shape[0] != layer.n_kv_heads * dim):
                raise ModelFileError(
                    f"{source}: tensor {info.name!r} has shape {info.shape}, but the config's "
                    f"{layer.n_kv_heads} KV heads × head dim {dim} need {layer.n_kv_heads * dim} rows"
                )


# -- files ---------------------------------------------------------------------------------------

def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A config.json as a dict; anything else (a list, null, JSON nested past Python's limit) is one line."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except RecursionError:
        raise ModelFileError(f"{path}: JSON nested too deeply to be a model config") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: not a readable JSON config ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: config must be a JSON object, got {type(config).__name__}")
    return config


def _checked_entry(path: Path, name: str, info: Any, data_bytes: int) -> TensorInfo:
    """One safetensors header entry: a known dtype, a shape of non-negative ints, data inside the file."""
    if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPE_BYTES:
        raise ModelFileError(f"{path}: tensor {name[:80]!r} has no known dtype ({short(info)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ModelFileError(f"{path}: tensor {name[:80]!r} has shape {short(shape)}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise ModelFileError(f"{path}: tensor {name[:80]!r} has data_offsets {short(offsets)} outside the {data_bytes:,} bytes of data")
    n = 1
    for d in shape:
        n *= d
    if n * SAFETENSORS_DTYPE_BYTES[info["dtype"]] != offsets[1] - offsets[0]:
        raise ModelFileError(f"{path}: tensor {name[:80]!r} of shape {tuple(shape)} {info['dtype']} does not fill its "
                             f"{offsets[1] - offsets[0]:,} bytes")
    return TensorInfo(name, tuple(shape), info["dtype"])


def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a .safetensors file (8-byte length + JSON); tensor data is never read.

    Every entry is checked: a known dtype, a shape of non-negative integers whose bytes fill its
    data_offsets, and offsets inside the file."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ModelFileError(f"{path} is truncated: no safetensors header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER:
                raise ModelFileError(f"{path} is not a safetensors file (header length {n} is implausible)")
            raw = fh.read(n)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc})") from None
    if len(raw) < n:
        raise ModelFileError(f"{path} is truncated: header needs {n} bytes, file has {len(raw)}")
    try:
        header = json.loads(raw)
    except RecursionError:
        raise ModelFileError(f"{path} is not a safetensors file (header JSON nested too deeply)") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFileError(f"{path} is not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path} is not a safetensors file (header is not a JSON object)")
    data_bytes = size - 8 - n
    for tensor_name, info in header.items():
        if tensor_name != "__metadata__":
            _checked_entry(path, tensor_name, info, data_bytes)
    return header


def safetensors_tensors(headers: list[dict[str, Any]]) -> dict[str, TensorInfo]:
    """The tensor table of safetensors headers (as read_safetensors_header checked them)."""
    return {name: TensorInfo(name, tuple(info["shape"]), info["dtype"])
            for header in headers for name, info in header.items() if name != "__metadata__"}


def safetensors_weights(headers: list[dict[str, Any]]) -> tuple[int, int]:
    """(bytes, parameters) of all tensors listed in safetensors headers."""
    total_bytes = total_params = 0
    for header in headers:
        for tensor_name, info in header.items():
            if tensor_name == "__metadata__":
                continue
            n = 1
            for d in info.get("shape", []):
                n *= int(d)
            offsets = info.get("data_offsets")
            total_bytes += int(offsets[1] - offsets[0]) if offsets else int(n * SAFETENSORS_DTYPE_BYTES.get(info.get("dtype"), 2))
            total_params += n
    return total_bytes, total_params


def spec_from_folder(path: str | os.PathLike, config: dict[str, Any] | None = None) -> ModelSpec:
    """A HF model folder (config.json + *.safetensors) or a config.json path (`config`: already read from it)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    folder = config_path.parent
    config = read_config(config_path) if config is None else config
    headers = [read_safetensors_header(p) for p in sorted(folder.glob("*.safetensors"))]
    weights_bytes, n_params = safetensors_weights(headers)
    return spec_from_config(config, name=folder.name if path.is_dir() else config_path.stem,
                            source=str(config_path), weights_bytes=weights_bytes, n_params=n_params,
                            tensors=safetensors_tensors(headers))


# -- the Hub ---------------------------------------------------------------------------------------

def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _check_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """Fail fast when the Hub's host cannot even be resolved or connected to (the client would retry for ~25 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError as exc:
        raise OfflineError(f"{repo_id}: cannot reach the Hugging Face Hub at {endpoint.hostname} ({exc.strerror or exc}); "
                           "are you offline? give a local file, folder or catalog name") from None


def spec_from_hub(repo_id: str) -> ModelSpec:
    """config.json and the safetensors headers of a Hub repo (HTTP range reads of the headers only)."""
    if _offline():
        raise OfflineError(f"{repo_id}: looks like a Hugging Face repo id, but HF_HUB_OFFLINE is set; "
                           "give a local file, folder or catalog name")
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError:
        raise OfflineError(f"{repo_id}: huggingface_hub is not installed, so Hub repos cannot be fetched") from None
    _check_reachable(repo_id)
    try:
        config = read_config(hf_hub_download(repo_id, "config.json", etag_timeout=5))
        weights_bytes = n_params = 0
        try:
            info = HfApi().get_safetensors_metadata(repo_id)
            for file_meta in info.files_metadata.values():
                for tensor in file_meta.tensors.values():
                    n = 1
                    for d in tensor.shape:
                        n *= int(d)
                    n_params += n
                    weights_bytes += int(tensor.data_offsets[1] - tensor.data_offsets[0])
        except Exception:  # noqa: BLE001 - weights are optional (repos without safetensors)
            pass
    except KvlabError:
        raise
    except Exception as exc:  # noqa: BLE001 - network stacks raise many types
        kind = type(exc).__name__
        # LocalEntryNotFoundError is what huggingface_hub raises when it cannot reach the Hub at all
        if kind in ("RepositoryNotFoundError", "EntryNotFoundError", "RemoteEntryNotFoundError", "GatedRepoError"):
            raise ModelFileError(f"{repo_id}: no such repo (or no config.json) on the Hugging Face Hub") from None
        raise OfflineError(f"{repo_id}: cannot reach the Hugging Face Hub ({type(exc).__name__}); "
                           "are you offline? give a local file, folder or catalog name") from None
    return spec_from_config(config, name=repo_id, source=f"https://huggingface.co/{repo_id}/blob/main/config.json",
                            weights_bytes=weights_bytes, n_params=n_params,
                            list_weights=False)   # a Hub repo's quants are sized from its parameter count
