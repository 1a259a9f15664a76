"""Tensor-parallel communication on meta, as one rank of a fake world (issue 15, item 2).

A dry run (:mod:`shardlib.dryrun`) sets ``mesh.device`` to meta, and check mode
(``SHARDLIB_CHECK_COLLECTIVES=1``, set by conftest and inherited here) raises
:class:`~shardlib.errors.CollectiveDeviceError` for any tensor handed to ``torch.distributed``
elsewhere: a call site that allocates on the CPU without ``device=`` fails here, as NCCL would
reject it on a GPU. A value read back to the host (``.item()``) fails on meta too. Torch's fake
group cannot share a process with the worker pool's gloo group, so everything runs in one fresh
interpreter (about 4 s).
"""

import json
import os
import subprocess
import sys

import pytest


def _in_this_process() -> dict:
    """Every case, in this (fresh) process; each result is "ok ..." or the exception raised."""
    import torch

    import shardlib
    from shardlib.dryrun import fake_world
    from shardlib.parallel.cross_entropy import vocab_parallel_cross_entropy

    out: dict = {}
    with fake_world(2, 1):
        mesh = shardlib.init_mesh({"tp": 2})
        mesh.device = torch.device("meta")  # as dry_run sets it
        for eps in (0.0, 0.1):
            try:
                logits = torch.empty(6, 18, device="meta", requires_grad=True)  # rank 1's slice of V = 37
                target = torch.zeros(6, dtype=torch.long, device="meta")
                mesh.comm.reset()
                loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=eps, mesh=mesh)
                loss.backward()
                out[f"ce_eps{eps}"] = f"ok {loss.device} {logits.grad.shape[-1]} calls {mesh.comm.calls('tp')}"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[f"ce_eps{eps}"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDLIB_CHECK_COLLECTIVES": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vocab_parallel_cross_entropy_exchanges_widths_on_the_mesh_device(runs):
    """``vocab_size=None``: the local widths are exchanged in a tensor on ``mesh.device`` (at
    8ed393d a CPU tensor: CollectiveDeviceError here, and its ``.item()`` a host sync per call)
    and the global size is never read back to the host (on meta ``.item()`` would raise), with
    and without label smoothing: the exchange and the three all-reduces, then backward."""
    for eps in ("0.0", "0.1"):
        assert runs[f"ce_eps{eps}"] == "ok meta 18 calls 4", runs[f"ce_eps{eps}"]


if __name__ == "__main__":  # the fresh process of the runs fixture
    print(json.dumps(_in_this_process()))
