"""Pipeline schedules as data: per-rank lists of actions, checked and drawn without processes.

A schedule is, for each pp rank, the list of :class:`~.actions.Action` s it runs in order
(``1F0``: stage 1, forward, microbatch 0; ``B`` a full backward, ``I`` / ``W`` the two halves of a
split one, see :mod:`.actions`). Communication is implied: a forward of stage ``s < S - 1``
sends its output to stage ``s + 1``; a backward (``B`` or ``I``) of stage ``s > 0`` sends the
input gradient to ``s - 1``; nothing moves between two stages on one rank. ``S = p * v``
stages over ``p`` ranks, placed as the schedule says (:data:`PLACEMENT`: Megatron's loop,
stage ``s`` on rank ``s % p``, or the V of the zero-bubble schedules).

Schedules (:data:`SCHEDULES`):

- GPipe (Huang et al., arXiv 1811.06965): all forwards, then all backwards. Stashes ``m``
  microbatches per stage; bubble ``(p - 1) / (m + p - 1)``.
- 1F1B, PipeDream-flush (Narayanan et al., arXiv 2006.09503 / 2104.04473): ``p - r - 1``
  warm-up forwards on rank ``r``, then alternate one forward and one backward. Same bubble,
  at most ``p - r`` stashed microbatches.
- Interleaved 1F1B (Narayanan et al., arXiv 2104.04473, section 2.2): ``v`` chunks per rank,
  bubble ``(p - 1) / (v m + p - 1)``; needs ``m`` divisible by ``p``.
- ZB-H1, ZB-V (Qi et al., arXiv 2401.10241) and DualPipeV (DeepSeek-V3, arXiv 2412.19437):
  split backwards, see :mod:`.zero_bubble`.

:func:`~.simulate.simulate` executes a schedule on a clock honouring the data dependencies:
it returns the step-by-rank grid and raises on a deadlock, so every schedule is validated for
any ``p``, ``m``, ``v`` without processes; :mod:`.schedule_theory` has each paper's bubble and
stash formulas.
"""

from __future__ import annotations

from ..errors import ShardingError
from .actions import Action, check_sizes as _check
from .simulate import Simulation, format_grid, simulate
from .zero_bubble import dualpipev, zb_h1, zbv

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "build_schedule",
           "simulate", "Simulation", "bubble_fraction", "format_grid", "SCHEDULES", "PLACEMENT", "placement",
           "default_virtual_stages", "splits_backward"]


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
        ShardingError: ``m`` not divisible by ``p`` (Megatron's requirement); ``v`` = 1 (that is
            1F1B: a plan asking for the interleaved schedule ran plain 1F1B, silently).
    """
    _check(p, m, v, "interleaved_1f1b")
    if v == 1:
        raise ShardingError(
            "interleaved_1f1b with virtual_stages=1 is the plain 1F1B schedule (one model chunk per rank): the "
            "interleaving needs two chunks per rank at least. Fix: virtual_stages=2 (the default), or schedule='1f1b'")
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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1, "zbv": zbv,
             "dualpipev": dualpipev}
# where each schedule puts its stages (.actions): the V schedules hold two chunks per rank by default
PLACEMENT = {"zbv": "v", "dualpipev": "v"}


def placement(name: str) -> str:
    """``"loop"`` (stage ``s`` on rank ``s % p``) or ``"v"`` (:mod:`.actions`) for schedule ``name``."""
    return PLACEMENT.get(name, "loop")


def default_virtual_stages(name: str) -> int:
    """The chunks per rank schedule ``name`` runs when ``virtual_stages`` is not given: 2 for
    the V schedules and interleaved 1F1B (its own default, as Megatron's virtual pipeline needs
    two chunks at least), else 1."""
    return 2 if placement(name) == "v" or name == "interleaved_1f1b" else 1


def splits_backward(schedule: list[list[Action]]) -> bool:
    """Whether ``schedule`` splits backwards into ``I`` and ``W`` (the zero-bubble schedules)."""
    return any(a.kind == "I" for acts in schedule for a in acts)


def build_schedule(name: str, p: int, m: int, v: int | None = None) -> list[list[Action]]:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``p`` ranks, ``m`` microbatches and
    ``v`` chunks per rank (default :func:`default_virtual_stages`).

    Raises:
        ShardingError: an unknown name, or sizes the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ShardingError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, default_virtual_stages(name) if v is None else v)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Theoretical idle fraction: ``(p - 1) / (v m + p - 1)`` (GPipe and 1F1B have ``v = 1``)."""
    return (p - 1) / (v * m + p - 1)
