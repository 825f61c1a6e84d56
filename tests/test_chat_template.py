"""Chat templates are untrusted: rendered in a child process bounded in time, memory and output size, every
failure a one-line error; a real template renders exactly as Jinja's sandbox renders it in-process."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvlab.cli import app
from kvlab.errors import ModelFileError
from kvlab.model import chat_template
from kvlab.model.chat_template import render_chat_template

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def reference_render(template: str, **variables) -> str:
    """The plain in-process render the bounded one must equal."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(**variables)


def test_the_real_template_renders_as_jinja_does(smollm2):
    tokenizer = smollm2.tokenizer
    bos = tokenizer.backend.id_to_token(tokenizer.bos_id)
    eos = tokenizer.backend.id_to_token(tokenizer.eos_ids[0])
    expected = reference_render(tokenizer.chat_template, messages=MESSAGES, add_generation_prompt=True,
                                bos_token=bos, eos_token=eos)
    assert tokenizer.apply_chat_template(MESSAGES) == expected
    assert "capital of France" in expected


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "syntax error on line 1"),
    ("{{ raise_exception('only user and assistant roles are supported') }}", "only user and assistant roles"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{% set x = messages.append(1) %}", "SecurityError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
    ("{% for a in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than"),
    ("{{ 'x' * 3000000000 }}", "memory"),
])
def test_a_bad_template_is_a_one_line_error(template, message):
    with pytest.raises(ModelFileError, match=message) as info:
        render_chat_template(template, MESSAGES)
    assert "\n" not in str(info.value) and str(info.value).startswith("chat template: ")


def test_an_endless_template_is_stopped_within_the_time_bound(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)
    endless = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"  # no call, no output
    with pytest.raises(ModelFileError, match="did not finish within 2 s"):
        render_chat_template(endless, MESSAGES)


def test_cli_chat_with_a_broken_template_is_one_line(monkeypatch):
    from kvlab.session import cached_model

    loaded = cached_model(None, "fp32", "cpu", "auto")  # the model `kvlab generate` uses in this process
    monkeypatch.setattr(loaded.tokenizer, "chat_template", "{% if %}")
    result = CliRunner().invoke(app, ["generate", "hi", "--chat", "--max-new-tokens", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "chat template: syntax error" in lines[0]


def test_one_child_renders_prompt_after_prompt_and_a_failed_render_gets_a_fresh_one(monkeypatch):
    """A Python process costs ~0.1 s to start, which a server would pay on every new conversation turn: the child stays
    between renders, and one that failed (here: killed at the time bound) is replaced at the next render."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    turns = [[{"role": "user", "content": word}] for word in ("one", "two", "three")]
    first = render_chat_template(template, turns[0])
    child = chat_template._renderer._child
    assert render_chat_template(template, turns[1]) == reference_render(template, messages=turns[1])
    assert first == reference_render(template, messages=turns[0])
    assert chat_template._renderer._child is child and child.poll() is None
    endless = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    with pytest.raises(ModelFileError, match="did not finish within 2 s"):
        render_chat_template(endless, MESSAGES)
    assert child.poll() is not None
    assert render_chat_template(template, turns[2]) == reference_render(template, messages=turns[2])
    assert chat_template._renderer._child is not child
