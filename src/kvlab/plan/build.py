"""A plan from the user's inputs: the model (file, folder, catalog or repo name), the engine's rules, the card,
the weights' quant or stated size, the vision projector and the offload, solved for --ctx max / --parallel max.

`build_plan(...)` is what `kvlab plan` prints and what the planner's page draws (plan/command.py, plan/page.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError, KvlabError
from ..limits import parse_size
from .budget import Placement, make_plan
from .components import Component
from .rules import rules_for
from .gpus import custom_gpu, find_gpu
from .launch import ALL_LAYERS
from .offload import Offload, check_offload, weight_split
from .report import human
from .settings import PlanSettings
from .vision import Projector, projector, tower_from_catalog
from .weights import WeightsEstimate, check_quant, file_weights


def parse_ctx(ctx: str | int) -> int | None:
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


#: the quants tried, best first, when the weights the model defaults to leave no room (hint)
HINT_QUANTS = {"llama.cpp": ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "IQ3_XXS", "Q2_K"),
               "vllm": ("fp8", "awq"), "kvlab": ("bf16",)}


def build_plan(model: str | None = None, ctx: str | int = "4096", kv_type: str | None = None, kv_type_k: str | None = None,
               kv_type_v: str | None = None, engine: str = "llama.cpp", flash_attn: bool = True, parallel: int | str = 1,
               ubatch: int | None = None, tp: int = 1, weights_quant: str | None = None, gpu: str | None = None,
               vram: float | None = None, kv_unified: bool = False, swa_full: bool = False,
               weights_bytes: str | int | None = None, weights_file: str | None = None, mmproj: str | None = None,
               headroom: str | int | None = None, params: str | int | None = None, gpu_layers: str | int | None = None,
               cpu_moe: bool = False, n_cpu_moe: int | None = None, ram: float | None = None, strict: bool = True):
    """Everything `kvlab plan` computes, as a Plan (raises KvlabError on bad input). No model: the embedded SmolLM2.

    strict=False (comparisons): a model that fits at no context comes back unsolved (max_context 0) instead of raising."""
    from ..sources import default_model_path, find_entry, is_gguf_repo, load_spec

    embedded = model is None
    model = str(default_model_path()) if embedded else model
    if kv_type and (kv_type_k or kv_type_v):
        raise ConfigError("give either --kv-type or --kv-type-k/--kv-type-v, not both")
    if weights_bytes is not None and weights_file is not None:
        raise ConfigError("give either --weights-bytes or --weights-file, not both")
    context = parse_ctx(ctx)
    card = custom_gpu(vram) if vram is not None else find_gpu(gpu) if gpu else None
    eng = rules_for(engine)
    if weights_quant is not None:
        check_quant(weights_quant)   # an unknown name is an error listing the known ones, whatever the model
    spec = load_spec(model)   # the one read of the model: its architecture's tensor list comes with it (sources/)
    if params is not None:
        spec = replace(spec, n_params=parse_count(params, "--params"),
                       extra={**spec.extra, "n_params_source": "--params"})
    entry = None if Path(model).expanduser().exists() else find_entry(model)
    stated = _stated_weights(weights_bytes, weights_file)
    projector = _projector(mmproj, entry, eng, flash_attn)
    extras = _projector_components(projector)
    room = eng.default_headroom if headroom is None else parse_size(headroom, "--headroom") if str(headroom) != "0" else 0
    most = str(parallel).strip().lower() == "max"
    if most and context is None:
        raise ConfigError("give --ctx max or --parallel max, not both: one is solved for the other")
    settings = PlanSettings(context=context or spec.context_length or 4096, kv_type_k=kv_type or kv_type_k,
                            kv_type_v=kv_type or kv_type_v, flash_attn=flash_attn, parallel=1 if most else _parallel(parallel),
                            ubatch=ubatch, tp=tp, kv_unified=kv_unified, swa_full=swa_full)
    offload = _offload(gpu_layers, cpu_moe, n_cpu_moe, ram, eng, spec)
    placement = None
    if offload is not None:
        weights_planned = stated or eng.weights(spec, weights_quant)
        split = weight_split(spec, weights_planned)
        check_offload(offload, spec, split)
        placement = Placement(offload, split)
        if str(gpu_layers).strip().lower() == "auto":
            placement = _auto_layers(spec, eng, settings, weights_quant, card, stated, extras, room, placement, context is None)
    plan = make_plan(spec, eng, settings, weights_quant, card, weights=stated, extras=extras, headroom=room, placement=placement)
    hints = ()
    stuck = not plan.max_context if context is None else plan.fits is False or (plan.max_context or 0) < settings.context
    if card is not None and stuck and stated is None and plan.weights.known:
        hints = _quant_hints(spec, eng, settings, weights_quant, card, extras, room, context is None, plan.weights.bytes)
    if card is not None and stuck and placement is None and plan.weights.known and eng.name == "llama.cpp":
        hints += _offload_hints(spec, eng, settings, weights_quant, card, stated, extras, room, context is None)
    if context is None and card is not None and plan.weights.known and (plan.max_context or strict):
        # --ctx max: re-plan at the longest context that fits
        if not plan.max_context:
            ram = offload.ram_bytes if offload else None
            if ram is not None and plan.host_bytes > ram:
                raise ConfigError(f"{spec.name} does not fit: its host side needs {human(plan.host_bytes)}, more than the "
                                  f"{human(ram)} of --ram ({offload.describe(spec.n_layers)})")
            if hints:
                raise ConfigError(f"{spec.name} does not fit on {card.name} even at 1 token of context; {hints[0]}")
            raise ConfigError(f"{spec.name} does not fit on {card.name} even at 1 token of context")
        plan = make_plan(spec, eng, replace(settings, context=plan.max_context), weights_quant, card, weights=stated,
                         extras=extras, headroom=room, placement=placement)
    if most and card is not None and plan.weights.known and (plan.max_sequences or strict):
        # --parallel max: re-plan with the most sequences that fit
        if not plan.max_sequences:
            raise ConfigError(f"{spec.name} does not fit on {card.name} even with 1 sequence of {settings.context:,} tokens"
                              + (f"; {hints[0]}" if hints else ""))
        plan = make_plan(spec, eng, replace(settings, parallel=plan.max_sequences), weights_quant, card, weights=stated,
                         extras=extras, headroom=room, placement=placement)
    elif most and (card is None or not plan.weights.known):
        raise ConfigError("--parallel max needs --gpu or --vram (and weights kvlab can size)")
    gguf_repo = model if not embedded and is_gguf_repo(model) else None
    return replace(plan, alias_of=_alias_asked(model), model_ref=None if embedded else _model_ref(model),
                   weights_quant=weights_quant, gguf_repo=gguf_repo, mmproj=projector, hints=hints)


def _offload(gpu_layers, cpu_moe: bool, n_cpu_moe: int | None, ram: float | None, eng, spec) -> Offload | None:
    """The placement the flags ask for (None: all on the GPU, as without them)."""
    if gpu_layers is None and not cpu_moe and n_cpu_moe is None and ram is None:
        return None
    if eng.name != "llama.cpp":
        raise ConfigError("--gpu-layers, --cpu-moe, --n-cpu-moe and --ram plan llama.cpp's offload; use --engine llama.cpp")
    if cpu_moe and n_cpu_moe is not None:
        raise ConfigError("give either --cpu-moe or --n-cpu-moe N, not both")
    layers = None
    text = None if gpu_layers is None else str(gpu_layers).strip().lower()
    if text not in (None, "auto", "all"):
        try:
            layers = int(text)
        except ValueError:
            raise ConfigError(f"--gpu-layers must be a number of layers, 'all' or 'auto', got {gpu_layers!r}") from None
    ram_bytes = None
    if ram is not None:
        from ..limits import check_float

        check_float(ram, "--ram (GiB)", 0.0, low_open=True)
        ram_bytes = int(ram * (1 << 30))
    moe = spec.n_layers if cpu_moe else (n_cpu_moe or 0)
    return Offload(gpu_layers=layers, cpu_moe_layers=min(moe, spec.n_layers) if moe >= 0 else moe, ram_bytes=ram_bytes)


def _auto_layers(spec, eng, settings, weights_quant, card, stated, extras, room, placement, ctx_max: bool):
    """--gpu-layers auto: the most layers on the GPU with which the asked context fits (--ctx max: 4,096 tokens)."""
    if card is None:
        raise ConfigError("--gpu-layers auto needs --gpu or --vram")
    n = spec.n_layers

    def placed(layers: int) -> Placement:
        return Placement(replace(placement.offload, gpu_layers=layers), placement.split)

    def fits(layers: int) -> bool:
        trial = make_plan(spec, eng, settings, weights_quant, card, weights=stated, extras=extras, headroom=room,
                          placement=placed(layers))
        return (trial.max_context or 0) >= (min(4096, trial.context_cap) if ctx_max else settings.context)

    lo, hi = 0, n + 1
    if fits(hi):
        return placed(ALL_LAYERS if n < ALL_LAYERS else n + 1)
    if not fits(lo):
        return placed(0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return placed(lo)


def _offload_hints(spec, eng, settings, weights_quant, card, stated, extras, room, ctx_max: bool) -> tuple[str, ...]:
    """Nothing fits on the GPU alone: what MoE experts on the host (--cpu-moe) or fewer GPU layers would give."""
    weights = stated or eng.weights(spec, weights_quant)
    split = weight_split(spec, weights)
    needed = min(4096, spec.context_length or 4096) if ctx_max else settings.context
    if any(split.experts):
        placement = Placement(Offload(cpu_moe_layers=spec.n_layers), split)
        trial = make_plan(spec, eng, settings, weights_quant, card, weights=stated, extras=extras, headroom=room,
                          placement=placement)
        if (trial.max_context or 0) >= needed:
            hint = (f"hint: with --cpu-moe (experts in host RAM: {human(trial.host_bytes)}) it fits; longest context then "
                    f"{trial.max_context:,} tokens")
            return (hint,)
    auto = _auto_layers(spec, eng, settings, weights_quant, card, stated, extras, room, Placement(Offload(), split), ctx_max)
    layers = auto.offload.gpu_layers
    if layers:
        trial = make_plan(spec, eng, settings, weights_quant, card, weights=stated, extras=extras, headroom=room, placement=auto)
        if (trial.max_context or 0) >= needed:
            hint = (f"hint: with --gpu-layers {layers} ({min(layers, spec.n_layers)} of {spec.n_layers} layers on the GPU, "
                    f"{human(trial.host_bytes)} in host RAM) it fits; longest context then {trial.max_context:,} tokens")
            return (hint,)
    return ()


def _parallel(value: str | int) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"--parallel must be a number of sequences or 'max', got {value!r}") from None


def parse_count(value: str | int, option: str) -> int:
    """9B, 8.03e9, 135M, 7_000_000 -> a positive integer."""
    text = str(value).strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}.get(text[-1:], 1)
    try:
        number = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ConfigError(f"{option} must be a count like 9B, 135M or 8.03e9, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"{option} must be positive, got {value!r}")
    return number


def _stated_weights(weights_bytes, weights_file) -> WeightsEstimate | None:
    if weights_bytes is not None:
        return WeightsEstimate(parse_size(weights_bytes, "--weights-bytes"), f"--weights-bytes {weights_bytes}", True)
    if weights_file is None:
        return None
    path = Path(weights_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"--weights-file {weights_file}: no such file")
    return WeightsEstimate(file_weights(path), f"tensor table of {path.name}", True)


def _projector(mmproj: str | None, entry, eng, flash_attn: bool) -> Projector | None:
    if mmproj is None:
        return None
    if eng.name != "llama.cpp":
        raise ConfigError("--mmproj is llama.cpp's vision projector file; use it with --engine llama.cpp")
    tower = tower_from_catalog(entry.vision) if entry is not None and entry.vision else None
    return projector(mmproj, tower, flash_attn)


def _projector_components(p: Projector | None) -> tuple[Component, ...]:
    if p is None:
        return ()
    return (Component("vision projector", p.formula, p.bytes, p.exact),
            Component("image buffer", p.buffer.formula, p.buffer.bytes, exact=p.buffer.exact))


def _quant_hints(spec, eng, settings, weights_quant, card, extras, room, ctx_max: bool, weights: int) -> tuple[str, ...]:
    """When the weights leave no room: the best quant that fits the asked settings (with --ctx max: that leaves
    room for at least 4,096 tokens)."""
    for quant in HINT_QUANTS.get(eng.name, ()):
        try:
            trial = make_plan(spec, eng, settings, quant, card, extras=extras, headroom=room)
        except KvlabError:
            continue
        if trial.weights.bytes >= weights:
            continue   # only lighter weights than the ones planned
        needed = min(4096, trial.context_cap) if ctx_max else settings.context
        if (trial.max_context or 0) >= needed:
            default = "" if weights_quant else f" ({spec.extra.get('dtype', 'bf16')} weights are the default for a config or catalog model)"
            at = "" if ctx_max else f" at {settings.context:,} tokens ({human(trial.total_bytes)} of {human(trial.budget_bytes)})"
            hint = f"hint: with --weights-quant {quant.lower()} it fits{at}{default}; longest context then {trial.max_context:,} tokens"
            return (hint,)
    return ()


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
