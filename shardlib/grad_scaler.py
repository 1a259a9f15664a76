"""Loss scaling for float16 training of a sharded module (:class:`GradScaler`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .mesh.collectives import raw_all_reduce

__all__ = ["GradScaler"]


_READY, _UNSCALED, _STEPPED = 0, 1, 2


class GradScaler:
    """Dynamic loss scaling for float16 training of sharded modules, every rank in step.

    The interface and update rule of ``torch.amp.GradScaler`` (Micikevicius et al., "Mixed
    Precision Training", arXiv 1710.03740), as FSDP's ``ShardedGradScaler``: multiply the loss by
    the scale before ``backward()``; ``step(opt)`` divides the (fp32 master) gradients by it, and
    skips ``opt.step()`` when any gradient element on any rank is inf or NaN; ``update()`` then
    multiplies the scale by ``backoff_factor`` after a skipped step, and by ``growth_factor``
    after ``growth_interval`` consecutive good ones. The inf/NaN check is one global decision: a
    flag all-reduced (max) over every axis of the optimizer's mesh, so all data, tensor and
    pipeline ranks skip the same steps. A skipped step leaves parameters, compute copies and
    optimizer state (including its step count) untouched.

    Use with ``shard(model, mesh, param_dtype=torch.float16)`` on an fp32 model (fp32 masters);
    with bfloat16 no scaling is needed. Unscaling happens before clipping, because
    :class:`ZeroOptimizer` clips (``max_grad_norm``) inside its ``step()``; to clip by hand, call
    ``scaler.unscale_(opt)`` first, then :func:`clip_grad_norm_`, then ``scaler.step(opt)``.

    Args:
        init_scale: the first scale (default ``2**16``).
        growth_factor: scale multiplier after ``growth_interval`` good steps (default 2; >= 1).
        backoff_factor: scale multiplier after a skipped step (default 0.5; in (0, 1]). With both
            factors 1 the scale is static (DeepSpeed's static loss scale), overflow steps are
            still skipped.
        growth_interval: good steps between growths (default 2000).
        enabled: False makes every method a pass-through (``scale`` returns the loss).

    Raises:
        ValueError: a scale that is not positive and finite, factors outside their ranges, or a
            ``growth_interval`` below 1.

    Example:
        >>> import shardlib
        >>> mesh = shardlib.init_mesh({"dp": 1})
        >>> smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh, param_dtype=torch.float16)
        >>> opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
        >>> scaler = shardlib.GradScaler(init_scale=2.0**10, growth_interval=1)
        >>> scaler.scale(smodel(torch.ones(3, 4)).float().sum()).backward()
        >>> scaler.step(opt); scaler.update(); opt.zero_grad()
        >>> scaler.get_scale()  # a good step: grown after growth_interval=1 step
        2048.0
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"GradScaler: init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor >= 1.0:
            raise ValueError(f"GradScaler: growth_factor must be >= 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor <= 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1], got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self._enabled = bool(enabled)
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)  # fp32 arithmetic, as torch's
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale.item() if self._enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor or a tree of tensors, e.g. the loss) multiplied by the scale;
        a 0-dim float16 loss becomes float32."""
        if not self._enabled:
            return outputs
        import optree

        return optree.tree_map(lambda t: t * self._scale.to(t.device) if isinstance(t, torch.Tensor) else t, outputs)

    def _state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": False})

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and decide, over the whole
        mesh, whether any is inf/NaN. At most once per optimizer between ``update()`` calls.

        Raises:
            RuntimeError: called twice before ``update()``, or after ``step()``.
            ValueError: a gradient is float16 (keep fp32 masters: ``param_dtype`` on an fp32 model).
        """
        if not self._enabled:
            return
        state = self._per_optimizer.get(id(optimizer), {"stage": _READY, "found_inf": False})
        if state["stage"] == _UNSCALED:
            raise RuntimeError("GradScaler.unscale_() has already been called on this optimizer since the last update()")
        if state["stage"] == _STEPPED:
            raise RuntimeError("GradScaler.unscale_() is being called after step(); call update() first")
        zero = getattr(optimizer, "_zero", None)  # a ZeroOptimizer: the gradient shards on the device
        grads = zero.owned_grads() if zero is not None else [
            p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError(
                "GradScaler: the optimizer's gradients are float16, which unscaling would underflow. Keep fp32 master "
                "weights: build the model in fp32 and shard it with param_dtype=torch.float16"
            )
        inv = self._scale.double().reciprocal().float()
        mesh = getattr(getattr(optimizer, "smodel", None), "mesh", None)
        # on the mesh's device for the collective, also on a rank holding no gradient (a pipeline
        # stage of frozen parameters): NCCL rejects the CPU tensor torch.zeros(1) would be; each flag
        # moved there before the stack, which takes one device (with offload_param_frac < 1 some shards'
        # gradients are in host memory, the others on the GPU); no host sync yet
        dev = mesh.device if mesh is not None else grads[0].device if grads else None
        finite = [torch.isfinite(g).all().to(dev) for g in grads if g.numel()]
        found = (~torch.stack(finite)).any().float().reshape(1) if finite else torch.zeros(1, device=dev)
        for g in grads:
            g.mul_(inv.to(device=g.device, dtype=g.dtype))
        if mesh is not None and mesh.size() > 1:
            raw_all_reduce(found, mesh, tuple(mesh.axis_names), op="max")  # one decision for every rank
        state["found_inf"] = bool(found.item())
        state["stage"] = _UNSCALED
        self._per_optimizer[id(optimizer)] = state

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` was called) and run ``optimizer.step(*args, **kwargs)``
        unless a gradient anywhere was inf/NaN; returns what it returns (None when skipped).

        Raises:
            RuntimeError: a ``closure`` argument, or a second ``step()`` before ``update()``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("GradScaler.step() does not support closures (as torch.amp.GradScaler)")
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("GradScaler.step() has already been called since the last update()")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        state["stage"] = _STEPPED
        if state["found_inf"]:
            skip = getattr(optimizer, "skip_step", None)  # a ZeroOptimizer: its last_grad_norm is this step's
            if skip is not None:
                skip()
            return None
        return optimizer.step()

    def update(self, new_scale: float | None = None) -> None:
        """Back off after a skipped step, grow after ``growth_interval`` good ones (or set
        ``new_scale``); starts a new iteration.

        Raises:
            RuntimeError: no optimizer was unscaled or stepped since the last update.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = torch.tensor(float(new_scale), dtype=torch.float32)
        else:
            if not self._per_optimizer:
                raise RuntimeError("GradScaler.update(): no inf checks were recorded; call step(optimizer) first")
            if any(s["found_inf"] for s in self._per_optimizer.values()):
                self._scale = self._fp32(self._scale.item() * self._backoff_factor)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale = self._fp32(self._scale.item() * self._growth_factor)
                    self._growth_tracker = 0
        self._per_optimizer = {}

    @staticmethod
    def _fp32(value: float) -> torch.Tensor:
        """``value`` (a product in float64) rounded to float32, as torch's ``_amp_update_scale_``."""
        return torch.tensor(value, dtype=torch.float32)

    def state_dict(self) -> dict:
        """``torch.amp.GradScaler``'s keys: scale, growth_factor, backoff_factor,
        growth_interval, _growth_tracker (empty when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("GradScaler.load_state_dict(): the state dict is empty (saved from a disabled scaler)")
        self._scale = torch.tensor(float(state_dict["scale"]), dtype=torch.float32)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
