"""Unmodified Hugging Face LLaMA (GQA) and GPT-2 (fused Conv1D q/k/v) under tensor parallelism."""

import pytest
import torch
import torch.nn.functional as F

from shardlib.models import gpt2_preset, llama_preset
from shardlib.testing import assert_equivalent

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess


def make_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def make_gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=37, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    for block in model.transformer.h:
        # c_attn's bias holds the key bias, whose gradient is zero in exact arithmetic (softmax is
        # shift invariant): AdamW turns its rounding noise into run-dependent updates
        block.attn.c_attn.bias.requires_grad_(False)
    return model


def lm_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())


def _batch(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (rows, 9), generator=g)
    return x[:, :-1], x[:, 1:]


CASES = [({"tp": 2}, 0, False), ({"dp": 2, "tp": 2}, 3, False), ({"tp": 2}, 1, True), ({"dp": 2, "tp": 2}, 2, True)]


@pytest.mark.parametrize("shape,stage,sp", CASES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_model_equivalent_to_single_process(family, shape, stage, sp):
    make, preset = {"llama": (make_llama, llama_preset()), "gpt2": (make_gpt2, gpt2_preset())}[family]
    report = assert_equivalent(
        make, shape, preset.specs, _batch(4), steps=3, zero_stage=stage, chunk_size=500, sequence_parallel=sp,
        loss_fn=lm_loss, optimizer_kwargs={"lr": 1e-3}, **preset.options,
    )
    kinds = {p.strategy.split("+")[0] for p in report["plan"].params}
    assert {"column", "row", "vocab"} <= kinds


def test_gpt2_fused_qkv_keeps_whole_heads():
    """A naive column split of c_attn [C, 3C] would give rank 0 all of q and half of k; the fused
    split gives each rank the same heads of q, k and v."""
    import shardlib
    from shardlib.mesh import AbstractMesh

    model = make_gpt2()
    p = shardlib.plan(model, AbstractMesh({"tp": 2}, rank=1), gpt2_preset().specs, **gpt2_preset().options)
    c_attn = p.param("transformer.h.0.attn.c_attn.weight")
    assert c_attn.tp_blocks == (16, 16, 16) and p.local_shape(c_attn) == (16, 24)
