"""Bad input gets a one-line error naming the problem, from the API and from the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import CacheCapacityError, ConfigError, KvlabError, ModelFileError, NonFiniteError, UnsupportedArchitectureError
from kvlab.generate import generate
from kvlab.model.config import DecoderConfig
from kvlab.model.loader import load_model

from .conftest import cli_error, tiny_model


def write_tiny_gguf(path, arch="llama"):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_feed_forward_length(16)
    writer.add_context_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 4)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        load_model(bogus)
    assert "not a GGUF" in cli_error(["generate", "hi", "--model", str(bogus)])


def test_truncated_gguf(tmp_path, smollm2):
    cut = tmp_path / "cut.gguf"
    with open(smollm2.path, "rb") as src:
        cut.write_bytes(src.read(200_000))
    with pytest.raises(ModelFileError, match="truncated"):
        load_model(cut)
    assert "truncated" in cli_error(["info", str(cut)])


def test_missing_file():
    assert "no such file" in cli_error(["generate", "hi", "--model", "/nonexistent/model.gguf"])


def test_unknown_architecture(tmp_path):
    path = tmp_path / "weird.gguf"
    write_tiny_gguf(path, arch="rwkv9")
    with pytest.raises(UnsupportedArchitectureError, match="rwkv9"):
        load_model(path)
    assert "rwkv9" in cli_error(["generate", "hi", "--model", str(path)])


def test_heads_not_divisible():
    with pytest.raises(ConfigError, match=r"n_head=6 is not a multiple of n_kv_head=4"):
        DecoderConfig(vocab_size=10, d_model=48, n_layers=1, n_heads=6, n_kv_heads=4, d_ff=8)


def test_heads_not_divisible_in_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4,'
        ' "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10}'
    )
    assert "n_head=6 is not a multiple of n_kv_head=4" in cli_error(["info", str(tmp_path)])


def test_prompt_longer_than_capacity():
    model = tiny_model()
    cache = make_cache("dense", CacheGeometry.for_model(model.config, capacity=8))
    with pytest.raises(CacheCapacityError, match="exceeds the cache capacity of 8 tokens"):
        generate(model, torch.zeros(1, 9, dtype=torch.long), cache, 2)


def test_cli_prompt_longer_than_capacity(smollm2):
    line = cli_error(["generate", "one two three four five six seven eight", "--capacity", "4"])
    assert "exceeds the cache capacity of 4 tokens" in line


def test_dense_cache_never_overwrites_silently():
    model = tiny_model()
    cache = make_cache("dense", CacheGeometry.for_model(model.config, capacity=4))
    k = torch.randn(1, 2, 4, 8)
    cache.append(0, k, k)
    with pytest.raises(CacheCapacityError):
        cache.append(0, k[:, :, :1], k[:, :, :1])
    assert torch.equal(cache.k[0, :, :, :4], k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_kv_is_refused(bad):
    cache = make_cache("dense", CacheGeometry(n_layers=1, n_kv_heads=1, head_dim=4, capacity=4))
    k = torch.ones(1, 1, 1, 4)
    k[0, 0, 0, 2] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        cache.append(0, k, torch.ones(1, 1, 1, 4))


def test_unknown_cache_name():
    assert "unknown cache 'bogus'" in cli_error(["generate", "hi", "--cache", "bogus"])


def test_errors_are_single_lines():
    assert "\n" not in str(KvlabError("first line\nsecond line"))


@pytest.mark.parametrize("args, message", [
    (["--prefill-chunk", "-1"], "prefill chunk size must be at least 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
])
def test_generate_option_errors(smollm2, args, message):
    assert message in cli_error(["generate", "hi", *args])


def test_cuda_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "no usable CUDA device" in cli_error(["generate", "hi", "--device", "cuda"])


def test_zero_kv_heads_in_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 0,'
        ' "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10}'
    )
    with pytest.raises(ConfigError, match="positive head counts, got n_head=6 n_kv_head=0"):
        load_model(tmp_path)


@pytest.mark.parametrize("name", ["dense", "concat", "int8", "int4", "tq-k4v4", "tq-k3v3+recent4", "tq-k4v4+sink1"])
@pytest.mark.parametrize("shape", [(1, 5, 3, 8), (1, 4, 3, 16), (2, 4, 3, 8), (4, 3, 8)])
def test_a_query_that_does_not_fit_the_cache_is_one_line(name, shape):
    """Wrong head count, head dim, batch or rank: one ConfigError before any arithmetic (or C) runs."""
    cache = make_cache(name, CacheGeometry(n_layers=1, n_kv_heads=2, head_dim=8, capacity=16, n_heads=4))
    k = torch.randn(1, 2, 3, 8)
    cache.append(0, k, k)
    with pytest.raises(ConfigError, match="query of shape") as info:
        cache.attend(0, torch.randn(*shape))
    assert "\n" not in str(info.value)
    assert cache.attend(0, torch.randn(1, 4, 3, 8)).shape == (1, 4, 3, 8)   # the right shape still reads
