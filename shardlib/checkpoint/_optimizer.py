"""The optimizer's side of a checkpoint: which torch optimizer a ``ZeroOptimizer`` wraps, the
tensor it updates for each chunk, and which of its state keys are per element (``exp_avg``,
saved as boxes of the parameter) or scalar (``step``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._files import CheckpointError
from ..shard import ShardedModule

__all__ = ["inner_optimizer", "optimizer_kind", "optimizer_params", "per_element", "element_states", "element_keys"]


def inner_optimizer(optimizer):
    if optimizer is None:
        return None
    from ..optim import ZeroOptimizer

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"checkpoint: optimizer must be the shardlib.ZeroOptimizer of the module, got {type(optimizer).__name__}")
    return optimizer.optimizer


def optimizer_kind(inner) -> str:
    """The torch optimizer class ``inner`` is or derives from (``FusedAdamW`` saves as
    ``torch.optim.AdamW``: same state and hyperparameters), as ``module.Name``."""
    cls = next((c for c in type(inner).__mro__ if c.__module__.startswith("torch.optim") and c is not torch.optim.Optimizer),
               type(inner))
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_params(smodel: ShardedModule, inner) -> dict[int, torch.Tensor]:
    """``{chunk index: the tensor the optimizer updates for it}``: the chunk's flat shard, or its
    host copy under optimizer offload (``ZeroOptimizer`` builds its groups in chunk order)."""
    trainable = [c for c in smodel._zero.chunks if c.trainable]
    params = [p for group in inner.param_groups for p in group["params"]]
    if len(params) != len(trainable) or any(p.shape != c.opt_param.shape for p, c in zip(params, trainable)):
        raise CheckpointError(
            f"checkpoint: the optimizer's {len(params)} parameters do not match the {len(trainable)} trainable chunks "
            "of the module; pass the shardlib.ZeroOptimizer built for this module")
    return {c.index: p for c, p in zip(trainable, params)}


def per_element(state: Any, opt_param: torch.Tensor) -> bool:
    return isinstance(state, torch.Tensor) and state.dim() > 0 and state.shape == opt_param.shape


def element_states(optimizer) -> list[str]:
    """The per-element state keys of ``optimizer`` on this rank (AdamW: ``exp_avg``, ``exp_avg_sq``).

    Saved in the marker: a 0-d parameter's per-element state is 0-d in the checkpoint, like a
    scalar state (``step``), so its shape alone does not tell a load which one it is."""
    inner = inner_optimizer(optimizer)
    if inner is None:
        return []
    keys = {k for opt_param, state in inner.state.items() for k, v in state.items() if per_element(v, opt_param)}
    return sorted(keys)


def element_keys(saved: dict, info: dict) -> set[str]:
    """The optimizer state keys a load reads per element: those saved with a dimension for some
    parameter, and those the marker lists (:func:`element_states`; older checkpoints lack it).
    Any other key saved 0-d is a scalar state (``step``), one per chunk."""
    keys = {k.rsplit(".", 1)[1] for k, md in saved.items()
            if k.startswith("optim.") and isinstance(md, TensorStorageMetadata) and len(md.size) > 0}
    return keys | set(info.get("optimizer_element_states") or ())
