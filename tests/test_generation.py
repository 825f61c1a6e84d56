"""Generation on the real model: the answer, sampling controls, batches, chunked prefill, streaming."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvlab.cache import CacheGeometry, make_cache
from kvlab.cli import app
from kvlab.generate import SamplingConfig, generate, sample_next
from kvlab.session import run_generation


def test_capital_of_france_is_paris(smollm2):
    run = run_generation("The capital of France is", max_new_tokens=4)
    assert run.text.strip().startswith("Paris")


def test_chat_template_answer(smollm2):
    run = run_generation("What is the capital of France? Answer in one word.", chat=True, max_new_tokens=16)
    assert "Paris" in run.text
    assert run.result.stop_reason == "eos"


def test_all_caches_generate_the_same_tokens(smollm2):
    texts = {name: run_generation("The three primary colours are", cache=name, max_new_tokens=12).result.token_ids[0]
             for name in ("dense", "concat", "none")}
    assert texts["dense"] == texts["concat"] == texts["none"]


def test_chunked_prefill_generates_the_same(smollm2):
    a = run_generation("A long time ago in a galaxy far, far away", max_new_tokens=8)
    b = run_generation("A long time ago in a galaxy far, far away", max_new_tokens=8, chunk_size=3)
    assert a.result.token_ids == b.result.token_ids


def test_batch_of_equal_length_prompts_matches_single_runs(smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode("The sun rises in the"), tok.encode("My favourite food is pizza")]
    assert len(prompts[0]) == len(prompts[1])
    batch = torch.tensor(prompts)
    cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, batch=2, capacity=32))
    together = generate(smollm2.model, batch, cache, 6).token_ids
    for row, prompt in enumerate(prompts):
        single = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=32))
        assert generate(smollm2.model, torch.tensor([prompt]), single, 6).token_ids[0] == together[row]


def test_seeded_sampling_is_reproducible_and_varies(smollm2):
    runs = [run_generation("Once upon a time", temperature=1.0, top_k=50, top_p=0.95, seed=s, max_new_tokens=10).text
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    picked = sample_next(logits, SamplingConfig(temperature=5.0, top_k=1, seed=0), torch.Generator().manual_seed(0))
    assert picked.tolist() == [1, 0]


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.5), g)) for _ in range(50)}
    assert draws == {0}


def test_streaming_pieces_add_up_to_the_text(smollm2):
    pieces = []
    run = run_generation("List three fruits:", max_new_tokens=12, stream=pieces.append)
    assert "".join(pieces) == run.text


def test_stream_decoder_pieces_join_to_the_text_across_multibyte_characters(smollm2):
    """Token by token, with characters split over several tokens (Korean, emoji) and leading spaces:
    the pieces add up to decoding everything at once, and no piece ends inside a character."""
    from kvlab.model.tokenizer import StreamDecoder

    text = "KV 캐시는 이전 토큰의 키와 값을 저장합니다 🙂🚀 so   spaces\tand digits 12345 stay. " * 3
    ids = smollm2.tokenizer.encode(text)
    decoder = StreamDecoder(smollm2.tokenizer)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == smollm2.tokenizer.decode(ids, skip_special=True) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_cli_generate_json(smollm2):
    result = CliRunner().invoke(app, ["generate", "The capital of France is", "--max-new-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    for key in ("text", "token_ids", "prompt_tokens", "new_tokens", "decode_tokens_per_s", "cache_bytes"):
        assert key in record
    assert record["new_tokens"] == 3 and record["prompt_tokens"] == 5
    assert record["cache_bytes"] == 2 * 30 * 3 * 64 * 4 * (5 + 3)
    assert "Paris" in record["text"]
    from kvlab.kernels import block_kernel

    expected = ("native", "fused") if block_kernel() is not None else ("dense", "modules")  # no C compiler: modules
    assert (record["weights"], record["decode_step"]) == expected
    for cache, step in (("int8", expected[1]), ("tq-k4v4+qjl", expected[1]), ("concat", "modules")):   # concat: no fused step
        record = json.loads(CliRunner().invoke(app, ["generate", "Hi", "--max-new-tokens", "2", "--cache", cache, "--json"]).output)
        assert record["decode_step"] == step, cache


def test_cli_info_formula(smollm2):
    result = CliRunner().invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert (record["layers"], record["heads"], record["kv_heads"], record["head_dim_k"]) == (30, 9, 3, 64)
    bf16 = next(r for r in record["kv_bytes_per_token"] if r["kv_type"] == "bf16")
    assert bf16["bytes_per_token"] == 23040 and "2 × 30 layers × 3 kv_heads × 64 head_dim × 2 bytes" in bf16["formula"]


def test_bf16_generation_answers(smollm2):
    run = run_generation("The capital of France is", dtype="bf16", max_new_tokens=4)
    assert "Paris" in run.text
    assert run.result.cache_bytes == 2 * 30 * 3 * 64 * 2 * (5 + 4)  # bf16 cache: 2 bytes per value


def test_batch_rows_stop_at_their_own_eos():
    from kvlab.generate import _cut_after_eos

    assert _cut_after_eos([5, 6, 2, 9, 9], (2,)) == [5, 6, 2]
    assert _cut_after_eos([5, 6, 7], (2,)) == [5, 6, 7]


def test_cli_info_lists_compressed_cache_costs(smollm2):
    record = json.loads(CliRunner().invoke(app, ["info", "--json"]).output)
    costs = {row["cache"]: row for row in record["caches"]}
    assert costs["dense"]["bytes_per_token"] == 23040  # bf16 reference
    assert costs["tq-k4v4"]["bytes_per_token"] == 30 * 3 * 2 * (64 * 4 // 8 + 2)  # codes + 16-bit norm per K and V vector
    # the tq4 preset: 4-bit codes + an 8-bit log scale per vector; the recipe named in its formula
    assert costs["tq4"]["bytes_per_token"] == 30 * 3 * 2 * (64 * 4 / 8 + 1)
    assert costs["tq4"]["formula"].startswith("tq-k4v4+ropemean+norms8+sink1+kscale=lsq+vscale=lsq: per key vector")
    assert costs["tq-k3v3"]["bytes_per_token"] == 30 * 3 * 2 * (64 * 3 // 8 + 2)
    # the tq3 preset: 3.5-bit keys and 3-bit values, each vector with an 8-bit log scale
    assert costs["tq3"]["bytes_per_token"] == 30 * 3 * ((64 * 3.5 / 8 + 1) + (64 * 3 / 8 + 1))
    assert costs["tq3"]["formula"].startswith("tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq: per key vector")


def test_bf16_keeps_rope_frequencies_in_fp32():
    from kvlab.model.llama import rope_inv_freq
    from kvlab.session import cached_model

    bf16 = cached_model(None, "bf16", "cpu")
    assert bf16.model.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.model.inv_freq, rope_inv_freq(bf16.config))


def test_bf16_tracks_fp32_over_a_long_prompt(smollm2):
    """bf16 weights and cache, 300 positions: next-token choices mostly agree with fp32."""
    from kvlab.session import cached_model

    bf16 = cached_model(None, "bf16", "cpu")
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    ids = torch.tensor([smollm2.tokenizer.encode(text)])
    with torch.no_grad():
        ref = smollm2.model(ids, make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=ids.shape[1])))
        low = bf16.model(ids, make_cache("dense", CacheGeometry.for_model(bf16.config, capacity=ids.shape[1]), dtype=torch.bfloat16))
    agreement = (ref.argmax(-1) == low.argmax(-1)).float().mean().item()
    assert ids.shape[1] > 250 and agreement > 0.95, agreement


def test_no_cache_ignores_prefill_chunks(smollm2):
    dense = run_generation("The capital of France is", max_new_tokens=4)
    none_chunked = run_generation("The capital of France is", cache="none", chunk_size=2, max_new_tokens=4)
    assert none_chunked.result.token_ids == dense.result.token_ids


def test_tiny_temperature_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 0.2]])
    assert sample_next(logits, SamplingConfig(temperature=1e-40), torch.Generator().manual_seed(0)).tolist() == [1]


def test_cli_info_hybrid_catalog_model():
    """The seed's Qwen3.5-9B: only 8 of 32 layers keep KV — 2 × 8 × 4 × 256 values per token."""
    record = json.loads(CliRunner().invoke(app, ["info", "qwen3.5-9b", "--json"]).output)
    assert (record["layers"], record["attention_layers"], record["kv_heads"], record["head_dim_k"]) == (32, 8, 4, 256)
    assert record["other_layers"] == {"recurrent": 24}
    assert next(r for r in record["kv_bytes_per_token"] if r["kv_type"] == "bf16")["bytes_per_token"] == 2 * 8 * 4 * 256 * 2


def test_demo_tour_caches_are_valid_names():
    """`make demo` runs every cache in its tour: each name must build (a typo would only show in the demo)."""
    from kvlab.cache import CacheGeometry, make_cache
    from kvlab.demo import TOUR_CACHES

    geometry = CacheGeometry(n_layers=2, n_kv_heads=2, head_dim=64, capacity=8, n_heads=4,
                             rope_inv_freq=tuple(10000.0 ** (-i / 32) for i in range(32)))   # the tq4 preset's +prerope
    assert [make_cache(name, geometry).geometry for name in TOUR_CACHES] == [geometry] * len(TOUR_CACHES)
