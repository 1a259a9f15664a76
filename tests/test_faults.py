"""Fault injection: diverging, frozen and killed ranks end every rank within seconds, and the
error names the rank and the collective (shardlib.mesh.watchdog, trace, diagnosis).

Each case breaks the process group on purpose, so the pool is replaced after it (the launcher
closes a group after a CollectiveError or a dead worker). Bounds: the watchdog is set to 2 s in
the workers; a case must end within BOUND seconds (watchdog + answers + a loaded 2-core
machine), far below the 120 s collective timeout of the pool.
"""

from __future__ import annotations

import time

import pytest

from shardlib.errors import WorkerError
from shardlib.testing.pool import run_on

pytestmark = pytest.mark.multiprocess

BOUND = 45.0  # s; measured 3-8 s per case on this machine


def _run_failing(nprocs, fn, *args):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_on(nprocs, fn, *args, timeout=BOUND + 30)
    took = time.monotonic() - t0
    assert took < BOUND, f"took {took:.0f} s"
    return info.value


def _setup(check: bool = False, watchdog: float = 2.0, shape=None, answer: float = 6.0):
    import os

    import shardlib

    os.environ["SHARDLIB_WATCHDOG"] = str(watchdog)
    os.environ["SHARDLIB_WATCHDOG_ANSWER"] = str(answer)
    mesh = shardlib.init_mesh(shape or {"dp": 2})
    mesh.trace.check = check
    return mesh


# -- divergence: one rank issues a collective the other does not ----------------------------------

def _only_rank0_collective():
    import torch

    import shardlib

    mesh = _setup()
    shardlib.all_reduce(torch.ones(3), "dp")
    if mesh.rank == 0:
        shardlib.all_reduce(torch.ones(3), "dp")  # rank 1 returns instead
    return "done"


def test_only_rank0_calls_a_collective():
    err = _run_failing(2, _only_rank0_collective)
    assert err.rank == 0 and err.exc_type == "CollectiveMismatchError"
    msg = err.message
    assert "First difference" in msg and "rank 0: all_reduce(axis 'dp', (3,) float32)" in msg
    assert "rank 1: issued none" in msg and "its function returned" in msg, msg
    assert "test_faults.py" in msg  # the user's call site


def _uneven_steps():
    import torch

    import shardlib

    mesh = _setup()
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Linear(4, 4), mesh, zero_stage=3)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    for _ in range(3 if mesh.rank == 0 else 2):  # rank 0 has one more batch
        smodel(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return "done"


def test_one_rank_runs_one_more_step():
    err = _run_failing(2, _uneven_steps)
    assert err.exc_type == "CollectiveMismatchError", err
    msg = err.message
    assert "rank 1 finished step 2" in msg and "rank 0 is in step 3" in msg, msg
    assert "all_gather(axis 'dp'" in msg and "rank 1: issued none" in msg


def _tp_block_twice():
    import os

    import torch

    import shardlib

    os.environ["SHARDLIB_WATCHDOG"] = "2"
    mesh = shardlib.init_mesh({"tp": 2})
    mesh.trace.check = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    smodel = shardlib.shard(model, mesh, {"0.weight": shardlib.P("tp", None), "0.bias": shardlib.P("tp"),
                                          "2.weight": shardlib.P(None, "tp")})
    x = torch.ones(2, 8)
    y = smodel(x)
    if mesh.rank == 0:
        y = smodel(y)  # rank 0 runs the block twice
    y.sum().backward()
    return "done"


def test_tp_rank_runs_a_block_twice():
    err = _run_failing(2, _tp_block_twice)
    assert err.rank == 0 and err.exc_type == "CollectiveMismatchError", err
    msg = err.message  # rank 1 ran the model once and returned: it has nothing to raise
    assert "First difference" in msg and "all_reduce(axis 'tp'" in msg and "rank 1: issued none" in msg, msg
    assert "its function returned" in msg


def _kinds_differ(check):
    import torch

    import shardlib

    mesh = _setup(check=check)
    if mesh.rank == 0:
        shardlib.all_reduce(torch.ones(4), "dp")
    else:
        shardlib.all_gather(torch.ones(2), "dp")
    return "done"


def test_all_reduce_against_all_gather_checked():
    err = _run_failing(2, _kinds_differ, True)
    assert set(err.errors) == {0, 1}
    for rank, (kind, msg) in err.errors.items():
        assert kind == "CollectiveMismatchError", (rank, msg)
        assert "rank 0: all_reduce(shape (4,), float32" in msg and "rank 1: all_gather(shape (2,), float32" in msg
        assert "test_faults.py" in msg  # both ranks' call sites, exchanged through the store


def test_all_reduce_against_all_gather_default_mode():
    err = _run_failing(2, _kinds_differ, False)
    text = " ".join(m for _, m in err.errors.values())
    assert "all_reduce" in text and "all_gather" in text, err.errors


def _sizes_differ(check, kind):
    import torch

    import shardlib

    mesh = _setup(check=check)
    n = 4 if mesh.rank == 0 else 8
    if kind == "all_reduce":
        shardlib.all_reduce(torch.ones(n), "dp")
    else:
        shardlib.all_gather(torch.ones(n), "dp")
    return "done"


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_sizes_differ_checked(kind):
    err = _run_failing(2, _sizes_differ, True, kind)
    assert set(err.errors) == {0, 1}
    for _, (exc, msg) in err.errors.items():
        assert exc == "CollectiveMismatchError"
        assert f"rank 0: {kind}(shape (4,)" in msg and f"rank 1: {kind}(shape (8,)" in msg


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_sizes_differ_default_mode_names_the_mismatch(kind):
    """Without the check gloo may abort the process natively; the error that reaches the user
    (a survivor's, or the launcher's for the dead rank) still names both shapes."""
    err = _run_failing(2, _sizes_differ, False, kind)
    text = " ".join(m for _, m in err.errors.values())
    assert kind in text and "(4,)" in text and "(8,)" in text, err.errors


def _shapes_differ():
    import torch

    import shardlib

    mesh = _setup(check=True)
    x = torch.ones(2, 4) if mesh.rank == 0 else torch.ones(4, 2)  # the same bytes
    shardlib.all_gather(x, "dp")
    return "done"


def test_same_bytes_other_shapes_checked():
    err = _run_failing(2, _shapes_differ)
    for _, (exc, msg) in err.errors.items():
        assert exc == "CollectiveMismatchError" and "(2, 4)" in msg and "(4, 2)" in msg


def _zero3_eval_on_rank0(check):
    import torch

    import shardlib

    mesh = _setup(check=check)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    smodel = shardlib.shard(model, mesh, zero_stage=3, chunk_size=40)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    x = torch.ones(2, 4)
    for step in range(2):
        if mesh.rank == 0:
            with torch.no_grad():
                smodel(x)  # evaluation on rank 0 only
        smodel(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return "done"


def test_zero3_evaluation_on_rank0_only_checked():
    err = _run_failing(2, _zero3_eval_on_rank0, True)
    assert set(err.errors) == {0, 1}
    for _, (exc, msg) in err.errors.items():
        assert exc == "CollectiveMismatchError", msg
        assert "axis 'dp'" in msg and "rank 0: " in msg and "rank 1: " in msg


def test_zero3_evaluation_on_rank0_only_default_mode():
    """Unchecked, the shifted gathers reach gloo with other sizes and it aborts both processes;
    the launcher's error still names the first collective where the two ranks' traces differ."""
    err = _run_failing(2, _zero3_eval_on_rank0, False)
    text = "\n".join(m for _, m in err.errors.values())
    assert "First difference" in text and "axis 'dp'" in text and "all_gather" in text, text
    assert "test_faults.py" in text


# -- lost ranks ------------------------------------------------------------------------------------

def _lose_rank1(signal_name: str, delay: float = 0.0):
    """Rank 1 sends itself ``signal_name`` after one collective; rank 0 (after ``delay`` s) issues
    the next one."""
    import os
    import signal
    import time

    import torch

    import shardlib

    # a stopped rank never answers and the diagnosis waits the whole answer time for it: 3 s, as
    # in the pipeline case below (2 ranks: only the stopped one is asked); 6 s took 19 s a case
    mesh = _setup(answer=3.0 if signal_name == "SIGSTOP" else 6.0)
    shardlib.all_reduce(torch.ones(3), "dp")
    if mesh.rank == 1:
        os.kill(os.getpid(), getattr(signal, signal_name))
    time.sleep(delay)  # rank 1 gone before rank 0 posts: gloo may refuse the send itself
    shardlib.all_gather(torch.ones(3), "dp")
    return "done"


def test_frozen_rank_is_named():
    err = _run_failing(2, _lose_rank1, "SIGSTOP")
    assert err.rank == 0 and err.exc_type == "RankFailureError", err
    msg = err.message
    assert msg.startswith("rank 1 is frozen") and "stopped (SIGSTOP" in msg, msg
    assert "rank 0 (" in msg and "waiting" in msg  # the neighbour is shown waiting, not blamed


def _stop_rank1_then_fail_rank0():
    import os
    import signal
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)  # rank 1 stopped first
    raise ValueError("rank 0 fails")


def test_the_launcher_waits_neither_grace_nor_close_for_a_stopped_rank():
    """A stopped worker can neither report nor exit: the launcher reads its state (/proc) and
    ends the run when the failing rank has reported, instead of waiting the 5 s grace period
    and 2 s of close for it (both were spent on every frozen-rank case)."""
    import signal
    import subprocess
    import sys

    from shardlib.mesh.launch import _stopped

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _stopped(proc)
        proc.send_signal(signal.SIGSTOP)
        for _ in range(100):  # the state changes asynchronously
            if _stopped(proc):
                break
            time.sleep(0.05)
        assert _stopped(proc)
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        assert not _stopped(proc)
    finally:
        proc.kill()
        proc.wait()
    assert not _stopped(proc)  # gone
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_on(2, _stop_rank1_then_fail_rank0)
    took = time.monotonic() - t0
    assert info.value.rank == 0 and "rank 0 fails" in info.value.message
    assert "ranks [1] were still running and were stopped" in info.value.message
    assert took < 5.0, f"took {took:.1f} s: the grace period was waited for a stopped rank"  # measured 1.0 s; 10.1 s before


@pytest.mark.parametrize("case", ["in_wait", "before_post"])
def test_killed_rank_is_named_gone(case):
    err = _run_failing(2, _lose_rank1, "SIGKILL", 0.0 if case == "in_wait" else 2.0)
    assert err.errors[1][0] == "ProcessExit" and "SIGKILL" in err.errors[1][1]
    exc, msg = err.errors[0]
    assert exc == "RankFailureError", msg
    assert "rank 1 is gone" in msg and "pid" in msg and "Connection closed" not in msg.split("\n")[0], msg


def _lose_rank1_mid_pipeline(signal_name: str):
    """A 2-stage pipeline: after one step, rank 1 (the last stage) sends itself ``signal_name``
    at the start of the next, so rank 0 blocks in its point-to-point wait for a gradient."""
    import os
    import signal

    import torch

    import shardlib

    # check mode off: else its signature all-gather (a sliced wait) meets the frozen rank first;
    # answers awaited 3 s: only the frozen rank is silent, and the diagnosis waits this long for it
    mesh = _setup(shape={"pp": 2}, answer=3.0)
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), mesh, microbatches=2)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    for step in range(2):
        if step == 1 and mesh.rank == 1:
            os.kill(os.getpid(), getattr(signal, signal_name))
        smodel.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
    return "done"


def test_frozen_rank_in_a_pipeline_wait_is_named():
    """A point-to-point wait is not sliced (a timed-out gloo wait closes the pair): the main
    thread waits itself and the answering thread diagnoses it. Nothing can interrupt a wait on a
    frozen peer, so the worker reports the verdict and ends (Watchdog.on_fatal)."""
    err = _run_failing(2, _lose_rank1_mid_pipeline, "SIGSTOP")
    assert err.rank == 0 and err.exc_type == "RankFailureError", err
    assert err.message.startswith("rank 1 is frozen") and "stopped (SIGSTOP" in err.message, err.message
    assert "rank 0 (" in err.message and "gradient of stage 1 microbatch" in err.message, err.message
    assert "watchdog thread" in err.remote_traceback, err.remote_traceback  # reported by Watchdog.on_fatal, not raised


def test_killed_rank_in_a_pipeline_wait_is_named_gone():
    """The peer of a point-to-point wait is killed: the wait fails at once (the connection
    closes) and the main thread raises the diagnosis, naming the rank that is gone."""
    err = _run_failing(2, _lose_rank1_mid_pipeline, "SIGKILL")
    assert err.errors[1][0] == "ProcessExit" and "SIGKILL" in err.errors[1][1]
    exc, msg = err.errors[0]
    assert exc == "RankFailureError" and "rank 1 is gone" in msg, msg


def test_end_process_reports_the_verdict_and_keeps_an_existing_error_file(tmp_path):
    """Watchdog.on_fatal outside a launch worker: the verdict on stderr and in torchrun's error
    file (a file already there is not replaced), exit status 1."""
    import json
    import subprocess
    import sys

    code = "from shardlib.mesh.watchdog import _end_process; _end_process('RankFailureError', 'rank 1 is frozen')"
    for existing in (False, True):
        path = tmp_path / f"error{int(existing)}.json"
        if existing:
            path.write_text("theirs")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, "TORCHELASTIC_ERROR_FILE": str(path)})
        assert out.returncode == 1
        assert "shardlib: RankFailureError: rank 1 is frozen" in out.stderr, out.stderr
        if existing:
            assert path.read_text() == "theirs"
        else:
            assert json.loads(path.read_text())["message"]["message"] == "RankFailureError: rank 1 is frozen"


# -- the NCCL branch of the waits, forced on gloo ----------------------------------------------------

def _forced_nccl_branch():
    import torch

    import shardlib
    from shardlib.mesh.collectives import raw_all_gather, raw_reduce_scatter

    mesh = shardlib.init_mesh({"dp": 2})
    mesh.backend = "nccl"  # the collectives' and waits' non-gloo branches (gloo runs these calls too)
    try:
        r = mesh.rank
        out = torch.empty(4)
        raw_all_gather(out, torch.tensor([r + 1.0, r + 2.0]), mesh, "dp")
        shard = torch.empty(2)
        raw_reduce_scatter(shard, torch.arange(4.0) * (r + 1), mesh, "dp", op="avg")
        total = shardlib.all_reduce(torch.ones(2) * (r + 1), "dp")
        return out.tolist(), shard.tolist(), total.tolist(), mesh.trace.records(3)[-1]["kind"]
    finally:
        mesh.backend = "gloo"


def test_nccl_branch_forced_on_gloo():
    res = run_on(2, _forced_nccl_branch)
    for r, (gathered, shard, total, last) in enumerate(res):
        assert gathered == [1.0, 2.0, 2.0, 3.0]
        assert shard == [1.5 * x for x in ((0.0, 1.0) if r == 0 else (2.0, 3.0))]  # mean of x and 2x
        assert total == [3.0, 3.0] and last == "all_reduce"


def _pipeline_evaluate_on_stage0():
    import os

    import torch

    import shardlib

    os.environ["SHARDLIB_WATCHDOG"] = "2"
    mesh = shardlib.init_mesh({"pp": 2}, timeout=8)  # groups of their own with an 8 s backend timeout
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    smodel = shardlib.shard(model, mesh, microbatches=2)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    crit = torch.nn.functional.mse_loss
    if mesh.rank == 0:
        smodel.evaluate(x, criterion=crit, labels=(y,))  # stage 0 alone: stage 1 is in its training step
    losses, _ = smodel.forward_backward(x, criterion=crit, labels=(y,))
    return "done"


def test_pipeline_evaluate_on_one_stage_never_pairs_with_training():
    """Evaluation and training schedules use other point-to-point tags: stage 1's training step
    used to take stage 0's evaluation activations as its own and go on silently; now the stages
    wait, and the crossed point-to-point waits are named within the watchdog's seconds."""
    err = _run_failing(2, _pipeline_evaluate_on_stage0)
    assert err.exc_type == "CollectiveMismatchError", err.errors
    assert ("Point to point: rank 1 waits to receive the activation of stage 0 microbatch 0 of a training step from "
            "rank 0") in err.message and "send the activation of stage 0 microbatch 0 of evaluate" in err.message
