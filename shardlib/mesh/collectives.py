"""Collectives by mesh axis name, autograd-aware, each counted in ``mesh.comm``.

The public functions follow ``jax.lax``: ``all_reduce`` is ``psum``, ``all_gather`` /
``reduce_scatter`` (``psum_scatter``) are each other's transpose, ``all_to_all`` is its own
transpose with the dims swapped, and ``ppermute`` transposes to the inverse permutation. As in
JAX's ``shard_map``, the backward of ``all_reduce`` is the identity: the cotangent of a summed
(replicated) value is itself replicated. ``pvary`` is the pair of that (identity forward,
all-reduce backward): Megatron's ``f`` and ``g`` operators (arXiv 1909.08053, section 3).

Over a tuple of axes, pieces are in axis-index order over the axes as named (as in JAX), on
every backend; torch lays them out by group rank (axes in mesh order), so where the two differ
the pieces are permuted around the flat-buffer call. The ``raw_*`` functions, the non-autograd
layer the strategies use on flat buffers, are in :mod:`.raw` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from .checks import check_dim as _check_dim, check_tensor as _check_tensor, is_int as _is_int
from .eager import eager
from .guard import Handle, begin, post, wait_works
from .mesh import Axis, Mesh, current_mesh
from .raw import _OPS, _group_positions, _key, _names, raw_all_gather, raw_all_reduce, raw_broadcast, raw_reduce_scatter

__all__ = [
    "all_reduce",
    "pvary",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ppermute",
    "Handle",
    "raw_all_reduce",
    "raw_all_gather",
    "raw_reduce_scatter",
    "raw_broadcast",
]


# ---------------------------------------------------------------------------------------------
# Autograd-aware collectives (the manual SPMD escape hatch, like jax.shard_map)


def _mesh(mesh: Mesh | None) -> Mesh:
    return mesh if mesh is not None else current_mesh()


# The public functions and the helpers their backward calls (``_gather``, ``_scatter``, ...) are
# ``eager``: a compiled function that calls ``backward()`` runs the autograd functions' backward
# under Dynamo too, so they must not be traced either (:mod:`.eager`).


def _own(t: torch.Tensor) -> torch.Tensor:
    """An autograd function's output as a tensor of its own: not a view of a buffer made in its
    forward (``movedim``, a reshape of the received pieces) nor its input returned as it was
    (``pvary``; size-1 axes go through :func:`_result`), either of which makes an in-place op on the output raise ("Output 0
    of _ReduceScatter is a view and is being modified inplace": Falcon's ``mlp_output +=
    attention_output`` after a bias-free row layer under sequence parallelism). No copy: the
    storage is shared, and so is the version counter, so autograd still sees an in-place change
    of an input that something saved."""
    return t.detach()


def _result(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A collective's output for the caller: :func:`_own`, and a copy where the collective had
    nothing to do and returned its input (an axis of size 1). The output of every collective is a
    new tensor at every axis size: an in-place op on it must not change ``x`` at tp=1 and leave it
    alone at tp=2 (the same SPMD code would compute different values on the two meshes)."""
    return y.clone() if y is x else _own(y)


def _inverse(where: list[int]) -> list[int]:
    """The inverse permutation of ``where`` (axis index -> group rank): group rank -> axis index."""
    order = [0] * len(where)
    for j, g in enumerate(where):
        order[g] = j
    return order


@eager
def _gather(x: torch.Tensor, mesh: Mesh, names, dim: int) -> torch.Tensor:
    n = mesh.size(names)
    if n == 1:
        return x
    xs = x.movedim(dim, 0).contiguous()
    out = xs.new_empty((n * xs.shape[0],) + tuple(xs.shape[1:]))
    raw_all_gather(out, xs, mesh, names)  # pieces in group-rank order
    where = _group_positions(mesh, names)
    if where is not None:  # into axis-index order
        out = out.view((n,) + tuple(xs.shape))[where].view(out.shape)
    # contiguous in the caller's layout: every reader then shares one storage (and autograd saves
    # it once); a strided result made each linear layer reading it (q, k, v under sequence
    # parallelism) save a copy of its own (3 T h elements a block where 1 serves)
    return out.movedim(0, dim).contiguous()


@eager
def _scatter(x: torch.Tensor, mesh: Mesh, names, dim: int) -> torch.Tensor:
    n = mesh.size(names)
    if n == 1:
        return x
    if x.shape[dim] % n:
        from ..errors import ShardingError

        raise ShardingError(
            f"reduce_scatter over {_key(names)} (size {n}) needs dimension {dim} of shape {tuple(x.shape)} "
            f"to be divisible by {n}. Fix: pad that dimension to a multiple of {n}"
        )
    xs = x.movedim(dim, 0).contiguous()
    where = _group_positions(mesh, names)
    if where is not None:  # axis-index order into group-rank order (a copy)
        xs = xs.view((n, xs.shape[0] // n) + tuple(xs.shape[1:]))[_inverse(where)].view(xs.shape)
    elif xs.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        xs = xs.clone()  # raw_reduce_scatter clobbers its input; never the caller's tensor
    shard = xs.new_empty((xs.shape[0] // n,) + tuple(xs.shape[1:]))
    raw_reduce_scatter(shard, xs, mesh, names)
    return shard.movedim(0, dim)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, op):
        ctx.scale = 1.0 / mesh.size(names) if op == "avg" else 1.0
        ctx.op = op
        y = x.clone(memory_format=torch.contiguous_format)  # NCCL reduces contiguous tensors only
        raw_all_reduce(y, mesh, names, op=op)
        return y

    @staticmethod
    def backward(ctx, g):
        if ctx.op in ("max", "min"):
            raise RuntimeError(f"all_reduce(op={ctx.op!r}) has no gradient; use op='sum' or 'avg'")
        return (g * ctx.scale if ctx.scale != 1.0 else g), None, None, None


class _PVary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names):
        ctx.mesh, ctx.names = mesh, names
        return _own(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)  # a gradient through a transpose is strided
        raw_all_reduce(g, ctx.mesh, ctx.names)
        return g, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, dim):
        ctx.mesh, ctx.names, ctx.dim = mesh, names, dim
        return _result(_gather(x, mesh, names, dim), x)

    @staticmethod
    def backward(ctx, g):
        return _scatter(g, ctx.mesh, ctx.names, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, dim):
        ctx.mesh, ctx.names, ctx.dim = mesh, names, dim
        return _result(_scatter(x, mesh, names, dim), x)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.mesh, ctx.names, ctx.dim), None, None, None


@eager
def _all_to_all(x, mesh, names, split_dim, concat_dim):
    n = mesh.size(names)
    if n == 1:
        return x
    if x.shape[split_dim] % n:
        from ..errors import ShardingError

        raise ShardingError(
            f"all_to_all over {_key(names)} (size {n}) splits dimension {split_dim} of shape {tuple(x.shape)}, "
            f"which {n} does not divide"
        )
    chunks = [c.contiguous() for c in x.chunk(n, dim=split_dim)]  # piece j goes to axis index j
    where = _group_positions(mesh, names)
    if where is not None:  # torch's lists are in group-rank order
        chunks = [chunks[j] for j in _inverse(where)]
    outs = [torch.empty_like(c) for c in chunks]
    mesh.comm.record(_key(names), "all_to_all", x.numel() * x.element_size(), n)
    rec, _ = begin(mesh, names, "all_to_all", x, 0, "", extra=split_dim * 16 + concat_dim)
    wait_works(mesh, [post(mesh, dist.all_to_all, outs, chunks, group=mesh.group(names), async_op=True)], rec, False)
    if where is not None:
        outs = [outs[g] for g in where]  # what axis index j sent, in axis-index order
    return torch.cat(outs, dim=concat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, split_dim, concat_dim):
        ctx.args = (mesh, names, split_dim, concat_dim)
        return _result(_all_to_all(x, mesh, names, split_dim, concat_dim), x)

    @staticmethod
    def backward(ctx, g):
        mesh, names, split_dim, concat_dim = ctx.args
        return _all_to_all(g.contiguous(), mesh, names, concat_dim, split_dim), None, None, None, None


@eager
def _ppermute(x, mesh, names, perm):
    n = mesh.size(names)
    ranks = mesh.axis_ranks(names)
    me = mesh.index(names)
    # contiguous first: the receive buffer takes ``x``'s strides, and a transposed input (or a
    # gradient arriving through a transpose in backward) made gloo refuse it ("input tensor has to
    # be contiguous") on the receiving rank while its peer waited
    x = x.contiguous()
    out = torch.zeros_like(x)
    ops = []
    rec, _ = begin(mesh, names, "ppermute", x, 0, "")
    for src, dst in perm:
        if src == me and dst == me:
            out.copy_(x)
        elif src == me:
            mesh.comm.record(_key(names), "send", x.numel() * x.element_size(), n)
            ops.append(dist.P2POp(dist.isend, x, ranks[dst], group=mesh.group(names)))
        elif dst == me:
            ops.append(dist.P2POp(dist.irecv, out, ranks[src], group=mesh.group(names)))
    if ops:
        wait_works(mesh, post(mesh, dist.batch_isend_irecv, ops), rec, True)
    return out


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, perm):
        ctx.args = (mesh, names, [(d, s) for s, d in perm])
        return _result(_ppermute(x, mesh, names, perm), x)

    @staticmethod
    def backward(ctx, g):
        mesh, names, inverse = ctx.args
        return _ppermute(g, mesh, names, inverse), None, None, None


@eager
def all_reduce(x: torch.Tensor, axis: Axis, op: str = "sum", *, mesh: Mesh | None = None) -> torch.Tensor:
    """``jax.lax.psum``: reduce ``x`` (any shape, same on every rank of the group) over ``axis``.

    Args:
        x: local tensor, shape ``S`` on every rank of the group.
        axis: a mesh axis name or a tuple of names (reduced over their product).
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"`` (the last two have no gradient).
        mesh: defaults to :func:`~shardlib.mesh.current_mesh`.

    Returns:
        A new tensor of shape ``S``; the input is not modified. Backward: the identity (scaled by
        ``1/N`` for ``"avg"``), since the cotangent of a reduced value is replicated (JAX).

    Raises:
        TypeError: ``x`` is not a tensor, or ``op="avg"`` on an integer or bool tensor.
        ValueError: an unknown ``op``.
        ShardingError: an axis the mesh does not have, or one named twice.
        All on every rank, before any communication.
    """
    mesh = _mesh(mesh)
    _check_tensor("all_reduce", x)
    if not isinstance(op, str) or op not in _OPS:
        raise ValueError(f"all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"all_reduce(op='avg') needs a floating-point tensor, got {x.dtype} of shape {tuple(x.shape)}: "
            "the mean of integers is not an integer. Fix: convert x to a float dtype, or use op='sum' and divide"
        )
    return _AllReduce.apply(x, mesh, _names(mesh, axis), op)


@eager
def pvary(x: torch.Tensor, axis: Axis, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient over ``axis`` backward.

    Megatron's ``f`` operator (copy to the tensor-parallel region; arXiv 1909.08053), JAX's
    ``pvary``: marks a replicated value as used differently on each rank of ``axis``.
    """
    mesh = _mesh(mesh)
    _check_tensor("pvary", x)
    return _PVary.apply(x, mesh, _names(mesh, axis))


@eager
def all_gather(x: torch.Tensor, axis: Axis, dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Concatenate the local ``x`` of every rank along ``axis`` in dimension ``dim``.

    Args:
        x: local shape ``(..., d, ...)``, equal on every rank of the group; at least 1-D.
        axis: a mesh axis name or a tuple of names (``N`` ranks: the product of their sizes).
        dim: the dimension to concatenate, ``-x.dim() <= dim < x.dim()`` (negative counts from
            the end, as in torch).
        mesh: defaults to :func:`~shardlib.mesh.current_mesh`.

    Returns:
        shape ``(..., N * d, ...)``, pieces in axis-index order. Backward: ``reduce_scatter``.

    Raises:
        TypeError: ``x`` is not a tensor, or ``dim`` not an int.
        ShardingError: ``dim`` out of range for ``x`` (or ``x`` 0-dimensional), or an axis the
            mesh does not have. All on every rank, before any communication.
    """
    mesh = _mesh(mesh)
    _check_tensor("all_gather", x)
    dim = _check_dim("all_gather", "dim", dim, x)
    return _AllGather.apply(x, mesh, _names(mesh, axis), dim)


@eager
def reduce_scatter(x: torch.Tensor, axis: Axis, dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's piece of dimension ``dim`` (``psum_scatter``).

    Args:
        x: local shape ``(..., N * d, ...)``; ``N`` (the axis size) must divide that dimension.
        axis: a mesh axis name or a tuple of names.
        dim: the dimension to scatter, ``-x.dim() <= dim < x.dim()``.
        mesh: defaults to :func:`~shardlib.mesh.current_mesh`.

    Returns:
        shape ``(..., d, ...)``. Backward: ``all_gather``.

    Raises:
        TypeError: ``x`` is not a tensor, or ``dim`` not an int.
        ShardingError: ``dim`` out of range for ``x``, ``N`` does not divide ``x.shape[dim]``, or
            an axis the mesh does not have. All on every rank, before any communication.
    """
    mesh = _mesh(mesh)
    _check_tensor("reduce_scatter", x)
    dim = _check_dim("reduce_scatter", "dim", dim, x)
    return _ReduceScatter.apply(x, mesh, _names(mesh, axis), dim)


@eager
def all_to_all(x: torch.Tensor, axis: Axis, split_dim: int, concat_dim: int, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Split ``x`` into ``N`` pieces along ``split_dim``, send piece ``i`` to rank ``i`` of
    ``axis``, and concatenate what arrives along ``concat_dim``. Backward: the same with the two
    dims swapped.

    Args:
        x: local shape with ``x.shape[split_dim]`` divisible by ``N`` (the axis size).
        axis: a mesh axis name or a tuple of names.
        split_dim, concat_dim: dimensions of ``x``, each in ``[-x.dim(), x.dim())``.
        mesh: defaults to :func:`~shardlib.mesh.current_mesh`.

    Returns:
        ``x.shape[split_dim] / N`` along ``split_dim`` and ``N`` times ``x.shape[concat_dim]``
        along ``concat_dim`` (one dimension for both: its size is kept).

    Raises:
        TypeError: ``x`` is not a tensor, or a dim not an int.
        ShardingError: a dim out of range, ``N`` does not divide ``x.shape[split_dim]``, or an
            axis the mesh does not have. All on every rank, before any communication.
    """
    mesh = _mesh(mesh)
    _check_tensor("all_to_all", x)
    split_dim = _check_dim("all_to_all", "split_dim", split_dim, x)
    concat_dim = _check_dim("all_to_all", "concat_dim", concat_dim, x)
    return _AllToAll.apply(x, mesh, _names(mesh, axis), split_dim, concat_dim)


@eager
def ppermute(x: torch.Tensor, axis: Axis, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Send ``x`` from axis index ``src`` to ``dst`` for each ``(src, dst)`` in ``perm``.

    A rank that receives nothing gets zeros (``jax.lax.ppermute``). Backward: the inverse
    permutation. Each rank sends at most once and receives at most once.

    Args:
        x: local tensor, the same shape and dtype on every rank of the group.
        axis: a mesh axis name or a tuple of names (``N`` ranks).
        perm: ``(src, dst)`` pairs of axis indices (ints in ``[0, N)``).
        mesh: defaults to :func:`~shardlib.mesh.current_mesh`.

    Returns:
        A tensor shaped like ``x``: what this rank received, or zeros.

    Raises:
        TypeError: ``x`` is not a tensor, or ``perm`` is not a sequence of ``(src, dst)`` int pairs.
        ShardingError: ``perm`` is not a partial permutation of ``0..N-1``, or an axis the mesh
            does not have. All on every rank, before any communication.
    """
    mesh = _mesh(mesh)
    _check_tensor("ppermute", x)
    pairs = list(perm) if isinstance(perm, Iterable) and not isinstance(perm, (str, torch.Tensor)) else None
    if pairs is None or not all(
        isinstance(pair, (tuple, list)) and len(pair) == 2 and all(_is_int(i) for i in pair) for pair in pairs
    ):
        raise TypeError(f"ppermute: perm must be a sequence of (src, dst) pairs of int axis indices, got {perm!r}")
    perm = [(int(s), int(d)) for s, d in pairs]
    n = mesh.size(axis)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or not all(0 <= i < n for i in srcs + dsts):
        from ..errors import ShardingError

        raise ShardingError(
            f"ppermute perm {perm} must be a partial permutation of 0..{n - 1} (axis {axis!r} has {n} ranks): "
            "each index sends at most once and receives at most once"
        )
    return _PPermute.apply(x, mesh, _names(mesh, axis), perm)
