"""The per-parameter table of ``Plan.explain()``, and the folding of repeated blocks.

A model of 80 decoder layers has 80 copies of the same nine rows. :func:`fold` finds them from
the parameter names alone: at the first dotted component that is a number
(``model.layers.3.mlp.up_proj.weight``), consecutive numbered entries whose rows are equal
(relative names and every printed column) become one :class:`Block`,
``model.layers.{0..79}`` (80x), printed once; the entries inside a block are folded the same
way (a mixture of experts' ``mlp.experts.{0..7}``). Entries that differ stay apart, so a folded
row is exactly what each of its copies would print.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Row", "Block", "fold", "flatten", "index_set", "rank_bytes", "param_rows", "render_table",
           "block_bytes_line", "FOLD_ABOVE", "WIDTH"]

FOLD_ABOVE = 60  # the default table folds repeated blocks when it would have more rows than this
WIDTH = 100  # characters per line of the default view


@dataclass(frozen=True)
class Row:
    """One printed row: ``name`` (relative to its enclosing blocks), the other ``cells``, and
    ``weight`` (bytes per rank of one copy, for the totals). ``foldable`` False keeps a row out
    of any block (a tied parameter, whose aliases name other places)."""

    name: str
    cells: tuple[str, ...]
    weight: float = 0.0
    numel: int = 0
    foldable: bool = True


@dataclass(frozen=True)
class Block:
    """``count`` equal copies of ``children`` under ``name`` (``model.layers.{0..79}``)."""

    name: str
    count: int
    children: tuple = field(default_factory=tuple)

    @property
    def weight(self) -> float:
        """Bytes per rank of one copy."""
        return sum(c.weight * (c.count if isinstance(c, Block) else 1) for c in self.children)

    @property
    def numel(self) -> int:
        """Elements of one copy."""
        return sum(c.numel * (c.count if isinstance(c, Block) else 1) for c in self.children)

    @property
    def tensors(self) -> int:
        """Rows (tensors) of one copy."""
        return sum(c.tensors * c.count if isinstance(c, Block) else 1 for c in self.children)


def index_set(indices: list[int]) -> str:
    """Sorted indices as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0..2,5,7,8"`` (two in a row stay two).

    Args:
        indices: ascending ints, at least one.
    """
    parts, start = [], 0
    for i in range(1, len(indices) + 1):
        if i == len(indices) or indices[i] != indices[i - 1] + 1:
            lo, hi = indices[start], indices[i - 1]
            parts.append(str(lo) if lo == hi else f"{lo},{hi}" if hi == lo + 1 else f"{lo}..{hi}")
            start = i
    return ",".join(parts)


def _split(name: str) -> tuple[str, int, str] | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1:])
    return None


def _signature(item) -> tuple:
    if isinstance(item, Block):
        return ("block", item.name, item.count, tuple(_signature(c) for c in item.children))
    return ("row", item.name, item.cells, item.weight, item.numel, item.foldable)


def _prefixed(item, prefix: str):
    return replace(item, name=prefix + item.name)


def fold(rows: list[Row]) -> list:
    """Fold repeated numbered blocks of ``rows`` into :class:`Block` s.

    Args:
        rows: :class:`Row` s with full dotted names, in model order.

    Returns:
        :class:`Row` s and :class:`Block` s in the order of their first row; a block's children
        carry names relative to it. Equal copies fold only where consecutive in index order
        (``{0..39}`` and ``{40..79}`` stay two blocks if layer 40 differs).
    """
    order: list = []
    groups: dict[str, dict[int, list[Row]]] = {}
    for row in rows:
        split = _split(row.name) if row.foldable else None
        if split is None:
            order.append(row)
            continue
        prefix, index, rest = split
        if prefix not in groups:
            groups[prefix] = {}
            order.append(prefix)
        groups[prefix].setdefault(index, []).append(replace(row, name=rest))
    out: list = []
    for item in order:
        if not isinstance(item, str):
            out.append(item)
            continue
        dot = item + "." if item else ""
        runs: list[tuple[list[int], tuple, list]] = []
        for index in sorted(groups[item]):
            children = fold(groups[item][index])
            sig = tuple(_signature(c) for c in children)
            if runs and runs[-1][1] == sig:
                runs[-1][0].append(index)
            else:
                runs.append(([index], sig, children))
        for indices, _, children in runs:
            if len(indices) == 1:
                out += [_prefixed(c, f"{dot}{indices[0]}.") for c in children]
            else:
                out.append(Block(f"{dot}{{{index_set(indices)}}}", len(indices), tuple(children)))
    return out


def flatten(items: list, prefix: str = "", count: int = 1) -> list[tuple[str, int, Row]]:
    """Every row under ``items`` with its full pattern and number of copies.

    Args:
        items: what :func:`fold` returns. prefix, count: of the enclosing blocks (for the recursion).

    Returns:
        ``[(pattern, copies, row)]``, e.g. ``("model.layers.{0..79}.mlp.up_proj.weight", 80, row)``.
    """
    out = []
    for item in items:
        if isinstance(item, Block):
            out += flatten(list(item.children), f"{prefix}{item.name}.", count * item.count)
        else:
            out.append((prefix + item.name, count, item))
    return out


def rank_bytes(plan, p) -> float:
    """Bytes of parameter ``p`` stored per rank between steps, as :attr:`Plan.param_bytes` counts
    them (its padding aside): the tensor-parallel shard, over the data ranks at ZeRO-3 (the
    average share of the flat chunks, not one rank's slice: :meth:`Plan.local_numel` gives that),
    plus the persistent compute copy under mixed precision (stages 0-2). The rows of a plan sum
    to ``plan.param_bytes`` less the padding's share.

    Args:
        plan: a :class:`~shardlib.Plan`. p: one of its :class:`~shardlib.ParamPlan` s.

    Returns:
        Bytes per rank; a fraction where the data ranks do not divide the shard's elements.
    """
    local = int(np.prod(plan.local_shape(p), dtype=np.int64))
    chunk = plan.chunks[plan.placement[p.name][0]]
    stage = plan.effective_stage
    master = local * chunk.element_size / (plan.data_size if stage >= 1 and (stage == 3 or chunk.mixed_compute) else 1)
    return master + (local * chunk.compute_element_size if chunk.mixed_compute and stage < 3 else 0)


HEADER = ("parameter", "global shape", "spec", "strategy", "local shape", "bytes/rank")


def param_rows(plan) -> list[Row]:
    """One :class:`Row` per unique parameter of ``plan``, in model order.

    Args:
        plan: a :class:`~shardlib.Plan`.

    Returns:
        Rows named by the canonical name (with `` (= tied names)`` and `` [frozen]``), cells: global
        shape, spec, strategy, tensor-parallel local shape, bytes per rank (:func:`rank_bytes`).
    """
    rows = []
    for p in plan.params:
        name = p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else "") + ("" if p.requires_grad else " [frozen]")
        nbytes = rank_bytes(plan, p)
        cells = (str(p.global_shape), str(p.spec), p.strategy, str(plan.local_shape(p)), f"{nbytes:,.0f}")
        rows.append(Row(name, cells, nbytes, p.numel, foldable=not p.aliases))
    return rows


def block_bytes_line(block: Block) -> str:
    """A block's line in the parameter table: its copies, tensors and bytes per rank of one copy."""
    return f"{block.name} ({block.count}x), each {block.tensors} tensors, {block.weight:,.0f} B per rank:"


def nested(items: list, depth: int = 0) -> list[tuple[int, object]]:
    """``[(depth, item)]`` for rows and blocks in print order, a block's rows one level deeper."""
    out: list[tuple[int, object]] = []
    for item in items:
        out.append((depth, item))
        if isinstance(item, Block):
            out += nested(item.children, depth + 1)
    return out


def render_table(header: tuple[str, ...], items: list, width: int | None = WIDTH, block_line=block_bytes_line) -> list[str]:
    """Aligned lines of ``items`` (rows and blocks, as :func:`fold` gives them) under ``header``:
    names left-aligned and indented under their block, the last column right-aligned.

    A block prints as ``block_line(block)`` (default :func:`block_bytes_line`) above its rows. With ``width``, a row whose
    name would push the line past it prints its name on a line of its own, the cells below it;
    ``width=None`` keeps every row on one line (the full table: one line per parameter).

    Args:
        header: the column titles. items: rows and blocks. width: the line budget, or None.
        block_line: ``Block -> str``, the line above a block's rows.

    Returns:
        The lines: the header, a rule of dashes, then the rows.
    """
    leaves = nested(items)
    rows = [("  " * d + r.name, *r.cells) for d, r in leaves if isinstance(r, Row)]
    ncol = len(header)
    cell_widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(1, ncol)]
    rest = sum(cell_widths) + 2 * (ncol - 1)
    names = [len(header[0])] + [len(r[0]) for r in rows]
    name_width = max(names)
    if width is not None and name_width + rest > width:
        name_width = max(len(header[0]), max((n for n in names if n + rest <= width), default=0))

    def line(name, cells):
        body = "  ".join(c.rjust(w) if i == len(cells) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, cell_widths)))
        if len(name) > name_width:
            return [name, " " * name_width + "  " + body]
        return [(name.ljust(name_width) + "  " + body).rstrip()]

    out = line(header[0], header[1:]) + ["-" * name_width + "  " + "  ".join("-" * w for w in cell_widths)]
    for depth, item in leaves:
        if isinstance(item, Block):
            out.append("  " * depth + block_line(item))
        else:
            out += line("  " * depth + item.name, item.cells)
    return out
