"""TurboQuantCache: rotations, distortion against the paper, QJL unbiasedness, bytes, attention on codes."""

import math

import pytest
import torch

from kvlab.cache import CacheGeometry, CacheSpec, expected_nbytes, make_cache
from kvlab.cache.rotation import Rotation
from kvlab.cache.tq_codec import RotatedCodes
from kvlab.errors import ConfigError, NonFiniteError

from kvlab.cache.attention import grouped_attention

from .compressed_checks import (GEOMETRY, check_attend_is_exact_to_storage, check_code_kernel_equals_the_torch_path, check_nbytes,
                              check_non_finite_is_a_one_line_error, feed, relative_error)

SMOLLM2 = CacheGeometry(n_layers=30, n_kv_heads=3, head_dim=64, capacity=511, n_heads=9)
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.034, 4: 0.009}


def unit_vectors(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_on_random_unit_vectors_within_paper_bounds(bits):
    x = unit_vectors(4000, 128)
    rot = Rotation(128, seed=bits)
    codes = RotatedCodes(128, bits)
    packed, _ = codes.encode(rot.apply(x))
    x_hat = rot.invert(codes.decode(packed))
    mse = ((x - x_hat) ** 2).sum(dim=-1).mean().item()
    assert 4.0 ** -bits <= mse <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.06)


def test_fractional_width_lies_between_its_neighbours():
    x = unit_vectors(2000, 64, seed=1)
    rot = Rotation(64, seed=0)
    errors = {}
    for bits in (3, 3.5, 4):
        codes = RotatedCodes(64, bits)
        errors[bits] = ((rot.invert(codes.decode(codes.encode(rot.apply(x))[0])) - x) ** 2).sum(-1).mean().item()
    assert errors[4] < errors[3.5] < errors[3]
    assert errors[3.5] == pytest.approx((errors[3] + errors[4]) / 2, rel=0.1)  # half the channels at each width
    assert RotatedCodes.packed_bytes(64, 3.5) == 32 * 4 // 8 + 32 * 3 // 8


def test_rotation_is_orthogonal_seeded_and_per_layer():
    for dim in (64, 80):  # randomized Hadamard / random orthogonal
        rot = Rotation(dim, seed=7)
        eye = torch.eye(dim)
        torch.testing.assert_close(rot.apply(eye) @ rot.apply(eye).T, eye, atol=1e-5, rtol=0)
        x = torch.randn(5, dim)
        torch.testing.assert_close(rot.invert(rot.apply(x)), x, atol=1e-5, rtol=0)
        torch.testing.assert_close(Rotation(dim, seed=7).apply(x), rot.apply(x))
        assert not torch.allclose(Rotation(dim, seed=8).apply(x), rot.apply(x))
    assert Rotation(64, 0).nbytes == 64 and Rotation(80, 0).nbytes == 80 * 80 * 4
    cache = make_cache("tq-k4v4", GEOMETRY)
    assert not torch.equal(cache.codec.rotations[0].signs, cache.codec.rotations[1].signs)
    assert torch.equal(make_cache("tq-k4v4", GEOMETRY).codec.rotations[2].signs, cache.codec.rotations[2].signs)


def test_qjl_inner_products_are_unbiased():
    # one key, one query; average the estimate over independent rotations and QJL matrices (seeds)
    g = CacheGeometry(n_layers=1, n_kv_heads=1, head_dim=64, capacity=1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 1, 64, generator=gen)
    q = torch.randn(64, generator=gen)
    q = q + 2 * k.flatten()                       # a query aligned with the key: a large true product
    truth = (q @ k.flatten()).item()
    estimates = {"qjl": [], "mse": []}
    for seed in range(1500):
        for kind, name in (("qjl", f"tq2+qjl+seed{seed}"), ("mse", f"tq1+kscale=norm+seed{seed}")):
            cache = make_cache(name, g)
            cache.append(0, k, k)
            estimates[kind].append((cache.dequantized(0)[0].flatten() @ q).item())
    qjl = torch.tensor(estimates["qjl"], dtype=torch.float64)
    mse = torch.tensor(estimates["mse"], dtype=torch.float64)
    stderr = qjl.std().item() / math.sqrt(len(qjl))
    assert abs(qjl.mean().item() - truth) < 4 * stderr
    # the 1-bit MSE quantizer shrinks inner products by about 2/π: a bias the QJL variant removes
    assert mse.mean().item() / truth == pytest.approx(2 / math.pi, abs=0.05)


@pytest.mark.parametrize("name", ["tq-k4v4", "tq-k3v3", "tq2.5", "tq-k4v3", "tq-k3v3+qjl", "tq-k3v3+recent8", "tq2+fp-first-last+recent40",
                                  "tq-k4v4+kscale=lsq+vscale=renorm", "tq-k3v3+kscale=unbiased+bf16norms", "tq-k3v3+center=kv+recent8", "tq-k3v3+center=k", "tq-k3v3+center=none+kscale=norm",
                                  "tq-k3v3+sink7", "tq-k3v3+sink2+recent8", "tq-k3v3+sink200"])
def test_attend_equals_dense_attention_over_dequantized(name):
    check_attend_is_exact_to_storage(name)


def test_non_power_of_two_head_dim():
    check_attend_is_exact_to_storage("tq-k3v3", CacheGeometry(2, 2, 80, capacity=96, n_heads=4))
    check_nbytes("tq-k3v3", CacheGeometry(2, 2, 80, capacity=96, n_heads=4))


def test_reconstruction_error_matches_the_codebook():
    k_err, v_err = relative_error("tq-k4v4")
    assert k_err == pytest.approx(math.sqrt(0.0091), rel=0.1) and v_err == pytest.approx(math.sqrt(0.0091), rel=0.1)
    assert relative_error("tq-k4v4", scale=1e3)[0] == pytest.approx(k_err, rel=1e-2)  # scale-free


@pytest.mark.parametrize("name", ["tq-k4v4", "tq-k3v3", "tq3.5", "tq2.5", "tq-k4v3", "tq-k4v4+qjl", "tq-k3v3+recent64", "tq-k3v3+fp-first-last",
                                  "tq-k4v4+sink1", "tq-k3v3+sink4+recent8", "tq-k3v3+sink600"])
def test_nbytes_equals_formula(name):
    check_nbytes(name)
    check_nbytes(name, SMOLLM2)


def test_smollm2_bytes_per_token_meet_the_targets():
    dense = 30 * 3 * 2 * 64 * 2
    assert expected_nbytes("dense", SMOLLM2, torch.bfloat16, 511) / 511 == dense == 23040
    # sign vectors per layer, K and V codebooks + byte tables (4 bits), fp8 key offsets and 4-bit key
    # channel weights per layer and head
    fixed = 30 * 64 + 4 * (16 + 15 + 256 * 2) * 2 + 30 * 3 * 64 + 30 * 3 * 32
    assert expected_nbytes("tq-k4v4", SMOLLM2, torch.bfloat16, 511) == 30 * 3 * 2 * (32 + 2) * 511 + fixed
    assert expected_nbytes("tq-k4v4", SMOLLM2, torch.bfloat16, 511) / 511 <= 6227
    assert expected_nbytes("tq-k3v3", SMOLLM2, torch.bfloat16, 511) / 511 <= 4702


def test_zero_constant_and_large_vectors():
    g = GEOMETRY
    cache = make_cache("tq-k3v3", g)
    zeros = torch.zeros(1, g.n_kv_heads, 4, g.head_dim)
    const = torch.full((1, g.n_kv_heads, 4, g.head_dim), -2.0)
    big = torch.randn(1, g.n_kv_heads, 4, g.head_dim) * 2e3     # norms ~1.6e4, inside float16
    cache.append(0, zeros, const)
    cache.append(0, big, zeros)
    k, v = cache.dequantized(0)
    assert torch.equal(k[:, :, :4], zeros) and torch.equal(v[:, :, 4:], zeros)
    assert ((v[:, :, :4] - const).norm() / const.norm()) < 0.25
    assert ((k[:, :, 4:] - big).norm() / big.norm()) < 0.25
    assert torch.isfinite(cache.attend(0, torch.randn(1, g.n_heads, 8, g.head_dim))).all()
    bf16 = make_cache("tq-k3v3+bf16norms", g)
    bf16.append(0, big * 1e3, big * 1e3)                          # beyond float16: bf16 norms hold it
    assert torch.isfinite(bf16.dequantized(0)[0]).all()
    with pytest.raises(NonFiniteError, match="bf16norms|float16"):
        cache.append(1, big * 1e3, big)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_is_a_one_line_error(bad):
    check_non_finite_is_a_one_line_error("tq-k4v4", bad, "v")


def test_key_offset_comes_from_the_first_append_and_costs_fp8_bytes():
    cache = make_cache("tq-k4v4", GEOMETRY)
    k = torch.randn(1, 2, 16, 64) + 5.0
    cache.append(0, k, torch.randn(1, 2, 16, 64))
    assert cache.codec.k_offset[0].dtype == torch.float8_e4m3fn
    torch.testing.assert_close(cache.codec.k_offset[0].float(), k.mean(dim=2), atol=0.4, rtol=0.07)
    assert not cache.codec.v_offset
    plain = make_cache("tq-k4v4+center=none", GEOMETRY)
    assert cache.nbytes - plain.nbytes == GEOMETRY.n_layers * GEOMETRY.n_kv_heads * 64
    short = make_cache("tq-k4v4", GEOMETRY)
    short.append(0, k[:, :, :1], k[:, :, :1])  # one token: too few to estimate an offset
    assert short.codec.k_offset[0].float().abs().sum() == 0


def test_bad_configurations():
    with pytest.raises(ConfigError, match="whole channels"):
        make_cache("tq3.3", GEOMETRY)
    with pytest.raises(ConfigError, match="at least 2"):
        make_cache("tq1+qjl", GEOMETRY)
    with pytest.raises(ConfigError, match="scale mode"):
        make_cache("tq-k4v4+kscale=magic", GEOMETRY)


def test_decode_steps_match_one_prefill():
    # the same tokens appended one at a time or all at once are stored identically (no offset and no
    # key weights: they come from the first append, which differs)
    tokens = [c for c in feed("tq-k3v3+center=none+kweights=none", chunks=(1,) * 12)]
    step_cache = tokens[-1][0]
    k_all, v_all = tokens[-1][2], tokens[-1][3]
    once = make_cache("tq-k3v3+center=none+kweights=none", GEOMETRY)
    for layer in range(GEOMETRY.n_layers):
        once.append(layer, k_all, v_all)
    for a, b in zip(step_cache.dequantized(1), once.dequantized(1)):
        torch.testing.assert_close(a, b)


def test_attend_first_reads_exactly_what_is_stored():
    # the first chunk is coded when first attended (its key weights need the queries)
    check_attend_is_exact_to_storage("tq-k3v3", attend_first=True)


def test_key_weights_follow_the_queries_and_cut_the_score_error():
    # channels 0-7: large key variance that no query reads; channels 8-15: queries' energy, small keys
    gen = torch.Generator().manual_seed(3)
    g = GEOMETRY
    k = torch.randn(1, g.n_kv_heads, 64, 64, generator=gen)
    k[..., :8] *= 20.0
    k[..., 8:16] *= 0.2
    q = torch.randn(1, g.n_heads, 64, 64, generator=gen)
    q[..., :8] *= 0.05
    q[..., 8:16] *= 10.0
    errors = {}
    for name in ("tq-k3v3", "tq-k3v3+kweights=none"):
        cache = make_cache(name, g)
        cache.append(0, k, torch.randn_like(k))
        cache.attend(0, q)
        k_hat, _ = cache.dequantized(0)
        qg = q.reshape(1, g.n_kv_heads, -1, 64)
        errors[name] = ((qg @ (k_hat - k).transpose(-1, -2)).square().mean()).item()
        if name == "tq-k3v3":
            weights = cache.codec.key_weights(0)[0, :, 0]                          # (Hkv, d)
            assert (weights[:, :8] > 2).all() and (weights[:, 8:16] < 0.5).all()
    assert errors["tq-k3v3"] < errors["tq-k3v3+kweights=none"] / 3


def test_key_weights_cost_four_bits_per_channel_and_head():
    with_weights, without = make_cache("tq-k4v4", GEOMETRY), make_cache("tq-k4v4+kweights=none", GEOMETRY)
    assert with_weights.nbytes - without.nbytes == GEOMETRY.n_layers * GEOMETRY.n_kv_heads * 64 // 2
    assert make_cache("tq-k4v4+kweights=none", GEOMETRY).config.name == "tq-k4v4+kweights=none"


@pytest.mark.parametrize("name", ["tq-k3v3+sink7", "int4+sink7+recent8"])
def test_sink_tokens_are_kept_exactly(name):
    # chunks of 5, 1, 1, 32, ...: the sink fills across three appends, then tokens go to the store
    for cache, _, k, v in feed(name):
        k_hat, v_hat = cache.dequantized(1)
        n = min(7, k.shape[2])
        assert torch.equal(k_hat[:, :, :n], k[:, :, :n]) and torch.equal(v_hat[:, :, :n], v[:, :, :n])
    assert not torch.equal(k_hat[:, :, 7:], k[:, :, 7:])                     # the rest is compressed
    assert make_cache(name, GEOMETRY).full.sink == 7 and CacheSpec.parse(name).full.sink == 7


def test_two_appends_before_any_read_stay_exact():
    cache = make_cache("tq-k3v3", GEOMETRY)
    gen = torch.Generator().manual_seed(5)
    k1, v1, k2, v2 = (torch.randn(1, 2, 16, 64, generator=gen) for _ in range(4))
    cache.append(0, k1, v1)
    cache.append(0, k2, v2)                  # the first chunk is coded now, before any query
    q = torch.randn(1, GEOMETRY.n_heads, 4, 64, generator=gen)
    out = cache.attend(0, q)
    k, v = cache.dequantized(0)
    torch.testing.assert_close(out, grouped_attention(q, k, v, cache.scale), atol=2e-5, rtol=1e-4)
    assert ((k - torch.cat([k1, k2], dim=2)).norm() / k.norm()) < 0.25


@pytest.mark.parametrize("name", ["tq-k4v4", "tq-k4v4+sink1", "tq-k4v3", "tq-k4v4+kweights=none", "tq-k4v4+center=kv"])
def test_four_bit_code_lookups_equal_the_torch_path(name):
    """4-bit codes scored and mixed in C (kernels/codebook.c) against torch's decode-then-matmul (tq-k4v3: 4-bit keys,
    3-bit values; every other width: tests/test_tq_kernels.py)."""
    check_code_kernel_equals_the_torch_path(name, seed=12)


def test_a_width_that_does_not_split_the_head_dim_is_one_line_error_for_the_formula_too():
    """tq4.12 on a head dim of 64 (7.68 channels at 5 bits): the cache and its bytes formula both refuse it."""
    for build in (lambda: make_cache("tq-k4.12v4", SMOLLM2), lambda: expected_nbytes("tq-k4.12v4", SMOLLM2, torch.bfloat16, 8)):
        with pytest.raises(ConfigError, match="4.12 bits does not split a head dim of 64") as err:
            build()
        assert "\n" not in str(err.value)


def test_tq4_is_the_preset_recipe_and_the_bare_method_is_tq_k4v4():
    """`tq4` stands for the recommended recipe (cache/format.py PRESETS); options after it apply to the recipe; the bare
    4-bit method prints as tq-k4v4, so every printed name reads back as the cache it names."""
    from kvlab.cache.names import PRESETS, parse

    recipe = PRESETS["tq4"]
    _, config = parse("tq4")
    assert config.name == recipe == "tq-k4v4+ropemean+norms8+sink1+kscale=lsq+vscale=lsq"
    assert config.rope_mean and config.log_norms and config.full.sink == 1 and config.key_bits == config.value_bits == 4
    assert parse("TQ4+seed1")[1] == parse(recipe + "+seed1")[1]
    assert parse("tq4+kscale=renorm")[1].key_scale == "renorm"                  # a later option overrides the recipe's
    bare = parse("tq-k4v4")[1]
    assert bare.name == "tq-k4v4" and not bare.pre_rope and not bare.log_norms and not bare.full.sink
    assert parse(bare.name)[1] == bare and parse(config.name)[1] == config
    from kvlab.cache import describe_formula                                    # a report names the recipe a preset stands for,
    assert describe_formula("tq4", SMOLLM2, torch.bfloat16).startswith(recipe + ": ")   # not a plain name spelled otherwise
    assert describe_formula("tq-k3v3", SMOLLM2, torch.bfloat16).startswith("per key vector")
    with pytest.raises(ConfigError, match="norms8") as err:                     # the recipe's 8-bit scales refuse +qjl
        parse("tq4+qjl")
    assert "\n" not in str(err.value)


def test_the_tq4_preset_meets_the_4_bit_budget_on_smollm2():
    """The tq4 class: at most 6,227 B/token (511 tokens, bf16); the preset's sink token and RoPE frequencies cost less
    than the byte each 8-bit scale frees, so it is smaller than the bare method."""
    roped = CacheGeometry(n_layers=30, n_kv_heads=3, head_dim=64, capacity=511, n_heads=9,
                          rope_inv_freq=tuple(100000.0 ** (-i / 32) for i in range(32)))
    preset = expected_nbytes("tq4", roped, torch.bfloat16, 511)
    assert preset == make_cache("tq4", roped, dtype=torch.bfloat16).nbytes
    assert preset < expected_nbytes("tq-k4v4", roped, torch.bfloat16, 511) <= 6227 * 511
