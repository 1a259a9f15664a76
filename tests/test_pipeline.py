"""Pipeline parallelism: every schedule equals one process (losses, gradients, parameters)."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardlib
import shardlib.parallel.schedules
from shardlib.errors import ShardingError, WorkerError
from shardlib.models import GPT, GPTConfig
from shardlib.testing import default_tolerances, run_on
from shardlib.testing.models import FrozenConstant
from shardlib.testing.tolerance import ReferenceRun, compare_records, reference_with_bands

pytestmark = pytest.mark.multiprocess


def ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _config(layers):
    return GPTConfig(vocab_size=37, block_size=8, n_layer=layers, n_head=2, n_embd=16, bias=False)


def _batches(rows, steps=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 37, (rows, 9), generator=g) for _ in range(steps)]


def _pipeline_worker(shape, layers, options, rows, clip):
    options = dict(options)
    if options.pop("native", False):  # the NCCL-style branch forced on gloo: tag 0, one work per batch
        from test_pipeline_p2p import nccl_like_p2p

        mesh = shardlib.init_mesh(shape)
        with nccl_like_p2p(mesh):
            return _pipeline_steps(mesh, layers, options, rows, clip)
    return _pipeline_steps(shardlib.init_mesh(shape), layers, options, rows, clip)


def _pipeline_steps(mesh, layers, options, rows, clip):
    torch.manual_seed(0)
    specs = options.pop("specs", None)
    dtype = options.pop("dtype", torch.float32)
    smodel = shardlib.shard(GPT(_config(layers)).to(dtype), mesh, specs, chunk_size=400, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3, max_grad_norm=clip)
    out = {"records": []}
    for step, x in enumerate(_batches(rows)):
        xl = shardlib.distribute(x, mesh, smodel.batch_spec)
        tables = [mesh.comm.table()]
        losses, _ = smodel.forward_backward(xl[:, :-1], criterion=ce, labels=(xl[:, 1:],))
        tables.append(mesh.comm.table())
        grads = shardlib.full_grads(smodel)
        tables.append(mesh.comm.table())
        opt.step()
        if step == 0:  # the step's collectives over dp (forward_backward and the optimizer's, not full_grads'), planned
            tables.append(mesh.comm.table())
            out["dp_comm"] = _dp_between(tables)
            # (the clipping norm's all-reduce runs over dp+pp, outside this table: the stage plan has no pp term for it)
            out["dp_planned"] = {key: value for key, value in smodel.plan.comm_per_step(
                micro_steps=smodel.pipeline_plan.m).items() if key[0] == "dp"}
        out["records"].append({"loss": torch.stack(losses).mean().item() if losses is not None else None,
                               "grads": grads, "params": shardlib.full_state_dict(smodel),
                               "norm": None if opt.last_grad_norm is None else opt.last_grad_norm.item()})
        opt.zero_grad()
    out["params"] = out["records"][-1]["params"]
    out["last_stage"] = losses is not None
    out["sent"] = mesh.comm.bytes(smodel.pp_axis, "send") / max(mesh.comm.calls(smodel.pp_axis, "send"), 1)
    out["timeline"] = smodel.timeline
    return out


def _dp_between(tables):
    """``{(axis, kind): (calls, bytes)}`` over ``dp`` counted from ``tables[0]`` to ``tables[1]``,
    plus from ``tables[2]`` to ``tables[3]`` (``mesh.comm.table()`` snapshots; the byte counts here
    are whole numbers, exact in a float)."""
    out = {}
    for start, end in ((tables[0], tables[1]), (tables[2], tables[3])):
        for key, (calls, nbytes) in end.items():
            if key[0] == "dp":
                calls0, bytes0 = start.get(key, (0, 0.0))
                total = out.get(key, (0, 0.0))
                out[key] = (total[0] + calls - calls0, total[1] + nbytes - bytes0)
    return {key: value for key, value in sorted(out.items()) if value[0]}


def _reference_run(layers, rows, clip, dtype=torch.float32):
    """A fresh single-process run of the same GPT on the same batches (for the band copies)."""
    torch.manual_seed(0)
    model = GPT(_config(layers)).to(dtype)
    batches = _batches(rows)
    return ReferenceRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        lambda m, step: m(batches[step][:, :-1], batches[step][:, 1:])[1], clip)


def _check(shape, layers, options, rows=8, clip=None):
    """Losses, gradients, norms and parameters after every step equal one process's, under the
    tolerance model of the equivalence harness (step-0 gradients tight, the rest with the
    sensitivity band), on every rank; the data-parallel mean of the last stages' losses."""
    world = 1
    for size in shape.values():
        world *= size
    dtype = options.get("dtype", torch.float32)
    results = run_on(world, _pipeline_worker, shape, layers, options, rows, clip)
    ref, bands = reference_with_bands(functools.partial(_reference_run, layers, rows, clip, dtype), 3,
                                      default_tolerances(dtype))
    last = [r for r in results if r["last_stage"]]
    assert len(last) == world // shape["pp"]  # one last stage per data/tensor coordinate
    for r in results:
        got = [dict(rec, loss=sum(q["records"][step]["loss"] for q in last) / len(last))  # tensor replicas agree
               for step, rec in enumerate(r["records"])]
        compare_records(got, ref, bands, default_tolerances(dtype))
    if "tie" not in options:  # tied copies on the first and last stage stay identical
        torch.testing.assert_close(results[0]["params"]["wte.weight"], results[0]["params"]["lm_head.weight"])
    for rank, r in enumerate(results):  # counted over dp in the first step: what the rank's stage plan predicts
        assert r["dp_comm"] == r["dp_planned"], (rank, r["dp_comm"], r["dp_planned"])
        assert bool(r["dp_comm"]) == ("dp" in shape), (rank, r["dp_comm"])
    return results


CASES = [
    ({"pp": 2}, 4, {"schedule": "gpipe", "microbatches": 1}),
    ({"pp": 2}, 4, {"schedule": "gpipe", "microbatches": 4}),
    ({"pp": 2}, 4, {"schedule": "1f1b", "microbatches": 3}),  # uneven: 8 rows do not split into 3
    ({"pp": 2}, 4, {"schedule": "1f1b", "microbatches": 8}),
    ({"pp": 2}, 4, {"schedule": "interleaved_1f1b", "microbatches": 2, "virtual_stages": 2}),
    ({"pp": 4}, 4, {"schedule": "1f1b", "microbatches": 2}),  # fewer microbatches than stages
    ({"pp": 4}, 4, {"schedule": "gpipe", "microbatches": 8}),
    ({"pp": 4}, 6, {"schedule": "interleaved_1f1b", "microbatches": 4, "virtual_stages": 2}),
]


@pytest.mark.parametrize("shape,layers,options", CASES)
def test_pipeline_equals_single_process(shape, layers, options):
    if options["microbatches"] == 3:
        with pytest.raises(WorkerError) as err:
            _check(shape, layers, options)
        assert set(err.value.errors) == {0, 1}  # raised on every rank, before any transfer
        assert all(t == "ShardingError" and "equal microbatches" in m for t, m in err.value.errors.values())
        _check(shape, layers, options, rows=6)
        return
    results = _check(shape, layers, options)
    actions = [a for a, _, _ in results[0]["timeline"]]
    assert len(actions) == 2 * options["microbatches"] * options.get("virtual_stages", 1)


NATIVE_CASES = [CASES[1], CASES[3], CASES[4], CASES[5], CASES[7]]  # gpipe, 1f1b, interleaved (p 2 and 4)


@pytest.mark.parametrize("shape,layers,options", NATIVE_CASES)
def test_pipeline_equals_single_process_on_the_native_path(shape, layers, options):
    """The NCCL-style transfers forced on gloo (``mesh.native``: tag 0, so messages pair by
    posting order alone; one work per batch, as NCCL's coalescing returns): every schedule still
    equals one process, tied embedding and LM head included."""
    _check(shape, layers, {**options, "native": True})


@pytest.mark.parametrize("schedule,native", [("1f1b", False), ("interleaved_1f1b", True)])
def test_pipeline_with_data_parallel_zero3_and_clipping(schedule, native):
    """pp2 x dp2: ZeRO-3 on dp inside each stage, the tied embedding summed over pp, the global
    norm counting every element once across pp and dp (both transfer paths). Interleaved: each
    rank's two model chunks have ZeRO chunks of their own, and a step gathers each once per
    forward and once per backward of its model chunk, as the stage plan counts (_check; it
    gathered every chunk of the rank for each, twice the bytes, before the split)."""
    _check({"pp": 2, "dp": 2}, 4, {"schedule": schedule, "microbatches": 2, "zero_stage": 3, "native": native},
           clip=0.05)


def test_pipeline_x_data_x_tensor_parallel_on_8_ranks():
    """pp2 x dp2 x tp2: Megatron layers (and the vocabulary-parallel tied embedding) inside each
    stage, ZeRO-1 on dp, tied-gradient sums over pp, clipping over all three axes."""
    from shardlib.models import gpt_preset

    _check({"pp": 2, "dp": 2, "tp": 2}, 4, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 1,
                                           "specs": gpt_preset().specs}, clip=0.05)


SP_CASES = [
    ({"pp": 2, "tp": 2}, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 1}),
    ({"pp": 2, "tp": 2}, {"schedule": "interleaved_1f1b", "microbatches": 2, "virtual_stages": 2}),
    ({"pp": 2, "tp": 2}, {"schedule": "interleaved_1f1b", "microbatches": 2, "virtual_stages": 2, "native": True}),
    ({"pp": 2, "dp": 2, "tp": 2}, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 3}),
]


@pytest.mark.parametrize("shape,options", SP_CASES)
def test_pipeline_x_sequence_parallel_equals_single_process(shape, options):
    """Megatron's layout over stages (arXiv 2205.05198): stage 0 splits the sequence at ``drop``,
    the boundary transfers carry the sequence shard, the last stage's LM head gathers it; norm
    weights summed over tp on every stage. Losses, gradients, the clipped global norm and the
    parameters after 3 AdamW steps equal one process; each transfer is the predicted shard."""
    from shardlib.mesh import AbstractMesh
    from shardlib.models import gpt_preset

    options = {**options, "specs": gpt_preset().specs, "sequence_parallel": True}
    results = _check(shape, 4, options, clip=0.05)
    planned = shardlib.plan(GPT(_config(4)), AbstractMesh(shape), gpt_preset().specs, sequence_parallel=True,
                            **{k: v for k, v in options.items() if k not in ("specs", "sequence_parallel", "native")})
    tokens = 8 // shape.get("dp", 1) // options["microbatches"] * 8  # rows per microbatch x sequence
    assert planned.boundary_bytes(tokens) == tokens // 2 * 16 * 4  # the shard: half the sequence
    assert all(r["sent"] == planned.boundary_bytes(tokens) for r in results)


def test_pipeline_option_errors():
    mesh = shardlib.init_mesh({"dp": 1})
    with pytest.raises(ShardingError, match="needs a pipeline axis"):
        shardlib.shard(GPT(_config(2)), mesh, microbatches=4)


def _fail_mid_schedule():
    mesh = shardlib.init_mesh({"pp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config(4)), mesh, microbatches=4)
    calls = []

    def criterion(logits, y):
        calls.append(1)
        if len(calls) == 2:  # the last stage fails on its second microbatch
            raise RuntimeError("boom in the criterion at microbatch 1")
        return ce(logits, y)

    x = _batches(8)[0]
    smodel.forward_backward(x[:, :-1], criterion=criterion, labels=(x[:, 1:],))


def test_rank_failing_mid_schedule_ends_every_rank():
    """The last stage raises while the first waits for a gradient: every rank stops, with the
    failing rank's message, long before the collective timeout."""
    import time

    from shardlib.mesh.launch import WorkerGroup

    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed with RuntimeError: boom in the criterion") as err:
        with WorkerGroup(2, timeout=60) as group:
            group.run(_fail_mid_schedule)
    assert time.monotonic() - start < 45
    assert "still running" in err.value.message


def _explain_worker():
    mesh = shardlib.init_mesh({"pp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config(4)), mesh, microbatches=4, schedule="gpipe")
    x = _batches(8)[0]
    smodel.forward_backward(x[:, :-1], criterion=ce, labels=(x[:, 1:],))
    return smodel.explain(), smodel.timeline


def test_pipeline_explain_and_timeline_picture():
    (text, tl0), (_, tl1) = run_on(2, _explain_worker)
    assert "schedule gpipe, 4 microbatches\n  bubble (p-1)/(vm+p-1) = 0.200" in text  # two lines (width, issue 14)
    assert "peak stashed microbatches per rank [4, 4]" in text
    assert "stage 0 on rank 0: embed, blocks.0, blocks.1" in text and "bytes per boundary transfer" in text
    from shardlib.parallel.pipeline import measured_bubble, timeline_svg

    svg = timeline_svg([tl0, tl1])
    assert svg.startswith("<svg") and svg.count("<rect") == 16 and "<title>0F0:" in svg and "<title>1B3:" in svg
    assert all(0 <= b < 1 for b in measured_bubble([tl0, tl1]))


def test_bubble_benchmark_smoke():
    """The benchmark runs at a tiny size (its 5% target is checked by the benchmark itself)."""
    from benchmarks.pipeline_bubble import measure

    rows = measure(2, 4, forward_ms=2.0)
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]
    assert all(len(r["measured"]) == 2 and len(r["idle_s"]) == 2 for r in rows)
    assert rows[1]["idle_ratio_vs_1f1b"] == 1.0 and rows[3]["theory_ratio_vs_1f1b"] == pytest.approx(1 / 3)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pp=st.sampled_from([2, 4]),
    microbatches=st.sampled_from([1, 2, 3, 4, 8]),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]),
    stage=st.integers(0, 3),
)
def test_pipeline_equivalence_hypothesis(pp, microbatches, schedule, stage):
    """Random pipeline configurations equal one process; interleaving needs microbatches
    divisible by pp, DualPipeV at least 2 pp (else the documented error, on every rank before any
    transfer). In float64:
    fp32 AdamW amplifies rounding differences of near-eps gradient elements (see
    tests/test_gpt_sharded.py), and random draws would hit that now and then."""
    options = {"schedule": schedule, "microbatches": microbatches, "zero_stage": stage, "dtype": torch.float64}
    layers = 4
    if schedule in ("interleaved_1f1b", "zbv", "dualpipev"):  # two chunks per rank (a V for the last two)
        options["virtual_stages"] = 2
        layers = 2 * pp - 2  # plus embed and head: 2 * pp layers
        if microbatches % pp and schedule == "interleaved_1f1b" or microbatches < 2 * pp and schedule == "dualpipev":
            with pytest.raises(ShardingError, match="multiple of the pipeline size|at least as many microbatches"):
                shardlib.parallel.schedules.build_schedule(schedule, pp, microbatches, 2)
            return
    _check({"pp": pp}, layers, options, rows=microbatches * 2)


def _accumulated_grads(shape, options, calls):
    """Full gradients after ``forward_backward`` on each batch of ``calls`` (``("sync" | "no_sync" |
    "zero_grad", seed)``) with no optimizer step, float64, the tied GPT."""
    import contextlib

    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=16)).double(), mesh,
                            **options)
    for how, seed in calls:
        b = torch.randint(0, 37, (8, 9), generator=torch.Generator().manual_seed(seed))
        x, y = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in (b[:, :-1], b[:, 1:]))
        if how == "zero_grad":
            smodel.zero_grad()
        with smodel.no_sync() if how == "no_sync" else contextlib.nullcontext():
            if "pp" in shape:
                smodel.forward_backward(x, criterion=ce, labels=(y,))
            else:
                ce(smodel(x)[0], y).backward()
    return shardlib.full_grads(smodel)


@pytest.mark.parametrize("shape,options", [({"pp": 2}, {}), ({"pp": 2, "dp": 2}, {"zero_stage": 0}),
                                           ({"pp": 2, "dp": 2}, {"zero_stage": 1})])
def test_tied_gradients_accumulate_over_forward_backward_calls(shape, options):
    """Two forward_backward calls without zero_grad accumulate, as two backward() calls do: at
    ZeRO stage 0 the tied embedding / LM head held on both pp ranks got 2 g0 + g1 (each call's
    sum over pp added the gradient the last call had summed again; 0.108 off; found by a
    new-user test). Also with no_sync() around the first call, and with zero_grad between
    them (g1 alone). Float64: the sums differ from one process only by rounding order."""
    calls = {"sync": [("sync", 0), ("sync", 1)], "no_sync": [("no_sync", 0), ("sync", 1)],
             "zero_grad": [("sync", 0), ("zero_grad", 1)]}
    n = 1
    for size in shape.values():
        n *= size
    for kind, seq in calls.items():
        ref = run_on(1, _accumulated_grads, {"dp": 1}, {}, seq)[0]
        got = run_on(n, _accumulated_grads, shape, dict(options, microbatches=2), seq)[0]
        for name, want in ref.items():
            assert torch.allclose(got[name], want, rtol=1e-10, atol=1e-13), (kind, name, (got[name] - want).abs().max())



def _optimizer_on_a_rank_without_trainable_parameters():
    mesh = shardlib.init_mesh({"pp": 3})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), FrozenConstant(),
                                torch.nn.Linear(8, 8))
    smodel = shardlib.shard(model, mesh, schedule="1f1b", microbatches=3, split_points=["3", "4"])
    try:
        shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_an_optimizer_over_a_pipeline_with_a_rank_without_trainable_parameters_is_refused_on_every_rank():
    """A partition may leave a pp rank without a trainable parameter (forward_backward works:
    test_zero_bubble.test_sequential_stages_that_broke). ZeroOptimizer raised on that rank alone,
    and the others went on into the step until the launcher stopped them (found by a new-user
    test); every rank now raises the same error, naming the rank, its layers and the fixes."""
    said = run_on(3, _optimizer_on_a_rank_without_trainable_parameters)
    assert said[0] == said[1] == said[2], said
    assert "pp rank 1 of the pipeline on mesh {'pp': 3} holds no trainable parameter (stage layers: {1: [['3']]})" in said[0]
    assert "Fix: split_points= that give every pp rank a layer with trainable parameters" in said[0]


class _BiasFreeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _bias_free_pipeline():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), _BiasFreeBlock(), _BiasFreeBlock()).double()


def _clipped_step_on_pp_x_tp():
    mesh = shardlib.init_mesh({"pp": 2, "tp": 2})
    specs = {"*.up.weight": shardlib.P("tp", None), "*.down.weight": shardlib.P(None, "tp")}
    smodel = shardlib.shard(_bias_free_pipeline(), mesh, specs, microbatches=2, split_points=["2"])
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1, max_grad_norm=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)
    smodel.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
    opt.step()
    return opt.last_grad_norm, shardlib.full_state_dict(smodel)


def test_clipping_on_a_pipeline_whose_stage_holds_only_tensor_sharded_parameters():
    """pp=2 x tp=2 where the second stage holds only tensor-parallel weights (bias-free blocks):
    the norm's all-reduce of the replicated kind was issued by the first stage's ranks only, a
    CollectiveMismatchError after the watchdog's 30 s (found while checking a new-user finding).
    The kinds now come from every stage's plan, the same on every rank; the norm and the clipped
    step equal one process (float64)."""
    results = run_on(4, _clipped_step_on_pp_x_tp)
    model = _bias_free_pipeline()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for got_norm, state in results:
        assert got_norm.item() == pytest.approx(norm.item(), rel=1e-12)
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-12, atol=1e-14, msg=name)
