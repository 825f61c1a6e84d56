"""Tool calling: OpenAI's `tools` / `tool_choice` rendered for the model and its output parsed back into tool calls.

The format comes from the model's chat template:
  hermes   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3): the template gets `tools`
  llama3   a bare JSON object `{"name": ..., "parameters": {...}}`, after an optional <|python_tag|> (Llama 3.x)
  mistral  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
  generic  a template that knows no tools (the embedded SmolLM2's): as llama-server's generic format, the tools are
           described in a system message and the whole reply is JSON held to a schema by the grammar --
           `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`
`tool_choice` "required" or a named function is enforced by constrained decoding in every format (a grammar over
the format's call syntax), "auto" lets the model choose (in the generic format: either JSON shape), "none" leaves
the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .grammar import Grammar

FORMATS = ("hermes", "llama3", "mistral", "generic")
GENERIC_SYSTEM = (
    "You can call these tools (JSON Schema of their arguments):\n{tools}\n"
    "Reply with JSON only. To call tools: {{\"tool_calls\": [{{\"name\": \"<tool name>\", \"arguments\": "
    "{{<arguments>}}}}]}}. To answer the user directly: {{\"response\": \"<your answer>\"}}."
)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str      # JSON text, as OpenAI sends it

    def wire(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_format(template: str | None) -> str:
    """Which family of tool-call syntax the chat template speaks."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes" if "tools" in template else "generic"


def _parsed_arguments(arguments: str) -> dict | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value


def template_messages(messages: list[dict], tools: list[dict] | None, fmt: str) -> list[dict]:
    """The conversation as the chat template receives it. Native formats keep the assistant's `tool_calls`
    (arguments as objects, as transformers' templates expect) and the `tool` messages; the generic format writes
    both as text the model reads, and adds the tool descriptions in a system message."""
    if fmt != "generic":
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _parsed_arguments(
                    c["function"]["arguments"])}} for c in m["tool_calls"]]
            out.append(m)
        return out
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _parsed_arguments(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls})})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": json.dumps({"tool_response": {
                "tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}})})
        elif m["role"] == "assistant" and tools:
            out.append({"role": "assistant", "content": json.dumps({"response": m.get("content") or ""})})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        described = json.dumps([t["function"] for t in tools], indent=1)
        system = GENERIC_SYSTEM.format(tools=described)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_schema(tool: dict, arguments_key: str = "arguments") -> dict:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def call_grammar(tools: list[dict], choice, parallel: bool, fmt: str) -> Grammar | None:
    """The grammar of the reply: None when the model may answer freely. `choice` is "auto", "required" or the
    name of the function it must call."""
    named = [t for t in tools if t["function"]["name"] == choice] if choice not in ("auto", "required") else tools
    key = "parameters" if fmt == "llama3" else "arguments"
    one_call = {"anyOf": [_call_schema(t, key) for t in named]} if len(named) > 1 else _call_schema(named[0], key)
    calls = {"type": "array", "items": one_call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    if fmt == "generic":
        tool_calls = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                      "additionalProperties": False}
        if choice != "auto":
            return Grammar.json_schema(tool_calls)
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return Grammar.json_schema({"anyOf": [tool_calls, answer]})
    if choice == "auto":
        return None
    if fmt == "mistral":
        return Grammar("lark", f"start: \"[TOOL_CALLS]\" calls\ncalls: %json{json.dumps(calls)}")
    call = f"%json{json.dumps(one_call)}"
    if fmt == "llama3":
        return Grammar("lark", f"start: call\ncall: {call}")
    repeat = "+" if parallel else ""
    return Grammar("lark", f"start: (\"<tool_call>\\n\" call \"\\n</tool_call>\" \"\\n\"?){repeat}\ncall: {call}")


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(_new_id(), obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _json_prefix(text: str):
    """The JSON value at the start of text (after spaces) and what follows it, or (None, text)."""
    try:
        value, end = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return None, text
    return value, text.lstrip()[end:]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished reply; text that is no valid call stays content."""
    if fmt == "generic":
        value, rest = _json_prefix(text)
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            calls = [c for c in (_call(v) for v in value["tool_calls"]) if c is not None]
            if calls:
                return None, calls
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        return text, []
    if fmt == "hermes":
        calls, pieces, at = [], [], 0
        for match in _HERMES.finditer(text):
            value, _ = _json_prefix(match.group(1))
            call = _call(value)
            if call is None:
                continue
            pieces.append(text[at:match.start()])
            at = match.end()
            calls.append(call)
        pieces.append(text[at:])
        content = "".join(pieces).strip()
        return (content or None) if calls else text, calls
    if fmt == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        if marker:
            value, _ = _json_prefix(tail)
            values = value if isinstance(value, list) else [value]
            calls = [c for c in (_call(v) for v in values) if c is not None]
            if calls:
                return head.strip() or None, calls
        return text, []
    body = text.strip().removeprefix("<|python_tag|>")                          # llama3
    value, rest = _json_prefix(body)
    values = value if isinstance(value, list) else [value]
    calls = [c for c in (_call(v, "parameters") for v in values) if c is not None]
    if calls and not rest.strip().strip(";"):
        return None, calls
    return text, []


_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_ESCAPE_START = re.compile(r'\\(?:u[0-9a-fA-F]{0,3})?')
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(?:,\s*"(arguments|parameters)"\s*:\s*)?')


class _Stuck(Exception):
    """The partial text is no prefix of any JSON value: nothing more of it is certain."""


def _string_at(raw: str, i: int) -> tuple[str, int | None]:
    """The JSON string starting at raw[i] (a quote): (its decoded characters known so far, the index after its
    closing quote or None while it is open). A trailing high surrogate is held back (its pair may follow)."""
    body = _STRING_BODY.match(raw, i + 1)
    end = body.end()
    if end < len(raw) and raw[end] == '"':
        return json.loads(raw[i:end + 1]), end + 1
    if end < len(raw) and not _ESCAPE_START.fullmatch(raw, end):
        raise _Stuck
    text = json.loads('"' + body.group() + '"')
    return (text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text), None


def _echo(raw: str) -> tuple[str, int | None]:
    """The JSON value at the start of raw as `json.dumps(json.loads(value))` writes it, as far as the partial text
    decides it: (that certain prefix, the index after the value or None while it is open). Stops at the first
    character that makes it no JSON or repeats a key (json.loads keeps the last value of a repeated key)."""
    out: list[str] = []
    stack: list[set | None] = []        # per open container: the keys of an object, None for an array
    expect, i, n = "value", 0, len(raw)
    try:
        while i < n:
            c = raw[i]
            if c in " \t\n\r":
                i += 1
                continue
            closing = {"value]": "]", "key}": "}", ",]": "]", ",}": "}"}.get(expect)
            if c == closing:
                out.append(c)
                stack.pop()
                i += 1
            elif expect in (",]", ",}") and c == ",":
                out.append(", ")
                expect, i = ("value" if expect == ",]" else "key"), i + 1
                continue
            elif expect == ":" and c == ":":
                out.append(": ")
                expect, i = "value", i + 1
                continue
            elif expect in ("key", "key}") and c == '"':
                key, end = _string_at(raw, i)
                if end is None:
                    out.append(json.dumps(key)[:-1])
                    return "".join(out), None
                if key in stack[-1]:
                    raise _Stuck
                stack[-1].add(key)
                out.append(json.dumps(key))
                expect, i = ":", end
                continue
            elif expect not in ("value", "value]"):
                raise _Stuck
            elif c in "{[":
                out.append(c)
                stack.append(set() if c == "{" else None)
                expect, i = ("key}" if c == "{" else "value]"), i + 1
                continue
            elif c == '"':
                text, end = _string_at(raw, i)
                if end is None:
                    out.append(json.dumps(text)[:-1])
                    return "".join(out), None
                out.append(json.dumps(text))
                i = end
            elif any(raw.startswith(word, i) for word in _LITERALS):
                word = next(w for w in _LITERALS if raw.startswith(w, i))
                out.append(word)
                i += len(word)
            elif any(word.startswith(raw[i:]) for word in _LITERALS):
                return "".join(out), None
            else:
                token = _NUMBER_CHARS.match(raw, i)
                if token is None:
                    raise _Stuck
                if token.end() == n:
                    return "".join(out), None
                if not _NUMBER.fullmatch(token.group()):
                    raise _Stuck
                out.append(json.dumps(json.loads(token.group())))
                i = token.end()
            if not stack:
                return "".join(out), i
            expect = ",}" if stack[-1] is not None else ",]"
    except _Stuck:
        pass
    return "".join(out), None


@dataclass(frozen=True)
class _Partial:
    name: str
    arguments: str      # certain prefix of the final arguments text


def _one_call(raw: str, key: str) -> tuple[_Partial | None, int | None]:
    """The call object at the start of raw (after spaces): (what is certain of it, the index after it or None
    while open). An object whose first member is not the name becomes known when it closes."""
    lead = len(raw) - len(raw.lstrip())
    _, end = _echo(raw[lead:])
    if end is not None:
        call = _call(json.loads(raw[lead:lead + end]), key)
        return (None if call is None else _Partial(call.name, call.arguments)), lead + end
    head = _NAME_FIRST.match(raw, lead)
    if head is None:
        return None, None
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None, None
    if head.group(2) is None:
        return _Partial(name, ""), None
    value = raw[head.end():]
    if value.startswith('"'):
        try:
            return _Partial(name, _string_at(value, 0)[0]), None
        except _Stuck:
            return _Partial(name, ""), None
    return _Partial(name, _echo(value)[0]), None


def _call_list(raw: str, key: str) -> list[_Partial]:
    """The calls of a JSON array of call objects (or one call object) at the start of raw, as far as known;
    elements that are no call are skipped, as parse_reply skips them."""
    body = raw.lstrip()
    if not body.startswith("["):
        call, _ = _one_call(body, key)
        return [call] if call else []
    calls, i = [], 1
    while True:
        call, end = _one_call(body[i:], key)
        if call is not None:
            calls.append(call)
        if end is None:
            if call is None and not body[i:].lstrip().startswith("{"):  # a non-object element: skip it whole
                _, skip = _echo(body[i:].lstrip())
                if skip is not None:
                    i += len(body[i:]) - len(body[i:].lstrip()) + skip
                    rest = body[i:].lstrip()
                    if rest.startswith(","):
                        i = len(body) - len(rest) + 1
                        continue
            return calls
        rest = body[i + end:].lstrip()
        if not rest.startswith(","):
            return calls
        i = len(body) - len(rest) + 1


def _held(text: str, marker: str) -> str:
    """text less a tail that may be the start of marker (decided by what comes next)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


def _partial_reply(text: str, fmt: str) -> tuple[str, list[_Partial]]:
    """What parse_reply will say of a reply that begins with text, as far as text decides it: a prefix of its
    content and its calls (a name as soon as written, a prefix of the arguments). parse_reply is the source of
    truth; this reads the same syntax left to right."""
    if fmt == "hermes":
        pieces, calls, at = [], [], 0
        while True:
            start = text.find("<tool_call>", at)
            if start < 0:
                pieces.append(_held(text[at:], "<tool_call>"))
                break
            pieces.append(text[at:start])
            match = _HERMES.match(text, start)
            if match is None:                                   # an open call: its text is not content yet
                call, _ = _one_call(text[start + len("<tool_call>"):], "arguments")
                calls += [call] if call else []
                break
            value, _ = _json_prefix(match.group(1))
            call = _call(value)
            if call is None:
                pieces.append(match.group())
            else:
                calls.append(_Partial(call.name, call.arguments))
            at = match.end()
        return _certain_content("".join(pieces), bool(calls)), calls
    if fmt == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        if not marker:
            return _certain_content(_held(text, "[TOOL_CALLS]"), False), []
        calls = _call_list(tail, "arguments")
        return _certain_content(head, bool(calls)), calls
    body = text.lstrip()
    if fmt == "llama3":
        if "<|python_tag|>".startswith(body):
            return "", []
        body = body.removeprefix("<|python_tag|>").lstrip()
        if body and body[0] not in "{[":
            return text, []                                     # no JSON: all of it is content
        return "", _call_list(body, "parameters")
    if not body.startswith("{"):                                # generic
        return (text if body else ""), []
    head = re.match(r'\{\s*"(tool_calls|response)"\s*:\s*', body)
    if head is None:
        return "", []
    value = body[head.end():]
    if head.group(1) == "tool_calls":
        return "", (_call_list(value, "arguments") if value.startswith("[") else [])
    try:
        return (_string_at(value, 0)[0] if value.startswith('"') else ""), []
    except _Stuck:
        return "", []


def _certain_content(content: str, calls: bool) -> str:
    """Content beside tool calls is stripped, alone it is the whole text: leading spaces wait for the first
    call, trailing spaces for what follows them."""
    if calls:
        return content.strip()
    return "" if content[:1].isspace() else content.rstrip()


class ToolStream:
    """A reply's `delta`s as it is generated: content as soon as it cannot be part of a call, each call's id,
    type and name (empty arguments) as soon as its name is written, then its arguments in fragments. What has
    been sent is never taken back: fragments concatenate to parse_reply's arguments, and `finish` sends what
    parse_reply has beyond them. A call sent and then broken off (the reply hit max_tokens inside it) stays sent."""

    #: replies up to this many characters are re-read at every step; a longer one once its unread tail reaches
    #: 1/READ_EVERY of it, so the re-reading of a long reply costs O(length), not O(length²), on the event loop
    READ_EACH_STEP, READ_EVERY = 4096, 32

    def __init__(self, fmt: str):
        self.fmt, self.text, self.content = fmt, "", ""
        self.calls: list[ToolCall] = []     # sent so far: ids, names, argument text
        self.read_upto = 0                  # len(self.text) at the last re-read

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if len(self.text) > self.READ_EACH_STEP and len(self.text) - self.read_upto < len(self.text) // self.READ_EVERY:
            return []
        self.read_upto = len(self.text)
        return self._send(*_partial_reply(self.text, self.fmt))

    def finish(self) -> tuple[list[dict], str | None, list[ToolCall]]:
        """(the last deltas, the reply's content, its calls); the same as parse_reply, with the ids sent, when
        the reply is whole."""
        content, calls = parse_reply(self.text, self.fmt)
        if self.calls and not calls:                    # a sent call broke off: the text is not sent again
            return [], self.content or None, list(self.calls)
        deltas = self._send(content or "", [_Partial(c.name, c.arguments) for c in calls])
        if not self.calls:
            return deltas, content, []
        return deltas, self.content or None, list(self.calls)

    def _send(self, content: str, calls: list[_Partial]) -> list[dict]:
        deltas = []
        if content.startswith(self.content) and len(content) > len(self.content):
            deltas.append({"content": content[len(self.content):]})
            self.content = content
        for index, call in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(ToolCall(_new_id(), call.name, ""))
                deltas.append({"tool_calls": [{"index": index, "id": self.calls[index].id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self.calls[index]
            if sent.name == call.name and call.arguments.startswith(sent.arguments) and \
                    len(call.arguments) > len(sent.arguments):
                deltas.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[len(sent.arguments):]}}]})
                self.calls[index] = ToolCall(sent.id, sent.name, call.arguments)
        return deltas
