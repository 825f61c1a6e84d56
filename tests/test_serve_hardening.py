"""`kvlab serve` against a client that misbehaves: bad Unicode, slow or huge uploads, a failing engine thread,
huge stop strings, looping chat templates, foreign Host headers. Each test here failed before its fix.

Servers run on the fake engine (tests/serve_fakes.py); where the tokenizer matters it is SmolLM2's real one.
No test asserts a duration: deadlines only turn a hang into a failure.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from .serve_fakes import FakeEngine, FakeTokenizer, ServerThread, fake_text  # noqa: E402

from kvlab.serve.http import ServerConfig, create_app  # noqa: E402

CHAT = [{"role": "user", "content": "hi there"}]


def server_for(engine=None, tokenizer=None, **config_kw) -> ServerThread:
    engine = engine or FakeEngine()
    config = ServerConfig(**{"model_name": "fake-model", "context_length": engine.context, **config_kw})
    server = ServerThread(create_app(engine, tokenizer or FakeTokenizer(), config))
    server.engine = engine
    return server


@pytest.fixture(scope="module")
def real_tokenizer_server(smollm2):
    """The fake engine behind SmolLM2's real tokenizer and chat template."""
    with server_for(tokenizer=smollm2.tokenizer) as server:
        yield server


def raw_connection(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a 20 s socket timeout turns a hang into a failure)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- Unicode ---------------------------------------------------------------------------------------------
def test_a_lone_surrogate_is_a_400_json_error_not_a_500(real_tokenizer_server):
    url = real_tokenizer_server.url
    for route, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}, "messages"),
            ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
            ("/v1/completions", {"prompt": "ab", "stop": ["x\udfffy"], "max_tokens": 2}, "stop")):
        content = json.dumps(body).encode()   # json.dumps escapes the surrogate as \ud800: valid JSON
        response = httpx.post(url + route, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "lone surrogate" in error["message"], error


def test_the_tokenizer_names_a_lone_surrogate(smollm2):
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"not valid Unicode: a lone surrogate U\+D800 at character 1"):
        smollm2.tokenizer.encode("a\ud800b")
    assert smollm2.tokenizer.encode("a\u00e9b")  # valid non-ASCII text still encodes


# -- connections, headers, bodies ------------------------------------------------------------------------
def test_a_connection_that_never_finishes_its_headers_is_closed():
    with server_for(header_timeout_s=0.3) as server:
        slow = raw_connection(server.url)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")   # and nothing more
        assert read_all(slow) == b""      # the server closed it (before the fix: open until the socket timed out)
        idle = raw_connection(server.url)  # a connection that sends nothing is timed the same way
        assert read_all(idle) == b""
        keep_alive = raw_connection(server.url)  # a second request on a kept-alive connection is timed too
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0")
        assert b"200 OK" in read_all(keep_alive)
        assert httpx.get(server.url + "/health").status_code == 200


def test_connections_beyond_max_connections_get_503():
    with server_for(max_connections=3, header_timeout_s=30) as server:
        held = [raw_connection(server.url) for _ in range(3)]
        try:
            refused = httpx.get(server.url + "/health")
            assert refused.status_code == 503
        finally:
            for sock in held:
                sock.close()


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    with server_for(max_body_bytes=1000) as server:
        sock = raw_connection(server.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000\r\n\r\n{\"prompt\": \"")      # 10 MB announced, a few bytes sent
        answer = b""
        while b"bytes" not in answer and (chunk := sock.recv(65536)):   # the answer comes before the body is sent
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 413") and b"larger than 1,000 bytes" in answer
        chunked = httpx.post(server.url + "/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),
                             headers={"content-type": "application/json"})      # no Content-Length: counted as read
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_body_that_stops_arriving_gets_408():
    with server_for(body_timeout_s=0.3) as server:
        sock = raw_connection(server.url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        assert read_all(sock).startswith(b"HTTP/1.1 408")


# -- the engine thread failing ---------------------------------------------------------------------------
def test_an_engine_that_raises_on_add_fails_that_request_with_503_and_serves_on():
    with server_for(FakeEngine(fail_adds=1)) as server:
        failed = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert failed.status_code == 503 and "injected add failure" in failed.json()["error"]["message"]
        after = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == fake_text([120], 3)


def test_an_abort_that_raises_does_not_stop_the_engine_thread():
    with server_for(FakeEngine(fail_aborts=1, step_delay_s=0.005)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        request = client.build_request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3000,
                                                                        "stream": True, "ignore_eos": True})
        response = client.send(request, stream=True)
        next(line for line in response.iter_lines() if line.startswith("data: "))
        response.close()                                   # the client leaves: the abort raises in the engine
        after = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert after.status_code == 200 and server.state.engine_loop.alive


def test_an_engine_that_always_fails_stops_its_thread_and_every_request_gets_503():
    from kvlab.serve.engine_loop import MAX_FAILURES

    with server_for(FakeEngine(fail_steps=-1)) as server:   # every step raises
        for _ in range(MAX_FAILURES + 2):
            response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
            assert response.status_code == 503, response.text
        assert not server.state.engine_loop.alive
        assert httpx.get(server.url + "/health").status_code == 503


def test_a_request_never_waits_on_an_engine_thread_that_is_gone():
    """Commands the thread will never read (it is gone): the wait is bounded, the client gets 503."""
    with server_for() as server:
        loop = server.state.engine_loop
        loop.stop()
        assert not loop.thread.is_alive()
        loop._dead.clear()                      # as if the thread had died without saying so
        loop.submit = lambda submission: None   # and the command were lost with it
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert response.status_code == 503 and "engine thread stopped" in response.json()["error"]["message"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_killed_by_a_base_exception_answers_what_it_held():
    class Dying(FakeEngine):
        def step(self):
            raise SystemExit("gone")             # not an Exception: the loop cannot catch it

    with server_for(Dying()) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert response.status_code == 503
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 3},
                          timeout=30).status_code == 503


# -- the event loop stays free ---------------------------------------------------------------------------
class BlockingTokenizer(FakeTokenizer):
    """encode() waits until released: a stand-in for tokenizing a huge prompt."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text, add_special=True):
        if text.startswith("slow"):
            self.entered.set()
            assert self.release.wait(30)
        return super().encode(text, add_special)


def test_tokenizing_runs_off_the_event_loop():
    tokenizer = BlockingTokenizer()
    with server_for(tokenizer=tokenizer) as server:
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=httpx.post(
            server.url + "/v1/completions", json={"prompt": "slow prompt", "max_tokens": 2}, timeout=30)))
        slow.start()
        try:
            assert tokenizer.entered.wait(30)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200   # while the prompt tokenizes
            assert "r" not in result
        finally:
            tokenizer.release.set()
            slow.join(30)
        assert result["r"].status_code == 200


def test_a_looping_chat_template_ends_within_the_render_limit_and_blocks_nothing(smollm2, monkeypatch):
    from kvlab.model import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)
    looping = dataclasses.replace(smollm2.tokenizer, chat_template=(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"))
    with server_for(tokenizer=looping) as server:
        results = []

        def ask(n: int) -> None:
            body = {"messages": [{"role": "user", "content": f"loop {n}"}], "max_tokens": 2}
            results.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))

        askers = [threading.Thread(target=ask, args=(n,)) for n in range(6)]   # more than the prompt threads
        for t in askers:
            t.start()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert len(results) == 0          # /health answered while the templates were still rendering
        for t in askers:
            t.join(60)
        assert len(results) == 6
        for response in results:
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert "did not finish within 2 s" in message and message.count("chat template:") == 1


def test_a_broken_template_error_says_chat_template_once(smollm2):
    broken = dataclasses.replace(smollm2.tokenizer, chat_template="{% for m in messages %}")
    with server_for(tokenizer=broken) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("chat template: syntax error") and message.count("chat template:") == 1


# -- stop strings ----------------------------------------------------------------------------------------
def test_stop_strings_are_bounded_in_length():
    from kvlab.serve.sampling import MAX_STOP_CHARS

    with server_for() as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 6,
                                                                    "stop": ["a" * 350_000, "b" * 350_000]})
        assert response.status_code == 400 and f"at most {MAX_STOP_CHARS:,} characters" in response.json()["error"]["message"]
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": ["q" * MAX_STOP_CHARS]})
        assert ok.status_code == 200


class CharTokenizer:
    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids)


def naive_cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The reference: the text up to the earliest end of any stop string, minus that (longest) stop string."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[:end - max(len(h) for h in hits)], True
    return text, False


def test_stop_string_matching_equals_the_naive_scan_on_random_texts():
    from kvlab.serve.sampling import TextStream

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3)))
        stream, out, hit = TextStream(CharTokenizer(), stops), "", False
        for ch in text:
            piece, hit = stream.push(ord(ch))
            out += piece
            if hit:
                break
        out += "" if hit else stream.flush()
        assert (out, hit) == naive_cut(text, stops), (text, stops)


def test_stop_string_matching_reads_each_character_a_bounded_number_of_times():
    """A long near-miss stop string ("aaa...ab" against "aaaa..."): the automaton's fallbacks are amortised, so
    the comparisons stay linear in the text (the suffix scan did len(stop) of them per token)."""
    from kvlab.serve import sampling

    stop = "a" * 999 + "b"
    matcher = sampling.StopMatcher((stop,))
    compared = 0

    class CountingStr(str):
        def __getitem__(self, i):
            nonlocal compared
            compared += 1
            return str.__getitem__(self, i)

    matcher.stops = (CountingStr(stop),)
    for _ in range(300):
        assert matcher.feed("a" * 10) is None
    assert matcher.partial == 999
    assert compared <= 3 * 3000 + 10


# -- limits, names and headers ---------------------------------------------------------------------------
def test_default_max_tokens_is_clipped_to_what_the_pool_holds():
    engine = FakeEngine(blocks_total=100, block_size=4, context=4096)     # the pool holds 400 tokens
    with server_for(engine, default_max_tokens=256) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 300}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 100
        assert response.json()["choices"][0]["finish_reason"] == "length"
        asked = httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 300, "max_tokens": 200}, timeout=30)
        assert asked.status_code == 400     # a max_tokens the client named is not clipped


def test_a_429_says_when_to_retry():
    with server_for(FakeEngine(max_batch=1, step_delay_s=0.005), max_running=1, max_waiting=0) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        request = client.build_request("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3000,
                                                                        "stream": True, "ignore_eos": True})
        running = client.send(request, stream=True)
        lines = running.iter_lines()      # kept: closing this iterator would close the stream
        next(line for line in lines if line.startswith("data: "))
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 1})
        running.close()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"


def test_an_unknown_model_name_is_a_404():
    with server_for(model_aliases=("/models/fake.gguf",)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as raised:
            client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        assert raised.value.code == "model_not_found" and "gpt-4" in raised.value.message
        for name in ("fake-model", "/models/fake.gguf"):
            assert client.completions.create(model=name, prompt="x", max_tokens=1).choices[0].text
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_loopback_server_refuses_foreign_host_headers():
    with server_for() as server:
        for host in ("evil.example", "evil.example:80", "10.0.0.1"):
            response = httpx.get(server.url + "/v1/models", headers={"host": host})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host", host
        for host in ("localhost:1234", "127.0.0.1", "127.1.2.3:80", "[::1]:8000"):
            assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host
    with server_for(allowed_hosts=None) as opened:          # `--host 0.0.0.0`: the operator opened it
        assert httpx.get(opened.url + "/v1/models", headers={"host": "evil.example"}).status_code == 200


def test_finish_reasons_are_openai_values():
    from kvlab.serve.openai_api import FINISH_REASONS

    assert set(FINISH_REASONS.values()) <= {"stop", "length", "tool_calls", "content_filter", "function_call"}
    assert FINISH_REASONS["abort"] == "length"
