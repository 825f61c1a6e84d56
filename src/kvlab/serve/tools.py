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


def stream_deltas(calls: list[ToolCall], fragment: int = 16) -> list[dict]:
    """`delta.tool_calls` entries as OpenAI streams them: per call one with its id, type and name (empty
    arguments), then its arguments in fragments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"index": index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})
        for at in range(0, len(call.arguments), fragment):
            deltas.append({"index": index, "function": {"arguments": call.arguments[at:at + fragment]}})
    return deltas
