"""Cross-entropy over logits split along the vocabulary, never gathered.

Megatron-LM's ``_VocabParallelCrossEntropy`` (arXiv 1909.08053, section 3: "fuse the output
embedding GEMM with the cross entropy loss"): the global max, the sum of exponentials and the
target logit are each reduced over the tensor axis (three all-reduces of ``N`` floats), so the
``(N, V)`` logits never exist on one rank. Label smoothing as ``torch.nn.functional.
cross_entropy``: ``(1 - eps) * nll + eps * mean_j(-log p_j)``.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..mesh.collectives import raw_all_reduce
from ..mesh.mesh import Mesh, current_mesh
from ..spec import shard_range

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, mesh, axis, vocab, ignore_index, eps):
        n = mesh.size(axis)
        lo, hi = shard_range(vocab, n, mesh.index(axis))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # accumulate half precision in fp32; fp32/fp64 stay as they are
        m = logits.max(dim=-1).values if logits.shape[-1] else logits.new_full(logits.shape[:-1], -float("inf"))
        raw_all_reduce(m, mesh, axis, op="max")
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        raw_all_reduce(sum_exp, mesh, axis)
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < hi)
        local_t = (target - lo).clamp(0, max(hi - lo - 1, 0))
        picked = torch.where(mine, shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) if hi > lo else torch.zeros_like(m), torch.zeros_like(m))
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
            grad = grad - ctx.eps / ctx.vocab
        if grad.shape[-1]:
            onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0) * mine.unsqueeze(-1)
            grad = grad - (1 - ctx.eps) * onehot
        grad = grad * (g * valid).unsqueeze(-1)
        return grad, None, None, None, None, None, None


def loss_from_stats(log_z: torch.Tensor, stats: torch.Tensor, valid: torch.Tensor, eps: float, vocab: int) -> torch.Tensor:
    """Per-row loss from the tensor-axis sums of the max-shifted statistics (both the torch and
    the fused path): ``log_z`` is log sum exp(x - m) over the whole vocabulary ``(N,)``;
    ``stats[0]`` the target's shifted logit, ``stats[1]`` (label smoothing ``eps > 0``) the sum
    of the shifted logits; rows that are not ``valid`` (ignore_index) give 0."""
    loss = log_z - stats[0]
    if eps:
        loss = (1 - eps) * loss + eps * (log_z - stats[1] / vocab)
    return torch.where(valid, loss, torch.zeros_like(loss))


def _fused_applies(flat: torch.Tensor) -> bool:
    return kernels.use_triton(flat) and kernels.fused_ce_applies(flat)  # imports the kernel module only then


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
            (torch.chunk layout of ``vocab_size``; a column-parallel output layer gives this).
        target: int64 ``(...)`` global class ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: targets with this value contribute zero loss and zero gradient.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``torch.nn.functional.cross_entropy``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        axis: the tensor axis the vocabulary is split over.
        vocab_size: global ``V``; default: the sum of local widths (one extra all-reduce).
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
        ValueError: bad ``reduction`` or ``label_smoothing``; local width not matching the layout.
    """
    mesh = mesh if mesh is not None else current_mesh()
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    n = mesh.size(axis)
    if vocab_size is None:
        width = torch.tensor([float(logits_local.shape[-1])])
        raw_all_reduce(width, mesh, axis)
        vocab_size = int(width.item())
    lo, hi = shard_range(vocab_size, n, mesh.index(axis))
    if logits_local.shape[-1] != hi - lo:
        raise ValueError(
            f"vocab_parallel_cross_entropy: local logits have width {logits_local.shape[-1]} but rank "
            f"{mesh.index(axis)} of {axis!r} (size {n}) should hold vocabulary [{lo}, {hi}) of {vocab_size}"
        )
    flat = logits_local.reshape(target.numel(), logits_local.shape[-1])  # also for an empty vocabulary shard
    if _fused_applies(flat):  # CUDA + triton + kernels on: one read of the logits, gradient written in place
        loss = kernels.fused_vocab_parallel_ce(flat, target.reshape(-1), mesh, axis, lo, hi, vocab_size, ignore_index,
                                               float(label_smoothing))
    else:
        loss = _VocabParallelCE.apply(flat, target.reshape(-1), mesh, axis, vocab_size, ignore_index, float(label_smoothing))
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
