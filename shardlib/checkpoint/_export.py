"""``export_safetensors``: the full weights of a sharded module in one ``.safetensors`` file."""

from __future__ import annotations

import os
import uuid

import torch.distributed as dist

from ..shard import ShardedModule, full_state_dict
from ._files import CheckpointError, agree, check_parent, describe, failure_of

__all__ = ["export_safetensors"]


def _check_export_target(path: str, overwrite: bool) -> None:
    caller = f"checkpoint.export_safetensors({path!r})"
    check_parent(path, caller)
    if os.path.isdir(path):
        raise CheckpointError(f"{caller}: {path!r} is a folder; the export is one file. Fix: name a file, such as "
                              f"{os.path.join(path, 'model.safetensors')!r}")
    if os.path.lexists(path) and not overwrite:
        raise CheckpointError(f"{caller}: {path!r} already exists; export_safetensors replaces a file only when asked. "
                              f"Fix: pass overwrite=True to replace it, or choose another path")


def _write(path: str, state: dict) -> None:
    """Rank 0: ``state`` to a temporary file of a new name in the folder of ``path`` (created
    exclusively: no file of the user's is touched), renamed to ``path``; removed on failure."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone().contiguous() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
    folder, base = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # ours alone; the umask applies
    try:
        save_file(out, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export_safetensors(path: str | os.PathLike, smodel: ShardedModule, overwrite: bool = False) -> str | None:
    """Write the full state dict of ``smodel`` to one ``.safetensors`` file (on rank 0).

    Collective (it gathers the shards: call on every rank). Tensors have their global shapes and
    the original names, as ``model.state_dict()`` of the unsharded model: tied names each get
    their own copy (safetensors stores no shared tensors), so ``model.load_state_dict(
    safetensors.torch.load_file(path))`` works for the reference GPT and for Hugging Face models
    sharded with the presets. The file is written under a temporary name in the same folder and
    renamed into place, so a failed export leaves no partial file (and ``path`` as it was).

    Args:
        path: the file to write (missing parent folders are made).
        smodel: a module from :func:`shardlib.shard`.
        overwrite: replace an existing file at ``path``.

    Returns:
        ``path`` (absolute) on rank 0, None elsewhere.

    Raises:
        TypeError: ``smodel`` is not sharded.
        CheckpointError: on every rank before anything is gathered or written: ``path`` is a
            folder, exists and ``overwrite`` is False, or its parent is a file or not writable;
            on every rank at once: rank 0 failed to write the file.
    """
    if not isinstance(smodel, ShardedModule):
        raise TypeError(f"checkpoint.export_safetensors() takes the module returned by shardlib.shard(), got "
                        f"{type(smodel).__name__}")
    path = os.path.abspath(os.fspath(path))
    _check_export_target(path, overwrite)  # every rank, before the gather
    state = full_state_dict(smodel, rank0_only=True)
    failure = None
    if dist.get_rank() == 0:
        try:
            _write(path, state)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure = failure_of(exc)
    failures = agree(failure, smodel.mesh, f"export_safetensors({path!r})")  # a lost peer is named
    if failures:
        raise CheckpointError(f"checkpoint.export_safetensors({path!r}) failed on {describe(failures)}; no file was "
                              f"left behind and {path!r} is as it was")
    return path if dist.get_rank() == 0 else None
