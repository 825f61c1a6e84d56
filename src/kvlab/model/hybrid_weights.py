"""Weights of the HybridDecoder (Gemma 3, Qwen3.5, Qwen3-Next) from a Hugging Face folder or a llama.cpp GGUF.

Each parameter of the HybridDecoder is made from one or more tensors of the file (`Part`): their names, the shapes
the config gives them, and how they combine. The file's conventions are undone here, once:
  * Gemma and Qwen3.5 / Qwen3-Next checkpoints store RMSNorm weights as w for a multiplier (1 + w): + 1 at load
    (llama.cpp's converter already added it; the DeltaNet's gated norm is a plain multiplier in both);
  * A_log becomes the decay rate -exp(A_log) (GGUF's ssm_a); the depthwise conv (C, 1, K) becomes (C, K);
  * Qwen3-Next's in_proj_qkvz / in_proj_ba interleave q, k, v, z (and b, a) per key head: regrouped;
  * llama.cpp's qwen35 GGUFs order value heads tiled ([k0, k1, .., k0, k1, ..]) where Hugging Face groups them by key
    head ([k0, k0, .., k1, k1, ..]) when there are fewer key heads than value heads: regrouped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ModelFileError
from .config import DecoderConfig
from .weights import HF, check_tensor, config_values


@dataclass(frozen=True)
class Part:
    """One parameter: the file tensors it is made of (name, shape, what sizes it) and how they combine."""

    key: str                                          # the HybridDecoder's state-dict key
    sources: tuple[tuple[str, tuple[int, ...], str], ...]
    combine: Callable[..., torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1.0


def _cat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def grouped_heads(t: torch.Tensor, k_heads: int, per_k: int, dim: int = 0) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order (index r·k_heads + k) to the grouped one (k·per_k + r)."""
    shape = list(t.shape)
    head = shape[dim] // (k_heads * per_k)
    tiled = t.reshape(*shape[:dim], per_k, k_heads, head, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def hf_prefix(tensors: dict) -> str:
    """Where a checkpoint keeps the text decoder: model.language_model. (Qwen3.5 and Gemma 3 multimodal) or model."""
    return "model.language_model." if any(name.startswith("model.language_model.") for name in tensors) else "model."


def parts(cfg: DecoderConfig, scheme: int, prefix: str = "model.") -> list[Part]:
    """Every parameter of the HybridDecoder for `cfg` and the file tensors (`scheme`: GGUF or HF) it is made of."""
    d, hd, ff, vocab = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    q_rows = cfg.n_heads * hd * (2 if cfg.attn_output_gate else 1)
    kv = cfg.n_kv_heads * hd
    norm = _plus_one if scheme == HF else _same
    gemma = cfg.arch == "gemma3"
    hf = scheme == HF
    out: list[Part] = []

    def part(key, combine, *sources):
        out.append(Part(key, tuple(sources), combine))

    g = (lambda name: f"{prefix}{name}") if hf else (lambda name: name)
    part("embed.weight", _same, (g("embed_tokens.weight") if hf else "token_embd.weight", (vocab, d), "(vocab, d_model)"))
    part("norm.weight", norm, (g("norm.weight") if hf else "output_norm.weight", (d,), "(d_model,)"))
    if not cfg.tie_embeddings:
        part("lm_head.weight", _same, ("lm_head.weight" if hf else "output.weight", (vocab, d), "(vocab, d_model)"))
    for i, kind in enumerate(cfg.layer_kinds):
        L = (lambda name, i=i: f"{prefix}layers.{i}.{name}") if hf else (lambda name, i=i: f"blk.{i}.{name}")
        b = f"blocks.{i}."
        dm = (d,), "(d_model,)"
        if hf:
            part(b + "attn_norm.weight", norm, (L("input_layernorm.weight"), *dm))
            if gemma:
                part(b + "post_attn_norm.weight", norm, (L("post_attention_layernorm.weight"), *dm))
                part(b + "ffn_norm.weight", norm, (L("pre_feedforward_layernorm.weight"), *dm))
                part(b + "post_ffn_norm.weight", norm, (L("post_feedforward_layernorm.weight"), *dm))
            else:
                part(b + "ffn_norm.weight", norm, (L("post_attention_layernorm.weight"), *dm))
        else:
            part(b + "attn_norm.weight", norm, (L("attn_norm.weight"), *dm))
            if gemma:
                part(b + "post_attn_norm.weight", norm, (L("post_attention_norm.weight"), *dm))
                part(b + "ffn_norm.weight", norm, (L("ffn_norm.weight"), *dm))
                part(b + "post_ffn_norm.weight", norm, (L("post_ffw_norm.weight"), *dm))
            else:
                part(b + "ffn_norm.weight", norm, (L("post_attention_norm.weight"), *dm))
        if i in cfg.moe_layers:
            out.extend(_moe_parts(cfg, scheme, b + "ffn.", L))
        else:
            mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight") if hf else (
                "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
            part(b + "ffn.gate_up.weight", _cat, (L(mlp[0]), (ff, d), "(d_ff, d_model)"), (L(mlp[1]), (ff, d), "(d_ff, d_model)"))
            part(b + "ffn.down.weight", _same, (L(mlp[2]), (d, ff), "(d_model, d_ff)"))
        m = b + "mixer."
        if kind == "recurrent":
            out.extend(_deltanet_parts(cfg, scheme, m, L))
            continue
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                 "self_attn.k_norm") if hf else ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
        q_meaning = "(2·n_head·head_dim, d_model): queries and gates" if cfg.attn_output_gate else "(n_head·head_dim, d_model)"
        part(m + "qkv.weight", _cat, (L(names[0] + ".weight"), (q_rows, d), q_meaning),
             (L(names[1] + ".weight"), (kv, d), "(n_kv_head·head_dim, d_model)"),
             (L(names[2] + ".weight"), (kv, d), "(n_kv_head·head_dim, d_model)"))
        if cfg.qkv_bias:
            part(m + "qkv.bias", _cat, (L(names[0] + ".bias"), (q_rows,), "(q rows,)"),
                 (L(names[1] + ".bias"), (kv,), "(n_kv_head·head_dim,)"), (L(names[2] + ".bias"), (kv,), "(n_kv_head·head_dim,)"))
        part(m + "out.weight", _same, (L(names[3] + ".weight"), (d, cfg.n_heads * hd), "(d_model, n_head·head_dim)"))
        if cfg.qk_norm:
            part(m + "q_norm.weight", norm, (L(names[4] + ".weight"), (hd,), "(head_dim,)"))
            part(m + "k_norm.weight", norm, (L(names[5] + ".weight"), (hd,), "(head_dim,)"))
    return out


def _moe_parts(cfg: DecoderConfig, scheme: int, f: str, L) -> list[Part]:
    """A mixture-of-experts feed-forward: router, experts stacked (E, 2F, C) / (E, C, F), the shared expert and its gate."""
    moe, d = cfg.moe, cfg.d_model
    E, F, Fs = moe.n_experts, moe.d_ff_expert, moe.d_ff_shared
    out: list[Part] = []
    if scheme == HF:
        out.append(Part(f + "router.weight", ((L("mlp.gate.weight"), (E, d), "(num_experts, d_model)"),), _same))
        sources = tuple((L(f"mlp.experts.{e}.{proj}.weight"), (F, d), "(moe_intermediate_size, d_model)")
                        for e in range(E) for proj in ("gate_proj", "up_proj"))
        out.append(Part(f + "gate_up", sources, lambda *t: torch.stack([torch.cat(t[2 * e:2 * e + 2]) for e in range(E)])))
        out.append(Part(f + "down", tuple((L(f"mlp.experts.{e}.down_proj.weight"), (d, F), "(d_model, moe_intermediate_size)")
                                          for e in range(E)), lambda *t: torch.stack(t)))
        shared = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                  "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")
    else:
        out.append(Part(f + "router.weight", ((L("ffn_gate_inp.weight"), (E, d), "(expert_count, d_model)"),), _same))
        out.append(Part(f + "gate_up", ((L("ffn_gate_exps.weight"), (E, F, d), "(expert_count, expert d_ff, d_model)"),
                                        (L("ffn_up_exps.weight"), (E, F, d), "(expert_count, expert d_ff, d_model)")),
                        lambda gate, up: torch.cat((gate, up), dim=1)))
        out.append(Part(f + "down", ((L("ffn_down_exps.weight"), (E, d, F), "(expert_count, d_model, expert d_ff)"),), _same))
        shared = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")
    if Fs:
        out.append(Part(f + "shared.gate_up.weight", ((L(shared[0]), (Fs, d), "(shared expert d_ff, d_model)"),
                                                      (L(shared[1]), (Fs, d), "(shared expert d_ff, d_model)")), _cat))
        out.append(Part(f + "shared.down.weight", ((L(shared[2]), (d, Fs), "(d_model, shared expert d_ff)"),), _same))
        out.append(Part(f + "shared_gate.weight", ((L(shared[3]), (1, d), "(1, d_model)"),), _same))
    return out


def _deltanet_parts(cfg: DecoderConfig, scheme: int, m: str, L) -> list[Part]:
    """A Gated DeltaNet layer's parameters: in_proj (rows q, k, v, z, b, a), conv, dt_bias, a, norm, out."""
    la = cfg.linear
    d, C, K = cfg.d_model, la.conv_channels, la.conv_kernel
    nk, nv, dk, dv = la.k_heads, la.v_heads, la.k_dim, la.v_dim
    per_k, qk, vd = nv // nk, 2 * nk * dk, nv * dv
    out: list[Part] = []
    heads = (nv,), "(linear_num_value_heads,)"
    if scheme == HF and cfg.arch == "qwen3_next":
        def regroup(qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
            per_head = qkvz.reshape(nk, 2 * dk + 2 * per_k * dv, d)                      # per key head [q, k, v, z]
            q, k, v, z = per_head.split((dk, dk, per_k * dv, per_k * dv), dim=1)
            b, a = ba.reshape(nk, 2 * per_k, d).split((per_k, per_k), dim=1)           # per key head [b, a]
            return torch.cat([x.reshape(-1, d) for x in (q, k, v, z, b, a)], dim=0)
        out.append(Part(m + "in_proj.weight", (
            (L("linear_attn.in_proj_qkvz.weight"), (C + vd, d), "(2·k_heads·k_dim + 2·v_heads·v_dim, d_model)"),
            (L("linear_attn.in_proj_ba.weight"), (2 * nv, d), "(2·linear_num_value_heads, d_model)")), regroup))
    elif scheme == HF:
        out.append(Part(m + "in_proj.weight", (
            (L("linear_attn.in_proj_qkv.weight"), (C, d), "(2·k_heads·k_dim + v_heads·v_dim, d_model)"),
            (L("linear_attn.in_proj_z.weight"), (vd, d), "(v_heads·v_dim, d_model)"),
            (L("linear_attn.in_proj_b.weight"), (nv, d), "(linear_num_value_heads, d_model)"),
            (L("linear_attn.in_proj_a.weight"), (nv, d), "(linear_num_value_heads, d_model)")), _cat))
    if scheme == HF:
        out.append(Part(m + "conv", ((L("linear_attn.conv1d.weight"), (C, 1, K), "(conv channels, 1, conv kernel)"),),
                        lambda w: w.reshape(C, K)))
        out.append(Part(m + "dt_bias", ((L("linear_attn.dt_bias"), *heads),), _same))
        out.append(Part(m + "a", ((L("linear_attn.A_log"), *heads),), lambda t: -torch.exp(t.float())))
        out.append(Part(m + "norm", ((L("linear_attn.norm.weight"), (dv,), "(linear_value_head_dim,)"),), _same))
        out.append(Part(m + "out.weight", ((L("linear_attn.out_proj.weight"), (d, vd), "(d_model, v_heads·v_dim)"),), _same))
        return out
    # GGUF: qwen35 files hold value heads tiled (when there are fewer key heads), qwen3next files grouped
    tiled = cfg.arch == "qwen3_5" and per_k > 1
    group = (lambda t, dim=0: grouped_heads(t, nk, per_k, dim)) if tiled else (lambda t, dim=0: t)

    def qkv_rows(qkv: torch.Tensor) -> torch.Tensor:
        return torch.cat((qkv[:qk], group(qkv[qk:])), dim=0)

    if cfg.arch == "qwen3_next":
        def combine(qkv, z, ba):
            b, a = ba.reshape(nk, 2 * per_k, d).split((per_k, per_k), dim=1)
            return torch.cat((qkv, z, b.reshape(nv, d), a.reshape(nv, d)), dim=0)
        out.append(Part(m + "in_proj.weight", (
            (L("attn_qkv.weight"), (C, d), "(2·k_heads·k_dim + v_heads·v_dim, d_model)"),
            (L("attn_gate.weight"), (vd, d), "(v_heads·v_dim, d_model)"),
            (L("ssm_ba.weight"), (2 * nv, d), "(2·v_heads, d_model)")), combine))
    else:
        out.append(Part(m + "in_proj.weight", (
            (L("attn_qkv.weight"), (C, d), "(2·k_heads·k_dim + v_heads·v_dim, d_model)"),
            (L("attn_gate.weight"), (vd, d), "(v_heads·v_dim, d_model)"),
            (L("ssm_beta.weight"), (nv, d), "(v_heads, d_model)"),
            (L("ssm_alpha.weight"), (nv, d), "(v_heads, d_model)")),
            lambda qkv, z, b, a: torch.cat((qkv_rows(qkv), group(z), group(b), group(a)), dim=0)))
    out.append(Part(m + "conv", ((L("ssm_conv1d.weight"), (C, K), "(conv channels, conv kernel)"),), qkv_rows))
    out.append(Part(m + "dt_bias", ((L("ssm_dt.bias"), *heads),), group))
    out.append(Part(m + "a", ((L("ssm_a"), *heads),), group))
    out.append(Part(m + "norm", ((L("ssm_norm.weight"), (dv,), "(v_dim,)"),), _same))
    out.append(Part(m + "out.weight", ((L("ssm_out.weight"), (d, vd), "(d_model, v_heads·v_dim)"),), lambda w: group(w, 1)))
    return out


def check_hybrid_tensors(cfg: DecoderConfig, tensors: dict, scheme: int, source: str) -> None:
    """Every tensor the HybridDecoder reads is in the file's table with the shape the config gives it and a weight
    type; checked on the header alone, before any weight is read. One line names the tensor."""
    values = config_values(cfg)
    if cfg.linear is not None:
        la = cfg.linear
        values += f", linear heads k={la.k_heads} v={la.v_heads}, dims k={la.k_dim} v={la.v_dim}, conv={la.conv_kernel}"
    for p in parts(cfg, scheme, hf_prefix(tensors) if scheme == HF else ""):
        for name, shape, meaning in p.sources:
            check_tensor(tensors, name, shape, meaning, scheme, source, values, _needed_by(p.key, cfg))


def _needed_by(key: str, cfg: DecoderConfig) -> str:
    """'layer 1 (recurrent) of qwen3_5 needs it' for a block's parameter, 'every gemma3 model needs it' otherwise."""
    if not key.startswith("blocks."):
        return f"every {cfg.arch} model needs it"
    layer = int(key.split(".")[1])
    return f"layer {layer} ({cfg.layer_kinds[layer]}) of {cfg.arch} needs it"


def hybrid_state_dict(get: Callable[[str], torch.Tensor | None], cfg: DecoderConfig, scheme: int,
                      prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The HybridDecoder's state dict from a file's tensors (`get(name)` -> fp32 tensor or None)."""
    state = {}
    for p in parts(cfg, scheme, prefix):
        tensors = []
        for name, _, _ in p.sources:
            tensor = get(name)
            if tensor is None:
                raise ModelFileError(f"tensor {name!r} is missing from the model file")
            tensors.append(tensor)
        state[p.key] = p.combine(*tensors).contiguous()
    return state
