"""Plan.explain(): the plan as text a person can read, at any size.

First the summary (:mod:`shardlib.explain_summary`: memory per rank, communication per step,
bytes per strategy, the largest tensors, one line per repeated block), then the per-parameter
table (:mod:`shardlib.explain_table`), the ZeRO chunks with their modules and why that size
(:mod:`shardlib.explain_chunks`), then the tensor-parallel layers and their collectives.
A table of more than :data:`~shardlib.explain_table.FOLD_ABOVE` rows prints each repeated block
once (``model.layers.{0..79} (80x)``, rows relative to it) unless ``full=True``.
"""

from __future__ import annotations

from .explain_chunks import chunk_lines
from .explain_summary import fit, summary_lines
from .explain_table import FOLD_ABOVE, HEADER, WIDTH, Block, Row, fold, nested, param_rows, render_table
from .parallel.tensor_cost import tensor_parallel_collectives

__all__ = ["explain"]


_PHASE = {"forward": "fwd", "backward": "bwd", "recompute": "recompute"}  # a TPCollective's phase, shown


def _tensor_parallel_lines(plan, full: bool) -> list[str]:
    """The tensor-parallel layers with their collectives per micro-batch, repeated blocks folded
    (unless ``full``) when there are more than ``FOLD_ABOVE`` of them."""
    by_layer: dict[str, list[str]] = {}
    for c in tensor_parallel_collectives(plan):
        size = f"{c.per_token}/token" if c.per_token else f"{c.fixed} elements once per step"
        by_layer.setdefault(c.layer, []).append(f"{_PHASE[c.phase]} {c.kind} {size}")
    kind_width = max(len(layer.kind) for layer in plan.tp_layers)
    rows = []
    for layer in plan.tp_layers:
        extra = (" (output, vocabulary-parallel)" if layer.parallel_output else " (output, gathered)") if layer.output_layer else ""
        calls = f"; {'; '.join(by_layer.pop(layer.path))}" if layer.path in by_layer else ""
        rows.append(Row(layer.path, (f"{layer.kind:<{kind_width}} {layer.axis}  {layer.in_features} -> "
                                     f"{layer.out_features}{extra}{calls}", "layer")))
    rows += [Row(name, ("; ".join(items), "")) for name, items in by_layer.items()]  # groups, parameters
    items = rows if full or len(rows) <= FOLD_ABOVE else fold(rows)
    entries = nested(items, 1)
    # the name column fits the layers; other rows' names (column groups, parameters) may run past it
    width = max(2 * d + len(r.name) for d, r in entries if isinstance(r, Row) and r.cells[1])
    lines = [f"tensor-parallel layers ({'sequence parallel' if plan.sequence_parallel else 'no sequence parallel'}), "
             "in -> out features, collectives per micro-batch:"]
    for depth, item in entries:
        if isinstance(item, Block):
            lines.append(f"{'  ' * depth}{item.name} ({item.count}x), each:")
        else:
            lines.append(f"{('  ' * depth + item.name):<{width}}  {item.cells[0]}")
    return fit(lines)


def explain(plan, tokens: int | None = None, full: bool = False, activation_checkpointing=None, in_flight: float = 1,
            accumulating: bool = False, micro_steps: int = 1) -> str:
    """The plan as text: the summary, the per-parameter table, the tensor-parallel layers.

    Args:
        plan: a :class:`~shardlib.Plan`.
        tokens: tokens per micro-batch per rank; when given, the activation collectives of
            tensor/sequence parallelism are in the communication figures.
        full: print every parameter's row (and every tensor-parallel layer and chunk) even
            when the table is long; by default a table of more than ``FOLD_ABOVE`` (60) rows folds its
            repeated blocks.
        activation_checkpointing: with ``tokens``, the recompute the predicted peak assumes
            (``"full"``, ``"selective"``, ``False``; None: the plan's own option).
        in_flight: microbatches whose activations the predicted peak holds (a pipeline
            stage's peak stash; 1 otherwise). accumulating: gradients accumulate over
            several backwards (a pipeline's microbatches).
        micro_steps: forward/backward passes in a step (a pipeline's microbatches, gradient
            accumulation's slices): the communication figures are per step of that many
            (ZeRO-3 gathers and tensor-parallel activations once per pass; reductions once).

    Returns:
        The text. The table has one row per parameter (name, global shape, spec, strategy,
        tensor-parallel local shape, bytes per rank: under ZeRO-3 the parameter's average share
        of the flat chunks, its elements over the data ranks), or, folded, one per repeated
        block pattern. Summary lines are at most ``WIDTH`` (100) characters, and so is a folded
        table; the rows of a table with long names may be wider, one line per parameter.
    """
    rows = param_rows(plan)
    folded = fold(rows)
    lines = summary_lines(plan, tokens, folded, activation_checkpointing, in_flight, accumulating, micro_steps)
    folding = not full and len(rows) > FOLD_ABOVE
    items = folded if folding else rows
    if folding:
        shown = sum(1 for item in _walk(items) if isinstance(item, Row))
        lines += fit([f"parameters: {len(rows)} tensors in {shown} rows, each repeated block once "
                      "(explain(full=True) lists every one):"])
    lines += render_table(HEADER, items, WIDTH if folding else None)
    lines += chunk_lines(plan, full)
    if plan.tp_layers:
        lines += _tensor_parallel_lines(plan, full)
    return "\n".join(lines)


def _walk(items):
    for item in items:
        yield item
        if isinstance(item, Block):
            yield from _walk(item.children)
