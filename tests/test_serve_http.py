"""`kvlab serve`: the OpenAI-compatible HTTP server, started on a free loopback port inside the tests.

Two servers: one on a small fake engine (tests/serve_fakes.py) for the protocol's exact edges, and one on
the real Engine with SmolLM2, whose greedy answers must equal `kvlab generate --chat`'s, alone or with 16
concurrent streaming clients, and whose KV blocks must all come back after aborted streams and shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from .serve_fakes import FakeEngine, FakeTokenizer, ServerThread, fake_text  # noqa: E402

from kvlab.serve.http import ServerConfig, create_app  # noqa: E402

CHAT = [{"role": "user", "content": "hi there"}]
FAKE_PROMPT = FakeTokenizer().encode(FakeTokenizer().apply_chat_template(CHAT))


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    """Poll `condition` (not a timing assertion: the deadline only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent event stream, JSON-decoded ([DONE] kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def fake_server(api_key=None, max_running=4, max_waiting=8, step_delay_s=0.0, grace=5.0, **engine_kw):
    engine = FakeEngine(max_batch=max_running, step_delay_s=step_delay_s, **engine_kw)
    config = ServerConfig(model_name="fake-model", context_length=engine.context, api_key=api_key,
                          max_running=max_running, max_waiting=max_waiting, shutdown_grace_s=grace)
    return ServerThread(create_app(engine, FakeTokenizer(), config)), engine


@pytest.fixture(scope="module")
def fake():
    server, engine = fake_server()
    with server:
        server.engine = engine
        yield server


# -- the protocol, on the fake engine ---------------------------------------------------------------------
def test_chat_completion_streamed_and_not_with_the_openai_client(fake):
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=5, temperature=0)
    assert whole.choices[0].message.content == fake_text(FAKE_PROMPT, 5)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (len(FAKE_PROMPT), 5, len(FAKE_PROMPT) + 5)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == fake_text(FAKE_PROMPT, 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completions_with_stop_strings_and_token_id_prompts(fake):
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)
    prompt_ids = FakeTokenizer().encode("abc")
    full = fake_text(prompt_ids, 6)
    cut = full.index("w", 6)  # the third word: a stop string that ends generation there
    stop = full[cut:cut + 2]
    whole = client.completions.create(model="fake-model", prompt="abc", max_tokens=6, stop=stop)
    assert whole.choices[0].text == full[:full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    by_ids = client.completions.create(model="fake-model", prompt=prompt_ids, max_tokens=6, stop=[stop, "zzz"])
    assert by_ids.choices[0].text == whole.choices[0].text
    streamed = list(client.completions.create(model="fake-model", prompt="abc", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full


def test_models_health_and_metrics(fake):
    with httpx.Client(base_url=fake.url) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-model"]
        client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3})
        text = client.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    for name in ("kvlab_requests_running", "kvlab_requests_waiting", "kvlab_kv_blocks_used", "kvlab_kv_blocks_free",
                 "kvlab_prefix_cache_hit_rate", "kvlab_generation_tokens_per_second",
                 "kvlab_time_to_first_token_seconds_count", "kvlab_time_per_output_token_seconds_count"):
        assert name in values, name
    assert values["kvlab_kv_blocks_free"] == fake.engine.blocks_total
    assert values["kvlab_time_to_first_token_seconds_count"] >= 1
    assert values["kvlab_generation_tokens_total"] >= 3


BAD_REQUESTS = [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"messages": []}, "messages", "at least 1"),
    ({}, "messages", "messages is required"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text"),
    ({"messages": CHAT, "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"messages": CHAT, "max_tokens": 10**12}, "max_tokens", "exceeds"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature", "valid number"),
    ({"messages": CHAT, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"messages": CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ({"messages": CHAT, "stream": "yes"}, "stream", "valid boolean"),
    ({"messages": CHAT, "stop": [1]}, "stop", "a string or a list of strings"),
    ({"messages": CHAT, "stop": ""}, "stop", "must not be empty"),
    ({"messages": CHAT, "n": 99}, "n", "less than or equal to 16"),
    ({"messages": CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": CHAT, "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"messages": CHAT, "min_p": 2}, "min_p", "less than or equal to 1"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": CHAT, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "Input should be"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
]


@pytest.mark.parametrize("body,param,fragment", BAD_REQUESTS)
def test_bad_chat_requests_get_an_openai_error(fake, body, param, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{fake.url}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"] and "\n" not in error["message"]


def test_bad_completion_requests_and_unknown_routes(fake):
    for body, fragment in (({"prompt": ""}, "prompt is empty"), ({"prompt": ["a", "b"]}, "one prompt"),
                           ({"prompt": [1, 99999]}, "token ids"), ({"max_tokens": 3}, "prompt is required"),
                           ({"prompt": "x", "echo": True}, "echo is not supported")):
        response = httpx.post(f"{fake.url}/v1/completions", json=body)
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], (body, response.text)
    missing = httpx.get(f"{fake.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{fake.url}/v1/chat/completions").status_code == 405


def test_the_openai_client_raises_its_bad_request_error_on_400(fake):
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=10**9)
    assert "exceeds the context" in raised.value.message


def test_api_key_guards_every_route_but_health():
    server, _ = fake_server(api_key="sekret")
    with server:
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(server.url + path).status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        denied = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="fake-model", prompt="x", max_tokens=2).choices[0].text == fake_text([120], 2)


def open_stream(client: httpx.Client, max_tokens: int = 1000, prompt: str = "x"):
    """Start a streamed completion (no EOS: it runs to max_tokens unless aborted) and read its first chunk;
    returns the open response."""
    request = client.build_request("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                    "stream": True, "ignore_eos": True})
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    response.event_lines = response.iter_lines()  # kept: closing this iterator would close the stream
    assert next(line for line in response.event_lines if line.startswith("data: ")).startswith('data: {"id"')
    return response


def test_a_full_queue_answers_429_and_frees_up_after(fake):
    server, engine = fake_server(max_running=1, max_waiting=1, step_delay_s=0.005)
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        first = open_stream(client)
        second = client.send(client.build_request("POST", "/v1/completions",
                                                  json={"prompt": "y", "max_tokens": 1000, "stream": True}), stream=True)
        wait_until(lambda: server.state.in_flight == 2, what="two requests in flight")
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "z", "max_tokens": 1})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
                model="fake-model", prompt="z", max_tokens=1)
        first.close()
        second.close()
        wait_until(lambda: server.state.in_flight == 0 and not engine.has_unfinished(), what="the aborts")
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "z", "max_tokens": 1}).status_code == 200
    assert engine.blocks_used == 0


def test_a_disconnected_stream_is_aborted_and_its_blocks_freed():
    server, engine = fake_server(step_delay_s=0.005)
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        streams = [open_stream(client, prompt=f"p{i}") for i in range(3)]
        assert engine.blocks_used > 0
        for response in streams:
            response.close()
        wait_until(lambda: not engine.has_unfinished(), what="the aborted streams to leave the engine")
        assert engine.blocks_used == 0 and server.state.in_flight == 0
        assert len(engine.aborted) == 3  # ended by the disconnects, not by running to max_tokens


def test_a_client_that_leaves_before_a_plain_answer_is_aborted_too():
    server, engine = fake_server(step_delay_s=0.005)
    with server:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True},
                       timeout=httpx.Timeout(30, read=0.3))
        wait_until(lambda: len(engine.aborted) == 1 and not engine.has_unfinished(), what="the abort")
        assert engine.blocks_used == 0
        wait_until(lambda: server.state.in_flight == 0, what="the handler to finish")


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on():
    server, engine = fake_server(fail_steps=1)
    with server:
        failed = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert failed.status_code == 503 and "injected engine failure" in failed.json()["error"]["message"]
        after = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == fake_text([120], 3)
        assert httpx.get(server.url + "/health").status_code == 200


def test_shutdown_aborts_running_streams_after_the_grace_and_stops_the_engine_thread():
    server, engine = fake_server(step_delay_s=0.005, grace=0.2)
    with server, httpx.Client(base_url=server.url, timeout=30) as client:
        response = open_stream(client)
        server.server.should_exit = True       # what uvicorn's SIGINT/SIGTERM handler does
        rest = [line for line in response.event_lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"  # cut, in OpenAI's words
        server.thread.join(30)
        assert not server.thread.is_alive() and not server.state.engine_loop.alive
    assert engine.blocks_used == 0 and not engine.has_unfinished()
    assert len(engine.thread_ids) == 1          # the engine was only ever called from its own thread


# -- the real engine on SmolLM2 -------------------------------------------------------------------------
PROMPTS = ["What is the capital of France?", "Name a colour.", "Say hello.", "What is 2 + 2?",
           "Name a fruit.", "Who wrote Hamlet?", "Name an animal.", "What is the sun?",
           "Name a planet.", "What is water?", "Name a tree.", "Say goodbye.",
           "Name a river.", "What is snow?", "Name a metal.", "What is a cat?"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def real(smollm2):
    engine_module = pytest.importorskip("kvlab.serve.engine", reason="the batched engine (kvlab.serve.engine) is not merged")
    engine = engine_module.Engine(smollm2, kv_budget="24MiB", max_batch=16, block_size=16)
    config = ServerConfig(model_name="smollm2", context_length=smollm2.config.max_seq_len, max_running=16,
                          max_waiting=16, shutdown_grace_s=0.5)
    server = ServerThread(create_app(engine, smollm2.tokenizer, config))
    with server:
        server.blocks_free_at_start = server.state.engine_loop.latest_stats.blocks_free
        yield server
    assert not server.state.engine_loop.alive


@functools.lru_cache(maxsize=None)
def reference_text(prompt: str) -> str:
    """What `kvlab generate --chat PROMPT --max-new-tokens NEW_TOKENS` prints (its library path)."""
    from kvlab.session import run_generation

    return run_generation(prompt, chat=True, max_new_tokens=NEW_TOKENS).text


def test_real_chat_equals_kvlab_generate_chat_streamed_and_not(real):
    expected = reference_text(PROMPTS[0])
    assert expected.strip()
    client = openai.OpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens <= NEW_TOKENS
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    # the same prompt again: its full blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert 0 < metric(real.url, "kvlab_prefix_cache_hit_rate") <= 1
    assert metric(real.url, "kvlab_kv_bytes_peak") > 0
    with httpx.stream("POST", f"{real.url}/v1/chat/completions", timeout=60,
                      json={"messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == expected


def test_real_seeded_sampling_repeats(real):
    client = openai.OpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0)
    texts = {client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=NEW_TOKENS, temperature=0.9, seed=7).choices[0].message.content
             for _ in range(2)}
    assert len(texts) == 1


def test_ctx_and_max_seqs_size_the_pool_for_exactly_that_many_sequences(smollm2):
    from kvlab.serve.command import budget_for
    from kvlab.serve.engine import capacity_for

    one = capacity_for(smollm2.config, "dense", 2**30, 16)
    for ctx, seqs in ((1000, 3), (4096, 8), (16, 1)):
        plan = capacity_for(smollm2.config, "dense", budget_for(ctx, seqs, one), 16)
        assert plan.max_concurrent(ctx) == seqs


def test_real_16_concurrent_streams_each_get_their_own_completion(real):
    expected = [reference_text(p) for p in PROMPTS]
    client = openai.AsyncOpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=NEW_TOKENS, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    assert asyncio.run(all_at_once()) == expected


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


def test_real_aborted_streams_return_every_block(real):
    aborted_before = metric(real.url, 'kvlab_requests_total{finish_reason="abort"}')
    with httpx.Client(base_url=real.url, timeout=60) as client:
        streams = [open_stream(client, max_tokens=200, prompt=f"Tell me a long story about the number {i}.")
                   for i in range(6)]
        for response in streams:
            response.close()

    def blocks_back() -> bool:
        stats = real.state.engine_loop.latest_stats
        return stats.running == 0 and stats.waiting == 0 and stats.blocks_free == real.blocks_free_at_start

    wait_until(blocks_back, what="every block back in the pool")
    assert real.state.in_flight == 0
    assert metric(real.url, 'kvlab_requests_total{finish_reason="abort"}') == aborted_before + 6


def test_real_request_that_cannot_fit_is_a_400(real):
    response = httpx.post(f"{real.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


# -- kvlab bench serve, and the CLI ------------------------------------------------------------------------
def test_bench_serve_refuses_urls_off_this_machine():
    from kvlab.bench.serve import check_loopback
    from kvlab.errors import ConfigError

    for url in ("http://127.0.0.1:8000/", "http://127.8.9.10:1", "http://localhost:8000", "http://[::1]:8000"):
        assert check_loopback(url) == url.rstrip("/")
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ConfigError):
            check_loopback(url)


def test_bench_serve_measures_a_server_and_writes_json_and_a_plot(fake, tmp_path):
    from rich.console import Console

    from kvlab.bench.serve import ServeBenchSettings, percentile, run_serve_bench

    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    settings = ServeBenchSettings(url=fake.url, concurrency=(1, 3), requests=4, max_tokens=5)
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    record = run_serve_bench(settings, str(out), str(plot), json_out=False, console=Console(file=open(tmp_path / "log", "w")))
    assert json.loads(out.read_text()) == json.loads(json.dumps(record)) and plot.stat().st_size > 0
    assert [lv["concurrency"] for lv in record["levels"]] == [1, 3]
    for level in record["levels"]:
        assert level["errors"] == 0 and level["requests"] == 4
        assert level["output_tokens_per_s"] > 0 and level["ttft_p50_ms"] is not None and level["tpot_p99_ms"] is not None
        assert level["peak_kv_bytes"] is not None
    assert record["http_overhead"] is None  # only measured against a server it started itself


def test_serve_without_the_extra_is_a_one_line_error(monkeypatch):
    import sys

    from kvlab.errors import KvlabError
    from kvlab.serve.command import check_serve_extra

    monkeypatch.setitem(sys.modules, "fastapi", None)  # what an interpreter without fastapi sees
    with pytest.raises(KvlabError, match=r"pip install 'kvlab\[serve\]'"):
        check_serve_extra()


def test_kvlab_serve_prints_its_plan_and_exits_cleanly_on_sigterm(smollm2):
    """The CLI in a subprocess: memory plan on start, loopback bind, a running stream aborted by SIGTERM, exit 0
    (weights native-q8: int8 activations in every product)."""
    import signal
    import subprocess
    import sys

    from kvlab.bench.serve import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", "from kvlab.cli import app; app()", "serve", "--port", str(port),
                                "--kv-budget", "16MiB", "--shutdown-grace", "0.2", "--weights", "native-q8"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            assert process.poll() is None, process.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=180, what="kvlab serve to start")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            response = open_stream(client, max_tokens=300)  # the 16 MiB pool holds 352 tokens
            process.send_signal(signal.SIGTERM)
            rest = [line for line in response.event_lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"  # cut, in OpenAI's words
        assert process.wait(60) == 0
        output = process.stdout.read()
        assert "KV memory plan" in output and "sequences of 512 tokens" in output
        assert f"(native-q8 weights) on http://127.0.0.1:{port}" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
