"""The training tool's checkpoints: a folder of ``step_NNNNNN`` sharded checkpoints
(:mod:`shardlib.checkpoint`), saved every ``checkpoint.interval`` steps and at the end, the last
``checkpoint.keep_last`` kept, and ``checkpoint.resume`` continuing from the newest.

Nothing the tool did not write is deleted: a ``checkpoint.dir`` that already holds anything is
refused at start unless the run resumes from it, and the rotation removes only finished shardlib
checkpoints named ``step_NNNNNN`` (:func:`shardlib.checkpoint.remove`).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from .. import checkpoint
from ..config import Config, ConfigError

__all__ = ["Checkpoints"]

_NAME = re.compile(r"^step_(\d{6,})$")


class Checkpoints:
    """Where a run's checkpoints go, which one it resumes from, and which it removes.

    Args:
        section: the config's ``checkpoint`` section (``dir``, ``interval``, ``keep_last``, ``resume``).
        steps: the run's total steps (a checkpoint is saved after the last one).

    Raises:
        ConfigError: at construction (every rank, before any communication): ``checkpoint.dir``
            is a file or blank, or holds entries and ``checkpoint.resume`` is False; ``resume``
            without a ``dir``; ``interval`` set without a ``dir``.
    """

    def __init__(self, section: Config, steps: int):
        self.dir, self.interval, self.keep_last, self.resume = section.dir, section.interval, section.keep_last, section.resume
        self.steps = steps
        if self.dir is not None and not str(self.dir).strip():  # (--set checkpoint.dir=$UNSET saved nothing)
            raise ConfigError(f"config key 'checkpoint.dir' is {self.dir!r}: a folder, or None for no checkpoints")
        if self.dir is None:
            if self.resume or self.interval:
                key = "resume" if self.resume else "interval"
                raise ConfigError(f"config key 'checkpoint.{key}' is set but 'checkpoint.dir' is None. Fix: --set "
                                  f"checkpoint.dir=FOLDER")
            return
        self.dir = os.path.expanduser(self.dir)
        if os.path.lexists(self.dir) and not os.path.isdir(self.dir):
            raise ConfigError(f"config key 'checkpoint.dir' is {self.dir!r}, which is a file, not a folder")
        from ..checkpoint._files import check_parent

        try:  # at start, not at the first save
            check_parent(os.path.join(self.dir, "step_000000"), "config key 'checkpoint.dir'")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        from ..checkpoint._shared import PROBE

        # (a probe of check_shared_folder left by a run stopped at start is ours: not an entry)
        names = sorted(n for n in (os.listdir(self.dir) if os.path.isdir(self.dir) else []) if not n.startswith(PROBE + "-"))
        if self.resume:
            self._check_resume_folder(names)
        if names and not self.resume:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(f"config key 'checkpoint.dir' is {self.dir!r}, which already holds {shown} (an earlier "
                              f"run?): this run's checkpoints would replace or mix with them. Fix: --set "
                              f"checkpoint.resume=True to continue that run, or another checkpoint.dir")

    def _check_resume_folder(self, names: list[str]) -> None:
        """``resume`` from a folder that is a checkpoint itself, or that holds only entries the
        tool did not write: nothing to resume from, so the run would start at step 0 and put its
        checkpoints in there (inside a checkpoint, which keep_last then can no longer remove).

        Raises:
            ConfigError: either case, naming the folder and what it holds."""
        from ..checkpoint._files import OLD, PARTIAL

        if os.path.lexists(os.path.join(self.dir, checkpoint.MARKER)):
            parent = os.path.dirname(os.path.normpath(self.dir)) or "."
            raise ConfigError(
                f"config key 'checkpoint.dir' is {self.dir!r}, which is a checkpoint itself, not a folder of them: "
                "checkpoint.resume would find none in it, start at step 0 and save inside it. Fix: --set "
                f"checkpoint.dir={parent} (resume takes the newest checkpoint there)")
        ours = [n for n in names if _NAME.match(n.removesuffix(PARTIAL).removesuffix(OLD))]
        if names and not ours:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(
                f"config key 'checkpoint.dir' is {self.dir!r}, which holds {shown} but no checkpoint of this tool "
                "(step_NNNNNN): checkpoint.resume has nothing to resume from, and this run's checkpoints would mix "
                "with those files. Fix: --set checkpoint.dir= an empty or new folder (or the folder of the run's "
                "step_NNNNNN checkpoints)")

    def latest(self, mesh: Any = None) -> str | None:
        """The checkpoint to resume from: the newest finished one in ``dir`` when ``resume``, else
        None; with ``mesh``, the same on every rank (:func:`shardlib.checkpoint.latest` refuses ranks
        that found different ones: ``dir`` on no shared file system)."""
        return checkpoint.latest(self.dir, mesh) if self.dir and self.resume else None

    def due(self, step: int) -> bool:
        """Whether to save after optimizer step ``step`` (1-based): every ``interval``, and the last."""
        return bool(self.dir) and (step == self.steps or (self.interval > 0 and step % self.interval == 0))

    def save(self, step: int, smodel: Any, optimizer: Any, extra: dict, is_main: bool) -> str:
        """Save after ``step`` (every rank), then on rank 0 remove the oldest of this folder's
        ``step_*`` checkpoints beyond ``keep_last`` (0 keeps all; one holding files the tool did
        not write is kept, with a warning). A checkpoint of the same step
        is replaced only on a resumed run (it repeats the steps after the one it resumed from)."""
        path = os.path.join(self.dir, f"step_{step:06d}")
        if not self.resume and os.path.lexists(os.path.join(path, checkpoint.MARKER)):  # every rank sees it
            raise checkpoint.CheckpointError(
                f"checkpoint.dir {self.dir!r} holds step_{step:06d}, which this run (started on an empty folder, "
                "without resume) did not write: another run saves into the same folder. It is kept. Fix: give each "
                "run its own checkpoint.dir")
        checkpoint.save(path, smodel, optimizer, extra=extra, overwrite=self.resume)
        if is_main and self.keep_last:
            for old in self.saved()[:-self.keep_last]:
                try:
                    checkpoint.remove(old)
                except checkpoint.CheckpointError as exc:  # a user's file put inside it: kept, training goes on
                    warnings.warn(f"checkpoint.keep_last: {exc}", stacklevel=2)
        return path

    def saved(self) -> list[str]:
        """The finished ``step_NNNNNN`` checkpoints in ``dir``, oldest step first."""
        found = []
        for name in os.listdir(self.dir):
            match = _NAME.match(name)
            if match and os.path.exists(os.path.join(self.dir, name, checkpoint.MARKER)):
                found.append((int(match.group(1)), os.path.join(self.dir, name)))
        return [p for _, p in sorted(found)]
