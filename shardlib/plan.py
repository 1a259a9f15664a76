"""The planner: specs + mesh + options -> a :class:`Plan`, checked before anything moves.

``plan()`` is pure and deterministic: the same model, mesh and options give the same plan on
every rank, and every user error is raised here, on every rank, before the first collective.

Lowering order (fixed, as torchtitan's ``parallelize``): validate specs against the mesh and
the tensors; choose each parameter's strategy; pack the parameters managed along the data axes
into ZeRO chunks (registration order, whole transformer blocks where they fit, one open chunk per
(dtype, trainable, pipeline model chunk) group of at most ``chunk_size`` elements, searched when not
given, padded to a multiple of the data-axis size; ColossalAI Gemini's design, :mod:`shardlib.chunking`);
then cost the result (model-state bytes per rank, communicated bytes per step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import ShardingError
from .lazy import meta_init_rules, missing_rule_error
from .lowering import lower, refuse_lowered
from .options import DEFAULT_CHUNK_SIZE, check_fused_patterns, check_model_and_mesh, check_options
from .pipeline_plan import PipelinePlan, check_no_pipeline_options, pipeline_axis, plan_pipeline
from .chunking import ChunkSearch, param_units, search_chunk_size
from .plan_bytes import PlanBytes
from .plan_items import ChunkPlan, ParamPlan, pack_chunks, plan_entries
from .parallel.recompute import find_blocks, resolve_activation_checkpointing, warn_selective_offload
from .parallel.tensor_rules import (TPLayer, analyze_tensor_parallel, sequence_parallel_layout, split_region_params,
                                    tensor_split, with_sum_globs)
from .spec import PartitionSpec, resolve_specs

__all__ = ["Plan", "ParamPlan", "ChunkPlan", "plan", "plan_module", "DEFAULT_CHUNK_SIZE"]


@dataclass(frozen=True)
class Plan(PlanBytes):
    """A checked sharding plan: one :class:`ParamPlan` per parameter, chunks, costs.

    ``str(plan)`` / ``plan.explain()`` print the totals, then the per-parameter table; the cost
    figures are per rank: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (model states
    that persist between steps) and ``comm_per_step()`` (logical ring bytes by axis and kind,
    see :mod:`shardlib.mesh.comm`).

    ``mesh`` is kept for :meth:`apply` and is not part of equality; a pickled plan keeps only
    the abstract mesh.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    zero_stage: int
    data_axes: tuple[str, ...]
    chunk_size: int  # the size given, or the one searched (chunk_search says why)
    optimizer_states: int
    broadcast_buffers: bool
    params: tuple[ParamPlan, ...]
    tp_layers: tuple[TPLayer, ...] = ()
    sequence_parallel: bool = False
    sp_entry: str | None = ""  # None: no entry in this module (a pipeline stage after the first: input arrives split)
    sp_exit: str = ""
    sp_grad_params: tuple[str, ...] = ()
    dropout_seed: int = 0
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    init_rules: tuple[tuple[str, tuple], ...] = ()  # meta-device init: (canonical name, rule); see shardlib.lazy
    init_seed: int = 0
    offload_ratio: float | None = None  # fraction of saved activations moved to host; None: no hooks
    optimizer_offload: bool = False  # optimizer state and update on the host (ZeRO-Offload)
    offload_param_frac: float = 0.0  # ZeRO-3: this fraction of the shard bytes lives on the host (offloaded_chunks)
    activation_checkpointing: tuple[tuple[str, str], ...] = ()  # (module path, "full" | "selective"): recomputed
    chunk_search: ChunkSearch | None = None  # None: chunk_size was given
    activation_shape: Any = None  # shardlib.memory_estimate.ActivationShape, or None: activations not modelled
    verify: bool = True  # shard() proves the tensor-parallel lowering exact first (parallel/tensor_verify.py)
    verify_input: Any = field(compare=False, repr=False, default=None)
    pipeline: Any = None  # a pipeline stage: this rank's schedule, for the cost model (pipeline_gathers.StageSchedule)
    mesh: Any = field(compare=False, repr=False, default=None)

    # -- layout on this rank -----------------------------------------------------------------
    def coords(self) -> dict[str, int]:
        """This rank's mesh coordinates (rank 0's for a plan without a mesh)."""
        return self.mesh.coords() if self.mesh is not None else {a: 0 for a, _ in self.mesh_shape}

    @functools.cached_property
    def chunks(self) -> tuple["ChunkPlan", ...]:
        """ZeRO chunks of this rank's (tensor-parallel local) parameters.

        Registration order (a pipeline rank's model chunks one after the other); one open chunk per
        (dtype, trainable, split over a tensor axis, pipeline model chunk) of at most ``chunk_size``
        elements holding whole units (transformer blocks, else modules) where they fit, a larger unit
        split at parameters and a larger parameter alone; a tied parameter alone; padded to a multiple
        of the data-axis size (:func:`shardlib.chunking.pack`). Ranks that differ only in data
        coordinates get identical chunks.
        """
        return pack_chunks(self)

    @functools.cached_property
    def placement(self) -> dict[str, tuple[int, int]]:
        """``{canonical name: (chunk index, element offset)}`` on this rank."""
        return {name: (c.index, off) for c in self.chunks for name, off in zip(c.params, c.offsets)}

    def local_shape(self, p: "ParamPlan") -> tuple[int, ...]:
        """``p``'s tensor-parallel local shape on this rank."""
        return p.local_shape(dict(self.mesh_shape), self.coords())

    def __reduce__(self):
        state = {f: getattr(self, f) for f in self.__dataclass_fields__}  # not the cached layout
        if state["mesh"] is not None:
            state["mesh"] = state["mesh"].abstract()
        return (_rebuild_plan, (state,))

    # -- sizes -------------------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        n = 1
        for a in self.data_axes:
            n *= dict(self.mesh_shape)[a]
        return n

    @property
    def effective_stage(self) -> int:
        """The stage that runs: with one data rank every stage is plain replication (stage 0),
        except ZeRO-3 with parameter offload (``offload_param_frac``), whose shard is the whole
        chunk, kept in host memory and copied in before each use (ZeRO-Infinity on one GPU)."""
        if self.data_size > 1 or (self.zero_stage == 3 and self.offload_param_frac > 0):
            return self.zero_stage
        return 0

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def local_numel(self, p: ParamPlan, data_index: int | None = None) -> int:
        """Elements of ``p`` stored persistently on the rank at ``data_index`` (default: ours)."""
        numel = int(np.prod(self.local_shape(p), dtype=np.int64))
        if not (self.effective_stage == 3):
            return numel
        idx = self._data_index() if data_index is None else data_index
        c, off = self.placement[p.name]
        chunk = self.chunks[c]
        lo, hi = idx * chunk.shard_numel, (idx + 1) * chunk.shard_numel
        return max(0, min(hi, off + numel) - max(lo, off))

    def _data_index(self) -> int:
        if self.mesh is None or not self.data_axes:
            return 0
        return self.mesh.group_index(self.data_axes)  # the shard ZeRO gives this rank (its group rank)

    def comm_per_step(self, micro_steps: int = 1, clip: bool = False, tokens: int | None = None) -> dict[tuple[str, str], tuple[int, float]]:
        """Predicted ``{(axis, kind): (calls, bytes per rank)}`` for one training step; see
        :func:`shardlib.cost.comm_per_step` for the model."""
        from .cost import comm_per_step

        return comm_per_step(self, micro_steps, clip, tokens)

    # -- printing ----------------------------------------------------------------------------
    def explain(self, tokens: int | None = None, full: bool = False, activation_checkpointing: Any = None,
                micro_steps: int = 1) -> str:
        """The plan as text: the summary first (memory per rank, communication per step by axis
        and kind, bytes per strategy, the largest tensors, one line per repeated block), then a
        row per parameter, then the tensor-parallel layers (see :func:`shardlib.explain.explain`).

        Args:
            tokens: tokens per micro-batch per rank; when given, activation collectives of
                tensor/sequence parallelism are included in the per-step totals, and the peak
                per rank is predicted (:meth:`peak_estimate`).
            full: every parameter's row even in a long table (more than 60 rows folds each
                repeated block into one row per pattern by default).
            activation_checkpointing: the recompute the predicted peak assumes (``"full"``,
                ``"selective"``, ``False``: none; None: this plan's own option).
            micro_steps: forward/backward passes per step (gradient accumulation): ZeRO-3's
                gathers and tensor-parallel activations count once per pass, reductions once.
        """
        from .explain import explain

        return explain(self, tokens, full, activation_checkpointing, micro_steps=micro_steps)

    def peak_estimate(self, tokens: int, activation_checkpointing: Any = None, in_flight: float = 1,
                      accumulating: bool = False):
        """The predicted peak bytes per rank of one training step, by term: a
        :class:`~shardlib.memory_estimate.PeakEstimate` (``.total``), or None for a model whose
        activations are not modelled. ``tokens``: per microbatch per rank; ``in_flight``:
        microbatches held at once; ``accumulating``: gradients accumulate unreduced over several
        backwards (a pipeline's microbatches). See :func:`shardlib.memory_estimate.estimate_peak`.

        Raises:
            ValueError: ``tokens`` not a positive int.
        """
        from .memory_estimate import estimate_peak

        return estimate_peak(self, tokens, activation_checkpointing, in_flight, accumulating)

    def __str__(self) -> str:
        return self.explain()

    def apply(self, model: torch.nn.Module):
        """Shard ``model`` as planned (``shard(model, mesh, specs, **options)`` is this): a
        :class:`~shardlib.ShardedModule`, through the lowering :mod:`shardlib.shard` registers."""
        if self.mesh is None or not hasattr(self.mesh, "group"):
            raise ShardingError(
                "this plan was made on an AbstractMesh (or unpickled) and cannot move tensors; "
                "make it with a Mesh from init_mesh() to apply it"
            )
        return lower(self, model)


def _rebuild_plan(state):
    return Plan(**state)


def plan(model: torch.nn.Module, mesh: Any, specs: Any = None, **options: Any) -> Plan | PipelinePlan:
    """Check ``specs`` against ``mesh`` and ``model`` and decide every parameter's layout.

    Moves nothing and communicates nothing; deterministic, so every rank gets the same plan. On
    a mesh with a pipeline axis (``pp``) of size > 1 the result is a
    :class:`~shardlib.pipeline_plan.PipelinePlan`: the stages, each with its own plan (as below,
    over the other axes), and the schedule; otherwise a :class:`Plan`.

    Args:
        model: the module to shard (on CPU or CUDA, or wholly on the meta device with init rules).
        mesh: a :class:`~shardlib.Mesh` or :class:`~shardlib.AbstractMesh`.
        specs: glob pattern -> PartitionSpec rules (see :func:`shardlib.spec.resolve_specs`);
            a spec along a data axis means ZeRO-3 storage for that parameter.
        zero_stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)
            over the data axes (ZeRO, arXiv 1910.02054). Default 0, or 3 when a spec names a
            data axis.
        data_axes: the mesh axes the batch is split along; default: those named ``dp``/``fsdp``.
        chunk_size: elements per ZeRO chunk; a chunk holds whole transformer blocks (else
            modules) where they fit, and a larger parameter gets its own. Default None: the
            block-aligned size with the least padding plus largest gathered working set
            (:func:`shardlib.chunking.search_chunk_size`; ``explain()`` says why).
        optimizer_states: optimizer tensors per parameter element, for the memory figure
            (AdamW 2, SGD with momentum 1); default 2.
        broadcast_buffers: re-broadcast buffers from the data-axis root before every forward
            (DDP's default); default False (buffers are synchronized once, at shard time).
        logical_axis_rules: a table from logical axis names used in ``specs`` to mesh axes.
        fused: ``{module glob: blocks}`` for column layers joining projections, each split on its
            own: equal blocks (GPT-2: ``{"*.c_attn": 3}``) or sizes (Phi-3: ``(H*hd, KV*hd, KV*hd)``).
        sequence_parallel: Megatron sequence parallelism on the tensor axis (arXiv 2205.05198).
        sp_entry: the module whose input is split along the sequence (default: ``drop``, else the first decoder block).
        sp_exit: a module whose output is gathered along the sequence (GPT-2's ``ln_f``, before
            Hugging Face reshapes by the full length); default: the output layer gathers.
        tp_sum_grads: globs of replicated parameters used on tensor-split activations, whose
            gradients are summed over the axis (the usual ones are found: tensor_rules).
        vocab_parallel_logits: the LM head keeps its logits split, local ``(..., V // tp)``, for
            ``vocab_parallel_cross_entropy`` (Megatron's ``parallel_output``); default False: gathered.
        verify: prove the tensor-parallel lowering exact on the model's own modules before
            lowering, else refuse (:mod:`shardlib.parallel.tensor_verify`); default True.
        verify_input: the positional arguments of a small forward for that check (the same on
            every rank); default: random token ids, or activations for a model without embedding.
        dropout_seed: seed of the mesh-independent dropout that replaces ``nn.Dropout``
            (:mod:`shardlib.random`); default 0.
        init_rules: for a model built on the meta device, ``{glob: rule}`` or ``(name, param) -> rule`` (rules
            ``("normal", std)``, ``("uniform", lo, hi)``, ``("zeros",)``, ...); the model's
            ``shardlib_init_rules()`` is used after it. Each rank materializes only its shards, equal to
            :func:`shardlib.lazy.init_parameters` on one device (see :mod:`shardlib.lazy`).
        init_seed: the seed of that initialization; default 0.
        offload_ratio: fraction in [0, 1] of saved activation bytes moved to host memory in forward and back in
            backward (haiscale's ``CPUOffload``; :mod:`shardlib.parallel.offload`); ``0.0`` moves nothing but
            measures (``smodel.activation_offload.stats``); default None: no saved-tensor hooks.
        optimizer_offload: optimizer state and update in host memory (ZeRO-Offload, arXiv 2101.06840);
            :class:`~shardlib.ZeroOptimizer` follows it; default False.
        offload_param_frac: ZeRO-3 only, a number in [0, 1]: the chunks holding this fraction of each rank's
            shard bytes (index order, :attr:`Plan.offloaded_chunks`) keep their shards, gradient shards and
            optimizer state in host memory (pinned with CUDA), are copied to the device before each gather (a side
            stream on CUDA) and updated on the CPU (ColossalAI Gemini's ``offload_param_frac``, ZeRO-Infinity's
            parameter offload, arXiv 2104.07857). On one data rank ZeRO-3 then keeps running as stage 3 (the shard
            is the whole chunk). Default 0.
        activation_checkpointing: modules whose forward backward runs again instead of keeping their activations
            (non-reentrant ``torch.utils.checkpoint``): ``"full"`` (every transformer block: a Hugging Face model's
            ``_no_split_modules``, else the largest ``nn.ModuleList`` of one module type), ``"selective"`` (every
            block, keeping its matmul outputs: Korthikanti et al. 2022), an int ``k`` (every k-th block), or
            ``fn(path, module) -> bool | "full" | "selective"``; composes with every ZeRO stage, tensor and sequence
            parallelism, pipelines, offload, mixed precision and mesh-independent dropout (the recompute draws
            the forward's masks); see :mod:`shardlib.parallel.recompute`. Default None: nothing recomputed.
        param_dtype: mixed precision (the semantics of FSDP2's ``MixedPrecisionPolicy``; Micikevicius et al., arXiv
            1710.03740): forward and backward run on copies of the floating parameters in this dtype
            (``torch.bfloat16`` or ``torch.float16``), while the master weights, gradients and optimizer state stay
            in the parameters' own dtype (fp32) on the ZeRO shards. Stage 3 casts its shard and all-gathers in
            ``param_dtype`` (half the bytes of fp32); stages 0-2 keep a full compute copy, refreshed from the
            masters after every optimizer step. The module's parameters (``p.data``) are the compute copies, and
            their ``p.grad`` stays None (gradients go straight into the fp32 flat buffers:
            :func:`shardlib.full_grads` reads them); floating-point tensors among the inputs of ``smodel(...)`` are
            cast to ``param_dtype`` (FSDP2's ``cast_forward_inputs``), outputs are left as computed; buffers are not
            cast (cast them yourself if the model needs it). ``None`` (default): no mixed precision.
        reduce_dtype: the dtype gradients are reduced in, over the data axes and, for parameters replicated over a
            tensor axis whose gradient is summed over it (norm weights under sequence parallelism), over that axis;
            they are then added into the master-dtype gradient shard. Default: the master dtype (fp32 reduction;
            unlike FSDP2, whose default is ``param_dtype``). Use :class:`~shardlib.GradScaler` with ``float16``.
        pp_axis: the pipeline axis (default ``pp``). With it of size > 1 in the mesh, the pipeline options are
            ``schedule`` (``"gpipe"``, GPipe arXiv 1811.06965; ``"1f1b"``, the default, PipeDream-flush;
            ``"interleaved_1f1b"``, both arXiv 2104.04473; the zero-bubble schedules with split backwards
            ``"zb_h1"`` and ``"zbv"``, arXiv 2401.10241, and ``"dualpipev"``, arXiv 2412.19437),
            ``microbatches`` (default the pipeline size), ``virtual_stages`` (model chunks per rank, default 1;
            2 for ``"interleaved_1f1b"`` and for the V schedules ``"zbv"`` and ``"dualpipev"``) and ``split_points``
            (the layers starting stages 1, 2, ...; default balanced by parameter count); see :mod:`~.pipeline_plan`.

    Returns:
        The :class:`Plan`, or a :class:`~shardlib.pipeline_plan.PipelinePlan` on a pipeline mesh.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``mesh`` not a Mesh / AbstractMesh.
        ShardingError: an unknown option, or one of the wrong type (see :func:`shardlib.options.check_options`); a
            zero_stage outside 0-3; an unknown or repeated data axis; a ``fused`` glob that matches no module; a
            spec naming an unknown axis or longer than its tensor; a spec along a data axis with zero_stage < 3; a
            tensor-parallel layout that cannot be lowered (see :mod:`shardlib.parallel.tensor_rules`); a mesh axis
            of size > 1 that nothing uses; a pattern matching no parameter; conflicting specs on a tied parameter; a
            parameter on the meta device with no init rule (or a model only partly on meta); an ``offload_ratio``
            or ``offload_param_frac`` outside [0, 1]; ``offload_param_frac`` > 0 below ZeRO-3 or without a data
            axis; an ``activation_checkpointing`` of another form, selecting nothing, or finding no
            transformer blocks; a ``param_dtype`` / ``reduce_dtype`` that is not a floating-point ``torch.dtype``; a
            pipeline option without a pipeline axis; the pipeline checks of
            :func:`~shardlib.pipeline_plan.plan_pipeline`; a model that is, or contains, a module
            :func:`~shardlib.shard` was given or returned (a module is sharded once).

    Example:
        >>> from shardlib.mesh import AbstractMesh
        >>> p = plan(torch.nn.Linear(4, 3), AbstractMesh({"dp": 2}), zero_stage=3)
        >>> p.param("weight").strategy, p.param_bytes
        ('zero-3', 32)
    """
    check_model_and_mesh(model, mesh)
    refuse_lowered(model, "plan")  # a sharded model's tensors are local shards: its plan would be wrong
    if pipeline_axis(mesh, options) is not None:
        for key in ("microbatches", "virtual_stages"):  # a bool is an int to the schedule's checks
            if isinstance(options.get(key), bool):
                raise ShardingError(f"{key} must be a positive int, got {options[key]!r}")
        return plan_pipeline(model, mesh, specs, options, plan_module)
    check_no_pipeline_options(mesh, options)
    return plan_module(model, mesh, specs, **options)


def plan_module(model: torch.nn.Module, mesh: Any, specs: Any = None, **options: Any) -> Plan:
    """The :class:`Plan` of one module (no pipeline): what :func:`plan` returns on a mesh without
    a pipeline axis, and what :func:`~shardlib.pipeline_plan.plan_pipeline` makes of the whole
    model and of each stage. Arguments, options and errors as :func:`plan` (less the pipeline
    options)."""
    mesh_shape = dict(mesh.shape)
    units, blocks = options.pop("_chunk_units", None) or (None, None)  # a pipeline stage: the whole model's (plan_pipeline)
    model_chunks = options.pop("_model_chunks", None) or {}  # a pipeline stage: its parameters' model chunks
    whole_model = options.pop("_whole_model", model)  # (a pipeline stage's: the model it was cut from)
    whole_sums = options.pop("_sum_grads", None)  # a pipeline stage: the whole model's partial-sum parameters
    opts = check_options(options, mesh_shape)
    data_axes, chunk_size, optimizer_states = opts.data_axes, opts.chunk_size, opts.optimizer_states

    resolved = resolve_specs(model, specs, options.get("logical_axis_rules"), strict=options.get("strict_specs", True))
    if options.get("strict_specs", True):  # a pipeline stage holds part of the model, checked whole before
        check_fused_patterns(model, options.get("fused"))
    pp_axis = opts.pp_axis
    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(prm), []).append(name)
        params[id(prm)] = prm
    init_rules = meta_init_rules(model, options.get("init_rules"), names_of, params)

    # Validate every spec against the mesh and its tensor.
    spec_names_data_axis = False
    used_axes: set[str] = set()
    for key, names in names_of.items():
        prm = params[key]
        spec, source = resolved[names[0]]
        if prm.device.type == "meta" and names[0] not in init_rules:
            raise missing_rule_error(names[0], tuple(prm.shape))
        if len(spec) > prm.dim():
            raise ShardingError(
                f"the spec {spec} ({source}) of parameter {names[0]} has {len(spec)} entries, but the parameter "
                f"has shape {tuple(prm.shape)} ({prm.dim()} dimension{'s' if prm.dim() != 1 else ''}). Fix: give at most {prm.dim()} entries"
            )
        for axis in spec.axes:
            if axis not in mesh_shape:
                raise ShardingError(
                    f"the spec {spec} ({source}) of parameter {names[0]} (shape {tuple(prm.shape)}) names axis "
                    f"{axis!r}, but the mesh is {mesh_shape}. Fix: use one of {list(mesh_shape)}, or add the axis to the mesh"
                )
            used_axes.add(axis)
            if axis in data_axes:
                spec_names_data_axis = True

    stage = options.get("zero_stage")
    if stage is None:
        stage = 3 if spec_names_data_axis else 0
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or stage not in (0, 1, 2, 3):
        raise ShardingError(f"zero_stage must be 0, 1, 2 or 3 (ZeRO stages), got {stage!r}")
    stage = int(stage)
    if opts.offload_param_frac > 0 and (stage != 3 or not data_axes):
        raise ShardingError(
            f"offload_param_frac={opts.offload_param_frac} needs ZeRO-3 over a data axis; here zero_stage={stage} over "
            f"data axes {data_axes or '()'} (mesh {mesh_shape}). Only stage 3 gathers each chunk before its use, so only "
            "it can keep a chunk's shard in host memory between uses (on one data rank the shard is the whole chunk). "
            "Fix: zero_stage=3 with a data axis (size 1 is fine: {'dp': 1}), or offload_param_frac=0 "
            "(optimizer_offload=True moves the optimizer state to the host at any stage)")
    if spec_names_data_axis and stage != 3:
        offender = next(
            n[0] for k, n in names_of.items() if any(a in data_axes for a in resolved[n[0]][0].axes)
        )
        shape = tuple(dict(model.named_parameters(remove_duplicate=False))[offender].shape)
        raise ShardingError(
            f"the spec {resolved[offender][0]} of parameter {offender} (shape {shape}) shards it along a data axis "
            f"{data_axes} of the mesh {mesh_shape}, which means ZeRO-3 storage, but zero_stage={stage}. "
            "Fix: pass zero_stage=3, or drop the data axis from the spec"
        )

    for axis, size in mesh_shape.items():
        if size > 1 and axis not in data_axes and axis not in used_axes and axis != pp_axis:
            raise ShardingError(
                f"mesh axis {axis!r} (size {size}) of the mesh {mesh_shape} is used by nothing: it is not a data "
                f"axis ({data_axes or 'none'}) and no spec names it, so its {size} ranks would repeat the same work. "
                f"Fix: pass data_axes=({axis!r},) (or name it 'dp'), give it size 1, or shard parameters along it"
            )

    roles, tp_layers = analyze_tensor_parallel(model, resolved, mesh_shape, data_axes, options.get("fused"),
                                               options.get("vocab_parallel_logits", False))
    sequence_parallel = bool(options.get("sequence_parallel", False))
    if sequence_parallel and not any(layer.kind == "row" for layer in tp_layers):
        raise ShardingError(
            f"sequence_parallel=True needs tensor-parallel column/row layer pairs on a tensor axis, but the specs "
            f"split no row layer (mesh {mesh_shape}). Fix: add tensor-parallel specs (e.g. models.gpt.tp_specs()), "
            "or drop sequence_parallel"
        )
    sp_entry, sp_exit, sp_grad_params = (
        sequence_parallel_layout(model, tp_layers, options.get("sp_entry"), options.get("sp_exit"))
        if sequence_parallel else ("", "", None if whole_sums is not None else split_region_params(model, tp_layers))
    )
    if whole_sums is not None:  # a stage's containers are not the model's (split_region_params reads ModuleLists)
        held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        sp_grad_params = tuple(n for n in whole_sums if n in held)
    else:
        sp_grad_params = with_sum_globs(model, sp_grad_params, options.get("tp_sum_grads", ()), tp_layers)
    zero = "replicated" if stage == 0 else f"zero-{stage}"
    if units is None:
        blocks = find_blocks(model)
        units = param_units((names[0] for names in names_of.values()), blocks)

    param_plans = []
    for key, names in names_of.items():
        axis, dim, fused_blocks = tensor_split(tp_layers, names)
        role = next((roles[n] for n in names if n in roles), None)
        spec, source = resolved[names[0]]
        if axis is not None and axis not in spec.axes:  # a column layer's bias follows its weight
            spec = PartitionSpec(*[axis if d == dim else None for d in range(params[key].dim())])
            source = f"follows the weight of its column-parallel layer (given {resolved[names[0]][0]}, {source})"
        param_plans.append(ParamPlan(
            name=names[0],
            aliases=tuple(names[1:]),
            global_shape=tuple(params[key].shape),
            dtype=params[key].dtype,
            spec=spec,
            source=source,
            strategy=f"{role}+{zero}" if role and axis is not None else zero,
            requires_grad=params[key].requires_grad,
            tp_axis=axis,
            tp_dim=dim,
            tp_blocks=fused_blocks,
            unit=units.get(names[0], names[0].rpartition(".")[0]), model_chunks=model_chunks.get(names[0], (0,)),
        ))
    search = None
    if chunk_size is None:
        data_size = int(np.prod([mesh_shape[a] for a in data_axes], dtype=np.int64))
        search = search_chunk_size(plan_entries(param_plans, mesh_shape, {a: 0 for a in mesh_shape}), data_size,
                                   blocks)
        chunk_size = search.size
    from .memory_estimate import activation_shape

    compute = opts.param_dtype or next((p.dtype for p in param_plans), torch.float32)
    shape = activation_shape(whole_model, [n for pp in param_plans for n in (pp.name,) + pp.aliases], blocks,
                             compute.itemsize)
    recompute = resolve_activation_checkpointing(model, options.get("activation_checkpointing"))
    warn_selective_offload(recompute, opts.offload_ratio)
    return Plan(
        activation_shape=shape,
        mesh_shape=tuple(mesh_shape.items()),
        zero_stage=stage,
        data_axes=data_axes,
        chunk_size=chunk_size,
        chunk_search=search,
        optimizer_states=optimizer_states,
        broadcast_buffers=bool(options.get("broadcast_buffers", False)),
        params=tuple(param_plans),
        tp_layers=tuple(tp_layers),
        sequence_parallel=sequence_parallel,
        sp_entry=sp_entry,
        sp_exit=sp_exit,
        sp_grad_params=sp_grad_params,
        dropout_seed=int(options.get("dropout_seed", 0)),
        param_dtype=opts.param_dtype,
        reduce_dtype=opts.reduce_dtype,
        init_rules=tuple(init_rules.items()),
        init_seed=int(options.get("init_seed", 0)),
        offload_ratio=opts.offload_ratio,
        offload_param_frac=opts.offload_param_frac,
        optimizer_offload=bool(options.get("optimizer_offload", False)),
        activation_checkpointing=recompute,
        verify=bool(options.get("verify", True)),
        verify_input=options.get("verify_input"),
        mesh=mesh,
    )
