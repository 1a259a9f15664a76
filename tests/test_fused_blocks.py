"""Fused projections with unequal blocks (issue 14): ``fused={glob: (block sizes)}``.

Hugging Face Phi-3's ``qkv_proj`` under grouped-query attention is ``[q: H*hd | k: KV*hd | v:
KV*hd]``; each block is split over tp separately, so rank r holds q heads [r*H/tp, (r+1)*H/tp)
and key/value heads [r*KV/tp, (r+1)*KV/tp). One layout (``ParamPlan.tp_pieces``) serves the local
shape, the local slice, full_state_dict / load_full_state_dict, meta init and checkpoints.
"""

import pytest
import torch
from torch import nn

import shardlib
import shardlib.checkpoint as ckpt
from shardlib import P, plan_items
from shardlib.errors import ShardingError
from shardlib.lazy import global_flat_index, init_parameters
from shardlib.mesh import AbstractMesh
from shardlib.plan_items import ParamPlan
from shardlib.testing import assert_equivalent, run_on

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 37, 8
SPECS = {"model.layers.*.self_attn.qkv_proj.weight": P("tp", None), "model.layers.*.self_attn.o_proj.weight": P(None, "tp"),
         "model.layers.*.mlp.gate_up_proj.weight": P("tp", None), "model.layers.*.mlp.down_proj.weight": P(None, "tp")}
QKV = "model.layers.*.self_attn.qkv_proj"
FUSED = {QKV: (16, 8, 8), "model.layers.*.mlp.gate_up_proj": 2}  # q: 4 heads of 4, k and v: 2 heads each


def make_phi3(hidden=16, heads=4, kv_heads=2, layers=2):
    """Tiny GQA Phi-3 (from the current torch seed): qkv_proj [(H + 2 KV) * hd, hidden]."""
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=24, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16,
        original_max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0, pad_token_id=0,  # the defaults (32000) lie outside the vocab
    )
    return transformers.Phi3ForCausalLM(cfg)


def lm_loss(output, targets):
    """Next-token cross entropy: ``logits (batch, seq, vocab)``, ``targets (batch, seq)``."""
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def causal_batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (rows, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# -- tier 0: plans on an abstract mesh -----------------------------------------------------------

def test_unequal_blocks_local_shapes_on_tp2_and_tp4():
    """qkv_proj of Phi-3 with 16 heads and 4 key/value heads of 4: blocks (64, 16, 16). Each rank
    holds H/tp q rows and KV/tp rows of k and of v, at the offsets of its own heads."""
    model = make_phi3(hidden=64, heads=16, kv_heads=4, layers=1)
    for tp, local in ((2, 48), (4, 24)):
        for r in range(tp):
            p = shardlib.plan(model, AbstractMesh({"tp": tp}, rank=r), SPECS, fused={QKV: (64, 16, 16)})
            qkv = p.param("model.layers.0.self_attn.qkv_proj.weight")
            assert qkv.tp_blocks == (64, 16, 16) and p.local_shape(qkv) == (local, 64)
            q, kv = 64 // tp, 16 // tp
            assert qkv.tp_pieces(dict(p.mesh_shape), p.coords()) == ((r * q, q), (64 + r * kv, kv), (80 + r * kv, kv))
            o = p.param("model.layers.0.self_attn.o_proj.weight")
            assert o.tp_blocks == () and p.local_shape(o) == (64, 64 // tp)


def test_int_and_equal_tuple_are_one_form():
    """fused=2 and fused=(24, 24) give the same plan; a one-block tuple is no fusion at all."""
    model = make_phi3(layers=1)
    mesh = AbstractMesh({"tp": 2}, rank=1)
    glob = "model.layers.*.mlp.gate_up_proj"
    as_int, as_tuple, one, none = (shardlib.plan(model, mesh, SPECS, fused={QKV: (16, 8, 8), glob: v})
                                   for v in (2, (24, 24), (48,), 1))
    name = "model.layers.0.mlp.gate_up_proj.weight"
    assert as_int.param(name).tp_blocks == as_tuple.param(name).tp_blocks == (24, 24)
    assert as_int.tp_layers == as_tuple.tp_layers and one.tp_layers == none.tp_layers
    assert one.param(name).tp_blocks == () and one.local_shape(one.param(name)) == (24, 16)
    assert plan_items.fused_blocks(48, 3) == (16, 16, 16) and plan_items.fused_blocks(32, [16, 8, 8]) == (16, 8, 8)
    assert plan_items.fused_blocks(8, 1) == plan_items.fused_blocks(8, ()) == plan_items.fused_blocks(8, (8,)) == ()


def test_blocks_not_summing_to_out_features_are_refused():
    with pytest.raises(ShardingError, match=r"fused layer model\.layers\.0\.self_attn\.qkv_proj \(blocks \(16, 8, 4\)\) "
                                            r"has out_features 32, but the blocks sum to 28"):
        shardlib.plan(make_phi3(), AbstractMesh({"tp": 2}), SPECS, fused={QKV: (16, 8, 4)})


def test_block_not_divisible_by_the_axis_is_refused():
    """Blocks (20, 6, 6) fill qkv_proj's 32 rows, but 6 does not split over tp=4."""
    with pytest.raises(ShardingError, match=r"fused layer model\.layers\.0\.self_attn\.qkv_proj \(blocks \(20, 6, 6\), "
                                            r"out_features 32\) must be column parallel with each block divisible by "
                                            r"'tp' of size 4; block size\(s\) \[6\] are not"):
        shardlib.plan(make_phi3(), AbstractMesh({"tp": 4}), SPECS, fused={QKV: (20, 6, 6)})


def test_blocks_on_a_row_layer_are_refused():
    with pytest.raises(ShardingError, match=r"fused layer model\.layers\.0\.self_attn\.o_proj \(blocks \(8, 8\), "
                                            r"out_features 16\) must be column parallel .* but it is row parallel"):
        shardlib.plan(make_phi3(), AbstractMesh({"tp": 2}), SPECS, fused={**FUSED, "*.o_proj": (8, 8)})


def test_key_value_heads_of_a_block_must_split():
    """tp=4 divides every block of (16, 8, 8) but not the 2 key/value heads in k and v."""
    with pytest.raises(ShardingError, match=r"qkv_proj has 2 key/value heads in its fused block of 8 features "
                                            r"\(blocks \(16, 8, 8\), head_dim 4\), which do not split over 'tp' of size 4"):
        shardlib.plan(make_phi3(), AbstractMesh({"tp": 4}), SPECS, fused=FUSED)


@pytest.mark.parametrize("value", [(16, 0, 16), (), (16.0, 16), [True, 31]])
def test_malformed_block_sizes_are_refused(value):
    with pytest.raises(ShardingError, match=r"fused must map module globs to a number of blocks \(an int >= 1\) or to "
                                            r"the block sizes \(a tuple of ints >= 1\)"):
        shardlib.plan(make_phi3(), AbstractMesh({"tp": 2}), SPECS, fused={QKV: value})


def test_fused_blocks_refuses_sizes_that_do_not_fill_the_dimension():
    with pytest.raises(ValueError, match=r"fused blocks \(3, 4\) must be sizes >= 1 summing to the dimension's size 8 "
                                         r"\(they sum to 7\)"):
        plan_items.fused_blocks(8, (3, 4))
    with pytest.raises(ValueError, match=r"fused blocks \(9, -1\) must be sizes >= 1"):
        plan_items.fused_blocks(8, (9, -1))
    with pytest.raises(ValueError, match="3 fused blocks do not divide the dimension's size 8"):
        plan_items.fused_blocks(8, 3)


def test_meta_init_index_map_follows_unequal_blocks():
    """The global indices meta init draws for a local block of (8, 4, 4) rows x 3 columns on tp=2
    are those of rank r's rows: [4r, 4r+4), [8+2r, 8+2r+2), [12+2r, 12+2r+2) (as the slicing of
    load_full_state_dict); a sub-range (a ZeRO slice) too."""
    pp = ParamPlan("w", (), (16, 3), torch.float32, P(), "", "column", True, tp_axis="tp", tp_dim=0, tp_blocks=(8, 4, 4))
    whole = torch.arange(48).view(16, 3)
    for r in range(2):
        rows = [*range(4 * r, 4 * r + 4), *range(8 + 2 * r, 10 + 2 * r), *range(12 + 2 * r, 14 + 2 * r)]
        local = whole[rows].reshape(-1)
        assert plan_items.tp_pieces(16, (8, 4, 4), 2, r) == ((4 * r, 4), (8 + 2 * r, 2), (12 + 2 * r, 2))
        assert torch.equal(global_flat_index(pp, {"tp": 2}, {"tp": r}, 0, 24), local)
        assert torch.equal(global_flat_index(pp, {"tp": 2}, {"tp": r}, 5, 20), local[5:20])


# -- multi-process: equivalence, full state, checkpoints -------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape,stage,verify", [({"tp": 2}, 0, True), ({"dp": 2, "tp": 2}, 3, False)])
def test_phi3_gqa_fused_qkv_is_exact(mesh_shape, stage, verify):
    """Phi-3 (4 heads, 2 key/value heads) with qkv_proj fused (16, 8, 8) and gate_up_proj fused 2,
    column/row parallel on tp=2: losses, gradients and parameters match one process over 3 AdamW
    steps (fp32 tolerances of shardlib.testing.tolerance). On tp=2 shard()'s verification of each
    unit passes too; dp=2 x tp=2 has the same tp units, so it skips it (measured: 21 s with it,
    4 s without, on this shared 2-core machine)."""
    report = assert_equivalent(make_phi3, mesh_shape, SPECS, causal_batch(4), steps=3, zero_stage=stage,
                               chunk_size=600, fused=FUSED, verify=verify, loss_fn=lm_loss,
                               optimizer_kwargs={"lr": 1e-3})
    qkv = report["plan"].param("model.layers.1.self_attn.qkv_proj.weight")
    assert qkv.tp_blocks == (16, 8, 8) and qkv.strategy.startswith("column")


def _state_worker(path, seed):
    """tp=2: the local qkv rows are rank r's heads of q, k and v; full_state_dict rebuilds the
    global tensors; load_full_state_dict puts them back; then train 2 steps and save."""
    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(seed)
    ref = make_phi3()
    torch.manual_seed(seed)
    smodel = shardlib.shard(make_phi3(), mesh, SPECS, fused=FUSED, verify=False)  # verified in the test above
    r = mesh.index("tp")
    w = ref.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = w[:16], w[16:24], w[24:]  # q: heads 0-3, k and v: heads 0-1 (head_dim 4)
    mine = torch.cat([q[8 * r: 8 * r + 8], k[4 * r: 4 * r + 4], v[4 * r: 4 * r + 4]])  # rank r: q heads 2r, 2r+1; kv head r
    local_ok = torch.equal(smodel.module.model.layers[0].self_attn.qkv_proj.weight.detach(), mine)
    full = shardlib.full_state_dict(smodel)
    full_ok = full.keys() == ref.state_dict().keys() and all(torch.equal(full[n], t) for n, t in ref.state_dict().items())
    torch.manual_seed(seed + 1)
    other = make_phi3().state_dict()
    shardlib.load_full_state_dict(smodel, other)
    back = shardlib.full_state_dict(smodel)
    load_ok = all(torch.equal(back[k], other[k]) for k in other)
    shardlib.load_full_state_dict(smodel, ref.state_dict())
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        x, y = causal_batch(4, seed=step)
        lm_loss(smodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    ckpt.save(path, smodel, opt)
    x, y = causal_batch(4, seed=2)
    return local_ok, full_ok, load_ok, shardlib.full_state_dict(smodel), lm_loss(smodel(x), y).item()


def _load_worker(path, mesh_shape, stage):
    mesh = shardlib.init_mesh(mesh_shape)
    torch.manual_seed(9)  # other initial values: everything comes from the checkpoint
    specs, fused = (SPECS, FUSED) if "tp" in mesh_shape else (None, None)
    smodel = shardlib.shard(make_phi3(), mesh, specs, zero_stage=stage, fused=fused, verify=False)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    ckpt.load(path, smodel, opt)
    x, y = causal_batch(4, seed=2)
    xl, yl = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in (x, y))
    loss = lm_loss(smodel(xl), yl).detach()
    loss = shardlib.all_reduce(loss, smodel.data_axes, op="avg") if smodel.data_axes else loss
    return shardlib.full_state_dict(smodel), loss.item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape,stage", [({"dp": 2}, 3), ({"tp": 1}, 0), ({"tp": 2}, 0)])
def test_phi3_full_state_and_checkpoint_resharding(tmp_path, mesh_shape, stage):
    """On tp=2: each rank's local qkv_proj rows are its own q, k and v heads; full_state_dict
    equals the unsharded model; load_full_state_dict round-trips. A checkpoint saved there after
    2 steps loads on dp=2 (ZeRO-3), on tp=1 (one process) and on tp=2 from other initial values: the same
    full parameters bit for bit, and the next loss within fp32 rounding of a mean over another
    split of the batch (rel 1e-6; the same tp=2 layout gives the same value)."""
    path = str(tmp_path / "ckpt")
    saved = run_on(2, _state_worker, path, 0)
    assert all(local_ok and full_ok and load_ok for local_ok, full_ok, load_ok, _, _ in saved)
    full_a, loss_a = saved[0][3], saved[0][4]
    loaded = run_on(max(mesh_shape.values()), _load_worker, path, mesh_shape, stage)
    for full_b, loss_b in loaded:
        assert full_b.keys() == full_a.keys()
        assert all(torch.equal(full_a[k], full_b[k]) for k in full_a), [k for k in full_a if not torch.equal(full_a[k], full_b[k])]
        assert loss_b == pytest.approx(loss_a, rel=1e-6)


def _gathers_worker(bucket_bytes):
    """tp=2 Phi-3 with fused blocks and a vocabulary-parallel embedding of 37 rows (19 + 18):
    full_state_dict and full_grads against the unsharded model, and the 'tp' all-gathers each
    takes (``full_state._BUCKET_BYTES`` set to ``bucket_bytes``)."""
    from shardlib import full_state

    default, full_state._BUCKET_BYTES = full_state._BUCKET_BYTES, bucket_bytes
    try:
        mesh = shardlib.init_mesh({"tp": 2})
        specs = {**SPECS, "model.embed_tokens.weight": P("tp", None)}
        torch.manual_seed(0)
        ref = make_phi3()
        torch.manual_seed(0)
        smodel = shardlib.shard(make_phi3(), mesh, specs, fused=FUSED, verify=False)
        x, y = causal_batch(4)
        lm_loss(ref(x), y).backward()
        lm_loss(smodel(x), y).backward()
        counts = []
        for fn in (shardlib.full_state_dict, shardlib.full_grads):
            mesh.comm.reset()
            got = fn(smodel)
            counts.append(mesh.comm.table().get(("tp", "all_gather"), (0, 0.0))[0])
            want = ref.state_dict() if fn is shardlib.full_state_dict else {n: p.grad for n, p in ref.named_parameters()}
            assert got.keys() == want.keys()
            if fn is shardlib.full_state_dict:  # the same values, gathered
                assert all(torch.equal(got[n], t) for n, t in want.items()), [n for n in want if not torch.equal(got[n], want[n])]
            else:  # tensor-parallel gradients: fp32 sums in another order; measured at most 1.5e-8
                for n, t in want.items():  # absolute (2.9e-7 of a tensor's largest entry), default and avx2
                    torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-7, msg=n)
    finally:  # a pool worker serves later tests
        full_state._BUCKET_BYTES = default
    split = sum(1 for p in smodel.plan.params if p.tp_axis is not None)
    return counts, split


@pytest.mark.multiprocess
def test_full_state_gathers_every_tensor_parallel_parameter_in_one_collective():
    """full_state_dict / full_grads gather the tensor-parallel pieces of all parameters in one
    all-gather over 'tp' (the harness calls them every step: one gather per parameter made a
    tensor-parallel equivalence test twice as slow); with a bucket smaller than any parameter,
    one per parameter. Either way the global tensors are the unsharded model's: fused blocks
    (16, 8, 8) and 2 x 24, and an embedding whose 37 rows split 19 + 18."""
    for counts, split in run_on(2, _gathers_worker, 64 << 20):
        assert counts == [1, 1]
    for counts, split in run_on(2, _gathers_worker, 1):
        assert split == 9 and counts == [split, split]  # 2 layers x 4 projections + the embedding


class _Fused(nn.Module):
    """A fused (8, 4, 4) column layer and its row partner, for meta init (no buffers): 4 query
    heads of 2 and 2 key/value heads of 2, each key/value head serving 2 query heads (as GQA), so
    the forward reads only the heads a rank holds."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 16)
        self.out = nn.Linear(8, 8)

    def forward(self, x):  # x: (..., 8)
        qkv = self.qkv(x)  # (..., 16), local (..., 16 / tp): [q | k | v] of this rank's heads
        n, lead = qkv.shape[-1], x.shape[:-1]
        q, k, v = qkv.split([n // 2, n // 4, n // 4], dim=-1)
        kv = (k * v).reshape(*lead, -1, 1, 2)  # (..., kv heads, 1, 2)
        return self.out((q.reshape(*lead, kv.shape[-3], -1, 2) * kv).flatten(-3))


def _meta_worker():
    mesh = shardlib.init_mesh({"tp": 2})
    rules = {"*.weight": ("normal", 0.5), "*.bias": ("uniform", -0.5, 0.5)}
    with torch.device("meta"):
        model = _Fused()
    specs = {"qkv.weight": P("tp", None), "out.weight": P(None, "tp")}
    smodel = shardlib.shard(model, mesh, specs, fused={"qkv": (8, 4, 4)}, init_seed=3, init_rules=rules)
    ref = init_parameters(_Fused(), seed=3, rules=rules).state_dict()
    full = shardlib.full_state_dict(smodel)
    return [k for k in ref if not torch.equal(full[k], ref[k])]


@pytest.mark.multiprocess
def test_meta_init_of_unequal_blocks_equals_the_one_device_init():
    """A meta-built model with a fused (8, 4, 4) layer on tp=2: each rank materializes its rows of
    every block (weight and bias) with the values of their global indices, so the full tensors
    equal init_parameters on one device bit for bit."""
    assert run_on(2, _meta_worker) == [[], []]


def _phi3_meta_worker():
    mesh = shardlib.init_mesh({"tp": 2})
    with torch.device("meta"):
        meta = make_phi3()
    smodel = shardlib.shard(meta, mesh, SPECS, fused=FUSED, init_seed=4, verify=False)  # rules: HF's own init
    full = shardlib.full_state_dict(smodel)
    torch.manual_seed(0)
    ref = init_parameters(make_phi3(), seed=4).state_dict()
    return sorted(full) == sorted(ref), [k for k in ref if not torch.equal(full[k], ref[k])]


@pytest.mark.multiprocess
def test_meta_built_phi3_on_tp2_equals_the_one_device_init():
    """Phi-3 built on meta and sharded on tp=2 with qkv_proj fused (16, 8, 8): the full tensors
    equal init_parameters() of the CPU-built model with the same seed, bit for bit (each rank drew
    the values of its own rows' global indices)."""
    assert run_on(2, _phi3_meta_worker) == [(True, []), (True, [])]


def _refused_worker():
    mesh = shardlib.init_mesh({"tp": 2})
    try:
        shardlib.shard(make_phi3(), mesh, SPECS, fused={QKV: (16, 8, 4)})
    except ShardingError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_bad_blocks_refused_on_every_rank():
    messages = run_on(2, _refused_worker)
    assert messages[0] is not None and messages[0] == messages[1] and "the blocks sum to 28" in messages[0]
