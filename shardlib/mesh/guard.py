"""What every collective goes through besides the transfer: the trace record, the optional
cross-rank check, the post and the bounded wait (:mod:`.trace`, :mod:`.watchdog`).

``begin`` records a collective in this process's trace (always) and, with
``SHARDLIB_CHECK_COLLECTIVES=1``, compares kind, shape and dtype across the group first;
``post`` issues a ``torch.distributed`` call and turns a failure at issue (a peer gone) into a
diagnosed :class:`~shardlib.errors.CollectiveError`; ``wait_works`` waits on gloo through the
watchdog and, on NCCL, only orders the stream; a :class:`Handle` is an in-flight collective
whose ``wait()`` does that and runs the follow-up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mesh import Mesh

__all__ = ["Handle", "begin", "post", "wait_works", "finish", "done_handle", "check_tensors", "native_all_gather", "native_reduce_scatter"]

_OP_NAMES = ("sum", "max", "min", "avg")  # the order of raw._OPS: an op's index is its id in the check


def native_all_gather():
    """torch's flat all-gather: ``all_gather_single`` (torch 2.13 deprecates its old name
    ``all_gather_into_tensor``, a ``FutureWarning`` per call site), else the old name. Looked up
    at each call, so a test that wraps ``torch.distributed`` sees it."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def native_reduce_scatter():
    """torch's flat reduce-scatter: ``reduce_scatter_single`` (2.13's name for
    ``reduce_scatter_tensor``), else the old name."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def wait_works(mesh: Mesh, works, rec, p2p: bool) -> None:
    """Wait for ``works`` under the mesh timeout; on gloo through the watchdog (a stall or a
    lost peer raises a :class:`~shardlib.errors.CollectiveError` naming ranks and collectives)."""
    if mesh.backend != "gloo":
        for w in works:  # NCCL: the current stream waits for the collective, the host goes on (a timeout
            w.wait()     # argument would block the host); the group's timeout bounds it in the NCCL watchdog
    elif mesh.watchdog is not None:
        mesh.watchdog.wait(works, rec, mesh.timeout, p2p)
    else:
        for w in works:
            w.wait(mesh.timeout)


_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "ppermute", "send", "recv")
_DTYPE_IDS: dict = {}


def begin(mesh: Mesh, names: tuple[str, ...], kind: str, t: torch.Tensor, channel: int = 0, note: str = "",
           extra: int = 0, async_op: bool = False):
    """Record a collective in the trace (always) and, with ``SHARDLIB_CHECK_COLLECTIVES=1``,
    compare kind, shape and dtype across the group before it is issued.

    Returns ``(record, verify)``. The check completes here, before the collective is posted
    (so mismatched sizes raise instead of a native abort), except for an async collective on a
    channel > 0: channels other than 0 are ordered independently of the rest (ZeRO reduces
    gradients on channel 1 in the order they become ready, which may follow the data), so
    blocking there could deadlock a correct program; its check is posted in order on the same
    group and ``verify`` compares when the collective is waited on (else ``verify`` is None).
    On torch's fake group (a dry run, :attr:`Mesh.fake`) there is no check: nothing is gathered."""
    trace = mesh.trace
    label = trace.label(mesh, mesh.group_axes(names), channel)  # one label per group, whatever the axis order
    rec = trace.record(kind, label, t.shape, t.dtype, note)
    verify = None
    if trace.compare and kind not in ("send", "recv") and mesh.backend != "fake":  # (a fake group gathers nothing)
        verify = _check(mesh, names, channel, kind, t, extra, rec)
        if not async_op or channel == 0:
            verify()
            verify = None
    return rec, verify


def _check(mesh: Mesh, names, channel: int, kind: str, t: torch.Tensor, extra: int, rec: dict):
    """Debug mode: post an all-gather of a fingerprint (kind, dtype, shape, index on the group,
    ``extra``) over the group; the returned function waits for it and raises
    :class:`~shardlib.errors.CollectiveMismatchError` on every rank of the group if they differ.
    Costs one small collective per collective."""
    n = mesh.size(names)
    if t.dim() > 8:
        return lambda: None
    dtype_id = _DTYPE_IDS.setdefault(str(t.dtype), len(_DTYPE_IDS) + 1)
    fp = [_KINDS.index(kind), dtype_id, t.dim(), *t.shape, *([-1] * (8 - t.dim())), rec["gseq"], extra]
    # on the mesh's device, not the checked tensor's: a tensor on another device is then named by
    # the device check of its own collective, not tripped over as a fingerprint
    mine = torch.tensor(fp, dtype=torch.int64, device=mesh.device)
    out = torch.empty(n * mine.numel(), dtype=torch.int64, device=mesh.device)
    work = post(mesh, native_all_gather(), out, mine, group=mesh.group(names, channel), async_op=True)

    def verify() -> None:
        wait_works(mesh, [work], rec, False)
        rows = out.view(n, -1).tolist()
        if any(r != rows[0] for r in rows):
            _mismatch(mesh, names, rows, rec)

    return verify


def _mismatch(mesh: Mesh, names, rows: list, rec: dict) -> None:
    from ..errors import CollectiveMismatchError
    from .diagnosis import ordinal

    ranks = mesh.axis_ranks(mesh.group_axes(names))  # the gathered rows are in group-rank order
    dtypes = {v: k for k, v in _DTYPE_IDS.items()}

    def say(row):
        kind, extra = _KINDS[row[0]], row[12]
        how = {"all_reduce": f", op {list(_OP_NAMES)[extra]!r}" if 0 <= extra < len(_OP_NAMES) else "",
               "reduce_scatter": f", op {list(_OP_NAMES)[extra]!r}" if 0 <= extra < len(_OP_NAMES) else "",
               "broadcast": f", from index {extra}", "all_to_all": f", split dim {extra // 16}, concat dim {extra % 16}"}
        return (f"{kind}(shape {tuple(row[3:3 + row[2]])}, {dtypes.get(row[1], '?').replace('torch.', '')}"
                + how.get(kind, "") + f"), its {ordinal(row[11] + 1)} on the group")

    detail = "; ".join(f"rank {r}: {say(row)}" for r, row in zip(ranks, rows))
    sites = _peer_sites(mesh, rec, ranks)
    raise CollectiveMismatchError(
        f"collective mismatch on axis {'+'.join(names)!r} (ranks {ranks}, mesh {mesh.shape}): the ranks issued "
        f"different collectives: {detail}. Call sites: {sites}. Every rank of a group must issue the same "
        "collective (kind, shape, dtype) in the same order; the shapes and kinds above show which rank took "
        "another branch (SHARDLIB_CHECK_COLLECTIVES=1 made this check)")


def _peer_sites(mesh: Mesh, rec: dict, ranks: list[int]) -> str:
    """Each rank's call site of this collective, exchanged through the store (best effort, 5 s)."""
    import json
    import time

    dog = mesh.watchdog
    if dog is None:
        return f"rank {mesh.rank}: {_where(rec)}"
    key = f"shardlib/check/{rec['group']}/{rec['gseq']}"
    dog.store.set(f"{key}/{mesh.rank}", json.dumps(_where(rec)))
    got, deadline = {}, time.monotonic() + 5.0
    while len(got) < len(ranks) and time.monotonic() < deadline:
        for r in ranks:
            if r not in got and dog.store.check([f"{key}/{r}"]):
                got[r] = json.loads(dog.store.get(f"{key}/{r}"))
        time.sleep(0.02)
    return "; ".join(f"rank {r}: " + (got[r] if r in got else "(no answer)") for r in ranks)


def _where(rec: dict) -> str:
    """``zero.py:140 from train.py:88 in step`` (the caller alone when it is the site)."""
    if rec["caller"] and not rec["caller"].startswith(rec["site"] + " "):
        return f"{rec['site']} from {rec['caller']}"
    return rec["caller"] or rec["site"]


def post(mesh: Mesh, fn, *args, **kwargs):
    """Issue the ``torch.distributed`` call ``fn(*args, **kwargs)``; on gloo, a failure at issue
    (a peer gone: ``Connection closed by peer``) is diagnosed as a failed wait is, and raised as
    a :class:`~shardlib.errors.CollectiveError` naming the rank that is gone.

    Every ``torch.distributed`` call of shardlib goes through here. With
    ``SHARDLIB_CHECK_COLLECTIVES=1`` (on in the tests) each tensor argument (in a list, or a
    ``P2POp``'s, too) must be on :attr:`Mesh.device` (NCCL rejects a CPU tensor; a dry run's
    device is ``meta``, so CPU tests catch a call site that allocates without ``device=``) and
    contiguous (NCCL's collectives reject a strided tensor, "Tensors must be contiguous", where
    gloo's accept one; its point-to-point operations only warn and move the raw memory, so a
    strided send or receive buffer scrambles the values).

    Raises:
        CollectiveDeviceError: a tensor on another device, or not contiguous (check mode),
            before it is issued."""
    if mesh.trace.check:
        check_tensors(mesh, fn, args, kwargs)
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        from ..errors import CollectiveError

        if mesh.watchdog is None or mesh.backend != "gloo" or isinstance(exc, CollectiveError):
            raise
        mesh.watchdog.fail(exc)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


def _contiguous(t: torch.Tensor) -> bool:
    """NCCL's test (``is_contiguous(suggest_memory_format())``): contiguous, or channels-last."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def check_tensors(mesh: Mesh, fn, args, kwargs) -> None:
    """Raise :class:`~shardlib.errors.CollectiveDeviceError` when a tensor among ``args`` /
    ``kwargs`` of the ``torch.distributed`` call ``fn`` is not on ``mesh.device`` or is not
    contiguous (NCCL's own check: contiguous in the tensor's suggested memory format, so a
    channels-last tensor passes)."""
    want = mesh.device
    for t in _tensors(list(args) + list(kwargs.values())):
        if t.device != want:
            rule = (f"on {t.device}, but the mesh {mesh.shape} communicates on {want} (backend {mesh.backend}; NCCL "
                    "takes CUDA tensors only)", "allocate it with device=mesh.device")
        elif not _contiguous(t):
            rule = (f"with strides {t.stride()}, not contiguous (NCCL refuses it in a collective, and in a send or "
                    "receive moves its raw memory as if it were contiguous)", "pass t.contiguous()")
        else:
            continue
        import traceback

        from ..errors import CollectiveDeviceError

        site = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}"
                     for f in reversed(traceback.extract_stack()[:-2]) if "/mesh/guard.py" not in f.filename), "?")
        raise CollectiveDeviceError(
            f"torch.distributed.{getattr(fn, '__name__', fn)} was given a tensor of shape {tuple(t.shape)} "
            f"({str(t.dtype).replace('torch.', '')}) {rule[0]}. Call site: {site}. Fix: {rule[1]} "
            "(SHARDLIB_CHECK_COLLECTIVES=1 made this check)")


class Handle:
    """An in-flight collective: ``wait()`` blocks (bounded, diagnosed: :mod:`.watchdog`) and runs
    the follow-up."""

    __slots__ = ("_works", "_then", "_mesh", "_rec", "_p2p", "_verify", "done")

    def __init__(self, works=(), then=None, mesh=None, rec=None, p2p=False, verify=None):
        self._works, self._then, self._mesh, self._rec, self._p2p, self.done = works, then, mesh, rec, p2p, False
        self._verify = verify

    def wait(self) -> None:
        if self.done:
            return
        if self._verify is not None:  # the collective check of an async collective, posted before it
            self._verify()
            self._verify = None
        if self._works:
            wait_works(self._mesh, self._works, self._rec, self._p2p)
        if self._then is not None:
            self._then()
        self.done = True


def finish(works, then, mesh: Mesh, async_op: bool, rec=None, p2p: bool = False, verify=None) -> Handle:
    """A :class:`Handle` of ``works``, waited on here unless ``async_op``."""
    handle = Handle(works, then, mesh, rec, p2p, verify)
    if not async_op:
        handle.wait()
    return handle


def done_handle() -> Handle:
    """A handle with nothing to wait for (a group of one rank)."""
    h = Handle()
    h.done = True
    return h
