"""The module given to shard() afterwards: ZeRO-3's sharded-away parameters raise a clear error
instead of reading freed memory (a segfault before), and a module is sharded once.

Every test runs on real gloo ranks through the shared pool; a worker that crashed would show up
as ``WorkerError`` "killed by SIGSEGV" and fail the test.
"""

import copy
import io
import math
import re

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

import shardlib
from shardlib import P, WorkerError
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess

AWAY = (r"parameter '{name}' of {model} was sharded away by shardlib\.shard \(ZeRO-3 over {over}\): outside the "
        r"forward and backward of the module shard\(\) returned, this rank stores only its shard of it, .*Use the "
        r"sharded module: shardlib\.full_state_dict\(smodel\) \(on every rank\) for full values")
TP = {"0.weight": P("tp", None), "0.bias": P("tp"), "2.weight": P(None, "tp")}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _shard(shape=None, **options):
    mesh = shardlib.init_mesh(shape or {"dp": 2})
    model = _model()
    return mesh, model, shardlib.shard(model, mesh, **options)


def _step(smodel, opt, seed):
    """One training step on this rank's batch; the loss."""
    axes = smodel.plan.data_axes  # a batch per data rank: tensor-parallel ranks read the same one
    g = torch.Generator().manual_seed(seed * 10 + (smodel.mesh.index(axes) if axes else 0))
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    if hasattr(smodel, "forward_backward"):
        losses, _ = smodel.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
        loss = None if losses is None else float(sum(losses))
    else:
        out = nn.functional.mse_loss(smodel(x), y)
        out.backward()
        loss = out.item()
    opt.step()
    opt.zero_grad()
    return loss


def _outcome(fn):
    """``("ok", value)`` or ``(exception class name, message)``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return (type(exc).__name__, str(exc))


def _refused(fn):
    """``(exception class name, message)``, or ``("ok", "")`` when ``fn`` returned (its value, a
    module holding process groups, cannot travel back)."""
    kind, value = _outcome(fn)
    return (kind, "") if kind == "ok" else (kind, value)


def _assert_on_every_rank(err: WorkerError, exc_type: str, n: int = 2):
    """Every rank reported the same error (it was raised locally, not by one rank's failure)."""
    assert sorted(err.errors) == list(range(n)), err.errors
    assert {e[0] for e in err.errors.values()} == {exc_type}, err.errors
    assert len({e[1] for e in err.errors.values()}) == 1, err.errors


# -- the three crashes of issue 13, as a user meets them -------------------------------------------

def _read_weight():
    _, model, _ = _shard(zero_stage=3)
    return model[0].weight.sum().item()


def _original_state_dict():
    _, model, _ = _shard(zero_stage=3)
    return list(model.state_dict())


def _shard_again():
    mesh, model, _ = _shard(zero_stage=3)
    shardlib.shard(model, mesh, zero_stage=3)
    return "sharded again"


def test_reading_a_sharded_away_parameter_raises_on_every_rank():
    """``model[0].weight.sum()`` after ZeRO-3 on dp=2 read freed storage (SIGSEGV): now a
    ShardedAwayError naming the parameter, the model, the layout and the way to read it."""
    with pytest.raises(WorkerError, match=AWAY.format(name=r"0\.weight", model="Sequential", over="dp=2")
                       + r".*\(tried Tensor\.sum\)") as info:
        run_on(2, _read_weight)
    _assert_on_every_rank(info.value, "ShardedAwayError")


def test_state_dict_of_the_original_module_raises_on_every_rank():
    """``model.state_dict()`` of the module given to shard() (ZeRO-3) returned aliases of freed
    storage that crashed when read: now it raises at the call, naming the first parameter."""
    with pytest.raises(WorkerError, match=AWAY.format(name=r"0\.weight", model="Sequential", over="dp=2")
                       + r".*\(tried Tensor\.detach\)") as info:
        run_on(2, _original_state_dict)
    _assert_on_every_rank(info.value, "ShardedAwayError")


def test_sharding_the_same_module_twice_is_refused_on_every_rank():
    """A second ``shard()`` of the same module packed its freed parameters again (SIGSEGV)."""
    with pytest.raises(WorkerError, match=r"ShardingError: shard\(\): Sequential was given to an earlier "
                       r"shardlib\.shard\(Sequential, zero_stage=3, mesh dp=2\), which moved its parameters into the "
                       r"ZeRO chunks and hooks of the module it returned; sharding them again would corrupt both\. "
                       r"Train, evaluate and save the sharded module that call returned, or build a fresh Sequential "
                       r"and shard it once") as info:
        run_on(2, _shard_again)
    _assert_on_every_rank(info.value, "ShardingError")


class _LoRA(nn.Module):
    """W + B A, minLoRA's parametrization (rank 2 on an 8 x 8 weight)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(2, 8)), nn.Parameter(torch.zeros(8, 2))

    def forward(self, w):
        return w + self.b @ self.a


class _Half(nn.Module):
    def forward(self, b):
        return 0.5 * b


def _change_structure_after_shard(stage):
    _, model, smodel = _shard(zero_stage=stage)
    lora = nn.Linear(8, 2, bias=False)
    cases = {  # what a user may write after shard(); the first four would train silently wrong
        "adapter parameter": lambda: setattr(model[0], "lora_a", nn.Parameter(torch.zeros(2, 8))),
        "replaced weight": lambda: setattr(model[2], "weight", nn.Parameter(torch.zeros(4, 8))),
        "adapter module": lambda: setattr(model[0], "lora", lora),
        "new head on smodel": lambda: setattr(smodel, "head", nn.Linear(4, 1)),
        "the same weight again": lambda: setattr(model[2], "weight", model[2].weight),
        "a module without parameters": lambda: setattr(model, "act", nn.GELU()),
        "a layer of the model moved": lambda: setattr(model, "first", model[0]),
        # torch.nn.utils.parametrize puts a ModuleDict in first (no parameters: it passes), then the
        # parametrization into it: a LoRA's own parameters are refused, one without any passes
        "a LoRA parametrization": lambda: parametrize.register_parametrization(model[0], "weight", _LoRA()),
        "a parametrization without parameters": lambda: parametrize.register_parametrization(model[2], "bias", _Half()),
    }
    return {name: _refused(fn)[0] for name, fn in cases.items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_registered_after_shard_is_refused_where_it_is_assigned(stage):
    """A parameter added to a sharded model (a LoRA adapter, a replaced or newly tied weight) is in
    no ZeRO chunk: its gradient was never averaged over dp and ZeroOptimizer never updated it,
    with no error. Now the assignment raises on every rank; re-assigning the same parameter,
    adding a module without parameters and moving a layer of the model still pass."""
    # (ZeRO-3: register_parametrization reads the weight first, which raises ShardedAwayError)
    parametrized = {"a LoRA parametrization": "ShardedAwayError", "a parametrization without parameters":
                    "ShardedAwayError"} if stage == 3 else {}
    for got in run_on(2, _change_structure_after_shard, stage):
        assert got == {"adapter parameter": "ShardingError", "replaced weight": "ShardingError",
                       "adapter module": "ShardingError", "new head on smodel": "ShardingError",
                       "the same weight again": "ok", "a module without parameters": "ok",
                       "a layer of the model moved": "ok", "a LoRA parametrization": "ShardingError",
                       "a parametrization without parameters": "ok", **parametrized}, got


def _insert_after_shard(check: bool):
    mesh, model, smodel = _shard(zero_stage=1)
    mesh.trace.check = check  # off: the check runs at the first step only (a user's run); on: every step
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=1.0)
    model.insert(1, nn.Linear(8, 8))  # writes _modules directly: no registration hook sees it
    smodel(torch.randn(2, 8)).sum().backward()
    opt.step()


@pytest.mark.parametrize("check", [False, True], ids=["first-step", "check-mode"])
def test_a_layer_inserted_past_the_registration_hooks_is_refused_at_the_step(check):
    """Sequential/ModuleList.insert after shard() was not refused (pass G): the inserted layer's
    gradients differed per rank (0.084 vs 0.152) and an SGD step left it unchanged."""
    with pytest.raises(WorkerError, match=r"ShardingError: ZeroOptimizer\.step\(\): the parameter 'module\.1\.weight' "
                       r"\(8, 8\) of ShardedModule was added after shard\(\) past torch's registration hooks "
                       r"\(ModuleList\.insert.*Fix: add it to the model before shard\(\)") as info:
        run_on(2, _insert_after_shard, check)
    _assert_on_every_rank(info.value, "ShardingError")


def _adapter_message():
    _, model, _ = _shard(zero_stage=1)
    model[0].lora_a = nn.Parameter(torch.zeros(2, 8))


def test_the_refusal_names_the_parameter_the_call_and_the_fix():
    with pytest.raises(WorkerError, match=r"ShardingError: Linear\.lora_a = Parameter\(2, 8\) adds a parameter to a "
                       r"module after shardlib\.shard\(Sequential, zero_stage=1, mesh dp=2\).*ZeroOptimizer would never "
                       r"update it.*Fix: add adapters, new heads and ties to the model before shard\(\)") as info:
        run_on(2, _adapter_message)
    _assert_on_every_rank(info.value, "ShardingError")


# -- what touching a sharded-away parameter does -----------------------------------------------------

def _touch_everything():
    mesh, model, smodel = _shard(zero_stage=3)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    _step(smodel, opt, 0)
    w = model[0].weight
    full = shardlib.full_state_dict(smodel)

    def save():
        torch.save(model, io.BytesIO())

    def write():
        with torch.no_grad():
            w.copy_(torch.zeros(8, 8))

    uses = {
        "sum": lambda: w.sum(), "print": lambda: str(w), "data": lambda: w.data, "detach": lambda: w.detach(),
        "clone": lambda: w.clone(), "tolist": lambda: w.tolist(), "add": lambda: torch.ones(8, 8) + w,
        "linear": lambda: nn.functional.linear(torch.ones(2, 8), w), "write": write, "save": save,
        "deepcopy": lambda: copy.deepcopy(model), "to": lambda: model.to(torch.float64),
        "load_state_dict": lambda: model.load_state_dict(full), "submodule state_dict": lambda: model[2].state_dict(),
        "bias": lambda: model[2].bias.numpy(), "foreach": lambda: torch._foreach_mul_(list(model.parameters()), 2.0),
    }
    before = mesh.comm.calls()
    touched = {name: _refused(fn) for name, fn in uses.items()}
    metadata = (tuple(w.shape), str(w.dtype), str(w.device), w.requires_grad, w.grad, w.is_leaf,
                sum(p.numel() for p in model.parameters()), len(set(model.parameters())))
    model.zero_grad()  # torch's own, reads and sets .grad only
    communicated = mesh.comm.calls() - before
    # inside the sharded module's forward the parameters are the gathered tensors
    seen = {}
    hook = model[2].register_forward_pre_hook(lambda m, args: seen.setdefault("2.weight", m.weight.detach().clone()))
    smodel(torch.ones(1, 8))
    hook.remove()
    return touched, metadata, communicated, torch.equal(seen["2.weight"], shardlib.full_state_dict(smodel)["2.weight"])


def test_every_use_but_metadata_raises_and_inside_forward_the_values_are_there():
    """Under ZeRO-3 any torch function on a parameter of the original module, read or write,
    raises ShardedAwayError naming it (no communication); its metadata stays readable, so
    parameter counts, ``zero_grad`` and optimizers' checks work; inside the sharded module's
    forward a hook reads the gathered values."""
    for touched, metadata, communicated, inside in run_on(2, _touch_everything):
        for use, (exc_type, message) in touched.items():
            # load_state_dict collects the error into its own RuntimeError, with the message
            expected = "RuntimeError" if use == "load_state_dict" else "ShardedAwayError"
            assert exc_type == expected, (use, exc_type, message)
            name = {"bias": r"2\.bias", "submodule state_dict": r"2\.weight"}.get(use, r"0\.weight")
            assert re.search(AWAY.format(name=name, model="Sequential", over="dp=2"), message), (use, message)
        assert metadata == ((8, 8), "torch.float32", "cpu", True, None, True, 8 * 8 + 8 + 8 * 4 + 4, 4)
        assert communicated == 0
        assert inside


def _train(probe: bool):
    mesh, model, smodel = _shard(zero_stage=3)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    losses, refused = [], []
    for step in range(3):
        losses.append(_step(smodel, opt, step))
        if probe:  # a user poking at the original module between steps
            refused += [_outcome(lambda: model[0].weight.sum())[0], _outcome(lambda: model.state_dict())[0],
                        _refused(lambda: shardlib.shard(model, mesh, zero_stage=3))[0]]
    return losses, shardlib.full_state_dict(smodel), refused


def _train_with_and_without_probes():
    return _train(True), _train(False)


def test_training_through_smodel_is_unchanged_by_touching_the_original():
    """Three AdamW steps with refused reads, state_dict() and re-shard calls between them give
    bit-identical losses and parameters to the same run without them (equivalence with one
    process is tests/test_zero.py's)."""
    for (losses, params, refused), (ref_losses, ref_params, _) in run_on(2, _train_with_and_without_probes):
        assert refused == ["ShardedAwayError", "ShardedAwayError", "ShardingError"] * 3
        assert losses == ref_losses
        assert params.keys() == ref_params.keys()
        for name in params:
            assert torch.equal(params[name], ref_params[name]), name
        assert not torch.equal(params["0.weight"], _model()[0].weight.detach()), "training moved nothing"


# -- a module is sharded once --------------------------------------------------------------------------

RESHARD = {
    "same module": (lambda model, smodel: model, r"shard\(\): Sequential was given to an earlier shardlib\.shard\("),
    "sharded module": (lambda model, smodel: smodel,
                       r"shard\(\): the model given \((ShardedModule|PipelineModule)\) is the module returned by "
                       r"an earlier shardlib\.shard\(Sequential, .*it is sharded already and "
                       r"cannot be sharded again\. Train, evaluate and save the sharded module that call returned, or "
                       r"build a fresh Sequential and shard it once"),
    "a submodule": (lambda model, smodel: model[0], r"shard\(\): [A-Za-z]+ (was given to|is part of the module "
                    r"returned by) an earlier shardlib\.shard\(Sequential, "),
    "inside another model": (lambda model, smodel: nn.Sequential(model, nn.Linear(4, 2)),
                             r"shard\(\): Sequential contains '0' \(Sequential\), which was given to an earlier "
                             r"shardlib\.shard\(Sequential, .*cannot be sharded again inside Sequential\. Build the "
                             r"whole model from fresh modules and shard it once, or use the sharded module as it is"),
    "sharded module inside another": (lambda model, smodel: nn.Sequential(smodel, nn.Linear(4, 2)),
                                      r"shard\(\): Sequential contains '0' \((ShardedModule|PipelineModule)\), which "
                                      r"is the module returned by an earlier shardlib\.shard\(Sequential, "),
}


def _reshard(case, stage):
    mesh, model, smodel = _shard(zero_stage=stage)
    shardlib.shard(RESHARD[case][0](model, smodel), mesh, zero_stage=stage)
    return "sharded again"


@pytest.mark.parametrize("case", list(RESHARD))
def test_resharding_is_refused_with_a_clear_error(case):
    """Each way of sharding a sharded model again, as the user sees it (stage 0: the parameters
    are valid there, and sharding them twice still doubled the gradient hooks silently)."""
    with pytest.raises(WorkerError, match="ShardingError: " + RESHARD[case][1]) as info:
        run_on(2, _reshard, case, 0)
    _assert_on_every_rank(info.value, "ShardingError")


PLAN_AGAIN = (r"plan\(\): Sequential was given to an earlier shardlib\.shard\(Sequential, zero_stage=\d, "
              r"mesh [a-z=0-9, ]+\), which moved its parameters")


def _plan_again():
    mesh, model, _ = _shard(zero_stage=1)
    return str(shardlib.plan(model, mesh, zero_stage=1))


def test_planning_a_sharded_model_is_refused():
    """plan() of a sharded model planned its local shards (under tensor parallelism it failed
    with a misleading "axis used by nothing"): refused like shard(), before anything else."""
    with pytest.raises(WorkerError, match="ShardingError: " + PLAN_AGAIN) as info:
        run_on(2, _plan_again)
    _assert_on_every_rank(info.value, "ShardingError")


def _original_after_shard(shape, options):
    """Per rank: the original module read against full_state_dict, and every re-shard refused."""
    mesh = shardlib.init_mesh(shape)
    model = _model()
    early = shardlib.plan(model, mesh, **options)  # a plan made before sharding, applied again below
    smodel = shardlib.shard(model, mesh, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    _step(smodel, opt, 0)
    full = shardlib.full_state_dict(smodel)
    stage = smodel.plan.effective_stage
    held = {n for n, _ in smodel.module.named_parameters(remove_duplicate=False)}
    mismatched = []
    for name, prm in model.named_parameters():
        if name not in held:
            continue  # a pipeline layer of another pp rank: unused here
        got = _outcome(lambda: prm.detach().clone())
        if stage == 3:
            ok = got[0] == "ShardedAwayError" and re.search(AWAY.format(name=re.escape(name), model="Sequential",
                                                                         over="dp=2"), got[1])
        else:  # a view of the chunk: the full tensor, or this rank's tensor-parallel slice of it
            want = full[name]
            for dim, (a, b) in enumerate(zip(prm.shape, want.shape)):
                if a != b:
                    want = want.chunk(b // a, dim)[mesh.index("tp")]
            ok = got[0] == "ok" and torch.equal(got[1], want)
        if not ok:
            mismatched.append((name, got[0]))
    before = mesh.comm.calls()
    refused = {}
    for case, (pick, pattern) in RESHARD.items():
        exc_type, message = _refused(lambda: shardlib.shard(pick(model, smodel), mesh, **options))
        refused[case] = exc_type == "ShardingError" and re.search(pattern, message) is not None
    exc_type, message = _refused(lambda: early.apply(model))
    refused["plan.apply"] = exc_type == "ShardingError" and re.search(RESHARD["same module"][1], message) is not None
    exc_type, message = _refused(lambda: shardlib.plan(model, mesh, **options))
    refused["plan"] = exc_type == "ShardingError" and re.search(PLAN_AGAIN, message) is not None
    communicated = mesh.comm.calls() - before
    loss = _step(smodel, opt, 1)  # the ranks are still in step and the sharded module trains on
    return mismatched, refused, communicated, loss


CONFIGS = {
    "zero-0": ({"dp": 2}, {"zero_stage": 0}),
    "zero-1": ({"dp": 2}, {"zero_stage": 1}),
    "zero-2": ({"dp": 2}, {"zero_stage": 2}),
    "zero-3": ({"dp": 2}, {"zero_stage": 3}),
    "zero-3 bf16 compute": ({"dp": 2}, {"zero_stage": 3, "param_dtype": torch.bfloat16}),
    "zero-3 offload": ({"dp": 2}, {"zero_stage": 3, "offload_ratio": 0.5, "optimizer_offload": True}),
    "tensor parallel": ({"dp": 1, "tp": 2}, {"specs": TP}),
    "pipeline": ({"pp": 2}, {"microbatches": 2}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_original_module_under_every_layout(config):
    """ZeRO stages 0-3, mixed precision, offload, tensor parallel and a pipeline on 2 ranks: the
    original module's parameters are the chunks' current values (stages 0-2; this rank's slice
    under tensor parallelism; the layers this pp rank holds) or refuse with ShardedAwayError
    (stage 3); every re-shard is refused on every rank without communication; training goes on."""
    shape, options = CONFIGS[config]
    for rank, (mismatched, refused, communicated, loss) in enumerate(run_on(2, _original_after_shard, shape, options)):
        assert mismatched == []
        assert refused == dict.fromkeys(list(RESHARD) + ["plan.apply", "plan"], True), refused
        assert communicated == 0
        if config == "pipeline" and rank == 0:
            assert loss is None  # the first stage has no loss
        else:
            assert math.isfinite(loss)


def _meta_initialized():
    mesh = shardlib.init_mesh({"dp": 2})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    smodel = shardlib.shard(model, mesh, zero_stage=3, init_rules={"*.weight": ("normal", 0.02), "*.bias": ("zeros",)})
    read = _outcome(lambda: model[2].weight.sum())
    again = _refused(lambda: shardlib.shard(model, mesh, zero_stage=3))
    return read, again[0], float(shardlib.full_state_dict(smodel)["2.bias"].abs().sum())


def test_meta_initialized_model():
    """A model built on meta and filled by init rules at shard time: its chunks were never
    allocated whole; its parameters refuse like any ZeRO-3 parameter, re-sharding is refused."""
    for (exc_type, message), again, bias in run_on(2, _meta_initialized):
        assert exc_type == "ShardedAwayError"
        assert re.search(AWAY.format(name=r"2\.weight", model="Sequential", over="dp=2"), message), message
        assert again == "ShardingError"
        assert bias == 0.0  # the zeros rule reached the shards


def _four_ranks():
    out = {}
    for label, shape, options in (("pipeline", {"pp": 2, "dp": 2}, {"microbatches": 2}),
                                  ("tensor parallel", {"dp": 2, "tp": 2}, {"specs": TP})):
        mesh = shardlib.init_mesh(shape)
        model = _model()
        smodel = shardlib.shard(model, mesh, options.pop("specs", None), zero_stage=3, **options)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
        _step(smodel, opt, 0)
        held = [n for n, _ in smodel.module.named_parameters()]
        out[label] = (held, _outcome(lambda: dict(model.named_parameters())[held[0]] * 2),
                      _refused(lambda: shardlib.shard(model, mesh, zero_stage=3))[0])
    return out


def test_zero3_with_a_pipeline_and_with_tensor_parallel_on_four_ranks():
    """ZeRO-3 on dp=2 with pp=2 (each rank's stage) and with tp=2 (local slices): the first
    parameter a rank holds refuses, named as in the model given; re-sharding is refused."""
    for ranked in run_on(4, _four_ranks):
        for label, (held, (exc_type, message), again) in ranked.items():
            assert exc_type == "ShardedAwayError", (label, message)
            assert re.search(AWAY.format(name=re.escape(held[0]), model="Sequential", over="dp=2"), message), message
            assert again == "ShardingError", label


def test_sharded_away_error_is_a_runtime_error():
    assert issubclass(shardlib.errors.ShardedAwayError, RuntimeError)
    assert "ShardedAwayError" in shardlib.errors.__all__
