"""Checks of the point-to-point programs of :mod:`.p2p` on a clock, without processes.

:func:`check_programs` executes the programs of all ranks under NCCL's semantics or gloo's and
checks that sends and receives pair up in order on every directed pair, that every tensor is
waited for before it is used, that every batch is waited for, and that nothing deadlocks. The
tests run it over every schedule for a range of ``(p, m, v)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from .actions import Action, stage_owners
from .p2p import Post, Read, Run, Wait, is_local, needed_by
from .simulate import action_costs

__all__ = ["check_programs", "ProgramCheck"]


@dataclass(frozen=True)
class ProgramCheck:
    """What :func:`check_programs` found.

    Attributes:
        makespan: clock units until every rank is done (forward 1, backward ``backward_cost``;
            transfers take no time).
        pairs: ``{(src rank, dst rank): [Message, ...]}``, the messages of each directed pair in
            posting order (the same on both ends).
    """

    makespan: int
    pairs: dict


def _pairs(schedule, programs) -> dict:
    """Sends and posted receives of each directed pair, in posting order; raises unless they
    are the same sequence on both ends."""
    n_stages = 1 + max(a.stage for acts in schedule for a in acts)
    owners = stage_owners(schedule)
    sent: dict = {}
    got: dict = {}
    for r, prog in enumerate(programs):
        for ins in prog:
            if isinstance(ins, Post):
                for m in ins.sends:
                    sent.setdefault((r, owners[m.dst_stage]), []).append(m)
                for m in ins.recvs:
                    got.setdefault((owners[m.stage], r), []).append(m)
    for key in sorted(set(sent) | set(got)):
        a, b = sent.get(key, []), got.get(key, [])
        if a != b:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ShardingError(
                f"point-to-point order differs on ranks {key[0]} -> {key[1]}: message {k} is "
                f"{a[k] if k < len(a) else 'nothing'} on the sender and {b[k] if k < len(b) else 'nothing'} on the "
                "receiver (NCCL pairs messages by posting order)")
    for r, prog in enumerate(programs):  # every input waited for in the batch that receives it, before its use
        ready: set = set()
        recvs = {ins.batch: ins.recvs for ins in prog if isinstance(ins, Post)}
        for ins in prog:
            if isinstance(ins, (Wait, Read)):
                ready.update(recvs.get(ins.batch, ()))
            elif isinstance(ins, Run):
                y = needed_by(schedule[r][ins.index], n_stages)
                if y is not None and not is_local(y, owners) and y not in ready:
                    raise ShardingError(f"rank {r} runs {schedule[r][ins.index]} before waiting for {y}")
        if set(recvs) - {ins.batch for ins in prog if isinstance(ins, (Wait, Read))}:
            raise ShardingError(f"rank {r} posts batches it never waits for")
    return {k: tuple(v) for k, v in sent.items()}


def check_programs(schedule: list[list[Action]], programs: list, semantics: str = "nccl",
                   backward_cost: int = 2) -> ProgramCheck:
    """Execute every rank's program on a clock and check it (see the module doc).

    Under ``"nccl"`` each rank has a host that issues instructions without blocking (but for
    :class:`Read`, which waits for its batch and for the computes issued before it), a
    communication stream that runs its batches in order (a batch starts once the batch before
    it is done and the compute issued before it is done) and a compute stream (an action
    starts once the one before it is done and every batch waited for so far is done). A batch
    is done once the matching operation of each of its own has been started by the peer (a
    receive completes only when the matching send was posted and started; both stay resident
    until done). Under ``"gloo"`` the host blocks on each wait and computes itself, and
    operations progress independently of each other. The k-th send on a directed pair matches
    the k-th receive posted there.

    Args:
        schedule: every rank's action list.
        programs: every rank's :func:`transfer_program`.
        semantics: ``"nccl"`` or ``"gloo"``.
        backward_cost: clock units of a backward (a forward takes 1).

    Returns:
        A :class:`ProgramCheck`.

    Raises:
        ShardingError: messages that pair up differently on the two ends of a pair, an input
            used before its batch was waited for, a batch never waited for, or a deadlock
            (naming where each rank stands).
    """
    if semantics not in ("nccl", "gloo"):
        raise ShardingError(f"check_programs: semantics must be 'nccl' or 'gloo', got {semantics!r}")
    pairs = _pairs(schedule, programs)
    p = len(programs)
    owners = stage_owners(schedule)
    costs = action_costs(backward_cost)
    nccl = semantics == "nccl"
    # the peer batch of each operation, by order on the directed pair
    order: dict = {}
    for r, prog in enumerate(programs):
        for ins in prog:
            if isinstance(ins, Post):
                for m in ins.sends:
                    order.setdefault(("s", r, owners[m.dst_stage]), []).append((r, ins.batch))
                for m in ins.recvs:
                    order.setdefault(("r", owners[m.stage], r), []).append((r, ins.batch))
    partners: dict = {}  # (rank, batch) -> [(peer rank, peer batch)]
    for (kind, a, b), ops in order.items():
        if kind == "s":
            for (r, bat), peer in zip(ops, order.get(("r", a, b), [])):
                partners.setdefault((r, bat), []).append(peer)
                partners.setdefault(peer, []).append((r, bat))
    pos = [0] * p
    started: dict = {}  # (rank, batch) -> start time
    done: dict = {}  # (rank, batch) -> done time
    posted: dict = {}  # (rank, batch) -> (previous batch on the rank or None, compute index issued before or None)
    comp_done: dict = {}  # (rank, run index) -> done time
    issued_runs: list[list] = [[] for _ in range(p)]  # per rank: [(index, waits before it)]
    waits: list[list] = [[] for _ in range(p)]
    last_batch = [None] * p
    t = 0

    def compute_ready(r: int, j: int) -> bool:
        index, deps = issued_runs[r][j]
        if j and (comp_done.get((r, issued_runs[r][j - 1][0])) is None or comp_done[(r, issued_runs[r][j - 1][0])] > t):
            return False
        return all((r, b) in done for b in deps)

    def computes_done(r: int) -> bool:
        return all(comp_done.get((r, i)) is not None and comp_done[(r, i)] <= t for i, _ in issued_runs[r])

    def step_hosts() -> bool:
        moved = False
        for r in range(p):
            prog = programs[r]
            while pos[r] < len(prog):
                ins = prog[pos[r]]
                if isinstance(ins, Post):
                    last_run = issued_runs[r][-1][0] if issued_runs[r] else None
                    if not nccl and not computes_done(r):
                        break
                    posted[(r, ins.batch)] = (last_batch[r] if nccl else None, last_run if nccl else None)
                    last_batch[r] = ins.batch
                elif isinstance(ins, Wait):
                    if nccl:
                        waits[r].append(ins.batch)
                    elif (r, ins.batch) not in done:
                        break
                elif isinstance(ins, Read):
                    if (r, ins.batch) not in done or not computes_done(r):
                        break
                else:
                    if not nccl and not computes_done(r):
                        break
                    issued_runs[r].append((ins.index, list(waits[r])))
                pos[r] += 1
                moved = True
        return moved

    def step_batches() -> bool:
        moved = False
        for key, (prev, run) in posted.items():
            r = key[0]
            if key not in started:
                if prev is not None and (r, prev) not in done:
                    continue
                if run is not None and (comp_done.get((r, run)) is None or comp_done[(r, run)] > t):
                    continue
                started[key] = t
                moved = True
            if key not in done and all(peer in started for peer in partners.get(key, ())):
                expected = sum(len(ins.sends) + len(ins.recvs) for ins in programs[r]
                               if isinstance(ins, Post) and ins.batch == key[1])
                if len(partners.get(key, ())) == expected:
                    done[key] = t
                    moved = True
        return moved

    def step_computes() -> bool:
        moved = False
        for r in range(p):
            for j, (index, _) in enumerate(issued_runs[r]):
                if comp_done.get((r, index)) is None and compute_ready(r, j):
                    a = schedule[r][index]
                    comp_done[(r, index)] = t + costs[a.kind]
                    moved = True
        return moved

    while True:
        while step_hosts() | step_batches() | step_computes():
            pass
        finished = all(pos[r] == len(programs[r]) and computes_done(r) for r in range(p)) and len(done) == len(posted)
        if finished:
            break
        future = [v for v in comp_done.values() if v is not None and v > t]
        if not future:
            where = []
            for r in range(p):
                ins = programs[r][pos[r]] if pos[r] < len(programs[r]) else None
                stuck = sorted(b for (q, b) in posted if q == r and (q, b) not in done)
                where.append(f"rank {r} at {ins if ins is not None else 'the end'}, batches not done {stuck}")
            raise ShardingError(f"point-to-point deadlock under {semantics} semantics at t={t}: " + "; ".join(where))
        t = min(future)
    return ProgramCheck(max(comp_done.values(), default=0), pairs)
