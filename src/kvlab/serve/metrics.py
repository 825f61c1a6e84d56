"""Prometheus metrics of one `kvlab serve` process, in a registry of its own (so two servers in one
process, as in the tests, never share counters).

Gauges read the engine's latest stats snapshot when scraped; histograms and counters are fed by the
engine thread as requests advance (prometheus-client's metrics are thread-safe).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class TokenRate:
    """Generated tokens per second over a trailing window (thread-safe)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int, now: float | None = None) -> None:
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, tokens))

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


class ServeMetrics:
    """Every metric `GET /metrics` shows. `stats` returns the engine's latest EngineStats (or None)."""

    def __init__(self, stats: Callable[[], object | None]):
        self.registry = CollectorRegistry()
        self.token_rate = TokenRate()
        r = self.registry

        def from_stats(field: str) -> Callable[[], float]:
            return lambda: float(getattr(stats(), field, 0) or 0)

        def hit_rate() -> float:
            s = stats()
            queried = getattr(s, "prefix_queries_tokens", 0)
            return s.prefix_hit_tokens / queried if queried else 0.0

        gauges = {
            "kvlab_requests_running": ("Requests being prefilled or decoded.", "running"),
            "kvlab_requests_waiting": ("Requests queued in the engine, not yet scheduled.", "waiting"),
            "kvlab_kv_blocks_total": ("KV blocks in the pool.", "blocks_total"),
            "kvlab_kv_blocks_used": ("KV blocks referenced by a sequence.", "blocks_used"),
            "kvlab_kv_blocks_free": ("KV blocks not referenced by any sequence.", "blocks_free"),
            "kvlab_kv_bytes_total": ("Bytes of the KV pool.", "kv_bytes_total"),
            "kvlab_kv_bytes_used": ("Bytes of the KV pool in use.", "kv_bytes_used"),
            "kvlab_kv_bytes_peak": ("The most bytes of the KV pool in use at once.", "kv_bytes_peak"),
            "kvlab_preemptions": ("Sequences preempted so far (recomputed later).", "preemptions"),
            "kvlab_state_bytes_total": ("Bytes of the recurrent layers' state slots.", "state_bytes_total"),
            "kvlab_prefix_caching": ("1 if prefix caching runs; 0 if asked off, or off for recurrent layers (their state "
                                     "is not in the blocks).", "prefix_caching"),
        }
        for name, (doc, field) in gauges.items():
            Gauge(name, doc, registry=r).set_function(from_stats(field))
        Gauge("kvlab_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.",
              registry=r).set_function(hit_rate)
        Gauge("kvlab_generation_tokens_per_second", f"Generated tokens/s over the last {RATE_WINDOW_S:.0f} s.",
              registry=r).set_function(self.token_rate.per_second)
        self.prompt_tokens = Counter("kvlab_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kvlab_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kvlab_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.rejected = Counter("kvlab_requests_rejected", "Requests refused before reaching the engine, by HTTP status.",
                                ["status"], registry=r)
        self.ttft = Histogram("kvlab_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvlab_time_per_output_token_seconds", "Mean time between a request's generated tokens.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("kvlab_request_latency_seconds", "Time from arrival to the last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def exposition(self) -> tuple[bytes, str]:
        """(Prometheus text, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
