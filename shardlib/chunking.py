"""ZeRO chunk layout: which parameters share a flat buffer, and the chunk size when none is given.

ColossalAI Gemini's layout (Fang et al., "Parallel Training of Pre-Trained Models via Chunk-Based
Dynamic Memory Management", IEEE TPDS 2022): parameters consecutive in execution order
(registration order) share a chunk, and a chunk holds whole modules, so a transformer block is
gathered by one all-gather, freed by one free, and recomputing it in backward needs no second
gather. The packing (:func:`pack`) keeps one open chunk per group (dtype, trainable, split over a
tensor axis, pipeline model chunk: :func:`~shardlib.plan_items.plan_entries`, so a model chunk's
forward gathers nothing of another's) and starts a new one when the next *unit* does not fit whole; a unit is a
transformer block (:func:`~shardlib.parallel.recompute.find_blocks`), else the module that holds
the parameter. A unit larger than the chunk size is split at parameter boundaries (a parameter
larger than it gets a chunk of its own). A tied parameter (an embedding shared with the LM head)
gets a chunk of its own, as small as the tensor: under ZeRO-3 it stays gathered from its forward
gather to the end of backward (:class:`~shardlib.plan_items.ChunkPlan.reshard_after_forward`).

With no ``chunk_size`` given, :func:`search_chunk_size` picks the block-aligned size that
minimizes padding plus the largest gathered working set of a ZeRO-3 forward (Gemini's chunk
search minimizes waste over a range of sizes; the working set is what makes a small model
keep most of its parameters gathered when its chunks are large). It is the same objective at
every stage: at stages 0-2 a chunk is the unit of gradient reduction, and the chunk size bounds
the gradient buffers in flight and sets how early reductions overlap backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["MIN_SEARCHED_CHUNK", "ChunkSearch", "Entry", "param_units", "pack", "gathered_peak", "search_chunk_size"]

# The smallest chunk the search proposes, in elements (1 MiB of fp32), unless the whole model is
# smaller (then it is one chunk) or one transformer block is: below it an all-gather is latency-bound (NCCL's fixed cost of
# ~10-20 us per collective against ~40 us to move 1 MiB at 25 GB/s), so smaller chunks buy memory
# with time. A block smaller than this is the floor instead: one block per chunk is FSDP2's
# per-block ``fully_shard`` (the granularity its users pick), and a chunk of several small blocks
# gathers more than FSDP2 holds on the same model (24-block 64-wide GPT, dp=2: 5 blocks a chunk
# peaked at 59.2 MB per rank against FSDP2's 57.9, one block a chunk at 57.7; benchmarks.memory).
MIN_SEARCHED_CHUNK = 1 << 18
_MAX_CANDIDATES = 64  # sizes evaluated (geometrically spaced when there are more)


@dataclass(frozen=True)
class Entry:
    """One parameter as the packing sees it: canonical name, elements on this rank (tensor-
    parallel local), group (dtype, trainable, split over a tensor axis, pipeline model chunk), unit (the module path
    whose boundary a chunk keeps), tied (a parameter under several names)."""

    name: str
    numel: int
    group: tuple
    unit: str
    tied: bool
    itemsize: int = 4


@dataclass(frozen=True)
class ChunkSearch:
    """Why :func:`search_chunk_size` chose its size: ``candidates`` block-aligned sizes from
    ``low`` to ``high`` elements were packed; the chosen one has ``padding_bytes`` of padding
    (all chunks, before the split over data ranks) and a largest gathered working set of
    ``working_bytes`` (a ZeRO-3 forward, the prefetched chunk and tied chunks included)."""

    size: int
    candidates: int
    low: int
    high: int
    padding_bytes: int
    working_bytes: int


def param_units(names: Iterable[str], blocks: list[str]) -> dict[str, str]:
    """``{parameter name: unit}``: the transformer block (a path in ``blocks``) holding the
    parameter, else the module holding it (``""``: the root)."""
    prefixes = [(b + ".", b) for b in blocks]
    out = {}
    for name in names:
        out[name] = next((b for pre, b in prefixes if name.startswith(pre)), name.rpartition(".")[0])
    return out


def pack(entries: list[Entry], chunk_size: int) -> list[dict]:
    """Chunks of ``entries`` (in order) of at most ``chunk_size`` elements, whole units where
    they fit (see the module); each ``{"group", "params", "offsets", "numel", "units", "tied",
    "itemsize"}``.

    The groups' open chunks are closed together: when the next unit does not fit whole into
    the open chunk of one of its groups, or has a group with no open chunk, every group starts
    a new chunk. So the chunks fall into segments of consecutive units, every chunk of a segment
    starting at its first unit, and segments follow each other in index order, in backward's
    reverse order too (a chunk spanning units around another segment would be gathered first in
    backward, and with it, as backward gathers go in descending index order, every chunk above
    it). A unit with fewer groups (a final norm) may join the open segment.
    """
    left: dict[tuple, int] = {}
    groups_of: dict[str, set] = {}
    for e in entries:
        if not e.tied:
            left[(e.unit, e.group)] = left.get((e.unit, e.group), 0) + e.numel
            groups_of.setdefault(e.unit, set()).add(e.group)
    chunks: list[dict] = []
    open_chunk: dict[tuple, int] = {}
    unit = None
    for e in entries:
        if e.tied:
            chunks.append({"group": e.group, "params": [e.name], "offsets": [0], "numel": e.numel,
                           "units": [e.unit], "tied": True, "itemsize": e.itemsize})
            continue
        if e.unit != unit:  # a unit starts: it goes whole into the open chunks, or all of them close
            unit = e.unit
            used = {g: chunks[i]["numel"] for g, i in open_chunk.items() if chunks[i]["numel"] > 0}
            if used and (not groups_of[unit] <= set(used)
                         or any(used[g] + left[(unit, g)] > chunk_size for g in groups_of[unit])):
                open_chunk.clear()
        idx = open_chunk.get(e.group)
        if idx is not None and 0 < chunks[idx]["numel"] and chunks[idx]["numel"] + e.numel > chunk_size:
            idx = None  # inside a unit larger than a chunk: split at a parameter
        if idx is None:
            idx = len(chunks)
            chunks.append({"group": e.group, "params": [], "offsets": [], "numel": 0, "units": [], "tied": False,
                           "itemsize": e.itemsize})
            open_chunk[e.group] = idx
        c = chunks[idx]
        c["params"].append(e.name)
        c["offsets"].append(c["numel"])
        c["numel"] += e.numel
        if not c["units"] or c["units"][-1] != e.unit:
            c["units"].append(e.unit)
        left[(e.unit, e.group)] -= e.numel
    return chunks


def _padded(numel: int, parts: int) -> int:
    return -(-max(numel, 1) // parts) * parts


def gathered_peak(chunks: list[dict], parts: int, units: list[str]) -> int:
    """The largest sum of gathered chunk bytes in a ZeRO-3 forward, as
    :class:`~shardlib.parallel.gather.ParameterGathering` runs it: units in order; at each, every
    chunk up to the highest it uses is gathered, then the one after that unless it is already
    (prefetch, one chunk ahead); a chunk is freed
    after the last unit using it, a tied chunk not until backward ends. ``units``: the units
    in execution (registration) order."""
    order = {u: i for i, u in enumerate(dict.fromkeys(units))}
    size = [_padded(c["numel"], parts) * c["itemsize"] for c in chunks]
    uses: dict[int, list[int]] = {}
    last = []
    for i, c in enumerate(chunks):
        pos = [order[u] for u in c["units"]]
        for p in pos:
            uses.setdefault(p, []).append(i)
        last.append(max(pos))
    gathered: set[int] = set()
    nxt, peak = 0, 0
    for u in range(len(order)):
        need = uses.get(u, [])
        if not need:
            continue
        top = max(need)
        gathered.update(range(nxt, top + 1))
        nxt = max(nxt, top + 1)
        if nxt == top + 1 < len(chunks):
            gathered.add(nxt)
            nxt += 1
        peak = max(peak, sum(size[i] for i in gathered))
        gathered = {i for i in gathered if last[i] > u or chunks[i]["tied"]}
    return peak


def _candidates(entries: list[Entry], blocks: frozenset = frozenset()) -> tuple[list[int], int, int]:
    units: dict[tuple, dict[str, int]] = {}  # group -> unit -> elements, in order
    for e in entries:
        if not e.tied:
            units.setdefault(e.group, {})
            units[e.group][e.unit] = units[e.group].get(e.unit, 0) + e.numel
    if not units:
        return [MIN_SEARCHED_CHUNK], MIN_SEARCHED_CHUNK, MIN_SEARCHED_CHUNK
    largest_unit = max(n for g in units.values() for n in g.values())
    high = max(sum(g.values()) for g in units.values())
    # the floor: the whole model when it is below MIN_SEARCHED_CHUNK (one collective), else the
    # smaller of MIN_SEARCHED_CHUNK and the largest transformer block
    block = max((n for g in units.values() for u, n in g.items() if u in blocks), default=MIN_SEARCHED_CHUNK)
    low = high if high <= MIN_SEARCHED_CHUNK else max(largest_unit, min(MIN_SEARCHED_CHUNK, block))
    sums = {low, high}
    for g in units.values():
        sizes = list(g.values())
        for i in range(len(sizes)):
            run = 0
            for n in sizes[i:]:
                run += n
                if run > high:
                    break
                if run >= low:
                    sums.add(run)
    cands = sorted(sums)
    if len(cands) > _MAX_CANDIDATES:  # geometrically spaced picks, both ends kept
        ratio = (high / low) ** (1 / (_MAX_CANDIDATES - 1))
        picks, target = [], float(low)
        for c in cands:
            if c >= target or c == high:
                picks.append(c)
                target = max(target * ratio, c + 1)
        cands = picks
    return cands, low, high


def search_chunk_size(entries: list[Entry], parts: int, blocks: Iterable[str] = ()) -> ChunkSearch:
    """The block-aligned chunk size for ``entries`` (:func:`pack`) over ``parts`` data ranks
    minimizing padding bytes plus :func:`gathered_peak`; the larger size (fewer collectives) on
    a tie. Candidates are the sums of runs of consecutive units of one group, at least the
    largest unit (a unit is never split) and :data:`MIN_SEARCHED_CHUNK`, or the largest
    transformer block if smaller (``blocks``: the units that are blocks, see
    :data:`MIN_SEARCHED_CHUNK`); a model smaller than :data:`MIN_SEARCHED_CHUNK` is one chunk. Deterministic: every rank computes the same from the same plan."""
    cands, low, high = _candidates(entries, frozenset(blocks))
    units = [e.unit for e in entries]
    best: tuple[Any, ...] | None = None
    for size in cands:
        chunks = pack(entries, size)
        padding = sum((_padded(c["numel"], parts) - c["numel"]) * c["itemsize"] for c in chunks)
        working = gathered_peak(chunks, parts, units)
        key = (padding + working, -size)
        if best is None or key < best[0]:
            best = (key, size, padding, working)
    _, size, padding, working = best
    return ChunkSearch(size=size, candidates=len(cands), low=low, high=high, padding_bytes=padding,
                       working_bytes=working)
