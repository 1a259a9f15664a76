"""The collective trace and the watchdog's waits: shardlib as shipped against shardlib with both
taken out, in one run (``shardlib.mesh.trace``, ``shardlib.mesh.watchdog``).

Side A is shardlib as it runs for users: every collective is recorded (a stack walk, a short
string, a copy into the ring file) and every gloo wait goes through the watchdog (sliced waits;
point-to-point works waited on directly, watched by its answering thread). Side B is the same model and plan with the
record replaced by nothing and the waits by a plain ``work.wait(timeout)``: what the library did
before. The PyTorch baseline of the same cases lives in ``data_parallel`` and
``tensor_parallel``; the trace has no counterpart there (PyTorch's NCCL flight recorder is off by
default and not on gloo).

Target: the trace costs under 1% of step time. Figures, all from this run: ``ratio`` (A's
median step over B's, noisy on a shared CPU); ``record_us``, the median time inside one record
(a timer around each, its own cost subtracted); ``record_share`` = records per step x
``record_us`` / A's median step; ``record_share_mean``, the total time inside records over the
total step time of the same steps (includes any preemption that hit inside a record). The table's
"shardlib"/"torch" columns are A and B here.

    python -m benchmarks.trace_overhead --quick
"""

from __future__ import annotations

import argparse
import time

import torch

from .common import Settings, Side, add_common_args, batches, compare, make_gpt, run_benchmark, settings_from_args, \
    train_step

CASES = ("zero3_dp2", "tp2")


class _Switch:
    """Take the trace and the watchdog waits out of ``shardlib.mesh.collectives`` (and the raw
    flat-buffer collectives of ``shardlib.mesh.raw``) while on."""

    def __init__(self):
        from shardlib.mesh import collectives, guard, raw

        self.c, self.g = (collectives, raw), guard
        self.begin, self.wait = guard.begin, guard.wait_works
        self.record_s, self.records, self.step_s, self.steps, self.each = 0.0, 0, 0.0, 0, []

    def plain(self):
        c, g, switch = self.c, self.g, self

        def begin(*args, **kwargs):
            return None, None

        def wait(mesh, works, rec, p2p):
            for w in works:
                w.wait(mesh.timeout)

        class _Ctx:
            def __enter__(self_):
                g.wait_works = wait
                for m in c:
                    m.begin = begin

            def __exit__(self_, *exc):
                g.wait_works = switch.wait
                for m in c:
                    m.begin = switch.begin

        return _Ctx()

    def timed(self):
        """Count the time spent in the record (as shipped) during a step."""
        c, switch, real = self.c, self, self.begin
        clock = time.perf_counter
        t0 = clock()
        for _ in range(1000):
            clock()
        self.clock_s = (clock() - t0) / 1000

        def begin(*args, **kwargs):
            t = clock()
            rec = real(*args, **kwargs)
            dt = clock() - t - switch.clock_s
            switch.record_s += dt
            switch.records += 1
            switch.each.append(dt)
            return rec

        class _Ctx:
            def __enter__(self_):
                for m in c:
                    m.begin = begin

            def __exit__(self_, *exc):
                for m in c:
                    m.begin = real

        return _Ctx()


def _wrap(step, ctx, switch=None):
    def run(i):
        t = time.perf_counter()
        with ctx():
            out = step(i)
        if switch is not None:
            switch.step_s += time.perf_counter() - t
            switch.steps += 1
        return out

    return run


def worker(settings: Settings, cases=CASES) -> list[dict]:
    import shardlib
    from shardlib.models import tp_specs

    rows = []
    for case in cases:
        axis = "dp" if case.startswith("zero") else "tp"
        mesh = shardlib.init_mesh({axis: 2})
        switch = _Switch()
        data = batches(settings, settings.batch * (2 if axis == "dp" else 1), settings.warmup + settings.steps + 4)
        if axis == "dp":  # each rank's local half of the global batch
            half = settings.batch
            data = [(x[mesh.rank * half:(mesh.rank + 1) * half], y[mesh.rank * half:(mesh.rank + 1) * half]) for x, y in data]

        def build(label, ctx, timed=False):
            model = make_gpt(settings)
            smodel = (shardlib.shard(model, mesh, zero_stage=3) if axis == "dp" else shardlib.shard(model, mesh, tp_specs("tp")))
            opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=settings.lr)
            return Side(label, _wrap(train_step(smodel, opt, data), ctx, switch if timed else None), [smodel],
                        [opt.optimizer], None, mesh)

        row = compare(case, lambda: build("shardlib (trace + watchdog)", switch.timed, True),
                      lambda: build("shardlib without them", switch.plain), settings,
                      theory={"target": "record_share < 1% of step time"})
        if "median_s" in row.get("a", {}):
            import statistics

            row["records_per_step"] = switch.records / switch.steps
            row["record_us"] = 1e6 * statistics.median(switch.each)  # median: a preempted record is the machine's
            row["record_mean_us"] = 1e6 * switch.record_s / max(switch.records, 1)
            row["record_share"] = row["records_per_step"] * statistics.median(switch.each) / row["a"]["median_s"]
            row["record_share_mean"] = switch.record_s / switch.step_s  # all of it, preemptions included
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    args = p.parse_args(argv)
    result = run_benchmark("trace_overhead", worker, settings_from_args(args), args.out, nprocs=2)
    for row in result["rows"]:
        if "record_share" in row:
            print(f"{row['name']}: {row['records_per_step']:.0f} collectives/step, {row['record_us']:.1f} us per record "
                  f"(median; mean {row['record_mean_us']:.1f}), record share {100 * row['record_share']:.2f}% of the median "
                  f"step (mean-based {100 * row['record_share_mean']:.2f}%); A/B median step ratio {row['ratio']:.3f}")
    return result


if __name__ == "__main__":
    main()
