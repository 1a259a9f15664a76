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
