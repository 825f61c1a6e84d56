"""Tool calling: parsers for each template family on scripted replies, the OpenAI stream of delta.tool_calls,
the history's tool calls and results rendered for the model, and a real two-turn exchange with the openai client
on the embedded SmolLM2 (generic format, tool_choice "required" enforced by the grammar)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvlab.serve.tools import call_grammar, parse_reply, template_messages, tool_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}


# -- parsers ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}} and more', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", '
                '"arguments": {}}]', None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]}', None,
     [("get_weather", {"city": "Lima"})]),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
])
def test_parsers_of_each_family(fmt, text, content, calls):
    got_content, got_calls = parse_reply(text, fmt)
    if fmt == "llama3" and not calls:
        content = text                               # not a clean call: the reply stays text
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


def test_the_template_decides_the_format():
    assert tool_format("{% for t in tools %}...<tool_call>{% endfor %}") == "hermes"
    assert tool_format("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert tool_format("<|python_tag|>{{ tools }}") == "llama3"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"
    assert tool_format(None) == "generic"


REPLIES = {"hermes": '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>',
           "llama3": '{"name": "%s", "parameters": %s}',
           "mistral": '[TOOL_CALLS][{"name": "%s", "arguments": %s}]',
           "generic": '{"tool_calls": [{"name": "%s", "arguments": %s}]}'}


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_each_formats_grammar_takes_a_valid_call_and_refuses_another_function(fmt, smollm2):
    pytest.importorskip("llguidance")
    from kvlab.serve.grammar import GrammarState, GrammarTokenizer

    tokenizer = GrammarTokenizer(smollm2.tokenizer)
    for choice in ("required", "get_weather"):
        state = GrammarState(call_grammar([WEATHER, TIME], choice, False, fmt), tokenizer)
        ids = smollm2.tokenizer.encode(REPLIES[fmt] % ("get_weather", '{"city": "Paris"}'), add_special=False)
        assert state.matcher.try_consume_tokens(ids) == len(ids) and state.matcher.is_accepting(), choice
    named = GrammarState(call_grammar([WEATHER, TIME], "get_weather", False, fmt), tokenizer)
    other = smollm2.tokenizer.encode(REPLIES[fmt] % ("get_time", "{}"), add_special=False)
    assert named.matcher.try_consume_tokens(other) < len(other)          # the forced function only
    assert call_grammar([WEATHER], "auto", True, "hermes") is None           # native auto: the model chooses
    assert call_grammar([WEATHER], "auto", True, "generic") is not None      # generic: always one of its JSON shapes


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
]


def test_history_tool_calls_and_results_reach_the_template(smollm2):
    generic = smollm2.tokenizer.apply_chat_template(template_messages(HISTORY, [WEATHER], "generic"))
    assert "get_weather" in generic and "21 C and sunny" in generic and '"city": "Paris"' in generic
    native_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                       "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
                       "({{ c.function.arguments.city }})</tool_call>{% endfor %}\n{% endfor %}")
    native = dataclasses.replace(smollm2.tokenizer, chat_template=native_template)
    text = native.apply_chat_template(template_messages(HISTORY, [WEATHER], "hermes"), tools=[WEATHER])
    assert "TOOL get_weather" in text and "<tool_call>get_weather(Paris)</tool_call>" in text
    assert "tool: 21 C and sunny" in text


# -- over HTTP --------------------------------------------------------------------------------------------
class ScriptedEngine:
    """A fake engine whose every request answers `script`, a few characters per step."""

    def __new__(cls, script: str):
        from .serve_fakes import FakeEngine, FakeOutput

        class Engine(FakeEngine):
            def step(self):
                outputs = []
                while self.waiting:
                    self.running.append(self.waiting.pop(0))
                for req in list(self.running):
                    piece = script[req["n"]:req["n"] + 7]
                    req["n"] += 7
                    done = req["n"] >= len(script)
                    if done:
                        self.running.remove(req)
                    outputs.append(FakeOutput(req["id"], [1], piece, done, "stop" if done else None,
                                              len(req["prompt"]), 0, req["n"] // 7))
                return outputs

        return Engine()


def test_hermes_tool_calls_streamed_and_not_with_the_openai_client():
    openai = pytest.importorskip("openai")
    from kvlab.serve.http import ServerConfig, create_app

    from .serve_fakes import FakeTokenizer, ServerThread

    class HermesTokenizer(FakeTokenizer):
        chat_template = "{% for t in tools %}<tool_call>{% endfor %}"

    script = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    config = ServerConfig(model_name="fake-model", context_length=4096)
    with ServerThread(create_app(ScriptedEngine(script), HermesTokenizer(), config)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        ask = dict(model="fake-model", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                   max_tokens=100)
        whole = client.chat.completions.create(**ask)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert whole.model_extra["tool_format"] == "hermes"
        chunks = list(client.chat.completions.create(**ask, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        plain = client.chat.completions.create(**{**ask, "tool_choice": "none"})
        assert plain.choices[0].message.content == script and not plain.choices[0].message.tool_calls


def test_a_two_turn_tool_exchange_with_the_openai_client_on_smollm2(smollm2):
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    from kvlab.serve import Engine
    from kvlab.serve.http import ServerConfig, create_app

    from .serve_fakes import ServerThread

    engine = Engine(smollm2, kv_budget="16MiB", max_batch=4, block_size=16)
    config = ServerConfig(model_name="smollm2", context_length=smollm2.config.max_seq_len, max_running=4)
    with ServerThread(create_app(engine, smollm2.tokenizer, config)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                               temperature=0)
        assert first.model_extra["tool_format"] == "generic"         # SmolLM2's template knows no tools
        assert first.choices[0].finish_reason == "tool_calls"
        [call] = first.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert isinstance(arguments["city"], str)
        result = "21 C and sunny"                                     # the client runs the function
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
        second = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                                max_tokens=40, temperature=0)
        answer = second.choices[0]
        assert answer.finish_reason in ("stop", "length", "tool_calls")
        assert answer.message.content or answer.message.tool_calls
        # the tool's result and the call were in the second prompt: it is longer than the first by at least them
        grew = second.usage.prompt_tokens - first.usage.prompt_tokens
        assert grew >= len(smollm2.tokenizer.encode(result + call.function.arguments, add_special=False))
        named = client.chat.completions.create(model="smollm2", messages=messages[:1], tools=[WEATHER, TIME],
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               parallel_tool_calls=False,
                                               max_tokens=40, temperature=0)
        assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
