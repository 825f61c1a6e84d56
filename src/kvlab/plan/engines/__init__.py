"""The engines the planner knows, by name."""

from __future__ import annotations

from ...errors import ConfigError
from .base import Engine
from .kvlab import KvlabEngine
from .llama_cpp import LlamaCppEngine
from .vllm import VllmEngine

ENGINES: dict[str, type[Engine]] = {"llama.cpp": LlamaCppEngine, "vllm": VllmEngine, "kvlab": KvlabEngine}
_ALIASES = {"llama-cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "vLLM": "vllm"}


def get_engine(name: str) -> Engine:
    key = _ALIASES.get(name.strip(), name.strip().lower())
    key = _ALIASES.get(key, key)
    if key not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
    return ENGINES[key]()


__all__ = ["Engine", "ENGINES", "get_engine", "LlamaCppEngine", "VllmEngine", "KvlabEngine"]
