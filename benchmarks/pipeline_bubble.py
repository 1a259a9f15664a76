"""Measured pipeline bubble against theory, with stages of fixed-duration work.

Each stage sleeps ``--forward-ms`` in forward, ``--input-ms`` in the backward to its input
(``I``) and ``--weight-ms`` in the backward to its weight (``W``): a full backward ``B`` sleeps
both. The work lies on the two paths of the graph, so a split backward really runs them apart
(:mod:`shardlib.parallel.split_backward`: ``I`` reaches the sleep on the input path, ``W`` the
one on the parameter path). The compute is deterministic and leaves the cores free. The idle
fraction of every rank over one step is read from the recorded timeline: ``1 - busy /
makespan``; the idle time per rank against 1F1B's is the zero-bubble paper's bubble ratio.

Theory (:mod:`shardlib.parallel.schedule_theory`, costs per chunk): ``(p - 1)(F + B + W)`` idle
per rank for GPipe and (interleaved) 1F1B, so the fraction ``(p - 1) / (v m + p - 1)``
(Narayanan et al. 2021); ZB-H1 ``(p - 1)(F + B - W)`` (Qi et al. 2024, ``W <= F``, ``m >= p``),
a third of 1F1B's at equal costs; ZB-V and DualPipeV ``(p - 1) F`` of a half-size chunk at
equal costs, the least a V can idle (the last rank's first chunk waits for ``p - 1`` chunk
forwards), a sixth of 1F1B's. The V schedules and interleaved 1F1B cut the same model into
twice the stages, each sleeping half as long.

    python -m benchmarks.pipeline_bubble --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import shardlib
from shardlib.errors import ShardingError
from shardlib.parallel.pipeline import measured_bubble
from shardlib.parallel.schedule_theory import bubble_time
from shardlib.parallel.schedules import build_schedule

# (schedule, chunks per rank); a schedule whose sizes do not fit (p, m) is skipped
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))


class _SleepInput(torch.autograd.Function):
    """Identity on the input path: sleeps ``forward_s`` in forward and ``input_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, input_s):
        ctx.input_s = input_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.input_s)
        return g, None, None


class _SleepWeight(torch.autograd.Function):
    """Identity on the parameter path: sleeps ``weight_s`` in backward (the weight gradient)."""

    @staticmethod
    def forward(ctx, w, weight_s):
        ctx.weight_s = weight_s
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.weight_s)
        return g, None


class SleepLayer(nn.Module):
    """A layer whose forward, input-gradient and weight-gradient work take fixed wall-clock times."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s

    def forward(self, x):
        return _SleepInput.apply(x * _SleepWeight.apply(self.scale, self.weight_s), self.forward_s, self.input_s)


def _worker(pp, schedule, m, v, costs):
    mesh = shardlib.init_mesh({"pp": pp})
    model = nn.Sequential(*[SleepLayer(*costs) for _ in range(pp * v)])
    smodel = shardlib.shard(model, mesh, schedule=schedule, microbatches=m, virtual_stages=v)
    x = torch.ones(m, 4)
    crit = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
    for _ in range(2):  # the second step is measured (the first warms up the transports)
        smodel.forward_backward(x, criterion=crit, labels=(torch.zeros(m, 4),))
    return smodel.timeline


def _fits(schedule: str, p: int, m: int, v: int) -> bool:
    """Whether the schedule takes these sizes (interleaved 1F1B: m a multiple of p; DualPipeV: m >= 2p)."""
    try:
        build_schedule(schedule, p, m, v)
    except ShardingError:
        return False
    return True


def measure(pp: int, m: int, forward_ms: float, input_ms: float | None = None, weight_ms: float | None = None,
            schedules=SCHEDULES) -> list[dict]:
    """One row per schedule: measured idle fraction and idle seconds per rank against theory.

    ``input_ms`` / ``weight_ms`` default to ``forward_ms`` (the papers' ``T_F = T_B = T_W``),
    per rank's share of the model; a schedule with ``v`` chunks per rank sleeps ``1 / v`` of each.
    ZB-V and DualPipeV are skipped at unequal costs (their closed form is at equal costs)."""
    input_ms = forward_ms if input_ms is None else input_ms
    weight_ms = forward_ms if weight_ms is None else weight_ms
    rows = []
    for schedule, v in schedules:
        if not _fits(schedule, pp, m, v):
            continue
        costs = tuple(ms / 1e3 / v for ms in (forward_ms, input_ms, weight_ms))  # the same model cut into v x stages
        timelines = shardlib.launch(_worker, pp, pp, schedule, m, v, costs)
        measured = measured_bubble(timelines)
        start = min(t[1] for tl in timelines for t in tl)
        span = max(t[2] for tl in timelines for t in tl) - start
        idle = [span - sum(e - s for _, s, e in tl) for tl in timelines]
        try:
            theory_idle = bubble_time(schedule, pp, m, *costs)
        except ShardingError:  # ZB-V / DualPipeV: a closed form at equal costs only
            continue
        theory = theory_idle / (theory_idle + v * m * sum(costs))
        rows.append({"schedule": schedule, "pp": pp, "microbatches": m, "v": v, "theory": theory,
                     "measured": measured, "max_abs_error": max(abs(b - theory) for b in measured),
                     "idle_s": idle, "theory_idle_s": theory_idle})
    one = next((r for r in rows if r["schedule"] == "1f1b"), None)
    for r in rows:  # the zero-bubble paper's comparison: idle time per rank against 1F1B's
        if one is not None:
            r["idle_ratio_vs_1f1b"] = (sum(r["idle_s"]) / len(r["idle_s"])) / (sum(one["idle_s"]) / len(one["idle_s"]))
            r["theory_ratio_vs_1f1b"] = r["theory_idle_s"] / one["theory_idle_s"]
    return rows


TARGETS = {"zb_h1": 0.4, "zbv": 0.15}  # issue 18: idle time against 1F1B's at p=4, m=8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=100.0, help="forward of one rank's share of the model")
    p.add_argument("--input-ms", type=float, default=None, help="its backward to the input (default: --forward-ms)")
    p.add_argument("--weight-ms", type=float, default=None, help="its weight gradients (default: --forward-ms)")
    p.add_argument("--json", default=None)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a measured bubble misses the 0.05 target (default: report it; wall-clock "
                        "timings on a loaded machine are noisy, and a benchmark reports rather than fails)")
    args = p.parse_args(argv)
    rows = measure(args.pp, args.microbatches, args.forward_ms, args.input_ms, args.weight_ms)
    print(f"{'schedule':<18} {'pp':>3} {'m':>3} {'v':>2} {'theory':>7}  {'measured per rank':<33} max |err|  "
          "idle vs 1F1B (theory)")
    for r in rows:
        per = " ".join(f"{b:.3f}" for b in r["measured"])
        ratio = f"{r['idle_ratio_vs_1f1b']:.3f} ({r['theory_ratio_vs_1f1b']:.3f})" if "idle_ratio_vs_1f1b" in r else ""
        print(f"{r['schedule']:<18} {r['pp']:>3} {r['microbatches']:>3} {r['v']:>2} {r['theory']:>7.3f}  {per:<33} "
              f"{r['max_abs_error']:.3f}      {ratio}")
    worst = max(r["max_abs_error"] for r in rows)
    met = worst <= 0.05
    print(f"worst absolute error {worst:.3f} (target <= 0.05: {'met' if met else 'MISSED'})"
          + ("" if met else "; timings are wall-clock sleeps, so a loaded machine adds idle time: rerun on a quiet one"))
    for r in rows:
        if r["schedule"] in TARGETS and "idle_ratio_vs_1f1b" in r:
            target = TARGETS[r["schedule"]]
            print(f"{r['schedule']} idle time / 1F1B's: {r['idle_ratio_vs_1f1b']:.3f} (theory "
                  f"{r['theory_ratio_vs_1f1b']:.3f}; target <= {target}: {'met' if r['idle_ratio_vs_1f1b'] <= target else 'MISSED'})")
            if r["theory_ratio_vs_1f1b"] > target:
                print(f"  (theory itself is {r['theory_ratio_vs_1f1b']:.3f} > {target}: at these costs no schedule on "
                      "its layout can idle less; see shardlib.parallel.schedule_theory)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    raise SystemExit(main())
