"""The tensor names of a llama-family decoder in the two file formats kvlab reads: GGUF (llama.cpp's) and Hugging
Face safetensors. The loader (model/weights.py) and the native-block rule (sources/native.py) read them here.
"""

# canonical part -> (GGUF name, Hugging Face name); {i} is the layer index
LAYER_NAMES = {
    "attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    "q": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    "k": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    "v": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    "q_bias": ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    "k_bias": ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    "v_bias": ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    "o": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    "q_norm": ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    "k_norm": ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    "ffn_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    "gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    "up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
}
GLOBAL_NAMES = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}
#: index of each scheme's name in the pairs above
GGUF, HF = 0, 1
