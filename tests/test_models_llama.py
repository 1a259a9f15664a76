"""The LLaMA- and PaLM-style builders train like one process over dp (ZeRO-3), tp with
sequence parallelism and vocabulary-parallel logits, pp (1F1B), and pp x dp x tp."""

import functools

import pytest
import torch
import torch.nn.functional as F

import shardlib
from shardlib.mesh import AbstractMesh
from shardlib.models.llama import Llama, LlamaConfig, PaLM, PaLMConfig, llama_tp_specs, rotary
from shardlib.testing import assert_equivalent

LLAMA = LlamaConfig(vocab_size=38, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
PALM = PaLMConfig(vocab_size=38, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def _make(kind, config):
    return (PaLM if kind == "palm" else Llama)(config)


def _batch(rows=8, seq=8):
    x = torch.randint(0, 38, (rows, seq + 1), generator=torch.Generator().manual_seed(3))
    return x[:, :-1], x[:, 1:]


def lm_loss(output, y):
    logits = output[0] if isinstance(output, tuple) else output  # the whole model's (logits, loss); a stage's logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def test_rotary_is_a_rotation_and_relative():
    q = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    r = rotary(q, 10000.0)
    assert torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # rotations keep lengths
    assert torch.equal(r[:, :, 0], q[:, :, 0])  # position 0: angle 0
    # scores depend on the offset only: <R_s q, R_t k> is the same for (s, t) and (s+1, t+1)
    k = q.flip(-1)
    same = torch.cat([q[:, :, :1]] * 6, 2), torch.cat([k[:, :, :1]] * 6, 2)
    rq, rk = rotary(same[0], 10000.0), rotary(same[1], 10000.0)
    assert torch.allclose((rq[:, :, 2] * rk[:, :, 0]).sum(), (rq[:, :, 5] * rk[:, :, 3]).sum(), atol=1e-5)


def test_a_float64_model_computes_its_loss_in_float64():
    """The unsharded loss was computed in fp32 (``logits.float()``) while the vocabulary-parallel
    loss keeps float64: a float64 Llama differed from itself sharded by 2.7e-7 in loss."""
    torch.manual_seed(0)
    model = Llama(LLAMA).double()
    x, y = _batch()
    logits, loss = model(x, y)
    assert loss.dtype == torch.float64
    assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_palm_block_is_parallel_and_tied():
    torch.manual_seed(0)
    m = PaLM(PALM)
    assert m.lm_head.weight is m.wte.weight and m.blocks[0].mlp_norm is None
    assert all(not isinstance(p, torch.nn.Linear) or p.bias is None for p in m.modules())
    x = torch.randn(2, 5, 32)
    b = m.blocks[0]
    h = b.attn_norm(x)
    assert torch.allclose(b(x), x + b.attn(h) + b.mlp(h))
    with pytest.raises(ValueError, match="parallel_block=False"):
        PaLM(LLAMA)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["llama", "palm"])
def test_dp_zero3(kind):
    assert_equivalent(functools.partial(_make, kind, LLAMA if kind == "llama" else PALM), {"dp": 2}, None,
                      _batch(), steps=3, zero_stage=3, optimizer_kwargs={"lr": 1e-3}, chunk_size=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["llama", "palm"])
def test_tp_with_sequence_parallel_and_vocab_parallel_logits(kind):
    report = assert_equivalent(functools.partial(_make, kind, LLAMA if kind == "llama" else PALM), {"dp": 2, "tp": 2},
                               llama_tp_specs(), _batch(), steps=3, zero_stage=1, sequence_parallel=True,
                               vocab_parallel_logits=True, optimizer_kwargs={"lr": 1e-3})
    assert [t.path for t in report["plan"].tp_layers if t.parallel_output] == ["lm_head"]


@pytest.mark.multiprocess
def test_llama_pipeline_1f1b():
    report = assert_equivalent(functools.partial(_make, "llama", LLAMA), {"pp": 2, "dp": 2}, None, _batch(),
                               steps=3, loss_fn=lm_loss, schedule="1f1b", microbatches=2, zero_stage=1,
                               optimizer_kwargs={"lr": 1e-3})
    assert report["plan"].stage_layers == (("embed", "blocks.0"), ("blocks.1", "head"))


@pytest.mark.multiprocess
def test_llama_3d_pp_dp_tp():
    assert_equivalent(functools.partial(_make, "llama", LLAMA), {"pp": 2, "dp": 2, "tp": 2}, llama_tp_specs(),
                      _batch(), steps=2, loss_fn=lm_loss, schedule="1f1b", microbatches=2, zero_stage=1,
                      optimizer_kwargs={"lr": 1e-3})


def test_a_7b_layout_plans_on_an_abstract_mesh():
    """LLaMA-2-7B shapes (meta device) on pp2 x dp4 x tp4: model state per rank by formula."""
    cfg = LlamaConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096,
                      ffn_hidden=11008)
    with torch.device("meta"):
        model = Llama(cfg)
    pplan = shardlib.plan(model, AbstractMesh({"pp": 2, "dp": 4, "tp": 4}), llama_tp_specs(), zero_stage=1,
                          schedule="1f1b", microbatches=8)
    C, Fh, V, tp = 4096, 11008, 32000, 4
    layer = (4 * C * C + 3 * C * Fh) // tp + 2 * C
    assert model.num_params() == 32 * layer * tp - 32 * 2 * C * (tp - 1) + 2 * V * C + C
    assert pplan.stages[0].param_bytes == 4 * (16 * layer + V * C // tp)
    assert pplan.stages[1].param_bytes == 4 * (16 * layer + V * C // tp + C)


@pytest.mark.multiprocess
def test_palm_pipeline_with_its_tied_embedding():
    """PaLM's embedding is its output layer: on pp=2 the two stages hold the tied tensor once each."""
    assert_equivalent(functools.partial(_make, "palm", PALM), {"pp": 2, "dp": 2}, None, _batch(), steps=3,
                      loss_fn=lm_loss, schedule="1f1b", microbatches=2, zero_stage=1, optimizer_kwargs={"lr": 1e-3})


def _meta_worker(kind):
    from shardlib.lazy import init_parameters

    mesh = shardlib.init_mesh({"dp": 2, "tp": 2})
    config = LLAMA if kind == "llama" else PALM
    with torch.device("meta"):
        meta = _make(kind, config)
    smodel = shardlib.shard(meta, mesh, llama_tp_specs(), init_seed=5, zero_stage=3, sequence_parallel=True)
    full = shardlib.full_state_dict(smodel)
    ref = init_parameters(_make(kind, config), seed=5).state_dict()
    return [k for k, v in ref.items() if not torch.equal(full[k], v)], sorted(ref)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["llama", "palm"])
def test_meta_init_equals_the_one_device_init(kind):
    """Built on the meta device, sharded over dp=2 x tp=2 at ZeRO-3: each rank fills its shards
    from shardlib_init_rules(); the gathered tensors equal init_parameters on one device."""
    from shardlib.testing import run_on

    for mismatched, names in run_on(4, _meta_worker, kind):
        assert mismatched == [] and any("norm" in n for n in names)


def test_init_rules_follow_the_constructor_distributions():
    from shardlib.lazy import init_parameters

    cfg = LlamaConfig(vocab_size=64, n_layer=8, n_head=4, n_kv_head=2, n_embd=256)
    m = init_parameters(Llama(cfg), seed=1)
    assert torch.equal(m.norm.weight, torch.ones(256)) and torch.equal(m.blocks[0].attn_norm.weight, torch.ones(256))
    resid = 0.02 / (2 * cfg.n_layer) ** 0.5
    o = torch.cat([b.attn.o_proj.weight.flatten() for b in m.blocks])  # 8 x 65,536 draws
    q = torch.cat([b.attn.q_proj.weight.flatten() for b in m.blocks])
    assert abs(o.std().item() / resid - 1) < 0.01 and abs(q.std().item() / 0.02 - 1) < 0.01  # std error ~0.1%
    torch.manual_seed(1)
    eager = Llama(cfg)
    assert abs(torch.cat([b.attn.o_proj.weight.flatten() for b in eager.blocks]).std().item() / resid - 1) < 0.01
