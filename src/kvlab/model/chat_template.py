"""Chat templates come inside model files, so they are untrusted input: render them so that no template
can hang kvlab, exhaust its memory, reach Python's internals or end in a traceback.

Jinja's ImmutableSandboxedEnvironment keeps a template away from Python internals (no `__class__`
walks, no mutation of the messages), but not from running for ever
(`{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}` does no call and
writes nothing, so no in-process hook sees it) or from building a 10 GB string. A Python thread cannot
be stopped from outside, so templates are rendered in a child Python process (`python -I`) that stays for
the next render (starting one costs ~0.1 s, a server's every new conversation turn would pay it):
  time    the parent kills the child when a render outlasts RENDER_SECONDS; RLIMIT_CPU, raised before each
          render by what the render may use, backs it up
  memory  the child caps its own address space at its start-up size + CHILD_MEMORY_BYTES (RLIMIT_AS)
  size    the child streams the output (Template.generate) and stops past MAX_OUTPUT_CHARS
It reads each request as one JSON line on stdin and answers one JSON line on stdout, so nothing is ever
unpickled; one render at a time. A child that failed a render, was killed or died is replaced by a new
one at the next. Results are cached per (template, messages), so a prompt rendered again (the passkey
trials of every cache) costs nothing. A caller may pass a `deadline` (time.monotonic()) earlier than now +
RENDER_SECONDS: a server that queued the render counts its limit from the request's arrival, so the limit
holds for the client, not only for the child.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from ..errors import ModelFileError

RENDER_SECONDS = 10.0             # a real template renders in milliseconds
MAX_OUTPUT_CHARS = 8_000_000      # more characters than any model's context holds tokens
CHILD_MEMORY_BYTES = 1 << 30      # on top of the child's own start-up address space
CACHED_RENDERS = 256              # finished renders remembered (least recently used dropped first)

_CHILD = r'''
import json, sys

try:  # bound this process before any template runs (POSIX; elsewhere the parent's timeout still holds)
    import resource

    start = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                start = int(line.split()[1]) * 1024
    limit = start + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
except (ImportError, OSError, ValueError):
    resource = None

from datetime import datetime

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(Exception):
    pass


def raise_exception(message):
    raise TemplateRaised(str(message))


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


def answer(**reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def render(request):
    if resource is not None:   # this render's CPU time on top of what the child has used
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        cpu = int(used + request["seconds"]) + 1
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        except (OSError, ValueError):
            pass
    try:
        template = env.from_string(request["template"])
        pieces, size = [], 0
        for piece in template.generate(**request["variables"]):
            size += len(piece)
            if size > request["max_chars"]:
                return answer(error=f"it renders more than {request['max_chars']:,} characters")
            pieces.append(piece)
        answer(text="".join(pieces))
    except TemplateSyntaxError as exc:
        answer(error=f"syntax error on line {exc.lineno}: {exc.message}")
    except TemplateRaised as exc:
        answer(error=str(exc))
    except MemoryError:
        answer(error=f"it needs more than {int(sys.argv[1]) >> 20} MiB of memory")
    except RecursionError:
        answer(error="it recurses too deeply")
    except Exception as exc:
        answer(error=f"{type(exc).__name__}: {exc}")


for line in sys.stdin:
    render(json.loads(line))
'''


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", tools: list[dict] | None = None,
                         deadline: float | None = None) -> str:
    """The rendered prompt, or ModelFileError with one line: a syntax error, the template's own
    raise_exception(), a render past RENDER_SECONDS (or `deadline`), MAX_OUTPUT_CHARS or the memory cap.
    `tools` (OpenAI function definitions) reach the template as the `tools` variable, as transformers passes them."""
    variables = {"messages": messages, "add_generation_prompt": bool(add_generation_prompt),
                 "bos_token": bos_token, "eos_token": eos_token}
    if tools is not None:
        variables["tools"] = tools
    try:
        variables_json = json.dumps(variables)   # key order kept: templates iterate dicts in it
    except (TypeError, ValueError):
        raise ModelFileError("chat messages must be JSON-like (lists, dicts, strings, numbers)") from None
    key = (template, variables_json)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    text = _render(template, variables_json, deadline)
    with _cache_lock:
        _cache[key] = text
        while len(_cache) > CACHED_RENDERS:
            _cache.popitem(last=False)
    return text


_cache: OrderedDict[tuple[str, str], str] = OrderedDict()
_cache_lock = threading.Lock()


class _Renderer:
    """The child that renders, kept between renders; one render at a time (a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def render(self, request: dict, deadline: float) -> dict | None:
        """The child's answer to `request`, or None when it did not answer by `deadline` (the child is killed)."""
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return None
        try:
            if self._child is None or self._child.poll() is not None:
                self._child = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, str(CHILD_MEMORY_BYTES)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL, text=True)
            child = self._child
            try:
                child.stdin.write(json.dumps({**request, "seconds": max(deadline - time.monotonic(), 0.0)}) + "\n")
                child.stdin.flush()
                ready = select.select([child.stdout], [], [], max(deadline - time.monotonic(), 0.0))[0]
                line = child.stdout.readline() if ready else None
            except OSError:
                line = ""
            if line is None:
                self._stop()
                return None
            try:
                reply = json.loads(line) if line else None
            except ValueError:
                reply = None
            if reply is None or "text" not in reply:   # a failed render, or no answer: the next gets a fresh child
                self._stop()
            return reply if reply is not None else {"died": child.returncode}
        finally:
            self._lock.release()

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


_renderer = _Renderer()


def _render(template: str, variables_json: str, deadline: float | None) -> str:
    limit = RENDER_SECONDS if deadline is None else min(RENDER_SECONDS, deadline - time.monotonic())
    late = ModelFileError(f"chat template: did not finish within {RENDER_SECONDS:g} s (an endless loop?); "
                          "fix the model's chat template")
    if limit <= 0:
        raise late
    request = {"template": template, "variables": json.loads(variables_json), "max_chars": MAX_OUTPUT_CHARS}
    try:
        reply = _renderer.render(request, time.monotonic() + limit)
    except OSError as exc:
        raise ModelFileError(f"chat template: cannot start a Python process to render it ({exc.strerror or exc})") from None
    if reply is None:
        raise late
    if "died" in reply:
        raise ModelFileError(f"chat template: the renderer stopped without an answer (exit status {reply['died']}; "
                             "out of CPU time or memory?)")
    if "error" in reply:
        raise ModelFileError(f"chat template: {reply['error']}")
    return reply["text"]
