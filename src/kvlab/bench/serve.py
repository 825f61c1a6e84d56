"""`kvlab bench serve`: a bounded load generator for any OpenAI-compatible server on this machine.

For each concurrency level C, C clients send streamed chat completions back to back until `requests`
requests are done. Per request: TTFT (send -> first content chunk) and TPOT ((last - first chunk) /
(output tokens - 1)); per level: requests/s and output tokens/s over the level's wall time, TTFT/TPOT
p50/p99, errors, and the peak `kvlab_kv_bytes_used` read from /metrics while it ran (kvlab servers only).

With no --url it starts `kvlab serve` itself on a free loopback port (and stops it after). Then it can
also measure the HTTP overhead: output tokens/s of the concurrency-1 workload served over HTTP against
the same requests run on an Engine called directly in this process.

Only loopback URLs are accepted (127.0.0.0/8, ::1, localhost): this is a load generator.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table

from ..errors import ConfigError, KvlabError

TOPICS = ("the sea", "a lighthouse", "winter", "a city at night", "bread", "the moon", "a river", "old books",
          "a garden", "trains", "rain", "a mountain", "the desert", "a cat", "music", "the forest")
WARMUP_PROMPT = "Say hi."   # one short request before measuring: first-call costs stay out of every level
SERVER_START_TIMEOUT_S = 300
METRICS_POLL_S = 0.25


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, if it points at this machine; else a one-line ConfigError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url must be an http(s) URL like http://127.0.0.1:8000, got {url!r}")
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(f"--url must point at this machine (127.0.0.0/8, ::1 or localhost), got host {host!r}")
    return url.rstrip("/")


def workload(n: int) -> list[str]:
    """n chat prompts, all different (the prefix cache helps only with the shared template)."""
    return [f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    peak_kv_bytes: int | None = None
    first_error: str | None = None


def summarize(concurrency: int, results: list[RequestResult], wall_s: float, peak_kv_bytes: int | None) -> LevelResult:
    good = [r for r in results if r.ok]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    tpot = [r.tpot_s for r in good if r.tpot_s is not None]
    errors = [r.error for r in results if not r.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(results), errors=len(errors), wall_s=round(wall_s, 3),
        requests_per_s=round(len(good) / wall_s, 3) if wall_s > 0 else 0.0,
        output_tokens_per_s=round(sum(r.output_tokens for r in good) / wall_s, 2) if wall_s > 0 else 0.0,
        ttft_p50_ms=ms(percentile(ttft, 50)), ttft_p99_ms=ms(percentile(ttft, 99)),
        tpot_p50_ms=ms(percentile(tpot, 50)), tpot_p99_ms=ms(percentile(tpot, 99)),
        peak_kv_bytes=peak_kv_bytes, first_error=errors[0] if errors else None,
    )


# -- the client ------------------------------------------------------------------------------------------
async def one_request(client, url: str, body: dict) -> RequestResult:
    """One streamed chat completion; tokens from the usage chunk (or content chunks if the server sends none)."""
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(ok=False, latency_s=time.perf_counter() - start,
                                     error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, latency_s=time.perf_counter() - start, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
                        chunks += 1
    except Exception as exc:  # noqa: BLE001  (a load generator counts every failure as an error and goes on)
        return RequestResult(ok=False, latency_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])
    tokens = usage_tokens if usage_tokens is not None else chunks
    return RequestResult(
        ok=True, output_tokens=tokens, latency_s=time.perf_counter() - start,
        ttft_s=None if first is None else first - start,
        tpot_s=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
    )


async def _peak_kv_bytes(client, url: str, stop: asyncio.Event) -> int | None:
    """The largest kvlab_kv_bytes_used seen on /metrics until `stop` (None if the server has no such metric)."""
    peak = None
    while not stop.is_set():
        try:
            text = (await client.get(f"{url}/metrics")).text
            for line in text.splitlines():
                if line.startswith("kvlab_kv_bytes_used "):
                    value = int(float(line.split()[1]))
                    peak = value if peak is None else max(peak, value)
        except Exception:  # noqa: BLE001  (metrics are optional)
            return peak
        try:
            await asyncio.wait_for(stop.wait(), METRICS_POLL_S)
        except asyncio.TimeoutError:
            pass
    return peak


async def run_level(url: str, concurrency: int, prompts: list[str], body: dict, api_key: str | None) -> LevelResult:
    """`len(prompts)` requests by `concurrency` clients sending back to back."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=limits) as client:
        queue = list(enumerate(prompts))
        results: list[RequestResult] = [None] * len(prompts)  # type: ignore[list-item]

        async def worker():
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one_request(client, url, {**body, "messages": [{"role": "user", "content": prompt}]})

        stop = asyncio.Event()
        watcher = asyncio.create_task(_peak_kv_bytes(client, url, stop))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        stop.set()
        peak = await watcher
    return summarize(concurrency, results, wall, peak)


# -- a server of our own ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """`kvlab serve` in a subprocess on a free loopback port, stopped with SIGTERM on exit."""

    def __init__(self, model: str | None, cache: str, kv_budget: str, max_batch: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-c", "from kvlab.cli import app; app()", "serve"] + ([model] if model else []) + [
            "--cache", cache, "--kv-budget", kv_budget, "--max-batch", str(max_batch), "--port", str(self.port)]

    def __enter__(self) -> "OwnServer":
        import tempfile

        import httpx

        self.log = tempfile.TemporaryFile(mode="w+")  # not a pipe: nobody reads it while the bench runs
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                lines = [line for line in self.log.read().splitlines() if line.strip()]
                self.log.close()
                raise KvlabError(f"kvlab serve exited with code {self.process.returncode}: "
                                 f"{lines[-1].strip() if lines else 'no message'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise KvlabError(f"kvlab serve did not answer on {self.url} within {SERVER_START_TIMEOUT_S} s")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def direct_tokens_per_s(model: str | None, cache: str, kv_budget: str, max_batch: int, prompts: list[str],
                        max_tokens: int, ignore_eos: bool) -> float:
    """Output tokens/s of the concurrency-1 workload on an Engine called directly (no HTTP): the baseline.
    The engine is set up as the served one was, and warmed up with one request first, as the server was."""
    from ..serve.engine import Engine
    from ..serve.sampling import SamplingParams

    engine = Engine.from_model_path(model, cache=cache, kv_budget=kv_budget, max_batch=max_batch,
                                    max_step_tokens=max(512, max_batch))
    tokenizer = engine.tokenizer

    def run(prompt: str, n: int) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request(tokenizer.encode(text, add_special=False),
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos))
        produced = 0
        while engine.has_unfinished():
            produced += sum(len(out.new_token_ids) for out in engine.step())
        return produced

    run(WARMUP_PROMPT, 2)
    start = time.perf_counter()
    tokens = sum(run(prompt, max_tokens) for prompt in prompts)
    return tokens / (time.perf_counter() - start)


# -- the command -------------------------------------------------------------------------------------------
@dataclass
class ServeBenchSettings:
    url: str | None = None
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    requests: int = 32                 # per level (at least the level's concurrency)
    max_tokens: int = 64
    ignore_eos: bool = True            # every request produces max_tokens tokens: levels compare like for like
    model: str | None = None           # for a server this bench starts itself
    cache: str = "dense"
    kv_budget: str = "512MiB"
    api_key: str | None = None
    direct: bool = True                # measure the HTTP overhead (own server only)
    extra: dict = field(default_factory=dict)


def run_serve_bench(settings: ServeBenchSettings, out: str | None, plot: str | None, json_out: bool,
                    console: Console) -> dict:
    if not settings.concurrency or any(c < 1 for c in settings.concurrency):
        raise ConfigError(f"--concurrency must be positive integers, got {settings.concurrency}")
    if settings.requests < 1 or settings.max_tokens < 1:
        raise ConfigError("--requests and --max-tokens must be at least 1")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise KvlabError("kvlab bench serve needs httpx: pip install 'kvlab[serve]'") from None
    body = {"max_tokens": settings.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **settings.extra}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    levels: list[LevelResult] = []

    def run_levels(url: str) -> None:
        body["model"] = settings.model or served_model(url, settings.api_key)
        warmup = asyncio.run(run_level(url, 1, [WARMUP_PROMPT], {**body, "max_tokens": 2}, settings.api_key))
        if warmup.errors:
            raise KvlabError(f"{url} failed the warm-up request: {warmup.first_error}")
        for c in settings.concurrency:
            prompts = workload(max(settings.requests, c))
            level = asyncio.run(run_level(url, c, prompts, body, settings.api_key))
            levels.append(level)
            if not json_out:
                console.print(f"concurrency {c}: {level.output_tokens_per_s:.1f} output tokens/s, {level.errors} errors",
                              highlight=False)

    direct = None
    if settings.url:
        url = check_loopback(settings.url)
        run_levels(url)
    else:
        with OwnServer(settings.model, settings.cache, settings.kv_budget, max(settings.concurrency)) as server:
            url = server.url
            run_levels(url)
        if settings.direct and 1 in settings.concurrency:
            direct = direct_tokens_per_s(settings.model, settings.cache, settings.kv_budget, max(settings.concurrency),
                                         workload(max(settings.requests, 1)), settings.max_tokens, settings.ignore_eos)
    served_c1 = next((lv.output_tokens_per_s for lv in levels if lv.concurrency == 1), None)
    record = {
        "url": url if settings.url else "own kvlab serve",
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("api_key", "extra")},
        "levels": [asdict(lv) for lv in levels],
        "http_overhead": None if direct is None or served_c1 is None else {
            "direct_tokens_per_s": round(direct, 2), "served_tokens_per_s": served_c1,
            "served_vs_direct": round(served_c1 / direct, 3) if direct else None,
        },
        "machine": _machine(),
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=2))
    if plot:
        plot_levels(levels, plot)
    if json_out:
        print(json.dumps(record))
    else:
        console.print(results_table(levels))
        if record["http_overhead"]:
            h = record["http_overhead"]
            console.print(f"HTTP overhead at concurrency 1: served {h['served_tokens_per_s']:.1f} vs direct "
                          f"{h['direct_tokens_per_s']:.1f} output tokens/s = {h['served_vs_direct']:.0%}", highlight=False)
        console.print(f"results in {out}" + (f", plot in {plot}" if plot else ""), highlight=False)
    return record


def served_model(url: str, api_key: str | None) -> str:
    """The first model the server lists (servers like vLLM insist on their own name)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise KvlabError(f"{url} does not answer ({type(exc).__name__}); is the server running?") from None
    if response.status_code != 200:
        raise KvlabError(f"{url}/v1/models answered HTTP {response.status_code}: {response.text[:120]}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise KvlabError(f"{url}/v1/models did not list a model") from None


def _machine() -> dict:
    from ..measure import machine_info

    return machine_info()


def results_table(levels: list[LevelResult]) -> Table:
    table = Table(title="kvlab bench serve: streamed chat completions")
    for name in ("concurrency", "requests", "errors", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "peak KV MiB"):
        table.add_column(name, justify="right")
    show = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    for lv in levels:
        table.add_row(str(lv.concurrency), str(lv.requests), str(lv.errors), show(lv.requests_per_s, "{:.2f}"),
                      show(lv.output_tokens_per_s), show(lv.ttft_p50_ms), show(lv.ttft_p99_ms), show(lv.tpot_p50_ms),
                      show(lv.tpot_p99_ms), show(None if lv.peak_kv_bytes is None else lv.peak_kv_bytes / 2**20, "{:.2f}"))
    return table


def plot_levels(levels: list[LevelResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv.concurrency for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(c, [lv.output_tokens_per_s for lv in levels], marker="o")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    for name, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"), ("tpot_p99_ms", "s--")):
        values = [getattr(lv, name) for lv in levels]
        if any(v is not None for v in values):
            right.plot(c, [float("nan") if v is None else v for v in values], style, label=name.replace("_ms", ""))
    right.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(c, [str(x) for x in c])
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(bench_app) -> None:
    """Add `kvlab bench serve` to the bench typer app."""
    import typer

    from ..errors import ConfigError
    from ..terminal import console, one_line_errors

    @bench_app.command("serve")
    @one_line_errors
    def bench_serve(
        url: Optional[str] = typer.Option(None, "--url", help="An OpenAI-compatible server on this machine "
                                          "(default: start `kvlab serve` on a free port)."),
        concurrency: str = typer.Option("1,4,16,32", "--concurrency", help="Comma-separated numbers of clients."),
        requests: int = typer.Option(32, "--requests", min=1, help="Requests per level (at least its concurrency)."),
        max_tokens: int = typer.Option(64, "--max-tokens", min=1),
        ignore_eos: bool = typer.Option(True, "--ignore-eos/--stop-at-eos",
                                        help="Send ignore_eos so every request makes max_tokens tokens."),
        model: Optional[str] = typer.Option(None, "--model", help="For the server it starts; with --url, the model name to send."),
        cache: str = typer.Option("dense", "--cache", help="Cache of the server it starts."),
        kv_budget: str = typer.Option("512MiB", "--kv-budget", help="KV pool of the server it starts."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="KVLAB_API_KEY"),
        direct: bool = typer.Option(True, "--direct/--no-direct",
                                    help="Also run concurrency 1 on the engine directly: the HTTP overhead (own server only)."),
        out: str = typer.Option("bench/results/serve.json", "--out"),
        plot: Optional[str] = typer.Option("bench/results/serve.png", "--plot", help="PNG of throughput and latency."),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Load an OpenAI-compatible server: requests/s, output tokens/s, TTFT/TPOT p50/p99, errors per concurrency."""
        try:
            levels = tuple(int(c) for c in concurrency.split(","))
        except ValueError:
            raise ConfigError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
        settings = ServeBenchSettings(url=url, concurrency=levels, requests=requests, max_tokens=max_tokens,
                                      ignore_eos=ignore_eos, model=model, cache=cache, kv_budget=kv_budget,
                                      api_key=api_key, direct=direct)
        run_serve_bench(settings, out, plot, json_out, console)
