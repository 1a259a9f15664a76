"""shard(verify=True): a tensor-parallel lowering is proven exact on the user's own modules, or refused.

Each case here is a model whose forward does something the column/row rules cannot see; on the
code before the verification (59e6484) every one of them trained silently wrong (or, for the
LLaMA-7B plan, was refused by mistake). Multi-process cases run on the worker pool at tp=2.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlib
from shardlib import AbstractMesh, P, ShardingError
from shardlib.errors import WorkerError
from shardlib.testing import assert_equivalent, run_on

transformers = pytest.importorskip("transformers")


# -- models whose forward hides something ----------------------------------------------------
class ScaledAlpha(nn.Module):
    """An MLP block whose hidden activations (split over tp) are multiplied by a replicated scalar:
    each rank's gradient of ``alpha`` is a partial sum over its half of the hidden units."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.alpha = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)) * self.alpha)


ALPHA_SPECS = {"blocks.*.fc1.weight": P("tp", None), "blocks.*.fc2.weight": P(None, "tp")}


class OwnLookup(nn.Embedding):
    """An embedding subclass that does the lookup itself instead of calling super().forward."""

    def forward(self, ids):
        return self.weight[ids] * 2.0


class OwnLookupLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = OwnLookup(12, 8)
        self.head = nn.Linear(8, 12)

    def forward(self, ids):
        return self.head(self.emb(ids))


class ScaledLookup(nn.Embedding):
    """Gemma's pattern: ``super().forward(ids) * scale``, kept by the lowering."""

    def __init__(self, *a, scale=3.0):
        super().__init__(*a)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class ScaledLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ScaledLookup(12, 8)
        self.head = nn.Linear(8, 12)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _ids():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 11, (4, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def lm(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _refusal(fn, *args, **kwargs) -> WorkerError:
    with pytest.raises(WorkerError) as info:
        fn(*args, **kwargs)
    exc = info.value
    assert exc.exc_type == "ShardingError" and set(exc.errors) == {0, 1}, exc  # every rank, same error
    return exc


@pytest.mark.multiprocess
def test_replicated_parameter_on_split_activations_is_refused_with_its_cause():
    exc = _refusal(assert_equivalent, ScaledAlpha, {"tp": 2}, ALPHA_SPECS, _ids(), steps=1, loss_fn=lm)
    assert "gradient of blocks.0.alpha differs" in exc.message
    assert "blocks.0.alpha is replicated but used on activations split over 'tp'" in exc.message
    assert "tp_sum_grads" in exc.message


class PreNormFF(nn.Module):
    """A pre-norm feed-forward block in one module (norm, column, GELU, row), not inside a
    ModuleList: the norm runs on the replicated input, before the split."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


class PreNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = PreNormFF()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.ff(x))


@pytest.mark.multiprocess
def test_a_norm_before_the_column_layer_in_the_same_module_is_not_summed():
    """Found by a new-user pass: every replicated parameter of a column/row pair's parent was taken
    to run on split activations (Qwen3's q_norm) and its gradient summed over tp, so this
    LayerNorm's gradient came out tp times too large; shard() refused the layout, blaming a fused
    projection or a global size (and with verify=False trained it wrong). A module registered
    before the group's first column layer is taken to run before the split (verify proves it)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    specs = {"ff.fc1.weight": P("tp", None), "ff.fc1.bias": P("tp"), "ff.fc2.weight": P(None, "tp")}
    report = assert_equivalent(PreNormModel, {"tp": 2}, specs, (x, y), steps=3, loss_fn=F.mse_loss)
    assert not any("ln" in n for n in report["plan"].sp_grad_params), report["plan"].sp_grad_params


class LateNormFF(PreNormFF):
    """The same computation with the norm registered after the projections: taken to run on split
    activations, it is refused, and the message says what happened (it blamed a fused projection)."""

    def __init__(self):
        nn.Module.__init__(self)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.ln = nn.LayerNorm(8)


class LateNormModel(PreNormModel):
    def __init__(self):
        super().__init__()
        self.ff = LateNormFF()


@pytest.mark.multiprocess
def test_a_norm_registered_after_the_projections_but_run_before_is_refused_naming_it():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
    specs = {"ff.fc1.weight": P("tp", None), "ff.fc1.bias": P("tp"), "ff.fc2.weight": P(None, "tp")}
    exc = _refusal(assert_equivalent, LateNormModel, {"tp": 2}, specs, (x, y), steps=1, loss_fn=F.mse_loss)
    assert "ff.ln.bias, ff.ln.weight run on the replicated input, before the split, but their gradients are summed " \
           "over 'tp'" in exc.message, exc.message
    assert "fused projection" not in exc.message


@pytest.mark.multiprocess
def test_tp_sum_grads_makes_it_exact():
    assert_equivalent(ScaledAlpha, {"tp": 2}, ALPHA_SPECS, _ids(), steps=3, loss_fn=lm, tp_sum_grads=["*.alpha"])


@pytest.mark.multiprocess
def test_embedding_that_bypasses_super_forward_is_refused():
    specs = {"emb.weight": P("tp", None), "head.weight": P("tp", None)}
    exc = _refusal(assert_equivalent, OwnLookupLM, {"tp": 2}, specs, _ids(), steps=1, loss_fn=lm)
    assert "embedding emb (OwnLookup): the sharded forward/backward raised IndexError" in exc.message
    assert "OwnLookup.forward overrides nn.Embedding.forward" in exc.message


@pytest.mark.multiprocess
def test_embedding_subclass_calling_super_keeps_its_forward():
    """Gemma's scaled embedding: the parallel lookup is placed under the subclass's forward."""
    specs = {"emb.weight": P("tp", None), "head.weight": P("tp", None)}
    assert_equivalent(ScaledLM, {"tp": 2}, specs, _ids(), steps=3, loss_fn=lm)


def _gemma():
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
                                   use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.GemmaForCausalLM(cfg)


def _parallel_embedding_types():
    mesh = shardlib.init_mesh({"tp": 2})
    model = _gemma()
    smodel = shardlib.shard(model, mesh, shardlib.models.llama_preset().specs)
    emb = smodel.module.model.embed_tokens
    units = smodel.verification["units"]
    assert set(units) == {"model.embed_tokens", "model.layers.0", ""}, units  # "" is the whole model; lm_head is a plain Linear
    assert smodel.verification["max_error"] < 1e-12  # float64 on both sides: measured 7.7e-16
    return type(emb).__name__, isinstance(emb, shardlib.VocabParallelEmbedding), float(emb.embed_scale), emb.weight.shape[0]


@pytest.mark.multiprocess
def test_gemma_embedding_stays_scaled_and_vocab_parallel():
    for name, is_vpe, scale, rows in run_on(2, _parallel_embedding_types):
        assert name == "VocabParallelEmbedding[GemmaTextScaledWordEmbedding]" and is_vpe
        assert scale == pytest.approx(16 ** 0.5) and rows in (19, 18)


def _skip_verification():
    mesh = shardlib.init_mesh({"tp": 2})
    smodel = shardlib.shard(ScaledAlpha(), mesh, ALPHA_SPECS, verify=False)  # the user's explicit choice
    return smodel.plan.verify


@pytest.mark.multiprocess
def test_verify_false_skips_the_check():
    assert run_on(2, _skip_verification) == [False, False]


# -- plan-time (no processes) ----------------------------------------------------------------
def test_option_checks():
    model = ScaledAlpha()
    with pytest.raises(ShardingError, match="verify must be True or False"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), ALPHA_SPECS, verify="yes")
    with pytest.raises(ShardingError, match="tp_sum_grads must be a list of globs"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), ALPHA_SPECS, tp_sum_grads="*.alpha")
    with pytest.raises(ShardingError, match="tp_sum_grads pattern '\\*.beta' matches no parameter"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), ALPHA_SPECS, tp_sum_grads=["*.beta"])
    with pytest.raises(ShardingError, match="matches blocks.0.fc1.weight, which is split over the tensor axis"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), ALPHA_SPECS, tp_sum_grads=["*.fc1.weight"])
    with pytest.raises(ShardingError, match="verify_input must be a tensor or a non-empty tuple of tensors"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), ALPHA_SPECS, verify_input=[1, 2])


def test_qwen3_per_head_norms_get_their_gradients_summed():
    """Qwen3's q_norm/k_norm run on this rank's heads: summed over tp without sequence parallelism."""
    cfg = transformers.Qwen3Config(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16)
    p = shardlib.plan(transformers.Qwen3ForCausalLM(cfg), AbstractMesh({"tp": 2}), shardlib.models.llama_preset().specs)
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= set(p.sp_grad_params)
    assert not any("layernorm" in n or "o_proj" in n for n in p.sp_grad_params)


def test_llama_7b_plans_at_tp8():
    """The standard LLaMA-7B layout (tp=8): the MLP's config reference is not read as heads."""
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    p = shardlib.plan(model, AbstractMesh({"tp": 8}), shardlib.models.llama_preset().specs,
                      init_rules={"*": ("normal", 0.02)})
    assert p.local_shape(p.param("model.layers.0.mlp.gate_proj.weight")) == (1376, 4096)
    assert p.local_shape(p.param("model.layers.0.self_attn.q_proj.weight")) == (512, 4096)


# -- found by a new-user review: each trained silently wrong on the first version of the check ----
class AuxBlock(nn.Module):
    """Returns ``(x, aux)``: ``aux`` is computed from the hidden units split over tp."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        a = F.gelu(self.fc1(x))
        return x + self.fc2(a), a.pow(2).mean()


class AuxLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList([AuxBlock()])
        self.head = nn.Linear(16, 11)

    def forward(self, ids):
        x, aux = self.blocks[0](self.emb(ids))
        return self.head(x), aux


class DropBlock(Block):
    """Dropout on the hidden units, which are split over tp."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))) * self.alpha)


class ScaledDrop(ScaledAlpha):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([DropBlock()])


class CtxBlock(Block):
    """A block class of its own (one instance per distinct class is checked)."""


class OptionalLM(ScaledAlpha):
    """A second block runs only when a context is given (never in the sample forward)."""

    def __init__(self):
        super().__init__()
        self.ctx = nn.ModuleList([CtxBlock()])

    def forward(self, ids, ctx=None):
        out = super().forward(ids)
        return out if ctx is None else out + self.head(self.ctx[0](self.emb(ctx)))


class OddAlpha(ScaledAlpha):
    """Two blocks of one class; only the second holds a replicated scale (a different layout)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        del self.blocks[0].alpha
        self.blocks[0].alpha = 1.0


class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class PlainLM(ScaledAlpha):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 16), nn.Linear(16, 11)
        self.blocks = nn.ModuleList([PlainBlock(), PlainBlock()])


class FlipBlock(PlainBlock):
    """A constructor flag: ``flip="hidden"`` mixes the hidden units (split over tp) across ranks,
    not exact; ``flip="input"`` reverses the replicated input, exact but another computation."""

    def __init__(self, flip=None, layer_idx=0):
        super().__init__()
        self.flip, self.layer_idx = flip, layer_idx

    def forward(self, x):
        h = F.gelu(self.fc1(torch.flip(x, [-1]) if self.flip == "input" else x))
        return x + self.fc2(torch.flip(h, [-1]) if self.flip == "hidden" else h)


class FlipLM(PlainLM):
    """Blocks of one class, layout and shapes (by default the second flips its hidden units)."""

    def __init__(self, flips=(None, "hidden")):
        super().__init__()
        self.blocks = nn.ModuleList([FlipBlock(f, i) for i, f in enumerate(flips)])


MLP_SPECS = {"blocks.*.fc1.weight": P("tp", None), "blocks.*.fc2.weight": P(None, "tp")}


def _refused_units_alone(make, specs, words):
    import os

    os.environ["SHARDLIB_VERIFY_WHOLE_LIMIT"] = "0"  # as for a real-size model: the units alone decide
    torch.manual_seed(0)  # every rank builds the same model, as shard() assumes
    try:
        shardlib.shard(make(), shardlib.init_mesh({"tp": 2}), specs)
    except ShardingError as exc:
        return words is not None and all(w in str(exc) for w in words), str(exc)
    finally:
        del os.environ["SHARDLIB_VERIFY_WHOLE_LIMIT"]
    return words is None, "not refused"


CASES = {
    "aux output": (AuxLM, MLP_SPECS, ["output 1 (of 2) differs"]),
    "dropout between column and row": (ScaledDrop, ALPHA_SPECS, ["drop (p=0.3) run between a column-parallel layer",
                                                                 "Fix: set their p to 0"]),
    "unreached block": (OptionalLM, {**ALPHA_SPECS, "ctx.*.fc1.weight": P("tp", None), "ctx.*.fc2.weight": P(None, "tp")},
                        ["never called ctx.0 (CtxBlock)", "verify_input="]),
    "instances that differ": (OddAlpha, ALPHA_SPECS, ["gradient of blocks.1.alpha differs"]),
    # found by a new user at 33.6M parameters (above the whole-model check): only blocks.0 was run
    "instances that compute differently": (FlipLM, MLP_SPECS, ["block blocks.1 (FlipBlock): output differs"]),
    "plain MLP block is exact": (PlainLM, MLP_SPECS, None),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_units_alone_refuse(case):
    make, specs, words = CASES[case]
    for ok, message in run_on(2, _refused_units_alone, make, specs, words):
        assert ok, message


def test_sequence_parallel_exit_before_the_last_block_is_refused():
    """An sp_exit on an early block crashed at real size (the blocks after it got the whole
    sequence into sequence-parallel layers); refused at plan time."""
    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    specs = shardlib.models.llama_preset().specs
    with pytest.raises(ShardingError, match="sp_exit 'model.layers.0' is inside the sequence-parallel region's block "
                                            "'model.layers.0', before its last block 'model.layers.2'"):
        shardlib.plan(model, AbstractMesh({"tp": 2}), specs, sequence_parallel=True, sp_exit="model.layers.0")
    p = shardlib.plan(model, AbstractMesh({"tp": 2}), specs, sequence_parallel=True, sp_exit="model.layers.2")
    assert p.sp_exit == "model.layers.2"


def _units_checked(flips, meta=False):
    import os

    os.environ["SHARDLIB_VERIFY_WHOLE_LIMIT"] = "0"
    torch.manual_seed(0)
    try:
        with torch.device("meta" if meta else "cpu"):
            model = FlipLM(flips)
        options = dict(init_seed=0, init_rules={"*": ("normal", 0.3)}) if meta else {}
        return shardlib.shard(model, shardlib.init_mesh({"tp": 2}), MLP_SPECS, **options).verification["units"]
    finally:
        del os.environ["SHARDLIB_VERIFY_WHOLE_LIMIT"]


@pytest.mark.multiprocess
def test_instances_are_run_once_per_distinct_computation():
    """Blocks of one class that differ only in values (a layer index, as Hugging Face's
    ``layer_idx``) run the same operations: one of them is checked. A block whose forward runs
    other operations is checked too, exact or not (the inexact one is refused in
    ``test_units_alone_refuse``)."""
    assert run_on(2, _units_checked, (None, None, None)) == [["blocks.0"]] * 2
    assert run_on(2, _units_checked, (None, "input", None, "input")) == [["blocks.0", "blocks.1"]] * 2
    # built on the meta device (weights materialized later): traced with one random copy of blocks.0's
    assert run_on(2, _units_checked, (None, "input", None), True) == [["blocks.0", "blocks.1"]] * 2
    with pytest.raises(WorkerError, match=r"block blocks.2 \(FlipBlock\): output differs"):
        run_on(2, _units_checked, (None, "input", "hidden"), True)


def _hf_llama_with_cache(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlib.models import hf_preset

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         use_cache=True, attn_implementation=attn)).eval()
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        want = model(x).logits
    preset = hf_preset(model)
    smodel = shardlib.shard(model, shardlib.init_mesh({"tp": 2}), preset.specs, **preset.options)
    with torch.no_grad():
        got = smodel(x).logits
    return smodel.verification["units"], float((got - want).abs().max())


@pytest.mark.multiprocess
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_hugging_face_model_with_its_kv_cache_on_verifies(attn):
    """use_cache=True, the default of most configs (a new user's finding): the sample forward
    passes each layer a DynamicCache, which the unsharded check run filled with 2 key/value heads
    and the sharded run (1 head per rank) then extended: 'Sizes of tensors must match', reported as
    an inexact layout. Each run now takes its own copy of the captured inputs."""
    for units, err in run_on(2, _hf_llama_with_cache, attn):
        assert units == ["model.layers.0", ""]
        assert err < 1e-5  # measured 1.2e-7 (fp32 logits, row-parallel sums in another order)
