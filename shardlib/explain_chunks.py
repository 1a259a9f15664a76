"""The ZeRO chunks in ``Plan.explain()``: which modules each flat buffer holds, and why that size.

One line per chunk (index, elements, dtype and role, the modules it holds); a run of chunks
that each hold one module of a repeated block (``blocks.0`` ... ``blocks.23``) with the same
size and kind folds into one line, so an 80-layer model prints a few lines, not 160.
"""

from __future__ import annotations

import re

from .explain_summary import fit, human

__all__ = ["chunk_lines"]

_INDEXED = re.compile(r"^(.*?)(\d+)$")
_SHOWN_UNITS = 4  # modules named on a chunk's line; the rest are counted
_SHOWN_ROWS = (16, 6)  # lines kept at the start and the end of a long list (explain(full=True): all)


def _kind(plan, chunk) -> str:
    parts = [str(chunk.dtype).replace("torch.", "")]
    if not chunk.requires_grad:
        parts.append("frozen")
    if chunk.tp_sharded:
        parts.append("tensor-parallel")
    if not chunk.reshard_after_forward:
        parts.append("tied: kept gathered forward to backward" if plan.effective_stage == 3 else "tied")
    return ", ".join(parts)


def _units(units: tuple[str, ...]) -> str:
    names = [u or "(root)" for u in units]
    if len(names) <= _SHOWN_UNITS:
        return ", ".join(names)
    return ", ".join(names[:_SHOWN_UNITS - 1]) + f", ... {names[-1]} ({len(names)} modules)"


def _indexed(units: tuple[str, ...]) -> tuple[str, int, int] | None:
    """``("blocks.", 4, 2)`` for ``("blocks.4", "blocks.5")``: units of one list, consecutive."""
    found = [_INDEXED.match(u) for u in units]
    if not units or not all(found) or len({m.group(1) for m in found}) != 1:
        return None
    idx = [int(m.group(2)) for m in found]
    return (found[0].group(1), idx[0], len(idx)) if idx == list(range(idx[0], idx[0] + len(idx))) else None


def chunk_lines(plan, full: bool = False) -> list[str]:
    """The chunk section of ``plan.explain()``: a heading with the chunk size and its reason
    (:class:`shardlib.chunking.ChunkSearch`, or "given"), then one line per segment (the
    consecutive chunks holding the same modules: one per group, replicated and tensor-parallel
    for instance), a run of segments each holding the next blocks of one list folded; of more
    than 27 lines the first 16 and the last 6 unless ``full``."""
    search = plan.chunk_search
    if search is None:
        why = f"chunk size {plan.chunk_size:,} elements (given)"
    else:
        why = (f"chunk size {plan.chunk_size:,} elements, searched over {search.candidates} block-aligned sizes "
               f"({search.low:,} to {search.high:,}): the least padding ({human(search.padding_bytes)}) plus largest "
               f"gathered working set ({human(search.working_bytes)}, a ZeRO-3 forward with its prefetch)")
    lines = [f"chunks: {len(plan.chunks)}; {why}; each holds whole modules where they fit:"]
    segments: list[list] = []
    for c in plan.chunks:
        if segments and segments[-1][-1].units == c.units and c.reshard_after_forward and segments[-1][-1].reshard_after_forward:
            segments[-1].append(c)
        else:
            segments.append([c])
    rows: list[tuple[int, int, list, tuple | None]] = []  # (first chunk, last chunk, a segment, folded units)
    for seg in segments:
        key = tuple((c.numel, _kind(plan, c)) for c in seg)
        ix = _indexed(seg[0].units)
        if rows and ix:
            first, _, prev, pix = rows[-1]
            if (pix and tuple((c.numel, _kind(plan, c)) for c in prev) == key and pix[0] == ix[0]
                    and ix[2] == len(prev[0].units) and ix[1] == pix[1] + pix[2]):
                rows[-1] = (first, seg[-1].index, prev, (pix[0], pix[1], pix[2] + ix[2]))
                continue
        rows.append((seg[0].index, seg[-1].index, seg, ix))
    body: list[str] = []
    sizes = [" + ".join(f"{c.numel:,}" for c in seg) for _, _, seg, _ in rows]
    index = [f"{a}-{b}" if a != b else str(a) for a, b, _, _ in rows]
    iw, sw = max(map(len, index)), max(map(len, sizes))
    for (first, last, seg, ix), idx, size in zip(rows, index, sizes):
        folded = ix is not None and ix[2] > len(seg[0].units)
        if folded or (ix is not None and ix[2] > _SHOWN_UNITS):
            held = f"{ix[0]}{{{ix[1]}..{ix[1] + ix[2] - 1}}}"
            per = "chunk" if len(seg) == 1 else f"{len(seg)} chunks"
            held += f", {len(seg[0].units)} per {per}" if folded else ""
        else:
            held = _units(seg[0].units)
        kinds = "; ".join(dict.fromkeys(_kind(plan, c) for c in seg))
        body.append(f"  {idx:>{iw}}  {size:>{sw}}  {held} ({kinds})")
    head, tail = _SHOWN_ROWS
    if not full and len(body) > head + tail + 5:
        body = body[:head] + [f"  ... {len(body) - head - tail} more lines (explain(full=True) lists every chunk)"] + body[-tail:]
    return fit(lines + body)
