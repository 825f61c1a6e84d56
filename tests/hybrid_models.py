"""Tiny seeded llama / Gemma 3 / Qwen3.5 / Qwen3-Next models from transformers' own classes, saved as HF folders (with
kvlab's tokenizer, or `word_tokenizer`'s synthetic one where no vocabulary is at hand) and written as GGUF the way
llama.cpp's convert_hf_to_gguf.py writes them (its tensor names from gguf-py's TensorNameMap, and its transforms:
norms + 1, A_log -> -exp(A_log), dt_bias -> ssm_dt.bias, the conv squeezed, qwen35's value heads tiled, Qwen3-Next's
in_proj_qkvz split into attn_qkv and attn_gate)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512)
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
WINDOW = 8   # Gemma 3's sliding window in these tests: prompts run well past it
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}


def build(arch: str, vocab: int, seed: int = 0, **overrides):
    """A tiny random transformers model of `arch` (llama, qwen3_5, qwen3_next, gemma3) with weights large enough that
    the logits spread over several units (transformers' 0.02 init leaves them near zero), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    sizes, deltanet = {**SIZES, "num_hidden_layers": 4}, dict(DELTANET)     # overrides replace these
    for key in [k for k in overrides if k in sizes or k in deltanet]:
        (sizes if key in sizes else deltanet)[key] = overrides.pop(key)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, **sizes, tie_word_embeddings=False, **overrides)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(vocab_size=vocab, **sizes, **deltanet, **overrides)
        model = transformers.Qwen3_5ForCausalLM(config)
    elif arch == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(vocab_size=vocab, **sizes, **deltanet, **EXPERTS,
                                                   **overrides)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    elif arch in ("qwen3_next", "qwen3_next_moe"):
        experts = {**EXPERTS, "mlp_only_layers": [1]} if arch == "qwen3_next_moe" else {"num_experts": 0}
        config = transformers.Qwen3NextConfig(vocab_size=vocab, **sizes, **deltanet, **experts,
                                              **overrides)
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        options = dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24,
                       rope_scaling={"rope_type": "linear", "factor": 8.0})
        options.update(overrides)
        config = transformers.Gemma3TextConfig(vocab_size=vocab, **sizes, **options)
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:          # decays of e^-0.05 .. e^-0.7 per token: a 64-token chunk stays far from
                p.uniform_(-2.5, -0.5)   # subnormal floats (transformers' reference would crawl through them)
            elif "norm" in name or "dt_bias" in name:
                low = 0.5 if arch == "llama" else -0.5      # llama's norms scale by w, the others' by 1 + w
                p.uniform_(low, low + 1.0)
            elif p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.eval()


def word_tokenizer(vocab: int):
    """A kvlab Tokenizer of `vocab` whitespace-separated words: a tokenizer.json for a model folder that needs no
    downloaded vocabulary. Ids 1 and 2 are `<|im_start|>` and `<|im_end|>`, what save_folder's tokenizer_config names
    and transformers' llama config (bos 1, eos 2) says."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    from kvlab.model.tokenizer import Tokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(3, vocab)]
    backend = HFTokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(words[1:3])
    return Tokenizer(backend=backend, bos_id=1, eos_ids=(2,))


def save_folder(model, folder: Path, tokenizer) -> Path:
    """config.json + safetensors + the tokenizer (kvlab's Tokenizer, saved as tokenizer.json)."""
    model.save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return folder


def _tile_value_heads(t: torch.Tensor, k_heads: int, per_k: int, dim: int = 0) -> torch.Tensor:
    """convert_hf_to_gguf's _reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    head = shape[dim] // (k_heads * per_k)
    grouped = t.reshape(*shape[:dim], k_heads, per_k, head, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


GGUF_ARCHS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next", "qwen3_next_moe": "qwen3next",
              "gemma3": "gemma3"}


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, transformed as its converter does."""
    import gguf

    cfg = model.config
    gguf_arch = {"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE, "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT,
                 "gemma3": gguf.MODEL_ARCH.GEMMA3}[GGUF_ARCHS[arch]]
    names = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    out = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        if arch == "gemma3" and name == "lm_head.weight":
            continue                                                   # tied: llama.cpp skips it
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        if arch.startswith("qwen3_5") and "linear_attn." in name:
            t = _qwen35_tiled(t, name, cfg)
        if name.endswith("mlp.experts.gate_up_proj"):                # transformers holds (E, 2F, C): llama.cpp two (E, F, C)
            layer = name.split(".")[2]
            gate, up = t.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate.numpy())
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(up.numpy())
            continue
        if name.endswith("mlp.experts.down_proj"):
            name = name + ".weight"
        if name.endswith("in_proj_qkvz.weight"):                       # Qwen3-Next: [q, k, v, z] per key head -> qkv, z
            nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            per_k = cfg.linear_num_value_heads // nk
            q, k, v, z = t.reshape(nk, -1, t.shape[-1]).split((dk, dk, per_k * dv, per_k * dv), dim=1)
            layer = name.split(".")[2]
            out[f"blk.{layer}.attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)]).numpy()
            out[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, t.shape[-1]).numpy()
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None and arch == "qwen3_next" and ".mlp." in name:   # llama.cpp's qwen3next is MoE-only
            gguf_name = name.replace("model.layers.", "blk.").replace("mlp.gate_proj", "ffn_gate").replace(
                "mlp.up_proj", "ffn_up").replace("mlp.down_proj", "ffn_down")
        assert gguf_name is not None, name
        out[gguf_name] = np.ascontiguousarray(t.numpy())
    return out


def _qwen35_tiled(t: torch.Tensor, name: str, cfg) -> torch.Tensor:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, per_k = cfg.linear_key_head_dim, nv // nk
    if per_k == 1:
        return t
    if ".in_proj_qkv." in name or ".conv1d" in name:
        qk = 2 * nk * dk
        return torch.cat((t[:qk], _tile_value_heads(t[qk:], nk, per_k)))
    if ".in_proj_z." in name:
        return _tile_value_heads(t, nk, per_k)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith(".A_log") or ".dt_proj" in name:
        return _tile_value_heads(t, nk, per_k)
    if ".out_proj." in name:
        return _tile_value_heads(t, nk, per_k, dim=1)
    return t


def write_gguf(model, arch: str, path: Path, tokenizer_meta: dict, drop: str | None = None) -> Path:
    """A GGUF of the model with llama.cpp's metadata keys for `arch` (`drop`: a tensor left out, for error tests)."""
    import gguf

    cfg = model.config
    name = GGUF_ARCHS[arch]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_name(f"tiny-{name}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    if getattr(cfg, "intermediate_size", None):
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_uint32(f"{name}.attention.sliding_window_pattern", 2)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        assert local["rope_theta"] == 10000.0  # llama.cpp's default for the sliding layers
    else:
        rope = cfg.rope_parameters
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)))
        writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        writer.add_ssm_state_size(cfg.linear_key_head_dim)
        writer.add_ssm_group_count(cfg.linear_num_key_heads)
        writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        writer.add_full_attention_interval(4)
        if getattr(cfg, "num_experts", 0):
            writer.add_expert_count(cfg.num_experts)
            writer.add_expert_used_count(cfg.num_experts_per_tok)
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer_meta.get("tokenizer.ggml.model") == "llama":  # SentencePiece: every key as given
        for key, value in tokenizer_meta.items():
            writer.add_key_value(key, value, *_gguf_type(gguf, value))
    else:
        add_byte_level_vocab(writer, tokenizer_meta)
    for tensor_name, data in gguf_tensors(model, arch).items():
        if tensor_name != drop:
            writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_type(gguf, value) -> tuple:
    """(type, sub_type) of a tokenizer key's value for GGUFWriter.add_key_value."""
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
             str: gguf.GGUFValueType.STRING}
    if isinstance(value, list):  # as llama.cpp reads them: token ids uint32, token types int32
        item = gguf.GGUFValueType.INT32 if isinstance(value[0], int) else kinds[type(value[0])]
        return gguf.GGUFValueType.ARRAY, item
    return kinds[type(value)], None


def add_byte_level_vocab(writer, tokenizer_meta: dict) -> None:
    """A byte-level BPE vocabulary ('gpt2', as SmolLM2's GGUF has it) from another GGUF's tokenizer metadata."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer_meta["tokenizer.ggml.tokens"])
    writer.add_token_types(tokenizer_meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(tokenizer_meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(tokenizer_meta["tokenizer.ggml.eos_token_id"])
