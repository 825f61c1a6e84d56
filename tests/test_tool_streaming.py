"""Tool calls streamed as they are generated (kvlab.serve.tools.ToolStream): scripted replies of every format fed
in pieces split at awkward places assemble to exactly parse_reply's message, the name arrives when it is written,
content before a call arrives before the call ends, and replies that are no call fall back as parse_reply does."""

from __future__ import annotations

import json

import pytest

from kvlab.serve import tools
from kvlab.serve.tools import ToolStream, _echo, parse_reply

ARGS = '{"city": "S\\u00e3o Paulo \\"centro\\"", "days": 3, "units": ["c", 1.50], "raw": "caf\u00e9 \U0001F600\\n"}'
TIME = '{"name": "get_time", "arguments": {}}'

REPLIES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>\n'
               '<tool_call>%s</tool_call>' % (ARGS, TIME)),
    ("hermes", 'Sure: <tool_call>{"arguments": {"a": 1}, "name": "late_name"}</tool_call> done'),
    ("hermes", '<tool_call>{not json}</tool_call> then <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
               '</tool_call>'),
    ("hermes", "No tools needed, <tool here> is text."),
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '  leading space <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": %s}' % ARGS),
    ("llama3", '[{"name": "a", "parameters": {"x": [1, {"y": null}]}}, 7, {"name": "b", "parameters": {}}]'),
    ("llama3", "Plain answer {not a call}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}, %s]' % (ARGS, TIME)),
    ("mistral", 'Thinking first. [TOOL_CALLS]{"name": "one", "arguments": {"k": true}}'),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": %s}, %s]}' % (ARGS, TIME)),
    ("generic", '{"response": "It is sunny \\u2600 and \\"warm\\"."}'),
    ("generic", "not json at all"),
]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _assemble(stream: ToolStream, pieces: list[str]) -> tuple[str, dict, list[int]]:
    """Feed pieces; (the content streamed, per index [id, name, arguments], the step each name arrived at)."""
    content, calls, named = "", {}, []
    steps = [stream.feed(p) for p in pieces]
    last, _, _ = stream.finish()
    for step, deltas in enumerate(steps + [last]):
        for d in deltas:
            content += d.get("content", "")
            for t in d.get("tool_calls", ()):
                if "id" in t:
                    assert t["index"] == len(calls) and t["type"] == "function" and t["function"]["arguments"] == ""
                    calls[t["index"]] = [t["id"], t["function"]["name"], ""]
                    named.append(step)
                else:
                    calls[t["index"]][2] += t["function"]["arguments"]
    return content, calls, named


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
@pytest.mark.parametrize("fmt,text", REPLIES)
def test_streamed_deltas_assemble_to_the_whole_reply(fmt, text, size):
    want_content, want_calls = parse_reply(text, fmt)
    stream = ToolStream(fmt)
    content, calls, _ = _assemble(stream, _pieces(text, size))
    _, final_content, final_calls = stream.finish()
    assert (content or None) == want_content == final_content
    assert [(c[1], c[2]) for c in calls.values()] == [(c.name, c.arguments) for c in want_calls]
    assert [c[0] for c in calls.values()] == [c.id for c in final_calls]
    assert [(c.name, c.arguments) for c in final_calls] == [(c.name, c.arguments) for c in want_calls]


@pytest.mark.parametrize("fmt,text", [(f, t) for f, t in REPLIES if "get_weather" in t])
def test_the_name_arrives_when_it_is_written_and_arguments_as_generated(fmt, text):
    pieces = list(text)                                       # one character per step
    stream = ToolStream(fmt)
    steps = [stream.feed(p) for p in pieces]
    name_end = text.index('"get_weather"') + len('"get_weather"') - 1
    first = next(i for i, deltas in enumerate(steps) if any("tool_calls" in d for d in deltas))
    assert first == name_end
    argument_steps = [i for i, deltas in enumerate(steps) for d in deltas
                      if "tool_calls" in d and d["tool_calls"][0]["index"] == 0 and "id" not in d["tool_calls"][0]]
    assert len(argument_steps) > 10 and argument_steps[0] <= text.index("\"days\"") < len(text) - 20
    if fmt == "hermes":
        said = "".join(d.get("content", "") for deltas in steps[:name_end] for d in deltas)
        assert said == "Let me check."                         # before the call was even named


def test_parallel_calls_are_numbered_in_order():
    text = REPLIES[9][1]
    content, calls, named = _assemble(ToolStream("mistral"), list(text))
    assert list(calls) == [0, 1] and [c[1] for c in calls.values()] == ["get_weather", "get_time"]
    assert named[0] < named[1] < len(text) - 1                 # the second named before the reply ends


def test_a_marker_split_across_pieces_is_held_then_decided():
    stream = ToolStream("hermes")
    assert stream.feed("Hi <tool") == [{"content": "Hi"}]     # the space waits: it may precede a call
    assert stream.feed(" box>") == [{"content": " <tool box>"}]
    stream = ToolStream("hermes")
    stream.feed("Hi <tool")
    assert stream.feed('_call>{"name": "f"') == [
        {"tool_calls": [{"index": 0, "id": stream.calls[0].id, "type": "function",
                         "function": {"name": "f", "arguments": ""}}]}]


def test_malformed_calls_fall_back_as_the_whole_reply_does():
    for fmt, text in [("hermes", "<tool_call>{not json}</tool_call>"), ("llama3", '{"nam": 1} and text'),
                      ("mistral", "[TOOL_CALLS] nothing"), ("generic", '{"other": 1}')]:
        content, calls, _ = _assemble(ToolStream(fmt), list(text))
        assert calls == {} and content == parse_reply(text, fmt)[0] == text


def test_a_call_cut_off_after_its_name_stays_sent():
    stream = ToolStream("hermes")
    stream.feed('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    last, content, calls = stream.finish()
    assert last == [] and content is None
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, ')]
    assert parse_reply(stream.text, "hermes")[1] == []          # the whole reply, parsed, is text


@pytest.mark.parametrize("raw", ['{"a": 1, "b": [true, null, -0, 1.5E+2, "x\\u00e9\\ud83d\\ude00"]}',
                                 '{"k": "caf\u00e9 \U0001F600 \\\\ \\/", "e": {}, "l": [], "n": -1.25e-3}',
                                 '[1, "two", {"three": NaN}]', '"just text"', '12'])
def test_json_echo_is_a_prefix_of_the_dumps_text_at_every_cut(raw):
    want = json.dumps(json.loads(raw))
    for cut in range(len(raw) + 1):
        out, end = _echo(raw[:cut])
        assert want.startswith(out), raw[:cut]
    assert _echo(raw + " ,")[0] == want and _echo(raw)[1] is not None or raw == "12"


def test_a_long_reply_is_re_read_in_amortized_steps_and_still_assembles():
    """Past READ_EACH_STEP characters the reply is re-read once its unread tail is 1/READ_EVERY of it: a 40,000-character
    argument streamed 4 characters at a time is re-read a few hundred times, not 10,000, and assembles exactly."""
    from unittest import mock

    reply = '<tool_call>{"name": "write", "arguments": {"text": "' + "abcd" * 10_000 + '"}}</tool_call>'
    stream = ToolStream("hermes")
    with mock.patch("kvlab.serve.tools._partial_reply", wraps=tools._partial_reply) as reads:
        deltas = [d for i in range(0, len(reply), 4) for d in stream.feed(reply[i:i + 4])]
    last, content, calls = stream.finish()
    assert 1_000 < reads.call_count < 1_400                      # 1,024 steps up to 4,096 characters, then ~80 re-reads
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas + last if "tool_calls" in d)
    assert calls[0].name == "write" and args == calls[0].arguments == json.dumps({"text": "abcd" * 10_000})
