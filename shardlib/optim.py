"""The optimizer of a sharded module, and global gradient clipping."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from . import kernels
from .mesh.collectives import raw_all_reduce
from .shard import ShardedModule

__all__ = ["ZeroOptimizer", "clip_grad_norm_"]


def clip_grad_norm_(smodel: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm, counting every unique element once.

    The norm is taken over the reduced gradients: under ZeRO stages 1-3 each rank sums its own
    shard and the sums are all-reduced over the data axes; tied parameters count once; padding
    is zero. Same value on every rank. Coefficient as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        smodel: a module from :func:`shardlib.shard` (a plain module falls back to torch's).
        max_norm: the largest norm allowed.
        norm_type: the p of the p-norm; ``float('inf')`` for the max norm.

    Returns:
        The total norm before clipping, a 0-dim float32 tensor.

    Raises:
        RuntimeError: called after a backward inside ``no_sync()`` (gradients not yet reduced).
    """
    if not isinstance(smodel, ShardedModule):
        return torch.nn.utils.clip_grad_norm_(smodel.parameters(), max_norm, norm_type)
    zero = smodel._zero
    norm_type = float(norm_type)
    tp_axes = tuple(sorted({layer.axis for layer in smodel.plan.tp_layers}))
    pp_axes = (smodel.pp_axis,) if getattr(smodel, "pp_axis", None) else ()
    duplicates = getattr(smodel, "norm_duplicates", [])
    parts = []  # (local statistic, axes to reduce it over)
    for sharded in (False, True):
        grads = zero.owned_grads(tp_sharded=sharded)
        if not grads:  # the same on every rank: chunk kinds do not depend on coordinates
            continue
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads if g.numel()] or [torch.zeros(())]).max().float()
        else:
            local = sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.zeros(()))
            for prm in duplicates:  # counted on the stage that holds the first copy
                if zero.param_chunk[id(prm)].plan.tp_sharded == sharded:
                    local = local - zero.owned_grad_region(prm).float().abs().pow(norm_type).sum()
        axes = (() if zero.grads_replicated() else tuple(zero.axes)) + (tp_axes if sharded else ()) + pp_axes
        parts.append((local.reshape(1).clone(), axes))
    op = "max" if math.isinf(norm_type) else "sum"
    for stat, axes in parts:
        if axes:
            raw_all_reduce(stat, zero.mesh, axes, op=op)
    stats = [stat for stat, _ in parts] or [torch.zeros(1)]
    if math.isinf(norm_type):
        total = torch.stack(stats).max()
    else:
        total = torch.stack(stats).sum().pow(1.0 / norm_type)
    grads = zero.owned_grads()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer of a sharded module, for every ZeRO stage (HAI-LLM's name).

    Builds ``optimizer_cls`` over the flat tensors this rank updates: whole chunks under
    stage 0, this rank's shards under stages 1-3 (ZeRO, arXiv 1910.02054), so optimizer state is
    sharded from stage 1. ``optimizer_cls`` must be elementwise (AdamW, Adam, SGD, ...): per-
    tensor optimizers (LAMB, Adafactor) would see chunks, not parameters.

    Args:
        smodel: the module returned by :func:`shardlib.shard`.
        optimizer_cls: a ``torch.optim.Optimizer`` class, e.g. ``torch.optim.AdamW``.
        max_grad_norm: if given, ``step()`` clips to this global norm first (the norm is in
            ``last_grad_norm``).
        **optimizer_kwargs: passed to ``optimizer_cls`` (``lr=...``, ``weight_decay=...``).

    With ``torch.optim.AdamW`` on CUDA (triton installed, :mod:`shardlib.kernels` enabled) the
    inner optimizer is :class:`shardlib.kernels.FusedAdamW`: the same update, state and
    ``state_dict``, one fused kernel launch per flat shard.

    ``param_groups`` and ``state`` are the inner optimizer's, so learning-rate schedulers work
    on this object. ``state_dict()`` holds this rank's shards (resharding checkpoints:
    :mod:`shardlib.checkpoint`).

    Raises:
        TypeError: ``smodel`` is not a sharded module.

    Example:
        >>> import shardlib
        >>> mesh = shardlib.init_mesh({"dp": 1})
        >>> smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh)
        >>> opt = ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
        >>> smodel(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, smodel: ShardedModule, optimizer_cls: type, max_grad_norm: float | None = None, **optimizer_kwargs: Any):
        if not isinstance(smodel, ShardedModule):
            raise TypeError(f"ZeroOptimizer takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
        self.smodel = smodel
        self._zero = smodel._zero
        if not self._zero.optimizer_params():
            raise ValueError(
                f"ZeroOptimizer: the sharded {type(smodel.module).__name__} has no trainable parameters on this rank "
                "(all frozen, or none): there is nothing to optimize"
            )
        if optimizer_cls is torch.optim.AdamW and kernels.use_triton(*self._zero.optimizer_params()):
            optimizer_cls = kernels.FusedAdamW  # CUDA: one fused launch per shard, torch's state and state_dict
        self.optimizer = optimizer_cls(self._zero.optimizer_params(), **optimizer_kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        super().__init__(self._zero.optimizer_params(), dict(self.optimizer.defaults))
        self.defaults = self.optimizer.defaults
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Clip (if ``max_grad_norm``), update this rank's shards, and re-gather parameters
        where the stage keeps them whole (stages 1-2)."""
        if self._zero.unsynced:
            raise RuntimeError(
                "ZeroOptimizer.step() after a backward inside no_sync(): gradients are not reduced yet. "
                "Run the last micro-batch's backward outside no_sync()"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(self.smodel, self.max_grad_norm)
        self.optimizer.step()
        self._zero.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (flat buffers are reused, so ``set_to_none`` is ignored)."""
        self._zero.zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
