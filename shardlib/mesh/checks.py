"""Argument checks of the public collectives (:mod:`shardlib.mesh.collectives`).

Local and alike on every rank, so a bad argument raises everywhere before anything is sent (a
modulo used to turn ``dim=5`` of a 1-D tensor into 0, and ``all_gather`` returned a result).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ..errors import ShardingError

__all__ = ["check_tensor", "check_dim", "is_int"]


def check_tensor(fn: str, x) -> None:
    """Raises TypeError when ``x`` (the tensor argument of ``fn``) is not a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")


def check_dim(fn: str, name: str, dim, x: torch.Tensor) -> int:
    """``dim`` (an int in ``[-x.dim(), x.dim())``) as a non-negative dimension of ``x``.

    Raises:
        TypeError: ``dim`` is not an int (a bool is not).
        ShardingError: ``x`` is 0-dimensional, or ``dim`` is out of range; the message names
            ``fn``, the argument ``name``, its value and ``x``'s shape.
    """
    if not is_int(dim):
        raise TypeError(f"{fn}: {name} must be an int, got {dim!r} of type {type(dim).__name__}")
    if x.dim() == 0:
        raise ShardingError(f"{fn}: x is 0-dimensional (a scalar), so {name}={dim} names no dimension. Fix: x.reshape(1)")
    if not -x.dim() <= dim < x.dim():
        raise ShardingError(
            f"{fn}: {name}={dim} is out of range for x of shape {tuple(x.shape)} ({x.dim()} "
            f"dimension{'s' if x.dim() != 1 else ''}): expected {-x.dim()} <= {name} < {x.dim()}"
        )
    return int(dim) % x.dim()


def is_int(value) -> bool:
    """An integer (Python or NumPy), not a bool (``True`` would pass for 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
