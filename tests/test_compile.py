"""torch.compile over sharded models: ZeRO 0-3 and tensor/sequence parallelism against one process.

shardlib's collectives and the ZeRO runtime run eagerly under ``torch.compile`` (a graph break
at each: :mod:`shardlib.mesh.eager`); the code between them compiles. Each equivalence test
trains the compiled sharded model beside the uncompiled single-process model
(:func:`~shardlib.testing.assert_equivalent`: losses, gradients and parameters after each of 3
AdamW steps), checks from Dynamo's counters that compiled graphs ran and that the steps after the
first compiled nothing new, and that every collective was counted as the plan predicts.
"""

import pytest
import torch
import torch.nn.functional as F

import shardlib
from shardlib.errors import ShardingError, WorkerError
from shardlib.mesh import AbstractMesh
from shardlib.mesh.eager import eager
from shardlib.models import GPT, GPTConfig, gpt_preset, llama_preset
from shardlib.testing import assert_equivalent, run_on

pytestmark = pytest.mark.multiprocess

VOCAB = 32


def make_gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16))


def make_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def lm_loss(output, targets):
    logits = output[0] if isinstance(output, tuple) else output.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _batch(rows=4, seq=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(make, shape, specs, backend="aot_eager", lr=1e-2, **options) -> int:
    """Train compiled against one process; return the number of graphs Dynamo compiled."""
    batch = _batch()
    report = assert_equivalent(make, shape, specs, batch, steps=3, loss_fn=lm_loss, optimizer_kwargs={"lr": lr},
                               compile={"backend": backend}, **options)
    graphs = [r["graphs"] for r in report["records"]]
    assert graphs[0]["unique_graphs"] > 0 and graphs[0]["calls_captured"] > 0, graphs
    assert graphs[-1] == graphs[0], f"the steps after the first compiled again: {graphs}"
    plan = report["plan"]
    tokens = batch[0].numel() // plan.data_size if "tp" in shape else None
    for step, comm in enumerate(report["comm"]):  # every collective ran, once, through the accounting
        assert comm == plan.comm_per_step(tokens=tokens), (step, comm, plan.comm_per_step(tokens=tokens))
    return graphs[0]["unique_graphs"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_zero_equals_single_process(stage):
    """ZeRO stages 0-3 on dp=2 under aot_eager. Stages 0-2 compile the whole forward as one graph
    (their hooks run in backward); stage 3 breaks it where module hooks gather and free chunks
    (before the fix Dynamo traced those hooks and read a freed parameter: ShardedAwayError)."""
    graphs = _train(make_gpt, {"dp": 2}, None, zero_stage=stage, chunk_size=300)
    if stage < 3:
        assert graphs == 1


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_tensor_parallel_equals_single_process(sp):
    """GPT with Megatron TP on tp=2, with and without sequence parallelism, under aot_eager
    (before the fix AOT autograd crashed in the LM head's all-gather: "incorrect out shape after
    application of ViewMeta sequence")."""
    _train(make_gpt, {"tp": 2}, gpt_preset().specs, sequence_parallel=sp)


@pytest.mark.parametrize("stage,sp", [(3, False), (0, True)])
def test_eager_backend(stage, sp):
    """The same with ``backend="eager"`` (Dynamo only, no AOT autograd): ZeRO-3 on dp=2, and
    TP with sequence parallelism on tp=2."""
    shape, specs = ({"dp": 2}, None) if stage == 3 else ({"tp": 2}, gpt_preset().specs)
    _train(make_gpt, shape, specs, backend="eager", zero_stage=stage, sequence_parallel=sp)


def test_compiled_hf_llama_tensor_and_sequence_parallel():
    """Unmodified Hugging Face LLaMA with llama_preset() on tp=2 with sequence parallelism, under
    aot_eager (lr 1e-3: at 1e-2 fp32 rounding alone scatters the single-process run by step 2)."""
    preset = llama_preset()
    _train(make_llama, {"tp": 2}, preset.specs, lr=1e-3, sequence_parallel=True, **preset.options)


def _step_worker(stage):
    from torch._dynamo import reset

    mesh = shardlib.init_mesh({"dp": 2})
    x, y = (shardlib.distribute(t, mesh, shardlib.P("dp")) for t in _batch())
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        smodel = shardlib.shard(make_gpt(), mesh, zero_stage=stage, chunk_size=300)
        opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)

        def step(x, y):
            loss = lm_loss(smodel(x), y)
            loss.backward()
            return loss.detach()

        reset()
        run = torch.compile(step, backend="aot_eager") if compiled else step
        losses, grads = [], []
        for _ in range(2):
            losses.append(run(x, y).item())
            grads.append(shardlib.full_grads(smodel))
            opt.step()
            opt.zero_grad()
        runs.append((losses, grads, shardlib.full_state_dict(smodel)))
    return runs


def test_compiled_step_with_backward_inside():
    """A compiled training step that calls ``backward()`` itself: Dynamo then also meets ZeRO-3's
    gradient hooks and end-of-backward callback (at 59e6484 the forward hooks crashed it first,
    ShardedAwayError; with only those fixed, compiling the gradient hooks crashed with "sources
    must not be empty for symbol"). Losses, gradients and parameters match the eager sharded run
    (itself equal to one process: the tests above and tests/test_zero.py) within fp32's default
    1e-5 of each tensor's scale (measured gradient difference: 0)."""
    for (losses, grads, params), (c_losses, c_grads, c_params) in run_on(2, _step_worker, 3):
        assert c_losses == pytest.approx(losses, rel=1e-5)
        for step_grads, c_step_grads in zip(grads, c_grads):
            for name, g in step_grads.items():
                assert (c_step_grads[name] - g).abs().max() <= 1e-5 * g.abs().max(), name
        for name, p in params.items():
            assert (c_params[name] - p).abs().max() <= 1e-5 * p.abs().max(), name


def _fullgraph_worker():
    from torch._dynamo import reset

    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(make_gpt(), mesh, gpt_preset().specs)
    reset()  # the pool's worker may hold compiled frames of these classes from other tests
    x, _ = _batch(2)
    torch.compile(smodel, backend="eager", fullgraph=True)(x)


def test_fullgraph_is_refused_naming_the_collective():
    """fullgraph=True cannot hold shardlib's collectives: every rank refuses at trace time, before
    any collective runs (so none waits for another), naming the first one (the vocabulary-parallel
    embedding's all-reduce)."""
    with pytest.raises(WorkerError, match=r"shardlib runs shardlib\.mesh\.collectives\.all_reduce eagerly: it issues "
                                          r"collectives or changes ZeRO state, which torch\.compile does not trace") as info:
        run_on(2, _fullgraph_worker)
    assert sorted(info.value.errors) == [0, 1] and {t for t, _ in info.value.errors.values()} == {"Unsupported"}


def _trace_worker():
    from torch._dynamo import reset

    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(make_gpt(), mesh, gpt_preset().specs)
    reset()
    x, y = _batch(2)
    fields = ("kind", "group", "shape", "dtype", "note", "site", "caller")

    def step(model):
        before = mesh.trace.seq
        lm_loss(model(x), y).backward()
        return [tuple(r[k] for k in fields) for r in mesh.trace.records(mesh.trace.seq - before)]

    plain, compiled = step(smodel), step(torch.compile(smodel, backend="aot_eager"))
    from torch._dynamo.convert_frame import input_codes  # (not public: the code objects Dynamo was given)

    return plain, compiled, {code().co_filename.rpartition("/")[2] for code in input_codes.seen if code() is not None}


def test_collective_trace_under_compile_is_the_eager_trace():
    """The collective trace records the collectives of a compiled step as those of an eager step:
    the same kinds, groups, shapes, library call sites and user frames, in the same order. Check
    mode's look at the batch is not compiled."""
    for plain, compiled, traced in run_on(2, _trace_worker):
        assert compiled == plain
        # check mode's batch check runs eagerly, as one graph break: at 4ea0ece Dynamo compiled its
        # frames one by one (12 frames, 5 more graphs than without check mode)
        assert "local_batch.py" not in traced and "shard.py" in traced, traced
        step = [r for r in plain if not r[4].startswith("check:")]  # check mode's own (the batch's checksum)
        kinds = [r[0] for r in step]
        assert kinds.count("all_reduce") == 6 and kinds.count("all_gather") == 1, kinds  # TP forward and backward
        assert {r[5].split(":")[0] for r in step} == {"tensor.py", "test_compile.py"}  # backward: from .backward()


def test_eager_function_runs_eagerly_inside_compiled_code():
    """A function marked ``eager`` runs outside Dynamo (``is_compiling()`` False) between two
    compiled graphs, with its result and gradient; outside compile it is the plain function."""
    seen = []

    @eager
    def double(t):
        seen.append(torch.compiler.is_compiling())
        return t * 2

    def f(t):
        return double(t.sin()).cos()

    x = torch.randn(5, requires_grad=True)
    expected = f(x)
    (grad,) = torch.autograd.grad(expected.sum(), x)
    got = torch.compile(f, backend="aot_eager")(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert torch.equal(got, expected) and torch.equal(got_grad, grad)
    assert seen and not any(seen)
    assert double.__wrapped__.__name__ == "double"


def test_mesh_queries_compile_without_graph_breaks():
    """Mesh sizes, coordinates and indices are integer arithmetic that Dynamo folds into
    constants (numpy's unravel_index was a graph break, then ``aten._local_scalar_dense`` in
    AOT autograd); a coordinate outside the mesh is refused with the mesh named."""
    mesh = AbstractMesh({"dp": 2, "tp": 3}, rank=4)

    def f(t):
        return t * mesh.index("tp") + mesh.size("dp") * mesh.index(("dp", "tp")) + mesh.coords(5)["dp"]

    x = torch.ones(2)
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(x), x * 1 + 2 * 4 + 1)
    assert mesh.coords(5) == {"dp": 1, "tp": 2} and mesh.size() == 6
    with pytest.raises(ShardingError, match=r"rank 6 is outside the mesh \{'dp': 2, 'tp': 3\} of 6 ranks"):
        mesh.coords(6)
