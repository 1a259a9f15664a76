"""Spec presets: tensor-parallel layouts for the reference GPT and unmodified Hugging Face models.

Each preset returns a :class:`Preset`, the specs plus the plan options the model needs:
``shard(model, mesh, preset.specs, **preset.options, zero_stage=...)``. Layouts follow Megatron
(arXiv 1909.08053): attention q/k/v and the first MLP projection(s) column parallel, the output
projections row parallel, the embedding vocabulary parallel and tied (or not) to a
column-parallel LM head. The reference GPT keeps the head's logits vocabulary-parallel into its
loss (Megatron's way); a Hugging Face model's logits are gathered for the model's own loss
(``ForCausalLMLoss`` reads the whole vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..spec import P, PartitionSpec

__all__ = ["Preset", "gpt_preset", "llama_preset", "gpt2_preset", "hf_preset"]


@dataclass(frozen=True)
class Preset:
    """Specs (glob -> PartitionSpec) and the plan options a model family needs."""

    specs: dict[str, PartitionSpec]
    options: dict[str, Any] = field(default_factory=dict)


def gpt_preset(axis: str = "tp") -> Preset:
    """:class:`shardlib.models.GPT`: Megatron layout plus a vocabulary-parallel embedding and LM
    head (one tensor when tied, two when ``tie_embeddings=False``).

    Options: ``vocab_parallel_logits=True``, as Megatron keeps the logits split into its cross
    entropy: the LM head's output stays ``(B, T, V // tp)`` and ``GPT.forward`` computes the loss
    with :func:`~shardlib.parallel.cross_entropy.vocab_parallel_cross_entropy`, so no rank holds
    the full logits (a call without targets still returns them gathered). A pipeline mesh
    refuses the option (``forward_backward``'s criterion reads whole logits): pass
    ``vocab_parallel_logits=False`` there.
    """
    from .gpt import tp_specs

    # the LM head by vocabulary too: the tied tensor's other name, or an untied GPT's own head
    return Preset({**tp_specs(axis), "wte.weight": P(axis, None), "lm_head.weight": P(axis, None)},
                  {"vocab_parallel_logits": True})


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


# HF's tp plan styles (transformers.integrations.tensor_parallel) -> the Megatron role of the module.
_HF_STYLES = {"colwise": "column", "colwise_gather_output": "column", "rowwise": "row", "rowwise_split_input": "row",
              "embedding_rowwise": "vocab"}
# families without a base_model_tp_plan: the same table, relative to the base model
_HF_TABLES = {
    "opt": {"decoder.layers.*.self_attn.q_proj": "colwise", "decoder.layers.*.self_attn.k_proj": "colwise",
            "decoder.layers.*.self_attn.v_proj": "colwise", "decoder.layers.*.self_attn.out_proj": "rowwise",
            "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"},
}


def hf_preset(model: Any, axis: str = "tp") -> Preset:
    """A Megatron layout for an unmodified Hugging Face model, read from the model itself.

    The projections come from the config's ``base_model_tp_plan`` (Hugging Face's own tensor
    parallel plan: LLaMA, Mistral, Qwen2/3, Gemma/Gemma2, Mixtral, Phi, Phi-3, GPT-NeoX, ...) or,
    for families without one, a table here (OPT); GPT-2 uses :func:`gpt2_preset`. On top:

    - the input embedding is vocabulary parallel and the output embedding (the LM head) column
      parallel with its logits gathered (tied or not);
    - fused projections are declared: ``gate_up_proj`` (Phi-3) holds 2 equal blocks, ``qkv_proj``
      holds q, k and v (block sizes ``(heads, kv_heads, kv_heads) x head_dim`` under grouped-query
      attention, each split over the axis so a rank holds its query heads and their key/value
      heads);
    - entries that are not ``Linear`` modules (Mixtral's 3-D expert parameters, HF's
      ``packed_colwise``/``moe_tp_experts``) stay replicated; HF's
      ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm``/``k_norm``) is found by the
      planner itself (:func:`shardlib.parallel.tensor_rules.split_region_params`).

    Every layout is then proven on the model's own modules by ``shard(verify=True)``.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (a task model such as ``*ForCausalLM`` or
            its base model).
        axis: the tensor mesh axis.

    Returns:
        The :class:`Preset` (``shard(model, mesh, p.specs, **p.options)``).

    Raises:
        ShardingError: the model is not a Hugging Face model, or its family has no tensor
            parallel plan here nor in its config (write specs; ``verify`` checks them).
    """
    from torch import nn

    from ..errors import ShardingError

    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if cfg is None or kind is None:
        raise ShardingError(f"hf_preset: {type(model).__name__} is not a Hugging Face model (it has no config.model_type)")
    if kind == "gpt2":
        return gpt2_preset(axis)
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    table = dict(getattr(cfg, "base_model_tp_plan", None) or _HF_TABLES.get(kind, {}))
    if not table:
        raise ShardingError(
            f"hf_preset: no tensor-parallel plan for {type(model).__name__} (model_type {kind!r}): its config has no "
            "base_model_tp_plan and shardlib has no table for it. Fix: write the specs (P(axis, None) on column "
            "Linear weights, P(None, axis) on row ones); shard(verify=True) proves them exact or refuses")
    modules = dict(model.named_modules())
    specs: dict[str, PartitionSpec] = {}
    fused: dict[str, Any] = {}
    import fnmatch

    for key, style in table.items():
        role = _HF_STYLES.get(style)
        pattern = base + key
        hits = [m for path, m in modules.items() if fnmatch.fnmatchcase(path, pattern)]
        if role is None or not hits or not isinstance(hits[0], (nn.Linear, nn.Embedding)):
            continue  # 3-D expert parameters, packed styles: replicated
        specs[pattern + ".weight"] = P(None, axis) if role == "row" else P(axis, None)
        leaf = key.rpartition(".")[2]
        if leaf == "gate_up_proj":
            fused[pattern] = 2
        elif leaf == "qkv_proj" and kind == "phi3":  # [q | k | v]; under GQA the blocks differ in size
            heads = cfg.num_attention_heads
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            fused[pattern] = 3 if kv == heads else (heads * head_dim, kv * head_dim, kv * head_dim)
    names = {id(m): path for path, m in modules.items()}
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(emb, nn.Embedding) and id(emb) in names:
        specs[names[id(emb)] + ".weight"] = P(axis, None)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, nn.Linear) and id(out) in names:
        specs[names[id(out)] + ".weight"] = P(axis, None)
    return Preset(specs, {"fused": fused} if fused else {})
