"""Wall time of dry runs at 1,024 ranks: GPT-7B and LLaMA-70B shapes, one training step as one rank.

Each run is what a user types, ``python -m shardlib.dryrun --model M --mesh S --rank R ...``, in
a fresh interpreter (torch and transformers imports included), timed from outside: wall seconds
and the child's CPU seconds. Issue 14's target: under 2 minutes each on this 2-core machine.
The run's own verdict (measured state and communication equal to the plan) is recorded too.

    python -m benchmarks.dryrun                      # both models, dp x tp and pp x dp x tp, ranks 0 and 1023
    python -m benchmarks.dryrun --models gpt-7b --meshes dp=128,tp=8 --ranks 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

TARGET_S = 120.0
MESHES = ("dp=128,tp=8", "pp=8,dp=16,tp=8")


def run_one(model: str, mesh: str, rank: int, extra: list[str]) -> dict:
    """One dry run in a fresh interpreter: its wall and CPU seconds, exit status and verdict."""
    argv = [sys.executable, "-m", "shardlib.dryrun", "--model", model, "--mesh", mesh, "--rank", str(rank), *extra]
    if mesh.startswith("pp=") or ",pp=" in mesh:
        argv += ["--microbatches", "32", "--schedule", "1f1b"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    verdict = next((line for line in proc.stdout.splitlines() if line.startswith("verdict:")), "")
    return {"model": model, "mesh": mesh, "rank": rank, "command": " ".join(argv[1:]), "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "status": proc.returncode, "verdict": verdict,
            "equal_to_plan": verdict == "verdict: the measured state and communication equal the plan",
            "under_target": proc.returncode == 0 and wall < TARGET_S,
            "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else ""}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt-7b", "llama-70b"])
    p.add_argument("--meshes", nargs="+", default=list(MESHES))
    p.add_argument("--ranks", nargs="+", type=int, default=[0, 1023])
    p.add_argument("--json", help="write the rows to this file")
    args, extra = p.parse_known_args(argv)
    rows = []
    print(f"{'model':<10} {'mesh':<16} {'rank':>5} {'wall s':>7} {'CPU s':>6}  verdict")
    for model in args.models:
        for mesh in args.meshes:
            for rank in args.ranks:
                row = run_one(model, mesh, rank, extra)
                rows.append(row)
                print(f"{model:<10} {mesh:<16} {rank:>5} {row['wall_s']:>7.1f} {row['cpu_s']:>6.1f}  "
                      f"{row['verdict'] or row['error']}", flush=True)
    met = all(r["under_target"] for r in rows)
    print(f"every run under {TARGET_S:.0f} s: {met}; every run equal to its plan: {all(r['equal_to_plan'] for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
