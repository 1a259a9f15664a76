"""Each schedule's bubble and activation stash in closed form, from its paper.

Costs are per virtual stage (a model chunk): ``forward`` ``T_F``, ``backward`` ``T_B`` (the
input-gradient part) and ``weight`` ``T_W``; a full backward takes ``T_B + T_W``. The bubble is
the idle time of each rank over a step (the zero-bubble paper's "bubble size"; every rank idles
alike in these schedules). Tests check :func:`~.simulate.simulate` against these for ``p`` 1-8,
``m`` 1-16.

- GPipe / 1F1B (Huang et al. 1811.06965, Narayanan et al. 2104.04473): ``(p - 1)(T_F + T_B +
  T_W)``; interleaved 1F1B the same at chunk costs (so the fraction ``(p - 1) / (v m + p - 1)``).
- ZB-H1 (Qi et al. 2401.10241, section 2.1): ``(p - 1)(T_F + T_B) - min(m - 1, p - 1) min(T_W,
  T_F)``, which for ``m >= p`` and ``T_W <= T_F`` is the paper's ``(p - 1)(T_F + T_B - T_W)``: a
  third of 1F1B's when ``T_F = T_B = T_W``.
- ZB-V (the same paper, section 6), at ``T_F = T_B = T_W = T``: ``max(p - 1, 2(2p - m - 1)) T``.
  ``(p - 1) T_F`` is the least any schedule on the V can idle: rank ``p - 1``'s first stage
  waits for the first microbatch to pass ``p - 1`` chunks, and every rank has the same work. So
  ZB-V's bubble against 1F1B's is ``T_F / (2 (T_F + T_B + T_W))``, 1/6 at equal costs, for any
  ``m >= 2p - 2``; the papers' "zero" neglects this start-up against ``m``.
- DualPipeV (DeepSeek-V3, 2412.19437; the DualPipe repository's table, with ``PP = 2p``
  stages): at most ``(PP / 2 - 1)(T_F&B + T_B' - 3 T_W)`` with ``T_B'`` a full backward and
  ``T_F&B`` a forward/backward pair (``T_F + T_B'`` here, where the pair runs in turn); at equal
  costs it reaches the V's floor ``(p - 1) T``. Activations: ``PP + 1 = 2p + 1`` chunks.

Stash (activations held, in (stage, microbatch) units of one chunk; a split backward frees them
at its ``W``): GPipe ``m v``, 1F1B ``min(p - r, m)`` on rank ``r``, ZB-H1 ``min(p, m)`` on every
rank (1F1B's peak, on all ranks: the paper's "same in-flight microbatches on all stages"),
ZB-V ``2p`` chunks (``p`` of the rank's microbatches: 1F1B's peak) once ``m >= 2p - 1``,
DualPipeV ``2p + 1``.
"""

from __future__ import annotations

from ..errors import ShardingError

__all__ = ["bubble_time", "bubble_ratio", "schedule_bubble_fraction", "peak_stash", "dualpipe_bound", "BUBBLE_FORMULA"]

_CLASSIC = ("gpipe", "1f1b", "interleaved_1f1b")
# how explain() names each schedule's bubble fraction (the classic ones: (p-1)/(vm+p-1))
BUBBLE_FORMULA = {"zb_h1": "of ZB-H1 at F=B=W", "zbv": "of ZB-V at F=B=W", "dualpipev": "of DualPipeV at F=B=W"}


def bubble_time(name: str, p: int, m: int, forward: float = 1, backward: float = 1, weight: float = 1) -> float:
    """Idle time per rank over one step of schedule ``name`` (see the module for each formula).

    Args:
        name, p, m: the schedule, pipeline ranks and microbatches.
        forward, backward, weight: ``T_F``, ``T_B`` (input gradient) and ``T_W`` of one chunk.

    Raises:
        ShardingError: an unknown schedule, or ZB-V / DualPipeV with unequal costs (their
            papers give the bubble at ``T_F = T_B = T_W`` only; DualPipeV's general bound is
            :func:`dualpipe_bound`).
    """
    if name in _CLASSIC:
        return (p - 1) * (forward + backward + weight)
    if name == "zb_h1":
        return (p - 1) * (forward + backward) - min(m - 1, p - 1) * min(weight, forward)
    if name in ("zbv", "dualpipev"):
        if not forward == backward == weight:
            raise ShardingError(f"bubble_time: the {name} bubble is known in closed form at T_F = T_B = T_W only, got "
                                f"{forward}, {backward}, {weight}")
        return max(p - 1, 2 * (2 * p - m - 1)) * forward
    raise ShardingError(f"bubble_time: no formula for schedule {name!r}")


def dualpipe_bound(p: int, forward: float = 1, backward: float = 1, weight: float = 1) -> float:
    """The DualPipe table's bubble ``(PP/2 - 1)(F&B + B - 3W)`` for DualPipeV on ``p`` ranks
    (``PP = 2p`` stages), with ``B`` a full backward (``backward + weight``) and ``F&B`` a
    forward and a full backward run in turn."""
    full = backward + weight
    return (p - 1) * ((forward + full) + full - 3 * weight)


def schedule_bubble_fraction(name: str, p: int, m: int, v: int) -> float:
    """Idle fraction of the makespan at ``T_F = T_B = T_W``: ``idle / (idle + 3 v m)``; for the
    classic schedules this is ``(p - 1) / (v m + p - 1)``."""
    idle = bubble_time(name, p, m)
    return idle / (idle + 3 * v * m)


def bubble_ratio(name: str, p: int, m: int, forward: float = 1, backward: float = 1, weight: float = 1) -> float:
    """Schedule ``name``'s idle time over 1F1B's on the same model: for a two-chunk schedule
    the costs are a chunk's (half a rank's layers), against 1F1B's at twice them."""
    chunks = 2 if name in ("zbv", "dualpipev") else 1
    return bubble_time(name, p, m, forward, backward, weight) / bubble_time("1f1b", p, m, *(chunks * c for c in (
        forward, backward, weight)))


def peak_stash(name: str, p: int, m: int, v: int) -> list[int] | None:
    """The most (stage, microbatch) activations each rank holds at once, where the paper gives
    it (see the module); None where it does not (ZB-V below ``2p - 1`` microbatches, and
    interleaved 1F1B, whose stash depends on ``m``'s groups)."""
    if name == "gpipe":
        return [m * v] * p
    if name == "1f1b" and v == 1:
        return [min(p - r, m) for r in range(p)]
    if name == "zb_h1":
        return [min(p, m)] * p
    if name == "zbv":
        return [2 * p] * p if m >= 2 * p - 1 else None
    if name == "dualpipev":
        return [2 * p + 1] * p
    return None
