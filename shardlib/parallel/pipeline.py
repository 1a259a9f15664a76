"""Pipeline parallelism: stages from the ``pp`` axis, run by a schedule of actions.

A model exposes its forward as ordered layers (``model.pipeline_layers()``, or the children of
an ``nn.Sequential``); :func:`partition` cuts them into ``p * v`` contiguous stages balanced by
parameter count (haiscale's ``partition``); stage ``s`` lives on rank ``s % p`` of the ``pp``
axis (Megatron's interleaving). A :class:`Stage` keeps every module at its original path, so
parameter names, specs and state dicts are those of the unpartitioned model, and tensor and
ZeRO parallelism apply to a stage as to any module.

``forward_backward`` splits the local batch into microbatches and executes the schedule's
actions (:mod:`shardlib.parallel.schedules`): activations and their gradients move by
point-to-point transfers planned from the schedule (:mod:`shardlib.parallel.p2p`: batches of
sends and receives in rounds, one ``batch_isend_irecv`` each on NCCL, each pair's messages in
the sender's order, shapes exchanged
once per input shape) and executed by :mod:`shardlib.parallel.p2p_run`. The loss of each microbatch is
divided by the number of microbatches, so the accumulated gradients are those of the mean loss
over the whole local batch, as without a pipeline. Gradients are reduced over the data axes once
per step, after the last backward; parameters shared by stages on different ranks (a tied
embedding and LM head) have their gradients summed over ``pp`` first, so the copies stay equal.

Under sequence parallelism (arXiv 2205.05198) the first stage splits the sequence at the model's
entry and every transfer carries a microbatch's sequence shard ``(batch / m, seq / tp, hidden)``
between ranks of the same tensor coordinate (:mod:`shardlib.pipeline_plan` plans and checks it).

Dropout stays mesh-independent (:mod:`shardlib.random`): each microbatch forward draws its rows
of the global batch's mask, with the counter of the step's whole-batch forward
(:class:`~shardlib.random.MicrobatchDropout`), so any ``p``, ``m``, ``v`` and schedule draws the
masks of one process, and the counters advance once per step, as there.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..errors import ShardingError
from ..mesh.collectives import raw_all_reduce
from ..random import MicrobatchDropout
from .actions import rank_stages, stage_owners
from .p2p import ACTIVATION, GRADIENT, Message, Post, Read, Wait, receives_ahead, transfer_program
from .p2p_run import Transfers
from .schedules import build_schedule, placement
from .split_backward import backward_input

__all__ = ["Stage", "pipeline_layers", "partition", "PipelineRunner", "timeline_svg", "measured_bubble"]


def pipeline_layers(model: nn.Module) -> list:
    """``[(name, {path: module}, fn(get, x))]`` for ``model``: its own ``pipeline_layers()``, the
    children of an ``nn.Sequential``, or for a Hugging Face decoder-only causal LM (a ``config``
    with a ``model_type``) :func:`shardlib.models.hf.hf_pipeline_layers`.

    Raises:
        ShardingError: the model offers none of these (for a Hugging Face model: a model type or
            structure the Hugging Face layers do not cover, naming what is missing).
    """
    if hasattr(model, "pipeline_layers"):
        return model.pipeline_layers()
    if isinstance(model, nn.Sequential):  # every position, a module used twice too (named_children() lists it once)
        return [(name, {name: child}, (lambda n: lambda get, x: get(n)(x))(name)) for name, child in model._modules.items()]
    from ..models.hf import hf_pipeline_layers, is_hf_model

    if is_hf_model(model):
        return hf_pipeline_layers(model)
    raise ShardingError(
        f"pipeline parallelism needs the forward pass as ordered layers: {type(model).__name__} is not an nn.Sequential "
        "and has no pipeline_layers() method. Fix: give the model a pipeline_layers() method (see "
        "shardlib.models.GPT.pipeline_layers), or drop the pp axis"
    )


class Stage(nn.Module):
    """A contiguous run of layers, with every module registered at its original dotted path.

    ``forward(chunk, x)`` runs model chunk ``chunk`` (one of the ``v`` stages this rank holds).
    """

    def __init__(self, chunks: list[list]):
        super().__init__()
        self._chunks = [[(name, fn) for name, _, fn in layers] for layers in chunks]
        self.chunk_layers = [[name for name, _, _ in layers] for layers in chunks]  # layer names of each chunk
        # module paths, each once (a module several layers use, like a rotary embedding, is registered once)
        self.chunk_paths = [list(dict.fromkeys(path for _, mods, _ in layers for path in mods)) for layers in chunks]
        self.chunk_bytes = []  # parameter bytes of each chunk, a shared tensor counted once
        for layers in chunks:
            unique = {id(p): p for _, mods, _ in layers for m in mods.values() for p in m.parameters()}
            self.chunk_bytes.append(sum(p.numel() * p.element_size() for p in unique.values()))
        for layers in chunks:
            for _, modules, _ in layers:
                for path, module in modules.items():
                    self._put(path, module)

    def _put(self, path: str, module: nn.Module) -> None:
        *parents, leaf = path.split(".")
        node: nn.Module = self
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, nn.ModuleDict())
            node = getattr(node, part)
        node.add_module(leaf, module)

    def get(self, path: str) -> nn.Module:
        return self.get_submodule(path)

    def forward(self, chunk: int, x: Any) -> Any:
        for _, fn in self._chunks[chunk]:
            x = fn(self.get, x)
        return x


def partition(model: nn.Module, rank: int, world_size: int, num_model_chunks: int = 1,
              split_points: list[str] | None = None, stage_placement: str = "loop") -> Stage:
    """This rank's stage(s) of ``model``: of ``p * v`` stages, chunks ``rank, rank + p, ...``
    (``"loop"``) or ``rank, 2p - 1 - rank, ...`` (``"v"``; :func:`~.actions.rank_stages`).

    Args:
        model: a model with ``pipeline_layers()`` or an ``nn.Sequential``.
        rank, world_size: this rank's index on the pipeline axis, and its size ``p``.
        num_model_chunks: ``v``, stages per rank (interleaved and V schedules).
        split_points: names of the layers that start stages 1, 2, ... (``p * v - 1`` names);
            default: balanced by parameter count (the first and last stage include the
            embedding and the head).
        stage_placement: ``"loop"`` or ``"v"`` (the schedule's, :func:`~.schedules.placement`).

    Raises:
        ShardingError: fewer layers than stages, or bad split points.
    """
    layers = pipeline_layers(model)
    n_stages = world_size * num_model_chunks
    if len(layers) < n_stages:
        raise ShardingError(
            f"{type(model).__name__} has {len(layers)} pipeline layers, fewer than the {n_stages} stages of "
            f"pp={world_size} x {num_model_chunks} chunks. Fix: a smaller pp axis, fewer virtual stages, or "
            "schedule='1f1b' (one stage per rank)"
        )
    if split_points is not None:
        names = [name for name, _, _ in layers]
        if len(split_points) != n_stages - 1 or any(s not in names for s in split_points):
            raise ShardingError(f"split_points must name {n_stages - 1} of the layers {names}, got {split_points}")
        starts = [0] + [names.index(s) for s in split_points]
        if starts != sorted(set(starts)):
            raise ShardingError(f"split_points {split_points} are not in layer order")
    else:
        sizes = [sum(p.numel() for m in mods.values() for p in m.parameters()) for _, mods, _ in layers]
        starts = _balanced_starts(sizes, n_stages)
    bounds = starts + [len(layers)]
    chunks = [layers[bounds[s] : bounds[s + 1]] for s in rank_stages(rank, world_size, num_model_chunks, stage_placement)]
    return Stage(chunks)


def _balanced_starts(sizes: list[int], n: int) -> list[int]:
    """Start indices of ``n`` contiguous non-empty groups with near-equal sums (greedy on the
    cumulative sum)."""
    total = sum(sizes) or 1
    cum = np.cumsum([0] + sizes)
    starts = [0]
    for k in range(1, n):
        target = total * k / n
        i = int(np.argmin(np.abs(cum[1:-1] - target))) + 1 if len(sizes) > 1 else 1
        i = max(i, starts[-1] + 1)
        i = min(i, len(sizes) - (n - k))
        starts.append(i)
    return starts


class PipelineRunner:
    """Executes a schedule on this rank: microbatches, point-to-point transfers, timeline.

    The transfers of a step follow this rank's :func:`~shardlib.parallel.p2p.transfer_program`
    (rounds of sends and receives, receives posted as soon as their message exists, each
    waited for just before its use; the order on every pair of ranks the sender's, by
    construction; on gloo a steady step posts each receive ahead of its sender's send on the
    schedule's clock instead, :func:`~shardlib.parallel.p2p.receives_ahead`, since a gloo pair
    sends only to a posted receive). Shapes are exchanged once per input signature (the local batch's shape and
    dtype, training or evaluation, autocast): the first step of a signature sends a header before
    the first activation over each boundary, every later one only the tensors, into buffers
    sized from the cache. So every rank must pass a local batch of the same shape (checked across
    the pipeline ranks in check mode, ``SHARDLIB_CHECK_COLLECTIVES=1``).

    Tags: with :attr:`Mesh.native <shardlib.mesh.Mesh.native>` (NCCL, which ignores tags) every
    message has tag 0 and pairs by order alone; on gloo's default path a message's tag is its
    schedule's number (mod 256) and kind, so a stage that runs a schedule the others do not
    (an evaluate on one stage only) waits, diagnosed by the watchdog, instead of taking another
    schedule's tensors as its own.

    Args:
        smodel: the sharded :class:`Stage` of this rank (a ShardedModule).
        mesh, axis: the mesh and its pipeline axis.
        schedule: a name of :data:`~shardlib.parallel.schedules.SCHEDULES`.
        microbatches: microbatches per step ``m``.
        virtual_stages: ``v``.
        tied: ``[(name, param or None, numel, dtype)]`` of parameters tied across stages.

    Split backwards (the zero-bubble schedules' ``I`` and ``W``) run through
    :mod:`~shardlib.parallel.split_backward`: ``I`` computes the gradient to the stage input and
    sends it upstream, leaving what its ``W`` needs; ``W`` accumulates the parameter gradients,
    which ZeRO reduces once per step, after the step's last ``W``. Two stages of one rank (the
    bottom of a V) hand their activation and gradient over in memory.
    """

    def __init__(self, smodel, mesh, axis: str, schedule: str, microbatches: int, virtual_stages: int, tied: list):
        self.smodel, self.mesh, self.axis = smodel, mesh, axis
        self.p, self.rank = mesh.size(axis), mesh.index(axis)
        self.m, self.v = microbatches, virtual_stages
        self.schedule = build_schedule(schedule, self.p, microbatches, virtual_stages)  # every rank's actions
        self.actions = self.schedule[self.rank]
        self.n_stages = self.p * self.v
        self.owners = stage_owners(self.schedule)  # stage -> pp rank
        # stage -> the index of its chunk in this rank's Stage (partition()'s order)
        self.chunk_of = {s: c for c, s in enumerate(rank_stages(self.rank, self.p, self.v, placement(schedule)))}
        self.last_rank = self.owners[self.n_stages - 1]  # the rank that computes the losses
        self.ranks = mesh.axis_ranks(axis)
        self.group = mesh.group(axis)
        # torch's fake group (a dry run in one process): sends complete at once and count their
        # bytes, receives return zeros of the planned shape (nothing arrives, headers neither)
        self.fake = getattr(mesh, "fake", False)
        self.tied = tied  # [(name, param or None, numel, dtype)] in a fixed order on every rank
        self.timeline: list[tuple[str, float, float]] = []
        self.runs = 0  # schedules run (forward_backward and evaluate), the same count on every stage
        self.training = True
        self._programs: dict = {}  # (training, handshake) -> (this rank's actions, its program)
        self.shapes: dict = {}  # input signature -> {("in" | "out", stage): (shape, dtype)} of this rank's transfers
        self.transfers = Transfers(mesh, axis, self.fake, self.owners)
        # stage 0: the tied gradients already summed over the pipeline, taken at the first backward
        # after a sum (_tied_snapshot); None: not taken since the last sum (_sum_tied_grads)
        self._tied_summed: dict | None = None

    def program(self, training: bool, handshake: bool) -> tuple:
        """``(actions, instructions)`` this rank executes for a step (built once per kind)."""
        key = (training, handshake)
        if key not in self._programs:
            sched = self.schedule if training else [[a for a in acts if a.kind == "F"] for acts in self.schedule]
            if not handshake and not self.mesh.native and not self.fake:  # gloo: receives ahead of their sends
                prog = receives_ahead(sched, self.rank)
            else:
                prog = transfer_program(sched, self.rank, handshake)
            self._programs[key] = (sched[self.rank], prog)
        return self._programs[key]

    # -- one step ------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, criterion: Callable | None, labels: tuple, return_outputs: bool, backward: bool = True):
        """One step (``forward_backward``, or ``evaluate`` with ``backward`` False): the losses
        on the last stage's rank, else ``(None, None)``."""
        try:
            return self._run(x, criterion, labels, return_outputs, backward)
        except BaseException:
            self._tied_summed = None  # a step that raised: its gradients are abandoned
            raise

    def _run(self, x: torch.Tensor, criterion: Callable | None, labels: tuple, return_outputs: bool, backward: bool):
        m = self.m
        if any(y.shape[0] != x.shape[0] for y in labels):
            raise ShardingError(
                f"forward_backward: the labels have {[y.shape[0] for y in labels]} rows (shapes "
                f"{[tuple(y.shape) for y in labels]}), the local batch x {x.shape[0]} (shape {tuple(x.shape)}): each "
                f"microbatch takes the same rows of x and of every label. Fix: give x and the labels the same rows "
                f"(shardlib.distribute each of them with smodel.batch_spec)"
            )
        if x.shape[0] % m or not x.shape[0]:
            raise ShardingError(
                f"{'forward_backward' if backward else 'evaluate'}: the local batch of {x.shape[0]} rows (shape "
                f"{tuple(x.shape)}) does not split into {m} equal microbatches of at least one row. Fix: a local batch "
                f"of a positive multiple of {m} rows"
            )
        plan = self.smodel.plan
        if plan.sequence_parallel:  # every rank, before any transfer (the split itself is on the first stage)
            axis = plan.tp_layers[0].axis
            n = self.mesh.size(axis)
            if x.dim() < 2 or x.shape[1] % n:
                raise ShardingError(
                    f"forward_backward: sequence_parallel splits the sequence (dim 1 of the local batch, shape "
                    f"{tuple(x.shape)}) over {axis!r} (size {n}), and every stage passes on its shard, but the length "
                    f"does not divide by {n} (mesh {self.mesh.shape}). Fix: use a sequence length divisible by {n}"
                )
        pplan = self.smodel.pipeline_plan
        if self.fake and (pplan.activation_width is None or x.dim() < 2):  # every rank, before any transfer
            missing = (f"the width of {pplan.model_name} is unknown (no config.hidden_size, n_embd or d_model)"
                       if pplan.activation_width is None else f"the local batch {tuple(x.shape)} has no sequence dimension")
            raise ShardingError(
                "forward_backward on torch's fake process group: a fake receive fills no buffer, so each stage receives "
                f"zeros of the planned boundary shape (rows per microbatch, sequence, width), but {missing}. Fix: dry-run "
                "a model with such a config and a (batch, seq) input, or use a real process group"
            )
        last = self.n_stages - 1
        if criterion is None and any(a.stage == last for a in self.actions):
            raise ShardingError("forward_backward: the last stage needs criterion=, a function (output, *labels) -> loss")
        dev = x.device.type
        cast = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)  # meta (a dry run) has none
        sig = (tuple(x.shape), x.dtype, backward, cast, torch.get_autocast_dtype(dev) if cast else None)
        shapes = self.shapes.get(sig)
        handshake = shapes is None and not self.fake
        if self.mesh.trace.compare and not self.fake:
            self.transfers.check_signature(sig, handshake)
        if shapes is None:
            shapes = {}
            if self.fake:  # nothing arrives on a fake group: the planned boundary shape
                planned = (pplan.boundary_shape(x.shape[0] // m, x.shape[1]), pplan.boundary_dtype)
                shapes.update((("in", s), planned) for s in self.chunk_of if s > 0)
        self.runs += 1
        self.training = backward
        tag = 0 if self.mesh.native else (self.runs % 256) * 2 + int(backward)  # see the class doc
        actions, program = self.program(backward, handshake)
        xs = x.chunk(m)
        ys = [y.chunk(m) for y in labels]
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], Any] = {}
        losses, outs = [None] * m, [None] * m  # per microbatch (the last stage's rank fills them)
        transfers = self.transfers
        transfers.begin(tag, backward)
        inbox = transfers.inbox  # receive buffers by message (valid once waited for)
        # the model's MeshDropout modules (shard() put them in); none drawing: a microbatch's masks change nothing
        drawing = any(d.p and d.training for d in self.smodel._dropouts)
        # masks by global sample, counters per step
        drops = MicrobatchDropout(self.smodel.module, m) if drawing else None
        timeline = self.timeline = []
        weights: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its W's WeightPass, between I and W
        zero = self.smodel._zero
        reduce = zero.sync  # False inside an enclosing no_sync(): accumulate, reduce at a later step
        if backward and self._tied_summed is None:  # the first backward since the last tied sum
            self._tied_summed = self._tied_snapshot()
        # times are absolute perf_counter (CLOCK_MONOTONIC) values: comparable across the processes
        # of one machine, so timelines of all ranks share one axis
        with self.smodel.no_sync():
            for ins in program:
                kind = type(ins)
                if kind is Post:
                    transfers.post(ins, shapes)
                    continue
                if kind is Wait:
                    if ins.message is None:  # the end of the step: every work not waited for yet, at once
                        transfers.finish()
                    else:
                        transfers.wait(ins.batch, ins.message)
                    continue
                if kind is Read:  # a handshake: the shape of the activations over a boundary
                    shapes[("in", ins.message.dst_stage)] = transfers.read(ins.batch, ins.message)
                    continue
                a = actions[ins.index]
                mb = a.microbatch
                zero.use_model_chunk(self.chunk_of[a.stage])  # ZeRO-3 gathers that model chunk's chunks only
                if a.kind == "F":
                    if a.stage == 0:
                        inp = xs[mb]
                    else:  # a float activation takes a gradient; token ids or a mask cannot
                        inp = inbox.pop(Message(ACTIVATION, a.stage - 1, mb))
                        inp.requires_grad_(backward and (inp.is_floating_point() or inp.is_complex()))
                    start = time.perf_counter()  # compute only: waiting for the input is idle time
                    # the stage sees a non-leaf alias of the received leaf, as a layer's output is in one
                    # process: an in-place op first (ReLU(inplace=True)) raised on a leaf needing a gradient
                    run_inp = _Received.apply(inp) if inp.requires_grad else inp
                    if drawing:
                        with drops.forward(mb):
                            out = self.smodel(self.chunk_of[a.stage], run_inp)
                    else:
                        out = self.smodel(self.chunk_of[a.stage], run_inp)
                    del run_inp
                    if a.stage != last:
                        _refuse_non_tensor(a.stage, out)
                    if a.stage == last:
                        loss = criterion(out, *[y[mb] for y in ys])
                        losses[mb] = loss.detach()
                        if return_outputs:  # a tuple, dict or ModelOutput too (torch's pytree, as pipelining's)
                            outs[mb] = tree_map_only(torch.Tensor, torch.Tensor.detach, out)
                        out = loss / m  # what the backward starts from
                    elif self.owners[a.stage + 1] == self.rank:  # the next stage is this rank's: handed over
                        inbox[Message(ACTIVATION, a.stage, mb)] = out.detach()
                    else:
                        _queue_output(transfers.outbox, shapes, Message(ACTIVATION, a.stage, mb), out)
                    end = time.perf_counter()
                    if backward:
                        outputs[(a.stage, mb)] = out
                        inputs[(a.stage, mb)] = inp
                elif a.kind == "W":  # the parameter gradients its I left
                    start = time.perf_counter()
                    weights.pop((a.stage, mb)).run(zero)
                    end = time.perf_counter()
                else:  # "B" (full) or "I" (to the input only)
                    out = outputs.pop((a.stage, mb))
                    inp = inputs.pop((a.stage, mb))
                    grad = None if a.stage == last else inbox.pop(Message(GRADIENT, a.stage + 1, mb))
                    start = time.perf_counter()
                    if a.kind == "B":
                        if out.requires_grad:  # (an output that needs none: nothing upstream gets a gradient)
                            torch.autograd.backward(out, grad)
                        dinp = inp.grad
                    else:
                        dinp, weights[(a.stage, mb)] = backward_input(out, grad, inp)
                    del out, grad
                    end = time.perf_counter()
                    if a.stage > 0:
                        dinp = dinp if dinp is not None else torch.zeros_like(inp)  # an input it did not use
                        msg = Message(GRADIENT, a.stage, mb)
                        if self.owners[a.stage - 1] == self.rank:
                            inbox[msg] = dinp
                        else:
                            transfers.outbox[msg] = dinp.contiguous()
                timeline.append((str(a), start, end))
        if handshake:
            self.shapes[sig] = shapes
        if backward and reduce:  # inside an enclosing no_sync(): the step's gradients wait, unreduced
            self._sum_tied_grads()
            zero.sync_grads()
        if self.rank == self.last_rank:
            return losses, (outs if return_outputs else None)
        return None, None

    def _tied_snapshot(self) -> dict:
        """``{name: (buffer, value)}`` of each tied gradient this rank holds that is not logically
        zero, at ZeRO stage 0: there the unreduced buffer keeps its values across steps (they are
        the parameters' ``.grad``), so a backward without ``zero_grad`` adds to a gradient already
        summed over the pipeline. Taken before that backward, as the value then is (after any
        clipping, scaling or zeroing since). Empty at stages 1-3 (a reduction restarts the
        buffer; stage 1 keeps the reduced shard aside) and in the usual step after ``zero_grad``."""
        zero = self.smodel._zero
        if zero.stage != 0:
            return {}
        out = {}
        for name, prm, _, _ in self.tied:
            if prm is None:
                continue
            chunk = zero.param_chunk[id(prm)]
            own = prm.grad is None or prm.grad is zero._grad_views.get(id(prm))  # (else one assigned by hand)
            if chunk.grad_full is None or (chunk.stale and id(prm) not in chunk.written and own):
                continue  # logically zero
            out[name] = (chunk.grad_full, zero.local_grad_view(prm).clone())
        return out

    def _sum_tied_grads(self) -> None:
        """Sum each tied parameter's gradient over the pipeline ranks (the stages that hold a
        copy; zeros from the others), in place. What was summed already (:meth:`_tied_snapshot`)
        is taken out first and put back after: summed again, it counted once per copy (a second
        forward_backward without zero_grad gave a tied embedding 2 g0 + g1 at stage 0)."""
        zero = self.smodel._zero
        summed, self._tied_summed = self._tied_summed or {}, None
        for name, prm, numel, dtype in self.tied:  # every pp rank, in one order; zeros where absent
            grad = zero.local_grad_view(prm) if prm is not None else torch.zeros(numel, dtype=dtype, device=self.mesh.device)
            buffer, before = summed.get(name, (None, None))
            if prm is None or zero.param_chunk[id(prm)].grad_full is not buffer:
                before = None  # released since (zero_grad): none of it is in the buffer now
            if before is not None:
                grad.sub_(before)
            raw_all_reduce(grad, self.mesh, self.axis)  # in place: a view into the chunk's gradients
            if before is not None:
                grad.add_(before)


def _refuse_non_tensor(stage: int, out: Any) -> None:
    """Raise when stage ``stage`` (not the last) returned something other than one tensor.

    Raises:
        ShardingError: naming the stage and the type (a tuple raised AttributeError on .detach)."""
    if not isinstance(out, torch.Tensor):
        raise ShardingError(
            f"pipeline step: stage {stage} returned a {type(out).__name__}, but a transfer between stages carries one "
            "tensor (as torch.distributed.pipelining's stages pass on positional tensors). Fix: return one tensor from "
            "the layer ending this stage (concatenate a mask or recompute it in the next stage), or cut the stages "
            "where one tensor flows")


class _Received(torch.autograd.Function):
    """Identity from a received stage input (a leaf) to the tensor the stage computes on: a
    non-leaf alias of the same storage (no copy), so an in-place op first in the stage works as
    on a layer's output in one process; the gradient passes to the leaf unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _queue_output(outbox: dict, shapes: dict, msg: Message, out: torch.Tensor) -> None:
    """Queue ``out`` (stage ``msg.stage``'s output) to be sent; its shape is the one every
    microbatch of this input signature has (recorded from the first: the size of the receiver's
    buffers and of this stage's gradient receives).

    Raises:
        ShardingError: an output whose shape or dtype differs from the first microbatch's."""
    t = out.detach().contiguous()
    key, got = ("out", msg.stage), (tuple(t.shape), t.dtype)
    have = shapes.setdefault(key, got)
    if have != got:
        raise ShardingError(
            f"pipeline step: stage {msg.stage}'s output for microbatch {msg.microbatch} has shape {got[0]} "
            f"({str(got[1]).replace('torch.', '')}), but this input signature's first microbatch gave {have[0]} "
            f"({str(have[1]).replace('torch.', '')}). Transfers between stages are sized once per input shape, so a "
            "stage's output shape may depend on the shape of its input but not on the data. Fix: make the layer at "
            "the end of this stage return a fixed shape (pad it), or cut the stages elsewhere")
    outbox[msg] = t


# the timeline helpers live in shardlib/parallel/timeline.py (re-exported here)
from .timeline import measured_bubble, timeline_svg  # noqa: E402
