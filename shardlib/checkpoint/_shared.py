"""One checkpoint folder that every rank sees: the checks that the ranks name the same folder
and find the same thing in it, each one object exchange (``all_gather_object``), so that ranks
that disagree are refused together instead of writing or reading apart.

DCP (``torch.distributed.checkpoint``) writes one folder from every rank and reads it from every
rank: it needs the folder on a file system the ranks share (NFS, Lustre, a node's own disk only
when every rank is on that node). On a cluster without one, each node's ranks wrote into their
own disk's copy of the path: every save reported success and rank 0's folder was marked
complete without the other node's data files; a resume found a checkpoint on one node and none
on the other, and the ranks went separate ways until the watchdog (found by a new-user pass).
"""

from __future__ import annotations

import json
import os
import torch.distributed as dist

from ._files import OWNER, CheckpointError, agree, describe, short_error

__all__ = ["same_folder", "seen_by_every_rank", "same_checkpoint", "same_latest", "check_shared_folder"]

SHARED_FS = ("A checkpoint folder must be on a file system every rank shares (NFS, Lustre, ...; DCP writes and "
             "reads one folder from every rank)")


def same_folder(path: str, mesh, fn: str) -> None:
    """Every rank names the same folder, checked in one exchange (which also serves as the
    barrier before the first write). Ranks that computed the path each on their own (a
    timestamp a second apart, their own newest checkpoint) wrote a checkpoint marked complete
    without some ranks' data files, or loaded a model mixed from two checkpoints, silently
    (found by a new user).

    Raises:
        CheckpointError: on every rank, naming each rank's folder.
        CollectiveError: a peer lost while exchanging (the watchdog's)."""
    paths = agree({dist.get_rank(): path}, mesh, f"checkpoint.{fn}: after checking the paths")
    _refuse_other_paths(paths, fn)


def _refuse_other_paths(paths: dict[int, str], fn: str) -> None:
    if len(set(paths.values())) > 1:
        shown = ", ".join(f"rank {r}: {p!r}" for r, p in sorted(paths.items())[:8])
        raise CheckpointError(
            f"checkpoint.{fn}: the ranks name different folders ({shown}{', ...' if len(paths) > 8 else ''}): a "
            f"checkpoint is one folder that every rank {'writes' if fn == 'save' else 'reads'} together. Nothing was "
            f"{'written' if fn == 'save' else 'read'}. Fix: compute the path once (on rank 0, then broadcast it), or "
            "from what every rank shares (the step)")


def seen_by_every_rank(tmp: str, mesh, note: str) -> None:
    """Save, after rank 0 made ``tmp`` (``<path>.partial``) with its ownership file: every rank
    reads that file (it holds a random token of this save), and the ranks compare what they read
    in one exchange.

    Raises:
        CheckpointError: on every rank, naming the ranks that do not see rank 0's folder; nothing
            was written but rank 0's empty ``tmp`` (the next save to the path removes it).
        CollectiveError: a peer lost while exchanging."""
    blind = _unseen(os.path.join(tmp, OWNER), mesh, note, "no folder made by rank 0",
                    "an older folder, not the one rank 0 just made")
    if blind:
        raise CheckpointError(
            f"checkpoint.save: not every rank sees the folder rank 0 made, {tmp!r} ({describe(blind)}): the ranks do "
            f"not share a file system there, and each would write its part to its own disk. {SHARED_FS}. Nothing was "
            "written. Fix: a checkpoint directory on a shared file system")


def _unseen(path: str, mesh, note: str, missing: str, other: str) -> dict[int, str]:
    """Every rank reads the file ``path`` rank 0 just wrote (its content is unique: a random token),
    and the ranks compare in one exchange. Returns ``{rank: why}`` for the ranks that read
    something else than rank 0 (``missing (the error)``, or ``other``), every rank when rank 0
    read nothing."""
    try:
        with open(path) as f:
            seen = f.read()
    except OSError as exc:
        seen = f"{missing} ({short_error(exc)})"
    views = agree({dist.get_rank(): seen}, mesh, note)
    lost = views[0].startswith(f"{missing} (")
    return {r: (s if s.startswith(f"{missing} (") else other) for r, s in views.items() if lost or s != views[0]}


def same_checkpoint(path: str, mesh, info: dict) -> None:
    """Load, after this rank's own checks of ``path`` passed (before any communication, so bad
    input is refused on every rank that sees it; a rank that does not see the checkpoint at all
    fails there, and its peers' wait names it) and before reading: the ranks compare the path and
    the checkpoint's marker ``info`` in one exchange.

    Raises:
        CheckpointError: on every rank: different paths (named per rank); ranks that see
            different checkpoints at ``path`` (another save of it, on a disk of their own).
        CollectiveError: a peer lost while exchanging."""
    seen = (f"a checkpoint saved at {info.get('time')}", json.dumps(info, sort_keys=True, default=str))
    views = agree({dist.get_rank(): (path, seen)}, mesh, "checkpoint.load: after checking the paths")
    _refuse_other_paths({r: p for r, (p, _) in views.items()}, "load")
    if len({s for _, s in views.values()}) > 1:
        raise CheckpointError(
            f"checkpoint.load({path!r}): the ranks see different checkpoints there "
            f"({describe({r: s[0] for r, (_, s) in views.items()})}): the ranks do not share a file system there. "
            f"{SHARED_FS}. Nothing was read. Fix: a checkpoint directory on a shared file system")


def same_latest(folder: str, found: str | None, mesh) -> str | None:
    """:func:`~shardlib.checkpoint.latest` with a mesh: the ranks compare the newest checkpoint each
    found in ``folder`` (``found``) in one exchange.

    Raises:
        CheckpointError: on every rank, naming what each rank found.
        CollectiveError: a peer lost while exchanging."""
    seen = agree({dist.get_rank(): (folder, found)}, mesh, "checkpoint.latest: after finding the newest checkpoint")
    if len(set(seen.values())) > 1:
        shown = {r: (f"{f!r} in {d!r}" if f is not None else f"none in {d!r}") for r, (d, f) in seen.items()}
        raise CheckpointError(
            f"checkpoint.latest: the ranks found different newest checkpoints ({describe(shown)}), so a resume would "
            f"load on some ranks and start afresh on others. {SHARED_FS}. Nothing was read. Fix: a checkpoint "
            "directory on a shared file system, named the same on every rank")
    return found


PROBE = ".shardlib_probe"  # check_shared_folder's file: written and removed by rank 0 of one run


def check_shared_folder(folder: str, mesh, what: str = "checkpoint.dir") -> None:
    """Before a run's first save (the training tool, at start): rank 0 makes ``folder`` if absent
    and writes a file with a random token into it, every rank reads it, the ranks compare in one
    exchange, and rank 0 removes the file. A folder on each node's own disk is refused at once,
    not at the first save after ``checkpoint.interval`` steps.

    Raises:
        CheckpointError: on every rank, naming ``what``, ``folder`` and the ranks that do not see
            rank 0's file.
        CollectiveError: a peer lost while exchanging."""
    probe = os.path.join(folder, f"{PROBE}-{os.getpid()}")
    made = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "x") as f:
                f.write(os.urandom(8).hex())
            made = probe
        except OSError:  # then rank 0 reads no file either: every rank is named below
            pass
    try:  # (the exchange of rank 0's probe path is also the barrier before the others read it)
        probe0 = agree({dist.get_rank(): probe}, mesh, f"{what}: after writing the probe")[0]
        blind = _unseen(probe0, mesh, f"{what}: after reading the probe", "no file", "another file")
    finally:
        if made is not None:  # ours alone: written above, by this process
            try:
                os.remove(made)
            except OSError:
                pass
    if blind:
        raise CheckpointError(
            f"{what} {folder!r}: not every rank sees the file rank 0 wrote there ({describe(blind)}): the ranks do not "
            f"share a file system at that path, and checkpoints saved there could never be loaded. {SHARED_FS}. "
            "Fix: a checkpoint directory on a shared file system")
