"""What may cross a pipeline stage boundary: a stage that starts with an in-place op, token ids
(int64) between stages, and the clear refusals (a tuple between stages, an empty local batch).
Found by a new user's pass (issue 15's pipeline path); each case failed before its fix with a
PyTorch-internal error on one rank while the other waited for the watchdog."""

import pytest
import torch
from torch import nn

import shardlib
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess


class _TokenIds(nn.Module):
    """A layer with a parameter (unused: ids carry no gradient) that maps token ids to others."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return (x * 7) % 37


class _MeanPool(nn.Module):
    def forward(self, h):
        return h.mean(1)


class _HiddenAndMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 8)

    def forward(self, x):
        return self.emb(x), x != 0


def _model(case: str):
    """(float64 model, split_points, input kind)."""
    torch.manual_seed(0)
    if case == "in_place_first":  # stage 1 starts with ReLU(inplace=True) on the received activation
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True),
                          nn.Linear(32, 4))
        return m.double(), ["3"], "float"
    # "token_ids": int64 ids cross the boundary; the embedding starts stage 1
    m = nn.Sequential(_TokenIds(), nn.Embedding(37, 16), nn.Linear(16, 16), _MeanPool(), nn.Linear(16, 4))
    return m.double(), ["1"], "int"


def _data(kind: str, steps: int = 2):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=g, dtype=torch.float64) if kind == "float" else
          torch.randint(0, 37, (4, 8), generator=g) for _ in range(steps)]
    return xs, [torch.randint(0, 4, (4,), generator=g) for _ in range(steps)]


def _reference(case: str):
    """One process, the pipeline's loss (mean over 2 microbatches), SGD."""
    m, _, kind = _model(case)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for x, y in zip(*_data(kind)):
        loss = sum(nn.functional.cross_entropy(m(a), b) for a, b in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in m.state_dict().items()}


def _pipelined(case: str, schedule: str):
    mesh = shardlib.init_mesh({"pp": 2})
    m, split, kind = _model(case)
    smodel = shardlib.shard(m, mesh, schedule=schedule, microbatches=2, split_points=split)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.5)
    losses = []
    for x, y in zip(*_data(kind)):
        got, _ = smodel.forward_backward(x, criterion=nn.functional.cross_entropy, labels=(y,))
        opt.step()
        opt.zero_grad()
        mine = torch.stack(got).mean() if got is not None else torch.zeros((), dtype=torch.float64)
        losses.append(shardlib.all_reduce(mine, "pp").item())
    return losses, shardlib.full_state_dict(smodel)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])  # the whole backward, and the split one (I, then W)
@pytest.mark.parametrize("case", ["in_place_first", "token_ids"])
def test_a_stage_starting_in_place_or_on_token_ids_trains_as_one_process(case, schedule):
    """Before the fix the received activation was a leaf needing a gradient, so an in-place op
    first in a stage raised ("a leaf Variable that requires grad is being used in an in-place
    operation"), and an int64 one could not need a gradient at all ("only Tensors of floating
    point dtype can require gradients"). float64, the same ops in the same order: measured
    differences are 0; 1e-12 leaves room for nothing but reordering."""
    ref_losses, ref_state = _reference(case)
    for losses, state in run_on(2, _pipelined, case, schedule):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-12, (losses, ref_losses)
        for name, value in ref_state.items():
            assert torch.allclose(state[name].cpu(), value, rtol=0, atol=1e-12), name
        assert (state["0.scale"] == 1).all() if case == "token_ids" else True  # no gradient reaches it


def test_a_tuple_between_stages_is_refused_naming_the_stage():
    """It raised AttributeError ('tuple' object has no attribute 'detach') on rank 0 (pass A's
    05_sequential_boundaries.py tuple_boundary). The step calls this check on every stage's
    output but the last; as a unit here (a rank raising restarts the test pool: 5 s)."""
    from shardlib.errors import ShardingError
    from shardlib.parallel.pipeline import _refuse_non_tensor

    out = _HiddenAndMask()(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ShardingError, match=r"stage 0 returned a tuple, but a transfer between stages carries one "
                                            r"tensor.*Fix: return one tensor"):
        _refuse_non_tensor(0, out)
    _refuse_non_tensor(0, out[0])  # one tensor: fine


def _empty_batch(backward: bool):
    from shardlib.errors import ShardingError

    mesh = shardlib.init_mesh({"pp": 2})
    m, split, _ = _model("in_place_first")
    smodel = shardlib.shard(m, mesh, microbatches=2, split_points=split)
    x, y = torch.zeros(0, 16, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    start = mesh.trace.seq
    try:
        if backward:
            smodel.forward_backward(x, criterion=nn.functional.cross_entropy, labels=(y,))
        else:
            smodel.evaluate(x, criterion=nn.functional.cross_entropy, labels=(y,))
    except ShardingError as e:
        return str(e), mesh.trace.seq - start
    return None, mesh.trace.seq - start


@pytest.mark.parametrize("backward", [True, False], ids=["forward_backward", "evaluate"])
def test_an_empty_local_batch_is_refused_on_every_rank_before_any_transfer(backward):
    """0 rows passed the divisibility check (0 % m == 0); the first stage then failed alone
    reshaping 0 elements while the last waited for its activation."""
    what = "forward_backward" if backward else "evaluate"
    for message, issued in run_on(2, _empty_batch, backward):
        assert message is not None and message.startswith(f"{what}: the local batch of 0 rows"), message
        assert "positive multiple of 2 rows" in message and issued == 0, (message, issued)


class _PairHead(nn.Module):
    """A last layer returning (logits, auxiliary loss), as a mixture-of-experts head does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, h):
        y = self.lin(h)
        return y, y.pow(2).mean()


def _pair_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), _PairHead()).double()


def _pair_loss(out, y):
    return ((out[0] - y) ** 2).mean() + out[1]


def _pair_outputs(schedule: str):
    mesh = shardlib.init_mesh({"pp": 2})
    smodel = shardlib.shard(_pair_model(), mesh, schedule=schedule, microbatches=2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    got = {}
    for name, fn in (("evaluate", smodel.evaluate), ("forward_backward", smodel.forward_backward)):
        losses, outs = fn(x, criterion=_pair_loss, labels=(y,), return_outputs=True)
        got[name] = None if outs is None else [(o[0].requires_grad, o[0], o[1]) for o in outs]
    return got


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_return_outputs_gives_a_tuple_output_per_microbatch_as_one_process(schedule):
    """return_outputs=True with a last stage returning a tuple raised AttributeError ('tuple'
    object has no attribute 'detach') on the last rank (new-user pass, 01_last_stage_tuple_return_
    outputs.py): each microbatch's output now keeps its structure, detached, and equals one
    process's (same float64 operations on the same rows: measured 0 difference)."""
    m = _pair_model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ref = [m(x[:2]), m(x[2:])]
    first, last = run_on(2, _pair_outputs, schedule)
    assert first == {"evaluate": None, "forward_backward": None}
    for name in ("evaluate", "forward_backward"):
        assert len(last[name]) == 2
        for (needs_grad, logits, aux), (ref_logits, ref_aux) in zip(last[name], ref):
            assert not needs_grad
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
            torch.testing.assert_close(aux, ref_aux, rtol=0, atol=1e-12)
