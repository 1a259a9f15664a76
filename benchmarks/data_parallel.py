"""Data parallelism: shardlib ZeRO stages against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2.

Pairs (world size 2, gloo, the reference GPT, AdamW):

==============  ==================================================================  =============
shardlib        PyTorch                                                             theory bytes
==============  ==================================================================  =============
zero_stage 0    ``DistributedDataParallel`` (defaults: 25 MB buckets)               2Ψ(N-1)/N
zero_stage 1    DDP + ``ZeroRedundancyOptimizer`` (all-reduce, then broadcasts)     2Ψ(N-1)/N
zero_stage 2    FSDP2 ``fully_shard(reshard_after_forward=False)`` per block+root   2Ψ(N-1)/N
zero_stage 3    FSDP2 ``fully_shard`` per block + root (ZeRO-3)                     3Ψ(N-1)/N
==============  ==================================================================  =============

Ψ is the model's own parameter count (``GPT.num_params()``, the tied embedding once) times 4
bytes (fp32, the dtype the benchmark trains and communicates in): ZeRO's formula (arXiv
1910.02054 section 7), not the plan's cost model. Where the plan differs on purpose (chunks
padded to a multiple of N elements; at stage 3 the chunk holding the tied embedding kept
gathered from forward to backward, so its backward all-gather is not issued) the difference is
its own column, "plan - paper", itemized in the row's ``theory.plan_minus_paper_items``.
Model state per rank is compared with the plan and with ZeRO's formula (section 5.1; fp32,
AdamW's two states: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N).

    python -m benchmarks.data_parallel --quick      # 0.4M-parameter GPT
    python -m benchmarks.data_parallel              # 10.8M-parameter GPT
"""

from __future__ import annotations

import argparse

import torch

from .common import Settings, Side, train_step, add_common_args, batches, compare, make_gpt, run_benchmark, settings_from_args, \
    torch_state_bytes
from .theory import theory_entry, zero_paper_bytes, zero_plan_differences, zero_state_formula

CASES = ("zero0_vs_ddp", "zero1_vs_zero_redundancy", "zero2_vs_fsdp2_noreshard", "zero3_vs_fsdp2")


def shardlib_side(settings: Settings, mesh, stage: int, data, **options) -> Side:
    import shardlib

    smodel = shardlib.shard(make_gpt(settings), mesh, zero_stage=stage, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
    return Side(f"shardlib zero-{stage}", train_step(smodel, opt, data), [smodel], [opt.optimizer],
                lambda: shardlib.model_state_bytes(smodel, opt), mesh,
                {"plan_bytes": sum(b for _, b in smodel.plan.comm_per_step().values()),
                 "plan_state": smodel.plan.model_state_bytes})


def floor_side(settings: Settings, data) -> Side:
    """The plain model and AdamW on each rank's local batch, no communication at all: the time
    a data-parallel step cannot beat on this machine (both ranks compute at once, as in the
    comparison)."""
    model = make_gpt(settings)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    return Side("plain, no communication", train_step(model, opt, data), [model], [opt])


def torch_side(settings: Settings, kind: str, data) -> Side:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_gpt(settings)
    if kind == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=settings.lr)
        return Side("DDP", train_step(ddp, opt, data), [ddp], [opt], lambda: torch_state_bytes(ddp, opt))
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=settings.lr)
        return Side("DDP+ZeroRedundancyOpt", train_step(ddp, opt, data), [ddp], [opt.optim], lambda: torch_state_bytes(ddp, opt))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reshard = kind == "fsdp2"
    for block in model.blocks:
        fully_shard(block, mesh=dm, reshard_after_forward=reshard)
    fully_shard(model, mesh=dm, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    label = "FSDP2" if reshard else "FSDP2 no-reshard"
    return Side(label, train_step(model, opt, data), [model], [opt], lambda: torch_state_bytes(model, opt))


def comm_theory(settings: Settings, mesh, stage: int, psi: int, itemsize: int, **options) -> dict:
    """The row's theory: ZeRO's formula on the model's ``psi`` parameters of ``itemsize`` bytes
    (:func:`~benchmarks.theory.zero_paper_bytes`), the plan's deliberate differences from it
    (:func:`~benchmarks.theory.zero_plan_differences`), and the model-state formula."""
    import shardlib

    n = mesh.size("dp")
    plan = shardlib.plan(make_gpt(settings), mesh, zero_stage=stage, **options)
    paper = zero_paper_bytes(stage, psi, n, itemsize)
    passes = "3 passes (forward all-gather, backward all-gather, gradient reduce-scatter)" if stage == 3 else \
        "a gradient all-reduce" if stage == 0 else "a gradient reduce-scatter + a parameter all-gather"
    formula = (f"ZeRO (arXiv 1910.02054 s.7): {3 if stage == 3 else 2} psi (N-1)/N, {passes}; psi = {psi} parameters "
               f"x {itemsize} bytes (fp32, the dtype communicated), N = {n}")
    theory = theory_entry(paper, formula, zero_plan_differences(plan), sum(b for _, b in plan.comm_per_step().values()))
    theory.update({"state_formula": zero_state_formula(stage, psi, n), "state_plan": plan.model_state_bytes,
                   "params": psi, "chunks": len(plan.chunks)})
    return theory


def worker(settings: Settings, cases=CASES, chunk_size: int | None = None) -> list[dict]:
    import shardlib

    mesh = shardlib.init_mesh({"dp": 2})
    n, rank = mesh.size("dp"), mesh.index("dp")
    b = settings.batch
    data = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
            for x, y in batches(settings, b * n, settings.warmup + settings.steps + 4)]
    model = make_gpt(settings)
    psi = model.num_params()  # the model's own parameters, the tied embedding once
    # the benchmark trains in fp32 and ZeRO communicates in the parameters' dtype: 4 bytes an element
    itemsize = next(model.parameters()).dtype.itemsize
    rows = []
    for case in cases:
        stage = int(case[4])
        baseline = case.split("_vs_")[1]
        options = {} if chunk_size is None else {"chunk_size": chunk_size}
        theory = comm_theory(settings, mesh, stage, psi, itemsize, **options)
        rows.append(compare(case, lambda: shardlib_side(settings, mesh, stage, data, **options),
                            lambda: torch_side(settings, baseline, data), settings, theory,
                            make_floor=lambda: floor_side(settings, data)))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--chunk-size", type=int, default=None, help="shardlib's ZeRO chunk size in elements (default: the plan's, 4 Mi)")
    args = p.parse_args(argv)
    return run_benchmark("data_parallel", worker, settings_from_args(args), args.out, cases=tuple(args.cases),
                         chunk_size=args.chunk_size)


if __name__ == "__main__":
    main()
