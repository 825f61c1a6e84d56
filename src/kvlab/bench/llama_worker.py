"""The llama.cpp side of `kvlab bench decode --llama-cpp PYTHON`, run by that other Python (a venv with
llama-cpp-python; kvlab never imports llama_cpp itself and this file imports nothing from kvlab).

It holds one llama.cpp context and answers one JSON command per stdin line with one JSON line:
    {"cmd": "load", "model": path, "n_ctx": n, "threads": t, "kv": "f16" | "q8_0" | "q4_0"}
    {"cmd": "prefill", "tokens": [ids]}   -> {"seconds": s, "token": greedy next id}
    {"cmd": "steps", "token": id, "n": n}  -> {"seconds": s, "token": last greedy id}
Steps are what kvlab's side times: decode one token (llama_decode of a batch of one), take the argmax of
its logits, feed it back. Quantized K/V types need flash attention in llama.cpp; f16 runs without it
(llama-cpp-python's default; llama.cpp's CPU flash attention is the slower path for f16 K/V here).
"""

import json
import os
import sys
import time

import numpy as np

import llama_cpp

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}


class Worker:
    def __init__(self):
        self.llm = None

    def load(self, model: str, n_ctx: int, threads: int, kv: str) -> dict:
        kind = KV_TYPES[kv]
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, type_k=kind, type_v=kind, flash_attn=kv != "f16", verbose=False)
        return {"n_vocab": self.llm.n_vocab(), "system_info": llama_cpp.llama_print_system_info().decode(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}

    def _greedy(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def prefill(self, tokens: list) -> dict:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "token": self._greedy()}

    def steps(self, token: int, n: int) -> dict:
        start = time.perf_counter()
        for _ in range(n):
            self.llm.eval([token])
            token = self._greedy()
        return {"seconds": time.perf_counter() - start, "token": token}


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            cmd = request.pop("cmd")
            reply = getattr(worker, cmd)(**request)
        except Exception as exc:  # reported to kvlab, which raises it as one line
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
