"""Zero-bubble pipelines at runtime: ZB-H1, ZB-V and DualPipeV equal one process.

Each schedule splits backwards into I (the input gradient, sent upstream at once) and W (the
parameter gradients, deferred), through autograd on ordinary modules
(:mod:`shardlib.parallel.split_backward`). Losses, gradients and parameters after 3 AdamW steps
equal one process (the equivalence harness's tolerance model, :func:`test_pipeline._check`)
with the GPT's tied embedding and LM head (on one rank in the V, on two ranks otherwise), under
ZeRO-3, tensor parallelism with sequence parallelism, both transfer paths, and a
gradient-accumulation step inside ``no_sync()``.
"""

import pytest
import torch

import shardlib
from shardlib.models import GPT, gpt_preset
from shardlib.parallel.split_backward import backward_input
from shardlib.testing import run_on
from shardlib.testing.models import FrozenConstant
from test_pipeline import _batches, _check, _config, ce

pytestmark = pytest.mark.multiprocess

SCHEDULES = [("zb_h1", 4), ("zbv", 2), ("dualpipev", 4)]  # (schedule, microbatches): DualPipeV needs m >= 2p


@pytest.mark.parametrize("schedule,m", SCHEDULES)
def test_zero_bubble_schedule_equals_single_process(schedule, m):
    """pp=2, 4 blocks: the tied embedding and LM head (two ranks for zb_h1, both on rank 0 in the
    V), every action of the schedule run once, I and W apart."""
    results = _check({"pp": 2}, 4, {"schedule": schedule, "microbatches": m})
    v = 1 if schedule == "zb_h1" else 2  # chunks per rank
    for r in results:
        kinds = [a[len(a.rstrip("0123456789")) - 1] for a, _, _ in r["timeline"]]
        assert kinds.count("F") == v * m
        assert kinds.count("I") + kinds.count("B") == v * m and kinds.count("W") == kinds.count("I") > 0
    from shardlib.parallel.timeline import COLORS, timeline_svg

    svg = timeline_svg([r["timeline"] for r in results])  # I and W drawn apart, with a legend
    assert f'fill="{COLORS["I"]}"' in svg and f'fill="{COLORS["W"]}"' in svg and "W weight gradient" in svg
    assert svg.count("<rect") == sum(len(r["timeline"]) for r in results)


@pytest.mark.parametrize("schedule,m,native", [(name, m, False) for name, m in SCHEDULES] + [("zbv", 2, True)])
def test_zero_bubble_with_zero3_and_clipping(schedule, m, native):
    """pp2 x dp2 at ZeRO-3: chunks gathered for I and again for W (one backward for ZeRO:
    ZeroRuntime.one_backward), reduced once after the step's last W, each model chunk's own ZeRO
    chunks only (the counted all-gathers equal the stage plan's, checked in _check); the clipped global norm;
    the NCCL-style transfers (tag 0, one work per batch) forced on gloo too (ZB-V: the V's
    boundaries, one of them in memory; zb_h1 and dualpipev take it in the no_sync test)."""
    _check({"pp": 2, "dp": 2}, 4, {"schedule": schedule, "microbatches": m, "zero_stage": 3, "native": native},
           clip=0.05)


@pytest.mark.parametrize("schedule,m", SCHEDULES)
def test_zero_bubble_with_tensor_and_sequence_parallel(schedule, m):
    """pp2 x tp2 with Megatron layers, sequence parallelism and the vocabulary-parallel tied
    embedding: the tensor axis's collectives of backward run in I on the input path and in W
    where a parameter needs them (the first stage's embedding), alike on both tensor ranks."""
    _check({"pp": 2, "tp": 2}, 4, {"schedule": schedule, "microbatches": m, "zero_stage": 1,
                                   "specs": gpt_preset().specs, "sequence_parallel": True}, clip=0.05)


def test_zbv_on_eight_ranks_with_data_tensor_and_zero3():
    """pp2 x dp2 x tp2 (8 ranks), ZB-V at ZeRO-3, and ZB-V on pp=4 (8 stages in the V; ZB-H1 on
    pp=4 is in the hypothesis sweep of test_pipeline)."""
    _check({"pp": 2, "dp": 2, "tp": 2}, 4, {"schedule": "zbv", "microbatches": 2, "zero_stage": 3,
                                           "specs": gpt_preset().specs}, clip=0.05)
    _check({"pp": 4}, 6, {"schedule": "zbv", "microbatches": 8, "native": True})


def _reductions(mesh):
    """Gradient reductions so far: over dp (reduce-scatter or all-reduce), and the tied sums over pp."""
    return (mesh.comm.calls("dp", "reduce_scatter") + mesh.comm.calls("dp", "all_reduce"), mesh.comm.calls("pp", "all_reduce"))


def _accumulate(schedule, m, zero_stage, native):
    if native:
        from test_pipeline_p2p import nccl_like_p2p

        mesh = shardlib.init_mesh({"pp": 2, "dp": 2})
        with nccl_like_p2p(mesh):
            return _accumulate_on(mesh, schedule, m, zero_stage)
    return _accumulate_on(shardlib.init_mesh({"pp": 2, "dp": 2}), schedule, m, zero_stage)


def _accumulate_on(mesh, schedule, m, zero_stage):
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config(4)), mesh, schedule=schedule, microbatches=m, zero_stage=zero_stage,
                            chunk_size=400)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    a, b = _batches(8)[:2]
    xa = shardlib.distribute(a, mesh, smodel.batch_spec)
    evaluated, _ = smodel.evaluate(xa[:, :-1], criterion=ce, labels=(xa[:, 1:],))  # forwards only, on the last stage's rank
    calls = []
    for i, x in enumerate((a, b)):
        xl = shardlib.distribute(x, mesh, smodel.batch_spec)
        before = _reductions(mesh)
        if i == 0:
            with smodel.no_sync():
                smodel.forward_backward(xl[:, :-1], criterion=ce, labels=(xl[:, 1:],))
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.step()  # nothing reduced yet
        else:
            smodel.forward_backward(xl[:, :-1], criterion=ce, labels=(xl[:, 1:],))
        calls.append(tuple(n - b for n, b in zip(_reductions(mesh), before)))
    grads = shardlib.full_grads(smodel)
    opt.step()
    return {"grads": grads, "calls": calls, "params": shardlib.full_state_dict(smodel),
            "evaluated": None if evaluated is None else torch.stack(evaluated).mean().item()}


@pytest.mark.parametrize("schedule,m,zero_stage,native", [("zbv", 2, 3, False), ("zb_h1", 2, 2, True),
                                                          ("1f1b", 2, 0, False), ("dualpipev", 4, 1, True)])
def test_forward_backward_inside_no_sync_accumulates_without_reducing(schedule, m, zero_stage, native):
    """Two steps of two batches, the first inside ``no_sync()``: the first reduces nothing over
    dp (and sums no tied gradient over pp), the optimizer refuses to step on it alone, and the
    gradients after the second are one process's on both batches (the sum of their mean losses).
    Before them, ``evaluate`` (forwards only) gives one process's loss."""
    results = run_on(4, _accumulate, schedule, m, zero_stage, native)
    torch.manual_seed(0)
    ref = GPT(_config(4))
    a, b = _batches(8)[:2]
    loss_a = ref(a[:, :-1], a[:, 1:])[1]
    (loss_a + ref(b[:, :-1], b[:, 1:])[1]).backward()
    evaluated = [r["evaluated"] for r in results if r["evaluated"] is not None]
    assert len(evaluated) == 2  # one per data rank: the rank of the last stage (rank 0 in a V)
    # the mean of the data ranks' microbatch means against one 8-row forward: fp32, measured <= 2.4e-7
    assert sum(evaluated) / 2 == pytest.approx(loss_a.item(), abs=1e-6)
    for r in results:
        (dp_first, pp_first), (dp_second, pp_second) = r["calls"]
        assert dp_first == 0 and dp_second > 0 and pp_first == 0, r["calls"]
        assert pp_second == (0 if schedule in ("zbv", "dualpipev") else 1)  # tied embedding and head: one rank in a V
        for name, p in ref.named_parameters():
            # fp32 sums of two microbatch orders: measured <= 6e-8 absolute; 1e-6 with rtol 1e-5
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


def test_split_backward_equals_backward_on_awkward_graphs():
    """One process, no pipeline: I then W gives the gradients of one backward on graphs that
    exercise each branch: a weight used twice along the input path (intermediates on one path,
    held at their kept gradients), around another layer (whose nodes that path runs through: the
    graph is kept for its own W) and three times in a loop, a gradient hook on an activation
    (applied once in effect), a parameter reached only from the output (its W from the output),
    an input that needs no gradient (W is the whole backward), a stage returning its input (the
    gradient passes through) or a parameter, and a reentrant checkpoint (the whole backward in
    I). The first five crashed or were wrong before (a new-user break session)."""
    from torch.utils.checkpoint import checkpoint

    class _Zero:  # what WeightPass needs of a ZeroRuntime
        def one_backward(self):
            import contextlib

            return contextlib.nullcontext()

    torch.manual_seed(0)
    lin, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    bias = torch.nn.Parameter(torch.randn(4))
    params = [*lin.parameters(), *other.parameters(), bias]

    def hooked(t):  # a gradient-scaling hook on an activation (applied once, as in one backward)
        h = lin(t)
        h.register_hook(lambda g: 0.5 * g)
        return other(torch.tanh(h))

    def looped(t):  # a residual block applied three times
        for _ in range(3):
            t = t + torch.tanh(lin(t))
        return t

    def graphs(x):
        yield "twice", lin(torch.tanh(lin(x)))
        yield "around another layer", lin(torch.tanh(other(torch.tanh(lin(x)))))  # ALBERT-style sharing
        yield "looped", looped(x)
        yield "hook", hooked(x)
        yield "output-only", other(x) + bias * 3
        yield "no input grad", other(lin(x.detach()))
        yield "identity", x
        yield "a parameter", bias
        yield "reentrant", checkpoint(lambda t: other(torch.relu(lin(t))), x, use_reentrant=True)

    x0 = torch.randn(3, 4)
    for name, _ in graphs(x0.clone().requires_grad_()):
        grads = {}
        for split in (False, True):
            for p in params:
                p.grad = None
            x = x0.clone().requires_grad_()
            out = dict(graphs(x))[name]
            g = torch.randn_like(out, generator=torch.Generator().manual_seed(3))
            if split:
                dx, weight = backward_input(out, g, x)
                weight.run(_Zero())
            else:
                out.backward(g)
                dx = x.grad
            dx = torch.zeros_like(x) if dx is None else dx
            grads[split] = ([None if p.grad is None else p.grad.clone() for p in params], dx)
        for a, b in zip(*[grads[s][0] for s in (False, True)]):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(grads[True][1], grads[False][1], rtol=0, atol=1e-6, msg=name)


def test_v_plans_put_the_first_and_last_stage_on_rank_0():
    """ZB-V / DualPipeV default to two chunks per rank in a V: rank r holds stages r and
    2p - 1 - r, so the tied embedding and LM head live on one rank (no pp sum), and the boundary
    at the V's bottom moves no bytes; the plan prints the placement and the papers' bubble."""
    from shardlib.mesh import AbstractMesh
    from shardlib.parallel.schedule_theory import schedule_bubble_fraction

    pplan = shardlib.plan(GPT(_config(6)), AbstractMesh({"pp": 2, "dp": 2}), schedule="zbv", microbatches=4)
    assert (pplan.v, pplan.placement, pplan.rank_stages(0), pplan.rank_stages(1)) == (2, "v", [0, 3], [1, 2])
    assert [pplan.stage_rank(s) for s in range(4)] == [0, 1, 1, 0]
    assert pplan.stage_layers[0][0] == "embed" and pplan.stage_layers[3][-1] == "head"
    assert pplan.tied == ()  # wte.weight and lm_head.weight: both on rank 0
    assert pplan.transfers_per_step(0) == pplan.transfers_per_step(1) == 2 * 4  # 0 -> 1 and 2 -> 3, each way
    assert pplan.bubble == schedule_bubble_fraction("zbv", 2, 4, 2) == pytest.approx(1 / 25)
    text = pplan.explain()
    assert "stage 3 on rank 0: blocks.5, head" in text and "bubble of ZB-V at F=B=W = 0.040" in text
    assert "3I0" in text and "3W0" in text  # the grid
    loop = shardlib.plan(GPT(_config(6)), AbstractMesh({"pp": 2, "dp": 2}), schedule="zb_h1", microbatches=4)
    assert loop.tied and loop.placement == "loop" and loop.bubble == pytest.approx(1 / 13)  # (p-1)/(3m+p-1)


def test_zero_bubble_plan_refusals():
    from shardlib.errors import ShardingError
    from shardlib.mesh import AbstractMesh

    mesh = AbstractMesh({"pp": 2})
    with pytest.raises(ShardingError, match="exactly two model chunks per rank.*got virtual_stages=3"):
        shardlib.plan(GPT(_config(6)), mesh, schedule="zbv", microbatches=4, virtual_stages=3)
    with pytest.raises(ShardingError, match="zb_h1 runs one model chunk per rank"):
        shardlib.plan(GPT(_config(6)), mesh, schedule="zb_h1", microbatches=4, virtual_stages=2)
    with pytest.raises(ShardingError, match="dualpipev needs at least as many microbatches as stages: 2"):
        shardlib.plan(GPT(_config(6)), mesh, schedule="dualpipev", microbatches=2)
    with pytest.raises(ShardingError, match=r"activation_checkpointing='selective' \(6 modules.*schedule='zb_h1'.*"
                                            r"Fix: activation_checkpointing='full'"):
        shardlib.plan(GPT(_config(6)), mesh, schedule="zb_h1", microbatches=4, activation_checkpointing="selective")
    shardlib.plan(GPT(_config(6)), mesh, schedule="1f1b", microbatches=4, activation_checkpointing="selective")


def _sequential(kind):
    from torch import nn

    torch.manual_seed(0)
    if kind == "identity":  # a stage of a no-op alone
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Identity(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    if kind == "repeated":  # a Linear and a Tanh each at two positions (tied across stages)
        lin, act = nn.Linear(8, 8), nn.Tanh()
        return nn.Sequential(lin, act, nn.Linear(8, 8), act, lin, nn.Tanh(), nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), FrozenConstant(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8))


def _sequential_worker(kind, shape, options):
    mesh = shardlib.init_mesh(shape)
    smodel = shardlib.shard(_sequential(kind), mesh, **options)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    losses, _ = smodel.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
    return None if losses is None else torch.stack(losses).mean().item(), shardlib.full_grads(smodel)


@pytest.mark.parametrize("kind,shape,options", [
    ("identity", {"pp": 2}, {"schedule": "zbv", "split_points": ["2", "3", "5"]}),
    ("identity", {"pp": 2}, {"schedule": "dualpipev", "split_points": ["2", "3", "5"]}),
    ("repeated", {"pp": 2}, {"schedule": "zb_h1"}),
    ("repeated", {"pp": 2}, {"schedule": "zbv"}),
    ("constant", {"pp": 3}, {"schedule": "1f1b", "split_points": ["3", "4"]}),
    ("constant", {"pp": 2}, {"schedule": "dualpipev", "split_points": ["2", "3", "4"]}),
], ids=lambda v: str(v).replace(" ", ""))
def test_sequential_stages_that_broke(kind, shape, options):
    """Found by a new-user break session, each equal to one process now: a stage that returns its
    input (the split schedules sent zero gradients upstream: the whole gradient of the layers
    before it lost); an nn.Sequential using one module at two positions (named_children() lists
    it once: the second use was silently dropped from the pipeline, on every schedule); a stage
    whose output needs no gradient (a full backward raised 'element 0 of tensors does not require
    grad')."""
    world = shape["pp"]
    results = run_on(world, _sequential_worker, kind, shape, {"microbatches": 4, **options})
    ref = _sequential(kind)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    loss = torch.nn.functional.mse_loss(ref(x), y)
    loss.backward()
    (got,) = [r[0] for r in results if r[0] is not None]
    # fp32, the mean of 4 microbatch means against one 8-row mean: measured <= 6e-8
    assert got == pytest.approx(loss.item(), abs=1e-6)
    for loss_rank, grads in results:
        for name, p in ref.named_parameters():
            if p.requires_grad:  # (before the constant layer nothing gets a gradient: None there, zeros here)
                want = torch.zeros_like(p) if p.grad is None else p.grad
                torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=name)
