"""Pipeline parallelism: shardlib schedules against ``torch.distributed.pipelining``.

Pairs (pp = 2 gloo ranks, or ``--ranks 4``): shardlib ``schedule="gpipe"`` vs ``ScheduleGPipe``, ``"1f1b"`` vs
``Schedule1F1B``, ``"interleaved_1f1b"`` (2 chunks per rank) vs ``ScheduleInterleaved1F1B``; the
zero-bubble ones with split backwards, ``"zb_h1"`` vs ``ScheduleInterleavedZeroBubble`` (one chunk
per rank: ZB-H1), ``"zbv"`` vs ``ScheduleZBVZeroBubble`` and ``"dualpipev"`` vs
``ScheduleDualPipeV`` (two chunks per rank in a V; DualPipeV needs ``--microbatches`` >= 2 x ranks,
its case is skipped otherwise). Both
sides cut the same GPT into the same stages (shardlib's partition, balanced by parameter count;
PyTorch gets one ``PipelineStage`` per chunk holding exactly those modules) and split the batch
into the same microbatches; the embedding is not tied to the LM head here (torch.pipelining
has no cross-stage tying). Each microbatch's loss is divided by the microbatch count on both
sides (torch's ``scale_grads``).

Theory of bytes: each microbatch crosses every stage boundary once forward (activations) and
once backward (their gradients), ``b s h`` elements each (microbatch ``b``, sequence ``s``,
width ``h``); the rank holding a stage sends its boundary tensors, so per rank the bytes are
``4 b s h`` times the number of boundaries it sends over, times ``m``.
The activation figure is the bytes saved for backward over the whole step (all microbatches),
not the peak of a schedule (1F1B frees a microbatch's activations before the last forward).
MemTracker's peak is not measured here (under its dispatch mode shardlib's pipeline receive on
the second rank never completes; see ``Side.memtracker``).

    python -m benchmarks.pipeline --quick
    python -m benchmarks.pipeline --quick --ranks 4
    python -m benchmarks.pipeline --quick --control   # each pair followed by torch against itself
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from shardlib.errors import ShardingError
from shardlib.parallel.schedules import build_schedule

from .common import Settings, Side, add_common_args, batches, compare, make_gpt, run_benchmark, settings_from_args, \
    torch_state_bytes, zero_state_formula

CASES = ("gpipe_vs_ScheduleGPipe", "1f1b_vs_Schedule1F1B", "interleaved_vs_ScheduleInterleaved1F1B",
         "zb_h1_vs_ScheduleInterleavedZeroBubble", "zbv_vs_ScheduleZBVZeroBubble", "dualpipev_vs_ScheduleDualPipeV")
_SCHEDULES = {"gpipe": ("gpipe", 1, "ScheduleGPipe"), "1f1b": ("1f1b", 1, "Schedule1F1B"),
              "interleaved": ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
              "zb_h1": ("zb_h1", 1, "ScheduleInterleavedZeroBubble"), "zbv": ("zbv", 2, "ScheduleZBVZeroBubble"),
              "dualpipev": ("dualpipev", 2, "ScheduleDualPipeV")}


def _my_stages(schedule: str, p: int, v: int, rank: int) -> list[int]:
    """The stages pp rank ``rank`` holds under ``schedule``'s placement (loop or V), in chunk order."""
    from shardlib.parallel.actions import rank_stages
    from shardlib.parallel.schedules import placement

    return rank_stages(rank, p, v, placement(schedule))


def _criterion(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class _OneChunk(nn.Module):
    """One pipeline stage as a module ``forward(x)`` for ``torch.distributed.pipelining``."""

    def __init__(self, layers):
        super().__init__()
        from shardlib.parallel.pipeline import Stage

        self.stage = Stage([layers])

    def forward(self, x):
        return self.stage(0, x)


def stage_bounds(model, n_stages: int) -> list[int]:
    """Layer index where each stage starts, as shardlib's partition computes it (+ the end)."""
    from shardlib.parallel.pipeline import _balanced_starts, pipeline_layers

    layers = pipeline_layers(model)
    sizes = [sum(p.numel() for m in mods.values() for p in m.parameters()) for _, mods, _ in layers]
    return _balanced_starts(sizes, n_stages) + [len(layers)]


def _model(settings: Settings):
    return make_gpt(settings, tie_embeddings=False)


def shardlib_side(settings: Settings, mesh, schedule: str, v: int, m: int, data) -> Side:
    import shardlib

    smodel = shardlib.shard(_model(settings), mesh, schedule=schedule, microbatches=m, virtual_stages=v)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad()
        losses, _ = smodel.forward_backward(x, criterion=_criterion, labels=(y,))
        opt.step()
        return None if losses is None else torch.stack([l.detach() for l in losses]).mean()

    return Side(f"shardlib {schedule}", step, [smodel], [opt.optimizer], lambda: shardlib.model_state_bytes(smodel, opt), mesh,
                {"stage_layers": smodel.stage_layers, "plan_state": smodel.plan.model_state_bytes}, memtracker=False)


def torch_side(settings: Settings, cls_name: str, v: int, m: int, data, schedule: str = "1f1b") -> Side:
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from shardlib.parallel.pipeline import pipeline_layers

    p, r = dist.get_world_size(), dist.get_rank()
    model = _model(settings)
    layers = pipeline_layers(model)
    if len(layers) < p * v:  # torch would build empty stages (and abort in gloo on their transfers)
        raise ValueError(f"the model has {len(layers)} pipeline layers, fewer than the {p * v} stages of {p} ranks "
                         f"x {v} chunks")
    bounds = stage_bounds(model, p * v)
    stages, modules = [], []
    mine = _my_stages(schedule, p, v, r)
    for s in mine:
        mod = _OneChunk(layers[bounds[s]:bounds[s + 1]])
        modules.append(mod)
        stages.append(pipelining.PipelineStage(mod, s, p * v, torch.device("cpu")))
    cls = getattr(pipelining, cls_name)
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # takes a list of stages, even of one
    sched = cls(stages if multi else stages[0], m, loss_fn=_criterion)
    params = [q for mod in modules for q in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=settings.lr)
    holder = nn.ModuleList(modules)
    first, last = 0 in mine, p * v - 1 in mine

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad()
        losses: list = []
        if first and last:
            sched.step(x, target=y, losses=losses)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        return torch.stack([l.detach() for l in losses]).mean() if losses else None

    return Side(cls_name, step, [holder], [opt], lambda: torch_state_bytes(holder, opt), memtracker=False)


def theory(settings: Settings, p: int, v: int, m: int, rank: int, stage_params: int, plan_state: int | None = None,
           schedule: str = "1f1b") -> dict:
    from shardlib.parallel.actions import stage_rank
    from shardlib.parallel.schedules import placement

    n_stages = p * v
    mb_tokens = settings.batch * 2 // m * settings.seq
    h = settings.gpt_config().n_embd
    per = 4 * mb_tokens * h
    sends = [0] * p
    owner = [stage_rank(s, p, placement(schedule)) for s in range(n_stages)]  # a V's bottom boundary is on one rank
    for s in range(n_stages):
        if s < n_stages - 1 and owner[s + 1] != owner[s]:
            sends[owner[s]] += 1  # forward: activations to stage s + 1
        if s > 0 and owner[s - 1] != owner[s]:
            sends[owner[s]] += 1  # backward: gradients to stage s - 1
    return {"bytes_rank0": float(sends[0] * m * per), "bytes_per_rank": [float(k * m * per) for k in sends],
            "bytes_formula": f"b s h * 4 bytes per boundary per microbatch per direction; b s = {mb_tokens} tokens, "
                             f"h = {h}, m = {m}; boundaries sent per microbatch by rank: {sends}",
            "state_formula": zero_state_formula(0, stage_params, 1), "state_plan": plan_state, "params_stage": stage_params}


def worker(settings: Settings, cases=CASES, microbatches: int = 4, control: bool = False) -> list[dict]:
    import torch.distributed as dist

    import shardlib

    mesh = shardlib.init_mesh({"pp": dist.get_world_size()})  # every rank of the worker group
    p, rank = mesh.size("pp"), mesh.index("pp")
    data = batches(settings, settings.batch * 2, settings.warmup + settings.steps + 4)
    rows = []
    for case in cases:
        schedule, v, cls_name = _SCHEDULES[case.split("_vs_")[0]]
        try:  # a schedule that does not take these sizes (DualPipeV: a microbatch per stage) is skipped
            build_schedule(schedule, p, microbatches, v)
        except ShardingError:
            continue
        model = _model(settings)
        bounds = stage_bounds(model, p * v)
        from shardlib.parallel.pipeline import pipeline_layers

        layers = pipeline_layers(model)
        mine = {id(q): q for s in _my_stages(schedule, p, v, rank) for _, mods, _ in layers[bounds[s]:bounds[s + 1]]
                for mod in mods.values() for q in mod.parameters()}
        stage_params = sum(q.numel() for q in mine.values())
        th = theory(settings, p, v, microbatches, rank, stage_params, schedule=schedule)
        row = compare(case, lambda: shardlib_side(settings, mesh, schedule, v, microbatches, data),
                      lambda: torch_side(settings, cls_name, v, microbatches, data, schedule), settings, th)
        # state formula and plan are per rank: keep rank 0's in the theory, every rank's in the row
        per_rank = [None] * p
        dist.all_gather_object(per_rank, stage_params)
        row["theory"]["params_per_rank"] = per_rank
        if "a" in row and "plan_state" in row["a"]:
            row["theory"]["state_plan"] = row["a"]["plan_state"]
        rows.append(row)
        if control:  # A/A: the same torch schedule on both sides, timed the same way: the ratio's noise this run
            rows.append(compare(f"control_{cls_name}_vs_itself",
                                lambda: torch_side(settings, cls_name, v, microbatches, data, schedule),
                                lambda: torch_side(settings, cls_name, v, microbatches, data, schedule), settings, th))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (gloo processes): 2 or 4")
    p.add_argument("--control", action="store_true",
                   help="after each pair, time torch's schedule against itself (an A/A row: how far from 1.0 noise "
                        "alone puts the ratio in this run)")
    args = p.parse_args(argv)
    return run_benchmark("pipeline", worker, settings_from_args(args), args.out, nprocs=args.ranks,
                         cases=tuple(args.cases), microbatches=args.microbatches, control=args.control)


if __name__ == "__main__":
    main()
