"""The NCCL-relevant choices of the communication layer, run on CPU (issue 15, item 5a).

ZeRO makes its second communicator over the data axes only where gathers run during backward
(stage 3). The data-dependent ZeRO-3 backward that needs it is tests/test_zero_datadep.py (and
its native-branch run in tests/test_native_collectives.py).
"""

import pytest
import torch

import shardlib
from shardlib.testing import TiedLM, run_on


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
