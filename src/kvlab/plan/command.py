"""`kvlab plan`: the CLI front of the planner.

Register it on the typer app with `register(app)`; `plan_command(...)` is the same thing as a
plain function (prints with rich, returns the exit code: 0 fits or no verdict, 1 does not fit,
2 bad input — the message is one line, `error: ...`).
"""

from __future__ import annotations

import json
from dataclasses import replace

from rich.console import Console

from ..errors import ConfigError, KvlabError
from ..terminal import console as default_console
from ..terminal import err_console
from .budget import make_plan
from .engines import get_engine
from .gpus import custom_gpu, find_gpu
from .report import plan_json, print_plan
from .settings import PlanSettings


def _parse_ctx(ctx: str | int) -> int | None:
    """An integer >= 1, or None for 'max'."""
    text = str(ctx).strip().lower().replace("_", "").replace(",", "")
    if text == "max":
        return None
    multiplier = 1
    if text.endswith("k"):
        text, multiplier = text[:-1], 1024
    try:
        value = int(text) * multiplier
    except ValueError:
        raise ConfigError(f"--ctx must be a number of tokens or 'max', got {ctx!r}") from None
    if value <= 0:
        raise ConfigError(f"--ctx must be a positive number of tokens, got {ctx!r}")
    return value


def build_plan(model: str | None = None, ctx: str | int = "4096", kv_type: str | None = None, kv_type_k: str | None = None,
               kv_type_v: str | None = None, engine: str = "llama.cpp", flash_attn: bool = True, parallel: int = 1,
               ubatch: int | None = None, tp: int = 1, weights_quant: str | None = None, gpu: str | None = None,
               vram: float | None = None, kv_unified: bool = False, swa_full: bool = False):
    """Everything `kvlab plan` computes, as a Plan (raises KvlabError on bad input). No model: the embedded SmolLM2."""
    from ..sources import default_model_path, load_spec

    embedded = model is None
    model = str(default_model_path()) if embedded else model

    if kv_type and (kv_type_k or kv_type_v):
        raise ConfigError("give either --kv-type or --kv-type-k/--kv-type-v, not both")
    context = _parse_ctx(ctx)
    card = custom_gpu(vram) if vram is not None else find_gpu(gpu) if gpu else None
    spec = load_spec(model)
    eng = get_engine(engine)
    settings = PlanSettings(context=context or spec.context_length or 4096, kv_type_k=kv_type or kv_type_k,
                            kv_type_v=kv_type or kv_type_v, flash_attn=flash_attn, parallel=parallel, ubatch=ubatch,
                            tp=tp, kv_unified=kv_unified, swa_full=swa_full)
    plan = make_plan(spec, eng, settings, weights_quant, card)
    if context is None and card is not None:  # --ctx max: re-plan at the longest context that fits
        if not plan.max_context:
            raise ConfigError(f"{spec.name} does not fit on {card.name} even at 1 token of context")
        plan = make_plan(spec, eng, replace(settings, context=plan.max_context), weights_quant, card)
    return replace(plan, alias_of=_alias_asked(model), model_ref=None if embedded else _model_ref(model), weights_quant=weights_quant)


def _model_ref(model: str) -> str:
    """How a launch line names the model: the path given, or the catalog entry's Hugging Face repo."""
    from pathlib import Path

    from ..sources import find_entry

    if Path(model).expanduser().exists():
        return model
    entry = find_entry(model)
    return entry.repo if entry is not None else model


def _alias_asked(model: str) -> str | None:
    """`model` when it named a catalog entry by one of its aliases (another model planned in its place)."""
    from pathlib import Path

    from ..sources import find_entry

    if Path(model).expanduser().exists():
        return None
    entry = find_entry(model)
    if entry is None:
        return None
    key = model.strip().lower().replace("_", "-")
    own_names = {entry.name.lower().replace("_", "-"), entry.repo.lower().replace("_", "-")}
    return None if key in own_names else model


def plan_command(model: str | None = None, ctx: str = "4096", kv_type: str | None = None, kv_type_k: str | None = None,
                 kv_type_v: str | None = None, engine: str = "llama.cpp", flash_attn: bool = True, parallel: int = 1,
                 ubatch: int | None = None, tp: int = 1, weights_quant: str | None = None, gpu: str | None = None,
                 vram: float | None = None, layers: bool = False, json_out: bool = False, plot: str | None = None,
                 kv_unified: bool = False, swa_full: bool = False, console: Console | None = None,
                 err_console: Console | None = None, kv_budget: str | None = None) -> int:
    """Print the plan (rich table + verdict, or JSON); return 0 fits / 1 does not fit / 2 bad input.

    Errors go to `err_console` (default: the same console) as one line, `error: <message>`.
    """
    console = console or default_console
    try:
        plan = build_plan(model, ctx, kv_type, kv_type_k, kv_type_v, engine, flash_attn, parallel, ubatch, tp,
                          weights_quant, gpu, vram, kv_unified, swa_full)
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
                          f"{a['block_bytes']:,} B each)", highlight=False)
        if plot:
            console.print(f"plot: {plot}")
    return 1 if plan.fits is False else 0


def _engine_admission(plan, kv_budget: str) -> dict:
    from .engines.kvlab import engine_admission

    if plan.engine.name != "kvlab":
        raise ConfigError("--kv-budget sizes the kvlab serving engine's block pool: use it with --engine kvlab")
    return engine_admission(plan.spec, plan.settings, kv_budget)


def register(app) -> None:
    """Add `plan` to a typer app."""
    import typer

    @app.command("plan")
    def plan(
        model: str = typer.Argument(None, help="GGUF file, HF folder or config.json, catalog name, or HF repo id "
                                    "(default: the embedded SmolLM2-135M)"),
        ctx: str = typer.Option("4096", "--ctx", help="context tokens per sequence, or 'max'"),
        kv_type: str = typer.Option(None, "--kv-type", help="KV type for K and V: f16 bf16 f32 fp8 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl, or a kvlab cache"),
        kv_type_k: str = typer.Option(None, "--kv-type-k", help="K type (with --kv-type-v)"),
        kv_type_v: str = typer.Option(None, "--kv-type-v", help="V type (with --kv-type-k)"),
        engine: str = typer.Option("llama.cpp", "--engine", help="llama.cpp | vllm | kvlab"),
        flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="flash attention (llama.cpp)"),
        parallel: int = typer.Option(1, "--parallel", help="concurrent sequences"),
        ubatch: int = typer.Option(None, "--ubatch", help="micro-batch (llama.cpp, default 512) / max batched tokens (vLLM, default 8192)"),
        tp: int = typer.Option(1, "--tp", help="tensor-parallel GPUs (figures per GPU)"),
        weights_quant: str = typer.Option(None, "--weights-quant", help="weights format for catalog models: bf16 q8_0 q4_k_m ..."),
        gpu: str = typer.Option(None, "--gpu", help="GPU name, e.g. 'RTX 3060'"),
        vram: float = typer.Option(None, "--vram", help="usable VRAM in GiB (instead of --gpu)"),
        kv_unified: bool = typer.Option(False, "--kv-unified", help="llama.cpp: one KV buffer shared by all sequences"),
        swa_full: bool = typer.Option(False, "--swa-full", help="llama.cpp: full-size cache for sliding-window layers"),
        layers: bool = typer.Option(False, "--layers", help="per-layer breakdown"),
        json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
        plot: str = typer.Option(None, "--plot", help="write memory vs context to FILE.png"),
        kv_budget: str = typer.Option(None, "--kv-budget", help="kvlab engine: KV bytes (512MiB) -> concurrent sequences at --ctx"),
    ) -> None:
        """How much memory a model needs: weights, KV cache, recurrent state, overheads; does it fit?"""
        code = plan_command(model, ctx, kv_type, kv_type_k, kv_type_v, engine, flash_attn, parallel, ubatch, tp,
                            weights_quant, gpu, vram, layers, json_out, plot, kv_unified, swa_full,
                            err_console=err_console, kv_budget=kv_budget)
        raise typer.Exit(code)
