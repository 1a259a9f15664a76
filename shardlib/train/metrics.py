"""What a run reports: a line every ``log_interval`` steps, a JSONL metrics file, TensorBoard
scalars, and a progress bar on a terminal (rank 0 only).

Each record is one JSON object per line of ``<out_dir>/metrics.jsonl``, written (and flushed) as
training goes, so a run stopped midway leaves every step it logged; ``python -m shardlib.plot``
draws it. Keys: ``step`` (optimizer steps done), ``loss`` (mean over the global batch, nats per
token), ``lr``, ``grad_norm`` (global L2 norm before clipping), ``tokens_per_s`` (all ranks
together), ``mfu`` (model FLOPs utilization, a fraction; None without a known peak),
``peak_mem_mb`` (MiB: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak resident
set on CPU), and ``val_loss`` (None but on evaluation steps).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, TextIO

import torch

__all__ = ["MetricsLog", "peak_memory_mb", "format_line"]


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: allocated CUDA memory on a CUDA device (since the
    last ``torch.cuda.reset_peak_memory_stats``), else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def format_line(record: dict[str, Any], steps: int) -> str:
    """One human-readable line of a record, e.g.
    ``step   20/200 | loss 2.8431 | lr 9.80e-04 | grad norm 0.912 | 12,345 tok/s | MFU n/a | peak 123 MiB``."""
    width = len(str(steps))
    parts = [f"step {record['step']:>{width}}/{steps}", f"loss {record['loss']:.4f}"]
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    parts.append(f"lr {record['lr']:.2e}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3f}")
    if record.get("loss_scale") is not None:
        parts.append(f"loss scale {record['loss_scale']:g}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    parts.append("MFU n/a" if record.get("mfu") is None else f"MFU {100 * record['mfu']:.1f}%")
    parts.append(f"peak {record['peak_mem_mb']:,.0f} MiB")
    return " | ".join(parts)


class MetricsLog:
    """Rank 0's reporting of a run (on other ranks every method does nothing).

    Args:
        out_dir: the folder of ``metrics.jsonl`` and the TensorBoard events (made if missing);
            None: no files.
        steps: the run's total steps (for the line and the bar).
        log_interval: print a line every this many steps (and at the last step).
        active: whether this rank reports (rank 0).
        tensorboard: write TensorBoard scalars when ``torch.utils.tensorboard`` can be imported
            (the ``tensorboard`` package); without it a note says so once.
        resume_from: the step a resumed run starts after; the file is appended to, its records of
            later steps (the run repeats them) left out first (rewritten aside, then renamed; a
            last record cut short by a killed run is dropped), and TensorBoard purges those steps.
        stream: where lines go (default ``sys.stdout``); the bar draws only when it is a terminal.

    Raises:
        FileExistsError: ``out_dir`` already holds a ``metrics.jsonl`` of another run and this is
            not a resume (the file is never replaced).
        ValueError: on a resume, a line of the file before its last is not a record.
    """

    def __init__(self, out_dir: str | None, steps: int, log_interval: int, active: bool, tensorboard: bool = True,
                 resume_from: int | None = None, stream: TextIO | None = None):
        self.steps, self.log_interval, self.active = steps, log_interval, active
        self.stream = stream or sys.stdout
        self.path = os.path.join(out_dir, "metrics.jsonl") if out_dir else None
        self._file = self._tb = self._bar = None
        if not active:
            return
        if self.path:
            os.makedirs(out_dir, exist_ok=True)
            kept = self._kept_records(resume_from)
            if kept is not None:  # a resume: the kept records, written aside and renamed over the file
                with open(self.path + ".tmp", "w") as f:
                    f.writelines(kept)
                os.replace(self.path + ".tmp", self.path)
            self._file = open(self.path, "a" if kept is not None else "x")
            if tensorboard:
                self._tb = _summary_writer(out_dir, self.stream, None if resume_from is None else resume_from + 1)
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=resume_from or 0, dynamic_ncols=True, leave=False)

    def _kept_records(self, resume_from: int | None) -> list[str] | None:
        """Lines of an existing file to keep on a resume (steps up to ``resume_from``); None: no file."""
        if not os.path.exists(self.path):
            return None
        if resume_from is None:
            raise FileExistsError(f"{self.path} already exists (an earlier run's metrics); this run does not replace "
                                  f"it. Fix: --set train.out_dir=ANOTHER_FOLDER, or resume that run "
                                  f"(--set checkpoint.resume=True)")
        kept = []
        with open(self.path) as f:
            lines = f.readlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                if n == len(lines):  # a record cut short when the run was killed: dropped
                    break
                raise ValueError(f"{self.path}:{n} is not a metrics record: {line[:80]!r}") from None
            if step <= resume_from:
                kept.append(line if line.endswith("\n") else line + "\n")
        return kept

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (one step) to the file and TensorBoard; print its line every
        ``log_interval`` steps, at an evaluation and at the last step; advance the bar."""
        if not self.active:
            return
        step = record["step"]
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, step)
        if step % self.log_interval == 0 or step == self.steps or record.get("val_loss") is not None:
            self.write(format_line(record, self.steps))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.3f}")

    def write(self, text: str) -> None:
        """Print ``text`` on rank 0 (above the bar when there is one)."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the bar, the file and the TensorBoard writer."""
        for thing in (self._bar, self._file, self._tb):
            if thing is not None:
                thing.close()
        self._bar = self._file = self._tb = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _summary_writer(out_dir: str, stream: TextIO, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        print("metrics: TensorBoard scalars off (pip install tensorboard to write them)", file=stream, flush=True)
        return None
    # purge_step: a resumed run hides the events of the steps it repeats
    return SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"), purge_step=purge_step)
