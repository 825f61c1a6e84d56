"""`+alloc` / `+halloc` recipes for a model: a calibration pass on text no evaluation window contains, then the allocator.

What the pass measures, for every layer l, for its keys and for its values (a "unit"), on CALIBRATION windows
of the calibration plays (corpus.CALIBRATION_PLAYS, disjoint from the evaluation and passkey plays):
  * KL_u: the mean KL of the next-token distribution from dense's when only this unit is coded at the base
    width b (layer l's other half coded at 8 bits, every other layer dense): the harm as the model's output
    feels it, through every later layer;
  * e_u(w): the mean squared error of block l's output with the unit coded at each width w the recipe may use
    (b-N .. b+N) against the dense block's: how the unit's own error grows or shrinks by a bit.
The harm of width w is KL_u·e_u(w)/e_u(b) (small errors: the KL is quadratic in the perturbation, as the
squared error is), so one pass through the later layers per unit serves every width. Every run feeds the
window in the evaluation's chunks (prefill, then chunks: the key offsets and weights calibrate as in eval),
from the dense hidden state entering layer l, so the layers before it are not run again. The rotation seed
is 0 for every recipe: `tq-k4v4+alloc+seed1` reads the same recipe with other rotations.

`+halloc` (a width per layer and KV head) uses the same runs, no more: measuring the KL of every (layer, head,
keys|values, width) through the later layers would take L·Hkv·2·3 = 540 tail runs per window for SmolLM2. Instead
  * a_uh(w): the squared error that KV head h alone adds to block l's attention output at width w, taken where the
    heads are still apart: the attention output of its query heads (coded minus dense, the same dense queries, keys
    and values from the same dense hidden state) projected by the output matrix alone (its columns for those heads),
    captured in the width runs above;
and the harm of head h at width w is KL_u·a_uh(w)/Σ_h' a_uh'(b): the layer's measured KL at the base width shared
out by each head's share of that layer's attention-output error. Why this is sound: each head's coding only
perturbs its own query heads' outputs (independent rotations and codes per head), those perturbations add linearly
through the output matrix and, being independent, their squared errors add; the KL, quadratic in a small
perturbation, is then split in proportion to them (the same small-error argument +alloc uses across widths). It
assumes the later layers are about equally sensitive to each head's error direction (what a per-head KL would
measure and this does not).

Recipes are kept in-process and on disk as JSON (never pickled) under the user cache directory
($KVLAB_CACHE_DIR/alloc, ...), keyed by the model file's SHA-256 and the cache's name without +alloc and
+seedN (tq-k4v4+alloc+sink1, tq-k4v4+alloc2); a stored recipe that does not parse or does not fit is a one-line ConfigError naming the file.
A fractional base (tq-k3v2.95+halloc) measures what its whole base (tq-k3v3+halloc) measures, so it allocates its own
budget from that file's harms when the whole base was calibrated before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..cache import CacheGeometry, TurboQuantCache
from ..cache.allocation import allocate, centre, check_geometry, check_recipe, held_widths
from ..paths import cache_dir
from ..cache.dense import DenseCache
from ..cache import CacheSpec
from ..cache.names import compressed
from ..cache.turboquant import TurboQuantConfig
from ..cache.vector_codebook import CODEBOOK_FORMAT
from ..errors import ConfigError
from ..fileio import write_json
from .agreement import kl_divergence
from .corpus import calibration_text, windows
from .perplexity import WindowProtocol, chunk_spans

#: The calibration windows: the evaluation's prefill and chunks, shorter windows, two of them.
CALIBRATION = WindowProtocol(length=256, prefill=64, chunk=32, n_windows=2)
#: The other half of a measured layer (values when keys are measured) is coded at this width: nearly exact.
OTHER_BITS = 8
_FORMAT = 1
_MEMO: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}


@dataclass
class Harms:
    """Per unit (layer, or layer and KV head layer-major with +halloc), per width: the harm of coding that unit's
    keys (values) at that width."""

    keys: list[dict[int, float]]
    values: list[dict[int, float]]


def calibration_windows(tokenizer, protocol: WindowProtocol | None = None) -> list[torch.Tensor]:
    """(1, length) token windows of the calibration plays."""
    protocol = protocol or CALIBRATION
    ids = tokenizer.encode(calibration_text(), add_special=False)
    return [torch.tensor([w]) for w in windows(ids, protocol.n_windows, protocol.length)]


@torch.inference_mode()
def measure_harms(model, token_windows: list[torch.Tensor], config: TurboQuantConfig,
                  protocol: WindowProtocol = CALIBRATION, advance=None) -> Harms:
    """The pass described in the module docstring, summed over `token_windows` ((1, length) each); `advance()`
    is called once per (window, keys|values, layer). With +halloc the harms are per (layer, KV head), layer-major."""
    L, Hkv = model.config.n_layers, model.config.n_kv_heads
    base = {"keys": centre(config.key_bits), "values": centre(config.value_bits)}
    kl = {kind: [0.0] * L for kind in base}
    widths = {kind: held_widths(base[kind], config.alloc) for kind in base}
    err = {kind: [{w: 0.0 for w in widths[kind]} for _ in range(L)] for kind in base}               # block output
    head_err = {kind: [[{w: 0.0 for w in widths[kind]} for _ in range(Hkv)] for _ in range(L)] for kind in base}
    for tokens in token_windows:
        hidden = _dense_hidden(model, tokens)                                     # L+1 × (1, T, C)
        geometry = CacheGeometry.for_model(model.config, batch=1, capacity=tokens.shape[1])
        reference = _head(model, _run_blocks(model, hidden[0], 0, L, DenseCache(geometry), protocol), protocol)
        dense_attention = {}                                                      # layer -> (1, T, H·D)
        for kind in base:
            for layer in range(L):
                if config.alloc_heads and layer not in dense_attention:
                    dense_attention[layer] = _attention_output(model, hidden[layer], layer, DenseCache(geometry), protocol)[1]
                for width in widths[kind]:
                    cache = _unit_cache(geometry, config, layer, kind, width)
                    out, attention = _attention_output(model, hidden[layer], layer, cache, protocol)  # (1, T, C), (1, T, H·D)
                    err[kind][layer][width] += (out - hidden[layer + 1])[0, protocol.prefill:].square().sum().item()
                    if config.alloc_heads:
                        errors = _head_errors(model.blocks[layer].attn, attention - dense_attention[layer], protocol)
                        for head, e in enumerate(errors):
                            head_err[kind][layer][head][width] += e
                cache = _unit_cache(geometry, config, layer, kind, base[kind])
                logits = _head(model, _run_blocks(model, hidden[layer], layer, L, cache, protocol), protocol)
                kl[kind][layer] += kl_divergence(reference, logits).mean().item()
                if advance:
                    advance()
    harms = {}
    for kind in base:
        harms[kind] = []
        for layer in range(L):
            layer_kl = kl[kind][layer] / len(token_windows)
            if config.alloc_heads:  # the layer's KL shared out by each head's attention-output error
                at_base = sum(head[base[kind]] for head in head_err[kind][layer])
                for head in head_err[kind][layer]:
                    harms[kind].append({w: layer_kl * (e / at_base if at_base > 0 else 1.0 / Hkv) for w, e in head.items()})
            else:
                at_base = err[kind][layer][base[kind]]
                harms[kind].append({w: layer_kl * (e / at_base if at_base > 0 else 1.0) for w, e in err[kind][layer].items()})
    return Harms(harms["keys"], harms["values"])


def recipe_from(harms: Harms, config: TurboQuantConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The widths of least total harm at the budget (allocation.allocate)."""
    return allocate(harms.keys, harms.values, config.key_bits, config.value_bits)


def _unit_cache(geometry: CacheGeometry, config: TurboQuantConfig, layer: int, kind: str, width: int) -> TurboQuantCache:
    """A cache coding only `layer`, its keys (kind "keys") or values at `width`, the other half at OTHER_BITS."""
    others = tuple(l for l in range(geometry.n_layers) if l != layer)
    key_bits, value_bits = (width, OTHER_BITS) if kind == "keys" else (OTHER_BITS, width)
    unit = replace(config, key_bits=key_bits, value_bits=value_bits, alloc=0, alloc_heads=False, key_alloc=(), value_alloc=(), seed=0,
                   full=replace(config.full, first_last=False, layer_list=others))
    return TurboQuantCache(geometry, config=unit)


def _run_blocks(model, x: torch.Tensor, first: int, stop: int, cache, protocol: WindowProtocol) -> torch.Tensor:
    """Blocks first .. stop-1 over x (1, T, C), the input of block `first`, fed in the protocol's chunks -> (1, T, C)."""
    out = []
    for a, b in chunk_spans(x.shape[1], protocol.prefill, protocol.chunk):
        h = x[:, a:b]                                                             # (1, b-a, C)
        cos, sin = model.rope(a, b - a, h.dtype)
        for block in model.blocks[first:stop]:
            h = block(h, cos, sin, cache)
        out.append(h)
    return torch.cat(out, dim=1)


def _attention_output(model, x: torch.Tensor, layer: int, cache, protocol: WindowProtocol) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `layer` over x (1, T, C) in the protocol's chunks -> (its output (1, T, C), its attention output before
    the output projection, every query head side by side (1, T, H·D))."""
    captured = []
    hook = model.blocks[layer].attn.out.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        out = _run_blocks(model, x, layer, layer + 1, cache, protocol)
    finally:
        hook.remove()
    return out, torch.cat(captured, dim=1)


def _head_errors(attn, error: torch.Tensor, protocol: WindowProtocol) -> list[float]:
    """The squared error each KV head's query heads add to the block after the output projection: error (1, T, H·D),
    the attention output's error, split by KV head (its G = H/Hkv query heads), each part projected alone."""
    error = error[:, protocol.prefill:]                                           # (1, N, H·D) scored positions
    n_kv = attn.n_kv_heads
    per_head = error.reshape(*error.shape[:2], n_kv, -1)                          # (1, N, Hkv, G·D)
    out = []
    for head in range(n_kv):
        alone = torch.zeros_like(per_head)
        alone[:, :, head] = per_head[:, :, head]
        out.append(attn.out(alone.reshape(error.shape)).square().sum().item())   # (1, N, C) through W_o only
    return out


def _dense_hidden(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The hidden state entering every block and leaving the last one, one dense pass: L+1 × (1, T, C)."""
    geometry = CacheGeometry.for_model(model.config, batch=1, capacity=tokens.shape[1])
    x = model.embed(tokens)                                                       # (1, T, C)
    cos, sin = model.rope(0, tokens.shape[1], x.dtype)
    cache, hidden = DenseCache(geometry), [x]
    for block in model.blocks:
        x = block(x, cos, sin, cache)
        hidden.append(x)
    return hidden


def _head(model, x: torch.Tensor, protocol: WindowProtocol) -> torch.Tensor:
    """Logits (N, V) of the scored positions (prefill .. T-1) from the last block's output x (1, T, C)."""
    x = model.norm(x[0, protocol.prefill:])                                       # (N, C)
    return (model.lm_head(x) if model.lm_head is not None else F.linear(x, model.output_weight())).float()


# -- recipes for a model, by name ----------------------------------------------------------------------------

def resolve(name: str, loaded) -> str:
    """`name` with its recipe spelled out when it asks for one (`tq-k4v4+alloc`): from memory, from disk, or
    calibrated now for `loaded` (a LoadedModel); any other name is returned as it is."""
    spec = CacheSpec.parse(name)
    if spec.base != "tq" or not spec.alloc or spec.key_alloc:
        return name
    config = compressed(spec)[1]
    check_geometry((), config.spec.alloc_units(loaded.config.n_layers, loaded.config.n_kv_heads), loaded.config.head_dim,
                   config.spec.alloc_option)
    digest = model_digest(Path(loaded.path))
    calibrated = replace(config, seed=0).name                                     # what the recipe is for: tq-k4v4+alloc
    memo = (digest, calibrated)
    if memo not in _MEMO:
        path = recipe_path(digest, calibrated)
        units = config.spec.alloc_units(loaded.config.n_layers, loaded.config.n_kv_heads)
        recipe = load_recipe(path, digest, calibrated, config, units)
        if recipe is None:
            whole = whole_base(config).name                                       # tq-k3v2.95+halloc: tq-k3v3+halloc's pass
            harms = load_harms(recipe_path(digest, whole), digest, whole, units) if whole != calibrated else None
            if harms is None:
                token_windows = calibration_windows(loaded.tokenizer, CALIBRATION)
                with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              console=Console(stderr=True), transient=True) as progress:
                    task = progress.add_task(f"calibrating {calibrated} (windows × keys|values × layers)",
                                             total=len(token_windows) * 2 * loaded.config.n_layers)
                    harms = measure_harms(loaded.model, token_windows, config, CALIBRATION, lambda: progress.advance(task))
            recipe = recipe_from(harms, config)
            save_recipe(path, digest, calibrated, recipe, harms)
        _MEMO[memo] = recipe
    keys, values = _MEMO[memo]
    return replace(config, key_alloc=keys, value_alloc=values).name


def recipe_dir() -> Path:
    return cache_dir() / "alloc"


def recipe_path(digest: str, calibrated: str) -> Path:
    """Where the recipe of cache `calibrated` for the model with this digest is kept; a +vq recipe's name carries the
    block codebooks' format, so a recipe measured with other codes is not found (and is calibrated again)."""
    codes = f"-vq{CODEBOOK_FORMAT}" if CacheSpec.parse(calibrated).vector else ""
    return recipe_dir() / f"{digest[:16]}-{calibrated.replace('=', '_')}{codes}.json"


def whole_base(config: TurboQuantConfig) -> TurboQuantConfig:
    """The cache whose calibration pass a fractional base shares: the same options at the centre widths (the pass
    measures the centre widths and their neighbours only, so tq-k3v2.95+halloc and tq-k3v3+halloc measure the same)."""
    return replace(config, key_bits=centre(config.key_bits), value_bits=centre(config.value_bits), seed=0)


def load_harms(path: Path, digest: str, calibrated: str, n_units: int) -> Harms | None:
    """The harms a stored recipe was allocated from (None if there is no such file); ConfigError (one line) if they
    do not parse or fit."""
    if not path.is_file():
        return None
    try:
        data = _stored_record(path, digest, calibrated)
        harms = Harms(*([{int(w): float(h) for w, h in row.items()} for row in data[kind]] for kind in ("key_harm", "value_harm")))
        if len(harms.keys) != n_units or len(harms.values) != n_units:
            raise ValueError(f"harms for {len(harms.keys)} units, the model has {n_units}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"stored calibration {path} is unusable ({err}); delete it to calibrate again") from None
    return harms


def model_digest(path: Path) -> str:
    """SHA-256 of the model file (of every file, by relative name, for a model folder)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _stored_record(path: Path, digest: str, calibrated: str) -> dict:
    """A stored calibration's JSON, checked to be of this format, for this model file and this cache (ValueError,
    KeyError, TypeError or OSError otherwise: the callers name the file)."""
    data = json.loads(path.read_text())
    if data["format"] != _FORMAT or data["model_sha256"] != digest or data["cache"] != calibrated:
        raise ValueError("for another model, cache or format")
    return data


def load_recipe(path: Path, digest: str, calibrated: str, config: TurboQuantConfig,
                n_units: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The stored recipe (n_units widths each for keys and values), None if there is none; ConfigError (one line)
    if it does not parse or fit."""
    if not path.is_file():
        return None
    try:
        data = _stored_record(path, digest, calibrated)
        keys, values = tuple(int(w) for w in data["keys"]), tuple(int(w) for w in data["values"])
        check_recipe(keys, values, config.key_bits, config.value_bits, config.alloc, config.spec.alloc_option)
        if len(keys) != n_units:
            raise ValueError(f"{len(keys)} units, the model has {n_units}")
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as err:
        raise ConfigError(f"stored {config.spec.alloc_option} recipe {path} is unusable ({err}); "
                          "delete it to calibrate again") from None
    return keys, values


def save_recipe(path: Path, digest: str, calibrated: str, recipe: tuple[tuple[int, ...], tuple[int, ...]],
                harms: Harms) -> None:
    """Atomic JSON write (fileio.write_json); a read-only cache directory only costs a calibration next time."""
    record = {"format": _FORMAT, "model_sha256": digest, "cache": calibrated, "keys": list(recipe[0]),
              "values": list(recipe[1]), "protocol": str(CALIBRATION),
              "key_harm": [{str(w): h for w, h in row.items()} for row in harms.keys],
              "value_harm": [{str(w): h for w, h in row.items()} for row in harms.values]}
    try:
        write_json(path, record, indent=1)
    except OSError:
        pass
