"""Which units :mod:`tensor_verify` runs: one per distinct computation, not one per class.

A unit is a decoder block (an element of a ``ModuleList``) holding column/row layers, the
attention/MLP module itself when it is not inside a block, or a parallel embedding / output
layer of a subclass. Instances of one class often compute the same thing (80 identical decoder
layers: one is run), but not always: a constructor flag, a per-layer type (Llama 4's layers
without rotary positions, a hybrid model's layers of one class) or a ``forward`` branch can make
two instances with the same class and parameter shapes differ, and the check must run each
kind, or a lowering exact on the first would be trusted on all.

So the candidates (:func:`candidate_units`: every unit, ``key`` its class, layout and parameter
names, shapes and dtypes) are told apart by what their ``forward`` executes
(:func:`distinct_units`): the first candidate of each key is the representative, whose inputs
the sample forward captures (:func:`~.tensor_verify_inputs.capture_inputs`); every candidate of
the key is then run on those inputs with the representative's parameters
(``torch.func.functional_call``; one materialized random copy of them for a model on the meta
device), without gradients, and :class:`OpTrace` records the torch operations it calls (name,
argument shapes and dtypes, non-tensor argument values). Same weights and inputs make
data-dependent paths (a mixture of experts' routing) the same, so two candidates trace apart
when their code or configuration makes them run other operations or other argument values (a
flag, a per-layer type, a constant); values held in their own buffers (a sliding-window mask)
do not count, as they do not change how the layers split. A candidate that traces differently,
or cannot run there, is checked too, on the representative's inputs. Cost: one
forward of each block on the sample (a few tokens), the forward the sample would run anyway.
Compare torchtitan's and Megatron's parity tests, which check a model once, whole, in CI.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .tensor_rules import region_blocks
from .tensor_verify_inputs import SEED, inside, rel

__all__ = ["Unit", "OpTrace", "candidate_units", "representatives", "distinct_units"]


@dataclasses.dataclass
class Unit:
    path: str
    kind: str  # "block", "embedding", "output", "model" (the whole model, when small)
    split_in: bool = False  # sequence-parallel: the input arrives split along dim 1
    split_out: bool = False  # ... and the output leaves split
    inputs: tuple | None = None  # (args, kwargs), captured or synthesized
    key: tuple = ()  # (class, kind, layout, split_in, parameters): candidates that may be alike


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def candidate_units(model: nn.Module, plan) -> list[Unit]:
    """Every unit the plan transforms (see the module doc), each once, in the order of the plan's
    tensor-parallel layers; ``key`` set, ``inputs`` not yet."""
    modules = dict(model.named_modules())
    in_lists = {f"{name}.{i}" for name, m in modules.items() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    region = set(region_blocks(modules, plan.sp_entry, plan.tp_layers)) if plan.sequence_parallel and plan.sp_entry else set()
    units: dict[str, Unit] = {}

    def add(path: str, kind: str, **kw) -> None:
        if path in units:
            return
        layout = tuple(sorted((rel(l.path, path), l.kind, l.fused) for l in plan.tp_layers if inside(l.path, path)))
        params = tuple((nm, tuple(p.shape), p.dtype, p.requires_grad) for nm, p in modules[path].named_parameters())
        units[path] = Unit(path, kind, key=(type(modules[path]), kind, layout, kw.get("split_in", False), params), **kw)

    for layer in plan.tp_layers:
        # a plain nn.Embedding / nn.Linear lowers the same in every model (shardlib's own tests prove
        # it); a subclass may override forward, so it is run
        plain = type(modules[layer.path]) in (nn.Embedding, nn.Linear)
        if layer.kind in ("vocab", "embed_dim"):
            if not plain:
                add(layer.path, "embedding")
        elif layer.output_layer:
            if not plain:
                add(layer.path, "output", split_in=bool(plan.sequence_parallel and not plan.sp_exit))
        else:
            anchor = layer.group or layer.path.rpartition(".")[0]
            block = next((a for a in _ancestors(anchor) if a in in_lists), anchor)
            sp = block in region
            add(block, "block", split_in=sp, split_out=sp)
    return list(units.values())


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{x.dtype}"
    if x is None or x is Ellipsis or isinstance(x, (bool, int, float, str, slice, torch.dtype, torch.device,
                                                     torch.memory_format, torch.layout)):
        return repr(x)
    return type(x).__name__


class OpTrace(TorchFunctionMode):
    """A digest of the torch operations called under it (``torch.*``, ``torch.nn.functional.*``
    and tensor methods, as ``__torch_function__`` sees them): each one's name and its arguments
    (tensors as shape and dtype, other values as themselves). A context manager. (A torch
    function mode, not a dispatch mode: entering the first dispatch mode imports
    ``torch._dynamo``, 1.4 s of a process's first ``shard()``.)"""

    def __init__(self):
        super().__init__()
        self._hash = hashlib.sha1()

    def digest(self) -> str:
        return self._hash.hexdigest()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        name = f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', None) or getattr(func, '__name__', func)}"
        self._hash.update((name + "(" + ",".join(_describe(a) for a in flat) + ")\n").encode())
        return func(*args, **(kwargs or {}))


def representatives(units: list[Unit]) -> list[Unit]:
    """The first candidate of each key (the ones whose inputs the sample forward captures)."""
    seen: set = set()
    out = []
    for unit in units:
        if unit.key not in seen:
            seen.add(unit.key)
            out.append(unit)
    return out


def _weights(rep: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The representative's parameters by name; for a model on the meta device, one random copy
    of its parameters and buffers on ``device`` (fixed seed: routing and other data-dependent
    paths need values; masks True, integers 0)."""
    named = dict(rep.named_parameters())
    if not any(p.is_meta for p in named.values()):
        return named
    named.update(rep.named_buffers())
    g = torch.Generator().manual_seed(SEED + 5)

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return (torch.randn(t.shape, generator=g) * 0.02).to(device, t.dtype)
        return (torch.ones if t.dtype == torch.bool else torch.zeros)(t.shape, dtype=t.dtype, device=device)

    return {nm: fill(t) for nm, t in named.items()}


def _trace(module: nn.Module, weights: dict, inputs: tuple) -> str | None:
    """The digest of ``module``'s forward on ``inputs`` with ``weights`` (eval mode, no
    gradients), or None if it raises there (then the unit is checked, and the check names the
    error)."""
    args, kwargs = copy.deepcopy(inputs)  # a forward may write into its inputs (a KV cache)
    was = [(m, m.training) for m in module.modules()]
    module.eval()
    trace = OpTrace()
    try:
        with torch.no_grad(), trace:
            functional_call(module, weights, args, kwargs, strict=False)
    except Exception:  # noqa: BLE001 - the check runs it and reports what it raises
        return None
    finally:
        for m, mode in was:
            m.training = mode
    return trace.digest()


def distinct_units(model: nn.Module, units: list[Unit], device: torch.device) -> list[Unit]:
    """The units to check, in the candidates' order: each representative (inputs captured, or
    None if the sample never called it: the check refuses it), and each other candidate whose
    forward traces differently from every one kept for its key (given the representative's
    inputs). A key of one candidate runs nothing here."""
    groups: dict[tuple, list[Unit]] = {}
    for unit in units:
        groups.setdefault(unit.key, []).append(unit)
    keep = set()
    for members in groups.values():
        rep = members[0]
        keep.add(id(rep))
        if len(members) == 1 or rep.inputs is None:
            continue
        weights = _weights(model.get_submodule(rep.path), device)
        traces = {_trace(model.get_submodule(rep.path), weights, rep.inputs)}
        for unit in members[1:]:
            t = _trace(model.get_submodule(unit.path), weights, rep.inputs)
            if t is None or t not in traces:
                traces.add(t)
                unit.inputs = rep.inputs
                keep.add(id(unit))
    return [u for u in units if id(u) in keep]
