"""The evaluation protocol: windows, chunked logits, KL / top-1, the table and the plot."""

from __future__ import annotations

import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.quality.agreement import kl_divergence, top1_matches
from kvlab.quality.corpus import windows
from kvlab.quality.perplexity import WindowProtocol, chunked_logits, run_window, window_nll
from kvlab.eval.plot import plot_quality
from kvlab.eval.run import quality_table
from kvlab.eval.suite import CacheQuality

from .conftest import tiny_model


def test_windows_are_evenly_spaced_and_cover_both_ends():
    tokens = list(range(1000))
    ws = windows(tokens, 4, 100)
    assert [w[0] for w in ws] == [0, 300, 600, 900] and all(len(w) == 100 for w in ws)


def test_chunked_dense_logits_equal_one_forward_pass():
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    geometry = CacheGeometry.for_model(model.config, 1, 40)
    with torch.no_grad():
        full = model(tokens, make_cache("dense", geometry))[0]                  # (40, V)
    chunked = chunked_logits(model, tokens, make_cache("dense", geometry), prefill=8, chunk=5)
    torch.testing.assert_close(chunked, full[8:], atol=1e-5, rtol=1e-4)
    protocol = WindowProtocol(length=40, prefill=8, chunk=5, n_windows=1)
    scored, _ = run_window(model, tokens, lambda: make_cache("dense", geometry), protocol)
    assert scored.shape[0] == protocol.scored_per_window == window_nll(chunked, tokens, 8).shape[0]


def test_compressed_cache_changes_the_logits_a_little():
    model = tiny_model(head_dim=0)
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    geometry = CacheGeometry.for_model(model.config, 1, 40)
    dense = chunked_logits(model, tokens, make_cache("dense", geometry), 8, 8)
    int8 = chunked_logits(model, tokens, make_cache("int8+g8", geometry), 8, 8)
    assert 0 < kl_divergence(dense, int8).mean() < 1e-3


def test_kl_and_top1():
    a = torch.randn(5, 11)
    assert torch.allclose(kl_divergence(a, a), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert (kl_divergence(a, torch.randn(5, 11)) > 0).all()
    assert top1_matches(a, a + 0.0).all()


def test_table_and_plot(tmp_path):
    records = [CacheQuality("dense", 23040, 16, 30.0, 0.0, 0.0, 1.0, 1.0, 100),
               CacheQuality("int4", 7923, 5.5, 30.3, 1.0, 0.01, 0.95, 1.0, 100),
               CacheQuality("tq-k3v3", 4695, 3.26, 31.0, 3.3, 0.05, 0.9, None, 100)]
    table = quality_table(records)
    assert table.row_count == 3
    path = plot_quality(records, tmp_path / "q.png")
    assert path.stat().st_size > 1000
