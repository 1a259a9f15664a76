"""Activation checkpointing as a plan option (``shard(..., activation_checkpointing=...)``).

What it selects (the forms, the blocks found, the refusals), that training with it equals one
process without it (ZeRO 0-3, tensor + sequence parallel, pipelines, dropout on, a frozen
parameter inside a block), that it is the same plan without it bit for bit (mixed precision,
activation offload) with the collectives the plan predicts, and that it lowers the activation
peak it exists to lower.
"""

import functools
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlib
from shardlib.errors import ShardingError
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig, gpt_preset
from shardlib.parallel.recompute import transformer_blocks
from shardlib.testing import run_on
from shardlib.testing.tolerance import ReferenceRun, reference_with_bands

sys.path.insert(0, str(Path(__file__).parent))
import test_pipeline_dropout as dropout_cases  # noqa: E402 - its batches, training loop and comparison

SEED = dropout_cases.SEED


def _gpt(layers=4, dropout=0.0, freeze=False):
    model = GPT(dropout_cases._config(layers, dropout))
    if freeze:  # a frozen parameter inside a checkpointed block (DeepSpeed's recompute saw it freed)
        model.blocks[1].ln_1.weight.requires_grad_(False)
    return model


# -- what it selects ------------------------------------------------------------------------------

def test_forms_select_the_blocks():
    mesh = AbstractMesh({"dp": 2})
    blocks = [f"blocks.{i}" for i in range(4)]
    assert transformer_blocks(_gpt()) == blocks
    for value, expected in [("full", [(b, "full") for b in blocks]), (True, [(b, "full") for b in blocks]),
                            ("selective", [(b, "selective") for b in blocks]),
                            (2, [("blocks.1", "full"), ("blocks.3", "full")]), (4, [("blocks.3", "full")]),
                            (None, []), (False, [])]:
        p = shardlib.plan(_gpt(), mesh, zero_stage=3, activation_checkpointing=value)
        assert list(p.activation_checkpointing) == expected, value
        assert pickle.loads(pickle.dumps(p)) == p
    # a function: asked in module order, not inside what it chose
    asked = []

    def choose(path, module):
        asked.append(path)
        return {"blocks.0": "selective", "blocks.2.mlp": True}.get(path, False)

    p = shardlib.plan(_gpt(), mesh, activation_checkpointing=choose)
    assert p.activation_checkpointing == (("blocks.0", "selective"), ("blocks.2.mlp", "full"))
    assert not any(a.startswith("blocks.0.") or a.startswith("blocks.2.mlp.") for a in asked)
    assert "blocks.2.attn" in asked
    text = p.explain()
    assert "activation checkpointing: full on 1 module (blocks.2.mlp); selective on 1 module (blocks.0)" in text
    full = shardlib.plan(_gpt(), mesh, activation_checkpointing="full").explain()
    assert "activation checkpointing: full on 4 modules (blocks.0, blocks.1, ..., blocks.3)" in full


def test_hugging_face_blocks_and_the_cache():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=37, n_embd=16, n_layer=3, n_head=4, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    assert transformer_blocks(model) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]  # _no_split_modules
    p = shardlib.plan(model, AbstractMesh({"dp": 2}), activation_checkpointing="selective")
    assert [path for path, _ in p.activation_checkpointing] == transformer_blocks(model)
    model.config.use_cache = True  # each recompute would append to the returned cache again
    with pytest.raises(ShardingError, match=r"config.use_cache=True.*Fix: model.config.use_cache = False"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), activation_checkpointing="full")


@pytest.mark.parametrize("value,match", [
    ("ful", r"must be None, 'full', 'selective', an int k >= 1"),
    (0, r"must be None, 'full', 'selective', an int k >= 1"),
    (5, r"activation_checkpointing=5 \(every 5-th block\) on GPT, which has 4 transformer blocks.*\[1, 4\]"),
    (lambda path, m: 3 if path == "blocks.0" else False, r"returned 3 for module 'blocks.0' \(Block\)"),
    (lambda path, m: False, r"selected no module of GPT"),
])
def test_bad_values_are_refused(value, match):
    with pytest.raises(ShardingError, match=match):
        shardlib.plan(_gpt(), AbstractMesh({"dp": 2}), activation_checkpointing=value)


def test_bert_blocks_are_its_layers_not_its_embeddings():
    """BERT's _no_split_modules also names its embeddings class: the blocks are the elements of a
    ModuleList only (before: ['embeddings', 'encoder.layer.0', ...], and k=5 passed on 4 layers)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=37, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    model = transformers.BertModel(cfg)
    assert "BertEmbeddings" in model._no_split_modules
    assert transformer_blocks(model) == [f"encoder.layer.{i}" for i in range(4)]
    with pytest.raises(ShardingError, match="which has 4 transformer blocks"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), activation_checkpointing=5)


def test_a_container_choice_and_a_stage_flag_are_refused():
    """A ModuleList is never called, so choosing it would recompute nothing while explain() said
    it does; strict_specs=False (a spec option) does not silence a function that chose nothing."""
    with pytest.raises(ShardingError, match=r"chose 'blocks', a ModuleList, which is never called.*blocks.0"):
        shardlib.plan(_gpt(), AbstractMesh({"dp": 2}), activation_checkpointing=lambda p, m: isinstance(m, nn.ModuleList))
    with pytest.raises(ShardingError, match="selected no module"):
        shardlib.plan(_gpt(), AbstractMesh({"dp": 2}), activation_checkpointing=lambda p, m: p == "block.0",
                      strict_specs=False)


class _KeywordBlock(nn.Module):
    """A block whose forward takes keywords torch.utils.checkpoint also has (debug, determinism_check)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, debug=False, determinism_check="none"):
        return torch.tanh(self.fc(x)) * (2.0 if debug else 1.0) + (determinism_check == "x")


class _KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_KeywordBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, debug=True, determinism_check="x")
        return x.square().mean()


def _single(model_fn, ac, backward):
    mesh = shardlib.init_mesh({"dp": 1})
    torch.manual_seed(0)
    smodel = shardlib.shard(model_fn(), mesh, activation_checkpointing=ac)
    backward(smodel)
    return {n: p.grad.clone() for n, p in smodel.module.named_parameters()}


def test_keywords_reach_the_module_and_a_retained_graph_recomputes_again():
    """The module's own keywords reach it (before: debug=True went to checkpoint() and raised,
    determinism_check= was taken by it), and a second backward through a retained graph
    recomputes again under full recompute (before: the one-shot recompute context raised
    AttributeError); gradients equal the run without checkpointing exactly."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))

    def twice(smodel):
        loss = smodel(x)
        loss.backward(retain_graph=True)
        loss.backward()

    plain = _single(_KeywordNet, None, twice)
    for name, grad in _single(_KeywordNet, "full", twice).items():
        assert torch.equal(grad, plain[name]), name
    with pytest.raises(RuntimeError, match="only allowed to backward once"):  # torch's limit of selective checkpointing
        _single(_KeywordNet, "selective", twice)


def test_a_cache_passed_at_call_time_is_refused():
    """config.use_cache=False but use_cache=True in the call: each recompute would append to the
    returned cache again (measured: 16 entries instead of 8), so the forward refuses it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=37, n_embd=16, n_layer=2, n_head=4, n_positions=16, use_cache=False)
    mesh = shardlib.init_mesh({"dp": 1})
    smodel = shardlib.shard(transformers.GPT2LMHeadModel(cfg), mesh, activation_checkpointing="full")
    with pytest.raises(RuntimeError, match=r"recomputes 'transformer.h.0'.*Fix: call the model with use_cache=False"):
        smodel(torch.zeros(1, 8, dtype=torch.long), use_cache=True)


def test_no_blocks_found_names_the_fix():
    with pytest.raises(ShardingError, match=r"found no transformer blocks in Sequential.*Fix: pass "
                                            r"activation_checkpointing=lambda path, module"):
        shardlib.plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), AbstractMesh({"dp": 2}), activation_checkpointing="full")


# -- equal to one process without it --------------------------------------------------------------

def _build(shape, options):
    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    options = dict(options)
    specs = gpt_preset().specs if options.pop("tp_specs", False) else None
    smodel = shardlib.shard(_gpt(4, 0.5, freeze=True), mesh, specs, chunk_size=400, dropout_seed=SEED, **options)
    return mesh, smodel, shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)


def _worker(shape, options):
    mesh, smodel, opt = _build(shape, options)
    return {"records": dropout_cases._train(mesh, smodel, opt, dropout_cases._batches()), "recomputed": smodel.recomputed}


def _reference_run(runs):
    torch.manual_seed(0)
    model = _gpt(4, 0.5, freeze=True)
    shardlib.random.mesh_independent_dropout(model, seed=SEED)
    batches = dropout_cases._batches()
    run = ReferenceRun(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                       lambda m, step: m(batches[step][:, :-1], batches[step][:, 1:])[1])
    runs.append(run)
    return run


CASES = [
    ({"dp": 2}, {"zero_stage": 3, "activation_checkpointing": "full"}),
    ({"dp": 2}, {"zero_stage": 1, "activation_checkpointing": "selective"}),
    ({"tp": 2}, {"tp_specs": True, "sequence_parallel": True, "activation_checkpointing": 2}),
    ({"pp": 2}, {"schedule": "1f1b", "microbatches": 2, "activation_checkpointing": "selective"}),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape,options", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_checkpointed_training_equals_single_process(shape, options):
    """Losses, gradients and parameters after 3 AdamW steps equal one process's without
    checkpointing (the harness's fp32 tolerance model), with dropout 0.5 (the recompute draws
    the forward's masks: MeshDropout refuses a recompute it does not replay) and blocks.1's
    ln_1.weight frozen; the plan's modules were really wrapped on every rank."""
    world = 1
    for size in shape.values():
        world *= size
    results = run_on(world, _worker, shape, options)
    runs = []
    ref, bands = reference_with_bands(functools.partial(_reference_run, runs), dropout_cases.STEPS, dropout_cases.RTOL)
    dropout_cases._compare(results, ref, bands)
    held = sorted(path for r in results for path in r["recomputed"])
    every = [f"blocks.{i}" for i in range(4)]
    assert sorted(set(held)) == (every[1::2] if options["activation_checkpointing"] == 2 else every)


# -- the same plan without it, bit for bit, and the collectives the plan predicts -----------------

def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _steps(shape, options, ac):
    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    options = dict(options)
    specs = gpt_preset().specs if options.pop("tp_specs", False) else None
    smodel = shardlib.shard(_gpt(3, options.pop("dropout", 0.3), freeze=True), mesh, specs, chunk_size=400, activation_checkpointing=ac,
                            **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    out = []
    for x in dropout_cases._batches()[:2]:
        xl = shardlib.distribute(x, mesh, smodel.batch_spec)
        mesh.comm.reset()
        if isinstance(smodel, shardlib.PipelineModule):
            smodel.forward_backward(xl[:, :-1], criterion=_ce, labels=(xl[:, 1:],))
        else:
            smodel(xl[:, :-1], xl[:, 1:])[1].backward()
        opt.step()  # (full_grads after it: its gathers are not the step's)
        table = mesh.comm.table()
        grads = shardlib.full_grads(smodel)
        opt.zero_grad()
        out.append({"grads": grads, "params": shardlib.full_state_dict(smodel), "table": table})
    tokens = xl.shape[0] * (xl.shape[1] - 1)
    return out, smodel.plan.comm_per_step(tokens=tokens), smodel.recomputed


def _bitwise_worker(shape, options):
    plain, plain_plan, _ = _steps(shape, options, None)
    found = []
    for ac in ("full", "selective"):
        steps, predicted, recomputed = _steps(shape, options, ac)
        assert recomputed, ac
        for a, b in zip(plain, steps):
            for key in ("grads", "params"):
                for name, t in a[key].items():
                    assert (t is None) == (b[key][name] is None), (ac, key, name)
                    if t is not None:
                        assert torch.equal(t, b[key][name]), (ac, key, name, (t - b[key][name]).abs().max())
        found.append(([s["table"] for s in steps], predicted, [s["table"] for s in plain], plain_plan))
    return found


BITWISE = [
    ({"dp": 2}, {"zero_stage": 3, "param_dtype": torch.bfloat16}),
    ({"dp": 2}, {"zero_stage": 2, "offload_ratio": 0.5}),
    ({"dp": 2}, {"zero_stage": 0}),
    ({"tp": 2}, {"tp_specs": True, "sequence_parallel": True}),
    ({"tp": 2}, {"tp_specs": True, "dropout": 0.0}),  # torch's early stop skipped the last all-reduce here
    ({"pp": 2}, {"microbatches": 2}),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape,options", BITWISE, ids=lambda v: str(v).replace(" ", ""))
def test_checkpointing_is_the_plan_without_it_bit_for_bit(shape, options):
    """Full and selective recompute give the gradients and parameters of the same plan without
    checkpointing exactly (measured: max difference 0.0 on every case; the recompute runs the
    same kernels on the same values, and the dropout masks are replayed), so every equivalence
    test of these plans carries over. Each step's counted collectives equal the plan's
    ``comm_per_step``: under ZeRO the table without checkpointing (a recompute gathers no chunk
    backward does not gather anyway), under tensor + sequence parallelism that table plus the
    checkpointed blocks' forward collectives once more (the recompute runs them again)."""
    for rank in run_on(2, _bitwise_worker, shape, options):
        for tables, predicted, plain_tables, plain_predicted in rank:
            for table, plain in zip(tables, plain_tables):
                _check_tables(shape, table, predicted, plain, plain_predicted)


def _check_tables(shape, table, predicted, plain, plain_predicted):
    if "pp" not in shape:  # a pipeline's plan is per stage: its transfers are not in comm_per_step
        assert table == predicted
        assert plain == plain_predicted
    if "tp" in shape:
        assert table != plain and predicted != plain_predicted  # the recompute's collectives, counted
    else:
        assert table == plain


# -- what it is for ------------------------------------------------------------------------------

def test_activation_peak_falls():
    """The activation peak of one forward and backward (torch's MemTracker, CPU) is lower with
    selective recompute than without, and lower still with full recompute (measured on this
    4-block GPT, batch 8 x 64: 8.46 MB, 5.92 MB, 2.38 MB)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mem_tracker import _MemRefType as Ref

    mesh = shardlib.init_mesh({"dp": 1})
    peaks = {}
    for ac in (None, "selective", "full"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0))
        smodel = shardlib.shard(model, mesh, activation_checkpointing=ac)
        x = torch.randint(0, 64, (8, 65), generator=torch.Generator().manual_seed(0))
        tracker = MemTracker()
        tracker.track_external(smodel)
        with tracker:
            smodel(x[:, :-1], x[:, 1:])[1].backward()
        peaks[ac] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")][Ref.ACT]
    assert peaks["full"] < 0.5 * peaks["selective"] and peaks["selective"] < 0.85 * peaks[None], peaks


class _BufferBlock(nn.Module):
    """A block whose forward changes buffers: BatchNorm's statistics (updated by its kernel with
    no version bump), a counter read after its in-place update, and a buffer assigned anew."""

    def __init__(self, h=8):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(h, h), nn.BatchNorm1d(h), nn.Linear(h, h)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.calls += 1
        self.seen = self.seen + x.detach().mean()
        return x + self.fc2(F.gelu(self.bn(self.fc1(x)))) * (1 + 0.1 * self.calls) + 0.01 * self.seen


class _PlainBlock(nn.Module):
    """A block with nothing a recompute must restore (no buffer, no dropout)."""

    def __init__(self, h=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class _BufferNet(nn.Module):
    def __init__(self, block=None):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList((block or _BufferBlock)() for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).pow(2).mean()


def _buffer_steps(model, smodel=None, steps=3, run=None):
    """Three SGD steps on fixed batches (through ``smodel`` and a ZeroOptimizer when given);
    the state (parameters and buffers) and the last gradients."""
    opt = (shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=0.1) if smodel is not None else
           torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        step = run if run is not None else smodel if smodel is not None else model
        step(torch.randn(6, 4, generator=g, dtype=torch.float64)).backward()
        grads = (shardlib.full_grads(smodel) if smodel is not None else
                 {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    state = shardlib.full_state_dict(smodel) if smodel is not None else model.state_dict()
    return {k: v.clone() for k, v in state.items()}, grads


@pytest.mark.parametrize("zero_stage,compiled", [(0, False), (3, False), (0, True)], ids=["zero0", "zero3", "compiled"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_recompute_leaves_the_buffers_as_the_forward_left_them(ac, zero_stage, compiled):
    """Regression (a new user's pass): each recompute ran the block's buffer updates again, so
    BatchNorm's num_batches_tracked and a counter read 6 after 3 steps and the running statistics
    took two momentum steps per step (0.07 off), silently, while the parameters stayed exact.
    Now buffers, gradients and parameters equal the run without checkpointing (float64, the same
    ops; measured difference 0), also under torch.compile (a compiled recompute counted 6: the
    blocks holding buffers run eagerly, with these contexts)."""
    torch.manual_seed(0)
    plain_state, plain_grads = _buffer_steps(_BufferNet().double())
    mesh = shardlib.init_mesh({"dp": 1})
    torch.manual_seed(0)
    smodel = shardlib.shard(_BufferNet().double(), mesh, zero_stage=zero_stage, activation_checkpointing=ac)
    state, grads = _buffer_steps(None, smodel, run=torch.compile(smodel, backend="aot_eager") if compiled else None)
    assert state["blocks.0.calls"].item() == 3 and state["blocks.1.bn.num_batches_tracked"].item() == 3, state
    for name, value in plain_state.items():
        assert torch.allclose(state[name], value, rtol=0, atol=1e-12), (name, state[name], value)
    for name, value in plain_grads.items():
        assert torch.allclose(grads[name], value, rtol=0, atol=1e-12), name


def _compiled_plain_blocks(ac):
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(_BufferNet(_PlainBlock).double(), mesh, zero_stage=1, activation_checkpointing=ac)
    return _buffer_steps(None, smodel, run=torch.compile(smodel, backend="aot_eager"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_compiled_activation_checkpointing_on_two_ranks_equals_one_process(ac):
    """Regression (a new user's pass): torch.compile of a dp=2 ZeRO-1 model with
    activation_checkpointing raised in AOT autograd ("context_fn ... must generate a tuple of two
    TorchDispatchMode"): shardlib's recompute contexts went to a compiled checkpoint. Blocks
    with nothing to restore now compile with torch's own. float64; each rank's batch is the
    whole batch, so the mean over ranks is one process's step (measured difference 0)."""
    torch.manual_seed(0)
    plain_state, plain_grads = _buffer_steps(_BufferNet(_PlainBlock).double())
    for state, grads in run_on(2, _compiled_plain_blocks, ac):
        for name, value in plain_state.items():
            assert torch.allclose(state[name], value, rtol=0, atol=1e-12), name
        for name, value in plain_grads.items():
            assert torch.allclose(grads[name], value, rtol=0, atol=1e-12), name
