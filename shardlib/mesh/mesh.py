"""Mesh: named axes over ranks, and the process groups that go with them.

The ranks form a grid ``arange(world).reshape(sizes)`` (picotron's ``process_group_manager``,
JAX's device mesh, torch's DeviceMesh): axis order is outer to inner, the last axis varies
fastest. The group of an axis holds the ranks that differ only in that axis' coordinate.

:class:`AbstractMesh` has names and sizes only (JAX's ``AbstractMesh``): the planner and most
tests reason about it without any process group. :class:`Mesh` adds the groups.
"""

from __future__ import annotations

import contextvars
import datetime
import os
from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np

from ..errors import ShardingError
from .checks import env_flag
from .comm import CommCounter
from .nccl_env import ASYNC_ERROR_HANDLING, nccl_environment  # (re-exported: init_mesh sets it)

__all__ = ["AbstractMesh", "Mesh", "init_mesh", "current_mesh", "default_timeout", "nccl_environment"]

Axis = Union[str, Sequence[str], None]

_CURRENT: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar("shardlib_mesh", default=None)
_DEFAULT: list["Mesh"] = []  # the mesh init_mesh made last; read only by current_mesh()


def env_seconds(name: str, default: str) -> float:
    """The environment variable ``name`` as a positive, finite number of seconds.

    Raises:
        ShardingError: it is not one (naming the variable, its value and the default)."""
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ShardingError(f"{name}={text!r}: it must be a positive number of seconds (default {default})")
    return value


def default_timeout() -> datetime.timedelta:
    """Timeout of every collective, from ``SHARDLIB_TIMEOUT`` (seconds, default 600).

    Raises:
        ShardingError: the variable is not a positive, finite number of seconds (named)."""
    return datetime.timedelta(seconds=env_seconds("SHARDLIB_TIMEOUT", "600"))


def _timeout(timeout, where: str) -> datetime.timedelta:
    """``timeout`` seconds (None: :func:`default_timeout`), checked: a positive number."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: timeout must be a number of seconds, got {timeout!r} ({type(timeout).__name__})")
    if not timeout > 0 or timeout != timeout or timeout == float("inf"):
        raise ShardingError(f"{where}: timeout must be a positive, finite number of seconds, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _check_shape(shape: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(shape, Mapping) or not shape:
        raise ShardingError(
            f"a mesh shape is a non-empty dict from axis name to size, like {{'dp': 2, 'tp': 2}}; got {shape!r}"
        )
    out: dict[str, int] = {}
    for name, size in shape.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardingError(
                f"mesh axis name {name!r} in {dict(shape)} is not a valid name; use identifiers such as 'dp', 'tp', 'pp'"
            )
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or int(size) < 1:
            raise ShardingError(
                f"mesh axis {name!r} has size {size!r} in {dict(shape)}; every axis size must be an integer >= 1 "
                "(a size of 1 is allowed and costs nothing)"
            )
        out[name] = int(size)
    return out


class AbstractMesh:
    """Named mesh axes and their sizes, seen from one rank; no process groups.

    Args:
        shape: ``{axis_name: size}``, outer axis first (the last axis varies fastest over ranks).
        rank: the global rank whose coordinates :meth:`index` reports (default 0).

    Raises:
        ShardingError: an empty shape, an axis name that is not an identifier, a size < 1, or a
            rank outside ``[0, product of sizes)``.

    Example:
        >>> m = AbstractMesh({"dp": 2, "tp": 2}, rank=3)
        >>> m.index("dp"), m.index("tp"), m.size(), m.size(("dp", "tp"))
        (1, 1, 4, 4)
    """

    def __init__(self, shape: Mapping[str, int], rank: int = 0):
        self._shape = _check_shape(shape)
        self._grid = np.arange(int(np.prod(list(self._shape.values())))).reshape(tuple(self._shape.values()))
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"AbstractMesh: rank {rank!r} is not an int; the mesh {self._shape} has ranks 0.."
                            f"{self._grid.size - 1}")
        if not 0 <= rank < self._grid.size:
            raise ShardingError(f"rank {rank} is outside the mesh {self._shape} of {self._grid.size} ranks")
        self.rank = int(rank)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self._shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._shape)

    def _axes(self, axis: Axis) -> tuple[str, ...]:
        if axis is None:
            return self.axis_names
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        for name in names:
            if name not in self._shape:
                raise ShardingError(f"axis {name!r} is not in the mesh {self._shape}; its axes are {list(self._shape)}")
        if len(set(names)) != len(names):
            raise ShardingError(f"axes {names} name an axis twice")
        return names

    # size, coords and index are plain integer arithmetic (no numpy): the parallel layers call
    # them inside forward, where torch.compile traces them as constants (numpy there became
    # tensor ops, and ``int()`` of one a graph break at ``aten._local_scalar_dense``)
    def size(self, axis: Axis = None) -> int:
        """Number of ranks along ``axis`` (a name or tuple of names; ``None``: the whole mesh)."""
        n = 1
        for a in self._axes(axis):
            n *= self._shape[a]
        return n

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{axis: coordinate}`` of ``rank`` (default: this mesh's rank).

        Raises:
            ShardingError: ``rank`` is outside the mesh."""
        rank = int(self.rank if rank is None else rank)
        world = self.size()
        if not 0 <= rank < world:
            raise ShardingError(f"rank {rank} is outside the mesh {self._shape} of {world} ranks")
        coords: dict[str, int] = {}
        for name in reversed(self._shape):  # the last axis varies fastest
            rank, coords[name] = divmod(rank, self._shape[name])
        return {name: coords[name] for name in self._shape}

    def index(self, axis: Axis) -> int:
        """This rank's coordinate along ``axis``; over a tuple of axes, the linear index (first outer)."""
        coords = self.coords()
        index = 0
        for name in self._axes(axis):
            index = index * self._shape[name] + coords[name]
        return index

    def group_axes(self, axis: Axis) -> tuple[str, ...]:
        """The axes of ``axis`` in mesh order: the names its process group is known by.

        ``torch.distributed.new_group`` sorts the ranks it is given, so the place of a rank in
        the group of several axes (its *group rank*, which sets where ``all_gather_into_tensor``
        and ``reduce_scatter_tensor`` put its data) is its linear index over the axes in mesh
        order, whatever order they are named in: ``("fsdp", "dp")`` and ``("dp", "fsdp")`` are
        one group, with one rank order.

        Example:
            >>> AbstractMesh({"dp": 2, "fsdp": 2}).group_axes(("fsdp", "dp"))
            ('dp', 'fsdp')
        """
        names = self._axes(axis)
        if len(names) < 2:
            return names
        return tuple(n for n in self._shape if n in names)

    def group_index(self, axis: Axis) -> int:
        """This rank's rank in the process group of ``axis``: :meth:`index` over
        :meth:`group_axes`, the slot it owns in every flat buffer a collective over ``axis``
        fills (:func:`~shardlib.mesh.raw.raw_all_gather`, ZeRO's shards). Equal to
        :meth:`index` for a single axis or axes named in mesh order.

        Example:
            >>> m = AbstractMesh({"dp": 2, "fsdp": 2}, rank=1)  # dp 0, fsdp 1
            >>> m.index(("fsdp", "dp")), m.group_index(("fsdp", "dp"))
            (2, 1)
        """
        return self.index(self.group_axes(axis))

    def axis_ranks(self, axis: Axis, rank: int | None = None) -> list[int]:
        """Global ranks in ``rank``'s group along ``axis``, ordered by their index along it."""
        names = self._axes(axis)
        coords = self.coords(rank)
        order = [n for n in self._shape if n not in names] + list(names)
        grid = self._grid.transpose([list(self._shape).index(n) for n in order])
        fixed = tuple(coords[n] for n in self._shape if n not in names)
        return [int(r) for r in grid[fixed].reshape(-1)]

    def all_groups(self, axis: Axis) -> list[list[int]]:
        """Every group along ``axis`` (lists of global ranks), in a fixed order all ranks agree on."""
        names = self._axes(axis)
        others = [n for n in self._shape if n not in names]
        order = others + list(names)
        grid = self._grid.transpose([list(self._shape).index(n) for n in order])
        return [list(map(int, row)) for row in grid.reshape(-1, self.size(names))]

    def abstract(self) -> "AbstractMesh":
        return AbstractMesh(self._shape, self.rank)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {v}" for k, v in self._shape.items())
        return f"{type(self).__name__}({{{inner}}}, rank={self.rank})"

    def __eq__(self, other) -> bool:
        return isinstance(other, AbstractMesh) and self._shape == other._shape and self.rank == other.rank

    def __hash__(self) -> int:
        return hash((tuple(self._shape.items()), self.rank))


# One cache of groups per process, keyed by the default group and the ranks: new_group must be
# called collectively by every rank in the same order, so reuse keeps meshes cheap in test pools.
# The key holds the default group itself, not its id: a destroyed group's id is reused by the next
# init_process_group (seen on the fake backend, which a dry run re-initializes as each rank).
_GROUP_CACHE: dict[tuple, object] = {}


class Mesh(AbstractMesh):
    """A mesh over the ranks of the initialized default process group.

    Args:
        shape: ``{axis_name: size}``; the product must equal ``torch.distributed`` world size.
        timeout: seconds each collective may take before it fails (default
            :func:`default_timeout`).

    Attributes:
        comm: a :class:`~shardlib.mesh.comm.CommCounter` of logical bytes by axis and kind.
        trace: this process's :class:`~shardlib.mesh.trace.Trace` of the collectives it issued.
        watchdog: the :class:`~shardlib.mesh.watchdog.Watchdog` bounding and diagnosing waits
            (None in a one-process world).
        device: the ``torch.device`` every tensor handed to ``torch.distributed`` lives on: this
            process's CUDA device on NCCL (``torch.cuda.current_device()``), else the CPU; a dry
            run sets ``meta`` (:mod:`shardlib.dryrun`). With ``SHARDLIB_CHECK_COLLECTIVES=1`` (on
            in the tests) every call checks it (:func:`shardlib.mesh.guard.post`).
        native: whether flat-buffer all-gathers and reduce-scatters use torch's
            ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (True on NCCL and the fake
            group) or direct point-to-point exchanges (gloo, where they are faster:
            :mod:`.raw`). ``SHARDLIB_NATIVE_COLLECTIVES=1`` forces the native calls on
            gloo, so the CPU tests run the NCCL branch too.

    Raises:
        ShardingError: bad shape, or a product of sizes different from the world size.

    Nothing hangs. On gloo every wait is bounded by ``timeout`` through shardlib's watchdog,
    which names the rank that stalled or left (:mod:`.watchdog`). On NCCL a wait only makes the
    current CUDA stream wait (the host goes on); the bound is the process group's timeout, which
    torch's NCCL watchdog thread enforces: it logs the timed-out collective with this rank
    (``[Rank N] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=...)``)
    and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3 (:func:`nccl_environment`), ends the
    process, so the launcher stops the others.

    Use :func:`init_mesh` rather than this constructor; ``with mesh:`` makes it the mesh that
    collectives use when none is passed.
    """

    def __init__(self, shape: Mapping[str, int], timeout: float | None = None):
        import torch.distributed as dist

        shape = _check_shape(shape)
        world = dist.get_world_size() if dist.is_initialized() else 1
        product = int(np.prod(list(shape.values())))
        if product != world:
            raise ShardingError(
                f"the mesh {shape} has {product} ranks but the world size is {world}. "
                f"Fix: choose axis sizes whose product is {world}, or launch {product} processes "
                f"(torchrun --nproc-per-node {product})"
            )
        super().__init__(shape, dist.get_rank() if dist.is_initialized() else 0)
        self.timeout = _timeout(timeout, "Mesh")
        self.comm = CommCounter()
        self.backend = dist.get_backend() if dist.is_initialized() else "gloo"
        self.device = _comm_device(self.backend)
        self.native = self.backend != "gloo" or env_flag("SHARDLIB_NATIVE_COLLECTIVES")
        from .watchdog import process_watchdog

        self.trace, self.watchdog = process_watchdog(self)
        self._groups: dict[tuple[str, ...], object] = {}
        for name in self.axis_names:
            self.group(name)
        self._tokens: list = []

    @property
    def fake(self) -> bool:
        """Whether the default group is torch's fake backend (``init_process_group("fake",
        store=FakeStore(), rank=R, world_size=W)``): every collective completes at once and moves
        nothing, so one process can be any rank of a large world (a dry run: shapes, memory and
        counted bytes are those of rank ``R``; values are not). There is no watchdog (no peers),
        and a pipeline receives zeros of the planned shape (a fake receive fills no buffer)."""
        return self.backend == "fake"

    def group(self, axis: Axis, channel: int = 0):
        """The ``ProcessGroup`` of this rank along ``axis`` (a name or a tuple of names).

        ``channel`` > 0 gives another group over the same ranks: collectives on different
        channels are ordered independently (ZeRO-3 reduces gradients on channel 1 while
        parameters are gathered on channel 0, so the two streams cannot pair up across ranks).
        Groups for tuples of axes and other channels are created on first use: every rank must
        ask for them in the same order (true of SPMD code), as ``torch.distributed.new_group``
        requires. A tuple of axes names one group whatever their order (:meth:`group_axes`);
        this rank's rank in it is :meth:`group_index`.
        """
        import torch.distributed as dist

        names = self.group_axes(axis)
        key_names = names if channel == 0 else names + (f"#{channel}",)
        if key_names not in self._groups:
            if not dist.is_initialized():
                self._groups[key_names] = None
                return None
            mine = None
            for ranks in self.all_groups(names):
                key = (dist.group.WORLD, tuple(ranks), self.timeout, channel)
                if key not in _GROUP_CACHE:
                    _GROUP_CACHE[key] = self._new_group(names, ranks)
                if self.rank in ranks:
                    mine = _GROUP_CACHE[key]
            self._groups[key_names] = mine
        return self._groups[key_names]

    def _new_group(self, names: tuple[str, ...], ranks: list[int]):
        """``dist.new_group(ranks)``: every rank of the world makes it, at the same point. A rank
        that asks for a group the others never ask for (a collective over a tuple of axes on
        some ranks only) waits for the timeout in torch's store, which said only "wait timeout
        ... keys: /default_pg/0//5//cpu//0/1" (found by a new user).

        Raises:
            CollectiveTimeoutError: the other ranks did not make the group within ``timeout``."""
        import torch.distributed as dist

        try:
            return dist.new_group(ranks, timeout=self.timeout, backend=self.backend)
        except RuntimeError as exc:  # DistStoreError under torchrun; "Wait timeout" from other stores
            if not isinstance(exc, dist.DistStoreError) and "timeout" not in str(exc).lower():
                raise
            from ..errors import CollectiveTimeoutError

            raise CollectiveTimeoutError(
                f"rank {self.rank} waited {self.timeout.total_seconds():.0f} s (SHARDLIB_TIMEOUT) for the other ranks to "
                f"make the process group of mesh axes {names} (ranks {list(ranks)}), which this rank needs for its first "
                f"collective over {names}: they never did. Every rank must run the same collectives in the same order "
                f"(SPMD): a collective over {names} on some ranks only does this. (torch: {str(exc)[:200]})") from exc

    def __enter__(self) -> "Mesh":
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())


def _comm_device(backend: str):
    """The device collectives of ``backend`` take tensors on: NCCL's is the current CUDA device
    (``init_mesh`` sets it from ``LOCAL_RANK``), gloo's and the fake group's the CPU."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current_mesh() -> Mesh:
    """The mesh of the innermost ``with mesh:`` block, else the last one :func:`init_mesh` made.

    Raises:
        ShardingError: no mesh exists yet.
    """
    mesh = _CURRENT.get() or (_DEFAULT[-1] if _DEFAULT else None)
    if mesh is None:
        raise ShardingError("no mesh: call init_mesh({'dp': N, ...}) first, or pass mesh=")
    return mesh


def _destroy_at_exit() -> None:
    """Destroy the process group init_mesh made when the interpreter exits: left to the C++
    destructors, gloo's threads may abort the process at exit ("terminate called without an
    active exception", seen in 2-3 of 6 two-rank runs that end right after a collective)."""
    import atexit

    def destroy():
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

    atexit.register(destroy)


def init_mesh(shape: Mapping[str, int], timeout: float | None = None) -> Mesh:
    """Create a :class:`Mesh`, initializing ``torch.distributed`` first if needed.

    Reads the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and picks
    NCCL when CUDA is available, else gloo. Without that environment and with a one-rank
    shape, a single-process gloo group is made, so the same script runs unlaunched.

    Every collective is bounded by ``timeout``. On gloo shardlib's watchdog enforces it and
    names the failing rank. On NCCL the process group's timeout does, through torch's NCCL
    watchdog, which logs the failing collective with its rank; before making an NCCL group
    this sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` unless it is set (:func:`nccl_environment`),
    so the process then ends instead of hanging.

    Args:
        shape: ``{axis: size}``, outer to inner; the product must equal the world size.
        timeout: seconds before a collective fails (default ``SHARDLIB_TIMEOUT`` or 600).

    Returns:
        The mesh; it also becomes the default mesh for collectives called without ``mesh=``.

    Raises:
        ShardingError: bad shape (empty, size < 1, bad name), a product != world size, or a
            timeout that is not positive; raised on every rank, before any communication.
        TypeError: a timeout that is not a number.

    Example:
        >>> mesh = init_mesh({"dp": 1})
        >>> mesh.size("dp"), mesh.index("dp")
        (1, 0)
    """
    import torch
    import torch.distributed as dist

    shape = _check_shape(shape)
    product = int(np.prod(list(shape.values())))
    tmo = _timeout(timeout, "init_mesh")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if product != world:  # checked before the rendezvous, so no rank waits for the others
                raise ShardingError(
                    f"the mesh {shape} has {product} ranks but WORLD_SIZE is {world}. "
                    f"Fix: choose axis sizes whose product is {world}, or launch {product} processes"
                )
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                nccl_environment()  # read by ProcessGroupNCCL when it is created, just below
            dist.init_process_group(backend, timeout=tmo)
            _destroy_at_exit()
        elif product == 1:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=tmo)
            _destroy_at_exit()
        else:
            raise ShardingError(
                f"the mesh {shape} needs {product} processes but torch.distributed is not initialized and "
                "no torchrun environment is set. Fix: run under `torchrun --nproc-per-node "
                f"{product} script.py`, or use shardlib.launch(fn, {product}) in a notebook"
            )
    mesh = Mesh(shape, timeout=tmo.total_seconds())
    _DEFAULT[:] = [mesh]
    return mesh
