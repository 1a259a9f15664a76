"""Gradient reductions of ZeRO chunks: launched in backward as chunks complete, finished in order.

Chunks reduce in backward order (``_trainable_order``), each as soon as its gradients are
complete (every trainable parameter's hook ran), at most one in flight besides the one being
packed at stages 2-3 (FSDP2's reduce-scatter state): the previous reduction is finished, and
its unreduced buffer freed, before the next chunk's gradients are packed. Stages 0-1 in one
dtype reduce in place (all-reduce, or reduce-scatter into the own slot); stages 2-3 reduce-
scatter into the optimizer's ``grad_shard`` (or a temporary added to it, and for an offloaded
chunk a device temporary copied to its host shard).

:class:`GradientReduction` is a mixin of :class:`~shardlib.parallel.zero.ZeroRuntime`; it uses
its ``stage``, ``mesh``, ``axes``, ``reduce_channel``, ``_sync``, ``_trainable_order``,
``_next_reduce``, ``_launched``, ``_grad_views``, ``_tp_sums``, ``_begin_accumulation`` and
``_adopt_grads``.
"""

from __future__ import annotations

import torch

from ..mesh.collectives import raw_all_reduce, raw_reduce_scatter
from .chunk import Chunk

__all__ = ["GradientReduction"]


class GradientReduction:
    """Launching and finishing the chunks' gradient reductions (see the module)."""

    def _launch_ready(self, force: bool = False) -> None:
        if not self._sync:
            return
        while self._next_reduce < len(self._trainable_order):
            chunk = self._trainable_order[self._next_reduce]
            if not force and len(chunk.ready) < chunk.n_trainable:
                return
            if self._next_reduce > 0 and not chunk.reduce_in_place:
                # one reduction in flight (FSDP2's reduce-scatter state): the one before is
                # finished and its unreduced grad_full freed before this chunk's is packed, not
                # at the end of backward (stages 2-3: every chunk's was alive at once)
                self._finish_reduce(self._trainable_order[self._next_reduce - 1])
            self._launch_reduce(chunk)
            self._launched.add(chunk.index)
            self._next_reduce += 1

    def _launch_reduce(self, chunk: Chunk) -> None:
        self._begin_accumulation(chunk)  # stage 1: no gradient reached it since its last reduction
        self._adopt_grads(chunk)
        chunk.ensure_grad_full()
        self._tp_sums.flush(chunk)
        chunk.settle_full()
        if chunk.reduce_in_place:  # stage 0: all-reduce in place; stage 1: into the own slot
            if self.stage == 0:
                chunk.reduce_handle = raw_all_reduce(chunk.grad_full, self.mesh, self.axes, op="avg", async_op=True,
                                                     channel=self.reduce_channel, note=f"chunk {chunk.index} gradients")
            else:
                chunk.reduce_handle = raw_reduce_scatter(chunk.grad_shard, chunk.grad_full, self.mesh, self.axes,
                                                         async_op=True, op="avg", channel=self.reduce_channel,
                                                         note=f"chunk {chunk.index} gradients")
            return
        # grad_shard apart (stages 2-3, or another reduction dtype): reduce into it directly when
        # it is logically zero and of the same dtype, else into a temporary added afterwards
        # (an offloaded chunk's grad_shard is in host memory: reduced on the device, then copied)
        direct = chunk.shard_stale and chunk.ensure_grad_shard().dtype == chunk.grad_full.dtype and not chunk.offloaded
        if self.stage == 0:
            out = chunk.grad_full
            chunk.reduce_handle = raw_all_reduce(out, self.mesh, self.axes, op="avg", async_op=True,
                                                 channel=self.reduce_channel, note=f"chunk {chunk.index} gradients")
        else:
            out = chunk.grad_shard if direct else torch.empty(chunk.grad_shard.shape, dtype=chunk.grad_full.dtype,
                                                                device=chunk.grad_full.device)
            chunk.reduce_handle = raw_reduce_scatter(out, chunk.grad_full, self.mesh, self.axes, async_op=True, op="avg",
                                                     channel=self.reduce_channel, note=f"chunk {chunk.index} gradients")
        chunk.reduce_tmp = None if out is chunk.grad_shard else out

    def _finish_reduce(self, chunk: Chunk) -> None:
        if chunk.reduce_handle is None:
            return
        chunk.reduce_handle.wait()
        chunk.reduce_handle = None
        if chunk.reduce_in_place:
            for prm, _ in chunk.params if self._grad_views else ():  # stage 0: every .grad is its reduced gradient
                view = self._grad_views.get(id(prm))
                if view is not None and prm.grad is not view:
                    prm.grad = view
            if self.stage == 1:
                if chunk.carry is not None:
                    chunk.grad_shard.add_(chunk.carry)
                    chunk.carry = None
                chunk.reduced = True  # outside its slot grad_full holds partial sums: restarted before reuse
            return
        if chunk.reduce_tmp is not None:
            if chunk.shard_stale:  # cast into the master dtype (offloaded: to pinned host memory, asynchronously)
                chunk.grad_shard.copy_(chunk.reduce_tmp, non_blocking=chunk.pinned)
            else:
                chunk.grad_shard.add_(chunk.reduce_tmp.to(chunk.grad_shard.device))
        chunk.shard_stale = False
        chunk.reduce_tmp = None
        chunk.grad_full = None
