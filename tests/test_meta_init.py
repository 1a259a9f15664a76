"""Lazy (meta-device) init: shard() materializes only local shards, equal to the one-device init."""

import re

import pytest
import torch
from torch import nn

import shardlib
from shardlib.lazy import global_flat_index, init_parameters
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig, tp_specs
from shardlib.testing import run_on

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _batch(seed, rows=4, seq=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (rows, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(smodel, mesh, steps=2):
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        idx, tgt = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in _batch(step))
        loss = smodel(idx, tgt)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_worker(mesh_shape, stage, tp, sp=False):
    mesh = shardlib.init_mesh(mesh_shape)
    specs = tp_specs() if tp else None
    with torch.device("meta"):
        meta = GPT(CFG)
    opts = {"zero_stage": stage, "chunk_size": 3000, **({"sequence_parallel": True, "sp_exit": "ln_f"} if sp else {})}
    smodel = shardlib.shard(meta, mesh, specs, init_seed=5, **opts)
    assert not any(p.device.type == "meta" for p in smodel.parameters())
    init_full = shardlib.full_state_dict(smodel)
    ref = init_parameters(GPT(CFG), seed=5).state_dict()
    mismatched = [k for k, v in ref.items() if not torch.equal(init_full[k], v)]
    # the same run from the materialized init: losses and parameters bitwise equal
    twin = shardlib.shard(init_parameters(GPT(CFG), seed=5), mesh, specs, **opts)
    losses, twin_losses = _train(smodel, mesh), _train(twin, mesh)
    after, twin_after = shardlib.full_state_dict(smodel), shardlib.full_state_dict(twin)
    trained_equal = all(torch.equal(after[k], twin_after[k]) for k in after)
    stored = sum(c.shard.numel() for c in smodel._zero.chunks)
    return mismatched, losses, twin_losses, trained_equal, stored, smodel.plan.param_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_init_on_dp2_equals_single_device_init(stage):
    """Every ZeRO stage on dp=2: full tensors bitwise equal to init_parameters on one device,
    and two AdamW steps equal (bitwise) to the run sharded from the materialized init."""
    for mismatched, losses, twin_losses, trained_equal, stored, plan_bytes in run_on(2, _meta_worker, {"dp": 2}, stage, False):
        assert mismatched == []
        assert losses == twin_losses and trained_equal
        assert stored * 4 == (plan_bytes if stage == 3 else stored * 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage,sp", [(0, False), (3, True)])
def test_meta_init_on_dp2_tp2_equals_single_device_init(stage, sp):
    """dp=2 x tp=2 (Megatron column/row blocks, tied embedding; with sequence parallelism, whose
    norm-weight gradient hooks must survive materialization): each rank fills only its
    tensor-parallel block (and, at stage 3, its ZeRO slice); the gathered tensors equal the
    one-device init and training matches the materialized run bitwise."""
    results = run_on(4, _meta_worker, {"dp": 2, "tp": 2}, stage, True, sp)
    for mismatched, losses, twin_losses, trained_equal, _, _ in results:
        assert mismatched == []
        assert losses == twin_losses and trained_equal


def _mixed_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    with torch.device("meta"):
        meta = GPT(CFG)
    runs = []
    for model in (meta, init_parameters(GPT(CFG), seed=5)):
        smodel = shardlib.shard(model, mesh, zero_stage=3, init_seed=5, param_dtype=torch.bfloat16)
        runs.append((_train(smodel, mesh), shardlib.full_state_dict(smodel)))
    (losses, after), (twin_losses, twin_after) = runs
    return losses == twin_losses and all(torch.equal(after[k], twin_after[k]) for k in after)


@pytest.mark.multiprocess
def test_meta_init_with_bf16_compute_copies():
    """ZeRO-3 with param_dtype=bfloat16: fp32 master shards filled from meta, compute copies
    made from them; training equals the materialized run bitwise."""
    assert all(run_on(2, _mixed_worker))


def _ce(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pipeline_meta_worker():
    mesh = shardlib.init_mesh({"pp": 2, "dp": 2})
    with torch.device("meta"):
        meta = GPT(CFG)
    runs = []
    for model in (meta, init_parameters(GPT(CFG), seed=5)):
        smodel = shardlib.shard(model, mesh, microbatches=2, zero_stage=3, init_seed=5)
        init = shardlib.full_state_dict(smodel)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
        losses = []
        for step in range(2):
            idx, tgt = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in _batch(step))
            out, _ = smodel.forward_backward(idx, criterion=_ce, labels=(tgt,))
            opt.step()
            opt.zero_grad()
            losses.append(None if out is None else [x.item() for x in out])
        runs.append((init, losses, shardlib.full_state_dict(smodel)))
    ref = init_parameters(GPT(CFG), seed=5).state_dict()
    (init, losses, after), (_, twin_losses, twin_after) = runs
    return ([k for k in ref if not torch.equal(init[k], ref[k])], losses == twin_losses,
            all(torch.equal(after[k], twin_after[k]) for k in after))


@pytest.mark.multiprocess
def test_meta_init_on_pipeline_with_tied_embedding():
    """pp=2 x dp=2, ZeRO-3 stages: each stage materializes its layers; the LM head on the last
    stage (tied to wte on the first, known there by its other name) draws from wte's stream, so
    the full tensors equal the one-device init; training matches the materialized run bitwise."""
    for mismatched, losses_equal, params_equal in run_on(4, _pipeline_meta_worker):
        assert mismatched == [] and losses_equal and params_equal


def test_global_flat_index_matches_tensor_parallel_slicing():
    """The index map used to fill a tensor-parallel block equals slicing the global index
    tensor as load_full_state_dict does (fused blocks and uneven splits included)."""
    from shardlib.plan import ParamPlan
    from shardlib.plan_items import fused_blocks
    from shardlib.spec import P, shard_range

    for shape, dim, fused, n in [((6, 5), 0, 1, 2), ((6, 5), 1, 1, 3), ((12, 4), 0, 3, 2), ((3, 7, 2), 1, 1, 4)]:
        pp = ParamPlan("w", (), shape, torch.float32, P(), "", "column", True, tp_axis="tp", tp_dim=dim,
                       tp_blocks=fused_blocks(shape[dim], fused))
        whole = torch.arange(int(torch.Size(shape).numel())).view(shape)
        for r in range(n):
            block = shape[dim] // fused
            lo, hi = shard_range(block, n, r)
            local = torch.cat([whole.narrow(dim, b * block + lo, hi - lo) for b in range(fused)], dim=dim).reshape(-1)
            got = global_flat_index(pp, {"tp": n}, {"tp": r}, 0, local.numel())
            assert torch.equal(got, local), (shape, dim, fused, n, r)
            if local.numel() > 2:  # a sub-range (a ZeRO slice of the block)
                assert torch.equal(global_flat_index(pp, {"tp": n}, {"tp": r}, 1, local.numel() - 1), local[1:-1])


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    def shardlib_init_buffers(self):
        self.mask.copy_(torch.tril(torch.ones(3, 3)))

    def forward(self, x):
        return self.lin(x) @ self.mask


def _buffer_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    with torch.device("meta"):
        model = _WithBuffer()
    rules = {"*.weight": ("uniform", -0.5, 0.5), "*.bias": ("constant", 0.25)}
    smodel = shardlib.shard(model, mesh, zero_stage=3, init_rules=rules)
    ref = init_parameters(_WithBuffer(), rules=rules)
    full = shardlib.full_state_dict(smodel)
    lazy_line = "lazy init: 2 parameters materialized from the meta device, only local shards, seed 0" in smodel.plan.explain()
    return all(torch.equal(full[k], v) for k, v in ref.state_dict().items()) and lazy_line, smodel(torch.ones(2, 4)).shape


@pytest.mark.multiprocess
def test_meta_buffers_are_rebuilt_by_their_module():
    """A meta buffer is allocated and filled by the module's shardlib_init_buffers(); uniform and
    constant rules given as the init_rules option; explain() says what was materialized."""
    for equal, shape in run_on(2, _buffer_worker):
        assert equal and shape == (2, 3)


def test_meta_model_without_rule_names_the_parameter():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(shardlib.ShardingError, match=r"parameter 1\.weight of shape \(4,\) is on the meta device.*no init rule"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, init_rules={"0.*": ("normal", 0.1), "*.bias": ("zeros",)})
    with pytest.raises(shardlib.ShardingError, match=r"init rule \('gaussian', 1\.0\) for parameter 0\.weight"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), init_rules={"*": ("gaussian", 1.0)})
    with pytest.raises(shardlib.ShardingError, match=r"'uniform' takes 2-2 numbers"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), init_rules=lambda name, p: ("uniform", 1.0))
    model[1] = nn.LayerNorm(4)  # on CPU
    with pytest.raises(shardlib.ShardingError, match=r"some parameters are on the meta device and some are not \(e\.g\. 1\.weight on cpu\)"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), init_rules={"*": ("zeros",)})
    with torch.device("meta"):
        buffered = nn.Sequential(nn.Linear(3, 3), nn.Module())
        buffered[1].register_buffer("mask", torch.ones(3, 3))  # a module with no shardlib_init_buffers()
    with pytest.raises(shardlib.ShardingError, match=r"buffer 1\.mask of shape \(3, 3\) is on the meta device.*Module"):
        init_parameters(buffered, rules={"*": ("zeros",)})


def test_gpt_rules_follow_the_gpt2_distributions():
    """The reference GPT's rules: N(0, 0.02) weights, residual projections N(0, 0.02/sqrt(2L)),
    norms one, biases zero; a rule for every parameter."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64)
    model = init_parameters(GPT(cfg), seed=1)
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].attn.o_proj.weight.std().item() - 0.01) < 0.001
    assert torch.equal(model.ln_f.weight, torch.ones(64)) and torch.equal(model.blocks[1].mlp.fc_in.bias, torch.zeros(256))
    assert model.lm_head.weight is model.wte.weight
    other = init_parameters(GPT(cfg), seed=2)
    assert not torch.equal(model.wte.weight, other.wte.weight)


# -- a model too large to materialize whole on a rank, whose shards fit ------------------------
BIG = GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=8, n_embd=1024)


def _peak_rss() -> int:
    """This process's peak resident set size since the last reset, bytes (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs), so a pooled worker,
    whose lifetime peak is historic, measures the peak of what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _big_worker():
    import gc
    import time

    mesh = shardlib.init_mesh({"dp": 4})
    with torch.device("meta"):
        model = GPT(BIG)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    if not _reset_peak_rss():
        return None
    before = _peak_rss()
    t0 = time.perf_counter()
    smodel = shardlib.shard(model, mesh, zero_stage=3)
    elapsed = time.perf_counter() - t0
    after = _peak_rss()
    # spot check: the first elements of this rank's slice of chunk 0 equal the global-index init
    chunk = smodel._zero.chunks[0]
    lo = chunk.slot.start
    name, off = next((n, o) for n, o in zip(reversed(chunk.plan.params), reversed(chunk.plan.offsets)) if o <= lo)
    n = min(1000, smodel.plan.param(name).numel - (lo - off))
    from shardlib.lazy import stream_of
    from shardlib.random import counter_values

    rule = dict(smodel.plan.init_rules)[name]
    want = counter_values(rule[0], rule[1:], 0, stream_of(name), torch.arange(lo - off, lo - off + n))
    print(f"rank {mesh.rank}: shard() {elapsed:.1f} s, peak RSS +{(after - before) / 1e6:.0f} MB, params {smodel.plan.param_bytes / 1e6:.0f} MB + grads {smodel.plan.grad_bytes / 1e6:.0f} MB of a {full_bytes / 1e6:.0f} MB model")
    return full_bytes, smodel.plan.param_bytes, smodel.plan.grad_bytes, after - before, torch.equal(chunk.shard[:n], want)


@pytest.mark.multiprocess
def test_model_too_large_to_materialize_whole_fits_as_shards():
    """~300 MB of fp32 parameters on meta, ZeRO-3 over 4 ranks (pooled workers, their peak RSS
    reset first) with a per-rank budget of 3/4 of the model: the plan puts ~75 MB of
    parameters and ~75 MB of gradient shards on each rank, and each rank's peak RSS grows by more
    than its parameter shard (so the measurement sees it) and less than the budget while
    shard() materializes and initializes its shards."""
    results = run_on(4, _big_worker)
    if results[0] is None:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    for full_bytes, plan_bytes, grad_bytes, rss_growth, spot in results:
        budget = full_bytes * 3 // 4  # the whole model does not fit; its ZeRO-3 shards do
        assert full_bytes > 250e6 and plan_bytes + grad_bytes < budget
        assert plan_bytes <= full_bytes // 4 + 4 * 4 * 64  # a quarter, plus padding
        assert plan_bytes < rss_growth < budget, f"peak RSS grew {rss_growth / 1e6:.0f} MB, budget {budget / 1e6:.0f} MB"
        assert spot
