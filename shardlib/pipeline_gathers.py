"""ZeRO-3 all-gathers of a pipeline stage per step, as the runtime issues them.

Under ZeRO-3 (Rajbhandari et al., arXiv 1910.02054) a stage gathers its chunks in every forward
and backward it runs, and a pipeline rank runs one forward and one backward (or, under the
zero-bubble schedules, arXiv 2401.10241, an ``I`` and a ``W``) per microbatch and model chunk, in
the schedule's order. What each action gathers (:mod:`shardlib.parallel.gather`; a model chunk's
ZeRO chunks are its own, :func:`~shardlib.plan_items.plan_entries`):

- ``F``: every chunk the model chunk uses (its own, and another's it reads: a tied embedding
  the LM head uses). The forward first frees every chunk still gathered; after it, the chunks
  with ``reshard_after_forward`` False (tied) stay gathered.
- ``B``: every chunk the model chunk uses that is not gathered; at its end every chunk is freed.
- ``I`` (the input gradient): on the first stage (its input, token ids, takes no gradient)
  nothing, and what is gathered stays; elsewhere as ``B``: the input path needs every chunk's
  parameters (their saved views are rebuilt from the re-gathered chunks) in the models shardlib
  ships (a chunk holding only parameters the input path skips, biases alone, would not be).
- ``W`` (the parameter gradients, one backward for ZeRO: ``ZeroRuntime.one_backward``): as
  ``B`` when the model chunk has a trainable parameter, else nothing; at its end every chunk is
  freed. So a chunk is gathered again for ``W`` after its ``I``: three gathers per microbatch
  where a full backward needs two (the gradient pass gathers parameters it only writes
  gradients for: its arrival gathers the chunk, :meth:`ZeroRuntime._on_grad_ready`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .parallel.actions import rank_stages
from .parallel.schedules import build_schedule, placement

__all__ = ["StageSchedule", "stage_schedule", "zero3_gathers"]


@dataclass(frozen=True)
class StageSchedule:
    """One pipeline rank's training actions, as the cost model reads them.

    Attributes:
        m: microbatches per schedule run (one ``forward_backward``).
        actions: ``(kind, model chunk, first stage)`` in execution order: kind ``"F"``, ``"B"``,
            ``"I"`` or ``"W"`` (:mod:`shardlib.parallel.actions`), the index of the model chunk in
            the rank's :class:`~shardlib.parallel.pipeline.Stage`, and whether it is stage 0
            (whose input takes no gradient).
    """

    m: int
    actions: tuple[tuple[str, int, bool], ...]


def stage_schedule(schedule: str, p: int, m: int, v: int, rank: int) -> StageSchedule:
    """The :class:`StageSchedule` of pp rank ``rank`` under ``schedule`` (``p`` ranks, ``m``
    microbatches, ``v`` model chunks per rank).

    Raises:
        ShardingError: an unknown schedule, or sizes it does not support (:func:`build_schedule`).

    Example:
        >>> stage_schedule("1f1b", 2, 2, 1, 1).actions
        (('F', 0, False), ('B', 0, False), ('F', 0, False), ('B', 0, False))
    """
    chunk_of = {s: c for c, s in enumerate(rank_stages(rank, p, v, placement(schedule)))}
    acts = build_schedule(schedule, p, m, v)[rank]
    return StageSchedule(m=m, actions=tuple((a.kind, chunk_of[a.stage], a.stage == 0) for a in acts))


def zero3_gathers(plan) -> list[int]:
    """All-gathers of each ZeRO chunk of pipeline stage ``plan`` (a :class:`~shardlib.Plan` with
    :attr:`~shardlib.Plan.pipeline` set) in one run of its schedule, by chunk index: the
    runtime's order walked action by action (see the module).

    Example (pp rank 0 of a V holds the tied embedding in model chunk 0 and the LM head in 1):
        >>> import shardlib, torch
        >>> from shardlib.models import GPT, GPTConfig
        >>> gpt = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=16, bias=False))
        >>> stage = shardlib.plan(gpt, shardlib.AbstractMesh({"pp": 2, "dp": 2}), schedule="zbv", microbatches=2,
        ...                       zero_stage=3).stages[0]
        >>> [(c.model_chunk, c.used_by, n) for c, n in zip(stage.chunks, zero3_gathers(stage))][:1]
        [(0, (0, 1), 8)]
    """
    chunks = plan.chunks
    uses = {k: {c.index for c in chunks if k in c.used_by} for k in {k for c in chunks for k in c.used_by}}
    trainable = {k for c in chunks if c.requires_grad for k in c.used_by}
    kept = {c.index for c in chunks if not c.reshard_after_forward}
    count = [0] * len(chunks)
    gathered: set[int] = set()
    for kind, k, first in plan.pipeline.actions:
        used = uses.get(k, set())
        if kind == "F":
            gathered = set()  # the forward frees what an earlier forward kept
        elif kind == "I" and first or kind == "W" and k not in trainable:
            if kind == "W":
                gathered = set()
            continue
        for i in used - gathered:
            count[i] += 1
        gathered = used & kept if kind == "F" else set()
    return count
