"""Training scripts under torchrun: a configuration error is one line from one rank, --help
shows the defaults (issue 12: a bad config printed about 150 lines, a traceback per rank)."""

import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


SCRIPT = ROOT / "examples" / "train_gpt.py"
SMALL = ("--steps", "1", "--batch-size", "4", "--block-size", "16", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
         "--sample", "0")


def _entry():
    """The script's ``entry()`` (what ``python train_gpt.py`` runs), in this process."""
    entry = runpy.run_path(str(SCRIPT), run_name="_shardlib_test_script")["entry"]
    with warnings.catch_warnings():  # torchrun's @record cannot enable faulthandler on captured stderr: harmless
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        return entry()


def _train_gpt(tmp_path, monkeypatch, capsys, *args, nproc=2):
    """train_gpt.py with ``args`` under torchrun on ``nproc`` ranks; ``nproc=None``: its ``entry()``
    in this process, as ``python train_gpt.py`` runs it (these errors come at parse time, before
    torch.distributed starts; a python start is 2-3 s of the suite)."""
    if nproc is None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(SCRIPT), *SMALL, *args])
        for name in ("SHARDLIB_TRACEBACK", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        rc = _entry()
        out = capsys.readouterr()
        return subprocess.CompletedProcess([str(SCRIPT)], rc, out.out, out.err)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT),
           *SMALL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SHARDLIB_TRACEBACK", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("args,message,nproc", [
    (("--zero-stage", "5"), "train_gpt.py: error: argument --zero-stage: invalid choice: 5", 2),
    (("--val-files", "hamlet.txt"), "held-out files hamlet.txt (--val-files) name files of a --data folder", 2),
    (("--mesh", "dp=1,tp=2", "--n-head", "1"), "ShardingError: attention blocks.0.attn", 2),
    # found by a review: these crashed after training, with a traceback per rank, or misled; they
    # take the parse-time path (p.error, before torch.distributed starts) that --zero-stage shows
    # under torchrun above: the script's entry() in this process (a torchrun launch is 4-5 s of the suite)
    (("--eval-only",), "--eval-only evaluates a trained model: it needs --resume CHECKPOINT", None),
    (("--steps", "0"), "argument --steps: expected a positive integer, got 0", None),
    (("--n-layer", "0"), "argument --n-layer: expected a positive integer, got 0", None),
    (("--mesh", "dp=2,dp=1"), "argument --mesh: 'dp=2,dp=1': axis 'dp' is given twice", None),  # now at parse time
])
def test_a_configuration_error_prints_one_line_from_one_rank(tmp_path, monkeypatch, capsys, args, message, nproc):
    out = _train_gpt(tmp_path, monkeypatch, capsys, *args, nproc=nproc)
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if line.startswith("train_gpt.py: error")]
    assert len(ours) == 1 and message in ours[0], out.stderr[-3000:]
    assert "Fix:" in ours[0] or "see --help" in ours[0] or "--mesh" in ours[0] or "--resume" in ours[0]
    # no rank's traceback and no recorded error file (torchrun's own ChildFailedError summary remains)
    assert "[rank" not in out.stderr and 'train_gpt.py", line' not in out.stderr, out.stderr[-3000:]
    if nproc:
        assert "error_file: <N/A>" in out.stderr
    else:
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len((out.stdout + out.stderr).splitlines()) < 60, out.stdout + out.stderr


def test_help_shows_the_defaults(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--help"])
    assert _entry() is None  # torchrun's @record turns --help's SystemExit(0) into None: sys.exit(None), status 0
    out = capsys.readouterr()
    text = " ".join(out.out.split())
    assert "--zero-stage {0,1,2,3} (default: 3)" in text and "--lr LR (default: 0.002)" in text
    assert "--dropout DROPOUT (default: 0.0)" in text  # a zero default is a default (0.0 == False)
    assert "../shared" not in out.out


def test_main_guard_lets_other_errors_through_and_honours_shardlib_traceback(monkeypatch):
    from shardlib.cli import main_guard
    from shardlib.errors import ShardingError

    def bad():
        raise ShardingError("bad spec. Fix: another")

    assert main_guard(bad, prog="x") == 2
    monkeypatch.setenv("SHARDLIB_TRACEBACK", "1")
    with pytest.raises(ShardingError):
        main_guard(bad, prog="x")

    def crash():
        raise RuntimeError("a bug, not a configuration")

    with pytest.raises(RuntimeError):
        main_guard(crash, prog="x")
