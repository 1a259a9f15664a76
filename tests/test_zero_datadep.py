"""ZeRO-3 with data-dependent control flow: a module that runs on one rank only."""

import pytest
import torch
from torch import nn

import shardlib
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = self.a(x)
        if x.sum() > 0:  # rank 0's batch takes the branch, rank 1's does not
            h = self.b(h)
        return self.c(h)


def _worker(stage, chunk_size):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(DataDependent(), mesh, zero_stage=stage, chunk_size=chunk_size)
    x = torch.ones(4, 3) * (1 if mesh.rank == 0 else -1)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    smodel(x).pow(2).mean().backward()
    grads = shardlib.full_grads(smodel)
    opt.step()
    return grads, shardlib.full_state_dict(smodel)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("chunk_size", [12, 13, 1 << 20])  # equal chunks, unequal chunks, one chunk
def test_module_skipped_on_one_rank(stage, chunk_size):
    """Regression (found by a new-user review): ZeRO-3 paired a rank's gradient reduce-scatter
    with another rank's parameter all-gather when their order followed the data."""
    torch.manual_seed(0)
    ref = DataDependent()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ((ref(torch.ones(4, 3)).pow(2).mean() + ref(-torch.ones(4, 3)).pow(2).mean()) / 2).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    for got_grads, got_params in run_on(2, _worker, stage, chunk_size):
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7)
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(got_params[name], p, rtol=1e-5, atol=1e-7)
