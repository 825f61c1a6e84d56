"""TurboQuant key-coding options: +prerope (keys coded before RoPE), +ropemean (keys after RoPE around their offset
turned to their positions) and +rot=haar (a shared Haar basis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlab.cache import CacheGeometry, compressed, expected_nbytes, make_cache
from kvlab.cache.attention import grouped_attention
from kvlab.cache.rotation import Rotation, haar_matrix
from kvlab.cache.tq_codec import RotatedCodes, TqCodec
from kvlab.cache.turboquant import TurboQuantCache
from kvlab.errors import ConfigError
from kvlab.model.llama import apply_rope

from .compressed_checks import GEOMETRY, check_attend_is_exact_to_storage, check_nbytes, feed
from .test_causal_caches import CHUNKS, SAME, chunked_logits, two_sequences

def rope_inv_freq(head_dim: int) -> tuple[float, ...]:
    """RoPE's frequencies (base 10,000) for a head dim, as a geometry holds them."""
    return tuple((1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float().tolist())


INV_FREQ = rope_inv_freq(64)
ROPED = replace(GEOMETRY, rope_inv_freq=INV_FREQ)


def rope_at(x: torch.Tensor, start: int) -> torch.Tensor:
    """The model's RoPE for positions start .. start+T. x: (B, H, T, 64)."""
    angles = torch.outer(torch.arange(start, start + x.shape[2], dtype=torch.float32), torch.tensor(INV_FREQ))
    angles = torch.cat((angles, angles), dim=-1)
    return apply_rope(x, angles.cos(), angles.sin())


@pytest.mark.parametrize("name", ["tq-k4v4+prerope", "tq-k3v3+prerope+sink2", "tq-k4v4+prerope+recent8",
                                  "tq-k4v4+ropemean", "tq-k3v3+ropemean+sink2+recent8+norms8"])
def test_attention_is_exact_to_the_stored_keys(name):
    check_attend_is_exact_to_storage(name, ROPED)
    check_attend_is_exact_to_storage(name, ROPED, attend_first=True)


def test_bytes_are_the_formula_and_the_frequencies_are_counted():
    check_nbytes("tq-k4v4+prerope", ROPED)
    plain = expected_nbytes("tq-k4v4", ROPED, torch.bfloat16, 10)
    assert expected_nbytes("tq-k4v4+prerope", GEOMETRY, torch.bfloat16, 10) == plain + 32 * 4   # d/2 float32
    assert make_cache("tq-k4v4+prerope", ROPED).config.name == "tq-k4v4+prerope"
    check_nbytes("tq-k4v4+ropemean+sink1", ROPED)
    assert expected_nbytes("tq-k4v4+ropemean", GEOMETRY, torch.bfloat16, 10) == plain + 32 * 4


def test_without_the_models_rope_frequencies_it_is_a_one_line_error():
    with pytest.raises(ConfigError, match="prerope needs the model's RoPE frequencies"):
        make_cache("tq-k4v4+prerope", GEOMETRY)
    with pytest.raises(ConfigError, match="ropemean needs the model's RoPE frequencies"):
        make_cache("tq-k4v4+ropemean", GEOMETRY)
    for name, problem in (("tq-k4v4+ropemean+prerope", "two ways to code keys around RoPE"),
                          ("tq-k4v4+ropemean+outliers1", "without \\+outliersN")):
        with pytest.raises(ConfigError, match=problem):
            make_cache(name, ROPED)


def test_ropemean_weights_keys_per_rope_pair():
    """RoPE turns (k - μ)/w like k - μ only where both channels of a pair share their weight."""
    gen = torch.Generator().manual_seed(2)
    cache = make_cache("tq-k4v4+ropemean", ROPED)
    scales = torch.linspace(0.2, 3.0, 64)                                      # channels of unequal energy
    cache.append(0, torch.randn(1, 2, 40, 64, generator=gen) * scales, torch.randn(1, 2, 40, 64, generator=gen))
    cache.attend(0, torch.randn(1, 6, 40, 64, generator=gen))
    weights = cache.codec.key_weights(0)[:, :, 0]                                   # (B, Hkv, d)
    torch.testing.assert_close(weights[..., :32], weights[..., 32:], rtol=0, atol=0)
    assert len(weights.unique()) > 2


def test_a_common_key_direction_turned_by_rope_is_coded_far_better_before_rope():
    """Keys = RoPE(m + noise) with one large common m (SmolLM2's keys are like this): the offset removes m
    whole only before RoPE."""
    gen = torch.Generator().manual_seed(4)
    common = 3 * torch.randn(1, 2, 1, 64, generator=gen)
    errors = {}
    for name in ("tq-k4v4", "tq-k4v4+prerope", "tq-k4v4+ropemean"):
        cache = make_cache(name, ROPED)
        keys, start = [], 0
        for T in (40, 1, 1, 20):
            k = rope_at(common + 0.5 * torch.randn(1, 2, T, 64, generator=gen), start)
            v = torch.randn(1, 2, T, 64, generator=gen)
            cache.append(0, k, v)
            cache.attend(0, torch.randn(1, 6, T, 64, generator=gen))
            keys.append(k)
            start += T
        k_all = torch.cat(keys, dim=2)
        errors[name] = ((cache.dequantized(0)[0] - k_all).norm() / k_all.norm()).item()
        gen = torch.Generator().manual_seed(4)
        common = 3 * torch.randn(1, 2, 1, 64, generator=gen)
    assert errors["tq-k4v4+prerope"] < errors["tq-k4v4"] / 2, errors
    assert errors["tq-k4v4+ropemean"] < errors["tq-k4v4"] / 2, errors


@pytest.fixture(scope="module")
def model():
    from .conftest import tiny_model
    from .test_causal_caches import SEQ

    return tiny_model(seed=3, n_heads=4, n_kv_heads=2, d_model=256, max_seq_len=SEQ)


@pytest.mark.parametrize("name", ["tq-k4v4+prerope", "tq-k4v4+ropemean+sink1"])
def test_later_tokens_never_change_earlier_logits(model, name):
    tokens = two_sequences()
    a = chunked_logits(model, tokens[:1], name, CHUNKS)
    b = chunked_logits(model, tokens[1:], name, CHUNKS)
    assert torch.equal(a[:, :SAME], b[:, :SAME]) and not torch.equal(a[:, SAME:], b[:, SAME:])
    geometry = CacheGeometry.for_model(model.config, 1, 16)
    assert geometry.rope_inv_freq is not None and len(geometry.rope_inv_freq) == model.config.head_dim // 2


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("name", ["tq-k4v4+prerope", "tq-k3v3+prerope+sink2+recent8", "tq-k4v4+ropemean+sink1"])
def test_prerope_scores_a_key_chunk_at_a_time(name, kernel, monkeypatch):
    """Keys rebuilt, turned by RoPE and scored == dense attention over the whole stored K/V. In C (the one read of
    TurboQuant codes, kernels/paged.c) nothing is decoded into torch tensors; the torch path (one pass: ATTEND_ROWS out
    of reach) decodes the keys 16 at a time, every decoded span within the chunk."""
    monkeypatch.setattr(compressed, "ATTEND_KEYS", 16)
    monkeypatch.setattr(compressed, "ATTEND_ROWS", 10**9)
    spans = []
    decoded = TqCodec.decoded

    def counted(self, buffer, codes, lo, hi):
        keys = any(codes is key_codes for key_codes in self.layer_key_codes.values())
        return (spans.append(hi - lo) if keys else None) or decoded(self, buffer, codes, lo, hi)

    monkeypatch.setattr(TqCodec, "decoded", counted)
    seen = coded_reads = 0
    for cache, q, k_all, v_all in feed(name, ROPED):
        if not kernel:
            cache.code_kernel = None
        for layer in range(ROPED.n_layers):
            spans.clear()
            first_read = cache.awaits_queries(layer)                # read exactly: nothing is coded yet
            out = cache.attend(layer, q)
            spans_read = list(spans)
            k, v = (k_all, v_all) if first_read else cache.dequantized(layer)
            torch.testing.assert_close(out, grouped_attention(q, k, v, cache.scale), atol=2e-5, rtol=1e-4)
            assert max(spans_read, default=0) <= 16, spans_read
            seen += len(spans_read)
            coded_reads += not first_read
    assert coded_reads and (not seen if kernel else seen)


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("name, window", [("tq-k4v4+prerope", None), ("tq-k3v3+prerope+sink3+recent8", 11), ("tq-k4v4+prerope+qjl+sink1", None),
                                          ("tq-k4v4+outliers2", None), ("tq-k3v3+prerope+sink1+outliers2+recent8", None),
                                          ("tq-k4v4+ropemean+sink1", None), ("tq-k3v3+ropemean+recent8", 11)])
def test_prerope_long_chunks_in_spans_equal_one_pass(name, window, kernel, monkeypatch):
    """+prerope (and +outliersN, keys rebuilt with their outliers) reads spans like the other widths: blocks of ≤ 45
    rows × spans of ≤ 32 keys == the one-pass read."""
    g = replace(ROPED, n_layers=1, batch=2, capacity=160, window=window)
    blocked, one_pass = make_cache(name, g), make_cache(name, g)
    if not kernel:
        blocked.code_kernel = one_pass.code_kernel = None
    assert blocked.reads_spans
    shapes = []
    span_attend = TurboQuantCache._span_attend
    gen = torch.Generator().manual_seed(3)
    for T in (70, 60, 1, 12):
        k, v = torch.randn(2, 2, T, 64, generator=gen), torch.randn(2, 2, T, 64, generator=gen)
        q = torch.randn(2, 6, T, 64, generator=gen)
        blocked.append(0, k, v)
        one_pass.append(0, k, v)
        reference = one_pass.attend(0, q)
        with monkeypatch.context() as patch:
            patch.setattr(compressed, "ATTEND_ROWS", 45)
            patch.setattr(compressed, "ATTEND_KEYS", 32)
            patch.setattr(TurboQuantCache, "_span_attend",
                          lambda self, layer, qg, lo, hi, *rest: shapes.append((qg.shape[2], hi - lo)) or span_attend(self, layer, qg, lo, hi, *rest))
            ours = blocked.attend(0, q)
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert shapes and max(r for r, _ in shapes) <= 45 and max(n for _, n in shapes) <= 32


# -- +rot=haar ------------------------------------------------------------------------------------------

def test_a_shared_haar_basis_gives_orthogonal_seeded_rotations_of_their_own():
    basis = haar_matrix(64, torch.Generator().manual_seed(1))
    eye = torch.eye(64)
    torch.testing.assert_close(basis @ basis.T, eye, atol=1e-5, rtol=0)
    a, b = Rotation(64, 3, basis=basis), Rotation(64, 4, basis=basis)
    x = torch.randn(5, 64)
    torch.testing.assert_close(a.invert(a.apply(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.apply(eye) @ a.apply(eye).T, eye, atol=1e-5, rtol=0)
    assert not torch.allclose(a.apply(x), b.apply(x)) and a.nbytes == 64 and not a.hadamard
    torch.testing.assert_close(Rotation(64, 3, basis=basis).apply(x), a.apply(x))


def test_haar_codes_two_basis_vectors_at_the_papers_distortion_where_hadamard_does_not():
    """x = (e_i + e_j)/√2: a randomized Hadamard maps it to a vector with half its coordinates exactly 0 (a law the
    Lloyd-Max codebook was not made for); a Haar rotation spreads it like any unit vector (paper: 0.009 at 4 bits)."""
    pairs = torch.combinations(torch.arange(64), 2)[::7]                   # (N, 2)
    x = torch.zeros(len(pairs), 64).scatter_(1, pairs, 2 ** -0.5)           # (N, 64) unit vectors
    codes = RotatedCodes(64, 4)
    errors = {}
    for kind, rot in (("hadamard", Rotation(64, 0)), ("haar", Rotation(64, 0, basis=haar_matrix(64, torch.Generator().manual_seed(0))))):
        y = rot.apply(x)
        errors[kind] = ((rot.invert(codes.decode(codes.encode(y)[0])) - x) ** 2).sum(-1).mean().item()
        if kind == "hadamard":
            assert ((y.abs() < 1e-6).float().mean(dim=-1) == 0.5).all()
    assert errors["haar"] == pytest.approx(0.009, rel=0.15)
    assert abs(errors["hadamard"] - 0.009) > abs(errors["haar"] - 0.009), errors


@pytest.mark.parametrize("name", ["tq-k4v4+rot=haar", "tq-k3v3+prerope+rot=haar+sink1"])
def test_haar_caches_read_exactly_what_they_store_and_count_the_basis(name):
    check_attend_is_exact_to_storage(name, ROPED)
    check_nbytes(name, ROPED)
    base = name.replace("+rot=haar", "")
    assert expected_nbytes(name, ROPED, torch.bfloat16, 1) == expected_nbytes(base, ROPED, torch.bfloat16, 1) + 64 * 64 * 4
    assert make_cache(name, ROPED).config.name == name


def test_the_haar_basis_follows_the_seed():
    one, two = make_cache("tq-k4v4+rot=haar", GEOMETRY), make_cache("tq-k4v4+rot=haar+seed1", GEOMETRY)
    assert not torch.equal(one.codec.haar_basis, two.codec.haar_basis)
    assert torch.equal(one.codec.haar_basis, make_cache("tq-k4v4+rot=haar", GEOMETRY).codec.haar_basis)
    with pytest.raises(ConfigError, match="unknown option 'rot=qr'"):
        make_cache("tq-k4v4+rot=qr", GEOMETRY)


def most_coded_keys_read_in_c_like_torch(name: str, g: CacheGeometry, chunks, seed: int) -> int:
    """Feed `chunks` to two caches `name`, one read through the C kernel and one through torch; after each chunk every
    layer's attention is the same in both. Returns the most coded keys one C read scored."""
    most = 0
    for (cache, q, _, _), (torch_cache, _, _, _) in zip(feed(name, g, chunks, seed=seed), feed(name, g, chunks, seed=seed)):
        torch_cache.code_kernel = None
        cache.codes_in_c = False   # the same codes in both (the first chunk waits for its queries): C reads, torch reads
        assert cache.code_kernel is not None
        for layer in range(g.n_layers):
            if not cache.awaits_queries(layer):
                most = max(most, cache._n_comp[layer])
            torch.testing.assert_close(cache.attend(layer, q), torch_cache.attend(layer, q), atol=2e-5, rtol=1e-4)
    return most


@pytest.mark.parametrize("name, window", [("tq4", None), ("tq3", 24), ("tq4+recent8", None), ("tq3+recent8+sink3", 24),
                                          ("tq-k3.5v3.125+prerope+vq+norms8+sink1", 24),
                                          ("tq-k4v4+prerope+sink1+halloc=k534453v453354", None),
                                          ("tq-k4v4+ropemean+sink1+norms8+kscale=lsq+vscale=lsq", 24),
                                          ("tq-k4v4+prerope+qjl+sink1", None), ("tq-k4v3+prerope+outliers2+sink1", 24),
                                          ("tq-k4v4+qjl+outliers1+recent8", None), ("tq-k4v4+ropemean+qjl+sink1", 24),
                                          ("tq-k4v4+sink1+halloc=k534453v453354+outliers2", None)])
def test_the_presets_read_in_c_like_the_torch_path(name, window):
    """The presets' coded tokens (and +qjl's, +outliersN's) read through the one C read (kernels/paged.c
    kvlab_tq_attention: each batch row's one block, keys rebuilt before RoPE, +norms8 scales, the residuals' sketches,
    the kept key entries, the sink and recent window merged by log-sum-exp) == the torch path, batch 2 (each row its
    own calibration), chunks that cross the window and a sliding-window model."""
    g = replace(ROPED, batch=2, window=window)
    assert most_coded_keys_read_in_c_like_torch(name, g, (40, 1, 1, 30, 5, 1), seed=5) > 0


@pytest.mark.parametrize(("name", "head_dim"), [("tq4", 64), ("tq-k4v4+ropemean+recent8", 64), ("tq4", 96), ("tq4", 128)])
def test_ropemean_runs_of_64_keys_read_in_c_like_the_torch_path(name, head_dim):
    """+ropemean's offsets of whole runs of 64 coded keys (decode.c turn_scores_mirrored: the run's keys scored in pairs
    about its middle key, the first from its own RoPE row) == the torch path, over runs that start anywhere: prompt
    chunks of 150 and 70 keys, then single tokens; head dims 64, 96 and 128."""
    g = replace(GEOMETRY, batch=2, capacity=240, head_dim=head_dim, head_dim_v=head_dim, rope_inv_freq=rope_inv_freq(head_dim))
    assert most_coded_keys_read_in_c_like_torch(name, g, (150, 1, 70, 1, 1), seed=7) >= 64
