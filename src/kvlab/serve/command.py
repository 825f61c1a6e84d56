"""`kvlab serve`: the CLI front of the HTTP server (its load generator, `kvlab bench serve`, is bench/serve.py's).

Register it with `register(app)`. Nothing here imports FastAPI until a command runs, so
kvlab works without the `serve` extra; `kvlab serve` without it says which extra to install. This module
imports serve.http (when `kvlab serve` runs), never the other way round.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from ..errors import ConfigError, KvlabError
from ..model.weight_modes import WEIGHTS_HELP

PLAN_CONTEXTS = (512, 2048, 8192)  # the memory plan shows how many sequences of these lengths fit


def check_serve_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise KvlabError(f"kvlab serve needs the serve extra ({', '.join(missing)} missing): pip install 'kvlab[serve]'")


def budget_for(ctx: int, max_seqs: int, capacity) -> int:
    """The KV bytes that hold `max_seqs` sequences of `ctx` tokens each, in whole blocks (of every layer group),
    and what the pool holds besides its blocks."""
    return max_seqs * capacity.blocks_for(ctx) * capacity.block_bytes + capacity.fixed_bytes


def memory_plan_table(capacity, model_name: str, context_length: int, max_batch: int, ctx: int | None = None) -> Table:
    """What the server allocated, from Engine.capacity: budget, format, blocks, and how many sequences fit."""
    table = Table(title=f"kvlab serve: KV memory plan for {model_name}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("cache format", str(capacity.format))
    table.add_row("KV budget", f"{capacity.budget:,} bytes ({capacity.budget / 2**20:,.1f} MiB)")
    groups = capacity.groups
    layers = "all attention layers" if groups is None or len(groups.members) == 1 else \
        f"{groups.size} layers of one of {len(groups.members)} layer groups, sliding ones freed behind the window"
    table.add_row("block", f"{capacity.block_size} tokens × {capacity.block_bytes:,} bytes ({layers}, K and V)")
    mib = capacity.n_blocks * capacity.block_bytes / 2**20
    if capacity.tokens == capacity.n_blocks * capacity.block_size:
        table.add_row("blocks", f"{capacity.n_blocks:,} = {capacity.tokens:,} tokens, {mib:,.1f} MiB")
    else:                                       # layer groups: a sequence takes a block in each
        table.add_row("blocks", f"{capacity.n_blocks:,} ({mib:,.1f} MiB): one sequence of up to {capacity.tokens:,} tokens")
    if capacity.fixed_bytes:
        table.add_row("besides the blocks", f"{capacity.fixed_bytes:,} bytes (shared codec state, per-sequence key groups, "
                                            "recurrent state slots)")
    lengths = sorted({n for n in (*PLAN_CONTEXTS, ctx or 0, context_length) if 0 < n <= context_length})
    for n in lengths:
        fits = capacity.max_concurrent(n)
        note = f" (decoded together: at most {max_batch})" if fits > max_batch else ""
        table.add_row(f"sequences of {n:,} tokens", f"{fits:,}{note}")
    return table


def _size(option: str, value: str) -> int:
    from .blocks import parse_bytes

    try:
        return parse_bytes(value)
    except ConfigError:
        raise ConfigError(f"{option} must be a size like 4MiB or 512KiB, got {value!r}") from None


def run_server(*, model: str | None, cache: str, kv_budget: str | None, ctx: int | None, max_seqs: int | None,
               host: str, port: int, api_key: str | None, max_batch: int, max_waiting: int, block_size: int,
               default_max_tokens: int, grace: float, dtype: str, max_body_bytes: int, console,
               kv_store: str | None = None, kv_store_max: str = "4GiB", weights: str = "auto") -> None:
    """`kvlab serve`: load the model, size the KV pool, print the memory plan, serve until SIGINT/SIGTERM."""
    from ..session import cached_model
    from .engine import Engine, capacity_for
    from .http import LOOPBACK_HOSTS, Server, ServerConfig, create_app, is_loopback

    loaded = cached_model(model, dtype, "cpu", weights)
    context_length = loaded.config.max_seq_len
    budget: int | str = kv_budget or "512MiB"
    if ctx is not None:
        if ctx > context_length:
            raise ConfigError(f"--ctx {ctx} exceeds the model's context of {context_length} tokens")
        one = capacity_for(loaded.config, cache, 2**40, block_size, max_batch, max(512, max_batch))   # sizes only
        budget = budget_for(ctx, max_seqs, one)
    engine = Engine(loaded, cache=cache, kv_budget=budget, max_batch=max_batch, block_size=block_size,
                    max_step_tokens=max(512, max_batch), kv_store=kv_store, kv_store_bytes=kv_store_max)
    name = loaded.path.stem if loaded.path.is_file() else loaded.path.name
    console.print(memory_plan_table(engine.capacity, name, context_length, max_batch, ctx))
    if engine.prefix_caching_off:
        console.print(f"note: {engine.prefix_caching_off}", highlight=False)
    local = is_loopback(host)
    if not local and api_key is None:
        console.print(f"[bold yellow]warning:[/] serving on {host} without --api-key: anyone who can reach it may use it")
    config = ServerConfig(model_name=name, context_length=context_length, api_key=api_key, max_running=max_batch,
                          max_waiting=max_waiting, default_max_tokens=default_max_tokens, shutdown_grace_s=grace,
                          model_aliases=tuple(a for a in (model, str(loaded.path)) if a),
                          allowed_hosts=(*LOOPBACK_HOSTS, host) if local else None, max_body_bytes=max_body_bytes)
    if engine.store is not None:
        store = engine.store
        console.print(f"KV store {store.folder}: {len(store.files):,} blocks, {store.nbytes / 2**20:,.1f} MiB "
                      f"(at most {store.max_bytes / 2**20:,.0f} MiB)", highlight=False)
    console.print(f"serving {name} ({loaded.weights} weights) on http://{host}:{port}/v1 (Ctrl+C stops)", highlight=False)
    Server(create_app(engine, loaded.tokenizer, config), host=host, port=port).run()


def register(app: typer.Typer) -> None:
    from ..terminal import console, one_line_errors

    @app.command("serve")
    @one_line_errors
    def serve(
        model: Optional[str] = typer.Argument(None, help="GGUF file or Hugging Face folder (default: embedded SmolLM2)."),
        cache: str = typer.Option("dense", "--cache", help="Block format of the KV pool: dense, dense-f16, dense-bf16, int8, int4, tq4, tq3, ..."),
        kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="KV pool size, e.g. 512MiB or 2GiB (default 512MiB)."),
        ctx: Optional[int] = typer.Option(None, "--ctx", min=1, help="With --max-seqs: size the pool for M sequences of N tokens."),
        max_seqs: Optional[int] = typer.Option(None, "--max-seqs", min=1, help="With --ctx: sequences of --ctx tokens the pool must hold."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only)."),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="KVLAB_API_KEY",
                                              help="Require `Authorization: Bearer KEY` on every route but /health."),
        max_batch: int = typer.Option(16, "--max-batch", min=1, help="Requests decoded together."),
        max_waiting: int = typer.Option(64, "--max-waiting", min=0, help="Requests allowed to queue beyond those; more get 429."),
        block_size: int = typer.Option(16, "--block-size", min=1, help="Tokens per KV block."),
        default_max_tokens: int = typer.Option(256, "--default-max-tokens", min=1, help="max_tokens of requests that name none."),
        grace: float = typer.Option(5.0, "--shutdown-grace", min=0.0, help="Seconds running requests may finish on SIGINT/SIGTERM."),
        dtype: str = typer.Option("fp32", "--dtype", help="fp32 | bf16."),
        weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
        max_body: str = typer.Option("4MiB", "--max-body", help="Largest request body accepted (413 beyond)."),
        kv_store: Optional[str] = typer.Option(None, "--kv-store", help="Folder keeping the prefix cache on disk "
                                               "across restarts (and POST /kv/save, /kv/restore files)."),
        kv_store_max: str = typer.Option("4GiB", "--kv-store-max", help="Most bytes of blocks --kv-store keeps "
                                         "(least recently used go first)."),
    ):
        """An OpenAI-compatible HTTP server (chat/completions, streaming, /metrics) on the batched engine."""
        check_serve_extra()
        if (ctx is None) != (max_seqs is None):
            raise ConfigError("--ctx and --max-seqs go together (the pool is sized for --max-seqs sequences of --ctx tokens)")
        if kv_budget is not None and ctx is not None:
            raise ConfigError("give either --kv-budget or --ctx with --max-seqs, not both")
        run_server(model=model, cache=cache, kv_budget=kv_budget, ctx=ctx, max_seqs=max_seqs, host=host, port=port,
                   api_key=api_key, max_batch=max_batch, max_waiting=max_waiting, block_size=block_size,
                   default_max_tokens=default_max_tokens, grace=grace, dtype=dtype,
                   max_body_bytes=_size("--max-body", max_body), console=console, kv_store=kv_store,
                   kv_store_max=kv_store_max, weights=weights)
