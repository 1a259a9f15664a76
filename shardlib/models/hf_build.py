"""Hugging Face causal LMs built from a family name and a few sizes (random initialization, no
download), or loaded from a local folder: the ``hf`` builder of the training tool and
``examples/train_hf.py``.

A family is the config's ``model_type`` (:data:`FAMILIES`); the model is the family's
``transformers`` class, sized by ``hidden``, ``layers``, ``heads`` (key/value heads: heads / 2
where the family has grouped-query attention and heads is even, unless given), a vocabulary
(256 for bytes) and positions; Mixtral has 4 experts of which 2 per token.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FAMILIES", "GQA", "SWIGLU", "kv_heads", "hf_config", "hf_model", "hf_pretrained"]

# family -> (config class, causal LM class) in transformers; the family is the config's model_type
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}
GQA = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi3"}  # num_key_value_heads < heads
SWIGLU = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi3"}  # gated MLPs: 8/3 hidden; else 4


def kv_heads(family: str, heads: int) -> int:
    """Key/value heads of ``family`` with ``heads`` attention heads: heads / 2 where the family
    has grouped-query attention and ``heads`` is even, else ``heads``."""
    return heads // 2 if family in GQA and heads % 2 == 0 else heads


def hf_config(family: str, hidden: int, layers: int, heads: int, block_size: int, vocab_size: int = 256,
              n_kv_heads: int = 0, dropout: float = 0.0) -> Any:
    """The ``transformers`` config of ``family`` at these sizes, without a KV cache.

    Args:
        family: a key of :data:`FAMILIES`.
        hidden, layers, heads: width, decoder layers, attention heads (``hidden % heads == 0``).
        block_size: positions.
        vocab_size: the vocabulary (256: bytes; token ids 0 and 1 serve as bos/eos and OPT's pad).
        n_kv_heads: key/value heads (0: :func:`kv_heads`); families without grouped-query
            attention take ``heads``.
        dropout: every dropout probability of the family (GPT-2's and OPT's default 0.1 among
            them; 0 by default here, so a run is the same on every mesh and in one process).

    Raises:
        ValueError: an unknown family.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown Hugging Face family {family!r}; the families are: {', '.join(FAMILIES)}")
    head_dim = hidden // heads
    tokens = dict(vocab_size=vocab_size, use_cache=False, bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=block_size,
                                       resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **tokens)
    size = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                max_position_embeddings=block_size, **tokens)
    ffn = max(8, int(8 * hidden / 3) // 8 * 8) if family in SWIGLU else 4 * hidden
    if family == "opt":  # pad_token_id 1 (OPT's own): byte 1 does not occur in text
        return transformers.OPTConfig(ffn_dim=ffn, dropout=dropout, attention_dropout=dropout, **size)
    size.update(intermediate_size=ffn, pad_token_id=0)  # Phi-3's default pad id (32000) is outside the vocab
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(hidden_dropout=dropout, attention_dropout=dropout, **size)
    size["num_key_value_heads"] = (n_kv_heads or kv_heads(family, heads)) if family in GQA else heads
    extra = {
        "qwen3": dict(head_dim=head_dim), "gemma": dict(head_dim=head_dim),  # defaults 128 and 256, not hidden / heads
        "gemma2": dict(head_dim=head_dim, query_pre_attn_scalar=head_dim),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "phi3": dict(original_max_position_embeddings=block_size, resid_pdrop=dropout, embd_pdrop=dropout),
        "phi": dict(resid_pdrop=dropout, embd_pdrop=dropout),
    }.get(family, {})
    extra["attention_dropout"] = dropout
    return getattr(transformers, FAMILIES[family][0])(**size, **extra)


def hf_model(family: str, *args: Any, seed: int | None = None, **kwargs: Any) -> torch.nn.Module:
    """The family's causal LM, randomly initialized (seeded when ``seed`` is given), from
    :func:`hf_config` ``(family, *args, **kwargs)``."""
    import transformers

    config = hf_config(family, *args, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, FAMILIES[family][1])(config)


def hf_pretrained(path: str) -> torch.nn.Module:
    """A causal LM with its weights from the local folder ``path`` (``config.json`` and
    safetensors; no download), without a KV cache.

    Raises:
        FileNotFoundError: ``path`` holds no ``config.json``.
    """
    import os

    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model.pretrained {path!r}: no config.json there (a local folder of a saved model)")
    return transformers.AutoModelForCausalLM.from_pretrained(path, use_cache=False, local_files_only=True)
