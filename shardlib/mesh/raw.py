"""The flat-buffer collectives the strategies use, by mesh axis name: no autograd, each
counted in ``mesh.comm`` and traced (:mod:`.guard`).

On gloo, reduce-scatter and all-gather are direct point-to-point exchanges (``_exchange``):
each rank sends every other rank the slice it owns (all-gather) or needs (reduce-scatter) and
receives straight into place, the (N-1)/N of the buffer a ring moves, without the copies of
gloo's ``all_gather_into_tensor`` (input flattened, output copied out) or the doubled traffic
of an all-reduce standing in for reduce-scatter (gloo's own reduce-scatter is an all-reduce
underneath). Two ranks, 16 MiB, wall/CPU ms: all-gather 8.9/6.6 against gloo's 13.0/10.2;
reduce-scatter 9.3/6.7 against an all-reduce's 15.7/12.9 (``benchmarks/README.md``). Every
rank posts its sends and receives in the same order, and gloo matches a pair's messages in
order, so exchanges in flight together (a prefetch) pair up. Elsewhere (NCCL, the fake group,
or ``mesh.native`` forced on) they are torch's ``all_gather_into_tensor`` /
``reduce_scatter_tensor``.

Layout. A flat buffer of ``N`` equal slots holds in slot ``i`` the data of the rank whose
*group rank* is ``i`` (:meth:`~shardlib.mesh.Mesh.group_index`: its index over the axes in
mesh order, which is where torch's collectives put it, since ``new_group`` sorts ranks). Both
branches compute the slot with that one function, so they agree by construction, for axes
named in any order. The public collectives (:mod:`.collectives`) keep the order the axes are
named in and permute pieces around these calls (``_group_positions``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .eager import eager
from .guard import Handle, begin, done_handle, finish, post, wait_works, native_all_gather, native_reduce_scatter
from .mesh import Axis, Mesh

__all__ = ["raw_all_reduce", "raw_all_gather", "raw_reduce_scatter", "raw_broadcast"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}


def _names(mesh: Mesh, axis: Axis) -> tuple[str, ...]:
    return mesh._axes(axis)


def _key(names: tuple[str, ...]) -> str:
    return "+".join(names)


def _exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group, mesh: Mesh) -> list:
    """Post point-to-point sends and receives ``[(global rank, tensor)]`` on ``group`` at once."""
    works = [post(mesh, dist.isend, t, peer, group=group) for peer, t in sends]
    works += [post(mesh, dist.irecv, t, peer, group=group) for peer, t in recvs]
    return works


def _peers(mesh: Mesh, names: tuple[str, ...], index: int) -> list[tuple[int, int]]:
    """``[(group rank, global rank)]`` of every other rank of this rank's group (``names`` in
    mesh order: :meth:`~shardlib.mesh.Mesh.group_axes`; ``index`` this rank's group rank)."""
    return [(j, r) for j, r in enumerate(mesh.axis_ranks(names)) if j != index]


def _group_positions(mesh: Mesh, names: tuple[str, ...]) -> list[int] | None:
    """``[group rank of the rank at index j along names for j in 0..N-1]``: where each piece
    of axis-index order sits in group-rank order; None when the two orders are the same."""
    canonical = mesh.group_axes(names)
    if canonical == names:
        return None
    slot = {r: g for g, r in enumerate(mesh.axis_ranks(canonical))}
    return [slot[r] for r in mesh.axis_ranks(names)]


def _flat_layout(mesh: Mesh, axis: Axis, flat: torch.Tensor, shard: torch.Tensor):
    """``(counter key, axes in mesh order, N, this rank's group rank, slot size, its slot of
    flat)``: the one layout of both branches (slot ``i`` is group rank ``i``'s)."""
    names = mesh.group_axes(axis)
    index = mesh.group_index(names)
    k = shard.numel()
    return _key(_names(mesh, axis)), names, mesh.size(names), index, k, flat.view(-1)[index * k : (index + 1) * k]


@eager
def raw_all_reduce(t: torch.Tensor, mesh: Mesh, axis: Axis, op: str = "sum", async_op: bool = False, record: bool = True,
                   channel: int = 0, note: str = "") -> Handle:
    """In-place all-reduce of ``t`` over ``axis``; counted as ``all_reduce``."""
    names = _names(mesh, axis)
    n = mesh.size(names)
    if n == 1:
        return done_handle()
    if record:
        mesh.comm.record(_key(names), "all_reduce", t.numel() * t.element_size(), n)
    rec, verify = begin(mesh, names, "all_reduce", t, channel, note, extra=list(_OPS).index(op), async_op=async_op)
    work = post(mesh, dist.all_reduce, t, op=_OPS[op], group=mesh.group(names, channel), async_op=True)
    then = (lambda: t.div_(n)) if op == "avg" else None
    return finish([work], then, mesh, async_op, rec, verify=verify)


@eager
def raw_all_gather(out: torch.Tensor, shard: torch.Tensor, mesh: Mesh, axis: Axis, async_op: bool = False,
                   note: str = "") -> Handle:
    """Gather equal shards into the flat ``out`` (``out.numel() == N * shard.numel()``).

    Slot ``i`` of ``out`` receives the shard of the rank whose group rank
    (:meth:`~shardlib.mesh.Mesh.group_index`) is ``i``, on both branches. ``shard`` may be a
    view of ``out``'s own slot (in-place all-gather). Counted as ``all_gather`` of ``out``'s
    bytes.
    """
    key, names, n, index, k, slot = _flat_layout(mesh, axis, out, shard)
    if n == 1:
        if slot.data_ptr() != shard.data_ptr():
            slot.copy_(shard.view(-1))
        return done_handle()
    mesh.comm.record(key, "all_gather", out.numel() * out.element_size(), n)
    rec, verify = begin(mesh, names, "all_gather", shard, 0, note, async_op=async_op)
    group = mesh.group(names)
    if not mesh.native:
        flat, src = out.view(-1), shard.view(-1)
        peers = _peers(mesh, names, index)
        if src.data_ptr() != slot.data_ptr():
            slot.copy_(src)
        works = _exchange([(r, slot) for _, r in peers], [(r, flat[j * k : (j + 1) * k]) for j, r in peers], group, mesh)
        return finish(works, None, mesh, async_op, rec, p2p=True, verify=verify)
    work = post(mesh, native_all_gather(), out.view(-1), shard.view(-1), group=group, async_op=True)
    return finish([work], None, mesh, async_op, rec, verify=verify)


@eager
def raw_reduce_scatter(shard: torch.Tensor, full: torch.Tensor, mesh: Mesh, axis: Axis, async_op: bool = False, op: str = "sum",
                       channel: int = 0, note: str = "") -> Handle:
    """Reduce the flat ``full`` over ``axis`` and write this rank's equal slice into ``shard``.

    This rank's slice is slot :meth:`~shardlib.mesh.Mesh.group_index` of ``full``, on both
    branches. ``full`` may be clobbered (NCCL reduces in place; gloo leaves it as it was).
    ``shard`` may be a view of ``full``'s own slot. ``op`` is ``"sum"`` or ``"avg"``. Counted as
    ``reduce_scatter`` of ``full``'s bytes.
    """
    key, names, n, index, k, slot = _flat_layout(mesh, axis, full, shard)
    if n == 1:
        if slot.data_ptr() != shard.data_ptr():
            shard.view(-1).copy_(slot)
        return done_handle()
    mesh.comm.record(key, "reduce_scatter", full.numel() * full.element_size(), n)
    rec, verify = begin(mesh, names, "reduce_scatter", full, channel, note, extra=list(_OPS).index(op),
                         async_op=async_op)
    group = mesh.group(names, channel)
    flat, out = full.view(-1), shard.view(-1)
    if not mesh.native:
        peers = _peers(mesh, names, index)
        parts = {j: flat.new_empty(k) for j, _ in peers}
        works = _exchange([(r, flat[j * k : (j + 1) * k]) for j, r in peers], [(r, parts[j]) for j, r in peers], group, mesh)

        def then():  # the owner sums its own slice, then the others' in rank order; scaled for "avg"
            rest = [parts[j] for j, _ in peers]
            if out.data_ptr() == slot.data_ptr():
                out.add_(rest[0])
            else:
                torch.add(slot, rest[0], out=out)
            for part in rest[1:]:
                out.add_(part)
            if op == "avg":
                out.div_(n)

        return finish(works, then, mesh, async_op, rec, p2p=True, verify=verify)
    work = post(mesh, native_reduce_scatter(), slot, flat, group=group, async_op=True)

    def then_nccl():
        if op == "avg":
            slot.div_(n)
        if slot.data_ptr() != out.data_ptr():
            out.copy_(slot)

    return finish([work], then_nccl, mesh, async_op, rec, verify=verify)


@eager
def raw_broadcast(t: torch.Tensor, mesh: Mesh, axis: Axis, src_index: int = 0) -> None:
    """Broadcast ``t`` in place from the rank at index ``src_index`` along ``axis``."""
    names = _names(mesh, axis)
    n = mesh.size(names)
    if n == 1:
        return
    mesh.comm.record(_key(names), "broadcast", t.numel() * t.element_size(), n)
    rec, _ = begin(mesh, names, "broadcast", t, 0, "", extra=src_index)
    src = mesh.axis_ranks(names)[src_index]
    wait_works(mesh, [post(mesh, dist.broadcast, t, src=src, group=mesh.group(names), async_op=True)], rec, False)
