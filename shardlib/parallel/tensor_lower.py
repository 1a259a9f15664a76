"""Apply a plan's tensor-parallel layers to a model: swap modules, share inputs, enter SP.

Lowering (after :mod:`tensor_rules` decided the roles):

1. every planned module is replaced in its parent by its parallel form, keeping the attribute
   name, so parameter names do not change; a tied tensor (embedding and LM head) becomes one
   local parameter shared by both new modules;
2. column layers that read the same input tensor (q/k/v; gate/up; fc_in) apply one ``pvary``
   to it (:class:`~shardlib.parallel.tensor.SharedInput`), so the backward does one all-reduce
   per input, as Megatron's fused QKV does (under sequence parallelism: one sequence
   all-gather per input); an attention module gathers its input along the sequence once, in a
   forward pre-hook, so its own code (HF attention reshapes by its input's shape) sees the
   whole sequence;
3. an attention module whose projections are split by heads gets its head-count attributes
   (``num_heads``, ``num_key_value_heads``, ...; the widths ``embed_dim``, ``inner_dim``,
   ``all_head_size`` ... that equal heads x head_dim; and a private copy of its ``config``
   with ``num_attention_heads``/``num_key_value_heads``) set to this rank's values, as GPT-2's
   ``split_size`` is: HF attention code that reshapes by ``self.num_heads`` then sees the local
   heads;
4. with ``sequence_parallel``: the input of ``plan.sp_entry`` (GPT-2's embedding dropout
   ``drop``, or LLaMA's first decoder layer) is split along the sequence (a pipeline stage
   after the first has no entry: it receives the sequence shard);
5. the parameters in ``plan.sp_grad_params`` (norm weights, row biases and every replicated
   parameter of the blocks under sequence parallelism; per-head norms inside split attention
   without it) get their gradient summed over the tensor axis: a hook per parameter here,
   which the ZeRO runtime then replaces by bucketed sums (:mod:`.tensor_grads`).
"""

from __future__ import annotations

from typing import Any

import copy

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh.collectives import all_gather
from ..mesh.regions import gather_from_region, scatter_to_region
from .tensor import (ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, SharedInput, VocabParallelEmbedding,
                     sum_grad_over)
from .tensor_rules import head_counts, is_attention

__all__ = ["lower_tensor_parallel", "LOCALIZED"]


def _replace_first_tensor(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return args[:i] + (fn(a),) + args[i + 1 :], kwargs
    for key in ("hidden_states", "x", "input", "inputs"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise RuntimeError("tensor parallel: found no floating-point input tensor to share among column layers")


def lower_tensor_parallel(model: nn.Module, plan: Any, mesh: Any) -> tuple[nn.Module, list]:
    """Replace the modules listed in ``plan.tp_layers``; return ``(model, hook handles)``.

    ``model`` is changed in place, except when it is itself a planned layer (``shard()`` of a
    bare ``nn.Linear`` or ``nn.Embedding``, layer path ``""``): then the returned model is its
    parallel form and the given module is left as it was.
    """
    hooks: list = []
    if not plan.tp_layers:
        return model, hooks
    sp = plan.sequence_parallel
    local_of: dict[int, nn.Parameter] = {}
    shared_input = SharedInput()
    attention: dict[str, str] = {}
    for layer in plan.tp_layers:
        parent_path, _, attr = layer.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr) if attr else model  # path "": the root module is the layer
        axis = layer.axis
        if layer.kind == "column":
            # under SP an attention parent gathers the sequence once for its projections (below);
            # after an SP exit the all-gather's backward (a reduce-scatter) sums the input gradients
            gathered = _parent_gathers(model, layer.group) if sp and layer.group else False
            new = ColumnParallelLinear.from_linear(
                old, mesh, axis, transposed=layer.transposed, gather_output=layer.output_layer and not layer.parallel_output,
                sequence_parallel=sp, fused=layer.fused, shared_input=shared_input,
                input_is_shared=bool(sp and (gathered or (layer.output_layer and plan.sp_exit))))
            if len(set(layer.fused)) == 1 and getattr(parent, "split_size", None) == layer.fused[0]:
                parent.split_size = new.hi - new.lo  # GPT-2 splits c_attn's equal blocks by this width
            if layer.group:
                attention[layer.group] = axis
        elif layer.kind == "row":
            new = RowParallelLinear.from_linear(old, mesh, axis, transposed=layer.transposed, sequence_parallel=sp)
        elif layer.kind == "vocab":
            new = VocabParallelEmbedding.from_embedding(old, mesh, axis)
        else:
            new = ParallelEmbedding.from_embedding(old, mesh, axis)
        shared = local_of.get(id(old.weight))
        if shared is not None:
            if shared.shape != new.weight.shape:
                raise ShardingError(f"tied parameter of {layer.path} gets two different local shapes")
            new.weight = shared
        else:
            local_of[id(old.weight)] = new.weight
        if attr:
            setattr(parent, attr, new)
        else:
            model = new

    for group, axis in attention.items():
        parent = model.get_submodule(group) if group else model
        _local_head_counts(parent, mesh.size(axis))
        if sp and _parent_gathers(model, group):  # its own code (HF attention reads its input's shape) sees it all
            gather = lambda t, axis=axis: all_gather(t, axis, 1, mesh=mesh)  # noqa: E731
            hooks.append(parent.register_forward_pre_hook(
                lambda m, a, k, op=gather: _replace_first_tensor(a, k, op), with_kwargs=True))

    axis = plan.tp_layers[0].axis
    if sp:
        hooks += _enter_sequence_parallel(model, plan, mesh, axis)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in plan.sp_grad_params:
        sum_grad_over(params[name], axis, mesh)
    return model, hooks


_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_key_value_heads", "num_kv_heads",
                "n_kv_heads", "num_kv")
_WIDTH_ATTRS = ("embed_dim", "inner_dim", "all_head_size", "hidden_size", "hidden_size_per_partition", "d_inner",
                "kv_dim", "q_dim")


LOCALIZED = frozenset(_COUNT_ATTRS + _WIDTH_ATTRS)  # attribute names the lowering sets to this rank's value


def _local_head_counts(parent: nn.Module, n: int) -> None:
    """Set the head counts (and widths of heads x head_dim) an attention module holds to this
    rank's share (``n`` ranks; the plan checked that heads and key/value heads divide by ``n``)."""
    head_dim, heads, kv_heads = head_counts(parent)
    if not heads or not head_dim:
        return
    local = {heads: heads // n}
    if kv_heads:
        local[kv_heads] = kv_heads // n  # a GQA ratio (num_key_value_groups) is unchanged
    widths = {heads * head_dim: heads // n * head_dim}
    if kv_heads:
        widths[kv_heads * head_dim] = kv_heads // n * head_dim
    for name in _COUNT_ATTRS:
        value = parent.__dict__.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value in local:
            setattr(parent, name, local[value])
    for name in _WIDTH_ATTRS:
        value = parent.__dict__.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value in widths:
            setattr(parent, name, widths[value])
    cfg = parent.__dict__.get("config")
    if cfg is not None and any(isinstance(getattr(cfg, k, None), int) for k in ("num_attention_heads", "num_key_value_heads")):
        cfg = copy.copy(cfg)  # the model's config is shared by every module: this attention gets its own
        for key in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value in local:
                try:
                    setattr(cfg, key, local[value])
                except Exception:  # a read-only alias (attribute_map) of another key
                    pass
        parent.config = cfg


def _parent_gathers(model: nn.Module, group: str) -> bool:
    """Under SP, whether the parent of a column/row group all-gathers its input along the
    sequence for its projections: attention modules, whose code reads the sequence length off
    its input. An MLP (or a block holding its MLP projections, OPT's decoder layer) leaves it to
    each column layer, which gathers the tensor it reads (once per tensor: SharedInput)."""
    return is_attention(model.get_submodule(group) if group else model)


def _map_first(out, fn):
    """``out`` with its first floating tensor replaced by ``fn(it)`` (a block may return a tuple)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]),) + out[1:]
    return out


def _enter_sequence_parallel(model: nn.Module, plan: Any, mesh: Any, axis: str) -> list:
    n = mesh.size(axis)

    def check(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] % n:
            raise ShardingError(
                f"sequence_parallel splits the sequence over {axis!r} (size {n}), but the sequence length is "
                f"{t.shape[1]} (activation shape {tuple(t.shape)}). Fix: use a length divisible by {n}"
            )
        return t

    hooks = []
    if plan.sp_entry is not None:  # None: a pipeline stage after the first, whose input arrives split
        entry = model.get_submodule(plan.sp_entry)
        split = lambda t: scatter_to_region(check(t), axis, 1, mesh=mesh)  # noqa: E731
        hooks.append(entry.register_forward_pre_hook(lambda m, a, k: _replace_first_tensor(a, k, split), with_kwargs=True))
    if plan.sp_exit:
        if any(layer.output_layer for layer in plan.tp_layers):
            # a column-parallel output layer reads the gathered sequence: its partial input
            # gradients are summed by the all-gather's backward (a reduce-scatter)
            gather = lambda m, a, out: _map_first(out, lambda t: all_gather(t, axis, 1, mesh=mesh))  # noqa: E731
        else:  # replicated layers after the exit: their gradients are whole, keep this rank's slice
            gather = lambda m, a, out: _map_first(out, lambda t: gather_from_region(t, axis, 1, mesh=mesh))  # noqa: E731
        hooks.append(model.get_submodule(plan.sp_exit).register_forward_hook(gather))
    return hooks
