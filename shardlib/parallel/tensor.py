"""Megatron tensor parallelism: column/row parallel Linear, parallel embeddings.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (arXiv 1909.08053), section 3; sequence parallelism after Korthikanti et al.
(arXiv 2205.05198). Names follow Megatron / haiscale. Shapes: ``tp`` is the size of the tensor
axis; uneven splits follow the torch.chunk layout (:func:`shardlib.spec.shard_range`).

A column layer followed by a row layer (attention q/k/v -> o_proj, MLP fc_in -> fc_out) needs
one all-reduce forward (after the row layer) and one backward (before the column layer). With
``sequence_parallel=True`` the input of a column layer is split along the sequence and
all-gathered, and the output of a row layer is reduce-scattered along the sequence instead.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh.collectives import all_gather, all_reduce, pvary, raw_all_reduce, reduce_scatter
from ..mesh.mesh import Mesh, current_mesh
from ..mesh.regions import gather_from_region
from ..plan_items import fused_blocks, tp_pieces
from ..spec import shard_range

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelEmbedding",
    "sum_grad_over",
    "SharedInput",
]


def seq_dim_of(x: torch.Tensor, seq_dim: int | None) -> int:
    """The sequence dimension of an activation under sequence parallelism: ``seq_dim`` if given,
    else 1 for ``(B, T, C)`` and 0 for a token-major ``(B * T, C)`` (OPT flattens before its MLP;
    the all-gather and the matching reduce-scatter then work on rows, which is exact for per-token
    layers)."""
    if seq_dim is not None:
        return seq_dim
    return 1 if x.dim() >= 3 else 0


class SharedInput:
    """One ``pvary`` (or sequence all-gather) per input tensor for the column layers reading it.

    Megatron fuses q/k/v into one matrix so their shared input is all-reduced once in backward;
    with separate modules (q_proj, k_proj, v_proj; gate_proj, up_proj) the same saving comes from
    applying the input operator once per *tensor*: a column layer that receives the very tensor
    object (same version) the previous one received reuses its result, whose backward then sums
    the gradients of every reader before one all-reduce. Exact by construction, whatever the
    module structure (a norm or residual between the parent's input and the projections simply
    gives a different tensor, which gets its own operator). A result is reused only in the mode
    it was made in: one made without a graph (under ``torch.no_grad()``, or before
    ``x.requires_grad_()``) would cut the gradient of ``x`` in a later training call.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._out: torch.Tensor | None = None  # held while its input lives (no longer: see _drop)

    def apply(self, x: torch.Tensor, kind: tuple, fn) -> torch.Tensor:
        """``fn(x)``, or the result of the last call when it was for this very ``x`` and ``kind``."""
        key, graph = self._key, torch.is_grad_enabled() and x.requires_grad
        if key is not None and key[0]() is x and key[1:] == (x._version, kind, graph):
            return self._out
        y = fn(x)
        self._key, self._out = (weakref.ref(x, self._drop), x._version, kind, graph), y
        return y

    def _drop(self, ref: weakref.ref) -> None:
        """The input died (its readers ran): release the result, so no activation outlives it."""
        if self._key is not None and self._key[0] is ref:
            self._key, self._out = None, None


def sum_grad_over(param: nn.Parameter, axis: str, mesh: Mesh) -> None:
    """Sum ``param``'s gradient over ``axis`` as it is produced (a hook on the parameter).

    For parameters replicated over the tensor axis but used on sequence shards (norm weights,
    row-layer biases under sequence parallelism): each rank's gradient is a partial sum. This
    per-parameter, per-backward all-reduce serves the layers used by hand; a sharded module's
    ZeRO runtime removes the hook and sums these gradients in buckets, once per step,
    overlapped with the backward (:mod:`shardlib.parallel.tensor_grads`).
    """
    if mesh.size(axis) == 1 or getattr(param, "_shardlib_grad_sum", None) == axis:
        return

    def hook(grad):
        grad = grad.clone()
        raw_all_reduce(grad, mesh, axis)
        return grad

    # the handle lets ZeRO take the sum over (in buckets, in its reduction dtype: tensor_grads)
    param._shardlib_grad_sum_hook = param.register_hook(hook)
    param._shardlib_grad_sum = axis


def _check_embedding(emb: nn.Embedding) -> None:
    unsupported = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(emb, k, None)]
    if unsupported:
        from ..errors import ShardingError

        raise ShardingError(
            f"nn.Embedding({emb.num_embeddings}, {emb.embedding_dim}) uses {unsupported}, which the parallel "
            "embeddings do not implement. Fix: leave this embedding replicated"
        )


def _from_embedding(cls, emb: nn.Embedding, mesh: Mesh, axis: str, dim: int, **kwargs) -> nn.Module:
    """``cls`` (a parallel embedding) holding this rank's slice along ``dim`` of ``emb``'s weight.

    A subclass of ``nn.Embedding`` that overrides ``forward`` (Gemma's
    ``GemmaTextScaledWordEmbedding`` returns ``super().forward(ids) * embed_scale``; BART, mBART
    and M2M100 do the same) keeps its class and its attributes: the result is an instance of
    ``(subclass, parallel lookup, cls)``, so the subclass's ``forward`` runs and its
    ``super().forward`` is the parallel lookup. A subclass whose ``forward`` does the lookup
    itself (never calling ``super().forward``) would read the local rows as if they were all of
    them; ``shard(verify=True)`` compares the outputs and refuses it.
    """
    _check_embedding(emb)
    w = emb.weight
    layer = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, axis=axis, mesh=mesh,
                device=w.device, dtype=w.dtype, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(_slice_rows(w, layer.lo, layer.hi, dim))
    layer.weight.requires_grad_(w.requires_grad)
    sub = type(emb)
    if sub is nn.Embedding or sub.forward is nn.Embedding.forward:
        return layer
    composed = _composed_embedding(sub, cls)
    new = composed.__new__(composed)
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in emb.__dict__.items()})
    for key in ("mesh", "axis", "lo", "hi", "sequence_parallel", "seq_dim"):
        if key in layer.__dict__:
            new.__dict__[key] = layer.__dict__[key]
    new._parameters["weight"] = layer.weight
    return new


_COMPOSED: dict[tuple[type, type], type] = {}


def _composed_embedding(sub: type, cls: type) -> type:
    """``class X(sub, lookup, cls)``: ``sub.forward``'s ``super().forward`` resolves to ``lookup``
    (an ``nn.Embedding`` whose forward is ``cls``'s), placed before ``nn.Embedding`` in the MRO."""
    key = (sub, cls)
    if key not in _COMPOSED:
        lookup = type(f"_{cls.__name__}Lookup", (nn.Embedding,), {"forward": cls.forward})
        _COMPOSED[key] = type(f"{cls.__name__}[{sub.__name__}]", (sub, lookup, cls),
                              {"extra_repr": cls.extra_repr, "__module__": sub.__module__})
    return _COMPOSED[key]


def _slice_rows(t: torch.Tensor | None, lo: int, hi: int, dim: int) -> torch.Tensor | None:
    return None if t is None else t.detach().narrow(dim, lo, hi - lo).clone()


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``(out, in)`` split by rows (output features) over ``axis``.

    Args:
        in_features: input width ``in`` (every rank sees the whole input).
        out_features: global output width ``out``; this rank holds ``out_local`` rows
            (``ceil(out / tp)``, fewer on trailing ranks when ``tp`` does not divide ``out``).
        bias: learnable bias, split like the output.
        axis: the tensor-parallel mesh axis.
        gather_output: all-gather the output to ``(..., out)`` (backward keeps the local slice);
            default False: the output stays ``(..., out_local)`` for a following row layer, or,
            for an LM head (``vocab_parallel_logits=True``), for
            :func:`~shardlib.parallel.cross_entropy.vocab_parallel_cross_entropy`.
        sequence_parallel: the input is ``(B, T / tp, in)`` and is all-gathered along
            ``seq_dim`` (backward: reduce-scatter); ``seq_dim=None`` (default): dimension 1, or
            0 for a token-major ``(B * T / tp, in)`` input.
        fused: the output concatenates several projections, each split over ``axis``
            separately, so every rank holds the same heads of each: a number of equal blocks
            (GPT-2's ``c_attn``: 3) or the block sizes, summing to ``out`` (Phi-3's ``qkv_proj``
            under GQA: ``(H * hd, KV * hd, KV * hd)``); the local output is this rank's slice of
            every block, joined in order. Default 1 (one block).
        shared_input: a :class:`SharedInput` shared with the other column layers of the model, so
            layers reading the same tensor apply the input operator once.
        mesh: default :func:`~shardlib.current_mesh`.

    Shapes: input ``(..., in)`` (or sequence-split), output ``(..., out_local)`` or
    ``(..., out)`` with ``gather_output``.

    Raises:
        ValueError: ``fused`` blocks that do not fill ``out``, or ``fused`` with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, axis: str = "tp",
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int | None = None,
                 input_is_shared: bool = False, transposed: bool = False, fused: int | tuple[int, ...] = 1,
                 shared_input: SharedInput | None = None, mesh: Mesh | None = None, device=None, dtype=None):
        super().__init__()
        self.mesh = mesh if mesh is not None else current_mesh()
        self.axis, self.in_features, self.out_features = axis, in_features, out_features
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        self.input_is_shared, self.transposed = input_is_shared, transposed
        self.fused = fused_blocks(out_features, fused)  # global block sizes; () for one block
        self.shared_input = shared_input
        if self.fused and gather_output:
            raise ValueError("a fused column layer cannot gather its output")
        # ((global start, width), ...) per block; lo, hi: this rank's rows of the first block
        self.pieces = tp_pieces(out_features, self.fused, self.mesh.size(axis), self.mesh.index(axis))
        self.lo, self.hi = self.pieces[0][0], self.pieces[0][0] + self.pieces[0][1]
        local = sum(w for _, w in self.pieces)
        kw = {"device": device, "dtype": dtype}
        shape = (in_features, local) if transposed else (local, in_features)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        self.bias = nn.Parameter(torch.zeros(local, **kw)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh: Mesh, axis: str = "tp", transposed: bool = False, **kwargs) -> "ColumnParallelLinear":
        """This rank's column slice of an existing ``nn.Linear`` (or, ``transposed``, a Hugging Face
        ``Conv1D`` whose weight is ``[in, out]``); weights copied."""
        w = linear.weight
        in_f, out_f = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
        layer = cls(in_f, out_f, linear.bias is not None, axis=axis, mesh=mesh, transposed=transposed,
                    device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(layer._local_blocks(w, 1 if transposed else 0))
            if linear.bias is not None:
                layer.bias.copy_(layer._local_blocks(linear.bias, 0))
        layer.weight.requires_grad_(w.requires_grad)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def _local_blocks(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of each of the ``fused`` blocks of ``t`` along ``dim``, joined."""
        return torch.cat([_slice_rows(t, start, start + width, dim) for start, width in self.pieces], dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_shared:
            pass  # after an SP exit: its all-gather's backward (a reduce-scatter) already sums the input gradients
        else:
            if self.sequence_parallel:
                dim = seq_dim_of(x, self.seq_dim)
                kind, op = ("gather", self.axis, dim), lambda t: all_gather(t, self.axis, dim, mesh=self.mesh)
            else:
                kind, op = ("pvary", self.axis), lambda t: pvary(t, self.axis, mesh=self.mesh)
            x = self.shared_input.apply(x, kind, op) if self.shared_input is not None else op(x)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        return self.gather(y) if self.gather_output else y

    @property
    def parallel_output(self) -> bool:
        """Whether the output is this rank's slice ``(..., out_local)`` (not gathered): an LM
        head's vocabulary-parallel logits (a model's loss reads this, as the reference GPT does)."""
        return not self.gather_output

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """The whole output ``(..., out)`` from this rank's ``(..., out_local)`` (torch.chunk
        layout): all-gathered over the axis; backward keeps the local slice. For a model that
        gives full logits to a caller who asks for them (no loss computed)."""
        if self.fused:
            raise ValueError("a fused column layer's output blocks cannot be gathered into one tensor")
        return gather_from_region(y, self.axis, -1, self.out_features, mesh=self.mesh)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {sum(w for _, w in self.pieces)}"
                + (f", fused blocks {self.fused}" if self.fused else "") + f"), axis={self.axis!r}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``(out, in)`` split by columns (input features) over ``axis``.

    The input is already split (``(..., in_local)``, the output of a column layer); partial
    products are all-reduced (or, with ``sequence_parallel``, reduce-scattered along
    ``seq_dim``), then the replicated bias is added once.

    Args:
        in_features: global input width ``in``; this rank holds ``in_local`` columns.
        out_features: output width ``out`` (whole on every rank).
        bias: learnable bias ``(out,)``, replicated (its gradient is summed over ``axis`` under
            sequence parallelism).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, axis: str = "tp",
                 sequence_parallel: bool = False, seq_dim: int | None = None, transposed: bool = False,
                 mesh: Mesh | None = None, device=None, dtype=None):
        super().__init__()
        self.mesh = mesh if mesh is not None else current_mesh()
        self.axis, self.in_features, self.out_features = axis, in_features, out_features
        self.sequence_parallel, self.seq_dim, self.transposed = sequence_parallel, seq_dim, transposed
        self.lo, self.hi = shard_range(in_features, self.mesh.size(axis), self.mesh.index(axis))
        kw = {"device": device, "dtype": dtype}
        shape = (self.hi - self.lo, out_features) if transposed else (out_features, self.hi - self.lo)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        if self.bias is not None and sequence_parallel:
            sum_grad_over(self.bias, axis, self.mesh)

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh: Mesh, axis: str = "tp", transposed: bool = False, **kwargs) -> "RowParallelLinear":
        """This rank's row slice of an existing ``nn.Linear`` (or transposed ``Conv1D``); weights
        copied, bias whole."""
        w = linear.weight
        in_f, out_f = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
        layer = cls(in_f, out_f, linear.bias is not None, axis=axis, mesh=mesh, transposed=transposed,
                    device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_slice_rows(w, layer.lo, layer.hi, 0 if transposed else 1))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        layer.weight.requires_grad_(w.requires_grad)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        if self.sequence_parallel:
            y = reduce_scatter(y, self.axis, seq_dim_of(y, self.seq_dim), mesh=self.mesh)
        else:
            y = all_reduce(y, self.axis, mesh=self.mesh)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.hi - self.lo}), out={self.out_features}, axis={self.axis!r}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding ``(vocab, dim)`` split by rows (vocabulary) over ``axis``.

    Each rank looks up the ids in its range ``[lo, hi)`` (others give zero rows) and the partial
    results are all-reduced; with ``sequence_parallel`` they are reduce-scattered along
    ``seq_dim`` instead (the entry into the sequence-parallel region, Megatron's choice).

    Shapes: ids ``(B, T)`` int64 -> ``(B, T, dim)`` (``(B, T / tp, dim)`` sequence-parallel).

    Raises:
        RuntimeError: an id outside ``[0, num_embeddings)``, as ``nn.Embedding`` refuses it:
            checked by ``torch._assert_async`` before the all-reduce (on CPU at once; on CUDA a
            device-side assert, with no host sync).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 axis: str = "tp", sequence_parallel: bool = False, seq_dim: int = 1,
                 mesh: Mesh | None = None, device=None, dtype=None):
        super().__init__()
        self.mesh = mesh if mesh is not None else current_mesh()
        self.axis, self.num_embeddings, self.embedding_dim = axis, num_embeddings, embedding_dim
        self.padding_idx, self.sequence_parallel, self.seq_dim = padding_idx, sequence_parallel, seq_dim
        self.lo, self.hi = shard_range(num_embeddings, self.mesh.size(axis), self.mesh.index(axis))
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mesh: Mesh, axis: str = "tp", **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (``padding_idx`` kept)."""
        return _from_embedding(cls, emb, mesh, axis, 0, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # nn.Embedding refuses an id outside [0, V) (IndexError on CPU, a device assert on CUDA);
        # here every rank would give it a zero row, silently. Asynchronous: no host sync on CUDA.
        torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                            f"VocabParallelEmbedding: a token id is outside [0, {self.num_embeddings}) (nn.Embedding "
                            "refuses it). Fix: check the tokenizer's vocabulary against the model's vocab_size")
        outside = (ids < self.lo) | (ids >= self.hi)
        if self.hi > self.lo:
            local = (ids - self.lo).clamp(0, self.hi - self.lo - 1)
            pad = self.padding_idx - self.lo if self.padding_idx is not None and self.lo <= self.padding_idx < self.hi else None
            y = F.embedding(local, self.weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)
        else:  # an empty shard (vocabulary smaller than the axis): contributes zeros
            y = self.weight.new_zeros(ids.shape + (self.embedding_dim,)) + self.weight.sum() * 0
        if self.sequence_parallel:
            return reduce_scatter(y, self.axis, self.seq_dim, mesh=self.mesh)
        return all_reduce(y, self.axis, mesh=self.mesh)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local rows [{self.lo}, {self.hi})), {self.embedding_dim}, axis={self.axis!r}"


class ParallelEmbedding(nn.Module):
    """An embedding ``(vocab, dim)`` split by columns (embedding dimension) over ``axis``.

    Each rank looks up ``dim_local`` features, then they are gathered (fairscale's
    ``ParallelEmbedding``). Shapes: ids ``(B, T)`` -> ``(B, T, dim)``, replicated.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 axis: str = "tp", mesh: Mesh | None = None, device=None, dtype=None):
        super().__init__()
        self.mesh = mesh if mesh is not None else current_mesh()
        self.axis, self.num_embeddings, self.embedding_dim, self.padding_idx = axis, num_embeddings, embedding_dim, padding_idx
        self.lo, self.hi = shard_range(embedding_dim, self.mesh.size(axis), self.mesh.index(axis))
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.hi - self.lo, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mesh: Mesh, axis: str = "tp", **kwargs) -> "ParallelEmbedding":
        """This rank's columns of an existing ``nn.Embedding`` (``padding_idx`` kept)."""
        return _from_embedding(cls, emb, mesh, axis, 1, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = F.embedding(ids, self.weight, padding_idx=self.padding_idx)
        return gather_from_region(y, self.axis, -1, self.embedding_dim, mesh=self.mesh)
