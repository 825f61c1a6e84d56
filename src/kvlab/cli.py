"""`kvlab plan | generate | info | bench | eval | lab | serve | demo`. Errors print one line and exit 2.

Command modules load when their command runs: `kvlab --help`, `kvlab --version` and `kvlab plan` import
neither torch nor numpy (plan, the pure-arithmetic planner, registers here directly; eval, lab, serve and
the bench group are placeholders in the listing until resolved).
"""

from __future__ import annotations

import json
import sys
from importlib import import_module
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from . import __version__
from .limits import MAX_REPEATS
from .model.weight_modes import WEIGHTS_HELP
from .terminal import OneLineUsageErrors, console, one_line_errors

#: commands whose module loads only when the command is resolved: name -> (one-line help, loader name)
LAZY_COMMANDS: dict[str, str] = {
    "eval": "Quality of a KV cache: perplexity, agreement with the dense cache, passkey retrieval.",
    "lab": "The textbook experiments, run for real on kvlab's engine and caches.",
    "serve": "Serve many sequences from one pool of KV blocks (OpenAI-style HTTP API).",
    "bench": "Benchmarks that print tables and write bench/results/*.json.",
}


def _load_command(name: str) -> TyperCommand | TyperGroup:
    """Import the module behind a lazy command and return its click command."""
    scratch = typer.Typer()
    if name == "bench":
        import_module(".bench.throughput", __package__).register(bench_app)
        import_module(".bench.serve", __package__).register(bench_app)
        group = typer.main.get_group(bench_app)
        group.name = "bench"
        return group
    import_module(f".{name}.command", __package__).register(scratch)
    return typer.main.get_group(scratch).commands[name]


class LazyCommands(OneLineUsageErrors):
    """The app's group: lazy commands are listed by their help line and imported when resolved."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.placeholders = {name: TyperCommand(name, help=text, short_help=text) for name, text in LAZY_COMMANDS.items()}
        for name, placeholder in self.placeholders.items():
            self.commands.setdefault(name, placeholder)

    def resolve_command(self, ctx, args):
        if args and args[0] in self.placeholders and self.commands.get(args[0]) is self.placeholders[args[0]]:
            self.commands[args[0]] = _load_command(args[0])
        return super().resolve_command(ctx, args)


def _version(value: bool) -> None:
    if value:
        print(f"kvlab {__version__}")
        raise typer.Exit()


app = typer.Typer(cls=LazyCommands, add_completion=False, no_args_is_help=True, help="Plan, run, compress and measure the KV cache of LLMs.")
bench_app = typer.Typer(no_args_is_help=True, help=LAZY_COMMANDS["bench"])


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print kvlab's version and exit."),
) -> None:
    """Plan, run, compress and measure the KV cache of LLMs."""


@app.command()
@one_line_errors
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file or Hugging Face folder (default: embedded SmolLM2)."),
    cache: str = typer.Option("dense", "--cache", help="dense | concat | none (and compressed caches)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 | bf16."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="At most the model's context minus the prompt."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", min=0),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed, 0 .. 2^64-1."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    capacity: Optional[int] = typer.Option(None, "--capacity", help="Cache capacity in tokens (default: prompt + new tokens)."),
    chunk_size: Optional[int] = typer.Option(None, "--prefill-chunk", help="Prefill the prompt in chunks of this many tokens."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N | mps (a device this machine has)."),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    backend: str = typer.Option("kvlab", "--backend", help="kvlab | transformers (any causal LM it loads from local files, with kvlab's caches inside)."),
):
    """Generate text with a real KV cache; prints token counts, prefill time, decode tokens/s and cache bytes."""
    from .session import run_generation

    result = run_generation(
        prompt, model=model, cache=cache, dtype=dtype, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, chat=chat, capacity=capacity, chunk_size=chunk_size, device=device, weights=weights,
        backend=backend, stream=None if json_out else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())),
    )
    if json_out:
        print(json.dumps(result.to_json()))
    else:
        print()
        console.print(result.summary_line(), highlight=False)


@app.command()
@one_line_errors
def info(
    model: Optional[str] = typer.Argument(None, help="GGUF file, HF folder or config.json, catalog name (default: embedded SmolLM2)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Layers, heads, KV heads, head dims and KV bytes per token with the formula written out, and each cache's cost."""
    from .session import model_info

    record, table = model_info(model)
    if json_out:
        print(json.dumps(record))
    else:
        console.print(table)


@app.command()
@one_line_errors
def demo(
    model: Optional[str] = typer.Option(None, "--model"),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", min=1),
):
    """The tour: one prompt through several caches side by side (text, tokens/s, cache bytes), then the memory plan."""
    from .demo import run_demo

    run_demo(model, max_new_tokens, console)


@bench_app.command("decode")
@one_line_errors
def bench_decode(
    model: Optional[str] = typer.Option(None, "--model"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1),
    new_tokens: int = typer.Option(256, "--new-tokens", min=2),
    dtypes: str = typer.Option("fp32,bf16", "--dtypes"),
    repeats: int = typer.Option(3, "--repeats", min=1, max=MAX_REPEATS),
    no_cache_repeats: int = typer.Option(1, "--no-cache-repeats", min=1, max=MAX_REPEATS, help="Runs of the (slow) no-cache contenders."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch intra-op threads (0: torch's default; at most 4 per core)."),
    contenders: str = typer.Option(
        "kvlab:dense,kvlab-unfused:dense,kvlab-dense-weights:dense,kvlab:concat,kvlab:none,transformers:default,transformers:none",
        "--contenders",
        help="engine:cache pairs; engines: kvlab (--weights), kvlab-unfused (kvlab without the fused decode step), "
        "kvlab-dense-weights (dequantized fp32/bf16 weights), transformers.",
    ),
    weights: str = typer.Option("auto", "--weights", help="Weights of the kvlab contenders: " + WEIGHTS_HELP),
    out: Optional[str] = typer.Option(None, "--out", help="[default: bench/results/decode.json, decode_contexts.json with --contexts]"),
    json_out: bool = typer.Option(False, "--json"),
    contexts: Optional[str] = typer.Option(
        None, "--contexts",
        help="Context lengths (512,2k,4k,8k): decode tokens/s and bandwidth of each of --caches at each, fp32, fused "
        "steps where they exist. Uses --caches, --steps, --warmup, --repeats, --threads, --weights, --out, --json.",
    ),
    caches: str = typer.Option("dense,dense-f16,int8,int4,tq4,tq3", "--caches", help="Caches of --contexts."),
    steps: int = typer.Option(16, "--steps", min=1, max=4096, help="Timed tokens per repeat (--contexts)."),
    warmup: int = typer.Option(2, "--warmup", min=0, max=4096, help="Untimed tokens before the repeats (--contexts)."),
    llama_cpp: Optional[str] = typer.Option(
        None, "--llama-cpp",
        help="A Python that imports llama_cpp (built apart, see docs/benchmarks.md): --caches may then name "
        "llama.cpp:f16, llama.cpp:q8_0, llama.cpp:q4_0 (--contexts).",
    ),
):
    """Decode tokens/s of kvlab's caches against transformers, interleaved in one run; with --contexts, of
    each cache at each context length."""
    if contexts is not None:
        from .bench.contexts import parse_contexts, run_context_bench

        run_context_bench(model, parse_contexts(contexts), caches.split(","), repeats, steps, warmup, threads, weights,
                          "bench/results/decode_contexts.json" if out is None else out, json_out, console,
                          llama_python=llama_cpp)
        return
    from .bench.decode import run_decode_bench

    run_decode_bench(model, prompt_tokens, new_tokens, dtypes.split(","), repeats, contenders.split(","),
                     "bench/results/decode.json" if out is None else out, json_out, console,
                     no_cache_repeats=min(no_cache_repeats, repeats), threads=threads, weights=weights)


from .plan.command import register as register_plan  # light: no torch, no numpy

register_plan(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover  (python -m kvlab.cli)
    main()
