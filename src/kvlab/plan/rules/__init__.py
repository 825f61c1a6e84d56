"""The engines' rules the planner knows (how llama.cpp, vLLM and kvlab allocate), by engine name."""

from __future__ import annotations

from ...errors import ConfigError
from .base import RuleSet
from .kvlab import KvlabRules
from .llama_cpp import LlamaCppRules
from .vllm import VllmRules

RULES: dict[str, type[RuleSet]] = {"llama.cpp": LlamaCppRules, "vllm": VllmRules, "kvlab": KvlabRules}
_ALIASES = {"llama-cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "vLLM": "vllm"}


def rules_for(name: str) -> RuleSet:
    key = _ALIASES.get(name.strip(), name.strip().lower())
    key = _ALIASES.get(key, key)
    if key not in RULES:
        raise ConfigError(f"unknown engine {name!r}; choose one of: {', '.join(RULES)}")
    return RULES[key]()


__all__ = ["RuleSet", "RULES", "rules_for", "LlamaCppRules", "VllmRules", "KvlabRules"]
