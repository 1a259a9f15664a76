"""Learning-rate schedules: linear warmup, then cosine, linear or no decay to a floor.

The shapes are GPT-3's and nanoGPT's (arXiv 2005.14165, appendix B: linear warmup, cosine decay
to 10% of the peak) and Megatron-LM's ``--lr-decay-style`` choices (cosine, linear, constant).
"""

from __future__ import annotations

import math

__all__ = ["DECAYS", "learning_rate"]

DECAYS = ("cosine", "linear", "constant")


def learning_rate(step: int, lr: float, steps: int, warmup_steps: int = 0, decay: str = "cosine",
                  min_lr: float = 0.0) -> float:
    """The learning rate of the 0-based optimizer ``step``.

    Warmup: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first update is
    not taken at 0). Then over the remaining ``steps - warmup_steps`` updates the rate goes from
    ``lr`` to ``min_lr``: ``cosine`` as ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2``,
    ``linear`` as ``lr - (lr - min_lr) * p``, ``constant`` stays at ``lr``; ``p`` is the fraction
    of the decay steps done (0 at the first step after warmup, 1 at the last step).

    Args:
        step: the optimizer step, 0-based.
        lr: the peak rate (after warmup).
        steps: the total number of optimizer steps of the run.
        warmup_steps: steps of linear warmup (0: none).
        decay: one of :data:`DECAYS`.
        min_lr: the rate at the last step (cosine and linear).

    Returns:
        The rate, a float.

    Raises:
        ValueError: an unknown ``decay``, a negative ``step``.
    """
    if decay not in DECAYS:
        raise ValueError(f"learning_rate: decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    if step < 0:
        raise ValueError(f"learning_rate: step must be >= 0, got {step}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = steps - warmup_steps - 1
    p = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    if decay == "linear":
        return lr - (lr - min_lr) * p
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
