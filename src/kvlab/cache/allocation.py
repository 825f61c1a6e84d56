"""Per-layer (`+alloc`) and per-(layer, KV head) (`+halloc`) bit allocation for TurboQuant: the recipe, its
checks and the allocator.

A recipe gives every layer its own key width and value width, integers within N bits of the base name's
(`+allocN`, N = 1 or 2; `+alloc` is N = 1: tq-k4v4+alloc takes 3, 4 or 5 bits, tq-k4v4+alloc2 2..6), with the
same total as the uniform cache: the widths of all layers, keys and values together, sum to
n_layers·(key bits + value bits). Keys and values have the same head dim in TurboQuant, and with a head
dim that is a multiple of 8 a vector's codes cost exactly d·b/8 bytes, so the codes of every token cost
exactly what the uniform cache's cost (a bit moved from one layer's values to another layer's keys is the
same bytes). What the recipe adds is fixed state, counted: the recipe itself (one uint8 width per layer for
keys and one for values) and the codebooks of every width a recipe may use (b-N .. b+N), whatever this
recipe uses, so the bytes do not depend on it (one codebook per width for keys and values, centroids and
boundaries only: the torch path then unpacks codes instead of looking up whole bytes, the same values).

A fractional base (`tq-k3v2.95+halloc`) spends fewer bits: the widths sum to the budget rounded down,
floor(units·(key bits + value bits)), around the nearest whole widths (3 and 3 here, each within N bits), so a
recipe can pay for something else at the same bytes (the +sink1 of `tq-k3v2.95+prerope+sink1+halloc` costs 5
unit-bits of tq-k3v3's 540 per SmolLM2 token). The codes then cost budget·d/8 bytes per token (every unit's d codes
at its width), which is the uniform cache's bytes for whole bases.

A recipe is spelled in the cache name, one digit per layer, layer 0 first:
    tq-k4v4+alloc=k4453…v3444…      (n_layers digits after k, n_layers after v)
`tq-k4v4+alloc` alone names the recipe calibrated for the model the cache is made for (quality/calibrate.py
measures it on text no evaluation window contains; the engine spells it out before building the cache).

`+halloc` (`+halloc2`) does the same per unit (layer, KV head): every KV head of every layer codes its keys and
its values at its own width, the widths of all units summing to n_layers·n_kv_heads·(key bits + value bits),
so the codes again cost the uniform cache's bytes per token (a head's codes cost d·b/8 bytes). Its recipe holds
one key and one value width per unit, layer-major (layer 0's heads first), and costs n_layers·n_kv_heads·2 bytes:
    tq-k4v4+halloc=k453354…v344…    (n_layers·n_kv_heads digits after k, as many after v)

The allocator (`allocate`) takes, per unit and for keys and values, the measured harm of each width
and finds the widths of least total harm at the uniform budget exactly (a knapsack over the bit offsets
by dynamic programming: every unit is one layer's (or one layer and head's) keys or values, every bit
costs the same bytes).
"""

from __future__ import annotations

import re

from ..errors import ConfigError

#: The spreads a name may ask for: a recipe's widths lie within that many bits of the base width (and 1..8).
SPREADS = (1, 2)
_RECIPE = re.compile(r"k([1-8]+)v([1-8]+)")
#: The two allocation options: what one recipe digit is the width of.
UNITS = {"+alloc": "layer", "+halloc": "layer and KV head"}


def centre(bits: float) -> int:
    """The whole width a recipe's widths spread around: the base itself, or the nearest one to a fractional base."""
    return int(bits + 0.5)


def budget(n_units: int, key_bits: float, value_bits: float) -> int:
    """Bits per token a recipe spends over its units (each unit's key width + value width): the uniform total,
    rounded down for a fractional base."""
    return int(n_units * (key_bits + value_bits) + 1e-9)


def held_widths(base: int, spread: int = 1) -> tuple[int, ...]:
    """The widths a recipe around `base` may use (their codebooks are held): base-spread .. base+spread within 1..8."""
    return tuple(b for b in range(base - spread, base + spread + 1) if 1 <= b <= 8)


def parse_recipe(text: str, name: str, option: str = "+alloc") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """'k4453v3544' -> ((4, 4, 5, 3), (3, 5, 4, 4)); one-line ConfigError for anything else."""
    match = _RECIPE.fullmatch(text)
    if not match or len(match.group(1)) != len(match.group(2)):
        raise ConfigError(f"bad {option} recipe {text[:40]!r} in cache {name[:60]!r}: expected k<one digit 1-8 per "
                          f"{UNITS[option]}>v<as many digits>, e.g. {option}=k4534v4453")
    return tuple(int(c) for c in match.group(1)), tuple(int(c) for c in match.group(2))


def format_recipe(keys: tuple[int, ...], values: tuple[int, ...]) -> str:
    return "k" + "".join(map(str, keys)) + "v" + "".join(map(str, values))


def check_recipe(keys: tuple[int, ...], values: tuple[int, ...], key_bits: float, value_bits: float, spread: int = 1,
                 option: str = "+alloc") -> None:
    """Widths within the spread of their base's centre and summing to the budget (one-line ConfigError)."""
    if len(keys) != len(values) or not keys:
        raise ConfigError(f"{option} recipe needs one key and one value width per {UNITS[option]}, got {len(keys)} "
                          f"and {len(values)}")
    for what, widths, base in (("key", keys, key_bits), ("value", values, value_bits)):
        allowed = held_widths(centre(base), spread)
        bad = [w for w in widths if w not in allowed]
        if bad:
            raise ConfigError(f"{option} {what} width {bad[0]} is outside {allowed[0]}..{allowed[-1]} (base {base:g} bits)")
    total = budget(len(keys), key_bits, value_bits)
    if sum(keys) + sum(values) != total:
        kind = "uniform" if total == len(keys) * (key_bits + value_bits) else "rounded-down"
        raise ConfigError(f"{option} recipe spends {sum(keys) + sum(values)} bits per token over its {len(keys)} "
                          f"units ({UNITS[option]}), not the {kind} {total}")


def check_geometry(keys: tuple[int, ...], n_units: int, head_dim: int, option: str = "+alloc") -> None:
    """The recipe fits the cache: one width per unit (layer, or layer and KV head), codes of whole bytes for every width."""
    if keys and len(keys) != n_units:
        raise ConfigError(f"{option} recipe has widths for {len(keys)} units ({UNITS[option]}), the cache has {n_units}")
    if head_dim % 8:
        raise ConfigError(f"{option} needs a head dim that is a multiple of 8 (codes of whole bytes), got {head_dim}")


def allocate(key_harm: list[dict[int, float]], value_harm: list[dict[int, float]], key_bits: float,
             value_bits: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The widths of least total harm at the budget (the uniform total, rounded down for a fractional base).

    key_harm[u][w]: the measured harm of coding unit u's keys at w bits (a unit is a layer, or a layer and KV
    head; the widths it may take: the keys of key_harm[u], which hold centre(key_bits)); value_harm likewise.
    Harms are taken as additive over units. Ties keep the centre width, then the narrower one: the result is a
    function of the harms alone.
    """
    key_centre, value_centre = centre(key_bits), centre(value_bits)
    units = [(harm, key_centre) for harm in key_harm] + [(harm, value_centre) for harm in value_harm]
    target = budget(len(key_harm), key_bits, value_bits) - len(key_harm) * (key_centre + value_centre)
    # best[s]: (total harm, widths off their centre, widths so far) over the units seen, the widths summing to centres + s
    best: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for harm, base in units:
        options = sorted(harm, key=lambda w: (w != base, w))                      # base first, then narrower
        step: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for offset in sorted(best):
            total, moved, widths = best[offset]
            for w in options:
                key = offset + w - base
                candidate = (total + float(harm[w]), moved + (w != base), widths + (w,))
                if key not in step or candidate[:2] < step[key][:2]:
                    step[key] = candidate
        best = step
    if target not in best:
        raise ConfigError(f"no widths within the measured ones spend the budget of {key_bits:g}+{value_bits:g} bits "
                          f"over {len(key_harm)} units")
    widths = best[target][2]
    n = len(key_harm)
    return widths[:n], widths[n:]
