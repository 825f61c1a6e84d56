"""Lab experiment 1: the causal mask makes earlier outputs (and K/V) final; without it a cache goes stale."""

from __future__ import annotations

import pytest
import torch

from kvlab.measure import torch_threads
from kvlab.lab.invariance import INVARIANCE_CONFIG, UnmaskedCache, make_lab_cache, run_invariance


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def result():
    with torch_threads(1):
        return run_invariance(n_tokens=8, decode_steps=8, seed=0)


def test_masked_outputs_do_not_change_when_a_token_is_appended(result):
    assert INVARIANCE_CONFIG.n_layers == 4 and INVARIANCE_CONFIG.d_model == 32
    assert result.masked_max_diff < 1e-5
    assert len(result.masked_by_position) == 8


def test_unmasked_outputs_change(result):
    assert result.unmasked_max_diff > 1e-2
    assert min(result.unmasked_by_position) > 1e-3  # every earlier position reads the new token


def test_cache_without_mask_is_stale_and_the_mismatch_is_detected(result):
    assert result.cached_masked_max_diff < 1e-5
    assert result.cached_unmasked_max_diff > 1e-2


def test_only_the_first_block_keys_survive_without_mask(result):
    assert max(result.stale_keys_masked_by_layer) < 1e-5
    assert result.stale_keys_unmasked_by_layer[0] < 1e-6          # keys of block 0 come from the embeddings only
    assert min(result.stale_keys_unmasked_by_layer[1:]) > 1e-3


def test_unmasked_cache_is_the_dense_cache_without_the_mask():
    cache = make_lab_cache(INVARIANCE_CONFIG, 4, masked=False)
    assert isinstance(cache, UnmaskedCache)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8)
    cache.append(0, k, v)
    expected = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, dim=-1) @ v   # no mask at all
    torch.testing.assert_close(cache.attend(0, q), expected, atol=1e-5, rtol=1e-5)
