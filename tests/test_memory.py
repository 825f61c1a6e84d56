"""What a run keeps resident (bench/prefill.py --memory-only measures it): the generate path imports no heavy
module it does not use; loading SmolLM2 leaves no mapping of the GGUF (pages touched through a mapping stay in
the RSS next to the copy) and imports none of torch's Python decompositions (meta-device ops would: ~70 MiB);
the GGUF header is freed once the loader is done with it; a prompt chunk's largest transients are one tile or
block wide (multi-row products, the feed-forward, f16-cache attention), each equal to its plain reference."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvlab import heap
from kvlab.cache.attention import chunked_attention, grouped_attention
from kvlab.errors import ModelFileError
from kvlab.model import blockquant
from kvlab.model.blockquant import BlockMatrix, BlockQuantLinear
from kvlab.model.loader import default_model_path
from kvlab.sources.gguf import open_gguf, write_gguf

SRC = Path(__file__).resolve().parents[1] / "src"


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter with this checkout's kvlab; its last stdout line, parsed as JSON."""
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_generate_path_imports_no_unused_heavy_module():
    found = run_python(
        "import json, sys\n"
        "import kvlab, kvlab.session, kvlab.generate, kvlab.cache, kvlab.model.loader\n"
        "heavy = ('transformers', 'matplotlib', 'scipy', 'sympy', 'pandas', 'safetensors', 'fastapi', 'uvicorn')\n"
        "print(json.dumps([name for name in heavy if name in sys.modules]))\n"
    )
    assert found == []


def test_loaded_model_keeps_no_mapping_of_the_file_and_no_decompositions():
    result = run_python(
        "import json, sys\n"
        "from kvlab.session import cached_model\n"
        "loaded = cached_model(None)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(json.dumps({'weights': loaded.weights, 'mapped': str(loaded.path) in maps,\n"
        "                  'sympy': 'sympy' in sys.modules}))\n"
    )
    if result["weights"] != "native":
        pytest.skip("no block kernel here: the dense path reads every tensor anyway")
    assert result == {"weights": "native", "mapped": False, "sympy": False}  # sympy: what the decompositions pull in


def test_tensor_read_equals_the_mapped_bytes():
    gguf_file = open_gguf(default_model_path())
    kinds = {}
    for tensor in gguf_file.tensors:  # one tensor of each type in the file (F32 norms, Q4_1 / Q8_0 matrices)
        kinds.setdefault(tensor.tensor_type, tensor)
    assert len(kinds) >= 2
    for tensor in kinds.values():
        read, mapped = tensor.read(), tensor.data
        assert read.dtype == mapped.dtype and read.shape == mapped.shape
        assert np.array_equal(read.view(np.uint8), mapped.view(np.uint8))
        assert read.flags.writeable


def test_tensor_read_of_a_file_cut_short_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", {"general.architecture": "llama"},
                      {"w": np.arange(64 * 4, dtype=np.float32).reshape(4, 64)})
    tensor = open_gguf(path).tensors[0]
    os.truncate(path, path.stat().st_size - 16)                    # cut after the header was read
    with pytest.raises(ModelFileError, match="truncated: tensor 'w'"):
        tensor.read()


# -- what a long prompt's prefill and the loader hold (bench/prefill.py --memory-only) ----------------


def test_generate_path_imports_no_rich():
    found = run_python(
        "import json, sys\n"
        "import kvlab.session, kvlab.generate, kvlab.cache, kvlab.model.loader\n"
        "print(json.dumps('rich' in sys.modules))\n"
    )
    assert found is False


def test_gguf_header_is_freed_when_dropped_and_its_tensors_still_read():
    gguf_file = open_gguf(default_model_path())
    tensor = next(t for t in gguf_file.tensors if t.tensor_type.name == "F32")
    header = weakref.ref(gguf_file)
    del gguf_file
    assert header() is None            # no reference cycle: freed at once, without waiting for gc
    assert tensor.read().flags.writeable and tensor.read().size == tensor.n_elements


def test_loader_keeps_no_gguf_header():
    from kvlab.model.loader import load_model
    from kvlab.sources.gguf import GGUFFile

    gc.collect()
    before = sum(type(o) is GGUFFile for o in gc.get_objects())
    gc.disable()                       # what load_model leaves alive without a collection's help
    try:
        loaded = load_model(None, weights="native")
        after = sum(type(o) is GGUFFile for o in gc.get_objects())
    finally:
        gc.enable()
    assert loaded.tokenizer.vocab_size > 0 and after == before


def test_release_free_memory_is_safe_to_call():
    expected = heap._malloc_trim() is not None
    assert heap.release_free_memory() is expected
    if platform.libc_ver()[0] == "glibc":
        assert expected                # glibc: malloc_trim is there


def _random_blocks(rows: int, cols: int, block_type: str = "Q4_1", seed: int = 0) -> BlockMatrix:
    """A (rows, cols) matrix of random GGUF blocks with finite fp16 scales."""
    per_block, block_bytes = blockquant.BLOCK_TYPES[block_type][1:]
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, cols // per_block, block_bytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(rows, cols // per_block, 2, generator=g) * 0.02).half().view(torch.uint8)  # d (and m) in [0, 0.02)
    data[..., :4] = scales.reshape(rows, cols // per_block, 4)
    return BlockMatrix.of_gguf_rows(block_type, data.reshape(rows, -1).contiguous(), cols)


def test_multi_row_product_dequantizes_one_tile_at_a_time(monkeypatch):
    layer = BlockQuantLinear(_random_blocks(200, 64), bias=torch.randn(200))
    monkeypatch.setattr(blockquant, "DEQUANT_TILE_BYTES", 64 * 64 * 4)  # 200 rows of 64 columns: tiles of 64, 64, 64, 8
    widest = []
    dequantize = blockquant.dequantize_blocks

    def recording(block_type, data, cols):
        widest.append(data.shape[0])
        return dequantize(block_type, data, cols)

    monkeypatch.setattr(blockquant, "dequantize_blocks", recording)
    x = torch.randn(2, blockquant.GEMM_MAX_ROWS, 64, generator=torch.Generator().manual_seed(5))  # 96 rows: multi-row
    with torch.inference_mode():
        y = layer(x)
        monkeypatch.setenv("KVLAB_NO_GEMM", "1")                    # the reference: the whole matrix, F.linear
        reference = layer(x)
    assert widest[:4] == [64, 64, 64, 8] and widest[-1] == 200
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, F.linear(x, layer.dequantized(), layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,S", [(300, 300), (130, 700), (1, 257)])
def test_chunked_attention_equals_grouped_attention(T, S):
    g = torch.Generator().manual_seed(T + S)
    q = torch.randn(1, 6, T, 32, generator=g)
    k, v = (torch.randn(1, 2, S, 32, generator=g).half() for _ in range(2))
    with torch.inference_mode():
        out = chunked_attention(q, k, v, 32 ** -0.5)                 # its default blocks: 128 queries x 256 keys
        reference = grouped_attention(q, k.float(), v.float(), 32 ** -0.5)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


def test_last_only_logits_equal_the_last_row_of_all_logits():
    from kvlab.cache import CacheGeometry, make_cache
    from kvlab.generate import prefill
    from kvlab.session import cached_model

    loaded = cached_model(None)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(3))
    logits = {}
    for last_only in (True, False):
        cache = make_cache("dense-f16", CacheGeometry.for_model(loaded.config, 1, 80), dtype=torch.float32)
        logits[last_only] = prefill(loaded.model, ids, cache, chunk_size=64, last_only=last_only)
    assert logits[True].shape == (1, 1, loaded.config.vocab_size)
    torch.testing.assert_close(logits[True][:, -1], logits[False][:, -1], rtol=1e-5, atol=1e-4)


def test_dequantized_tiles_are_bounded_in_bytes_and_whole_steps_of_rows():
    assert blockquant.dequant_tile_rows(576) == 512                         # SmolLM2's q|k|v, gate|up, o
    assert blockquant.dequant_tile_rows(1536) == 192                        # its down projection: 1.2 MB, not 3 MB
    assert blockquant.dequant_tile_rows(10 ** 6) == blockquant.DEQUANT_ROW_STEP   # never fewer rows than one step
    for cols in (64, 576, 1536, 8192):
        rows = blockquant.dequant_tile_rows(cols)
        assert rows % blockquant.DEQUANT_ROW_STEP == 0
        assert rows * cols * 4 <= blockquant.DEQUANT_TILE_BYTES or rows == blockquant.DEQUANT_ROW_STEP


def test_a_dense_run_never_imports_the_compressed_formats():
    """The compressed caches' modules load on first use (cache/__init__.py): a dense model run does not page them in."""
    script = """
import sys, torch
from kvlab.cache import CacheGeometry, make_cache
from kvlab.generate import generate
from kvlab.model.fused import fused_decode_step
from tests.conftest import tiny_model
model = tiny_model(head_dim=0)
cache = make_cache("dense", CacheGeometry.for_model(model.config, 1, 16))
generate(model, torch.tensor([[1, 2, 3]]), cache, 4)
fused_decode_step(model)
print(sorted(m for m in sys.modules if m in ("kvlab.cache.quantized", "kvlab.cache.turboquant", "kvlab.cache.compressed")))
import kvlab.cache
assert kvlab.cache.TurboQuantCache.__name__ == "TurboQuantCache"   # still importable from the package, on demand
"""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "src") + os.pathsep + str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
