"""`kvlab serve`'s HTTP side: an OpenAI-compatible API (FastAPI + uvicorn) on one batched Engine.

    asyncio (FastAPI routes)                          engine thread (kvlab.serve.engine_loop)
    parse + validate -> Submission --commands queue--> add_request / abort, step() while busy
    per-request asyncio.Queue     <-call_soon_threadsafe-- ACCEPTED, RequestOutputs, or an error

Routes: POST /v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream: true`),
GET /v1/models, /health, /metrics. A client that disconnects has its request aborted at once (its KV
blocks return to the pool). At most `max_running + max_waiting` requests are in flight; more get 429.
On SIGINT/SIGTERM uvicorn stops accepting; running requests get `shutdown_grace_s` to finish, then are
aborted (their streams end with finish_reason "abort"), and the engine thread stops.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from jinja2 import TemplateError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import KvlabError, RequestTooLargeError
from .engine_loop import AbortedOutput, EngineFailure, EngineLoop, Submission
from .metrics import ServeMetrics
from .openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage,
    validation_error,
)
from .sampling import SamplingParams


@dataclass
class ServerConfig:
    model_name: str                   # what /v1/models lists and responses name
    context_length: int               # the model's context: default max_tokens never asks for more
    api_key: str | None = None        # every route but /health needs `Authorization: Bearer <key>`
    max_running: int = 16             # requests the engine decodes together (its max_batch)
    max_waiting: int = 64             # requests allowed to wait beyond those; more get 429
    default_max_tokens: int = 256     # when a request names no max_tokens (clipped to the context left)
    shutdown_grace_s: float = 5.0     # on SIGINT/SIGTERM running requests may finish this long, then abort


class ServerState:
    """What the routes share: the engine thread, the tokenizer, the config and the metrics."""

    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = ServeMetrics(lambda: self.engine_loop.latest_stats)
        self.engine_loop = EngineLoop(engine, self.metrics)
        self.in_flight = 0            # requests admitted and not yet done (the event loop's thread only)
        self.draining = False         # set when shutdown begins: new requests get 503
        self.created = int(time.time())


def create_app(engine, tokenizer, config: ServerConfig) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and stops it (aborting what still runs)."""
    state = ServerState(engine, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start()
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="kvlab serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvlab = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        if exc.status in (400, 429, 503):
            state.metrics.rejected.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    if config.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=config.api_key)

    @app.get("/health")
    async def health():
        if state.draining or not state.engine_loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "kvlab"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        body.check_supported()
        try:
            text = tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True)
        except (KvlabError, TemplateError) as exc:  # the template refused these messages
            raise ApiError(400, f"chat template: {exc}", param="messages") from None
        prompt_ids = tokenizer.encode(text, add_special=False)  # the template writes the special tokens itself
        return await _serve(state, request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request (n=1), got a list of {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        else:
            vocab = tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        return await _serve(state, request, body, prompt_ids, chat=False)

    return app


class ApiKeyGuard:
    """Every route but /health needs `Authorization: Bearer <key>` (a plain ASGI middleware: streams pass
    through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                                 type="authentication_error", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- one request ----------------------------------------------------------------------------------------
def _sampling(body, prompt_len: int, config: ServerConfig) -> SamplingParams:
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(config.default_max_tokens, config.context_length - prompt_len))
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(1.0 if body.temperature is None else body.temperature),
            top_k=body.top_k or 0,
            top_p=float(1.0 if body.top_p is None else body.top_p),
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )
    except KvlabError as exc:
        raise ApiError(400, str(exc)) from None


async def _serve(state: ServerState, request: Request, body, prompt_ids: list[int], chat: bool):
    config = state.config
    if state.draining:
        raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if state.in_flight >= config.max_running + config.max_waiting:
        raise ApiError(429, f"the server is busy: {state.in_flight} requests in flight (at most "
                            f"{config.max_running} running + {config.max_waiting} waiting); retry later",
                       type="rate_limit_error", code="too_many_requests")
    sampling = _sampling(body, len(prompt_ids), config)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def deliver(event) -> None:  # runs on the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the process is exiting): nobody is waiting
            pass

    state.in_flight += 1
    handed_over = False
    try:
        state.engine_loop.submit(Submission(request_id, prompt_ids, sampling, deliver))
        first = await events.get()
        if isinstance(first, RequestTooLargeError):
            raise ApiError(400, str(first), param="max_tokens", code="context_length_exceeded")
        if isinstance(first, KvlabError):
            raise ApiError(400, str(first))
        if isinstance(first, EngineFailure):
            raise ApiError(503, str(first), type="server_error")
        stream = _RequestStream(state, request_id, events)
        if body.stream:
            handed_over = True
            return _SseResponse(_sse_events(stream, body, chat), stream)
        return await _collect(stream, request, body, chat)
    except asyncio.CancelledError:
        state.engine_loop.abort(request_id)
        raise
    finally:
        if not handed_over:
            state.in_flight -= 1


class _RequestStream:
    """The events of one accepted request, and the bookkeeping to end it exactly once."""

    def __init__(self, state: ServerState, request_id: str, events: asyncio.Queue):
        self.state, self.request_id, self.events = state, request_id, events
        self.created = int(time.time())
        self.finished = False
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    async def outputs(self):
        """Yield RequestOutputs until the finished one; an engine failure raises EngineFailure."""
        while not self.finished:
            out = await self.events.get()
            if isinstance(out, Exception):
                self.finished = True
                raise out
            if not isinstance(out, AbortedOutput):  # an abort we reported ourselves carries no counts
                self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_prompt_tokens
                self.completion_tokens = out.completion_tokens
            self.finished = out.finished
            yield out

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def close(self) -> None:
        """Abort the request if it has not finished (the client left) -- its blocks are freed at once."""
        if not self.finished:
            self.finished = True
            self.state.engine_loop.abort(self.request_id)


async def _collect(stream: _RequestStream, request: Request, body, chat: bool) -> JSONResponse:
    """A non-streamed answer; a client that disconnects while waiting aborts the request."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
    try:
        pieces, finish_reason = [], None
        async for out in stream.outputs():
            pieces.append(out.text_delta)
            finish_reason = out.finish_reason
    except EngineFailure as exc:
        raise ApiError(500, str(exc), type="server_error") from None
    finally:
        watcher.cancel()
        stream.close()
    make = chat_response if chat else completion_response
    return JSONResponse(make(stream.request_id, stream.state.config.model_name, "".join(pieces), finish_reason,
                             stream.usage()))


async def _abort_on_disconnect(request: Request, stream: _RequestStream) -> None:
    """Abort the request when the client goes away (its body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.close()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse_events(stream: _RequestStream, body, chat: bool):
    """OpenAI's stream: a role chunk (chat), content chunks, a finish chunk, an optional usage chunk, [DONE]."""
    model = stream.state.config.model_name
    rid, created = stream.request_id, stream.created
    if chat:
        yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    try:
        async for out in stream.outputs():
            if out.text_delta:
                yield _sse(chat_chunk(rid, model, created, {"content": out.text_delta}) if chat
                           else completion_chunk(rid, model, created, out.text_delta))
            if out.finished:
                yield _sse(chat_chunk(rid, model, created, {}, out.finish_reason) if chat
                           else completion_chunk(rid, model, created, "", out.finish_reason))
    except EngineFailure as exc:
        yield _sse(ApiError(500, str(exc), type="server_error").body())
    if body.include_usage:
        yield _sse(chat_chunk(rid, model, created, None, usage_=stream.usage()) if chat
                   else completion_chunk(rid, model, created, None, usage_=stream.usage()))
    yield _sse("[DONE]")


class _SseResponse(StreamingResponse):
    """Server-sent events that always end their request: finished, or aborted when the client disconnects
    (Starlette cancels the body when it sees http.disconnect) or the stream never started."""

    def __init__(self, content, stream: _RequestStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.request_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()
            self.request_stream.state.in_flight -= 1


# -- the server -------------------------------------------------------------------------------------------
class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGINT/SIGTERM, or should_exit) first refuses new requests, gives the
    running ones `shutdown_grace_s` to finish, then aborts them so their connections close."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
        self.kvlab_state: ServerState = app.state.kvlab
        grace = self.kvlab_state.config.shutdown_grace_s
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=grace + 5.0))

    async def shutdown(self, sockets=None) -> None:
        state = self.kvlab_state
        state.draining = True

        async def abort_after_grace():
            await asyncio.sleep(state.config.shutdown_grace_s)
            state.engine_loop.abort_all()

        aborter = asyncio.create_task(abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    async def _serve(self, sockets=None) -> None:
        await super()._serve(sockets)
        # uvicorn re-raises the SIGINT/SIGTERM it caught once it has shut down, which would end `kvlab serve` with a
        # KeyboardInterrupt or a signal status after a clean shutdown; the shutdown was the answer, so exit 0
        self._captured_signals.clear()


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_server(*, model: str | None, cache: str, kv_budget: str | None, ctx: int | None, max_seqs: int | None,
               host: str, port: int, api_key: str | None, max_batch: int, max_waiting: int, block_size: int,
               default_max_tokens: int, grace: float, dtype: str, console) -> None:
    """`kvlab serve`: load the model, size the KV pool, print the memory plan, serve until SIGINT/SIGTERM."""
    from ..cache import CacheGeometry
    from ..errors import ConfigError
    from ..session import cached_model
    from .command import budget_for, memory_plan_table
    from .blocks import CapacityPlan
    from .engine import Engine

    loaded = cached_model(model, dtype, "cpu")
    context_length = loaded.config.max_seq_len
    budget: int | str = kv_budget or "512MiB"
    if ctx is not None:
        if ctx > context_length:
            raise ConfigError(f"--ctx {ctx} exceeds the model's context of {context_length} tokens")
        one = CapacityPlan.build(CacheGeometry.for_model(loaded.config), cache, 2**40, block_size, max_batch)  # sizes only
        budget = budget_for(ctx, max_seqs, one.block_bytes, block_size) + one.fixed_bytes
    engine = Engine(loaded, cache=cache, kv_budget=budget, max_batch=max_batch, block_size=block_size,
                    max_step_tokens=max(512, max_batch))
    name = loaded.path.stem if loaded.path.is_file() else loaded.path.name
    console.print(memory_plan_table(engine.capacity, name, context_length, max_batch, ctx))
    if not _is_loopback(host) and api_key is None:
        console.print(f"[bold yellow]warning:[/] serving on {host} without --api-key: anyone who can reach it may use it")
    config = ServerConfig(model_name=name, context_length=context_length, api_key=api_key, max_running=max_batch,
                          max_waiting=max_waiting, default_max_tokens=default_max_tokens, shutdown_grace_s=grace)
    console.print(f"serving {name} on http://{host}:{port}/v1 (Ctrl+C stops)", highlight=False)
    Server(create_app(engine, loaded.tokenizer, config), host=host, port=port).run()
