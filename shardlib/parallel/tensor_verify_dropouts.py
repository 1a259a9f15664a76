"""Dropout where a tensor-parallel lowering cannot make it exact: between a column layer and its
row layer, on activations split over the tensor axis (a rank's own features or heads). A dropout
module there would drop the same local features on every rank (shardlib's mesh-independent masks
are drawn by batch and sequence position); dropout called as a function (attention's ``F.dropout``,
sdpa's ``dropout_p``) draws from torch's generator, the same stream on every rank. Both are
refused at ``shard()`` time by :func:`refuse_split_dropouts`, part of the verification
(:mod:`.tensor_verify`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ShardingError
from .tensor_verify_inputs import run_device

__all__ = ["refuse_split_dropouts"]


def refuse_split_dropouts(ref: nn.Module, mini: SimpleNamespace, order: list[str], forward: Any, where: str,
                          axis: str) -> None:
    """Refuse dropout between a column layer and its row layer in the verified unit ``ref``.

    Args:
        ref: a throwaway copy of the unit's unsharded working copy (in eval mode; left so): its
            forward runs in training mode, which may change its buffers.
        mini: the unit's plan (``tp_layers``).
        order: module paths in the order the reference forward entered them.
        forward: ``forward(module)`` runs a module on the unit's inputs.
        where: the unit, for the message (``"model.layers.0 (LlamaDecoderLayer)"``).
        axis: the tensor mesh axis.

    Raises:
        ShardingError: a dropout module with p > 0 ran there, or (in a training forward) a dropout
            function with p > 0 was called there; naming them and the fixes.
    """
    dropouts = _split_dropouts(ref, mini, order)
    if dropouts:
        raise ShardingError(
            f"shard(verify=True): in {where}, {', '.join(dropouts[:4])} "
            f"run between a column-parallel layer and its row-parallel partner, on activations split over {axis!r}: "
            "shardlib's mesh-independent dropout draws masks by batch and sequence position, not by the split feature, so "
            "every rank would drop the same local features, unlike one device. Fix: set their p to 0, or leave that "
            "projection pair replicated")
    calls = _split_functional_dropouts(ref, mini, forward)
    if calls:
        raise ShardingError(
            f"shard(verify=True): in {where}, in a training forward, "
            f"{', '.join(calls[:4])} between a column-parallel layer and its row-parallel partner, on activations split "
            f"over {axis!r} (this rank's heads): dropout called as a function draws from torch's generator, the same "
            "stream on every rank of the axis, so every rank would drop the same pattern on its own heads, unlike one "
            "device. Fix: set that dropout to 0 (a Hugging Face config's attention_dropout=0.0), or leave that "
            "projection pair replicated")


def _split_dropouts(ref: nn.Module, mini: SimpleNamespace, order: list[str]) -> list[str]:
    """Dropout modules (p > 0) that ran, in the reference forward, after a column layer of a
    group and before its row layer: on feature-split activations (``path (p=...)``)."""
    modules = dict(ref.named_modules())
    groups: dict[str, list] = {}
    for layer in mini.tp_layers:
        if layer.kind in ("column", "row") and not layer.output_layer:
            groups.setdefault(layer.group, []).append(layer)
    out = []
    for layers in groups.values():
        cols = [order.index(l.path) for l in layers if l.kind == "column" and l.path in order]
        rows = [order.index(l.path) for l in layers if l.kind == "row" and l.path in order]
        if not cols or not rows:
            continue
        for path in order[min(cols) + 1:max(rows)]:
            m = modules.get(path)
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
                out.append(f"{path} (p={m.p})")
    return list(dict.fromkeys(out))


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
             torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def _split_functional_dropouts(ref: nn.Module, mini: SimpleNamespace, forward: Any) -> list[str]:
    """Dropout called as a function (``F.dropout`` on attention weights, ``scaled_dot_product_attention``
    with ``dropout_p > 0``: Hugging Face's attention), with p > 0 in a training forward, between a
    column layer of a group and its row layer: ``module.function (p=...)``. Found by one forward of
    ``ref`` in training mode without gradients (the verification runs in eval mode, where these
    draw nothing; ``forward(module)`` runs it on the unit's inputs); a dropout module's own call is
    :func:`_split_dropouts`'s."""
    from torch.overrides import TorchFunctionMode

    kinds = {layer.path: (layer.kind, layer.group) for layer in mini.tp_layers
             if layer.kind in ("column", "row") and not layer.output_layer}
    if not kinds:
        return []
    stack: list[str] = []
    open_groups: set[str] = set()  # groups whose column layer has run and whose row layer has not
    found: list[str] = []

    def enter(path: str, module: nn.Module) -> None:
        stack.append(path)
        kind, group = kinds.get(path, (None, None))
        if kind == "column":
            open_groups.add(group)
        elif kind == "row":
            open_groups.discard(group)

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _DROPOUTS:
                p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
                training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            elif func is F.scaled_dot_product_attention:
                p, training = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0), True
            else:
                p, training = 0.0, False
            where = stack[-1] if stack else ""
            inside_module = isinstance(modules.get(where), nn.modules.dropout._DropoutNd)
            if p and training and open_groups and not inside_module:
                found.append(f"{where or '<root>'} calls {getattr(func, '__name__', func)} (p={p})")
            return func(*args, **kwargs)

    modules = dict(ref.named_modules())
    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    hooks = [m.register_forward_pre_hook(lambda mod, a, p_=p_: enter(p_, mod)) for p_, m in modules.items()]
    hooks += [m.register_forward_hook(leave) for m in modules.values()]
    device = run_device(ref)
    ref.train()
    try:  # the caller's generators as they were: the probe's draws are not the user's
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), Probe():
            forward(ref)
    except Exception:  # noqa: BLE001 - a model that cannot run in training mode here draws nothing we can see
        pass
    finally:
        ref.eval()
        for h in hooks:
            h.remove()
    return list(dict.fromkeys(found))
