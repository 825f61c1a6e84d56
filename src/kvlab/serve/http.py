"""`kvlab serve`'s HTTP side: an OpenAI-compatible API (FastAPI + uvicorn) on one batched Engine.

    asyncio (FastAPI routes)                          engine thread (kvlab.serve.engine_loop)
    parse + validate -> Submission --commands queue--> add_request / abort, step() while busy
    per-request asyncio.Queue     <-call_soon_threadsafe-- ACCEPTED, RequestOutputs, or an error

Routes: POST /v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream: true`;
n choices, logprobs, penalties, logit_bias, min_p), POST /tokenize and /detokenize (vLLM's shapes),
POST /kv/save and /kv/restore (and llama-server's /slots/{id}?action=save|restore) with --kv-store,
GET /v1/models, /health, /metrics. A client that disconnects has its request aborted at once (its KV
blocks return to the pool). At most `max_running + max_waiting` requests are in flight; more get 429
with Retry-After. On SIGINT/SIGTERM uvicorn stops accepting; running requests get `shutdown_grace_s` to
finish, then are cut (their streams end with finish_reason "length"), and the engine thread stops.

What a misbehaving client cannot do (ServerConfig sets the bounds):
  hold connections      headers must arrive within header_timeout_s, the body within body_timeout_s;
                        at most max_connections connections (uvicorn's limit_concurrency: then 503)
  send a huge body      the body is counted as it arrives and refused (413) past max_body_bytes, before
                        anything parses it; a Content-Length above the limit is refused before it is read
  stall the event loop  chat templating and tokenizing run on a small thread pool, never on the loop
  hang on the engine    every await on the engine thread is bounded: if the thread is gone the request
                        fails with 503 within ENGINE_WATCH_S
  rebind DNS            a server bound to loopback serves only loopback Host headers (allowed_hosts)
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import KvlabError, RequestTooLargeError, StoreFileError
from ..model import chat_template
from .engine_loop import AbortedOutput, EngineFailure, EngineLoop, Submission
from .metrics import ServeMetrics
from .openai_api import (
    FINISH_REASONS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    KvFileRequest,
    TokenizeRequest,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    usage,
    validation_error,
)
from .sampling import SamplingParams
from .tools import ToolStream, call_grammar, parse_reply, template_messages, tool_format

ENGINE_WATCH_S = 1.0     # how often a waiting request checks that the engine thread still lives
PROMPT_WORKERS = 4       # threads that render chat templates and tokenize, off the event loop
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass
class ServerConfig:
    model_name: str                   # what /v1/models lists and responses name
    context_length: int               # the model's context: default max_tokens never asks for more
    api_key: str | None = None        # every route but /health needs `Authorization: Bearer <key>`
    max_running: int = 16             # requests the engine decodes together (its max_batch)
    max_waiting: int = 64             # requests allowed to wait beyond those; more get 429
    default_max_tokens: int = 256     # when a request names no max_tokens (clipped to what the context and pool hold)
    shutdown_grace_s: float = 5.0     # on SIGINT/SIGTERM running requests may finish this long, then are cut
    model_aliases: tuple[str, ...] = ()  # other names a request's `model` may give (the path the model came from)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # Host headers served (any loopback address too);
    #                                   None: any Host (the server was opened to the network with --host)
    max_body_bytes: int = 4 << 20     # a request body larger than this is refused (413) before it is parsed
    header_timeout_s: float = 10.0    # a connection's request headers must be complete this long after they start
    body_timeout_s: float = 30.0      # and its body must have arrived this long after the headers
    max_connections: int = 512        # open connections at most (more get 503)
    retry_after_s: int = 1            # the Retry-After of a 429


class ServerState:
    """What the routes share: the engine thread, the tokenizer, the config and the metrics."""

    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = ServeMetrics(lambda: self.engine_loop.latest_stats)
        self.engine_loop = EngineLoop(engine, self.metrics)
        # the most prompt + new tokens a request can have: the context, or the whole KV pool if that is smaller
        self.token_room = min(config.context_length, getattr(engine, "max_request_tokens", config.context_length))
        self.model_names = {config.model_name, *config.model_aliases}
        self.grammar_tokenizer = getattr(engine, "grammar_tokenizer", None)   # built off the loop on first use
        self.tool_format = tool_format(getattr(tokenizer, "chat_template", None))
        self.prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="kvlab-prompt")
        self.in_flight = 0            # requests admitted and not yet done (the event loop's thread only)
        self.draining = False         # set when shutdown begins: new requests get 503
        self.created = int(time.time())

    async def off_loop(self, fn, *args):
        """Run fn(*args) on the prompt threads (templating and tokenizing never stall the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"the model {model!r} does not exist (this server serves {self.config.model_name!r})",
                           param="model", code="model_not_found")


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
            state.prompt_pool.shutdown(wait=False, cancel_futures=True)
            if hasattr(engine, "close"):               # the KV store writes what it still has queued
                await asyncio.to_thread(engine.close)

    app = FastAPI(title="kvlab serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvlab = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        if exc.status in (400, 429, 503):
            state.metrics.rejected.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    app.add_middleware(RequestGate, config=config)

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
        state.check_model(body.model)
        deadline = time.monotonic() + chat_template.RENDER_SECONDS   # the render limit counts from the arrival
        tools = _ToolPlan.of(body, state.tool_format)
        messages = template_messages(body.template_messages(), tools.offered if tools else None,
                                     tools.format if tools else state.tool_format)
        prompt_ids = await state.off_loop(_chat_prompt, tokenizer, messages, deadline, True,
                                          tools.offered if tools and tools.format != "generic" else None)
        return await _serve(state, request, body, prompt_ids, chat=True, tools=tools)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        body.check()
        state.check_model(body.model)
        if body.messages is not None:
            deadline = time.monotonic() + chat_template.RENDER_SECONDS
            messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
            ids = await state.off_loop(_chat_prompt, tokenizer, messages, deadline, body.add_generation_prompt)
        else:
            ids = await state.off_loop(_encode, tokenizer, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.token_room, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {tokenizer.vocab_size})", param="tokens")
        return {"prompt": await state.off_loop(tokenizer.decode, body.tokens)}

    @app.post("/kv/save")
    async def kv_save(body: KvFileRequest):
        body.check()
        if body.messages is not None:
            deadline = time.monotonic() + chat_template.RENDER_SECONDS
            messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
            ids = await state.off_loop(_chat_prompt, tokenizer, messages, deadline, False)
        elif body.prompt is not None:
            ids = await state.off_loop(_encode, tokenizer, body.prompt)
        else:
            ids = body.tokens
        return await _kv_save(state, engine, body.filename, ids)

    @app.post("/kv/restore")
    async def kv_restore(body: KvFileRequest):
        return await _kv_restore(state, engine, body.filename)

    @app.post("/slots/{id_slot}")
    async def slots(id_slot: int, action: str, body: KvFileRequest):
        """llama-server's slot files: kvlab has no fixed slots, so any slot saves the conversation that finished last
        and restores into the prefix cache every request shares."""
        if action not in ("save", "restore"):
            raise ApiError(400, f"action {action!r}: kvlab takes save or restore", param="action")
        body.check()
        answer = await (_kv_save(state, engine, body.filename, body.tokens) if action == "save"
                        else _kv_restore(state, engine, body.filename))
        return {"id_slot": id_slot, **answer}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        state.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request (n=1), got a list of {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await state.off_loop(_encode, tokenizer, prompt)
        else:
            vocab = tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        return await _serve(state, request, body, prompt_ids, chat=False)

    return app


async def _kv_call(state: ServerState, fn, *args):
    """fn(*args) on the engine thread; a refusal is a 400 with its one line."""
    try:
        return await asyncio.wrap_future(state.engine_loop.call(fn, *args))
    except EngineFailure as exc:
        raise _engine_down(exc) from None
    except KvlabError as exc:
        raise ApiError(400, str(exc)) from None


def _saved_path(engine, filename: str):
    if getattr(engine, "store", None) is None:
        raise ApiError(400, "saving and restoring KV needs the server started with --kv-store DIR", code="kv_store_off")
    try:
        return engine.store.saved_path(filename)
    except KvlabError as exc:
        raise ApiError(400, str(exc), param="filename") from None


async def _kv_save(state: ServerState, engine, filename: str, ids: list[int] | None) -> dict:
    """The full blocks of `ids` (default: the last finished request's) the prefix cache holds, into one file."""
    path = _saved_path(engine, filename)
    start = time.perf_counter()
    if ids is None:
        ids = await _kv_call(state, lambda: engine.last_tokens)
    snapshot = await _kv_call(state, engine.snapshot_prefix, list(ids))
    try:
        path.parent.mkdir(exist_ok=True)
        written = await asyncio.to_thread(snapshot.write, path)
    except OSError as exc:
        raise ApiError(500, f"{path}: {exc.strerror or exc}", type="server_error") from None
    return {"filename": filename, "n_saved": len(snapshot.tokens), "n_written": written,
            "timings": {"save_ms": round((time.perf_counter() - start) * 1e3, 3)}}


async def _kv_restore(state: ServerState, engine, filename: str) -> dict:
    """A saved conversation's blocks into the prefix cache: its next request finds them there."""
    path = _saved_path(engine, filename)
    start = time.perf_counter()
    if not path.is_file():
        raise ApiError(404, f"no saved KV named {filename!r}", param="filename", code="not_found")
    try:
        stored = await asyncio.to_thread(engine.read_saved, path)
    except StoreFileError as exc:
        raise ApiError(400, str(exc), param="filename", code="kv_file_refused") from None
    except OSError as exc:
        raise ApiError(500, f"{path}: {exc.strerror or exc}", type="server_error") from None
    restored = await _kv_call(state, engine.restore_prefix, stored)
    return {"filename": filename, "n_restored": restored, "n_read": len(stored.data),
            "timings": {"restore_ms": round((time.perf_counter() - start) * 1e3, 3)}}


def _chat_prompt(tokenizer, messages: list[dict], deadline: float, add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
    """The chat template's text as token ids (on a prompt thread)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             deadline=deadline)
    except KvlabError as exc:       # the template refused these messages (its message names the template)
        raise ApiError(400, str(exc), param="messages") from None
    except TemplateError as exc:
        raise ApiError(400, f"chat template: {exc}", param="messages") from None
    return _encode(tokenizer, text, add_special=False)  # the template writes the special tokens itself


def _encode(tokenizer, text: str, add_special: bool = True) -> list[int]:
    try:
        return tokenizer.encode(text, add_special=add_special)
    except KvlabError as exc:
        raise ApiError(400, str(exc), param="prompt") from None


# -- what every request passes before a route sees it ------------------------------------------------------
def _host_name(host: str) -> str:
    """The name of a Host header without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "[::1]"."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    """A name or address of this machine only (localhost, 127.0.0.0/8, ::1)."""
    name = host.strip("[]")
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class RequestGate:
    """A plain ASGI middleware (streams pass through untouched) that every HTTP request passes, in order:
      Host        a loopback-bound server answers only loopback Host headers (a DNS-rebinding page cannot reach it)
      API key     `Authorization: Bearer <key>` on every route but /health, when the server has a key
      body        read here, counted as it arrives: past max_body_bytes (or a Content-Length above it) 413, slower
                  than body_timeout_s 408; the route then reads the body from memory
    """

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.expected_key = None if config.api_key is None else f"Bearer {config.api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            refusal, receive = await self._read_body(headers, receive)
        if refusal is not None:
            await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers: dict) -> ApiError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        allowed = self.config.allowed_hosts
        if host and allowed is not None and _host_name(host) not in allowed and not is_loopback(_host_name(host)):
            return ApiError(400, f"Host {host!r} is not an address of this server (it serves loopback only; "
                                 "start kvlab serve with --host to serve other names)", code="invalid_host")
        if self.expected_key is not None and scope["path"] != "/health":
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected_key):
                return ApiError(401, "missing or incorrect API key: send `Authorization: Bearer <key>`",
                                type="authentication_error", code="invalid_api_key")
        return None

    async def _read_body(self, headers: dict, receive):
        """(refusal or None, a receive that replays the body read here, then passes on the connection's events)."""
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"request body larger than {limit:,} bytes", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large, receive
        chunks, size = [], 0
        deadline = time.monotonic() + self.config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return ApiError(408, f"request body not received within {self.config.body_timeout_s:g} s",
                                code="request_timeout"), receive
            if message["type"] == "http.disconnect":
                return None, _replay(message, receive)
            size += len(message.get("body", b""))
            if size > limit:
                return too_large, receive
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return None, _replay({"type": "http.request", "body": b"".join(chunks), "more_body": False}, receive)


def _replay(first: dict, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


# -- one request ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ToolPlan:
    """The tools a chat request offers, in the format the model's template speaks (kvlab.serve.tools)."""

    offered: list
    mode: str            # "auto" | "required" | a function's name
    parallel: bool
    format: str          # hermes | llama3 | mistral | generic

    @classmethod
    def of(cls, body, fmt: str) -> "_ToolPlan | None":
        mode = getattr(body, "tool_mode", None)
        return None if mode is None else cls(body.tool_dicts(), mode, body.parallel_tool_calls, fmt)

    def grammar(self):
        return call_grammar(self.offered, self.mode, self.parallel, self.format)


def _sampling(body, prompt_len: int, room: int, config: ServerConfig, vocab: int,
              tools: _ToolPlan | None = None) -> SamplingParams:
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # what fits beside the prompt in the context and the pool, as vLLM and llama.cpp clip it
        max_tokens = max(1, min(config.default_max_tokens, room - prompt_len))
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(1.0 if body.temperature is None else body.temperature),
            top_k=body.top_k or 0,
            top_p=float(1.0 if body.top_p is None else body.top_p),
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=float(1.0 if body.repetition_penalty is None else body.repetition_penalty),
            logit_bias=body.logit_bias_pairs(vocab),
            min_p=float(body.min_p or 0.0),
            logprobs=body.top_logprobs_asked,
            n=body.n or 1,
            grammar=tools.grammar() if tools is not None else
            body.response_format.grammar() if body.response_format is not None else None,
        )
    except KvlabError as exc:
        raise ApiError(400, str(exc)) from None


def _busy(state: ServerState) -> ApiError:
    config = state.config
    return ApiError(429, f"the server is busy: {state.in_flight} requests in flight (at most {config.max_running} "
                         f"running + {config.max_waiting} waiting); retry later", type="rate_limit_error",
                    code="too_many_requests", headers={"Retry-After": str(config.retry_after_s)})


def _engine_down(exc: Exception) -> ApiError:
    return ApiError(503, str(exc), type="server_error", code="engine_unavailable")


async def _serve(state: ServerState, request: Request, body, prompt_ids: list[int], chat: bool,
                 tools: _ToolPlan | None = None):
    if state.draining:
        raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
    if state.in_flight >= state.config.max_running + state.config.max_waiting:
        raise _busy(state)
    sampling = _sampling(body, len(prompt_ids), state.token_room, state.config, state.tokenizer.vocab_size, tools)
    if sampling.grammar is not None and state.grammar_tokenizer is not None:
        try:   # the grammar library's view of the vocabulary takes ~2 s to build once: not on the engine thread
            await state.off_loop(state.grammar_tokenizer.get)
        except KvlabError as exc:
            raise ApiError(400, str(exc), param="response_format") from None
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
        stream = _RequestStream(state, request_id, events)
        first = await stream.next_event()
        if isinstance(first, RequestTooLargeError):
            raise ApiError(400, str(first), param="max_tokens", code="context_length_exceeded")
        if isinstance(first, KvlabError):
            raise ApiError(400, str(first))
        if isinstance(first, EngineFailure):
            raise _engine_down(first)
        if body.stream:
            handed_over = True
            return _SseResponse(_sse_events(stream, body, chat, tools), stream, tools)
        return await _collect(stream, request, body, chat, tools)
    except asyncio.CancelledError:
        state.engine_loop.abort(request_id)
        raise
    finally:
        if not handed_over:
            state.in_flight -= 1


class _RequestStream:
    """The events of one accepted request (its n choices), and the bookkeeping to end it exactly once."""

    def __init__(self, state: ServerState, request_id: str, events: asyncio.Queue):
        self.state, self.request_id, self.events = state, request_id, events
        self.created = int(time.time())
        self.finished = False
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens: dict[int, int] = {}    # per choice

    async def next_event(self):
        """The next event from the engine thread; EngineFailure (returned) if the thread has gone meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), ENGINE_WATCH_S)
            except asyncio.TimeoutError:
                if not self.state.engine_loop.alive and self.events.empty():
                    return EngineFailure("the engine thread stopped")

    async def outputs(self):
        """Yield RequestOutputs until the request's last; an engine failure raises EngineFailure."""
        while not self.finished:
            out = await self.next_event()
            if isinstance(out, Exception):
                self.finished = True
                raise out
            if not isinstance(out, AbortedOutput):  # an abort we reported ourselves carries no counts
                self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_prompt_tokens
                self.completion_tokens[out.index] = out.completion_tokens
            self.finished = out.all_finished
            yield out

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(self.completion_tokens.values()), self.cached_tokens)

    def close(self) -> None:
        """Abort the request if it has not finished (the client left) -- its blocks are freed at once."""
        if not self.finished:
            self.finished = True
            self.state.engine_loop.abort(self.request_id)


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, "stop")


class _Choices:
    """What each of a request's n choices has so far: text, finish reason, logprob entries."""

    def __init__(self, n: int, tokenizer, chat: bool):
        self.n, self.tokenizer, self.chat = n, tokenizer, chat
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.entries: list[list] = [[] for _ in range(n)]

    def add(self, out) -> tuple[list[int], list]:
        """Record one output; (the choices it touches, the logprob entries it brought)."""
        indices = range(self.n) if out.index is None else [out.index]   # an abort we reported ends them all
        new = [self._entry(d) for d in out.logprobs or ()]
        for i in indices:
            self.text[i] += out.text_delta
            self.entries[i] += new
            if out.finished and self.finish[i] is None:
                self.finish[i] = _finish_reason(out.finish_reason)
        return [i for i in indices], new

    def _entry(self, draw) -> tuple:
        return (*self._token(draw.token), draw.logprob, [(*self._token(t), lp) for t, lp in draw.top])

    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token_id) if hasattr(self.tokenizer, "token_bytes") else \
            self.tokenizer.decode([token_id]).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), raw

    def logprobs(self, entries: list, offset: int) -> dict:
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)


async def _collect(stream: _RequestStream, request: Request, body, chat: bool,
                   tools: _ToolPlan | None = None) -> JSONResponse:
    """A non-streamed answer; a client that disconnects while waiting aborts the request."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
    choices = _Choices(body.n or 1, stream.state.tokenizer, chat)
    try:
        async for out in stream.outputs():
            choices.add(out)
    except EngineFailure as exc:
        raise _engine_down(exc) from None
    finally:
        watcher.cancel()
        stream.close()
    asked = body.top_logprobs_asked is not None
    if tools is not None:
        made = []
        for i in range(choices.n):
            content, calls = parse_reply(choices.text[i], tools.format)
            reason = "tool_calls" if calls else choices.finish[i] or "length"
            made.append(chat_choice(i, content, reason, choices.logprobs(choices.entries[i], 0) if asked else None,
                                    [c.wire() for c in calls]))
        return JSONResponse({**chat_response(stream.request_id, stream.state.config.model_name, made, stream.usage()),
                             "tool_format": tools.format}, headers={"X-Kvlab-Tool-Format": tools.format})
    make_choice, make = (chat_choice, chat_response) if chat else (completion_choice, completion_response)
    return JSONResponse(make(stream.request_id, stream.state.config.model_name,
                             [make_choice(i, choices.text[i], choices.finish[i] or "length",
                                          choices.logprobs(choices.entries[i], 0) if asked else None)
                              for i in range(choices.n)], stream.usage()))


async def _abort_on_disconnect(request: Request, stream: _RequestStream) -> None:
    """Abort the request when the client goes away (its body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.close()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse_events(stream: _RequestStream, body, chat: bool, tools: _ToolPlan | None = None):
    """OpenAI's stream: a role chunk per choice (chat), content chunks (with their tokens' logprobs when asked),
    a finish chunk per choice, an optional usage chunk, [DONE]. With tools, each choice's text goes through a
    ToolStream: content as soon as it cannot be part of a call, a call's id and name as soon as the name is
    written, then its arguments in fragments as they are generated; finish_reason "tool_calls" when calls were sent."""
    model = stream.state.config.model_name
    rid, created = stream.request_id, stream.created
    choices = _Choices(body.n or 1, stream.state.tokenizer, chat)
    asked = body.top_logprobs_asked is not None
    parsers = [ToolStream(tools.format) for _ in range(choices.n)] if tools is not None else None
    if chat:
        for i in range(choices.n):
            yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=i))
    try:
        async for out in stream.outputs():
            offsets = [len(t) for t in choices.text]
            done_before = list(choices.finish)
            indices, entries = choices.add(out)
            for i in indices:
                logprobs = choices.logprobs(entries, offsets[i]) if asked and entries else None
                if parsers is not None:
                    for chunk in _tool_chunks(rid, model, created, i, out.text_delta, parsers[i],
                                              choices.finish[i] if done_before[i] is None else None):
                        yield _sse(chunk)
                    continue
                if out.text_delta or logprobs:
                    yield _sse(chat_chunk(rid, model, created, {"content": out.text_delta}, index=i, logprobs=logprobs)
                               if chat else completion_chunk(rid, model, created, out.text_delta, index=i,
                                                             logprobs=logprobs))
                if choices.finish[i] is not None and done_before[i] is None:
                    yield _sse(chat_chunk(rid, model, created, {}, choices.finish[i], index=i) if chat
                               else completion_chunk(rid, model, created, "", choices.finish[i], index=i))
    except EngineFailure as exc:
        yield _sse(_engine_down(exc).body())
    if body.include_usage:
        yield _sse(chat_chunk(rid, model, created, None, usage_=stream.usage()) if chat
                   else completion_chunk(rid, model, created, None, usage_=stream.usage()))
    yield _sse("[DONE]")


def _tool_chunks(rid: str, model: str, created: int, index: int, text: str, parser: ToolStream,
                 finish: str | None):
    """The chunks of one choice's new text, and its finish chunk when it has just ended."""
    deltas = parser.feed(text)
    if finish is not None:
        last, _, calls = parser.finish()
        deltas += last
    for delta in deltas:
        yield chat_chunk(rid, model, created, delta, index=index)
    if finish is not None:
        yield chat_chunk(rid, model, created, {}, "tool_calls" if calls else finish, index=index)


class _SseResponse(StreamingResponse):
    """Server-sent events that always end their request: finished, or aborted when the client disconnects
    (Starlette cancels the body when it sees http.disconnect) or the stream never started."""

    def __init__(self, content, stream: _RequestStream, tools: _ToolPlan | None = None):
        headers = {"Cache-Control": "no-cache", **({"X-Kvlab-Tool-Format": tools.format} if tools else {})}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.request_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()
            self.request_stream.state.in_flight -= 1


# -- the server -------------------------------------------------------------------------------------------
class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers (uvicorn has none: a client sending a byte of
    headers now and then would hold its connection for ever). The deadline starts with the connection, or with
    the first byte of a keep-alive connection's next request, and closes the connection if the headers are
    still incomplete when it passes. (The body's own deadline is RequestGate's.)"""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self.header_deadline is None:       # a new request has begun: its headers are timed
                self._arm_header_deadline()
        elif self.header_deadline is not None:     # its headers are complete
            self.header_deadline.cancel()
            self.header_deadline = None

    def connection_lost(self, exc) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self.header_deadline = self.loop.call_later(self.config.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _Config(uvicorn.Config):
    def __init__(self, *args, header_timeout_s: float, **kw):
        super().__init__(*args, **kw)
        self.header_timeout_s = header_timeout_s


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGINT/SIGTERM, or should_exit) first refuses new requests, gives the
    running ones `shutdown_grace_s` to finish, then aborts them so their connections close."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
        self.kvlab_state: ServerState = app.state.kvlab
        config = self.kvlab_state.config
        super().__init__(_Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=GuardedH11Protocol,
                                 timeout_graceful_shutdown=config.shutdown_grace_s + 5.0,
                                 limit_concurrency=config.max_connections, header_timeout_s=config.header_timeout_s))

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
