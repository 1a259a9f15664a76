"""Pipeline layers for unmodified Hugging Face decoder-only causal language models.

:func:`hf_pipeline_layers` cuts a ``...ForCausalLM`` into the ordered layers a pipeline stage
runs (the contract of :func:`shardlib.parallel.pipeline.pipeline_layers`:
``[(name, {path: module}, fn(get, x))]``): the embedding, one layer per decoder layer, and the
head (final norm, LM head, Gemma-2's logit soft-capping). Between stages only the hidden states
``(B, T, C)`` travel; what Hugging Face's base-model ``forward`` computes once and hands every
decoder layer (transformers 5.x: ``position_ids``, the rotary ``position_embeddings =
rotary_emb(hidden_states, position_ids)`` and the causal mask from ``create_causal_mask`` /
``create_sliding_window_causal_mask``) each decoder layer's function rebuilds from its input,
with the same functions and the model's ``config`` (so the attention implementation the config
names, ``eager`` with an explicit mask or ``sdpa`` with ``is_causal``, gets what it expects).
They depend only on the input's shape, dtype and device: every microbatch, on every stage, gets
the tensors one process would.

The rotary embedding module holds buffers only (``inv_freq``); each decoder layer lists it among
its modules, so every stage that runs decoder layers registers it once, at its original path
(``model.rotary_emb``), and moves or materializes it with the rest of the stage.

Families (``config.model_type``) and what their base model does, mirrored here:

========================== ====================================================================
llama, gemma               one causal mask for every layer (Gemma's ``embed_scale`` is inside
                           its embedding module's ``forward``, so it runs with the module)
mistral, phi3              a sliding-window mask when ``config.sliding_window`` is set
qwen2, qwen3, gemma2       a mask per ``config.layer_types[i]`` (``full_attention`` or
                           ``sliding_attention``); gemma2 soft-caps the logits
                           (``final_logit_softcapping``)
gpt_neox                   ``embed_in``, ``emb_dropout``; rotary; ``final_layer_norm``
gpt2                       ``wte + wpe(positions)``, ``drop``; blocks ``h``; ``ln_f``
opt                        ``embed_tokens``, ``project_in``, learned positions (offset 2),
                           ``final_layer_norm``, ``project_out``; no LayerDrop
========================== ====================================================================

Any other model type, a model without its language-model head (a base model, a classifier),
or a configuration these layers would not reproduce is refused with a
:class:`~shardlib.errors.ShardingError` naming what is missing: never a pipeline that computes
something else than the model's own ``forward``.

Not supported here: padding masks (``attention_mask``), a KV cache, and sequence parallelism
inside the pipeline (a stage's input would be a sequence shard, and the masks and positions are
built from the input's length); ``shardlib.plan`` refuses the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ShardingError

__all__ = ["hf_pipeline_layers", "is_hf_model", "HF_PIPELINE_FAMILIES"]


@dataclass(frozen=True)
class _Family:
    """Where a family keeps its modules and what its base model's ``forward`` does."""

    base: str  # path of the base model inside the causal LM
    embed: tuple[str, ...]  # modules of the embedding (in the base model), in the order they run
    layers: str  # the ModuleList of decoder layers (in the base model)
    final: tuple[str, ...]  # modules after the last layer (in the base model), in order
    rotary: str | None  # the rotary embedding module (in the base model), or None
    masks: str  # "causal", "sliding_if_set" (config.sliding_window) or "layer_types"
    head: str = "lm_head"  # path of the LM head inside the causal LM
    kind: str = "tokens"  # how the embedding runs: "tokens", "neox", "gpt2" or "opt"
    optional: tuple[str, ...] = ()  # modules a config may leave out (attributes that are None)
    slice_layers: bool = True  # the base model runs layers[: config.num_hidden_layers]
    softcap: bool = False  # the causal LM soft-caps its logits by config.final_logit_softcapping (Gemma-2)


_LLAMA = _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "causal")
HF_PIPELINE_FAMILIES: dict[str, _Family] = {
    "llama": _LLAMA,
    "gemma": _LLAMA,
    "mistral": _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "sliding_if_set"),
    "phi3": _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "sliding_if_set"),
    "qwen2": _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "layer_types"),
    "qwen3": _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "layer_types"),
    "gemma2": _Family("model", ("embed_tokens",), "layers", ("norm",), "rotary_emb", "layer_types", softcap=True),
    "gpt_neox": _Family("gpt_neox", ("embed_in", "emb_dropout"), "layers", ("final_layer_norm",), "rotary_emb",
                        "causal", kind="neox", slice_layers=False),
    "gpt2": _Family("transformer", ("wte", "wpe", "drop"), "h", ("ln_f",), None, "causal", kind="gpt2",
                    slice_layers=False),
    "opt": _Family("model.decoder", ("embed_tokens", "embed_positions", "project_in"), "layers",
                   ("final_layer_norm", "project_out"), None, "causal", kind="opt",
                   optional=("project_in", "final_layer_norm", "project_out"), slice_layers=False),
}
"""``config.model_type`` -> where the modules are and how the base model's ``forward`` runs."""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` looks like a Hugging Face model: a ``config`` with a ``model_type``."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def hf_pipeline_layers(model: nn.Module) -> list:
    """The forward pass of a Hugging Face decoder-only causal LM as ordered pipeline layers.

    Args:
        model: an unmodified ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
            ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM``,
            ``Phi3ForCausalLM``, ``GPTNeoXForCausalLM``, ``OPTForCausalLM`` or
            ``GPT2LMHeadModel`` (transformers 5.x), on any device (meta too).

    Returns:
        ``[(name, {path: module}, fn(get, x))]``: ``"embed"`` (token ids ``(B, T)`` int64 ->
        hidden states ``(B, T, C)``), one layer per decoder layer named by its path
        (``"model.layers.3"``; ``(B, T, C)`` -> ``(B, T, C)``), and ``"head"`` (``(B, T, C)`` ->
        logits ``(B, T, V)``, soft-capped where the model does). Paths are those of
        ``model.named_modules()``, so parameter names and specs do not change.

    Raises:
        ShardingError: a model type not in :data:`HF_PIPELINE_FAMILIES`, a missing module (the
            message names it: a base model without ``lm_head``, a classifier), a layer type
            other than full or sliding attention, or OPT's LayerDrop; before any communication.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> layers = hf_pipeline_layers(transformers.LlamaForCausalLM(cfg))
        >>> [name for name, _, _ in layers]
        ['embed', 'model.layers.0', 'model.layers.1', 'head']
    """
    config = model.config
    name = type(model).__name__
    family = HF_PIPELINE_FAMILIES.get(config.model_type)
    if family is None:
        raise ShardingError(
            f"pipeline parallelism needs the forward pass as ordered layers: {name} (a Hugging Face model, model_type "
            f"{config.model_type!r}) is not an nn.Sequential and has no pipeline_layers() method, and shardlib's Hugging "
            f"Face pipeline layers cover the decoder-only causal LMs {sorted(HF_PIPELINE_FAMILIES)} only. Fix: give the "
            "model a pipeline_layers() method (see shardlib.models.GPT.pipeline_layers), or drop the pp axis"
        )
    base = _module(model, family.base, name, family, config)
    paths = {part: f"{family.base}.{part}" for part in family.embed + family.final + (family.layers,)}
    if family.rotary:
        paths[family.rotary] = f"{family.base}.{family.rotary}"
    modules = {part: _module(base, part, name, family, config, prefix=family.base) for part in paths}
    head = _module(model, family.head, name, family, config)
    decoder = modules[family.layers]
    if not isinstance(decoder, nn.ModuleList):
        raise ShardingError(f"{name}: {paths[family.layers]} is a {type(decoder).__name__}, not the ModuleList of decoder "
                            f"layers shardlib's {config.model_type!r} pipeline layers expect")
    count = min(len(decoder), config.num_hidden_layers) if family.slice_layers else len(decoder)
    if family.kind == "opt" and getattr(config, "layerdrop", 0.0) > 0:
        raise ShardingError(
            f"{name}: config.layerdrop={config.layerdrop} skips decoder layers at random in training (torch's RNG, "
            "different on every stage and mesh), which a pipeline cannot reproduce. Fix: layerdrop=0.0, or drop the pp axis"
        )
    masks = [_mask_function(family, config, i, name) for i in range(count)]

    def get_all(get: Callable, parts: tuple[str, ...]) -> list:
        return [get(paths[p]) if modules[p] is not None else None for p in parts]

    def embed(get, idx):  # (B, T) token ids -> (B, T, C)
        return _EMBED[family.kind](idx, *get_all(get, family.embed))

    def head_fn(get, x):  # (B, T, C) -> logits (B, T, V)
        for module in get_all(get, family.final):
            if module is not None:
                x = module(x)
        logits = get(family.head)(x)
        cap = config.final_logit_softcapping if family.softcap else None
        if cap is not None:  # Gemma2ForCausalLM.forward
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decoder_layer(i: int) -> Callable:
        path = f"{paths[family.layers]}.{i}"

        def run(get, x):  # (B, T, C) -> (B, T, C), as the base model's loop body
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
            kwargs: dict[str, Any] = {"position_ids": positions}
            if family.kind == "opt":  # OPT builds its mask without positions, and its positions per row
                kwargs["position_ids"] = positions.expand(x.shape[0], -1)
                kwargs["attention_mask"] = masks[i](config=config, inputs_embeds=x, attention_mask=None, cache=None)
            else:
                kwargs["attention_mask"] = masks[i](config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                                    position_ids=positions)
            if family.rotary:
                kwargs["position_embeddings"] = get(paths[family.rotary])(x, positions)  # (cos, sin), (1, T, D)
            return get(path)(x, **kwargs)

        return run

    layers = [("embed", {paths[p]: modules[p] for p in family.embed if modules[p] is not None}, embed)]
    for i in range(count):
        mods = {f"{paths[family.layers]}.{i}": decoder[i]}
        if family.rotary:
            mods[paths[family.rotary]] = modules[family.rotary]  # buffers only: every stage holds it
        layers.append((f"{paths[family.layers]}.{i}", mods, decoder_layer(i)))
    finals = {paths[p]: modules[p] for p in family.final if modules[p] is not None}
    layers.append(("head", {**finals, family.head: head}, head_fn))
    return layers


def _module(root: nn.Module, path: str, name: str, family: _Family, config: Any, prefix: str = "") -> nn.Module | None:
    """``root``'s submodule at ``path``, None where the family allows it; else a clear refusal."""
    node: Any = root
    for part in path.split("."):
        node = getattr(node, part, _MISSING)
        if node is None and path in family.optional:
            return None
        if not isinstance(node, nn.Module):
            full = f"{prefix}.{path}" if prefix else path
            needed = [f"{family.base}.{p}" for p in family.embed + (family.layers,) + family.final
                      if p not in family.optional]
            needed += [f"{family.base}.{family.rotary}"] if family.rotary else []
            raise ShardingError(
                f"pipeline parallelism needs the forward pass as ordered layers: {name} (model_type "
                f"{config.model_type!r}) has no module {full!r}; shardlib's Hugging Face pipeline layers for "
                f"{config.model_type!r} need {needed + [family.head]} (the ...ForCausalLM class, with its LM head). "
                "Fix: use the causal LM class, give the model a pipeline_layers() method, or drop the pp axis"
            )
    return node


_MISSING = object()


def _mask_function(family: _Family, config: Any, i: int, name: str) -> Callable:
    """The mask builder the base model's ``forward`` uses for decoder layer ``i``."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if family.masks == "causal":
        return create_causal_mask
    if family.masks == "sliding_if_set":  # MistralModel / Phi3Model.forward
        return create_causal_mask if getattr(config, "sliding_window", None) is None else create_sliding_window_causal_mask
    kinds = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    kind = config.layer_types[i]
    if kind not in kinds:
        raise ShardingError(
            f"{name}: decoder layer {i} has layer type {kind!r} (config.layer_types); shardlib's pipeline layers build "
            f"masks for {sorted(kinds)} only. Fix: drop the pp axis for this model"
        )
    return kinds[kind]


def _embed_tokens(idx: torch.Tensor, embed_tokens: nn.Module) -> torch.Tensor:
    return embed_tokens(idx)  # (B, T, C); Gemma's scale is inside this module's forward


def _embed_neox(idx: torch.Tensor, embed_in: nn.Module, dropout: nn.Module) -> torch.Tensor:
    return dropout(embed_in(idx))  # GPTNeoXModel.forward


def _embed_gpt2(idx: torch.Tensor, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> torch.Tensor:
    positions = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)  # (1, T)
    return drop(wte(idx) + wpe(positions))  # GPT2Model.forward: (B, T, C) + (1, T, C)


def _embed_opt(idx: torch.Tensor, embed_tokens: nn.Module, embed_positions: nn.Module, project_in) -> torch.Tensor:
    x = embed_tokens(idx)  # (B, T, word_embed_proj_dim)
    ones = torch.ones(idx.shape, device=idx.device)
    positions = (torch.cumsum(ones, dim=1) * ones - 1).long()  # OPTDecoder.forward: (B, T) = 0..T-1
    pos = embed_positions(ones, 0, position_ids=positions)  # (B, T, C), learned with an offset of 2
    if project_in is not None:
        x = project_in(x)
    return x + pos.to(x.device)


_EMBED = {"tokens": _embed_tokens, "neox": _embed_neox, "gpt2": _embed_gpt2, "opt": _embed_opt}
