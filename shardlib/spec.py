"""PartitionSpec, NamedSharding, and the rules that attach specs to parameters.

Modelled on JAX's ``jax/_src/partition_spec.py`` and ``named_sharding.py``: a
:class:`PartitionSpec` has one entry per tensor dimension, each ``None`` (replicated along that
dimension), a mesh axis name, or a tuple of axis names (sharded over their product, first name
outermost). Specs reach parameters three ways, strongest first:

1. ``annotate(param, spec)`` on the parameter itself;
2. glob patterns over the names of ``model.named_parameters()``, first match wins
   (``{"*.attn.c_attn.weight": P("tp", None)}``);
3. otherwise replicated, ``P()``.

Specs may be written with *logical* axis names (``P("vocab", "embed")``) and a table of logical
axis rules mapping them to mesh axes (``{"vocab": "tp", "embed": None}``), as in flax/MaxText.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from .errors import ShardingError

__all__ = [
    "PartitionSpec",
    "P",
    "NamedSharding",
    "annotate",
    "get_annotation",
    "logical_to_mesh",
    "resolve_specs",
    "shard_range",
    "distribute",
]

AxisEntry = Union[None, str, tuple]


def _normalize_entry(entry: Any, position: int) -> AxisEntry:
    if entry is None:
        return None
    if isinstance(entry, str):
        if not entry:
            raise ShardingError(f"PartitionSpec entry {position} is an empty axis name; use None for a replicated dimension")
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ShardingError(
                    f"PartitionSpec entry {position} is {entry!r}: a tuple entry must hold non-empty axis names (str)"
                )
        if len(names) == 0:
            return None
        if len(names) == 1:
            return names[0]
        return names
    raise ShardingError(
        f"PartitionSpec entry {position} is {entry!r} of type {type(entry).__name__}; "
        "each entry must be None, an axis name, or a tuple of axis names"
    )


class PartitionSpec(tuple):
    """How a tensor is laid out over a mesh: one entry per tensor dimension.

    Each entry is ``None`` (the dimension is not split), an axis name (split over that mesh
    axis), or a tuple of axis names (split over the product of those axes, first name
    outermost). Trailing dimensions not named are replicated, so ``P()`` is fully replicated and
    ``P("tp")`` on a ``[out, in]`` weight equals ``P("tp", None)``.

    Immutable and hashable; prints as ``P('tp', None)``. An axis may appear at most once in a
    spec (checked here, for every spec, at construction).

    Raises:
        ShardingError: an entry that is not None, a str or a tuple of str, or an axis named twice.

    Example:
        >>> P("dp", None)
        P('dp', None)
        >>> P(("dp", "tp"), None).axes
        ('dp', 'tp')
    """

    def __new__(cls, *entries: Any) -> "PartitionSpec":
        normalized = tuple(_normalize_entry(e, i) for i, e in enumerate(entries))
        seen: dict[str, int] = {}
        for i, entry in enumerate(normalized):
            for name in _entry_names(entry):
                if name in seen:
                    raise ShardingError(
                        f"PartitionSpec{tuple(entries)!r} uses mesh axis {name!r} twice "
                        f"(dimensions {seen[name]} and {i}); a tensor can be split over an axis only "
                        "once. Fix: name the axis in one entry, or use a tuple entry for a product of axes"
                    )
                seen[name] = i
        return super().__new__(cls, normalized)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    __str__ = __repr__

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis named in the spec, in dimension order."""
        return tuple(name for entry in self for name in _entry_names(entry))

    def entry(self, dim: int) -> AxisEntry:
        """The entry for tensor dimension ``dim`` (``None`` beyond the spec's length)."""
        return self[dim] if dim < len(self) else None

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The axis names dimension ``dim`` is split over (empty when replicated)."""
        return _entry_names(self.entry(dim))

    @property
    def is_replicated(self) -> bool:
        return not self.axes


P = PartitionSpec


def _entry_names(entry: AxisEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def as_spec(value: Any, where: str = "spec") -> PartitionSpec:
    """Coerce ``None``, a tuple/list of entries, or a PartitionSpec into a PartitionSpec."""
    if value is None:
        return P()
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, (tuple, list)):
        return P(*value)
    raise ShardingError(
        f"{where} is {value!r} of type {type(value).__name__}; expected a PartitionSpec such as "
        "P('dp', None), a tuple of entries, or None for replicated"
    )


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` slice of a dimension of ``size`` held by shard ``index`` of ``parts``.

    torch.chunk / DTensor ``Shard`` layout: blocks of ``ceil(size / parts)`` elements, so the last
    shards may be shorter or empty when ``parts`` does not divide ``size``.

    Example:
        >>> [shard_range(6, 4, i) for i in range(4)]
        [(0, 2), (2, 4), (4, 6), (6, 6)]
    """
    block = -(-size // parts) if parts > 0 else size
    start = min(index * block, size)
    return start, min(start + block, size)


@dataclass(frozen=True)
class NamedSharding:
    """A PartitionSpec bound to a mesh (JAX's ``NamedSharding``).

    Args:
        mesh: a :class:`~shardlib.mesh.Mesh` or :class:`~shardlib.mesh.AbstractMesh`.
        spec: the PartitionSpec.

    Raises:
        ShardingError: the spec names an axis the mesh does not have.
    """

    mesh: Any
    spec: PartitionSpec

    def __post_init__(self):
        object.__setattr__(self, "spec", as_spec(self.spec))
        for name in self.spec.axes:
            if name not in self.mesh.shape:
                raise ShardingError(
                    f"{self.spec} names axis {name!r}, but the mesh has axes {dict(self.mesh.shape)}. "
                    f"Fix: use one of {list(self.mesh.shape)}"
                )

    def num_shards(self, dim: int) -> int:
        """How many pieces dimension ``dim`` is split into."""
        n = 1
        for name in self.spec.dim_axes(dim):
            n *= self.mesh.shape[name]
        return n

    def shard_index(self, dim: int, coords: Mapping[str, int]) -> int:
        """This rank's piece of dimension ``dim`` given its mesh coordinates (first axis outer)."""
        index = 0
        for name in self.spec.dim_axes(dim):
            index = index * self.mesh.shape[name] + coords[name]
        return index

    def local_slices(self, shape: Sequence[int], coords: Mapping[str, int]) -> tuple[slice, ...]:
        """Slices into a global tensor of ``shape`` selecting the shard at ``coords``."""
        out = []
        for dim, size in enumerate(shape):
            start, stop = shard_range(size, self.num_shards(dim), self.shard_index(dim, coords))
            out.append(slice(start, stop))
        return tuple(out)

    def local_shape(self, shape: Sequence[int], coords: Mapping[str, int]) -> tuple[int, ...]:
        """The local shape at ``coords`` of a global tensor of ``shape`` (uneven: torch.chunk)."""
        return tuple(s.stop - s.start for s in self.local_slices(shape, coords))


# ---------------------------------------------------------------------------------------------
# Attaching specs to parameters

_ANNOTATION = "_shardlib_spec"


def annotate(param: torch.Tensor, spec: Any) -> torch.Tensor:
    """Attach ``spec`` to ``param``; it wins over every glob pattern. Returns ``param``.

    Raises:
        ShardingError: ``param`` is not a tensor, or the spec has more entries than ``param`` has
            dimensions.

    Example:
        >>> w = torch.nn.Linear(4, 8).weight
        >>> annotate(w, P("tp", None)) is w
        True
    """
    if not isinstance(param, torch.Tensor):
        raise ShardingError(f"annotate() takes a parameter tensor, got {type(param).__name__}")
    spec = as_spec(spec, "annotate(spec)")
    if len(spec) > param.dim():
        raise ShardingError(
            f"annotate(): {spec} has {len(spec)} entries but the parameter has shape {tuple(param.shape)} "
            f"({param.dim()} dimension{'s' if param.dim() != 1 else ''}). Fix: give at most {param.dim()} entries"
        )
    setattr(param, _ANNOTATION, spec)
    return param


def get_annotation(param: torch.Tensor) -> PartitionSpec | None:
    """The spec attached by :func:`annotate`, or ``None``."""
    return getattr(param, _ANNOTATION, None)


def logical_to_mesh(spec: Any, rules: Mapping[str, Any] | Iterable[tuple[str, Any]], where: str = "spec") -> PartitionSpec:
    """Translate a spec written in logical (model) axis names into mesh axis names.

    ``rules`` maps each logical name to a mesh axis, a tuple of mesh axes, or ``None``
    (flax ``logical_axis_rules`` / MaxText). As in flax, a logical axis whose mesh axis is already
    used by an earlier dimension of the same spec falls back to ``None``.

    Raises:
        ShardingError: a logical name with no rule; ``rules`` neither a mapping nor pairs.

    Example:
        >>> logical_to_mesh(P("vocab", "embed"), {"vocab": "tp", "embed": None})
        P('tp', None)
    """
    table = _rule_table(rules)
    spec = as_spec(spec, where)
    used: set[str] = set()
    out = []
    for entry in spec:
        names = []
        for logical in _entry_names(entry):
            if logical not in table:
                raise ShardingError(
                    f"{where} {spec} uses logical axis {logical!r}, which has no rule in the logical axis "
                    f"rules {table}. Fix: add a rule {{{logical!r}: <mesh axis or None>}}"
                )
            for mesh_axis in _entry_names(_normalize_entry(table[logical], 0)):
                if mesh_axis not in used:
                    names.append(mesh_axis)
                    used.add(mesh_axis)
        out.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return P(*out)


def _rule_table(rules: Any) -> dict:
    """Logical axis rules as a dict; a mapping or an iterable of ``(logical name, mesh axes)``
    pairs, else a ShardingError naming what was given."""
    if isinstance(rules, Mapping):
        return dict(rules)
    if isinstance(rules, Iterable) and not isinstance(rules, (str, bytes)):
        items = list(rules)
        if all(isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) for item in items):
            return dict(items)
    raise ShardingError(
        f"logical axis rules must map logical axis names to mesh axes, got {rules!r} of type {type(rules).__name__}. "
        "Fix: pass {'vocab': 'tp', 'embed': None} or [('vocab', 'tp'), ('embed', None)]"
    )


def _as_rule_list(specs: Any) -> list[tuple[str, PartitionSpec]]:
    if specs is None:
        return []
    if not isinstance(specs, Mapping) and (not isinstance(specs, Iterable) or isinstance(specs, (str, bytes))):
        raise ShardingError(
            f"specs must map glob patterns (str) to PartitionSpecs, got {specs!r} of type {type(specs).__name__}. "
            "Fix: pass {'*.weight': P('dp', None)} or [('*.weight', P('dp', None))]"
        )
    items = specs.items() if isinstance(specs, Mapping) else specs
    rules = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ShardingError(
                f"specs must map glob patterns (str) to PartitionSpecs, got the item {item!r}. "
                "Fix: pass {'*.weight': P('dp', None)} or [('*.weight', P('dp', None))]"
            )
        pattern, spec = item
        rules.append((pattern, as_spec(spec, f"specs[{pattern!r}]")))
    return rules


def resolve_specs(
    module: torch.nn.Module,
    specs: Any = None,
    logical_axis_rules: Any = None,
    strict: bool = True,
) -> dict[str, tuple[PartitionSpec, str]]:
    """The spec of every unique parameter of ``module`` and where it came from.

    Args:
        module: the model; its parameters are named as in ``module.named_parameters()``.
        specs: ``None``, a mapping, or a sequence of ``(glob pattern, spec)`` pairs; the first
            pattern matching any of a parameter's names wins (``fnmatch`` syntax, ``*`` crosses
            dots).
        logical_axis_rules: optional table from logical axis names to mesh axes; when given,
            every spec (pattern or annotation) is translated with :func:`logical_to_mesh`.
        strict: raise for a pattern that matches nothing (off for a pipeline stage, which holds
            a part of the model checked whole before).

    Returns:
        ``{name: (spec, source)}`` keyed by the canonical (first) name of each unique parameter;
        ``source`` is ``"annotation"``, ``"pattern '<glob>'"`` or ``"default"``.

    Raises:
        ShardingError: ``specs`` neither a mapping nor a sequence of pairs, or an item that is not
            ``(str, spec)``; a pattern that matches no parameter (the message says so when it matches
            a buffer, which is never sharded); a tied parameter whose names are
            matched by patterns giving different specs.
    """
    rules = _as_rule_list(specs)
    names_of: dict[int, list[str]] = {}
    param_of: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        param_of[id(param)] = param

    used_patterns: set[int] = set()
    out: dict[str, tuple[PartitionSpec, str]] = {}
    for key, names in names_of.items():
        param = param_of[key]
        annotation = get_annotation(param)
        chosen: tuple[PartitionSpec, str] | None = None
        per_name: dict[str, tuple[PartitionSpec, str]] = {}
        for name in names:
            for i, (pattern, spec) in enumerate(rules):
                if fnmatch.fnmatchcase(name, pattern):
                    used_patterns.add(i)
                    per_name[name] = (spec, f"pattern {pattern!r}")
                    break
        if annotation is not None:
            chosen = (annotation, "annotation")
        elif per_name:
            distinct = {spec for spec, _ in per_name.values()}
            if len(distinct) > 1:
                detail = ", ".join(f"{n} -> {s} ({src})" for n, (s, src) in per_name.items())
                raise ShardingError(
                    f"tied parameter {names} of shape {tuple(param.shape)} gets conflicting specs: {detail}. "
                    "A tied parameter is one tensor and has one layout. Fix: make the patterns agree, "
                    "or annotate(param, spec) once"
                )
            chosen = next(iter(per_name.values()))
        else:
            chosen = (P(), "default")
        spec, source = chosen
        if logical_axis_rules is not None:
            spec = logical_to_mesh(spec, logical_axis_rules, where=f"the spec of {names[0]}")
        out[names[0]] = (spec, source)

    for i, (pattern, spec) in enumerate(rules):
        if strict and i not in used_patterns:
            hits = [n for ns in names_of.values() for n in ns if fnmatch.fnmatchcase(n, pattern)]
            if hits:
                shadow = next(q for q, _ in rules[:i] if fnmatch.fnmatchcase(hits[0], q))
                raise ShardingError(
                    f"spec pattern {pattern!r} -> {spec} is never used: every parameter it matches is matched first by "
                    f"the earlier pattern {shadow!r} (first match wins). Fix: move {pattern!r} before it, or remove it"
                )
            buffers = [n for n, _ in module.named_buffers() if fnmatch.fnmatchcase(n, pattern)]
            if buffers:
                raise ShardingError(
                    f"spec pattern {pattern!r} -> {spec} matches only buffers of {type(module).__name__} "
                    f"({', '.join(buffers[:4])}{', ...' if len(buffers) > 4 else ''}), no parameter. A buffer is "
                    "not sharded: every rank holds it whole, as DDP and FSDP keep buffers. Fix: remove the "
                    "pattern, or make the tensor an nn.Parameter (requires_grad=False) to shard it"
                )
            all_names = [n for ns in names_of.values() for n in ns]
            sample = ", ".join(all_names[:6]) + (", ..." if len(all_names) > 6 else "")
            raise ShardingError(
                f"spec pattern {pattern!r} -> {spec} matches no parameter of {type(module).__name__} "
                f"(parameters: {sample}). Fix: correct the pattern (fnmatch syntax, e.g. '*.c_attn.weight') "
                "or remove it"
            )
    return out


def distribute(tensor: torch.Tensor, mesh: Any, spec: Any, *, uneven: bool = False) -> torch.Tensor:
    """This rank's shard of a global tensor held whole on every rank.

    For tests and examples that build the global batch on every rank from one seed. By default
    every dimension the spec splits must divide evenly: a batch split 2/1 over ``dp=2`` would
    give the ranks unequal local batches, and the gradient averaged over the data axes (DDP's
    mean of per-rank means) would no longer be the gradient of the global mean loss.

    Args:
        tensor: the global tensor, e.g. a batch ``(batch, seq)``.
        mesh: the mesh (:class:`~shardlib.Mesh` or :class:`~shardlib.AbstractMesh`); its
            ``rank`` picks the shard.
        spec: the layout, e.g. ``P("dp")`` (batch split over ``dp``) or ``P(("dp", "fsdp"), None)``.
        uneven: allow a split dimension that the axes do not divide, in the torch.chunk layout
            (blocks of ``ceil(size / N)``: trailing ranks get fewer elements, possibly none).

    Returns:
        A view of the local shard: for ``P("dp")`` on a ``(B, T)`` tensor and ``dp = N``, shape
        ``(B / N, T)`` (with ``uneven=True``, ``ceil(B / N)`` rows or fewer).

    Raises:
        ShardingError: ``tensor`` is not a tensor or ``mesh`` not a mesh; the spec names an
            unknown axis or has more entries than ``tensor`` has dimensions; without ``uneven``,
            a split dimension that the number of its shards does not divide (the message names
            the shape, the dimension, the axes and their sizes). Local checks, no communication.

    Example:
        >>> from shardlib.mesh import AbstractMesh
        >>> distribute(torch.arange(8), AbstractMesh({"dp": 4}, rank=1), P("dp")).tolist()
        [2, 3]
        >>> distribute(torch.arange(6), AbstractMesh({"dp": 4}, rank=3), P("dp"), uneven=True).tolist()
        []
    """
    if not isinstance(tensor, torch.Tensor):
        raise ShardingError(f"distribute() takes a global tensor, got {type(tensor).__name__}")
    if not (hasattr(mesh, "shape") and hasattr(mesh, "coords")):
        raise ShardingError(
            f"distribute(): mesh must be a shardlib Mesh or AbstractMesh, got {type(mesh).__name__}. "
            "Fix: pass the mesh from init_mesh() (e.g. smodel.mesh)"
        )
    if not isinstance(uneven, bool):
        raise ShardingError(f"distribute(): uneven must be True or False, got {uneven!r}")
    spec = as_spec(spec, "distribute(spec)")
    if len(spec) > tensor.dim():
        raise ShardingError(
            f"distribute(): {spec} has {len(spec)} entries but the tensor has shape {tuple(tensor.shape)}; "
            f"give at most {tensor.dim()} entries"
        )
    sharding = NamedSharding(mesh, spec)
    for dim, size in enumerate(tensor.shape):
        parts = sharding.num_shards(dim)
        if not uneven and size % parts:
            axes = spec.dim_axes(dim)
            sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ShardingError(
                f"distribute(): {spec} splits dimension {dim} (size {size}) of the tensor of shape "
                f"{tuple(tensor.shape)} over {axes[0] if len(axes) == 1 else axes} ({sizes}: {parts} shards), which does "
                f"not divide {size}: the ranks would get unequal shards ({size % parts} left over), and for a batch the "
                f"gradient averaged over the data axes is the global mean loss's only for equal local batches. Fix: a "
                f"size divisible by {parts} (pad or trim the batch), or distribute(..., uneven=True) for the torch.chunk layout"
            )
    return tensor[sharding.local_slices(tensor.shape, mesh.coords())]
