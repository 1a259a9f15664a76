"""Cross-entropy over logits split along the vocabulary, never gathered.

Megatron-LM's ``_VocabParallelCrossEntropy`` (arXiv 1909.08053, section 3: "fuse the output
embedding GEMM with the cross entropy loss"): the global max, the sum of exponentials and the
target logit are each reduced over the tensor axis (three all-reduces of ``N`` floats), so the
``(N, V)`` logits never exist on one rank. Label smoothing as ``torch.nn.functional.
cross_entropy``: ``(1 - eps) * nll + eps * mean_j(-log p_j)``.

This module owns the communication; the fused kernels (:mod:`shardlib.kernels.cross_entropy`)
compute on this rank's slice only, and the all-reduces run here, between them. Every tensor
handed to a collective lives on the logits' device (the mesh's communication device), and no
call reads a value back to the host (see ``vocab_size`` of :func:`vocab_parallel_cross_entropy`).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..mesh.collectives import raw_all_reduce
from ..mesh.mesh import Mesh, current_mesh
from ..spec import shard_range

__all__ = ["vocab_parallel_cross_entropy"]

def _as_dtype(v, like: torch.Tensor):
    """``v`` (an int, or a 0-dim integer tensor) as something to divide ``like``'s dtype by."""
    return v.to(like.dtype) if isinstance(v, torch.Tensor) else v


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, mesh, axis, lo, vocab, ignore_index, eps):
        width = logits.shape[-1]  # this rank's slice [lo, lo + width) of the vocabulary
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # accumulate half precision in fp32; fp32/fp64 stay as they are
        m = logits.max(dim=-1).values if width else logits.new_full(logits.shape[:-1], -float("inf"))
        raw_all_reduce(m, mesh, axis, op="max")
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        raw_all_reduce(sum_exp, mesh, axis)
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < lo + width)
        local_t = (target - lo).clamp(0, max(width - 1, 0))
        picked = torch.where(mine, shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) if width else torch.zeros_like(m),
                             torch.zeros_like(m))
        stats = torch.stack([picked, shifted.sum(dim=-1)]) if eps else picked.unsqueeze(0)
        raw_all_reduce(stats, mesh, axis)
        loss = loss_from_stats(sum_exp.log(), stats, valid, eps, vocab)
        ctx.save_for_backward(exp, sum_exp, local_t, mine, valid)
        ctx.eps, ctx.vocab = eps, vocab
        return loss

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, local_t, mine, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)  # softmax over the local slice
        if ctx.eps:
            grad = grad - ctx.eps / _as_dtype(ctx.vocab, grad)
        if grad.shape[-1]:
            onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0) * mine.unsqueeze(-1)
            grad = grad - (1 - ctx.eps) * onehot
        grad = grad * (g * valid).unsqueeze(-1)
        return grad, None, None, None, None, None, None, None


class _FusedVocabParallelCE(torch.autograd.Function):
    """The same loss through the kernels of :mod:`shardlib.kernels.cross_entropy`: local
    statistics in one read of the logits, the three all-reduces here, and a backward that
    writes the gradient into the logits' storage (Liger-Kernel, arXiv 2410.10989)."""

    @staticmethod
    def forward(ctx, logits, target, mesh, axis, lo, vocab, ignore_index, eps, inplace):
        width = logits.shape[1]
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < lo + width)
        target_local = torch.where(mine, target - lo, torch.full_like(target, -1))
        m_local, s_local, xt, sx = kernels.vocab_ce_stats(logits, target_local, bool(eps))
        m = m_local.clone()
        raw_all_reduce(m, mesh, axis, op="max")
        s = s_local * torch.exp(m_local - m)  # rescale this slice's sum to the global max
        raw_all_reduce(s, mesh, axis)
        # shifted by the global max, exactly the torch path's statistics: a rank with an empty
        # vocabulary slice takes that path (no kernel for width 0) and the sums must agree
        picked = torch.where(mine, xt - m, torch.zeros_like(xt))
        stats = torch.stack([picked, sx - width * m]) if eps else picked.unsqueeze(0)
        raw_all_reduce(stats, mesh, axis)
        loss = loss_from_stats(s.log(), stats, valid, eps, vocab)
        ctx.save_for_backward(logits, target_local, m, s, valid)
        ctx.eps, ctx.vocab, ctx.inplace = eps, vocab, inplace
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, target_local, m, s, valid = ctx.saved_tensors
        grad = logits if ctx.inplace else logits.clone()
        # the kernel takes eps / V as a number: with V exchanged (a device tensor) and label
        # smoothing on, reading it is this path's one host sync (pass vocab_size to avoid it)
        eps_over_v = ctx.eps / int(ctx.vocab) if ctx.eps else 0.0
        kernels.vocab_ce_grad_(grad, target_local, m, s, (g * valid).to(m.dtype).contiguous(), eps_over_v, 1.0 - ctx.eps)
        return grad, None, None, None, None, None, None, None, None


def fused_vocab_parallel_ce(logits: torch.Tensor, target: torch.Tensor, mesh, axis: str, lo, vocab,
                            ignore_index: int, eps: float) -> torch.Tensor:
    """Per-row loss of vocab-parallel cross-entropy through the fused kernels.

    Args:
        logits: ``(N, V_local)``, this rank's vocabulary slice ``[lo, lo + V_local)``.
        target: int64 ``(N,)`` global class ids or ``ignore_index``.
        mesh, axis: the mesh and tensor axis the vocabulary is split over.
        lo: this rank's first vocabulary id; vocab: the global vocabulary size ``V`` (each an
            int, or a 0-dim int64 tensor on the logits' device).
        eps: label smoothing.

    Returns:
        fp32 ``(N,)`` losses (0 for ignored targets). In backward the gradient is written into
        ``logits``' own storage (as Liger-Kernel and Megatron's fused cross-entropy do), unless
        ``logits`` is a leaf or a view of one, where a copy is written instead: do not read
        the logits after backward on this path.
    """
    logits = logits.contiguous()  # a copy only for a strided view (then the copy takes the gradient)
    root = logits._base if logits._base is not None else logits
    inplace = root.grad_fn is not None
    return _FusedVocabParallelCE.apply(logits, target, mesh, axis, lo, vocab, ignore_index, float(eps), inplace)


def loss_from_stats(log_z: torch.Tensor, stats: torch.Tensor, valid: torch.Tensor, eps: float, vocab) -> torch.Tensor:
    """Per-row loss from the tensor-axis sums of the max-shifted statistics (both the torch and
    the fused path): ``log_z`` is log sum exp(x - m) over the whole vocabulary ``(N,)``;
    ``stats[0]`` the target's shifted logit, ``stats[1]`` (label smoothing ``eps > 0``) the sum
    of the shifted logits; rows that are not ``valid`` (ignore_index) give 0. ``vocab``: ``V``,
    an int or a 0-dim tensor."""
    loss = log_z - stats[0]
    if eps:
        loss = (1 - eps) * loss + eps * (log_z - stats[1] / _as_dtype(vocab, stats))
    return torch.where(valid, loss, torch.zeros_like(loss))


def _fused_applies(flat: torch.Tensor) -> bool:
    return kernels.use_triton(flat) and kernels.fused_ce_applies(flat)  # imports the kernel module only then


def exchange_vocab_layout(width: int, mesh: Mesh, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, V)``: this rank's first vocabulary id and the global vocabulary size, as 0-dim
    int64 tensors on ``mesh.device``, from every rank's local width ``width`` (one all-reduce of
    ``tp`` integers, rank order along ``axis``; nothing is read back to the host, so on CUDA
    the call does not wait for the GPU)."""
    n, index = mesh.size(axis), mesh.index(axis)
    widths = torch.zeros(n, dtype=torch.int64, device=mesh.device)
    widths[index] = width
    raw_all_reduce(widths, mesh, axis, note="vocabulary widths")
    return widths[:index].sum(), widths.sum()


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    *,
    axis: str = "tp",
    vocab_size: int | None = None,
    data_axes: tuple[str, ...] = (),
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` on logits split over ``axis`` along the vocabulary.

    Args:
        logits_local: ``(..., V_local)``, this rank's slice ``[lo, hi)`` of the vocabulary
            (torch.chunk layout of ``vocab_size``; a column-parallel output layer gives this),
            on the mesh's communication device (``mesh.device``).
        target: int64 ``(...)`` global class ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: targets with this value contribute zero loss and zero gradient.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``torch.nn.functional.cross_entropy``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        axis: the tensor axis the vocabulary is split over.
        vocab_size: global ``V`` (checked against the local width: the torch.chunk layout).
            Default None: the ranks exchange their local widths, one more all-reduce of ``tp``
            integers per call, and the slices may then follow any contiguous layout in rank
            order. ``V`` and ``lo`` stay device tensors (never read back to the host: on CUDA
            the call does not stall on the GPU), except on the fused CUDA path with label
            smoothing, whose backward reads ``V`` once. Not cached: a cache keyed by this
            rank's width would let ranks of different vocabularies with equal widths on some
            ranks disagree on whether to exchange.
        data_axes: for ``"mean"``: the data axes the batch is split over. The mean is then taken
            over the global count of non-ignored targets, scaled so that the data-parallel
            gradient average gives the gradient of the global mean (a rank whose targets are all
            ignored contributes zero, never NaN). Default: the local mean.
        mesh: default :func:`~shardlib.current_mesh`.

    Returns:
        A scalar for ``"mean"``/``"sum"``; ``(...)`` per target for ``"none"``. Float32 for
        half-precision logits, else the logits' dtype.

    On CUDA with :mod:`shardlib.kernels` enabled, the statistics come from one fused read of
    the logits and backward writes the gradient into the logits' own storage (do not read them
    after backward; ``shardlib.kernels.use_kernels(False)`` restores this torch path).

    Raises:
        ValueError: bad ``reduction`` or ``label_smoothing``; a target that is not integer or whose
            shape is not ``logits_local.shape[:-1]``; local width not matching the layout. All
            before any communication.
        RuntimeError: a class id outside ``[0, V)`` other than ``ignore_index``, as
            ``F.cross_entropy`` refuses it: checked by ``torch._assert_async`` (on CPU at once; on
            CUDA a device-side assert, with no host sync), before any communication when
            ``vocab_size`` is given, after the width exchange otherwise.
    """
    mesh = mesh if mesh is not None else current_mesh()
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"vocab_parallel_cross_entropy takes class ids (an integer target), got {target.dtype}: class "
                         "probabilities are not supported. Fix: pass target.argmax(-1) for one-hot targets")
    if tuple(target.shape) != tuple(logits_local.shape[:-1]):
        # it paired logits and targets by flat order: a (T, B) target for (B, T, V) logits gave a loss
        raise ValueError(
            f"vocab_parallel_cross_entropy: target of shape {tuple(target.shape)} does not match logits_local of shape "
            f"{tuple(logits_local.shape)}: it needs one class id per row of logits, shape {tuple(logits_local.shape[:-1])} "
            "(F.cross_entropy refuses the pair too). Fix: reshape or transpose the target to the logits' leading dims")
    n = mesh.size(axis)
    width = logits_local.shape[-1]
    if vocab_size is None:
        lo, vocab = exchange_vocab_layout(width, mesh, axis)
    else:
        lo, hi = shard_range(vocab_size, n, mesh.index(axis))
        vocab = vocab_size
        if width != hi - lo:
            raise ValueError(
                f"vocab_parallel_cross_entropy: local logits have width {width} but rank "
                f"{mesh.index(axis)} of {axis!r} (size {n}) should hold vocabulary [{lo}, {hi}) of {vocab_size}"
            )
    # F.cross_entropy refuses an id outside [0, V) (IndexError on CPU, a device assert on CUDA);
    # here it would silently take the row's logsumexp as its loss. Asynchronous: no host sync on CUDA.
    torch._assert_async(((target >= 0) & (target < vocab) | (target == ignore_index)).all(),
                        f"vocab_parallel_cross_entropy: a target class id is outside [0, V) and is not ignore_index "
                        f"({ignore_index}), V = {vocab if isinstance(vocab, int) else 'the summed widths'}. Fix: check the "
                        "tokenizer's vocabulary against the model's output size")
    flat = logits_local.reshape(target.numel(), width)  # also for an empty vocabulary shard
    eps = float(label_smoothing)
    if _fused_applies(flat):  # CUDA + triton + kernels on: one read of the logits, gradient written in place
        loss = fused_vocab_parallel_ce(flat, target.reshape(-1), mesh, axis, lo, vocab, ignore_index, eps)
    else:
        loss = _VocabParallelCE.apply(flat, target.reshape(-1), mesh, axis, lo, vocab, ignore_index, eps)
    if reduction == "none":
        return loss.view(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(total.dtype).reshape(1)
    if data_axes:
        count = count.clone()
        raw_all_reduce(count, mesh, data_axes)
        return total * mesh.size(data_axes) / count.clamp(min=1)[0]
    return total / count.clamp(min=1)[0]
