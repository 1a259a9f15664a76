"""ZeRO stages 0-3: equivalence with one process, communication and memory against theory."""

import contextlib
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardlib
from shardlib.mesh import AbstractMesh
from shardlib.testing import TiedLM, assert_equivalent, run_on

pytestmark = pytest.mark.multiprocess


def _batch(vocab, rows, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    vocab=st.integers(5, 41),
    hidden=st.integers(3, 12),
    chunk_size=st.sampled_from([40, 150, 1 << 20]),
    accum=st.sampled_from([1, 2]),
    clip=st.sampled_from([None, 0.05]),
    seed=st.integers(0, 2**16),
)
def test_equivalent_to_single_process(stage, dp, vocab, hidden, chunk_size, accum, clip, seed):
    """Loss, gradients and parameters after 3 AdamW steps equal the single-process run
    (fp32, normwise relative 1e-5), with tied embeddings, a frozen layer and a buffer; with
    no_sync() accumulation over 2 micro-steps and with clipping small enough to clip."""
    make = functools.partial(TiedLM, vocab, hidden, hidden + 3)
    batch = _batch(vocab, 2 * dp * accum, 4, seed)
    report = assert_equivalent(
        make,
        {"dp": dp},
        None,
        batch,
        steps=3,
        zero_stage=stage,
        chunk_size=chunk_size,
        accum_steps=accum,
        max_grad_norm=clip,
        optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
        seed=seed,
    )
    if clip is not None:
        norms = [r["norm"] for r in report["records"]]
        assert all(n > clip for n in norms), f"clip {clip} too large to clip: norms {norms}"


def _comm_worker(stage, chunk_size):
    mesh = shardlib.init_mesh({"dp": torch.distributed.get_world_size()})
    torch.manual_seed(0)
    model = TiedLM(37, 10, 13, freeze=False)
    smodel = shardlib.shard(model, mesh, zero_stage=stage, chunk_size=chunk_size)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    idx, tgt = _batch(37, 2, 5, mesh.rank)
    out = []
    for set_to_none in (True, False, True):
        mesh.comm.reset()
        smodel(idx, tgt)[1].backward()
        opt.step()
        measured = shardlib.model_state_bytes(smodel, opt)
        opt.zero_grad(set_to_none=set_to_none)
        out.append((mesh.comm.table(), mesh.comm.exact_bytes(), measured, shardlib.model_state_bytes(smodel, opt),
                    set_to_none))
    return out, smodel.plan


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_communication_and_memory_equal_theory_and_plan(dp):
    """Counted bytes per step equal the plan's prediction and ZeRO's 2Ψ / 3Ψ (N-1)/N up to
    padding, less, under stage 3, the backward gathers of the chunk holding the tied embedding
    (``reshard_after_forward`` False: it stays gathered from forward to backward); measured
    model-state bytes equal the plan's figures after the step; ``zero_grad()`` releases every
    gradient buffer, ``zero_grad(set_to_none=False)`` keeps them."""
    for stage in (0, 1, 2, 3):
        results = run_on(dp, _comm_worker, stage, 64)
        for rank, (steps, plan) in enumerate(results):
            psi = sum(p.numel for p in plan.params)  # no frozen parameters in this model
            psi_padded = sum(c.padded_numel for c in plan.chunks)
            assert 0 <= psi_padded - psi < len(plan.chunks) * dp
            resident = [c for c in plan.chunks if not c.reshard_after_forward]
            assert [c.index for c in resident] == [plan.placement["wte.weight"][0]]  # the tied chunk only
            factor = 3 if stage == 3 else 2
            kept = sum(c.padded_numel for c in resident) if stage == 3 else 0  # not gathered again in backward
            theory = (factor * psi_padded - kept) * 4 * (dp - 1) / dp
            predicted = plan.comm_per_step()
            for table, exact, measured, after_zero_grad, set_to_none in steps:
                assert table == predicted, (stage, table, predicted)
                assert float(exact) == pytest.approx(theory, rel=1e-12), (stage, float(exact), theory)
                assert abs(float(exact) - (factor * psi - kept) * 4 * (dp - 1) / dp) <= factor * (psi_padded - psi) * 4
                assert measured == {
                    "params": plan.param_bytes,
                    "grads": plan.grad_bytes,
                    "optimizer": plan.optimizer_bytes,
                    "total": plan.model_state_bytes,
                }, (stage, rank, measured)
                # issue 16: every stage releases its gradient buffers at zero_grad (torch's set_to_none)
                released = plan.grad_bytes if set_to_none else 0
                assert after_zero_grad == dict(measured, grads=measured["grads"] - released,
                                               total=measured["total"] - released), (stage, after_zero_grad)


def test_memory_formula_per_stage():
    """Plan memory follows ZeRO's table: Ψ per rank for stage 0, sharded states from stage 1."""
    model = TiedLM(40, 16, 24, freeze=False)
    n = 4
    sizes = {s: shardlib.plan(model, AbstractMesh({"dp": n}), zero_stage=s, chunk_size=1 << 20) for s in range(4)}
    psi = sum(c.padded_numel for c in sizes[0].chunks)
    assert (sizes[0].param_bytes, sizes[0].grad_bytes, sizes[0].optimizer_bytes) == (4 * psi, 4 * psi, 8 * psi)
    assert (sizes[1].param_bytes, sizes[1].grad_bytes, sizes[1].optimizer_bytes) == (4 * psi, 4 * psi, 8 * psi // n)
    assert (sizes[2].param_bytes, sizes[2].grad_bytes, sizes[2].optimizer_bytes) == (4 * psi, 4 * psi // n, 8 * psi // n)
    assert (sizes[3].param_bytes, sizes[3].grad_bytes, sizes[3].optimizer_bytes) == (4 * psi // n, 4 * psi // n, 8 * psi // n)


def _accumulate_worker(stage):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(TiedLM(), mesh, zero_stage=stage, chunk_size=100)
    idx, tgt = _batch(37, 2, 5, mesh.rank)
    smodel(idx, tgt)[1].backward()
    once = shardlib.full_grads(smodel)
    smodel(idx, tgt)[1].backward()  # no zero_grad: gradients add up, as in plain PyTorch
    twice = shardlib.full_grads(smodel)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    opt.zero_grad()
    with smodel.no_sync():
        smodel(idx, tgt)[1].backward()
    try:
        opt.step()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    return once, twice, raised


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_accumulate_without_zero_grad_and_step_after_no_sync_raises(stage):
    once, twice, raised = run_on(2, _accumulate_worker, stage)[0]
    for name, g in once.items():
        if g is not None:
            torch.testing.assert_close(twice[name], 2 * g, rtol=1e-6, atol=1e-7)
    assert raised is not None and "no_sync" in raised


class _Branchy(torch.nn.Module):
    """Two linears; ``b`` only runs when asked, so a backward can leave it without a gradient."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 5)

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))
        return (self.b(h) if use_b else h).square().mean()


def _zero_grad_worker(stage, how):
    """Backward A (all parameters), zero the gradients ``how``, backward B (``b`` unused): the
    gradients must equal those of backward B alone on a fresh sharding of the same model."""
    mesh = shardlib.init_mesh({"dp": 2})
    g = torch.Generator().manual_seed(mesh.rank)
    xa, xb = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    out = []
    for zeroed in (True, False):
        torch.manual_seed(0)
        model = _Branchy()
        smodel = shardlib.shard(model, mesh, zero_stage=stage, chunk_size=40)  # a and b in different chunks
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.0)
        if zeroed:
            smodel(xa, True).backward()
            {"optimizer": opt.zero_grad, "sharded module": smodel.zero_grad, "inner module": model.zero_grad,
             "kept buffers": lambda: opt.zero_grad(set_to_none=False)}[how]()
            if stage == 0 and how != "inner module":
                assert all(p.grad is None for p in model.parameters())  # torch's set_to_none
        smodel(xb, False).backward()
        out.append(shardlib.full_grads(smodel))
        if stage == 0:  # after the reduction every .grad is the reduced gradient, a view into the chunk
            assert torch.equal(model.a.weight.grad, out[-1]["a.weight"]) and not model.b.weight.grad.any()
    return out


@pytest.mark.parametrize("stage,how", [(s, h) for s in range(4) for h in ("optimizer", "sharded module", "kept buffers")]
                         + [(0, "inner module")])
def test_zero_grad_then_backward_with_an_unused_parameter(stage, how):
    """zero_grad releases the buffers, or with ``set_to_none=False`` ("kept buffers") marks them
    stale; either way first gradients are copied in and untouched regions zeroed before the
    reduction: the gradients after it equal a fresh run's, and the unused
    ``b`` has a zero gradient, not backward A's. ``smodel.zero_grad()`` used to leave the flat
    buffers untouched (gradients doubled); under stage 0 the wrapped module's own
    ``zero_grad()`` (``.grad`` set to None) works too."""
    for after, fresh in run_on(2, _zero_grad_worker, stage, how):
        for name in fresh:
            assert torch.equal(after[name], fresh[name]), name
        assert not after["b.weight"].any() and after["a.weight"].any()


class _RaisingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (as an out-of-memory error part-way)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _RaisingBackward.armed:
            raise RuntimeError("out of memory (simulated)")
        return grad


class _Raising(torch.nn.Module):
    """``b(raising(a(x)))``: a backward that raises has run ``b``'s gradient hooks, not ``a``'s."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 5)

    def forward(self, x):
        return self.b(_RaisingBackward.apply(torch.tanh(self.a(x)))).square().mean()


def _raised_backward_run(model, opt, xs, mode, no_sync=contextlib.nullcontext):
    """The sequence both sides run: a backward that raises part-way, then clean ones (``mode``:
    "zero_grad" drops what it accumulated; "retry" keeps it, as plain PyTorch's ``.grad``;
    "no_sync" raises inside an accumulation window); ``opt.step`` records the gradients."""
    def fail():
        _RaisingBackward.armed = True
        try:
            with pytest.raises(RuntimeError, match="simulated"):
                model(xs[0]).backward()
        finally:
            _RaisingBackward.armed = False

    if mode == "no_sync":
        with no_sync():
            model(xs[1]).backward()
            fail()
    else:
        fail()
        if mode == "zero_grad":
            opt.zero_grad()
    for x in xs[2:]:
        model(x).backward()
        opt.step()
        opt.zero_grad()


def _raised_backward_worker(stage, mode):
    mesh = shardlib.init_mesh({"dp": 2})
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 6, generator=g)[2 * mesh.rank : 2 * mesh.rank + 2] for _ in range(4)]
    torch.manual_seed(0)
    model = _Raising()
    smodel = shardlib.shard(model, mesh, zero_stage=stage, chunk_size=40)  # a and b in different chunks
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    grads = []
    real_step = opt.step
    opt.step = lambda: (grads.append(shardlib.full_grads(smodel)), real_step())  # read before each step
    _raised_backward_run(smodel, opt, xs, mode, smodel.no_sync)
    return grads, smodel._zero._callback_queued  # (each clean backward ran its end)


@pytest.mark.parametrize("mode", ["zero_grad", "retry", "no_sync"])
def test_a_backward_that_raises_part_way_leaves_the_next_steps_exact(mode):
    """Regression: a backward that raised after some gradient hooks ran (an out-of-memory
    error, then a retry) lost its end-of-backward callback (torch drops it), and shardlib kept
    believing one was queued: no later backward reduced over the data axes (each rank stepped
    on its own gradients) and the raised backward's hooks counted as arrived. Every stage at
    dp=2 must give the single process's gradients in the two clean steps after it (fp32 sums
    of two ranks in another order: measured normwise difference below 1e-7; bound 1e-6)."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 6, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    ref = _Raising()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    grads = []
    real_step = ref_opt.step
    ref_opt.step = lambda: (grads.append({n: p.grad.clone() for n, p in ref.named_parameters()}), real_step())

    @contextlib.contextmanager
    def plain_no_sync():
        yield

    _raised_backward_run(ref, ref_opt, xs, mode, plain_no_sync)
    for stage in range(4):
        for rank, (got, queued) in enumerate(run_on(2, _raised_backward_worker, stage, mode)):
            assert len(got) == len(grads) == 2
            for step, (a, b) in enumerate(zip(got, grads)):
                for name in b:
                    err = ((a[name] - b[name]).norm() / b[name].norm()).item()
                    assert err < 1e-6, (stage, rank, step, name, err)
            assert not queued, (stage, rank)


def _retained_retry_worker(stage):
    mesh = shardlib.init_mesh({"dp": 2})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))[2 * mesh.rank : 2 * mesh.rank + 2]
    torch.manual_seed(0)
    smodel = shardlib.shard(_Raising(), mesh, zero_stage=stage, chunk_size=40)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    loss = smodel(x)
    _RaisingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            loss.backward(retain_graph=True)
    finally:
        _RaisingBackward.armed = False
    messages = []
    try:
        loss.backward()  # the same graph again: no forward, no zero_grad, so nothing could recover
    except shardlib.errors.ShardingError as exc:  # a chunk it reaches had started its reduction: refused here
        messages.append(str(exc))
    for call in (opt.step, lambda: shardlib.clip_grad_norm_(smodel, 1.0)):
        with pytest.raises(RuntimeError, match="whose end never ran") as info:
            call()
        messages.append(str(info.value))
    opt.zero_grad()  # recovers: the next step is exact again (test above)
    smodel(x).backward()
    opt.step()
    return messages


def test_a_retried_backward_on_a_retained_graph_is_refused_not_silently_unreduced():
    """Regression (found by a review of the recovery above): a raised ``backward(retain_graph=True)``
    retried on the same graph, with no forward or zero_grad between, reduced nothing (stages 2-3
    stepped on zero gradients, 0-1 on each rank's own); no hook can tell that backward from a
    nested one, so ``step()`` and ``clip_grad_norm_`` refuse it on every rank, saying how to retry
    (and the retried backward itself stops where it reaches a chunk whose reduction had started,
    saying the same)."""
    for stage in range(4):
        for messages in run_on(2, _retained_retry_worker, stage):
            assert all("zero_grad()" in m for m in messages), messages


def _forward_without_backward_worker(extra_forward):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(TiedLM(), mesh, zero_stage=3, chunk_size=100)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    idx, tgt = _batch(37, 2, 5, mesh.rank)
    assert not smodel.plan.chunks[smodel.plan.placement["wte.weight"][0]].reshard_after_forward
    for step in range(3):
        smodel(idx, tgt)[1].backward()
        if extra_forward:
            smodel(idx, tgt)  # gradients on, no backward (a validation loss without no_grad)
        opt.step()
        opt.zero_grad()
    with smodel.no_sync():
        smodel(idx, tgt)[1].backward()  # accumulated, then thrown away
    opt.zero_grad()  # which also ends the no_sync state: step() may follow (zero gradients)
    opt.step()
    return shardlib.full_state_dict(smodel)


def test_zero3_forward_without_backward_changes_nothing():
    """Regression (found by a review): the chunk holding the tied embedding stays gathered from
    forward to backward; after a forward with no backward it stayed gathered across the
    optimizer step, and the next forward ran on the old weights. Extra forwards must leave the
    training run bitwise unchanged. Also: zero_grad() after a no_sync() backward lets step() run."""
    plain = run_on(2, _forward_without_backward_worker, False)
    extra = run_on(2, _forward_without_backward_worker, True)
    for a, b in zip(plain, extra):
        for name in a:
            assert torch.equal(a[name], b[name]), name


def _buffer_worker():
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(mesh.rank)  # deliberately different initial values per rank
    model = TiedLM()
    model.scale.fill_(float(mesh.rank + 1))
    smodel = shardlib.shard(model, mesh, zero_stage=3, chunk_size=100)
    return shardlib.full_state_dict(smodel), smodel.plan


def test_parameters_and_buffers_start_identical_across_ranks():
    (sd0, plan0), (sd1, plan1) = run_on(2, _buffer_worker)
    assert plan0 == plan1
    for name in sd0:
        assert torch.equal(sd0[name], sd1[name]), name
    assert torch.equal(sd0["scale"], torch.ones(10))
    assert sd0["wte.weight"] is not None and torch.equal(sd0["wte.weight"], sd0["lm_head.weight"])


def _hooks(model) -> dict:
    return {n: len(p._post_accumulate_grad_hooks or {}) for n, p in model.named_parameters()}


@pytest.mark.parametrize("reset", [None, "optimizer", "inner module"])
@pytest.mark.parametrize("end", ["sync backward", "sync_grads"])
def test_stage0_no_sync_accumulates_in_the_views_without_hooks(reset, end):
    """Stage 0 inside no_sync(): a parameter's hook adopts its first gradient (``.grad`` becomes
    its view into the chunk) and is removed at the end of that backward, so later backwards
    accumulate in place with no Python call per parameter (a pipeline runs m of them per step);
    it is back once sync resumes (or zero_grad sets ``.grad`` to None). ``b`` is unused in the
    first backward: its hook stays until its own first gradient. The gradients equal plain
    PyTorch's sums bit for bit, whether the step ends in a sync backward or ``sync_grads()``
    (the pipeline's), and after a zero_grad part-way (ZeroOptimizer's, or the wrapped module's
    own, which sets ``.grad`` to None behind shardlib's back)."""
    mesh = shardlib.init_mesh({"dp": 1})
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 6, generator=g) for _ in range(4)]
    uses = [False, True, True, True]
    torch.manual_seed(0)
    ref = _Branchy()
    torch.manual_seed(0)
    model = _Branchy()
    smodel = shardlib.shard(model, mesh, zero_stage=0, chunk_size=40)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.0)
    first = {n: 1 for n, _ in model.named_parameters()}
    assert _hooks(model) == first
    n_sync = 3 if end == "sync backward" else 4
    with smodel.no_sync():
        for i in range(n_sync):
            if reset and i == 2:
                {"optimizer": opt.zero_grad, "inner module": model.zero_grad}[reset]()
                ref.zero_grad()
                if reset == "optimizer":
                    assert _hooks(model) == first  # to adopt the new first gradients
            ref(xs[i], uses[i]).backward()
            smodel(xs[i], uses[i]).backward()
            if i == 0:  # a adopted and silenced; b had no gradient yet
                assert _hooks(model) == {"a.weight": 0, "a.bias": 0, "b.weight": 1, "b.bias": 1}
                assert model.a.weight.grad is smodel._zero._grad_views[id(model.a.weight)]
                assert model.b.weight.grad is None
            if i == 1 and reset != "optimizer":
                assert set(_hooks(model).values()) == {0}
    assert _hooks(model) == first  # sync resumed
    if end == "sync backward":
        ref(xs[3], uses[3]).backward()
        smodel(xs[3], uses[3]).backward()
    else:
        smodel._zero.sync_grads()
    got = shardlib.full_grads(smodel)
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.grad), name
        assert torch.equal(dict(model.named_parameters())[name].grad, p.grad), name
    assert _hooks(model) == first


class _Deep(torch.nn.Module):
    """Three linears in a row and a fourth (``skip``) used only when asked."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 4))
        self.skip = torch.nn.Linear(6, 4)

    def forward(self, x, use_skip):
        y = self.layers(x)
        return (y + self.skip(x) if use_skip else y).square().mean()


@pytest.mark.parametrize("frozen", [False, True])
def test_stage0_no_sync_first_gradient_points_the_others_at_their_views(monkeypatch, frozen):
    """Stage 0 inside no_sync(): a chunk's first gradient hook in a backward points every other
    parameter of that chunk that this backward reaches at its view (zeroed) and silences its hook,
    so one Python hook runs per chunk and backward instead of one per parameter (8 parameters: 1
    or 2 calls, not 6 or 8); autograd then adds into the views in place. A parameter the backward
    does not reach (``skip`` in the first backward) keeps ``.grad`` None and its hook, as in plain
    PyTorch, and adopts its first gradient later; a frozen one gets nothing. Gradients equal plain
    PyTorch's sums bit for bit (0 + g is g)."""
    from shardlib.parallel.zero import ZeroRuntime

    calls = []
    original = ZeroRuntime._on_grad_ready
    def counted(self, prm):
        calls.append(prm)
        original(self, prm)

    monkeypatch.setattr(ZeroRuntime, "_on_grad_ready", counted)
    mesh = shardlib.init_mesh({"dp": 1})
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 6, generator=g) for _ in range(3)]
    uses = [False, True, True]
    torch.manual_seed(0)
    ref = _Deep()
    torch.manual_seed(0)
    model = _Deep()
    if frozen:
        for m in (ref, model):
            m.layers[2].weight.requires_grad_(False)
    smodel = shardlib.shard(model, mesh, zero_stage=0, chunk_size=1000)
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    with smodel.no_sync():
        for i in range(3):
            calls.clear()
            ref(xs[i], uses[i]).backward()
            smodel(xs[i], uses[i]).backward()
            if i == 0:
                reached = {id(smodel._zero.param_chunk[id(named[n])]) for n in trainable if n.startswith("layers")}
                assert len(reached) == 1 + frozen  # (the frozen weight splits the trainable ones into two chunks)
                assert len(calls) == len(reached)  # each chunk's first gradient's hook; the others were pointed
                views = smodel._zero._grad_views
                for n in trainable:
                    if n.startswith("layers"):
                        assert named[n].grad is views[id(named[n])], n
                    else:
                        assert named[n].grad is None, n
                assert _hooks(model) == {n: int(n.startswith("skip")) for n in named}
            if i == 1:
                assert len(calls) == 1  # skip's first gradient: adopted by its own hook, nothing else to point
            if i == 2:
                assert calls == []
    smodel._zero.sync_grads()
    got = shardlib.full_grads(smodel)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(got[name], p.grad), name
            assert torch.equal(named[name].grad, p.grad), name
        else:
            assert named[name].grad is None


def test_stage0_no_sync_allocates_each_chunks_gradients_when_backward_reaches_it(monkeypatch):
    """Stage 0 inside no_sync() (every pipeline step): each chunk's gradient buffer is allocated
    when the backward reaches that chunk, not every chunk's at the backward's first gradient, so
    it can take memory the activations behind it freed (as plain PyTorch's ``.grad`` tensors
    do). Here one chunk per linear: when the last linear's chunk gets its buffer the first
    linear's has none yet; the gradients still equal plain PyTorch's bit for bit."""
    from shardlib.parallel.chunk import Chunk

    ref, model, smodel = _stage0_pair(_Deep, chunk_size=80)
    chunks = smodel._zero.chunks
    first, last = (smodel._zero.param_chunk[id(model.layers[i].weight)] for i in (0, 4))
    assert first is not last
    seen = []
    original = Chunk.fill_grad_views
    def recorded(self):
        seen.append((self.index, [c.grad_full is not None for c in chunks]))
        original(self)

    monkeypatch.setattr(Chunk, "fill_grad_views", recorded)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    with smodel.no_sync():
        for _ in range(2):
            ref(x, False).backward()
            smodel(x, False).backward()
    order = [i for i, _ in seen]
    assert order.index(last.index) < order.index(first.index)
    allocated_then = next(alloc for i, alloc in seen if i == last.index)  # at the last linear's first fill
    assert not allocated_then[first.index]  # the first linear's buffer did not exist yet
    smodel._zero.sync_grads()
    got = shardlib.full_grads(smodel)
    for name, p in ref.named_parameters():
        if name.startswith("layers"):
            assert torch.equal(got[name], p.grad), name


def _stage0_pair(cls, chunk_size):
    """``(reference, model, shard(model) at stage 0 on one rank)``, both models from seed 0."""
    mesh = shardlib.init_mesh({"dp": 1})
    torch.manual_seed(0)
    ref = cls()
    torch.manual_seed(0)
    model = cls()
    return ref, model, shardlib.shard(model, mesh, zero_stage=0, chunk_size=chunk_size)


def _stage0_branchy():
    ref, model, smodel = _stage0_pair(_Branchy, chunk_size=40)
    return ref, model, smodel, shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.0)


def test_stage0_silenced_hooks_reads_freezing_and_tied_sums():
    """Edge cases of the hooks removed inside no_sync() (review of the change): (1) the wrapped
    module's own zero_grad and a backward replace ``.grad`` after its hook is gone, and a read
    of the buffers inside the window (full_grads) still sees the new gradient; (2) a parameter
    frozen inside the window takes no hook: leaving the block and zero_grad do not raise, and
    once trainable again its gradients are right; (3) local_grad_view of a parameter with no
    gradient this step (a tied copy on a stage that did not use it): what is summed into the
    view survives sync_grads (it used to be zeroed by the adoption of a None gradient)."""
    g = torch.Generator().manual_seed(1)
    x0, x1 = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    ref, model, smodel, opt = _stage0_branchy()
    with smodel.no_sync():
        smodel(x0, True).backward()
        model.zero_grad()  # .grad None behind shardlib's back; the next backward makes a new tensor
        smodel(x1, True).backward()
        got = shardlib.full_grads(smodel)
    ref(x1, True).backward()
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.grad), name

    ref, model, smodel, opt = _stage0_branchy()
    with smodel.no_sync():
        smodel(x0, True).backward()
        model.a.weight.requires_grad_(False)
    opt.zero_grad()
    model.a.weight.requires_grad_(True)
    opt.zero_grad()
    smodel(x1, True).backward()
    ref(x1, True).backward()
    got = shardlib.full_grads(smodel)
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.grad), name

    ref, model, smodel, opt = _stage0_branchy()
    zero = smodel._zero
    with smodel.no_sync():
        smodel(x0, False).backward()  # b gets no gradient
        zero.local_grad_view(model.b.weight).add_(1.0)  # as the tied all-reduce writes into it
    zero.sync_grads()
    assert torch.equal(model.b.weight.grad, torch.ones(5, 5))
    assert torch.equal(shardlib.full_grads(smodel)["b.weight"], torch.ones(5, 5))


def test_one_rank_mesh_equals_plain_pytorch_bitwise():
    """A one-rank mesh (no launcher) runs every stage and matches plain PyTorch bit for bit."""
    mesh = shardlib.init_mesh({"dp": 1})
    idx, tgt = _batch(37, 4, 5, 0)
    torch.manual_seed(0)
    ref = TiedLM()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        ref(idx, tgt)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for stage in range(4):
        torch.manual_seed(0)
        smodel = shardlib.shard(TiedLM(), mesh, zero_stage=stage)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
        for _ in range(3):
            smodel(idx, tgt)[1].backward()
            opt.step()
            opt.zero_grad()
        assert mesh.comm.calls() == 0
        full = shardlib.full_state_dict(smodel)
        for name, value in ref.state_dict().items():
            assert torch.equal(full[name], value), (stage, name)


def test_lr_scheduler_drives_zero_optimizer():
    mesh = shardlib.init_mesh({"dp": 1})
    smodel = shardlib.shard(TiedLM(), mesh, zero_stage=2)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for _ in range(3):
        smodel(*_batch(37, 2, 3, 0))[1].backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_plan_is_picklable_and_explains_itself():
    import pickle

    p = shardlib.plan(TiedLM(), AbstractMesh({"dp": 4}), zero_stage=3, chunk_size=100)
    q = pickle.loads(pickle.dumps(p))
    assert q == p
    text = p.explain()
    assert "wte.weight (= lm_head.weight)" in text and "[frozen]" in text
    assert "reduce_scatter" in text and "all_gather" in text and "model state per rank" in text
    assert str(p) == text


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_two_data_axes_and_data_axis_specs_are_zero3(data):
    """Specs along data axes mean ZeRO-3 storage; meshes with two data axes (dp x fsdp, sizes of
    1 included) shard over their product and stay equivalent to one process."""
    from shardlib.testing.strategies import data_axis_specs, mesh_shapes

    shape = data.draw(mesh_shapes(("dp", "fsdp"), max_world=4, min_world=2))
    model = TiedLM()
    names = [n for n, _ in model.named_parameters()]
    specs = data.draw(data_axis_specs(names, [p.dim() for _, p in model.named_parameters()], ("dp", "fsdp")))
    world = shape["dp"] * shape["fsdp"]
    p = shardlib.plan(model, AbstractMesh(shape), specs, chunk_size=90)
    assert p.zero_stage == (3 if specs else 0) and p.data_size == world
    assert_equivalent(TiedLM, shape, specs, _batch(37, 2 * world, 3, 7), steps=2, chunk_size=90)


def _load_worker(stage, specs):
    mesh = shardlib.init_mesh({"dp": 2, "tp": 2} if specs else {"dp": 2})
    torch.manual_seed(0)
    from shardlib.models import GPT, GPTConfig

    make = (lambda: GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=16))) if specs else (lambda: TiedLM(37, 12, 14))
    torch.manual_seed(0)
    source = make().state_dict()
    torch.manual_seed(123)  # a different initialization, overwritten by the load
    smodel = shardlib.shard(make(), mesh, specs, zero_stage=stage, chunk_size=100)
    smodel.load_state_dict(source)
    try:
        smodel.state_dict()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    return source, shardlib.full_state_dict(smodel), raised


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tp", [False, True])
def test_load_full_state_dict_round_trip(stage, tp):
    """A full state dict loads into any stage (and tensor-parallel shards) without communication,
    and comes back bit for bit; state_dict() under ZeRO-3 says to use full_state_dict."""
    from shardlib.models import gpt_preset

    world = 4 if tp else 2
    for source, full, raised in run_on(world, _load_worker, stage, gpt_preset().specs if tp else None):
        for name, value in source.items():
            assert torch.equal(full[name], value), name
        assert (raised is not None and "full_state_dict" in raised) == (stage == 3)


class DirectReads(torch.nn.Module):
    """A model whose forward reads parameters outside their own module's forward: a tied head
    ``h @ self.emb.weight.t()`` (nanoGPT / minGPT style without a head module), a
    ``ParameterList`` entry, and ``self.aux.weight`` right after ``l1`` runs (under ZeRO-3 with
    one module a chunk, aux's chunk is then being prefetched), once more inside a
    non-reentrant ``torch.utils.checkpoint`` (its recompute reads it in backward)."""

    def __init__(self, vocab: int = 13, hidden: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.l1 = torch.nn.Linear(hidden, hidden)
        self.aux = torch.nn.Linear(hidden, hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.scale = torch.nn.ParameterList([torch.nn.Parameter(torch.rand(hidden) + 0.5)])
        self.norm = torch.nn.LayerNorm(hidden)

    def _mix(self, h):
        return torch.tanh(h @ self.aux.weight.t()) * self.scale[0]

    def forward(self, idx, targets):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.l1(self.emb(idx)))
        h = h + h @ self.aux.weight.t() + self.aux.bias
        h = h + checkpoint(self._mix, h, use_reentrant=False)
        h = self.norm(self.l2(h))
        logits = h @ self.emb.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("stage,chunk_size", [(2, None), (3, 100), (3, None)])
def test_parameters_read_outside_their_modules_forward_train_like_one_process(stage, chunk_size):
    """A parameter read by a parent's forward instead of its own module's was sharded away under
    ZeRO-3: a ShardedAwayError inside forward when its chunk was freed (the message said
    "outside the forward"), and silently wrong losses and gradients (0.034 and 0.104 for 0.036)
    when its chunk was being prefetched, the read seeing the all-gather's buffer before it was
    complete (found by a new-user test). Now such a read gathers (or waits for) the chunk, and
    losses, gradients and parameters after 3 AdamW steps equal one process: with one module a
    chunk (chunk_size 100 elements) and with the default chunks; ZeRO-2 as a control."""
    options = {} if chunk_size is None else {"chunk_size": chunk_size}
    assert_equivalent(DirectReads, {"dp": 2}, None, _batch(13, 4, 5, 3), steps=3, zero_stage=stage, **options)


def _read_between_steps_worker():
    from shardlib.errors import ShardedAwayError

    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    model = DirectReads()
    smodel = shardlib.shard(model, mesh, zero_stage=3, chunk_size=100)
    smodel(*_batch(13, 2, 5, 1))  # a forward with gradients and no backward: the tied chunk is freed at the next forward
    with pytest.raises(ShardedAwayError, match=r"parameter 'aux.weight' .* outside the forward and backward"):
        model.aux.weight.sum()
    return True


def test_a_read_outside_forward_and_backward_still_raises():
    assert run_on(2, _read_between_steps_worker) == [True, True]
