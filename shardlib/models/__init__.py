"""Reference models and spec presets for shardlib's examples and tests."""

from .gpt import GPT, GPTConfig, tp_specs
from .presets import Preset, gpt2_preset, gpt_preset, hf_preset, llama_preset

__all__ = ["GPT", "GPTConfig", "tp_specs", "Preset", "gpt_preset", "llama_preset", "gpt2_preset", "hf_preset"]
