"""The fused decode step (one C call per token) equals the Decoder's modules and a full recompute."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import CacheCapacityError, NonFiniteError
from kvlab.model.blockquant import BlockMatrix, set_activations
from kvlab.model.fused import FusedDecodeStep, decode_step_kind, fused_decode_step, fused_step_off
from kvlab.model.loader import install_blocks
from .kernel_checks import require_kernel

from .conftest import tiny_model

CONFIGS = {
    "MHA": dict(n_heads=4, n_kv_heads=4),
    "GQA": dict(n_heads=4, n_kv_heads=2),
    "MQA": dict(n_heads=4, n_kv_heads=1),
    "qk-norm": dict(n_heads=4, n_kv_heads=2, qk_norm=True),
    "qkv-bias": dict(n_heads=4, n_kv_heads=2, qkv_bias=True),
    "window": dict(n_heads=4, n_kv_heads=2, sliding_window=5),
    # head_dim 16: keys are scored sixteen at a time (AVX-512), the window's start off that grid
    "head-dim-16": dict(n_heads=4, n_kv_heads=2, d_model=64),
    "head-dim-16-window": dict(n_heads=4, n_kv_heads=1, d_model=64, sliding_window=19),
}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return require_kernel()


class CountingStep:
    """Wraps a FusedDecodeStep to count the tokens it actually ran (so a test cannot pass on the fallback)."""

    def __init__(self, step: FusedDecodeStep):
        self.step, self.calls = step, 0

    def try_step(self, tokens, cache):
        logits = self.step.try_step(tokens, cache)
        self.calls += logits is not None
        return logits


def decode(model, tokens, first_chunk, fused: bool):
    """Prefill `first_chunk` tokens, then one token at a time; logits (1, T, V) and the cache."""
    counting = CountingStep(fused_decode_step(model)) if fused else None
    model.fused = counting
    cache = make_cache("dense", CacheGeometry.for_model(model.config, capacity=tokens.shape[1]))
    with torch.no_grad():
        out = [model(tokens[:, :first_chunk], cache)] + [model(tokens[:, t:t + 1], cache) for t in range(first_chunk, tokens.shape[1])]
    model.fused = None
    if fused:
        assert counting.calls == tokens.shape[1] - first_chunk
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("kind", CONFIGS)
def test_fused_steps_equal_modules_and_full_recompute(kind):
    model = tiny_model(**CONFIGS[kind])
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    fused, fused_cache = decode(model, tokens, 3, fused=True)
    modules, module_cache = decode(model, tokens, 3, fused=False)
    full = model(tokens, make_cache("none", CacheGeometry.for_model(model.config, capacity=40)))
    assert (fused - modules).abs().max().item() < 1e-5
    assert (fused - full).abs().max().item() < 1e-5
    assert fused_cache.length == module_cache.length == 40
    assert torch.allclose(fused_cache.k, module_cache.k, atol=1e-5, rtol=0), (fused_cache.k - module_cache.k).abs().max()
    assert torch.allclose(fused_cache.v, module_cache.v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 300])
def test_fused_steps_over_several_key_chunks(window):
    """600 positions: attention runs in chunks of 256 keys whose partial softmax sums are combined
    (and, with a window, the chunks start at the window's edge)."""
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, sliding_window=window)
    tokens = torch.randint(0, 97, (1, 600), generator=torch.Generator().manual_seed(8))
    fused, fused_cache = decode(model, tokens, 500, fused=True)
    modules, _ = decode(model, tokens, 500, fused=False)
    full = model(tokens, make_cache("none", CacheGeometry.for_model(model.config, capacity=600)))
    scale = full.abs().max().item()  # ~10: fp32 rounding over 600 positions is relative to it
    assert (fused - modules).abs().max().item() < 1e-5 * scale
    assert (fused - full).abs().max().item() < 1e-5 * scale
    assert fused_cache.length == 600


def quantize_matrices(model, block_type: str) -> None:
    """Swap every matrix (and the output head) for GGUF blocks of `block_type` quantized from its weights."""
    qtype = GGMLQuantizationType[block_type]
    blocks = {}
    for name, module in model.named_modules():
        if name.endswith(("attn.qkv", "attn.out", "ffn.gate_up", "ffn.down")) or name == "lm_head":
            data = quants.quantize(module.weight.detach().numpy(), qtype)
            blocks[name] = BlockMatrix.of_gguf_rows(block_type, torch.from_numpy(np.ascontiguousarray(data)), module.weight.shape[1])
    biases = {name: module.bias.detach().clone() for name, module in model.named_modules()
              if getattr(module, "bias", None) is not None}
    install_blocks(model, blocks)
    for name, bias in biases.items():
        model.get_submodule(name).bias.data.copy_(bias)


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_fused_steps_on_block_weights(block_type):
    """Matrices held as blocks, rows of 2 to 17 blocks (the kernel's 16-block scale groups and their tail)."""
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, d_ff=544, qkv_bias=True, tie_embeddings=False)
    quantize_matrices(model, block_type)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    fused, _ = decode(model, tokens, 4, fused=True)
    modules, _ = decode(model, tokens, 4, fused=False)
    assert (fused - modules).abs().max().item() < 1e-5 * modules.abs().max().item() + 1e-6


@pytest.mark.parametrize("block_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_fused_steps_with_int8_activations(block_type):
    """With int8 activations (weights native-q8) the step's products are q8gemm.c's row dots, the modules' kernel for
    one row: within 5e-3 of the modules' logits (an activation an ulp apart may round to a neighbouring code), and not
    the fp32 step's."""
    model = tiny_model(n_heads=4, n_kv_heads=2, d_model=64, d_ff=544, qkv_bias=True, tie_embeddings=False)
    quantize_matrices(model, block_type)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(6))
    fp32, _ = decode(model, tokens, 4, fused=True)
    set_activations(model, "int8")
    fused, _ = decode(model, tokens, 4, fused=True)
    modules, _ = decode(model, tokens, 4, fused=False)
    scale = modules.abs().max().item()
    assert (fused - modules).abs().max().item() < 5e-3 * scale
    assert (fused[:, 4:] - fp32[:, 4:]).abs().max().item() > 1e-5 * scale


def test_fused_step_is_the_same_for_any_thread_count():
    """Threads share rows and heads, never one dot product: logits are bit-identical (every token fused,
    the first included, so no multi-threaded torch op takes part)."""
    model = tiny_model(n_heads=4, n_kv_heads=2)
    model.fused = fused_decode_step(model)
    tokens = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            cache = make_cache("dense", CacheGeometry.for_model(model.config, capacity=10))
            with torch.no_grad():
                runs.append(torch.cat([model(tokens[:, t:t + 1], cache) for t in range(10)], dim=1))
    finally:
        torch.set_num_threads(threads)
        model.fused = None
    assert torch.equal(runs[0], runs[1])


def test_fused_step_non_finite_kv_is_the_module_paths_error():
    model = tiny_model(n_heads=4, n_kv_heads=2)
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    q_dim = model.config.n_heads * model.config.head_dim
    messages = []
    for fused in (True, False):
        model.fused = fused_decode_step(model) if fused else None
        cache = make_cache("dense", CacheGeometry.for_model(model.config, capacity=8))
        with torch.no_grad():
            model(tokens[:, :5], cache)
            saved = model.blocks[1].attn.qkv.weight[q_dim].clone()
            model.blocks[1].attn.qkv.weight[q_dim] = float("nan")    # a key row of layer 1
            with pytest.raises(NonFiniteError) as err:
                model(tokens[:, 5:6], cache)
            model.blocks[1].attn.qkv.weight[q_dim] = saved
        messages.append(str(err.value))
        assert [cache.layer_length(0), cache.layer_length(1)] == [6, 5]   # layer 0 written, layer 1 refused
    model.fused = None
    assert messages[0] == messages[1] and "\n" not in messages[0] and "layer 1" in messages[0]


def test_fused_step_leaves_other_cases_to_the_modules():
    model = tiny_model(n_heads=4, n_kv_heads=2)
    step = fused_decode_step(model)
    geometry = CacheGeometry.for_model(model.config, capacity=4)
    one = torch.tensor([[3]])
    dense = make_cache("dense", geometry)
    with torch.no_grad():
        assert step.accepts(one, dense)
        assert not step.accepts(torch.tensor([[3, 4]]), dense)                               # a chunk
        assert not step.accepts(torch.tensor([[3], [4]]), make_cache("dense", CacheGeometry.for_model(model.config, batch=2)))
        assert not step.accepts(one, make_cache("concat", geometry))
        assert not step.accepts(one, make_cache("dense", geometry, dtype=torch.bfloat16))
        assert not step.accepts(one, make_cache("int8", geometry, dtype=torch.bfloat16))
    assert not step.accepts(one, dense)                                                       # autograd on
    model.fused = step
    with torch.no_grad():
        for t in range(4):
            model(torch.tensor([[t]]), dense)
        with pytest.raises(CacheCapacityError, match="exceeds the cache capacity of 4 tokens"):
            model(one, dense)                                                                 # full: the module path says so
    model.fused = None


def test_loader_installs_the_step_and_copies_drop_it(smollm2):
    assert isinstance(smollm2.model.fused, FusedDecodeStep)
    assert copy.deepcopy(smollm2.model).fused is None
    model = tiny_model()
    model.fused = fused_decode_step(model)
    assert model.double().fused is None        # moved or cast buffers: the step's pointers would be stale


def test_smollm2_fused_greedy_equals_modules(smollm2):
    """64 greedy tokens through the fused step and through the modules: the same tokens, logits within 1e-4."""
    from kvlab.generate import generate

    model = smollm2.model
    ids = torch.tensor([smollm2.tokenizer.encode("Once upon a time, in a small village,")])
    results = []
    for off in (False, True):
        with fused_step_off(model, off):
            cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1] + 65))
            assert decode_step_kind(model, cache) == ("modules" if off else "fused")
            tokens = generate(model, ids, cache, 64).token_ids[0]
            with torch.no_grad():
                last = model(torch.tensor([[tokens[-1]]]), cache)
        results.append((tokens, last))
    assert isinstance(model.fused, FusedDecodeStep)   # put back
    assert results[0][0] == results[1][0]
    assert (results[0][1] - results[1][1]).abs().max().item() < 1e-4


def test_bench_decode_reports_fused_and_unfused_steps(smollm2, tmp_path):
    """`kvlab bench decode --json`: the kvlab contender runs the fused step, kvlab-unfused the modules."""
    import json

    from typer.testing import CliRunner

    from kvlab.cli import app

    out = tmp_path / "decode.json"
    result = CliRunner().invoke(app, ["bench", "decode", "--json", "--dtypes", "fp32", "--repeats", "1", "--prompt-tokens", "8",
                                      "--new-tokens", "4", "--contenders", "kvlab:dense,kvlab-unfused:dense", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    rows = {(r["engine"], r["cache"]): r for r in record["results"]}
    assert rows["kvlab", "dense"]["step"] == "fused" and rows["kvlab-unfused", "dense"]["step"] == "modules"
    assert all(r["tokens_per_s"] > 0 and r["weights"] == "native" for r in rows.values())
