"""The main job runs under torchrun and its --check agrees with one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_train_gpt_under_torchrun_with_check(tmp_path):
    log = tmp_path / "log.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train_gpt.py"),
        "--zero-stage", "3", "--steps", "4", "--eval-every", "4", "--eval-batches", "1", "--batch-size", "4",
        "--block-size", "32", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--check", "4",
        "--sample", "0", "--log-json", str(log),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "max relative loss difference" in out.stdout
    assert "final val loss" in out.stdout
    assert log.exists()
