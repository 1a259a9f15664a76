"""Which function applies which kind of plan: a registry, so a plan never imports its module type.

``Plan.apply(model)`` and ``PipelinePlan.apply(model)`` call :func:`lower`, which looks the
plan's type up here; :mod:`shardlib.shard` registers the lowerings (``ShardedModule`` for a
:class:`~shardlib.plan.Plan`, the pipeline stage for a
:class:`~shardlib.pipeline_plan.PipelinePlan`) when the package is imported. The planner modules
stay below the modules they lower to.

A module is lowered once. :func:`lower` records every module of the model it is given and of the
module it returns; :func:`refuse_lowered` (called by :func:`lower`, ``shard()`` and ``plan()``)
refuses a model that is, or contains, one of them: its parameters already live in the
first lowering's ZeRO chunks and hooks, and a second set on the same tensors would corrupt both.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn

from .errors import ShardingError

__all__ = ["register_lowering", "lower", "refuse_lowered"]

_LOWERINGS: dict[type, Callable[[Any, Any], Any]] = {}
# id(module) -> (weak reference, how it was lowered: "was given to", "is the module returned by", "is part
# of the module returned by"; (the call, the class name of the model given)). By id: a module may define __eq__.
_LOWERED: dict[int, tuple[weakref.ref, str, tuple[str, str]]] = {}


def register_lowering(plan_type: type) -> Callable:
    """Decorator: ``fn(plan, model) -> module`` applies plans of ``plan_type``."""

    def register(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        _LOWERINGS[plan_type] = fn
        return fn

    return register


def lower(plan: Any, model: Any) -> Any:
    """Apply ``plan`` to ``model`` with the lowering registered for its type.

    Raises:
        ShardingError: ``model`` is, or contains, a module an earlier lowering was given or
            returned (see :func:`refuse_lowered`); on every rank, before any communication.
        TypeError: no lowering is registered for the plan's type (``shardlib.shard`` not imported).
    """
    for cls in type(plan).__mro__:
        if cls in _LOWERINGS:
            refuse_lowered(model)
            call = (_describe(plan, model), type(model).__name__)
            _record(model, "was given to", call)  # before anything moves: a lowering that fails half-way counts
            out = _LOWERINGS[cls](plan, model)
            _record(out, "is part of the module returned by", call)
            _record_root(out, call)
            return out
    raise TypeError(f"no lowering registered for {type(plan).__name__}; import shardlib (shardlib.shard registers them)")


def refuse_lowered(model: Any, caller: str = "shard") -> None:
    """Refuse to shard ``model`` if it, or a module inside it, went through a lowering before.

    Local and deterministic (no communication), so every rank that made the same calls raises.

    Args:
        model: the model about to be planned or sharded.
        caller: the function named in the message (``shard``, ``plan``).

    Raises:
        ShardingError: naming the module (its path inside ``model``), the earlier call, and what
            to do instead.
    """
    if not isinstance(model, nn.Module):
        return  # plan() names what it needs
    for path, module in model.named_modules():
        seen = _LOWERED.get(id(module))
        if seen is None or seen[0]() is not module:
            continue
        _, how, (call, first) = seen
        name = type(model).__name__
        if path:
            raise ShardingError(
                f"{caller}(): {name} contains '{path}' ({type(module).__name__}), which {how} an earlier {call}: its "
                f"parameters live in that sharded module's ZeRO chunks and hooks, so it cannot be sharded again "
                f"inside {name}. Build the whole model from fresh modules and shard it once, or use the sharded "
                "module as it is")
        fix = (f"Train, evaluate and save the sharded module that call returned, or build a fresh {first} and shard "
               "it once (to carry trained weights over to another layout: shardlib.checkpoint.save(path, smodel), "
               "then shardlib.checkpoint.load(path, new_smodel))")
        if how == "is the module returned by":
            raise ShardingError(
                f"{caller}(): the model given ({name}) is the module returned by an earlier {call}; it is sharded "
                f"already and cannot be sharded again. {fix}")
        raise ShardingError(
            f"{caller}(): {name} {how} an earlier {call}, which moved its parameters into the ZeRO chunks and hooks "
            f"of the module it returned; sharding them again would corrupt both. {fix}")


def _record(module: Any, how: str, call: tuple[str, str]) -> None:
    if not isinstance(module, nn.Module):
        return
    for m in module.modules():
        key = id(m)
        seen = _LOWERED.get(key)
        if seen is None or seen[0]() is not m:  # the first record stays ("was given to" before the others)
            _LOWERED[key] = (weakref.ref(m, lambda _, k=key: _LOWERED.pop(k, None)), how, call)


def _record_root(module: Any, call: tuple[str, str]) -> None:
    if isinstance(module, nn.Module):
        key = id(module)
        _LOWERED[key] = (weakref.ref(module, lambda _, k=key: _LOWERED.pop(k, None)), "is the module returned by", call)


def _describe(plan: Any, model: Any) -> str:
    """``shardlib.shard(Sequential, zero_stage=3, mesh dp=2)``-like text for messages."""
    inner = getattr(plan, "whole", plan)  # a PipelinePlan's whole-model plan holds the options
    mesh = ", ".join(f"{a}={n}" for a, n in getattr(inner, "mesh_shape", ()))
    stage = getattr(inner, "zero_stage", None)
    options = (f"zero_stage={stage}, " if stage is not None else "") + f"mesh {mesh}"
    return f"shardlib.shard({type(model).__name__}, {options})"
