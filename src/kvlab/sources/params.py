"""Parameters from a Hugging Face config's architecture: the tensors a checkpoint stores (named as llama.cpp names
them in a GGUF, so a quant scheme can type each one: plan/quants.py) and their count, for a bare config.json.

Tensor by tensor, for the families the catalog holds:
  dense decoders    llama, mistral, qwen2, qwen3, phi3, gemma2/3, smollm (GQA, biases, q/k norms, sandwich norms)
  mixture of experts mixtral, qwen2_moe/qwen3_moe, qwen3_next, gpt-oss (biased experts, sinks), deepseek v2/v3
                    (multi-head latent attention, shared experts, leading dense layers)
  hybrids           gated DeltaNet layers (qwen3-next, qwen3.5), Mamba-1
The per-layer attention shapes come from the same LayerSpecs the planner uses. A key missing from the
config takes its transformers default for that model type (config.json leaves out values equal to the
default). The count is what a checkpoint stores (parameters, tied ones once, and saved buffers such as
DeepSeek-V3's router bias), tested against transformers' own models built from the same configs and
against the safetensors files save_pretrained writes. An architecture it does not know counts 0 (unknown), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..spec import LayerSpec

#: transformers' defaults for the keys below, where they differ from "absent = off / 0"
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "mamba", "falcon_mamba"}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_oss": {"attention_bias": True},
    "deepseek_v2": {"n_shared_experts": 2, "first_k_dense_replace": 0, "moe_intermediate_size": 1407},
    "deepseek_v3": {"n_shared_experts": 1, "first_k_dense_replace": 3, "moe_intermediate_size": 2048},
    "kimi_k2": {"n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 2048},
    "glm4_moe": {"n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_routed_experts": 128},
    "qwen3_5_moe": {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "qwen3_5_moe_text": {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "qwen3_moe": {"moe_intermediate_size": 768},
    "qwen3_next": {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "qwen2_moe": {"moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
}
_QKV_BIAS = {"qwen2", "qwen2_moe"}                    # biases on q, k, v (not o), with no config key
_QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl",
            "qwen3_vl_text", "gemma3", "gemma3_text"}  # an RMSNorm of head_dim over each head's q and k
_SANDWICH_NORMS = {"gemma2", "gemma3", "gemma3_text"}  # pre/post norms around attention and around the MLP
_GATED_ATTENTION = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}  # q_proj also emits a gate
_QKV_BIAS_KEYED = {"glm4_moe"}                        # attention_bias puts biases on q, k, v only (o has none)
_ROUTER_BIAS = {"deepseek_v3", "kimi_k2", "glm4_moe"}  # the router's saved score-correction bias
_LEADING_DENSE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe"}  # the first k layers keep a dense MLP
_QWEN_SHARED = {"qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}  # one shared expert with a sigmoid gate
_SINKS = {"gpt_oss"}                                  # one learned attention sink logit per head
_BIASED_EXPERTS = {"gpt_oss"}                         # router and expert projections carry biases
_DENSE = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gemma3_text", "smollm3",
          "qwen3_vl", "qwen3_vl_text", "qwen3_5", "qwen3_5_text", "granite", "olmo"}
_MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss", "deepseek_v2",
        "deepseek_v3", "kimi_k2", "glm4_moe"}


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    if value is not None:
        return value
    return _DEFAULTS.get(str(cfg.get("model_type")), {}).get(key, default)


def _int(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    """A non-negative whole number from the config; anything else is a one-line error naming the key."""
    value = _get(cfg, key, default)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():  # 4096.0 is a whole number; NaN and inf are not
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json: {key} must be a non-negative whole number, got {value!r}")
    return value


@dataclass(frozen=True)
class WeightTensor:
    """One stored tensor, named as llama.cpp names it in a GGUF (token_embd, blk.3.attn_v, blk.3.ffn_down_exps ...).

    shape: rows first, the row (llama.cpp's ne[0], the dimension quantized in blocks) last; experts stack first."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None    # the block it belongs to (None: embeddings, output, final norm)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def role(self) -> str:
        """The name without its block: attn_v, ffn_down_exps, token_embd ..."""
        return self.name.split(".", 2)[2] if self.name.startswith("blk.") else self.name

    @property
    def is_expert(self) -> bool:
        return self.role.endswith("_exps") or self.role.endswith("_exps.bias")


def count_params(cfg: dict[str, Any], layers: list[LayerSpec]) -> int:
    """Parameters of the language model described by `cfg` (the text config), or 0 when the family is unknown."""
    return sum(t.numel for t in weight_tensors(cfg, layers))


def weight_tensors(cfg: dict[str, Any], layers: list[LayerSpec]) -> list[WeightTensor]:
    """Every tensor a checkpoint of this architecture stores (tied ones once), or [] when the family is unknown."""
    model_type = str(cfg.get("model_type", ""))
    if model_type == "mamba":
        return _mamba(cfg)
    if model_type not in _DENSE | _MOE:
        return []
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    if not hidden or not vocab or not layers:
        return []
    tied = bool(_get(cfg, "tie_word_embeddings", model_type in _TIED_BY_DEFAULT))
    tensors = [WeightTensor("token_embd", (vocab, hidden))]
    for i, layer in enumerate(layers):
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if model_type in _SANDWICH_NORMS else [])
        mixer = _attention(cfg, layer, hidden) if layer.kind in ("full", "sliding") else \
            _latent_attention(cfg, layer, hidden) if layer.kind == "mla" else \
            _gated_deltanet(cfg, hidden) if layer.kind == "recurrent" else None
        if mixer is None:
            return []  # a layer kind this counter does not know
        block = [(name, (hidden,)) for name in norms] + mixer + _mlp(cfg, i, hidden)
        tensors += [WeightTensor(f"blk.{i}.{name}", shape, i) for name, shape in block]
    tensors.append(WeightTensor("output_norm", (hidden,)))
    if not tied:
        tensors.append(WeightTensor("output", (vocab, hidden)))
    return tensors


Shapes = list[tuple[str, tuple[int, ...]]]


def _attention(cfg: dict[str, Any], layer: LayerSpec, hidden: int) -> Shapes:
    model_type = str(cfg.get("model_type"))
    q_out = layer.n_heads * layer.head_dim_k
    k_out, v_out = layer.n_kv_heads * layer.head_dim_k, layer.n_kv_heads * layer.head_dim_v
    shapes: Shapes = [("attn_q", (q_out * (2 if model_type in _GATED_ATTENTION else 1), hidden)),
                      ("attn_k", (k_out, hidden)), ("attn_v", (v_out, hidden)), ("attn_output", (hidden, q_out))]
    if _get(cfg, "attention_bias", False) and model_type in _QKV_BIAS_KEYED:
        shapes += [("attn_q.bias", (q_out,)), ("attn_k.bias", (k_out,)), ("attn_v.bias", (v_out,))]
    elif _get(cfg, "attention_bias", False):
        shapes += [("attn_q.bias", (q_out,)), ("attn_k.bias", (k_out,)), ("attn_v.bias", (v_out,)), ("attn_output.bias", (hidden,))]
    elif model_type in _QKV_BIAS:
        shapes += [("attn_q.bias", (q_out,)), ("attn_k.bias", (k_out,)), ("attn_v.bias", (v_out,))]
    if model_type in _QK_NORM or (model_type == "glm4_moe" and _get(cfg, "use_qk_norm", False)):
        shapes += [("attn_q_norm", (layer.head_dim_k,)), ("attn_k_norm", (layer.head_dim_k,))]
    if model_type in _SINKS:
        shapes.append(("attn_sinks", (layer.n_heads,)))
    return shapes


def _latent_attention(cfg: dict[str, Any], layer: LayerSpec, hidden: int) -> Shapes:
    """DeepSeek's multi-head latent attention: low-rank q (optional) and one compressed KV latent."""
    heads, rope, latent = layer.n_heads, layer.rope_dim, layer.kv_lora_rank
    nope = layer.head_dim_k - rope
    q_rank = _int(cfg, "q_lora_rank")
    q: Shapes = ([("attn_q_a", (q_rank, hidden)), ("attn_q_a_norm", (q_rank,)), ("attn_q_b", (heads * (nope + rope), q_rank))]
                 if q_rank else [("attn_q", (heads * (nope + rope), hidden))])
    kv: Shapes = [("attn_kv_a_mqa", (latent + rope, hidden)), ("attn_kv_a_norm", (latent,)),
                  ("attn_kv_b", (heads * (nope + layer.head_dim_v), latent))]
    return q + kv + [("attn_output", (hidden, heads * layer.head_dim_v))]


def _gated_deltanet(cfg: dict[str, Any], hidden: int) -> Shapes | None:
    """Qwen3-Next / Qwen3.5 linear attention: q, k, v, z, b, a projections, a causal conv, decay, norm, out."""
    n_v = _int(cfg, "linear_num_value_heads")
    if not n_v:
        return None  # Mamba-2 and other recurrent layers inside a transformer: not counted
    n_k = _int(cfg, "linear_num_key_heads") or n_v
    d_k, d_v = _int(cfg, "linear_key_head_dim") or 128, _int(cfg, "linear_value_head_dim") or 128
    kernel = _int(cfg, "linear_conv_kernel_dim") or 4
    key_dim, value_dim = n_k * d_k, n_v * d_v
    return [("attn_qkv", (2 * key_dim + value_dim, hidden)), ("attn_gate", (value_dim, hidden)),
            ("ssm_beta", (n_v, hidden)), ("ssm_alpha", (n_v, hidden)), ("ssm_conv1d", (2 * key_dim + value_dim, kernel)),
            ("ssm_dt", (n_v,)), ("ssm_a", (n_v,)), ("ssm_norm", (d_v,)), ("ssm_out", (hidden, value_dim))]


def _n_experts(cfg: dict[str, Any]) -> int:
    return _int(cfg, "num_experts") or _int(cfg, "num_local_experts") or _int(cfg, "n_routed_experts")


def _is_moe_layer(cfg: dict[str, Any], index: int) -> bool:
    model_type = str(cfg.get("model_type"))
    if model_type not in _MOE or not _n_experts(cfg):
        return False
    if model_type in _LEADING_DENSE:   # the first k layers stay dense
        return index >= _int(cfg, "first_k_dense_replace") and index % (_int(cfg, "moe_layer_freq", 1) or 1) == 0
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"):
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        dense_layers = cfg.get("mlp_only_layers") or []
        if not isinstance(dense_layers, list):
            raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense_layers!r}")
        return index not in dense_layers and (index + 1) % step == 0
    return True                                          # mixtral, gpt-oss: every layer


def _mlp(cfg: dict[str, Any], index: int, hidden: int) -> Shapes:
    """A SwiGLU MLP (gate, up, down), or a router + experts (+ shared experts) on MoE layers."""
    if not _is_moe_layer(cfg, index):
        ff = _int(cfg, "intermediate_size")
        shapes: Shapes = [("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))]
        if _get(cfg, "mlp_bias", False):
            shapes += [("ffn_gate.bias", (ff,)), ("ffn_up.bias", (ff,)), ("ffn_down.bias", (hidden,))]
        return shapes
    model_type = str(cfg.get("model_type"))
    experts = _n_experts(cfg)
    expert_ff = _int(cfg, "moe_intermediate_size") or _int(cfg, "intermediate_size")
    shapes = [("ffn_gate_inp", (experts, hidden)), ("ffn_gate_exps", (experts, expert_ff, hidden)),
              ("ffn_up_exps", (experts, expert_ff, hidden)), ("ffn_down_exps", (experts, hidden, expert_ff))]
    if model_type in _BIASED_EXPERTS:
        shapes += [("ffn_gate_inp.bias", (experts,)), ("ffn_gate_exps.bias", (experts, expert_ff)),
                   ("ffn_up_exps.bias", (experts, expert_ff)), ("ffn_down_exps.bias", (experts, hidden))]
    if model_type in _ROUTER_BIAS:
        shapes.append(("exp_probs_b", (experts,)))                    # the router's score-correction bias
    shared = _int(cfg, "n_shared_experts")
    if shared:                                                        # DeepSeek: always-on experts
        shared_ff = expert_ff * shared
        shapes += [("ffn_gate_shexp", (shared_ff, hidden)), ("ffn_up_shexp", (shared_ff, hidden)),
                   ("ffn_down_shexp", (hidden, shared_ff))]
    shared_ff = _int(cfg, "shared_expert_intermediate_size")
    if shared_ff and model_type in _QWEN_SHARED:                      # one shared expert and its sigmoid gate
        shapes += [("ffn_gate_shexp", (shared_ff, hidden)), ("ffn_up_shexp", (shared_ff, hidden)),
                   ("ffn_down_shexp", (hidden, shared_ff)), ("ffn_gate_inp_shexp", (hidden,))]
    return shapes


def _mamba(cfg: dict[str, Any]) -> list[WeightTensor]:
    """Mamba-1 (transformers MambaConfig): in/out projections, depthwise conv, x/dt projections, A, D."""
    hidden, vocab, n_layers = _int(cfg, "hidden_size"), _int(cfg, "vocab_size"), _int(cfg, "num_hidden_layers")
    if not hidden or not vocab or not n_layers:
        return []
    inner = _int(cfg, "intermediate_size") or 2 * hidden
    state = _int(cfg, "state_size", 16)
    kernel = _int(cfg, "conv_kernel", 4)
    rank = -(-hidden // 16) if cfg.get("time_step_rank") in (None, "auto") else _int(cfg, "time_step_rank")
    block: Shapes = [("ssm_in", (2 * inner, hidden)), ("ssm_conv1d", (inner, kernel)), ("ssm_x", (rank + 2 * state, inner)),
                     ("ssm_dt", (inner, rank)), ("ssm_dt.bias", (inner,)), ("ssm_a", (inner, state)), ("ssm_d", (inner,)),
                     ("ssm_out", (hidden, inner)), ("attn_norm", (hidden,))]
    if cfg.get("use_conv_bias", True):
        block.append(("ssm_conv1d.bias", (inner,)))
    if cfg.get("use_bias", False):                                    # in_proj and out_proj biases
        block += [("ssm_in.bias", (2 * inner,)), ("ssm_out.bias", (hidden,))]
    tensors = [WeightTensor("token_embd", (vocab, hidden))]
    tensors += [WeightTensor(f"blk.{i}.{name}", shape, i) for i in range(n_layers) for name, shape in block]
    tensors.append(WeightTensor("output_norm", (hidden,)))
    if not cfg.get("tie_word_embeddings", True):
        tensors.append(WeightTensor("output", (vocab, hidden)))
    return tensors
