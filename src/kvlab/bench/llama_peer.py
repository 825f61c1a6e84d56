"""llama.cpp as a contender of `kvlab bench decode --contexts … --llama-cpp PYTHON --caches …,llama.cpp:f16`.

kvlab never imports llama_cpp: PYTHON is another interpreter (a venv with llama-cpp-python, built apart
and never in CI; bench/README.md says how to build it) that runs llama_worker.py. One worker process per contender
holds its llama.cpp context for one context length, so its K/V grow across the repeats exactly as a
kvlab cache does, and the bench interleaves it with kvlab's caches (A B C A B C …).

A contender name is `llama.cpp:<kv>`, kv one of f16 (llama.cpp's default), q8_0, q4_0: the type of
both K and V. f16 runs without flash attention (llama-cpp-python's default, and 2× faster than llama.cpp's
CPU flash attention at 2,000 tokens of context on this machine); q8_0 and q4_0 with it (llama.cpp's quantized V
needs it). The worker runs in the user's environment: OMP_WAIT_POLICY=passive, which `import kvlab` sets for
its own threads, is taken out again (llama.cpp's OpenMP threads spin between its ops, as its users run it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from ..errors import ConfigError, KvlabError

PREFIX = "llama.cpp:"
WORKER = Path(__file__).with_name("llama_worker.py")
#: bytes per stored K/V value of each llama.cpp type (GGML blocks of 32: q8_0 34 B, q4_0 18 B)
KV_VALUE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
#: seconds a worker may take to answer one command (a long prefill included) before it is given up on
TIMEOUT_S = 1800


def is_peer(name: str) -> bool:
    return name.startswith(PREFIX)


def peer_kv(name: str) -> str:
    kv = name[len(PREFIX):]
    if kv not in KV_VALUE_BYTES:
        raise ConfigError(f"{name}: llama.cpp contenders are {', '.join(PREFIX + k for k in KV_VALUE_BYTES)}")
    return kv


def kv_bytes_per_token(config, kv: str) -> float:
    """Bytes llama.cpp stores per token for K and V over all layers (no sliding-window savings counted)."""
    return config.n_layers * config.n_kv_heads * config.head_dim * 2 * KV_VALUE_BYTES[kv]


def peer_environment() -> dict[str, str]:
    """This process's environment without the OpenMP wait policy kvlab chose for itself (see kvlab/__init__.py)."""
    import kvlab

    env = dict(os.environ)
    if kvlab.WAIT_POLICY_SET_BY_KVLAB:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def check_python(python: str) -> None:
    """A one-line error unless `python` runs and imports llama_cpp."""
    try:
        done = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--llama-cpp {python}: cannot run it ({exc})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"--llama-cpp {python}: it cannot import llama_cpp ({last})")


class LlamaPeer:
    """One llama.cpp context in a worker process: prefill a prompt, then time greedy one-token steps."""

    def __init__(self, python: str, model: Path, n_ctx: int, threads: int, kv: str):
        self.kv = kv
        self._proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=peer_environment())
        try:
            self.info = self._ask(cmd="load", model=str(model), n_ctx=n_ctx, threads=threads, kv=kv)
        except BaseException:
            self.close()
            raise

    def _ask(self, **request) -> dict:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            err = self._proc.stderr.read().strip().splitlines() if self._proc.poll() is not None else []
            raise KvlabError(f"llama.cpp worker ({self.kv}) stopped during {request['cmd']}: {err[-1] if err else 'no message'}")
        reply = json.loads(line)
        if "error" in reply:
            raise KvlabError(f"llama.cpp worker ({self.kv}) {request['cmd']}: {reply['error']}")
        return reply

    def prefill(self, prompt: torch.Tensor) -> tuple[float, int]:
        """prompt (1, T) -> (seconds, greedy next token)."""
        reply = self._ask(cmd="prefill", tokens=prompt[0].tolist())
        return reply["seconds"], reply["token"]

    def steps(self, token: int, n: int) -> tuple[float, int]:
        reply = self._ask(cmd="steps", token=int(token), n=n)
        return reply["seconds"], reply["token"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdout, self._proc.stderr):
            stream.close()
