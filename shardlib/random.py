"""Mesh-independent random numbers: drawn by global element index, not by rank.

A random value is a pure function of (seed, stream, counter, global index of the element), as
in counter-based generators (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy
as 1, 2, 3", SC 2011: Philox/Threefry of Random123) and JAX's partitionable threefry keys: so a
dropout mask or an initial weight is the same whatever the mesh, and equal to the single-device
one. Replicated copies get identical values; shards get different slices of one global tensor.
The hash is SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) on int64 with wrapping arithmetic, then the top 24 bits as a float in
``[0, 1)``.

Dropout (:class:`MeshDropout`). The mask of an element of a ``(batch, seq, ...)`` activation is
``u >= p`` for ``u = counter_uniform(seed, stream, counter, ...)`` at the element's *global*
index, where

- ``seed`` is the run's dropout seed (``shard(..., dropout_seed=)``), ``stream`` a hash of the
  module's path (:func:`mesh_independent_dropout`), so modules draw independently;
- ``counter`` is the module's count of training-mode calls in *forwards of the global batch*
  (``MeshDropout.calls``, saved in checkpoints as ``dropout.<path>``): one process, any data,
  tensor or sequence split, and a pipeline with any microbatching and schedule all count the
  same, so a checkpoint resumes on any layout with the counters it saved;
- the global index is row-major over ``(global sample in the global batch, global position,
  feature...)``: a data-parallel rank's rows start at ``batch_index * local rows``; microbatch
  ``i`` of ``m`` (equal) microbatches of that rank's local batch at ``(batch_index * m + i) *
  microbatch rows``; a sequence-parallel shard's positions at ``seq_index * local positions``.

Kept elements are scaled by ``1 / (1 - p)``, as ``nn.Dropout``. A pipeline runs a stage's forward
once per microbatch; :class:`MicrobatchDropout` gives every such forward the counter the
whole-batch forward has (it does not advance per microbatch) and the microbatch's rows, then
leaves each counter where one whole-batch forward would. Gradient accumulation by hand (several
forwards per optimizer step under ``no_sync()``) can use it the same way. A recompute
(``torch.utils.checkpoint`` around a module with dropout) calls the module a second time and
draws the next counter's mask: not supported.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["counter_uniform", "counter_normal_", "counter_values", "MeshDropout", "MicrobatchDropout",
           "mesh_independent_dropout"]

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def _key(seed: int, stream: int, counter: int) -> int:
    k = torch.tensor([seed], dtype=torch.int64)
    for v in (stream, counter):
        k = _mix(k * _GOLDEN + v)
    return int(k.item())


def _global_index(local_shape: Sequence[int], global_shape: Sequence[int], offsets: Sequence[int], device) -> torch.Tensor:
    index = torch.zeros((), dtype=torch.int64, device=device)
    for dim, (n, g, o) in enumerate(zip(local_shape, global_shape, offsets)):
        shape = [1] * len(local_shape)
        shape[dim] = n
        index = index * g + (torch.arange(n, dtype=torch.int64, device=device) + o).view(shape)
    return index.expand(tuple(local_shape)) if local_shape else index


def counter_uniform(seed: int, stream: int, counter: int, local_shape: Sequence[int],
                    global_shape: Sequence[int] | None = None, offsets: Sequence[int] | None = None,
                    device=None) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 values of the block of a global tensor held locally.

    Args:
        seed, stream, counter: the key (stream separates modules; counter separates calls).
        local_shape: shape of the local block.
        global_shape: shape of the whole tensor (default: the local shape).
        offsets: the block's starting index in each dimension (default: zeros).

    Returns:
        float32 ``local_shape``; element ``i`` equals element ``offsets + i`` of
        ``counter_uniform(seed, stream, counter, global_shape)``.
    """
    global_shape = tuple(local_shape) if global_shape is None else tuple(global_shape)
    offsets = (0,) * len(local_shape) if offsets is None else tuple(offsets)
    idx = _global_index(tuple(local_shape), global_shape, offsets, device)
    bits = _mix(idx ^ _key(seed, stream, counter))
    return _srl(bits, 40).to(torch.float32) * (1.0 / (1 << 24))


def _uniform_at(seed: int, stream: int, counter: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 at the int64 global flat ``index`` (any shape); equal to
    ``counter_uniform`` at those indices, computed in place (two int64 temporaries)."""
    x = index ^ _key(seed, stream, counter)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        t = x >> shift
        t &= (1 << (64 - shift)) - 1
        x ^= t
        del t
        if mult is not None:
            x.mul_(mult)
    x >>= 40
    x &= (1 << 24) - 1
    return x.to(torch.float32).mul_(1.0 / (1 << 24))


def counter_values(kind: str, args: Sequence[float], seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Initial values at the int64 global flat ``index`` of a tensor, by counter.

    Each element's value is a pure function of (seed, stream, its global flat index), so any
    block of a tensor (a tensor-parallel slice, a ZeRO shard of a flat chunk) is filled with
    exactly the values the whole tensor would get on one device.

    Args:
        kind: ``"normal"`` (``args = (std,)`` or ``(std, mean)``; Box-Muller as
            :func:`counter_normal_`), ``"uniform"`` (``(low, high)``), ``"zeros"``, ``"ones"``,
            ``"constant"`` (``(value,)``).
        index: int64 global flat indices (row-major over the global shape), any shape.

    Returns:
        float32 tensor of ``index``'s shape.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "normal":
        # sqrt(-2 log(1 - u1)) cos(2 pi u2), in place, the same operations as counter_normal_
        z = _uniform_at(seed, stream, 0, index).neg_().log1p_().mul_(-2.0).sqrt_()
        z.mul_(_uniform_at(seed, stream, 1, index).mul_(2 * math.pi).cos_()).mul_(float(args[0]))
        return z.add_(float(args[1])) if len(args) > 1 and args[1] else z
    if kind == "uniform":
        lo, hi = float(args[0]), float(args[1])
        return _uniform_at(seed, stream, 0, index) * (hi - lo) + lo
    if kind in ("zeros", "ones", "constant"):
        value = {"zeros": 0.0, "ones": 1.0}.get(kind) if kind != "constant" else float(args[0])
        return torch.full(index.shape, value, dtype=torch.float32, device=index.device)
    raise ValueError(f"unknown init kind {kind!r}; use 'normal', 'uniform', 'zeros', 'ones' or 'constant'")


def counter_normal_(tensor: torch.Tensor, std: float, seed: int, stream: int,
                    global_shape: Sequence[int] | None = None, offsets: Sequence[int] | None = None) -> torch.Tensor:
    """Fill ``tensor`` (a block of a global tensor) with ``N(0, std^2)`` values by global index
    (Box-Muller on two counter streams). The full tensor is the same for any sharding."""
    u1 = counter_uniform(seed, stream, 0, tensor.shape, global_shape, offsets, tensor.device)
    u2 = counter_uniform(seed, stream, 1, tensor.shape, global_shape, offsets, tensor.device)
    z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)
    with torch.no_grad():
        return tensor.copy_(z * std)


def _in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (where a forward runs only to
    recompute activations)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class MeshDropout(nn.Module):
    """Dropout whose mask depends on the global position of each element, not on the rank.

    Args:
        p: drop probability, in ``[0, 1)``.
        seed: the run's dropout seed.
        stream: separates modules (:func:`mesh_independent_dropout` hashes the module path).

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.

    The layout of the input ``(batch, seq, ...)`` (local) is set by the planner: dimension 0
    split over ``batch_parts`` ranks at index ``batch_index``; dimension 1 over ``seq_parts`` at
    ``seq_index`` under sequence parallelism; and, for the duration of a pipeline's microbatch
    forward, ``microbatch = (i, m)``: the input is microbatch ``i`` of ``m`` equal ones of the
    local batch. Each training-mode call advances ``calls`` (the counter of the module
    docstring), so two runs that call the module equally often per global batch draw equal masks.

    Example:
        >>> drop = MeshDropout(0.5, seed=0, stream=1)
        >>> y = drop(torch.ones(2, 3, 4))  # (batch, seq, feature)
        >>> drop.calls, sorted(set(y.flatten().tolist()))
        (1, [0.0, 2.0])
    """

    def __init__(self, p: float = 0.5, seed: int = 0, stream: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"MeshDropout: p (the drop probability) must be in [0, 1), got {p!r}")
        self.p, self.seed, self.stream = p, seed, stream
        self.calls = 0
        self.batch_parts, self.batch_index, self.seq_parts, self.seq_index = 1, 0, 1, 0
        self.microbatch = (0, 1)  # (index, count) of the local batch's equal microbatches
        self.replaying = 0  # > 0 while shard()'s activation checkpointing recomputes (its masks replayed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x local ``(batch, seq, ...)``. Returns ``x * mask / (1 - p)`` in training mode, else ``x``."""
        if not self.training or self.p == 0.0:
            return x
        if _in_backward() and not self.replaying:  # a recompute the user wrote would draw the next call's mask
            raise RuntimeError(
                f"MeshDropout(p={self.p}) ran again during backward: activation recompute (torch.utils.checkpoint, "
                "Hugging Face's gradient_checkpointing_enable()) re-runs the forward, and the recomputed mask would be "
                "another one than the forward used, so the gradients would be wrong. Fix: set dropout to 0 where you "
                "recompute activations yourself (torch.utils.checkpoint in a module, Hugging Face's gradient "
                "checkpointing), or recompute only through shard(..., activation_checkpointing=...), which replays the masks")
        shape = tuple(x.shape)
        global_shape = list(shape)
        offsets = [0] * len(shape)
        if len(shape) >= 1:  # rows before this block: other data ranks', then earlier microbatches'
            index, count = self.microbatch
            global_shape[0] = shape[0] * self.batch_parts * count
            offsets[0] = shape[0] * (self.batch_index * count + index)
        if len(shape) >= 2:
            global_shape[1], offsets[1] = shape[1] * self.seq_parts, shape[1] * self.seq_index
        u = counter_uniform(self.seed, self.stream, self.calls, shape, global_shape, offsets, x.device)
        self.calls += 1
        keep = (u >= self.p).to(x.dtype)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}, stream={self.stream}"


class MicrobatchDropout:
    """One whole-batch forward's dropout masks, drawn over ``count`` microbatch forwards.

    A pipeline stage runs its forward once per microbatch (GPipe arXiv 1811.06965, 1F1B and
    interleaved 1F1B arXiv 2104.04473, in any order). Inside :meth:`forward` every
    :class:`MeshDropout` of ``module`` draws microbatch ``index``'s rows of the mask the
    whole local batch would get, with the counter the whole-batch forward would use: the
    counters as they were when this object was made, not advanced per microbatch. After each
    microbatch forward every counter stands where one whole-batch forward leaves it (its calls
    in the microbatch forward that called it most), so a checkpoint's ``dropout.<path>`` means
    the same on every layout.

    Args:
        module: the modules to cover (a pipeline stage); its :class:`MeshDropout` submodules.
        count: microbatches per step ``m``; the local batch splits into ``m`` equal ones.

    Raises:
        ValueError: ``count`` is not a positive int.

    Example:
        >>> stage = torch.nn.Sequential(MeshDropout(0.5, seed=0, stream=1))
        >>> x = torch.ones(4, 3)  # the local batch (batch, feature)
        >>> whole = MeshDropout(0.5, seed=0, stream=1)(x)  # one forward of the whole batch
        >>> drops = MicrobatchDropout(stage, 2)
        >>> parts = []
        >>> for i, xi in enumerate(x.chunk(2)):
        ...     with drops.forward(i):
        ...         parts.append(stage(xi))
        >>> torch.equal(torch.cat(parts), whole), stage[0].calls
        (True, 1)
    """

    def __init__(self, module: nn.Module, count: int):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"MicrobatchDropout: count (microbatches per step) must be a positive int, got {count!r}")
        self.count = count
        self.dropouts = [m for m in module.modules() if isinstance(m, MeshDropout)]
        self._base = [d.calls for d in self.dropouts]  # the counters of this whole-batch forward
        self._used = [0] * len(self.dropouts)  # the most calls any microbatch forward made

    @contextlib.contextmanager
    def forward(self, index: int) -> Iterator[None]:
        """The block runs the forward of microbatch ``index`` (``0 <= index < count``).

        Raises:
            ValueError: ``index`` outside ``[0, count)``.
        """
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.count:
            raise ValueError(f"MicrobatchDropout.forward: microbatch index must be an int in [0, {self.count}) "
                             f"(count={self.count} microbatches), got {index!r}")
        for drop, base in zip(self.dropouts, self._base):
            drop.calls, drop.microbatch = base, (index, self.count)
        try:
            yield
        finally:
            for k, (drop, base) in enumerate(zip(self.dropouts, self._base)):
                self._used[k] = max(self._used[k], drop.calls - base)
                drop.calls, drop.microbatch = base + self._used[k], (0, 1)


def mesh_independent_dropout(model: nn.Module, seed: int = 0) -> list[MeshDropout]:
    """Replace every ``nn.Dropout`` of ``model`` by a :class:`MeshDropout` (in place).

    The stream of each is a hash (CRC-32) of its module path, so the same model gets the same
    masks in any process, and its counter starts at 0.

    Args:
        model: the module whose ``nn.Dropout`` children (at any depth) are replaced; each new
            module keeps the old one's ``p`` and training mode.
        seed: the run's dropout seed.

    Returns:
        The new modules, in ``named_modules()`` order.
    """
    made = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                full = f"{path}.{name}" if path else name
                new = MeshDropout(child.p, seed, zlib.crc32(full.encode()))
                new.train(child.training)
                setattr(module, name, new)
                made.append(new)
    return made
