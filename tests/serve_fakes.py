"""A small engine with kvlab.serve.Engine's API, and a server-in-a-thread harness, for the HTTP tests.

The fake engine makes the protocol tests fast and exact: request r's i-th new token is
(sum(prompt) + i) % 7 and reads as the word "w<token> "; it keeps a block pool (one block per
`block_size` tokens of prompt + output, reserved when scheduled) so aborts and frees can be checked.
The real engine on SmolLM2 is what the end-to-end tests use.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from kvlab.errors import ConfigError, RequestTooLargeError

@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    index: int = 0
    logprobs: None = None

    @property
    def all_finished(self) -> bool:
        return self.finished


@dataclass
class FakeStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    block_size: int
    kv_bytes_total: int
    kv_bytes_used: int
    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


class FakeTokenizer:
    """Characters are token ids; the chat template is `role: content` lines."""

    vocab_size = 256
    eos_ids = ()

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, deadline=None):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")

    def encode(self, text, add_special=True):
        return [min(ord(c), 255) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids)


def fake_text(prompt_ids: list[int], n: int) -> str:
    """What the fake engine answers after `n` tokens (no stop strings)."""
    return "".join(f"w{(sum(prompt_ids) + i) % 7} " for i in range(n))


class FakeEngine:
    def __init__(self, blocks_total: int = 1024, block_size: int = 4, max_batch: int = 4, context: int = 4096,
                 step_delay_s: float = 0.0, fail_steps: int = 0, fail_adds: int = 0, fail_aborts: int = 0):
        self.blocks_total, self.block_size, self.max_batch, self.context = blocks_total, block_size, max_batch, context
        self.step_delay_s = step_delay_s
        self.fail_steps = fail_steps        # the next this many steps raise (a bug in the engine)
        self.fail_adds = fail_adds          # the next this many add_request calls raise a non-kvlab error
        self.fail_aborts = fail_aborts      # the next this many abort calls raise
        self.waiting: list[dict] = []
        self.running: list[dict] = []
        self.blocks_used = 0
        self.steps = 0
        self.thread_ids: set[int] = set()   # every thread that called the engine: must be exactly one
        self.aborted: list[str] = []        # ids aborted while waiting or running

    def _blocks(self, req) -> int:
        return math.ceil((len(req["prompt"]) + req["sampling"].max_tokens) / self.block_size)

    def add_request(self, prompt_ids, sampling=None, request_id=None) -> str:
        self.thread_ids.add(threading.get_ident())
        if self.fail_adds:
            self.fail_adds -= 1
            raise ValueError("injected add failure")
        if not prompt_ids:
            raise ConfigError("prompt is empty")
        req = {"id": request_id, "prompt": list(prompt_ids), "sampling": sampling, "n": 0, "text": ""}
        if len(prompt_ids) + sampling.max_tokens > self.context or self._blocks(req) > self.blocks_total:
            raise RequestTooLargeError(f"prompt of {len(prompt_ids)} tokens + max_tokens {sampling.max_tokens} "
                                      f"exceeds the context of {self.context} tokens")
        self.waiting.append(req)
        return request_id

    def abort(self, request_id) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.fail_aborts:
            self.fail_aborts -= 1
            raise KeyError("injected abort failure")
        for group in (self.waiting, self.running):
            for req in list(group):
                if req["id"] == request_id:
                    group.remove(req)
                    self.aborted.append(request_id)
                    if group is self.running:
                        self.blocks_used -= self._blocks(req)

    @property
    def max_request_tokens(self) -> int:
        return min(self.context, self.blocks_total * self.block_size)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected engine failure")
        while self.waiting and len(self.running) < self.max_batch and \
                self.blocks_used + self._blocks(self.waiting[0]) <= self.blocks_total:
            req = self.waiting.pop(0)
            self.blocks_used += self._blocks(req)
            self.running.append(req)
        outputs = []
        for req in list(self.running):
            token = (sum(req["prompt"]) + req["n"]) % 7
            req["n"] += 1
            piece = f"w{token} "
            text = req["text"] + piece
            finish = None
            stops = [text.find(s) for s in req["sampling"].stop if s in text]
            if stops:
                piece = piece[: len(piece) - (len(text) - min(stops))]
                finish = "stop"
            elif req["n"] >= req["sampling"].max_tokens:
                finish = "length"
            req["text"] = text
            if finish:
                self.running.remove(req)
                self.blocks_used -= self._blocks(req)
            outputs.append(FakeOutput(req["id"], [token], piece, finish is not None, finish, len(req["prompt"]), 0,
                                      req["n"]))
        return outputs

    def stats(self) -> FakeStats:
        return FakeStats(running=len(self.running), waiting=len(self.waiting), blocks_total=self.blocks_total,
                         blocks_used=self.blocks_used, blocks_free=self.blocks_total - self.blocks_used,
                         block_size=self.block_size, kv_bytes_total=self.blocks_total * 1024,
                         kv_bytes_used=self.blocks_used * 1024, steps=self.steps)


class ServerThread:
    """`kvlab serve`'s app on a free loopback port, in a thread (uvicorn installs no signal handlers there)."""

    def __init__(self, app):
        from kvlab.serve.http import Server

        self.server = Server(app, host="127.0.0.1", port=0, log_level="warning")
        self.state = app.state.kvlab
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True  # what uvicorn's SIGINT/SIGTERM handler does
        self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()
