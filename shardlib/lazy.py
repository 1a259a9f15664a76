"""Lazy (meta-device) initialization: build the model on ``meta``, materialize only local shards.

A model built under ``with torch.device("meta"):`` has shapes and dtypes but no storage.
``shard(meta_model, mesh, ...)`` then allocates, on each rank, only what that rank stores (the
tensor-parallel block of each parameter; under ZeRO-3 only this rank's slice of each flat
chunk) and fills it with values that depend on the global element index alone (counter-based
SplitMix64, :func:`shardlib.random.counter_values`), so the full tensors equal what
:func:`init_parameters` gives the same model on one device for the same seed. This is
torchtitan's / FSDP2's "init on meta, then materialize shards" recipe, with an initializer that
does not depend on the mesh (JAX's partitionable RNG) instead of a per-rank torch generator.

Init rules. Each parameter needs a rule ``(kind, *args)``: ``("normal", std)``,
``("normal", std, mean)``, ``("uniform", low, high)``, ``("zeros",)``, ``("ones",)``,
``("constant", value)``. Rules come from, first match wins:

1. the ``init_rules`` plan option: ``{glob over parameter names: rule}`` or a callable
   ``init_rules(name, param) -> rule | None``;
2. the model's ``shardlib_init_rules()`` method, returning ``{glob: rule}`` (the reference
   :class:`~shardlib.models.GPT` has one);
3. the model's own per-module init function, Hugging Face's ``_init_weights``, read without
   running it (:mod:`shardlib.own_init`): an unmodified HF model built on meta needs no rules.

A tied parameter matches under any of its names. The random stream of a parameter is the CRC-32
of its canonical name (first in ``named_parameters()``), or of the name a rule ends with
(``("normal", 0.02, "wte.weight")``: pipeline stages use it for a tied tensor that a later stage
knows by its other name); the seed is the ``init_seed`` option.

Buffers. A buffer built on ``meta`` is allocated on the device (full size, it is replicated) and
must then be filled by its module: a module that owns meta buffers defines
``shardlib_init_buffers(self)`` (called once, after allocation; e.g. to recompute a rotary cache
or a causal mask), or is a torch norm module with running statistics (``reset_running_stats()``
is used), or belongs to a model whose own ``_init_weights`` recomputes it (Hugging Face's rotary
``inv_freq``, Gemma's ``embed_scale``: :mod:`shardlib.own_init`). Any other meta buffer, or one
that init leaves unwritten, is an error naming it.

Device: CUDA's current device when CUDA is available, else CPU; inside
:func:`materialize_on` the device given. On ``meta`` (a dry run, :mod:`shardlib.dryrun`) nothing
is allocated or filled: parameters, chunks and buffers stay shapes.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import zlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .errors import ShardingError
from .random import counter_values

__all__ = ["init_parameters", "resolve_init_rules", "default_device", "materialize_on"]

_KINDS = {"normal": (1, 2), "uniform": (2, 2), "zeros": (0, 0), "ones": (0, 0), "constant": (1, 1)}
_BLOCK = 1 << 18  # elements filled per step (bounds the int64 index and float temporaries)


_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("shardlib_materialize", default=None)


def default_device() -> torch.device:
    """Where meta parameters are materialized: the device of the innermost :func:`materialize_on`,
    else CUDA's current device if available, else CPU."""
    device = _DEVICE.get()
    if device is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def materialize_on(device: Any) -> Iterator[torch.device]:
    """Inside the block, ``shard()`` and :func:`init_parameters` materialize meta models on ``device``.

    ``"meta"`` keeps them on meta: parameters, ZeRO chunks, gradients and optimizer state get
    shapes and no storage, nothing is filled, and a forward and backward on meta inputs issue
    every collective (counted in ``mesh.comm``) without arithmetic: what :mod:`shardlib.dryrun`
    runs on torch's fake process group.

    Args:
        device: a ``torch.device`` or its name (``"meta"``, ``"cpu"``, ``"cuda:1"``).

    Example:
        >>> with materialize_on("meta"):
        ...     default_device()
        device(type='meta')
    """
    token = _DEVICE.set(torch.device(device))
    try:
        yield _DEVICE.get()
    finally:
        _DEVICE.reset(token)


def _check_rule(rule: Any, name: str) -> tuple:
    if isinstance(rule, str):
        rule = (rule,)
    if not isinstance(rule, (tuple, list)) or not rule or rule[0] not in _KINDS:
        raise ShardingError(
            f"init rule {rule!r} for parameter {name} is not one of ('normal', std[, mean]), ('uniform', low, high), "
            "('zeros',), ('ones',), ('constant', value)"
        )
    stream = (rule[-1],) if len(rule) > 1 and isinstance(rule[-1], str) else ()
    numbers = rule[1 : len(rule) - len(stream)]
    lo, hi = _KINDS[rule[0]]
    if not lo <= len(numbers) <= hi:
        raise ShardingError(f"init rule {tuple(rule)!r} for parameter {name}: {rule[0]!r} takes {lo}-{hi} numbers")
    return (str(rule[0]),) + tuple(float(a) for a in numbers) + stream


def _split(rule: tuple, name: str) -> tuple[str, tuple, int]:
    """``(kind, numbers, stream)``: a rule may end with the name whose stream it draws from."""
    if len(rule) > 1 and isinstance(rule[-1], str):
        return rule[0], rule[1:-1], stream_of(rule[-1])
    return rule[0], rule[1:], stream_of(name)


def meta_init_rules(model: nn.Module, rules: Any, names_of: dict[int, list[str]], params: dict[int, nn.Parameter]) -> dict:
    """The init rules of a model built on meta (:func:`resolve_init_rules`), or ``{}`` when no
    parameter is on meta. ``names_of`` / ``params``: each parameter's names and the parameter,
    by ``id``.

    Raises:
        ShardingError: only some parameters are on meta (naming one that is not)."""
    on_meta = [p.device.type == "meta" for p in params.values()]
    if not any(on_meta):
        return {}
    init_rules = resolve_init_rules(model, rules, list(names_of.values()))
    if not all(on_meta):
        key = next(k for k in names_of if params[k].device.type != "meta")
        raise ShardingError(
            f"some parameters are on the meta device and some are not (e.g. {names_of[key][0]} on {params[key].device}); "
            "shard() materializes a model that is wholly on meta. Fix: build the whole model under torch.device('meta')"
        )
    return init_rules


def resolve_init_rules(model: nn.Module, rules: Any = None, names: list[list[str]] | None = None) -> dict[str, tuple]:
    """``{canonical name: rule}`` for every unique parameter of ``model`` that some rule covers.

    Args:
        model: the module (on any device, meta included).
        rules: ``{glob: rule}``, a callable ``(name, param) -> rule | None``, or None; the model's
            ``shardlib_init_rules()`` is consulted after it.
        names: the names of each unique parameter (canonical first); default from the model.

    Raises:
        ShardingError: a malformed rule (naming the parameter).
    """
    if names is None:
        seen: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            seen.setdefault(id(p), []).append(n)
        names = list(seen.values())
    params = dict(model.named_parameters(remove_duplicate=False))
    sources: list = []
    if rules is not None:
        sources.append(rules)
    own = getattr(model, "shardlib_init_rules", None)
    if callable(own):
        sources.append(own())
    out: dict[str, tuple] = {}
    for group in names:
        for source in sources:
            rule = None
            for n in group:
                if callable(source):
                    rule = source(n, params[n])
                else:
                    rule = next((r for pat, r in source.items() if fnmatch.fnmatchcase(n, pat)), None)
                if rule is not None:
                    break
            if rule is not None:
                out[group[0]] = _check_rule(rule, group[0])
                break
    rest = [g for g in names if g[0] not in out]
    if rest:  # the model's own init function (Hugging Face's _init_weights), read on meta
        from .own_init import rules_from_own_init

        found, unsupported = rules_from_own_init(model, rest)
        for group in rest:
            if group[0] in unsupported:
                raise ShardingError(
                    f"parameter {group[0]} of shape {tuple(params[group[0]].shape)} has no init rule, and the model's "
                    f"own init cannot stand in for one: {unsupported[group[0]]}, which a rule cannot reproduce from "
                    "global element indices. Fix: pass init_rules={pattern: ('normal', std) | ('uniform', lo, hi) | "
                    "('zeros',) | ...} for it, or build the model on CPU"
                )
            if group[0] in found:
                out[group[0]] = _check_rule(found[group[0]], group[0])
    return out


def missing_rule_error(name: str, shape: tuple) -> ShardingError:
    return ShardingError(
        f"parameter {name} of shape {shape} is on the meta device, but no init rule covers it, so shard() cannot "
        "materialize it. Fix: pass init_rules={pattern: ('normal', std) | ('zeros',) | ...} (or a callable "
        "(name, param) -> rule), give the model a shardlib_init_rules() method, or build the model on CPU"
    )


def stream_of(name: str) -> int:
    """The random stream of a parameter: CRC-32 of its canonical name."""
    return zlib.crc32(name.encode())


def global_flat_index(pp: Any, mesh_shape: dict[str, int], coords: dict[str, int], start: int, stop: int,
                      device=None) -> torch.Tensor:
    """Global flat indices of elements ``[start, stop)`` of ``pp``'s tensor-parallel local block
    (flattened row-major), as int64 ``(stop - start,)``.

    The local block is this rank's rows of each of the ``tp_blocks`` of ``tp_dim``
    (:meth:`~shardlib.plan_items.ParamPlan.tp_pieces`), joined, as
    :func:`shardlib.load_full_state_dict` slices a full tensor.
    """
    i = torch.arange(start, stop, dtype=torch.int64, device=device)
    if pp.tp_axis is None:
        return i
    g, d = pp.global_shape, pp.tp_dim
    pieces = pp.tp_pieces(mesh_shape, coords)
    inner = 1
    for s in g[d + 1 :]:
        inner *= s
    n_local = sum(w for _, w in pieces)
    if n_local == 0:
        return i
    outer, m, r = i // (n_local * inner), (i // inner) % n_local, i % inner
    # local row m lies in piece j (local starts: running sum of widths); global row = start_j + m - local_j
    widths = torch.tensor([w for _, w in pieces], dtype=torch.int64, device=device)
    local_start = torch.cumsum(widths, 0) - widths
    shift = torch.tensor([s for s, _ in pieces], dtype=torch.int64, device=device) - local_start
    j = torch.searchsorted(torch.cumsum(widths, 0), m, right=True)
    gm = m + shift[j]
    return (outer * g[d] + gm) * inner + r


class LazyInit:
    """Fills flat ZeRO chunks of a meta-built model from the init rules (used by ZeroRuntime).

    Args:
        plan: the :class:`~shardlib.plan.Plan` (its ``init_rules`` and ``init_seed``).
    """

    def __init__(self, plan: Any):
        self.plan = plan
        self.rules = dict(plan.init_rules)
        self.seed = plan.init_seed
        self.mesh_shape = dict(plan.mesh_shape)
        self.coords = plan.coords()
        self.by_name = {p.name: p for p in plan.params}

    @torch.no_grad()
    def fill(self, chunk: Any, out: torch.Tensor, lo: int) -> None:
        """Fill ``out`` (flat, elements ``[lo, lo + out.numel())`` of ``chunk``; padding zero)."""
        if out.device.type == "meta":  # a dry run: shapes only
            return
        hi = lo + out.numel()
        out.zero_()
        for name, off in zip(chunk.params, chunk.offsets):
            pp = self.by_name[name]
            n = 1
            for s in self.plan.local_shape(pp):
                n *= s
            a, b = max(lo, off), min(hi, off + n)
            kind, args, stream = _split(self.rules[name], name)
            for s in range(a, b, _BLOCK):
                e = min(b, s + _BLOCK)
                idx = global_flat_index(pp, self.mesh_shape, self.coords, s - off, e - off, out.device)
                out[s - lo : e - lo].copy_(counter_values(kind, args, self.seed, stream, idx))

    def filled(self, chunk: Any, owned: slice, device) -> torch.Tensor:
        """Elements ``owned`` of a chunk (stages 0-2: all of it; stage 3: this rank's shard), in
        the chunk's (master) dtype, filled; on ``meta`` only allocated."""
        out = torch.empty(owned.stop - owned.start, dtype=chunk.dtype, device=device)
        self.fill(chunk, out, owned.start)
        return out


def materialize_meta(model: nn.Module, device: torch.device, mesh: Any = None, root: nn.Module | None = None) -> None:
    """Give every meta parameter of ``model`` a placeholder on ``device`` (right shape, one
    element of storage: ZeroRuntime points it into its chunk) and allocate and fill meta buffers.

    Parameter objects are replaced (a meta tensor cannot change device in place): hooks set by
    the tensor-parallel lowering (gradient sums over the tensor axis) are installed again on
    the new ones; other hooks on meta parameters are not carried over. ``root``: the whole model
    when ``model`` is part of it (a pipeline stage), for its own init function (buffers).
    """
    from .parallel.tensor import sum_grad_over

    new_of: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, prm in list(module._parameters.items()):
            if prm is None or prm.device.type != "meta":
                continue
            new = new_of.get(id(prm))
            if new is None:
                data = torch.zeros((), dtype=prm.dtype, device=device).expand(prm.shape)
                new = nn.Parameter(data, requires_grad=prm.requires_grad)
                axis = prm.__dict__.get("_shardlib_grad_sum")
                new.__dict__.update({k: v for k, v in prm.__dict__.items() if k != "_shardlib_grad_sum"})
                if axis is not None:
                    sum_grad_over(new, axis, mesh)
                new_of[id(prm)] = new
            module._parameters[key] = new
    init_meta_buffers(model, device, root)


def init_meta_buffers(model: nn.Module, device: torch.device, root: nn.Module | None = None) -> None:
    """Allocate every meta buffer on ``device`` and have its module fill it (see the module doc).

    ``root``: the whole model ``model`` is part of (a pipeline stage's modules belong to it),
    whose own init function covers them; default ``model``.

    Raises:
        ShardingError: a meta buffer whose module defines no ``shardlib_init_buffers()``, is not
            a norm with running statistics and is not covered by the model's own init function,
            or one that function leaves unwritten; naming it.
    """
    from .own_init import fill_buffers_from_own_init, own_init_calls

    own_init: dict[int, Callable] | None = None
    for path, module in model.named_modules():
        meta = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        hook: Callable | None = getattr(module, "shardlib_init_buffers", None)
        if hook is None and hasattr(module, "reset_running_stats"):
            hook = module.reset_running_stats
        if hook is None:  # the model's own init (Hugging Face's _init_weights) recomputes it
            if own_init is None:
                own_init = {id(m): fn for m, fn in own_init_calls(model if root is None else root)}
            fn = own_init.get(id(module))
            hook = lambda module=module, meta=meta, path=path, fn=fn: fill_buffers_from_own_init(
                model if root is None else root, module, meta, path, fn)
            if fn is None:
                hook()  # raises, naming the buffer
        for k in meta:
            module._buffers[k] = torch.empty_like(module._buffers[k], device=device)
        if torch.device(device).type == "meta":  # a dry run: shapes only
            continue
        with torch.no_grad():
            hook()


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int = 0, rules: Any = None, device: Any = None) -> nn.Module:
    """Initialize every parameter of ``model`` by the mesh-independent rules, in place.

    The single-device counterpart of ``shard(meta_model, ..., init_seed=seed)``: both give every
    element the value :func:`shardlib.random.counter_values` assigns to its global index, so
    ``full_state_dict`` of the sharded model equals this model's state dict bit for bit. A model
    on ``meta`` is first moved to ``device`` (default :func:`default_device`) and its meta buffers
    filled as described in the module doc.

    Args:
        model: the module; every parameter needs a rule (``rules`` or ``shardlib_init_rules()``).
        seed: the init seed (``init_seed`` of :func:`~shardlib.plan`).
        rules: ``{glob: rule}`` or ``(name, param) -> rule``, see the module doc.
        device: where to materialize a meta model.

    Returns:
        ``model``.

    Raises:
        ShardingError: a parameter with no rule, or a malformed rule (naming the parameter).

    Example:
        >>> m = init_parameters(torch.nn.Linear(3, 2), seed=0, rules={"weight": ("normal", 0.02), "bias": ("zeros",)})
        >>> m.bias.tolist()
        [0.0, 0.0]
    """
    if any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())):
        device = default_device() if device is None else torch.device(device)
        meta_buffers = {id(b) for b in model.buffers() if b.device.type == "meta"}
        new_of: dict[int, nn.Parameter] = {}  # a tied meta tensor gets one new parameter
        for module in model.modules():
            for key, prm in list(module._parameters.items()):
                if prm is not None and prm.device.type == "meta":
                    if id(prm) not in new_of:
                        new_of[id(prm)] = nn.Parameter(torch.empty_like(prm, device=device), requires_grad=prm.requires_grad)
                    module._parameters[key] = new_of[id(prm)]
        if meta_buffers:
            init_meta_buffers(model, device)
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    resolved = resolve_init_rules(model, rules, list(groups.values()))
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in groups.values():
        prm = params[names[0]]
        if names[0] not in resolved:
            raise ShardingError(
                f"parameter {names[0]} of shape {tuple(prm.shape)} has no init rule. Fix: pass rules={{pattern: rule}} "
                "or give the model a shardlib_init_rules() method"
            )
        if prm.device.type == "meta":  # materialize_on("meta"): shapes only
            continue
        kind, args, stream = _split(resolved[names[0]], names[0])
        flat = prm.view(-1)
        for s in range(0, flat.numel(), _BLOCK):
            e = min(flat.numel(), s + _BLOCK)
            idx = torch.arange(s, e, dtype=torch.int64, device=prm.device)
            flat[s:e].copy_(counter_values(kind, args, seed, stream, idx))
    return model

