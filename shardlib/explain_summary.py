"""The summary that ``Plan.explain()`` prints first: totals, then where the bytes are.

Memory per rank (parameters, gradients, optimizer state), bytes communicated per step by axis
and collective kind, the options that change them (mixed precision, offload, meta init), then
parameter bytes per strategy, the largest tensors and one line per repeated block (folded by
:func:`shardlib.explain_table.fold`). Sizes are bytes per rank; the figures in binary units
(KiB = 1024 B) are the same numbers rounded for reading.
"""

from __future__ import annotations

import textwrap

from .explain_table import WIDTH, Block, flatten

__all__ = ["human", "fit", "summary_lines", "TOP_TENSORS"]

TOP_TENSORS = 5  # the largest tensors listed


def human(nbytes: float) -> str:
    """Bytes for reading: ``8622080000`` -> ``"8.03 GiB"`` (binary units, three significant digits).

    Args:
        nbytes: a size in bytes.
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            text = f"{nbytes:.3g}"  # 1000-1023 KiB: "1e+03" in three digits, so the four shown
            return f"{nbytes:.0f} {unit}" if unit == "B" or "e" in text else f"{text} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def fit(lines: list[str], width: int = WIDTH) -> list[str]:
    """``lines`` with each line longer than ``width`` wrapped at spaces, continued 4 columns
    further in than it starts.

    Args:
        lines: text lines. width: characters per line (default 100).

    Returns:
        The lines, wrapped; a single word longer than ``width`` stays whole.
    """
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return out


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _recompute_line(choices: tuple[tuple[str, str], ...]) -> str:
    parts = []
    for mode in ("full", "selective"):
        paths = [p or "the root module" for p, m in choices if m == mode]
        if paths:
            shown = ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]}, ..., {paths[-1]}"
            parts.append(f"{mode} on {len(paths)} module{'s' if len(paths) > 1 else ''} ({shown})")
    return ("activation checkpointing: " + "; ".join(parts) + ": their forward runs again in backward "
            "(full keeps each one's input, selective also its matmul outputs)")


def _state_lines(plan) -> list[str]:
    stage = plan.effective_stage
    parts = (("params", plan.param_bytes), ("grads", plan.grad_bytes), ("optimizer", plan.optimizer_bytes))
    lines = [f"model state per rank: {human(plan.model_state_bytes)} = " + " + ".join(f"{k} {human(v)}" for k, v in parts)
             + f" ({plan.optimizer_states} states)",
             f"  bytes: {plan.model_state_bytes:,} = " + " + ".join(f"{v:,}" for _, v in parts)]
    kept = [c for c in plan.chunks if not c.reshard_after_forward]
    if stage == 3 and kept:
        lines.append(
            f"kept gathered from forward to backward (tied parameters): chunk(s) {', '.join(str(c.index) for c in kept)}, "
            f"{sum(c.padded_numel * c.compute_element_size for c in kept):,} B per rank at the turn of the step")
    if plan.optimizer_offload:
        lines.append(
            f"optimizer offload (ZeRO-Offload): host memory per rank {plan.host_bytes:,} B (optimizer state "
            f"{plan.optimizer_bytes:,} B + master and gradient copies of the updated shards); on the device "
            f"{plan.device_state_bytes:,} B; the update runs on the CPU")
    if plan.offloaded_chunks:
        off = plan.offloaded_chunks
        shown = f"{off[0]}-{off[-1]}" if off == tuple(range(off[0], off[-1] + 1)) and len(off) > 1 else ", ".join(map(str, off))
        lines.append(
            f"parameter offload (offload_param_frac={plan.offload_param_frac:g}): chunk(s) {shown} of {len(plan.chunks)} keep "
            f"their shards, gradient shards and optimizer state in host memory, {plan.param_offload_bytes:,} B per rank "
            "(pinned with CUDA); each gather copies the shard to the device first, and their update runs on the CPU")
    if plan.offload_ratio is not None:
        lines.append(
            f"activation offload: {plan.offload_ratio:.0%} of saved activation bytes moved to host memory in forward, "
            f"{1 - plan.offload_ratio:.0%} kept on the device (sizes depend on the data; measured in "
            "smodel.activation_offload.stats); parameters never move")
    if plan.activation_checkpointing:
        lines.append(_recompute_line(plan.activation_checkpointing))
    if plan.init_rules:
        lines.append(f"lazy init: {len(plan.init_rules)} parameters materialized from the meta device, only local "
                     f"shards, seed {plan.init_seed}")
    mixed = [c for c in plan.chunks if c.mixed_compute or c.separate_grads]
    if mixed:
        compute = sum(c.padded_numel * c.compute_element_size for c in mixed if c.mixed_compute)
        copies = "no compute copies (param_dtype: none)" if not compute else (
            f"compute copies in {_name(plan.param_dtype)} ({compute:,} B of full chunks"
            + (", gathered per use" if stage == 3 else ", kept, refreshed after each step") + ")")
        lines.append(
            f"mixed precision: {copies}; masters, gradients and optimizer state in "
            f"{', '.join(sorted({_name(c.dtype) for c in mixed}))}; gradients reduced in "
            f"{_name(plan.reduce_dtype) if plan.reduce_dtype else 'the master dtype'}")
    return lines


def _comm_lines(plan, tokens: int | None, micro_steps: int = 1) -> list[str]:
    comm = plan.comm_per_step(micro_steps=micro_steps, tokens=tokens)
    if not comm:
        return ["communication per step: none"]
    head = "communication per step (per rank, logical ring bytes"
    if tokens:
        head += f", {micro_steps} micro-batches of {tokens} tokens each):" if micro_steps > 1 else \
            f", {tokens} tokens per micro-batch):"
    else:
        head += (f", {micro_steps} micro-batches" if micro_steps > 1 else "") + "; tensor-parallel activations need tokens=):"
    lines = [head]
    for (axis, kind), (calls, nbytes) in comm.items():
        lines.append(f"  {axis:<6} {kind:<15} {calls:>5} calls  {nbytes:>16,.0f} B  {human(nbytes):>10}")
    total = sum(b for _, b in comm.values())
    lines.append(f"  {'total':<35}{total:>16,.0f} B  {human(total):>10}")
    return lines


def _columns(rows: list[tuple[str, ...]], right: tuple[int, ...]) -> list[str]:
    """``rows`` as aligned lines, indented by 2; the columns in ``right`` right-aligned."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _where_lines(plan, items: list) -> list[str]:
    rows = flatten(items)
    total = sum(r.weight * n for _, n, r in rows) or 1.0
    by_kind: dict[str, list] = {}
    for _, n, row in rows:
        entry = by_kind.setdefault(row.cells[2], [0, 0.0])
        entry[0] += n
        entry[1] += n * row.weight
    lines = ["parameter bytes per rank by strategy:"]
    lines += _columns([(kind, f"{n} tensor{'s' if n != 1 else ''}", f"{nbytes:,.0f} B",
                        human(nbytes) if nbytes >= 1024 else "", f"{nbytes / total:.1%}")
                       for kind, (n, nbytes) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])], (1, 2, 3, 4))
    largest = sorted(rows, key=lambda t: -t[2].weight)[:TOP_TENSORS]
    lines.append("largest tensors (bytes per rank of one):")
    lines += _columns([(name, row.cells[0], row.cells[2], f"{row.weight:,.0f} B", f"({n}x)" if n > 1 else "")
                       for name, n, row in largest], (3,))
    blocks = [b for b in items if isinstance(b, Block)]
    if not blocks:
        lines.append("repeated blocks: none")
    else:
        lines.append("repeated blocks (parameter bytes per rank):")
        for b in blocks:
            lines.append(f"  {b.name} ({b.count}x): {b.tensors} tensors, {_count(b.numel)} elements, {human(b.weight)} each, "
                         f"{human(b.weight * b.count)} in all ({b.weight * b.count / total:.1%})")
    return lines


def _peak_lines(plan, tokens: int | None, activation_checkpointing, in_flight: float = 1,
                accumulating: bool = False) -> list[str]:
    if tokens is None:
        return []
    from .memory_estimate import estimate_peak

    est = estimate_peak(plan, tokens, activation_checkpointing, in_flight, accumulating)
    if est is None:
        return ["peak per rank: not predicted (the activation formula models shardlib.models.GPT only; "
                "see shardlib.memory_estimate)"]
    return est.lines()


def summary_lines(plan, tokens: int | None, items: list, activation_checkpointing=None, in_flight: float = 1,
                  accumulating: bool = False, micro_steps: int = 1) -> list[str]:
    """The summary of ``plan``: the mesh and ZeRO layout, parameter counts, model state per
    rank, communication per step, then bytes per strategy, the largest tensors and the repeated
    blocks of ``items`` (the folded parameter rows).

    Args:
        plan: a :class:`~shardlib.Plan`.
        tokens: tokens per micro-batch per rank, for the tensor-parallel activation collectives
            and the predicted peak (:func:`shardlib.memory_estimate.estimate_peak`).
        items: :func:`~shardlib.explain_table.fold` of the plan's parameter rows.
        activation_checkpointing: the recompute the peak assumes (None: the plan's own).
        in_flight: microbatches whose activations the peak holds (a pipeline stage's stash).
        accumulating: gradients accumulate over several backwards (a pipeline's microbatches).
        micro_steps: forward/backward passes per step, for the communication figures.

    Returns:
        Lines of at most :data:`~shardlib.explain_table.WIDTH` characters.
    """
    mesh = dict(plan.mesh_shape)
    world = 1
    for size in mesh.values():
        world *= size
    stage = plan.effective_stage
    numel = sum(p.numel for p in plan.params)
    trainable = sum(p.numel for p in plan.params if p.requires_grad)
    pad = sum(c.padded_numel - c.numel for c in plan.chunks)
    lines = [
        f"Plan: mesh {mesh} ({world} rank{'s' if world != 1 else ''}), rank {plan.mesh.rank if plan.mesh is not None else 0} "
        f"at {plan.coords()}",
        f"  zero_stage={plan.zero_stage}" + (" (runs as 0: one data rank)" if stage != plan.zero_stage else "")
        + f" over data axes {plan.data_axes or '()'} (N={plan.data_size}); {len(plan.chunks)} chunks of "
        f"<= {plan.chunk_size:,} elements" + (" (searched)" if plan.chunk_search is not None else ""),
        f"parameters: {numel:,} elements in {len(plan.params)} tensors "
        + ("(all trainable)" if trainable == numel else f"({trainable:,} trainable)") + f", {pad:,} padding elements",
    ]
    lines += (_state_lines(plan) + _peak_lines(plan, tokens, activation_checkpointing, in_flight, accumulating)
              + _comm_lines(plan, tokens, micro_steps) + _where_lines(plan, items))
    return fit(lines)
