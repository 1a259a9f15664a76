"""Parameter offload (``shard(..., zero_stage=3, offload_param_frac=f)``; ColossalAI Gemini's
``offload_param_frac``, ZeRO-Infinity's parameter offload): a fraction of each rank's ZeRO-3
shards lives in host memory with its gradient shards and optimizer state, is copied into the
full buffer's slot before each gather, and is updated on the CPU. On this CPU-only machine host
and device are one, so what the tests show is the path: the separate host shard, the copy-in
and in-place all-gather, the reduction into a device temporary copied out, the norm and clip
over mixed storage, each equal to a single process."""

import math

import pytest
import torch

import shardlib
from shardlib.errors import ShardingError
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig
from shardlib.testing import assert_equivalent, run_on

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=64)
CHUNK = 50_000  # one block (49,984 elements) a chunk: 6 chunks (wte, wpe + block 0, blocks 1 and 2, ln_f)


def _make():
    return GPT(CFG)


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("frac", [0.5, 1.0])
def test_offloaded_shards_train_as_one_process(frac):
    """ZeRO-3 at dp=2 with half and with all of the shard bytes offloaded, clipping on: losses,
    gradients, norms and parameters after 2 AdamW steps equal one process (the harness's
    tolerances; the update is the same arithmetic on the same values, in host memory)."""
    report = assert_equivalent(_make, {"dp": 2}, None, _batch(), steps=2, zero_stage=3, offload_param_frac=frac,
                               max_grad_norm=0.5, chunk_size=CHUNK)
    plan = report["plan"]
    assert len(plan.chunks) == 6 and 0 < len(plan.offloaded_chunks) <= len(plan.chunks)
    assert (len(plan.offloaded_chunks) == len(plan.chunks)) == (frac == 1.0)


# with mixed precision, no_sync() accumulation and TP + SP: tests/test_mixed_precision.py (BF16_CASES)


def _runtime_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    out = {}
    for frac in (0.0, 0.5):
        torch.manual_seed(0)
        smodel = shardlib.shard(_make(), mesh, zero_stage=3, offload_param_frac=frac, chunk_size=CHUNK)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
        zero = smodel._zero
        x, y = _batch()
        mesh.comm.reset()
        smodel(x[:2], y[:2])[1].backward()
        opt.step()
        table = {k: v for k, v in mesh.comm.table().items()}
        own = [c.shard.untyped_storage().data_ptr() != c.full.untyped_storage().data_ptr() for c in zero.chunks]
        out[frac] = {"offloaded": [c.offloaded for c in zero.chunks], "own_storage": own, "comm": table,
                     "planned": list(smodel.plan.offloaded_chunks),
                     "grads_apart": [c.grad_shard is not None and c.grad_shard.untyped_storage().data_ptr()
                                     != c.shard.untyped_storage().data_ptr() for c in zero.chunks if c.offloaded]}
    return out


@pytest.mark.multiprocess
def test_offloaded_chunks_are_the_planned_ones_and_move_the_same_bytes():
    """The chunks the plan offloads are the ones the runtime keeps apart (their own host
    storage, a gradient shard of their own); a step's collectives (calls and bytes per axis and
    kind) are those of the same step without offload: the copy-in is local."""
    for out in run_on(2, _runtime_worker):
        on = out[0.5]
        assert [i for i, o in enumerate(on["offloaded"]) if o] == on["planned"] and on["planned"]
        assert all(on["own_storage"]) and all(on["grads_apart"])
        assert not any(out[0.0]["offloaded"])
        assert on["comm"] == out[0.0]["comm"]


def test_plan_offloads_the_fraction_and_refuses_what_it_cannot():
    """The offloaded chunks (in index order) hold at least the fraction of the shard bytes and
    one chunk fewer would not; explain() and host_bytes say so; offload below ZeRO-3, without a
    data axis, or with a fraction outside [0, 1] is refused before anything moves; one data rank
    is accepted (and stays stage 3)."""
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=256))
    plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, offload_param_frac=0.4)
    sizes = {c.index: c.shard_numel * c.element_size for c in plan.chunks}
    off = plan.offloaded_chunks
    assert off == tuple(range(len(off)))
    assert sum(sizes[i] for i in off) >= 0.4 * sum(sizes.values()) > sum(sizes[i] for i in off[:-1])
    assert plan.host_bytes == plan.param_offload_bytes == 4 * sum(sizes[i] for i in off)  # shard, gradient, AdamW's 2 states
    assert plan.device_state_bytes == plan.model_state_bytes - plan.param_offload_bytes
    assert "parameter offload (offload_param_frac=0.4)" in plan.explain()
    for options, needle in ((dict(zero_stage=2, offload_param_frac=0.5), "needs ZeRO-3"),
                            (dict(zero_stage=3, offload_param_frac=1.5), "must be a number in [0, 1]"),
                            (dict(zero_stage=3, offload_param_frac=True), "must be a number in [0, 1]")):
        with pytest.raises(ShardingError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            shardlib.plan(model, AbstractMesh({"dp": 2}), **options)
    with pytest.raises(ShardingError, match="needs ZeRO-3 over a data axis"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), zero_stage=3, offload_param_frac=0.5)
    one = shardlib.plan(model, AbstractMesh({"dp": 1}), zero_stage=3, offload_param_frac=1.0)
    assert one.effective_stage == 3 and len(one.offloaded_chunks) == len(one.chunks)  # ZeRO-Infinity on one device
    assert shardlib.plan(model, AbstractMesh({"dp": 1}), zero_stage=3).effective_stage == 0


@pytest.mark.multiprocess
def test_offload_on_one_data_rank_trains_as_one_process():
    """On one data rank (one GPU) ZeRO-3 with offload keeps running as stage 3: each chunk's
    shard is the whole chunk, in host memory, copied in before each use and freed after it;
    equal to the plain single process."""
    report = assert_equivalent(_make, {"dp": 1}, None, _batch(), steps=2, zero_stage=3, offload_param_frac=1.0,
                               max_grad_norm=0.5, chunk_size=CHUNK)
    assert report["plan"].effective_stage == 3 and len(report["plan"].offloaded_chunks) == 6


def _checkpoint_worker(path):
    mesh = shardlib.init_mesh({"dp": 2})
    x, y = _batch()
    rank = mesh.index("dp")
    xs, ys = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
    runs = {}
    for name, save_frac, load_frac in (("offloaded", 0.5, 0.0), ("plain", 0.0, 1.0)):
        torch.manual_seed(0)
        a = shardlib.shard(_make(), mesh, zero_stage=3, offload_param_frac=save_frac, chunk_size=CHUNK)
        opt_a = shardlib.ZeroOptimizer(a, torch.optim.AdamW, lr=1e-2)
        a(xs, ys)[1].backward()
        opt_a.step()
        opt_a.zero_grad()
        shardlib.checkpoint.save(f"{path}/{name}", a, opt_a)
        torch.manual_seed(1)  # other initial values: the load must replace them
        b = shardlib.shard(_make(), mesh, zero_stage=3, offload_param_frac=load_frac, chunk_size=CHUNK)
        opt_b = shardlib.ZeroOptimizer(b, torch.optim.AdamW, lr=1e-2)
        shardlib.checkpoint.load(f"{path}/{name}", b, opt_b)
        losses = []
        for m, o in ((a, opt_a), (b, opt_b)):  # one more step each: the same loss and the same weights
            loss = m(xs, ys)[1]
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        sa, sb = shardlib.full_state_dict(a), shardlib.full_state_dict(b)
        runs[name] = (torch.equal(losses[0], losses[1]), all(torch.equal(sa[k], sb[k]) for k in sa))
    return runs


@pytest.mark.multiprocess
def test_checkpoint_of_offloaded_shards_resumes_exactly(tmp_path):
    """A checkpoint written with half the shards offloaded loads into a plan without offload,
    and one without into a plan with everything offloaded (masters and AdamW state come from and
    go to host memory): the next step's loss and the weights after it equal the saving run's."""
    for runs in run_on(2, _checkpoint_worker, str(tmp_path)):
        assert runs == {"offloaded": (True, True), "plain": (True, True)}, runs


def _with_optimizer_offload_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(_make(), mesh, zero_stage=3, offload_param_frac=0.5, optimizer_offload=True, chunk_size=CHUNK)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    x, y = _batch()
    smodel(x[:2], y[:2])[1].backward()
    opt.step()
    off = [c for c in smodel._zero.chunks if c.offloaded]
    copied = [p for p in opt.offload.device_params if any(p is c.opt_param for c in off)]
    shards = sum(c.shard.nbytes + c.grad_shard.nbytes for c in off)
    host = shards + sum(opt.offload.host_bytes(opt.optimizer).values())
    return len(off), len(copied), host, smodel.plan.host_bytes


@pytest.mark.multiprocess
def test_with_optimizer_offload_an_offloaded_shard_is_not_copied_again():
    """optimizer_offload=True with offload_param_frac: ZeRO-Offload's host copies are made only
    of the shards still on the device; an offloaded shard is updated where it is. The host bytes
    measured after a step equal plan.host_bytes (before: a second master and gradient copy of
    every offloaded shard, 1.5 x). Training with both equals one process."""
    for n_off, copied, host, planned in run_on(2, _with_optimizer_offload_worker):
        assert n_off > 0 and copied == 0 and host == planned, (n_off, copied, host, planned)
    assert_equivalent(_make, {"dp": 2}, None, _batch(), steps=2, zero_stage=3, offload_param_frac=0.5,
                      optimizer_offload=True, chunk_size=CHUNK)


def _scaler_and_max_norm_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    out = {}
    for frac in (0.0, 0.5):
        found, norms = [], []
        for init_scale in (2.0**8, 2.0**40):  # the second overflows fp16: every rank must find the inf
            torch.manual_seed(0)
            smodel = shardlib.shard(_make(), mesh, zero_stage=3, offload_param_frac=frac, chunk_size=CHUNK,
                                    param_dtype=torch.float16)
            opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
            scaler = shardlib.GradScaler(init_scale=init_scale)
            x, y = (shardlib.distribute(t, mesh, shardlib.P("dp")) for t in _batch())
            scaler.scale(smodel(x, y)[1]).backward()
            scaler.unscale_(opt)
            found.append(scaler._per_optimizer[id(opt)]["found_inf"])
            norms.append(float(shardlib.clip_grad_norm_(smodel, 1.0, norm_type=math.inf)))
        out[frac] = {"found_inf": found, "max_norm": norms, "offloaded": len(smodel.plan.offloaded_chunks)}
    return out


@pytest.mark.multiprocess
def test_the_max_norm_and_the_scalers_inf_check_over_partly_offloaded_shards():
    """Both stack one statistic per gradient shard: with offload_param_frac=0.5 on CUDA some are in
    host memory and some on the GPU, and torch.stack refuses two devices (found by review, not
    run on a GPU). Here host and device are one, so this shows the path: at frac 0.5 the inf check
    and the inf-norm equal those of frac 0, for a finite step and an fp16 overflow."""
    for out in run_on(2, _scaler_and_max_norm_worker):
        assert out[0.5]["offloaded"] > 0
        assert out[0.0]["found_inf"] == out[0.5]["found_inf"] == [False, True]
        assert out[0.0]["max_norm"][0] == out[0.5]["max_norm"][0] and math.isfinite(out[0.5]["max_norm"][0])
        assert not math.isfinite(out[0.0]["max_norm"][1]) and not math.isfinite(out[0.5]["max_norm"][1])
