"""The names a model's state lives under: parameters (with their tied aliases) and persistent
buffers, over the whole model, for checks that must agree on every rank (a checkpoint load).

A pipeline stage holds only its own layers, so what the *model* has is computed at plan time,
when the whole model is known (``PipelinePlan.state_names``; a sharded module's
``model_state_names``); every rank then checks against the same list without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

__all__ = ["StateName", "persistent_buffers", "model_state_names"]


@dataclass(frozen=True)
class StateName:
    """One tensor of a model's state.

    Attributes:
        names: every name it has; for a parameter the canonical name first (a checkpoint stores
            it under that one), then its tied aliases (``("wte.weight", "lm_head.weight")``).
        shape: the global shape.
        kind: ``"parameter"`` or ``"buffer"`` (persistent buffers only).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    kind: str


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: buffer}`` for the buffers of ``module`` that its ``state_dict`` holds."""
    out = {}
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            out[name] = buf
    return out


def model_state_names(params: Iterable, modules: Iterable[nn.Module], held: set[str] | None = None) -> tuple[StateName, ...]:
    """The parameters of ``params`` (:class:`~shardlib.plan_items.ParamPlan`) and the persistent
    buffers of ``modules``, each once, parameters first.

    Args:
        params: the plan's parameters (names, aliases, global shapes).
        modules: the modules whose buffers count (every pipeline stage's).
        held: if given, only parameters with one of their names in it (held by some stage).
    """
    out = [StateName((pp.name,) + pp.aliases, tuple(pp.global_shape), "parameter") for pp in params
           if held is None or held.intersection((pp.name,) + pp.aliases)]
    buffers: dict[str, tuple[int, ...]] = {}
    for module in modules:
        for name, buf in persistent_buffers(module).items():
            buffers.setdefault(name, tuple(buf.shape))
    return tuple(out) + tuple(StateName((name,), shape, "buffer") for name, shape in buffers.items())
