"""What a run keeps resident (bench/prefill.py --memory-only measures it): the generate path imports no heavy
module it does not use; loading SmolLM2 leaves no mapping of the GGUF (pages touched through a mapping stay in
the RSS next to the copy) and imports none of torch's Python decompositions (meta-device ops would: ~70 MiB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import ModelFileError
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
