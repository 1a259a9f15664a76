"""Full-state views of a sharded module: the global tensors gathered from the shards
(``full_state_dict``, ``full_grads``), scattered back (``load_full_state_dict``), and the
bytes of model state per rank (``model_state_bytes``)."""

from __future__ import annotations

from typing import Any

import torch

from .mesh.regions import _uneven_gather
from .plan_items import tp_pieces
from .state_names import persistent_buffers
from .shard import PipelineModule, ShardedModule

__all__ = ["full_state_dict", "full_grads", "load_full_state_dict", "model_state_bytes"]


def _require_sharded(smodel: Any, fn: str) -> ShardedModule:
    if not isinstance(smodel, ShardedModule):
        raise TypeError(f"{fn}() takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
    return smodel


def full_state_dict(smodel: ShardedModule, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors under the original names (parameters, tied aliases, persistent buffers).

    Args:
        smodel: a sharded module.
        rank0_only: if True, ranks other than 0 return ``{}`` (they still take part in the
            gathers).

    Returns:
        ``{name: tensor}`` in ``smodel.module.state_dict()`` order; each parameter has its global
        shape and is a fresh copy (collective under ZeRO-3: call on every rank).

    Raises:
        TypeError: ``smodel`` is not a sharded module, or ``rank0_only`` not a bool (before any
            communication).
    """
    smodel = _require_sharded(smodel, "full_state_dict")
    if not isinstance(rank0_only, bool):
        raise TypeError(f"full_state_dict: rank0_only must be True or False, got {rank0_only!r}")
    zero = smodel._zero
    flat = {c.index: zero.full_chunk(c) for c in zero.chunks}
    full: dict[str, torch.Tensor] = {}
    for pp in smodel.plan.params:
        full[pp.name] = _unshard(smodel, pp, flat)
        for alias in pp.aliases:
            full[alias] = full[pp.name]
    out = {}
    for name, value in smodel.module.state_dict(keep_vars=True).items():
        out[name] = full[name] if name in full else value.detach().clone()
    out = _merge_over_pipeline(smodel, out)
    if rank0_only and smodel.mesh.rank != 0:
        return {}
    return out


def _merge_over_pipeline(smodel: ShardedModule, local: dict) -> dict:
    """Every stage's tensors, in stage order (a pipeline's ranks each hold some names)."""
    if not isinstance(smodel, PipelineModule):
        return local
    import torch.distributed as dist

    parts: list = [None] * smodel.mesh.size(smodel.pp_axis)
    dist.all_gather_object(parts, local, group=smodel.mesh.group(smodel.pp_axis))
    merged: dict = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def full_grads(smodel: ShardedModule) -> dict[str, torch.Tensor | None]:
    """The reduced (data-axis averaged) gradient of every parameter, full size, on every rank.

    For tests and debugging: under stages 1-3 this all-gathers the gradient shards (counted in
    ``mesh.comm``). Frozen parameters map to ``None``. Keys are canonical parameter names.
    """
    smodel = _require_sharded(smodel, "full_grads")
    zero = smodel._zero
    flat = {c.index: zero.full_grad_chunk(c) for c in zero.chunks if c.trainable}
    out = {pp.name: _unshard(smodel, pp, flat) if pp.requires_grad else None for pp in smodel.plan.params}
    return _merge_over_pipeline(smodel, out)


def _unshard(smodel: ShardedModule, pp, flat: dict[int, torch.Tensor]) -> torch.Tensor:
    """The full tensor of ``pp`` from this rank's gathered chunks, gathered over its tensor axis."""
    plan = smodel.plan
    c, off = plan.placement[pp.name]
    shape = plan.local_shape(pp)
    local = flat[c][off : off + int(torch.Size(shape).numel())].view(shape)
    if pp.tp_axis is not None and pp.tp_blocks:  # gathered rank-major; each piece back to its global place
        n, d = smodel.mesh.size(pp.tp_axis), pp.tp_dim
        full = _uneven_gather(local.contiguous(), smodel.mesh, (pp.tp_axis,), d, pp.global_shape[d])
        rank_major = [p for r in range(n) for p in tp_pieces(pp.global_shape[d], pp.tp_blocks, n, r)]
        parts = full.split([width for _, width in rank_major], dim=d)
        local = torch.cat([parts[i] for i in sorted(range(len(parts)), key=lambda i: rank_major[i][0])], dim=d)
    elif pp.tp_axis is not None:
        local = _uneven_gather(local.contiguous(), smodel.mesh, (pp.tp_axis,), pp.tp_dim, pp.global_shape[pp.tp_dim])
    return local.clone()


def model_state_bytes(smodel: ShardedModule, optimizer: Any = None) -> dict[str, int]:
    """Measured bytes of model state held on this rank now, by kind.

    Counts distinct storages (a view is counted once, with its base): parameter chunks and
    shards, gradient buffers, and the optimizer's state tensors (0-dim step counters excluded).
    On a model kept on meta (:func:`shardlib.lazy.materialize_on`, a dry run) these are the bytes
    the storages would hold.
    Compare with ``plan.param_bytes``, ``plan.grad_bytes`` and ``plan.optimizer_bytes``.

    Returns:
        ``{"params": B, "grads": B, "optimizer": B, "total": B}``.
    """
    smodel = _require_sharded(smodel, "model_state_bytes")
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: on meta (a dry run) every data_ptr is 0
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    chunks = smodel._zero.chunks
    out = {
        "params": size([c.full for c in chunks] + [c.shard for c in chunks]),
        "grads": size([c.grad_full for c in chunks] + [c.grad_shard for c in chunks]),
    }
    states = []
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        for state in inner.state.values():
            states += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = size(states)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


@torch.no_grad()
def load_full_state_dict(smodel: ShardedModule, state_dict: dict, strict: bool = True):
    """Copy full tensors (original names, global shapes) into this rank's shards and buffers.

    Each rank slices what it holds (tensor-parallel slice, then its ZeRO shard or the whole
    chunk), so nothing is communicated; every rank must pass the same tensors.

    Returns:
        ``(missing, unexpected)`` key lists, as ``nn.Module.load_state_dict``.

    Raises:
        RuntimeError: with ``strict``, a missing or unexpected key, or a shape that differs
            from the parameter's global shape.
    """
    smodel = _require_sharded(smodel, "load_full_state_dict")
    plan, zero = smodel.plan, smodel._zero
    coords = plan.coords()
    known = set()
    missing = []
    for pp in plan.params:
        names = (pp.name,) + pp.aliases
        known.update(names)
        name = next((n for n in names if n in state_dict), None)
        if name is None:
            missing.append(pp.name)
            continue
        full = state_dict[name]
        if tuple(full.shape) != pp.global_shape:
            raise RuntimeError(f"load_full_state_dict: {name} has shape {tuple(full.shape)}, expected {pp.global_shape}")
        local = full
        if pp.tp_axis is not None:
            pieces = pp.tp_pieces(dict(plan.mesh_shape), coords)
            local = torch.cat([full.narrow(pp.tp_dim, start, width) for start, width in pieces], dim=pp.tp_dim)
        flat = local.reshape(-1)
        c, off = plan.placement[pp.name]
        zero.write_full(zero.chunks[c], off, flat)  # master shard and compute copy
    buffers = dict(smodel.module.named_buffers())
    persistent = persistent_buffers(smodel.module)
    for name, buf in buffers.items():
        if name in state_dict:
            buf.copy_(state_dict[name])
        elif name in persistent:
            missing.append(name)
    unexpected = [k for k in state_dict if k not in known and k not in buffers]
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    return missing, unexpected
