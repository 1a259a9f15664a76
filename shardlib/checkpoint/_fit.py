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


def _listing(items: list[str]) -> str:
    more = f", ... {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _renamed(missing: list[str], unclaimed: list[str]) -> str | None:
    """A phrase when every missing name is an unclaimed one with a prefix added or removed (a
    model wrapped in, or unwrapped from, another module), else None."""
    if not missing or len(missing) != len(unclaimed):
        return None
    m, u = sorted(missing, key=len)[0], None
    for cand in unclaimed:
        if cand.endswith("." + m) or m.endswith("." + cand):
            u = cand
            break
    if u is None:
        return None
    if u.endswith("." + m):  # the checkpoint has a prefix the model lacks
        prefix = u[: -len(m)]
        if {prefix + x for x in missing} == set(unclaimed):
            return (f"the checkpoint's names are this model's with the prefix {prefix!r} (it holds {u!r} for {m!r}): "
                    f"it was saved from a module that wraps this one")
    else:
        prefix = m[: -len(u)]
        if {prefix + x for x in unclaimed} == set(missing):
            return (f"this model's names are the checkpoint's with the prefix {prefix!r} (it needs {m!r}, the checkpoint "
                    f"holds {u!r}): the checkpoint was saved from the module this one wraps")
    return None


def fit_problems(smodel: Any, saved: dict[str, Any], optimizer: bool, strict: bool) -> tuple[list[str], bool, list[str]]:
    """What keeps the checkpoint with metadata ``saved`` from loading into ``smodel``.

    Args:
        smodel: the sharded module (its ``model_state_names`` cover the whole model).
        saved: DCP's ``state_dict_metadata`` of the checkpoint.
        optimizer: whether an optimizer's state is being loaded too (its shapes are checked).
        strict: also refuse the model's entries missing from the checkpoint, the checkpoint's
            entries no rank holds, and a tied parameter saved as separate tensors; without it,
            refuse only a checkpoint with no entry of the model at all (nothing would load).

    Returns:
        ``(problems, names_differ, skipped)``: one line per problem, summaries first, in a stable
        order (the same on every rank); whether a name difference is among them (``strict=False``
        would skip it); and, under ``strict=False``, the lines saying what will be skipped.
    """
    shapes: list[str] = []
    missing: list[tuple[str, str]] = []  # (name, "name (shape)")
    tied: list[str] = []
    claimed: set[str] = set()
    for state in smodel.model_state_names:
        claimed.update(state.names)
        label = state.names[0]
        present = [n for n in state.names if f"model.{n}" in saved]
        if not present:
            missing.append((label, f"{label} {state.shape}"))
            continue
        if len(present) > 1:
            tied.append(f"{' = '.join(state.names)} is one tied parameter here, but the checkpoint holds "
                        f"{' and '.join(present)} as separate tensors (an untied model's): loading would keep "
                        f"{present[0]} and drop {', '.join(present[1:])}")
        key = present[0]
        md = saved[f"model.{key}"]
        if not isinstance(md, TensorStorageMetadata) or _size(md) != state.shape:
            shapes.append(f"{state.kind} {label}: shape {state.shape} here, {_size(md)} in the checkpoint")
            continue
        if not optimizer or state.kind != "parameter":
            continue
        prefix = f"optim.{key}."
        for skey, md in saved.items():
            rest = skey[len(prefix):]
            if (skey.startswith(prefix) and "." not in rest and isinstance(md, TensorStorageMetadata)
                    and len(md.size) > 0 and _size(md) != state.shape):
                shapes.append(f"optimizer state {rest!r} of {label}: shape {_size(md)} in the checkpoint, "
                              f"neither {state.shape} nor a scalar")
    unclaimed, with_state = unclaimed_entries(saved, claimed)
    names: list[str] = []
    renamed = _renamed([n for n, _ in missing], list(unclaimed))
    if renamed:
        names.append(renamed)
    names += tied
    if unclaimed:
        listed = [f"{name} {shape}" if shape is not None else name for name, shape in unclaimed.items()]
        names.append(f"{len(unclaimed)} of its entries {'is' if len(unclaimed) == 1 else 'are'} in no rank's part of "
                     f"the model: {_listing(listed)}"
                     f"{' (with their optimizer state)' if with_state else ''}")
    if missing:
        names.append(f"{len(missing)} of the model's entries {'is' if len(missing) == 1 else 'are'} not in the "
                     f"checkpoint: {_listing([t for _, t in missing])}")
    if strict:
        return names + shapes, bool(names), []
    if names and len(missing) == len(smodel.model_state_names):  # strict=False, and no name in common
        return ([f"none of its entries has a name of {smodel.model_name}, so even with strict=False nothing would load: "
                 f"{'; '.join(names)}"] + shapes, False, [])
    return shapes, False, names
