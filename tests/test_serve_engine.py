"""The batched engine on the real SmolLM2: every sequence's tokens equal its tokens generated alone.

"Alone" is kvlab's single-sequence path (generate.generate with a DenseCache). Greedy fp32, mixes of
prompt and output lengths, chunked prefill, prefix hits, preemption under a tiny budget, abort.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.errors import ConfigError, RequestTooLargeError
from kvlab.generate import SamplingConfig, generate
from kvlab.serve import Engine, SamplingParams

from .conftest import tiny_model

TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. To die, "
        "to sleep, no more; and by a sleep to say we end the heart-ache and the thousand natural shocks that flesh "
        "is heir to: 'tis a consummation devoutly to be wished.")


def ids_of(smollm2, n: int, offset: int = 0) -> list[int]:
    ids = smollm2.tokenizer.encode(TEXT)
    return (ids * 3)[offset:offset + n]


def alone(smollm2, prompt: list[int], max_tokens: int, sampling: SamplingConfig = SamplingConfig()) -> list[int]:
    geometry = CacheGeometry.for_model(smollm2.config, capacity=len(prompt) + max_tokens)
    cache = make_cache("dense", geometry)
    return generate(smollm2.model, torch.tensor([prompt]), cache, max_tokens, sampling, smollm2.tokenizer.eos_ids).token_ids[0]


def run_all(engine: Engine, on_step=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if on_step:
            on_step(steps)
    return tokens


def test_mixed_lengths_with_chunked_prefill_equal_each_sequence_alone(smollm2):
    cases = [(ids_of(smollm2, 3), 6), (ids_of(smollm2, 21, 5), 12), (ids_of(smollm2, 47, 9), 4), (ids_of(smollm2, 70, 1), 9)]
    engine = Engine(smollm2, kv_budget="32MiB", max_batch=4, max_step_tokens=32)    # prompts span several steps
    outputs = engine.generate([p for p, _ in cases], [SamplingParams(max_tokens=n) for _, n in cases], progress=False)
    for (prompt, n), out in zip(cases, outputs):
        assert out.token_ids == alone(smollm2, prompt, n)
        assert out.finish_reason == "length" and len(out.token_ids) == n
        assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special=True)
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.running == stats.waiting == 0 and stats.generated_tokens == sum(n for _, n in cases)


def test_prefix_hits_compute_only_the_rest_and_change_nothing(smollm2):
    system = ids_of(smollm2, 40)
    prompts = [system + ids_of(smollm2, n, 50 + n) for n in (3, 9, 17)]
    engine = Engine(smollm2, kv_budget="32MiB", max_batch=4)
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=5))
    (out,) = engine.step()                                    # the system prompt's full blocks are now cached
    later = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in prompts[1:]]
    cached: dict[str, int] = {}
    tokens: dict[str, list[int]] = {first: out.new_token_ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.cached_prompt_tokens
    assert cached[first] == 0 and [cached[r] for r in later] == [32, 32]   # two full blocks of 16 of the 40 shared
    assert engine.stats().prefix_hit_tokens == 64
    for rid, prompt in zip([first, *later], prompts):
        assert tokens[rid] == alone(smollm2, prompt, 5)


def test_preemption_under_a_tiny_budget_loses_nothing(smollm2):
    prompts = [ids_of(smollm2, 30, k) for k in (0, 7, 13, 20)]               # 2 blocks each; the 3rd is needed at token 32
    plan_bytes = Engine(smollm2, kv_budget="64MiB").capacity.block_bytes
    engine = Engine(smollm2, kv_budget=6 * plan_bytes, max_batch=4, prefix_caching=False)
    assert engine.capacity.n_blocks == 6
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=5))
    used = []
    tokens = run_all(engine, on_step=lambda _: used.append(engine.stats().blocks_used))
    assert engine.stats().preemptions > 0 and max(used) <= 6
    for rid, prompt in zip(sorted(tokens, key=int), prompts):
        assert tokens[rid] == alone(smollm2, prompt, 5)


def test_abort_frees_blocks_at_once_and_leaves_the_others_unchanged(smollm2):
    prompts = [ids_of(smollm2, n, n) for n in (12, 25, 33)]
    engine = Engine(smollm2, kv_budget="32MiB", max_batch=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    before = engine.stats().blocks_used
    engine.abort(ids[1])
    engine.abort("no such request")                          # unknown id: no-op
    assert engine.stats().blocks_used == before - 2          # its two blocks (25 + 1 tokens) are free
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {ids[0]: "length", ids[1]: "abort", ids[2]: "length"}
    assert len(tokens[ids[1]]) == 2                          # the two tokens before the abort, nothing after
    for rid, prompt in ((ids[0], prompts[0]), (ids[2], prompts[2])):
        assert tokens[rid] == alone(smollm2, prompt, 8)


def test_seeded_sampling_stop_strings_and_stop_ids(smollm2):
    prompt = ids_of(smollm2, 10)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, top_p=0.9, seed=3)
    reference = alone(smollm2, prompt, 8, SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, seed=3))
    greedy = alone(smollm2, prompt, 12)
    text = smollm2.tokenizer.decode(greedy, skip_special=True)
    stop = text[6:9]                                          # a stop string inside the greedy text
    engine = Engine(smollm2, kv_budget="16MiB", max_batch=4)
    out_sampled, out_stop, out_id = engine.generate(
        [prompt] * 3,
        [sampled, SamplingParams(max_tokens=12, stop=(stop,)), SamplingParams(max_tokens=12, stop_token_ids=(greedy[3],))],
        progress=False)
    assert out_sampled.token_ids == reference
    assert out_stop.finish_reason == "stop" and out_stop.text == text[:text.find(stop)]
    assert out_id.finish_reason == "stop" and out_id.token_ids == greedy[:4]


def test_f16_blocks_batched_equal_one_at_a_time(smollm2):
    prompts = [ids_of(smollm2, n, n) for n in (5, 19, 36)]
    params = SamplingParams(max_tokens=6)
    batched = Engine(smollm2, cache="dense-f16", kv_budget="16MiB", max_batch=4, max_step_tokens=24)
    batched = batched.generate(prompts, params, progress=False)
    one = Engine(smollm2, cache="dense-f16", kv_budget="16MiB", max_batch=1)
    for prompt, out in zip(prompts, batched):
        assert out.token_ids == one.generate([prompt], params, progress=False)[0].token_ids


def test_requests_that_can_never_fit_are_rejected_at_add_request(smollm2):
    engine = Engine(smollm2, kv_budget="4MiB")                # a few blocks only
    with pytest.raises(RequestTooLargeError, match="KV pool"):
        engine.add_request(ids_of(smollm2, 10), SamplingParams(max_tokens=engine.capacity.tokens))
    with pytest.raises(RequestTooLargeError, match="context"):
        Engine(smollm2, kv_budget="1GiB").add_request([1] * 10, SamplingParams(max_tokens=smollm2.config.max_seq_len))
    for bad in ([], [smollm2.config.vocab_size], [-1], ["a"]):
        with pytest.raises(ConfigError):
            engine.add_request(bad)
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request([1, 2], request_id="x")
        engine.add_request([1, 2], request_id="x")
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    fresh = Engine(smollm2, kv_budget="4MiB")
    with pytest.raises(RequestTooLargeError):                # all or nothing: the good prompt is not left queued
        fresh.generate([[1, 2, 3], [1] * fresh.capacity.tokens], progress=False)
    assert not fresh.has_unfinished() and fresh.stats().waiting == 0
    with pytest.raises(ConfigError, match="max_step_tokens"):
        Engine(smollm2, max_batch=8, max_step_tokens=4)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_on_a_tiny_model_never_fails_mid_step_and_matches_alone(seed):
    """Random prompts (many sharing prefixes), a pool of a few blocks, aborts and late arrivals: every step
    succeeds, blocks never exceed the pool, and every finished sequence equals its greedy run alone."""
    rng = random.Random(seed)
    model = tiny_model(seed, max_seq_len=64)
    block_bytes = Engine(model, kv_budget="1MiB", block_size=4).capacity.block_bytes
    engine = Engine(model, kv_budget=rng.randint(6, 12) * block_bytes, block_size=4, max_batch=rng.choice([2, 3, 5]),
                    max_step_tokens=rng.choice([5, 8, 13]))
    shared = [rng.randrange(97) for _ in range(10)]
    pending = []
    for _ in range(10):
        head = shared[:rng.randint(0, 10)]
        pending.append((head + [rng.randrange(97) for _ in range(rng.randint(1, 12))], rng.randint(1, 8)))
    requests, tokens, finished, aborted = {}, {}, {}, set()
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.5:
            prompt, n = pending.pop()
            requests[engine.add_request(prompt, SamplingParams(max_tokens=n))] = (prompt, n)
        if requests and rng.random() < 0.05:
            victim = rng.choice(sorted(requests))
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        stats = engine.stats()
        assert stats.blocks_used + stats.blocks_free == stats.blocks_total == engine.capacity.n_blocks
    assert engine.stats().blocks_used == 0 and set(finished) == set(requests)
    for rid, (prompt, n) in requests.items():
        if finished[rid] == "abort":
            continue
        geometry = CacheGeometry.for_model(model.config, capacity=len(prompt) + n)
        want = generate(model, torch.tensor([prompt]), make_cache("dense", geometry), n).token_ids[0]
        assert tokens[rid] == want, rid
