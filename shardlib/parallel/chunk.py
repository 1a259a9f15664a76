"""The runtime state of one ZeRO chunk: its flat parameter buffers and gradient buffers.

A chunk (ColossalAI Gemini's unit) is a flat buffer of ``P`` elements (the padded total of its
parameters, a multiple of the data-axis size ``N``); rank ``i`` owns the shard
``[i * S, (i + 1) * S)``, ``S = P / N``. See :mod:`shardlib.parallel.zero` for what each ZeRO
stage keeps.

Gradient buffers are zeroed lazily. ``zero_grad`` only marks them *stale* (logically zero); the
first gradient of each parameter after that is copied into its region instead of added, and
just before a buffer is reduced or read (:meth:`Chunk.settle_full`, :meth:`Chunk.settle_shard`)
only the regions no gradient reached (unused parameters, padding) are zeroed. This saves a
memset of every buffer per step and turns the first accumulation's read-add-write into a copy,
as torch's ``AccumulateGrad`` steals the first gradient of a parameter whose ``.grad`` is None.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Chunk"]


class Chunk:
    """Runtime state of one planned chunk (:class:`~shardlib.plan_items.ChunkPlan`).

    Args:
        plan: the chunk's plan (``padded_numel`` ``P``, ``shard_numel`` ``S``, dtypes).
        params: ``(parameter, element offset)`` of its unique parameters, in offset order.
        stage: the effective ZeRO stage (0-3).
        data_index: this rank's index along the data axes (which shard it owns).
        lazy: for a model built on ``meta``, a :class:`shardlib.lazy.LazyInit` that fills the
            elements this rank stores (stage 3: only its shard).
    """

    def __init__(self, plan, params: list[tuple[nn.Parameter, int]], stage: int, data_index: int, lazy=None):
        self.plan = plan
        self.index = plan.index
        self.params = params  # (param, offset), unique params in order
        self.trainable = plan.requires_grad
        p, s = plan.padded_numel, plan.shard_numel
        slot = slice(data_index * s, (data_index + 1) * s)
        if lazy is not None:  # built on the meta device: initialise only what this rank stores
            self.full, owned = lazy.allocate(plan, slot if stage == 3 else slice(0, p), params[0][0].device)
        else:
            self.full = torch.zeros(p, dtype=plan.dtype, device=params[0][0].device)
            for prm, off in params:
                self.full[off : off + prm.numel()].copy_(prm.detach().reshape(-1))
        self.slot = slot
        if stage == 3:
            self.shard = owned if lazy is not None else self.full[slot].clone()
        elif stage == 0:
            self.shard = self.full
        else:
            self.shard = self.full[slot]
        # Mixed precision: ``shard`` keeps the master values (stage 0: the full chunk), ``full``
        # becomes the compute copy in ``compute_dtype`` that the parameters view.
        self.mixed = plan.mixed_compute or plan.separate_grads
        self.separate_grads = plan.separate_grads
        if plan.mixed_compute:
            if stage in (1, 2):
                self.shard = self.shard.clone()
            self.full = self.full.to(plan.compute_dtype)
        for prm, off in params:
            prm.data = self.full[off : off + prm.numel()].view(prm.shape)
        if lazy is not None and stage == 3:
            self.full.untyped_storage().resize_(0)  # never filled: gathered before its first use
        # Gradients: ``grad_full`` (P elements, unreduced, in the reduction dtype) and
        # ``grad_shard`` (what the optimizer reads: the full chunk under stage 0, else S).
        # Stages 0-1 keep ``grad_full`` between steps and ``grad_shard`` views it; stages 2-3 (and
        # a separate reduction dtype) allocate ``grad_full`` per step and keep ``grad_shard`` apart.
        self.persistent_full = stage in (0, 1) and not self.separate_grads
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.opt_param: nn.Parameter | None = None
        self.stale = True  # grad_full is logically zero outside the regions in ``written``
        self.written: set[int] = set()  # ids of parameters whose region holds this window's gradient
        self.shard_stale = False  # grad_shard (separate storage) is logically zero
        if self.trainable:
            if self.persistent_full:
                self.grad_full = self.new_grad_full()
                self.grad_shard = self.grad_full if stage == 0 else self.grad_full[slot]
            else:
                self.grad_shard = torch.zeros_like(self.shard)
            self.opt_param = nn.Parameter(self.shard, requires_grad=True)
            self.opt_param.grad = self.grad_shard
        self.gathered = True
        self.gather_handle = None
        self.reduce_handle = None
        self.reduce_tmp: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.n_trainable = len(params) if self.trainable else 0
        self.carry: torch.Tensor | None = None  # stage 1: reduced grads kept across sync steps
        self.reduced = False

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def new_grad_full(self) -> torch.Tensor:
        """An unreduced-gradient buffer for the whole chunk in the reduction dtype, uninitialised
        and marked stale (its regions are copied into, or zeroed by :meth:`settle_full`)."""
        self.mark_stale()
        return torch.empty(self.plan.padded_numel, dtype=self.plan.reduce_dtype or self.plan.dtype, device=self.shard.device)

    def ensure_grad_full(self) -> torch.Tensor:
        if self.grad_full is None:
            self.grad_full = self.new_grad_full()
        return self.grad_full

    def accumulate(self, prm: nn.Parameter, off: int, grad: torch.Tensor) -> None:
        """Add the flat gradient ``grad`` of ``prm`` (at element ``off``) into ``grad_full``:
        a copy for its first gradient since the buffer went stale, an add after that."""
        region = self.ensure_grad_full()[off : off + grad.numel()]
        if self.stale and id(prm) not in self.written:
            region.copy_(grad)  # cast into the reduction dtype
            self.written.add(id(prm))
        else:
            region.add_(grad)

    def mark_stale(self) -> None:
        """Make ``grad_full`` logically zero, without writing it."""
        self.stale, self.written = True, set()

    def settle_full(self) -> None:
        """Zero the regions of a stale ``grad_full`` that no gradient reached (parameters without
        a gradient, padding), so the whole buffer holds the accumulated gradients."""
        if not self.stale or self.grad_full is None:
            return
        pos = 0
        for prm, off in self.params:
            if id(prm) in self.written:
                if off > pos:
                    self.grad_full[pos:off].zero_()
                pos = max(pos, off + prm.numel())
        if pos < self.grad_full.numel():
            self.grad_full[pos:].zero_()
        self.stale, self.written = False, set()

    def settle_shard(self) -> None:
        """Make every gradient the optimizer reads hold its value (zero where none arrived)."""
        if self.persistent_full:
            self.settle_full()
        elif self.shard_stale:
            self.grad_shard.zero_()
            self.shard_stale = False
