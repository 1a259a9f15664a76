"""The items of a :class:`~shardlib.plan.Plan`: one :class:`ParamPlan` per unique parameter and
one :class:`ChunkPlan` per ZeRO flat buffer (frozen values, computed by :func:`shardlib.plan`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .chunking import Entry, pack
from .spec import PartitionSpec, shard_range

__all__ = ["ParamPlan", "ChunkPlan", "tp_pieces", "fused_blocks", "pack_chunks", "plan_entries", "model_chunks_of"]


def fused_blocks(size: int, fused: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The one form of a ``fused`` declaration: the global block sizes along a dimension of
    ``size``, ``()`` for a single block.

    Args:
        size: the global size of the dimension (a column layer's ``out_features``).
        fused: a number of equal blocks (GPT-2's ``c_attn``: 3), or the block sizes
            (Phi-3's ``qkv_proj``: ``(H * hd, KV * hd, KV * hd)``; ``()``: one block).

    Returns:
        ``k`` equal sizes for an int ``k > 1``, the given sizes as a tuple, ``()`` for one block.

    Raises:
        ValueError: ``k`` is not a positive divisor of ``size``; sizes below 1 or not summing
            to ``size``.

    Example:
        >>> fused_blocks(48, 3), fused_blocks(96, [64, 16, 16]), fused_blocks(8, 1)
        ((16, 16, 16), (64, 16, 16), ())
    """
    if isinstance(fused, (tuple, list)):
        blocks = tuple(int(b) for b in fused)
        if blocks and (sum(blocks) != size or min(blocks) < 1):
            raise ValueError(f"fused blocks {blocks} must be sizes >= 1 summing to the dimension's size {size} "
                             f"(they sum to {sum(blocks)})")
    else:
        k = int(fused)
        if k < 1 or size % k:
            raise ValueError(f"{k} fused blocks do not divide the dimension's size {size}")
        blocks = (size // k,) * k
    return blocks if len(blocks) > 1 else ()


def tp_pieces(size: int, blocks: tuple[int, ...], parts: int, index: int) -> tuple[tuple[int, int], ...]:
    """Where shard ``index`` of ``parts`` lies along a tensor-parallel dimension of ``size``.

    The dimension is the concatenation of ``blocks`` (global sizes summing to ``size``; ``()``:
    one block, the whole dimension), and each block is split over the ranks separately
    (:func:`~shardlib.spec.shard_range` layout): the local tensor is this rank's slice of every
    block, joined in order (a fused q/k/v projection keeps the same heads of each).

    Returns:
        ``((global start, width), ...)``, one per block, in local order.

    Example:
        >>> tp_pieces(96, (64, 16, 16), 2, 1)
        ((32, 32), (72, 8), (88, 8))
    """
    out, start = [], 0
    for block in blocks or (size,):
        lo, hi = shard_range(block, parts, index)
        out.append((start + lo, hi - lo))
        start += block
    return tuple(out)


@dataclass(frozen=True)
class ParamPlan:
    """The decision for one unique parameter.

    Attributes:
        name: canonical name (first in ``named_parameters()``); ``aliases`` holds tied names.
        global_shape: the full shape.
        spec: the PartitionSpec after logical-axis translation; ``source`` says where it came from.
        strategy: the tensor-parallel role (``"column"``, ``"row"``, ``"vocab"``, ``"embed_dim"``)
            if any, joined with the data-parallel one (``"replicated"`` at zero_stage 0, else
            ``"zero-1"`` ... ``"zero-3"``), e.g. ``"column+zero-3"``.
        tp_axis, tp_dim: the tensor axis and the dimension split over it (``None``: replicated
            over every non-data axis).
        tp_blocks: the global sizes of the blocks ``tp_dim`` concatenates, each split over
            ``tp_axis`` separately (a fused projection: GPT-2's ``c_attn`` ``(C, C, C)``, Phi-3's
            ``qkv_proj`` under grouped-query attention ``(H * hd, KV * hd, KV * hd)``); ``()``:
            one block (see :func:`tp_pieces`).
        unit: the module whose boundary the ZeRO chunks keep (its transformer block, else the
            module holding it; :mod:`shardlib.chunking`).
        model_chunks: on a pipeline rank holding several model chunks (interleaved 1F1B, the V
            schedules), the chunks (:class:`~shardlib.parallel.pipeline.Stage` order) whose layers
            use the parameter under any of its names, ascending; its ZeRO chunk is packed with the
            first one's parameters only. ``(0,)`` outside a pipeline.
    """

    name: str
    aliases: tuple[str, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    spec: PartitionSpec
    source: str
    strategy: str
    requires_grad: bool
    tp_axis: str | None = None
    tp_dim: int | None = None
    tp_blocks: tuple[int, ...] = ()
    unit: str = ""
    model_chunks: tuple[int, ...] = (0,)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.global_shape:
            n *= s
        return n

    def local_shape(self, mesh_shape: dict[str, int], coords: dict[str, int]) -> tuple[int, ...]:
        """The shape of this parameter's tensor-parallel shard at ``coords`` (before ZeRO)."""
        if self.tp_axis is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.tp_dim] = sum(w for _, w in self.tp_pieces(mesh_shape, coords))
        return tuple(shape)

    def tp_pieces(self, mesh_shape: dict[str, int], coords: dict[str, int]) -> tuple[tuple[int, int], ...]:
        """``((global start, width), ...)`` of this parameter's local tensor along ``tp_dim`` at
        ``coords`` (:func:`tp_pieces`); ``()`` when it is not split over a tensor axis."""
        if self.tp_axis is None:
            return ()
        return tp_pieces(self.global_shape[self.tp_dim], self.tp_blocks, mesh_shape[self.tp_axis], coords[self.tp_axis])


@dataclass(frozen=True)
class ChunkPlan:
    """A flat buffer of consecutive parameters (ZeRO's unit of communication).

    Attributes:
        numel: elements used by parameters; ``padded_numel`` rounds up to a multiple of the
            data-axis size ``parts``; each rank owns ``shard_numel = padded_numel // parts``.
        dtype: the dtype of the parameters, which the master copy and optimizer state keep.
        compute_dtype: the dtype of the copy forward/backward use (``param_dtype``; ``None``:
            ``dtype``). reduce_dtype: the dtype gradients are reduced in (``None``: ``dtype``).
        reshard_after_forward: ZeRO-3 frees the chunk after the forward and gathers it again in
            backward (FSDP2's option of that name). False for a chunk holding a tied parameter
            (an embedding shared with the LM head): the head is the first thing backward runs
            and the embedding the last, so the chunk would be gathered first in backward, and
            as gathers go in descending chunk order (the same on every rank) with it every
            chunk above; it stays gathered from its forward gather to the end of backward, as
            FSDP2 keeps the root module's parameters. Such a chunk holds that parameter only.
        units: the modules (:attr:`ParamPlan.unit`) whose parameters the chunk holds, in order.
        model_chunk: the pipeline model chunk whose parameters the chunk holds (a ZeRO chunk
            never spans two: a model chunk's forward or backward gathers its own chunks only);
            0 outside a pipeline. used_by: the model chunks using any of them (a tied parameter
            held by one and read by another too), ascending.
    """

    index: int
    dtype: torch.dtype
    requires_grad: bool
    params: tuple[str, ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    parts: int
    tp_sharded: bool = False
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    units: tuple[str, ...] = ()
    model_chunk: int = 0
    used_by: tuple[int, ...] = (0,)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.parts

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def compute_element_size(self) -> int:
        """Bytes per element of the compute copy (what all-gathers move)."""
        return (self.compute_dtype or self.dtype).itemsize

    @property
    def reduce_element_size(self) -> int:
        """Bytes per element of gradient reductions."""
        return (self.reduce_dtype or self.dtype).itemsize

    @property
    def mixed_compute(self) -> bool:
        """Forward/backward use a copy in another dtype than the (master) parameters."""
        return self.compute_dtype is not None and self.compute_dtype != self.dtype

    @property
    def separate_grads(self) -> bool:
        """Gradients are reduced in another dtype than the master's: reduced in a transient
        buffer, then added into the master-dtype gradient shard."""
        return self.reduce_dtype is not None and self.reduce_dtype != self.dtype



def pack_chunks(plan) -> tuple[ChunkPlan, ...]:
    """The ZeRO chunks of ``plan`` on this rank: what :attr:`shardlib.plan.Plan.chunks` returns
    (:func:`shardlib.chunking.pack` of the parameters in registration order, at most
    ``plan.chunk_size`` elements each, whole modules where they fit, a tied parameter alone, one
    pipeline model chunk's parameters apart from the others'; padded to a multiple of the
    data-axis size)."""
    parts = plan.data_size
    chunks = pack(plan_entries(plan.params, dict(plan.mesh_shape), plan.coords()), plan.chunk_size)
    used = {p.name: p.model_chunks for p in plan.params}

    def mixed(dtype: torch.dtype, option: torch.dtype | None) -> torch.dtype | None:
        return option if option is not None and dtype.is_floating_point and option != dtype else None

    return tuple(
        ChunkPlan(index=i, dtype=c["group"][0], requires_grad=c["group"][1], params=tuple(c["params"]),
                  offsets=tuple(c["offsets"]), numel=c["numel"],
                  padded_numel=-(-max(c["numel"], 1) // parts) * parts, parts=parts, tp_sharded=c["group"][2],
                  compute_dtype=mixed(c["group"][0], plan.param_dtype),
                  reduce_dtype=mixed(c["group"][0], plan.reduce_dtype),
                  reshard_after_forward=not c["tied"], units=tuple(c["units"]), model_chunk=c["group"][3],
                  used_by=tuple(sorted({k for name in c["params"] for k in used[name]})))
        for i, c in enumerate(chunks)
    )


def plan_entries(params, mesh_shape: dict[str, int], coords: dict[str, int]) -> list[Entry]:
    """``params`` (:class:`ParamPlan`) as :func:`shardlib.chunking.pack` takes them, at mesh
    ``coords``: grouped by (dtype, trainable, split over a tensor axis, pipeline model chunk), each
    model chunk's parameters after the previous one's (a stable sort: registration order within
    it), so a model chunk's ZeRO chunks are consecutive and hold nothing of another's."""
    return [Entry(name=p.name, numel=int(np.prod(p.local_shape(mesh_shape, coords), dtype=np.int64)),
                  group=(p.dtype, p.requires_grad, p.tp_axis is not None, p.model_chunks[0]), unit=p.unit,
                  tied=bool(p.aliases), itemsize=p.dtype.itemsize)
            for p in sorted(params, key=lambda p: p.model_chunks[0])]


def model_chunks_of(chunk_paths: list[list[str]], names_of: list[list[str]]) -> dict[str, tuple[int, ...]]:
    """``{canonical name: model chunks}`` (:attr:`ParamPlan.model_chunks`) of a pipeline rank.

    Args:
        chunk_paths: for each model chunk of the rank's
            :class:`~shardlib.parallel.pipeline.Stage`, the module paths its layers use
            (``Stage.chunk_paths``; a module several chunks use is in each list).
        names_of: each parameter's names, the canonical one first (tied names after it).

    Returns:
        The chunks whose module paths hold one of the names, ascending (``(0,)`` when none do).

    Example:
        >>> model_chunks_of([["wte", "h.0"], ["h.3", "lm_head"]], [["wte.weight", "lm_head.weight"], ["h.3.w"]])
        {'wte.weight': (0, 1), 'h.3.w': (1,)}
    """
    out = {}
    for names in names_of:
        found = {c for c, paths in enumerate(chunk_paths) for path in paths for name in names
                 if name == path or name.startswith(path + ".")}
        out[names[0]] = tuple(sorted(found)) or (0,)
    return out
