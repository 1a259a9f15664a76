"""Whether a checkpoint fits a model: the checks :func:`shardlib.checkpoint.load` makes first.

They compare the checkpoint's metadata with the *whole* model's state names
(``smodel.model_state_names``: every pipeline stage's parameters, tied aliases and persistent
buffers, computed at shard time), so every rank raises the same error before any communication,
even a pipeline stage that holds every entry it needs itself.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["fit_problems", "unclaimed_entries"]

SHOWN = 5  # unclaimed names listed in a message; the rest are counted


def _size(md: Any) -> tuple[int, ...]:
    return tuple(getattr(md, "size", ()))


def unclaimed_entries(saved: dict[str, Any], claimed: set[str]) -> tuple[dict[str, tuple[int, ...] | None], bool]:
    """Checkpoint entries no rank of the model holds: ``({name: global shape}, any optimizer
    state among them)``, in the checkpoint's order. A ``model.<name>`` entry, and the state
    ``optim.<name>.<key>`` of an unclaimed name, count as one entry ``<name>`` (shape None for
    optimizer state with no ``model.`` entry)."""
    out: dict[str, tuple[int, ...] | None] = {}
    optimizer_state = False
    for key, md in saved.items():
        if key.startswith("model.") and key[len("model."):] not in claimed:
            out[key[len("model."):]] = _size(md)
        elif key.startswith("optim.") and key != "optim.param_groups":
            name = key[len("optim."):].rpartition(".")[0]
            if name not in claimed:
                out.setdefault(name, None)
                optimizer_state = True
    for name, shape in list(out.items()):  # optimizer state seen before its model entry
        if shape is None and isinstance(saved.get(f"model.{name}"), TensorStorageMetadata):
            out[name] = _size(saved[f"model.{name}"])
    return out, optimizer_state


def fit_problems(smodel: Any, saved: dict[str, Any], optimizer: bool, strict: bool) -> tuple[list[str], bool]:
    """What keeps the checkpoint with metadata ``saved`` from loading into ``smodel``.

    Args:
        smodel: the sharded module (its ``model_state_names`` cover the whole model).
        saved: DCP's ``state_dict_metadata`` of the checkpoint.
        optimizer: whether an optimizer's state is being loaded too (its shapes are checked).
        strict: also report the model's entries missing from the checkpoint and the
            checkpoint's entries no rank holds.

    Returns:
        ``(problems, names)``: one line per problem, in a stable order (the same on every rank),
        and whether a missing or unclaimed entry is among them (``strict=False`` would skip it).
    """
    problems: list[str] = []
    names_differ = False
    claimed: set[str] = set()
    for state in smodel.model_state_names:
        claimed.update(state.names)
        label = state.names[0]
        key = next((n for n in state.names if f"model.{n}" in saved), None)
        if key is None:
            if strict:
                problems.append(f"{state.kind} {label} {state.shape} is not in the checkpoint")
                names_differ = True
            continue
        md = saved[f"model.{key}"]
        if not isinstance(md, TensorStorageMetadata) or _size(md) != state.shape:
            problems.append(f"{state.kind} {label}: shape {state.shape} here, {_size(md)} in the checkpoint")
            continue
        if not optimizer or state.kind != "parameter":
            continue
        prefix = f"optim.{key}."
        for skey, md in saved.items():
            rest = skey[len(prefix):]
            if (skey.startswith(prefix) and "." not in rest and isinstance(md, TensorStorageMetadata)
                    and len(md.size) > 0 and _size(md) != state.shape):
                problems.append(f"optimizer state {rest!r} of {label}: shape {_size(md)} in the checkpoint, "
                                f"neither {state.shape} nor a scalar")
    if strict:
        unclaimed, with_state = unclaimed_entries(saved, claimed)
        if unclaimed:
            listed = [f"{name} {shape}" if shape is not None else name for name, shape in list(unclaimed.items())[:SHOWN]]
            more = f", ... {len(unclaimed) - SHOWN} more" if len(unclaimed) > SHOWN else ""
            problems.append(f"{len(unclaimed)} of its entries are in no rank's part of the model: {', '.join(listed)}"
                            f"{more}{' (with their optimizer state)' if with_state else ''}")
            names_differ = True
    return problems, names_differ
