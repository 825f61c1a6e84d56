"""Structured output: response_format json_object / json_schema held token by token by llguidance's mask inside
the batched sampler."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from kvlab.serve import Engine, SamplingParams  # noqa: E402
from kvlab.serve.grammar import Grammar  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "colour", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, kv_budget="24MiB", max_batch=20, block_size=16, max_step_tokens=512)


def test_strict_json_schema_output_always_parses_and_validates(engine, smollm2):
    prompt = smollm2.tokenizer.encode("Describe a person as JSON:")
    grammar = Grammar.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar) for seed in range(20)]
    plain = SamplingParams(max_tokens=20, temperature=1.0, seed=99)      # an unconstrained neighbour in the batch
    outputs = engine.generate([prompt] * 21, params + [plain], progress=False)
    for out in outputs[:20]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outputs[:20]}) > 1                     # sampled, not one forced answer
    assert outputs[20].text                                                # the neighbour ran as usual


def test_json_object_over_http_with_the_openai_client(smollm2):
    openai = pytest.importorskip("openai")
    from kvlab.serve.http import ServerConfig, create_app

    from .serve_fakes import ServerThread

    engine = Engine(smollm2, kv_budget="8MiB", max_batch=4, block_size=16)
    config = ServerConfig(model_name="smollm2", context_length=smollm2.config.max_seq_len, max_running=4)
    with ServerThread(create_app(engine, smollm2.tokenizer, config)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Give me a JSON object about a cat."}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                               response_format={"type": "json_object"})
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
        else:                                   # cut by max_tokens: still a prefix of an object
            assert reply.choices[0].message.content.lstrip().startswith("{")
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        strict = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                                response_format={"type": "json_schema", "json_schema": {
                                                    "name": "answer", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(strict.choices[0].message.content), schema)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "bogus"}}})
        assert "grammar is not valid" in raised.value.message
