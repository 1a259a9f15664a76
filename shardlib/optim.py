"""The optimizer of a sharded module, and global gradient clipping."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable

import torch

from . import kernels
from .elementwise import check_elementwise
from .lowering import refuse_unlowered
from .mesh.collectives import raw_all_reduce
from .parallel.offload import OptimizerOffload
from .shard import ShardedModule

__all__ = ["ZeroOptimizer", "clip_grad_norm_", "GradScaler"]


def _real(value: Any) -> bool:
    """A real number (int, float, NumPy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_max_norm(where: str, name: str, value: Any, zero_ok: bool) -> float:
    """``value`` as a float: a number > 0 (``>= 0`` with ``zero_ok``), infinity allowed (measure
    the norm, never clip), NaN and negatives refused: a negative bound flips the sign of every
    gradient (``coef = max_norm / norm < 0``), so the optimizer climbs the loss."""
    off = "" if zero_ok else "; None turns clipping off"
    if not _real(value):
        raise TypeError(f"{where}: {name} must be a number (the largest global gradient norm allowed){off}, got "
                        f"{value!r} of type {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        why = "NaN would make every gradient NaN"
    elif value < 0:
        why = "a negative bound reverses every gradient, so the update climbs the loss"
    elif value == 0 and not zero_ok:
        why = "0 would scale every gradient to zero, so nothing trains"
    else:
        return value
    raise ValueError(f"{where}: {name}={value!r} is not a valid clipping norm: {why}. Fix: a positive number such as "
                     f"{name}=1.0{off}")


def _check_norm_type(value: Any) -> float:
    if not _real(value) or math.isnan(float(value)) or float(value) <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 (the p of the p-norm; float('inf') for the "
                         f"max norm), got {value!r}")
    return float(value)


def _refuse_unended_backward(zero, what: str) -> None:
    """Raise when gradients were accumulated by a backward whose end never ran here: an earlier
    backward raised part-way (torch drops the end-of-backward callback it queued) and the graph
    was backpropagated again with no forward or ``zero_grad`` between (``retain_graph=True``),
    so those gradients are not reduced. ``zero_grad`` or the next forward recovers (see
    :meth:`~shardlib.parallel.zero.ZeroRuntime.recover_abandoned_backward`)."""
    if zero.abandoned_backward():
        raise RuntimeError(
            f"{what} after a backward whose end never ran: an earlier backward raised part-way and the graph was "
            "backpropagated again without a forward or zero_grad() in between, so these gradients are not reduced "
            "over the data axes. Call zero_grad() (or run the forward again) before retrying the backward")


def clip_grad_norm_(smodel: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm, counting every unique element once.

    The norm is taken over the reduced gradients: under ZeRO stages 1-3 each rank sums its own
    shard and the sums are all-reduced over the data axes; tied parameters count once; padding
    is zero. Same value on every rank. Coefficient as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        smodel: a module from :func:`shardlib.shard` (a plain module falls back to torch's).
        max_norm: the largest norm allowed, a number >= 0. As in torch, ``0`` zeroes the
            gradients and ``float('inf')`` measures the norm without clipping.
        norm_type: the p of the p-norm, > 0; ``float('inf')`` for the max norm.

    Returns:
        The total norm before clipping, a 0-dim tensor: float32, float64 for float64 gradients.

    Raises:
        TypeError: ``max_norm`` is not a number.
        ValueError: ``max_norm`` is negative or NaN (a negative bound reverses the update), or
            ``norm_type`` is not a number > 0.
        RuntimeError: called after a backward inside ``no_sync()`` (gradients not yet reduced).
        All on every rank, before any communication.
    """
    max_norm = _check_max_norm("clip_grad_norm_", "max_norm", max_norm, zero_ok=True)
    norm_type = _check_norm_type(norm_type)
    if not isinstance(smodel, ShardedModule):
        return torch.nn.utils.clip_grad_norm_(smodel.parameters(), max_norm, norm_type)
    zero = smodel._zero
    if zero.unsynced:
        raise RuntimeError(
            "clip_grad_norm_() after a backward inside no_sync(): gradients are not reduced yet, so their norm is "
            "not the global one. Run the last micro-batch's backward outside no_sync(), then clip"
        )
    _refuse_unended_backward(zero, "clip_grad_norm_()")
    # which kinds of chunk (tensor-sharded or not) hold trainable parameters, and their dtypes, from
    # the plan of every stage: the same on every rank (a pipeline stage may hold only one kind and
    # still joins the other's all-reduce with a zero, or the ranks' collectives would differ)
    pplan = getattr(smodel, "pipeline_plan", None)
    planned = [c for stage in pplan.stages for c in stage.chunks] if pplan is not None else list(smodel.plan.chunks)
    tp_axes = tuple(sorted({layer.axis for layer in (pplan.whole if pplan is not None else smodel.plan).tp_layers}))
    pp_axes = (smodel.pp_axis,) if getattr(smodel, "pp_axis", None) else ()
    duplicates = getattr(smodel, "norm_duplicates", [])
    parts = []  # (local statistic, axes to reduce it over)
    for sharded in (False, True):
        kinds = [c for c in planned if c.requires_grad and c.tp_sharded == sharded]
        if not kinds:
            continue
        grads = zero.owned_grads(tp_sharded=sharded)  # (none on a stage that holds none of this kind)
        # in float32, or float64 for float64 gradients (as torch's clip_grad_norm_ computes in their
        # dtype); not in torch's default dtype, which float32 gradients of a float64 default left
        # in float32 precision while the statistic went out as 8 bytes
        acc = functools.reduce(torch.promote_types, (c.dtype for c in kinds), torch.float32)
        if math.isinf(norm_type):  # each on the mesh's device: with offload_param_frac < 1 some shards' gradients are
            # in host memory and some on the GPU, and torch.stack takes one device
            dev = zero.mesh.device
            local = torch.stack([g.abs().max().to(dev, acc) for g in grads if g.numel()]
                                or [torch.zeros((), dtype=acc, device=dev)]).max()
        else:
            local = sum((g.to(acc).abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=acc))
            for prm in duplicates:  # counted on the stage that holds the first copy
                if zero.param_chunk[id(prm)].plan.tp_sharded == sharded:
                    local = local - zero.owned_grad_region(prm).to(acc).abs().pow(norm_type).sum()
        axes = (() if zero.grads_replicated() else tuple(zero.axes)) + (tp_axes if sharded else ()) + pp_axes
        # on the mesh's device for the collective (offloaded shards' gradients are in host memory)
        parts.append((local.reshape(1).to(zero.mesh.device, copy=True), axes))
    op = "max" if math.isinf(norm_type) else "sum"
    for stat, axes in parts:
        if axes:
            raw_all_reduce(stat, zero.mesh, axes, op=op)
    acc = functools.reduce(torch.promote_types, (stat.dtype for stat, _ in parts), torch.float32)
    stats = [stat.to(acc) for stat, _ in parts] or [torch.zeros(1)]
    if math.isinf(norm_type):
        total = torch.stack(stats).max()
    else:
        total = torch.stack(stats).sum().pow(1.0 / norm_type)
    grads = zero.owned_grads()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer of a sharded module, for every ZeRO stage (HAI-LLM's name).

    Builds ``optimizer_cls`` over the flat tensors this rank updates: whole chunks under
    stage 0, this rank's shards under stages 1-3 (ZeRO, arXiv 1910.02054), so optimizer state is
    sharded from stage 1. ``optimizer_cls`` must be elementwise (its update of a shard is the
    shard of its update): per-tensor optimizers (Adafactor, LAMB, Muon, LBFGS) would see chunks,
    not parameters, and are refused. Accepted: torch's elementwise optimizers (SGD, Adam, AdamW,
    Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD) and
    :class:`shardlib.kernels.FusedAdamW`, by exact class (also inside a ``functools.partial``);
    and a class whose own body sets ``shardlib_elementwise = True`` (its author vouches). Any
    other (a subclass, your own) is refused: a probe on small float64 tensors
    (:func:`shardlib.elementwise.probe`) can show an update is not elementwise but not that it is,
    so it only says in the message what it found (no communication).

    Args:
        smodel: the module returned by :func:`shardlib.shard`.
        optimizer_cls: an elementwise ``torch.optim.Optimizer`` class (above), e.g.
            ``torch.optim.AdamW``.
        max_grad_norm: if given, ``step()`` clips to this global norm first (the norm is in
            ``last_grad_norm``): a number > 0; ``float('inf')`` measures the norm without
            clipping; ``None`` (the default) neither clips nor measures. ``0``, negatives and NaN
            are refused (0 would zero every update, a negative bound reverse it); the example
            scripts' ``--grad-clip 0`` means off and passes ``None``.
        offload: ``None``, True or False. ZeRO-Offload (arXiv 2101.06840): the optimizer works on host copies of the
            shards (:class:`shardlib.parallel.offload.OptimizerOffload`), so its state lives in
            host memory and the update runs on the CPU; ``step()`` copies gradients down and the
            updated shards back. Default: the plan's ``optimizer_offload`` option. Results equal
            the non-offloaded run where the CPU update equals the device one (bitwise on CPU).
            :class:`GradScaler` unscales and checks the device gradients, which ``step()`` then
            copies down.
        **optimizer_kwargs: passed to ``optimizer_cls`` (``lr=...``, ``weight_decay=...``).

    With ``torch.optim.AdamW`` (:mod:`shardlib.kernels` enabled, no ``foreach``/``fused``
    argument) the inner optimizer is :class:`shardlib.kernels.FusedAdamW`: the same update, state
    and ``state_dict``, one fused Triton launch per flat shard on CUDA, torch's own update in
    cache-sized blocks of the flat shard on CPU (equal to ``torch.optim.AdamW`` bit for bit).

    Mixed precision (``shard(..., param_dtype=...)``): the optimizer updates the master shards
    (the parameters' own dtype, fp32) with fp32 gradients and state, and ``step()`` refreshes the
    compute copies from them. For float16 use :class:`GradScaler` (``scaler.scale(loss).backward();
    scaler.step(opt); scaler.update()``), which unscales before this optimizer clips.

    ``param_groups`` and ``state`` are the inner optimizer's, so learning-rate schedulers work
    on this object; there is one group (``add_param_group`` is refused). ``state_dict()`` holds
    this rank's shards and its place on the mesh, which ``load_state_dict()`` checks (resharding
    checkpoints: :mod:`shardlib.checkpoint`). ``step()`` after ``zero_grad()`` (set_to_none) with
    no backward since updates nothing, as torch skips parameters whose ``.grad`` is None.

    Raises:
        TypeError: ``smodel`` is not a sharded module; ``max_grad_norm`` is not a number or
            None; ``offload`` is not a bool or None.
        ValueError: ``max_grad_norm`` is 0, negative or NaN; no trainable parameters on this rank,
            or (a pipeline, on every rank) on some pp rank while the others have some.
        shardlib.errors.NotElementwiseError: (a ``ShardingError`` and a ``TypeError``)
            ``optimizer_cls`` is not shown elementwise (Adafactor, LBFGS, SparseAdam, Muon, a
            per-tensor-norm optimizer of your own), or its ``step()`` requires a closure (LBFGS):
            on every rank, before the first step; the message names the class, what the probe
            found and the optimizers that work.
        All before any communication.

    Example:
        >>> import shardlib
        >>> mesh = shardlib.init_mesh({"dp": 1})
        >>> smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh)
        >>> opt = ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
        >>> smodel(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, smodel: ShardedModule, optimizer_cls: type, max_grad_norm: float | None = None,
                 offload: bool | None = None, **optimizer_kwargs: Any):
        if not isinstance(smodel, ShardedModule):
            raise TypeError(f"ZeroOptimizer takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
        if max_grad_norm is not None:
            max_grad_norm = _check_max_norm("ZeroOptimizer", "max_grad_norm", max_grad_norm, zero_ok=False)
        if offload is not None and not isinstance(offload, bool):
            raise TypeError(f"ZeroOptimizer: offload must be True, False or None (the plan's optimizer_offload), got "
                            f"{offload!r} of type {type(offload).__name__}")
        check_elementwise(optimizer_cls, optimizer_kwargs)  # every rank alike, before anything moves
        self.smodel = smodel
        self._structure_checked = False  # a parameter added past the registration hooks: refused at step()
        self._zero = smodel._zero
        pplan = getattr(smodel, "pipeline_plan", None)
        empty = [r for r, stage in enumerate(pplan.stages) if not any(c.requires_grad for c in stage.chunks)] if pplan else []
        if empty and len(empty) < pplan.p:  # (the same on every rank: the plan holds every stage's)
            held = {r: [list(pplan.stage_layers[s]) for s in pplan.rank_stages(r)] for r in empty}
            raise ValueError(
                f"ZeroOptimizer: pp rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of the pipeline on "
                f"mesh {dict(pplan.mesh.shape)} hold{'' if len(empty) > 1 else 's'} no trainable parameter (stage "
                f"layers: {held}), while the others do; an optimizer there would have nothing to update, and the "
                "step's gradient-norm collectives would not pair up with the other ranks'. Fix: split_points= that "
                "give every pp rank a layer with trainable parameters, or fewer pp ranks or virtual_stages")
        if not self._zero.optimizer_params():
            raise ValueError(
                f"ZeroOptimizer: the sharded {type(smodel.module).__name__} has no trainable parameters on this rank "
                "(all frozen, or none): there is nothing to optimize"
            )
        offload = smodel.plan.optimizer_offload if offload is None else bool(offload)
        # ZeRO-Offload; shards already in host memory (offload_param_frac) are updated where they are
        self.offload = OptimizerOffload(self._zero.optimizer_params(),
                                        [c.offloaded for c in self._zero.chunks if c.trainable]) if offload else None
        params = self.offload.host_params if offload else self._zero.optimizer_params()
        if optimizer_cls is torch.optim.AdamW and _fusable_adamw(params, optimizer_kwargs):
            optimizer_cls = kernels.FusedAdamW  # one fused pass per shard, torch's state and state_dict
        self.optimizer = optimizer_cls(params, **optimizer_kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self._built = False
        super().__init__(params, dict(self.optimizer.defaults))
        self._built = True  # (torch's __init__ calls add_param_group)
        self.defaults = self.optimizer.defaults
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Clip (if ``max_grad_norm``), update this rank's shards, and re-gather parameters
        where the stage keeps them whole (stages 1-2)."""
        if self._zero.unsynced:
            raise RuntimeError(
                "ZeroOptimizer.step() after a backward inside no_sync(): gradients are not reduced yet. "
                "Run the last micro-batch's backward outside no_sync()"
            )
        _refuse_unended_backward(self._zero, "ZeroOptimizer.step()")
        if not self._structure_checked or self._zero.mesh.trace.check:  # (about 1 ms for 400 parameters: the
            refuse_unlowered(self.smodel, "ZeroOptimizer.step()")  # first step, and every step in check mode)
            self._structure_checked = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._zero.grads_absent:  # no backward since zero_grad(set_to_none=True): torch skips every .grad None
            self.last_grad_norm = None
            self._zero.mesh.trace.next_step()
            return loss
        self._zero.settle_grads()
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(self.smodel, self.max_grad_norm)
        kept = self._keep_frozen()
        if self.offload is not None:
            self.offload.step(self.optimizer)
        else:
            self.optimizer.step()
        self._put_back(kept)
        self._zero.after_step()
        self._zero.mesh.trace.next_step()  # the collective trace names steps ("rank 1 finished step 7")
        return loss

    def _keep_frozen(self) -> list:
        """The elements of this rank's shards (and of their optimizer state) that belong to
        parameters frozen since ``shard()`` (``requires_grad`` False now, in a trainable chunk),
        copied: torch skips a parameter whose ``.grad`` is None, but a flat shard is updated as a
        whole, and weight decay or momentum moved a frozen parameter (found by a new user:
        AdamW with weight decay 0.1 moved it where one process left it). Nothing when none is."""
        kept = []
        flats = self.offload.host_params if self.offload is not None else self._zero.optimizer_params()
        for chunk, flat in zip([c for c in self._zero.chunks if c.trainable], flats):
            frozen = [(prm, off) for prm, off in chunk.params if not prm.requires_grad]
            if not frozen:
                continue
            lo = chunk.slot.start if self._zero.stage >= 1 else 0
            state = self.optimizer.state.get(flat, {})
            tensors = [flat] + [t for t in state.values() if torch.is_tensor(t) and t.shape == flat.shape]
            for prm, off in frozen:
                a, b = max(lo, off) - lo, min(lo + flat.numel(), off + prm.numel()) - lo
                if a < b:
                    kept.append((chunk, flat, a, b, [(t, t[a:b].clone()) for t in tensors]))
        return kept

    def _put_back(self, kept: list) -> None:
        """Write back what :meth:`_keep_frozen` copied (a state tensor the step created starts
        from zero gradients there: zeros, as a parameter torch never stepped has none)."""
        for chunk, flat, a, b, saved in kept:
            for t, values in saved:
                t[a:b].copy_(values)
            if chunk.opt_param is not flat:  # optimizer offload: the device shard took the host's values
                chunk.opt_param.data[a:b].copy_(flat[a:b])

    @torch.no_grad()
    def skip_step(self) -> None:
        """The step :class:`~shardlib.GradScaler` skips (a gradient somewhere was inf or NaN):
        nothing is updated, and ``last_grad_norm`` is this step's norm (inf or NaN, measured over
        the mesh: collective, as every rank skips together) where ``max_grad_norm`` is set, as
        torch's ``clip_grad_norm_`` after ``unscale_`` reports it; it held the previous step's
        finite norm, so a log showed a normal norm for an overflowed step."""
        _refuse_unended_backward(self._zero, "ZeroOptimizer.skip_step()")
        self.last_grad_norm = None
        if self.max_grad_norm is not None and not self._zero.grads_absent:
            self._zero.settle_grads()
            self.last_grad_norm = clip_grad_norm_(self.smodel, math.inf)
        self._zero.mesh.trace.next_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients: ``set_to_none`` (the default, as torch's) releases the flat
        gradient buffers until the next backward; False keeps them and zeroes them lazily.
        Same as ``smodel.zero_grad()``."""
        self._zero.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction: the optimizer updates flat chunks and shards, not the
        module's parameters (torch's duplicate check cannot see them), so a group of the module's
        parameters was updated twice at stage 0 and ignored at stages 1-3, silently.

        Raises:
            TypeError: always, once the optimizer is built."""
        if not getattr(self, "_built", False):
            super().add_param_group(param_group)
            return
        raise TypeError(
            "ZeroOptimizer.add_param_group: the optimizer updates the sharded module's flat chunks (stage 0) or "
            "this rank's shards (stages 1-3), one parameter group over all of them; a group of the module's own "
            "parameters would be updated twice or not at all. Fix: train those parameters by the one group "
            "(set requires_grad before shard()), or change param_groups[0]['lr'] for every parameter")

    def _identity(self) -> dict:
        """What makes this rank's optimizer state its own: the mesh, this rank's coordinates on the
        axes its shards depend on (every axis but the data axes at ZeRO stage 0, where every data
        rank holds the same state), and the flat sizes."""
        plan, mesh = self.smodel.plan, self.smodel.plan.mesh
        axes = [a for a in mesh.axis_names if plan.zero_stage > 0 or a not in plan.data_axes]
        return {"mesh": dict(mesh.shape), "coords": {a: mesh.index((a,)) for a in axes if mesh.size(a) > 1},
                "numels": [p.numel() for group in self.optimizer.param_groups for p in group["params"]]}

    def state_dict(self) -> dict:
        """The inner optimizer's state dict (this rank's flat shards' state) plus ``"shardlib"``:
        the mesh and this rank's coordinates, which :meth:`load_state_dict` checks."""
        return {**self.optimizer.state_dict(), "shardlib": self._identity()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict that :meth:`state_dict` made on this rank of the same mesh and plan
        (to move to another mesh, use :mod:`shardlib.checkpoint`).

        Raises:
            ValueError: the state dict was made on another rank (another shard: rank 0's state
                loaded everywhere gave every rank rank 0's moments, silently), another mesh or
                other flat sizes."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("shardlib", None)
        mine = self._identity()
        if saved is not None and saved != mine:
            what = next(k for k in ("mesh", "coords", "numels") if saved.get(k) != mine[k])
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: the state dict holds the optimizer state of {what} {saved.get(what)}, "
                f"and this rank's is {mine[what]}: ZeRO shards the state, so each rank loads the state dict it saved "
                "itself (rank 0's loaded everywhere would give every rank rank 0's shard). Fix: save and load on every "
                "rank, or shardlib.checkpoint.save/load, which reshards to any mesh")
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state


def _fusable_adamw(params: list[torch.Tensor], kwargs: dict) -> bool:
    """Whether torch.optim.AdamW over ``params`` may become :class:`shardlib.kernels.FusedAdamW`:
    kernels on, no implementation chosen by the caller, all on CUDA with triton or all on CPU."""
    if not kernels.enabled() or any(kwargs.get(k) for k in ("foreach", "fused", "capturable", "differentiable")):
        return False
    return kernels.use_triton(*params) or all(p.device.type == "cpu" for p in params)


# the loss scaler lives in shardlib/grad_scaler.py (re-exported here)
from .grad_scaler import GradScaler  # noqa: E402
