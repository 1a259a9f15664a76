"""Sharded checkpoints: resharding round trips, atomic saves, exact resume, safetensors export.

A round trip trains on mesh A, saves (ckpt 1) and takes one more step; a fresh model on mesh B
(another seed, another plan) loads ckpt 1, saves again at once (ckpt 2) and takes the same step.
Both checkpoints, read back whole by DCP's own ``dcp_to_torch_save``, must hold bit-identical
parameters and optimizer state, equal to A's full state dict; the step after loading must give
A's loss. A different world size sums gradients and losses in another order, so that loss is
compared to fp32 rounding (rtol 1e-6); on the same mesh (exact resume) everything is bitwise.
"""

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardlib
import shardlib.checkpoint as ckpt
from shardlib.checkpoint._layout import range_boxes
from shardlib.errors import WorkerError
from shardlib.mesh.launch import WorkerGroup
from shardlib.models import GPT, GPTConfig, gpt_preset
from shardlib.testing import TiedLM, run_on

pytestmark = pytest.mark.multiprocess

STEP_RTOL = 1e-6  # fp32 rounding of a mean over another split of the batch


# -- tier 0: the box decomposition -------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4), data=st.data())
def test_range_boxes_cover_the_range_exactly(shape, data):
    """Boxes of a flat range are disjoint, contiguous in memory, in order, and cover it."""
    n = 1
    for s in shape:
        n *= s
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    index = torch.arange(n).view(shape)
    covered = []
    boxes = range_boxes(tuple(shape), a, b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for start, offs, sizes in boxes:
        block = index[tuple(slice(o, o + z) for o, z in zip(offs, sizes))].reshape(-1)
        assert block.tolist() == list(range(start, start + block.numel()))  # contiguous
        covered += block.tolist()
    assert covered == list(range(a, b))


# -- workers -------------------------------------------------------------------------------------

class SixLM(torch.nn.Module):
    """A length-6 parameter alone in its chunk: on 4 data ranks (slots of 2) rank 3 owns none of it."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(6))
        self.lin = torch.nn.Linear(6, 5)

    def forward(self, x, y):  # x: (B, 6) float, y: (B,) int64 in [0, 5)
        logits = self.lin(x * self.gain)
        return logits, torch.nn.functional.cross_entropy(logits, y)


class ScalarLM(SixLM):
    """SixLM with a learnable 0-d temperature: its AdamW ``exp_avg`` is saved 0-d, like ``step``."""

    def __init__(self):
        super().__init__()
        self.temp = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        logits = self.lin(x * self.gain) * self.temp
        return logits, torch.nn.functional.cross_entropy(logits, y)


def _gpt(seed, dropout=0.0, n_layer=2):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout))


def _make(kind, seed):
    if kind == "tied":
        torch.manual_seed(seed)
        return TiedLM(37, 10, 13)
    if kind in ("six", "scalar"):
        torch.manual_seed(seed)
        return SixLM() if kind == "six" else ScalarLM()
    if kind == "gpt2":
        torch.manual_seed(seed)
        return make_gpt2()
    if kind.startswith("layers"):  # "layers4": the reference GPT with 4 blocks
        return _gpt(seed, n_layer=int(kind[len("layers"):]))
    return _gpt(seed)


def _batch(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind in ("six", "scalar"):
        return torch.randn(12, 6, generator=g), torch.randint(0, 5, (12,), generator=g)
    x = torch.randint(0, 37, (12, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _step(smodel, opt, kind, step):
    """One training step on the global batch ``step``; returns the global mean loss (a float)."""
    x, y = _batch(kind, step)
    xl, yl = (shardlib.distribute(t, smodel.mesh, smodel.batch_spec) for t in (x, y))
    if isinstance(smodel, shardlib.PipelineModule):
        losses, _ = smodel.forward_backward(xl, criterion=_ce, labels=(yl,))
        loss = shardlib.all_reduce(torch.stack(losses).mean() if losses is not None else torch.zeros(()), "pp")
    elif kind == "gpt2":  # Hugging Face: output.logits
        loss = _ce(smodel(xl).logits, yl)
        loss.backward()
    else:
        _, loss = smodel(xl, yl)
        loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    return (shardlib.all_reduce(loss, smodel.data_axes, op="avg") if smodel.data_axes else loss).item()


def _shard(kind, seed, shape, stage, chunk_size, meta=False, **options):
    mesh = shardlib.init_mesh(shape)
    specs = gpt_preset("tp").specs if "tp" in shape else None
    options.update(dict(microbatches=2) if "pp" in shape else {})
    if kind == "gpt2" and "tp" in shape:
        from shardlib.models import gpt2_preset

        specs = gpt2_preset().specs
        options.update(gpt2_preset().options)
    if meta:  # built on the meta device: shard() materializes only the local shards
        with torch.device("meta"):
            model = _make(kind, seed)
        options["init_seed"] = seed
    else:
        model = _make(kind, seed)
    smodel = shardlib.shard(model, mesh, specs, zero_stage=stage, chunk_size=chunk_size, **options)
    return smodel, shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _save_side(path, kind, shape, stage, chunk_size, steps=2):
    smodel, opt = _shard(kind, 0, shape, stage, chunk_size)
    for s in range(steps):
        _step(smodel, opt, kind, s)
    ckpt.save(path, smodel, opt, extra={"step": steps})
    full = shardlib.full_state_dict(smodel)
    return full, _step(smodel, opt, kind, steps)


def _load_side(path, path2, kind, shape, stage, chunk_size, steps=2, **options):
    smodel, opt = _shard(kind, 7, shape, stage, chunk_size, **options)  # other initial values
    for group in opt.param_groups:
        group["lr"] = 123.0  # restored from the checkpoint
    extra = ckpt.load(path, smodel, opt)
    ckpt.save(path2, smodel, opt)
    full = shardlib.full_state_dict(smodel)
    return extra, full, _step(smodel, opt, kind, steps)


def _read_whole(path, tmp_path):
    """Every tensor of a checkpoint, whole, read by DCP's own converter (one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / (os.path.basename(path) + ".pt")
    dcp_to_torch_save(path, out)
    whole = torch.load(out, weights_only=False)
    return {k: v for k, v in whole.items() if k.startswith(("model.", "optim.")) and isinstance(v, torch.Tensor)}


def _round_trip(tmp_path, kind, a, b, **load_options):
    """``a``/``b``: (shape, zero stage, chunk size); ``load_options`` for the loading side."""
    p1, p2 = str(tmp_path / "ckpt1"), str(tmp_path / "ckpt2")
    size = lambda shape: int(torch.tensor(list(shape.values())).prod())  # noqa: E731
    saved = run_on(size(a[0]), _save_side, p1, kind, *a)
    loaded = run_on(size(b[0]), _load_side, p1, p2, kind, *b, **load_options)
    full_a, loss_a = saved[0]
    extra, full_b, loss_b = loaded[0]
    assert extra == {"step": 2}
    assert full_a.keys() == full_b.keys()
    for name in full_a:
        assert torch.equal(full_a[name], full_b[name]), name
    one, two = _read_whole(p1, tmp_path), _read_whole(p2, tmp_path)
    assert one.keys() == two.keys()
    assert any(k.endswith(".exp_avg_sq") for k in one) and any(k.endswith(".step") for k in one)
    for key in one:
        assert torch.equal(one[key], two[key]), key
        if key.startswith("model.") and key[6:] in full_a:
            assert torch.equal(one[key], full_a[key[6:]]), key
    assert loss_b == pytest.approx(loss_a, rel=STEP_RTOL)
    assert all(r[2] == loss_b for r in loaded)  # the same global loss on every rank
    return one


# -- resharding round trips ----------------------------------------------------------------------

def test_dp4_to_dp2(tmp_path):
    """ZeRO-3 over 4 ranks -> ZeRO-1 over 2, with a tied embedding, a frozen layer and a buffer."""
    _round_trip(tmp_path, "tied", ({"dp": 4}, 3, 150), ({"dp": 2}, 1, 40))


def test_dp2_to_dp3_uneven(tmp_path):
    """ZeRO-2 over 2 ranks -> ZeRO-3 over 3 (chunks padded unevenly, other chunk boundaries)."""
    _round_trip(tmp_path, "tied", ({"dp": 2}, 2, 1 << 20), ({"dp": 3}, 3, 64))


@pytest.mark.parametrize("ranks,stage", [(3, 3), (2, 1)])
def test_zero_size_shard(tmp_path, ranks, stage):
    """A length-6 parameter on 4 ranks (rank 3's shard of it is empty) loads on 3 ranks at ZeRO-3
    (rank 2's shard of it is empty too) and on 2 at ZeRO-1 (every load reads the empty saved
    shard; 2 ranks, a pool the suite has anyway: 6 ranks spawned a pool for this case alone, 16 s)."""
    smodel_plan = shardlib.plan(SixLM(), shardlib.AbstractMesh({"dp": 4}), zero_stage=3, chunk_size=8)
    chunk = next(c for c in smodel_plan.chunks if "gain" in c.params)
    assert chunk.padded_numel == 8 and chunk.shard_numel == 2  # rank 3 holds padding only
    _round_trip(tmp_path, "six", ({"dp": 4}, 3, 8), ({"dp": ranks}, stage, 8))


@pytest.mark.parametrize("a,b", [(({"dp": 2}, 3, 8), ({"dp": 1}, 0, 8)), (({"dp": 1}, 0, 64), ({"dp": 2}, 3, 4))])
def test_a_0d_parameter_resumes_with_its_optimizer_state(tmp_path, a, b):
    """A 0-d parameter's per-element AdamW state is saved 0-d, as ``step`` is: the load reads it
    per element (it raised ``slice() cannot be applied to a 0-dim tensor``, or loaded the state 0-d
    and AdamW refused it at the next step). ZeRO-3 on 2 ranks <-> one rank, the scalar alone in its
    chunk or sharing one."""
    whole = _round_trip(tmp_path, "scalar", a, b)
    assert whole["optim.temp.exp_avg"].shape == () and whole["optim.temp.exp_avg"].abs() > 0


def test_dp2_tp2_to_dp4(tmp_path):
    """Megatron column/row/vocab-parallel GPT over dp=2 x tp=2 (ZeRO-1) -> ZeRO-3 over dp=4, the
    loading model built on the meta device (only its shards are ever allocated)."""
    _round_trip(tmp_path, "gpt", ({"dp": 2, "tp": 2}, 1, 400), ({"dp": 4}, 3, 400), meta=True)


def test_pp2_dp2_to_dp4(tmp_path):
    """Two pipeline stages x dp=2 (ZeRO-2; the tied wte/lm_head on both stages, written once)
    -> one stage over dp=4 at stage 0."""
    whole = _round_trip(tmp_path, "gpt", ({"pp": 2, "dp": 2}, 2, 400), ({"dp": 4}, 0, 400))
    assert "model.wte.weight" in whole and "model.lm_head.weight" not in whole


def _mixed_side(path, out, shape, stage, steps, **options):
    """Train ``steps`` steps and save to ``out``, or (``path``) load and save at once; then take
    step ``steps``. Returns its loss and the parameters the model computes with before it."""
    smodel, opt = _shard("gpt", 0 if path is None else 9, shape, stage, 400, **options)
    if path is None:
        for s in range(steps):
            _step(smodel, opt, "gpt", s)
    else:
        ckpt.load(path, smodel, opt)
    ckpt.save(out, smodel, opt)
    compute = {name: prm.detach().clone() for name, prm in smodel.module.named_parameters()}  # views of the chunks
    return _step(smodel, opt, "gpt", steps), compute


def test_mixed_precision_and_optimizer_offload(tmp_path):
    """bf16 compute with fp32 masters: the checkpoint holds the fp32 masters and AdamW state
    (from the host under optimizer offload); a ZeRO-1 bf16 run on 3 ranks loads them into masters
    and compute copies; the same mesh and options as the saving run resume bit for bit."""
    p1, p2, p3 = (str(tmp_path / f"ckpt{i}") for i in (1, 2, 3))
    bf16 = dict(param_dtype=torch.bfloat16)
    saved = run_on(2, _mixed_side, None, p1, {"dp": 2}, 2, 2, optimizer_offload=True, **bf16)
    loaded = run_on(3, _mixed_side, p1, p2, {"dp": 3}, 1, 2, **bf16)
    resumed = run_on(2, _mixed_side, p2, p3, {"dp": 2}, 2, 2, optimizer_offload=True, **bf16)
    one, two, three = (_read_whole(p, tmp_path) for p in (p1, p2, p3))
    assert one["model.wte.weight"].dtype == torch.float32 and one["optim.wte.weight.exp_avg"].dtype == torch.float32
    for key in one:
        assert torch.equal(one[key], two[key]) and torch.equal(one[key], three[key]), key
    compute = loaded[0][1]  # ZeRO-1 keeps whole bf16 compute copies: loaded too, cast from the masters
    assert compute.keys() <= {k[6:] for k in one}
    for name, value in compute.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, one[f"model.{name}"].to(torch.bfloat16)), name
    assert [r[0] for r in resumed] == [r[0] for r in saved]  # same mesh: the next loss bit for bit


def test_hf_gpt2_fused_qkv_dp2_tp2_to_dp2(tmp_path):
    """Hugging Face GPT-2: ``c_attn`` ``[C, 3C]`` holds q, k, v as 3 blocks each split over tp
    (a rank's columns are 3 pieces of the global tensor), ZeRO-3 on dp=2 x tp=2 -> ZeRO-1 on dp=2."""
    pytest.importorskip("transformers")
    one = _round_trip(tmp_path, "gpt2", ({"dp": 2, "tp": 2}, 3, 500), ({"dp": 2}, 1, 500))
    assert one["model.transformer.h.0.attn.c_attn.weight"].shape == (16, 48)


# -- atomic saves and clear errors ---------------------------------------------------------------

def _kill_mid_save(path):
    smodel, opt = _shard("tied", 0, {"dp": 2}, 3, 64)
    _step(smodel, opt, "tied", 0)
    ckpt.save(path, smodel, opt, extra={"step": 1})
    _step(smodel, opt, "tied", 1)
    if torch.distributed.get_rank() == 1:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait()  # this rank's data files are on disk, the metadata is not
            os._exit(17)

        FileSystemWriter.write_data = write_then_die
    ckpt.save(path, smodel, opt, extra={"step": 2}, overwrite=True)  # replaces path: killed midway


def _load_after_kill(path):
    out = {}
    for name in (path + ".partial", os.path.dirname(path) + "/missing"):
        smodel, opt = _shard("tied", 0, {"dp": 2}, 1, 64)
        try:
            ckpt.load(name, smodel, opt)
        except ckpt.CheckpointError as exc:  # raised on each rank before any communication
            out[name] = str(exc)
    smodel, opt = _shard("tied", 5, {"dp": 2}, 3, 64)
    out["extra"] = ckpt.load(path, smodel, opt)
    out["loss"] = _step(smodel, opt, "tied", 1)
    return out


def test_kill_mid_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    group = WorkerGroup(2, timeout=60)  # not the shared pool: a rank of this group dies
    try:
        with pytest.raises(WorkerError):  # rank 1 exits; rank 0 loses its peer mid-collective
            group.run(_kill_mid_save, path)
        assert not group.alive
    finally:
        group.close()
    files = os.listdir(path + ".partial")
    assert any(f.endswith(".distcp") for f in files), files  # rank 1's data was written ...
    assert ckpt.MARKER not in files and ".metadata" not in files  # ... the save never finished
    shutil.copytree(path + ".partial", str(tmp_path / "missing.partial"))
    results = run_on(2, _load_after_kill, path)
    reference = run_on(2, _save_side, str(tmp_path / "again"), "tied", {"dp": 2}, 3, 64, 1)[0][1]
    for out in results:
        assert "is incomplete" in out[path + ".partial"] and ckpt.MARKER in out[path + ".partial"]
        assert "missing.partial" in out[str(tmp_path / "missing")] and "did not finish" in out[str(tmp_path / "missing")]
        assert out["extra"] == {"step": 1}  # the previous checkpoint
        assert out["loss"] == reference  # its step 2 is the uninterrupted step 2 (same mesh: bitwise)
    assert ckpt.latest(str(tmp_path)) in (path, str(tmp_path / "again"))


def test_a_save_stopped_while_renaming_is_named(tmp_path):
    """Killed between rank 0's two renames (old checkpoint aside, new one into place): the error
    says which folder holds which checkpoint (checked by every rank before communication)."""
    path = str(tmp_path / "ckpt")
    os.makedirs(path + ".old")
    with pytest.raises(ckpt.CheckpointError, match=r"ckpt\.old' is the checkpoint it was replacing"):
        ckpt._check_complete(path)
    os.makedirs(path + ".partial")
    with pytest.raises(ckpt.CheckpointError, match=r"ckpt\.partial' is a save that did not finish"):
        ckpt._check_complete(path)
    open(os.path.join(path + ".partial", ckpt.MARKER), "w").close()
    with pytest.raises(ckpt.CheckpointError, match=r"ckpt\.partial' is a finished save that was not renamed"):
        ckpt._check_complete(path)


def _bad_loads(path):
    out = []
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    for model in (TiedLM(37, 12, 13), SixLM()):
        smodel = shardlib.shard(model, mesh, zero_stage=3)
        try:
            ckpt.load(path, smodel)
        except ckpt.CheckpointError as exc:
            out.append(str(exc))
    smodel = shardlib.shard(_make("tied", 1), mesh, zero_stage=3, chunk_size=64)
    sgd = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.5, momentum=0.9)
    try:  # AdamW's state and weight decay must not land in an SGD optimizer
        ckpt.load(path, smodel, sgd)
    except ckpt.CheckpointError as exc:
        out.append(str(exc))
    out.append(sgd.param_groups[0]["lr"])
    return out


def test_bad_loads_raise_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on(2, _save_side, path, "tied", {"dp": 2}, 3, 64, 1)
    for messages in run_on(2, _bad_loads, path):  # both ranks raise, and the pool is not stuck
        shape, missing, other_optimizer, lr = messages
        assert "wte.weight: shape (37, 12) here, (37, 10) in the checkpoint" in shape and path in shape
        assert "3 of the model's entries are not in the checkpoint: gain (6,), lin.weight (5, 6)" in missing
        assert "torch.optim.adamw.AdamW optimizer, but the optimizer given is a torch.optim.sgd.SGD" in other_optimizer
        assert lr == 0.5  # untouched


def _resume_worker(path, start, stop, save_at):
    """Train the reference GPT (dropout on, batches from torch's global RNG) from ``start`` to
    ``stop``; load ``path`` first if ``start > 0``; save there after step ``save_at``."""
    mesh = shardlib.init_mesh({"dp": 2})
    smodel = shardlib.shard(_gpt(0 if start == 0 else 99, dropout=0.1), mesh, zero_stage=3, chunk_size=400)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2, max_grad_norm=1.0)
    torch.manual_seed(1234)  # the data stream
    if start:
        torch.manual_seed(4321)  # a different process state, which load() replaces
        assert ckpt.load(path, smodel, opt) == {"step": start}
    losses = []
    for step in range(start, stop):
        x = torch.randint(0, 37, (8, 9))  # the global batch, from the (restored) global RNG
        xl = shardlib.distribute(x, mesh, smodel.batch_spec)
        _, loss = smodel(xl[:, :-1], xl[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if step + 1 == save_at:
            ckpt.save(path, smodel, opt, extra={"step": save_at})
    return losses, shardlib.full_state_dict(smodel)


def test_exact_resume_is_bitwise(tmp_path):
    """4 steps straight == 2 steps, save, a fresh model loads, 2 more steps: every loss on every
    rank and every parameter bit-identical (dropout counters and RNG states restored)."""
    path = str(tmp_path / "resume")
    straight = run_on(2, _resume_worker, str(tmp_path / "unused"), 0, 4, -1)
    first = run_on(2, _resume_worker, path, 0, 2, 2)
    second = run_on(2, _resume_worker, path, 2, 4, -1)
    for rank in range(2):
        losses = first[rank][0] + second[rank][0]
        assert all(torch.equal(a, b) for a, b in zip(losses, straight[rank][0])), (losses, straight[rank][0])
        for name, value in straight[rank][1].items():
            assert torch.equal(second[rank][1][name], value), name



class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x)))).pow(2).mean()


def _buffers_worker(path, broadcast, mode):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(_BatchNormNet(), mesh, zero_stage=1, broadcast_buffers=broadcast)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)

    def step(i):  # each rank its own rows: running statistics differ across ranks after a step
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
        smodel(shardlib.distribute(x, mesh, smodel.batch_spec)).backward()
        opt.step()
        opt.zero_grad()

    own = {}
    if mode == "save":
        step(0)
        step(1)
        own = {k: v.clone() for k, v in smodel.module.bn.named_buffers()}
        ckpt.save(path, smodel, opt)
    else:
        ckpt.load(path, smodel, opt)
    step(2)
    return own, shardlib.full_state_dict(smodel), {k: v.clone() for k, v in smodel.module.bn.named_buffers()}


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_are_saved_as_the_first_data_rank_holds_them(tmp_path, broadcast):
    """BatchNorm's running statistics differ across data ranks between steps (each rank's own
    rows). DCP deduplicates a key saved by every rank by picking one rank per key, so a
    checkpoint held running_mean from one rank and running_var from the other: a state no
    rank ever had, and the resumed run's statistics were 6.1e-2 off the uninterrupted run's
    (found by a new-user test). Every buffer is now the first data rank's, in the checkpoint and
    in full_state_dict on every rank; with broadcast_buffers (DDP's rule: the first rank's are
    authoritative) the step after a resume equals the uninterrupted one."""
    path = str(tmp_path / "bn")
    saved = run_on(2, _buffers_worker, path, broadcast, "save")
    (own0, full0, live0), (own1, full1, _) = saved
    assert not torch.equal(own0["running_mean"], own1["running_mean"])  # the ranks really differ
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, str(tmp_path / "whole.pt"))
    whole = torch.load(str(tmp_path / "whole.pt"))
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(whole[f"model.bn.{key}"], own0[key]), key
    for name in full0:  # one full state on every rank, rank 0's buffers after the third step
        assert torch.equal(full0[name], full1[name]), name
    assert torch.equal(full0["bn.running_var"], live0["running_var"])
    resumed = run_on(2, _buffers_worker, path, broadcast, "load")
    if broadcast:
        for key in ("running_mean", "running_var"):
            assert torch.equal(resumed[0][2][key], live0[key]), key

# -- safetensors export ----------------------------------------------------------------------------

def make_gpt2():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=37, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _export_worker(path, kind):
    mesh = shardlib.init_mesh({"dp": 2, "tp": 2} if kind == "gpt" else {"dp": 1, "tp": 2})
    if kind == "gpt":
        smodel = shardlib.shard(_gpt(0), mesh, gpt_preset("tp").specs, zero_stage=3)
    else:
        from shardlib.models import gpt2_preset

        torch.manual_seed(0)
        preset = gpt2_preset()
        smodel = shardlib.shard(make_gpt2(), mesh, preset.specs, zero_stage=0, **preset.options)
    out = ckpt.export_safetensors(path, smodel)
    return out, shardlib.full_state_dict(smodel)


def test_export_safetensors_loads_into_the_unsharded_gpt(tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "gpt.safetensors")
    results = run_on(4, _export_worker, path, "gpt")
    assert results[0][0] == path and all(r[0] is None for r in results[1:])
    model = _gpt(5)
    model.load_state_dict(load_file(path))  # strict: every name, original shapes
    for name, value in model.state_dict().items():
        assert torch.equal(value, results[0][1][name]), name
    x = torch.randint(0, 37, (2, 8))
    assert torch.equal(model(x)[0], _reference_gpt(results[0][1])(x)[0])


def _reference_gpt(state):
    model = _gpt(3)
    model.load_state_dict(state)
    return model


def test_export_safetensors_loads_into_hugging_face_gpt2(tmp_path):
    """Fused q/k/v (``c_attn``) split over tp=2, exported and read by ``from_pretrained``."""
    transformers = pytest.importorskip("transformers")
    results = run_on(2, _export_worker, str(tmp_path / "model.safetensors"), "gpt2")
    torch.manual_seed(0)
    make_gpt2().config.save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        if name in results[0][1]:
            assert torch.equal(value, results[0][1][name]), name
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, results[0][1]["transformer.h.0.attn.c_attn.weight"])
