"""The OpenAI wire format: request bodies (validated strictly), error bodies, responses and stream chunks.

Only what kvlab can honour is accepted: text content only, no legacy `functions`. A field kvlab
does not support, sent with a non-default value, is a 400 naming it -- never silently ignored.
Unknown fields are ignored (clients send many), but known fields of the wrong type are refused (strict).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..errors import KvlabError
from ..model.tokenizer import check_unicode
from .grammar import Grammar

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16   # n at most (each choice is a sequence decoded beside the others)
# finish reasons OpenAI's clients know; the engine's own "abort" (a request the server cut, at shutdown) is
# reported as "length": the answer ended before the model ended it
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "length"}
# Fields that take one of several shapes: a wrong value is described by what the field takes.
UNION_FIELDS = {
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of token ids, or a list of one string",
    "content": "a string or a list of text parts",
}
# Values of fields kvlab does not implement that still mean "off" (what clients send by default).
UNSUPPORTED_DEFAULTS: dict[str, tuple] = {
    "functions": (None, []),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, " ".join(message.split()), type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr = "response"
    schema_: dict = Field(..., alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema (that schema)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar.json_object()
        if self.json_schema is None:
            raise ApiError(400, "response_format: type json_schema needs a json_schema object with a schema",
                           param="response_format")
        return Grammar.json_schema(self.json_schema.schema_)


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)       # not OpenAI's; vLLM and llama.cpp accept it too
    ignore_eos: StrictBool = False                    # not OpenAI's (vLLM's): exactly max_tokens tokens, for benchmarks
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)   # not OpenAI's; vLLM and llama.cpp accept it
    min_p: float | None = Field(None, ge=0, le=1)                  # likewise
    logit_bias: dict[StrictStr, float] | None = None               # token id (as a string) -> bias in [-100, 100]
    functions: Any = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        for name, defaults in UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name, None)
            if not any(type(value) is type(d) and value == d for d in defaults):
                raise ApiError(400, f"{name} is not supported by kvlab serve (got {value!r})", param=name)
        if isinstance(self.stop, list):
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", param="stop")
        if any(s == "" for s in self.stop_strings()):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        for s in self.stop_strings():
            _check_text(s, "stop", "stop")

    def logit_bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab:
                raise ApiError(400, f"logit_bias: keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias: biases must be in [-100, 100], got {bias:g} for token {key}",
                               param="logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None    # assistant turns that called tools
    tool_call_id: StrictStr | None = None         # a tool message answers this call

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{index}]: only text content parts are supported, got type {part.type!r}",
                               param="messages")
            pieces.append(part.text)
        return "".join(pieces)


def _check_text(text: str | None, where: str, param: str) -> None:
    """A lone surrogate ("\\ud800" is valid JSON) is a 400 naming where it is, not a tokenizer crash."""
    if text is None:
        return
    try:
        check_unicode(text, where)
    except KvlabError as exc:
        raise ApiError(400, str(exc), param=param) from None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @property
    def tool_mode(self) -> str | None:
        """None (no tools offered, or tool_choice "none"), "auto", "required", or the name of the forced function."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k most likely."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in \
                {t.function.name for t in self.tools or ()}:
            raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        if self.tool_choice in ("required",) and not self.tools:
            raise ApiError(400, "tool_choice \"required\" needs tools", param="tool_choice")
        if self.tool_mode is not None and self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, "response_format cannot be combined with tools (the reply's grammar is the tools')",
                           param="response_format")
        for i, m in enumerate(self.messages):
            _check_text(m.text(i), f"messages[{i}].content", "messages")
            _check_text(m.name, f"messages[{i}].name", "messages")

    def template_messages(self) -> list[dict]:
        """Messages as the chat template wants them: role + plain text content, and the tool calls and tool
        results of earlier turns (never dropped: kvlab.serve.tools renders them for the model)."""
        out = []
        for i, m in enumerate(self.messages):
            message = {"role": m.role, "content": m.text(i)}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = Field(...)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)   # the legacy form: how many top logprobs (0: the chosen's)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for text in [self.prompt] if isinstance(self.prompt, str) else self.prompt:
            if isinstance(text, str):
                _check_text(text, "prompt", "prompt")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "tokenize takes either prompt or messages", param="prompt")
        texts = [self.prompt] if self.messages is None else [m.text(i) for i, m in enumerate(self.messages)]
        for text in texts:
            _check_text(text, "prompt" if self.messages is None else "messages", "prompt")


class KvFileRequest(BaseModel):
    """POST /kv/save and /kv/restore (llama-server's slot files): a file name under --kv-store DIR/saved, and for a
    save the conversation: token ids, a prompt, or chat messages (rendered without the generation prompt, the
    history a next turn's prompt starts with); none: the last finished request's tokens."""

    model_config = ConfigDict(extra="ignore", strict=True)
    filename: StrictStr
    tokens: list[StrictInt] | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None

    def check(self) -> None:
        if sum(x is not None for x in (self.tokens, self.prompt, self.messages)) > 1:
            raise ApiError(400, "give the conversation as one of tokens, prompt or messages", param="tokens")
        texts = [self.prompt] if self.prompt is not None else [m.text(i) for i, m in enumerate(self.messages or ())]
        for text in texts:
            _check_text(text, "prompt" if self.prompt is not None else "messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    tokens: list[StrictInt]


# -- responses ----------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(request_id: str, obj: str, model: str, created: int | None) -> dict:
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {**_envelope(request_id, "chat.completion", model, None), "choices": choices, "usage": usage_}


def completion_response(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {**_envelope(request_id, "text_completion", model, None), "choices": choices, "usage": usage_}


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    """A `chat.completion.chunk`; delta None makes the usage-only chunk (empty choices)."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    chunk = {**_envelope(request_id, "chat.completion.chunk", model, created), "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(request_id: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
                     usage_: dict | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    """A streamed `text_completion`; text None makes the usage-only chunk (empty choices)."""
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    chunk = {**_envelope(request_id, "text_completion", model, created), "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_logprobs(entries: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]]) -> dict:
    """Chat's logprobs object from (token, its bytes, logprob, top [(token, bytes, logprob)]) per token."""
    def one(token: str, raw: bytes, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(t, b, lp), "top_logprobs": [one(*x) for x in top]} for t, b, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]], offset: int) -> dict:
    """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset) from the same
    entries; `offset` is the text length before the first of them."""
    offsets = []
    for token, _, _, _ in entries:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[2] for e in entries],
            "top_logprobs": [{t: lp for t, _, lp in e[3]} for e in entries], "text_offset": offsets}


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's RequestValidationError details -> one clear 400 naming the first bad field."""
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # pydantic adds the union member that failed to the location (e.g. "str", "list[str]"): keep the field path
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path.append(f".{part}" if path else part)
        else:
            break
    field = "".join(path)
    name = next((p for p in reversed(path) if not p.startswith("[")), "").lstrip(".")
    if first.get("type") == "missing":
        return ApiError(400, f"{field or 'body'} is required", param=field or None)
    if not field:
        return ApiError(400, f"request body: {first.get('msg', 'invalid')} (expected a JSON object)")
    param = path[0]
    if name in UNION_FIELDS and len(errors) > 1:
        return ApiError(400, f"{field} must be {UNION_FIELDS[name]}", param=param)
    return ApiError(400, f"{field}: {first.get('msg', 'invalid value')}", param=param)
