"""The NCCL-only branches of the communication layer, run on CPU (issue 15, items 3 and 5a).

Waits on a non-gloo backend only order streams (no timeout argument, no shardlib watchdog);
init_mesh makes torch's own NCCL bound explicit (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); ZeRO
makes its second communicator only where gathers run during backward (stage 3); every tensor
ZeRO hands to torch.distributed is on ``mesh.device`` (a dry run on meta in check mode, and a
model elsewhere refused before any collective).

The bounded exit on gloo is shown by the fault tests that stall, freeze or kill a rank
(tests/test_faults.py: test_only_rank0_calls_a_collective, test_frozen_rank_is_named,
test_killed_rank_is_named_gone, test_zero3_evaluation_on_rank0_only_default_mode); the
data-dependent ZeRO-3 backward is tests/test_zero_datadep.py (and its native-branch run in
tests/test_native_collectives.py).
"""

import datetime
import json
import os

import pytest
import torch

import shardlib
from shardlib.mesh.guard import Handle, wait_works
from shardlib.mesh.mesh import nccl_environment
from shardlib.testing import TiedLM, run_on


# -- waits --------------------------------------------------------------------------------------
class _Work:
    """A torch ``Work`` stand-in that records how it was waited on."""

    def __init__(self):
        self.waits = []

    def wait(self, *args, **kwargs):
        self.waits.append((args, kwargs))
        return True


class _Watchdog:
    def __init__(self, allowed: bool):
        self.allowed, self.calls = allowed, []

    def wait(self, works, rec, timeout, p2p):
        if not self.allowed:
            raise AssertionError("a wait on NCCL entered shardlib's watchdog (a host-blocking, timed wait)")
        self.calls.append((list(works), rec, timeout, p2p))
        for w in works:
            w.wait(timeout)


@pytest.fixture
def one_rank_mesh():
    mesh = shardlib.init_mesh({"dp": 1})
    saved = (mesh.backend, mesh.watchdog)
    yield mesh
    mesh.backend, mesh.watchdog = saved


def test_nccl_waits_order_streams_without_a_timeout_or_the_watchdog(one_rank_mesh):
    """On NCCL, ``Work.wait(timeout)`` blocks the host until the collective ends; a plain
    ``wait()`` makes the current stream wait. Both ways in (wait_works and a Handle, async or
    not) call ``wait()`` with no argument and never enter shardlib's watchdog."""
    mesh = one_rank_mesh
    mesh.backend, mesh.watchdog = "nccl", _Watchdog(allowed=False)
    works = [_Work(), _Work()]
    wait_works(mesh, works, None, False)
    assert [w.waits for w in works] == [[((), {})], [((), {})]]
    ran = []
    work = _Work()
    handle = Handle([work], lambda: ran.append("then"), mesh, None, p2p=True)
    assert work.waits == [] and not handle.done  # posted, not waited
    handle.wait()
    handle.wait()  # a second wait does nothing
    assert work.waits == [((), {})] and ran == ["then"] and handle.done


def test_gloo_waits_stay_bounded_by_the_mesh_timeout(one_rank_mesh):
    """On gloo every wait goes through the watchdog with the mesh's timeout (or, in a world
    without one, ``Work.wait(timeout)``): the bounded exit the fault tests exercise."""
    mesh = one_rank_mesh
    dog = _Watchdog(allowed=True)
    mesh.backend, mesh.watchdog = "gloo", dog
    work = _Work()
    wait_works(mesh, [work], "rec", True)
    assert dog.calls == [([work], "rec", mesh.timeout, True)] and work.waits == [((mesh.timeout,), {})]
    mesh.watchdog = None
    work = _Work()
    Handle([work], None, mesh, None).wait()
    assert work.waits == [((mesh.timeout,), {})] and isinstance(mesh.timeout, datetime.timedelta)


# -- torch's NCCL error handling -------------------------------------------------------------------
def test_nccl_environment_sets_torchs_bounded_exit_unless_the_user_chose():
    env = {}
    assert nccl_environment(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"} and env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    for name, value in [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("NCCL_ASYNC_ERROR_HANDLING", "2")]:
        env = {name: value}  # torchrun sets 1; the old name still counts
        assert nccl_environment(env) == {} and env == {name: value}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    with pytest.warns(UserWarning, match=r"TORCH_NCCL_ASYNC_ERROR_HANDLING=0 turns off torch's NCCL error handling: a "
                                         r"collective that outlives the process group's timeout is only logged, and the "
                                         r"job hangs instead of ending\. Fix: unset it \(shardlib then sets 3"):
        assert nccl_environment(env) == {}
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


class _Stop(Exception):
    pass


def test_init_mesh_sets_it_before_making_the_nccl_group(monkeypatch):
    """init_mesh under torchrun with CUDA: the variable is in the environment when
    ``init_process_group("nccl")`` runs (ProcessGroupNCCL reads it at construction)."""
    import torch.distributed as dist

    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, value=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), timeout=kwargs["timeout"])
        raise _Stop

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for name, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "LOCAL_RANK": "0", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    with pytest.raises(_Stop):
        shardlib.init_mesh({"dp": 2}, timeout=30)
    assert seen == {"backend": "nccl", "value": "3", "timeout": datetime.timedelta(seconds=30), "device": 0}


# -- ZeRO's second communicator: stage 3 only -------------------------------------------------------
def _channels_worker():
    mesh_groups, reduce_groups = {}, {}
    for stage in range(4):
        mesh = shardlib.init_mesh({"dp": 2})  # a new mesh: its own record of the groups it asked for
        torch.manual_seed(0)
        smodel = shardlib.shard(TiedLM(), mesh, zero_stage=stage, chunk_size=100)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
        g = torch.Generator().manual_seed(mesh.rank)
        idx = torch.randint(0, 37, (2, 5), generator=g)
        start = mesh.trace.seq
        smodel(idx, idx)[1].backward()
        opt.step()
        records = mesh.trace.records(mesh.trace.seq - start)
        mesh_groups[stage] = sorted(mesh._groups)
        reduce_groups[stage] = sorted({r["group"] for r in records if r["note"].endswith("gradients")})
    return mesh_groups, reduce_groups


@pytest.mark.multiprocess
def test_second_data_communicator_only_at_stage_3():
    """Regression: every ZeRO run made a second group over the data axes (channel 1) for its
    gradient reductions. Only stage 3 gathers during backward (in an order that follows the
    data), so only stage 3 needs it; stages 0-2 reduce on the data axis' own group."""
    for mesh_groups, reduce_groups in run_on(2, _channels_worker):
        for stage in range(4):
            assert mesh_groups[stage] == ([("dp",), ("dp", "#1")] if stage == 3 else [("dp",)]), stage
            assert reduce_groups[stage] == (["dp#1[0,1]"] if stage == 3 else ["dp[0,1]"]), stage


# -- devices ------------------------------------------------------------------------------------------
def _off_device_worker():
    from shardlib.errors import ShardingError

    mesh = shardlib.init_mesh({"dp": 2})
    mesh.device = torch.device("meta")  # stands in for an NCCL mesh's cuda:0, the model being on the CPU
    start = mesh.trace.seq
    with pytest.raises(ShardingError, match=r"parameter 'wte.weight' of TiedLM \(sharded on \{'dp': 2\}\) \(shape \(37, 10\)\) "
                                            r"is on cpu, but the mesh \{'dp': 2\} communicates on meta \(backend gloo\)\. "
                                            r"Fix: move the model there first \(model.to\('meta'\)\), or build it on meta"):
        shardlib.shard(TiedLM(), mesh, zero_stage=2)
    return mesh.trace.seq - start


@pytest.mark.multiprocess
def test_a_model_off_the_mesh_device_is_refused_before_any_collective():
    """Regression: a CPU model on an NCCL mesh reached ZeRO's first broadcast (NCCL rejects CPU
    tensors; check mode raised CollectiveDeviceError there). Now every rank refuses it first,
    naming the tensor, both devices and the fix, with no collective issued."""
    assert run_on(2, _off_device_worker) == [0, 0]


DRY_CASES = [(stage, axes) for stage in range(4) for axes in (("dp", "fsdp"), ("fsdp", "dp"))]


def _dry_runs() -> list:
    """ZeRO 0-3 over two data axes in both orders, as rank 2 (dp 1, fsdp 0) of a fake world of
    4, with clipping: one step on meta in check mode (a CPU tensor handed to a collective
    raises CollectiveDeviceError). Run in a fresh interpreter (this file as a script)."""
    import torch.distributed as dist

    from shardlib.dryrun import build_meta_model, fake_world
    from shardlib.lazy import materialize_on
    from shardlib.models import GPTConfig

    out = []
    for stage, axes in DRY_CASES:
        with fake_world(4, 2):
            mesh = shardlib.init_mesh({"dp": 2, "fsdp": 2})
            mesh.device = torch.device("meta")
            with materialize_on("meta"):
                smodel = shardlib.shard(build_meta_model(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2,
                                                                   n_embd=16)), mesh, zero_stage=stage, data_axes=axes)
            opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-4, max_grad_norm=1.0)
            x = torch.zeros(2, 8, dtype=torch.long, device="meta")
            smodel(x, x)[1].backward()
            opt.step()
            zero = smodel._zero
            out.append({"native": mesh.native, "check": mesh.trace.check, "norm_device": str(opt.last_grad_norm.device),
                        "torch_group_rank": dist.get_group_rank(mesh.group(axes), 2),
                        "slots": [(c.slot.start, c.plan.shard_numel) for c in zero.chunks],
                        "comm": {f"{a}/{k}": v[0] for (a, k), v in mesh.comm.table().items()}})
    return out


@pytest.mark.multiprocess
def test_zero_dry_run_on_two_data_axes_hands_collectives_only_meta_tensors(tmp_path):
    """Device discipline on ZeRO's path that tests/test_dryrun.py does not cover: stages 0 and
    2, the optimizer step with clipping (the norm's all-reduce), two data axes in both orders.
    Every tensor handed to a collective is on meta (check mode); each chunk's shard is torch's
    group rank's slot (the fake group runs the native branch)."""
    from _inpool import in_fresh_process

    assert os.environ["SHARDLIB_CHECK_COLLECTIVES"] == "1"  # the fresh process checks as the suite does
    results = json.loads(json.dumps(in_fresh_process(_dry_runs)))  # a process with no group: tests/_inpool.py
    for (stage, axes), res in zip(DRY_CASES, results):
        assert res["native"] and res["check"] and res["norm_device"] == "meta", (stage, axes, res)
        assert res["torch_group_rank"] == 2  # dp 1, fsdp 0: the third of the sorted ranks [0, 1, 2, 3]
        for start, shard in res["slots"]:
            assert start == 2 * shard, (stage, axes, res["slots"])
        key = "+".join(axes)
        assert res["comm"][f"{key}/all_reduce"] >= 1  # the norm (stages 1-3) or the gradients (stage 0)
        if stage:
            assert res["comm"][f"{key}/reduce_scatter"] >= 1 and res["comm"][f"{key}/all_gather"] >= 1
