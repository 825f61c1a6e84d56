"""kvlab plan: exact KV-cache and memory planning for llama.cpp, vLLM and kvlab's own caches."""

from .budget import Plan, make_plan
from .rules import rules_for
from .gpus import find_gpu
from .kv_types import KV_TYPES, kv_type
from .settings import PlanSettings

__all__ = ["Plan", "make_plan", "rules_for", "find_gpu", "KV_TYPES", "kv_type", "PlanSettings"]
