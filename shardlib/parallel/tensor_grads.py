"""Gradient sums over the tensor axis, in buckets, overlapped with the backward.

A parameter replicated over the tensor axis but used on split activations has a partial sum for
a gradient on each rank: under sequence parallelism the norm weights and row-layer biases, which
run on sequence shards (Korthikanti et al., arXiv 2205.05198, section 4.2.2), per-head norms
inside split attention (Qwen3's ``q_norm``), and ``tp_sum_grads=`` globs. Megatron sums them
once per step, in one coalesced all-reduce after the backward (``finalize_model_grads``); DDP
sums data-parallel gradients in 25 MiB buckets launched as they fill. Here both:

- layout (:func:`pack_buckets`, the same from the plan alone: :func:`grad_sum_buckets`): the
  parameters of each ZeRO chunk, in backward order (descending offset), are packed into flat
  buffers in the chunk's reduction dtype of at most :data:`BUCKET_BYTES`; a bucket never spans
  two chunks, so a chunk's data-axis reduction waits for its own sums only;
- backward (:meth:`TensorGradSums.add`, called by ZeRO's gradient hook instead of accumulating
  the gradient into the chunk): each gradient is added into its slot; in a synchronizing
  backward a bucket whose parameters all have this backward's gradient is all-reduced over the
  axis at once, asynchronously, while the backward goes on; inside ``no_sync()`` (micro-steps, a
  pipeline's microbatches) the slots only accumulate;
- before ZeRO reduces a chunk over the data axes (:meth:`TensorGradSums.flush`: as the chunk
  completes, at the end of a synchronizing backward at the latest, or in ``sync_grads()``), its
  buckets are launched if they were not (a parameter this backward did not reach), waited for,
  and the sums added into the chunk's gradient buffer, so the reduction, the norm and the
  optimizer read whole gradients.

So a step issues one all-reduce per bucket, not one per parameter and backward, and each is
exact: the sum of the ranks' partial sums, in the reduction dtype (``reduce_dtype`` under mixed
precision). These parameters' own ``.grad`` stays None, at stage 0 too (as under mixed
precision: a gradient view into the chunk would mix this backward's partial sum with the summed
gradients already there); :func:`shardlib.full_grads` reads their gradients. Without ZeRO (layers used by hand, ``shard(verify=True)``'s unit checks) the
per-parameter hook of :func:`~shardlib.parallel.tensor.sum_grad_over` does the sum; ZeRO takes
those hooks over (:meth:`TensorGradSums.take_over`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh.collectives import raw_all_reduce

__all__ = ["BUCKET_BYTES", "TensorGradSums", "pack_buckets", "grad_sum_buckets"]

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default


def pack_buckets(numels: list[int], itemsize: int, cap: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices into ``numels`` grouped into consecutive buckets of at most ``cap`` bytes (at
    ``itemsize`` bytes an element); an item larger than ``cap`` gets a bucket of its own.

    Example:
        >>> pack_buckets([4, 4, 4], itemsize=4, cap=32)
        [[0, 1], [2]]
    """
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        if out and size + n * itemsize <= cap:
            out[-1].append(i)
            size += n * itemsize
        else:
            out.append([i])
            size = n * itemsize
    return out


def grad_sum_buckets(plan) -> list[tuple[int, tuple[str, ...], int]]:
    """The buckets of ``plan``'s tensor-axis gradient sums on this rank, as ZeRO lays them out:
    ``[(chunk index, parameter names, elements)]`` in launch order (descending chunk index, each
    chunk's parameters in descending offset). Empty when the tensor axis has size 1."""
    summed = set(plan.sp_grad_params)
    if not summed or not plan.tp_layers or dict(plan.mesh_shape)[plan.tp_layers[0].axis] <= 1:
        return []
    by_name = {p.name: p for p in plan.params}
    out = []
    for chunk in reversed(plan.chunks):
        if not chunk.requires_grad:
            continue
        names = [n for n in reversed(chunk.params) if n in summed or summed.intersection(by_name[n].aliases)]
        numels = [by_name[n].numel for n in names]  # replicated over the tensor axis: the global size
        for idx in pack_buckets(numels, chunk.reduce_element_size):
            out.append((chunk.index, tuple(names[i] for i in idx), sum(numels[i] for i in idx)))
    return out


class _Bucket:
    """One flat buffer of partial-sum gradients (see the module docstring)."""

    __slots__ = ("chunk", "axis", "params", "slots", "buffer", "written", "ready", "handle")

    def __init__(self, chunk, axis: str, members: list[tuple[nn.Parameter, int]]):
        self.chunk, self.axis = chunk, axis
        self.params = [prm for prm, _ in members]
        self.slots: dict[int, tuple[int, int, int]] = {}  # id(param) -> (start in buffer, numel, offset in chunk)
        start = 0
        for prm, off in members:
            self.slots[id(prm)] = (start, prm.numel(), off)
            start += prm.numel()
        plan = chunk.plan
        self.buffer = torch.empty(start, dtype=plan.reduce_dtype or plan.dtype, device=chunk.device)
        self.written: set[int] = set()  # parameters whose slot holds a gradient since the last sum
        self.ready: set[int] = set()  # ... from this backward
        self.handle = None  # the all-reduce in flight


class TensorGradSums:
    """The tensor-axis gradient sums of a :class:`~shardlib.parallel.zero.ZeroRuntime` (module
    docstring). Every method is called on every rank of the tensor group in the same order
    (from the same backward), so the all-reduces pair up.

    Args:
        chunks: the runtime's :class:`~shardlib.parallel.chunk.Chunk` objects.
        mesh: the :class:`~shardlib.Mesh`.
        members: ``{chunk index: [(parameter, offset in the chunk, axis)]}``, the parameters
            whose gradients are summed (:meth:`take_over` finds them).
    """

    def __init__(self, chunks, mesh, members: dict[int, list[tuple[nn.Parameter, int, str]]]):
        self.mesh = mesh
        self.buckets: list[_Bucket] = []
        self.by_chunk: dict[int, list[_Bucket]] = {}
        self._of: dict[int, _Bucket] = {}
        for chunk in reversed(chunks):  # launch order: ZeRO reduces in descending chunk order
            items = sorted(members.get(chunk.index, ()), key=lambda m: -m[1])  # backward order
            for axis in dict.fromkeys(a for _, _, a in items):
                mine = [(p, off) for p, off, a in items if a == axis]
                itemsize = (chunk.plan.reduce_dtype or chunk.plan.dtype).itemsize
                for idx in pack_buckets([p.numel() for p, _ in mine], itemsize):
                    bucket = _Bucket(chunk, axis, [mine[i] for i in idx])
                    self.buckets.append(bucket)
                    self.by_chunk.setdefault(chunk.index, []).append(bucket)
                    for prm in bucket.params:
                        self._of[id(prm)] = bucket

    @classmethod
    def take_over(cls, chunks, mesh) -> "TensorGradSums":
        """Remove the per-parameter sum hooks the lowering installed
        (:func:`~shardlib.parallel.tensor.sum_grad_over`) from the trainable chunks' parameters
        and sum those gradients in buckets instead."""
        members: dict[int, list] = {}
        for chunk in chunks:
            for prm, off in chunk.params if chunk.trainable else ():
                handle = getattr(prm, "_shardlib_grad_sum_hook", None)
                if handle is not None:
                    handle.remove()
                    prm._shardlib_grad_sum_hook = None
                    members.setdefault(chunk.index, []).append((prm, off, prm._shardlib_grad_sum))
        return cls(chunks, mesh, members)

    def __contains__(self, prm: nn.Parameter) -> bool:
        return id(prm) in self._of

    def __len__(self) -> int:
        return len(self.buckets)

    def add(self, prm: nn.Parameter, grad: torch.Tensor, launch: bool) -> None:
        """Add this backward's gradient of ``prm`` (any shape) into its slot; with ``launch``
        (a synchronizing backward), all-reduce the bucket once it holds every parameter's."""
        bucket = self._of[id(prm)]
        if bucket.handle is not None:  # a second gradient in one backward (reentrant use): sum what came first
            self._finish(bucket)
        key = id(prm)
        start, numel, _ = bucket.slots[key]
        region = bucket.buffer[start : start + numel]
        if key in bucket.written:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))  # cast into the reduction dtype
            bucket.written.add(key)
        bucket.ready.add(key)
        if launch and len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for prm in bucket.params:  # slots no gradient reached since the last sum hold zeros
            if id(prm) not in bucket.written:
                start, numel, _ = bucket.slots[id(prm)]
                bucket.buffer[start : start + numel].zero_()
        bucket.handle = raw_all_reduce(bucket.buffer, self.mesh, bucket.axis, async_op=True,
                                       note=f"chunk {bucket.chunk.index} gradient sums ({len(bucket.params)} parameters)")

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for the bucket's sum and add it into its chunk's gradient buffer."""
        if bucket.handle is None:
            if not bucket.written:
                return  # no gradient since the last sum (on every rank alike): nothing to send
            self._launch(bucket)
        bucket.handle.wait()
        bucket.handle = None
        chunk = bucket.chunk
        for prm in bucket.params:
            key = id(prm)
            if key in bucket.written:
                start, numel, off = bucket.slots[key]
                chunk.accumulate(prm, off, bucket.buffer[start : start + numel])
        bucket.written.clear()

    def flush(self, chunk) -> None:
        """Before ``chunk``'s data-axis reduction (its gradient buffer allocated): the summed
        gradients of its parameters added into it."""
        for bucket in self.by_chunk.get(chunk.index, ()):
            self._finish(bucket)

    def end_backward(self) -> None:
        """A backward ended: the next one starts its buckets' completeness afresh."""
        for bucket in self.buckets:
            bucket.ready.clear()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last sum (``zero_grad`` after ``no_sync()``)."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            bucket.written.clear()
            bucket.ready.clear()
