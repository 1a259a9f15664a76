"""Communication accounting: logical bytes per rank, by mesh axis and collective kind.

Figures are the per-rank traffic of the standard ring algorithms, the unit of the ZeRO paper
(arXiv 1910.02054, section 7) and of Megatron's analysis: for a group of ``N`` ranks and a
payload of ``B`` bytes,

=================  ==========================  ==========================================
kind               payload ``B``                bytes per rank
=================  ==========================  ==========================================
``all_reduce``     the tensor reduced           ``2 B (N - 1) / N``
``all_gather``     the gathered output          ``B (N - 1) / N``
``reduce_scatter`` the input before scatter     ``B (N - 1) / N``
``all_to_all``     the local input              ``B (N - 1) / N``
``broadcast``      the tensor                   ``B (N - 1) / N``
``send``           the tensor sent              ``B``
=================  ==========================  ==========================================

These are *logical* figures counted at our own call sites, independent of how the backend
implements the call (gloo builds reduce-scatter from an all-reduce, for instance).
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

__all__ = ["CommCounter", "ring_bytes"]

_FACTOR = {
    "all_reduce": lambda n: Fraction(2 * (n - 1), n),
    "all_gather": lambda n: Fraction(n - 1, n),
    "reduce_scatter": lambda n: Fraction(n - 1, n),
    "all_to_all": lambda n: Fraction(n - 1, n),
    "broadcast": lambda n: Fraction(n - 1, n),
    "send": lambda n: Fraction(1),
}


def ring_bytes(kind: str, payload_bytes: int, group_size: int) -> Fraction:
    """Per-rank bytes of one collective of ``kind`` on ``payload_bytes`` over ``group_size`` ranks."""
    if group_size <= 1:
        return Fraction(0)
    return _FACTOR[kind](group_size) * payload_bytes


class CommCounter:
    """Counts collectives: calls and per-rank logical bytes, keyed by ``(axis, kind)``.

    ``axis`` is the axis name, or names joined by ``+`` for a product of axes. Collectives over a
    group of one rank move nothing and are not counted.

    Example:
        >>> c = CommCounter()
        >>> c.record("dp", "all_reduce", 400, 4)
        >>> c.bytes(), c.calls()
        (600.0, 1)
    """

    def __init__(self):
        # payload bytes summed by (axis, kind, group size): a call costs an integer add (it is on the
        # pipeline's critical path); the ring factors are applied, exactly, when read
        self._payload: dict[tuple[str, str, int], int] = defaultdict(int)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self.enabled = True

    def record(self, axis: str, kind: str, payload_bytes: int, group_size: int) -> None:
        if not self.enabled or group_size <= 1:
            return
        if kind not in _FACTOR:
            raise KeyError(kind)
        self._payload[(axis, kind, group_size)] += payload_bytes
        self._calls[(axis, kind)] += 1

    def _exact(self) -> dict[tuple[str, str], Fraction]:
        out: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        for (a, k, n), payload in self._payload.items():
            out[(a, k)] += ring_bytes(k, payload, n)
        return out

    def _select(self, table, axis, kind):
        return [v for (a, k), v in table.items() if (axis is None or a == axis) and (kind is None or k == kind)]

    def bytes(self, axis: str | None = None, kind: str | None = None) -> float:
        """Per-rank logical bytes recorded for ``axis`` and ``kind`` (``None``: all)."""
        return float(self.exact_bytes(axis, kind))

    def exact_bytes(self, axis: str | None = None, kind: str | None = None) -> Fraction:
        """As :meth:`bytes`, as an exact fraction."""
        return sum(self._select(self._exact(), axis, kind), Fraction(0))

    def calls(self, axis: str | None = None, kind: str | None = None) -> int:
        """Number of collectives recorded for ``axis`` and ``kind`` (``None``: all)."""
        return sum(self._select(self._calls, axis, kind))

    def table(self) -> dict[tuple[str, str], tuple[int, float]]:
        """``{(axis, kind): (calls, bytes)}``."""
        return {k: (self._calls[k], float(v)) for k, v in sorted(self._exact().items())}

    def reset(self) -> None:
        self._payload.clear()
        self._calls.clear()

    def __repr__(self) -> str:
        rows = ", ".join(f"{a}/{k}: {c} calls {b:.0f} B" for (a, k), (c, b) in self.table().items())
        return f"CommCounter({rows})"
