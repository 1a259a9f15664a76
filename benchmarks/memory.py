"""Memory: shardlib's peak per rank against PyTorch's tools on the same model, batch and world size.

Each row builds both sides on every rank of one worker group (gloo, one thread each), runs one
unmeasured step (so AdamW's state exists, as in training), then one step whose peak is the model
state before it plus the highest running sum of the CPU allocations ``torch.profiler`` records
(:func:`_peak`; the largest over the ranks), the bytes autograd saved for backward
(:func:`benchmarks.common.saved_activation_bytes`), and the targets of issue 16:

==============================  ==============================================  ===============
row                             PyTorch side                                     target
==============================  ==============================================  ===============
zero3 vs FSDP2 (10.8M, 24x64)   ``fully_shard`` per block + root                 peak <= torch
zero0 vs DDP                    ``DistributedDataParallel``                      <= 1.05 x
one rank vs plain PyTorch       the model and AdamW, no wrapper                  <= 1.05 x
zero3 full recompute vs none    the same shardlib model without checkpointing    see below
predicted vs measured peak      (``Plan.peak_estimate`` against the measured)    0.9-1.1
==============================  ==============================================  ===============

The predicted rows (:data:`PREDICTED`: ZeRO 0-3, ZeRO-3 with full recompute, tp=2 + SP, pp=2
1F1B) put the prediction of :mod:`shardlib.memory_estimate` in the "shardlib peak" column and
the measured peak in the "torch peak" one, per rank (``rank 0 / rank 1``).

The recompute row compares shardlib against itself on purpose: what the option buys. Its
targets: the blocks' saved activations (the bytes saved while a transformer block runs its
forward; the embeddings, final norm, head and loss are outside the formula and reported
apart) fall by at least the factor of Korthikanti et al. 2022 for the model as run
(:func:`formula_factor`), the step time of full recompute over none (medians of alternated
steps) at most 1.4, and the ZeRO-3 all-gather bytes per step unchanged (counted by the mesh's
``CommCounter``).

    python -m benchmarks.memory            # 10.8M GPT and the 24-block narrow GPT, batch 4 x 128
    python -m benchmarks.memory --quick    # 0.4M GPT, batch 4 x 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import Settings, add_common_args, batches, make_gpt, saved_activation_bytes, settings_from_args, \
    torch_state_bytes, train_step, worker_group

CASES = ("zero3_vs_fsdp2", "zero3_vs_fsdp2_narrow", "zero0_vs_ddp", "one_rank_vs_plain", "zero3_recompute", "predicted")
# the plans whose predicted peak (Plan.peak_estimate) is compared with the measured one, on 2 ranks
PREDICTED = (("zero-0", {"dp": 2}, dict(zero_stage=0)), ("zero-1", {"dp": 2}, dict(zero_stage=1)),
             ("zero-2", {"dp": 2}, dict(zero_stage=2)), ("zero-3", {"dp": 2}, dict(zero_stage=3)),
             ("zero-3 full recompute", {"dp": 2}, dict(zero_stage=3, activation_checkpointing="full")),
             ("zero-3 selective recompute", {"dp": 2}, dict(zero_stage=3, activation_checkpointing="selective")),
             ("zero-3 recompute every 2nd block", {"dp": 2}, dict(zero_stage=3, activation_checkpointing=2)),
             ("tp=2 + SP", {"tp": 2}, dict(sequence_parallel=True)),
             ("pp=2 1F1B, 4 microbatches", {"pp": 2}, dict(schedule="1f1b", microbatches=4)))
NARROW = dict(n_layer=24, n_head=4, n_embd=64)  # the 24-block narrow GPT (1.2M parameters)


def _peak(step, state_bytes, over_ranks: bool = True) -> int:
    """Peak bytes over one call of ``step``, the largest over the ranks: the model state alive
    before it (``state_bytes()["total"]``: parameters, gradients, optimizer state) plus the
    highest running sum of every CPU allocation and free during the call, in time order over all
    threads (the communication threads too), as ``torch.profiler(profile_memory=True)`` records
    them (c10's CPU allocator reports each one, a ZeRO-3 chunk's ``resize_`` included).

    The profiler drops the free of a block allocated before it started, so the window holds two
    calls and only the second is measured: what it frees (last step's gradients, activations)
    was allocated inside the window. MemTracker is not used: it reads every tracked parameter's
    storage at start, which a ZeRO-3 parameter between steps refuses (ShardedAwayError), and it
    does not see ``resize_``."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("memory-benchmark-mark"):
            base = state_bytes()["total"]
        step()
    events = prof.profiler.kineto_results.events()
    mark = next(e.start_ns() for e in events if e.name() == "memory-benchmark-mark")
    run = top = 0
    records = [e for e in events if e.name() == "[memory]" and e.start_ns() > mark]
    for e in sorted(records, key=lambda e: e.start_ns()):  # every allocation and free, every thread, in time order
        run += e.nbytes()
        top = max(top, run)
    peak = torch.tensor(base + top, dtype=torch.int64)
    if dist.is_initialized() and over_ranks:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def _shardlib(settings, mesh, data, stage, **options):
    import shardlib

    smodel = shardlib.shard(make_gpt(settings, **options.pop("gpt", {})), mesh, zero_stage=stage, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
    return train_step(smodel, opt, data), [smodel], lambda: shardlib.model_state_bytes(smodel, opt), smodel


def _torch(settings, kind, data, **gpt):
    import torch.distributed as dist

    model = make_gpt(settings, **gpt)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=dm)
        fully_shard(model, mesh=dm)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    return train_step(model, opt, data), [model], lambda: torch_state_bytes(model, opt)


def _measure(step, modules, state_bytes) -> dict:
    step(0)  # AdamW's state exists from here on, as in training
    saved = saved_activation_bytes(lambda: step(1), modules)
    calls = iter(range(2, 4))
    return {"peak": _peak(lambda: step(next(calls)), state_bytes), "saved": saved}


def _row(name, ours, theirs, target, limit) -> dict:
    ratio = ours["peak"] / theirs["peak"]
    return {"comparison": name, "shardlib peak MB": round(ours["peak"] / 2**20, 1),
            "torch peak MB": round(theirs["peak"] / 2**20, 1), "ratio": round(ratio, 3),
            "shardlib saved MB": round(ours["saved"] / 2**20, 1), "torch saved MB": round(theirs["saved"] / 2**20, 1),
            "target": f"{target}: {'met' if ratio <= limit else 'MISS'}"}


def _timed(step, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        step(10 + i)
        out.append(time.perf_counter() - t0)
    return out


def formula_factor(a: int, s: int, h: int, dropout: bool, fused_attention: bool) -> float:
    """Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1): a transformer layer saves
    ``s b h (34 + 5 a s / h)`` bytes in 16-bit without recompute and its ``2 s b h``-byte input
    with full recompute, so recompute divides a block's saved bytes by ``(34 + 5 a s / h) / 2``
    (the element size cancels: fp32 doubles both). The 34 and the 5 count, per ``s b h`` and per
    ``a s^2 b`` bytes: attention 11 and 5 (QKV input 2, Q and K 4, softmax output 2, its dropout
    mask 1 and output 2, V 2, projection input 2, dropout mask 1), MLP 19 (input 2, GeLU input 8
    and output 8, dropout mask 1) and the two layer norms' inputs 4. Without dropout the masks
    (1 + 1 per ``s b h``, 1 per ``a s^2 b``) and the attention dropout's output (2 per
    ``a s^2 b``) are not saved: ``32 + 2 a s / h``. A fused attention kernel (torch's
    ``scaled_dot_product_attention``: flash on CPU) keeps no ``s x s`` softmax output, only its
    row log-sum-exp (``a s b`` elements, below the formula's resolution): the ``a s^2 b`` term
    goes."""
    per_sbh = 34 - (0 if dropout else 2)
    per_as2b = 5 - (0 if dropout else 3) - (2 if fused_attention and not dropout else 0)
    if fused_attention and dropout:  # the kernel keeps neither the probabilities nor its dropout's
        per_as2b = 0
    return (per_sbh + per_as2b * a * s / h) / 2


def _recompute_row(settings, mesh, data) -> dict:
    """Full recompute against none at ZeRO-3: saved bytes against the formula's factor, step
    time (alternated blocks of 3 steps), all-gather bytes per step."""
    sides = {}
    for mode in (None, "full"):
        step, modules, state, smodel = _shardlib(settings, mesh, data, 3, activation_checkpointing=mode)
        step(0)
        mesh.comm.reset()
        step(1)
        gathered = sum(b for (axis, kind), (_, b) in mesh.comm.table().items() if kind == "all_gather")
        inside, outside = saved_activation_bytes(lambda: step(2), modules, list(smodel.module.blocks))
        sides[mode] = {"step": step, "saved": inside + outside, "blocks": inside, "other": outside,
                       "peak": _peak(lambda calls=iter(range(3, 5)): step(next(calls)), state), "gathered": gathered,
                       "times": []}
    for _ in range(max(1, settings.steps // 3)):
        for mode in (None, "full"):
            sides[mode]["times"] += _timed(sides[mode]["step"], 3)
    cfg = settings.gpt_config()
    a, s, h = cfg.n_head, settings.seq, cfg.n_embd
    factor = formula_factor(a, s, h, dropout=cfg.dropout > 0 or cfg.attn_dropout > 0, fused_attention=True)
    measured = sides[None]["blocks"] / sides["full"]["blocks"]
    time_ratio = statistics.median(sides["full"]["times"]) / statistics.median(sides[None]["times"])
    same_bytes = sides[None]["gathered"] == sides["full"]["gathered"]
    return {"comparison": "zero3 full recompute vs none", "shardlib peak MB": round(sides["full"]["peak"] / 2**20, 1),
            "torch peak MB": round(sides[None]["peak"] / 2**20, 1), "ratio": round(sides["full"]["peak"] / sides[None]["peak"], 3),
            "shardlib saved MB": round(sides["full"]["saved"] / 2**20, 2), "torch saved MB": round(sides[None]["saved"] / 2**20, 2),
            "target": (f"blocks' saved {sides[None]['blocks'] / 2**20:.2f} -> {sides['full']['blocks'] / 2**20:.2f} MB: "
                       f"/ {measured:.2f} (formula {factor:.1f}; 16-bit with dropout {formula_factor(a, s, h, True, False):.1f}): "
                       f"{'met' if measured >= factor else 'MISS'}; outside the blocks {sides[None]['other'] / 2**20:.2f} -> "
                       f"{sides['full']['other'] / 2**20:.2f} MB; "
                       f"time x{time_ratio:.2f} (<= 1.4): {'met' if time_ratio <= 1.4 else 'MISS'}; all-gather "
                       f"{int(sides['full']['gathered']):,} B vs {int(sides[None]['gathered']):,}: {'met' if same_bytes else 'MISS'}")}


def _predicted_rows(settings, data_all) -> list[dict]:
    """Each plan of :data:`PREDICTED`: the peak ``Plan.peak_estimate`` predicts per rank against
    the one measured (:func:`_peak` on each rank), and the ratio's range over the ranks."""
    import torch.distributed as dist

    import shardlib
    from shardlib.models.gpt import tp_specs

    from .pipeline import _criterion

    rank, rows = dist.get_rank(), []
    for label, shape, options in PREDICTED:
        mesh = shardlib.init_mesh(shape)
        pipe = "pp" in shape
        model = make_gpt(settings, **({"tie_embeddings": False} if pipe else {}))
        smodel = shardlib.shard(model, mesh, tp_specs() if "tp" in shape else None, **options)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
        dp = shape.get("dp", 1)
        b = settings.batch
        local = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) if dp > 1 else (x[:b], y[:b]) for x, y in data_all]

        def step(i, smodel=smodel, opt=opt, local=local, pipe=pipe):
            x, y = local[i % len(local)]
            opt.zero_grad()
            if pipe:
                smodel.forward_backward(x, criterion=_criterion, labels=(y,))
            else:
                smodel(x, y)[1].backward()
            opt.step()

        step(0)
        calls = iter(range(1, 3))
        measured = _peak(lambda: step(next(calls)), lambda: shardlib.model_state_bytes(smodel, opt), over_ranks=False)
        tokens = b * settings.seq // options.get("microbatches", 1)
        est = (smodel.pipeline_plan.peak_estimate(tokens, mesh.index("pp")) if pipe else smodel.plan.peak_estimate(tokens))
        pair = torch.tensor([est.total, measured], dtype=torch.float64)
        both = [torch.zeros_like(pair) for _ in range(dist.get_world_size())]
        dist.all_gather(both, pair)
        ratios = [float(p / m) for p, m in both]
        ok = all(0.9 <= r <= 1.1 for r in ratios)
        rows.append({"comparison": f"predicted vs measured peak: {label}",
                     "shardlib peak MB": " / ".join(f"{float(p) / 2**20:.1f}" for p, _ in both),
                     "torch peak MB": " / ".join(f"{float(m) / 2**20:.1f}" for _, m in both),
                     "ratio": " / ".join(f"{r:.3f}" for r in ratios), "shardlib saved MB": "", "torch saved MB": "",
                     "target": f"0.9-1.1 on every rank: {'met' if ok else 'MISS'}"})
    return rows


def worker(settings: Settings, cases=CASES) -> list[dict]:
    import torch.distributed as dist

    import shardlib

    n = dist.get_world_size()
    mesh = shardlib.init_mesh({"dp": n})
    data = batches(settings, settings.batch * n, 4)
    rank = dist.get_rank()
    local = [(x[rank * settings.batch:(rank + 1) * settings.batch], y[rank * settings.batch:(rank + 1) * settings.batch])
             for x, y in data]
    rows = []
    for case in cases:
        if case in ("zero3_vs_fsdp2", "zero3_vs_fsdp2_narrow"):
            gpt = NARROW if case.endswith("narrow") else {}
            step, mods, state, _ = _shardlib(settings, mesh, local, 3, gpt=dict(gpt))
            ours = _measure(step, mods, state)
            theirs = _measure(*_torch(settings, "fsdp2", local, **gpt))
            label = f"zero3 vs FSDP2 ({'24 x 64 narrow' if gpt else settings.size})"
            rows.append(_row(label, ours, theirs, "<= 1.0", 1.0))
        elif case == "zero0_vs_ddp":
            step, mods, state, _ = _shardlib(settings, mesh, local, 0)
            rows.append(_row("zero0 vs DDP", _measure(step, mods, state), _measure(*_torch(settings, "ddp", local)),
                             "<= 1.05", 1.05))
        elif case == "one_rank_vs_plain":  # run by main() on a group of one
            step, mods, state, _ = _shardlib(settings, mesh, local, 0)
            rows.append(_row("one rank vs plain PyTorch", _measure(step, mods, state),
                             _measure(*_torch(settings, "plain", local)), "<= 1.05", 1.05))
        elif case == "zero3_recompute":
            rows.append(_recompute_row(settings, mesh, local))
        elif case == "predicted":  # "shardlib peak" is the predicted one, "torch peak" the measured, per rank
            rows += _predicted_rows(settings, data)
    return rows if rank == 0 else []


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> dict:
    import json
    import os

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    args = p.parse_args(argv)
    settings = settings_from_args(args)
    t0 = time.perf_counter()
    rows = worker_group(1).run(worker, settings, cases=("one_rank_vs_plain",), timeout=3600)[0]
    rows += worker_group(2).run(worker, settings, cases=tuple(c for c in CASES if c != "one_rank_vs_plain"),
                                timeout=3600)[0]
    table = _table(rows)
    print(f"== memory ({settings.size} GPT, batch {settings.batch} x {settings.seq}, gloo, "
          f"wall {time.perf_counter() - t0:.0f} s)\n{table}")
    result = {"benchmark": "memory", "settings": vars(settings), "torch": torch.__version__, "rows": rows, "table": table}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
