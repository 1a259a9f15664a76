"""The cost model: bytes each rank communicates per training step, predicted from a Plan."""

from __future__ import annotations

import numpy as np

from .mesh.comm import ring_bytes
from .parallel.tensor_cost import tensor_parallel_collectives
from .pipeline_gathers import zero3_gathers

__all__ = ["comm_per_step"]


def comm_per_step(plan, micro_steps: int = 1, clip: bool = False, tokens: int | None = None) -> dict[tuple[str, str], tuple[int, float]]:
    """Predicted ``{(axis, kind): (calls, bytes per rank)}`` for one training step of ``plan``.

    Args:
        micro_steps: forward/backward passes per step (all but the last under
            ``no_sync()``); stage 3 gathers the parameters again for each.
        clip: ``ZeroOptimizer(max_grad_norm=...)`` is used (one 4-byte all-reduce of the
            squared norm under stages 1-3).
        tokens: tokens in one micro-batch on one rank (local batch x sequence length);
            needed for the activation collectives of tensor/sequence parallelism, which are
            left out when it is None.

    One step is ``micro_steps`` forward and backward passes and ``ZeroOptimizer.step()``:
    stage 0 all-reduces the trainable chunks (2Ψ(N-1)/N); stages 1-2 reduce-scatter them and
    all-gather the updated shards (2Ψ(N-1)/N); stage 3 all-gathers every chunk in forward and
    again in backward (but a chunk with ``reshard_after_forward`` False, holding a tied
    parameter, only in forward) and reduce-scatters the trainable ones (3Ψ(N-1)/N without frozen
    or tied parameters). Ψ counts padded elements.

    A pipeline stage's plan (:attr:`~shardlib.Plan.pipeline` set) counts its schedule instead:
    ``micro_steps`` is then the microbatches of a step, a multiple of the schedule's ``m`` (one
    ``forward_backward`` per ``m``), and stage 3 gathers each chunk as often as the schedule's
    actions on this rank do (:func:`shardlib.pipeline_gathers.zero3_gathers`: per microbatch and
    model chunk a forward and a backward, an input-gradient and a weight-gradient pass).

    Raises:
        ValueError: a pipeline stage under ZeRO-3, and ``micro_steps`` not a positive multiple
            of its schedule's microbatches.
    """
    n = plan.data_size
    out: dict[tuple[str, str], list] = {}
    if tokens is not None:
        mesh_shape = dict(plan.mesh_shape)
        itemsize = plan.params[0].dtype.itemsize if plan.params else 4
        act_size = plan.param_dtype.itemsize if plan.param_dtype is not None else itemsize  # activations
        grad_size = plan.reduce_dtype.itemsize if plan.reduce_dtype is not None else itemsize
        for c in tensor_parallel_collectives(plan):
            calls, total = out.setdefault((c.axis, c.kind), [0, 0.0])
            nbytes = c.per_token * tokens * (max(act_size, 4) if c.fp32 else act_size) + c.fixed * grad_size
            times = micro_steps if c.per_token else 1  # gradient sums: once per step (parallel/tensor_grads.py)
            out[(c.axis, c.kind)] = [calls + times, total + times * float(ring_bytes(c.kind, nbytes, mesh_shape[c.axis]))]
    if clip:
        mesh_shape = dict(plan.mesh_shape)
        tp_axes = tuple(sorted({layer.axis for layer in plan.tp_layers}))
        for sharded in sorted({c.tp_sharded for c in plan.chunks if c.requires_grad}):
            axes = (plan.data_axes if plan.effective_stage >= 1 else ()) + (tp_axes if sharded else ())
            size = int(np.prod([mesh_shape[a] for a in axes], dtype=np.int64)) if axes else 1
            if size > 1:  # one statistic in float32, or float64 for float64 gradients (optim.clip_grad_norm_)
                stat = max([4] + [c.element_size for c in plan.chunks if c.requires_grad and c.tp_sharded == sharded])
                key = ("+".join(axes), "all_reduce")
                calls, total = out.setdefault(key, [0, 0.0])
                out[key] = [calls + 1, total + float(ring_bytes("all_reduce", stat, size))]
    if n <= 1:
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}
    axis = "+".join(plan.data_axes)

    def add(kind, chunk, times=1):
        calls, total = out.setdefault((axis, kind), [0, 0.0])
        # parameters are gathered in their compute dtype, gradients reduced in the reduction dtype
        size = chunk.compute_element_size if kind == "all_gather" else chunk.reduce_element_size
        nbytes = chunk.padded_numel * size
        out[(axis, kind)] = [calls + times, total + times * float(ring_bytes(kind, nbytes, n))]

    gathers = None
    if plan.zero_stage == 3 and plan.pipeline is not None:
        runs, rest = divmod(micro_steps, plan.pipeline.m)
        if rest or not runs:
            raise ValueError(f"comm_per_step(micro_steps={micro_steps}) of a pipeline stage: a step runs the schedule "
                             f"on {plan.pipeline.m} microbatches at a time, so micro_steps must be a positive multiple "
                             f"of {plan.pipeline.m}. Fix: micro_steps={plan.pipeline.m} for one forward_backward")
        gathers = [per_run * runs for per_run in zero3_gathers(plan)]  # (n stays the data size)
    for c in plan.chunks:
        if plan.zero_stage == 0:
            if c.requires_grad:
                add("all_reduce", c)
        elif plan.zero_stage in (1, 2):
            if c.requires_grad:
                add("reduce_scatter", c)
                add("all_gather", c)
        elif gathers is not None:  # a pipeline stage: as its schedule runs
            if gathers[c.index]:
                add("all_gather", c, gathers[c.index])
            if c.requires_grad:
                add("reduce_scatter", c)
        else:  # forward and backward, or only forward where the chunk stays gathered in between
            add("all_gather", c, (2 if c.reshard_after_forward else 1) * micro_steps)
            if c.requires_grad:
                add("reduce_scatter", c)
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}
