"""Every bad input raises ShardingError with a message that names what was given; nothing hangs.

The issue's demands:

* at least 12 distinct bad inputs each raise :class:`ShardingError` (checked here one test per
  input, matching the message: the parameter, axis, spec and sizes it must name);
* on every rank, identically, before any communication (the multi-process tests count the
  collectives recorded in ``mesh.comm``: zero);
* a rank that raises mid-step ends every rank within the timeout with its message and rank, with
  no hang (a fresh two-rank group; the other rank is left waiting inside a ZeRO-3 all-gather).

Tier 0 tests use :class:`~shardlib.AbstractMesh` and need no process group.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardlib
from shardlib import AbstractMesh, NamedSharding, P, ShardingError, WorkerError, annotate, distribute, init_mesh, plan
from shardlib.mesh.launch import WorkerGroup
from shardlib.testing import TiedLM, get_pool, run_on


def mlp() -> nn.Module:
    # 0.weight (6, 4), 0.bias (6,), 2.weight (2, 6), 2.bias (2,)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def annotated_mlp() -> nn.Module:
    model = mlp()
    annotate(model[2].weight, P(None, "sp"))
    return model


def meta_linear() -> nn.Module:
    return nn.Linear(4, 2, device="meta")


DP2 = AbstractMesh({"dp": 2})
DP2_TP2 = AbstractMesh({"dp": 2, "tp": 2})

# (id, the bad call, the parts its message must contain, in order)
CASES = [
    # -- specs ----------------------------------------------------------------------------------
    (
        "unknown-axis-in-spec",
        lambda: plan(mlp(), DP2, {"0.weight": P("pp", None)}),
        ["P('pp', None)", "(pattern '0.weight')", "parameter 0.weight", "shape (6, 4)", "axis 'pp'",
         "the mesh is {'dp': 2}", "Fix: use one of ['dp']"],
    ),
    (
        "unknown-axis-in-annotation",
        lambda: plan(annotated_mlp(), DP2),
        ["P(None, 'sp')", "(annotation)", "parameter 2.weight", "shape (2, 6)", "axis 'sp'", "{'dp': 2}"],
    ),
    (
        "axis-twice-in-spec:entries",
        lambda: P("dp", "dp"),
        ["PartitionSpec('dp', 'dp')", "uses mesh axis 'dp' twice", "(dimensions 0 and 1)", "Fix:"],
    ),
    (
        "axis-twice-in-spec:tuple-entry",
        lambda: plan(mlp(), DP2_TP2, {"0.weight": P(("dp", "tp"), "tp")}),
        ["uses mesh axis 'tp' twice", "(dimensions 0 and 1)"],
    ),
    (
        "spec-longer-than-rank",
        lambda: plan(mlp(), DP2, {"0.bias": P(None, "dp")}),
        ["P(None, 'dp')", "(pattern '0.bias')", "parameter 0.bias", "has 2 entries", "shape (6,)",
         "(1 dimension)", "at most 1 entries"],
    ),
    (
        "bad-spec-entry-type",
        lambda: plan(mlp(), DP2, {"0.weight": P(None, 1)}),
        ["entry 1 is 1 of type int", "must be None, an axis name, or a tuple of axis names"],
    ),
    (
        "empty-axis-name-in-spec",
        lambda: P("dp", ""),
        ["entry 1 is an empty axis name", "use None"],
    ),
    (
        "spec-given-as-bare-string",
        lambda: plan(mlp(), DP2, {"0.weight": "dp"}),
        ["specs['0.weight'] is 'dp' of type str", "expected a PartitionSpec"],
    ),
    (
        "malformed-specs-item",
        lambda: plan(mlp(), DP2, [("0.weight",)]),
        ["specs must map glob patterns (str) to PartitionSpecs", "the item ('0.weight',)", "Fix:"],
    ),
    (
        "pattern-matches-nothing",
        lambda: plan(mlp(), DP2, {"*.kernel": P("dp")}),
        ["spec pattern '*.kernel' -> P('dp')", "matches no parameter of Sequential",
         "0.weight, 0.bias, 2.weight, 2.bias", "Fix:"],
    ),
    (
        "pattern-matches-only-a-buffer",
        lambda: plan(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), DP2, {"1.running_mean": P("dp")}),
        ["spec pattern '1.running_mean' -> P('dp')", "matches only buffers of Sequential (1.running_mean)",
         "A buffer is not sharded", "Fix:"],
    ),
    (
        "tied-parameter-conflicting-specs",
        lambda: plan(TiedLM(), DP2, [("lm_head.weight", P("dp")), ("wte.*", P())]),
        ["tied parameter ['wte.weight', 'lm_head.weight']", "shape (37, 10)", "conflicting specs",
         "wte.weight -> P() (pattern 'wte.*')", "lm_head.weight -> P('dp') (pattern 'lm_head.weight')", "Fix:"],
    ),
    (
        "unknown-logical-axis",
        lambda: plan(mlp(), DP2, {"0.weight": P("embed", None)}, logical_axis_rules={"vocab": "dp"}),
        ["the spec of 0.weight", "logical axis 'embed'", "no rule", "{'vocab': 'dp'}", "{'embed':"],
    ),
    (
        "logical-rule-to-unknown-mesh-axis",
        lambda: plan(mlp(), DP2, {"0.weight": P("embed", None)}, logical_axis_rules={"embed": "tp"}),
        ["P('tp', None)", "parameter 0.weight", "axis 'tp'", "the mesh is {'dp': 2}"],
    ),
    (
        "annotate-too-many-entries",
        lambda: annotate(nn.Linear(4, 2).bias, P("dp", None)),
        ["annotate(): P('dp', None) has 2 entries", "shape (2,)", "(1 dimension)", "at most 1 entries"],
    ),
    (
        "annotate-not-a-tensor",
        lambda: annotate([1.0], P()),
        ["annotate() takes a parameter tensor, got list"],
    ),
    (
        "named-sharding-unknown-axis",
        lambda: NamedSharding(DP2, P("tp")),
        ["P('tp') names axis 'tp'", "the mesh has axes {'dp': 2}", "Fix: use one of ['dp']"],
    ),
    (
        "distribute-spec-longer-than-tensor",
        lambda: distribute(torch.ones(3), DP2, P("dp", None)),
        ["distribute(): P('dp', None) has 2 entries", "shape (3,)", "at most 1 entries"],
    ),
    # -- meshes ---------------------------------------------------------------------------------
    (
        "mesh-axis-size:zero",
        lambda: AbstractMesh({"dp": 0}),
        ["mesh axis 'dp' has size 0 in {'dp': 0}", "integer >= 1"],
    ),
    (
        "mesh-axis-size:negative",
        lambda: AbstractMesh({"dp": 2, "tp": -2}),
        ["mesh axis 'tp' has size -2 in {'dp': 2, 'tp': -2}", "integer >= 1"],
    ),
    (
        "mesh-axis-size:float",
        lambda: AbstractMesh({"dp": 2.0}),
        ["mesh axis 'dp' has size 2.0", "integer >= 1"],
    ),
    (
        "mesh-axis-size:bool",
        lambda: AbstractMesh({"dp": True}),
        ["mesh axis 'dp' has size True", "integer >= 1"],
    ),
    (
        "mesh-bad-axis-name",
        lambda: AbstractMesh({"d-p": 2}),
        ["mesh axis name 'd-p' in {'d-p': 2} is not a valid name", "identifiers"],
    ),
    (
        "mesh-empty-shape",
        lambda: AbstractMesh({}),
        ["a mesh shape is a non-empty dict", "got {}"],
    ),
    (
        "mesh-rank-outside",
        lambda: AbstractMesh({"dp": 2}, rank=2),
        ["rank 2 is outside the mesh {'dp': 2} of 2 ranks"],
    ),
    (
        "mesh-unknown-axis-query",
        lambda: DP2_TP2.size("pp"),
        ["axis 'pp' is not in the mesh {'dp': 2, 'tp': 2}", "['dp', 'tp']"],
    ),
    (
        "mesh-axis-twice-in-query",
        lambda: DP2_TP2.all_groups(("dp", "dp")),
        ["axes ('dp', 'dp') name an axis twice"],
    ),
    # -- plan options ---------------------------------------------------------------------------
    (
        "zero-stage-out-of-range:4",
        lambda: plan(mlp(), DP2, zero_stage=4),
        ["zero_stage must be 0, 1, 2 or 3", "got 4"],
    ),
    (
        "zero-stage-out-of-range:-1",
        lambda: plan(mlp(), DP2, zero_stage=-1),
        ["zero_stage must be 0, 1, 2 or 3", "got -1"],
    ),
    (
        "zero-stage-out-of-range:str",
        lambda: plan(mlp(), DP2, zero_stage="3"),
        ["zero_stage must be 0, 1, 2 or 3", "got '3'"],
    ),
    (
        "unknown-data-axis",
        lambda: plan(mlp(), DP2, data_axes=("batch",)),
        ["data_axes names 'batch'", "not an axis of the mesh {'dp': 2}", "Fix: use some of ['dp']"],
    ),
    (
        "data-axis-twice",
        lambda: plan(mlp(), DP2, data_axes=("dp", "dp")),
        ["data_axes ('dp', 'dp') names an axis twice"],
    ),
    (
        "unused-mesh-axis",
        lambda: plan(mlp(), DP2_TP2),
        ["mesh axis 'tp' (size 2)", "{'dp': 2, 'tp': 2}", "is used by nothing", "not a data axis (('dp',))",
         "its 2 ranks would repeat the same work", "data_axes=('tp',)"],
    ),
    (
        "data-axis-spec-with-zero-stage-below-3",
        lambda: plan(mlp(), DP2, {"0.weight": P("dp", None)}, zero_stage=1),
        ["P('dp', None)", "parameter 0.weight", "along a data axis", "ZeRO-3 storage", "zero_stage=1",
         "zero_stage=3"],
    ),
    (
        "row-layer-without-column-partner",
        lambda: plan(mlp(), DP2_TP2, {"2.weight": P(None, "tp")}),
        ["row-parallel layer 2", "split over 'tp', size 2", "no column-parallel partner", "<root>",
         "input would arrive whole", "Fix"],
    ),
    (
        "bias-split-without-weight",
        lambda: plan(mlp(), DP2_TP2, {"0.bias": P("tp")}),
        ["0.bias (shape (6,)) is split over 'tp'", "Linear 0 has no weight split over it", "Fix"],
    ),
    (
        "norm-weight-split-over-tp",
        lambda: plan(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), DP2_TP2, {"1.weight": P("tp")}),
        ["1.weight (shape (4,)) of the norm 1 is split over 'tp'", "never split", "sequence_parallel=True",
         "Fix: leave the norm weight replicated"],
    ),
    (
        "unknown-plan-option",
        lambda: plan(mlp(), DP2, zero_stag=3),
        ["unknown plan option(s) ['zero_stag']", "valid options are", "'zero_stage'"],
    ),
    (
        "bad-chunk-size:zero",
        lambda: plan(mlp(), DP2, chunk_size=0),
        ["chunk_size must be a positive number of elements, got 0"],
    ),
    (
        "bad-chunk-size:float",
        lambda: plan(mlp(), DP2, chunk_size=1.5),
        ["chunk_size must be a positive number of elements, got 1.5"],
    ),
    (
        "meta-device-parameter",
        lambda: plan(meta_linear(), DP2),
        ["parameter weight of shape (2, 4) is on the meta device", "no init rule covers it", "Fix: pass init_rules="],
    ),
    (
        "apply-plan-of-abstract-mesh",
        lambda: plan(mlp(), DP2).apply(mlp()),
        ["made on an AbstractMesh", "cannot move tensors", "init_mesh()"],
    ),
]

# Distinct kinds of bad input: an id "kind:variant" is one more variant of the same kind.
KINDS = {case_id.split(":")[0] for case_id, _, _ in CASES}


def pattern(parts: list[str]) -> str:
    return ".*".join(re.escape(p) for p in parts)


def test_at_least_fourteen_distinct_bad_inputs():
    assert len(KINDS) >= 14
    assert len({case_id for case_id, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("call, parts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_sharding_error(call, parts):
    with pytest.raises(ShardingError, match=pattern(parts)):
        call()


def test_sharding_error_is_value_error_and_exported():
    assert issubclass(ShardingError, ValueError)
    assert "ShardingError" in shardlib.__all__ and "WorkerError" in shardlib.__all__


def test_first_error_is_deterministic():
    """Two problems at once: the same one is reported every time (ranks must agree)."""
    bad = {"0.weight": P("pp"), "0.bias": P(None, "dp")}
    messages = set()
    for _ in range(3):
        with pytest.raises(ShardingError) as info:
            plan(mlp(), DP2, bad, zero_stage=9)
        messages.add(str(info.value))
    assert len(messages) == 1


# -- init_mesh in this process: checked before any rendezvous ---------------------------------


def test_init_mesh_product_differs_from_world_size_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never dialled: the check comes first
    monkeypatch.setenv("RANK", "0")
    start = time.monotonic()
    if dist.is_initialized():  # another test made a one-rank group in this process
        with pytest.raises(ShardingError, match=pattern(["the mesh {'dp': 3}", "has 3 ranks but the world size is"])):
            init_mesh({"dp": 3})
    else:
        with pytest.raises(ShardingError, match=pattern(["the mesh {'dp': 3}", "has 3 ranks but WORLD_SIZE is 2",
                                                         "launch 3 processes"])):
            init_mesh({"dp": 3})
        assert not dist.is_initialized()
    assert time.monotonic() - start < 5


def test_init_mesh_without_launcher(monkeypatch):
    for var in ("WORLD_SIZE", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        with pytest.raises(ShardingError, match=pattern(["the mesh {'dp': 2}", "has 2 ranks but the world size is"])):
            init_mesh({"dp": 2})
    else:
        with pytest.raises(ShardingError, match=pattern(["the mesh {'dp': 2} needs 2 processes", "not initialized",
                                                         "torchrun --nproc-per-node 2", "shardlib.launch(fn, 2)"])):
            init_mesh({"dp": 2})
        assert not dist.is_initialized()


# -- regression tests for bugs found while writing these tests ---------------------------------------------


def test_float_zero_stage_is_rejected():
    with pytest.raises(ShardingError, match="zero_stage must be 0, 1, 2 or 3"):
        plan(mlp(), DP2, zero_stage=2.0)


@pytest.mark.parametrize("value", ["2", -1])
def test_bad_optimizer_states_is_rejected(value):
    with pytest.raises(ShardingError, match="optimizer_states"):
        plan(mlp(), DP2, optimizer_states=value)


# -- on every rank, before any communication ---------------------------------------------------

BAD_SHARD_CALLS = [
    ({"wte.weight": P("tp")}, {}),  # unknown axis
    ({"*.kernel": P("dp")}, {}),  # pattern matches nothing
    ([("lm_head.weight", P("dp")), ("wte.*", P())], {}),  # tied parameter, conflicting specs
    ({"up.weight": P(None, None, "dp")}, {}),  # spec longer than the tensor
    (None, {"zero_stage": 7}),
    (None, {"data_axes": "batch"}),
    ({"up.weight": P("dp")}, {"zero_stage": 2}),
    (None, {"chunk_size": -4}),
]


def _shard_badly_on_every_rank():
    """Per rank: (error type, message, collectives recorded) for each bad call, then a check."""
    import shardlib
    from shardlib.testing import TiedLM

    results = {}
    for shape in ({"dp": 3}, {"dp": 1}, {"dp": 2, "tp": 2}):  # product != world size (2)
        try:
            shardlib.init_mesh(shape)
            results[str(shape)] = None
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[str(shape)] = (type(exc).__name__, str(exc))
    mesh = shardlib.init_mesh({"dp": 2})
    calls = []
    for specs, options in BAD_SHARD_CALLS:
        try:
            shardlib.shard(TiedLM(), mesh, specs, **options)
            calls.append(None)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            calls.append((type(exc).__name__, str(exc), mesh.comm.calls()))
    results["shard"] = calls
    # The ranks are still in step after all that: a collective completes.
    results["after"] = shardlib.all_reduce(torch.ones(1), "dp", mesh=mesh).item()
    return results


@pytest.mark.multiprocess
def test_bad_inputs_raise_on_every_rank_before_communication():
    ranks = run_on(2, _shard_badly_on_every_rank)
    for shape, size in (("{'dp': 3}", 3), ("{'dp': 1}", 1), ("{'dp': 2, 'tp': 2}", 4)):
        messages = {r[shape] for r in ranks}
        assert len(messages) == 1, f"ranks disagree for {shape}: {messages}"
        exc_type, message = messages.pop()
        assert exc_type == "ShardingError"
        assert f"the mesh {shape} has {size} ranks but the world size is 2" in message
        assert f"launch {size} processes" in message
    assert len(ranks[0]["shard"]) == len(BAD_SHARD_CALLS)
    for i, (specs, options) in enumerate(BAD_SHARD_CALLS):
        outcomes = [r["shard"][i] for r in ranks]
        assert all(o is not None and o[0] == "ShardingError" for o in outcomes), (specs, options, outcomes)
        assert outcomes[0][1] == outcomes[1][1], f"different messages on the two ranks for {specs}, {options}"
        assert outcomes[0][2] == outcomes[1][2] == 0, f"{specs}, {options} communicated before raising"
    assert [r["after"] for r in ranks] == [2.0, 2.0]


def _shard_with_unknown_axis():
    import shardlib
    from shardlib.testing import TiedLM

    mesh = shardlib.init_mesh({"dp": 2})
    return shardlib.shard(TiedLM(), mesh, {"up.weight": P("tp", None)})


@pytest.mark.multiprocess
def test_plan_error_reaches_the_caller_from_every_rank():
    get_pool(2)  # started outside the timing
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_on(2, _shard_with_unknown_axis)
    err = info.value
    assert time.monotonic() - start < 10  # every rank raised at once: no grace period or timeout
    assert err.rank == 0 and err.exc_type == "ShardingError"
    assert sorted(err.errors) == [0, 1]
    assert err.errors[0] == err.errors[1]
    assert err.errors[0][0] == "ShardingError"
    assert re.search(pattern(["P('tp', None)", "parameter up.weight", "shape (13, 10)", "axis 'tp'", "{'dp': 2}"]),
                     err.errors[0][1])
    assert "rank 0 failed with ShardingError" in str(err) and "_shard_with_unknown_axis" in err.remote_traceback
    assert get_pool(2).alive  # no rank was stuck, so the pool was kept
    assert run_on(2, lambda: 1) == [1, 1]


# -- a rank that raises mid-step: no hang ------------------------------------------------------


def _train_then_fail(fail_rank: int, fail_step: int):
    import torch

    import shardlib
    from shardlib.testing import TiedLM

    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(TiedLM(), mesh, zero_stage=3)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    gen = torch.Generator().manual_seed(mesh.rank)
    for step in range(20):
        idx = torch.randint(0, 37, (2, 5), generator=gen)
        if mesh.rank == fail_rank and step == fail_step:
            raise RuntimeError(f"boom at step {step}")
        _, loss = smodel(idx, idx)  # rank 0 waits here, in a ZeRO-3 all-gather, for rank 1
        loss.backward()
        opt.step()
        opt.zero_grad()
    return "finished"


@pytest.mark.multiprocess
def test_rank_raising_mid_step_ends_every_rank_without_hanging():
    wall = time.monotonic()
    group = WorkerGroup(2, timeout=30)  # not the shared pool: this group gets killed
    procs = list(group._procs)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            group.run(_train_then_fail, 1, 2)
        elapsed = time.monotonic() - start
    finally:
        group.close()
    wall = time.monotonic() - wall
    err = info.value
    assert wall < 60, f"took {wall:.1f} s (start, run, failure, stop)"
    # Well inside the 30 s collective timeout: rank 0 was stopped, not left to time out.
    assert elapsed < 25, f"took {elapsed:.1f} s from run() to the WorkerError"
    assert err.rank == 1 and err.exc_type == "RuntimeError"
    assert "boom at step 2" in err.message and "boom at step 2" in str(err)
    assert "rank 1 failed with RuntimeError" in str(err)
    assert "ranks [0] were still running and were stopped" in err.message
    assert err.errors == {1: ("RuntimeError", "boom at step 2")}
    assert "_train_then_fail" in err.remote_traceback
    assert not group.alive
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="closed after a failure"):
        group.run(_train_then_fail, 1, 2)


def _unequal_local_batches(stage):
    import shardlib

    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Linear(3, 1), mesh, zero_stage=stage)
    x = torch.randn(5, 3)
    mine = x[:4] if mesh.rank == 0 else x[4:]  # a short last batch on rank 1 (drop_last=False)
    with torch.no_grad():  # evaluation may weigh its ranks itself: accepted
        smodel(mine)
    smodel.eval()
    smodel(mine).sum()
    smodel.train()
    smodel(x[:2]).sum().backward()  # equal rows: accepted
    try:
        smodel(mine).sum().backward()
    except ShardingError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_check_mode_refuses_unequal_local_batches_in_training(stage):
    """Found by a new user: dp=2 ranks with 4 and 1 rows trained on the mean of the per-rank
    means, 0.57 off the global batch's gradient, silently, also in check mode."""
    messages = run_on(2, _unequal_local_batches, stage)
    assert "has 4 rows on this rank, and between 1 and 4 across the data axes ('dp',)" in messages[0], messages[0]
    assert "has 1 row on this rank, and between 1 and 4" in messages[1], messages[1]


def _different_batches_on_tp_ranks():
    import shardlib
    from shardlib import P

    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), mesh,
                            {"0.weight": P("tp", None), "0.bias": P("tp"), "2.weight": P(None, "tp")})
    x = torch.randn(6, 4)
    smodel(x.clone()).sum().backward()  # the same batch: accepted
    with torch.no_grad():
        try:
            smodel(x.flip(0) if mesh.rank else x)  # the same rows in another order on rank 1
        except ShardingError as exc:
            return str(exc)
    return "not refused"


@pytest.mark.multiprocess
def test_check_mode_refuses_different_batches_on_tensor_parallel_ranks():
    """A sampler over the whole world instead of the data ranks hands tp ranks different batches;
    each then trained on a mix of both, silently (a new user's finding)."""
    for message in run_on(2, _different_batches_on_tp_ranks):
        assert "forward: the batch differs across the axes ('tp',) (mesh {'tp': 2})" in message, message


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _LinearWithLoss(_Mlp):
    """A tensor-parallel pair whose forward takes its target too (as Hugging Face models take labels)."""

    def forward(self, x, target=None, extra=()):
        out = super().forward(x)
        return out if target is None else torch.nn.functional.mse_loss(out, target)


def _different_targets_on_tp_ranks(case):
    import shardlib
    from shardlib import P

    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(_LinearWithLoss(), mesh,
                            {"up.weight": P("tp", None), "up.bias": P("tp"), "down.weight": P(None, "tp")})
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    smodel(x, target=y.clone()).backward()  # the same batch and target: accepted
    mine = y + 1 if mesh.rank else y
    try:
        if case == "keyword":
            smodel(x, target=mine).backward()
        elif case == "positional":
            smodel(x, mine).backward()
        elif case == "ninth":  # past the arguments compared one by one
            smodel(x, y, extra=[y] * 8 + [mine]).backward()
        else:  # one more tensor argument on rank 1
            smodel(x, y, extra=[y] if mesh.rank else []).backward()
    except ShardingError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["keyword", "positional", "ninth", "count"])
def test_check_mode_refuses_different_targets_on_tensor_parallel_ranks(case):
    """Check mode compared the first tensor argument only: tp ranks given the same inputs and
    different labels (a keyword argument, as Hugging Face models take them) each trained on its
    own loss, silently."""
    named = {"keyword": "target: its checksum is", "positional": "args[1]: its checksum is",
             "ninth": "extra", "count": "the number of tensor arguments: 2 on this rank"}[case]
    messages = run_on(2, _different_targets_on_tp_ranks, case)
    for message in messages:
        assert "forward: the batch differs across the axes ('tp',) (mesh {'tp': 2})" in message, message
    assert named in messages[0], messages[0]


def _pipeline_given_different_batches(case):
    import shardlib
    from shardlib import P

    if case == "rows":
        mesh, specs = shardlib.init_mesh({"pp": 2, "dp": 2}), None
    else:
        mesh = shardlib.init_mesh({"pp": 2, "tp": 2})
        specs = {"*.up.weight": P("tp", None), "*.up.bias": P("tp"), "*.down.weight": P(None, "tp")}
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Sequential(_Mlp(), _Mlp()), mesh, specs, microbatches=2,
                            split_points=["1"])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    other = mesh.index(("dp",) if case == "rows" else ("tp",)) == 1
    if case == "rows":  # dp rank 1 has 2 rows (still divisible into the 2 microbatches)
        x, y = (x[:2], y[:2]) if other else (x, y)
    else:  # the same inputs, other labels on tp rank 1
        y = y + 1 if other else y
    try:
        smodel.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
    except ShardingError as exc:
        return str(exc)
    return "not refused"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["rows", "labels"])
def test_check_mode_refuses_different_batches_on_every_pipeline_rank(case):
    """A pipeline's tp ranks given other labels trained on different losses silently (the
    check looked at each stage's forward input only, and the labels reach only the criterion);
    unequal rows across dp were refused on the first stage only, so the last stage waited in
    its receive until the watchdog. Both are now refused on every rank before any transfer."""
    want = {"rows": "forward_backward: the local batch has", "labels": "forward_backward: the batch differs across "
            "the axes ('tp',) (mesh {'pp': 2, 'tp': 2}): labels[0]: its checksum is"}[case]
    for message in run_on(4, _pipeline_given_different_batches, case):
        assert want in message, message


def _diagnosis_and_lost_peer(order):
    import torch.distributed as dist

    from shardlib.errors import CollectiveMismatchError

    rank = dist.get_rank()
    if order[rank] == "diagnosis":  # what a rank's watchdog raises, naming the first differing collective
        raise CollectiveMismatchError("the ranks stopped issuing the same collectives (the diagnosis)")
    if order[rank] == "lost":  # what gloo raises on the peer once that rank has closed its pairs
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:50847. This is "
                           "typically caused by a remote worker crashing.")
    raise ValueError("the user's own error")


@pytest.mark.multiprocess
@pytest.mark.parametrize("order,first,exc_type", [(("diagnosis", "lost"), 0, "CollectiveMismatchError"),
                                                  (("lost", "diagnosis"), 1, "CollectiveMismatchError"),
                                                  (("lost", "own"), 1, "ValueError")])
def test_launch_reports_the_diagnosis_before_a_peers_lost_connection(order, first, exc_type):
    """Rank 0 alone in a ZeRO-3 forward, rank 1 in a plain barrier: rank 0's watchdog raised the
    CollectiveMismatchError naming both call sites and closed its connections, and rank 1's gloo
    then raised 'Connection closed by peer'; launch() reported rank 1's RuntimeError alone (its
    rule put any error before the collective errors; found by a new-user test). A backend's lost
    connection now comes last: a rank's own error first, then the diagnosis."""
    with pytest.raises(WorkerError) as info:
        shardlib.launch(_diagnosis_and_lost_peer, 2, order)
    assert info.value.rank == first and info.value.exc_type == exc_type, str(info.value)[:500]
    assert set(info.value.errors) == {0, 1}
