"""Every rank planned the same model the same way: checked when ``shard()`` applies a plan,
before anything else communicates.

``plan()`` is deterministic, so ranks that built the same model and passed the same specs and
options get the same plan. Ranks that did not (a ``zero_stage`` read from a per-rank variable, a
model width from a config each rank parsed differently) went on to issue different collectives:
a process group created on some ranks only waited for the whole ``SHARDLIB_TIMEOUT`` and ended in
torch's store error, and different parameter shapes ended in a native gloo abort with no
message (found by a new user). One exchange of a digest of the plan over the mesh now refuses
them on every rank, naming what differs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .errors import ShardingError

__all__ = ["plan_summary", "check_same_plan", "check_same_values"]

# the whole-model decisions (the same on every rank); per-rank fields (coordinates, local
# shapes, chunk sizes under an uneven tensor split) are left out
_FIELDS = ("mesh_shape", "zero_stage", "data_axes", "chunk_size", "optimizer_states", "broadcast_buffers",
           "sequence_parallel", "sp_entry", "sp_exit", "sp_grad_params", "dropout_seed", "param_dtype", "reduce_dtype",
           "init_seed", "offload_ratio", "optimizer_offload", "offload_param_frac", "activation_checkpointing")


def _stable(value: Any) -> str:
    """A text of ``value`` that does not depend on the process (no addresses)."""
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_stable(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable(k)}: {_stable(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if callable(value) and not isinstance(value, (type, torch.dtype)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


def plan_summary(plan: Any) -> list[tuple[str, str]]:
    """``[(what, its text)]`` of a :class:`~shardlib.Plan` or
    :class:`~shardlib.pipeline_plan.PipelinePlan`: the options, the pipeline's schedule and
    stages, and every parameter's name, aliases, global shape, dtype, ``requires_grad``, spec and
    strategy; the same list on every rank that planned the same model the same way."""
    from .pipeline_plan import PipelinePlan

    whole = plan.whole if isinstance(plan, PipelinePlan) else plan
    out = [(name, _stable(getattr(whole, name, None))) for name in _FIELDS]
    if isinstance(plan, PipelinePlan):
        out += [("schedule", plan.schedule), ("microbatches", str(plan.m)), ("virtual_stages", str(plan.v)),
                ("stage_layers", _stable(plan.stage_layers))]
    out += [(f"parameter {pp.name}", _stable((pp.aliases, tuple(pp.global_shape), pp.dtype, pp.requires_grad,
                                                str(pp.spec), pp.strategy))) for pp in whole.params]
    return out


def check_same_plan(plan: Any, mesh: Any) -> None:
    """Refuse, on every rank, a plan that differs between the ranks of ``mesh``: one
    ``all_gather_object`` of a digest over the default group (the mesh's ranks, under the
    watchdog on gloo); only when the digests differ, a second one of the summaries, to name
    what differs. Nothing on one rank, a fake mesh, or a mesh smaller than the world.

    Raises:
        ShardingError: naming the ranks that differ from rank 0 and the first entries that
            differ (an option, a parameter's shape or spec).
        CollectiveError: a peer lost while exchanging (the watchdog's).
    """
    import torch.distributed as dist

    from .checkpoint._files import watched

    if mesh.size() == 1 or getattr(mesh, "fake", False) or not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world != mesh.size():
        return
    summary = plan_summary(plan)
    digest = hashlib.sha256(repr(summary).encode()).hexdigest()
    digests: list[Any] = [None] * world
    watched(mesh, "all_gather_object", "shard: every rank's plan", lambda: dist.all_gather_object(digests, digest),
            shape=(world,), dtype="object")
    if len(set(digests)) == 1:
        return
    summaries: list[Any] = [None] * world
    watched(mesh, "all_gather_object", "shard: the plans that differ",
            lambda: dist.all_gather_object(summaries, summary), shape=(world,), dtype="object")
    ranks = [r for r in range(world) if digests[r] != digests[0]]
    other = ranks[0]
    mine, theirs = dict(summaries[0]), dict(summaries[other])
    keys = list(dict.fromkeys([k for k, _ in summaries[0]] + [k for k, _ in summaries[other]]))
    diffs = [(k, mine.get(k, "absent"), theirs.get(k, "absent")) for k in keys if mine.get(k) != theirs.get(k)]
    shown = "; ".join(f"{k}: rank 0 {a}, rank {other} {b}" for k, a, b in diffs[:4])
    raise ShardingError(
        f"shard(): the ranks did not plan the same model: rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} differ{'' if len(ranks) > 1 else 's'} from rank 0 in {len(diffs)} "
        f"entr{'ies' if len(diffs) != 1 else 'y'} ({shown}{'; ...' if len(diffs) > 4 else ''}). Every rank must "
        "build the same model (the same config and seed) and pass the same specs and options to shard(). Nothing "
        "was sharded")


def check_same_values(model: torch.nn.Module, plan: Any, mesh: Any) -> None:
    """Refuse a model whose parameters differ between the ranks of its tensor axes, before the
    tensor-parallel check and the lowering: each rank slices its part of the model it built, and
    its replicated parameters stay its own, so the ranks must hold one model. Data axes need no
    check (``shard()`` broadcasts from their first rank, as DDP). Ranks seeded differently (no
    ``torch.manual_seed``, or one seeded with the rank) got a refusal blaming a fused projection
    or a global size, and with ``verify=False`` trained with different replicated parameters
    on each tensor rank, silently (found by a new user).

    One float64 sum per parameter (not on meta), compared by two all-reduces (min, max) over the
    tensor axes; relative tolerance 1e-9 (the same values sum the same on every rank; different
    draws differ at O(1)).

    Raises:
        ShardingError: naming the axes and the first parameters that differ, on every rank of
            the tensor group concerned.
    """
    from .mesh.raw import raw_all_reduce
    from .pipeline_plan import PipelinePlan

    whole = plan.whole if isinstance(plan, PipelinePlan) else plan
    axes = tuple(dict.fromkeys(layer.axis for layer in whole.tp_layers if mesh.size(layer.axis) > 1))
    if not axes or getattr(mesh, "fake", False):
        return
    named = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    if not named:
        return
    with torch.no_grad():  # summed in float64 without a float64 copy; moved to the mesh's device once
        sums = torch.stack([p.detach().sum(dtype=torch.float64) for _, p in named]).to(mesh.device)
    low, high = sums.clone(), sums.clone()
    raw_all_reduce(low, mesh, axes, op="min", note="shard: the tensor ranks' initial values")
    raw_all_reduce(high, mesh, axes, op="max", note="shard: the tensor ranks' initial values")
    bad = ((high - low).abs() > 1e-9 * torch.maximum(high.abs(), low.abs()).clamp(min=1e-30)).tolist()
    differ = [(name, float(lo), float(hi)) for (name, _), b, lo, hi in zip(named, bad, low.tolist(), high.tolist()) if b]
    if differ:
        shown = "; ".join(f"{n} (sums {lo:.6g} .. {hi:.6g})" for n, lo, hi in differ[:4])
        raise ShardingError(
            f"shard(): the ranks of the tensor axes {axes} built different values of {len(differ)} of "
            f"{type(model).__name__}'s {len(named)} parameters ({shown}{'; ...' if len(differ) > 4 else ''}). "
            "Tensor parallelism splits one model: each rank keeps its slice of the model it built, and its "
            "replicated parameters as they are. Fix: build the model from the same seed on every rank "
            "(torch.manual_seed(seed) before building it, not a per-rank seed), or load the same weights")
