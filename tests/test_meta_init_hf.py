"""Unmodified Hugging Face models built on the meta device: shard() takes their init rules and
their non-persistent buffers (rotary inv_freq, Gemma's embed_scale) from the model's own
_init_weights (shardlib.own_init), and a meta-built, sharded model trains exactly as the same
model built on CPU and initialized by the same rules."""

import math

import pytest
import torch
from torch import nn

import shardlib
from shardlib.lazy import init_parameters, resolve_init_rules
from shardlib.mesh import AbstractMesh
from shardlib.testing import run_on

transformers = pytest.importorskip("transformers")

_DECODER = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi3", "gpt_neox", "opt", "gpt2"]


def make_config(family: str):
    """A tiny config of ``family``, dropout off (the eager and sharded models then run the same ops)."""
    T = transformers
    if family == "gpt_neox":
        return T.GPTNeoXConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=16, hidden_dropout=0.0,
                               attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    if family == "opt":
        return T.OPTConfig(vocab_size=37, hidden_size=16, ffn_dim=24, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                           pad_token_id=1, bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=37, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    extra = {"qwen3": {"head_dim": 4}, "gemma": {"head_dim": 4}, "gemma2": {"head_dim": 4},
             "mixtral": {"num_local_experts": 2}}.get(family, {})
    cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
           "gemma": T.GemmaConfig, "gemma2": T.Gemma2Config, "mixtral": T.MixtralConfig, "phi3": T.Phi3Config}[family]
    return cls(**_DECODER, **extra)


def _build(family: str, meta: bool):
    cfg = make_config(family)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _train(smodel, mesh, steps=2):
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(2, 37, (4, 9), generator=g)
        idx, tgt = (shardlib.distribute(t, mesh, smodel.batch_spec) for t in (x[:, :-1], x[:, 1:]))
        logits = smodel(idx).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_vs_eager_worker(family: str):
    mesh = shardlib.init_mesh({"dp": 2})
    eager = _build(family, meta=False)
    eager_buffers = {n: b.clone() for n, b in eager.named_buffers()}  # computed by HF's __init__
    smodel = shardlib.shard(_build(family, meta=True), mesh, zero_stage=3, init_seed=7, chunk_size=700)
    buffers_equal = {n: torch.equal(b, eager_buffers[n]) for n, b in smodel.module.named_buffers()}
    init = shardlib.full_state_dict(smodel)
    ref = init_parameters(eager, seed=7).state_dict()
    init_equal = sorted(init) == sorted(k for k in ref if k in init) and all(torch.equal(init[k], ref[k]) for k in init)
    twin = shardlib.shard(eager, mesh, zero_stage=3, chunk_size=700)
    return buffers_equal, sorted(eager_buffers), init_equal, _train(smodel, mesh), _train(twin, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_built_hf_model_trains_as_the_cpu_built_one(family):
    """shard() of the meta-built model (ZeRO-3 on dp=2, no init_rules given): every buffer equals
    the one HF's __init__ computed on CPU, the gathered parameters equal init_parameters() of the
    CPU-built model with the same seed, and two AdamW steps give bitwise the same losses as the
    CPU-built model sharded the same way."""
    for buffers_equal, eager_names, init_equal, losses, twin_losses in run_on(2, _meta_vs_eager_worker, family):
        assert sorted(buffers_equal) == eager_names and all(buffers_equal.values()), buffers_equal
        assert init_equal
        assert losses == twin_losses and all(math.isfinite(x) for x in losses)


def test_own_init_rules_follow_each_family_init():
    """The rules read from _init_weights are HF's distributions, written out here from the HF
    sources: N(0, initializer_range) for linear and embedding weights, zero biases, norms one
    (Gemma's (1 + w) RMSNorm zero), GPT-2's residual projections N(0, 0.02 / sqrt(2 n_layer)),
    Mixtral's expert tensors and router N(0, initializer_range)."""
    def rules(family):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(make_config(family))
        return model, resolve_init_rules(model)

    model, got = rules("llama")
    assert len(got) == len(list(model.parameters()))
    assert got["model.layers.0.self_attn.q_proj.weight"] == ("normal", 0.02, 0.0)
    assert got["model.embed_tokens.weight"] == ("normal", 0.02, 0.0)
    assert got["model.layers.1.input_layernorm.weight"] == ("ones",) and got["model.norm.weight"] == ("ones",)
    _, got = rules("gemma")
    assert got["model.layers.0.input_layernorm.weight"] == ("zeros",) and got["model.norm.weight"] == ("zeros",)
    _, got = rules("gpt2")
    assert got["transformer.h.0.attn.c_proj.weight"] == ("normal", 0.02 / math.sqrt(2 * 2), 0.0)
    assert got["transformer.h.1.mlp.c_fc.weight"] == ("normal", 0.02, 0.0)
    assert got["transformer.h.0.attn.c_attn.bias"] == ("zeros",) and got["transformer.ln_f.weight"] == ("ones",)
    _, got = rules("mixtral")
    assert got["model.layers.0.mlp.experts.gate_up_proj"] == ("normal", 0.02, 0.0)
    assert got["model.layers.0.mlp.gate.weight"] == ("normal", 0.02, 0.0)
    _, got = rules("qwen2")
    assert got["model.layers.0.self_attn.q_proj.bias"] == ("zeros",)


class _OwnInit(nn.Module):
    """A model with its own HF-style _init_weights and a non-persistent buffer."""

    def __init__(self, init_buffer=True, weight="kaiming"):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(3.0), persistent=False)
        self.init_buffer, self.weight = init_buffer, weight

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            if self.weight == "trunc":
                nn.init.trunc_normal_(module.weight, std=0.02)
            elif self.weight == "eye":
                nn.init.normal_(module.weight)
                nn.init.eye_(module.weight)  # the last write wins, and no rule reproduces it
            else:
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # what nn.Linear does
            nn.init.zeros_(module.bias)
        elif module is self and self.init_buffer:
            nn.init.constant_(module.scale, 3.0)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_own_init_rules_and_buffers_of_a_custom_model():
    """kaiming_uniform_ (nn.Linear's init) becomes uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); the
    buffer is recomputed by _init_weights when the model is materialized."""
    with torch.device("meta"):
        model = _OwnInit()
    rules = resolve_init_rules(model)
    assert rules["lin.bias"] == ("zeros",) and rules["lin.weight"][0] == "uniform"
    assert rules["lin.weight"][1:] == pytest.approx((-0.5, 0.5), rel=1e-12)  # sqrt(3) * sqrt(1/3) / sqrt(4), rounded
    model = init_parameters(model, seed=1, device="cpu")
    assert model.scale.item() == 3.0 and model.lin.weight.abs().max() <= 0.5 and model.lin.weight.std() > 0.1


def test_own_init_that_no_rule_reproduces_is_refused():
    with torch.device("meta"):
        eye, model = _OwnInit(weight="eye"), _OwnInit(weight="trunc")
    with pytest.raises(shardlib.ShardingError, match=r"_OwnInit\._init_weights writes it with torch\.eye\(\.\.\., out=\), which "
                       r"a rule cannot reproduce from global element indices"):
        resolve_init_rules(eye)
    with pytest.raises(shardlib.ShardingError, match=r"parameter lin\.weight of shape \(4, 4\) has no init rule, and the "
                       r"model's own init cannot stand in for one: _OwnInit\._init_weights writes it with an init that "
                       r"does nothing on meta tensors \(it read Tensor\.is_meta: trunc_normal_"):
        shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3)
    # an explicit rule for it wins over the model's own init
    p = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, init_rules={"lin.weight": ("normal", 0.02)})
    assert dict(p.init_rules)["lin.weight"] == ("normal", 0.02)


def test_buffer_own_init_leaves_unwritten_is_refused():
    with torch.device("meta"):
        model = _OwnInit(init_buffer=False)
    with pytest.raises(shardlib.ShardingError, match=r"buffer scale of shape \(\) is on the meta device, and neither its "
                       r"module _OwnInit \(no shardlib_init_buffers\(\) method\) nor _OwnInit\._init_weights fills it"):
        init_parameters(model, device="cpu")


def _bf16_worker():
    """Elements converted to bf16 while shard() materializes a meta-built model at stage 3."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and args and isinstance(args[0], torch.Tensor) \
                    and args[0].dtype == torch.float32:
                self.elements += out.numel()
            return out

    mesh = shardlib.init_mesh({"dp": 2})
    with torch.device("meta"):
        model = _build("llama", meta=True)
    with Casts() as casts:
        smodel = shardlib.shard(model, mesh, zero_stage=3, param_dtype=torch.bfloat16, chunk_size=700)
    full = sum(c.plan.padded_numel for c in smodel._zero.chunks)
    return casts.elements, full, _train(smodel, mesh, steps=1)


@pytest.mark.multiprocess
def test_bf16_meta_init_converts_no_full_chunk():
    """ZeRO-3 with param_dtype=bfloat16 from meta: shard() casts no full chunk to bf16 (it cast
    every chunk's unfilled full buffer, which made a bf16 meta init of LLaMA-7B on fake ranks
    take 24 s of CPU against 4.7 s in fp32); the compute copies are made at the first gather,
    from this rank's shard, and training runs."""
    for converted, full, losses in run_on(2, _bf16_worker):
        assert full > 0 and converted == 0, f"{converted} of {full} chunk elements cast to bf16 in shard()"
        assert math.isfinite(losses[0])
