"""`kvlab plan --web`: the planner as a local page (127.0.0.1), redrawn on every change of its inputs.

The page (plan/static/: one HTML file, one script, one style sheet; no CDN, works offline) sends one request
per change, GET /api/plan?model=...&gpu=...&ctx=... (or POST /api/plan with a dropped config.json's JSON
or the first bytes of a GGUF), and draws what the same planner code answers: the `--json` document plus the
per-layer rows and the verdict lines. No figure is computed in JavaScript. The URL's query holds the inputs,
so a plan is a link. Errors come back as the planner's one-line message (HTTP 400), never a traceback.
"""

from __future__ import annotations

import json
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from ..errors import KvlabError
from .report import plan_json, verdict

#: query keys -> build_plan keywords (every other key is refused)
_OPTIONS = {"ctx": "ctx", "kv_type": "kv_type", "kv_type_k": "kv_type_k", "kv_type_v": "kv_type_v", "engine": "engine",
            "parallel": "parallel", "tp": "tp", "weights_quant": "weights_quant", "gpu": "gpu", "vram": "vram",
            "weights_bytes": "weights_bytes", "mmproj": "mmproj", "headroom": "headroom", "params": "params",
            "gpu_layers": "gpu_layers", "n_cpu_moe": "n_cpu_moe", "ram": "ram", "ubatch": "ubatch"}
_FLAGS = {"kv_unified", "swa_full", "cpu_moe", "no_flash_attn"}
_NUMBERS = {"tp": int, "vram": float, "n_cpu_moe": int, "ram": float, "ubatch": int}
_STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/app.js": ("app.js", "text/javascript; charset=utf-8"),
           "/style.css": ("style.css", "text/css; charset=utf-8")}
MAX_UPLOAD = 32 << 20   # a config.json, or the head of a GGUF (its metadata and tensor table)


def plan_document(query: dict[str, str], upload: bytes | None = None, upload_name: str = "", upload_size: int = 0) -> dict:
    """What the page draws for one set of inputs: {plan, layers, verdict} (raises KvlabError on bad input)."""
    from ..errors import ConfigError
    from .build import build_plan

    options: dict = {}
    for key, value in query.items():
        if key == "model" or value == "":
            continue
        if key in _FLAGS:
            if value not in ("0", "false", "off"):
                options["flash_attn" if key == "no_flash_attn" else key] = key != "no_flash_attn"
            continue
        if key not in _OPTIONS:
            raise ConfigError(f"unknown input {key!r}")
        try:
            options[_OPTIONS[key]] = _NUMBERS[key](value) if key in _NUMBERS else value
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    with tempfile.TemporaryDirectory(prefix="kvlab-page-") as folder:
        model = query.get("model") or None
        if upload is not None:
            model = _saved_upload(Path(folder), upload, upload_size)
        plan = build_plan(model, **options)
        document = {"plan": plan_json(plan), "layers": _layer_rows(plan), "verdict": _plain(verdict(plan)),
                    "model_name": plan.spec.name}
    return document


MAX_FILE = 1 << 41   # the size a dropped GGUF may claim (2 TiB)


def _saved_upload(folder: Path, upload: bytes, size: int = 0) -> str:
    """A dropped file, written where the planner reads models: config.json, or a GGUF's first bytes extended
    (sparse, never written) to the file's real size, so its tensor table checks out; tensor data is never read."""
    if upload[:4] != b"GGUF":
        path = folder / "config.json"
        path.write_bytes(upload)
        return str(path)
    path = folder / "dropped.gguf"
    with open(path, "wb") as fh:
        fh.write(upload)
        if len(upload) < size <= MAX_FILE:
            fh.truncate(size)
    return str(path)


def _layer_rows(plan) -> list[dict]:
    rows = []
    for row in plan.layout.layers:
        layer = plan.spec.layers[row.index]
        attention = row.kind in ("full", "sliding", "mla")
        rows.append({"layer": row.index, "kind": row.kind, "kv_heads": layer.n_kv_heads or None,
                     "head_dim_k": layer.head_dim_k if attention else None, "head_dim_v": layer.head_dim_v if attention else None,
                     "window": layer.window if row.kind == "sliding" else None, "cells": row.cells, "k_bytes": row.k_bytes,
                     "v_bytes": row.v_bytes, "state_bytes": row.state_bytes})
    return rows


def _plain(text: str) -> list[str]:
    """The verdict's lines without rich markup."""
    from rich.text import Text

    return [Text.from_markup(line).plain for line in text.splitlines()]


def catalog_document() -> dict:
    from ..sources import catalog
    from .gpus import GPUS

    return {"models": [{"name": e.name, "repo": e.repo, "vision": bool(e.vision)} for e in catalog().values()],
            "gpus": [g.name for g in GPUS.values()]}


class PlanHandler(BaseHTTPRequestHandler):
    server_version = "kvlab-plan"

    def log_message(self, format, *args):   # the page's requests are not the user's business
        return

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, document: dict) -> None:
        self._send(status, json.dumps(document).encode(), "application/json")

    def do_GET(self):  # http.server's name
        url = urlparse(self.path)
        if url.path in _STATIC:
            name, kind = _STATIC[url.path]
            self._send(200, resources.files(__package__).joinpath("static", name).read_bytes(), kind)
        elif url.path == "/api/catalog":
            self._json(200, catalog_document())
        elif url.path == "/api/plan":
            self._plan({k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()})
        else:
            self._json(404, {"error": f"no such page: {url.path}"})

    def do_POST(self):
        url = urlparse(self.path)
        if url.path != "/api/plan":
            self._json(404, {"error": f"no such page: {url.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_UPLOAD:
            self._json(413, {"error": f"a dropped file may hold at most {MAX_UPLOAD >> 20} MiB (a GGUF's head is enough)"})
            return
        body = self.rfile.read(length)
        try:
            size = int(self.headers.get("X-File-Size") or 0)
        except ValueError:
            size = 0
        self._plan({k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}, body,
                   self.headers.get("X-File-Name", ""), size)

    def _plan(self, query: dict[str, str], upload: bytes | None = None, name: str = "", size: int = 0) -> None:
        try:
            self._json(200, plan_document(query, upload, name, size))
        except KvlabError as exc:
            self._json(400, {"error": str(exc)})
        except OSError as exc:
            self._json(400, {"error": f"{exc.strerror or exc}"})


def make_server(port: int = 0) -> ThreadingHTTPServer:
    """The page's server on 127.0.0.1 (port 0: a free one)."""
    return ThreadingHTTPServer(("127.0.0.1", port), PlanHandler)


def serve_page(port: int, console) -> None:
    server = make_server(port)
    console.print(f"kvlab plan page: http://127.0.0.1:{server.server_address[1]}/  (Ctrl-C stops it)", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
