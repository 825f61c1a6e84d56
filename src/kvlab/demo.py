"""`make demo`: one prompt through several caches side by side, then the memory plan."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .session import run_generation

PROMPT = "Explain in two sentences why a KV cache makes text generation faster."
TOUR_CACHES = ("dense", "none", "concat", "int8", "int4", "tq4", "tq3")


def run_demo(model: str | None, max_new_tokens: int, console: Console) -> None:
    console.rule("[bold]kvlab demo[/]: the same prompt through different KV caches")
    console.print(f"[bold]prompt[/] (chat template): {PROMPT}\n")
    table = Table(title="one prompt, several caches (greedy)")
    for column, justify in (("cache", "left"), ("decode tokens/s", "right"), ("cache bytes", "right"),
                            ("bytes/token", "right"), ("same text as dense", "center"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    dense_text = None
    run_generation("warm-up", model=model, max_new_tokens=2)  # first calls pay one-off set-up costs
    for name in TOUR_CACHES:
        run = run_generation(PROMPT, model=model, cache=name, chat=True, max_new_tokens=max_new_tokens)
        result = run.result
        tokens = result.prompt_tokens + result.new_tokens
        dense_text = run.text if dense_text is None else dense_text
        per_token = f"{result.cache_bytes / tokens:,.0f}" if result.cache_bytes else "0 (recomputes)"
        table.add_row(name, f"{result.decode_tokens_per_s:.1f}", f"{result.cache_bytes:,}", per_token,
                      "yes" if run.text == dense_text else "no", run.text.strip().replace("\n", " ")[:160])
    console.print(table)
    console.print(
        "[dim]'none' recomputes every previous token at every step; the cached runs only process the new token. "
        "Dense caches are preallocated for prompt + new tokens.[/]\n"
    )
    plan_tour(model, console)


def plan_tour(model: str | None, console: Console) -> None:
    """The memory plan for the model just run, then the seed's question: Qwen3.5-9B on a 12 GB RTX 3060."""
    from .model.loader import default_model_path
    from .plan.command import plan_command

    path = str(model or default_model_path())
    console.rule("[bold]kvlab plan[/]: the model above on an RTX 3060 12 GB, llama.cpp, 8k context, f16 KV")
    plan_command(path, ctx="8192", kv_type="f16", gpu="RTX 3060", console=console)
    console.rule("[bold]kvlab plan[/]: Qwen3.5-9B (only 8 of 32 layers keep KV) at 32k context, q8_0 KV, Q4_K_M weights")
    plan_command("qwen3.5-9b", ctx="32768", kv_type="q8_0", weights_quant="q4_k_m", gpu="RTX 3060", console=console)
