"""kvlab: plan, run, compress and measure the KV cache of decoder-only LLMs."""

__version__ = "0.1.0"
