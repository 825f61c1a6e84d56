"""Shared fixtures: tiny random decoders and the real SmolLM2 (loaded once per session)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from kvlab.model.config import DecoderConfig  # noqa: E402
from kvlab.model.llama import Decoder  # noqa: E402


def tiny_config(n_heads: int = 4, n_kv_heads: int = 2, **overrides) -> DecoderConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=64, max_seq_len=64)
    base.update(overrides)
    return DecoderConfig(**base)


def tiny_model(seed: int = 0, **config) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(tiny_config(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def smollm2():
    from kvlab.session import cached_model

    return cached_model(None, "fp32", "cpu")


@pytest.fixture(scope="session")
def hf_smollm2():
    """The same GGUF loaded by transformers: the reference implementation."""
    from transformers import AutoModelForCausalLM

    from kvlab.model.loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def cli_error(args) -> str:
    """The one line a failing `kvlab ARGS` prints (exit code 2, no traceback)."""
    from typer.testing import CliRunner

    from kvlab.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]
