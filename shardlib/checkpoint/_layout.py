"""Where each rank's elements of a parameter lie in the global tensor, as boxes.

Under ZeRO (arXiv 1910.02054) a rank owns a contiguous range of each flat chunk, i.e. for each
parameter a contiguous range of its row-major, tensor-parallel local tensor; that local tensor is
a ``torch.chunk`` block of the global one (one per fused block along the split dimension, joined,
for fused weights such as GPT-2's ``c_attn`` or Phi-3's ``qkv_proj``: ``ParamPlan.tp_pieces``).
A contiguous range of a row-major N-d block is at most ``2N - 1`` boxes, each contiguous in
memory (:func:`range_boxes`), which map to global coordinates by the tensor-parallel offset
(:func:`global_pieces`).
"""

from __future__ import annotations

import math

import torch

from ..shard import ShardedModule

__all__ = ["range_boxes", "global_pieces", "owned_range", "region", "load_targets", "entries"]


def range_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[a, b)`` of a row-major tensor of ``shape`` as boxes.

    Returns ``[(flat start, offsets, sizes)]``; each box is contiguous in the flat order, the boxes
    are disjoint, in order, and cover the range (at most ``2 * len(shape) - 1`` of them).

    Example:
        >>> range_boxes((3, 4), 2, 11)
        [(2, (0, 2), (1, 2)), (4, (1, 0), (1, 4)), (8, (2, 0), (1, 3))]
    """
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(a, (a,) * len(shape), (b - a,) * len(shape))]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(a, inner), divmod(b, inner)

    def row(r, lo, hi):
        return [(r * inner + s, (r,) + o, (1,) + z) for s, o, z in range_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append((r0 * inner, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


def global_pieces(smodel: ShardedModule, pp, a: int, b: int, flat: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Elements ``[a, b)`` of ``pp``'s local tensor (held in the 1-D ``flat``) as
    ``[(global offsets, view)]``: views into ``flat`` shaped as boxes of the global tensor."""
    plan = smodel.plan
    shape = plan.local_shape(pp)
    pieces = pp.tp_pieces(dict(plan.mesh_shape), plan.coords())  # ((global start, width), ...) along tp_dim
    out = []
    for start, offs, sizes in range_boxes(shape, a, b):
        view = flat[start - a : start - a + math.prod(sizes)].view(sizes)
        if pp.tp_axis is None:
            out.append((offs, view))
            continue
        d = pp.tp_dim
        local = 0  # each tp piece (this rank's rows of one fused block) is one global box
        for g_start, width in pieces:
            a_, b_ = max(offs[d], local), min(offs[d] + sizes[d], local + width)
            if a_ < b_:
                g = list(offs)
                g[d] = g_start + a_ - local
                out.append((tuple(g), view.narrow(d, a_ - offs[d], b_ - a_)))
            local += width
    return out


def owned_range(zero, chunk, off: int, n: int) -> tuple[int, int]:
    """The range of a parameter's local elements ``[0, n)`` in this rank's ZeRO slot."""
    if zero.stage == 0:
        return 0, n
    a = min(max(chunk.slot.start - off, 0), n)
    return a, max(a, min(max(chunk.slot.stop - off, 0), n))


def region(smodel: ShardedModule, pp, flat_owner: torch.Tensor):
    """``(a, b, flat)``: the local elements ``[a, b)`` of ``pp`` that this rank owns, as a slice of
    a tensor laid out as this rank's shard of the chunk (the master parameters, or a per-element
    optimizer state; the whole chunk at stage 0)."""
    zero = smodel._zero
    c, off = smodel.plan.placement[pp.name]
    chunk = zero.chunks[c]
    n = math.prod(smodel.plan.local_shape(pp))
    a, b = owned_range(zero, chunk, off, n)
    lo = chunk.slot.start if zero.stage >= 1 else 0
    return a, b, flat_owner[a + off - lo : b + off - lo]


def load_targets(smodel: ShardedModule, pp) -> list:
    """Where a load writes ``pp`` on this rank: ``[(a, b, flat)]``. The owned range of the master
    shard (``chunk.shard``), and at stages 0-2 the whole local tensor in the compute copy
    (``chunk.full``) unless the shard is a view of it; values are cast on copy."""
    zero = smodel._zero
    c, off = smodel.plan.placement[pp.name]
    chunk = zero.chunks[c]
    master = region(smodel, pp, chunk.shard)
    if zero.stage == 3:
        return [master]
    n = math.prod(smodel.plan.local_shape(pp))
    whole = (0, n, chunk.full[off : off + n])
    if chunk.shard.untyped_storage().data_ptr() == chunk.full.untyped_storage().data_ptr():
        return [whole]
    return [master, whole]


def canonical_names(smodel: ShardedModule) -> dict[int, str]:
    """``{id(param): name in the whole model}`` for parameters a pipeline stage holds under a
    tied alias (``lm_head.weight`` on the last stage is ``wte.weight``)."""
    runner = getattr(smodel, "runner", None)
    return {id(prm): name for name, prm, _, _ in getattr(runner, "tied", ()) if prm is not None}


def entries(smodel: ShardedModule):
    """``[(pp, key name, param, skip)]``: ``skip`` marks a second copy of a parameter tied across
    pipeline stages (written by the stage that holds the first copy)."""
    canonical = canonical_names(smodel)
    duplicates = {id(p) for p in getattr(smodel, "norm_duplicates", [])}
    out = []
    for pp in smodel.plan.params:
        prm = smodel.module.get_parameter(pp.name)
        out.append((pp, canonical.get(id(prm), pp.name), prm, id(prm) in duplicates))
    return out
