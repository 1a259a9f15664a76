"""The executor of a pipeline step's transfer program (:mod:`.p2p`) on a process group.

:class:`Transfers` posts each :class:`~.p2p.Post` (one ``batch_isend_irecv`` on the native
path, each ``isend`` / ``irecv`` on its own on gloo; through :func:`shardlib.mesh.guard.post`,
every tensor on ``mesh.device``), waits for a receive just
before its use, reads shape headers, and waits for what is left at the end of the step.

Waits. On NCCL a wait orders the compute stream after the transfer and returns at once. On gloo
a wait blocks the host: the main thread waits for a receive's work itself, just before its use
(gloo's thread wakes it, as in torch's own schedules), watched by the watchdog's answering
thread (:mod:`shardlib.mesh.watchdog`: a point-to-point wait that times out closes the pair, so
it is not sliced; a hang is diagnosed from that thread). Sends are waited for once, all at the
end of the step.
"""

from __future__ import annotations

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


class _Batch:
    """One posted batch: its works, the message each operation carries (``None``: a send), their
    trace records and the indices waited for."""

    __slots__ = ("works", "slots", "recs", "waited")

    def __init__(self, works: list, slots: list, recs: list):
        self.works, self.slots, self.recs, self.waited = works, slots, recs, set()


class Transfers:
    """The transfers of one pipeline rank (see the module doc).

    Args:
        mesh, axis: the mesh and its pipeline axis.
        fake: torch's fake group (a dry run): operations posted one by one (its
            ``batch_isend_irecv`` takes no meta tensors), receive buffers zeros (nothing arrives).
        owners: ``{stage: pp rank}`` (the schedule's placement), which names each message's peer.

    Attributes:
        inbox: receive buffers by message, for the step running (valid once waited for).
        outbox: tensors to send by message (filled by the step's actions).
    """

    def __init__(self, mesh, axis: str, fake: bool, owners: dict[int, int]):
        self.mesh, self.axis, self.fake, self.owners = mesh, axis, fake, owners
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
        device, mesh, owners = self.mesh.device, self.mesh, self.owners
        ops = []  # (send?, tensor, the peer's index on the axis = its rank in the axis's group, message)
        for msg in ins.sends:
            if msg.header:
                t = _header(self.outbox[Message(msg.kind, msg.stage, msg.microbatch)], device)
            else:
                t = self.outbox.pop(msg)
            ops.append((True, t, owners[msg.dst_stage], msg))
        alloc = torch.zeros if self.fake else torch.empty
        for msg in ins.recvs:
            if msg.header:
                buf = torch.empty(_HEADER, dtype=torch.int64, device=device)
            else:
                shape, dtype = shapes[("in" if msg.kind == ACTIVATION else "out", msg.dst_stage)]
                buf = alloc(shape, dtype=dtype, device=device)
            ops.append((False, buf, owners[msg.stage], msg))
            self.inbox[msg] = buf
        works = self._issue(ops)
        recs, slots = [], []
        for send, t, peer, msg in ops:
            if send and not msg.header:
                mesh.comm.record(self.axis, "send", t.numel() * t.element_size(), 2)
            recs.append(self._trace("send" if send else "recv", t, msg, self.ranks[peer]))
            slots.append(None if send else msg)
        self._batches[ins.batch] = _Batch(works, slots, recs)

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
        """Wait for the receives of batch ``batch`` before ``msg``'s use: every receive of the
        batch not waited for yet (a program waits once per batch, and a wait makes all of that
        batch's receives ready), or, with ``msg`` ``None``, all that is left of the batch."""
        b = self._batches[batch]
        if msg is None or len(b.works) != len(b.slots):
            todo = [i for i in range(len(b.works)) if i not in b.waited]
        else:  # gloo: a work per operation; the batch's sends wait for the end of the step
            todo = [i for i, slot in enumerate(b.slots) if slot is not None and i not in b.waited]
        self._wait(b, todo, b.slots.index(msg) if msg is not None else None)

    def _wait(self, b: _Batch, todo: list, rec_index: int | None) -> None:
        if not todo:
            return
        rec = b.recs[todo[0] if rec_index is None else rec_index]
        wait_works(self.mesh, [b.works[i] for i in todo], rec, True)
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
        wait_works(self.mesh, [b.works[i] for b, i in left], left[0][0].recs[left[0][1]], True)
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
