"""Check mode's look at the batch a sharded module's forward is given (``SHARDLIB_CHECK_COLLECTIVES=1``):
equal row counts across the data axes, the same tensors across the tensor-parallel axes."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import ShardingError
from .mesh.eager import eager

if TYPE_CHECKING:
    from .plan import Plan


@eager  # under torch.compile: one graph break, not a compiled frame for each of its own breaks
def check_local_batch(plan: Plan, args: tuple, kwargs: dict, training: bool, where: str = "forward") -> None:
    """Check mode (see :meth:`ShardedModule.forward`): the first tensor argument of at least one
    dimension has as many rows on every data rank (a training forward), and every tensor argument
    (positional or keyword: labels, masks) is the same on every rank of the tensor-parallel axes
    of size > 1 (not ``pp``: stages take different inputs; a checksum weighted by position, in
    float64, NaN and infinities as 0 and +-1: the same arithmetic on every rank, so equal inputs
    give equal sums). One all-reduce (max of ``v`` and ``-v``) for each, not counted. Nothing on
    a dry run (meta tensors, a fake group). A pipeline checks its step's whole local batch and
    labels (before sequence parallelism splits them) on every rank.

    Raises:
        ShardingError: on every rank of the group, naming the axes, the sizes or the checksums."""
    import optree

    from .mesh.raw import raw_all_reduce

    mesh = plan.mesh
    first = next((t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if getattr(mesh, "fake", False) or (first is not None and first.is_meta):  # a dry run: no values to compare
        return

    def spread(values: torch.Tensor, axes: tuple, what: str) -> tuple[list, list]:
        """(least, most) of each of ``values`` (float64, on the mesh's device) over ``axes``."""
        both = torch.cat([values, -values])
        raw_all_reduce(both, mesh, axes, op="max", record=False, note=f"check: {what}")
        k = values.numel()
        return (-both[k:]).tolist(), both[:k].tolist()

    if training and plan.data_size > 1:
        rows = -1 if first is None else first.shape[0]
        (least,), (most,) = spread(torch.tensor([rows], dtype=torch.float64, device=mesh.device), plan.data_axes,
                                   "local batch rows")
        if most != least:
            raise ShardingError(
                f"{where}: the local batch has {rows} row{'' if rows == 1 else 's'} on this rank, and between "
                f"{int(least)} and {int(most)} across the data axes {plan.data_axes} (mesh {dict(mesh.shape)}): the "
                "gradient, reduced as the mean of the ranks' gradients, would not be the global batch's (the rows of a "
                "shorter batch weigh more). Fix: give every data rank as many rows (drop_last=True in a DataLoader, or "
                "shardlib.distribute() of one global batch that divides evenly) (SHARDLIB_CHECK_COLLECTIVES=1 made "
                "this check)")
    others = tuple(a for a in mesh.axis_names if a in {l.axis for l in plan.tp_layers} and mesh.size(a) > 1)
    if others:
        paths, leaves, _ = optree.tree_flatten_with_path((args, kwargs))
        named = [(_argument_name(path), t) for path, t in zip(paths, leaves) if isinstance(t, torch.Tensor)]
        # one slot per tensor argument (from the 8th on they share the last), and their count: one size everywhere
        sums = torch.zeros(_SLOTS + 1, dtype=torch.float64, device=mesh.device)
        sums[_SLOTS] = len(named)
        for i, (_, t) in enumerate(named):
            flat = torch.nan_to_num(t.detach().reshape(-1).to(torch.float64), nan=0.0, posinf=1.0, neginf=-1.0)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            sums[min(i, _SLOTS - 1)] += (flat * weights).sum().to(sums.device) if flat.numel() else 0.0
        least, most = spread(sums, others, "the same batch")
        differ = [i for i in range(_SLOTS + 1) if most[i] != least[i]]
        if differ:
            mine = sums.tolist()
            if _SLOTS in differ:
                what = f"the number of tensor arguments: {len(named)} on this rank, between {int(least[-1])} and {int(most[-1])} on the group"
            else:
                i = differ[0]
                name = named[i][0] if i < _SLOTS - 1 else ", ".join(n for n, _ in named[_SLOTS - 1:])
                what = f"{name}: its checksum is {mine[i]!r} on this rank, between {least[i]!r} and {most[i]!r} on the group"
            raise ShardingError(
                f"{where}: the batch differs across the axes {others} (mesh {dict(mesh.shape)}): {what}. Ranks that "
                f"differ only along {others} compute parts of one result from the same batch, so each would train on a "
                f"mix of the batches. Fix: split the data over the data axes {plan.data_axes} only "
                "(shardlib.distribute(batch, mesh, smodel.batch_spec), or a sampler over the data ranks, not the whole "
                "world) (SHARDLIB_CHECK_COLLECTIVES=1 made this check)")


_SLOTS = 8  # tensor arguments compared one by one in check mode; the rest share the last slot


def _argument_name(path: tuple) -> str:
    """``args[0]``, ``labels`` or ``kwargs['batch'][1]``: a tensor argument of forward by its place."""
    where, *rest = path
    head = f"args[{rest[0]}]" if where == 0 and rest else (str(rest[0]) if rest else "args")
    return head + "".join(f"[{k!r}]" for k in rest[1:])
