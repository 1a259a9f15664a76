"""Fused AdamW over one flat fp32 shard: one kernel launch per ZeRO chunk.

The update is ``torch.optim.AdamW``'s (Loshchilov & Hutter, arXiv 1711.05101: weight decay
decoupled from the gradient; Adam's bias correction, Kingma & Ba arXiv 1412.6980), element by
element in the same order of operations as torch's single-tensor implementation, so the result
agrees with ``torch.optim.AdamW`` to fp32 rounding::

    param    *= 1 - lr * weight_decay
    exp_avg  += (1 - beta1) * (grad - exp_avg)              # exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    param    -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
    param_copy = param.to(param_copy.dtype)                 # optional bf16/fp16 compute copy

The Triton program reads param, grad, exp_avg and exp_avg_sq once and writes param, the two
moments and the optional low-precision copy once (multi-tensor fused Adam as in NVIDIA Apex
``FusedAdam`` / Megatron-LM's distributed optimizer, here over a flat buffer so no tensor list is
needed). On CPU the reference runs block by block (:data:`CPU_BLOCK` elements): torch's six
element-wise passes then reuse each block's param, grad and moments from cache instead of
streaming a whole chunk (16 MiB each) from memory six times, the same arithmetic per element.
:class:`FusedAdamW` is a ``torch.optim.AdamW`` whose ``step`` uses it; its ``state``
(``step``, ``exp_avg``, ``exp_avg_sq``) and ``state_dict`` are torch's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import _get_scalar_dtype

from ._dispatch import enabled, programs as triton_programs, use_triton

__all__ = ["adamw_", "adamw_reference_", "FusedAdamW", "CPU_BLOCK"]

# Elements per block of the CPU path: param, grad, both moments and the denominator temporary of
# a block take 2.5 MiB in fp32, which stays in L2/L3. A multiple of every SIMD width, so block
# edges never move the vectorised loops' scalar tails (the result equals the unblocked one).
CPU_BLOCK = 1 << 17

def _scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: float) -> tuple[float, float, float]:
    """``(1 - lr*wd, lr / bias_correction1, sqrt(bias_correction2))`` in Python floats, as torch."""
    step_size = lr / (1 - beta1 ** step)
    return 1 - lr * weight_decay, step_size, (1 - beta2 ** step) ** 0.5


def _check(param, grad, exp_avg, exp_avg_sq, param_copy) -> None:
    if param.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise TypeError(
            f"adamw_: param, exp_avg and exp_avg_sq must be float32 (master weights), got "
            f"{param.dtype}, {exp_avg.dtype}, {exp_avg_sq.dtype}"
        )
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("param_copy", param_copy)):
        if t is not None and t.shape != param.shape:
            raise ValueError(f"adamw_: {name} has shape {tuple(t.shape)}, param has {tuple(param.shape)}")


def adamw_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     param_copy: Optional[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: float) -> None:
    """The torch reference of :func:`adamw_`: ``torch.optim.AdamW``'s single-tensor update, in place."""
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    grad = grad.float()
    param.mul_(decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_copy is not None:
        param_copy.copy_(param)


def _adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                param_copy: Optional[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: float) -> None:
    """One AdamW step on a flat shard, in place (Triton on CUDA, :func:`adamw_reference_` else).

    Args:
        param: float32 ``(n,)`` master weights (a flat ZeRO shard), updated in place.
        grad: ``(n,)`` gradient, float32 or half precision (read as float32).
        exp_avg: float32 ``(n,)`` first moment, updated in place.
        exp_avg_sq: float32 ``(n,)`` second moment, updated in place.
        param_copy: None, or a bf16/fp16/fp32 ``(n,)`` copy of ``param`` written in the same pass
            (the compute copy of mixed-precision training).
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW``.
        step: the step count after this update (1 on the first step), for bias correction.

    Raises:
        TypeError: param or a moment not float32. ValueError: shapes differ.
    """
    _check(param, grad, exp_avg, exp_avg_sq, param_copy)
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([param_copy] if param_copy is not None else [])
    contiguous = all(t.is_contiguous() for t in tensors)
    if not use_triton(*tensors) or not contiguous:
        if contiguous and param.numel() > CPU_BLOCK and all(t.device.type == "cpu" for t in tensors):
            flat = [t.view(-1) for t in tensors] + ([] if param_copy is not None else [None])
            for lo in range(0, param.numel(), CPU_BLOCK):
                p, g, m, v, c = (t[lo : lo + CPU_BLOCK] if t is not None else None for t in flat)
                adamw_reference_(p, g, m, v, c, lr, beta1, beta2, eps, weight_decay, step)
            return
        adamw_reference_(param, grad, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps, weight_decay, step)
        return
    n = param.numel()
    if n == 0:
        return
    decay, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    block = 1024
    triton_programs()._adamw_kernel[(-(-n // block),)](
        param, grad, exp_avg, exp_avg_sq, param_copy if param_copy is not None else param, n,
        decay, 1 - beta1, beta2, 1 - beta2, -step_size, bc2_sqrt, eps,
        HAS_COPY=param_copy is not None, BLOCK=block,
    )


adamw_ = torch.library.custom_op("shardlib::adamw_", mutates_args=("param", "exp_avg", "exp_avg_sq", "param_copy"))(
    _adamw_step)
adamw_.__doc__ = _adamw_step.__doc__


def _eager_adamw(*args) -> None:
    """:func:`adamw_` as :class:`FusedAdamW` calls it: through the custom op while Dynamo traces
    (so the step compiles), else the implementation itself. The op's dispatch (schema checks,
    autograd and in-place wrappers) cost 0.45 ms a call on the CPU, more than the update of a
    200k-element chunk (0.18 ms) in the quick pipeline benchmark."""
    if torch.compiler.is_compiling():
        return adamw_(*args)
    return _adamw_step(*args)


@adamw_.register_fake
def _(param, grad, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps, weight_decay, step) -> None:
    _check(param, grad, exp_avg, exp_avg_sq, param_copy)
    return None


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` runs :func:`adamw_`: one launch per parameter tensor
    (a whole flat chunk or its ZeRO shard), optionally writing a low-precision copy; on CPU,
    torch's single-tensor update over cache-sized blocks (:data:`CPU_BLOCK`).

    Same constructor, ``param_groups``, ``state`` keys (``step``, ``exp_avg``, ``exp_avg_sq``) and
    ``state_dict`` as ``torch.optim.AdamW``, so checkpoints move between the two. Falls back to
    ``torch.optim.AdamW.step`` where the kernel does not apply: kernels off, tensors neither all
    on CUDA (with triton) nor all on CPU (e.g. optimizer state offloaded from CUDA to the host),
    a float ``lr`` that is a tensor, ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable``, non-float32 parameters or sparse gradients.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); opt = FusedAdamW([w], lr=0.1, weight_decay=0.0)
        >>> w.grad = torch.ones(4); opt.step(); w.detach()
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._param_copies: dict[int, torch.Tensor] = {}

    def set_param_copy(self, param: torch.Tensor, copy: Optional[torch.Tensor]) -> None:
        """Write ``param``'s new value into ``copy`` (same shape; bf16/fp16 compute weights)
        in the same kernel pass as the update; ``None`` stops it. Not part of ``state_dict``."""
        if copy is None:
            self._param_copies.pop(id(param), None)
        elif copy.shape != param.shape:
            raise ValueError(f"FusedAdamW.set_param_copy: copy has shape {tuple(copy.shape)}, param has {tuple(param.shape)}")
        else:
            self._param_copies[id(param)] = copy

    def _fusable(self, group: dict) -> bool:
        if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable"):
            return False
        if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
            return False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = [self.state[p][k] for k in ("exp_avg", "exp_avg_sq") if k in self.state.get(p, {})]
            tensors = (p, p.grad, *state)
            if p.dtype != torch.float32 or p.grad.is_sparse:
                return False
            if not (use_triton(*tensors) or (enabled() and all(t.device.type == "cpu" for t in tensors))):
                return False  # e.g. optimizer state offloaded to the CPU: torch's step handles devices
        return True

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient (see the class docstring)."""
        if not all(self._fusable(g) for g in self.param_groups):
            step = torch.optim.AdamW.step
            if getattr(step, "hooked", False):  # torch wrapped it with the step hooks, which already ran for us
                step = step.__wrapped__
            loss = step(self, closure)
            for group in self.param_groups:  # keep the compute copies in step on the fallback path too
                for p in group["params"]:
                    if id(p) in self._param_copies and p.grad is not None:
                        self._param_copies[id(p)].copy_(p)
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # torch's lazy init: a CPU float32 step counter, zero moments
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                _eager_adamw(p, p.grad, state["exp_avg"], state["exp_avg_sq"], self._param_copies.get(id(p)),
                       float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                       float(group["weight_decay"]), float(state["step"].item()))
        return loss
