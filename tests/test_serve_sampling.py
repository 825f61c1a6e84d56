"""The batched sampler's features: penalties, logit_bias and min_p (against a plain per-row reference), logprobs
(log_softmax of the engine's own logits), n choices forked from one prefill, and their HTTP side (the openai
client, streamed and not) with /tokenize and /detokenize."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.cache import CacheGeometry, make_cache
from kvlab.serve import Engine, SamplingParams
from kvlab.serve import runner as runner_module
from kvlab.serve.sampling import TokenCounts, adjust_logits, sample_rows

PROMPT = "The capital of France is"


# -- the logits adjustments, against a plain reference ------------------------------------------------------
def reference_adjust(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, token by token, as the formulas read (HF's repetition penalty, OpenAI's presence/frequency)."""
    row = row.clone()
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    if p.min_p > 0 and not p.greedy:
        probs = torch.softmax(row / p.temperature, dim=-1)
        row[probs < p.min_p * probs.max()] = float("-inf")
    return row


def test_adjust_logits_equals_the_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    V = 50
    params = [SamplingParams(), SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(repetition_penalty=1.3, logit_bias=((3, 5.0), (7, -100.0))),
              SamplingParams(temperature=0.8, min_p=0.2), SamplingParams(temperature=1.5, min_p=0.05, repetition_penalty=0.7,
                                                                         frequency_penalty=1.0, logit_bias=((1, 2.5),))]
    prompts = [[1, 2, 3], [4, 4, 5], [6, 7], [8], [1, 9, 9]]
    outputs = [[], [4, 10, 10, 10], [11, 6], [12], [1, 1, 13]]
    counts = []
    for p, prompt, output in zip(params, prompts, outputs):
        c = TokenCounts(V, prompt)
        for t in output:
            c.add(t)
        counts.append(c if p.counts_tokens else None)
    logits = torch.randn(len(params), V, generator=gen) * 3
    got = adjust_logits(logits, params, counts)
    for r, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        want = reference_adjust(logits[r], p, prompt, output)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got[r])), r
        assert torch.allclose(got[r][finite], want[finite], atol=1e-5), r


def test_logit_bias_and_penalties_steer_greedy_draws():
    V = 20
    logits = torch.zeros(3, V)
    logits[:, 5] = 2.0                                             # token 5 wins unless something moves it
    counts = TokenCounts(V, [0])
    counts.add(5)
    params = [SamplingParams(logit_bias=((9, 3.0),)), SamplingParams(presence_penalty=2.0, frequency_penalty=0.5),
              SamplingParams()]
    draws = sample_rows(logits, params, [None] * 3, counts=[None, counts, None])
    assert [d[0].token for d in draws] == [9, draws[1][0].token, 5] and draws[1][0].token != 5


# -- the engine on SmolLM2 ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, kv_budget="16MiB", max_batch=8, block_size=16)


def run(engine, prompt_ids, sampling):
    """One request to the end: {index: (token ids, text, finish_reason, draws)}."""
    rid = engine.add_request(prompt_ids, sampling)
    choices: dict[int, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            ids, text, _, draws = choices.setdefault(out.index, [[], "", None, []])
            choices[out.index] = [ids + out.new_token_ids, text + out.text_delta, out.finish_reason,
                                  draws + (out.logprobs or [])]
    return choices


def test_logprobs_are_log_softmax_of_the_engines_logits(engine, smollm2, monkeypatch):
    seen = []

    def recording(logits, *args, **kw):
        seen.append(logits.clone())
        return sample_rows(logits, *args, **kw)

    monkeypatch.setattr(runner_module, "sample_rows", recording)
    prompt = smollm2.tokenizer.encode(PROMPT)
    [(ids, _, _, draws)] = run(engine, prompt, SamplingParams(max_tokens=5, logprobs=4, ignore_eos=True)).values()
    assert len(draws) == len(seen) == 5
    for logits, draw, token in zip(seen, draws, ids):
        want = torch.log_softmax(logits[0].float(), dim=-1)
        assert draw.token == token and math.isclose(draw.logprob, want[token].item(), abs_tol=1e-6)
        values, top = want.topk(4)
        assert [t for t, _ in draw.top] == top.tolist()
        assert all(math.isclose(lp, v, abs_tol=1e-6) for (_, lp), v in zip(draw.top, values.tolist()))
        assert draw.top[0][0] == token                       # greedy: the chosen token is the most likely
    # and those logits are the model's: the plain torch forward over prompt + output agrees
    full = torch.tensor([prompt + ids[:-1]])
    cache = make_cache("dense", CacheGeometry.for_model(smollm2.config, capacity=full.shape[1]))
    reference = torch.log_softmax(smollm2.model(full, cache)[0, len(prompt) - 1:].float(), dim=-1)   # (5, V)
    for i, (draw, token) in enumerate(zip(draws, ids)):
        assert abs(draw.logprob - reference[i, token].item()) < 2e-3


def test_n_greedy_choices_are_equal_and_the_prompt_is_prefilled_once(smollm2):
    engine = Engine(smollm2, kv_budget="16MiB", max_batch=8, block_size=16, prefix_caching=False)
    prompt = smollm2.tokenizer.encode(PROMPT)
    single = run(engine, prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    before = engine.stats().computed_tokens
    choices = run(engine, prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=4))
    assert sorted(choices) == [0, 1, 2, 3]
    assert all(c[0] == single[0] and c[1] == single[1] for c in choices.values())
    assert engine.stats().computed_tokens - before == len(prompt) + 4 * (6 - 1)    # one prefill, 4 x 5 decodes
    assert engine.stats().blocks_used == 0                                        # every fork gave its blocks back


def test_n_sampled_choices_differ_and_repeat_with_a_seed(engine, smollm2):
    prompt = smollm2.tokenizer.encode(PROMPT)
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    first, again = run(engine, prompt, sampling), run(engine, prompt, sampling)
    assert [c[0] for c in first.values()] == [c[0] for c in again.values()]
    assert len({tuple(c[0]) for c in first.values()}) > 1


def test_penalties_change_what_they_should(engine, smollm2):
    prompt = smollm2.tokenizer.encode("Repeat after me: la la la la la la la la")
    plain = run(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0][0]
    penalised = run(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                                                   presence_penalty=2.0))[0][0]
    assert len(set(penalised)) > len(set(plain))                     # fewer repeats
    repeated = run(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8))[0][0]
    assert sum(t in prompt for t in repeated) < sum(t in prompt for t in plain)
    forced = smollm2.tokenizer.encode(" banana")[0]
    biased = run(engine, prompt, SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=((forced, 100.0),)))[0][0]
    assert biased == [forced] * 3
    banned = run(engine, prompt, SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=((plain[0], -100.0),)))[0][0]
    assert banned[0] != plain[0]


# -- over HTTP --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2):
    pytest.importorskip("fastapi")
    from kvlab.serve.http import ServerConfig, create_app

    from .serve_fakes import ServerThread

    engine = Engine(smollm2, kv_budget="16MiB", max_batch=8, block_size=16)
    config = ServerConfig(model_name="smollm2", context_length=smollm2.config.max_seq_len, max_running=8)
    with ServerThread(create_app(engine, smollm2.tokenizer, config)) as thread:
        thread.engine = engine
        yield thread


def test_chat_logprobs_and_n_streamed_and_not(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    ask = dict(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5, temperature=0,
               logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens // 2 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode() .startswith(whole.choices[0].message.content)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens; the logprobs to 1e-4: the stream runs one sequence, the n=2 request a batch of two, whose
    # products sum in another order (a logprob rounded to 4 places can fall either side of a boundary)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completion_logprobs_and_n_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == whole.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp_, abs=1e-6)
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, n=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: whole.choices[0].text, 1: whole.choices[0].text, 2: whole.choices[0].text}


def test_tokenize_and_detokenize(server, smollm2):
    httpx = pytest.importorskip("httpx")
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert got["tokens"] == smollm2.tokenizer.encode(PROMPT) and got["count"] == len(got["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == smollm2.tokenizer.encode(rendered, add_special=False)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == PROMPT
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert both.status_code == 400
