"""Pipeline schedules run on a clock, without processes: validity, deadlock, bubble, stash.

:func:`simulate` executes every rank's action list in order, each action as soon as its inputs
exist (:func:`dependencies`), on a clock where a forward takes 1 unit, a full backward
``backward_cost`` and a split backward's ``W`` ``weight_cost`` (its ``I`` the rest), so every
schedule is checked for any ``p``, ``m``, ``v`` and cost model; :func:`format_grid` draws the
result as a step-by-rank table (torch.distributed.pipelining's ``_format_pipeline_order``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from .actions import Action, stage_owners

__all__ = ["Simulation", "simulate", "format_grid", "dependencies", "gradient_senders", "action_costs"]


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


def simulate(schedule: list[list[Action]], backward_cost: int | None = None, weight_cost: int | None = None) -> Simulation:
    """Execute ``schedule`` on a clock, honouring :func:`dependencies`; check it is complete.

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
    stages = _check_complete(schedule)
    stage_owners(schedule)
    split = any(a.kind in "IW" for acts in schedule for a in acts)
    if backward_cost is None:
        backward_cost = 2 if split else 1
    costs = action_costs(backward_cost, weight_cost)
    if split and "I" not in costs:
        raise ShardingError(f"simulate: a split backward (I and W) needs backward_cost >= 2, got {backward_cost}")
    senders = gradient_senders(schedule)
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
            if all(d in done and done[d] <= t for d in dependencies(a, stages, senders)):
                cost = costs[a.kind]
                done[a] = free_at[r] = t + cost
                busy[r] += cost
                pos[r] += 1
                stash[r] += 1 if a.kind == "F" else -1 if a.kind in "BW" else 0
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
