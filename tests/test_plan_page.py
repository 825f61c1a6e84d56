"""`kvlab plan --web`: the page's server answers with the planner's own --json, serves its static files (no CDN),
and turns bad input into the planner's one-line error; in a real headless Chromium (when one is installed) the
numbers shown equal `kvlab plan --json` and follow the inputs."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvlab.plan.command import build_plan
from kvlab.plan.page import make_server
from kvlab.plan.report import plan_json

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


@pytest.fixture(scope="module")
def server():
    srv = make_server(0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(url: str, data: bytes | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body, status, kind = response.read().decode(), response.status, response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        body, status, kind = exc.read().decode(), exc.code, exc.headers["Content-Type"]
    return status, json.loads(body) if kind == "application/json" else body


def test_one_request_answers_the_planners_json(server):
    status, doc = get(f"{server}/api/plan?model=qwen3.5-9b&gpu=RTX+3060&ctx=32768&kv_type=q8_0&weights_quant=UD-Q4_K_XL")
    assert status == 200
    assert doc["plan"] == plan_json(build_plan("qwen3.5-9b", gpu="RTX 3060", ctx="32768", kv_type="q8_0", weights_quant="UD-Q4_K_XL"))
    assert len(doc["layers"]) == 32 and doc["verdict"][1].startswith("launch: llama-server")
    status, doc = get(f"{server}/api/plan?model=qwen3-30b-a3b&gpu=RTX+3060&ctx=max&weights_quant=q4_k_m&cpu_moe=1&ram=32")
    assert status == 200 and doc["plan"]["offload"]["cpu_moe_layers"] == 48 and doc["plan"]["fits"]


def test_static_files_and_no_cdn(server):
    for path in ("/", "/app.js", "/style.css"):
        status, body = get(server + path)
        assert status == 200 and body
        assert "http://" not in body and "https://" not in body   # everything from this server, offline
    status, catalog = get(f"{server}/api/catalog")
    assert status == 200 and any(m["name"] == "qwen3.5-9b" for m in catalog["models"]) and "RTX 3060" in catalog["gpus"]


def test_bad_input_is_the_planners_one_line_error(server):
    status, doc = get(f"{server}/api/plan?model=qwen3.5-9b&weights_quant=q4_x")
    assert status == 400 and doc["error"].startswith("unknown --weights-quant 'q4_x'") and "\n" not in doc["error"]
    status, doc = get(f"{server}/api/plan?model=qwen3.5-9b&bogus=1")
    assert status == 400 and "unknown input 'bogus'" in doc["error"]
    status, doc = get(f"{server}/api/plan?gpu=RTX+3060", data=b'{"model_type": "llama", "num_hidden_layers": "many"}')
    assert status == 400 and "num_hidden_layers" in doc["error"] and "Traceback" not in doc["error"]


def test_a_dropped_config_plans(server):
    from kvlab.sources import catalog

    config = json.dumps(catalog()["llama-3.1-8b"].config).encode()
    status, doc = get(f"{server}/api/plan?gpu=RTX+3060&weights_quant=q4_k_m", data=config)
    assert status == 200 and doc["plan"]["kv_bytes_per_token"] == 131_072 and doc["plan"]["n_params"] == 8_030_261_248


def _browser():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        return None, "playwright is not installed (pip install playwright; the test drives the system's chromium)"
    path = shutil.which("chromium") or shutil.which("chromium-browser") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        return None, "no chromium on this machine (apt-get install chromium; nothing is downloaded at run time)"
    return path, ""


def test_the_page_in_a_real_browser(server, tmp_path):
    executable, why = _browser()
    if executable is None:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=[   # no background traffic: the network is closed
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{server}/?model=qwen3.5-9b&gpu=RTX+3060&ctx=32768&kv_type=q8_0&weights_quant=UD-Q4_K_XL")
        page.wait_for_selector("body[data-state=ready]")
        expected = plan_json(build_plan("qwen3.5-9b", gpu="RTX 3060", ctx="32768", kv_type="q8_0", weights_quant="UD-Q4_K_XL"))
        assert page.text_content("#launch") == expected["launch"]
        assert page.text_content("#max-context").startswith(f"{expected['max_context']:,}")
        assert str(expected["total_bytes"]) in page.text_content("#total").replace(",", "")
        page.fill("#parallel", "4")
        page.wait_for_function("document.querySelector('#launch').textContent.includes('-np 4')")
        page.wait_for_selector("body[data-state=ready]")
        four = plan_json(build_plan("qwen3.5-9b", gpu="RTX 3060", ctx="32768", kv_type="q8_0", weights_quant="UD-Q4_K_XL", parallel=4))
        assert page.text_content("#max-sequences") == str(four["max_sequences"])
        assert "parallel=4" in page.url                                  # the URL holds the inputs
        RESULTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(RESULTS / "plan_page.png"), full_page=True)
        page.fill("#weights_quant", "q4_x")
        page.wait_for_selector("body[data-state=error]")
        assert page.text_content("#error").startswith("error: unknown --weights-quant 'q4_x'")
        assert errors == []
        browser.close()


def test_a_dropped_gguf_head_plans(server):
    """The page sends a GGUF's first bytes and its size: the header plans, as the file on disk does."""
    from kvlab.sources import default_model_path

    path = default_model_path()
    head = path.read_bytes()[: 8 << 20]
    request = urllib.request.Request(f"{server}/api/plan?gpu=RTX+3060", data=head, method="POST",
                                     headers={"X-File-Size": str(path.stat().st_size), "X-File-Name": path.name})
    with urllib.request.urlopen(request, timeout=60) as response:
        doc = json.loads(response.read())
    expected = plan_json(build_plan(str(path), gpu="RTX 3060"))
    assert doc["plan"]["weights_bytes"] == expected["weights_bytes"] == 96_576_768
    assert doc["plan"]["kv_bytes"] == expected["kv_bytes"] and doc["plan"]["max_context"] == expected["max_context"]
