"""Pipeline parallelism: stages from the ``pp`` axis, run by a schedule of actions.

A model exposes its forward as ordered layers (``model.pipeline_layers()``, or the children of
an ``nn.Sequential``); :func:`partition` cuts them into ``p * v`` contiguous stages balanced by
parameter count (haiscale's ``partition``); stage ``s`` lives on rank ``s % p`` of the ``pp``
axis (Megatron's interleaving). A :class:`Stage` keeps every module at its original path, so
parameter names, specs and state dicts are those of the unpartitioned model, and tensor and
ZeRO parallelism apply to a stage as to any module.

``forward_backward`` splits the local batch into microbatches and executes the schedule's
actions (:mod:`shardlib.parallel.schedules`): activations and their gradients move by
point-to-point sends with tags (stage, microbatch, direction). The loss of each microbatch is
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
import torch.distributed as dist
from torch import nn

from ..errors import ShardingError
from ..mesh.collectives import raw_all_reduce
from ..mesh.guard import post, wait_works
from ..random import MicrobatchDropout
from .schedules import build_schedule

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
    if isinstance(model, nn.Sequential):
        return [(name, {name: child}, (lambda n: lambda get, x: get(n)(x))(name)) for name, child in model.named_children()]
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
              split_points: list[str] | None = None) -> Stage:
    """This rank's stage(s) of ``model``: chunks ``rank, rank + p, ...`` of ``p * v`` stages.

    Args:
        model: a model with ``pipeline_layers()`` or an ``nn.Sequential``.
        rank, world_size: this rank's index on the pipeline axis, and its size ``p``.
        num_model_chunks: ``v``, stages per rank (interleaved schedules).
        split_points: names of the layers that start stages 1, 2, ... (``p * v - 1`` names);
            default: balanced by parameter count (the first and last stage include the
            embedding and the head).

    Raises:
        ShardingError: fewer layers than stages, or bad split points.
    """
    layers = pipeline_layers(model)
    n_stages = world_size * num_model_chunks
    if len(layers) < n_stages:
        raise ShardingError(
            f"{type(model).__name__} has {len(layers)} pipeline layers, fewer than the {n_stages} stages of "
            f"pp={world_size} x {num_model_chunks} chunks. Fix: a smaller pp axis, or fewer virtual stages"
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
    chunks = [layers[bounds[s] : bounds[s + 1]] for s in range(rank, n_stages, world_size)]
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

    Args:
        smodel: the sharded :class:`Stage` of this rank (a ShardedModule).
        mesh, axis: the mesh and its pipeline axis.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        microbatches: microbatches per step ``m``.
        virtual_stages: ``v``.
    """

    def __init__(self, smodel, mesh, axis: str, schedule: str, microbatches: int, virtual_stages: int, tied: list):
        self.smodel, self.mesh, self.axis = smodel, mesh, axis
        self.p, self.rank = mesh.size(axis), mesh.index(axis)
        self.m, self.v = microbatches, virtual_stages
        self.actions = build_schedule(schedule, self.p, microbatches, virtual_stages)[self.rank]
        self.n_stages = self.p * self.v
        self.ranks = mesh.axis_ranks(axis)
        self.group = mesh.group(axis)
        # torch's fake group (a dry run in one process): sends complete at once and count their
        # bytes, receives return zeros of the planned shape (their header never arrives)
        self.fake = getattr(mesh, "fake", False)
        self.tied = tied  # [(name, param or None, numel, dtype)] in a fixed order on every rank
        self.timeline: list[tuple[str, float, float]] = []
        self.runs = 0  # schedules run (forward_backward and evaluate), the same count on every stage
        self.training = True

    # -- point to point ----------------------------------------------------------------------
    def _tag(self, stage: int, mb: int, grad: bool) -> int:
        # the schedule's number (mod 256) and kind are in the tag: a stage that runs a schedule the
        # others do not (evaluate on one stage only) waits, diagnosed, instead of taking another
        # schedule's activations as its own
        run = (self.runs % 256) * 2 + int(self.training)  # an evaluate never pairs with a training step
        return ((run * self.n_stages * self.m + stage * self.m + mb) * 2 + int(grad)) * 2

    def _send(self, t: torch.Tensor, stage: int, mb: int, grad: bool, pending: list) -> None:
        dst = self.ranks[(stage + (-1 if grad else 1)) % self.p]
        t = t.detach().contiguous()
        header = torch.zeros(8, dtype=torch.int64, device=self.mesh.device)
        header[0] = t.dim()
        header[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64, device=header.device)
        header[7] = _DTYPES.index(t.dtype)
        tag = self._tag(stage, mb, grad)
        self.mesh.comm.record(self.axis, "send", t.numel() * t.element_size(), 2)
        rec = self._trace("send", t, stage, mb, grad, dst)
        pending.append((post(self.mesh, dist.isend, header, dst, group=self.group, tag=tag), rec))
        pending.append((post(self.mesh, dist.isend, t, dst, group=self.group, tag=tag + 1), rec))

    def _trace(self, kind: str, t: torch.Tensor, stage: int, mb: int, grad: bool, peer: int) -> dict:
        what = "gradient" if grad else "activation"
        trace = self.mesh.trace
        return trace.record(kind, trace.label(self.mesh, (self.axis,), 0), t.shape, t.dtype,
                            f"{what} of stage {stage} microbatch {mb} of {'a training step' if self.training else 'evaluate'} "
                            f"{'to' if kind == 'send' else 'from'} rank {peer}")

    def _recv(self, stage: int, mb: int, grad: bool, like: tuple) -> torch.Tensor:
        """The activation (or gradient) stage ``stage`` receives for microbatch ``mb``; ``like``:
        ``(shape, dtype, device)`` the sender sends, used on a fake group only, where nothing
        arrives (the device is the step's: ``meta`` in a dry run, :mod:`shardlib.dryrun`)."""
        if self.fake:
            shape, dtype, device = like
            return torch.zeros(shape, dtype=dtype, device=device)
        src = self.ranks[(stage + (1 if grad else -1)) % self.p]
        sender_stage = stage + (1 if grad else -1)
        tag = self._tag(sender_stage, mb, grad)
        header = torch.empty(8, dtype=torch.int64, device=self.mesh.device)
        rec = self._trace("recv", header, sender_stage, mb, grad, src)
        wait_works(self.mesh, [post(self.mesh, dist.irecv, header, src, group=self.group, tag=tag)], rec, True)
        ndim = int(header[0])
        buf = torch.empty(tuple(header[1 : 1 + ndim].tolist()), dtype=_DTYPES[int(header[7])], device=self.mesh.device)
        wait_works(self.mesh, [post(self.mesh, dist.irecv, buf, src, group=self.group, tag=tag + 1)], rec, True)
        return buf

    # -- one step ------------------------------------------------------------------------------
    def run(self, x: torch.Tensor, criterion: Callable | None, labels: tuple, return_outputs: bool, backward: bool = True):
        m = self.m
        if x.shape[0] % m or any(y.shape[0] != x.shape[0] for y in labels):
            raise ShardingError(
                f"forward_backward: the local batch of {x.shape[0]} rows (labels {[tuple(y.shape) for y in labels]}) "
                f"does not split into {m} equal microbatches. Fix: a local batch divisible by {m}"
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
        self.runs += 1
        self.training = backward
        last = self.n_stages - 1
        if criterion is None and any(a.stage == last for a in self.actions):
            raise ShardingError("forward_backward: the last stage needs criterion=, a function (output, *labels) -> loss")
        xs = x.chunk(m)
        ys = [y.chunk(m) for y in labels]
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], Any] = {}
        losses: list = [None] * m
        outs: list = [None] * m
        pending: list = []
        drops = MicrobatchDropout(self.smodel.module, m)  # masks by global sample, counters per step
        self.timeline = []
        # times are absolute perf_counter (CLOCK_MONOTONIC) values: comparable across the processes
        # of one machine, so timelines of all ranks share one axis
        actions = self.actions if backward else [a for a in self.actions if a.kind == "F"]
        for a in actions:
            chunk = a.stage // self.p
            if a.kind == "F":
                if a.stage == 0:
                    inp = xs[a.microbatch]
                else:
                    planned = ((pplan.boundary_shape(*xs[a.microbatch].shape[:2]), pplan.boundary_dtype, x.device)
                               if self.fake else None)
                    inp = self._recv(a.stage, a.microbatch, False, planned).requires_grad_(backward)
                start = time.perf_counter()  # compute only: waiting for the input is idle time
                with self.smodel.no_sync(), drops.forward(a.microbatch):
                    out = self.smodel(chunk, inp)
                if a.stage == last:
                    loss = criterion(out, *[y[a.microbatch] for y in ys])
                    losses[a.microbatch] = loss.detach()
                    if return_outputs:
                        outs[a.microbatch] = out.detach()
                    out = loss / m  # what the backward starts from
                end = time.perf_counter()
                if a.stage != last:
                    self._send(out, a.stage, a.microbatch, False, pending)
                if backward:
                    outputs[(a.stage, a.microbatch)] = out
                    inputs[(a.stage, a.microbatch)] = inp
            else:
                out = outputs.pop((a.stage, a.microbatch))
                inp = inputs.pop((a.stage, a.microbatch))
                grad = None if a.stage == last else self._recv(a.stage, a.microbatch, True, (out.shape, out.dtype, out.device))
                start = time.perf_counter()
                with self.smodel.no_sync():
                    torch.autograd.backward(out, grad)
                end = time.perf_counter()
                if a.stage > 0:
                    self._send(inp.grad, a.stage, a.microbatch, True, pending)
            self.timeline.append((str(a), start, end))
        for work, rec in pending:
            wait_works(self.mesh, [work], rec, True)
        if backward:
            self._sum_tied_grads()
            self.smodel._zero.sync_grads()
        if self.rank == self.p - 1:
            return losses, (outs if return_outputs else None)
        return None, None

    def _sum_tied_grads(self) -> None:
        zero = self.smodel._zero
        for name, prm, numel, dtype in self.tied:  # every pp rank, in one order; zeros where absent
            grad = zero.local_grad_view(prm) if prm is not None else torch.zeros(numel, dtype=dtype, device=self.mesh.device)
            raw_all_reduce(grad, self.mesh, self.axis)  # in place: a view into the chunk's gradients


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]


def measured_bubble(timelines: list[list[tuple[str, float, float]]]) -> list[float]:
    """Idle fraction per rank: 1 - busy time / (last end - first start over all ranks)."""
    start = min(t[1] for tl in timelines for t in tl)
    end = max(t[2] for tl in timelines for t in tl)
    return [1 - sum(e - s for _, s, e in tl) / (end - start) for tl in timelines]


def timeline_svg(timelines: list[list[tuple[str, float, float]]], width: int = 900) -> str:
    """An SVG picture of per-rank timelines ``[(action, start s, end s)]``: one row per rank,
    forwards blue, backwards orange, labelled like ``1F0``."""
    start = min(t[1] for tl in timelines for t in tl)
    end = max(t[2] for tl in timelines for t in tl)
    scale = (width - 80) / max(end - start, 1e-9)
    row = 28
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(timelines) + 30}" '
             'font-family="monospace" font-size="10">']
    for r, tl in enumerate(timelines):
        y = 10 + r * row
        parts.append(f'<text x="4" y="{y + 16}">rank {r}</text>')
        for name, s, e in tl:
            x, w = 70 + (s - start) * scale, max((e - s) * scale, 1)
            color = "#4e79a7" if "F" in name else "#f28e2b"
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{color}" stroke="white">'
                         f'<title>{name}: {(e - s) * 1e3:.2f} ms</title></rect>')
            if w > 18:
                parts.append(f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white">{name}</text>')
    parts.append(f'<text x="70" y="{row * len(timelines) + 24}">{(end - start) * 1e3:.1f} ms; bubble per rank '
                 + ", ".join(f"{b:.2f}" for b in measured_bubble(timelines)) + "</text></svg>")
    return "\n".join(parts)
