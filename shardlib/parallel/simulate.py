"""Pipeline schedules run on a clock, without processes: validity, deadlock, bubble, stash.

:func:`action_times` lays every rank's action list out in order, each action as soon as its
inputs exist (:func:`dependencies`), on a clock where a forward takes 1 unit, a full backward
``backward_cost`` and a split backward's ``W`` ``weight_cost`` (its ``I`` the rest). The
transfer programs (:mod:`.p2p`) take their rounds from it; :func:`simulate` checks a schedule
complete and returns its layout as a grid with each rank's busy time and peak stash, so every
schedule is checked for any ``p``, ``m``, ``v`` and cost model; :func:`format_grid` draws the
grid as a step-by-rank table (torch.distributed.pipelining's ``_format_pipeline_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from .actions import Action, stage_owners

__all__ = ["Simulation", "simulate", "action_times", "format_grid", "dependencies", "gradient_senders", "action_costs"]


def gradient_senders(schedule: list[list[Action]]) -> dict[tuple[int, int], Action]:
    """``{(stage, microbatch): the action computing its input gradient}``: its ``B``, or its
    ``I`` when the backward is split."""
    return {(a.stage, a.microbatch): a for acts in schedule for a in acts if a.kind in "BI"}


def dependencies(a: Action, n_stages: int, senders: dict) -> list[Action]:
    """The actions ``a`` waits for: a forward for the previous stage's forward of its
    microbatch; a backward (``B`` or ``I``) for its own forward and the next stage's gradient
    (``senders``, :func:`gradient_senders`); a ``W`` for its own ``I``."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action(a.stage, "I", a.microbatch)]
    deps = [Action(a.stage, "F", a.microbatch)]
    if a.stage < n_stages - 1:
        nxt = senders.get((a.stage + 1, a.microbatch))
        deps.append(nxt if nxt is not None else Action(a.stage + 1, "B", a.microbatch))
    return deps


def action_costs(backward_cost: int, weight_cost: int | None = None) -> dict[str, int]:
    """Clock units of each kind: ``F`` 1, ``B`` ``backward_cost``; with ``backward_cost > 1`` (or
    a ``weight_cost``) also ``W`` ``weight_cost`` (default half a backward) and ``I`` the rest.

    Raises:
        ShardingError: a cost below one unit for any kind."""
    costs = {"F": 1, "B": backward_cost}
    if weight_cost is not None or (isinstance(backward_cost, int) and backward_cost > 1):
        w = backward_cost // 2 if weight_cost is None else weight_cost
        costs.update(I=backward_cost - w, W=w)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in costs.values()):
        raise ShardingError(f"simulate: every kind takes a whole number of units >= 1, got {costs} "
                            f"(backward_cost={backward_cost}, weight_cost={weight_cost})")
    return costs


def _check_complete(schedule: list[list[Action]]) -> int:
    """The number of stages; raises unless every (stage, microbatch) has one forward and one
    backward, full or split, and nothing else."""
    listed = [a for acts in schedule for a in acts]
    if not listed:
        raise ShardingError("schedule is empty")
    stages = 1 + max(a.stage for a in listed)
    micro = 1 + max(a.microbatch for a in listed)
    seen = set(listed)
    if len(listed) != len(seen) or any(a.kind not in "FBIW" for a in seen):
        raise ShardingError("schedule is not a permutation of every forward and backward (an action twice, or an "
                            "unknown kind)")
    for s in range(stages):
        for i in range(micro):
            f, b = Action(s, "F", i) in seen, Action(s, "B", i) in seen
            split = (Action(s, "I", i) in seen, Action(s, "W", i) in seen)
            if not f or (b, split) not in ((True, (False, False)), (False, (True, True))):
                raise ShardingError(f"schedule is not a permutation of every forward and backward: stage {s} "
                                    f"microbatch {i} needs one F and either one B or one I and one W")
    return stages


@dataclass(frozen=True)
class Simulation:
    """A schedule run on a clock.

    Attributes:
        grid: ``grid[t][r]``, the action rank ``r`` runs during time unit ``t`` (``None``: idle).
        makespan: time units until the last action ends.
        busy: time units each rank computes.
        peak_stash: per rank, the most (stage, microbatch) activations held at once: from a
            forward to its full backward, or to its ``W`` (which reads them) when split.
    """

    grid: list[list[Action | None]]
    makespan: int
    busy: list[int]
    peak_stash: list[int]

    def bubble(self) -> list[float]:
        """Idle fraction per rank over the makespan."""
        return [1 - b / self.makespan for b in self.busy]

    def idle(self) -> list[int]:
        """Idle time units per rank (the zero-bubble paper's bubble size): makespan - busy."""
        return [self.makespan - b for b in self.busy]


def action_times(schedule: list[list[Action]], backward_cost: int = 2,
                 weight_cost: int | None = None) -> list[list[tuple[int, int]]]:
    """``(start, end)`` of every action on a clock (forward 1 unit, full backward
    ``backward_cost``, a split one's ``W`` ``weight_cost`` (default half a backward) and its
    ``I`` the rest), each rank running its list in order, each action as soon as the rank is free
    and its :func:`dependencies` are done (a list may hold forwards only: an evaluation).

    Raises:
        ShardingError: the schedule deadlocks (no rank can start its next action, naming where
            each waits), or a cost below one unit.
    """
    p = len(schedule)
    listed = {a for acts in schedule for a in acts}
    n_stages = 1 + max((a.stage for a in listed), default=0)
    senders = gradient_senders(schedule)
    costs = action_costs(backward_cost, weight_cost)
    if any(a.kind not in costs for a in listed):
        raise ShardingError(f"a split backward (I and W) needs backward_cost >= 2, got {backward_cost}")
    end: dict[Action, int] = {}
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    free = [0] * p
    while any(len(out[r]) < len(schedule[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while len(out[r]) < len(schedule[r]):
                a = schedule[r][len(out[r])]
                deps = [d for d in dependencies(a, n_stages, senders) if d in listed]
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                end[a] = free[r] = start + costs[a.kind]
                out[r].append((start, end[a]))
                moved = True
        if not moved:
            raise ShardingError("pipeline schedule deadlocks: " + ", ".join(
                f"rank {r} waits at {schedule[r][len(out[r])]}" for r in range(p) if len(out[r]) < len(schedule[r])))
    return out


def simulate(schedule: list[list[Action]], backward_cost: int | None = None, weight_cost: int | None = None) -> Simulation:
    """Check ``schedule`` is complete and lay it out on the clock of :func:`action_times`.

    Each rank runs its actions in order, one at a time, each as soon as its inputs are done.

    Args:
        schedule: every rank's action list.
        backward_cost: units of a full backward (``B``); default 2 for a schedule with split
            backwards (so ``F``, ``I`` and ``W`` take one unit each, the zero-bubble paper's
            ``T_F = T_B = T_W``), else 1 (forward and backward alike).
        weight_cost: units of a ``W`` (default half a backward); an ``I`` takes the rest.

    Raises:
        ShardingError: a deadlock (no rank can proceed, naming where each waits), an incomplete
            or duplicated schedule, a stage on two ranks, or a cost below one unit.
    """
    p = len(schedule)
    _check_complete(schedule)
    stage_owners(schedule)
    if backward_cost is None:
        backward_cost = 2 if any(a.kind in "IW" for acts in schedule for a in acts) else 1
    times = action_times(schedule, backward_cost, weight_cost)
    makespan = max((end for ts in times for _, end in ts), default=0)
    grid: list[list[Action | None]] = [[None] * p for _ in range(makespan)]
    busy, peak = [0] * p, [0] * p
    for r, acts in enumerate(schedule):
        stash = 0
        for a, (start, end) in zip(acts, times[r]):
            busy[r] += end - start
            for t in range(start, end):
                grid[t][r] = a
            stash += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
            peak[r] = max(peak[r], stash)
    return Simulation(grid, makespan, busy, peak)


def format_grid(sim: Simulation) -> str:
    """The simulated schedule as a step-by-rank table (torch's ``_format_pipeline_order`` style)."""
    p = len(sim.busy)
    width = max([len(str(a)) for row in sim.grid for a in row if a is not None] + [4])
    lines = ["step " + " ".join(f"rank{r}".rjust(width) for r in range(p))]
    for t, row in enumerate(sim.grid):
        lines.append(f"{t:>4} " + " ".join((str(a) if a is not None else ".").rjust(width) for a in row))
    return "\n".join(lines)
