"""The one thread that owns the Engine (which is not thread-safe) and feeds every HTTP connection.

Other threads never touch the engine: they put commands (add, abort, abort all) on a thread-safe queue.
The thread applies them between steps, runs `engine.step()` while any request is unfinished, and hands
each request's events to the callback it was submitted with:

  ACCEPTED        the engine took the request (add_request returned)
  RequestOutput   one per step in which the request changed; the last one has finished=True
  KvlabError      add_request refused it (too large, bad sampling) -- nothing else follows
A `call(fn, *args)` runs fn on the thread between steps and answers through a Future (saving and restoring KV).
  EngineFailure   the engine raised (in step, add or abort): the request was aborted -- nothing else follows

Any exception in the thread fails the requests it touched with EngineFailure and the loop goes on; after
MAX_FAILURES failures in a row (an engine that is broken, not unlucky) the thread stops, `alive` turns
False, and every request still waiting or submitted later gets EngineFailure at once: no caller is left
waiting on a thread that is gone.
The callbacks run on this thread; the HTTP side passes one that forwards into an asyncio queue with
loop.call_soon_threadsafe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from ..errors import KvlabError

log = logging.getLogger("kvlab.serve")

ACCEPTED = "accepted"
IDLE_POLL_S = 0.5  # how long the idle thread waits for a command before looking again
MAX_FAILURES = 3   # engine failures in a row after which the thread stops


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
        self._dead = threading.Event()         # set once the thread has stopped for good
        self.failures = 0                      # engine failures in a row (the engine thread only)

    # -- called from any thread ---------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, submission: Submission) -> None:
        self.commands.put(("add", submission))
        if self._dead.is_set():                # the thread is gone: nobody would apply the command
            self._drain(EngineFailure("the engine is not running"))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def call(self, fn: Callable, *args) -> Future:
        """fn(*args) on the engine thread between steps (what touches the engine's pool but is no request)."""
        future: Future = Future()
        self.commands.put(("call", (fn, args, future)))
        if self._dead.is_set():
            self._drain(EngineFailure("the engine is not running"))
        return future

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
        return self.thread.is_alive() and not self._dead.is_set()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._cycle():
                pass
        finally:
            self._dead.set()
            self._drain(EngineFailure("the server is shutting down" if self._stop.is_set()
                                      else "the engine stopped after repeated failures"))

    def _cycle(self) -> bool:
        """Apply commands, step once if busy; True when the thread should end. Nothing escapes but the end."""
        try:
            busy = self.engine.has_unfinished()
            self._apply_commands(wait=not busy and not self._stop.is_set())
            if self._stop.is_set() and not self.engine.has_unfinished():
                return True
            if self.engine.has_unfinished():
                self._step()
                self.failures = 0
        except Exception as exc:  # noqa: BLE001  (a bug in the engine or a callback: fail, then go on or stop)
            return self._failed(exc)
        return False

    def _failed(self, exc: Exception) -> bool:
        """Fail every request in flight with EngineFailure; True if the thread must stop (MAX_FAILURES in a row)."""
        self.failures += 1
        log.error("engine failed (%d in a row); aborting %d request(s)", self.failures, len(self.active),
                  exc_info=exc)
        failure = EngineFailure(f"engine failed: {type(exc).__name__}: {exc}")
        for request_id, sub in list(self.active.items()):
            del self.active[request_id]
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001  (the engine is already broken; the request is gone anyway)
                pass
            _tell(sub, failure)
        try:
            self.latest_stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            pass
        return self.failures >= MAX_FAILURES

    def _drain(self, failure: EngineFailure) -> None:
        """Answer every command still queued (and every request still active) with `failure`."""
        for sub in list(self.active.values()):
            _tell(sub, failure)
        self.active.clear()
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _tell(arg, failure)
            elif kind == "call" and not arg[2].done():
                arg[2].set_exception(failure)

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
        elif kind == "call":
            fn, args, future = arg
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001  (the caller gets it, as its answer)
                future.set_exception(exc)
            self.latest_stats = self.engine.stats()

    def _add(self, sub: Submission) -> None:
        if self._stop.is_set():
            sub.deliver(EngineFailure("the server is shutting down"))
            return
        try:
            self.engine.add_request(sub.prompt_ids, sub.sampling, request_id=sub.request_id)
        except KvlabError as exc:
            sub.deliver(exc)
            return
        except Exception as exc:  # noqa: BLE001  (this request only: the engine refused it by raising a bug)
            log.error("engine refused request %s with an error", sub.request_id, exc_info=exc)
            sub.deliver(EngineFailure(f"engine failed: {type(exc).__name__}: {exc}"))
            return
        self.active[sub.request_id] = sub
        sub.deliver(ACCEPTED)

    def _abort(self, request_id: str) -> None:
        sub = self.active.get(request_id)
        if sub is not None:  # the engine may or may not report the abort in a later step; the caller learns now
            self._finish(sub, finish_reason="abort", completion_tokens=None)
        self.engine.abort(request_id)
        self.latest_stats = self.engine.stats()

    def _step(self) -> None:
        outputs = self.engine.step()
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
            if out.all_finished:
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


def _tell(sub: Submission, event) -> None:
    """Deliver an event without letting a failing callback take the thread down."""
    try:
        sub.deliver(event)
    except Exception:  # noqa: BLE001
        log.exception("delivering to request %s failed", sub.request_id)


@dataclass
class AbortedOutput:
    """What an aborted request's caller receives (mirrors RequestOutput's fields): every choice has ended."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    finished: bool = True
    finish_reason: str = "abort"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    index: int | None = None       # None: all of them
    all_finished: bool = True
    logprobs: None = None

