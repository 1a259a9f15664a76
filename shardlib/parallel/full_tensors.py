"""Full copies of ZeRO chunks (parameters and gradients) and writes of full values into them.

:class:`FullTensors` is a mixin of :class:`~shardlib.parallel.zero.ZeroRuntime`, used by
``full_state_dict``/``full_grads``, loads and checkpoints; it uses its ``stage``, ``mesh``,
``axes``, ``_view_hooks`` and ``_adopt_silenced``.
"""

from __future__ import annotations

import torch

from ..mesh.collectives import raw_all_gather
from .chunk import Chunk

__all__ = ["FullTensors"]


class FullTensors:
    """Gathered copies of a chunk and writes of full values (see the module)."""

    def full_chunk(self, chunk: Chunk) -> torch.Tensor:
        """A full copy of a chunk's (master) parameters (gathers under stage 3, and under stages
        1-2 with mixed precision, where the master is only this rank's shard)."""
        if self.stage == 0:
            return chunk.shard.clone()
        if self.stage != 3 and chunk.full.dtype == chunk.shard.dtype:
            return chunk.full.clone()
        src = chunk.shard.to(chunk.device)  # (an offloaded shard: from host memory; the collective is on the device)
        out = src.new_empty(chunk.plan.padded_numel)
        raw_all_gather(out, src, self.mesh, self.axes, note=f"chunk {chunk.index}")
        return out

    def write_full(self, chunk: Chunk, off: int, flat: torch.Tensor) -> None:
        """Set the elements ``[off, off + flat.numel())`` of ``chunk`` from full values, in every
        copy this rank holds (master shard, compute copy); no communication."""
        lo = chunk.slot.start if self.stage >= 1 else 0
        hi = lo + chunk.shard.numel()
        a, b = max(lo, off), min(hi, off + flat.numel())
        if a < b:
            chunk.shard[a - lo : b - lo].copy_(flat[a - off : b - off])
        if self.stage != 3:  # the full parameters (the compute copy under mixed precision)
            chunk.full[off : off + flat.numel()].copy_(flat)

    def full_grad_chunk(self, chunk: Chunk) -> torch.Tensor:
        """A full copy of a chunk's averaged gradients (gathers from shards under stages 1-3)."""
        if self._view_hooks.silenced:
            self._adopt_silenced()
        chunk.settle_shard()
        if self.stage == 0:
            return chunk.grad_shard.clone()
        src = chunk.grad_shard.to(chunk.device)
        out = src.new_empty(chunk.plan.padded_numel)
        raw_all_gather(out, src, self.mesh, self.axes, note=f"chunk {chunk.index} gradients")
        return out
