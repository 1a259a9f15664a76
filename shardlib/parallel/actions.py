"""The vocabulary of pipeline schedules: actions, and which pp rank holds which stage.

An :class:`Action` is ``(stage, kind, microbatch)`` and prints as torch.distributed.pipelining
writes it (``1F0``: stage 1, forward, microbatch 0). Kinds:

- ``"F"``: forward.
- ``"B"``: full backward (gradients to the stage input and to its parameters in one pass).
- ``"I"``: backward to the stage input only: the critical-path half of a split backward (the
  zero-bubble paper's "B", torch's ``BACKWARD_INPUT``), whose gradient goes upstream at once.
- ``"W"``: the parameter gradients of a stage and microbatch whose ``"I"`` ran (the paper's
  "W", torch's ``BACKWARD_WEIGHT``); deferred into the bubble.

Every (stage, microbatch) has one ``F`` and either one ``B`` or one ``I`` and one ``W``; a
schedule may mix the two forms (DualPipeV does). Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024 (arXiv 2401.10241).

Placement. ``S = p * v`` stages over ``p`` ranks. ``"loop"`` (Megatron's interleaving): stage
``s`` on rank ``s % p``, so a rank's chunks are stages ``r, r + p, ...``. ``"v"`` (zigzag, the
V of ZB-V and DualPipeV): chunk ``c`` of rank ``r`` is stage ``c * p + r`` for even ``c`` and
``c * p + p - 1 - r`` for odd ``c``; with two chunks rank ``r`` holds stages ``r`` and
``2p - 1 - r``, so rank 0 holds the first and the last stage, and stages ``p - 1`` and ``p`` are
on one rank (their boundary moves no bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError

__all__ = ["Action", "KINDS", "PLACEMENTS", "stage_rank", "rank_stages", "stage_owners", "check_sizes"]

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True, order=True)
class Action:
    """One action of a schedule: ``kind`` (``"F"``, ``"B"``, ``"I"`` or ``"W"``, see the module)
    of virtual stage ``stage`` on microbatch ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The pp rank holding virtual stage ``stage`` of ``p`` ranks under ``placement``."""
    chunk, within = divmod(stage, p)
    if placement == "loop" or chunk % 2 == 0:
        return within
    if placement == "v":
        return p - 1 - within
    raise ShardingError(f"unknown stage placement {placement!r}; choose one of {PLACEMENTS}")


def rank_stages(rank: int, p: int, v: int, placement: str = "loop") -> list[int]:
    """The virtual stages pp rank ``rank`` holds, in chunk order (chunk ``c`` is item ``c``)."""
    if placement not in PLACEMENTS:
        raise ShardingError(f"unknown stage placement {placement!r}; choose one of {PLACEMENTS}")
    return [c * p + (rank if placement == "loop" or c % 2 == 0 else p - 1 - rank) for c in range(v)]


def stage_owners(schedule: list[list[Action]]) -> dict[int, int]:
    """``{stage: rank}`` as a schedule lays its actions out (every rank's list holds the actions
    of its own stages).

    Raises:
        ShardingError: a stage with actions on two ranks.
    """
    owners: dict[int, int] = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            if owners.setdefault(a.stage, r) != r:
                raise ShardingError(f"stage {a.stage} has actions on ranks {owners[a.stage]} and {r}; a stage lives on one rank")
    return owners


def check_sizes(p: int, m: int, v: int, name: str) -> None:
    """Raise a ShardingError naming schedule ``name`` unless ``p``, ``m`` and ``v`` are positive ints."""
    for label, value in (("pipeline size", p), ("microbatches", m), ("model chunks per rank", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardingError(f"{name}: {label} must be a positive int, got {value!r}")
