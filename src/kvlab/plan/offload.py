"""llama.cpp's partial offload: which weights, caches and buffers sit on the GPU and which in host RAM.

Rules (llama-model.cpp load_tensors, llama-model-loader.cpp create_tensor, llama-context.cpp, common/arg.cpp):
- -ngl N puts the last N layers on the GPU counting the output layer (output.weight, output_norm) as layer
  n_layer: i_gpu_start = n_layer + 1 - N, so -ngl 1 offloads the output layer alone, -ngl N the output layer
  and the last N - 1 repeating layers, and N > n_layer every layer (99 = all).
- The token embedding always stays in host memory ("very little benefit to offloading the input layer").
  A model with tied embeddings (no output.weight) uses token_embd as its output matrix too: llama.cpp
  loads a second copy of it into the output layer's buffer when that is another device (the GPU).
- --n-cpu-moe N keeps the experts (ffn_*_exps) of the first N layers in host memory, --cpu-moe all of them;
  the rest of those layers (attention, norms, router, shared experts) stays where -ngl put it.
- A layer's K/V cache and recurrent state live with the layer (offload_kqv, the default).
- The GPU keeps its compute buffer and the CUDA runtime; the host gets a compute buffer of its own for the
  layers it runs, estimated like the GPU's.
Plans without offload flags keep everything on the GPU, token embedding included (as before: conservative by
the embedding's size); --gpu-layers / --cpu-moe / --n-cpu-moe plan llama.cpp's placement exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..spec import ModelSpec
from .quants import GGML_TYPES, row_bytes


@dataclass(frozen=True)
class WeightSplit:
    """Weight bytes by where llama.cpp can place them."""

    embedding: int                 # token_embd (always host)
    output: int                    # output.weight + output_norm (the "output layer")
    layers: tuple[int, ...]        # each block's bytes, experts included
    experts: tuple[int, ...]       # of which its routed experts (ffn_*_exps)
    exact: bool = True
    tied: bool = False             # no output.weight: the output layer on the GPU holds a copy of token_embd

    @property
    def total(self) -> int:
        return self.embedding + self.output + sum(self.layers)


@dataclass(frozen=True)
class Offload:
    """The placement a llama.cpp plan assumes. gpu_layers None: every layer and the output layer (-ngl 99)."""

    gpu_layers: int | None = None
    cpu_moe_layers: int = 0        # experts of the first N layers on the host (n_layer for --cpu-moe)
    ram_bytes: int | None = None   # host memory available for the rest (--ram), None: not checked

    def layer_on_gpu(self, i: int, n_layer: int) -> bool:
        return self.gpu_layers is None or i >= n_layer + 1 - self.gpu_layers

    def output_on_gpu(self, n_layer: int) -> bool:
        return self.gpu_layers is None or self.gpu_layers >= 1

    def describe(self, n_layer: int) -> str:
        on_gpu = n_layer if self.gpu_layers is None else max(0, min(self.gpu_layers - 1, n_layer))
        text = f"{on_gpu} of {n_layer} layers on the GPU" + (", output layer too" if self.output_on_gpu(n_layer) and on_gpu < n_layer
                                                            else "" if self.output_on_gpu(n_layer) else ", output layer on the host")
        if self.cpu_moe_layers:
            text += f", experts of {'all' if self.cpu_moe_layers >= n_layer else f'the first {self.cpu_moe_layers}'} layers on the host"
        return text


def split_from_tensors(tensors: dict, n_layer: int) -> WeightSplit:
    """The split of a file's tensor table (name -> TensorInfo with GGUF type names, rows first)."""
    layers, experts = [0] * n_layer, [0] * n_layer
    embedding = output = 0
    for name, info in tensors.items():
        if info.dtype not in GGML_TYPES or not info.shape:
            continue
        rows = 1
        for d in info.shape[:-1]:
            rows *= d
        nbytes = row_bytes(info.dtype, info.shape[-1]) * rows
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if 0 <= i < n_layer:
                layers[i] += nbytes
                experts[i] += nbytes if "_exps" in name else 0
        elif name.startswith("token_embd"):
            embedding += nbytes
        else:
            output += nbytes
    return WeightSplit(embedding, output, tuple(layers), tuple(experts), tied="output.weight" not in tensors)


def weight_split(spec: ModelSpec, weights) -> WeightSplit:
    """Where the planned weights can go: from the quant scheme's tensors, the file's tensor table, or estimated."""
    scheme = weights.scheme
    if scheme is not None:
        return WeightSplit(scheme.embedding_bytes, scheme.output_bytes, scheme.layer_bytes, scheme.layer_expert_bytes,
                           tied=scheme.tied)
    tensors = spec.runtime.tensors if spec.runtime is not None else {}
    if tensors and weights.exact and spec.extra.get("dtype") == "gguf":
        split = split_from_tensors(tensors, spec.n_layers)
        if split.total == weights.bytes:
            return split
    return estimated_split(spec, weights.bytes)


def estimated_split(spec: ModelSpec, total: int) -> WeightSplit:
    """Without a tensor list: the embedding and output by their shapes at the average bits, blocks equal."""
    n = spec.n_layers
    per_param = total / spec.n_params if spec.n_params else 0
    embedding = int(spec.vocab_size * spec.d_model * per_param)
    tied = spec.runtime.tie_embeddings if spec.runtime is not None else False
    output = 0 if tied else embedding
    rest = max(0, total - embedding - output)
    return WeightSplit(embedding, output, tuple([rest // n] * n), tuple([0] * n), exact=False, tied=tied)


def check_offload(offload: Offload, spec: ModelSpec, split: WeightSplit) -> None:
    if offload.gpu_layers is not None and offload.gpu_layers < 0:
        raise ConfigError(f"--gpu-layers must be 0 or more, got {offload.gpu_layers}")
    if offload.cpu_moe_layers and not any(split.experts):
        raise ConfigError(f"{spec.name} has no routed experts kvlab can place: --cpu-moe / --n-cpu-moe apply to MoE models")
    if offload.cpu_moe_layers < 0:
        raise ConfigError(f"--n-cpu-moe must be 0 or more, got {offload.cpu_moe_layers}")
