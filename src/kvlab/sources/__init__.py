"""Where model facts come from: GGUF headers, HF config.json (+ safetensors headers), the Hub, the catalog.

`load_spec(model)` accepts any of them and returns a ModelSpec; it never reads tensor data.
The GGUF reader (numpy, the gguf package) loads only when a GGUF is read: a catalog name or a config.json
plans without it.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ModelFileError
from ..spec import ModelSpec
from .bundled import (
    catalog,
    catalog_entry,
    default_model_path,
    find_entry,
    is_gguf_repo,
    suggestions,
)
from .hf_folder import spec_from_config, spec_from_folder, spec_from_hub

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_spec(model: str) -> ModelSpec:
    """A GGUF file, a HF folder or config.json, a catalog name, or a Hub repo id (tried in that order)."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ModelFileError(f"{path}: folder has no config.json")
            return spec_from_folder(path)
        if path.suffix.lower() == ".json":
            return spec_from_folder(path)
        from .gguf import open_gguf, spec_from_gguf

        return spec_from_gguf(open_gguf(path))  # any other file must be GGUF; open_gguf says if not
    entry = find_entry(model)
    if entry is not None:
        return entry.spec()
    if path.suffix.lower() in (".gguf", ".json", ".safetensors"):
        raise ModelFileError(f"{model}: no such file")
    if _REPO_ID.match(model):
        return spec_from_hub(model)
    close = suggestions(model)
    hint = f"; did you mean {' or '.join(close)}? (kvlab plan --list shows the catalog)" if close else \
        " (kvlab plan --list shows the catalog)"
    raise ModelFileError(f"{model!r} is not a file, a folder, a catalog name or a Hugging Face repo id{hint}")


_GGUF_NAMES = ("GGUFFile", "gguf_metadata", "open_gguf", "spec_from_gguf")


def __getattr__(name: str):
    """The GGUF reader's names, imported on first use (`from kvlab.sources import open_gguf`)."""
    if name in _GGUF_NAMES:
        from . import gguf

        return getattr(gguf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["load_spec", "open_gguf", "gguf_metadata", "GGUFFile", "spec_from_gguf", "spec_from_config",
           "spec_from_folder", "spec_from_hub", "catalog", "catalog_entry", "default_model_path", "find_entry", "is_gguf_repo", "suggestions"]
