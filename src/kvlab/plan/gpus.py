"""GPU catalog: total VRAM and what is usable for a model.

usable = total − reserve: a desktop card driving a display keeps ~0.5 GiB for the driver and the
compositor; a headless data-center card ~0.3 GiB for the driver and ECC bookkeeping. `--vram GiB`
replaces the whole lookup with a usable figure of your own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    vram_gib: float
    reserve_gib: float = 0.5

    @property
    def vram_bytes(self) -> int:
        return int(self.vram_gib * GiB)

    @property
    def usable_bytes(self) -> int:
        return int((self.vram_gib - self.reserve_gib) * GiB)


_CARDS = [
    ("RTX 3060", 12), ("RTX 3060 Ti", 8), ("RTX 3070", 8), ("RTX 3080", 10), ("RTX 3080 12GB", 12), ("RTX 3090", 24),
    ("RTX 4060", 8), ("RTX 4060 Ti", 8), ("RTX 4060 Ti 16GB", 16), ("RTX 4070", 12), ("RTX 4070 Ti Super", 16),
    ("RTX 4080", 16), ("RTX 4090", 24), ("RTX 5060 Ti", 16), ("RTX 5070", 12), ("RTX 5080", 16), ("RTX 5090", 32),
    ("RTX A4000", 16), ("RTX A5000", 24), ("RTX A6000", 48), ("RTX 6000 Ada", 48),
]
_DATACENTER = [
    ("T4", 15), ("L4", 22.5), ("A10", 22.5), ("L40S", 45), ("V100", 32), ("A100 40GB", 40), ("A100", 80),
    ("H100", 80), ("H200", 141), ("B200", 180), ("MI300X", 192),
]
GPUS: dict[str, GPU] = {
    **{name.lower(): GPU(name, gib) for name, gib in _CARDS},
    **{name.lower(): GPU(name, gib, reserve_gib=0.3) for name, gib in _DATACENTER},
}


def _key(name: str) -> str:
    text = name.strip().lower().replace("nvidia", "").replace("geforce", "").replace("-", " ").replace("_", " ")
    text = " ".join(text.split())
    return text.replace(" 12 gb", " 12gb").replace(" 16 gb", " 16gb").replace(" 40 gb", " 40gb")


def find_gpu(name: str) -> GPU:
    key = _key(name)
    if key in GPUS:
        return GPUS[key]
    if key.endswith(("gb", "g")) and key.rsplit(" ", 1)[0] in GPUS:  # "RTX 3060 12GB" -> RTX 3060
        return GPUS[key.rsplit(" ", 1)[0]]
    for known, gpu in GPUS.items():  # "3060" or "rtx3060"
        if key.replace(" ", "") in (known.replace(" ", ""), known.replace(" ", "").removeprefix("rtx")):
            return gpu
    raise ConfigError(f"unknown GPU {name!r}; give --vram GiB or one of: {', '.join(g.name for g in GPUS.values())}")


def custom_gpu(vram_gib: float) -> GPU:
    from ..limits import check_float

    check_float(vram_gib, "--vram (GiB)", 0.0, low_open=True)  # NaN, inf and <= 0 are not a GPU
    return GPU(f"{vram_gib:g} GiB", vram_gib, reserve_gib=0.0)
