"""GGUF files of several architectures, written here from random transformers models, run as transformers runs them.

llama GGUFs store Q/K rows permuted for interleaved RoPE (as llama.cpp's converter writes them); qwen2/qwen3
keep the half layout. The engine must undo the first and leave the second alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.model.loader import load_model
from kvlab.sources.gguf import gguf_metadata, open_gguf

from .hybrid_models import add_byte_level_vocab


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: halves (i, i + D/2) -> pairs (2i, 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_gguf(path, arch: str, hf_model, tokenizer_meta: dict) -> None:
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") and cfg.rope_parameters else cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    add_byte_level_vocab(writer, tokenizer_meta)
    for name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                data = permute_for_interleaved_rope(data, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_of_each_arch_matches_transformers(tmp_path, smollm2, arch):
    import transformers

    tokenizer_meta = gguf_metadata(open_gguf(smollm2.path))
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=len(tokenizer_meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(1)
    source = getattr(transformers, model_cls)(config).eval()
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, source, tokenizer_meta)

    loaded = load_model(path)
    assert (loaded.config.arch, loaded.config.qk_norm, loaded.config.qkv_bias) == (arch, arch == "qwen3", arch == "qwen2")
    ids = torch.tensor([loaded.tokenizer.encode("Rotary embeddings, pairwise or by halves?")])
    with torch.no_grad():
        ours = loaded.model(ids, make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1])))
        ref_source = source(ids).logits
    assert (ours - ref_source).abs().max().item() < 1e-5
    if arch != "qwen3":  # transformers' GGUF reader ignores qwen3.attention.key_length (assumes head_dim 128)
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
        with torch.no_grad():
            assert (ours - reference.eval()(ids).logits).abs().max().item() < 1e-5


def test_llama3_gguf_rope_freqs_match_transformers_llama3_scaling(tmp_path, smollm2):
    """Llama 3.x GGUFs carry their long-context RoPE as a `rope_freqs` tensor of per-frequency factors."""
    import gguf
    import transformers

    from kvlab.model.config import DecoderConfig, RopeScaling
    from kvlab.model.llama import rope_inv_freq

    tokenizer_meta = gguf_metadata(open_gguf(smollm2.path))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer_meta["tokenizer.ggml.tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling=scaling, rope_theta=10000.0,
    )
    torch.manual_seed(2)
    source = transformers.LlamaForCausalLM(config).eval()
    plain = DecoderConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8)
    scaled = DecoderConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8,
                           rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    factors = (rope_inv_freq(plain).double() / rope_inv_freq(scaled).double()).numpy().astype(np.float32)
    assert factors.max() > 1.0  # the test model really is scaled
    path = tmp_path / "llama3.gguf"
    original_add = gguf.GGUFWriter.write_header_to_file

    def with_rope_freqs(writer, *args, **kwargs):
        writer.add_tensor("rope_freqs.weight", factors)
        return original_add(writer, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = with_rope_freqs
    try:
        write_gguf(path, "llama", source, tokenizer_meta)
    finally:
        gguf.GGUFWriter.write_header_to_file = original_add
    loaded = load_model(path)
    assert loaded.config.rope_freq_factors is not None
    ids = torch.tensor([loaded.tokenizer.encode("long context " * 12)])  # well past the 16 original positions
    with torch.no_grad():
        ours = loaded.model(ids, make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=ids.shape[1])))
        ref = source(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5
