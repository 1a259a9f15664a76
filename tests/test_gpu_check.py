"""benchmarks/gpu_check.py: what runs without a GPU (the no-CUDA exit, the table and exit codes,
the FLOPs and MFU arithmetic, and its checks at tiny size on CPU/gloo), and the `gpu`-marked
entry point that runs the script on a CUDA machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import SKIPPED, Skip, exit_code, format_table, run_check
from benchmarks.gpu_throughput import MEDIUM, flops_per_token, mfu, n_params, peak_for
from shardlib.testing import run_on

ROOT = Path(__file__).resolve().parent.parent


def gpt_check_config():
    from shardlib.models import GPTConfig

    return GPTConfig(**MEDIUM)


def test_without_cuda_one_line_and_the_skip_code(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == SKIPPED == 77
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device here" in out and "exit 77 (skipped)" in out


def test_flops_and_mfu_by_hand():
    """GPT-2 medium as the script builds it: per block 12 C^2 + 13 C (q/k/v/o and the 4C MLP with
    biases, two LayerNorms), wte V C, wpe T C, ln_f 2 C; C = 1024, V = 50304, T = 1024, L = 24."""
    c = 1024
    n = 24 * (12 * c * c + 13 * c) + 50304 * c + 1024 * c + 2 * c
    assert n == 354_871_296 == n_params(gpt_check_config())
    assert flops_per_token(n, 24, 1024, c) == 6 * 354_871_296 == 2_129_227_776
    assert flops_per_token(n, 24, 1024, c, attention=True) == 2_129_227_776 + 12 * 24 * 1024 * 1024
    # 200k tokens/s x 2.129e9 FLOPs = 4.2585e14 FLOP/s over 989e12: 0.43058
    assert mfu(200_000, 2_129_227_776, 989.0) == pytest.approx(0.430582, rel=1e-5)
    assert peak_for("NVIDIA H200") == 989.0 and peak_for("NVIDIA H100 80GB HBM3") == 989.0 and peak_for("Tesla V100") is None


def test_a_failing_check_is_a_row_and_the_others_still_run():
    rows = []
    run_check(rows, "a", "raises", lambda: 1 / 0)
    run_check(rows, "b", "skips", lambda: (_ for _ in ()).throw(Skip("not here")))
    run_check(rows, "c", "passes", lambda: ("ok", "1.0"))
    run_check(rows, "d", "slow", lambda: ("ok", "2.0", "MISS"))
    assert [(r.check, r.status) for r in rows] == [("a", "FAIL"), ("b", "SKIP"), ("c", "PASS"), ("d", "MISS")]
    assert rows[0].result == "ZeroDivisionError: division by zero" and "1 / 0" in rows[0].detail
    assert rows[1].figures == "not here"
    assert exit_code(rows) == 1 and exit_code(rows[1:]) == 0 and exit_code(rows[1:], strict=True) == 1
    table = format_table(rows).splitlines()
    assert table[0].split() == ["check", "setting", "result", "figures", "status"] and set(table[1]) == {"-", " "}
    start = table[0].index("status")
    assert [line[start:] for line in table[2:]] == ["FAIL", "SKIP", "PASS", "MISS"]  # one aligned column


def test_a_failed_init_fails_each_check_once_without_retrying(monkeypatch):
    """A failed NCCL rendezvous is one FAIL row per check that needs the mesh, not one 120 s
    init attempt per check (which would run past the 8-minute budget)."""
    calls = []

    def broken(shape=None):
        calls.append(shape)
        raise RuntimeError("rendezvous timed out")

    monkeypatch.setattr(gpu_check, "init_single_rank", broken)
    rows = gpu_check.run_checks(torch.device("cpu"), tiny=True, only=("nccl", "offload"))
    assert [(r.check, r.status) for r in rows] == [("nccl", "FAIL"), ("offload", "FAIL"), ("offload", "FAIL")]
    assert all("init_mesh({'dp': 1}) failed: rendezvous timed out" in r.result for r in rows) and calls == [{"dp": 1}]


def _cpu_checks():
    # in a pool worker: gloo, one rank, SHARDLIB_CHECK_COLLECTIVES=1 from conftest
    return gpu_check.run_checks(torch.device("cpu"), tiny=True, only=("nccl", "train", "offload", "throughput"),
                                peak=1.0, steps=2, warmup=1)


@pytest.mark.multiprocess
def test_the_checks_run_on_cpu():
    """The script's checks at tiny size on CPU/gloo (what can run without a GPU): shard() trains as
    plain PyTorch at stages 0-3 and at tp=1 with and without SP, check mode refuses a tensor off
    the mesh's device, offload equals the non-offloaded step, parameter offload at dp=1 trains as
    plain PyTorch, and the throughput sides run."""
    rows = run_on(1, _cpu_checks)[0]
    status = {(r.check, r.setting): r.status for r in rows}
    assert [k for k, v in status.items() if v == "FAIL"] == [], [r.detail for r in rows if r.status == "FAIL"]
    assert status[("train", "pipeline 1f1b at pp=1")] == "SKIP"  # shard refuses schedules at pp = 1 (the row says so)
    assert sum(1 for c, _ in status if c == "train") == 7 and sum(1 for c, _ in status if c == "throughput") == 3
    assert all(v == "PASS" for (check, setting), v in status.items()
               if check in ("nccl", "train", "offload") and "pp=1" not in setting)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: benchmarks.gpu_check checks NCCL, Triton, "
                                                           "pinned offload and throughput on a GPU")
def test_gpu_check_script_on_cuda():
    """`pytest -m gpu`: the whole script at tiny sizes in a fresh process (NCCL is initialized
    there, not in the test process); every check passes (a MISS, a speed target, is allowed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "== benchmarks.gpu_check on" in proc.stdout and " FAIL" not in proc.stdout
