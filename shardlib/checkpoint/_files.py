"""The files of a checkpoint: what is at a path, what save() may replace, and failing together.

A folder is ours when it holds a readable ``shardlib_checkpoint.json`` (a finished checkpoint)
or, for the unfinished save in ``<path>.partial``, the ownership file ``.shardlib_partial.json``
written when that folder was made. :func:`check_save_target` refuses, on every rank and before
any write or communication, whatever save() would replace that is not ours (a user's folder or
file, a link), and a finished checkpoint unless ``overwrite=True``. :func:`agree` turns a failure
on one rank into the same error on every rank: all ranks exchange their error (or None) where
the old code had a bare barrier, so no rank waits for the collective timeout. :func:`watched`
runs these exchanges and DCP's own collectives under the watchdog: a rank killed or frozen
mid-save or mid-load is named by the others within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from ..errors import ShardingError

__all__ = ["CheckpointError", "MARKER", "PARTIAL", "OLD", "read_marker", "check_save_target", "check_parent",
           "prepare_partial", "finish_partial", "remove_checkpoint", "agree", "watched", "failure_of", "describe", "short_error", "Reader"]

MARKER = "shardlib_checkpoint.json"  # written last: its presence means the save finished
OWNER = ".shardlib_partial.json"  # written first into <path>.partial: the folder is ours to remove
PARTIAL, OLD = ".partial", ".old"
_SHOWN = 5  # entries of a folder named in a message
_DETAIL = 300  # characters of an underlying error kept in a message


class CheckpointError(ShardingError):
    """A checkpoint that cannot be saved or loaded here: a path that holds something else,
    missing, unfinished, damaged, or not matching the model.

    Raised on every rank: before any communication where every rank sees the same files, and
    through an exchange of errors for a failure on one rank while writing or reading."""


def short_error(exc: BaseException) -> str:
    """``"Type: message"`` on one line, the message cut to a few hundred characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:_DETAIL] + ' ...' if len(text) > _DETAIL else text}"


# -- what is at a path -------------------------------------------------------------------------

def _load_marker(path: str) -> tuple[dict | None, str | None]:
    """``(marker, None)`` or ``(None, what is wrong with it)``."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            info = json.load(f)
        if not isinstance(info, dict) or not isinstance(info.get("format"), int):
            raise ValueError(f"expected a JSON object with an integer 'format', got {str(info)[:80]!r}")
        if not isinstance(info.get("time", 0), (int, float)):
            raise ValueError(f"'time' is {info['time']!r}, not a number")
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, short_error(exc)
    return info, None


def read_marker(path: str) -> dict:
    """The ``shardlib_checkpoint.json`` of the checkpoint folder ``path``.

    Raises:
        CheckpointError: the file cannot be read or is not a marker save() wrote (damaged),
            naming the file and the checkpoint.
    """
    info, problem = _load_marker(path)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {path!r} is damaged: its file {MARKER!r} (written by save() when the checkpoint was "
            f"finished) cannot be read ({problem}). Load an earlier checkpoint")
    return info


def _listing(folder: str) -> str:
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        return f"its entries cannot be listed ({short_error(exc)})"
    if not names:
        return "it is empty"
    shown = ", ".join(n + ("/" if os.path.isdir(os.path.join(folder, n)) else "") for n in names[:_SHOWN])
    return f"it holds {shown}" + (f" ({len(names)} entries)" if len(names) > _SHOWN else "")


def _what(p: str) -> tuple[str, str]:
    """``(kind, description)`` of what is at ``p``; kind is ``"none"``, ``"checkpoint"`` (a
    finished one of ours), ``"unfinished"`` (a ``.partial`` folder we made) or ``"other"``."""
    if not os.path.lexists(p):
        return "none", "nothing"
    if os.path.islink(p):
        return "other", f"a symbolic link to {os.readlink(p)!r}"
    if not os.path.isdir(p):
        if os.path.isfile(p):
            return "other", f"a file ({os.path.getsize(p):,} bytes)"
        return "other", "neither a file nor a folder"
    if os.path.lexists(os.path.join(p, MARKER)):
        problem = _load_marker(p)[1]
        if problem is not None:
            return "other", f"a folder whose {MARKER} cannot be read ({problem})"
        return "checkpoint", "a finished shardlib checkpoint"
    if os.path.isfile(os.path.join(p, OWNER)):
        return "unfinished", "an unfinished shardlib save"
    return "other", f"a folder that is not a shardlib checkpoint (it has no {MARKER}; {_listing(p)})"


def check_parent(path: str, caller: str) -> None:
    """Refuse ``path`` whose nearest existing ancestor is not a writable folder.

    Raises:
        CheckpointError: naming ``caller``, the ancestor and what it is.
    """
    parent = os.path.dirname(os.path.abspath(path))  # a relative path's top folder may not exist yet
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = _what(parent)[1]
        raise CheckpointError(f"{caller}: cannot write {path!r}: its parent {parent!r} is {what}, not a folder. "
                              f"Fix: choose a path inside a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{caller}: cannot write {path!r}: the folder {parent!r} is not writable by this "
                              f"process. Fix: choose a path in a folder you can write, or change its permissions")


def check_save_target(path: str, overwrite: bool) -> None:
    """What checkpoint.save(path, overwrite=overwrite) would replace, checked on every rank
    before any write or communication (every rank sees the same files, so every rank raises).

    Accepted: nothing at ``path``, or a finished checkpoint with ``overwrite``; at
    ``<path>.partial`` nothing, an unfinished save of ours, or with ``overwrite`` a finished one
    (a save stopped while renaming); at ``<path>.old`` nothing, or with ``overwrite`` a finished
    checkpoint (the one a stopped save was replacing).

    Raises:
        CheckpointError: anything else, naming the path and what is there.
    """
    caller = f"checkpoint.save({path!r})"
    check_parent(path, caller)
    found = {p: _what(p) for p in (path, path + PARTIAL, path + OLD)}
    kind, what = found[path]
    if kind == "checkpoint" and not overwrite:
        raise CheckpointError(f"{caller}: {path!r} already holds a finished shardlib checkpoint; save() replaces one "
                              f"only when asked. Fix: pass overwrite=True to replace it, or choose another path")
    if kind not in ("none", "checkpoint"):
        raise CheckpointError(f"{caller}: {path!r} is {what}; save() writes a checkpoint folder there and never "
                              f"replaces what it did not write. Fix: choose another path, or move it away")
    for folder, (kind, _) in found.items():
        foreign = _foreign_entries(folder) if kind in ("checkpoint", "unfinished") else []
        if foreign:  # overwrite replaces a checkpoint, not the user's files put inside it
            raise CheckpointError(
                f"{caller}: the checkpoint {folder!r} also holds {', '.join(foreign[:4])}"
                f"{', ...' if len(foreign) > 4 else ''}, which save() did not write; replacing the checkpoint would "
                f"delete them. Fix: move them out of the checkpoint folder, or choose another path")
    kind, what = found[path + PARTIAL]
    if kind == "checkpoint" and not overwrite:
        raise CheckpointError(
            f"{caller}: {path + PARTIAL!r} holds a finished checkpoint that was not renamed (a save stopped while "
            f"renaming). Fix: rename it to {path!r} to keep it, or pass overwrite=True to replace it")
    if kind == "other":
        raise CheckpointError(
            f"{caller}: {path + PARTIAL!r} is {what}; save() writes its unfinished saves there and removes only "
            f"folders it made (they hold {OWNER}). Fix: move it away, or choose another path")
    kind, what = found[path + OLD]
    if kind == "checkpoint" and not overwrite:
        raise CheckpointError(
            f"{caller}: {path + OLD!r} holds the checkpoint an earlier save was replacing (it stopped while renaming). "
            f"Fix: rename it back to {path!r} to keep it, or pass overwrite=True to replace it")
    if kind not in ("none", "checkpoint"):
        raise CheckpointError(
            f"{caller}: {path + OLD!r} is {what}; save() moves the checkpoint it replaces there and removes only "
            f"checkpoints. Fix: move it away, or choose another path")


def _foreign_entries(folder: str) -> list[str]:
    """Entries of a checkpoint folder that save() never writes (DCP's ``.metadata`` and
    ``*.distcp``, the marker, the ownership file), sorted; [] if the folder is absent."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return []
    ours = {".metadata", MARKER, OWNER, MARKER + ".tmp"}
    return sorted(n for n in os.listdir(folder) if n not in ours and not n.endswith(".distcp"))


def remove_checkpoint(path: str) -> None:
    """Delete the finished checkpoint folder ``path`` (one process: rank 0).

    Raises:
        CheckpointError: ``path`` is not a finished shardlib checkpoint (a user's folder or file, a
            link, an unfinished save), or holds entries save() did not write; nothing is deleted.
    """
    kind, what = _what(path)
    if kind != "checkpoint":
        raise CheckpointError(f"checkpoint.remove({path!r}): it is {what}; only a finished shardlib checkpoint is "
                              f"removed")
    foreign = _foreign_entries(path)
    if foreign:
        raise CheckpointError(f"checkpoint.remove({path!r}): the checkpoint also holds {', '.join(foreign[:4])}"
                              f"{', ...' if len(foreign) > 4 else ''}, which save() did not write; it is kept. Fix: "
                              f"move them out to let it be removed")
    os.remove(os.path.join(path, MARKER))  # first: a removal stopped midway leaves no loadable-looking folder
    shutil.rmtree(path)


# -- rank 0's folder work -----------------------------------------------------------------------

def prepare_partial(path: str) -> None:
    """Rank 0: an empty ``<path>.partial`` holding the ownership file (an unfinished save of
    ours there, checked by :func:`check_save_target`, is removed first)."""
    tmp = path + PARTIAL
    if _what(tmp)[0] in ("unfinished", "checkpoint"):  # ours: an earlier save that did not finish
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, OWNER), "w") as f:
            json.dump(dict(writer="shardlib", target=path, time=time.time(), token=os.urandom(8).hex()), f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # just made, without the file that makes it ours
        raise


def finish_partial(path: str, info: dict) -> None:
    """Rank 0, after every rank wrote its data: write the marker, then move ``<path>.partial``
    to ``path`` (a checkpoint there goes to ``<path>.old`` first, and is removed after)."""
    tmp, old = path + PARTIAL, path + OLD
    with open(os.path.join(tmp, MARKER + ".tmp"), "w") as f:
        json.dump(info, f, indent=1)
    os.replace(os.path.join(tmp, MARKER + ".tmp"), os.path.join(tmp, MARKER))
    moved = False
    if os.path.lexists(path):  # a finished checkpoint, and overwrite=True (checked before)
        if _what(old)[0] == "checkpoint":
            shutil.rmtree(old)
        os.rename(path, old)
        moved = True
    try:
        os.rename(tmp, path)
    except OSError:
        if moved:
            os.rename(old, path)  # put the previous checkpoint back
        raise
    if _what(old)[0] == "checkpoint":  # the one replaced (overwrite=True)
        shutil.rmtree(old, ignore_errors=True)


# -- failing together --------------------------------------------------------------------------

def failure_of(exc: BaseException) -> dict[int, str]:
    """``{rank: description}`` of an exception: DCP's ``CheckpointException`` carries every
    failing rank's (the same on each rank); any other is this rank's."""
    if isinstance(exc, CheckpointException):
        return {r: (str(e) if isinstance(e, CheckpointError) else short_error(e)) for r, (e, _) in exc.failures.items()}
    return {dist.get_rank(): str(exc) if isinstance(exc, CheckpointError) else short_error(exc)}


def describe(failures: dict[int, str]) -> str:
    """``"rank 1: OSError: ..."``; ranks with the same description are named together."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(failures.items()):
        by_text.setdefault(text, []).append(rank)
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {t}" for t, r in by_text.items())


def watched(mesh, kind: str, note: str, fn, shape: tuple = (), dtype: str = ""):
    """``fn()``, blocking ``torch.distributed`` calls (DCP's, an object exchange), on gloo under
    the watchdog of ``mesh`` (:meth:`~shardlib.mesh.watchdog.Watchdog.call`): recorded in the
    collective trace as ``kind`` with ``note``, ``shape`` and ``dtype`` (the same on every rank),
    so that a peer killed or frozen meanwhile is named (a
    :class:`~shardlib.errors.RankFailureError`) within ``SHARDLIB_WATCHDOG`` seconds, not after
    the collective timeout. On NCCL, or without a mesh, ``fn()`` runs as it is (NCCL's own
    watchdog bounds its collectives).

    An ``Exception`` of ``fn`` counts as a failed collective and is diagnosed: DCP's ``save`` and
    ``load`` raise the failures of their ranks' own work (a write, a read, a plan) as a
    ``CheckpointException``, a ``BaseException``, on every rank, which is re-raised as it is; what
    else they raise comes from a collective that failed (gloo's "Connection closed by peer").

    Raises:
        CollectiveError: a peer is lost (gone or frozen), or the ranks diverged.
        CheckpointException: DCP's, as ``fn`` raised it.
    """
    dog = mesh.watchdog if mesh is not None and mesh.backend == "gloo" else None
    if dog is None:
        return fn()
    trace = mesh.trace
    rec = trace.record(kind, trace.label(mesh, mesh.axis_names, 0), shape, dtype, note)
    return dog.call(fn, rec, mesh.timeout, collective=True)


def agree(failure: dict[int, str] | None, mesh=None, note: str = "") -> dict[int, str]:
    """Exchange this rank's failures (or None) with every rank (a collective: every rank calls
    it at the same point); returns every rank's failures merged, the same dict on each rank.
    With ``mesh`` (gloo), a lost peer raises a CollectiveError naming it (see :func:`watched`)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    watched(mesh, "all_gather_object", note, lambda: dist.all_gather_object(gathered, failure),
            shape=(len(gathered),), dtype="object")
    merged: dict[int, str] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


class Reader(FileSystemReader):
    """DCP's file-system reader; a data file that cannot be read raises a :class:`CheckpointError`
    naming it (DCP's own error names neither the file nor the checkpoint)."""

    def read_data(self, plan, planner) -> Future:
        import dataclasses

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:  # noqa: BLE001 - a damaged or missing file, named
                raise CheckpointError(f"its data file {name!r} cannot be read ({short_error(exc)})") from None
        done: Future = Future()
        done.set_result(None)
        return done
