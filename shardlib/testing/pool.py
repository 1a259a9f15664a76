"""One pool of gloo worker processes per world size, reused across tests.

Spawning a process and importing torch costs seconds; a test suite that spawns per test does
not fit in 15 minutes on two cores. ``run_on(n, fn, *args)`` sends ``fn`` to a cached
:class:`~shardlib.mesh.launch.WorkerGroup` of ``n`` ranks, making a new one only if the last
run left a rank stuck (then the group was killed).
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable

from ..mesh.launch import WorkerGroup

__all__ = ["get_pool", "run_on", "close_pools"]

_POOLS: dict[int, WorkerGroup] = {}


def _timeout() -> float:
    return float(os.environ.get("SHARDLIB_TEST_TIMEOUT", "120"))


def get_pool(nprocs: int) -> WorkerGroup:
    """The cached worker group of ``nprocs`` ranks (created on first use)."""
    group = _POOLS.get(nprocs)
    if group is None or not group.alive:
        group = WorkerGroup(nprocs, timeout=_timeout())
        _POOLS[nprocs] = group
    return group


def run_on(nprocs: int, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of the pool of ``nprocs``; results by rank.

    Raises:
        WorkerError: as :meth:`WorkerGroup.run`.
    """
    return get_pool(nprocs).run(fn, *args, timeout=timeout, **kwargs)


def close_pools() -> None:
    """Stop every cached worker group."""
    for group in _POOLS.values():
        group.close()
    _POOLS.clear()


atexit.register(close_pools)
