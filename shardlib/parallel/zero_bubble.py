"""Zero-bubble schedules as data: ZB-H1, ZB-V and DualPipeV.

Each splits backwards into ``I`` (the input gradient, on the critical path: sent upstream at
once) and ``W`` (the parameter gradients, which nothing waits for) and moves ``W`` into what
would be bubble (:mod:`.actions`). The builders follow torch.distributed.pipelining's
(``ScheduleInterleavedZeroBubble`` at one chunk, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``), so the two libraries run the same orders on the same split. With ``F``,
``I`` and ``W`` of one unit each (the papers' ``T_F = T_B = T_W``; :mod:`.schedule_theory` has the
closed forms the tests check them against):

- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B's
  warm-up, then ``F``, ``I`` and, once rank ``r`` has done ``r`` steady steps, the oldest
  ``W``. Bubble ``(p - 1)(T_F + T_B - T_W)`` per rank, a third of 1F1B's ``(p - 1)(T_F + T_B +
  T_W)``; every rank holds at most ``p`` microbatches (1F1B's peak, on its first rank).
- ZB-V (the same paper, section 6): two chunks per rank in a V (:data:`.actions.PLACEMENTS`),
  rank ``r`` holding stages ``r`` and ``2p - 1 - r``; near-zero bubble at 1F1B's activation
  memory (``2p`` half-size chunks).
- DualPipeV (DeepSeek-V3 technical report, arXiv 2412.19437, and the DualPipe repository's
  V-shaped variant): the V layout, with the steady phase pairing the forward of one chunk
  with the full backward of the other, whose computation and communication DualPipe overlaps.
  shardlib runs each pair's two actions one after the other on one stream (torch's default
  too), with their transfers posted together. Needs ``m >= 2p``.
"""

from __future__ import annotations

from ..errors import ShardingError
from .actions import Action, check_sizes as _check

__all__ = ["zb_h1", "zbv", "dualpipev"]


def zb_h1(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1: 1F1B with split backwards, rank ``r`` deferring its first ``r`` ``W`` s (see the module).

    Raises:
        ShardingError: ``v != 1`` (ZB-V is the two-chunk zero-bubble schedule).
    """
    _check(p, m, v, "zb_h1")
    if v != 1:
        raise ShardingError(f"zb_h1 runs one model chunk per rank, got virtual_stages={v}; for two chunks per rank "
                            "use schedule='zbv' (or 'dualpipev')")
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        f, b, w, step = warm, 0, 0, 0
        while b < m:
            if f < m:
                acts.append(Action(r, "F", f))
                f += 1
            acts.append(Action(r, "I", b))
            b += 1
            if step >= r:  # rank r defers its first r weight gradients into its cool-down bubble
                acts.append(Action(r, "W", w))
                w += 1
            step += 1
        acts += [Action(r, "W", i) for i in range(w, m)]
        ranks.append(acts)
    return ranks


def zbv(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V, ``F``/``I``/``W`` interleaved (see the module).

    Raises:
        ShardingError: ``v != 2`` (the V holds two chunks per rank).
    """
    _check(p, m, v, "zbv")
    if v != 2:
        raise ShardingError(f"zbv holds exactly two model chunks per rank (a V over the ranks), got virtual_stages={v}. "
                            "Fix: virtual_stages=2 (the default for this schedule)")
    n = max(2 * p - 1, m)  # built for at least 2p - 1 microbatches, then the ones beyond m dropped
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        acts: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - r) - 1):
            acts.append(Action(s0, "F", f0))
            f0 += 1
        for _ in range(r):
            acts += [Action(s1, "F", f1), Action(s0, "F", f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(p - r):
            acts += [Action(s1, "F", f1), Action(s1, "I", b1), Action(s1, "W", b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(Action(s0, "F", f0))
                f0 += 1
            acts += [Action(s0, "I", b0), Action(s0, "W", b0), Action(s1, "F", f1), Action(s1, "I", b1),
                     Action(s1, "W", b1)]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(r):
            acts += [Action(s0, "I", b0), Action(s1, "I", b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(p - r):
            acts += [Action(s0, "I", b0), Action(s0, "W", w0)]
            b0, w0 = b0 + 1, w0 + 1
        acts += [Action(s1, "W", i) for i in range(w1, b1)]
        acts += [Action(s0, "W", i) for i in range(w0, b0)]
        ranks.append([a for a in acts if a.microbatch < m])
    return ranks


def dualpipev(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """DualPipeV: the V layout with forward/backward pairs in the steady phase (see the module).

    Raises:
        ShardingError: ``v != 2``, or fewer microbatches than stages (``m < 2p``).
    """
    _check(p, m, v, "dualpipev")
    if v != 2:
        raise ShardingError(f"dualpipev holds exactly two model chunks per rank (a V over the ranks), got "
                            f"virtual_stages={v}. Fix: virtual_stages=2 (the default for this schedule)")
    if m < 2 * p:
        raise ShardingError(f"dualpipev needs at least as many microbatches as stages: {m} microbatches for {2 * p} "
                            f"stages (pp={p} x 2 chunks), as DualPipe and torch's ScheduleDualPipeV. Fix: microbatches "
                            f">= {2 * p}, or schedule='zbv'")
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        acts: list[Action] = []
        count: dict[tuple[int, str], int] = {}
        weights: list[tuple[int, int]] = []  # (stage, microbatch) of I's whose W waits

        def add(stage: int, kind: str) -> None:
            i = count.get((stage, "B"), 0) if kind in "BI" else count.get((stage, kind), 0)
            acts.append(Action(stage, kind, i))
            if kind in "BI":
                count[(stage, "B")] = i + 1
                if kind == "I":
                    weights.append((stage, i))
            else:
                count[(stage, kind)] = i + 1

        def add_weight() -> None:
            if weights:
                acts.append(Action(weights[0][0], "W", weights.pop(0)[1]))

        for _ in range(2 * (p - r - 1)):  # 1: chunk 0's forwards
            add(s0, "F")
        for _ in range(r + 1):  # 2: both chunks' forwards
            add(s0, "F")
            add(s1, "F")
        for _ in range(p - r - 1):  # 3: chunk 1 zero-bubble steps
            add(s1, "I")
            add_weight()
            add(s1, "F")
        for i in range(m - 2 * p + r + 1):  # 4: the overlapped pairs F0 + B1, F1 + B0
            add(s0, "F")
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        for _ in range(p - r - 1):  # 5: B1, then the pair F1 + B0
            add(s1, "B")
            add(s1, "F")
            add(s0, "B")
        split = False  # 6: both chunks' backwards, the second half split (W deferred)
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(s1, "I" if split else "B")
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(s0, "I" if split else "B")
        for _ in range(p - r - 1):  # 7: W, then chunk 0's backward
            add_weight()
            add(s0, "I" if split else "B")
        while weights:  # 8: the weight gradients left
            add_weight()
        ranks.append(acts)
    return ranks
