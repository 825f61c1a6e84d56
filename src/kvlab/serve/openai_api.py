"""The OpenAI wire format: request bodies (validated strictly), error bodies, responses and stream chunks.

Only what kvlab can honour is accepted: n=1, no logprobs, no penalties, no tools, text content only.
A field kvlab does not support, sent with a non-default value, is a 400 naming it -- never silently ignored.
Unknown fields are ignored (clients send many), but known fields of the wrong type are refused (strict).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..errors import KvlabError
from ..model.tokenizer import check_unicode

MAX_STOP_STRINGS = 16
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
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
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
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (kvlab returns one choice per request), got {self.n}", param="n")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

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

    def check_supported(self) -> None:
        super().check_supported()
        for i, m in enumerate(self.messages):
            _check_text(m.text(i), f"messages[{i}].content", "messages")
            _check_text(m.name, f"messages[{i}].name", "messages")

    def template_messages(self) -> list[dict]:
        """Messages as the chat template wants them: role + plain text content."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] = Field(...)
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


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {
        **_envelope(request_id, "chat.completion", model, None),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {
        **_envelope(request_id, "text_completion", model, None),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None) -> dict:
    """A `chat.completion.chunk`; delta None makes the usage-only chunk (empty choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    chunk = {**_envelope(request_id, "chat.completion.chunk", model, created), "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(request_id: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
                     usage_: dict | None = None) -> dict:
    """A streamed `text_completion`; text None makes the usage-only chunk (empty choices)."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    chunk = {**_envelope(request_id, "text_completion", model, created), "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


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
