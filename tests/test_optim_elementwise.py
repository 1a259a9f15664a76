"""ZeroOptimizer runs its optimizer on flat chunks and shards: it takes only elementwise ones.

Torch's elementwise optimizers are accepted by class and still train as plain PyTorch; Adafactor,
LBFGS and per-tensor optimizers of one's own are refused in the constructor, where they used to
train another model silently (Adafactor: TiedLM's weights up to 1.7e-2 off plain torch after
one step at lr 1e-2). An optimizer of one's own is accepted only when its class declares
itself elementwise: a probe on small tensors can show an update is not elementwise, never that
it is (a review found two that pass it and train another model).
"""

import pytest
import torch

import shardlib
from shardlib.elementwise import ELEMENTWISE_OPTIMIZERS, probe
from shardlib.errors import NotElementwiseError
from shardlib.testing import TiedLM

# PlainSGD rounds lr * g before subtracting, torch's SGD adds -lr * g in one op: fp32 parameters
# differ by up to 1.8e-7 relative after two steps (measured on TiedLM)
STEP_RTOL = 1e-6


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 37, (4, 5), generator=g), torch.randint(0, 37, (4, 5), generator=g)


def _sharded(stage=3):
    mesh = shardlib.init_mesh({"dp": 1})
    torch.manual_seed(0)
    return shardlib.shard(TiedLM(), mesh, zero_stage=stage, chunk_size=200)  # several chunks


class PlainSGD(torch.optim.Optimizer):
    """``p -= lr * g``: elementwise, but no torch class: the probe must prove it."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)


class DeclaredPlainSGD(PlainSGD):
    shardlib_elementwise = True


class ClipsBigTensors(PlainSGD):
    """Per-tensor clipping, only for tensors of >= 64 elements: passes a small probe (review)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    scale = min(1.0, 1.0 / (p.grad.norm().item() + 1e-6)) if p.numel() >= 64 else 1.0
                    p.sub_(group["lr"] * scale * p.grad)


class TrustRatioFromStep4(PlainSGD):
    """A LAMB-style per-tensor trust ratio from the fourth step on: passes a 3-step probe (review)."""

    @torch.no_grad()
    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = (p.norm() / (p.grad.norm() + 1e-12)).item() if self.calls >= 4 else 1.0
                    p.sub_(group["lr"] * ratio * p.grad)


class NormalizedSGD(PlainSGD):
    """``p -= lr * g / ||g||`` per tensor (LARS-like): not elementwise."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / p.grad.norm().clamp_min(1e-12))


class VouchedNormalizedSGD(NormalizedSGD):
    shardlib_elementwise = True  # its author's word, not checked


class InheritsTheVow(VouchedNormalizedSGD):
    """A subclass does not inherit the declaration: probed, and refused."""


class InfSGD(PlainSGD):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad / 0.0)


class NoisySGD(PlainSGD):
    """Draws from torch's global RNG: the probe must leave that RNG as it was."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["lr"] * (p.grad + torch.randn_like(p)))


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_allowlisted_optimizers_train_as_plain_pytorch(cls):
    """Each allowlisted class, with hyperparameters passed through: two steps on a one-rank mesh
    (ZeRO-3, several flat chunks) give plain PyTorch's parameters bit for bit (elementwise: the
    same operations on each element); the probe agrees too."""
    kwargs = dict(lr=1e-2) if cls is not torch.optim.Adadelta else dict(lr=1.0, rho=0.8)
    assert probe(cls, kwargs) is None
    torch.manual_seed(0)
    ref = TiedLM()
    ref_opt = cls([p for p in ref.parameters() if p.requires_grad], **kwargs)
    smodel = _sharded()
    opt = shardlib.ZeroOptimizer(smodel, cls, **kwargs)
    for step in range(2):
        ref(*_batch(step))[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        smodel(*_batch(step))[1].backward()
        opt.step()
        opt.zero_grad()
    full = shardlib.full_state_dict(smodel)
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name], value), name


def test_adafactor_is_refused_before_the_first_step():
    """It used to train on the flat chunks (row/column statistics of 1-D pieces): weights up to
    1.7e-2 off plain torch after one step."""
    smodel = _sharded(stage=0)
    with pytest.raises(NotElementwiseError, match=r"ZeroOptimizer\(smodel, torch\.optim\.Adafactor\): the optimizer "
                       r"must be elementwise.*it gave other values on the split tensor \(max relative difference "
                       r".*Fix: use an elementwise optimizer \(torch\.optim\.SGD, Adam, AdamW, .*ASGD\)") as info:
        shardlib.ZeroOptimizer(smodel, torch.optim.Adafactor, lr=1e-2)
    assert isinstance(info.value, shardlib.ShardingError) and isinstance(info.value, TypeError)
    assert "shardlib_elementwise" not in str(info.value)  # torch's own class: no vow to offer


@pytest.mark.parametrize("cls,found", [
    (torch.optim.LBFGS, r"torch\.optim\.LBFGS\.step\(\) requires a closure"),  # said first: the probe is not run
    (torch.optim.SparseAdam, r"raised RuntimeError: SparseAdam does not support dense gradients"),
    (torch.optim.Muon, r"raised ValueError: Muon only supports 2D parameters"),
])
def test_whole_tensor_optimizers_are_refused(cls, found):
    with pytest.raises(NotElementwiseError, match=rf"ZeroOptimizer\(smodel, torch\.optim\.{cls.__name__}\).*{found}"):
        shardlib.ZeroOptimizer(_sharded(), cls)


def test_an_elementwise_optimizer_of_ones_own_is_accepted_when_it_declares_itself():
    """``p -= lr * g`` in a user class that says it is elementwise (kwargs passed through):
    accepted, and equal to plain torch SGD after two steps."""
    smodel = _sharded()
    opt = shardlib.ZeroOptimizer(smodel, DeclaredPlainSGD, lr=0.1)
    assert type(opt.optimizer) is DeclaredPlainSGD
    torch.manual_seed(0)
    ref = TiedLM()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        for model, o in ((ref, ref_opt), (smodel, opt)):
            model(*_batch(step))[1].backward()
            o.step()
            o.zero_grad()
    full = shardlib.full_state_dict(smodel)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=STEP_RTOL, atol=1e-7, msg=name)


def test_a_per_tensor_norm_optimizer_of_ones_own_is_refused():
    with pytest.raises(NotElementwiseError, match=r"ZeroOptimizer\(smodel, test_optim_elementwise\.NormalizedSGD\):"
                       r".*is not one of torch's elementwise optimizers, and on a few float64 parameters and their "
                       r"flat concatenation cut in two it gave other values on the split tensor.*if NormalizedSGD's "
                       r"update is elementwise at every size and step, declare it with "
                       r"NormalizedSGD.shardlib_elementwise = True"):
        shardlib.ZeroOptimizer(_sharded(), NormalizedSGD, lr=0.1)


def test_the_declaration_is_the_escape_hatch_and_is_not_inherited():
    shardlib.ZeroOptimizer(_sharded(), VouchedNormalizedSGD, lr=0.1)  # accepted unprobed
    with pytest.raises(NotElementwiseError, match=r"InheritsTheVow\).*gave other values"):
        shardlib.ZeroOptimizer(_sharded(), InheritsTheVow, lr=0.1)


@pytest.mark.parametrize("cls", [PlainSGD, ClipsBigTensors, TrustRatioFromStep4])
def test_what_the_probe_finds_elementwise_is_still_refused_undeclared(cls):
    """A probe that finds no difference proves nothing: ClipsBigTensors and TrustRatioFromStep4
    pass it and train another model (a review measured 4.3e-5 and 1.7e-3 off plain torch); so an
    undeclared optimizer is refused, with the declaration as the fix."""
    assert probe(cls, dict(lr=0.1)) is None  # they do pass the probe
    with pytest.raises(NotElementwiseError, match=rf"{cls.__name__}\).*found no difference, but that cannot prove.*"
                       rf"declare it with {cls.__name__}.shardlib_elementwise = True"):
        shardlib.ZeroOptimizer(_sharded(), cls, lr=0.1)


def test_subclasses_and_partials():
    """A subclass of AdamW is not AdamW (it may change the update): refused undeclared; a
    ``functools.partial`` of an allowed class is that class; of Adafactor, refused."""
    import functools

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(NotElementwiseError, match=r"MyAdamW\).*cannot prove"):
        shardlib.ZeroOptimizer(_sharded(), MyAdamW, lr=1e-3)
    MyAdamW.shardlib_elementwise = True
    assert type(shardlib.ZeroOptimizer(_sharded(), MyAdamW, lr=1e-3).optimizer) is MyAdamW
    opt = shardlib.ZeroOptimizer(_sharded(), functools.partial(torch.optim.AdamW, betas=(0.9, 0.95)), lr=1e-3)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(NotElementwiseError, match=r"torch\.optim\.Adafactor\)"):
        shardlib.ZeroOptimizer(_sharded(), functools.partial(torch.optim.Adafactor), lr=1e-2)


@pytest.mark.parametrize("cls,kwargs,found", [
    (PlainSGD, dict(lr=0.0), r"it left the parameters unchanged \(lr=0\?\), so nothing was shown"),
    (InfSGD, dict(lr=0.1), r"it gave non-finite values"),
    (PlainSGD, dict(lr=0.1, momentum=0.9), r"it raised TypeError: .*unexpected keyword argument 'momentum'"),
])
def test_what_the_probe_cannot_show_is_refused(cls, kwargs, found):
    with pytest.raises(NotElementwiseError, match=found):
        shardlib.ZeroOptimizer(_sharded(), cls, **kwargs)


def test_the_probe_leaves_torch_rng_as_it_was():
    """Building a ZeroOptimizer mid-run must not move the data or dropout stream."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    probe(NoisySGD, dict(lr=0.1))  # draws inside the probe, from its own seed
    assert torch.equal(torch.get_rng_state(), before)
