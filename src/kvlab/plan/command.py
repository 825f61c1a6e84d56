"""`kvlab plan`: the CLI front of the planner.

Register it on the typer app with `register(app)`; `plan_command(...)` is the same thing as a
plain function (prints with rich, returns the exit code: 0 fits or no verdict, 1 does not fit,
2 bad input — the message is one line, `error: ...`).
"""

from __future__ import annotations

import json

from rich.console import Console

from ..errors import ConfigError, KvlabError
from ..terminal import console as default_console
from ..terminal import err_console
from .build import build_plan
from .report import plan_json, print_plan


def plan_command(model: str | None = None, ctx: str = "4096", kv_type: str | None = None, kv_type_k: str | None = None,
                 kv_type_v: str | None = None, engine: str = "llama.cpp", flash_attn: bool = True, parallel: int = 1,
                 ubatch: int | None = None, tp: int = 1, weights_quant: str | None = None, gpu: str | None = None,
                 vram: float | None = None, layers: bool = False, json_out: bool = False, plot: str | None = None,
                 kv_unified: bool = False, swa_full: bool = False, console: Console | None = None,
                 err_console: Console | None = None, kv_budget: str | None = None, **options) -> int:
    """Print the plan (rich table + verdict, or JSON); return 0 fits / 1 does not fit / 2 bad input.

    Errors go to `err_console` (default: the same console) as one line, `error: <message>`. `options`: the
    rest of build_plan's keywords (weights_bytes, weights_file, mmproj, headroom, params).
    """
    console = console or default_console
    try:
        plan = build_plan(model, ctx, kv_type, kv_type_k, kv_type_v, engine, flash_attn, parallel, ubatch, tp,
                          weights_quant, gpu, vram, kv_unified, swa_full, **options)
        if plot:
            from .plot import plot_plan  # matplotlib only when a plot is asked for

            plot_plan(plan, plot)
        admission = _engine_admission(plan, kv_budget) if kv_budget else None
    except KvlabError as exc:
        (err_console or console).print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    if json_out:
        console.print_json(json.dumps(plan_json(plan) | ({"engine_admission": admission} if admission else {})))
    else:
        if plan.alias_note:
            console.print(plan.alias_note, markup=False, highlight=False, soft_wrap=True)
        print_plan(plan, console, layers=layers)
        if admission:
            a = admission
            console.print(f"kvlab serving engine: {a['max_concurrent']} concurrent sequences of {a['context']:,} tokens in "
                          f"{a['budget_bytes']:,} B of {a['format']} blocks ({a['blocks']:,} blocks of {a['block_size']} tokens, "
                          f"{a['block_bytes']:,} B each"
                          + (f"; {a['layer_groups']} layer groups, sliding ones freed behind the window" if a["sliding_window_freed"] else "")
                          + (f"; {a['state_bytes_per_sequence']:,} B of recurrent state per batch slot" if a["state_bytes_per_sequence"] else "")
                          + ")", highlight=False)
        if plot:
            console.print(f"plot: {plot}")
    return 1 if plan.fits is False else 0


def list_command(text: str | None = None, json_out: bool = False, console: Console | None = None) -> int:
    """`kvlab plan --list [FILTER]`: the catalog (0), or nothing matching (1)."""
    from .listing import catalog_rows, catalog_table

    console = console or default_console
    rows = catalog_rows(text)
    if json_out:
        console.print_json(json.dumps(rows))
    elif rows:
        console.print(catalog_table(rows, text))
    else:
        console.print(f"no catalog model matches {text!r}; kvlab plan --list shows them all", markup=False, highlight=False)
    return 0 if rows else 1


def compare_command(models: list[str], json_out: bool = False, console: Console | None = None,
                    err_console: Console | None = None, **options) -> int:
    """Plan each model with the same options and print them ranked; 0 when any fits (or no GPU), 1 none, 2 bad input."""
    from .compare import compare_rows, compare_table, rank_by

    console = console or default_console
    plans = []
    for model in models:
        try:
            plans.append(build_plan(model, strict=False, **options))
        except KvlabError as exc:
            (err_console or globals()["err_console"]).print(f"error: {model}: {exc}", markup=False, highlight=False, soft_wrap=True)
            return 2
    if json_out:
        console.print_json(json.dumps(compare_rows(plans, rank_by(options.get("ctx"), options.get("parallel")))))
    else:
        console.print(compare_table(plans, options.get("ctx"), options.get("parallel")))
    verdicts = [plan.fits for plan in plans]
    return 0 if any(v is not False for v in verdicts) else 1


def _engine_admission(plan, kv_budget: str) -> dict:
    from .rules.kvlab import engine_admission

    if plan.engine.name != "kvlab":
        raise ConfigError("--kv-budget sizes the kvlab serving engine's block pool: use it with --engine kvlab")
    return engine_admission(plan.spec, plan.settings, kv_budget)


def register(app) -> None:
    """Add `plan` to a typer app."""
    import typer

    @app.command("plan")
    def plan(
        models: list[str] = typer.Argument(None, help="GGUF file, HF folder or config.json, catalog name, or HF repo id "
                                           "(default: the embedded SmolLM2-135M); several: compared side by side",
                                           metavar="MODEL"),
        list_catalog: bool = typer.Option(False, "--list", help="list the catalog (MODEL filters: 'qwen', 'moe' ...)"),
        web: bool = typer.Option(False, "--web", help="serve the planner as a local page on 127.0.0.1 (--port)"),
        port: int = typer.Option(8731, "--port", min=0, max=65535, help="port of the --web page (0: a free one)"),
        ctx: str = typer.Option("4096", "--ctx", help="context tokens per sequence, or 'max'"),
        kv_type: str = typer.Option(None, "--kv-type", help="KV type for K and V: f16 bf16 f32 fp8 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl, or a kvlab cache"),
        kv_type_k: str = typer.Option(None, "--kv-type-k", help="K type (with --kv-type-v)"),
        kv_type_v: str = typer.Option(None, "--kv-type-v", help="V type (with --kv-type-k)"),
        engine: str = typer.Option("llama.cpp", "--engine", help="llama.cpp | vllm | kvlab"),
        flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="flash attention (llama.cpp)"),
        parallel: str = typer.Option("1", "--parallel", help="concurrent sequences, or 'max' (the most that fit at --ctx)"),
        ubatch: int = typer.Option(None, "--ubatch", help="micro-batch (llama.cpp, default 512) / max batched tokens (vLLM, default 8192)"),
        tp: int = typer.Option(1, "--tp", help="tensor-parallel GPUs (figures per GPU)"),
        weights_quant: str = typer.Option(None, "--weights-quant", help="weights of a catalog/config model: a GGUF scheme "
                                          "(Q4_K_M, UD-Q4_K_XL, IQ4_XS, Q8_0 ...) or bf16 fp8 int4 awq ..."),
        gpu: str = typer.Option(None, "--gpu", help="GPU name, e.g. 'RTX 3060'"),
        vram: float = typer.Option(None, "--vram", help="usable VRAM in GiB (instead of --gpu)"),
        kv_unified: bool = typer.Option(False, "--kv-unified", help="llama.cpp: one KV buffer shared by all sequences"),
        swa_full: bool = typer.Option(False, "--swa-full", help="llama.cpp: full-size cache for sliding-window layers"),
        layers: bool = typer.Option(False, "--layers", help="per-layer breakdown"),
        json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
        plot: str = typer.Option(None, "--plot", help="write memory vs context to FILE.png"),
        kv_budget: str = typer.Option(None, "--kv-budget", help="kvlab engine: KV bytes (512MiB) -> concurrent sequences at --ctx"),
        weights_bytes: str = typer.Option(None, "--weights-bytes", help="the weights' real size (5.97GB, 5.56GiB, bytes), e.g. the GGUF file's"),
        weights_file: str = typer.Option(None, "--weights-file", help="the weights file (GGUF / safetensors): its tensor bytes"),
        mmproj: str = typer.Option(None, "--mmproj", help="llama.cpp vision projector: FILE, a size (0.92GB), or 'auto' (the catalog's tower)"),
        headroom: str = typer.Option(None, "--headroom", help="kept free by --ctx max / --parallel max (default: llama.cpp 1GiB like its --fit, vLLM 0)"),
        params: str = typer.Option(None, "--params", help="parameter count (9B, 135M) where kvlab cannot count the architecture"),
        gpu_layers: str = typer.Option(None, "--gpu-layers", help="llama.cpp -ngl: layers on the GPU, 'all', or 'auto' (the most that fit)"),
        cpu_moe: bool = typer.Option(False, "--cpu-moe", help="llama.cpp: every MoE expert in host RAM"),
        n_cpu_moe: int = typer.Option(None, "--n-cpu-moe", help="llama.cpp: the experts of the first N layers in host RAM"),
        ram: float = typer.Option(None, "--ram", help="host RAM in GiB for what is offloaded (checked with --gpu-layers / --cpu-moe)"),
    ) -> None:
        """How much memory a model needs: weights, KV cache, recurrent state, overheads; does it fit?"""
        if list_catalog:
            raise typer.Exit(list_command(models[0] if models else None, json_out))
        if web:
            from .page import serve_page

            serve_page(port, default_console)
            raise typer.Exit(0)
        if models and len(models) > 1:
            raise typer.Exit(compare_command(models, json_out=json_out, ctx=ctx, kv_type=kv_type, kv_type_k=kv_type_k,
                                             kv_type_v=kv_type_v, engine=engine, flash_attn=flash_attn, parallel=parallel,
                                             ubatch=ubatch, tp=tp, weights_quant=weights_quant, gpu=gpu, vram=vram,
                                             kv_unified=kv_unified, swa_full=swa_full, headroom=headroom,
                                             gpu_layers=gpu_layers, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, ram=ram))
        model = models[0] if models else None
        code = plan_command(model, ctx, kv_type, kv_type_k, kv_type_v, engine, flash_attn, parallel, ubatch, tp,
                            weights_quant, gpu, vram, layers, json_out, plot, kv_unified, swa_full,
                            err_console=err_console, kv_budget=kv_budget, weights_bytes=weights_bytes,
                            weights_file=weights_file, mmproj=mmproj, headroom=headroom, params=params,
                            gpu_layers=gpu_layers, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, ram=ram)
        raise typer.Exit(code)
