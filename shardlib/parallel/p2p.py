"""The point-to-point transfers of a pipeline step, planned from the schedule as data.

A schedule (:mod:`.schedules`) says which action each rank runs, and every rank knows every
rank's list. :func:`transfer_program` turns them into one rank's *program*: the instructions
the runner (:class:`~shardlib.parallel.pipeline.PipelineRunner`) executes in order:

- :class:`Post` a batch: one ``torch.distributed.batch_isend_irecv`` of sends and receives;
- :class:`Wait` for a batch just before the action that uses a tensor it receives (on NCCL the
  compute stream waits and the host goes on; on gloo the host waits, bounded by the watchdog);
- :class:`Read` a shape header on the host (the first step of an input shape only);
- :class:`Run` action ``index`` of the rank's list.

Ordering. NCCL pairs the messages between two ranks in the order they are posted and ignores
tags, and with ``batch_isend_irecv`` every batch of a rank runs on one stream, in order: a
batch holding a receive whose sender is not there yet holds back every later batch of that
rank, its sends too. So batches follow *rounds*: the schedule is laid out on a clock
(:func:`action_times`), a message belongs to the round at which the action producing it
ends, and at each round a rank posts one batch with the sends of its action that just ended
and the receives of every message produced for it in that round. Both ends post a message in
the same round and every rank posts its rounds in increasing order, so on each directed pair
the k-th receive is the k-th send (the receiver follows the *sender's* order, whatever order it
uses them in), and round ``t`` completes on every rank once the rounds before it have (the
computes whose outputs round ``t`` sends wait only for earlier rounds): no deadlock, by
induction over rounds. Sends and receives of a round share a batch, so two neighbours that
send to each other at once do not wait for each other (the 1F1B hang of unbatched sends), and
a receive is posted as soon as its message exists, often several actions before its use. A
round that arrives while the rank runs a longer action (a full backward beside one-unit
forwards, as in DualPipeV) has its receives posted before that action: NCCL's stream waits for
the compute issued before a batch, so posted after it they would start only when it ends and
hold back their senders (DualPipeV's makespan grew by 4-6 units on the checked clock). This
keeps each rank's rounds in increasing order, so the induction above still holds.

Kinds. A forward sends its activation; a full backward (``B``) or a split backward's input half
(``I``) sends the input gradient; a split backward's weight half (``W``) sends and receives
nothing. Stage placement comes from the schedule (:func:`~.actions.stage_owners`): two stages on
one rank (the bottom of a V) hand their tensors over in memory, never posted.

Shapes. All microbatches of a step have the first one's shapes (the runner splits the batch
into equal microbatches), so shapes are exchanged once per input signature. In a *handshake*
program (the first step of a signature) the first activation over each stage boundary is
preceded by a header (a :class:`Message` with ``header=True``, a fixed-size tensor) in the same
batch; the receiver reads it on the host between two batches of that round, then posts the
activation's receive. A gradient has the shape of the stage's own output. A *steady* program
(every later step) sends no headers.

gloo. A gloo TCP pair sends a message only once the receiver has posted its receive (the
receiver's notice travels first), so a receive posted after its sender's ``isend`` holds the
data back until the notice arrives and the sender's event-loop thread sends it: latency on the
critical path, and CPU taken from the sender's compute. On gloo, where every operation is
issued on its own and progresses independently, a steady program therefore posts each receive
ahead of its sender's send on the schedule's clock, after the last action of the rank that
ends before that send (:func:`receives_ahead`), rather than at its round; not all at the start
of the step, which delays the first stage's first forward. Under NCCL's in-order batches
a receive posted ahead of the sends its sender needs first would hold back every later batch (a
deadlock), so the native path keeps the rounds.

:mod:`.p2p_check` executes the programs of all ranks on a clock under NCCL's semantics and
gloo's, and checks pairing and freedom from deadlock.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Union

from ..errors import ShardingError
from .actions import Action, stage_owners
from .simulate import action_times

__all__ = ["Message", "Post", "Wait", "Read", "Run", "action_times", "transfer_program", "receives_ahead", "sent_by",
           "needed_by", "is_local"]

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer of a step.

    Attributes:
        kind: ``"activation"`` (a forward's output, to ``stage + 1``) or ``"gradient"`` (a
            backward's input gradient, to ``stage - 1``).
        stage: the sending stage.
        microbatch: the microbatch.
        header: the shape header sent just before the first activation over this boundary (a
            handshake step's only extra messages).
    """

    kind: str
    stage: int
    microbatch: int
    header: bool = False

    @property
    def dst_stage(self) -> int:
        return self.stage + 1 if self.kind == ACTIVATION else self.stage - 1

    def __str__(self) -> str:
        return f"{'header of ' if self.header else ''}{self.kind} {self.stage}->{self.dst_stage} mb{self.microbatch}"


@dataclass(frozen=True)
class Post:
    """Post batch ``batch``: ``sends`` then ``recvs``, in order, in one ``batch_isend_irecv``."""

    batch: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True)
class Wait:
    """Wait for batch ``batch`` before ``message`` (received there) is used; ``None``: the
    batch's sends, at the end of the step."""

    batch: int
    message: Message | None


@dataclass(frozen=True)
class Read:
    """Wait on the host for batch ``batch`` and read the shape header ``message`` from it."""

    batch: int
    message: Message


@dataclass(frozen=True)
class Run:
    """Run action ``index`` of the rank's action list."""

    index: int


Instruction = Union[Post, Wait, Read, Run]


def sent_by(a: Action, n_stages: int) -> Message | None:
    """The message action ``a`` sends: a forward's output (but the last stage's), a backward's
    (``B`` or ``I``) input gradient (but the first stage's); a ``W`` sends nothing."""
    if a.kind == "F":
        return Message(ACTIVATION, a.stage, a.microbatch) if a.stage < n_stages - 1 else None
    if a.kind == "W":
        return None
    return Message(GRADIENT, a.stage, a.microbatch) if a.stage > 0 else None


def needed_by(a: Action, n_stages: int) -> Message | None:
    """The message action ``a`` receives before it runs: a forward's input (but the first
    stage's), a backward's (``B`` or ``I``) output gradient (but the last stage's); a ``W`` none."""
    if a.kind == "F":
        return Message(ACTIVATION, a.stage - 1, a.microbatch) if a.stage > 0 else None
    if a.kind == "W":
        return None
    return Message(GRADIENT, a.stage + 1, a.microbatch) if a.stage < n_stages - 1 else None


def is_local(msg: Message, owners: dict[int, int]) -> bool:
    """Whether ``msg`` goes between two stages of one rank (the bottom of a V): handed over in
    memory, never posted."""
    return owners[msg.stage] == owners[msg.dst_stage]


def _layout(schedule: list[list[Action]], who: str, backward_cost: int) -> tuple:
    """``(p, n_stages, owners, times)`` of a schedule of ``p >= 2`` ranks, its actions laid out
    by :func:`action_times`.

    Raises:
        ShardingError: fewer than 2 ranks (naming ``who``), or a schedule that deadlocks."""
    p = len(schedule)
    if p < 2:
        raise ShardingError(f"{who}: a pipeline has at least 2 ranks, got a schedule of {p}")
    n_stages = 1 + max(a.stage for acts in schedule for a in acts)
    return p, n_stages, stage_owners(schedule), action_times(schedule, backward_cost)


def _sends(schedule: list[list[Action]], rank: int, n_stages: int, handshake: bool, owners: dict) -> list[list[Message]]:
    """Per action of ``rank``, the messages it posts, in order (a header first in a handshake;
    none to a stage of its own)."""
    out, headed = [], set()
    for a in schedule[rank]:
        m = sent_by(a, n_stages)
        msgs = []
        if m is not None and not is_local(m, owners):
            if handshake and m.kind == ACTIVATION and m.stage not in headed:
                headed.add(m.stage)
                msgs.append(Message(ACTIVATION, m.stage, m.microbatch, header=True))
            msgs.append(m)
        out.append(msgs)
    return out


def transfer_program(schedule: list[list[Action]], rank: int, handshake: bool = False,
                     backward_cost: int = 2) -> tuple[Instruction, ...]:
    """The instructions ``rank`` executes for one step of ``schedule`` (see the module doc).

    Rounds. The schedule is laid out on a clock (:func:`action_times`); a message belongs to
    the round at which the action that produces it ends. At each round a rank posts one batch:
    the sends of its action that ended then and the receives of every message produced then
    for it, in the senders' order. Both ends of every message post it in the same round, and
    every rank posts its rounds in increasing order, so on each directed pair the k-th receive
    is the k-th send, and under NCCL's in-order streams round ``t`` completes on every rank
    once rounds before ``t`` have (by induction over rounds: the computes that produce round
    ``t``'s sends only wait for earlier rounds). A receive is thus posted as soon as its
    message exists, often several actions before its use, and waited for just before it.

    Args:
        schedule: every rank's action list (``build_schedule(...)``; for an evaluation, every
            rank's forwards only), ``p >= 2`` ranks.
        rank: the pipeline rank.
        handshake: the first step of an input signature: a header before the first activation
            over each boundary; the receiver reads it on the host (between two batches of the
            same round) before it posts that activation's receive.
        backward_cost: the clock's backward (a forward is 1): only the order of rounds
            depends on it.

    Returns:
        A tuple of :class:`Post`, :class:`Wait`, :class:`Read` and :class:`Run`.
    """
    p, n_stages, owners, times = _layout(schedule, "transfer_program", backward_cost)
    sends = {q: _sends(schedule, q, n_stages, handshake, owners) for q in range(p)}
    recv_at: dict[int, list[Message]] = {}  # round -> messages for this rank, by sender rank then order
    send_at: dict[int, list[Message]] = {}
    for q in range(p):
        for k, msgs in enumerate(sends[q]):
            t = times[q][k][1]
            for m in msgs:
                if owners[m.dst_stage] == rank:
                    recv_at.setdefault(t, []).append(m)
                if q == rank:
                    send_at.setdefault(t, []).append(m)
    starts = {times[rank][k][0]: k for k in range(len(schedule[rank]))}
    # a round that arrives while this rank runs a longer action (start < t < end): its receives
    # are posted before that action (so they start with it, not after it: NCCL's stream waits for
    # the compute issued before a batch), its header reads and the rest at the round itself
    ahead: dict[int, list[int]] = {}
    for k, (begin, end) in enumerate(times[rank]):
        ahead[k] = sorted(t for t in recv_at if begin < t < end)
    early = {t for ts in ahead.values() for t in ts}

    def parts(t: int) -> tuple[list[Message], list[Message]]:
        """Round ``t``'s receives: those posted at once, and the activations whose header is
        read from that batch first (a handshake's first over each boundary)."""
        recvs = recv_at.get(t, [])
        later = [m for m in recvs if not m.header and m.kind == ACTIVATION
                 and Message(ACTIVATION, m.stage, m.microbatch, header=True) in recvs]
        return [m for m in recvs if m not in later], later

    prog: list[Instruction] = []
    batch_of: dict[Message, int] = {}
    waited: set[int] = set()
    ran: set[int] = set()  # this rank's stages that have run a forward (their output shape is known)
    nb = 0

    def post(sends: list[Message], recvs: list[Message]) -> None:
        nonlocal nb
        assert all(m.kind == ACTIVATION or m.header or m.dst_stage in ran for m in recvs), rank  # gradient shapes known
        prog.append(Post(nb, tuple(sends), tuple(recvs)))
        batch_of.update((m, nb) for m in recvs)
        nb += 1

    for t in sorted(set(recv_at) | set(send_at) | set(starts)):
        first, later = parts(t)
        if t in early:
            first = []
        if first or send_at.get(t):
            post(send_at.get(t, []), first)
        if later:
            for m in later:
                h = Message(ACTIVATION, m.stage, m.microbatch, header=True)
                prog.append(Read(batch_of[h], h))
                waited.add(batch_of[h])
            post([], later)
        k = starts.get(t)
        if k is not None:
            y = needed_by(schedule[rank][k], n_stages)
            if y is not None and not is_local(y, owners) and batch_of[y] not in waited:
                waited.add(batch_of[y])
                prog.append(Wait(batch_of[y], y))
            for u in ahead[k]:  # after the wait: a batch holding later rounds' receives is not waited for here
                first = parts(u)[0]
                if first:
                    post([], first)
            prog.append(Run(k))
            if schedule[rank][k].kind == "F":
                ran.add(schedule[rank][k].stage)
    prog += [Wait(ins.batch, None) for ins in list(prog) if isinstance(ins, Post) and ins.batch not in waited]
    return _merge_posts(prog)


def receives_ahead(schedule: list[list[Action]], rank: int, backward_cost: int = 2) -> tuple[Instruction, ...]:
    """The steady program of ``rank`` for gloo (see the module doc): every operation a batch of
    its own; each receive posted at the latest place in this rank's program that the schedule's
    clock (:func:`action_times`) reaches before the action that sends it ends: after the last
    action of this rank that ends earlier (and that action's sends), before the next one's wait.
    So it is usually posted before its sender's ``isend``, without being posted long before it
    is needed; each receive is waited for just before the action that uses it, and every send
    posted right after the action that produced it and waited for at the end of the step.

    Pairing: the receives from one sender are posted in the order of their send times on the
    clock, which is the sender's own order (one rank's actions end one after another), so the
    k-th receive on each directed pair is the k-th send, as in :func:`transfer_program`. A
    receive is never posted after its use: the action that uses a message starts at or after
    its send time. gloo issues and progresses each operation independently, so nothing here
    waits for an order between operations, and every send finds its receive posted in the end
    (:func:`~.p2p_check.check_programs` under gloo's semantics checks both, and that the
    schedule's makespan is kept). NCCL's in-order batches would deadlock on a receive posted
    ahead of a send its sender needs first, so the native path keeps the rounds.

    Why not every receive at the start of the step: a stage with nothing to wait for (the first)
    then posts ``m`` receives before its first forward, which every later stage waits for, and
    the receiving ranks post theirs while the first activation arrives. Measured on the 0.4M GPT
    at 2 gloo ranks against ``torch.distributed.pipelining``, 200 steps a side
    (benchmarks/README.md): 1F1B 0.98-1.03 with every receive first against 0.97-1.00 posted
    ahead; GPipe 0.90-0.92 against 0.82-0.89; interleaved 0.95 against 0.90. Receive buffers also
    exist from their post only, not for the whole step.

    Args:
        schedule: every rank's action list (for an evaluation, every rank's forwards only),
            ``p >= 2`` ranks.
        rank: the pipeline rank.
        backward_cost: the clock's backward (a forward is 1).

    Returns:
        A tuple of :class:`Post`, :class:`Wait` and :class:`Run` (no :class:`Read`: a steady step
        knows every shape).

    Raises:
        ShardingError: fewer than 2 ranks, or a schedule that deadlocks on the clock.
    """
    p, n_stages, owners, times = _layout(schedule, "receives_ahead", backward_cost)
    sends = {q: _sends(schedule, q, n_stages, False, owners) for q in range(p)}
    # (send time on the clock, sender, message) of each message to this rank, in that order
    incoming = sorted(((times[q][k][1], q, m) for q in range(p) for k, msgs in enumerate(sends[q]) for m in msgs
                       if owners[m.dst_stage] == rank), key=lambda x: x[:2])
    # the place before action k (after action k-1 and its sends, before k's wait) is reached at
    # the clock time action k-1 ends (the step's start for k = 0): a receive goes to the last
    # place reached before its send
    reached = [0] + [end for _, end in times[rank][:-1]]
    before: dict[int, list[Message]] = {}  # action index -> the receives posted just before it
    for t, _, m in incoming:
        before.setdefault(max(bisect_left(reached, t) - 1, 0), []).append(m)
    prog: list[Instruction] = []
    batch_of: dict[Message, int] = {}
    posted_sends: list[int] = []
    for k, a in enumerate(schedule[rank]):
        for m in before.get(k, ()):
            batch_of[m] = len(batch_of) + len(posted_sends)
            prog.append(Post(batch_of[m], (), (m,)))
        y = needed_by(a, n_stages)
        if y is not None and not is_local(y, owners):
            prog.append(Wait(batch_of[y], y))
        prog.append(Run(k))
        for m in sends[rank][k]:
            posted_sends.append(len(batch_of) + len(posted_sends))
            prog.append(Post(posted_sends[-1], (m,), ()))
    return tuple(prog + [Wait(b, None) for b in posted_sends])


def _merge_posts(prog: list) -> tuple[Instruction, ...]:
    """Posts with nothing between them (rounds while the rank computes nothing) as one batch,
    batches renumbered in order: each directed pair's messages keep their order in it, and the
    batch starts when its first round would (no compute lies between), so the pairing and the
    induction over rounds hold; fewer ``batch_isend_irecv`` calls."""
    out: list[Instruction] = []
    into: dict[int, int] = {}
    for ins in prog:
        if isinstance(ins, Post):
            if out and isinstance(out[-1], Post):
                last = out[-1]
                out[-1] = Post(last.batch, last.sends + ins.sends, last.recvs + ins.recvs)
                into[ins.batch] = last.batch
                continue
            into[ins.batch] = ins.batch
            out.append(ins)
        else:
            out.append(ins)
    order = {b: i for i, b in enumerate(ins.batch for ins in out if isinstance(ins, Post))}
    final: list[Instruction] = []
    seen_end: set[int] = set()
    for ins in out:
        if isinstance(ins, Post):
            final.append(Post(order[ins.batch], ins.sends, ins.recvs))
        elif isinstance(ins, (Wait, Read)):
            b = order[into.get(ins.batch, ins.batch)]
            if isinstance(ins, Wait) and ins.message is None:
                if b in seen_end:
                    continue
                seen_end.add(b)
            final.append(type(ins)(b, ins.message))
        else:
            final.append(ins)
    return tuple(final)
