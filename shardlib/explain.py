"""Plan.explain(): the plan as a table a person can read."""

from __future__ import annotations

import torch

from .parallel.tensor_cost import tensor_parallel_collectives

__all__ = ["explain"]


def explain(plan, tokens: int | None = None) -> str:
    """One row per parameter (name, global shape, spec, strategy, local shape, bytes on this
    rank); the tensor-parallel layers and their collectives per micro-batch; model-state bytes
    per rank; bytes communicated per step by axis and kind (activation collectives of tensor
    parallelism only when ``tokens`` per micro-batch per rank is given)."""
    mesh = dict(plan.mesh_shape)
    coords = plan.mesh.coords() if plan.mesh is not None else {a: 0 for a in mesh}
    rank = plan.mesh.rank if plan.mesh is not None else 0
    stage = plan.effective_stage
    lines = [
        f"Plan: mesh {mesh}, rank {rank} at {coords}; zero_stage={plan.zero_stage}"
        + (f" (runs as 0: one data rank)" if stage != plan.zero_stage else "")
        + f" over data axes {plan.data_axes or '()'} (N={plan.data_size}); "
        f"{len(plan.chunks)} chunks of <= {plan.chunk_size:,} elements",
    ]
    rows = [("parameter", "global shape", "spec", "strategy", "local shape", "bytes")]
    for p in plan.params:
        name = p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else "")
        if not p.requires_grad:
            name += " [frozen]"
        local = plan.local_numel(p)
        local_shape = str(plan.local_shape(p)) if stage != 3 else f"flat[{local}]"
        itemsize = torch.empty((), dtype=p.dtype).element_size()
        rows.append((name, str(p.global_shape), str(p.spec), p.strategy, local_shape, f"{local * itemsize:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 5 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    pad = sum(c.padded_numel - c.numel for c in plan.chunks)
    lines.append(
        f"parameters: {sum(p.numel for p in plan.params):,} elements "
        f"({sum(p.numel for p in plan.params if p.requires_grad):,} trainable), {pad:,} padding elements"
    )
    lines.append(
        f"model state per rank: params {plan.param_bytes:,} B + grads {plan.grad_bytes:,} B + "
        f"optimizer {plan.optimizer_bytes:,} B ({plan.optimizer_states} states) = {plan.model_state_bytes:,} B"
    )
    kept = [c for c in plan.chunks if not c.reshard_after_forward]
    if stage == 3 and kept:
        lines.append(
            f"kept gathered from forward to backward (tied parameters): chunk(s) {', '.join(str(c.index) for c in kept)}, "
            f"{sum(c.padded_numel * c.compute_element_size for c in kept):,} B per rank at the turn of the step"
        )
    if plan.optimizer_offload:
        lines.append(
            f"optimizer offload (ZeRO-Offload): host memory per rank {plan.host_bytes:,} B (optimizer state "
            f"{plan.optimizer_bytes:,} B + master and gradient copies of the updated shards); on the device "
            f"{plan.device_state_bytes:,} B; the update runs on the CPU"
        )
    if plan.offload_ratio is not None:
        lines.append(
            f"activation offload: {plan.offload_ratio:.0%} of saved activation bytes moved to host memory in forward, "
            f"{1 - plan.offload_ratio:.0%} kept on the device (sizes depend on the data; measured in "
            "smodel.activation_offload.stats); parameters never move"
        )
    if plan.init_rules:
        lines.append(f"lazy init: {len(plan.init_rules)} parameters materialized from the meta device, only local "
                     f"shards, seed {plan.init_seed}")
    mixed = [c for c in plan.chunks if c.mixed_compute or c.separate_grads]
    if mixed:
        compute = sum(c.padded_numel * c.compute_element_size for c in mixed if c.mixed_compute)
        name = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
        copies = "no compute copies (param_dtype: none)" if not compute else (
            f"compute copies in {name(plan.param_dtype)} ({compute:,} B of full chunks"
            + (", gathered per use" if stage == 3 else ", kept, refreshed after each step") + ")")
        lines.append(
            f"mixed precision: {copies}; masters, gradients "
            f"and optimizer state in {', '.join(sorted({name(c.dtype) for c in mixed}))}; gradients reduced in "
            f"{name(plan.reduce_dtype) if plan.reduce_dtype else 'the master dtype'}"
        )
    if plan.tp_layers:
        lines.append(
            f"tensor-parallel layers ({'sequence parallel' if plan.sequence_parallel else 'no sequence parallel'}); "
            "collectives per micro-batch, payload in elements per token:"
        )
        by_layer: dict[str, list[str]] = {}
        for c in tensor_parallel_collectives(plan):
            size = f"{c.per_token}/token" if c.per_token else f"{c.fixed} elements"
            by_layer.setdefault(c.layer, []).append(f"{'fwd' if c.phase == 'forward' else 'bwd'} {c.kind} {size}")
        for layer in plan.tp_layers:
            extra = " (output layer: gathered)" if layer.output_layer else ""
            lines.append(f"  {layer.path:<28} {layer.kind:<9} {layer.axis}  in {layer.in_features} out {layer.out_features}{extra}"
                         + (f"; {'; '.join(by_layer.pop(layer.path))}" if layer.path in by_layer else ""))
        for name, items in by_layer.items():
            lines.append(f"  {name:<28} {'; '.join(items)}")
    comm = plan.comm_per_step(tokens=tokens)
    if comm:
        lines.append("communication per step (per rank, logical ring bytes"
                     + (f", {tokens} tokens per micro-batch):" if tokens else "; tensor-parallel activations need tokens=):"))
        for (axis, kind), (calls, nbytes) in comm.items():
            lines.append(f"  {axis:<6} {kind:<15} {calls:>5} calls  {nbytes:>16,.0f} B")
        lines.append(f"  total                         {sum(b for _, b in comm.values()):>16,.0f} B")
    else:
        lines.append("communication per step: none")
    return "\n".join(lines)

