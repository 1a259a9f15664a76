"""Unmodified Hugging Face decoder-only causal LMs as pipelines (shardlib.models.hf).

Each model is trained 3 AdamW steps by ``forward_backward`` on a pp mesh and in one process
(``assert_equivalent``: losses, full gradients, gradient norm and parameters after every step).
The configs make every piece the pipeline layers rebuild matter: sliding windows (3) shorter than
the sequence (8), Gemma-2's logit soft-capping at 0.1 (the tiny model's logits reach 0.27), tied embeddings across
stages, fused projections (Phi-3), per-head norms (Qwen3), eager and sdpa attention.
"""

import pytest
import torch
import torch.nn.functional as F

import shardlib
from shardlib.errors import ShardingError
from shardlib.mesh import AbstractMesh
from shardlib.models import hf_preset, llama_preset
from shardlib.models.hf import hf_pipeline_layers
from shardlib.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

# tiny: hidden 16, 4 layers, vocab 37, sequence 8
_COMMON = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=0,
               pad_token_id=0)


def make_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False))


def make_llama_eager():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, attn_implementation="eager", tie_word_embeddings=True))


def make_mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON, sliding_window=3))


def make_qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=3, max_window_layers=2))  # layers 2, 3 sliding


def make_qwen3():
    # float64: in fp32 this tiny Qwen3 is chaotic for the harness at step 2 (moving its gradients
    # within rtol 1e-5 moves the loss 3.558 by 3.6e-3, relative 1.0e-3 = the harness's limit)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **_COMMON, head_dim=4, use_sliding_window=True, sliding_window=3, max_window_layers=1)).double()


def make_gemma():
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**_COMMON, head_dim=4))


def make_gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_COMMON, head_dim=4, sliding_window=3, final_logit_softcapping=0.1))  # sliding / full alternate


def make_phi3():
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **_COMMON, sliding_window=3, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def make_neox():
    cfg = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **cfg, hidden_dropout=0.0, attention_dropout=0.0))


def make_opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=37, hidden_size=16, ffn_dim=24, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=16,
        word_embed_proj_dim=8, dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def make_gpt2():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=37, n_embd=16, n_layer=4, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, bos_token_id=0, eos_token_id=0))
    for block in model.transformer.h:  # the key bias's gradient is rounding noise (see tests/test_hf_models.py)
        block.attn.c_attn.bias.requires_grad_(False)
    return model


MAKERS = {"llama": make_llama, "llama_eager": make_llama_eager, "mistral": make_mistral, "qwen2": make_qwen2,
          "qwen3": make_qwen3, "gemma": make_gemma, "gemma2": make_gemma2, "phi3": make_phi3, "gpt_neox": make_neox,
          "opt": make_opt, "gpt2": make_gpt2}


def lm_loss(output, targets):
    """Mean next-token cross-entropy; ``output`` is the model's (``.logits``) or the pipeline's (logits)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (rows, 9), generator=g)
    return x[:, :-1], x[:, 1:]  # (rows, 8) inputs and next-token targets


def _run_layers(model, x):
    """The pipeline layers run back to back in one process (``get`` is the model's own lookup)."""
    for _, _, fn in hf_pipeline_layers(model):
        x = fn(model.get_submodule, x)
    return x


# -- tier 0: the layers reproduce the model's own forward, bit for bit -------------------------------
@pytest.mark.parametrize("family", sorted(MAKERS))
def test_layers_reproduce_the_models_forward(family):
    torch.manual_seed(0)
    model = MAKERS[family]()
    x, _ = _batch(3)
    assert torch.equal(_run_layers(model, x), model(x).logits)  # same ops in the same order: exact


def test_layers_rebuild_masks_and_softcap(monkeypatch):
    """What the base model builds once is rebuilt per layer: dropping any of it changes the logits
    (so the exact match above is not a coincidence of these configs)."""
    from transformers import masking_utils

    torch.manual_seed(0)
    gemma2 = make_gemma2()
    x, _ = _batch(3)
    ref = gemma2(x).logits
    assert torch.equal(_run_layers(gemma2, x), ref)
    gemma2.config.final_logit_softcapping = None
    uncapped = _run_layers(gemma2, x)
    assert uncapped.abs().max() > 0.2 and ref.abs().max() <= 0.1  # the cap bites: the head soft-caps
    gemma2.config.final_logit_softcapping = 0.1
    # the sliding layers need their own mask: the full causal mask everywhere differs
    monkeypatch.setattr(masking_utils, "create_sliding_window_causal_mask", masking_utils.create_causal_mask)
    assert (_run_layers(gemma2, x) - ref).abs().max() > 1e-3
    names = [name for name, _, _ in hf_pipeline_layers(gemma2)]
    assert names == ["embed", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "head"]


def test_rotary_embedding_is_on_every_stage_once():
    """The parameter-free rotary module is held by every stage with decoder layers, at its own path,
    registered once per stage; parameter names are the model's."""
    from shardlib.parallel.pipeline import partition

    torch.manual_seed(0)
    model = make_llama()
    stages = [partition(model, r, 2, 2) for r in range(2)]  # 4 stages, interleaved
    for stage in stages:
        assert stage.get("model.rotary_emb") is model.model.rotary_emb
        assert [list(paths).count("model.rotary_emb") for paths in stage.chunk_paths] == [1, 1]
    names = {n for st in stages for n, _ in st.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_unknown_structures_are_refused():
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=37, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24))
    with pytest.raises(ShardingError, match=r"BertForMaskedLM \(a Hugging Face model, model_type 'bert'\) is not an "
                                            r"nn.Sequential and has no pipeline_layers\(\) method.*'gemma2'"):
        shardlib.plan(bert, AbstractMesh({"pp": 2}), microbatches=2)
    classifier = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**_COMMON))
    with pytest.raises(ShardingError, match=r"LlamaForSequenceClassification \(model_type 'llama'\) has no module "
                                            r"'lm_head'.*'model.rotary_emb', 'lm_head'"):
        shardlib.plan(classifier, AbstractMesh({"pp": 2}), microbatches=2)
    base = transformers.LlamaModel(transformers.LlamaConfig(**_COMMON))
    with pytest.raises(ShardingError, match=r"LlamaModel \(model_type 'llama'\) has no module 'model'"):
        shardlib.plan(base, AbstractMesh({"pp": 2}), microbatches=2)
    opt = make_opt()
    opt.config.layerdrop = 0.1
    with pytest.raises(ShardingError, match=r"OPTForCausalLM: config.layerdrop=0.1 skips decoder layers at random"):
        shardlib.plan(opt, AbstractMesh({"pp": 2}), microbatches=2)
    qwen2 = make_qwen2()
    qwen2.config.layer_types = ["full_attention", "linear_attention"] + qwen2.config.layer_types[2:]
    with pytest.raises(ShardingError, match=r"decoder layer 1 has layer type 'linear_attention'"):
        shardlib.plan(qwen2, AbstractMesh({"pp": 2}), microbatches=2)
    llama = make_llama()
    llama.model.layers = torch.nn.Sequential(*llama.model.layers)
    with pytest.raises(ShardingError, match=r"LlamaForCausalLM: model.layers is a Sequential, not the ModuleList"):
        shardlib.plan(llama, AbstractMesh({"pp": 2}), microbatches=2)
    with pytest.raises(ShardingError, match=r"Module is not an nn.Sequential and has no pipeline_layers\(\) method"):
        shardlib.plan(torch.nn.Module(), AbstractMesh({"pp": 2}), microbatches=2)


def test_equivalence_harness_needs_a_loss_on_pipelines():
    """Refused before any worker runs: a pipeline step has one input, labels and a criterion."""
    with pytest.raises(ShardingError, match=r"assert_equivalent on the pipeline mesh \{'pp': 2\}: .* needs "
                                            r"loss_fn= \(got None\), a batch \(x, y\) \(got 2 tensors\)"):
        assert_equivalent(make_llama, {"pp": 2}, None, _batch(4), microbatches=2)
    with pytest.raises(ShardingError, match=r"\(got 3 tensors\) and accum_steps=1 \(got 1\)"):
        assert_equivalent(make_llama, {"pp": 2}, None, _batch(4) + (_batch(4)[0],), loss_fn=lm_loss, microbatches=2)


def test_sequence_parallel_is_refused_for_hf_pipelines():
    with pytest.raises(ShardingError, match=r"sequence_parallel=True on the pipeline mesh .* LlamaForCausalLM's "
                                            r"pipeline layers build masks and rotary positions from"):
        shardlib.plan(make_llama(), AbstractMesh({"pp": 2, "tp": 2}), llama_preset().specs, microbatches=2,
                      sequence_parallel=True)


def test_llama_70b_plans_on_an_abstract_mesh_with_pp():
    """LLaMA-70B shapes (meta device) on pp8 x dp16 x tp8, 1F1B, 32 microbatches, ZeRO-1: a value,
    no process group; every pp rank's model state equals the closed formula exactly."""
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                   tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    pplan = shardlib.plan(model, AbstractMesh({"pp": 8, "dp": 16, "tp": 8}), llama_preset().specs, microbatches=32,
                          schedule="1f1b", zero_stage=1, init_rules={"*norm.weight": ("ones",), "*": ("normal", 0.02)})
    C, F, KV, V, tp, dp = 8192, 28672, 8 * 128, 32000, 8, 16
    layer = (2 * C * C + 2 * C * KV + 3 * C * F) // tp + 2 * C  # q, o, k, v, gate, up, down split; 2 norms whole
    stage = [10 * layer for _ in range(8)]  # 80 layers, 10 per stage
    stage[0] += V * C // tp  # vocabulary-parallel embedding
    stage[7] += V * C // tp + C  # LM head, final norm
    assert [len(layers) for layers in pplan.stage_layers] == [11] + [10] * 6 + [11]
    for r, st in enumerate(pplan.stages):
        assert (st.param_bytes, st.grad_bytes) == (4 * stage[r], 4 * stage[r])  # fp32, whole on each dp rank
        assert st.optimizer_bytes == 2 * 4 * stage[r] // dp  # AdamW's 2 states, ZeRO-1 over dp
    assert pplan.stages[1].model_state_bytes == 9_092_546_560  # 8.47 GiB per rank on stages 1-6
    assert pplan.boundary_bytes(tokens=4096) == 4096 * C * 4


# -- tier 2: pipelines on worker processes equal one process -------------------------------------
def _equivalent(make, shape, specs=None, rows=8, **options):
    return assert_equivalent(make, shape, specs, _batch(rows), steps=3, loss_fn=lm_loss,
                             optimizer_kwargs={"lr": 1e-3}, chunk_size=500, **options)


@pytest.mark.multiprocess
def test_llama_pp2_1f1b_4_microbatches():
    report = _equivalent(make_llama, {"pp": 2}, schedule="1f1b", microbatches=4)
    pplan = report["plan"]
    assert pplan.stage_layers == (("embed", "model.layers.0", "model.layers.1"),
                                  ("model.layers.2", "model.layers.3", "head"))


@pytest.mark.multiprocess
def test_llama_pp2_x_tp2_with_llama_preset():
    report = _equivalent(make_llama, {"pp": 2, "tp": 2}, llama_preset().specs, schedule="1f1b", microbatches=4)
    kinds = {p.strategy.split("+")[0] for st in report["plan"].stages for p in st.params}
    assert {"column", "row", "vocab"} <= kinds


@pytest.mark.multiprocess
def test_opt_pp2_x_tp2_with_hf_preset():
    """OPT's MLP projections sit directly in its decoder layer. Each stage found the partial-sum
    parameters (split_region_params) on its own containers, which are not the model's
    ModuleLists, so every layer norm of a decoder layer was summed over tp: their gradients were
    exactly doubled, silently (a new user's finding; pp and tp alone were exact). Each stage now
    takes the whole model's."""
    preset = hf_preset(make_opt())
    report = _equivalent(make_opt, {"pp": 2, "tp": 2}, preset.specs, schedule="1f1b", microbatches=2, **preset.options)
    whole = report["plan"].whole
    assert not any("norm" in n for n in whole.sp_grad_params), whole.sp_grad_params
    for stage in report["plan"].stages:
        assert set(stage.sp_grad_params) <= set(whole.sp_grad_params)


def test_a_tp_sum_grads_glob_matching_one_stage_only_is_planned():
    """A tp_sum_grads glob names parameters of the whole model: a stage without a match takes none
    (each stage's own plan refused the glob as matching nothing)."""
    specs = dict(llama_preset().specs)
    pplan = shardlib.plan(make_llama(), AbstractMesh({"pp": 2, "tp": 2}), specs, microbatches=2,
                          tp_sum_grads=["model.layers.3.post_attention_layernorm.weight"])
    assert [st.sp_grad_params for st in pplan.stages] == [(), ("model.layers.3.post_attention_layernorm.weight",)]


@pytest.mark.multiprocess
def test_llama_pp2_x_dp2_zero3_gpipe_tied_embeddings():
    """Tied embedding and LM head on the first and last stage (gradient summed over pp), ZeRO-3 on
    dp, eager attention with an explicit mask."""
    report = _equivalent(make_llama_eager, {"pp": 2, "dp": 2}, schedule="gpipe", microbatches=2, zero_stage=3)
    assert report["plan"].tied == ((("model.embed_tokens.weight", "lm_head.weight"), 0),)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "mistral", "qwen2", "gemma", "gpt_neox", "opt", "gpt2"])
def test_family_pp2_equals_single_process(family):
    _equivalent(MAKERS[family], {"pp": 2}, schedule="1f1b", microbatches=4)


@pytest.mark.multiprocess
def test_llama_interleaved_1f1b_two_chunks_per_rank():
    """4 stages on 2 ranks: each rank's Stage holds two chunks, both using the one rotary module."""
    report = _equivalent(make_llama, {"pp": 2}, schedule="interleaved_1f1b", microbatches=2, virtual_stages=2)
    assert len(report["plan"].stage_layers) == 4


@pytest.mark.multiprocess
def test_llama_zero_bubble_schedules_split_its_backward():
    """Hugging Face layers as they are, each backward split into I and W through autograd: ZB-V
    on pp2 x dp2 at ZeRO-3 with the tied embedding and LM head, both on rank 0 in the V (nothing
    summed over pp), the rotary module on both chunks of each rank."""
    report = _equivalent(make_llama_eager, {"pp": 2, "dp": 2}, schedule="zbv", microbatches=2, zero_stage=3)
    assert report["plan"].tied == () and report["plan"].rank_stages(0) == [0, 3]
