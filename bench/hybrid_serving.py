"""Gemma 3 and Qwen3.5 in the serving engine and on the torch path: capacity, prefix reuse, decode speed, bytes.

    python bench/hybrid_serving.py            # writes bench/results/hybrid_serving.json
    python bench/hybrid_serving.py --quick    # small workloads (a smoke run)

Random models made from transformers' own classes (tests/hybrid_models.py), fp32 on the CPU, 1 thread:
  capacity   Gemma 3 layer pattern (5 sliding : 1 full, window 1,024), tiny dims: at one KV budget, how many
             sequences of 8k tokens the engine runs at once with sliding layers freeing their blocks behind the window
             vs one block table for every layer (--no free_window): the plan's number and the engine's peak, measured.
  prefix     a shared 512-token prefix + 32 own tokens per request: prefill tokens computed and wall time with prefix
             caching on and off (Gemma 3), and for Qwen3.5, where it is off (recurrent state), what it costs.
  decode     Qwen3.5 tiny and medium: decode tokens/s of kvlab's torch path against transformers' own generate.
  layer      per-token decode cost of one Gated DeltaNet layer against one attention layer at 512 and 4,096 tokens.
  plan       the Qwen3.5-9B config planned with --engine kvlab, and a model of the same layer pattern scaled down:
             the planner's bytes and the running cache's (LayeredCache) agree layer by layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvlab.model.layer_caches import LayeredCache, model_cache  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.plan import PlanSettings, make_plan, rules_for  # noqa: E402
from kvlab.serve.engine import Engine  # noqa: E402
from kvlab.serve.sampling import SamplingParams  # noqa: E402
from kvlab.session import cached_model  # noqa: E402
from kvlab.sources import load_spec  # noqa: E402
from tests.hybrid_models import build, save_folder  # noqa: E402

OUT = ROOT / "bench" / "results" / "hybrid_serving.json"
GEMMA = dict(num_hidden_layers=12, sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=16384)
MEDIUM = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              num_hidden_layers=8, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
              linear_value_head_dim=64, max_position_embeddings=8192)


def folder(arch: str, tokenizer, **overrides):
    reference = build(arch, tokenizer.vocab_size, **overrides)
    path = save_folder(reference, Path(tempfile.mkdtemp()) / arch, tokenizer)
    return load_model(path), reference


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def capacity(tokenizer, quick: bool) -> dict:
    loaded, _ = folder("gemma3", tokenizer, **GEMMA)
    ctx = 2048 if quick else 8192
    out = {"model": "Gemma 3 pattern: 12 layers (10 sliding, 2 full), window 1,024, 2 KV heads × 16 dims", "context": ctx}
    n = 6
    new = n * ctx // 512 + 8                    # the first sequence still decodes when the last one's prompt is in
    on = Engine(loaded, kv_budget="4MiB", max_batch=16)
    budget = on.capacity.fixed_bytes + 4 * on.capacity.blocks_for(ctx + new) * on.capacity.block_bytes   # 4 with freeing
    out["workload"] = f"{n} requests of {ctx} prompt tokens + {new} new tokens, 512 tokens a step"
    for label, free in (("window freeing on", True), ("window freeing off", False)):
        engine = Engine(loaded, kv_budget=budget, max_batch=16, free_window=free)
        for i in range(n):
            engine.add_request(ids(ctx, i), SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        peak, start = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, sum(s.num_computed >= ctx for s in engine.scheduler.running))
        out[label] = {"budget_bytes": budget, "blocks": engine.capacity.n_blocks, "block_bytes": engine.capacity.block_bytes,
                      "layer_groups": len(engine.groups.members), "planned_sequences": engine.capacity.max_concurrent(ctx + new),
                      "measured_peak_sequences_at_context": peak, "preemptions": engine.scheduler.preemptions,
                      "seconds": round(time.perf_counter() - start, 1)}
        print(label, out[label], flush=True)
    return out


def prefix(tokenizer, quick: bool) -> dict:
    shared = ids(512, 100)
    prompts = [shared + ids(32, 200 + i) for i in range(4 if quick else 8)]
    out = {"workload": f"{len(prompts)} requests: a shared 512-token prefix + 32 own tokens, 16 new tokens, submitted "
                       "one after another"}
    for arch in ("gemma3", "qwen3_5"):
        loaded, _ = folder(arch, tokenizer, max_position_embeddings=2048)
        for caching in (True, False):
            engine = Engine(loaded, kv_budget="16MiB", max_batch=8, prefix_caching=caching)
            start = time.perf_counter()
            for p in prompts:                        # one at a time: each can reuse the prefix the others left
                engine.generate([p], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), progress=False)
            stats = engine.stats()
            key = f"{arch} prefix caching {'asked' if caching else 'off'}"
            out[key] = {"prompt_tokens": stats.prompt_tokens, "prefix_hit_tokens": stats.prefix_hit_tokens,
                        "computed_tokens": stats.computed_tokens, "seconds": round(time.perf_counter() - start, 2),
                        "off_because": engine.prefix_caching_off}
            print(key, out[key], flush=True)
    return out


def decode(tokenizer, quick: bool) -> dict:
    out = {}
    for size, overrides in (("tiny", {}), ("medium", MEDIUM)):
        loaded, reference = folder("qwen3_5", tokenizer, **overrides)
        prompt = torch.tensor([ids(128, 7)])
        new = 16 if quick else 64
        rates = {}
        for name in ("kvlab", "transformers"):
            best = 0.0
            for _ in range(2 if quick else 3):
                with torch.inference_mode():
                    if name == "kvlab":
                        cache = model_cache(loaded.config, "dense", capacity=128 + new + 1)
                        logits = loaded.model(prompt, cache, last_only=True)
                        start = time.perf_counter()
                        for _ in range(new):
                            logits = loaded.model(logits[:, -1:].argmax(-1), cache, last_only=True)
                    else:
                        result = reference(prompt, use_cache=True)
                        past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
                        start = time.perf_counter()
                        for _ in range(new):
                            result = reference(token, past_key_values=past, use_cache=True)
                            past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
                    best = max(best, new / (time.perf_counter() - start))
            rates[name] = round(best, 1)
        params = sum(p.numel() for p in reference.parameters())
        out[size] = {"params": params, "layers": loaded.config.layer_kinds, "tokens_per_s": rates,
                     "kvlab_over_transformers": round(rates["kvlab"] / rates["transformers"], 2)}
        print(size, out[size], flush=True)
    return out


def layer_cost(tokenizer, quick: bool) -> dict:
    loaded, _ = folder("qwen3_5", tokenizer, **MEDIUM)
    model, cfg = loaded.model, loaded.config
    rec, full = cfg.layers_of("recurrent")[0], cfg.layers_of("full")[0]
    out = {"model": "Qwen3.5 medium (d_model 512, 16 value heads of 64 × 64 state, attention 8 heads / 2 KV × 64)"}
    for ctx in (512, 4096):
        cache = model_cache(cfg, "dense", capacity=ctx + 256)   # the timed calls append 100 tokens
        with torch.inference_mode():
            for a in range(0, ctx, 512):
                model(torch.tensor([ids(min(512, ctx - a), a)]), cache, last_only=True)
            x = torch.randn(1, 1, cfg.d_model)
            ropes = {"full": model.rope("full", torch.tensor([ctx]), x.dtype)}
            times = {}
            for name, layer in (("recurrent", rec), ("attention", full)):
                block = model.blocks[layer]
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(20):
                        block(x, ropes, cache)
                    best = min(best, (time.perf_counter() - start) / 20)
                times[name] = round(best * 1e6, 1)
        out[f"{ctx} tokens"] = {"microseconds_per_token": times}
        print(ctx, times, flush=True)
    return out


def plan_agreement(tokenizer) -> dict:
    """Qwen3.5-9B planned; the same 32-layer pattern scaled down, planned from its folder and run."""
    spec = load_spec("qwen3.5-9b")
    settings = PlanSettings(context=8192, parallel=1, kv_type_k="dense@f32")
    plan = make_plan(spec, rules_for("kvlab"), settings)
    kinds = [layer.kind for layer in spec.layers]
    nine_b = {"layers": len(kinds), "full": kinds.count("full"), "recurrent": kinds.count("recurrent"),
              "kv_bytes_at_8192": plan.layout.kv_bytes, "recurrent_bytes": plan.layout.recurrent_bytes,
              "per_layer": [[row.kind, row.k_bytes + row.v_bytes + row.state_bytes] for row in plan.layout.layers[:4]]}
    loaded, _ = folder("qwen3_5", tokenizer, num_hidden_layers=len(kinds))
    small = load_spec(str(loaded.path))
    rows = []
    for name in ("dense", "int8", "tq-k4v4"):
        small_plan = make_plan(small, rules_for("kvlab"), PlanSettings(context=300, parallel=2, kv_type_k=f"{name}@f32"))
        cache = LayeredCache(loaded.config, name, 2, 300)
        running = {}
        for part, layers in cache.parts:
            running.update({i: part.nbytes // len(layers) for i in layers})
        state = cache.state_nbytes // len(loaded.config.layers_of("recurrent"))
        running.update({i: state for i in loaded.config.layers_of("recurrent")})
        planned = {row.index: row.k_bytes + row.v_bytes + row.state_bytes for row in small_plan.layout.layers}
        rows.append({"format": name, "layers_agree": planned == running, "planned_total": sum(planned.values()),
                     "running_nbytes": cache.nbytes})
    return {"qwen3.5-9b": nine_b, "same_pattern_scaled_down": {"kinds_match": tuple(small.layers[i].kind for i in
                                                                                  range(len(kinds))) == tuple(kinds),
                                                               "formats": rows}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="capacity,prefix,decode,layer", help="which measurements (all by default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = cached_model(None, "fp32", "cpu").tokenizer
    result = {"command": "python bench/hybrid_serving.py", "threads": 1, "dtype": "fp32",
              "machine": "2-core VM shared with other jobs while measured: times are indicative",
              "plan": plan_agreement(tokenizer)}
    print(result["plan"], flush=True)
    for name, run in (("capacity", capacity), ("prefix", prefix), ("decode", decode), ("layer", layer_cost)):
        if name in args.parts.split(","):
            result[name] = run(tokenizer, args.quick)
    if not args.quick:                  # some parts only: the others are kept from the file
        kept = json.loads(OUT.read_text()) if OUT.exists() and args.parts != parser.get_default("parts") else {}
        OUT.write_text(json.dumps(kept | result, indent=1) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
