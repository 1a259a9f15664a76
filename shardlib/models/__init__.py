"""Reference models and spec presets for shardlib's examples and tests."""

from .gpt import GPT, GPTConfig, tp_specs
from .llama import Llama, LlamaConfig, PaLM, PaLMConfig, llama_tp_specs
from .presets import Preset, gpt2_preset, gpt_preset, hf_preset, llama_preset

__all__ = ["GPT", "GPTConfig", "tp_specs", "Llama", "LlamaConfig", "PaLM", "PaLMConfig", "llama_tp_specs", "Preset", "gpt_preset", "llama_preset", "gpt2_preset", "hf_preset"]
