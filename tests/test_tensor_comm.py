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
