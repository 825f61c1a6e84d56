"""Which GGUF matrices kvlab's native weights keep as blocks (Q4_0 / Q4_1 / Q8_0, read by kernels/blockgemv.c), and
the bytes a native-weights decoder then holds: from a file's tensor table alone, so the loader (model/blockquant.py)
and the planner (`kvlab plan --engine kvlab` on a GGUF) apply one rule, the planner without reading the file again.
"""

from __future__ import annotations

from .tensor_names import GGUF, LAYER_NAMES

#: the block types the kernel reads (kernels.BLOCK_TYPES, where their layouts are; a test holds the two equal)
BLOCK_TYPE_NAMES = ("Q4_0", "Q4_1", "Q8_0")


def supported(tensor) -> bool:
    """Whether the kernel reads this GGUF tensor's blocks: a 2-D matrix of Q4_0, Q4_1 or Q8_0."""
    return len(tensor.shape) == 2 and tensor.tensor_type.name in BLOCK_TYPE_NAMES


FUSED = {"attn.qkv": ("q", "k", "v"), "attn.out": ("o",), "ffn.gate_up": ("gate", "up"), "ffn.down": ("down",)}


def native_parts(tensors: dict, n_layers: int) -> dict[str, list]:
    """Decoder module name -> the GGUF tensors that become its blocks, for every module that can be native.

    A fused module is native only when all its parts are supported matrices of one block type; the
    others (and 1-D tensors: norms, biases) stay fp32.
    """
    parts: dict[str, list] = {}
    if "token_embd.weight" in tensors and supported(tensors["token_embd.weight"]):
        parts["embed"] = [tensors["token_embd.weight"]]
    if "output.weight" in tensors and supported(tensors["output.weight"]):
        parts["lm_head"] = [tensors["output.weight"]]
    for i in range(n_layers):
        for module, keys in FUSED.items():
            found = [tensors.get(LAYER_NAMES[key][GGUF].format(i=i)) for key in keys]
            if all(t is not None and supported(t) for t in found) and len({t.tensor_type for t in found}) == 1:
                parts[f"blocks.{i}.{module}"] = found
    return parts


def native_weight_bytes(tensors: dict, n_layers: int) -> int:
    """Bytes a native-weights Decoder holds: block bytes of the native modules, fp32 for every other tensor."""
    native = {t.name for found in native_parts(tensors, n_layers).values() for t in found}
    total = 0
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into the RoPE frequencies, not held as a weight
        total += t.n_bytes if name in native else t.n_elements * 4
    return total
