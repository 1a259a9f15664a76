"""Mixed precision: bf16/fp16 compute copies, fp32 masters and reductions, dynamic loss scaling.

The sharded runs are compared with a single-process reference written out here, the recipe of
Micikevicius et al. (arXiv 1710.03740) that FSDP2's ``MixedPrecisionPolicy`` implements: an fp32
model holds the master weights; every step copies them into a ``param_dtype`` model, runs forward
and backward there, casts the gradients to fp32 and steps AdamW on the fp32 masters.
"""

import copy
import functools

import pytest
import torch

import shardlib
from shardlib.mesh import AbstractMesh
from shardlib.models.gpt import GPTConfig, tp_specs
from shardlib.testing import run_on
from shardlib.testing.models import gpt_for_tests

pytestmark = pytest.mark.multiprocess

SEQ = 8
CONFIG = GPTConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=4, n_embd=16)
TP_SPECS = dict(tp_specs(), **{"wte.weight": shardlib.P("tp", None)})  # vocab-parallel wte tied to lm_head
STEPS = 3
LR = 1e-3
# AdamW's update lr * m / (sqrt(v) + eps) is sign-like for |g| >> eps: a gradient element that is
# zero up to rounding (bf16 noise ~1e-3 relative) would flip a whole lr step between two runs. An
# eps of the order of the gradients (~1e-3 here) keeps the update Lipschitz in g (slope <= lr/eps),
# so parameter differences stay proportional to gradient differences and the tolerance below holds.
OPT = {"lr": 1e-2, "eps": 1e-1, "weight_decay": 0.1}


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _reference(batch, steps: int, seed: int, param_dtype: torch.dtype, scaler=None):
    """One process: fp32 masters, ``param_dtype`` forward/backward, fp32 AdamW (+ torch's GradScaler)."""
    torch.manual_seed(seed)
    master = gpt_for_tests(CONFIG)
    compute = copy.deepcopy(master).to(param_dtype)  # deepcopy keeps the tied wte/lm_head
    pairs = list(zip(master.parameters(), compute.parameters()))
    names = [n for n, _ in master.named_parameters()]
    opt = torch.optim.AdamW([p for p in master.parameters() if p.requires_grad], **OPT)
    records = []
    for _ in range(steps):
        with torch.no_grad():
            for pm, pc in pairs:
                pc.copy_(pm)
        loss = compute(*batch)[1]
        (scaler.scale(loss) if scaler else loss).backward()
        for pm, pc in pairs:
            pm.grad = None if pc.grad is None else pc.grad.float()
            pc.grad = None
        grads = {n: None if pm.grad is None else pm.grad.clone() for n, (pm, _) in zip(names, pairs)}
        scale = scaler.get_scale() if scaler else 1.0
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        steps_taken = max((int(s["step"]) for s in opt.state.values()), default=0)
        records.append({"loss": loss.item(), "grads": grads, "params": {k: v.clone() for k, v in master.state_dict().items()},
                        "scale": scale, "opt_steps": steps_taken})
    return records


def _sharded(mesh_shape, specs, batch, steps, seed, options, scaler_kwargs=None):
    mesh = shardlib.init_mesh(mesh_shape)
    torch.manual_seed(seed)
    smodel = shardlib.shard(gpt_for_tests(CONFIG), mesh, specs, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, **OPT)
    scaler = shardlib.GradScaler(**scaler_kwargs) if scaler_kwargs else None
    local = [shardlib.distribute(t, mesh, smodel.batch_spec) for t in batch]
    axes = smodel.plan.data_axes
    records, seen_dtypes = [], set()
    hook = lambda m, args: seen_dtypes.update(p.dtype for p in m.parameters(recurse=False))  # noqa: E731
    handles = [m.register_forward_pre_hook(hook) for m in smodel.module.modules()]
    for _ in range(steps):
        mesh.comm.reset()
        loss = smodel(*local)[1]
        (scaler.scale(loss) if scaler else loss).backward()
        mesh.comm.enabled = False
        total = loss.detach().double().reshape(1)
        if axes:
            shardlib.mesh.collectives.raw_all_reduce(total, mesh, axes, op="avg")
        grads = shardlib.full_grads(smodel)
        before = shardlib.full_state_dict(smodel)
        state_before = copy.deepcopy(opt.state_dict())
        mesh.comm.enabled = True
        scale = scaler.get_scale() if scaler else 1.0
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        comm = mesh.comm.table()
        mesh.comm.enabled = False
        params = shardlib.full_state_dict(smodel)
        mesh.comm.enabled = True
        steps_taken = max((int(s["step"]) for s in opt.state.values()), default=0)
        skipped_untouched = None
        if scaler and scaler.get_scale() < scale:  # skipped: nothing may have moved
            state_after = opt.state_dict()["state"]
            skipped_untouched = all(torch.equal(before[k], params[k]) for k in params) and all(
                torch.equal(v, state_after[i][k]) for i, s in state_before["state"].items() for k, v in s.items())
        opt.zero_grad()
        records.append({"loss": total.item(), "grads": grads, "params": params, "scale": scale, "opt_steps": steps_taken,
                        "comm": comm, "skipped_untouched": skipped_untouched})
    for h in handles:
        h.remove()
    zero = smodel._zero
    return {
        "records": records,
        "plan": smodel.plan,
        "compute_dtypes": seen_dtypes,
        "masters": [(c.shard.dtype, c.shard.numel(), c.plan.shard_numel, c.plan.padded_numel, c.trainable)
                    for c in zero.chunks],
        "opt_state": [(v.dtype, v.numel()) for s in opt.state.values() for v in s.values() if v.dim() > 0],
        "measured": shardlib.model_state_bytes(smodel, opt),
        "stage": zero.stage,
    }


def _max_rel(got: dict, ref: dict) -> float:
    """max over tensors of ``max |got - ref| / max |ref|`` (normwise, as assert_equivalent)."""
    worst = 0.0
    for name, r in ref.items():
        if r is None:
            assert got[name] is None, name
            continue
        err = (got[name].double() - r.double()).abs().max().item()
        worst = max(worst, err / max(r.double().abs().max().item(), 1e-30))
    return worst


BF16_U = 2.0**-8  # bf16 unit roundoff: 8 significand bits, round to nearest
# Tolerances, from bf16's unit roundoff u. Each run rounds every bf16 intermediate (relative error
# <= u); the two runs round at different points (dp: the loss mean and the weight-gradient sums
# over half the batch; tp: the partial products of row-parallel layers, sequence-sharded norms),
# so they agree to a few roundings, not bitwise. Loss: a bf16 scalar near 3.6 whose two values may
# round to neighbours: 2 ulps = 4u. Gradients: an element sums 64 token contributions of mixed
# sign, so its rounding error is ~u x sum|terms| ~ u x sqrt(64) |sum| = 8u relative; two runs, each
# product's two inputs rounded: 4 x 8u = 32u, normwise, with tensors below 1/64 of the largest
# gradient (norm biases, mostly cancellation) measured against that floor. Parameters: identical
# initial values, updates lr * m / (sqrt(v) + eps) with eps ~ the gradients (OPT) damp gradient
# differences, so half the gradient tolerance. Measured worst over seeds 0-5 on these meshes:
# loss 2.2u, gradients 10.9u, parameters 6.1u (a stale compute copy, not refreshed after the step:
# gradients ~1000u).
LOSS_RTOL, GRAD_RTOL, PARAM_RTOL, GRAD_FLOOR = 4 * BF16_U, 32 * BF16_U, 16 * BF16_U, 1 / 64


def _assert_close(kind: str, step: int, got: dict, ref: dict, rtol: float, floor: float = 0.0) -> None:
    for name, r in ref.items():
        if r is None:
            assert got[name] is None, (step, name)
            continue
        err = (got[name].double() - r.double()).abs().max().item()
        scale = max(r.double().abs().max().item(), floor, 1e-30)
        assert err <= rtol * scale, (
            f"step {step}: {kind} {name}: max |sharded - single| {err:.3e} > {rtol / BF16_U:.0f}u x {scale:.3e}")


def _world(mesh_shape: dict) -> int:
    n = 1
    for size in mesh_shape.values():
        n *= size
    return n


BF16_CASES = [({"dp": 2}, None, {"zero_stage": s}) for s in (0, 1, 2, 3)] + [
    ({"dp": 2}, None, {"zero_stage": 3, "reduce_dtype": torch.bfloat16}),
    ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 3, "sequence_parallel": True}),
    ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 1, "sequence_parallel": True}),
]


@pytest.mark.parametrize("mesh_shape,specs,options", BF16_CASES, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_bf16_equals_single_process_bf16_compute_fp32_masters(mesh_shape, specs, options):
    """param_dtype=bf16 on dp2 (ZeRO 0-3, fp32 or bf16 reduction) and dp2 x tp2 with sequence
    parallelism: losses, fp32 gradients and fp32 master parameters after 3 AdamW steps equal the
    single-process bf16-compute / fp32-master run within the bf16 tolerances above; the model
    computes in bf16 while masters and optimizer state stay fp32 and sharded; memory and
    communication (all-gathers in bf16: half the bytes of fp32) equal the plan's figures."""
    seed = 3
    batch = _batch(8, seed)
    options = dict(options, param_dtype=torch.bfloat16, chunk_size=900)
    results = run_on(_world(mesh_shape), _sharded, mesh_shape, specs, batch, STEPS, seed, options)
    reference = _reference(batch, STEPS, seed, torch.bfloat16)
    for step, (got, ref) in enumerate(zip(results[0]["records"], reference)):
        assert abs(got["loss"] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (step, got["loss"], ref["loss"])
        floor = GRAD_FLOOR * max(g.abs().max().item() for g in ref["grads"].values() if g is not None)
        _assert_close("gradient of", step, got["grads"], ref["grads"], GRAD_RTOL, floor)
        _assert_close("parameter", step, got["params"], ref["params"], PARAM_RTOL)
        for rank, other in enumerate(results[1:], start=1):
            for name, value in got["params"].items():
                assert torch.equal(other["records"][step]["params"][name], value), (step, rank, name)
    for rank, res in enumerate(results):
        plan = res["plan"]
        # (c) bf16 compute, fp32 masters and optimizer state on the shards
        assert res["compute_dtypes"] == {torch.bfloat16}, res["compute_dtypes"]
        for dtype, numel, shard_numel, padded, _ in res["masters"]:
            assert dtype == torch.float32
            assert numel == (padded if res["stage"] == 0 else shard_numel) and shard_numel * 2 == padded
        trainable = sum(n for _, n, _, _, train in res["masters"] if train)  # the frozen k biases have no state
        assert all(dtype == torch.float32 for dtype, _ in res["opt_state"])
        assert sum(n for _, n in res["opt_state"]) == 2 * trainable  # AdamW: exp_avg, exp_avg_sq per master element
        assert res["measured"] == {"params": plan.param_bytes, "grads": plan.grad_bytes, "optimizer": plan.optimizer_bytes,
                                   "total": plan.model_state_bytes}, (rank, res["measured"])
        tokens = batch[0].shape[0] // mesh_shape["dp"] * SEQ
        for rec in res["records"]:
            assert rec["comm"] == plan.comm_per_step(tokens=tokens if "tp" in mesh_shape else None), (rank, rec["comm"])
    plan = results[0]["plan"]
    fp32 = shardlib.plan(gpt_for_tests(CONFIG), AbstractMesh(mesh_shape), specs, **dict(options, param_dtype=None, reduce_dtype=None))
    mixed, full = plan.comm_per_step(), fp32.comm_per_step()
    gather = ("dp", "all_gather")
    if gather in full:
        assert mixed[gather][1] * 2 == full[gather][1]  # parameters gathered in bf16
    reduce = ("dp", "all_reduce" if options["zero_stage"] == 0 else "reduce_scatter")
    assert mixed[reduce][1] * (2 if options.get("reduce_dtype") == torch.bfloat16 else 1) == full[reduce][1]
