"""A model's own per-module init function, read on the meta device: init rules and buffers.

Hugging Face models initialize through ``PreTrainedModel._init_weights(module)``, applied to
every module children first (``initialize_weights``; a sub-model uses its own). Built under
``torch.device("meta")`` they have shapes and no values, and shardlib needs two things from
that function:

- **init rules** for the parameters (:mod:`shardlib.lazy`): the function is run on every module
  under a ``TorchFunctionMode`` that records what it writes into each parameter and skips the
  write: ``normal_(mean, std)`` becomes ``("normal", std, mean)``, ``uniform_`` (also what
  ``xavier_uniform_`` and ``kaiming_uniform_`` reduce to) ``("uniform", a, b)``, ``zeros_`` /
  ``ones_`` / ``constant_`` / ``fill_`` a constant; the last whole-tensor write wins, as it does
  when HF runs it (GPT-2's scaled ``c_proj`` after the plain ``Conv1D`` one). A parameter that
  the function ends up writing with anything else (a ``mul_``, a ``copy_``; ``trunc_normal_``
  and ``orthogonal_``, which return early on meta after reading ``Tensor.is_meta``) gets no rule
  and :func:`rules_from_own_init` says why. A write to part of a
  parameter is not reproduced: HF zeroes an embedding's ``padding_idx`` row, shardlib's rule
  draws the whole tensor (that row's gradient is zero, so it keeps its drawn values).
- **buffers** computed in ``__init__`` and not saved (``persistent=False``): the rotary
  ``inv_freq`` / ``original_inv_freq`` of LLaMA, Mistral, Qwen2/3, Gemma/Gemma2, Mixtral,
  Phi-3 and GPT-NeoX, Gemma's ``embed_scale``. HF's ``_init_weights`` recomputes each of them
  from the config (the rotary class's ``rope_init_fn``, ``scalar_embed_scale``), which is
  torchtitan's ``init_weights`` / accelerate's ``init_empty_weights`` recipe: after allocation
  :func:`fill_buffers_from_own_init` runs the owning module's init with its parameter writes
  skipped (parameters are filled by the rules, shard by shard) and checks that every buffer was
  written (its version counter moved).

The values of parameters are not HF's (those come from torch's global generator; shardlib's
are counter-based and mesh-independent, :mod:`shardlib.random`), their distributions are.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import ShardingError

__all__ = ["own_init_calls", "rules_from_own_init", "fill_buffers_from_own_init"]

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "register_hook"})
_INIT_LEVEL = ("uniform_", "normal_", "constant_", "kaiming_uniform_")  # torch.nn.init functions with overrides
_IS_META = torch._C.TensorBase.is_meta.__get__  # trunc_normal_, orthogonal_, dirac_, sparse_ return early on meta
_SKIPS_META = ("an init that does nothing on meta tensors (it read Tensor.is_meta: trunc_normal_, orthogonal_, "
               "dirac_ or sparse_)")


def own_init_calls(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """``[(module, init function)]`` in the order HF's ``initialize_weights`` applies them:
    children before their parent, each with the ``_init_weights`` of the nearest enclosing
    module that has one (a sub-model its own). Empty for a model without one."""
    out: list[tuple[nn.Module, Callable]] = []

    def walk(module: nn.Module, fn: Callable | None) -> None:
        own = getattr(module, "_init_weights", None)
        fn = own if callable(own) else fn
        for child in module.children():
            walk(child, fn)
        if fn is not None:
            out.append((module, fn))

    walk(model, None)
    return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _rule_of(func: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> tuple | str:
    """The init rule a write amounts to, or a string naming the write when it is not one."""
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__module__", None) == "torch.nn.init":
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if name == "normal_":
            return ("normal", float(a["std"]), float(a["mean"]))
        if name == "uniform_":
            return ("uniform", float(a["a"]), float(a["b"]))
        if name == "constant_":
            return _constant(a["val"])
        if name == "kaiming_uniform_":
            fan = torch.nn.init._calculate_correct_fan(target, a["mode"])
            bound_ = math.sqrt(3.0) * torch.nn.init.calculate_gain(a["nonlinearity"], a["a"]) / math.sqrt(fan)
            return ("uniform", -bound_, bound_)
        return f"torch.nn.init.{name}"
    rest = list(args[1:])
    if name == "normal_":
        mean = rest[0] if rest else kwargs.get("mean", 0.0)
        std = rest[1] if len(rest) > 1 else kwargs.get("std", 1.0)
        return ("normal", float(std), float(mean))
    if name == "uniform_":
        lo = rest[0] if rest else kwargs.get("from", 0.0)
        hi = rest[1] if len(rest) > 1 else kwargs.get("to", 1.0)
        return ("uniform", float(lo), float(hi))
    if "out" in kwargs and not (args and args[0] is target):
        return f"torch.{name}(..., out=)"
    if name == "zero_":
        return ("zeros",)
    if name == "fill_":
        value = rest[0] if rest else kwargs.get("value")
        if isinstance(value, torch.Tensor):
            return "Tensor.fill_ with a tensor"
        return _constant(value)
    return f"Tensor.{name}"


def _constant(value: Any) -> tuple:
    value = float(value)
    return ("zeros",) if value == 0.0 else ("ones",) if value == 1.0 else ("constant", value)


class _Writes(TorchFunctionMode):
    """Sees every in-place write (torch.nn.init functions, ``Tensor.*_`` methods). A write into a
    storage of ``skip`` is recorded (whole tensor: its rule) and not run; one into ``mark`` runs
    and is remembered; anything else (temporaries of the init function) runs as usual."""

    def __init__(self, skip: dict[int, torch.Tensor], mark: set[int] = frozenset()):
        super().__init__()
        self.skip, self.mark = skip, mark
        self.last: dict[int, tuple | str] = {}  # storage -> rule, or what wrote it last
        self.marked: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = None
        if func == _IS_META and args and _storage_key(args[0]) in self.skip:
            self.last[_storage_key(args[0])] = _SKIPS_META  # its writes will not be seen
            return func(*args, **kwargs)
        if getattr(func, "__module__", None) == "torch.nn.init" and name in _INIT_LEVEL:
            target = kwargs.get("tensor", args[0] if args else None)
        elif (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and args
              and getattr(func, "__objclass__", None) is torch._C.TensorBase):
            target = args[0]
        elif isinstance(kwargs.get("out"), torch.Tensor):  # torch.eye(..., out=w): eye_'s way
            target = kwargs["out"]
        if isinstance(target, torch.Tensor):
            key = _storage_key(target)
            if key in self.skip:
                whole = self.skip[key]
                if target.numel() == whole.numel() and target.storage_offset() == 0 and target.shape == whole.shape:
                    self.last[key] = _rule_of(func, tuple(args), kwargs, target)
                return target  # skipped: a parameter is filled by its rule, shard by shard
            if key in self.mark:
                self.marked.add(key)
        return func(*args, **kwargs)


def _owner_name(fn: Callable) -> str:
    owner = getattr(fn, "__self__", None)
    return f"{type(owner).__name__}._init_weights" if owner is not None else getattr(fn, "__qualname__", repr(fn))


def rules_from_own_init(model: nn.Module, groups: list[list[str]]) -> tuple[dict[str, tuple], dict[str, str]]:
    """The init rules a model's own ``_init_weights`` implies (see the module doc).

    Args:
        model: the model (on meta, or on a device: nothing is written either way).
        groups: the names of each unique parameter, canonical first.

    Returns:
        ``(rules, unsupported)``: ``{canonical name: rule}`` for the parameters the function
        writes whole with a distribution shardlib reproduces, and ``{canonical name: what wrote
        it}`` for those it writes otherwise. Parameters it never writes are in neither.
    """
    calls = own_init_calls(model)
    if not calls:
        return {}, {}
    params = dict(model.named_parameters(remove_duplicate=False))
    by_storage = {_storage_key(params[g[0]]): params[g[0]] for g in groups}
    mode = _Writes(by_storage)
    fn_of: dict[int, Callable] = {}
    with torch.no_grad(), mode:
        for module, fn in calls:
            before = dict(mode.last)
            fn(module)
            for key, rule in mode.last.items():
                if before.get(key) is not rule:
                    fn_of[key] = fn
    rules: dict[str, tuple] = {}
    unsupported: dict[str, str] = {}
    for g in groups:
        key = _storage_key(params[g[0]])
        rule = mode.last.get(key)
        if isinstance(rule, tuple):
            rules[g[0]] = rule
        elif isinstance(rule, str):
            unsupported[g[0]] = f"{_owner_name(fn_of[key])} writes it with {rule}"
    return rules, unsupported


def fill_buffers_from_own_init(model: nn.Module, module: nn.Module, keys: list[str], path: str,
                               fn: Callable | None) -> None:
    """Fill ``module``'s freshly allocated buffers ``keys`` by the model's own init of ``module``
    (parameter writes skipped); every one must be written.

    Args:
        model: the root model (whose parameters' writes are skipped).
        module: the module owning the buffers (already allocated on their device).
        keys: the buffer names in ``module._buffers``.
        path: ``module``'s name in ``model``, for the error.
        fn: the init function that covers ``module`` (from :func:`own_init_calls`), or None.

    Raises:
        ShardingError: no init function covers ``module``, or it left a buffer unwritten
            (naming the buffer, its shape and the module's class).
    """
    name = f"{path}.{keys[0]}" if path else keys[0]
    if fn is None:
        raise ShardingError(
            f"buffer {name} of shape {tuple(module._buffers[keys[0]].shape)} is on the meta device and its module "
            f"{type(module).__name__} has no shardlib_init_buffers() method to fill it. Fix: define "
            "shardlib_init_buffers(self) on the module (recompute the buffer), or build the module on CPU"
        )
    bufs = {_storage_key(module._buffers[k]): k for k in keys}
    params = {_storage_key(p): p for p in model.parameters()}
    mode = _Writes(params, set(bufs))
    with torch.no_grad(), mode:
        fn(module)
    missing = [k for key, k in bufs.items() if key not in mode.marked]
    if missing:
        name = f"{path}.{missing[0]}" if path else missing[0]
        raise ShardingError(
            f"buffer {name} of shape {tuple(module._buffers[missing[0]].shape)} is on the meta device, and neither its "
            f"module {type(module).__name__} (no shardlib_init_buffers() method) nor {_owner_name(fn)} fills it. "
            "Fix: define shardlib_init_buffers(self) on the module (recompute the buffer), or build the model on CPU"
        )
