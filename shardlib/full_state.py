"""Full-state views of a sharded module: the global tensors gathered from the shards
(``full_state_dict``, ``full_grads``), scattered back (``load_full_state_dict``), and the
bytes of model state per rank (``model_state_bytes``)."""

from __future__ import annotations

from typing import Any

import torch

from .mesh.collectives import _gather, raw_broadcast
from .mesh.guard import post, wait_works
from .state_names import persistent_buffers
from .shard import PipelineModule, ShardedModule

__all__ = ["data_root_buffers", "full_state_dict", "full_grads", "load_full_state_dict", "model_state_bytes"]


def _require_sharded(smodel: Any, fn: str) -> ShardedModule:
    if not isinstance(smodel, ShardedModule):
        raise TypeError(f"{fn}() takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
    return smodel


def data_root_buffers(smodel: ShardedModule) -> dict[str, torch.Tensor]:
    """``{name: copy}`` of every persistent buffer of ``smodel.module`` as the first data rank
    (index 0 over the plan's data axes) holds it: one ``broadcast`` per buffer over the data
    axes (collective: call on every rank). Under data parallelism each rank updates buffers
    such as BatchNorm's running statistics from its own batch, and DDP's rule
    (``broadcast_buffers=True``) makes the first rank's authoritative; a saved state is that
    rank's, never one buffer from one rank and the next from another (what DCP's deduplication
    of equal keys wrote before: a state no rank ever held). The live buffers are not changed."""
    from .mesh.raw import raw_broadcast

    plan, mesh = smodel.plan, smodel.mesh
    spread = plan.data_size > 1 and not getattr(mesh, "fake", False)
    out = {}
    for name, buf in persistent_buffers(smodel.module).items():
        copy = buf.detach().clone()
        if spread and copy.numel() and not copy.is_meta:
            raw_broadcast(copy.view(torch.uint8) if copy.dtype == torch.bool else copy, mesh, plan.data_axes)
        out[name] = copy
    return out


def full_state_dict(smodel: ShardedModule, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors under the original names (parameters, tied aliases, persistent buffers).

    Args:
        smodel: a sharded module.
        rank0_only: if True, ranks other than 0 return ``{}`` (they still take part in the
            gathers over data and tensor axes; on a pipeline only rank 0's pp group exchanges
            stages, towards rank 0).

    Returns:
        ``{name: tensor}`` in ``smodel.module.state_dict()`` order (on a pipeline: stage by stage,
        the other stages' tensors on the mesh's device); each parameter has its global shape and
        is a fresh copy; each buffer is the first data rank's (:func:`data_root_buffers`), the
        same on every rank. Collective: call on every rank.

    Raises:
        TypeError: ``smodel`` is not a sharded module, or ``rank0_only`` not a bool (before any
            communication).
    """
    smodel = _require_sharded(smodel, "full_state_dict")
    if not isinstance(rank0_only, bool):
        raise TypeError(f"full_state_dict: rank0_only must be True or False, got {rank0_only!r}")
    zero = smodel._zero
    flat = {c.index: zero.full_chunk(c) for c in zero.chunks}
    full = _unshard_all(smodel, smodel.plan.params, flat)
    for pp in smodel.plan.params:
        for alias in pp.aliases:
            full[alias] = full[pp.name]
    full.update(data_root_buffers(smodel))
    out = {}
    for name, value in smodel.module.state_dict(keep_vars=True).items():
        out[name] = full[name] if name in full else value.detach().clone()
    out = _merge_over_pipeline(smodel, out, rank0_only)
    if rank0_only and smodel.mesh.rank != 0:
        return {}
    return out


def _merge_over_pipeline(smodel: ShardedModule, local: dict, rank0_only: bool = False) -> dict:
    """Every stage's tensors, in stage order (a pipeline's ranks each hold some names).

    Tensors travel as tensors: each pp rank packs its tensors into one flat byte buffer on the
    mesh's device, and the buffers go over the pipeline axis with ``broadcast`` from each pp rank
    (to every rank), or with ``rank0_only`` by point-to-point to global rank 0 alone (pp groups
    without rank 0 exchange nothing). Only the metadata (names, shapes, dtypes; a frozen
    parameter's ``None``) is exchanged as Python objects, so no tensor is pickled."""
    if not isinstance(smodel, PipelineModule):
        return local
    import torch.distributed as dist

    from .checkpoint._files import watched

    mesh, axis = smodel.mesh, smodel.pp_axis
    ranks = mesh.axis_ranks(axis)
    if rank0_only and 0 not in ranks:
        return local  # nobody here needs the others' tensors
    me, p = mesh.index(axis), len(ranks)
    meta, first = [], {}
    for name, t in local.items():  # a tensor under two names (tied) is sent once
        if t is None:
            meta.append((name, None))
        elif id(t) in first:
            meta.append((name, ("=", first[id(t)])))
        else:
            first[id(t)] = name
            meta.append((name, (tuple(t.shape), str(t.dtype).replace("torch.", ""))))
    metas: list = [None] * p
    watched(mesh, "all_gather_object", "full_state_dict: every stage's names, shapes and dtypes",
            lambda: dist.all_gather_object(metas, meta, group=mesh.group(axis)))
    bufs = [_pack(local, meta, mesh.device) if i == me else torch.empty(_packed_bytes(metas[i]), dtype=torch.uint8,
                                                                   device=mesh.device) for i in range(p)]
    if not rank0_only:
        for i in range(p):
            raw_broadcast(bufs[i], mesh, axis, src_index=i)
    elif p > 1:
        _to_rank0(mesh, axis, bufs, me)
    merged: dict = {}
    for i in range(p):
        part = local if i == me else _unpack(bufs[i], metas[i]) if me == 0 or not rank0_only else {}
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


_ALIGN = 16  # bytes: every tensor starts at a multiple, so its dtype view of the buffer is aligned


def _packed_bytes(meta: list) -> int:
    total = 0
    for _, spec in meta:
        if spec is not None and spec[0] != "=":
            total += -(-int(torch.Size(spec[0]).numel()) * getattr(torch, spec[1]).itemsize // _ALIGN) * _ALIGN
    return total


def _pack(tensors: dict, meta: list, device) -> torch.Tensor:
    """One ``uint8`` buffer on ``device`` holding the tensors of ``tensors`` that ``meta`` gives
    a shape (``None`` and second names skipped)."""
    parts = []
    for (name, spec) in meta:
        if spec is not None and spec[0] != "=":
            raw = tensors[name].detach().to(device).contiguous().reshape(-1).view(torch.uint8)
            pad = -raw.numel() % _ALIGN
            parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=device)] if pad else [raw]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _unpack(buf: torch.Tensor, meta: list) -> dict:
    """The tensors :func:`_pack` packed, as fresh copies, from their metadata."""
    out, off = {}, 0
    for name, spec in meta:
        if spec is None or spec[0] == "=":
            out[name] = None if spec is None else out[spec[1]]
            continue
        shape, dtype = spec[0], getattr(torch, spec[1])
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[name] = buf[off:off + n].view(dtype).view(shape).clone()
        off += -(-n // _ALIGN) * _ALIGN
    return out


def _to_rank0(mesh, axis: str, bufs: list, me: int) -> None:
    """Each pp rank's buffer to pp index 0 (global rank 0), point to point, in one batch."""
    import torch.distributed as dist

    ranks, group = mesh.axis_ranks(axis), mesh.group(axis)
    if me == 0:
        ops = [dist.P2POp(dist.irecv, bufs[i], ranks[i], group) for i in range(1, len(ranks)) if bufs[i].numel()]
    else:
        ops = [dist.P2POp(dist.isend, bufs[me], ranks[0], group)] if bufs[me].numel() else []
        mesh.comm.record(axis, "send", bufs[me].numel(), 2)
    if ops:
        trace = mesh.trace
        rec = trace.record("recv" if me == 0 else "send", trace.label(mesh, (axis,), 0), bufs[me].shape, torch.uint8,
                           f"full_state_dict tensors {'from every stage' if me == 0 else 'to rank ' + str(ranks[0])}")
        wait_works(mesh, post(mesh, dist.batch_isend_irecv, ops), rec, True)


def full_grads(smodel: ShardedModule) -> dict[str, torch.Tensor | None]:
    """The reduced (data-axis averaged) gradient of every parameter, full size, on every rank.

    For tests and debugging: under stages 1-3 this all-gathers the gradient shards (counted in
    ``mesh.comm``). Frozen parameters map to ``None``, also one frozen after ``shard()``
    (``requires_grad`` False now: the gradient torch would not have). Keys are canonical
    parameter names.
    """
    smodel = _require_sharded(smodel, "full_grads")
    zero = smodel._zero
    flat = {c.index: zero.full_grad_chunk(c) for c in zero.chunks if c.trainable}
    full = _unshard_all(smodel, [pp for pp in smodel.plan.params if pp.requires_grad], flat)
    live = dict(smodel.module.named_parameters(remove_duplicate=False))
    out = {pp.name: full.get(pp.name) if pp.name not in live or live[pp.name].requires_grad else None
           for pp in smodel.plan.params}
    return _merge_over_pipeline(smodel, out)


_BUCKET_BYTES = 64 << 20  # gathered bytes per all-gather of tensor-parallel pieces (one parameter may exceed it)


def _unshard_all(smodel: ShardedModule, params, flat: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full tensor of each parameter plan in ``params``, from this rank's gathered chunks
    (``flat``), as fresh copies.

    A parameter split over a tensor axis has local shape ``plan.local_shape(pp)`` (its pieces of
    each block along ``tp_dim``, :func:`~shardlib.plan_items.tp_pieces`); the pieces of every
    rank of the axis travel together: this rank's pieces of a bucket of parameters (same axis and
    dtype, at most ``_BUCKET_BYTES`` gathered) are packed into one flat buffer, padded to the
    largest rank's total, and all-gathered once, so a model costs a few collectives, not one per
    parameter (the harness calls this every step). Each parameter is then joined along
    ``tp_dim`` in global order."""
    plan, mesh = smodel.plan, smodel.mesh
    mesh_shape, coords = dict(plan.mesh_shape), plan.coords()
    out: dict[str, torch.Tensor] = {}
    groups: dict = {}
    for pp in params:
        c, off = plan.placement[pp.name]
        shape = plan.local_shape(pp)
        local = flat[c][off : off + int(torch.Size(shape).numel())].view(shape)
        if pp.tp_axis is None or mesh.size(pp.tp_axis) == 1:
            out[pp.name] = local.clone()
        else:
            groups.setdefault((pp.tp_axis, local.dtype), []).append((pp, local))
    for (axis, dtype), items in groups.items():
        n = mesh.size(axis)
        # every rank's local shape of each parameter, from the plan (no sizes exchanged)
        shapes = [[pp.local_shape(mesh_shape, {**coords, axis: r}) for r in range(n)] for pp, _ in items]
        start, gathered = 0, 0  # the open bucket is items[start:i], ``gathered`` bytes after its all-gather
        for i, per_rank in enumerate(shapes):
            size = n * max(int(torch.Size(s).numel()) for s in per_rank) * dtype.itemsize
            if i > start and gathered + size > _BUCKET_BYTES:
                _gather_bucket(mesh, axis, mesh_shape, coords, items[start:i], shapes[start:i], out)
                start, gathered = i, 0
            gathered += size
        _gather_bucket(mesh, axis, mesh_shape, coords, items[start:], shapes[start:], out)
    return out


def _gather_bucket(mesh, axis: str, mesh_shape: dict, coords: dict, items: list, shapes: list, out: dict) -> None:
    """One all-gather over ``axis`` of the local pieces of ``items`` (``(pp, local)`` pairs,
    ``shapes[k][r]``: rank r's local shape of item k); each full tensor into ``out``."""
    n = mesh.size(axis)
    sizes = [[int(torch.Size(s[r]).numel()) for r in range(n)] for s in shapes]
    block = max(sum(col) for col in zip(*sizes))
    dtype = items[0][1].dtype
    buf = torch.zeros(block, dtype=dtype, device=mesh.device)
    with torch.no_grad():
        torch.cat([local.reshape(-1).to(mesh.device) for _, local in items],
                  out=buf[: sum(s[coords[axis]] for s in sizes)])
    full = _gather(buf, mesh, (axis,), 0)  # (n * block,), in axis-index order
    offsets = [r * block for r in range(n)]
    for k, (pp, _) in enumerate(items):
        d = pp.tp_dim
        pieces = []  # (global start along d, tensor)
        for r in range(n):
            mine = full[offsets[r] : offsets[r] + sizes[k][r]].view(shapes[k][r])
            offsets[r] += sizes[k][r]
            at = 0
            for start, width in pp.tp_pieces(mesh_shape, {**coords, axis: r}):
                pieces.append((start, mine.narrow(d, at, width)))
                at += width
        pieces.sort(key=lambda piece: piece[0])
        out[pp.name] = torch.cat([t for _, t in pieces], dim=d)


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

    A tied tensor loads from any one of its names (``save_pretrained`` keeps one of a tied
    embedding and LM head), also where a pipeline holds it on two stages.

    Returns:
        ``(missing, unexpected)`` key lists, as ``nn.Module.load_state_dict``; ``missing`` is
        over the whole model (every stage's tensors, each under its first name), the same on
        every rank.

    Raises:
        RuntimeError: with ``strict``, a missing or unexpected key (on a pipeline the other
            stages' keys are expected, as :func:`full_state_dict` gives them); a shape that
            differs from a parameter's global shape or a buffer's. Raised before anything is
            written.
    """
    smodel = _require_sharded(smodel, "load_full_state_dict")
    plan, zero = smodel.plan, smodel._zero
    coords = plan.coords()
    # a pipeline's full_state_dict holds every stage's tensors: the other stages' are expected
    shapes = {n: tuple(s.shape) for s in smodel.model_state_names for n in s.names}  # parameters, persistent buffers
    missing, writes = [], []
    # every rank checks every stage's shapes: a rank refusing alone left the others loaded
    wrong = [f"{k} has shape {tuple(v.shape)}, expected {shapes[k]}" for k, v in state_dict.items()
             if k in shapes and tuple(v.shape) != shapes[k]]
    # what is missing is judged over the whole model (every stage's names), the same on every rank;
    # a tensor tied across stages (a pipeline's embedding and LM head) loads from any of its names
    # (save_pretrained keeps one): the last stage found only its own name and refused, alone
    names_of = {n: s.names for s in smodel.model_state_names for n in s.names}
    for s in smodel.model_state_names:
        if not any(n in state_dict for n in s.names):
            missing.append(s.names[0])
    for pp in plan.params:
        name = next((n for n in names_of.get(pp.name, (pp.name,) + pp.aliases) if n in state_dict), None)
        if name is not None and tuple(state_dict[name].shape) == pp.global_shape:  # (another shape is in wrong)
            writes.append((pp, state_dict[name]))
    buffers = dict(smodel.module.named_buffers())
    for name, buf in buffers.items():
        if name in state_dict and name not in shapes and tuple(state_dict[name].shape) != tuple(buf.shape):
            # a non-persistent buffer (copy_ broadcast another shape)
            wrong.append(f"{name} has shape {tuple(state_dict[name].shape)}, expected {tuple(buf.shape)}")
    unexpected = [k for k in state_dict if k not in shapes and k not in buffers]
    if wrong:  # every check before the first write: a refused load leaves the model as it was
        raise RuntimeError(f"load_full_state_dict: {'; '.join(wrong)}")
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for pp, full in writes:
        local = full
        if pp.tp_axis is not None:
            pieces = pp.tp_pieces(dict(plan.mesh_shape), coords)
            local = torch.cat([full.narrow(pp.tp_dim, start, width) for start, width in pieces], dim=pp.tp_dim)
        c, off = plan.placement[pp.name]
        zero.write_full(zero.chunks[c], off, local.reshape(-1))  # master shard and compute copy
    for name, buf in buffers.items():
        if name in state_dict:
            buf.copy_(state_dict[name])
    return missing, unexpected
