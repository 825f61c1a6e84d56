"""Does kvlab's torch path run right on a CUDA GPU? One short run that records the answer.

    python bench/gpu_check.py                          # --device cuda: writes bench/results/gpu_check.json
    python bench/gpu_check.py --device cpu --quick     # a smoke run of the same checks on the CPU (writes no file
                                                       # unless --out is given: it is not the GPU's results file)

No downloaded model: a seeded random llama (transformers' LlamaForCausalLM: 4 layers, d_model 256, 4 query and 2 KV
heads of 64 dims, a 4,096-word tokenizer) is saved as a Hugging Face folder (tests/hybrid_models.py) and loaded by
kvlab's loader on the device, and once more on the CPU as the reference. Checks, in fp32:

  caches        every cache README names and `none`: 200 random prompt tokens prefilled in 2 chunks, then 32 greedy
                one-token steps. Recorded: max |logit difference| over every position the run produced against one
                recompute without a cache on the same device (on the run's own tokens), the same on the CPU, where the
                greedy tokens first differ from the same cache's on the CPU, the smallest top-1 - top-2 logit gap of
                the device's steps (a near tie explains a differing token), and `cache.nbytes` against the format's
                formula (CacheSpec.bytes). A cache that refuses the device is recorded with its one-line message.
  transformers  the same weights in transformers on the device: its logits against kvlab's dense run at every
                position, and its 32 greedy tokens (argmax of a pass over the sequence per token) against kvlab's.
  engine        the serving engine (kvlab.serve) with dense blocks on the device: 4 requests, each one's tokens
                against kvlab's single-sequence greedy run.
  speed         decode tokens/s over 32 steps after 4 warm-up steps at a 4,096-token context, synchronized, for dense,
                dense-f16 and tq4 on a larger random llama (12 layers, d_model 768, 12/4 heads): the module path
                (torch ops, no C kernel off the CPU) on random weights, not a model's speed.

Problems (a crash, a byte count unlike the formula, dense or transformers or the engine unlike the reference) are
listed in the file and printed last; the exit status is 1 when there is one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvlab.cache import CacheGeometry, CacheSpec, make_cache  # noqa: E402
from kvlab.errors import KvlabError  # noqa: E402
from kvlab.generate import generate, prefill  # noqa: E402
from kvlab.limits import check_device  # noqa: E402
from kvlab.measure import machine_info, write_json  # noqa: E402
from kvlab.model.loader import LoadedModel, load_model  # noqa: E402
from tests.hybrid_models import build, save_folder, word_tokenizer  # noqa: E402

OUT = ROOT / "bench" / "results" / "gpu_check.json"
CACHES = ("none", "dense", "dense-f16", "dense-bf16", "concat", "int8", "int4", "tq5", "tq4", "tq3", "tq-k4v4",
          "tq-k3v3")
SPEED_CACHES = ("dense", "dense-f16", "tq4")
EXACT = ("none", "dense", "concat")     # fp32 K/V: equal to the recompute up to summation order
EXACT_TOLERANCE = 1e-3                  # absolute, on logits of a few units (fp32 over 4 layers: ~1e-5 expected)
VOCAB = 4096
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024)
SPEED = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
ENGINE_REQUESTS = ((7, 8), (40, 16), (100, 12), (150, 20))   # (prompt tokens, new tokens)


def say(text: str) -> None:
    print(text, flush=True)


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


# --------------------------------------------------------------------------------------------------- the models

def make_folder(folder: Path, sizes: dict, seed: int = 0):
    """A seeded random llama from transformers' classes saved as an HF folder -> (the transformers model, the
    folder)."""
    reference = build("llama", VOCAB, seed=seed, **sizes)
    return reference, save_folder(reference, folder, word_tokenizer(VOCAB))


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """n random token ids past the special ones (0-2)."""
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------------------------------- one cache's run

@dataclass
class Run:
    tokens: list[int]            # the greedy tokens
    first: int                   # the absolute position of logits' first row
    logits: torch.Tensor         # (positions, V) on the model's device: every position the run computed
    nbytes: int                  # cache.nbytes at the end
    expected_nbytes: int         # CacheSpec.bytes for the same geometry and tokens
    smallest_gap: float          # min over the greedy choices of top-1 - top-2 logit


@torch.inference_mode()
def cache_run(loaded: LoadedModel, name: str, prompt: list[int], steps: int, chunks: int = 2) -> Run:
    """Prefill `prompt` in `chunks` passes (one pass for `none`, which keeps nothing), then `steps` greedy tokens,
    each fed back alone (`none`: the whole sequence again)."""
    model, device = loaded.model, loaded.device
    stored = len(prompt) + steps - 1                                          # the last token is never fed back
    geometry = CacheGeometry.for_model(loaded.config, capacity=stored)
    cache = make_cache(name, geometry, dtype=loaded.dtype, device=device)
    ids = torch.tensor([prompt], device=device)                               # (1, T)
    if cache.persistent:
        size = -(-len(prompt) // chunks)
        rows = [model(ids[:, a:a + size], cache)[0] for a in range(0, len(prompt), size)]   # each (chunk, V)
        first = 0
    else:
        rows, first = [model(ids, cache, last_only=True)[0]], len(prompt) - 1
    tokens: list[int] = []
    gaps = []
    for step in range(steps):
        top = rows[-1][-1].topk(2)
        gaps.append(top.values[0] - top.values[1])
        tokens.append(int(top.indices[0]))
        if step == steps - 1:
            break
        fed = torch.tensor([[tokens[-1]]], device=device) if cache.persistent else \
            torch.tensor([prompt + tokens], device=device)
        rows.append(model(fed, cache, last_only=True)[0])                    # (1, V)
    expected = CacheSpec.parse(name).bytes(geometry, stored, loaded.dtype)
    return Run(tokens, first, torch.cat(rows), cache.nbytes, expected, float(torch.stack(gaps).min()))


@torch.inference_mode()
def recompute_diff(loaded: LoadedModel, prompt: list[int], run: Run) -> tuple[float, float]:
    """(max |logit difference| of `run` against one pass over its whole sequence without a cache, the largest
    |logit| of that pass)."""
    sequence = prompt + run.tokens[:-1]
    geometry = CacheGeometry.for_model(loaded.config, capacity=len(sequence))
    ref = loaded.model(torch.tensor([sequence], device=loaded.device),
                       make_cache("none", geometry, dtype=loaded.dtype, device=loaded.device))[0, run.first:]
    return float((run.logits.float() - ref.float()).abs().max()), float(ref.abs().max())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_cache(device_model: LoadedModel, cpu_model: LoadedModel, name: str, prompt: list[int], steps: int) -> dict:
    """One cache on the device against the recompute there and against the same cache on the CPU."""
    record: dict = {"cache": name}
    start = time.perf_counter()
    try:
        run = cache_run(device_model, name, prompt, steps)
    except KvlabError as exc:                                      # a refusal: kvlab's one-line errors
        return {**record, "status": "refused", "message": one_line(exc)}
    except Exception as exc:  # noqa: BLE001 - anything else is a defect to record, not to stop the other checks at
        return {**record, "status": "error", "message": one_line(exc), "traceback": traceback.format_exc()[-2000:]}
    diff, scale = recompute_diff(device_model, prompt, run)
    record.update(status="ok", max_abs_diff_vs_recompute=diff, logit_scale=scale, smallest_top2_gap=run.smallest_gap,
                  nbytes=run.nbytes, expected_nbytes=run.expected_nbytes,
                  nbytes_equal=run.nbytes == run.expected_nbytes)
    if cpu_model is device_model:                                  # a CPU run: it is its own reference
        cpu = run
        record["cpu_max_abs_diff_vs_recompute"] = diff
    else:
        try:
            cpu = cache_run(cpu_model, name, prompt, steps)
            record["cpu_max_abs_diff_vs_recompute"] = recompute_diff(cpu_model, prompt, cpu)[0]
        except Exception as exc:  # noqa: BLE001
            cpu = None
            record.update(cpu_status="error", cpu_message=one_line(exc))
    record["first_difference_vs_cpu"] = None if cpu is None else first_difference(run.tokens, cpu.tokens)
    record.update(tokens=run.tokens, seconds=round(time.perf_counter() - start, 2))
    record["_run"] = run                                           # for the transformers check; dropped before saving
    return record


# --------------------------------------------------------------------------------------------------- the references

@torch.inference_mode()
def check_transformers(reference, loaded: LoadedModel, prompt: list[int], dense: Run) -> dict:
    """transformers on the same weights and device: logits at every position of kvlab's dense run, and greedy tokens
    (argmax of a pass over the whole sequence per token: generate() would hold EOS back under min_new_tokens, and its
    cache argument's name changes across transformers versions)."""
    reference = reference.to(loaded.device)
    sequence = torch.tensor([prompt + dense.tokens[:-1]], device=loaded.device)
    logits = reference(sequence).logits[0].float()                                    # (T, V)
    diff = float((logits - dense.logits.float()).abs().max())
    tokens: list[int] = []
    for _ in range(len(dense.tokens)):                               # greedy, each step one pass over the sequence
        fed = torch.tensor([prompt + tokens], device=loaded.device)
        tokens.append(int(reference(fed).logits[0, -1].argmax()))
    return {"max_abs_logit_diff": diff, "logit_scale": float(logits.abs().max()), "greedy_tokens": len(tokens),
            "first_difference": first_difference(tokens, dense.tokens),
            "attention": reference.config._attn_implementation}


def check_engine(loaded: LoadedModel, requests=ENGINE_REQUESTS) -> dict:
    """The serving engine with dense blocks on the model's device: each request's greedy tokens against kvlab's
    single-sequence run of the same prompt."""
    from kvlab.serve import Engine, SamplingParams

    prompts = [prompt_ids(n, seed=10 + i) for i, (n, _) in enumerate(requests)]
    try:
        engine = Engine(loaded, cache="dense", kv_budget="64MiB", max_batch=4, max_step_tokens=64)
        outputs = engine.generate(prompts, [SamplingParams(max_tokens=k, ignore_eos=True) for _, k in requests],
                                  progress=False)
    except Exception as exc:  # noqa: BLE001 - the engine not running on this device is the answer, in one line
        return {"status": "cannot run", "message": one_line(exc)}
    rows = []
    try:
        for prompt, (_, k), out in zip(prompts, requests, outputs):
            cache = make_cache("dense", CacheGeometry.for_model(loaded.config, capacity=len(prompt) + k),
                               dtype=loaded.dtype, device=loaded.device)
            alone = generate(loaded.model, torch.tensor([prompt], device=loaded.device), cache, k).token_ids[0]
            rows.append({"prompt_tokens": len(prompt), "new_tokens": k,
                         "first_difference": first_difference(out.token_ids, alone)})
    except Exception as exc:  # noqa: BLE001 - the single-sequence run failed (caches part 1 says why)
        return {"status": "error", "message": f"the single-sequence reference run: {one_line(exc)}"}
    return {"status": "ok", "device": str(engine.pool.device), "requests": rows}


# --------------------------------------------------------------------------------------------------- speed

@torch.inference_mode()
def check_speed(loaded: LoadedModel, caches=SPEED_CACHES, context: int = 4096, steps: int = 32,
                warmup: int = 4) -> list[dict]:
    """Decode tokens/s per cache at `context` tokens: prefill (kvlab's chunked prefill), `warmup` steps, then `steps`
    timed steps between two synchronizations."""
    device, rows = loaded.device, []
    prompt = torch.tensor([prompt_ids(context, seed=1)], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for name in caches:
        geometry = CacheGeometry.for_model(loaded.config, capacity=context + warmup + steps)
        try:
            cache = make_cache(name, geometry, dtype=loaded.dtype, device=device)
            t0 = time.perf_counter()
            token = prefill(loaded.model, prompt, cache)[:, -1].argmax(-1, keepdim=True)      # (1, 1)
            sync()
            prefill_s = time.perf_counter() - t0
            for _ in range(warmup):
                token = loaded.model(token, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                token = loaded.model(token, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
            sync()
            seconds = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            rows.append({"cache": name, "status": "error", "message": one_line(exc)})
            continue
        rows.append({"cache": name, "status": "ok", "context": context, "steps": steps, "tokens_per_s": steps / seconds,
                     "prefill_s": round(prefill_s, 3), "cache_bytes": cache.nbytes})
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------- the run

def problems_of(result: dict) -> list[str]:
    found = []
    for r in result["caches"]:
        if r["status"] == "error" or r.get("cpu_status") == "error":
            found.append(f"{r['cache']}: {r.get('message') or r.get('cpu_message')}")
        elif r["status"] == "ok":
            if not r["nbytes_equal"]:
                found.append(f"{r['cache']}: nbytes {r['nbytes']:,} but the formula says {r['expected_nbytes']:,}")
            if r["cache"] in EXACT and r["max_abs_diff_vs_recompute"] > EXACT_TOLERANCE:
                found.append(f"{r['cache']}: logits {r['max_abs_diff_vs_recompute']:.2e} from the recompute")
            if r["cache"] in EXACT and r["first_difference_vs_cpu"] is not None:
                found.append(f"{r['cache']}: greedy tokens differ from the CPU's at step "
                             f"{r['first_difference_vs_cpu']}")
    t = result.get("transformers") or {}
    if "max_abs_logit_diff" not in t:
        found.append(f"transformers: {t.get('message') or t.get('status')}")
    elif t["max_abs_logit_diff"] > EXACT_TOLERANCE or t["first_difference"] is not None:
        found.append(f"transformers: logits {t['max_abs_logit_diff']:.2e} apart, greedy first difference "
                     f"{t['first_difference']}")
    e = result.get("engine") or {}
    if e.get("status") == "error":
        found.append(f"engine: {e['message']}")
    for r in e.get("requests", []):
        if r["first_difference"] is not None:
            found.append(f"engine: a {r['prompt_tokens']}-token request differs from its single-sequence run at "
                         f"token {r['first_difference']}")
    speed = result.get("speed") or {}
    if "message" in speed:
        found.append(f"speed: {speed['message']}")
    found += [f"speed {r['cache']}: {r['message']}" for r in speed.get("results", []) if r["status"] != "ok"]
    return found


def print_caches(rows: list[dict]) -> None:
    say(f"{'cache':<11} {'status':<8} {'max|Δ| vs recompute':>19} {'on CPU':>9} {'greedy vs CPU':>13} "
        f"{'top-2 gap':>9} {'nbytes = formula':>22}")
    for r in rows:
        if r["status"] != "ok":
            say(f"{r['cache']:<11} {r['status']:<8} {r['message']}")
            continue
        same = "equal" if r.get("first_difference_vs_cpu") is None else f"differ @{r['first_difference_vs_cpu']}"
        nb = f"{r['nbytes']:,} {'=' if r['nbytes_equal'] else '≠'} {r['expected_nbytes']:,}"
        say(f"{r['cache']:<11} {'ok':<8} {r['max_abs_diff_vs_recompute']:>19.2e} "
            f"{r.get('cpu_max_abs_diff_vs_recompute', float('nan')):>9.2e} {same:>13} {r['smallest_top2_gap']:>9.3f} "
            f"{nb:>22}")


def run_checks(device: str, caches=CACHES, tiny: dict = TINY, prompt_tokens: int = 200, steps: int = 32,
               requests=ENGINE_REQUESTS, speed: tuple[dict, int, int] | None = (SPEED, 4096, 32)) -> dict:
    """Every check on `device` -> the results file's record. `tiny`: the checked model's sizes; `requests`: the
    engine's (prompt tokens, new tokens); `speed`: (the speed model's sizes, context, timed steps), None to skip it."""
    import transformers

    check_device(device)                                    # one line, before anything is built
    prompt = prompt_ids(prompt_tokens)
    with tempfile.TemporaryDirectory(prefix="kvlab-gpu-check-") as work:
        say("building the tiny random llama")
        reference, folder = make_folder(Path(work) / "tiny", tiny)
        device_model = load_model(folder, device=device)
        cpu_model = device_model if device_model.device.type == "cpu" else load_model(folder, device="cpu")
        name = torch.cuda.get_device_name(device_model.device) if device_model.device.type == "cuda" else "cpu"
        result: dict = {
            "device": str(device_model.device), "device_name": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "transformers_version": transformers.__version__, "machine": machine_info(),
            "model": {"arch": "llama", "vocab": VOCAB, **tiny, "dtype": "fp32",
                      "weights": "random (seed 0), tests/hybrid_models.build"},
            "prompt_tokens": len(prompt), "prefill_chunks": 2, "greedy_steps": steps,
        }
        say(f"device {result['device']} ({name}), torch {torch.__version__}, transformers {transformers.__version__}")
        dense = caches_part(result, device_model, cpu_model, caches, prompt, steps)
        transformers_part(result, reference, device_model, prompt, dense)
        engine_part(result, device_model, requests)
        del reference, device_model, cpu_model, dense
        if speed is not None:
            speed_part(result, device, Path(work) / "speed", *speed)
    result["problems"] = problems_of(result)
    return result


def caches_part(result: dict, device_model, cpu_model, caches, prompt: list[int], steps: int) -> Run | None:
    """Check 1 into result["caches"]; returns the dense run (None without one) for check 2."""
    say(f"\n1. caches: {len(prompt)}-token prompt in 2 chunks + {steps} greedy steps, on {result['device']} and on "
        "the CPU")
    rows = []
    for cache in caches:
        rows.append(check_cache(device_model, cpu_model, cache, prompt, steps))
        r = rows[-1]
        say(f"  {cache}: {r['status']}" + (f" ({r['message']})" if r["status"] != "ok" else f", {r['seconds']} s"))
    print_caches(rows)
    runs = {r["cache"]: r.pop("_run", None) for r in rows}
    result["caches"] = rows
    return runs.get("dense")


def transformers_part(result: dict, reference, device_model, prompt: list[int], dense: Run | None) -> None:
    say("\n2. transformers on the same weights and device")
    if dense is None:
        result["transformers"] = {"status": "no dense run to compare with"}
        return
    try:
        result["transformers"] = t = check_transformers(reference, device_model, prompt, dense)
    except Exception as exc:  # noqa: BLE001
        result["transformers"] = {"status": "error", "message": one_line(exc)}
        say(f"  error: {one_line(exc)}")
        return
    say(f"  logits max|Δ| {t['max_abs_logit_diff']:.2e} (scale {t['logit_scale']:.1f}, {t['attention']}), "
        f"{t['greedy_tokens']} greedy tokens " + ("equal" if t["first_difference"] is None
                                                   else f"differ at {t['first_difference']}"))


def engine_part(result: dict, device_model, requests) -> None:
    say("\n3. the serving engine, dense blocks")
    result["engine"] = e = check_engine(device_model, requests)
    if e["status"] != "ok":
        say(f"  {e['status']}: {e['message']}")
    for r in e.get("requests", []):
        say(f"  {r['prompt_tokens']:>4} prompt + {r['new_tokens']:>2} new tokens: "
            + ("equal to the single-sequence run" if r["first_difference"] is None
               else f"differs at token {r['first_difference']}"))


def speed_part(result: dict, device: str, folder: Path, sizes: dict, context: int, steps: int) -> None:
    path = ("module-path numbers (torch ops; kvlab's C kernels run on the CPU only)" if result["device"] != "cpu"
            else "the CPU's numbers (the fused C step where it applies)")
    say(f"\n4. decode speed at {context:,} tokens, {path}, random weights: {sizes['num_hidden_layers']} layers, "
        f"d_model {sizes['hidden_size']}, {sizes['num_attention_heads']}/{sizes['num_key_value_heads']} heads")
    result["speed"] = sp = {"note": f"{path} on random weights, fp32, batch 1",
                            "model": {"arch": "llama", "vocab": VOCAB, **sizes}, "results": []}
    try:
        _, speed_folder = make_folder(folder, sizes, seed=1)
        sp["results"] = check_speed(load_model(speed_folder, device=device), context=context, steps=steps)
    except Exception as exc:  # noqa: BLE001 - the speed model not building or loading: recorded, the rest kept
        sp["message"] = one_line(exc)
        say(f"  error: {sp['message']}")
    for r in sp["results"]:
        say(f"  {r['cache']:<10} " + (f"{r['tokens_per_s']:8.1f} tok/s  (prefill {r['prefill_s']:.2f} s)"
                                      if r["status"] == "ok" else f"error: {r['message']}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--out", default=None, help=f"the JSON to write (default {OUT.relative_to(ROOT)} on a GPU, "
                                                     "none on the CPU)")
    parser.add_argument("--caches", default=",".join(CACHES), help="comma-separated cache names")
    parser.add_argument("--quick", action="store_true", help="a small speed model and context (a CPU smoke run)")
    parser.add_argument("--no-speed", action="store_true", help="skip the decode speed part")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    speed = None if args.no_speed else (TINY, 256, 8) if args.quick else (SPEED, 4096, 32)
    try:
        result = run_checks(args.device, tuple(c.strip() for c in args.caches.split(",") if c.strip()), speed=speed)
    except KvlabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = ([f"--device {args.device}"] * (args.device != "cuda") + ["--quick"] * args.quick
               + [f"--caches {args.caches}"] * (args.caches != ",".join(CACHES)) + ["--no-speed"] * args.no_speed)
    # the options that made the numbers (not --out)
    result = {"command": " ".join(["python bench/gpu_check.py", *options]), **result,
              "seconds": round(time.perf_counter() - start, 1)}
    out = args.out or (OUT if torch.device(args.device).type == "cuda" else None)
    if out:
        write_json(out, result)
        say(f"\nwrote {out}")
    say(f"\n{len(result['problems'])} problem(s) in {result['seconds']} s" +
        "".join(f"\n  - {p}" for p in result["problems"]))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
