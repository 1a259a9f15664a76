"""Pipeline timelines: the measured bubble and an SVG picture of each rank's actions."""

from __future__ import annotations

import re

__all__ = ["measured_bubble", "timeline_svg", "COLORS"]

COLORS = {"F": "#4e79a7", "B": "#f28e2b", "I": "#e15759", "W": "#59a14f"}
LEGEND = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def _kind(name: str) -> str:
    """The kind of an action label like ``12W3``."""
    return re.fullmatch(r"\d+([FBIW])\d+", name).group(1)


def measured_bubble(timelines: list[list[tuple[str, float, float]]]) -> list[float]:
    """Idle fraction per rank: 1 - busy time / (last end - first start over all ranks)."""
    start = min(t[1] for tl in timelines for t in tl)
    end = max(t[2] for tl in timelines for t in tl)
    return [1 - sum(e - s for _, s, e in tl) / (end - start) for tl in timelines]


def timeline_svg(timelines: list[list[tuple[str, float, float]]], width: int = 900) -> str:
    """An SVG picture of per-rank timelines ``[(action, start s, end s)]``: one row per rank,
    each action labelled like ``1F0``: forwards blue, full backwards orange, and a split
    backward's two halves apart, ``I`` (to the input) red and ``W`` (the weights) green, so the
    bubble a zero-bubble schedule fills with ``W`` shows; a legend under the rows."""
    start = min(t[1] for tl in timelines for t in tl)
    end = max(t[2] for tl in timelines for t in tl)
    scale = (width - 80) / max(end - start, 1e-9)
    row = 28
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(timelines) + 30}" '
             'font-family="monospace" font-size="10">']
    for r, tl in enumerate(timelines):
        y = 10 + r * row
        parts.append(f'<text x="4" y="{y + 16}">rank {r}</text>')
        for name, s, e in tl:
            x, w = 70 + (s - start) * scale, max((e - s) * scale, 1)
            color = COLORS[_kind(name)]
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{color}" stroke="white">'
                         f'<title>{name}: {(e - s) * 1e3:.2f} ms</title></rect>')
            if w > 18:
                parts.append(f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white">{name}</text>')
    parts.append(f'<text x="70" y="{row * len(timelines) + 24}">{(end - start) * 1e3:.1f} ms; bubble per rank '
                 + ", ".join(f"{b:.2f}" for b in measured_bubble(timelines)) + "; "
                 + ", ".join(f'<tspan fill="{COLORS[k]}">{k} {LEGEND[k]}</tspan>' for k in "FBIW"
                             if any(_kind(n) == k for tl in timelines for n, _, _ in tl)) + "</text></svg>")
    return "\n".join(parts)
