"""kvlab plan: exact KV-cache and memory planning for llama.cpp, vLLM and kvlab's own caches."""

from .budget import Plan, make_plan
from .engines import get_engine
from .gpus import find_gpu
from .kv_types import KV_TYPES, kv_type
from .settings import PlanSettings

__all__ = ["Plan", "make_plan", "get_engine", "find_gpu", "KV_TYPES", "kv_type", "PlanSettings"]
