"""Tensor/sequence-parallel communication: counted bytes equal the plan and Megatron's theory."""

import pytest
import torch

import shardlib
from shardlib.models import GPTConfig, tp_specs
from shardlib.parallel.tensor_cost import tensor_parallel_collectives
from shardlib.testing import run_on
from shardlib.testing.models import gpt_for_tests

pytestmark = pytest.mark.multiprocess

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16)
SPECS = dict(tp_specs(), **{"wte.weight": shardlib.P("tp", None)})


def _one_step(shape, stage, sp, clip):
    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    smodel = shardlib.shard(gpt_for_tests(CFG), mesh, SPECS, zero_stage=stage, sequence_parallel=sp, chunk_size=500)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, max_grad_norm=1.0 if clip else None, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (4, 9), generator=g)
    xl = shardlib.distribute(x, mesh, smodel.batch_spec)
    tokens = xl[:, :-1].numel()
    mesh.comm.reset()
    smodel(xl[:, :-1], xl[:, 1:])[1].backward()
    opt.step()
    return mesh.comm.table(), smodel.plan.comm_per_step(tokens=tokens, clip=clip), smodel.plan, tokens


@pytest.mark.parametrize("shape,stage", [({"tp": 2}, 0), ({"dp": 2, "tp": 2}, 3), ({"tp": 4}, 1)])
@pytest.mark.parametrize("sp", [False, True])
def test_counted_bytes_equal_plan_and_megatron_theory(shape, stage, sp):
    world = 1
    for size in shape.values():
        world *= size
    results = run_on(world, _one_step, shape, stage, sp, True)
    for measured, predicted, plan, tokens in results:
        assert measured == predicted, (measured, predicted)
        hidden, tp = CFG.n_embd, shape["tp"]
        for i in range(CFG.n_layer):
            layer = [c for c in tensor_parallel_collectives(plan) if c.layer.startswith(f"blocks.{i}.") and c.per_token]
            kinds = sorted((c.phase, c.kind) for c in layer)
            if sp:  # Korthikanti et al.: 4 all-gathers + 4 reduce-scatters per layer
                assert kinds == sorted([("forward", "all_gather")] * 2 + [("forward", "reduce_scatter")] * 2
                                       + [("backward", "all_gather")] * 2 + [("backward", "reduce_scatter")] * 2)
            else:  # Megatron: 2 all-reduces forward, 2 backward
                assert kinds == sorted([("forward", "all_reduce")] * 2 + [("backward", "all_reduce")] * 2)
            assert all(c.per_token == hidden for c in layer)
            volume = sum(shardlib.mesh.ring_bytes(c.kind, c.payload(tokens) * 4, tp) for c in layer)
            assert volume == 4 * shardlib.mesh.ring_bytes("all_reduce", tokens * hidden * 4, tp)  # same volume either way


def test_explain_lists_tensor_parallel_collectives():
    from shardlib.mesh import AbstractMesh

    p = shardlib.plan(gpt_for_tests(CFG), AbstractMesh({"dp": 2, "tp": 2}), SPECS, sequence_parallel=True)
    text = p.explain(tokens=64)
    assert "tensor-parallel layers (sequence parallel)" in text
    assert "blocks.0.attn.o_proj" in text and "fwd reduce_scatter 16/token" in text
    assert "64 tokens per micro-batch" in text and "tp     reduce_scatter" in text


@pytest.mark.parametrize("stage", [0, 2])
def test_clipping_counts_each_element_once_on_dp_x_tp(stage):
    """Global-norm clipping on {dp: 2, tp: 2}: tensor-parallel shards summed over tp, replicated
    parameters counted once, data shards once; the norm and the clipped run equal one process."""
    import functools

    from shardlib.testing import assert_equivalent

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 37, (4, 9), generator=g)
    report = assert_equivalent(functools.partial(gpt_for_tests, CFG), {"dp": 2, "tp": 2}, SPECS, (x[:, :-1], x[:, 1:]),
                               steps=2, zero_stage=stage, max_grad_norm=0.05, chunk_size=500,
                               optimizer_kwargs={"lr": 1e-3})
    assert all(r["norm"] > 0.05 for r in report["records"])


def _summed_step(accum):
    """One step of ``accum`` micro-batches (all but the last under no_sync) under sequence
    parallelism on {dp: 2, tp: 2}, chunk_size 200 (the replicated parameters span two chunks):
    counted and predicted communication, the planned buckets, and the step's tp collectives."""
    import contextlib

    from shardlib.parallel.tensor_grads import grad_sum_buckets

    mesh = shardlib.init_mesh({"dp": 2, "tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(gpt_for_tests(CFG), mesh, SPECS, zero_stage=1, sequence_parallel=True, chunk_size=200)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    x = shardlib.distribute(torch.randint(0, 37, (4 * accum, 9), generator=torch.Generator().manual_seed(0)), mesh,
                            smodel.batch_spec)
    rows = x.shape[0] // accum
    mesh.comm.reset()
    start = mesh.trace.records(1)[-1]["seq"]
    for i in range(accum):
        with smodel.no_sync() if i < accum - 1 else contextlib.nullcontext():
            smodel(x[i * rows:(i + 1) * rows, :-1], x[i * rows:(i + 1) * rows, 1:])[1].backward()
    opt.step()
    tp_records = [(r["kind"], r["note"]) for r in mesh.trace.records() if r["seq"] > start and r["group"].startswith("tp")]
    return (mesh.comm.table(), smodel.plan.comm_per_step(micro_steps=accum, tokens=rows * 8), grad_sum_buckets(smodel.plan),
            smodel.plan.sp_grad_params, tp_records)


def test_norm_gradient_sums_are_one_all_reduce_per_bucket_per_step():
    """Issue 15 (5c): the 14 replicated parameters on sequence shards (LayerNorm weights and
    biases, row-layer biases, ln_f) get their tensor-axis gradient sums from 2 buckets (one per
    ZeRO chunk holding them), all-reduced once per step even with 2 micro-batches: 2 all-reduces,
    not 14 per backward (28, as at 8ed393d). The rest of the tp all-reduces is the vocabulary-
    parallel embedding's forward, one per micro-batch. The first bucket goes out while the last
    backward still runs (tp collectives of that backward follow it), and the counted bytes equal
    the plan's. Values: test_sum_in_buckets_trains_like_one_process."""
    accum = 2
    for measured, predicted, buckets, summed, records in run_on(4, _summed_step, accum):
        assert len(summed) == 14 and sorted(n for _, names, _ in buckets for n in names) == sorted(summed)
        # chunk_size 200, chunks following the blocks (shardlib.chunking): each block's 6 replicated
        # parameters (ln_1, ln_2 weight and bias, o_proj and fc_out biases: 6 x 16) in a chunk of their
        # own (2 and 11), ln_f's 2 joining block 1's (128 elements); reduced in descending chunk order
        assert [(chunk, len(names), numel) for chunk, names, numel in buckets] == [(11, 8, 128), (2, 6, 96)]
        assert measured[("tp", "all_reduce")][0] == accum + len(buckets)
        assert measured == predicted, (measured, predicted)
        sums = [i for i, (kind, note) in enumerate(records) if "gradient sums" in note]
        assert len(sums) == len(buckets) and all(records[i][0] == "all_reduce" for i in sums)
        assert any("gradient sums" not in note for _, note in records[sums[0] + 1:])  # launched inside the backward


@pytest.mark.parametrize("stage", [0, 3])
def test_sum_in_buckets_trains_like_one_process(stage):
    """Bucketed sums under sequence parallelism equal one process for 2 AdamW steps of 2
    micro-batches each (no_sync accumulation into the buckets), with 2 buckets (chunk_size 200):
    stage 0 (the summed parameters leave the gradient views of their chunk) and stage 3."""
    import functools

    from shardlib.testing import assert_equivalent

    x = torch.randint(0, 37, (8, 9), generator=torch.Generator().manual_seed(3))
    assert_equivalent(functools.partial(gpt_for_tests, CFG), {"dp": 2, "tp": 2}, SPECS, (x[:, :-1], x[:, 1:]), steps=2,
                      zero_stage=stage, sequence_parallel=True, accum_steps=2, chunk_size=200,
                      optimizer_kwargs={"lr": 1e-3})


def _float64_clip_step():
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    smodel = shardlib.shard(model, mesh, zero_stage=2)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1, max_grad_norm=1e-3)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mesh.comm.reset()
    smodel(shardlib.distribute(x, mesh, smodel.batch_spec)).pow(2).mean().backward()
    opt.step()
    return mesh.comm.table(), smodel.plan.comm_per_step(clip=True), opt.last_grad_norm


def test_float64_gradients_clip_with_a_float64_norm_as_counted():
    """The norm statistic went out in torch's default dtype, and it was computed from float32
    copies of the gradients: float64 gradients were clipped by a float32-precision norm, and
    the plan counted 4 bytes where 8 went out (found by a new-user test). The statistic is now
    float32, or float64 for float64 gradients: counted bytes equal the plan, and the norm equals
    torch's clip_grad_norm_ on one process to float64 rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    for measured, predicted, norm in run_on(2, _float64_clip_step):
        assert measured == predicted and predicted[("dp", "all_reduce")] == (1, 8.0), (measured, predicted)
        assert norm.dtype == torch.float64
        # float64 sums in another order (two shards): measured 0 or a few ulps; float32 would be ~1e-8 off
        assert abs(norm.item() - expected.item()) <= 1e-13 * expected.item(), (norm.item(), expected.item())
