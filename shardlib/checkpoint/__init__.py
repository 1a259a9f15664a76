"""Sharded checkpoints with resharding, on ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the elements it owns, as boxes (rectangular blocks) of the *global*
tensors under the original parameter names; DCP records every box in its metadata, and a load
on any mesh and plan reads, for each box the new rank holds, the overlapping parts of the saved
boxes. So a checkpoint from ``dp=2, tp=2`` loads into ``dp=3`` or ``pp=2, dp=2``.

Layout (``_layout``). Under ZeRO (arXiv 1910.02054) a rank owns a contiguous range of each flat
chunk, i.e. for each parameter a contiguous range of its row-major, tensor-parallel local tensor,
itself a ``torch.chunk`` block of the global one (``k`` blocks for fused weights): at most
``2N - 1`` boxes of the N-d global tensor. Copies held by several ranks (data replicas at stage 0,
parameters replicated over ``tp``) give equal boxes, which DCP's save planner writes once; the
second copy of a parameter tied across pipeline stages is left out. DCP's global-plan validation
then checks that the boxes of every tensor neither overlap nor leave holes. Optimizer state
(per-element tensors such as AdamW's ``exp_avg``) is saved per original parameter with the same
boxes, so it reshards too.

Files (``_files``). ``save`` writes into ``<path>.partial`` (made by rank 0 with an ownership
file, ``.shardlib_partial.json``), then rank 0 adds ``shardlib_checkpoint.json`` and renames the
folder to ``<path>`` after every rank finished: a process killed mid-save leaves the previous
checkpoint untouched, and a folder without the json is refused by :func:`load`. ``save`` never
deletes or replaces what it did not write (a user's folder or file at ``<path>``,
``<path>.partial`` or ``<path>.old`` is refused before anything is written), and replaces a
finished checkpoint only with ``overwrite=True``. A failure on one rank while writing (rank 0's
folder, any rank's data files, rank 0's marker and renames) or reading (a damaged data file)
is the same :class:`CheckpointError` on every rank: the ranks exchange their errors at each step.
A rank killed or frozen while saving or loading is named by the others, a
:class:`~shardlib.errors.RankFailureError` within ``SHARDLIB_WATCHDOG`` seconds on gloo: those
exchanges and DCP's own collectives run under the watchdog (:func:`_files.watched`).

Keys: ``model.<name>`` (parameters and persistent buffers), ``optim.<name>.<state>``,
``optim.param_groups``, ``dropout.<module path>`` (counters of the mesh-independent dropout),
``rng.<rank>`` (torch CPU/CUDA generator states), ``extra`` (the caller's dict, from rank 0).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CollectiveError
from ..random import MeshDropout
from ..shard import ShardedModule
from ..full_state import data_root_buffers
from ..state_names import persistent_buffers
from ._export import export_safetensors
from ._files import (MARKER, OLD, PARTIAL, CheckpointError, Reader, agree, check_save_target, describe, failure_of,
                     finish_partial, prepare_partial, remove_checkpoint, read_marker, short_error, watched)
from ._fit import fit_problems
from ._shared import same_checkpoint, same_folder, same_latest, seen_by_every_rank
from ._layout import entries, global_pieces, load_targets, region
from ._planner import Boxes, LoadPlanner, SavePlanner
from ._optimizer import element_keys, element_states, inner_optimizer, optimizer_kind, optimizer_params, per_element

__all__ = ["save", "load", "export_safetensors", "latest", "remove", "CheckpointError", "MARKER"]

FORMAT_VERSION = 1


# -- what a rank writes and reads ------------------------------------------------------------------

def _dropouts(smodel: ShardedModule) -> dict[str, MeshDropout]:
    return {path: m for path, m in smodel.module.named_modules() if isinstance(m, MeshDropout)}


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _save_state(smodel: ShardedModule, optimizer, extra: dict | None) -> dict[str, Any]:
    zero, inner = smodel._zero, inner_optimizer(optimizer)
    updated = optimizer_params(smodel, inner) if inner is not None else {}
    sd: dict[str, Any] = {}
    for pp, name, prm, skip in entries(smodel):
        if skip:
            continue
        chunk = zero.param_chunk[id(prm)]
        a, b, flat = region(smodel, pp, chunk.shard)  # the master values (mixed precision)
        sd[f"model.{name}"] = Boxes(pp.global_shape, flat.dtype, global_pieces(smodel, pp, a, b, flat))
        if inner is None or not chunk.trainable:
            continue
        for key, state in inner.state.get(updated[chunk.index], {}).items():
            if per_element(state, chunk.opt_param):
                a, b, flat = region(smodel, pp, state)
                sd[f"optim.{name}.{key}"] = Boxes(pp.global_shape, state.dtype, global_pieces(smodel, pp, a, b, flat))
            elif isinstance(state, torch.Tensor) and state.dim() == 0:
                sd[f"optim.{name}.{key}"] = state.detach().clone()
            else:
                raise CheckpointError(
                    f"checkpoint.save: optimizer state {key!r} of {name} has shape "
                    f"{tuple(getattr(state, 'shape', ()))}, neither per element {tuple(chunk.opt_param.shape)} nor a "
                    f"scalar; only elementwise optimizers (AdamW, Adam, SGD) are supported")
    for name, buf in data_root_buffers(smodel).items():  # the first data rank's, every one of them
        sd[f"model.{name}"] = buf
    if inner is not None:
        sd["optim.param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    for path, drop in _dropouts(smodel).items():
        sd[f"dropout.{path}"] = drop.calls
    sd[f"rng.{dist.get_rank()}"] = _rng_state()
    if dist.get_rank() == 0:
        sd["extra"] = dict(extra or {})
    return sd


# -- public API --------------------------------------------------------------------------------

def save(path: str | os.PathLike, smodel: ShardedModule, optimizer: Any = None, extra: dict | None = None,
         overwrite: bool = False) -> str:
    """Write a sharded checkpoint of ``smodel`` (and ``optimizer``) to the folder ``path``.

    Collective: call on every rank with the same ``path`` (on a file system every rank sees).
    Each rank writes the parameter and optimizer-state elements it owns (its ZeRO shard of its
    tensor-parallel block; replicas are written once) as boxes of the global tensors under the
    original names, through DCP (``torch.distributed.checkpoint``). Also saved: persistent
    buffers, optimizer hyperparameters, the counters of the mesh-independent dropout, each rank's
    torch RNG states, and ``extra``.

    Atomic: written to ``<path>.partial``, renamed to ``path`` after every rank finished; a save
    killed midway leaves ``path`` as it was. Safe: nothing that save() did not write is deleted
    or replaced, and a finished checkpoint at ``path`` is replaced only with ``overwrite=True``
    (it is moved to ``<path>.old`` and removed once the new one is in place).

    Args:
        path: the checkpoint folder; it must not exist, or hold a finished shardlib checkpoint
            (replaced only with ``overwrite``). Missing parent folders are made.
        smodel: a module from :func:`shardlib.shard` (pipelines included).
        optimizer: its :class:`~shardlib.ZeroOptimizer` (per-element state such as AdamW's
            ``exp_avg`` ``(global shape)`` and scalar state such as ``step``), or None.
        extra: picklable values to restore with :func:`load` (step, data position, a
            :class:`~shardlib.GradScaler`'s ``state_dict()``, ...); rank 0's dict is the one saved.
        overwrite: replace a finished checkpoint at ``path`` (also one at ``<path>.partial`` or
            ``<path>.old`` that a save stopped while renaming left there).

    Returns:
        ``path`` as a string (absolute).

    Raises:
        TypeError: ``smodel`` is not sharded, or ``optimizer`` is not a ZeroOptimizer.
        CheckpointError: on every rank, before anything is written or communicated: ``path`` is
            a file, a link, a folder that is not a finished shardlib checkpoint, or a finished
            one without ``overwrite``; ``<path>.partial`` or ``<path>.old`` holds something save()
            did not write; the parent of ``path`` is a file or not writable; an optimizer state
            that is not per element or scalar. On every rank at once, before anything is
            written: the ranks name different folders; some ranks do not see the folder rank 0
            made (no shared file system: each node's ranks would write to their own disk). On
            every rank at once: a failure on any rank while
            writing (rank 0 making the folder, any rank's DCP write, rank 0's marker and renames),
            naming the ranks and their errors; ``path`` is then as it was, unless the message
            says otherwise.
        RankFailureError: on the ranks still running, when a rank is killed or frozen during the
            save (a :class:`~shardlib.errors.CollectiveError`: the process group is unusable; on
            gloo within ``SHARDLIB_WATCHDOG`` seconds). The message begins with
            ``checkpoint.save(path) stopped while <phase>``, names the lost rank, and ends with
            where the checkpoint and the previous one are.

    Example:
        >>> import shardlib, tempfile
        >>> mesh = shardlib.init_mesh({"dp": 1})
        >>> smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh)
        >>> d = tempfile.mkdtemp()
        >>> shardlib.checkpoint.save(f"{d}/step_1", smodel, extra={"step": 1})  # doctest: +ELLIPSIS
        '.../step_1'
        >>> shardlib.checkpoint.load(f"{d}/step_1", smodel)["step"]
        1
        >>> shardlib.checkpoint.save(f"{d}/step_1", smodel, overwrite=True)  # doctest: +ELLIPSIS
        '.../step_1'
    """
    if not isinstance(smodel, ShardedModule):
        raise TypeError(f"checkpoint.save() takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
    path = os.path.abspath(os.fspath(path))
    check_save_target(path, overwrite)  # every rank, before any write or communication
    sd = _save_state(smodel, optimizer, extra)  # its checks too: nothing written yet
    rank, tmp = dist.get_rank(), path + PARTIAL
    left = {"checking the paths": f"{path!r} is as it was (nothing was written)",
            "making the folder": f"{path!r} is as it was",
            "writing the data files": f"{path!r} is as it was; the unfinished save is in {tmp!r} (the next save to "
                                      f"{path!r} removes it)",
            "finishing": f"The new checkpoint is in {tmp!r} or {path!r}, the previous one, if any, in {path!r} or "
                         f"{path + OLD!r} (load() names the folder to use)"}

    def lost(exc: CollectiveError, what: str) -> CollectiveError:  # a peer killed or frozen: the group is unusable
        return type(exc)(f"checkpoint.save({path!r}) stopped while {what}: {exc}\n{left[what]}")

    def exchange(what: str, failure) -> dict:  # a collective in place of a bare barrier: no rank waits for the timeout
        try:
            return agree(failure, smodel.mesh, f"checkpoint.save: after {what}")
        except CollectiveError as exc:
            raise lost(exc, what) from exc

    def step(what: str, work) -> None:  # ``work`` on this rank; then every rank learns every rank's failure
        failure = None
        try:
            work()
        except CollectiveError as exc:  # raised by the watchdog on the ranks still alive
            raise lost(exc, what) from exc
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised on every rank below
            failure = failure_of(exc)
        failures = exchange(what, failure)
        if failures:
            raise CheckpointError(f"checkpoint.save({path!r}) failed {what} on {describe(failures)}. {left[what]}")

    try:  # every rank has checked them before rank 0 changes one (else it might see a half-made folder)
        same_folder(path, smodel.mesh, "save")
    except CollectiveError as exc:
        raise lost(exc, "checking the paths") from exc
    step("making the folder", lambda: prepare_partial(path) if rank == 0 else None)
    try:  # a folder on each node's own disk: every save "succeeded" without the other nodes' data files
        seen_by_every_rank(tmp, smodel.mesh, "checkpoint.save: after making the folder")
    except CollectiveError as exc:
        raise lost(exc, "making the folder") from exc
    step("writing the data files", lambda: watched(  # DCP's collectives, under the watchdog (gloo)
        smodel.mesh, "dcp.save", "checkpoint.save: writing the data files",
        lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), planner=SavePlanner())))

    def finish():
        if rank == 0:
            info = dict(format=FORMAT_VERSION, world_size=dist.get_world_size(), mesh=dict(smodel.mesh.shape),
                        zero_stage=smodel.plan.zero_stage, optimizer=optimizer is not None,
                        optimizer_class=optimizer_kind(optimizer.optimizer) if optimizer is not None else None,
                        optimizer_element_states=element_states(optimizer), time=time.time())
            finish_partial(path, info)

    step("finishing", finish)
    return path


def _check_complete(path: str) -> dict:
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "a broken symbolic link" if os.path.islink(path) else "not a folder"
        raise CheckpointError(f"checkpoint {path!r} is {what}, not a checkpoint folder: pass the folder save() wrote "
                              f"(it holds {MARKER} and .metadata)")
    if not os.path.isdir(path):
        if os.path.exists(os.path.join(path + PARTIAL, MARKER)):  # stopped between the final renames
            raise CheckpointError(f"checkpoint {path!r} does not exist; {path + PARTIAL!r} is a finished save that was "
                                  f"not renamed (stopped while renaming): rename it to {path!r} to load it")
        if os.path.isdir(path + PARTIAL):
            raise CheckpointError(
                f"checkpoint {path!r} does not exist; {path + PARTIAL!r} is a save that did not finish (killed or "
                f"failed before every rank was done). Load an earlier checkpoint")
        if os.path.isdir(path + OLD):  # killed between the two renames of an overwrite
            raise CheckpointError(f"checkpoint {path!r} does not exist; {path + OLD!r} is the checkpoint it was "
                                  f"replacing (the save stopped while renaming): rename it back to load it")
        raise CheckpointError(f"checkpoint {path!r} does not exist (no such folder)")
    missing = [f for f in (MARKER, ".metadata") if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete: it has no {' and no '.join(missing)} (written last, after every rank "
            f"finished), so the save that made it did not finish. Load an earlier checkpoint")
    info = read_marker(path)
    if info.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format {info.get('format')}, this shardlib reads {FORMAT_VERSION}")
    return info


def load(path: str | os.PathLike, smodel: ShardedModule, optimizer: Any = None, strict: bool = True) -> dict:
    """Load a checkpoint written by :func:`save` into ``smodel`` (and ``optimizer``), resharding.

    Collective: call on every rank. The mesh and plan may differ from the saving run's: another
    world size, another data/tensor/pipeline split, uneven or empty shards, another ZeRO stage or
    chunk size. Each rank reads the parts of the saved boxes that overlap the elements it holds.
    Also restored: persistent buffers, optimizer hyperparameters (``lr`` included), the
    mesh-independent dropout counters, and, when the world size is the saving one, each rank's
    torch RNG states (another world size leaves them as they are).

    Args:
        path: a checkpoint folder written by :func:`save`.
        smodel: a module from :func:`shardlib.shard` with the same parameter names and global
            shapes as the saved one.
        optimizer: its :class:`~shardlib.ZeroOptimizer`; its state is replaced by the saved one.
        strict: if True (the default), the checkpoint's parameters and persistent buffers must
            be exactly the model's: none missing, none that no rank of the model holds (checked
            over the whole model, every pipeline stage included, as ``torch.nn.Module.
            load_state_dict(strict=True)``). If False, only the entries both have are loaded
            (weights and their optimizer state); the model's other parameters and buffers keep
            their values, and their optimizer state starts from zero (moments; the step count is
            that of their flat chunk), the checkpoint's other entries are ignored, and rank 0
            warns what was skipped (``UserWarning``). Shapes must agree either way. The returned
            ``extra`` is the saved one in both cases.

    Returns:
        The ``extra`` dict given to :func:`save` (``{}`` if none).

    Raises:
        CheckpointError: on every rank before any communication: ``path`` missing, a file, or a
            save that did not finish (``<path>.partial``, or no ``shardlib_checkpoint.json``); a
            damaged ``shardlib_checkpoint.json`` or ``.metadata`` (the file is named); a parameter,
            buffer or per-element optimizer state of another global shape; with ``strict``, a
            parameter or buffer missing from the checkpoint, or checkpoint entries that no rank
            of the model holds (a checkpoint of a model with more layers: named, a few and the
            count), or a parameter tied here (embedding and LM head) that the checkpoint holds as
            separate tensors; a prefix that tells all names apart (a wrapped model) is named
            first; with ``strict=False``, a checkpoint none of whose entries has a name of the
            model; ``optimizer`` given but the checkpoint has no optimizer state, or the state of
            another optimizer class (AdamW saved, SGD given). On every rank at once, after
            reading has started: a data file (``*.distcp``) that cannot be read on some rank
            (damaged or missing; the file is named); the model may then be partly loaded. On
            every rank at once, before reading: the ranks name different folders, or see
            different checkpoints there (no shared file system; named per rank).
        RankFailureError: on the ranks still running, when a rank is killed or frozen while
            reading (a :class:`~shardlib.errors.CollectiveError`; on gloo within
            ``SHARDLIB_WATCHDOG`` seconds), naming it; the checkpoint is as it was.
        TypeError: ``smodel`` is not sharded, or ``optimizer`` is not a ZeroOptimizer.
    """
    if not isinstance(smodel, ShardedModule):
        raise TypeError(f"checkpoint.load() takes the module returned by shardlib.shard(), got {type(smodel).__name__}")
    path = os.path.abspath(os.fspath(path))
    inner = inner_optimizer(optimizer)
    info = _check_complete(path)
    reader = Reader(path)
    try:
        metadata = reader.read_metadata()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises many kinds
        raise CheckpointError(f"checkpoint {path!r} is damaged: its file '.metadata' (DCP's index of the saved "
                              f"tensors) cannot be read ({short_error(exc)}). Load an earlier checkpoint") from None
    saved = metadata.state_dict_metadata
    if inner is not None and not info.get("optimizer"):
        raise CheckpointError(f"checkpoint {path!r} was saved without optimizer state; call load() without optimizer")
    if inner is not None and info.get("optimizer_class") not in (None, optimizer_kind(inner)):
        raise CheckpointError(
            f"checkpoint {path!r} holds the state of a {info['optimizer_class']} optimizer, but the optimizer given is a "
            f"{optimizer_kind(inner)}: its state and hyperparameters would not fit. Fix: build the ZeroOptimizer with "
            f"{info['optimizer_class']}, or call load() without optimizer (weights only)")
    problems, names_differ, skipped = fit_problems(smodel, saved, inner is not None, strict)  # the whole model
    model = smodel.model_name
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        fix = "build the model the checkpoint was saved from (the same layers, names and shapes)"
        if names_differ:
            fix += ", or pass strict=False to load only the entries both have (their shapes must still agree)"
        raise CheckpointError(f"checkpoint {path!r} does not fit {model}: {shown}. Fix: {fix}")
    if skipped and dist.get_rank() == 0:
        warnings.warn(f"checkpoint.load({path!r}, strict=False) into {model} skips: {'; '.join(skipped)}", stacklevel=2)
    zero = smodel._zero
    sd: dict[str, Any] = {}
    updated = optimizer_params(smodel, inner) if inner is not None else {}
    states: list[tuple[torch.Tensor, str, Any]] = []  # (optimizer's param, state key, tensors)
    new_state: dict[int, dict] = {}
    per_element_keys = element_keys(saved, info)
    for pp, name, prm, _ in entries(smodel):
        key = next((k for k in dict.fromkeys((name, pp.name) + pp.aliases) if f"model.{k}" in saved), None)
        if key is None:  # not in the checkpoint (strict=False): keeps its value
            continue
        pieces = [p for a, b, flat in load_targets(smodel, pp) for p in global_pieces(smodel, pp, a, b, flat)]
        sd[f"model.{key}"] = Boxes(pp.global_shape, pp.dtype, pieces)
        chunk = zero.param_chunk[id(prm)]
        if inner is None or not chunk.trainable:
            continue
        prefix = f"optim.{key}."
        keys = [k[len(prefix):] for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]]
        fresh = new_state.setdefault(chunk.index, {})
        for skey in keys:
            md = saved[prefix + skey]
            if not isinstance(md, TensorStorageMetadata):
                continue
            if skey in per_element_keys:  # per element (0-d for a 0-d parameter): its shape was checked above
                if skey not in fresh:
                    fresh[skey] = torch.zeros_like(updated[chunk.index], dtype=md.properties.dtype)
                a, b, flat = region(smodel, pp, fresh[skey])
                sd[prefix + skey] = Boxes(pp.global_shape, md.properties.dtype, global_pieces(smodel, pp, a, b, flat))
            elif skey not in fresh:
                fresh[skey] = torch.zeros((), dtype=md.properties.dtype)
                sd[prefix + skey] = fresh[skey]
        states.append((updated[chunk.index], prefix, fresh))
    for name, buf in persistent_buffers(smodel.module).items():
        if f"model.{name}" in saved:  # else (strict=False) it keeps its value
            sd[f"model.{name}"] = buf
    wanted = ["extra"] + [f"dropout.{p}" for p in _dropouts(smodel)]
    if inner is not None:
        wanted.append("optim.param_groups")
    if info.get("world_size") == dist.get_world_size():
        wanted.append(f"rng.{dist.get_rank()}")
    for key in wanted:
        if key in saved:
            sd[key] = None
    same_checkpoint(path, smodel.mesh, info)  # after the local checks: the same folder and checkpoint everywhere
    planner = LoadPlanner()
    try:  # DCP gathers every rank's read errors: a damaged file read by one rank fails every rank
        watched(smodel.mesh, "dcp.load", "checkpoint.load: reading the data files",  # DCP's collectives, watched
                lambda: dcp.load(sd, storage_reader=reader, planner=planner))
    except CollectiveError as exc:  # a peer killed or frozen: not a damaged checkpoint
        raise type(exc)(f"checkpoint.load({path!r}) stopped while reading the data files: {exc}\nThe model"
                        f"{' and optimizer' if inner is not None else ''} may be partly loaded; the checkpoint is as "
                        f"it was (load() only reads it)") from exc
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the same error on every rank
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read: {describe(failure_of(exc))}. It may be damaged, and the model"
            f"{' and optimizer' if inner is not None else ''} partly loaded: load an earlier checkpoint") from None
    got = planner.loaded
    for path_, drop in _dropouts(smodel).items():
        drop.calls = got.get(f"dropout.{path_}", drop.calls)
    if inner is not None:
        inner.state.clear()
        for opt_param, _, fresh in states:
            if fresh:
                inner.state[opt_param] = fresh
        for group in inner.param_groups:
            group.update(got.get("optim.param_groups", [{}])[0])
        offload = getattr(optimizer, "offload", None)
        if offload is not None:  # ZeRO-Offload: host copies of the shards just loaded
            offload.reload()
    rng = got.get(f"rng.{dist.get_rank()}")
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return dict(got.get("extra") or {})


def remove(path: str | os.PathLike) -> None:
    """Delete the finished checkpoint at ``path`` (call on one process, e.g. rank 0): the
    training tool's ``checkpoint.keep_last`` rotation. Nothing save() did not write is deleted.

    Raises:
        CheckpointError: ``path`` is not a finished shardlib checkpoint, or holds other files.
    """
    remove_checkpoint(os.fspath(path))


def latest(folder: str | os.PathLike, mesh: Any = None) -> str | None:
    """The newest finished checkpoint under ``folder`` (by the time in its marker), or None.

    Unfinished ``*.partial`` folders are ignored. A checkpoint whose ``shardlib_checkpoint.json``
    cannot be read (damaged) is skipped with a ``UserWarning`` naming it, so a resume takes the
    newest readable one.

    Args:
        folder: a folder of checkpoint folders (``train_gpt.py``'s ``--ckpt-dir``).
        mesh: with a mesh (collective: every rank calls it), the ranks compare what they found
            in one exchange, so that a resume takes one branch on every rank.

    Returns:
        The path of the newest checkpoint in ``folder``, None if it has none (or is no folder).

    Raises:
        CheckpointError: with ``mesh``, on every rank: the ranks found different checkpoints
            (``folder`` on no shared file system, or ranks naming different folders), named per rank.
    """
    found = _newest(folder)
    return found if mesh is None else same_latest(os.fspath(folder), found, mesh)


def _newest(folder: str | os.PathLike) -> str | None:
    best, best_time = None, -math.inf
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return None
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.endswith(PARTIAL) or not os.path.lexists(os.path.join(path, MARKER)):
            continue
        try:
            t = read_marker(path).get("time", 0)
        except CheckpointError as exc:
            warnings.warn(f"checkpoint.latest({folder!r}) skips {entry!r}: {exc}", stacklevel=2)
            continue
        if t > best_time:
            best, best_time = path, t
    return best
