"""The executor of a pipeline step's transfer program (:mod:`.p2p`) on a process group.

:class:`Transfers` posts each :class:`~.p2p.Post` (one ``batch_isend_irecv`` on the native
path, each ``isend`` / ``irecv`` on its own on gloo; through :func:`shardlib.mesh.guard.post`,
every tensor on ``mesh.device``), waits for a receive just
before its use, reads shape headers, and waits for what is left at the end of the step.

Waits. On NCCL a wait orders the compute stream after the transfer and returns at once. On gloo
a wait blocks the host, and a point-to-point wait that times out closes the pair, so the
watchdog (:mod:`shardlib.mesh.watchdog`) waits for point-to-point works on a helper thread
while the main thread waits for its signal in slices, diagnosing a hang: a hop between threads
(two context switches, on the critical path) per wait. A pipeline posts its receives ahead, so
on gloo their works go, at posting time, to a prefetch thread (:class:`_Prefetch`) that waits
for them in posting order (the order the program's rounds complete in, see
:func:`~.p2p.transfer_program`); the wait before a receive's use then finds it done, without a
hop, and one not done yet is waited for through the watchdog as any gloo work (sliced,
diagnosed). Sends are waited for once, all at the end of the step.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from ..errors import ShardingError
from ..mesh.guard import native_all_gather, post, wait_works
from .p2p import ACTIVATION, Message, Post

__all__ = ["Transfers"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
_HEADER = 10  # int64: dims, up to 8 sizes, dtype


def _dtype_id(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise ShardingError(f"pipeline transfers carry {', '.join(str(d).replace('torch.', '') for d in _DTYPES)}; "
                            f"a stage output of dtype {dtype} cannot be sent. Fix: cast it to one of these")
    return _DTYPES.index(dtype)


def _header(t: torch.Tensor, device) -> torch.Tensor:
    """The shape header of activation ``t`` (a handshake's first over its boundary)."""
    if t.dim() > _HEADER - 2:
        raise ShardingError(f"pipeline transfers carry tensors of up to {_HEADER - 2} dimensions; a stage output of shape "
                            f"{tuple(t.shape)} cannot be sent. Fix: reshape it at the end of the stage")
    return torch.tensor([t.dim(), *t.shape, *([0] * (_HEADER - 2 - t.dim())), _dtype_id(t.dtype)], dtype=torch.int64,
                        device=device)


def _read_header(h: torch.Tensor) -> tuple:
    """``(shape, dtype)`` from a header (a host sync: once per input signature and boundary)."""
    v = h.tolist()
    return tuple(v[1:1 + v[0]]), _DTYPES[v[-1]]


class _Done:
    """A work-like handle of a prefetched work, for :meth:`Watchdog.wait
    <shardlib.mesh.watchdog.Watchdog.wait>`: a wait of a slice that does not see it end raises a
    "timed out" error (a slice, as the watchdog's own ``_Call``); the helper's error re-raised."""

    __slots__ = ("event", "error")

    def __init__(self):
        self.event, self.error = threading.Event(), None

    def wait(self, timeout=None) -> bool:
        if not self.event.wait(None if timeout is None else timeout.total_seconds()):
            raise TimeoutError("timed out (a slice of the watchdog's wait; the prefetched transfer runs on)")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.event.is_set()

    def ok(self) -> bool:
        """Done without an error: nothing left to wait for."""
        return self.event.is_set() and self.error is None


class _Prefetch:
    """A thread that waits for works in the order they are given (gloo's point-to-point
    receives, each under the mesh timeout), marking each :class:`_Done`."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, works: list, timeout) -> list[_Done]:
        """Handles of ``works``, waited for in this order (one wake of the thread per call)."""
        done = [_Done() for _ in works]
        self._q.put((works, timeout, done))
        return done

    def _run(self) -> None:
        while True:
            works, timeout, done = self._q.get()
            for work, d in zip(works, done):
                try:
                    work.wait(timeout)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    d.error = exc
                d.event.set()


_PREFETCH: list = []


def _prefetch() -> _Prefetch:
    """This process's prefetch thread, made on first use."""
    if not _PREFETCH:
        _PREFETCH.append(_Prefetch("shardlib-pipeline-recv"))
    return _PREFETCH[0]


class _Batch:
    """One posted batch: its works, the message each operation carries (``None``: a send), their
    trace records, prefetch handles (gloo) and the indices waited for."""

    __slots__ = ("works", "slots", "recs", "done", "waited")

    def __init__(self, works: list, slots: list, recs: list, done: list | None):
        self.works, self.slots, self.recs, self.done, self.waited = works, slots, recs, done, set()


class Transfers:
    """The transfers of one pipeline rank (see the module doc).

    Args:
        mesh, axis: the mesh and its pipeline axis.
        fake: torch's fake group (a dry run): operations posted one by one (its
            ``batch_isend_irecv`` takes no meta tensors), receive buffers zeros (nothing arrives).

    Attributes:
        inbox: receive buffers by message, for the step running (valid once waited for).
        outbox: tensors to send by message (filled by the step's actions).
    """

    def __init__(self, mesh, axis: str, fake: bool):
        self.mesh, self.axis, self.fake = mesh, axis, fake
        self.p = mesh.size(axis)
        self.ranks = mesh.axis_ranks(axis)
        self.group = mesh.group(axis)
        self.inbox: dict[Message, torch.Tensor] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        self._batches: dict[int, _Batch] = {}
        self._tag, self._what = 0, ""

    def begin(self, tag: int, training: bool) -> None:
        """A new step: messages tagged ``tag``, traced as a training step's or evaluate's."""
        self.inbox, self.outbox, self._batches = {}, {}, {}
        self._tag, self._what = tag, "a training step" if training else "evaluate"

    def _trace(self, kind: str, t: torch.Tensor, msg: Message, peer: int) -> dict:
        trace = self.mesh.trace
        return trace.record(kind, trace.label(self.mesh, (self.axis,), 0), t.shape, t.dtype,
                            f"{msg.kind} of stage {msg.stage} microbatch {msg.microbatch} of {self._what} "
                            f"{'to' if kind == 'send' else 'from'} rank {peer}")

    def post(self, ins: Post, shapes: dict) -> None:
        """Post one batch: ``ins.sends`` from :attr:`outbox`, ``ins.recvs`` into fresh buffers on
        the mesh's device, sized by ``shapes`` (``{("in" | "out", stage): (shape, dtype)}``).

        With :attr:`Mesh.native <shardlib.mesh.Mesh.native>` (NCCL) the batch is one
        ``batch_isend_irecv`` (one NCCL group); otherwise (gloo, whose ``batch_isend_irecv`` issues
        its operations one by one anyway, and torch's fake group, whose ``batch_isend_irecv`` takes
        no meta tensors) each is an ``isend`` / ``irecv`` in the batch's order. The operations are
        issued first and traced and counted after, so a send leaves as soon as the compute that
        made it ends (the Python between the two is on the pipeline's critical path)."""
        device, mesh, p = self.mesh.device, self.mesh, self.p
        ops = []  # (send?, tensor, the peer's index on the axis = its rank in the axis's group, message)
        for msg in ins.sends:
            if msg.header:
                t = _header(self.outbox[Message(msg.kind, msg.stage, msg.microbatch)], device)
            else:
                t = self.outbox.pop(msg)
            ops.append((True, t, msg.dst_stage % p, msg))
        alloc = torch.zeros if self.fake else torch.empty
        for msg in ins.recvs:
            if msg.header:
                buf = torch.empty(_HEADER, dtype=torch.int64, device=device)
            else:
                shape, dtype = shapes[("in" if msg.kind == ACTIVATION else "out", msg.dst_stage)]
                buf = alloc(shape, dtype=dtype, device=device)
            ops.append((False, buf, msg.stage % p, msg))
            self.inbox[msg] = buf
        works = self._issue(ops)
        recs, slots = [], []
        for send, t, peer, msg in ops:
            if send and not msg.header:
                mesh.comm.record(self.axis, "send", t.numel() * t.element_size(), 2)
            recs.append(self._trace("send" if send else "recv", t, msg, self.ranks[peer]))
            slots.append(None if send else msg)
        done = None
        if ins.recvs and mesh.backend == "gloo" and mesh.watchdog is not None and len(works) == len(ops):
            first = len(ins.sends)  # the receives' works (the sends are waited for at the end of the step)
            done = [None] * first + _prefetch().submit(works[first:], mesh.timeout)
        self._batches[ins.batch] = _Batch(works, slots, recs, done)

    def _issue(self, ops: list) -> list:
        """The works of ``ops`` (see :meth:`post`): one ``batch_isend_irecv`` on the native path,
        else each operation on its own, the peer named by its rank in the group."""
        mesh, tag, group = self.mesh, self._tag, self.group
        if mesh.native and not self.fake:
            return post(mesh, dist.batch_isend_irecv, [dist.P2POp(dist.isend if send else dist.irecv, t, self.ranks[peer],
                                                                  group, tag) for send, t, peer, _ in ops])
        return [post(mesh, dist.isend, t, group=group, tag=tag, group_dst=peer) if send
                else post(mesh, dist.irecv, t, group=group, tag=tag, group_src=peer) for send, t, peer, _ in ops]

    def wait(self, batch: int, msg: Message | None) -> None:
        """Wait for the work that carries ``msg`` (every work of the batch where the backend made
        one for the whole batch, as NCCL does; ``None``: all that is left of it)."""
        b = self._batches[batch]
        if msg is None or len(b.works) != len(b.slots):
            todo = [i for i in range(len(b.works)) if i not in b.waited]
        else:
            i = b.slots.index(msg)
            todo = [] if i in b.waited else [i]
        self._wait(b, todo, b.slots.index(msg) if msg is not None else None)

    def _wait(self, b: _Batch, todo: list, rec_index: int | None) -> None:
        if not todo:
            return
        rec = b.recs[todo[0] if rec_index is None else rec_index]
        direct = [b.works[i] for i in todo if b.done is None or b.done[i] is None]  # each work waited once, by one thread
        if direct:
            wait_works(self.mesh, direct, rec, True)
        helped = [b.done[i] for i in todo if b.done is not None and b.done[i] is not None and not b.done[i].ok()]
        if helped:  # prefetched receives (gloo) not done yet: their handles, waited in slices by the watchdog
            wait_works(self.mesh, helped, rec, False)
        b.waited.update(todo)

    def read(self, batch: int, msg: Message) -> tuple:
        """Wait for header ``msg`` (batch ``batch``) and return the ``(shape, dtype)`` it carries."""
        self.wait(batch, msg)
        return _read_header(self.inbox.pop(msg))

    def finish(self) -> None:
        """Wait for every work of the step not waited for yet (its last sends), at once."""
        left = [(b, i) for b in self._batches.values() for i in range(len(b.works)) if i not in b.waited]
        if not left:
            return
        rec = left[0][0].recs[left[0][1]]
        direct = [b.works[i] for b, i in left if b.done is None or b.done[i] is None]
        if direct:
            wait_works(self.mesh, direct, rec, True)
        helped = [b.done[i] for b, i in left if b.done is not None and b.done[i] is not None and not b.done[i].ok()]
        if helped:
            wait_works(self.mesh, helped, rec, False)
        for b, i in left:
            b.waited.add(i)

    def check_signature(self, sig: tuple, handshake: bool) -> None:
        """Check mode: every pipeline rank sizes its transfers alike (the step's input shape and
        dtype, autocast, and whether it is that shape's first step), before any transfer.

        Raises:
            ShardingError: on every pipeline rank, naming each rank's step, if they differ."""
        shape, dtype, training = sig[0], sig[1], sig[2]
        device = self.mesh.device
        mine = torch.tensor([int(training), int(handshake), len(shape), *shape, *([-1] * (8 - len(shape))),
                             _dtype_id(dtype), int(sig[3])], dtype=torch.int64, device=device)
        rows = torch.empty(self.p * mine.numel(), dtype=torch.int64, device=device)
        trace = self.mesh.trace
        rec = trace.record("all_gather", trace.label(self.mesh, (self.axis,), 0), mine.shape, mine.dtype,
                           "the pipeline step's input signature (check mode)")
        work = post(self.mesh, native_all_gather(), rows, mine, group=self.group, async_op=True)
        wait_works(self.mesh, [work], rec, False)
        rows = rows.view(self.p, -1).tolist()
        # training or evaluation is left to the tags (see PipelineRunner); what sizes the transfers must agree
        if any(r[1:] != rows[0][1:] for r in rows):
            said = "; ".join(f"pp rank {i}: {'forward_backward' if r[0] else 'evaluate'} of a local batch of shape "
                             f"{tuple(r[3:3 + r[2]])} {str(_DTYPES[r[-2]]).replace('torch.', '')}"
                             f"{' under autocast' if r[-1] else ''}, {'first' if r[1] else 'not the first'} step of "
                             "that shape" for i, r in enumerate(rows))
            raise ShardingError(
                f"pipeline step: the stages of axis {self.axis!r} (mesh {self.mesh.shape}) run different steps: {said}. "
                "Every stage sizes its transfers by the step's input signature, so every rank calls the same "
                "method with a local batch of the same shape and dtype. Fix: pass every rank the same local batch "
                "(only the first stage reads its values)")
