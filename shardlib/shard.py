"""shard(): apply a Plan to an nn.Module; the sharded module and its full state dict."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

from .parallel.tensor_lower import lower_tensor_parallel
from .parallel.tensor_verify import verify_tensor_parallel
from .parallel.offload import ActivationOffload, current_activation_offload
from .parallel.recompute import apply_activation_checkpointing
from .parallel.zero import ZeroRuntime
from .random import mesh_independent_dropout
from .local_batch import check_local_batch
from .lowering import refuse_lowered, register_lowering
from .errors import ShardingError
from .mesh.checks import check_on_device
from .pipeline_plan import PipelinePlan
from .plan import Plan, plan
from .plan_agree import check_same_plan, check_same_values
from .state_names import StateName, model_state_names

__all__ = ["ShardedModule", "PipelineModule", "shard", "load_full_state_dict", "full_state_dict", "full_grads", "model_state_bytes"]


class ShardedModule(nn.Module):
    """A module sharded as a :class:`~shardlib.plan.Plan` says; built by :func:`shard`.

    Calls keep the wrapped module's signature: ``smodel(x_local)`` returns what
    ``model(x_local)`` would, on this rank's local batch. Gradients are averaged over the data
    axes (DDP semantics), so equal local batches give the gradient of the global mean loss.

    Attributes:
        module: the original module (its parameters now live in ZeRO chunks).
        plan: the plan applied.
        mesh: the mesh.
        recomputed: the paths of the modules whose forward backward runs again (the plan's
            ``activation_checkpointing``; a pipeline stage: those it holds).
        verification: what ``shard(verify=True)`` proved (:func:`~shardlib.parallel.tensor_verify.
            verify_tensor_parallel`: the units checked and the largest relative error, or why it
            was skipped), None with no tensor parallelism or ``verify=False``.

    Use :class:`~shardlib.ZeroOptimizer` for the optimizer: under ZeRO stages 1-3 the
    parameters' own ``.grad`` is not the reduced gradient (see :func:`full_grads`).
    """

    def __init__(self, module: nn.Module, plan: Plan, model_name: str | None = None, init_root: nn.Module | None = None):
        super().__init__()
        self.module = module
        self.plan = plan
        self.mesh = plan.mesh
        # Fixed lowering order: dropout first (the sequence-parallel entry hooks onto the new
        # module), then tensor parallelism (swaps modules), then ZeRO (packs the local params).
        self._model_name = model_name or type(module).__name__  # before the root may become a parallel layer
        self._dropouts = mesh_independent_dropout(module, seed=plan.dropout_seed)
        module, self._tp_hooks = lower_tensor_parallel(module, plan, plan.mesh)
        self.module = module  # a new object only when the root itself is a parallel layer
        for drop in self._dropouts:
            drop.batch_parts = plan.data_size
            drop.batch_index = plan.mesh.index(plan.data_axes) if plan.data_axes else 0
            if plan.sequence_parallel:
                axis = plan.tp_layers[0].axis
                drop.seq_parts, drop.seq_index = plan.mesh.size(axis), plan.mesh.index(axis)
        lazy = None
        if plan.init_rules:  # built on meta: placeholders now, local shards filled by ZeroRuntime
            from .lazy import LazyInit, default_device, materialize_meta

            materialize_meta(module, default_device(), plan.mesh, root=init_root)  # a stage: the whole model's own init
            lazy = LazyInit(plan)
        self._zero = ZeroRuntime(module, plan, plan.mesh, lazy, model_name=self._model_name)
        # after the lowering (a chosen module may have become a parallel layer) and ZeRO's hooks
        self.recomputed = apply_activation_checkpointing(module, plan.activation_checkpointing, self._zero)
        # haiscale CPUOffload semantics; an activation_offload() context around a call wins
        off = plan.offload_ratio  # 0.0: measured, nothing moves; None: no hooks
        self._own_offload = ActivationOffload(off) if off is not None else None
        self._last_offload = self._own_offload
        self.verification: dict | None = None  # set by the lowering (shard(verify=True))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward on this rank's local batch (its rows of the global batch,
        split along dim 0 over ``data_axes``: :attr:`batch_spec`).

        Every data rank must pass as many rows: the gradient is reduced as the mean of the ranks'
        gradients, which is the gradient of the global batch's mean loss only when each rank's
        loss is the mean over the same number of rows (a short last batch on one rank, as a
        ``DataLoader`` with ``drop_last=False`` gives, weighs its rows more; DDP does the same).
        Ranks that differ only along the tensor-parallel axes (``tp``) must pass the same batch: their
        partial results are summed as parts of one computation (Megatron's rule; a sampler over
        the whole world instead of the data axes breaks it silently). Check mode
        (``SHARDLIB_CHECK_COLLECTIVES=1``, on in the tests) checks the rows of the first tensor
        argument and the values of every tensor argument (labels too), with one small all-reduce
        each (not counted in ``mesh.comm``).

        Raises:
            ShardingError: in check mode, on every rank of the group concerned: a training
                forward's (module in training mode, gradients enabled) local batches have
                different row counts across the data axes; or any forward's batch differs
                (a position-weighted checksum) across the tensor-parallel axes. With gradients
                enabled: a parameter frozen when ``shard()`` planned it is trainable now (its chunk
                has no gradient buffer or optimizer shard: set ``requires_grad`` before ``shard()``).
        """
        zero = self._zero
        # check mode; a pipeline's step checks its local batch and labels on every rank (forward_backward)
        if self.plan.mesh.trace.check and not torch.compiler.is_compiling() and not isinstance(self, PipelineModule):
            check_local_batch(self.plan, args, kwargs, self.training and torch.is_grad_enabled())
        if self.plan.param_dtype is not None:  # FSDP2's cast_forward_inputs
            args, kwargs = _cast_floating((args, kwargs), self.plan.param_dtype)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # (no graph break)
            zero.refuse_unfrozen()
        zero.root_pre_forward()
        try:
            if not torch.is_grad_enabled():  # nothing is saved for backward
                return self.module(*args, **kwargs)
            inner = (zero.pack, zero.unpack) if zero.stage == 3 else None
            off = self._last_offload = current_activation_offload() or self._own_offload
            if off is not None:
                off.begin_forward()
                with off.apply(inner, self._chunk_storage_test()):
                    return self.module(*args, **kwargs)
            if inner is not None:
                with torch.autograd.graph.saved_tensors_hooks(*inner):
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)
        finally:
            zero.root_post_forward()

    @property
    def activation_offload(self) -> ActivationOffload | None:
        """The activation offload of the last forward with gradients: an
        :func:`~shardlib.activation_offload` context around the call if there was one, else the
        plan's ``offload_ratio`` (None when neither ever applied). Its ``stats`` hold the bytes
        measured in that forward (and, live, through its backward)."""
        return self._last_offload

    def _chunk_storage_test(self):
        """``t -> bool``: does ``t`` live in a ZeRO chunk (a parameter, never offloaded)?"""
        ptrs = {t.untyped_storage().data_ptr() for c in self._zero.chunks for t in (c.full, c.shard)}
        ptrs.discard(0)
        return lambda t: t.untyped_storage().data_ptr() in ptrs

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ``.double()``, ``.cuda()`` and the like: a conversion that leaves
        every floating tensor's dtype and device as they are does nothing; any other is refused.

        The parameters are views of the ZeRO chunks' flat buffers; a cast replaced them with
        new tensors, so under stages 1-2 the optimizer went on updating buffers the module no
        longer read and training stopped without an error (found by a new user; stage 0 failed
        in backward with torch's grad-dtype error).

        Raises:
            ShardingError: a conversion to another dtype or device (on every rank alike, before
                anything is changed)."""
        probe = next((p for p in self.module.parameters() if p.is_floating_point()), None)
        if probe is None:
            return self
        out = fn(torch.empty(0, dtype=probe.dtype, device=probe.device))
        if isinstance(out, torch.Tensor) and out.dtype == probe.dtype and out.device == probe.device:
            return self
        got = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)
        raise ShardingError(
            f"converting a sharded {self.model_name} to {got} (from {probe.dtype} on {probe.device}), as .to(), .half(), "
            f".double() or .cuda() do: its parameters live in shardlib's flat ZeRO buffers, and new tensors would leave "
            f"the optimizer updating buffers the module no longer reads. Fix: convert the model before shard() "
            f"(model.to(...)), or shard(..., param_dtype=...) for mixed precision")

    def state_dict(self, *args: Any, **kwargs: Any):
        """The module's state dict; under ZeRO-3 parameters are sharded flat chunks, so this
        raises: use :func:`full_state_dict` (a collective, on every rank). With ``param_dtype``
        the module's parameters are the compute copies (``param_dtype``), not the masters."""
        if self._zero.stage == 3:
            raise RuntimeError(
                "state_dict() of a ZeRO-3 sharded module: its parameters are flat shards, not tensors of their "
                "global shape. Use shardlib.full_state_dict(smodel) on every rank (rank0_only=True to keep one copy)"
            )
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load full tensors under the original names (as :func:`full_state_dict` returns); every
        rank takes its own shards, so there is no communication. See :func:`load_full_state_dict`."""
        return load_full_state_dict(self, state_dict, strict=strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient: the flat ZeRO gradient buffers and, under stage 0, the
        parameters' ``.grad`` (set to None until the next backward). With ``set_to_none`` (the
        default, as torch's) the buffers' memory is released until the next backward allocates
        them; with False it is kept and zeroed lazily (no memset). Same as
        :meth:`ZeroOptimizer.zero_grad`.

        Under stages 1-3 the parameters' ``.grad`` stays None, so ``zero_grad()`` of the wrapped
        module cannot see the buffers: call this method or the optimizer's."""
        self._zero.zero_grad(set_to_none)

    @property
    def model_name(self) -> str:
        """The class name of the model that was sharded (for messages)."""
        return self._model_name

    @property
    def model_state_names(self) -> tuple[StateName, ...]:
        """Every parameter (canonical name, tied aliases, global shape) and persistent buffer of
        the whole model, the same on every rank (a pipeline's: every stage's)."""
        return model_state_names(self.plan.params, [self.module])

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split along (gradients are averaged over them)."""
        return self.plan.data_axes

    @property
    def batch_spec(self):
        """``P(data_axes)``: the spec of a batch split along dim 0 over the data axes, for
        :func:`~shardlib.distribute` (``P()`` when there are none)."""
        from .spec import P

        return P(self.plan.data_axes) if self.plan.data_axes else P()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication (DDP's ``no_sync``).

        Backward passes inside the block add into unreduced gradient buffers; the first
        backward after it reduces the sum. Under stages 2-3 the buffers are full-size while
        accumulating (as FSDP's ``no_sync``).
        """
        old = self._zero.sync
        self._zero.sync = False
        try:
            yield
        finally:
            self._zero.sync = old

    def extra_repr(self) -> str:
        return f"zero_stage={self.plan.zero_stage}, data_axes={self.plan.data_axes}, mesh={dict(self.plan.mesh_shape)}"


class PipelineModule(ShardedModule):
    """This rank's pipeline stage(s), sharded, with the schedule that runs them.

    Built by :func:`shard` (``PipelinePlan.apply``) when the mesh has a pipeline axis (``pp``) of
    size > 1. Train with :meth:`forward_backward`; the optimizer is
    :class:`~shardlib.ZeroOptimizer` as usual.

    Attributes:
        pipeline_plan: the :class:`~shardlib.pipeline_plan.PipelinePlan` applied.
        plan: this rank's stage plan (``pipeline_plan.stages[pp index]``).
        stage_layers, stage_bytes: every stage's layer names and unsharded parameter bytes.
    """

    def __init__(self, stage: nn.Module, pplan: PipelinePlan, model: nn.Module | None = None):
        from .parallel.pipeline import PipelineRunner

        rank = pplan.mesh.index(pplan.pp_axis)
        super().__init__(stage, pplan.stages[rank], model_name=pplan.model_name or None, init_root=model)
        self.pipeline_plan = pplan
        self.pp_axis = pplan.pp_axis
        whole = pplan.whole
        params = dict(stage.named_parameters(remove_duplicate=False))  # names survive the lowering
        mine = []  # (name, this rank's parameter or None, local elements, gradient dtype), one order everywhere
        for names, _ in pplan.tied:
            pp = whole.param(names[0])
            dtype = whole.reduce_dtype if whole.reduce_dtype is not None else pp.dtype  # the local gradient's dtype
            mine.append((names[0], next((params[n] for n in names if n in params), None),
                         int(np.prod(whole.local_shape(pp))), dtype))
        self.tied = [names[0] for names, _ in pplan.tied]
        # a tied parameter's second copy is left out of the global gradient norm
        self.norm_duplicates = [prm for (_, prm, _, _), (_, first) in zip(mine, pplan.tied) if prm is not None and rank != first]
        self.runner = PipelineRunner(self, pplan.mesh, self.pp_axis, pplan.schedule, pplan.m, pplan.v, mine)
        self.schedule = pplan.schedule
        self.stage_layers = [list(layers) for layers in pplan.stage_layers]
        self.stage_bytes = list(pplan.stage_param_bytes)

    @property
    def model_name(self) -> str:
        """The class name of the whole model (this rank holds a Stage of it)."""
        return self.pipeline_plan.model_name or self._model_name

    @property
    def model_state_names(self) -> tuple[StateName, ...]:
        """Every stage's parameters and persistent buffers (computed at plan time from the whole
        model), the same on every rank: what a checkpoint load checks against."""
        return self.pipeline_plan.state_names

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One stage's forward, as the schedule calls it: ``forward(chunk, x)`` (the index of a
        stage this rank holds, its input). A pipeline is not called like the module it shards:
        each rank holds only some of its layers.

        Raises:
            TypeError: any other call (``smodel(x)``), naming :meth:`forward_backward` and
                :meth:`evaluate`.
        """
        if len(args) != 2 or kwargs or not isinstance(args[0], int) or isinstance(args[0], bool):
            raise TypeError(
                f"{type(self).__name__}: a pipeline is not called like the module it shards: each of the "
                f"{len(self.stage_layers)} pp ranks holds only its stages' layers (smodel.stage_layers), and a step runs "
                "every stage's microbatches by a schedule. Fix: smodel.forward_backward(x, criterion=loss_fn, labels=(y,)) to train, "
                "smodel.evaluate(x, criterion=loss_fn, labels=(y,)) for losses (or return_outputs=True for the outputs) "
                "without gradients")
        self._zero.use_model_chunk(args[0])  # ZeRO-3 gathers that model chunk's chunks only (parallel/gather.py)
        return super().forward(*args, **kwargs)

    def forward_backward(self, x: torch.Tensor, criterion=None, labels: tuple = (), return_outputs: bool = False):
        """Run one step's forwards and backwards over ``microbatches`` microbatches.

        Args:
            x: the local batch ``(B_local, ...)`` (used by the first stage; every rank passes it);
                under sequence parallelism ``(B_local, T)`` with ``T`` divisible by the tensor axis.
            criterion: ``criterion(output, *labels) -> scalar`` on the last stage (mean over a
                microbatch); each microbatch's loss is divided by the number of microbatches, so
                the gradients are those of the mean loss over the local batch.
            labels: tensors split like ``x`` along dim 0.
            return_outputs: also return each microbatch's output on the last stage: a list of
                ``microbatches`` outputs, detached (a tuple, dict or ``ModelOutput`` keeps its
                structure, its tensors detached).

        Returns:
            ``(losses, outputs)`` on the last stage (per-microbatch losses, unscaled), else
            ``(None, None)``. Gradients are reduced over the data axes when it returns.

        Raises:
            TypeError: ``x`` not a tensor, ``criterion`` not callable (checked on every stage: only
                the last one calls it, and the others would wait for it), ``labels`` not a
                tuple or list of tensors.
            ShardingError: a local batch not divisible by the microbatch count, or under
                sequence parallelism a sequence length not divisible by the tensor axis (on every
                rank, before any communication). In check mode (``SHARDLIB_CHECK_COLLECTIVES=1``),
                on every rank before the first transfer: local batches with different row counts
                across the data axes, or ``x`` or ``labels`` differing across the tensor axes (as
                :meth:`ShardedModule.forward`).
        """
        _check_step_args("forward_backward", x, criterion, labels)
        if self.mesh.trace.check:  # every rank, before the schedule's first transfer
            check_local_batch(self.plan, (), {"x": x, "labels": tuple(labels)}, True, "forward_backward")
        return self.runner.run(x, criterion, tuple(labels), return_outputs)

    def explain(self, tokens: int | None = None) -> str:
        """The pipeline plan's summary (stages, bytes per pp rank, bubble, peak stashed
        microbatches), the bytes sent per boundary transfer (measured, after a step), the
        schedule as a step-by-rank grid, then this stage's sharding plan.

        Args:
            tokens: tokens in one microbatch on one rank, for the predicted transfer bytes.
        """
        from .explain_pipeline import GRID_LEGEND
        from .parallel.schedules import format_grid

        pplan = self.pipeline_plan
        lines = [pplan.summary(tokens)]
        if self.mesh.comm.calls(self.pp_axis, "send"):
            sent = self.mesh.comm.bytes(self.pp_axis, "send") / self.mesh.comm.calls(self.pp_axis, "send")
            lines.append(f"  bytes per boundary transfer (measured mean): {sent:,.0f}")
        lines.append(f"schedule ({GRID_LEGEND}; stage, kind, microbatch):")
        lines.append(format_grid(pplan.simulation))
        lines.append("this rank's stage:")
        lines.append(self.plan.explain(tokens))
        return "\n".join(lines)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, criterion=None, labels: tuple = (), return_outputs: bool = False):
        """Forwards only (no gradients, no optimizer state touched): ``(losses, outputs)`` on the
        last stage as :meth:`forward_backward`, ``(None, None)`` elsewhere; the same checks."""
        _check_step_args("evaluate", x, criterion, labels)
        if self.mesh.trace.check:  # every rank, before the schedule's first transfer
            check_local_batch(self.plan, (), {"x": x, "labels": tuple(labels)}, False, "evaluate")
        return self.runner.run(x, criterion, tuple(labels), return_outputs, backward=False)

    @property
    def timeline(self) -> list[tuple[str, float, float]]:
        """The last step's actions on this rank: ``(action, start s, end s)``."""
        return self.runner.timeline


def _check_step_args(fn: str, x: Any, criterion: Any, labels: Any) -> None:
    """The arguments of a pipeline step, alike on every stage (the runner checks what needs the
    schedule: microbatch and sequence sizes)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be the local batch as a tensor, got {type(x).__name__}")
    if not callable(criterion):
        raise TypeError(
            f"{fn}: criterion must be a function (output, *labels) -> loss, got {criterion!r}; every stage passes it "
            "(the last one calls it). Fix: forward_backward(x, criterion=loss_fn, labels=(y,))"
        )
    if not isinstance(labels, (tuple, list)) or not all(isinstance(y, torch.Tensor) for y in labels):
        raise TypeError(f"{fn}: labels must be a tuple of tensors split like x, got {type(labels).__name__}. "
                        "Fix: labels=(y,)")


def _check_device(model: nn.Module, plan, mesh) -> None:
    """On a mesh of several ranks, every parameter and buffer must be on ``mesh.device`` (its
    values, activations and gradients reach collectives: NCCL takes CUDA tensors only); a model
    built on meta for ``shard()`` to materialize may be on meta. Refused before the tensor-parallel
    check at ``shard()``, the first thing that communicates."""
    if mesh.size() == 1:
        return
    tensors = [(f"parameter '{n}'", p) for n, p in model.named_parameters()]
    tensors += [(f"buffer '{n}'", b) for n, b in model.named_buffers()]
    check_on_device(tensors, mesh, f"{type(model).__name__} (sharded on {mesh.shape})", allow_meta=True)


@register_lowering(Plan)
def _lower_module(plan: Plan, model: nn.Module) -> ShardedModule:
    _check_device(model, plan, plan.mesh)
    check_same_plan(plan, plan.mesh)  # the first communication: ranks that planned differently stop here
    check_same_values(model, plan, plan.mesh)
    report = verify_tensor_parallel(model, plan, plan.mesh)  # refuses what it cannot prove exact, before anything moves
    smodel = ShardedModule(model, plan)
    smodel.verification = report
    return smodel


@register_lowering(PipelinePlan)
def _lower_pipeline(pplan: PipelinePlan, model: nn.Module) -> PipelineModule:
    """Cut ``model`` where the plan cut it, keep this rank's stage, shard it by its stage plan."""
    from .parallel.pipeline import partition

    _check_device(model, pplan.whole, pplan.mesh)
    check_same_plan(pplan, pplan.mesh)
    check_same_values(model, pplan, pplan.mesh)
    report = verify_tensor_parallel(model, pplan.whole, pplan.mesh)  # the whole model: every rank checks the same units
    rank = pplan.mesh.index(pplan.pp_axis)
    stage = partition(model, rank, pplan.p, pplan.v, list(pplan.split_points), pplan.placement)
    assert [tuple(c) for c in stage.chunk_layers] == [pplan.stage_layers[s] for s in pplan.rank_stages(rank)], \
        "stage differs from its plan"
    smodel = PipelineModule(stage, pplan, model)  # the model: its own init fills a meta stage's buffers
    smodel.verification = report
    return smodel


def shard(model: nn.Module, mesh: Any, specs: Any = None, **options: Any) -> ShardedModule:
    """Shard ``model`` over ``mesh``: ``plan(model, mesh, specs, **options).apply(model)``.

    The returned module owns ``model``, as ``FSDP(model)`` does: ``model`` is changed in place
    and becomes ``smodel.module`` (on a pipeline mesh, this rank's layers of it form the stage),
    so use ``smodel`` from then on, and shard a model once. In ``model`` afterwards, buffers are
    the live tensors ``smodel`` uses; parameters under ZeRO stages 0-2 are views of the ZeRO
    chunks with the current values (the compute copies under ``param_dtype``); a layer tensor
    parallelism replaced holds this rank's slice (a replaced root, and a pipeline's layers on
    other pp ranks, are left as they were, unused). Under ZeRO-3 a parameter keeps its metadata
    (shape, dtype, device, ``requires_grad``, ``grad``: counting parameters works) but outside
    the forward and backward of ``smodel`` only this rank's shard of it exists: any other use
    (reading or printing it, ``detach()``, ``model.state_dict()``, ``copy_``, ``torch.save``)
    raises :class:`~shardlib.errors.ShardedAwayError` naming it. Read full values with
    :func:`full_state_dict` (on every rank); set them with ``smodel.load_state_dict``.

    Args:
        model: the module; modified in place and owned by the module returned (its parameters
            move into flat ZeRO chunks).
        mesh: a :class:`~shardlib.Mesh` from :func:`~shardlib.init_mesh`.
        specs: glob pattern -> PartitionSpec rules, see :func:`~shardlib.plan`.
        **options: ``zero_stage``, ``data_axes``, ``chunk_size``, ... and, on a mesh with a
            ``pp`` axis, ``schedule``, ``microbatches``, ``virtual_stages``, ``split_points``;
            see :func:`~shardlib.plan`.

    Returns:
        A :class:`ShardedModule` with the call signature of ``model``; on a pipeline mesh a
        :class:`PipelineModule` (this rank's stage, run by ``forward_backward``).

    Raises:
        ShardingError: ``model`` is a module ``shard()`` returned, was given to ``shard()``
            before, or contains such a module (build a fresh model, or use the sharded one);
            every check of :func:`~shardlib.plan`. On every rank, before any communication.
            Then, in the first collective (:func:`~shardlib.plan_agree.check_same_plan`): ranks
            that planned differently (another model, specs or options), naming what differs.

    Example:
        >>> import shardlib
        >>> mesh = shardlib.init_mesh({"dp": 1})
        >>> smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh, zero_stage=3)
        >>> smodel(torch.ones(3, 4)).shape
        torch.Size([3, 2])
    """
    refuse_lowered(model)  # before planning: a sharded model's parameter names and tensors are not the model's
    return plan(model, mesh, specs, **options).apply(model)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor leaf cast to ``dtype``."""
    import optree

    return optree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# the full-state views of a sharded module live in shardlib/full_state.py (re-exported here)
from .full_state import full_grads, full_state_dict, load_full_state_dict, model_state_bytes  # noqa: E402
