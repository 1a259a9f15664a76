"""Vocab-parallel cross-entropy, fused: statistics in one pass, the gradient written in place.

Megatron-LM's vocab-parallel cross-entropy (arXiv 1909.08053, section 3) with the fusion of
Liger-Kernel's ``cross_entropy`` (Hsu et al., arXiv 2410.10989): each rank holds logits
``(N, V_local)`` for its vocabulary slice ``[lo, hi)``.

1. ``shardlib::vocab_ce_stats`` reads each row once, in blocks of the vocabulary, keeping an
   online max and rescaled sum of exponentials (Milakov & Gimelshein, arXiv 1805.02867), the
   target logit when the target falls in this slice, and (label smoothing) the sum of logits:
   four fp32 numbers per row.
2. Between the kernels, the tensor-axis all-reduces of Megatron's algorithm (the global max,
   the sum of exponentials rescaled to it, the target logit / logit sum) are issued by the
   strategy, :mod:`shardlib.parallel.cross_entropy`: these kernels compute on local tensors
   only and never communicate.
3. ``shardlib::vocab_ce_grad_`` (backward) overwrites the logits with
   ``g * (softmax - eps/V - (1 - eps) * onehot(target))`` row by row, so no second
   logits-sized tensor (and no fp32 copy of half-precision logits) is ever made.

Each program takes one row and walks its vocabulary slice in blocks of at most 4096 columns,
so working memory stays flat however large the vocabulary; only ``(N,)`` vectors are kept for
backward besides the logits themselves. Loss and gradient are those of
``torch.nn.functional.cross_entropy`` (``ignore_index``; ``label_smoothing`` as
``(1 - eps) * nll + eps * mean_j(-log p_j)``). The torch references
(:func:`vocab_ce_stats_reference`, :func:`vocab_ce_grad_reference_`) compute the same
quantities with whole-row torch ops.
"""

from __future__ import annotations

import torch

from ._dispatch import next_power_of_2, programs as triton_programs, use_triton

__all__ = ["vocab_ce_stats", "vocab_ce_grad_", "vocab_ce_stats_reference", "vocab_ce_grad_reference_",
           "fused_ce_applies"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 4096

def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def vocab_ce_stats_reference(logits: torch.Tensor, target_local: torch.Tensor, smoothing: bool):
    """Torch reference of :func:`vocab_ce_stats` (same outputs, whole-row ops)."""
    x = logits.to(_acc(logits.dtype))
    n, v = x.shape
    m = x.max(dim=-1).values if v else x.new_full((n,), -float("inf"))
    s = (x - m.unsqueeze(-1)).exp().sum(dim=-1)
    mine = (target_local >= 0) & (target_local < v)
    xt = x.gather(-1, target_local.clamp(0, max(v - 1, 0)).unsqueeze(-1)).squeeze(-1) if v else x.new_zeros(n)
    xt = torch.where(mine, xt, torch.zeros_like(xt))
    sx = x.sum(dim=-1) if smoothing else torch.zeros_like(m)
    return m, s, xt, sx


def vocab_ce_grad_reference_(logits: torch.Tensor, target_local: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                             g: torch.Tensor, eps_over_v: float, one_minus_eps: float) -> None:
    """Torch reference of :func:`vocab_ce_grad_` (in place; makes whole-row temporaries)."""
    x = logits.to(_acc(logits.dtype))
    grad = (x - m.unsqueeze(-1)).exp() / s.unsqueeze(-1) - eps_over_v
    cols = torch.arange(x.shape[-1], device=x.device)
    grad = grad - one_minus_eps * (cols == target_local.unsqueeze(-1)).to(grad.dtype)
    logits.copy_(grad * g.unsqueeze(-1))


def _kernel_ok(logits: torch.Tensor, *others: torch.Tensor, contiguous: bool = True) -> bool:
    return (use_triton(logits, *others) and logits.dtype in _KERNEL_DTYPES and logits.dim() == 2
            and logits.shape[0] > 0 and logits.shape[1] > 0 and (logits.is_contiguous() or not contiguous))


def _block(v: int) -> int:
    return min(next_power_of_2(v), _MAX_BLOCK)


def _warps(v: int) -> int:
    return min(max(_block(v) // 256, 1), 16)  # 16 warps for a 4096-column block


@torch.library.custom_op("shardlib::vocab_ce_stats", mutates_args=())
def vocab_ce_stats(logits: torch.Tensor, target_local: torch.Tensor,
                   smoothing: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row statistics of a vocabulary slice, in one read of the logits.

    Args:
        logits: ``(N, V_local)`` fp32/fp16/bf16 (fp64 runs the reference), contiguous.
        target_local: int64 ``(N,)``, the target's column in this slice, or any value outside
            ``[0, V_local)`` when the target is elsewhere (or ignored).
        smoothing: also compute the row sums of logits (for label smoothing; else zeros).

    Returns:
        ``(m, s, xt, sx)``, each fp32 ``(N,)`` (fp64 for fp64 logits): the local max, the sum of
        ``exp(x - m)``, the target logit (0 where not in this slice) and the logit sum.
    """
    if not _kernel_ok(logits, target_local):
        return vocab_ce_stats_reference(logits, target_local, smoothing)
    n, v = logits.shape
    m, s, xt, sx = (torch.empty(n, device=logits.device, dtype=torch.float32) for _ in range(4))
    triton_programs()._ce_stats_kernel[(n,)](logits, target_local, m, s, xt, sx, v, SMOOTH=smoothing,
                                             BLOCK=_block(v), num_warps=_warps(v))
    return m, s, xt, sx


@vocab_ce_stats.register_fake
def _(logits, target_local, smoothing):
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=_acc(logits.dtype)) for _ in range(4))


@torch.library.custom_op("shardlib::vocab_ce_grad_", mutates_args=("logits",))
def vocab_ce_grad_(logits: torch.Tensor, target_local: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                   g: torch.Tensor, eps_over_v: float, one_minus_eps: float) -> None:
    """Overwrite ``logits`` ``(N, V_local)`` with the cross-entropy gradient, in place.

    ``logits[i, j] = g[i] * (exp(logits[i, j] - m[i]) / s[i] - eps_over_v - one_minus_eps * [j == t[i]])``
    with ``m``, ``s`` the *global* max and sum of exponentials (fp32 ``(N,)``), ``g`` fp32
    ``(N,)`` the upstream gradient times the valid-target mask, ``t = target_local``.
    """
    if not _kernel_ok(logits, target_local, m, s, g):
        vocab_ce_grad_reference_(logits, target_local, m, s, g, eps_over_v, one_minus_eps)
        return
    n, v = logits.shape
    triton_programs()._ce_grad_kernel[(n,)](logits, target_local, m, s, g, v, eps_over_v, one_minus_eps,
                                            BLOCK=_block(v), num_warps=_warps(v))


@vocab_ce_grad_.register_fake
def _(logits, target_local, m, s, g, eps_over_v, one_minus_eps) -> None:
    return None


def fused_ce_applies(logits: torch.Tensor) -> bool:
    """Whether :func:`shardlib.parallel.cross_entropy.fused_vocab_parallel_ce` runs these kernels on ``logits`` ``(N, V_local)``
    (kernels enabled, triton, CUDA or the forced interpreter, fp32/fp16/bf16, no empty dimension)."""
    return _kernel_ok(logits, contiguous=False)
