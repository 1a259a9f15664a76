"""Mixed precision: bf16/fp16 compute copies, fp32 masters and reductions, dynamic loss scaling.

The sharded runs are compared with a single-process reference written out here, the recipe of
Micikevicius et al. (arXiv 1710.03740) that FSDP2's ``MixedPrecisionPolicy`` implements: an fp32
model holds the master weights; every step copies them into a ``param_dtype`` model, runs forward
and backward there, casts the gradients to fp32 and steps AdamW on the fp32 masters.
"""

import contextlib
import copy

import math

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
# AdamW's update lr * m / (sqrt(v) + eps) is sign-like for |g| >> eps: a gradient element that is
# zero up to rounding (bf16 noise ~4e-3 relative) would flip a whole lr step between two runs. An
# eps of the order of the largest gradients (~0.2 here: row-layer biases) keeps the update Lipschitz
# in g (slope <= lr/eps), so parameter differences stay proportional to gradient differences. The
# large lr makes each step move the weights (~0.02) noticeably: a compute copy left stale after a
# step shows as ~1000u gradient errors.
OPT = {"lr": 1e-2, "eps": 1e-1, "weight_decay": 0.1}


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _reference(batch, steps: int, seed: int, param_dtype: torch.dtype, scaler=None, clip=None):
    """One process: fp32 masters, ``param_dtype`` forward/backward, fp32 AdamW (+ torch's GradScaler,
    unscaling before clipping to the global norm ``clip``)."""
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
        if scaler and clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in master.parameters() if p.grad is not None], clip)
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


def _sharded(mesh_shape, specs, batch, steps, seed, options, scaler_kwargs=None, accum=1, clip=None):
    mesh = shardlib.init_mesh(mesh_shape)
    torch.manual_seed(seed)
    smodel = shardlib.shard(gpt_for_tests(CONFIG), mesh, specs, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=clip, **OPT)  # clips after the unscale
    scaler = shardlib.GradScaler(**scaler_kwargs) if scaler_kwargs else None
    local = [shardlib.distribute(t, mesh, smodel.batch_spec) for t in batch]
    axes = smodel.plan.data_axes
    records, seen_dtypes = [], set()
    hook = lambda m, args: seen_dtypes.update(p.dtype for p in m.parameters(recurse=False))  # noqa: E731
    handles = [m.register_forward_pre_hook(hook) for m in smodel.module.modules()]
    for _ in range(steps):
        mesh.comm.reset()
        total = torch.zeros(1, dtype=torch.float64)
        for i, micro in enumerate(zip(*(t.chunk(accum) for t in local))):  # all but the last under no_sync()
            with smodel.no_sync() if i < accum - 1 else contextlib.nullcontext():
                loss = smodel(*micro)[1] / accum
                (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach().double()
        mesh.comm.enabled = False
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
        measured = shardlib.model_state_bytes(smodel, opt)  # after the step: stages 2-3 release gradients at zero_grad
        opt.zero_grad()
        norm = None if opt.last_grad_norm is None else opt.last_grad_norm.item()
        records.append({"loss": total.item(), "grads": grads, "params": params, "scale": scale, "opt_steps": steps_taken,
                        "comm": comm, "skipped_untouched": skipped_untouched, "norm": norm})
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
        "measured": measured,
        "stage": zero.stage,
    }


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
# differences, so half the gradient tolerance. Measured worst (seeds 0-5, dp2 ZeRO-0/3 and dp2 x tp2
# ZeRO-2/3 +-SP): loss 2.2u, gradients 10.9u, parameters 6.1u; a compute copy left stale after
# the step: gradients ~1000u. The same argument holds for fp16 (u = 2^-11) with the same factors
# (measured on the fp16 cases below: loss 1.7u, gradients 7.7u, parameters 6.3u).
LOSS_U, GRAD_U, PARAM_U, GRAD_FLOOR = 4, 32, 16, 1 / 64
FP16_U = 2.0**-11


def _assert_close(kind: str, step: int, got: dict, ref: dict, rtol: float, floor: float = 0.0) -> None:
    for name, r in ref.items():
        if r is None:
            assert got[name] is None, (step, name)
            continue
        err = (got[name].double() - r.double()).abs().max().item()
        scale = max(r.double().abs().max().item(), floor, 1e-30)
        assert err <= rtol * scale, f"step {step}: {kind} {name}: max |sharded - single| {err:.3e} > {rtol:.2e} x {scale:.3e}"


def _compare(records: list, reference: list, u: float, skipped: tuple = ()) -> None:
    """Losses, gradients (not on skipped steps: inf/NaN) and parameters against the reference."""
    for step, (got, ref) in enumerate(zip(records, reference)):
        if step not in skipped:
            assert abs(got["loss"] - ref["loss"]) <= LOSS_U * u * abs(ref["loss"]), (step, got["loss"], ref["loss"])
            floor = GRAD_FLOOR * max(g.abs().max().item() for g in ref["grads"].values() if g is not None)
            _assert_close("gradient of", step, got["grads"], ref["grads"], GRAD_U * u, floor)
        _assert_close("parameter", step, got["params"], ref["params"], PARAM_U * u)


def _world(mesh_shape: dict) -> int:
    n = 1
    for size in mesh_shape.values():
        n *= size
    return n


CASE_IDS = ["dp2-zero0", "dp2-zero1", "dp2-zero2", "dp2-zero3", "dp2-zero3-reduce-bf16", "dp2-zero0-reduce-bf16-accum2",
            "dp2-zero1-accum2", "dp2-zero1-reduce-bf16-accum2", "dp2xtp2-sp-zero3", "dp2xtp2-sp-zero1",
            "dp2-zero3-offload-params-accum2", "dp2xtp2-sp-zero3-offload-half"]
BF16_CASES = [({"dp": 2}, None, {"zero_stage": s}, 1) for s in (0, 1, 2, 3)] + [
    ({"dp": 2}, None, {"zero_stage": 3, "reduce_dtype": torch.bfloat16}, 1),
    ({"dp": 2}, None, {"zero_stage": 0, "reduce_dtype": torch.bfloat16}, 2),
    ({"dp": 2}, None, {"zero_stage": 1}, 2),
    ({"dp": 2}, None, {"zero_stage": 1, "reduce_dtype": torch.bfloat16}, 2),
    ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 3, "sequence_parallel": True}, 1),
    ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 1, "sequence_parallel": True}, 1),
    # parameter offload: bf16 compute copies gathered from fp32 masters in host memory (the copy-in casts)
    ({"dp": 2}, None, {"zero_stage": 3, "offload_param_frac": 1.0}, 2),
    ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 3, "sequence_parallel": True, "offload_param_frac": 0.5}, 1),
]


@pytest.mark.parametrize("mesh_shape,specs,options,accum", BF16_CASES, ids=CASE_IDS)
def test_bf16_equals_single_process_bf16_compute_fp32_masters(mesh_shape, specs, options, accum):
    """param_dtype=bf16 on dp2 (ZeRO 0-3, fp32 or bf16 reduction, no_sync() accumulation over 2
    micro-batches) and dp2 x tp2 with sequence parallelism: losses, fp32 gradients and fp32 master
    parameters after 3 AdamW steps equal the single-process bf16-compute / fp32-master run within
    the bf16 tolerances above; the model computes in bf16 while masters and optimizer state stay
    fp32 and sharded; memory and communication (all-gathers in bf16: half the bytes of fp32)
    equal the plan's figures."""
    seed = 3
    batch = _batch(8, seed)
    options = dict(options, param_dtype=torch.bfloat16, chunk_size=900)
    results = run_on(_world(mesh_shape), _sharded, mesh_shape, specs, batch, STEPS, seed, options, None, accum)
    reference = _reference(batch, STEPS, seed, torch.bfloat16)
    _compare(results[0]["records"], reference, BF16_U)
    for step, got in enumerate(results[0]["records"]):
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
            assert rec["comm"] == plan.comm_per_step(accum, tokens=tokens // accum if "tp" in mesh_shape else None), (rank, rec["comm"])
    plan = results[0]["plan"]
    fp32 = shardlib.plan(gpt_for_tests(CONFIG), AbstractMesh(mesh_shape), specs, **dict(options, param_dtype=None, reduce_dtype=None))
    mixed, full = plan.comm_per_step(), fp32.comm_per_step()
    gather = ("dp", "all_gather")
    if gather in full:
        assert mixed[gather][1] * 2 == full[gather][1]  # parameters gathered in bf16
    reduce = ("dp", "all_reduce" if options["zero_stage"] == 0 else "reduce_scatter")
    assert mixed[reduce][1] * (2 if options.get("reduce_dtype") == torch.bfloat16 else 1) == full[reduce][1]


# fp16 with dynamic loss scaling. An initial scale of 2^18 overflows: the loss gradient itself
# (the scale, in fp16) exceeds fp16's largest value 65504 for scales >= 2^16. Expected sequence
# with growth every 2 good steps: skip at 2^18, 2^17, 2^16; good at 2^15 twice; grow to 2^16:
# skip; good at 2^15.
FP16_STEPS = 7
SCALER = {"init_scale": 2.0**18, "growth_interval": 2}
CLIP = 0.1  # below the gradient norms here (~0.9, unscaled): clipping acts (unclipped: ~1800u parameter errors)
FP16_CASES = [({"dp": 2}, None, {"zero_stage": 2}, None), ({"dp": 2}, None, {"zero_stage": 1, "optimizer_offload": True}, None),
              ({"dp": 2, "tp": 2}, TP_SPECS, {"zero_stage": 3, "sequence_parallel": True}, CLIP)]


@pytest.mark.parametrize("mesh_shape,specs,options,clip", FP16_CASES,
                         ids=["dp2-zero2", "dp2-zero1-optimizer-offload", "dp2xtp2-sp-zero3-clip"])
def test_fp16_loss_scaling_skips_the_same_steps_as_torch_gradscaler(mesh_shape, specs, options, clip):
    """param_dtype=fp16 with shardlib.GradScaler against the single-process fp16-compute /
    fp32-master run with torch.amp.GradScaler: the same scale before every step, the same steps
    skipped (AdamW's step count), skipped steps leave parameters and optimizer state bitwise
    untouched, and results match within the fp16 tolerances (with global-norm clipping, which
    must see unscaled gradients)."""
    seed = 0
    batch = _batch(8, seed)
    options = dict(options, param_dtype=torch.float16, chunk_size=900)
    results = run_on(_world(mesh_shape), _sharded, mesh_shape, specs, batch, FP16_STEPS, seed, options, SCALER, 1, clip)
    reference = _reference(batch, FP16_STEPS, seed, torch.float16, scaler=torch.amp.GradScaler("cpu", **SCALER), clip=clip)
    ref_scales = [r["scale"] for r in reference]
    assert ref_scales == [2.0**18, 2.0**17, 2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15], ref_scales
    ref_steps = [r["opt_steps"] for r in reference]
    assert ref_steps == [0, 0, 0, 1, 2, 2, 3], ref_steps
    skipped = (0, 1, 2, 5)
    for rank, res in enumerate(results):
        records = res["records"]
        assert [r["scale"] for r in records] == ref_scales, (rank, [r["scale"] for r in records])
        assert [r["opt_steps"] for r in records] == ref_steps, (rank, [r["opt_steps"] for r in records])
        assert [s for s, r in enumerate(records) if r["skipped_untouched"] is not None] == list(skipped)
        assert all(records[s]["skipped_untouched"] for s in skipped), rank
        for s in skipped:
            assert not all(torch.isfinite(g).all() for g in records[s]["grads"].values() if g is not None)
        if clip is not None:
            norms = [records[s]["norm"] for s in range(FP16_STEPS) if s not in skipped]
            assert all(n > clip for n in norms), f"clip {clip} does not act: norms {norms}"
            # a skipped step's norm is its own (inf or NaN, as torch's clip_grad_norm_ after unscale_
            # gives); it was the previous step's finite norm (None before any step), found by a new user
            assert all(not math.isfinite(records[s]["norm"]) for s in skipped), [records[s]["norm"] for s in skipped]
    _compare(results[0]["records"], reference, FP16_U, skipped)


def _one_rank_overflows(mesh_shape, stage, bad_rank):
    """An inf in one rank's gradient shard only: every rank must skip and back off."""
    mesh = shardlib.init_mesh(mesh_shape)
    torch.manual_seed(0)
    specs = TP_SPECS if "tp" in mesh_shape else None
    smodel = shardlib.shard(gpt_for_tests(CONFIG), mesh, specs, zero_stage=stage, param_dtype=torch.float16,
                            sequence_parallel="tp" in mesh_shape)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, **OPT)
    scaler = shardlib.GradScaler(init_scale=2.0**10)
    idx, tgt = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in _batch(4, 0))
    out = []
    for step in range(2):
        scaler.scale(smodel(idx, tgt)[1]).backward()
        if step == 0 and mesh.rank == bad_rank:
            smodel._zero.owned_grads()[-1].view(-1)[-1] = float("inf")  # a local overflow on this rank only
        before = shardlib.full_state_dict(smodel)
        scaler.step(opt)
        scaler.update()
        after = shardlib.full_state_dict(smodel)
        out.append((scaler.get_scale(), len(opt.state), all(torch.equal(before[k], after[k]) for k in after)))
        opt.zero_grad()
    return out


@pytest.mark.parametrize("mesh_shape,stage,bad_rank", [({"dp": 2}, 3, 1), ({"dp": 2, "tp": 2}, 1, 3)], ids=["dp2-zero3", "dp2xtp2-zero1"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(mesh_shape, stage, bad_rank):
    """The inf check is one decision over the whole mesh (a max all-reduce of the found-inf flag):
    one rank's inf makes every rank skip step 0 (no optimizer state, parameters unchanged, scale
    halved); step 1 is taken everywhere."""
    results = run_on(_world(mesh_shape), _one_rank_overflows, mesh_shape, stage, bad_rank)
    for rank, steps in enumerate(results):
        assert steps[0] == (2.0**9, 0, True), (rank, steps)
        scale, n_states, unchanged = steps[1]
        assert scale == 2.0**9 and n_states > 0 and not unchanged, (rank, steps)


def test_grad_scaler_follows_torch_gradscaler_update_rule():
    """One process, no mesh: the scale sequence, skipped steps and parameters equal
    torch.amp.GradScaler's with non-power-of-two factors and overflows injected on chosen steps."""
    kwargs = {"init_scale": 3.0, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 2}
    runs = []
    for scaler in (shardlib.GradScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        scales = []
        for step in range(7):
            scaler.scale(model(torch.ones(4, 3)).pow(2).sum()).backward()
            if step in (1, 4):
                model.weight.grad[0, 0] = float("nan") if step == 1 else float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
        runs.append((scales, [p.detach().clone() for p in model.parameters()], scaler.state_dict()))
    (mine, p_mine, sd_mine), (ref, p_ref, sd_ref) = runs
    assert mine == ref and len(set(mine)) > 3, (mine, ref)
    assert all(torch.equal(a, b) for a, b in zip(p_mine, p_ref))
    assert sd_mine == sd_ref


def test_bad_mixed_precision_options_raise():
    model = gpt_for_tests(CONFIG)
    mesh = AbstractMesh({"dp": 2})
    for option, value in [("param_dtype", torch.int8), ("param_dtype", "bf16"), ("reduce_dtype", torch.int32),
                          ("param_dtype", torch.float8_e4m3fn), ("reduce_dtype", torch.complex64)]:
        with pytest.raises(shardlib.ShardingError, match=f"{option} must be a floating-point torch.dtype.*got {value!r}"):
            shardlib.plan(model, mesh, **{option: value})
    for kwargs, match in [({"init_scale": 0.0}, "init_scale must be a positive finite"),
                          ({"init_scale": float("inf")}, "init_scale must be a positive finite"),
                          ({"growth_factor": 0.5}, "growth_factor must be >= 1"),
                          ({"backoff_factor": 1.5}, r"backoff_factor must be in \(0, 1\]"),
                          ({"growth_interval": 0}, "growth_interval must be an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            shardlib.GradScaler(**kwargs)
    scaler = shardlib.GradScaler()
    half = torch.nn.Linear(2, 2).half()
    opt = torch.optim.SGD(half.parameters(), lr=0.1)
    half(torch.ones(1, 2, dtype=torch.float16)).sum().backward()
    with pytest.raises(ValueError, match="gradients are float16"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="no inf checks were recorded"):
        scaler.update()
    model32 = torch.nn.Linear(2, 2)
    opt32 = torch.optim.SGD(model32.parameters(), lr=0.1)
    scaler.scale(model32(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt32)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt32)
    scaler.step(opt32)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt32)


def test_plan_memory_counts_masters_and_compute_copies():
    """Per rank, ZeRO stage by stage: fp32 masters (full at stage 0, shards from stage 1) plus the
    persistent bf16 compute copy (stages 0-2; stage 3 gathers it per use); fp32 gradients and
    optimizer state as without mixed precision; explain() says so."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    n = 2
    psi = sum(c.padded_numel for c in shardlib.plan(model, AbstractMesh({"dp": n}), chunk_size=1 << 20).chunks)
    expected = {0: (4 * psi + 2 * psi, 4 * psi), 1: (4 * psi // n + 2 * psi, 4 * psi), 2: (4 * psi // n + 2 * psi, 4 * psi // n),
                3: (4 * psi // n, 4 * psi // n)}
    for stage, (params, grads) in expected.items():
        p = shardlib.plan(model, AbstractMesh({"dp": n}), zero_stage=stage, param_dtype=torch.bfloat16, chunk_size=1 << 20)
        assert (p.param_bytes, p.grad_bytes, p.optimizer_bytes) == (params, grads, 8 * psi // (n if stage else 1)), stage
        assert "mixed precision: compute copies in bfloat16" in p.explain()
        assert p == shardlib.plan(model, AbstractMesh({"dp": n}), zero_stage=stage, param_dtype=torch.bfloat16, chunk_size=1 << 20)
    p1 = shardlib.plan(model, AbstractMesh({"dp": n}), zero_stage=1, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert p1.grad_bytes == 4 * psi // n  # reduced aside in bf16, only the fp32 shard kept


def _pipeline(batch, steps, seed, stage, reduce_dtype):
    import torch.nn.functional as F

    mesh = shardlib.init_mesh({"pp": 2, "dp": 2})
    torch.manual_seed(seed)
    smodel = shardlib.shard(gpt_for_tests(CONFIG), mesh, zero_stage=stage, param_dtype=torch.bfloat16,
                            reduce_dtype=reduce_dtype, microbatches=2)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, **OPT)
    idx, tgt = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in batch)
    records = []
    for _ in range(steps):
        losses, _ = smodel.forward_backward(idx, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()), (tgt,))
        total = torch.tensor([0.0 if losses is None else sum(x.item() for x in losses) / len(losses)], dtype=torch.float64)
        shardlib.mesh.collectives.raw_all_reduce(total, mesh, ("pp", "dp"), op="sum")  # last stage's 2 dp ranks
        grads = shardlib.full_grads(smodel)
        opt.step()
        records.append({"loss": total.item() / 2, "grads": grads, "params": shardlib.full_state_dict(smodel)})
        opt.zero_grad()
    return records


@pytest.mark.parametrize("stage,reduce_dtype", [(3, torch.bfloat16)], ids=["zero3-reduce-bf16"])
def test_bf16_pipeline_with_tied_embeddings_equals_single_process(stage, reduce_dtype):
    """pp2 x dp2 (1F1B, 2 microbatches; wte on the first stage tied to lm_head on the last, their
    gradients summed over pp in reduce_dtype): the bf16 tolerances above hold."""
    seed = 3
    batch = _batch(8, seed)
    results = run_on(4, _pipeline, batch, STEPS, seed, stage, reduce_dtype)
    _compare(results[0], _reference(batch, STEPS, seed, torch.bfloat16), BF16_U)


class _HalfAndFull(torch.nn.Module):
    """A bf16 layer next to an fp32 one: under ``param_dtype=bfloat16`` the first chunk needs no
    compute copy and the second does."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6).to(torch.bfloat16)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).float().square().mean()


def _half_and_full(stage):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(_HalfAndFull(), mesh, zero_stage=stage, param_dtype=torch.bfloat16)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(mesh.rank))
    grads = []
    for _ in range(2):
        smodel(x).backward()
        grads.append(shardlib.full_grads(smodel))
        opt.step()
        opt.zero_grad()
    return grads, [c.mixed for c in smodel._zero.chunks]


def test_stage0_with_a_mixed_and_a_plain_chunk():
    """Regression: stage 0 looked up a gradient view for every parameter of a chunk around its
    reduction, and a compute-copy chunk has none (KeyError). Gradients of two steps agree with
    stage 3, which handles both chunks alike."""
    (g0, mixed), _ = run_on(2, _half_and_full, 0)
    (g3, _), _ = run_on(2, _half_and_full, 3)
    assert mixed == [False, True]
    for s0, s3 in zip(g0, g3):
        for name in s0:
            torch.testing.assert_close(s0[name].float(), s3[name].float(), rtol=2e-2, atol=1e-3)
            assert s0[name].abs().sum() > 0, name


def test_grad_scaler_hands_the_mesh_device_to_its_all_reduce_on_a_rank_without_gradients(monkeypatch):
    """Regression (NCCL only): on a rank holding no gradient (every parameter of its pipeline
    stage frozen) unscale_ all-reduced ``torch.zeros(1)``, a CPU tensor, which NCCL rejects.
    A mesh on ``meta`` stands in for cuda:0; the all-reduce records the device it was given."""
    import types

    import shardlib.grad_scaler as gs

    seen = []

    class Stop(Exception):
        pass

    def all_reduce(t, mesh, axes, op):
        seen.append(t.device)
        raise Stop  # a meta tensor has no value for .item()

    monkeypatch.setattr(gs, "raw_all_reduce", all_reduce)
    mesh = types.SimpleNamespace(device=torch.device("meta"), axis_names=("pp", "dp"), size=lambda: 4)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    for params in ([], list(frozen.parameters())):  # no parameter; parameters without gradients
        opt = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        opt.smodel = types.SimpleNamespace(mesh=mesh)
        with pytest.raises(Stop):
            gs.GradScaler().unscale_(opt)
    assert seen == [torch.device("meta")] * 2, seen
