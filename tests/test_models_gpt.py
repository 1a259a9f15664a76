"""Tier 0 tests of the reference GPT (shardlib/models/gpt.py): no processes, tiny configs."""

import math

import pytest
import torch

from shardlib.models import GPT, GPTConfig, tp_specs

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def _model(seed=0, config=TINY):
    torch.manual_seed(seed)
    return GPT(config)


def _batch(B=3, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def test_shapes_and_loss_dtype():
    x, y = _batch()
    logits, loss = _model()(x, y)
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    assert loss.shape == () and loss.dtype == torch.float32


def test_no_targets_gives_no_loss_and_short_sequences_work():
    logits, loss = _model()(_batch(B=2, T=5)[0])
    assert logits.shape == (2, 5, 256) and loss is None


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        _model()(torch.zeros(1, 17, dtype=torch.long))
    # the pipeline's first layer too: it gave IndexError "index out of range in self" (new-user pass)
    name, modules, embed = _model().pipeline_layers()[0]
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size=16"):
        embed(modules.__getitem__, torch.zeros(1, 17, dtype=torch.long))


def test_initial_loss_is_close_to_uniform():
    x, y = _batch(B=8)
    _, loss = _model()(x, y)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_tied_embeddings_are_one_tensor():
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # listed once


def test_untied_embeddings_are_separate():
    model = _model(config=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, tie_embeddings=False))
    assert model.lm_head.weight is not model.wte.weight
    assert model.lm_head.bias is None


def test_module_layout_names():
    names = {n for n, _ in _model().named_parameters()}
    for suffix in ("ln_1.weight", "attn.q_proj.weight", "attn.k_proj.bias", "attn.v_proj.weight",
                   "attn.o_proj.weight", "ln_2.bias", "mlp.fc_in.weight", "mlp.fc_out.bias"):
        assert f"blocks.1.{suffix}" in names
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} <= names


def test_num_params():
    model = _model()
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=True) == model.num_params() - 16 * 32
    assert 500_000 < GPT(GPTConfig()).num_params() < 1_000_000  # the examples' default size


def test_init_is_gpt2_style():
    model = _model(config=GPTConfig(n_layer=4))
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * 4)
    assert abs(model.blocks[0].mlp.fc_out.weight.std().item() - residual_std) < 0.001
    assert torch.count_nonzero(model.blocks[0].mlp.fc_in.bias) == 0


def test_same_seed_same_model_different_seed_different_model():
    a, b, c = _model(0).state_dict(), _model(0).state_dict(), _model(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.q_proj.weight"], c["blocks.0.attn.q_proj.weight"])


def test_causal_masking():
    model = _model().eval()
    x, _ = _batch(B=2)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    before, after = model(x)[0], model(changed)[0]
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_backward_reaches_every_parameter():
    model = _model()
    x, y = _batch()
    model(x, y)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.wte.weight.grad.abs().sum() > 0


def test_a_few_adam_steps_reduce_the_loss():
    model = _model()
    x, y = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(5):
        loss = model(x, y)[1]
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(x, y)[1].item() < first


def test_generate_appends_tokens():
    out = _model().generate(torch.zeros(2, 3, dtype=torch.long), 4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 7) and out.dtype == torch.long


def test_config_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)


def test_tp_specs_match_real_parameter_names():
    import fnmatch

    names = [n for n, _ in _model().named_parameters()]
    for pattern in tp_specs():
        assert fnmatch.filter(names, pattern), pattern
