"""Megatron's paired region operators, by mesh axis name.

Shoeybi et al., "Megatron-LM" (arXiv 1909.08053), section 3, and Korthikanti et al. (arXiv
2205.05198) for the sequence-parallel pair. Each is an autograd function whose backward is the
conjugate collective:

==========================  ==================================  ===============================
operator                    forward                              backward
==========================  ==================================  ===============================
``pvary`` (f)               identity                             all-reduce over the axis
``all_reduce`` (g)          all-reduce                           identity
``gather_from_region``      all-gather along ``dim``             keep this rank's slice
``scatter_to_region``       keep this rank's slice               all-gather along ``dim``
``all_gather`` (SP)         all-gather along the sequence        reduce-scatter
``reduce_scatter`` (SP)     reduce-scatter along the sequence    all-gather
==========================  ==================================  ===============================

``gather_from_region`` / ``scatter_to_region`` follow the torch.chunk layout, so a dimension
the axis does not divide (a vocabulary of 37 over 2 ranks: 19 + 18) works: pieces are padded to
the block size for the collective and trimmed after, never padded into the data.
"""

from __future__ import annotations

import torch

from ..spec import shard_range
from .collectives import _gather, _mesh, _names
from .eager import eager
from .mesh import Axis, Mesh

__all__ = ["gather_from_region", "scatter_to_region"]


def _uneven_gather(x: torch.Tensor, mesh: Mesh, names, dim: int, full: int) -> torch.Tensor:
    n = mesh.size(names)
    if n == 1:
        return x
    block = -(-full // n)
    pad = block - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    out = _gather(x, mesh, names, dim)
    if block * n == full:
        return out
    pieces = [out.narrow(dim, i * block, hi - lo) for i, (lo, hi) in enumerate(shard_range(full, n, i) for i in range(n))]
    return torch.cat(pieces, dim=dim)


def _own_slice(x: torch.Tensor, mesh: Mesh, names, dim: int) -> torch.Tensor:
    n = mesh.size(names)
    if n == 1:
        return x
    lo, hi = shard_range(x.shape[dim], n, mesh.index(names))
    return x.narrow(dim, lo, hi - lo).contiguous()


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, dim, full):
        ctx.args = (mesh, names, dim)
        return _uneven_gather(x.contiguous(), mesh, names, dim, full)

    @staticmethod
    def backward(ctx, g):
        mesh, names, dim = ctx.args
        return _own_slice(g, mesh, names, dim), None, None, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, names, dim):
        ctx.args = (mesh, names, dim, x.shape[dim])
        return _own_slice(x, mesh, names, dim)

    @staticmethod
    def backward(ctx, g):
        mesh, names, dim, full = ctx.args
        return _uneven_gather(g.contiguous(), mesh, names, dim, full), None, None, None


@eager
def gather_from_region(x: torch.Tensor, axis: Axis, dim: int, full_size: int | None = None, *, mesh: Mesh | None = None) -> torch.Tensor:
    """All-gather a value split over ``axis`` into a replicated one; backward keeps this rank's slice.

    Args:
        x: local ``(..., d_i, ...)`` with ``d_i`` this rank's piece of ``full_size`` (torch.chunk
            layout) along ``dim``.
        full_size: the global size of ``dim`` (default: local size times the axis size).

    Returns:
        ``(..., full_size, ...)``, the same on every rank of the axis.
    """
    mesh = _mesh(mesh)
    names = _names(mesh, axis)
    dim = dim % x.dim()
    full = full_size if full_size is not None else x.shape[dim] * mesh.size(names)
    return _GatherFromRegion.apply(x, mesh, names, dim, full)


@eager
def scatter_to_region(x: torch.Tensor, axis: Axis, dim: int, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Keep this rank's slice (torch.chunk layout) of a replicated value; backward all-gathers."""
    mesh = _mesh(mesh)
    return _ScatterToRegion.apply(x, mesh, _names(mesh, axis), dim % x.dim())
