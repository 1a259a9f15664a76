"""PipelinePlan.summary() / explain(): a pipeline as text, totals first.

The summary gives the schedule and its bubble, one line per stage (its layers, repeated ones
folded: ``blocks.{0..9}``), the model state per pp rank (equal ranks on one line), tied tensors,
and the boundary transfers; :func:`pipeline_explain` adds the schedule grid (for short schedules,
or ``full=True``) and each pp rank's stage plan (:func:`shardlib.explain.explain`).
"""

from __future__ import annotations

from .explain_summary import fit, human
from .explain_table import index_set
from .parallel.schedule_theory import BUBBLE_FORMULA
from .parallel.schedules import format_grid

__all__ = ["compact_names", "pipeline_summary", "pipeline_explain", "GRID_STEPS", "GRID_LEGEND"]

GRID_STEPS = 40  # the default explain() draws the schedule grid up to this many steps
# the grid's legend, and its clock (parallel.simulate's defaults)
GRID_LEGEND = "forward F, backward B, or split: I to the input, W the weights"
GRID_UNITS = ("forward and backward one step each", "F, I and W one step each, a full B two")  # without / with I and W
LAYERS_SHOWN = 4  # layer names listed per stage line (after folding)


def compact_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """Runs of 3 or more consecutive numbered names folded: ``["embed", "blocks.0", ...,
    "blocks.9"]`` -> ``["embed", "blocks.{0..9}"]``; shorter runs and other names as given.

    Args:
        names: layer names in order (a stage's ``stage_layers``).
    """
    out: list[str] = []
    run: list[int] = []
    prefix = None

    def close():
        if prefix is not None:
            out.extend([f"{prefix}.{{{index_set(run)}}}"] if len(run) >= 3 else [f"{prefix}.{i}" for i in run])

    for name in names:
        head, _, tail = name.rpartition(".")
        if tail.isdigit() and head == prefix and int(tail) == run[-1] + 1:
            run.append(int(tail))
            continue
        close()
        prefix, run = (head, [int(tail)]) if tail.isdigit() and head else (None, [])
        if prefix is None:
            out.append(name)
    close()
    return out


def _state_table(pplan) -> list[str]:
    """Model state per pp rank as a table; consecutive ranks with equal figures share a row."""
    figures = [(st.param_bytes, st.grad_bytes, st.optimizer_bytes, st.model_state_bytes) for st in pplan.stages]
    groups: list[list[int]] = []
    for r, f in enumerate(figures):
        if groups and figures[groups[-1][-1]] == f:
            groups[-1].append(r)
        else:
            groups.append([r])
    rows = [("pp rank", "params", "grads", "optimizer", "total", "")]
    rows += [(index_set(g), *(f"{v:,}" for v in figures[g[0]]), human(figures[g[0]][3])) for g in groups]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def pipeline_summary(pplan, tokens: int | None = None) -> str:
    """The pipeline in a few lines: schedule and bubble, stages, bytes per pp rank, transfers.

    Args:
        pplan: a :class:`~shardlib.pipeline_plan.PipelinePlan`.
        tokens: tokens in one microbatch on one rank (``local batch / m * seq``), for the
            boundary bytes; without it they are reported as needing it.

    Returns:
        Lines of at most 100 characters.
    """
    p = pplan
    lines = [f"Pipeline over {p.pp_axis!r} ({p.p} ranks x {p.v} chunks = {p.n_stages} stages), schedule {p.schedule}, "
             f"{p.m} microbatches",
             f"  bubble {BUBBLE_FORMULA.get(p.schedule, '(p-1)/(vm+p-1)')} = {p.bubble:.3f}; peak stashed "
             f"{'chunk-' if p.v > 1 else ''}microbatches per rank {p.simulation.peak_stash}"]
    for s, layers in enumerate(p.stage_layers):
        shown = compact_names(layers)
        lines.append(f"  stage {s} on rank {p.stage_rank(s)}: {', '.join(shown[:LAYERS_SHOWN])}"
                     f"{' ...' if len(shown) > LAYERS_SHOWN else ''} ({len(layers)} layers, {p.stage_param_bytes[s]:,} "
                     "parameter bytes)")
    whole = p.whole
    tp = f"tensor parallel over {whole.tp_layers[0].axis!r}" if whole.tp_layers else "no tensor parallelism"
    lines.append(f"model state per rank (bytes), each stage sharded over the other axes (zero_stage={whole.zero_stage} "
                 f"over {whole.data_axes or '()'}, N={whole.data_size}; {tp}; {whole.optimizer_states} optimizer "
                 "states per element):")
    lines += _state_table(p)
    for names, _ in p.tied:
        ranks = [r for r, st in enumerate(p.stages) if any(q.name in names for q in st.params)]
        lines.append(f"  tied across stages: {' = '.join(names)} on pp ranks {ranks}; its gradient is summed over "
                     f"{p.pp_axis!r} every step")
    if p.sequence_parallel:
        lines += [f"sequence parallel over {whole.tp_layers[0].axis!r}: stage 0 splits the sequence at "
                  f"{p.stages[0].sp_entry!r};", "  every boundary transfer carries the sequence shard"]
    shape = "(tokens / tp, width)" if p.sequence_parallel else "(tokens, width)"
    if p.activation_width is None:
        lines.append(f"bytes per boundary transfer: unknown (the model's config gives no width; activations are {shape})")
    elif tokens is None:
        lines.append(f"bytes per boundary transfer: needs tokens= (tokens per microbatch per rank); activations "
                     f"{shape} with width {p.activation_width}")
    else:
        sends = ", ".join(f"rank {r} {p.transfers_per_step(r)}" for r in range(p.p))
        lines.append(f"bytes per boundary transfer: {p.boundary_bytes(tokens):,} ({tokens} tokens per microbatch, {shape} "
                     f"with width {p.activation_width}); transfers per step: {sends}")
        peaks = [p.peak_estimate(tokens, r) for r in range(p.p)]
        if all(e is not None for e in peaks):
            lines.append("peak per rank (predicted, the stashed microbatches' activations held): "
                         + ", ".join(f"pp rank {r} {human(e.total)}" for r, e in enumerate(peaks)))
    return "\n".join(fit(lines))


def pipeline_explain(pplan, tokens: int | None = None, full: bool = False) -> str:
    """:func:`pipeline_summary`, the schedule grid, then each pp rank's stage plan.

    Args:
        pplan: a :class:`~shardlib.pipeline_plan.PipelinePlan`.
        tokens: as :func:`pipeline_summary`; also each stage plan's tokens per microbatch.
        full: draw the grid however long, and print every row of each stage plan; by default
            a grid of more than ``GRID_STEPS`` (40) steps is left out (its size is said) and
            stage plans fold their repeated blocks.
    """
    sim = pplan.simulation
    lines = [pipeline_summary(pplan, tokens)]
    if full or len(sim.grid) <= GRID_STEPS:
        lines += [f"schedule ({GRID_LEGEND}; stage, kind, microbatch):", format_grid(sim)]
    else:
        lines.append(f"schedule: {len(sim.grid)} steps x {pplan.p} ranks ({GRID_UNITS[pplan.split_backward]}); "
                     "explain(full=True) draws the grid")
    for r, st in enumerate(pplan.stages):
        lines += fit([f"stage plan of pp rank {r} (stages {', '.join(str(s) for s in pplan.rank_stages(r))}; "
                      f"communication per step of {pplan.m} microbatches):"])
        from .explain import explain

        lines.append(explain(st, tokens, full, in_flight=sim.peak_stash[r] / pplan.v, accumulating=pplan.m > 1,
                             micro_steps=pplan.m))
    return "\n".join(lines)
