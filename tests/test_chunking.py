"""ZeRO chunks that follow the model (shardlib.chunking): block-aligned packing, the chunk-size
search, the tied chunk alone, explain() of the chunks, and the gathered working set a ZeRO-3
step really holds against the one the search predicts."""

import pickle

import pytest
import torch

import shardlib
from shardlib.chunking import MIN_SEARCHED_CHUNK, gathered_peak, pack
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig
from shardlib.models.gpt import tp_specs
from shardlib.plan_items import plan_entries
from shardlib.testing import assert_equivalent, run_on

# one block is 12 * 160^2 + 13 * 160 = 309,280 elements, above MIN_SEARCHED_CHUNK: one block a chunk
WIDE = GPTConfig(vocab_size=65, block_size=32, n_layer=6, n_head=4, n_embd=160)
NARROW = GPTConfig(vocab_size=65, block_size=32, n_layer=24, n_head=4, n_embd=64)


def _unit_span(plan):
    order = {u: i for i, u in enumerate(dict.fromkeys(p.unit for p in plan.params))}
    return [(order[c.units[0]], order[c.units[-1]]) for c in plan.chunks if c.reshard_after_forward]


def _cost(entries, size, parts):
    chunks = pack(entries, size)
    padding = sum((-(-max(c["numel"], 1) // parts) * parts - c["numel"]) * c["itemsize"] for c in chunks)
    return padding + gathered_peak(chunks, parts, [e.unit for e in entries])


def test_searched_chunks_hold_one_block_each():
    """With no chunk_size, a 6-block GPT gets one chunk per block (the least working set: two
    blocks gathered at once, not the 4 Mi default's 39% of the model), the tied embedding a
    chunk as small as itself, and explain() says so and why."""
    model = GPT(WIDE)
    plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert plan.chunk_search is not None and plan.chunk_size == block
    for i in range(WIDE.n_layer):
        holding = [c for c in plan.chunks if f"blocks.{i}" in c.units]
        assert len(holding) == 1 and holding[0].units == (f"blocks.{i}",), holding
        assert holding[0].numel == block
    kept = [c for c in plan.chunks if not c.reshard_after_forward]
    assert [c.params for c in kept] == [("wte.weight",)] and kept[0].numel == model.wte.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    # gathered at most: the tied embedding, one block and the prefetched next one
    assert plan.chunk_search.working_bytes == 4 * (model.wte.weight.numel() + 2 * block)
    assert plan.chunk_search.working_bytes / (4 * total) < 0.34
    text = plan.explain()
    assert f"<= {block:,} elements (searched)" in text
    assert "blocks.{0..5}, 1 per chunk (float32)" in text and "wte (float32, tied: kept gathered forward to backward)" in text
    again = pickle.loads(pickle.dumps(plan))
    assert again.chunks == plan.chunks and again.chunk_search == plan.chunk_search


def test_search_is_the_least_cost_over_every_size():
    """The searched size's padding + working set is the least of every chunk size from the
    largest unit to the whole model (steps of 1/97 of the range, the candidates' ends too),
    the larger size on a tie; sizes below MIN_SEARCHED_CHUNK or one block (whichever is less)
    are not proposed."""
    for cfg, mesh in ((WIDE, {"dp": 3}), (NARROW, {"dp": 4})):
        model = GPT(cfg)
        block = sum(p.numel() for p in model.blocks[0].parameters())
        plan = shardlib.plan(model, AbstractMesh(mesh), zero_stage=3)
        entries = plan_entries(plan.params, dict(plan.mesh_shape), plan.coords())
        s = plan.chunk_search
        best = _cost(entries, s.size, plan.data_size)
        assert best == s.padding_bytes + s.working_bytes
        step = max(1, (s.high - s.low) // 97)
        for size in list(range(s.low, s.high + 1, step)) + [s.high]:
            assert _cost(entries, size, plan.data_size) >= best, size
        assert s.low >= min(MIN_SEARCHED_CHUNK, block)


def test_blocks_below_the_floor_get_a_chunk_each_and_other_models_keep_it():
    """A block smaller than MIN_SEARCHED_CHUNK is the floor (FSDP2's per-block unit): the narrow
    24-block GPT (49,984 elements a block) gets one chunk per block. A model without transformer
    blocks (a Sequential of small layers: each layer its own unit) keeps the 1 MiB floor."""
    model = GPT(NARROW)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert block < MIN_SEARCHED_CHUNK
    plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3)
    assert plan.chunk_size == block
    for i in range(NARROW.n_layer):
        assert [c.units for c in plan.chunks if f"blocks.{i}" in c.units] == [(f"blocks.{i}",)]
    mlp = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(80)])  # 80 x 4,160 elements
    plan = shardlib.plan(mlp, AbstractMesh({"dp": 2}), zero_stage=3)
    assert plan.chunk_search.low == MIN_SEARCHED_CHUNK and plan.chunk_size >= MIN_SEARCHED_CHUNK


def test_chunks_keep_unit_order_under_tensor_parallel_and_frozen():
    """With groups interleaved (tensor-parallel and replicated parameters, a frozen block), the
    groups' chunks close together at unit boundaries: segment by segment the units run forward, so
    backward's descending gathers never pull a chunk that spans the others (and with it every
    chunk above). The narrow 24-block model at tp=2."""
    model = GPT(NARROW)
    for p in model.blocks[3].parameters():
        p.requires_grad_(False)
    plan = shardlib.plan(model, AbstractMesh({"dp": 2, "tp": 2}), tp_specs(), zero_stage=3)
    spans = _unit_span(plan)
    assert len(spans) >= 6
    for i, (a0, a1) in enumerate(spans):  # segments: the chunks starting at one unit, before the next starts
        for b0, b1 in spans[i + 1:]:
            assert a0 == b0 or a1 < b0, plan.explain(full=True)
    frozen = [c for c in plan.chunks if not c.requires_grad]
    assert frozen and all(c.units == ("blocks.3",) for c in frozen)


def test_given_chunk_size_keeps_whole_modules():
    """A given chunk_size is a bound: no chunk above it but for a parameter larger than it, and
    a module that fits is never split between chunks; explain() says it was given."""
    model = GPT(NARROW)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    for size in (block // 3, block, 2 * block + 10, 10**9):
        plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, chunk_size=size)
        assert plan.chunk_search is None and f"chunk size {size:,} elements (given)" in plan.explain()
        sizes = {p.name: p.numel for p in plan.params}
        for c in plan.chunks:
            assert c.numel <= size or len(c.params) == 1
        if size >= block:
            for i in range(NARROW.n_layer):
                assert sum(f"blocks.{i}" in c.units for c in plan.chunks) == 1
        assert sum(c.numel for c in plan.chunks) == sum(sizes.values())


def test_small_model_one_chunk_and_pipeline_stages():
    """A model smaller than MIN_SEARCHED_CHUNK packs into one chunk (and its tied tensor's);
    pipeline stages take the whole model's blocks as units (a stage's modules hang in
    ModuleDicts, where no block list would be found)."""
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=4, n_head=2, n_embd=16)
    plan = shardlib.plan(GPT(cfg), AbstractMesh({"dp": 2}), zero_stage=3)
    assert len(plan.chunks) == 2 and plan.chunk_search.candidates == 1
    pipe = shardlib.plan(GPT(WIDE), AbstractMesh({"pp": 2, "dp": 2}), zero_stage=3)
    for stage in pipe.stages:
        blocks = [u for u in (p.unit for p in stage.params) if u.startswith("blocks.")]
        assert blocks and all(c.units == (c.units[0],) for c in stage.chunks if c.units[0].startswith("blocks."))


def _gathered_worker():
    """Rank's largest gathered bytes in forward and in backward of one ZeRO-3 step of WIDE."""
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(WIDE), mesh, zero_stage=3)
    zero = smodel._zero
    peak = {"forward": 0, "backward": 0}
    phase = ["forward"]
    gather, free = zero._gather, zero._free

    def count():
        now = sum(c.full.untyped_storage().nbytes() for c in zero.chunks if c.gathered)
        peak[phase[0]] = max(peak[phase[0]], now)

    def _gather(chunk):
        gather(chunk)
        count()

    zero._gather, zero._free = _gather, free
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, WIDE.vocab_size, (2, WIDE.block_size + 1), generator=g)
    _, loss = smodel(x[:, :-1], x[:, 1:])
    phase[0] = "backward"
    loss.backward()
    return peak, smodel.plan.chunk_search.working_bytes


@pytest.mark.multiprocess
def test_zero3_step_gathers_what_the_search_predicts():
    """A ZeRO-3 step of the 6-block GPT at dp=2: the largest gathered bytes in forward equal
    the search's working set (the tied embedding, a block and the prefetched next block), and
    backward holds no more than that plus one block (a block's chunk is freed once its
    gradients are reduced, and its gradients finish after the next block's gather)."""
    block = 4 * sum(p.numel() for p in GPT(WIDE).blocks[0].parameters())
    for peak, predicted in run_on(2, _gathered_worker):
        assert peak["forward"] == predicted
        assert peak["backward"] <= predicted + block, (peak, predicted)


def _grad_buffers_worker(stage):
    """Rank's largest bytes of unreduced gradient buffers (``grad_full``) alive at once in one
    backward of WIDE, sampled after every reduction launch, and the largest chunk's bytes."""
    mesh = shardlib.init_mesh({"dp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(WIDE), mesh, zero_stage=stage)
    zero = smodel._zero
    peak = [0]
    launch = zero._launch_reduce

    def _launch_reduce(chunk):
        launch(chunk)
        alive = sum(c.grad_full.numel() * c.grad_full.element_size() for c in zero.chunks if c.grad_full is not None)
        peak[0] = max(peak[0], alive)

    zero._launch_reduce = _launch_reduce
    deferred = []
    for c in zero.chunks:
        def defer(prm, off, grad, c=c, orig=c.defer):
            deferred.append(c.grad_full is None)  # the chunk's buffer is not allocated before its pack
            orig(prm, off, grad)

        c.defer = defer
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, WIDE.vocab_size, (2, WIDE.block_size + 1), generator=g)
    _, loss = smodel(x[:, :-1], x[:, 1:])
    loss.backward()
    assert all(c.grad_full is None for c in zero.chunks)  # all freed by the end of backward
    # every gradient waited in autograd's own tensor until its chunk was packed
    assert all(deferred) and len(deferred) == sum(p.requires_grad for p in smodel.parameters())
    return peak[0], max(c.nbytes for c in zero.chunks), len(zero.chunks)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_stage_2_3_backward_holds_two_gradient_buffers_at_most(stage):
    """ZeRO-2/3 keep one gradient reduction in flight (FSDP2's reduce-scatter state): an
    earlier chunk's unreduced buffer is freed when the next chunk's reduction starts, not at the
    end of backward, so at most two chunks' ``grad_full`` are alive (before: every chunk's, 7 on
    this 6-block GPT); and a chunk's buffer is allocated only when its gradients are complete,
    each one waiting in autograd's tensor until then (FSDP2's unsharded gradients)."""
    for peak, largest, n in run_on(2, _grad_buffers_worker, stage):
        assert n >= 7
        assert 0 < peak <= 2 * largest, (peak, largest)


@pytest.mark.multiprocess
def test_searched_chunks_equivalent_with_tensor_parallel():
    """Searched chunks at ZeRO-3 with tensor parallelism and a frozen block (groups interleaved,
    closed together): 2 AdamW steps equal one process."""
    cfg = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=96, bias=False)

    def make():
        model = GPT(cfg)
        for p in model.blocks[1].parameters():
            p.requires_grad_(False)
        return model

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
    report = assert_equivalent(make, {"dp": 2, "tp": 2}, tp_specs(), (x[:, :-1], x[:, 1:]), steps=2, zero_stage=3)
    assert report["plan"].chunk_search is not None and len(report["plan"].chunks) >= 5
