"""Argument checks of the public collectives (:mod:`shardlib.mesh.collectives`).

Local and alike on every rank, so a bad argument raises everywhere before anything is sent (a
modulo used to turn ``dim=5`` of a 1-D tensor into 0, and ``all_gather`` returned a result).
"""

from __future__ import annotations

import numbers
import os

import numpy as np
import torch

from ..errors import ShardingError

__all__ = ["check_tensor", "check_dim", "is_int", "env_flag", "check_on_device"]


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


_OFF = ("", "0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def env_flag(name: str) -> bool:
    """The on/off environment variable ``name`` (unset: off), read as ``SHARDLIB_KERNELS`` is:
    ``1``/``true``/``on``/``yes`` on, ``0``/``false``/``off``/``no`` or empty off (case and
    surrounding spaces ignored).

    Raises:
        ShardingError: any other value, naming the variable and the words it takes."""
    value = os.environ.get(name, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ShardingError(f"{name}={os.environ[name]!r} is not understood: use one of {list(_ON)} (on) or "
                        f"{list(_OFF[1:])} or empty (off)")


def env_count(name: str) -> int | None:
    """The positive integer environment variable ``name`` (unset or empty: None).

    Raises:
        ShardingError: anything else, naming the variable and its value."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ShardingError(f"{name}={os.environ[name]!r} is not understood: a positive integer, or unset (no limit)")
    return int(value)


def check_on_device(tensors, mesh, what: str, allow_meta: bool = False) -> None:
    """Refuse a tensor that is not on ``mesh.device`` (the device every tensor handed to
    ``torch.distributed`` must be on: NCCL takes CUDA tensors only), before any communication.

    Args:
        tensors: ``[(label, tensor)]``, e.g. ``("parameter 'fc.weight'", p)``.
        mesh: the :class:`~shardlib.Mesh`.
        what: the model and the purpose, for the message ("GPT, sharded over tp=2").
        allow_meta: accept meta tensors (a model built on meta, materialized by ``shard()`` on
            the default device, which is the mesh's).

    Raises:
        ShardingError: the first tensor elsewhere, naming it, its shape and both devices."""
    want = mesh.device
    for label, t in tensors:
        if t.device != want and not (allow_meta and t.is_meta):
            raise ShardingError(
                f"{label} of {what} (shape {tuple(t.shape)}) is on {t.device}, but the mesh {mesh.shape} communicates "
                f"on {want} (backend {mesh.backend}). Fix: move the model there first (model.to({str(want)!r})), or "
                "build it on meta and let shard() materialize it")
