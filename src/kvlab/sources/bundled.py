"""The bundled catalog: JSON configs of current models in sources/catalog/, each citing its source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import ConfigError
from ..spec import ModelSpec
from .hf import spec_from_config


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str             # the Hugging Face repo the facts come from
    source: str           # URL of its config.json
    n_params: float       # parameters as stated by the model card
    aliases: tuple[str, ...]
    note: str
    config: dict[str, Any]

    def spec(self) -> ModelSpec:
        spec = spec_from_config(self.config, name=self.name, source=self.source, n_params=int(self.n_params))
        return spec


@lru_cache(maxsize=1)
def catalog() -> dict[str, CatalogEntry]:
    """name -> entry, for every bundled JSON file."""
    entries = {}
    for item in resources.files(__package__).joinpath("catalog").iterdir():
        if item.name.endswith(".json"):
            raw = json.loads(item.read_text(encoding="utf-8"))
            entry = CatalogEntry(raw["name"], raw["repo"], raw["source"], float(raw["n_params"]),
                                 tuple(raw.get("aliases", ())), raw.get("note", ""), raw["config"])
            entries[entry.name] = entry
    return dict(sorted(entries.items()))


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def find_entry(name: str) -> CatalogEntry | None:
    """The entry called `name` (by name, alias or repo id; case-insensitive), or None."""
    key = _key(name)
    for entry in catalog().values():
        if key in {_key(entry.name), _key(entry.repo), *(_key(a) for a in entry.aliases)}:
            return entry
    return None


def catalog_entry(name: str) -> CatalogEntry:
    entry = find_entry(name)
    if entry is None:
        raise ConfigError(f"{name!r} is not in the catalog; known models: {', '.join(catalog())}")
    return entry
