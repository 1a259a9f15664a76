"""One-rank overhead: ``shardlib.shard`` on a one-rank mesh against the plain PyTorch model.

With one data rank every ZeRO stage is plain replication (``Plan.effective_stage`` is 0), so the
sharded step differs from ``model(x); loss.backward(); AdamW.step()`` only by shardlib's
bookkeeping: the forward wrapper, gradient hooks into flat buffers, and AdamW over one flat
tensor per chunk instead of one per parameter. Target: within 3% of plain PyTorch.

    python -m benchmarks.overhead --quick
"""

from __future__ import annotations

import argparse

import torch

from .common import Settings, Side, train_step, add_common_args, batches, compare, make_gpt, run_benchmark, settings_from_args, \
    torch_state_bytes
from .theory import theory_entry, zero_paper_bytes, zero_plan_differences, zero_state_formula

CASES = ("shard_dp1_vs_plain",)


def worker(settings: Settings, cases=CASES, zero_stage: int = 3) -> list[dict]:
    import shardlib

    mesh = shardlib.init_mesh({"dp": 1})
    data = batches(settings, settings.batch, settings.warmup + settings.steps + 4)

    def a():
        smodel = shardlib.shard(make_gpt(settings), mesh, zero_stage=zero_stage)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
        return Side(f"shardlib dp=1 (zero_stage={zero_stage})", train_step(smodel, opt, data), [smodel], [opt.optimizer],
                    lambda: shardlib.model_state_bytes(smodel, opt), mesh)

    def b():
        model = make_gpt(settings)
        opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
        return Side("plain PyTorch", train_step(model, opt, data), [model], [opt], lambda: torch_state_bytes(model, opt))

    psi = make_gpt(settings).num_params()
    plan = shardlib.plan(make_gpt(settings), mesh, zero_stage=zero_stage)
    theory = theory_entry(zero_paper_bytes(zero_stage, psi, 1), "ZeRO's formula at N = 1: (N-1)/N = 0, nothing to communicate",
                          zero_plan_differences(plan), sum(b for _, b in plan.comm_per_step().values()))
    theory.update({"state_formula": zero_state_formula(0, psi, 1), "params": psi, "state_plan": plan.model_state_bytes})
    return [compare(cases[0], a, b, settings, theory)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    args = p.parse_args(argv)
    return run_benchmark("overhead", worker, settings_from_args(args), args.out, nprocs=1)


if __name__ == "__main__":
    main()
