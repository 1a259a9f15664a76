"""Tests of shardlib/mesh: the rank grid, communication accounting, and the autograd collectives.

Tier 0: :class:`AbstractMesh` (no process group) and :class:`CommCounter`. Tier 2: every
autograd collective of ``shardlib/mesh/collectives.py`` on a ``{"dp": 2, "tp": 2}`` mesh of four
gloo workers, forward and backward against values computed by hand in this process, with the
bytes recorded in ``mesh.comm`` against the ring formulas. One pool call checks everything.
"""

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlib import AbstractMesh
from shardlib.mesh import CommCounter, ring_bytes
from shardlib.testing import run_on

# ---------------------------------------------------------------------------------------------
# AbstractMesh: the grid arange(world).reshape(sizes), last axis fastest


def test_coords_and_index_follow_numpy_grid():
    mesh = AbstractMesh({"dp": 2, "tp": 3})
    grid = np.arange(6).reshape(2, 3)
    for (i, j), rank in np.ndenumerate(grid):
        assert mesh.coords(int(rank)) == {"dp": i, "tp": j}
        m = AbstractMesh({"dp": 2, "tp": 3}, rank=int(rank))
        assert (m.index("dp"), m.index("tp"), m.index(("dp", "tp"))) == (i, j, rank)
        assert m.index(("tp", "dp")) == j * 2 + i  # a tuple's index: first axis outer
    assert mesh.size() == 6 and mesh.size("tp") == 3 and mesh.size(("dp", "tp")) == 6
    assert mesh.axis_names == ("dp", "tp") and mesh.shape == {"dp": 2, "tp": 3}


def test_axis_ranks_and_all_groups_2d():
    mesh = AbstractMesh({"dp": 2, "tp": 3}, rank=4)  # dp=1, tp=1
    assert mesh.axis_ranks("tp") == [3, 4, 5]
    assert mesh.axis_ranks("dp") == [1, 4]
    assert mesh.axis_ranks("dp", rank=2) == [2, 5]
    assert mesh.axis_ranks(("dp", "tp")) == [0, 1, 2, 3, 4, 5]
    assert mesh.all_groups("tp") == [[0, 1, 2], [3, 4, 5]]
    assert mesh.all_groups("dp") == [[0, 3], [1, 4], [2, 5]]
    assert mesh.all_groups(("dp", "tp")) == [[0, 1, 2, 3, 4, 5]]
    assert mesh.all_groups(("tp", "dp")) == [[0, 3, 1, 4, 2, 5]]  # ordered by the tuple's index


def test_all_groups_3d_match_numpy():
    shape = {"pp": 2, "dp": 3, "tp": 2}
    mesh = AbstractMesh(shape)
    grid = np.arange(12).reshape(2, 3, 2)
    assert mesh.all_groups("tp") == grid.reshape(-1, 2).tolist()
    assert mesh.all_groups("pp") == grid.transpose(1, 2, 0).reshape(-1, 2).tolist()
    assert mesh.all_groups(("pp", "tp")) == grid.transpose(1, 0, 2).reshape(-1, 4).tolist()
    assert mesh.axis_ranks(("pp", "tp"), rank=9) == [2, 3, 8, 9]  # rank 9 is (pp 1, dp 1, tp 1): dp=1 fixed


def test_group_index_is_the_rank_in_torchs_sorted_group():
    """torch.distributed.new_group sorts the ranks it is given, so the rank of a member of the
    group over axes named in any order (where NCCL's flat collectives put its data) is its
    position among the group's sorted global ranks: group_index gives exactly that, and
    group_axes names every order of the same axes as one group."""
    shape = {"pp": 2, "dp": 3, "fsdp": 2}
    for rank in range(12):
        m = AbstractMesh(shape, rank=rank)
        for k in (1, 2, 3):
            for names in itertools.permutations(shape, k):
                members = m.axis_ranks(names)  # ordered by the index along names as given
                assert m.group_index(names) == sorted(members).index(rank), (rank, names)
                assert set(m.group_axes(names)) == set(names) and m.axis_ranks(m.group_axes(names)) == sorted(members)
    assert AbstractMesh(shape).group_axes(("fsdp", "pp")) == ("pp", "fsdp")
    assert AbstractMesh(shape, rank=1).index(("fsdp", "dp")) == 3 and AbstractMesh(shape, rank=1).group_index(
        ("fsdp", "dp")) == 1


def test_size_one_axes_and_value_semantics():
    mesh = AbstractMesh({"dp": 1, "tp": 2}, rank=1)
    assert mesh.all_groups("dp") == [[0], [1]] and mesh.axis_ranks("dp") == [1]
    assert mesh == AbstractMesh({"dp": 1, "tp": 2}, rank=1) != AbstractMesh({"dp": 1, "tp": 2}, rank=0)
    assert hash(mesh) == hash(AbstractMesh({"dp": 1, "tp": 2}, rank=1))
    assert repr(mesh) == "AbstractMesh({'dp': 1, 'tp': 2}, rank=1)"
    assert mesh.abstract() == mesh
    assert AbstractMesh({"dp": np.int64(2)}).size() == 2


@st.composite
def mesh_shapes(draw):
    n = draw(st.integers(1, 4))
    names = ["pp", "dp", "fsdp", "tp"][:n]
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    return dict(zip(names, sizes))


@settings(max_examples=40, deadline=None)
@given(shape=mesh_shapes(), data=st.data())
def test_groups_partition_ranks_and_differ_in_one_axis(shape, data):
    mesh = AbstractMesh(shape)
    world = mesh.size()
    assert world == int(np.prod(list(shape.values())))
    names = list(shape)
    axes = [(a,) for a in names]
    subset = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    axes.append(tuple(subset))
    for axis in axes:
        groups = mesh.all_groups(axis)
        # The groups partition the ranks.
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))
        assert all(len(g) == mesh.size(axis) for g in groups)
        for group in groups:
            coords = [mesh.coords(r) for r in group]
            for pos, (rank, c) in enumerate(zip(group, coords)):
                # Only the group's axes vary; the others are fixed ...
                assert all(c[n] == coords[0][n] for n in names if n not in axis)
                # ... and a rank's place in the group is its index along the axis.
                m = AbstractMesh(shape, rank=rank)
                assert m.index(axis) == pos
                assert m.axis_ranks(axis) == group
            assert len({tuple(c[n] for n in axis) for c in coords}) == len(group)


# ---------------------------------------------------------------------------------------------
# CommCounter and ring formulas


def test_ring_bytes_formulas():
    assert ring_bytes("all_reduce", 400, 4) == 600  # 2 B (N - 1) / N
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert ring_bytes(kind, 400, 4) == 300  # B (N - 1) / N
    assert ring_bytes("send", 400, 4) == 400
    assert ring_bytes("all_reduce", 100, 3) == Fraction(400, 3)
    assert ring_bytes("all_gather", 100, 1) == 0 and ring_bytes("send", 100, 1) == 0


def test_comm_counter_accumulates_by_axis_and_kind():
    c = CommCounter()
    c.record("dp", "all_reduce", 400, 4)
    c.record("dp", "all_reduce", 100, 4)
    c.record("tp", "all_gather", 90, 3)
    c.record("dp+tp", "reduce_scatter", 80, 8)
    c.record("dp", "all_to_all", 40, 2)
    c.record("pp", "send", 12, 2)
    c.record("tp", "all_reduce", 1000, 1)  # a group of one moves nothing: not counted
    assert c.calls() == 6 and c.calls("dp") == 3 and c.calls(kind="all_reduce") == 2
    assert c.bytes("dp", "all_reduce") == 750.0
    assert c.bytes("tp") == 60.0
    assert c.bytes("dp+tp") == 70.0
    assert c.bytes("dp", "all_to_all") == 20.0 and c.bytes("pp", "send") == 12.0
    assert c.bytes() == 750 + 60 + 70 + 20 + 12
    assert c.exact_bytes() == Fraction(912)
    assert c.table()[("dp", "all_reduce")] == (2, 750.0)
    assert "dp/all_reduce: 2 calls 750 B" in repr(c)
    c.enabled = False
    c.record("dp", "all_reduce", 400, 4)
    assert c.calls() == 6
    c.reset()
    assert c.calls() == 0 and c.bytes() == 0.0 and c.table() == {}


def test_comm_counter_exact_fractions():
    c = CommCounter()
    for _ in range(3):
        c.record("tp", "all_reduce", 100, 3)
    assert c.exact_bytes("tp") == 400  # 3 * 400/3, exactly
    assert c.bytes("tp") == 400.0


# ---------------------------------------------------------------------------------------------
# Autograd collectives on {"dp": 2, "tp": 2}, four gloo ranks

MESH = {"dp": 2, "tp": 2}


def _inp(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank), dtype=torch.float64)


def _wt(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(2000 + rank), dtype=torch.float64)


def _tp_group(r):
    return [2 * (r // 2), 2 * (r // 2) + 1]


def _dp_group(r):
    return [r % 2, r % 2 + 2]


def _collectives_worker():
    """On every rank: each collective's forward value, input gradient and comm tables."""
    import torch.distributed as dist

    import shardlib
    from shardlib import all_gather, all_reduce, all_to_all, ppermute, pvary, reduce_scatter

    mesh = shardlib.init_mesh(MESH)
    r = mesh.rank
    out = {
        "coords": (mesh.index("dp"), mesh.index("tp")),
        "group_ranks": {a: dist.get_process_group_ranks(mesh.group(a)) for a in ("dp", "tp")},
    }

    def check(name, fn, in_shape, out_shape):
        x = _inp(r, in_shape).requires_grad_(True)
        x0 = x.detach().clone()
        mesh.comm.reset()
        y = fn(x)
        fwd = mesh.comm.table()
        mesh.comm.reset()
        (y * _wt(r, out_shape)).sum().backward()
        out[name] = {
            "y": y.detach().clone(),
            "grad": x.grad.clone(),
            "fwd": fwd,
            "bwd": mesh.comm.table(),
            "input_unchanged": torch.equal(x.detach(), x0),
        }

    check("all_reduce_sum_tp", lambda x: all_reduce(x, "tp"), (3,), (3,))
    check("all_reduce_avg_dp", lambda x: all_reduce(x, "dp", op="avg"), (3,), (3,))
    check("all_reduce_sum_world", lambda x: all_reduce(x, ("dp", "tp")), (3,), (3,))
    check("pvary_tp", lambda x: pvary(x, "tp"), (3,), (3,))
    check("all_gather_tp_dim1", lambda x: all_gather(x, "tp", dim=1), (2, 3), (2, 6))
    check("all_gather_world_dim0", lambda x: all_gather(x, ("dp", "tp"), dim=-2), (1, 2), (4, 2))
    check("reduce_scatter_dp_dim0", lambda x: reduce_scatter(x, "dp", dim=0), (4, 3), (2, 3))
    check("reduce_scatter_tp_dim1", lambda x: reduce_scatter(x, "tp", dim=1), (2, 4), (2, 2))
    check("all_to_all_tp", lambda x: all_to_all(x, "tp", split_dim=0, concat_dim=1), (4, 3), (2, 6))
    ring = [(i, (i + 1) % 4) for i in range(4)]
    check("ppermute_ring_world", lambda x: ppermute(x, ("dp", "tp"), ring), (3,), (3,))
    check("ppermute_partial_tp", lambda x: ppermute(x, "tp", [(0, 1)]), (3,), (3,))
    # a transposed input, and a gradient arriving through a transpose: gloo refused the strided
    # receive buffer (the peer waited for the watchdog), forward and backward
    check("ppermute_ring_world_strided", lambda x: ppermute(x.t(), ("dp", "tp"), ring).t(), (2, 3), (2, 3))
    # all_reduce of a transposed input, pvary's all-reduce of a gradient through a transpose: gloo
    # reduces a strided tensor, NCCL refuses it ("Tensors must be contiguous"); check mode refuses
    # what NCCL refuses, so these raised CollectiveDeviceError here before
    check("all_reduce_sum_tp_strided", lambda x: all_reduce(x.t(), "tp").t(), (2, 3), (2, 3))
    check("pvary_tp_strided", lambda x: pvary(x.t(), "tp").t(), (2, 3), (2, 3))

    # Two all_gathers whose outputs are added receive the same gradient tensor in backward.
    x1 = _inp(r, (1, 3)).requires_grad_(True)
    x2 = _inp(r + 4, (1, 3)).requires_grad_(True)
    y = all_gather(x1, "tp") + all_gather(x2, "tp")
    (y * _wt(r, (2, 3))).sum().backward()
    out["shared_grad"] = (x1.grad.clone(), x2.grad.clone())

    # max: forward is the elementwise max; backward has no gradient.
    x = _inp(r, (3,)).requires_grad_(True)
    mesh.comm.reset()
    y = all_reduce(x, ("dp", "tp"), op="max")
    out["all_reduce_max_world"] = {"y": y.detach().clone(), "fwd": mesh.comm.table()}
    try:
        y.sum().backward()
        out["max_backward_error"] = None
    except RuntimeError as exc:
        out["max_backward_error"] = str(exc)

    # On an axis of size 1 each collective still returns a tensor of its own: an in-place op on
    # the output leaves the input as it was, as on the size-2 axes above (it changed it)
    one = shardlib.init_mesh({"dp": 2, "tp": 2, "one": 1})
    untouched = {}
    for name, fn in {
        "all_reduce": lambda t: all_reduce(t, "one", mesh=one),
        "all_gather": lambda t: all_gather(t, "one", 0, mesh=one),
        "reduce_scatter": lambda t: reduce_scatter(t, "one", 0, mesh=one),
        "all_to_all": lambda t: all_to_all(t, "one", 0, 1, mesh=one),
        "ppermute": lambda t: ppermute(t, "one", [(0, 0)], mesh=one),
        "all_gather_tp": lambda t: all_gather(t, "tp", 0, mesh=one),
    }.items():
        x = torch.ones(2, 2)
        y = fn(x)
        y.add_(1)
        untouched[name] = x.eq(1).all().item()
    out["size_one_outputs_leave_the_input_alone"] = untouched
    mesh = shardlib.init_mesh(MESH)

    # Bad calls fail before communicating.
    mesh.comm.reset()
    errors = {}
    for name, fn in {
        "reduce_scatter_indivisible": lambda: reduce_scatter(torch.ones(3), "tp"),
        "all_to_all_indivisible": lambda: all_to_all(torch.ones(3, 2), "tp", split_dim=0, concat_dim=1),
        "unknown_axis": lambda: all_reduce(torch.ones(1), "pp"),
        "ppermute_bad_perm": lambda: ppermute(torch.ones(1), "tp", [(0, 1), (1, 1)]),
        "bad_op": lambda: all_reduce(torch.ones(1), "tp", op="prod"),
        "avg_of_integers": lambda: all_reduce(torch.ones(2, dtype=torch.int64), "tp", op="avg"),
    }.items():
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors[name] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    out["calls_after_errors"] = mesh.comm.calls()
    from shardlib.mesh.collectives import raw_all_reduce

    try:  # the layer under the public collectives: check mode stops a strided tensor before NCCL would
        raw_all_reduce(torch.ones(3, 2).t(), mesh, ("tp",))
        errors["raw_strided"] = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        errors["raw_strided"] = (type(exc).__name__, str(exc))
    # The ranks are still in step: one more collective works.
    out["after"] = all_reduce(torch.ones(1), ("dp", "tp")).item()
    return out


def _expected(r):
    """What each check in _collectives_worker should give on rank r, computed by hand."""
    dp, tp = r // 2, r % 2
    tpg, dpg, world = _tp_group(r), _dp_group(r), [0, 1, 2, 3]
    w = _wt
    ar = lambda axis, n, nbytes: {(axis, "all_reduce"): (1, float(ring_bytes("all_reduce", nbytes, n)))}
    one = lambda axis, kind, n, nbytes: {(axis, kind): (1, float(ring_bytes(kind, nbytes, n)))}
    B = 8  # float64
    exp = {}
    exp["all_reduce_sum_tp"] = (
        sum(_inp(q, (3,)) for q in tpg), w(r, (3,)), ar("tp", 2, 3 * B), {})
    exp["all_reduce_avg_dp"] = (
        sum(_inp(q, (3,)) for q in dpg) / 2, w(r, (3,)) / 2, ar("dp", 2, 3 * B), {})
    exp["all_reduce_sum_world"] = (
        sum(_inp(q, (3,)) for q in world), w(r, (3,)), ar("dp+tp", 4, 3 * B), {})
    exp["pvary_tp"] = (_inp(r, (3,)), sum(w(q, (3,)) for q in tpg), {}, ar("tp", 2, 3 * B))
    exp["all_gather_tp_dim1"] = (
        torch.cat([_inp(q, (2, 3)) for q in tpg], dim=1),
        sum(w(q, (2, 6)) for q in tpg).chunk(2, dim=1)[tp],
        one("tp", "all_gather", 2, 12 * B),
        one("tp", "reduce_scatter", 2, 12 * B),
    )
    exp["all_gather_world_dim0"] = (
        torch.cat([_inp(q, (1, 2)) for q in world], dim=0),
        sum(w(q, (4, 2)) for q in world)[r : r + 1],
        one("dp+tp", "all_gather", 4, 8 * B),
        one("dp+tp", "reduce_scatter", 4, 8 * B),
    )
    exp["reduce_scatter_dp_dim0"] = (
        sum(_inp(q, (4, 3)) for q in dpg).chunk(2, dim=0)[dp],
        torch.cat([w(q, (2, 3)) for q in dpg], dim=0),
        one("dp", "reduce_scatter", 2, 12 * B),
        one("dp", "all_gather", 2, 12 * B),
    )
    exp["reduce_scatter_tp_dim1"] = (
        sum(_inp(q, (2, 4)) for q in tpg).chunk(2, dim=1)[tp],
        torch.cat([w(q, (2, 2)) for q in tpg], dim=1),
        one("tp", "reduce_scatter", 2, 8 * B),
        one("tp", "all_gather", 2, 8 * B),
    )
    exp["all_to_all_tp"] = (
        torch.cat([_inp(q, (4, 3)).chunk(2, dim=0)[tp] for q in tpg], dim=1),
        torch.cat([w(q, (2, 6)).chunk(2, dim=1)[tp] for q in tpg], dim=0),  # dims swapped
        one("tp", "all_to_all", 2, 12 * B),
        one("tp", "all_to_all", 2, 12 * B),
    )
    exp["ppermute_ring_world"] = (
        _inp((r - 1) % 4, (3,)),  # index i receives from i - 1
        w((r + 1) % 4, (3,)),  # the inverse permutation carries the cotangent back
        {("dp+tp", "send"): (1, 3.0 * B)},
        {("dp+tp", "send"): (1, 3.0 * B)},
    )
    exp["all_reduce_sum_tp_strided"] = (
        sum(_inp(q, (2, 3)) for q in tpg), w(r, (2, 3)), ar("tp", 2, 6 * B), {})
    exp["pvary_tp_strided"] = (_inp(r, (2, 3)), sum(w(q, (2, 3)) for q in tpg), {}, ar("tp", 2, 6 * B))
    exp["ppermute_ring_world_strided"] = (
        _inp((r - 1) % 4, (2, 3)),
        w((r + 1) % 4, (2, 3)),
        {("dp+tp", "send"): (1, 6.0 * B)},
        {("dp+tp", "send"): (1, 6.0 * B)},
    )
    zeros = torch.zeros(3, dtype=torch.float64)
    exp["ppermute_partial_tp"] = (
        _inp(tpg[0], (3,)) if tp == 1 else zeros,  # index 0 -> 1; index 0 receives nothing
        w(tpg[1], (3,)) if tp == 0 else zeros,  # inverse: 1 -> 0
        {("tp", "send"): (1, 3.0 * B)} if tp == 0 else {},
        {("tp", "send"): (1, 3.0 * B)} if tp == 1 else {},
    )
    return exp


@pytest.fixture(scope="module")
def collectives():
    return run_on(4, _collectives_worker)


@pytest.mark.multiprocess
def test_mesh_groups_on_four_ranks(collectives):
    for r, res in enumerate(collectives):
        assert res["coords"] == (r // 2, r % 2)
        assert res["group_ranks"] == {"dp": _dp_group(r), "tp": _tp_group(r)}
        assert res["group_ranks"]["tp"] == AbstractMesh(MESH, rank=r).axis_ranks("tp")


NAMES = [
    "all_reduce_sum_tp",
    "all_reduce_avg_dp",
    "all_reduce_sum_world",
    "pvary_tp",
    "all_gather_tp_dim1",
    "all_gather_world_dim0",
    "reduce_scatter_dp_dim0",
    "reduce_scatter_tp_dim1",
    "all_to_all_tp",
    "ppermute_ring_world",
    "ppermute_partial_tp",
    "ppermute_ring_world_strided",
    "all_reduce_sum_tp_strided",
    "pvary_tp_strided",
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_collective_forward_backward_and_bytes(collectives, name):
    for r, res in enumerate(collectives):
        y, grad, fwd, bwd = _expected(r)[name]
        got = res[name]
        torch.testing.assert_close(got["y"], y, msg=lambda m: f"{name} forward, rank {r}: {m}")
        torch.testing.assert_close(got["grad"], grad, msg=lambda m: f"{name} backward, rank {r}: {m}")
        assert got["fwd"] == fwd, f"{name} forward bytes, rank {r}"
        assert got["bwd"] == bwd, f"{name} backward bytes, rank {r}"
        assert got["input_unchanged"], f"{name} modified its input on rank {r}"


@pytest.mark.multiprocess
def test_reduce_scatter_leaves_its_input_alone(collectives):
    for r, res in enumerate(collectives):
        assert res["reduce_scatter_dp_dim0"]["input_unchanged"], f"rank {r}: the input of reduce_scatter changed"


@pytest.mark.multiprocess
def test_all_gather_backward_does_not_clobber_a_shared_gradient(collectives):
    for r, res in enumerate(collectives):
        tp = r % 2
        expected = sum(_wt(q, (2, 3)) for q in _tp_group(r))[tp : tp + 1]
        g1, g2 = res["shared_grad"]
        torch.testing.assert_close(g2, expected, msg=lambda m: f"second input, rank {r}: {m}")
        torch.testing.assert_close(g1, expected, msg=lambda m: f"first input, rank {r}: {m}")


@pytest.mark.multiprocess
def test_an_axis_of_size_one_returns_a_new_tensor_from_every_collective(collectives):
    for r, res in enumerate(collectives):
        got = res["size_one_outputs_leave_the_input_alone"]
        assert got == dict.fromkeys(got, True) and len(got) == 6, f"rank {r}: {got}"


@pytest.mark.multiprocess
def test_all_reduce_max(collectives):
    expected = torch.stack([_inp(q, (3,)) for q in range(4)]).amax(0)
    for res in collectives:
        torch.testing.assert_close(res["all_reduce_max_world"]["y"], expected)
        assert res["all_reduce_max_world"]["fwd"] == {("dp+tp", "all_reduce"): (1, 36.0)}
        assert "all_reduce(op='max') has no gradient" in res["max_backward_error"]


@pytest.mark.multiprocess
def test_bad_collective_calls_fail_before_communicating(collectives):
    for res in collectives:
        errors = res["errors"]
        assert errors["reduce_scatter_indivisible"][0] == "ShardingError"
        assert "reduce_scatter over tp (size 2) needs dimension 0 of shape (3,) to be divisible by 2" in errors[
            "reduce_scatter_indivisible"
        ][1]
        assert errors["all_to_all_indivisible"][0] == "ShardingError"
        assert "splits dimension 0 of shape (3, 2), which 2 does not divide" in errors["all_to_all_indivisible"][1]
        assert errors["unknown_axis"] == ("ShardingError", "axis 'pp' is not in the mesh {'dp': 2, 'tp': 2}; its axes are ['dp', 'tp']")
        assert errors["ppermute_bad_perm"][0] == "ShardingError" and "partial permutation of 0..1" in errors["ppermute_bad_perm"][1]
        assert errors["bad_op"][0] == "ValueError" and "'prod'" in errors["bad_op"][1]
        name, message = errors["raw_strided"]
        assert name == "CollectiveDeviceError" and "was given a tensor of shape (2, 3) (float32) with strides (1, 2), " \
            "not contiguous" in message and "Fix: pass t.contiguous()" in message, errors["raw_strided"]
        # it used to communicate, then fail in the division with torch's cast error
        assert errors["avg_of_integers"] == (
            "TypeError",
            "all_reduce(op='avg') needs a floating-point tensor, got torch.int64 of shape (2,): the mean of "
            "integers is not an integer. Fix: convert x to a float dtype, or use op='sum' and divide",
        )
        assert res["calls_after_errors"] == 0
        assert res["after"] == 4.0


def _raw_flat_worker(k):
    """raw_reduce_scatter / raw_all_gather on a 1-D mesh of every rank: into a separate shard
    and in place (the shard a view of the rank's own slot), sum and avg, several in flight."""
    from shardlib import init_mesh
    from shardlib.mesh.collectives import raw_all_gather, raw_reduce_scatter

    n = torch.distributed.get_world_size()
    mesh = init_mesh({"dp": n})
    i = mesh.index("dp")
    fulls = [torch.arange(n * k, dtype=torch.float32) * (i + 1) + c for c in range(3)]  # rank i's input
    out = {}
    sep = [torch.empty(k) for _ in fulls]
    handles = [raw_reduce_scatter(s, f.clone(), mesh, "dp", async_op=True, op=op) for s, f, op in zip(sep, fulls, ("sum", "avg", "sum"))]
    for h in handles:
        h.wait()
    out["separate"] = sep
    inplace = [f.clone() for f in fulls]
    for f in inplace:
        raw_reduce_scatter(f[i * k : (i + 1) * k], f, mesh, "dp", op="avg")
    out["inplace"] = [f[i * k : (i + 1) * k].clone() for f in inplace]
    out["inputs_after"] = inplace  # outside its own slot the input is left as it was (gloo)
    gathered = [torch.empty(n * k) for _ in range(3)]
    handles = [raw_all_gather(g, torch.full((k,), 10.0 * c + i), mesh, "dp", async_op=True) for c, g in enumerate(gathered)]
    own = torch.zeros(n * k)
    own[i * k : (i + 1) * k] = 7.0 + i
    handles.append(raw_all_gather(own, own[i * k : (i + 1) * k], mesh, "dp", async_op=True))
    for h in handles:
        h.wait()
    out["gathered"], out["own"] = gathered, own
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3, 4])
def test_raw_reduce_scatter_and_all_gather_point_to_point(n):
    """gloo's reduce-scatter and all-gather are point-to-point exchanges (found: summing into
    an output that aliases the rank's own slot overwrote its contribution when n > 2)."""
    k = 5
    results = run_on(n, _raw_flat_worker, k)
    scale = sum(range(1, n + 1))
    for i, res in enumerate(results):
        base = torch.arange(n * k, dtype=torch.float32)[i * k : (i + 1) * k]
        for c, (got, op) in enumerate(zip(res["separate"], ("sum", "avg", "sum"))):
            want = base * scale + n * c
            torch.testing.assert_close(got, want / n if op == "avg" else want, rtol=1e-6, atol=0)
        for c, got in enumerate(res["inplace"]):
            torch.testing.assert_close(got, (base * scale + n * c) / n, rtol=1e-6, atol=0)
        for c, f in enumerate(res["inputs_after"]):
            mine = torch.arange(n * k, dtype=torch.float32) * (i + 1) + c
            keep = torch.ones(n * k, dtype=torch.bool)
            keep[i * k : (i + 1) * k] = False
            assert torch.equal(f[keep], mine[keep])
        for c, g in enumerate(res["gathered"]):
            assert torch.equal(g, torch.arange(n, dtype=torch.float32).repeat_interleave(k) + 10.0 * c)
        assert torch.equal(res["own"], torch.arange(n, dtype=torch.float32).repeat_interleave(k) + 7.0)


def test_launch_at_import_time_of_a_script_names_the_missing_main_guard_and_a_guarded_one_runs(tmp_path):
    """Regression (issue 12): a script calling ``launch()`` without ``if __name__ ==
    "__main__":`` failed with ``ProcessExit`` and no hint; the error now names the fix."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import shardlib\n\ndef f():\n    return 1\n\nprint(shardlib.launch(f, 2))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode != 0
    assert "WorkerError: rank 0 failed with ProcessExit: worker process exited at start" in out.stderr
    assert 'Fix: put the call under `if __name__ == "__main__":`' in out.stderr
    # guarded, and run from a folder holding a folder named shardlib (a checkout, seen from its
    # parent folder): the workers imported that folder as the package (a new user's finding: "module
    # 'shardlib' has no attribute 'init_mesh'"); they also work in the parent's folder
    (tmp_path / "shardlib" / "shardlib").mkdir(parents=True)
    (tmp_path / "data.txt").write_text("ok")
    (tmp_path / "scripts").mkdir()
    guarded = tmp_path / "scripts" / "guarded.py"
    # a worker starts with torch._dynamo imported by the fork server: creating any torch optimizer
    # imports it, 1.4-1.8 s of CPU in each worker otherwise (shardlib.mesh.launch._context)
    guarded.write_text("import sys\nimport shardlib\n\ndef f():\n    import shardlib\n    dynamo = 'torch._dynamo' in sys.modules\n"
                       "    return shardlib.init_mesh({'dp': 2}).size('dp'), open('data.txt').read(), dynamo\n\n"
                       "if __name__ == '__main__':\n    print(shardlib.launch(f, 2))\n")
    out = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[(2, 'ok', True), (2, 'ok', True)]", out.stderr


@pytest.mark.multiprocess
def test_an_idle_worker_survives_an_interrupt_of_the_process_group():
    """A notebook's Interrupt (and Ctrl-C in a terminal) sends SIGINT to the whole process group:
    an idle worker of a warm group keeps waiting (it used to die with a KeyboardInterrupt
    traceback in ``conn.recv()``, so the next call found its group dead, and every notebook
    printed two such tracebacks at kernel shutdown); a worker running a task is interrupted as
    usual, says so, and serves the next task."""
    import os
    import signal
    import time

    from shardlib.errors import WorkerError
    from shardlib.mesh.launch import WorkerGroup

    group = WorkerGroup(1, timeout=60)
    try:
        pid = group.run(os.getpid)[0]
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert group.run(os.getpid) == [pid]  # the same worker, still serving

        def interrupted():
            # as a worker started in a terminal or a notebook (started in the background, as by a CI
            # runner, a worker begins with SIGINT ignored, and its tasks keep it so)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)

        with pytest.raises(WorkerError) as info:
            group.run(interrupted)
        assert info.value.exc_type == "KeyboardInterrupt"
        assert group.run(os.getpid) == [pid]  # and the worker serves on
    finally:
        group.close()


def _wait_for_file(path):
    import os
    import time

    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return os.getpid()


@pytest.mark.multiprocess
def test_start_returns_while_the_ranks_run_and_its_results_are_collected_once(tmp_path):
    """``WorkerGroup.start`` sends the function and returns: the ranks here wait for a file the
    caller writes only after start() returned (a blocking start would time them out). A second
    start before the collection, and a second collection, are refused."""
    from shardlib.mesh.launch import WorkerGroup

    flag = tmp_path / "go"
    with WorkerGroup(2, timeout=60) as group:
        collect = group.start(_wait_for_file, str(flag))
        with pytest.raises(RuntimeError, match="was not collected"):
            group.start(_wait_for_file, str(flag))
        flag.write_text("")
        pids = collect()
        assert len(set(pids)) == 2
        with pytest.raises(RuntimeError, match="already collected"):
            collect()
        assert group.run(_wait_for_file, str(flag)) == pids  # the group serves the next run
