"""Profile training steps of one benchmark side with ``torch.profiler`` (world size 2, gloo).

Prints, for rank 0, the operators with the largest self CPU time over ``--steps`` steps, the
time spent waiting for collectives, and writes a Chrome trace per rank
(``<out>/profile_<side>_rank<r>.json``, open in ``chrome://tracing`` or Perfetto).

    python -m benchmarks.profile_step --side zero3 --size 10m
    python -m benchmarks.profile_step --side fsdp2 --size 10m

Sides: ``zero0`` ... ``zero3`` (shardlib), ``ddp``, ``zero_redundancy``, ``fsdp2``,
``fsdp2_noreshard``, ``tp`` (shardlib), ``parallelize_module``.
"""

from __future__ import annotations

import argparse
import os

from .common import add_common_args, batches, settings_from_args, worker_group

SIDES = ("zero0", "zero1", "zero2", "zero3", "ddp", "zero_redundancy", "fsdp2", "fsdp2_noreshard", "tp",
         "parallelize_module")


def _build(settings, side, rank):
    import shardlib

    from . import data_parallel, tensor_parallel

    if side in ("tp", "parallelize_module"):
        mesh = shardlib.init_mesh({"tp": 2})
        data = batches(settings, settings.batch, 8)
        if side == "tp":
            return tensor_parallel.shardlib_side(settings, mesh, False, data)
        return tensor_parallel.torch_side(settings, False, data)
    mesh = shardlib.init_mesh({"dp": 2})
    b = settings.batch
    data = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) for x, y in batches(settings, 2 * b, 8)]
    if side.startswith("zero") and side[4:].isdigit():
        return data_parallel.shardlib_side(settings, mesh, int(side[4:]), data)
    return data_parallel.torch_side(settings, side, data)


def worker(settings, side: str, steps: int, out: str, rows: int) -> str:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    s = _build(settings, side, rank)
    for i in range(settings.warmup):
        s.step(i)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for i in range(steps):
            s.step(settings.warmup + i)
    os.makedirs(out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out, f"profile_{side}_rank{rank}.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    del torch
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args(argv)
    settings = settings_from_args(args)
    if not args.quick and not args.smoke and args.size is None:
        settings.size = "10m"
    tables = worker_group(2).run(worker, settings, args.side, args.profile_steps, args.out, args.rows)
    print(f"== {args.side}: {args.profile_steps} steps, {settings.size} GPT, rank 0 (self CPU time)")
    print(tables[0])


if __name__ == "__main__":
    main()
