"""Spec presets: tensor-parallel layouts for the reference GPT and unmodified Hugging Face models.

Each preset returns a :class:`Preset`, the specs plus the plan options the model needs:
``shard(model, mesh, preset.specs, **preset.options, zero_stage=...)``. Layouts follow Megatron
(arXiv 1909.08053): attention q/k/v and the first MLP projection(s) column parallel, the output
projections row parallel, the embedding vocabulary parallel and tied (or not) to a
column-parallel LM head whose logits are gathered for the model's own loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..spec import P, PartitionSpec

__all__ = ["Preset", "gpt_preset", "llama_preset", "gpt2_preset"]


@dataclass(frozen=True)
class Preset:
    """Specs (glob -> PartitionSpec) and the plan options a model family needs."""

    specs: dict[str, PartitionSpec]
    options: dict[str, Any] = field(default_factory=dict)


def gpt_preset(axis: str = "tp") -> Preset:
    """:class:`shardlib.models.GPT`: Megatron layout plus a vocabulary-parallel tied embedding."""
    from .gpt import tp_specs

    return Preset({**tp_specs(axis), "wte.weight": P(axis, None)})


def llama_preset(axis: str = "tp") -> Preset:
    """Hugging Face ``LlamaForCausalLM`` (RMSNorm, SwiGLU, grouped-query attention).

    q/k/v split by heads (the key/value head count must divide by the axis size too; a bias, if
    the config has one, follows its weight), gate and up
    column parallel, down row parallel, embedding and LM head vocabulary parallel. Works because
    LLaMA reshapes attention by ``-1`` heads and repeats key/value heads by the ratio, which a
    split keeps. Sequence parallelism enters at the first decoder layer (after the causal mask and
    rotary positions are built on the whole sequence).
    """
    return Preset({
        "model.embed_tokens.weight": P(axis, None),
        "model.layers.*.self_attn.[qkv]_proj.weight": P(axis, None),
        "model.layers.*.self_attn.o_proj.weight": P(None, axis),
        "model.layers.*.mlp.gate_proj.weight": P(axis, None),
        "model.layers.*.mlp.up_proj.weight": P(axis, None),
        "model.layers.*.mlp.down_proj.weight": P(None, axis),
        "lm_head.weight": P(axis, None),
    })


def gpt2_preset(axis: str = "tp") -> Preset:
    """Hugging Face ``GPT2LMHeadModel``.

    GPT-2 stores Linear weights as ``Conv1D`` ``[in, out]``, so column parallel is ``P(None,
    axis)`` and row parallel ``P(axis, None)``. ``c_attn`` joins q, k and v in one ``[C, 3C]``
    matrix: a plain column split would hand rank 0 all of q and half of k, so the preset declares
    it ``fused`` (3 blocks, each split by heads) and the lowering sets the attention's
    ``split_size`` to the local width. Under sequence parallelism the sequence is gathered at
    ``ln_f``, before GPT-2 reshapes the hidden states by the full input length.
    """
    return Preset(
        {
            "transformer.wte.weight": P(axis, None),
            "transformer.h.*.attn.c_attn.weight": P(None, axis),
            "transformer.h.*.attn.c_proj.weight": P(axis, None),
            "transformer.h.*.mlp.c_fc.weight": P(None, axis),
            "transformer.h.*.mlp.c_proj.weight": P(axis, None),
        },
        {"fused": {"transformer.h.*.attn.c_attn": 3}, "sp_exit": "transformer.ln_f"},
    )
