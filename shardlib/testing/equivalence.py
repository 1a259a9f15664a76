"""assert_equivalent: a sharded run against a single-process run, step by step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ShardingError
from .tolerance import ReferenceRun, compare_records, reference_with_bands

__all__ = ["assert_equivalent", "loss_of", "default_tolerances"]

_HARNESS = {"optimizer_cls", "optimizer_kwargs", "loss_fn", "accum_steps", "max_grad_norm", "rtol", "seed", "pool", "compile"}


def default_tolerances(dtype: torch.dtype) -> float:
    """Relative tolerance by dtype: fp32 1e-5, fp64 1e-10, bf16 1e-2, fp16 1e-3."""
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(dtype, 1e-5)


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: the output itself, the last scalar of a tuple
    (nanoGPT's ``(logits, loss)``), or ``.loss`` (Hugging Face ``ModelOutput``)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)):
        for item in reversed(output):
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                return item
    raise TypeError(f"cannot find a scalar loss in the model output of type {type(output).__name__}; pass loss_fn=")


def _forward_loss(model, batch, loss_fn):
    if loss_fn is None:
        return loss_of(model(*batch))
    return loss_fn(model(*batch[:-1]), batch[-1])


def _sharded_worker(make_model, mesh_shape, specs, batch, steps, options, harness):
    import shardlib
    from shardlib.mesh.collectives import raw_all_reduce

    mesh = shardlib.init_mesh(mesh_shape)
    torch.manual_seed(harness["seed"])
    model = make_model()
    mesh.comm.reset()
    smodel = shardlib.shard(model, mesh, specs, **options)
    opt = shardlib.ZeroOptimizer(
        smodel, harness["optimizer_cls"], max_grad_norm=harness["max_grad_norm"], **harness["optimizer_kwargs"]
    )
    axes = smodel.plan.data_axes
    spec = shardlib.P(axes) if axes else shardlib.P()
    local = [shardlib.distribute(t, mesh, spec) for t in batch]
    run, graphs = smodel, None
    if harness["compile"] is not None:  # torch.compile(smodel, **compile), on a fresh Dynamo cache
        from torch._dynamo import reset, utils

        reset()
        utils.counters.clear()
        run = torch.compile(smodel, **harness["compile"])
        graphs = utils.counters["stats"]
    accum = harness["accum_steps"]
    micro = [tuple(t.chunk(accum, dim=0)[i] for t in local) for i in range(accum)]
    pipeline = getattr(smodel, "pp_axis", None)  # a PipelineModule: the schedule runs forward and backward
    records = []
    for _ in range(steps):
        mesh.comm.reset()
        total = torch.zeros((), dtype=torch.float64)
        if pipeline:
            losses, _ = smodel.forward_backward(local[0], criterion=harness["loss_fn"], labels=tuple(local[1:]))
            if losses is not None:  # the last stage: the mean of equal microbatches' mean losses
                total += torch.stack(losses).double().mean()
        else:
            for i, mb in enumerate(micro):
                ctx = smodel.no_sync() if i < accum - 1 else contextlib.nullcontext()
                with ctx:
                    loss = _forward_loss(run, mb, harness["loss_fn"]) / accum
                    loss.backward()
                total += loss.detach().double()
        comm_bwd = mesh.comm.exact_bytes()
        mesh.comm.enabled = False
        global_loss = total.reshape(1).clone()
        if pipeline:  # only the last stage holds the loss: the sum over pp gives it to every rank
            raw_all_reduce(global_loss, mesh, pipeline)
        if axes:
            raw_all_reduce(global_loss, mesh, axes, op="avg")
        grads = shardlib.full_grads(smodel)
        mesh.comm.enabled = True
        opt.step()
        comm = mesh.comm.table()
        comm_total = mesh.comm.exact_bytes()
        mesh.comm.enabled = False
        params = shardlib.full_state_dict(smodel)
        mesh.comm.enabled = True
        opt.zero_grad()
        records.append(
            {
                "loss": global_loss[0].item(),
                "grads": grads,
                "params": params,
                "norm": None if opt.last_grad_norm is None else opt.last_grad_norm.item(),
                "comm": comm,
                "comm_bytes": comm_total,
                "comm_backward_bytes": comm_bwd,
                # Dynamo's totals so far (compile only): graphs compiled, operations they captured
                "graphs": None if graphs is None else {k: graphs[k] for k in ("unique_graphs", "calls_captured")},
            }
        )
    planned = smodel.pipeline_plan if pipeline else smodel.plan
    return {"records": records, "plan": planned, "explain": planned.explain()}


def _reference_run(make_model, batch, harness):
    """A fresh single-process run (model, optimizer, loss) for :func:`.tolerance.reference_with_bands`."""
    from ..random import mesh_independent_dropout

    torch.manual_seed(harness["seed"])
    model = make_model()
    mesh_independent_dropout(model, seed=harness["dropout_seed"])  # the same masks as every sharded run
    opt = harness["optimizer_cls"]([p for p in model.parameters() if p.requires_grad], **harness["optimizer_kwargs"])
    return ReferenceRun(model, opt, lambda m, step: _forward_loss(m, batch, harness["loss_fn"]), harness["max_grad_norm"])


def assert_equivalent(
    make_model: Callable[[], torch.nn.Module],
    mesh_shape: dict[str, int],
    specs: Any,
    batch: Sequence[torch.Tensor],
    steps: int = 3,
    **options: Any,
) -> dict:
    """Train ``make_model()`` sharded on ``mesh_shape`` ranks and in one process; compare.

    Both copies are built after ``torch.manual_seed(seed)``. The single-process copy trains on
    the whole ``batch``; each sharded rank on its slice along dim 0 (split over the data axes),
    so the data-parallel mean equals the global mean. After every step the losses, the full
    (reduced) gradients, the gradient norm and the full parameters are compared under the
    tolerance model of :mod:`shardlib.testing.tolerance`: step 0's gradients tightly, normwise
    (``max |sharded - single| <= rtol * max |single|``; a gradient tensor below 1/1000 of the
    largest gradient's scale, pure rounding noise, is compared at that floor), and everything
    after an optimizer step with an added band measured on three copies of the single process
    trained in lockstep with their gradients at the edge of that tolerance (an fp32 rounding
    difference in a gradient element near AdamW's ``eps`` moves its weight by up to ``lr`` on
    any correct lowering).

    Args:
        make_model: builds the model (a picklable callable: module-level function or partial).
        mesh_shape: ``{axis: size}``; its product is the number of worker processes.
        specs: passed to :func:`shardlib.shard`.
        batch: global tensors; the model is called as ``model(*batch)`` (its output holds the
            loss, see :func:`loss_of`), or with ``loss_fn``: ``loss_fn(model(*batch[:-1]), batch[-1])``.
            On a mesh with a pipeline axis the batch is ``(x, y)`` and each sharded step is
            ``smodel.forward_backward(x, criterion=loss_fn, labels=(y,))``: ``loss_fn`` then gets
            the last pipeline layer's output (logits for a causal LM) and must be a mean over the
            microbatch, as it is a mean over the batch in the single process.
        steps: optimizer steps.
        **options: harness options ``optimizer_cls`` (AdamW), ``optimizer_kwargs``
            (``{"lr": 1e-2}``), ``loss_fn``, ``accum_steps`` (micro-steps per step, all but the
            last under ``no_sync()``), ``max_grad_norm``, ``rtol`` (default by dtype of the
            first parameter: :func:`default_tolerances`), ``seed``, ``compile`` (a dict of
            ``torch.compile`` arguments, such as ``{"backend": "aot_eager"}``: the sharded copy
            is trained through ``torch.compile(smodel, **compile)``; each record then carries
            Dynamo's counters under ``"graphs"``); every other option goes to
            :func:`shardlib.shard` (``zero_stage``, ``chunk_size``, ...).

    Returns:
        A report: ``{"losses": [(sharded, single), ...], "max_rel": {...}, "comm": [...],
        "plan": Plan, "explain": str}`` (on a pipeline mesh the plan is the
        :class:`~shardlib.pipeline_plan.PipelinePlan`).

    Raises:
        AssertionError: a loss, gradient, norm or parameter differs beyond tolerance, or the
            ranks disagree on a full parameter; :class:`~shardlib.testing.tolerance.NotComparable`
            (an AssertionError) when rounding alone scatters the single-process run (a large
            learning rate over many steps): use fewer steps, a smaller lr, or float64.
        ShardingError: the batch does not split evenly over data ranks and micro-steps; on a
            pipeline mesh, no ``loss_fn``, a batch that is not ``(x, y)``, or ``accum_steps`` != 1.
    """
    from .pool import get_pool

    harness = {
        "optimizer_cls": options.pop("optimizer_cls", torch.optim.AdamW),
        "optimizer_kwargs": options.pop("optimizer_kwargs", {"lr": 1e-2}),
        "loss_fn": options.pop("loss_fn", None),
        "accum_steps": options.pop("accum_steps", 1),
        "max_grad_norm": options.pop("max_grad_norm", None),
        "seed": options.pop("seed", 0),
        "compile": options.pop("compile", None),
        "dropout_seed": options.get("dropout_seed", 0),
    }
    rtol = options.pop("rtol", None)
    world = 1
    for size in mesh_shape.values():
        world *= size
    from ..mesh.mesh import AbstractMesh
    from ..plan import plan as make_plan

    torch.manual_seed(harness["seed"])
    probe = make_plan(make_model(), AbstractMesh(mesh_shape), specs, **options)  # errors early, here
    batch = tuple(batch)
    if hasattr(probe, "whole"):  # a pipeline: one input, labels after it, the loss from loss_fn
        if harness["loss_fn"] is None or harness["accum_steps"] != 1 or len(batch) != 2:
            raise ShardingError(
                f"assert_equivalent on the pipeline mesh {mesh_shape}: a pipeline step is forward_backward(x, "
                f"criterion=loss_fn, labels=(y,)), so it needs loss_fn= (got {harness['loss_fn']!r}), a batch (x, y) "
                f"(got {len(batch)} tensors) and accum_steps=1 (got {harness['accum_steps']})"
            )
        probe = probe.whole
    data = probe.data_size * harness["accum_steps"]
    if batch[0].shape[0] % data:
        raise ShardingError(
            f"assert_equivalent: the batch of {batch[0].shape[0]} rows does not split evenly over "
            f"{probe.data_size} data ranks x {harness['accum_steps']} micro-steps; use a multiple of {data}"
        )
    if rtol is None:
        rtol = default_tolerances(probe.params[0].dtype if probe.params else torch.float32)

    # the ranks run while this process computes the single-process reference (its serial time was
    # idle time of the workers' cores); a trajectory too chaotic to compare is reported first
    collect = get_pool(world).start(_sharded_worker, make_model, mesh_shape, specs, batch, steps, options, harness)
    try:
        reference, bands = reference_with_bands(functools.partial(_reference_run, make_model, batch, harness), steps,
                                                rtol)
    except BaseException:
        with contextlib.suppress(Exception):  # the ranks' results or errors: the reference's error comes first
            collect()
        raise
    results = collect()
    mine = results[0]["records"]
    report: dict[str, Any] = {"losses": [(g["loss"], r["loss"]) for g, r in zip(mine, reference)],
                              "max_rel": compare_records(mine, reference, bands, rtol),
                              "comm": [g["comm"] for g in mine]}
    for step in range(len(mine)):
        for r, other in enumerate(results[1:], start=1):
            for name, value in mine[step]["params"].items():
                if not torch.equal(other["records"][step]["params"][name], value):
                    raise AssertionError(f"step {step}: rank {r} and rank 0 disagree on the full parameter {name}")
    report["plan"] = results[0]["plan"]
    report["explain"] = results[0]["explain"]
    report["records"] = mine
    return report
