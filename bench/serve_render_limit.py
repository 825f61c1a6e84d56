"""Does the 10 s chat-template render limit hold under load? A model whose template loops for ever (the GGUF of
issue 33: two nested range(100000) loops writing a character each), N clients asking at once; every answer must be
a 400 within ~RENDER_SECONDS of its request, and /health must answer meanwhile.

    PYTHONPATH=src python bench/serve_render_limit.py [--clients 8]

Writes bench/results/serve_render_limit.json: each request's latency, the slowest, and /health's latency
during the renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/serve_fakes.py: the fake engine and harness

LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", default="bench/results/serve_render_limit.json")
    args = parser.parse_args()
    from kvlab.model.chat_template import RENDER_SECONDS
    from kvlab.serve.http import ServerConfig, create_app
    from kvlab.session import cached_model
    from tests.serve_fakes import FakeEngine, ServerThread

    tokenizer = dataclasses.replace(cached_model(None, "fp32", "cpu").tokenizer, chat_template=LOOPING)
    engine = FakeEngine()
    config = ServerConfig(model_name="looping", context_length=engine.context)
    results: list[dict] = []
    with ServerThread(create_app(engine, tokenizer, config)) as server:
        def ask(n: int) -> None:
            started = time.monotonic()
            response = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                                  json={"messages": [{"role": "user", "content": f"client {n}"}], "max_tokens": 2})
            results.append({"status": response.status_code, "seconds": round(time.monotonic() - started, 2),
                            "message": response.json()["error"]["message"] if response.status_code != 200 else ""})

        clients = [threading.Thread(target=ask, args=(n,)) for n in range(args.clients)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=60).status_code
        health_s = time.monotonic() - started
        for t in clients:
            t.join()
    record = {"what": "looping chat template, concurrent chat requests, fake engine, SmolLM2 tokenizer",
              "render_seconds": RENDER_SECONDS, "clients": args.clients, "cpus": os.cpu_count(),
              "load_average_1min": round(os.getloadavg()[0], 2),
              "slowest_s": max(r["seconds"] for r in results), "health_status": health,
              "health_during_renders_s": round(health_s, 3), "requests": sorted(results, key=lambda r: r["seconds"])}
    print(json.dumps({k: v for k, v in record.items() if k != "requests"}))
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
