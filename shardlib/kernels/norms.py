"""LayerNorm and RMSNorm, forward and backward, with fp32 accumulation for half precision.

LayerNorm (Ba et al., arXiv 1607.06450) and RMSNorm (Zhang & Sennrich, arXiv 1910.07467) over
the last ``C = prod(normalized_shape)`` elements of each row::

    LayerNorm: xhat = (x - mean(x)) * rstd,  rstd = 1 / sqrt(var(x) + eps)   (biased variance)
    RMSNorm:   xhat = x * rstd,              rstd = 1 / sqrt(mean(x**2) + eps)
    y = xhat * weight (+ bias)

The Triton programs follow the Triton tutorial "Layer Normalization" (``05-layer-norm.py``) and
Liger-Kernel's ``rms_norm``: the forward keeps a whole row in registers (one program per row)
and saves ``mean``/``rstd`` (fp32, one per row); the backward gives each program a contiguous
block of rows, computes ``dx = rstd * (w*dy - xhat * mean(xhat*w*dy) [- mean(w*dy)])`` row by
row, and accumulates its rows' ``dweight``/``dbias`` in fp32 registers, written once per program
and summed by torch (no atomics, no ``(N, C)`` fp32 buffer). Inputs may be fp32, fp16 or bf16;
statistics and accumulation are fp32; outputs have the input's dtype, weight gradients the
weight's. Rows wider than 16384 elements, fp64, or non-CUDA tensors use the torch reference.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ._dispatch import next_power_of_2, programs as triton_programs, use_triton

__all__ = ["layer_norm", "rms_norm", "norm_reference", "norm_backward_reference"]

_MAX_C = 16384
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for half precision; fp64 stays fp64


def norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                   rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the forward: ``x`` ``(N, C)`` -> ``(y (N, C) in x.dtype, mean (N,), rstd (N,))``,
    statistics in fp32 (fp64 for fp64 input); ``mean`` is ``(0,)`` for RMSNorm."""
    xf = x.to(_acc_dtype(x.dtype))
    if rms:
        mean = xf.new_empty(0)
        xc = xf
    else:
        mean = xf.mean(dim=-1)
        xc = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1) + eps)
    y = xc * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean, rstd


def norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                            rstd: torch.Tensor, has_bias: bool, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the backward: ``(dx (N, C), dweight (C,) or (0,), dbias (C,) or (0,))``."""
    acc = _acc_dtype(x.dtype)
    xf, dyf, r = x.to(acc), dy.to(acc), rstd.unsqueeze(-1)
    xhat = xf * r if rms else (xf - mean.unsqueeze(-1)) * r
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    c1 = (xhat * wdy).mean(dim=-1, keepdim=True)
    dx = (wdy - xhat * c1) * r if rms else (wdy - (xhat * c1 + wdy.mean(dim=-1, keepdim=True))) * r
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else x.new_empty(0)
    db = dyf.sum(0).to(weight.dtype if weight is not None else x.dtype) if has_bias else x.new_empty(0)
    return dx.to(x.dtype), dw, db


def _warps(c: int) -> int:
    """Warps per row program, as the Triton layer-norm tutorial: one per 256 columns, 1 to 8."""
    return min(max(next_power_of_2(c) // 256, 1), 8)


def _kernel_ok(*tensors: Optional[torch.Tensor]) -> bool:
    ts = [t for t in tensors if t is not None]
    x = ts[0]
    return (use_triton(*ts) and x.dtype in _KERNEL_DTYPES and 0 < x.shape[-1] <= _MAX_C
            and all(t.is_contiguous() for t in ts))


@torch.library.custom_op("shardlib::norm_forward", mutates_args=())
def norm_forward(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                 rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm/RMSNorm forward on ``x`` ``(N, C)``: ``(y (N, C), mean (N,) or (0,), rstd (N,))``."""
    if not _kernel_ok(x, weight, bias) or x.shape[0] == 0:
        return norm_reference(x, weight, bias, eps, rms)
    n, c = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(0 if rms else n, device=x.device, dtype=torch.float32)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    triton_programs()._norm_fwd_kernel[(n,)](
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean if not rms else rstd, rstd, c,
        eps, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms, BLOCK_C=next_power_of_2(c),
        num_warps=_warps(c))
    return y, mean, rstd


@norm_forward.register_fake
def _(x, weight, bias, eps, rms):
    acc = _acc_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty(0 if rms else x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc)


@torch.library.custom_op("shardlib::norm_backward", mutates_args=())
def norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                  rstd: torch.Tensor, has_bias: bool, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm/RMSNorm backward: ``(dx (N, C), dweight (C,) or (0,), dbias (C,) or (0,))``."""
    dy = dy.contiguous()
    if not _kernel_ok(x, dy, weight) or x.shape[0] == 0:
        return norm_backward_reference(dy, x, weight, mean, rstd, has_bias, rms)
    n, c = x.shape
    if x.is_cuda:
        programs = min(n, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:  # the interpreter: a few programs, so the row loop and the partial sums are exercised
        programs = min(n, 4)
    rows = math.ceil(n / programs)
    programs = math.ceil(n / rows)
    dx = torch.empty_like(x)
    dw = torch.empty(programs, c, device=x.device, dtype=torch.float32) if weight is not None else None
    db = torch.empty(programs, c, device=x.device, dtype=torch.float32) if has_bias else None
    triton_programs()._norm_bwd_kernel[(programs,)](
        dy, x, weight if weight is not None else x, mean if not rms else rstd, rstd, dx, dw if dw is not None else dx,
        db if db is not None else dx, n, c, rows, HAS_W=weight is not None, HAS_B=has_bias, RMS=rms,
        BLOCK_C=next_power_of_2(c), num_warps=_warps(c))
    pdtype = weight.dtype if weight is not None else x.dtype
    dw = dw.sum(0).to(pdtype) if dw is not None else x.new_empty(0)
    db = db.sum(0).to(pdtype) if db is not None else x.new_empty(0)
    return dx, dw, db


@norm_backward.register_fake
def _(dy, x, weight, mean, rstd, has_bias, rms):
    pdtype = weight.dtype if weight is not None else x.dtype
    c = x.shape[-1]
    return (torch.empty_like(x), x.new_empty(c if weight is not None else 0, dtype=pdtype),
            x.new_empty(c if has_bias else 0, dtype=pdtype))


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias, ctx.rms = bias is not None, rms


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward(dy, x, weight, mean, rstd, ctx.has_bias, ctx.rms)
    return dx, (dw if weight is not None else None), (db if ctx.has_bias else None), None, None


norm_forward.register_autograd(_backward, setup_context=_setup_context)


def _apply(x: torch.Tensor, normalized_shape: Sequence[int] | int, weight, bias, eps: float, rms: bool) -> torch.Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"{'rms' if rms else 'layer'}_norm: input of shape {tuple(x.shape)} does not end in normalized_shape {shape}")
    c = math.prod(shape)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{'rms' if rms else 'layer'}_norm: {name} has shape {tuple(t.shape)}, expected {shape}")
    x2 = x.reshape(-1, c).contiguous()
    w2 = weight.reshape(c).contiguous() if weight is not None else None
    b2 = bias.reshape(c).contiguous() if bias is not None else None
    y, _, _ = norm_forward(x2, w2, b2, float(eps), rms)
    return y.view(x.shape)


def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int] | int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` through ``shardlib::norm_forward`` (Triton on CUDA, torch reference else).

    Args:
        x: ``(..., *normalized_shape)``, fp32/fp16/bf16 (fp64 runs the reference).
        normalized_shape: the trailing dimensions normalized over (``C`` elements in all).
        weight, bias: ``normalized_shape`` or None.
        eps: added to the variance.

    Returns:
        ``x``'s shape and dtype. Differentiable in ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: ``x``, ``weight`` or ``bias`` does not match ``normalized_shape``.
    """
    return _apply(x, normalized_shape, weight, bias, eps, rms=False)


def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int] | int, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    """``F.rms_norm`` through ``shardlib::norm_forward``; ``eps=None`` means
    ``torch.finfo(x.dtype).eps`` as in torch. Shapes, dtypes and errors as :func:`layer_norm`."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _apply(x, normalized_shape, weight, None, eps, rms=True)
