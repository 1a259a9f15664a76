"""A column layer's input operator is applied once per input tensor (``SharedInput``), and a
result is reused only in the mode it was made in.

Regression (found by a new-user pass): the cache was keyed on the tensor, its version and the
operator, not on whether a graph was recorded. A forward under ``torch.no_grad()`` on a batch (an
evaluation pass), or one before ``x.requires_grad_()``, left a graph-less result that the next
training forward on the same tensor reused: ``x.grad`` stayed None on every rank, silently.
"""

import pytest
import torch
from torch import nn

import shardlib
from shardlib import P
from shardlib.parallel.tensor import SharedInput
from shardlib.testing import run_on


def test_a_result_made_without_a_graph_is_not_reused_with_one():
    calls = []

    def op(t):
        calls.append(t)
        return t * 1.0

    cache, x = SharedInput(), torch.randn(3, requires_grad=True)
    with torch.no_grad():
        assert not cache.apply(x, ("pvary",), op).requires_grad
    y = cache.apply(x, ("pvary",), op)
    assert y.requires_grad and len(calls) == 2
    assert cache.apply(x, ("pvary",), op) is y and len(calls) == 2  # reused within one mode, as before
    z = torch.randn(3)  # no gradient wanted yet, then wanted
    cache.apply(z, ("pvary",), op)
    z.requires_grad_()
    assert cache.apply(z, ("pvary",), op).requires_grad and len(calls) == 4


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _make():
    torch.manual_seed(0)
    return _MLP().double()


def _input_grad(mode):
    """x.grad of the column -> row MLP on tp=2 after ``mode``'s first forward (or one process)."""
    torch.manual_seed(1)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=mode != "late_requires_grad")
    if mode == "one_process":
        model = _make()
    else:
        mesh = shardlib.init_mesh({"tp": 2})
        model = shardlib.shard(_make(), mesh, {"up.weight": P("tp", None), "up.bias": P("tp"),
                                               "down.weight": P(None, "tp")})
    if mode == "no_grad_first":
        with torch.no_grad():
            model(x)  # an evaluation pass on the same batch
    elif mode == "late_requires_grad":
        model(x)
        x.requires_grad_()
    model(x).pow(2).sum().backward()
    return x.grad


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["no_grad_first", "late_requires_grad"])
def test_the_input_gradient_survives_an_earlier_forward_without_a_graph(mode):
    expected = _input_grad("one_process")
    for rank, grad in enumerate(run_on(2, _input_grad, mode)):
        assert grad is not None, f"rank {rank}: x.grad is None (the cached operator had no graph)"
        # float64, one matmul pair: measured difference 2.8e-17 (the row layer's all-reduce
        # adds two partial sums where one process adds in one matmul)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
