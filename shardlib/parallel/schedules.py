"""Pipeline schedules as data: per-rank lists of actions, checked and drawn without processes.

An :class:`Action` is ``(stage, kind, microbatch)``: run the forward (``"F"``) or backward
(``"B"``) of virtual stage ``stage`` on microbatch ``microbatch`` (torch.distributed.pipelining
writes ``1F0``). Communication is implied: a forward of stage ``s < S - 1`` sends its output
to stage ``s + 1``; a backward of stage ``s > 0`` sends the input gradient to ``s - 1``. With
``v`` model chunks per rank and ``p`` ranks, stage ``s`` lives on rank ``s % p`` (Megatron's
interleaving), so ``S = p * v``.

Schedules:

- GPipe (Huang et al., arXiv 1811.06965): all forwards, then all backwards. Stashes ``m``
  microbatches per stage; bubble ``(p - 1) / (m + p - 1)``.
- 1F1B, PipeDream-flush (Narayanan et al., arXiv 2006.09503 / 2104.04473): ``p - r - 1``
  warm-up forwards on rank ``r``, then alternate one forward and one backward. Same bubble,
  at most ``p - r`` stashed microbatches.
- Interleaved 1F1B (Narayanan et al., arXiv 2104.04473, section 2.2): ``v`` chunks per rank,
  bubble ``(p - 1) / (v m + p - 1)``; needs ``m`` divisible by ``p``.

:func:`simulate` executes a schedule on a clock (forward 1 unit, backward ``backward_cost``
units) honouring the data dependencies: it returns the step-by-rank grid and raises on a
deadlock, so every schedule is validated for any ``p``, ``m``, ``v`` without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "build_schedule", "simulate", "Simulation",
           "bubble_fraction", "format_grid", "SCHEDULES"]


@dataclass(frozen=True, order=True)
class Action:
    """Forward or backward of one virtual stage on one microbatch."""

    stage: int
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """GPipe: on each rank, every forward of its stage, then every backward (one chunk per rank).

    Raises:
        ShardingError: ``v > 1`` (use the interleaved 1F1B schedule for model chunks).
    """
    _check(p, m, v, "gpipe")
    if v != 1:
        raise ShardingError(f"GPipe runs one model chunk per rank, got {v}; use 'interleaved_1f1b' for virtual stages")
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward and one backward in turn."""
    _check(p, m, v, "1f1b")
    if v != 1:
        return interleaved_1f1b(p, m, v)
    ranks = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            acts += [Action(r, "F", f), Action(r, "B", b)]
            f, b = f + 1, b + 1
        acts += [Action(r, "B", i) for i in range(b, m)]
        ranks.append(acts)
    return ranks


def interleaved_1f1b(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron's virtual pipeline): ``v`` model chunks per rank.

    Forwards go through microbatches in groups of ``p``: chunk 0 for microbatches ``0..p-1``,
    chunk 1 for the same, ..., then the next group; backwards in the same order with chunks
    reversed. Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards.

    Raises:
        ShardingError: ``m`` not divisible by ``p`` (Megatron's requirement).
    """
    _check(p, m, v, "interleaved_1f1b")
    if m % p:
        raise ShardingError(
            f"interleaved 1F1B needs the number of microbatches ({m}) to be a multiple of the pipeline size ({p}), "
            "as in Megatron. Fix: use a multiple, or the 1F1B / GPipe schedule"
        )
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return (chunk if forward else v - 1 - chunk), group * p + within % p

    ranks = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts, f, b = [], 0, 0
        for _ in range(warm):
            c, i = chunk_mb(f, True)
            acts.append(Action(c * p + r, "F", i))
            f += 1
        while f < total:
            c, i = chunk_mb(f, True)
            acts.append(Action(c * p + r, "F", i))
            f += 1
            c, i = chunk_mb(b, False)
            acts.append(Action(c * p + r, "B", i))
            b += 1
        while b < total:
            c, i = chunk_mb(b, False)
            acts.append(Action(c * p + r, "B", i))
            b += 1
        ranks.append(acts)
    return ranks


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The schedule ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``) for ``p`` ranks,
    ``m`` microbatches and ``v`` chunks per rank.

    Raises:
        ShardingError: an unknown name, or sizes the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ShardingError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)


def _check(p: int, m: int, v: int, name: str) -> None:
    for label, value in (("pipeline size", p), ("microbatches", m), ("model chunks per rank", v)):
        if not isinstance(value, int) or value < 1:
            raise ShardingError(f"{name}: {label} must be a positive int, got {value!r}")


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Theoretical idle fraction: ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B have ``v = 1``)."""
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class Simulation:
    """A schedule run on a clock.

    Attributes:
        grid: ``grid[t][r]``, the action rank ``r`` runs during time unit ``t`` (``None``: idle).
        makespan: time units until the last action ends.
        busy: time units each rank computes.
        peak_stash: per rank, the most microbatches forwarded but not yet backwarded at once.
    """

    grid: list[list[Action | None]]
    makespan: int
    busy: list[int]
    peak_stash: list[int]

    def bubble(self) -> list[float]:
        """Idle fraction per rank over the makespan."""
        return [1 - b / self.makespan for b in self.busy]


def simulate(schedule: list[list[Action]], backward_cost: int = 1) -> Simulation:
    """Execute ``schedule`` on a clock, honouring data dependencies; check it is complete.

    A forward of stage ``s > 0`` waits for the forward of ``s - 1`` on the same microbatch; a
    backward waits for its own forward and for the backward of ``s + 1``. Each rank runs its
    actions in order, one at a time.

    Raises:
        ShardingError: a deadlock (no rank can proceed), a duplicated or missing action, or a
            backward listed before its forward on a rank.
    """
    p = len(schedule)
    stages = 1 + max(a.stage for acts in schedule for a in acts)
    micro = 1 + max(a.microbatch for acts in schedule for a in acts)
    expected = {Action(s, k, i) for s in range(stages) for k in "FB" for i in range(micro)}
    listed = [a for acts in schedule for a in acts]
    if len(listed) != len(set(listed)) or set(listed) != expected:
        raise ShardingError("schedule is not a permutation of every forward and backward")
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.stage % p != r:
                raise ShardingError(f"action {a} is on rank {r}, but stage {a.stage} lives on rank {a.stage % p}")
    done: dict[Action, int] = {}
    pos = [0] * p
    free_at = [0] * p
    grid: list[list[Action | None]] = []
    busy = [0] * p
    stash = [0] * p
    peak = [0] * p
    t = 0
    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(schedule[r]) or free_at[r] > t:
                continue
            a = schedule[r][pos[r]]
            deps = []
            if a.kind == "F" and a.stage > 0:
                deps.append(Action(a.stage - 1, "F", a.microbatch))
            if a.kind == "B":
                deps.append(Action(a.stage, "F", a.microbatch))
                if a.stage < stages - 1:
                    deps.append(Action(a.stage + 1, "B", a.microbatch))
            if all(d in done and done[d] <= t for d in deps):
                cost = 1 if a.kind == "F" else backward_cost
                done[a] = t + cost
                free_at[r] = t + cost
                busy[r] += cost
                pos[r] += 1
                stash[r] += 1 if a.kind == "F" else -1
                peak[r] = max(peak[r], stash[r])
                while len(grid) < t + cost:
                    grid.append([None] * p)
                for k in range(cost):
                    grid[t + k][r] = a
                progressed = True
        if not progressed and all(f <= t for f in free_at) and not any(v > t for v in done.values()):
            waiting = [r for r in range(p) if pos[r] < len(schedule[r])]
            raise ShardingError(
                "pipeline schedule deadlocks: " + ", ".join(f"rank {r} waits at {schedule[r][pos[r]]}" for r in waiting)
            )
        t += 1
    makespan = max(done.values()) if done else 0
    while len(grid) < makespan:
        grid.append([None] * p)
    return Simulation(grid, makespan, busy, peak)


def format_grid(sim: Simulation) -> str:
    """The simulated schedule as a step-by-rank table (torch's ``_format_pipeline_order`` style)."""
    p = len(sim.busy)
    width = max([len(str(a)) for row in sim.grid for a in row if a is not None] + [4])
    lines = ["step " + " ".join(f"rank{r}".rjust(width) for r in range(p))]
    for t, row in enumerate(sim.grid):
        lines.append(f"{t:>4} " + " ".join((str(a) if a is not None else ".").rjust(width) for a in row))
    return "\n".join(lines)
