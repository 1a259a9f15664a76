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

Its parameters stay the ones lowered: a parameter registered on one of those modules afterwards
(an adapter added, a weight replaced or tied anew) is refused where it is assigned
(:func:`_refuse_new_parameter`, :func:`_refuse_new_module`): it is in no ZeRO chunk and would
train silently wrong.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from .errors import ShardingError

__all__ = ["register_lowering", "lower", "refuse_lowered", "refuse_unlowered"]

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
            _install_guard()
            global _busy
            _busy += 1
            try:
                out = _LOWERINGS[cls](plan, model)
            finally:
                _busy -= 1
            _record(out, "is part of the module returned by", call)
            _record_root(out, call)
            for prm in out.parameters() if isinstance(out, nn.Module) else ():
                _PARAMS[id(prm)] = weakref.ref(prm, lambda _, k=id(prm): _PARAMS.pop(k, None))
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


_busy = 0  # lowerings in progress: they replace layers and parameters of the modules they were given
_PARAMS: dict[int, weakref.ref] = {}  # id -> the parameters of the modules lowerings returned
_guard_handles: list = []


def _lowered(module: Any) -> tuple | None:
    seen = _LOWERED.get(id(module))
    return seen if seen is not None and seen[0]() is module else None


def _refuse_new_parameter(module: nn.Module, name: str, param: Any) -> None:
    """Global parameter-registration hook: refuse a parameter assigned to a module of a lowered model
    after its lowering (``m.lora_A = nn.Parameter(...)``, ``m.weight = nn.Parameter(t)``, tying
    ``lm_head.weight = wte.weight`` anew). The lowering put the model's parameters into ZeRO
    chunks; a new one is in none: its gradient would never be averaged over the data axes, and
    :class:`~shardlib.ZeroOptimizer` would never update it (or a replaced one's chunk elements
    would keep training unused), with no error. Local, so every rank that does the same raises.

    Raises:
        ShardingError: naming the module class, the attribute, the shard() call, and the fix.
    """
    if torch.compiler.is_compiling():  # (see _refuse_new_module)
        return None
    seen = None if _busy else _lowered(module)
    if seen is None or (param is not None and module._parameters.get(name) is param):
        return None
    what = "replaces a parameter of" if name in module._parameters else "adds a parameter to"
    raise ShardingError(
        f"{type(module).__name__}.{name} = Parameter{tuple(param.shape)} {what} a module after {seen[2][0]}: "
        f"that call packed the model's parameters into ZeRO chunks, and a parameter registered later is in none, "
        "so its gradient would never be averaged over the data axes and ZeroOptimizer would never update it (no "
        "error, ranks drifting apart). Fix: add adapters, new heads and ties to the model before shard(), then shard "
        "it once; to change the weights of a sharded model, copy values in (smodel.load_state_dict, "
        "shardlib.checkpoint.load)")


def _refuse_new_module(module: nn.Module, name: str, submodule: Any) -> None:
    """Global module-registration hook: refuse a submodule with parameters that no lowering packed
    (a LoRA wrapper, a fresh layer, a parametrization's own parameters) assigned into a lowered
    model; one whose parameters are all lowered already (moving or wrapping a layer of the model),
    or that has none, passes and becomes part of the model (so ``ModuleDict`` items put into it
    later are checked too, as ``torch.nn.utils.parametrize`` does). Direct writes to
    ``_modules`` (``ModuleList.insert``) reach no hook and are not seen.

    Raises:
        ShardingError: naming the new module's parameters and the shard() call.
    """
    if torch.compiler.is_compiling():  # not traced: Dynamo would wrap _LOWERED, which weakref callbacks change at
        return None  # any garbage collection ("dictionary changed size during iteration", tracing LLaMA's layers[:n])
    seen = None if _busy or not isinstance(submodule, nn.Module) else _lowered(module)
    if seen is None:
        return None
    new = [f"{path + '.' if path else ''}{n}" for path, m in submodule.named_modules()
           for n, p in m._parameters.items() if p is not None and not _lowered_param(p)]
    if not new:  # part of the model from now on: what is added into it later is checked too
        _record(submodule, "is part of the module returned by", seen[2])
        return None
    raise ShardingError(
        f"{type(module).__name__}.{name} = {type(submodule).__name__}(...) adds the parameters "
        f"{', '.join(new[:4])}{', ...' if len(new) > 4 else ''} to a module after {seen[2][0]}: that call packed the "
        "model's parameters into ZeRO chunks, and these are in none, so their gradients would never be averaged "
        "over the data axes and ZeroOptimizer would never update them (no error, ranks drifting apart). Fix: add "
        "adapters (LoRA, peft.get_peft_model) and new layers to the model before shard(), then shard it once")


def _lowered_param(p: Any) -> bool:
    ref = _PARAMS.get(id(p))
    return ref is not None and ref() is p


def refuse_unlowered(module: nn.Module, where: str) -> None:
    """Refuse a trainable parameter of ``module`` (a lowered model) that no lowering returned: one
    added past torch's registration hooks (``ModuleList.insert``, a direct ``_modules`` or
    ``_parameters`` write), so in no ZeRO chunk. One pass over the parameters, no communication:
    every rank with the same model raises.

    Raises:
        ShardingError: naming ``where``, the parameter and the fix.
    """
    if not _PARAMS:
        return
    for prm in module.parameters():
        if prm.requires_grad and not _lowered_param(prm):
            name = next((n for n, p in module.named_parameters() if p is prm), "?")
            raise ShardingError(
                f"{where}: the parameter '{name}' {tuple(prm.shape)} of {type(module).__name__} was added after "
                "shard() past torch's registration hooks (ModuleList.insert, or a direct write to _modules or "
                "_parameters): it is in no ZeRO chunk, so its gradient was never averaged over the data axes and "
                "this step would not update it. Fix: add it to the model before shard(), then shard it once")


def _install_guard() -> None:
    """Install the two global registration hooks once per process (torch's
    ``register_module_parameter_registration_hook`` and ``register_module_module_registration_hook``);
    each is a dictionary lookup for a module no lowering has seen."""
    if not _guard_handles:
        from torch.nn.modules import module as torch_module

        _guard_handles.append(torch_module.register_module_parameter_registration_hook(_refuse_new_parameter))
        _guard_handles.append(torch_module.register_module_module_registration_hook(_refuse_new_module))


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
