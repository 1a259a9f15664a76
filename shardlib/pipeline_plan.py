"""The plan of a pipeline: stages over the ``pp`` axis, each with its own sharding plan, and a schedule.

:func:`plan_pipeline` is what :func:`shardlib.plan` does on a mesh with a pipeline axis of size
> 1, and what :func:`shardlib.shard` applies, so the printed plan and the run cannot drift:

1. the schedule's sizes are checked (:func:`~shardlib.parallel.schedules.build_schedule`);
2. the whole model is planned (every check, and the layout each stage follows: a tied tensor
   keeps one layout on every stage, under either name);
3. the layers (``model.pipeline_layers()``) are cut into ``p * v`` stages
   (:func:`~shardlib.parallel.pipeline.partition`); stage ``s`` lives on pp rank ``s % p``, or
   on the V of the zero-bubble V schedules (rank ``r`` holding stages ``r`` and ``2p - 1 - r``:
   :func:`~shardlib.parallel.actions.rank_stages`);
4. each pp rank's :class:`~shardlib.parallel.pipeline.Stage` is planned like any module, with
   the whole model's specs, ZeRO over the data axes and tensor parallelism over the tensor axis.

Sequence parallelism (Korthikanti et al., arXiv 2205.05198) over stages follows Megatron: the
first stage splits the sequence at the whole model's entry (``drop``), every later stage
receives its sequence shard and passes one on, so a boundary transfer carries
``(batch / m, seq / tp, hidden)`` per microbatch (the sequence-parallel region simply spans the
cut: exact, and ``tp`` times fewer bytes than full-sequence transfers); the last stage's output
layer gathers the sequence. Norm weights and row-layer biases have their gradients summed over
the tensor axis on every stage. Layouts this cannot make exact are refused (see
:func:`plan_pipeline`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .errors import ShardingError
from .lowering import lower
from .mesh.mesh import AbstractMesh
from .models.hf import is_hf_model
from .parallel.actions import rank_stages, stage_rank
from .parallel.pipeline import Stage, partition
from .parallel.recompute import find_blocks, stage_choice
from .parallel.schedule_theory import schedule_bubble_fraction
from .parallel.schedules import Simulation, build_schedule, default_virtual_stages, placement, simulate, splits_backward
from .pipeline_gathers import stage_schedule
from .plan_items import model_chunks_of
from .stage_layout import check_stage_layout, sequence_parallel_per_rank
from .state_names import model_state_names

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["PipelinePlan", "plan_pipeline", "pipeline_axis", "check_no_pipeline_options", "PIPELINE_OPTIONS"]

PIPELINE_OPTIONS = ("schedule", "microbatches", "virtual_stages", "split_points")


def pipeline_axis(mesh: Any, options: dict) -> str | None:
    """The pipeline axis (option ``pp_axis``, default ``"pp"``) if ``mesh`` has it with size > 1."""
    axis = options.get("pp_axis", "pp")
    return axis if isinstance(axis, str) and dict(mesh.shape).get(axis, 1) > 1 else None


def check_no_pipeline_options(mesh: Any, options: dict) -> None:
    """Refuse pipeline options on a mesh without a pipeline axis of size > 1.

    Raises:
        ShardingError: ``schedule``, ``microbatches``, ``virtual_stages`` or ``split_points`` given.
    """
    axis = options.get("pp_axis", "pp")
    for key in PIPELINE_OPTIONS:
        if key in options:
            raise ShardingError(
                f"option {key}={options[key]!r} needs a pipeline axis {axis!r} of size > 1 in the mesh {dict(mesh.shape)}. "
                f"Fix: add the axis to the mesh (e.g. {{{axis!r}: 2, ...}}), or drop the option"
            )


@dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline plan: the stages, each stage's sharding :class:`~shardlib.Plan`, the schedule.

    ``str(pplan)`` / :meth:`explain` print the bubble, the stages (layers, pp rank), each pp
    rank's parameter, gradient and optimizer bytes, the bytes of one boundary transfer and the
    schedule as a step-by-rank grid, then each stage's plan. Frozen, picklable (the mesh
    becomes abstract) and equal on every rank.

    Attributes:
        pp_axis: the pipeline mesh axis.
        schedule: ``"gpipe"`` (arXiv 1811.06965), ``"1f1b"`` or ``"interleaved_1f1b"`` (arXiv
            2104.04473), ``"zb_h1"`` or ``"zbv"`` (arXiv 2401.10241), ``"dualpipev"`` (arXiv
            2412.19437); see :mod:`shardlib.parallel.schedules`.
        p: ranks along the pipeline axis. m: microbatches per step. v: model chunks per rank.
        stage_layers: for each of the ``p * v`` stages (stage ``s`` on pp rank
            :meth:`stage_rank` ``(s)``), the names of its layers, in ``pipeline_layers()`` order.
        stage_param_bytes: each stage's parameter bytes before sharding (a shared tensor once).
        stages: for each pp rank ``r``, the plan of its :class:`~shardlib.parallel.pipeline.Stage`
            (:meth:`rank_stages` ``(r)``): bytes per rank after ZeRO / tensor parallelism over the
            other axes, on the rank at pp index ``r`` with this mesh's other coordinates (this
            rank's own stage keeps the mesh; the others an :class:`~shardlib.AbstractMesh`).
        whole: the whole model's plan (the checks and the layout every stage follows; its bytes
            are those of all layers, about ``p`` times a stage's).
        tied: ``(names, first pp rank)`` of each trainable tensor held on several pp ranks (a
            tied embedding and LM head); its gradient is summed over ``pp`` every step.
        activation_width: the last dimension of the activations sent between stages (the
            model's ``config.n_embd``, ``hidden_size`` or ``d_model``); None when unknown.
        state_names: every stage's parameters (with tied aliases) and persistent buffers, as
            :class:`~shardlib.state_names.StateName` s: what a checkpoint of the whole model holds.
        model_name: the class name of the model planned (for messages).
        mesh: the mesh (not part of equality; kept for :meth:`apply`).

    Example:
        >>> import shardlib
        >>> from shardlib.models import GPT, GPTConfig
        >>> gpt = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=16))
        >>> pplan = shardlib.plan(gpt, shardlib.AbstractMesh({"pp": 2, "dp": 2}), schedule="1f1b", microbatches=4)
        >>> pplan.stage_layers[1], pplan.bubble, pplan.boundary_bytes(tokens=16)  # (B / m, T, C) fp32
        (('blocks.2', 'blocks.3', 'head'), 0.2, 1024)
    """

    pp_axis: str
    schedule: str
    p: int
    m: int
    v: int
    stage_layers: tuple[tuple[str, ...], ...]
    stage_param_bytes: tuple[int, ...]
    stages: tuple["Plan", ...]
    whole: "Plan"
    tied: tuple[tuple[tuple[str, ...], int], ...] = ()
    activation_width: int | None = None
    state_names: tuple = ()  # StateName of every stage's parameters and persistent buffers (checkpoint checks)
    model_name: str = ""  # the class name of the model planned (for messages)
    mesh: Any = field(compare=False, repr=False, default=None)

    @property
    def n_stages(self) -> int:
        """``p * v``."""
        return self.p * self.v

    @property
    def split_points(self) -> tuple[str, ...]:
        """The first layer of stages 1, 2, ...: the cut, as :func:`partition` takes it."""
        return tuple(layers[0] for layers in self.stage_layers[1:])

    @property
    def placement(self) -> str:
        """``"loop"`` (stage ``s`` on pp rank ``s % p``) or ``"v"`` (the V schedules)."""
        return placement(self.schedule)

    def stage_rank(self, stage: int) -> int:
        """The pp rank holding ``stage``."""
        return stage_rank(stage, self.p, self.placement)

    def rank_stages(self, rank: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in chunk order."""
        return rank_stages(rank, self.p, self.v, self.placement)

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into ``I`` and ``W`` (the zero-bubble ones)."""
        return splits_backward(build_schedule(self.schedule, self.p, self.m, self.v))

    @property
    def bubble(self) -> float:
        """The theoretical idle fraction of a step: ``(p - 1) / (v m + p - 1)`` for GPipe and
        (interleaved) 1F1B; for the zero-bubble schedules their papers' bubble at ``T_F = T_B =
        T_W`` over the step (:func:`~shardlib.parallel.schedule_theory.schedule_bubble_fraction`)."""
        return schedule_bubble_fraction(self.schedule, self.p, self.m, self.v)

    @functools.cached_property
    def simulation(self) -> Simulation:
        """The schedule run on a clock (forward and backward one unit each; a split backward's
        ``I`` and ``W`` one unit each)."""
        return simulate(build_schedule(self.schedule, self.p, self.m, self.v))

    # the data layout is the same on every stage (the whole model's options)
    @property
    def data_axes(self) -> tuple[str, ...]:
        return self.whole.data_axes

    @property
    def data_size(self) -> int:
        return self.whole.data_size

    @property
    def sequence_parallel(self) -> bool:
        return self.whole.sequence_parallel

    @property
    def boundary_dtype(self) -> torch.dtype:
        """The dtype of the activations sent between stages: the compute dtype (``param_dtype``),
        else the first floating parameter's."""
        whole = self.whole
        return whole.param_dtype or next((p.dtype for p in whole.params if p.dtype.is_floating_point), torch.float32)

    def boundary_shape(self, rows: int, seq: int) -> tuple[int, int, int] | None:
        """Shape of one transfer between stages: a microbatch's activation, or its gradient.

        Args:
            rows: rows of one microbatch on one rank (``local batch / m``).
            seq: its sequence length, before any sequence split.

        Returns:
            ``(rows, seq / tp, width)`` under sequence parallelism (the sequence shard),
            ``(rows, seq, width)`` otherwise; None if the width is unknown.
        """
        if self.activation_width is None:
            return None
        whole = self.whole
        parts = dict(whole.mesh_shape)[whole.tp_layers[0].axis] if whole.sequence_parallel else 1
        return (rows, -(-seq // parts), self.activation_width)

    def boundary_bytes(self, tokens: int) -> int | None:
        """Bytes of one transfer between stages: a microbatch's activation, or its gradient.

        Args:
            tokens: tokens in one microbatch on one rank, before any sequence split
                (``local batch / m * seq``).

        Returns:
            ``tokens / tp * width * element size`` under sequence parallelism (the sequence
            shard), ``tokens * width * element size`` otherwise; None if the width is unknown.
        """
        shape = self.boundary_shape(1, tokens)
        return None if shape is None else shape[1] * shape[2] * self.boundary_dtype.itemsize

    def transfers_per_step(self, rank: int) -> int:
        """Point-to-point sends pp rank ``rank`` makes per step: ``m`` activations from each of
        its stages but the last, ``m`` gradients from each but the first."""
        mine = self.rank_stages(rank)
        return self.m * (sum(s < self.n_stages - 1 and self.stage_rank(s + 1) != rank for s in mine)
                         + sum(s > 0 and self.stage_rank(s - 1) != rank for s in mine))

    def peak_estimate(self, tokens: int, rank: int, activation_checkpointing: Any = None):
        """The predicted peak bytes of pp rank ``rank`` (its stage plan's
        :meth:`~shardlib.plan.Plan.peak_estimate` with the schedule's peak stash of
        microbatches, over its ``v`` chunks), or None for a model whose activations are not
        modelled. ``tokens``: per microbatch per rank.

        Raises:
            ValueError: ``tokens`` not a positive int, or ``rank`` not in ``[0, p)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.p:
            raise ValueError(f"peak_estimate: rank must be a pp rank in [0, {self.p}), got {rank!r}")
        return self.stages[rank].peak_estimate(tokens, activation_checkpointing,
                                               in_flight=self.simulation.peak_stash[rank] / self.v, accumulating=self.m > 1)

    # -- printing ----------------------------------------------------------------------------
    def summary(self, tokens: int | None = None) -> str:
        """The pipeline in a few lines, totals first: schedule and bubble, one line per stage
        (repeated layers folded), the model state per pp rank, tied tensors, boundary transfers
        (see :func:`shardlib.explain_pipeline.pipeline_summary`).

        Args:
            tokens: tokens in one microbatch on one rank (``local batch / m * seq``), for the
                boundary bytes; without it they are reported as needing it.
        """
        from .explain_pipeline import pipeline_summary

        return pipeline_summary(self, tokens)

    def explain(self, tokens: int | None = None, full: bool = False) -> str:
        """:meth:`summary`, the schedule grid, then each pp rank's stage plan.

        A stage plan's communication figures are those of one forward and backward (one
        microbatch, ``tokens`` per rank); a step runs ``m`` of them per stage and reduces the
        gradients over the data axes once.

        Args:
            tokens: as :meth:`summary`.
            full: draw the grid however many steps it has and print every row of each stage
                plan (by default a grid of more than 40 steps is only sized, and long stage
                tables fold their repeated blocks).
        """
        from .explain_pipeline import pipeline_explain

        return pipeline_explain(self, tokens, full)

    def __str__(self) -> str:
        return self.explain()

    def apply(self, model: torch.nn.Module):
        """This rank's stage of ``model``, sharded as planned, with the schedule that runs it (a
        :class:`~shardlib.PipelineModule`); ``shard(model, mesh, specs, **options)`` is this.

        Raises:
            ShardingError: the plan was made on an :class:`~shardlib.AbstractMesh` (or unpickled).
        """
        if self.mesh is None or not hasattr(self.mesh, "group"):
            raise ShardingError(
                "this pipeline plan was made on an AbstractMesh (or unpickled) and cannot move tensors; "
                "make it with a Mesh from init_mesh() to apply it"
            )
        return lower(self, model)

    def __reduce__(self):
        state = {f: getattr(self, f) for f in self.__dataclass_fields__}  # not the cached simulation
        if state["mesh"] is not None:
            state["mesh"] = state["mesh"].abstract()
        return (_rebuild, (state,))


def _rebuild(state):
    return PipelinePlan(**state)


def plan_pipeline(model: torch.nn.Module, mesh: Any, specs: Any, options: dict, plan_module: Callable) -> PipelinePlan:
    """Plan ``model`` as a pipeline over ``options["pp_axis"]`` (default ``"pp"``) of ``mesh``.

    Args:
        model: a model with ``pipeline_layers()`` or an ``nn.Sequential``.
        mesh: a :class:`~shardlib.Mesh` or :class:`~shardlib.AbstractMesh` with the pipeline axis.
        specs: as :func:`shardlib.plan`.
        options: :func:`shardlib.plan`'s options, with ``schedule``, ``microbatches``,
            ``virtual_stages`` and ``split_points``.
        plan_module: the one-module planner (:func:`shardlib.plan.plan_module`), passed in so
            that this module sits below ``plan.py`` and imports nothing from it.

    Returns:
        The :class:`PipelinePlan`.

    Raises:
        ShardingError: every check of :func:`shardlib.plan` on the whole model and on each
            stage; schedule sizes the schedule does not support; fewer layers than stages or
            bad split points; under ``sequence_parallel``, a Hugging Face model (its pipeline
            layers build masks and positions from each layer's input), or a layout that would not be exact: the
            entry not on the first stage, an output layer or ``sp_exit`` not on the last, no
            output layer and no ``sp_exit`` (the output would stay split along the sequence), or
            a pp rank holding no tensor-parallel layer. All before any communication.
    """
    options = dict(options)
    axis = options.pop("pp_axis", "pp")
    p = mesh.size(axis)
    schedule = options.pop("schedule", "1f1b")
    m = options.pop("microbatches", p)
    v = options.pop("virtual_stages", None)
    split_points = options.pop("split_points", None)
    actions = build_schedule(schedule, p, m, v)  # checks the name and the sizes
    v = default_virtual_stages(schedule) if v is None else v
    where = placement(schedule)
    whole = plan_module(model, mesh, specs, pp_axis=axis, **options)  # every check on the whole model
    if splits_backward(actions):
        _refuse_selective_recompute(schedule, whole)
    if whole.sequence_parallel and not hasattr(model, "pipeline_layers") and is_hf_model(model):
        raise ShardingError(
            f"sequence_parallel=True on the pipeline mesh {dict(mesh.shape)}: {type(model).__name__}'s pipeline layers "
            "build masks and rotary positions from the length of each decoder layer's input, which inside the "
            "sequence-parallel region is a sequence shard, so they would not match the attention's whole sequence. "
            "Fix: drop sequence_parallel (tensor parallelism inside each stage works without it), or drop the pp axis"
        )
    modules = [partition(model, r, p, v, split_points, where) for r in range(p)]
    # stage -> (rank, chunk index on it)
    at = {s: (r, c) for r in range(p) for c, s in enumerate(rank_stages(r, p, v, where))}
    layers = tuple(tuple(modules[at[s][0]].chunk_layers[at[s][1]]) for s in range(p * v))
    sizes = tuple(modules[at[s][0]].chunk_bytes[at[s][1]] for s in range(p * v))
    sp_fields = sequence_parallel_per_rank(whole, modules, mesh, axis, at) if whole.sequence_parallel else None

    # the whole model's decision per parameter, under every name: a tied tensor keeps one layout
    # even on a stage that holds it under its other name (lm_head.weight for wte.weight)
    exact = {name: pp.spec for pp in whole.params for name in (pp.name,) + pp.aliases}
    for key in ("logical_axis_rules", "sp_entry", "sp_exit"):
        options.pop(key, None)
    options["sequence_parallel"] = False  # the whole model's layout, restricted to each stage below
    # the whole model's modules to recompute (a stage's ModuleLists are not the model's); a stage takes its own
    options["activation_checkpointing"] = stage_choice(whole.activation_checkpointing)
    options["_chunk_units"] = ({n: pp.unit for pp in whole.params for n in (pp.name,) + pp.aliases},  # the whole model's blocks
                               find_blocks(model))
    options["_whole_model"] = model  # (its config, for the activation estimate)
    # the whole model's partial-sum parameters (tp_sum_grads included; under sequence parallelism the region's):
    # found on the model's own modules, which a stage holds in other containers; a glob need not match every stage
    options["_sum_grads"] = whole.sp_grad_params
    options.pop("tp_sum_grads", None)
    if whole.init_rules:  # meta-built: each stage takes the whole model's rule under every name
        by_name = dict(whole.init_rules)  # a rule ending in a name draws from that name's stream
        rules = {alias: by_name[pp.name] + (() if isinstance(by_name[pp.name][-1], str) else (pp.name,))
                 for pp in whole.params for alias in (pp.name,) + pp.aliases}
        options["init_rules"] = lambda name, _, rules=rules: rules.get(name)
    stages = []
    for r, stage in enumerate(modules):
        # seen from the rank at pp index r with this rank's other coordinates (this mesh for our own stage)
        view = mesh if r == mesh.index(axis) else AbstractMesh(mesh.shape, rank=mesh.axis_ranks(axis)[r])
        names_of: dict[int, list[str]] = {}
        for name, prm in stage.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(prm), []).append(name)
        stage_plan = plan_module(stage, view, exact, pp_axis=axis, strict_specs=False, **options,
                                 _model_chunks=model_chunks_of(stage.chunk_paths, list(names_of.values())))
        check_stage_layout(whole, stage_plan, stage, r)
        stages.append(dataclasses.replace(stage_plan, **(sp_fields[r] if sp_fields else {}),
                                          pipeline=stage_schedule(schedule, p, m, v, r)))
    return PipelinePlan(pp_axis=axis, schedule=schedule, p=p, m=m, v=v, stage_layers=layers, stage_param_bytes=sizes,
                        stages=tuple(stages), whole=whole, tied=_tied(model, whole, modules),
                        activation_width=_activation_width(model), state_names=_state_names(whole, modules),
                        model_name=type(model).__name__, mesh=mesh)


def _refuse_selective_recompute(schedule: str, whole: "Plan") -> None:
    """Refuse selective recompute under a schedule that splits backwards: torch's selective
    checkpointing lets one backward through a region, and a split backward runs two (``I``, then
    ``W`` from the kept intermediates, :mod:`~shardlib.parallel.split_backward`)."""
    chosen = [path for path, mode in whole.activation_checkpointing if mode == "selective"]
    if chosen:
        raise ShardingError(
            f"activation_checkpointing='selective' ({len(chosen)} modules, e.g. {chosen[0]!r}) with schedule={schedule!r}: "
            "the schedule splits each backward into the input gradient (I) and the weight gradients (W), two backward "
            "passes through every block, and torch's selective checkpointing allows one. Fix: "
            "activation_checkpointing='full' (or every k-th block), or schedule='1f1b' / 'interleaved_1f1b'")


def _state_names(whole: "Plan", modules: list[Stage]) -> tuple:
    """The whole model's state as the stages hold it: what a checkpoint load checks against."""
    held = {name for st in modules for name, _ in st.named_parameters(remove_duplicate=False)}
    return model_state_names(whole.params, modules, held)


def _tied(model: torch.nn.Module, whole: "Plan", modules: list[Stage]) -> tuple:
    owners: dict[int, set[int]] = {}
    for r, stage in enumerate(modules):
        for prm in stage.parameters():
            owners.setdefault(id(prm), set()).add(r)
    tied = []
    for pp in whole.params:
        ranks = owners.get(id(model.get_parameter(pp.name)), set())
        if len(ranks) > 1 and pp.requires_grad:
            tied.append(((pp.name,) + pp.aliases, min(ranks)))
    return tuple(tied)


def _activation_width(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("n_embd", "hidden_size", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
