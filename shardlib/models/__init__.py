"""Reference models for shardlib's examples and tests."""

from .gpt import GPT, GPTConfig, tp_specs

__all__ = ["GPT", "GPTConfig", "tp_specs"]
