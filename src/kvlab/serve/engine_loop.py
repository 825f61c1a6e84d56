"""The one thread that owns the Engine (which is not thread-safe) and feeds every HTTP connection.

Other threads never touch the engine: they put commands (add, abort, abort all) on a thread-safe queue.
The thread applies them between steps, runs `engine.step()` while any request is unfinished, and hands
each request's events to the callback it was submitted with:

  ACCEPTED        the engine took the request (add_request returned)
  RequestOutput   one per step in which the request changed; the last one has finished=True
  KvlabError      add_request refused it (too large, bad sampling) -- nothing else follows
  EngineFailure   step() raised: the request was aborted -- nothing else follows

The callbacks run on this thread; the HTTP side passes one that forwards into an asyncio queue with
loop.call_soon_threadsafe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import KvlabError

log = logging.getLogger("kvlab.serve")

ACCEPTED = "accepted"
IDLE_POLL_S = 0.5  # how long the idle thread waits for a command before looking again


class EngineFailure(Exception):
    """The engine raised while stepping; the requests it was running were aborted."""


@dataclass
class Submission:
    request_id: str
    prompt_ids: list[int]
    sampling: object                       # kvlab.serve.sampling.SamplingParams
    deliver: Callable[[object], None]      # receives ACCEPTED, RequestOutputs, or one exception
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics                 # kvlab.serve.metrics.ServeMetrics or None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, Submission] = {}  # owned by the engine thread
        self.latest_stats = engine.stats()
        self.thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self._stop = threading.Event()

    # -- called from any thread ---------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, submission: Submission) -> None:
        self.commands.put(("add", submission))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self.commands.put(("abort_all", None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs and end the thread."""
        self._stop.set()
        self.commands.put(("abort_all", None))
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            self._apply_commands(wait=not busy and not self._stop.is_set())
            if self._stop.is_set() and not self.engine.has_unfinished():
                self._apply_commands(wait=False)  # an add that raced with stop is refused, not left hanging
                break
            if self.engine.has_unfinished():
                self._step()

    def _apply_commands(self, wait: bool) -> None:
        try:
            command = self.commands.get(timeout=IDLE_POLL_S) if wait else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg) -> None:
        if kind == "add":
            self._add(arg)
        elif kind == "abort":
            self._abort(arg)
        elif kind == "abort_all":
            for request_id in list(self.active):
                self._abort(request_id)

    def _add(self, sub: Submission) -> None:
        if self._stop.is_set():
            sub.deliver(EngineFailure("the server is shutting down"))
            return
        try:
            self.engine.add_request(sub.prompt_ids, sub.sampling, request_id=sub.request_id)
        except KvlabError as exc:
            sub.deliver(exc)
            return
        self.active[sub.request_id] = sub
        sub.deliver(ACCEPTED)

    def _abort(self, request_id: str) -> None:
        sub = self.active.get(request_id)
        self.engine.abort(request_id)
        if sub is not None:  # the engine may or may not report the abort in a later step; the caller learns now
            self._finish(sub, finish_reason="abort", completion_tokens=None)
            self.latest_stats = self.engine.stats()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in the engine: fail the requests in flight, keep serving
            log.exception("engine step failed; aborting %d request(s)", len(self.active))
            failure = EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}")
            for request_id, sub in list(self.active.items()):
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001  (the engine is already broken; the request is gone anyway)
                    pass
                del self.active[request_id]
                sub.deliver(failure)
            self.latest_stats = self.engine.stats()
            return
        now = time.monotonic()
        generated = 0
        for out in outputs:
            sub = self.active.get(out.request_id)
            if sub is None:  # aborted by us before this step's report
                continue
            generated += len(out.new_token_ids)
            if out.new_token_ids and sub.first_token_at is None:
                sub.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - sub.arrived)
            sub.deliver(out)
            if out.finished:
                self._finish(sub, out.finish_reason or "stop", out.completion_tokens, out.prompt_tokens, now, delivered=True)
        if self.metrics is not None and generated:
            self.metrics.generation_tokens.inc(generated)
            self.metrics.token_rate.add(generated, now)
        self.latest_stats = self.engine.stats()

    def _finish(self, sub: Submission, finish_reason: str, completion_tokens: int | None, prompt_tokens: int = 0,
                now: float | None = None, delivered: bool = False) -> None:
        """Forget a finished request, record its metrics, and (for aborts) tell its caller."""
        self.active.pop(sub.request_id, None)
        if not delivered:
            sub.deliver(AbortedOutput(sub.request_id))
        if self.metrics is None:
            return
        now = time.monotonic() if now is None else now
        self.metrics.requests.labels(finish_reason=finish_reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        if sub.first_token_at is not None:
            self.metrics.latency.observe(now - sub.arrived)
            if completion_tokens and completion_tokens > 1:
                self.metrics.tpot.observe((now - sub.first_token_at) / (completion_tokens - 1))


@dataclass
class AbortedOutput:
    """What an aborted request's caller receives (mirrors RequestOutput's fields)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    finished: bool = True
    finish_reason: str = "abort"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0

