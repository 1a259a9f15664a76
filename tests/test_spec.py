"""Tier 0 tests of shardlib/spec.py: PartitionSpec, NamedSharding, spec rules, distribute.

No process group: everything runs against an :class:`~shardlib.AbstractMesh`.
"""

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shardlib
from shardlib import AbstractMesh, NamedSharding, P, PartitionSpec, ShardingError, annotate, distribute, logical_to_mesh
from shardlib.spec import as_spec, get_annotation, resolve_specs, shard_range
from shardlib.testing import TiedLM


def mlp() -> nn.Module:
    # 0.weight (6, 4), 0.bias (6,), 2.weight (2, 6), 2.bias (2,)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


# ---------------------------------------------------------------------------------------------
# PartitionSpec


def test_p_is_partition_spec_and_a_tuple():
    assert P is PartitionSpec
    spec = P("dp", None)
    assert isinstance(spec, tuple) and tuple(spec) == ("dp", None)
    assert len(spec) == 2


@pytest.mark.parametrize(
    "entries, normalized",
    [
        (("dp", None), ("dp", None)),
        ((("dp",), None), ("dp", None)),  # a one-name tuple is the name
        ((["dp", "tp"],), (("dp", "tp"),)),  # a list entry becomes a tuple
        (((), "tp"), (None, "tp")),  # an empty tuple is replicated
        ((("dp", "tp"), None), (("dp", "tp"), None)),
        ((), ()),
    ],
)
def test_entries_are_normalized(entries, normalized):
    assert tuple(P(*entries)) == normalized
    assert P(*entries) == P(*normalized)


def test_repr_is_jax_style():
    assert repr(P("dp", None)) == "P('dp', None)"
    assert str(P(("dp", "tp"), None)) == "P(('dp', 'tp'), None)"
    assert repr(P()) == "P()"
    assert repr(P(["fsdp"])) == "P('fsdp')"


def test_hash_and_equality_follow_normalized_entries():
    assert hash(P(("dp",), None)) == hash(P("dp", None))
    assert {P("dp", None): 1}[P(["dp"], None)] == 1
    assert P("dp", None) != P(None, "dp")
    assert len({P("dp"), P(("dp",)), P("tp"), P()}) == 3


@pytest.mark.parametrize("spec", [P(), P("dp", None), P(("dp", "tp"), None, "pp")])
def test_pickle_round_trip(spec):
    back = pickle.loads(pickle.dumps(spec))
    assert type(back) is PartitionSpec
    assert back == spec and hash(back) == hash(spec) and repr(back) == repr(spec)


def test_empty_spec_is_replicated():
    spec = P()
    assert spec.is_replicated and spec.axes == () and len(spec) == 0
    assert spec.entry(0) is None and spec.entry(5) is None
    assert P(None, None).is_replicated


def test_axes_entry_and_dim_axes():
    spec = P(("dp", "fsdp"), None, "tp")
    assert spec.axes == ("dp", "fsdp", "tp")
    assert not spec.is_replicated
    assert spec.entry(0) == ("dp", "fsdp") and spec.entry(1) is None and spec.entry(2) == "tp"
    assert spec.entry(7) is None  # beyond the spec: replicated
    assert spec.dim_axes(0) == ("dp", "fsdp") and spec.dim_axes(1) == () and spec.dim_axes(2) == ("tp",)
    assert spec.dim_axes(3) == ()


@pytest.mark.parametrize(
    "entries, match",
    [
        (("dp", "dp"), r"uses mesh axis 'dp' twice \(dimensions 0 and 1\)"),
        ((("dp", "tp"), None, "tp"), r"uses mesh axis 'tp' twice \(dimensions 0 and 2\)"),
        ((("dp", "dp"),), r"uses mesh axis 'dp' twice"),
    ],
)
def test_axis_twice_is_rejected(entries, match):
    with pytest.raises(ShardingError, match=match):
        P(*entries)


@pytest.mark.parametrize(
    "entries, match",
    [
        ((1,), r"entry 0 is 1 of type int; each entry must be None, an axis name, or a tuple"),
        ((None, 2.5), r"entry 1 is 2.5 of type float"),
        (("",), r"entry 0 is an empty axis name; use None"),
        ((("dp", 3),), r"entry 0 is \('dp', 3\): a tuple entry must hold non-empty axis names"),
        ((None, ("dp", "")), r"entry 1 is \('dp', ''\)"),
        (({"dp"},), r"of type set"),
    ],
)
def test_bad_entry_types_are_rejected(entries, match):
    with pytest.raises(ShardingError, match=match):
        P(*entries)


def test_sharding_error_is_a_value_error():
    with pytest.raises(ValueError):
        P(1)


def test_as_spec_coerces():
    assert as_spec(None) == P()
    assert as_spec(("dp", None)) == P("dp", None)
    assert as_spec(["tp"]) == P("tp")
    spec = P("dp")
    assert as_spec(spec) is spec
    with pytest.raises(ShardingError, match=r"my spec is 'dp' of type str; expected a PartitionSpec"):
        as_spec("dp", "my spec")


# ---------------------------------------------------------------------------------------------
# shard_range


@pytest.mark.parametrize(
    "size, parts, expected",
    [
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (6, 4, [(0, 2), (2, 4), (4, 6), (6, 6)]),  # uneven: the last shard is empty
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # more shards than elements
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_shard_range_examples(size, parts, expected):
    assert [shard_range(size, parts, i) for i in range(parts)] == expected


@given(size=st.integers(0, 200), parts=st.integers(1, 17))
def test_shard_ranges_tile_the_dimension(size, parts):
    ranges = [shard_range(size, parts, i) for i in range(parts)]
    block = -(-size // parts)
    # Contiguous, in order, from 0 to size: together they tile [0, size) exactly once.
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        assert stop == start
    lengths = [b - a for a, b in ranges]
    assert all(0 <= n <= block for n in lengths) and sum(lengths) == size
    assert lengths == sorted(lengths, reverse=True)  # short or empty shards only at the end
    # The non-empty shards are exactly torch.chunk's pieces.
    if size:
        assert [n for n in lengths if n] == [len(c) for c in torch.arange(size).chunk(parts)]


# ---------------------------------------------------------------------------------------------
# NamedSharding


def test_named_sharding_local_shape_on_abstract_mesh():
    shape = (10, 5)
    for rank in range(4):
        mesh = AbstractMesh({"dp": 2, "tp": 2}, rank=rank)
        coords = mesh.coords()
        # Rows over dp*tp (4 blocks of 3: 3, 3, 3, 1), dp outer.
        s = NamedSharding(mesh, P(("dp", "tp"), None))
        assert s.num_shards(0) == 4 and s.num_shards(1) == 1
        assert s.shard_index(0, coords) == rank
        assert s.local_shape(shape, coords) == ((3, 5), (3, 5), (3, 5), (1, 5))[rank]
        # Rows over tp (blocks of 5), columns over dp (blocks of 3: 3, 2).
        s = NamedSharding(mesh, P("tp", "dp"))
        assert s.local_shape(shape, coords) == (5, (3, 2)[coords["dp"]])
        assert s.local_slices(shape, coords) == (
            slice(5 * coords["tp"], 5 * coords["tp"] + 5),
            (slice(0, 3), slice(3, 5))[coords["dp"]],
        )


def test_named_sharding_replicated_and_tuple_spec():
    mesh = AbstractMesh({"dp": 2}, rank=1)
    s = NamedSharding(mesh, None)
    assert s.spec == P() and s.local_shape((3, 4), mesh.coords()) == (3, 4)
    s = NamedSharding(mesh, ("dp",))
    assert s.spec == P("dp") and s.local_shape((3, 4), mesh.coords()) == (1, 4)


def test_named_sharding_unknown_axis():
    with pytest.raises(ShardingError, match=r"P\('tp', None\) names axis 'tp', but the mesh has axes \{'dp': 2\}"):
        NamedSharding(AbstractMesh({"dp": 2}), P("tp", None))


# ---------------------------------------------------------------------------------------------
# Attaching specs to parameters


def test_annotate_attaches_and_returns_param():
    w = nn.Linear(4, 8).weight
    assert get_annotation(w) is None
    assert annotate(w, ("dp", None)) is w
    assert get_annotation(w) == P("dp", None)


def test_annotation_wins_over_patterns():
    model = mlp()
    annotate(model[0].weight, P(None, "dp"))
    resolved = resolve_specs(model, {"*.weight": P("dp", None)})
    assert resolved["0.weight"] == (P(None, "dp"), "annotation")
    assert resolved["2.weight"] == (P("dp", None), "pattern '*.weight'")
    assert resolved["0.bias"] == (P(), "default")
    p = shardlib.plan(model, AbstractMesh({"dp": 2}), {"*.weight": P("dp", None)})
    assert p.param("0.weight").spec == P(None, "dp") and p.param("0.weight").source == "annotation"


def test_first_matching_pattern_wins():
    rules = [("0.*", P("dp")), ("*.weight", P(None, "dp")), ("*", P())]
    resolved = resolve_specs(mlp(), rules)
    assert resolved["0.weight"] == (P("dp"), "pattern '0.*'")
    assert resolved["0.bias"] == (P("dp"), "pattern '0.*'")
    assert resolved["2.weight"] == (P(None, "dp"), "pattern '*.weight'")
    assert resolved["2.bias"] == (P(), "pattern '*'")
    # The same rules as a dict keep their order.
    assert resolve_specs(mlp(), dict(rules)) == resolved


def test_star_crosses_dots():
    resolved = resolve_specs(TiedLM(), {"*weight": P("dp")})
    assert resolved["up.weight"][0] == P("dp") and resolved["norm.weight"][0] == P("dp")


def test_logical_to_mesh():
    rules = {"vocab": "tp", "embed": None, "batch": ("dp", "fsdp"), "heads": "tp"}
    assert logical_to_mesh(P("vocab", "embed"), rules) == P("tp", None)
    assert logical_to_mesh(("batch", None), rules) == P(("dp", "fsdp"), None)
    # A mesh axis already used by an earlier dimension falls back to None (flax).
    assert logical_to_mesh(P("vocab", "heads"), rules) == P("tp", None)
    # A tuple of logical axes maps to the product of their mesh axes.
    assert logical_to_mesh(P(("batch", "vocab")), rules) == P(("dp", "fsdp", "tp"))
    # Rules as a sequence of pairs.
    assert logical_to_mesh(P("embed", "vocab"), [("vocab", "tp"), ("embed", None)]) == P(None, "tp")
    assert logical_to_mesh(P(), {}) == P()


def test_logical_axis_rules_in_resolve_specs_and_plan():
    model = mlp()
    specs = {"*.weight": P("hidden", None)}
    resolved = resolve_specs(model, specs, logical_axis_rules={"hidden": "dp"})
    assert resolved["0.weight"] == (P("dp", None), "pattern '*.weight'")
    p = shardlib.plan(model, AbstractMesh({"dp": 2}), specs, logical_axis_rules={"hidden": "dp"})
    assert p.param("2.weight").spec == P("dp", None) and p.zero_stage == 3


def test_resolve_specs_tied_parameter_has_one_entry():
    model = TiedLM()
    assert model.lm_head.weight is model.wte.weight
    resolved = resolve_specs(model, {"lm_head.weight": P("dp", None)})
    assert "lm_head.weight" not in resolved  # keyed by the canonical (first) name
    assert resolved["wte.weight"] == (P("dp", None), "pattern 'lm_head.weight'")
    # Both names matched by patterns that agree.
    resolved = resolve_specs(model, [("wte.weight", P("dp")), ("lm_head.weight", P("dp"))])
    assert resolved["wte.weight"][0] == P("dp")
    # An annotation on the shared tensor wins over conflicting patterns.
    annotate(model.wte.weight, P(None, "dp"))
    resolved = resolve_specs(model, [("wte.weight", P("dp")), ("lm_head.weight", P())])
    assert resolved["wte.weight"] == (P(None, "dp"), "annotation")


def test_plan_tied_parameter_aliases():
    p = shardlib.plan(TiedLM(), AbstractMesh({"dp": 2}), {"lm_head.weight": P("dp")})
    pp = p.param("lm_head.weight")
    assert pp is p.param("wte.weight")
    assert pp.name == "wte.weight" and pp.aliases == ("lm_head.weight",) and pp.spec == P("dp")
    assert [q.name for q in p.params].count("wte.weight") == 1


# ---------------------------------------------------------------------------------------------
# distribute


def test_distribute_uneven_rows_on_abstract_mesh():
    """Uneven only on request (uneven=True): the torch.chunk layout. Refused by default, see
    tests/test_bad_inputs.py (distribute-3-rows-over-dp2 and others)."""
    batch = torch.arange(10).reshape(5, 2)
    pieces = [distribute(batch, AbstractMesh({"dp": 2}, rank=r), P("dp"), uneven=True) for r in range(2)]
    assert [tuple(x.shape) for x in pieces] == [(3, 2), (2, 2)]
    assert torch.equal(torch.cat(pieces), batch)
    pieces = [distribute(batch, AbstractMesh({"dp": 4}, rank=r), P("dp", None), uneven=True) for r in range(4)]
    assert [x.shape[0] for x in pieces] == [2, 2, 1, 0]  # the last rank gets an empty shard
    assert torch.equal(torch.cat(pieces), batch)


def test_distribute_two_dims_and_tuple_axes():
    x = torch.arange(24).reshape(4, 6)
    mesh = AbstractMesh({"dp": 2, "tp": 2}, rank=2)  # dp=1, tp=0
    assert torch.equal(distribute(x, mesh, P("dp", "tp")), x[2:4, 0:3])
    # Columns over dp*tp = 4 (blocks of 2: 2, 2, 2, 0); this rank is index 1 * 2 + 0 = 2.
    assert torch.equal(distribute(x, mesh, P(None, ("dp", "tp")), uneven=True), x[:, 4:6])
    assert torch.equal(distribute(x, AbstractMesh({"dp": 2, "tp": 2}, rank=3), P(None, ("dp", "tp")), uneven=True), x[:, 6:6])
    y = torch.arange(32).reshape(4, 8)  # even: 8 columns over dp*tp = 4, no opt-in needed
    assert torch.equal(distribute(y, mesh, P(None, ("dp", "tp"))), y[:, 4:6])
    assert torch.equal(distribute(x, mesh, P()), x)
