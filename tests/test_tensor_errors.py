"""Bad tensor-parallel specs raise ShardingError at plan time, naming what was given.

Tier 0: ``shardlib.plan`` on an :class:`~shardlib.AbstractMesh` (no process group). One
multi-process test checks that the same errors are raised identically on every rank of a real
two-rank mesh with zero collectives recorded, and that the ranks are still in step afterwards.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardlib import AbstractMesh, P, ShardingError, plan
from shardlib.models import gpt_preset
from shardlib.models.gpt import GPT, GPTConfig, tp_specs
from shardlib.testing import run_on

TP2 = AbstractMesh({"tp": 2})
TP4 = AbstractMesh({"tp": 4})
TP2_EP2 = AbstractMesh({"tp": 2, "ep": 2})
DP2_TP2 = AbstractMesh({"dp": 2, "tp": 2})


def gpt(**overrides) -> GPT:
    """A one-block GPT: n_embd 16, 4 heads of 4, MLP width 64."""
    cfg = dict(vocab_size=37, block_size=8, n_layer=1, n_head=4, n_embd=16)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


class GQAAttention(nn.Module):
    """Grouped-query attention projections with the attributes the planner reads (LLaMA's names):
    ``head_dim``, ``num_heads``, ``num_key_value_heads``; or the same on ``config`` (Hugging Face)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, on_config: bool = False):
        super().__init__()
        names = {"head_dim": head_dim, "num_heads": heads, "num_key_value_heads": kv_heads}
        if on_config:
            self.config = SimpleNamespace(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
        else:
            for k, v in names.items():
                setattr(self, k, v)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class GQAModel(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = GQAAttention(**kw)


GQA_SPECS = {"attn.[qkv]_proj.weight": P("tp", None), "attn.o_proj.weight": P(None, "tp")}


class Scale(nn.Module):
    """A module with a 2-D weight that is neither Linear, Conv1D nor Embedding."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))


def pattern(parts):
    return ".*".join(re.escape(p) for p in parts)


# (id, the bad call, the parts its message must contain, in order)
CASES = [
    (
        "heads-not-divisible",
        lambda: plan(gpt(n_head=3, n_embd=12), TP2, tp_specs()),
        ["attention blocks.0.attn", "blocks.0.attn.q_proj has 3 heads", "(out_features 12, head_dim 4)",
         "do not split over 'tp' of size 2", "(mesh {'tp': 2})", "Fix: use a tensor axis size dividing 3"],
    ),
    (
        "heads-not-divisible:tp4",
        lambda: plan(gpt(n_head=2, n_embd=16), TP4, tp_specs()),
        ["blocks.0.attn.q_proj has 2 heads", "(out_features 16, head_dim 8)", "'tp' of size 4"],
    ),
    (
        "kv-heads-not-divisible",
        lambda: plan(GQAModel(hidden=32, heads=8, kv_heads=2, head_dim=4), TP4, GQA_SPECS),
        ["attention attn", "attn.k_proj has 2 key/value heads", "(out_features 8, head_dim 4)",
         "do not split over 'tp' of size 4", "{'tp': 4}", "Fix: use a tensor axis size dividing 2"],
    ),
    (
        "kv-heads-not-divisible:config",
        lambda: plan(GQAModel(hidden=24, heads=6, kv_heads=3, head_dim=4, on_config=True), TP2, GQA_SPECS),
        ["attn.k_proj has 3 key/value heads", "(out_features 12, head_dim 4)", "'tp' of size 2"],
    ),
    (
        "row-without-column-partner",
        lambda: plan(gpt(), TP2, {"blocks.*.attn.o_proj.weight": P(None, "tp")}),
        ["row-parallel layer blocks.0.attn.o_proj", "(split over 'tp', size 2)", "no column-parallel partner",
         "in blocks.0.attn", "its input would arrive whole", "Fix: split the layer(s) feeding it",
         "P('tp', None)"],
    ),
    (
        "row-without-column-partner:mlp",
        lambda: plan(gpt(), TP2, {"blocks.*.mlp.fc_out.weight": P(None, "tp")}),
        ["row-parallel layer blocks.0.mlp.fc_out", "no column-parallel partner", "in blocks.0.mlp"],
    ),
    (
        "mismatched-qkv",
        lambda: plan(gpt(), TP2, {"blocks.*.attn.[qv]_proj.weight": P("tp", None),
                                  "blocks.*.attn.o_proj.weight": P(None, "tp")}),
        ["in blocks.0.attn", "blocks.0.attn.k_proj is not column parallel over 'tp'",
         "while blocks.0.attn.q_proj, blocks.0.attn.v_proj are", "blocks.0.attn.o_proj is row parallel",
         "must be column parallel on the same axis",
         "Fix: if blocks.0.attn.k_proj reads the same input as blocks.0.attn.q_proj (q/k/v, gate/up), give "
         "blocks.0.attn.k_proj.weight the same spec as blocks.0.attn.q_proj.weight"],
    ),
    (
        # a flat nn.Sequential: no two layers read the same input, so the fix is to move the pair
        # (the message claimed 0 read the same input as 2 and proposed its spec, which verify
        # then refused; found by a new-user test)
        "replicated-linear-beside-a-pair:sequential",
        lambda: plan(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16),
                                   nn.Linear(16, 4)), TP2, {"2.weight": P("tp", None), "4.weight": P(None, "tp")}),
        ["in <root>, 0 is not column parallel over 'tp' while 2 is, and 4 is row parallel",
         "a replicated Linear cannot share that module", "In an nn.Sequential no two layers read the same input",
         "Fix: move 2 ... 4 (and what runs between them) into an nn.Sequential of their own, one child of <root>"],
    ),
    (
        "mismatched-qkv:other-axis",
        lambda: plan(gpt(), TP2_EP2, {"blocks.*.attn.[qv]_proj.weight": P("tp", None),
                                      "blocks.*.attn.k_proj.weight": P("ep", None),
                                      "blocks.*.attn.o_proj.weight": P(None, "tp")}),
        ["blocks.0.attn.k_proj is not column parallel over 'tp'", "give blocks.0.attn.k_proj.weight the same spec",
         "move blocks.0.attn.q_proj, blocks.0.attn.v_proj and blocks.0.attn.o_proj into a module of their own"],
    ),
    (
        "norm-weight-split",
        lambda: plan(gpt(), TP2, dict(tp_specs(), **{"blocks.0.ln_1.weight": P("tp")})),
        ["blocks.0.ln_1.weight (shape (16,))", "of the norm blocks.0.ln_1 is split over 'tp'",
         "norm weights are never split", "(mesh {'tp': 2})", "Fix: leave the norm weight replicated (P())"],
    ),
    (
        "norm-weight-split:final",
        lambda: plan(gpt(), TP2, dict(tp_specs(), **{"ln_f.weight": P("tp")})),
        ["ln_f.weight (shape (16,)) of the norm ln_f is split over 'tp'", "never split"],
    ),
    (
        "bias-split-without-weight",
        lambda: plan(gpt(), TP2, {"blocks.0.mlp.fc_in.bias": P("tp")}),
        ["blocks.0.mlp.fc_in.bias (shape (64,)) is split over 'tp'",
         "Linear blocks.0.mlp.fc_in has no weight split over it", "Fix: split the weight (a bias follows its weight)"],
    ),
    (
        "bias-split-without-weight:other-axis",
        lambda: plan(gpt(), TP2_EP2, {**{k: v for k, v in tp_specs().items() if k != "blocks.*.mlp.fc_in.bias"},
                                      "blocks.*.mlp.fc_in.bias": P("ep")}),
        ["blocks.0.mlp.fc_in.bias (shape (64,)) is split over 'ep'", "has no weight split over it"],
    ),
    (
        "sequence-parallel-without-row-layer",
        lambda: plan(gpt(), TP2, {"wte.weight": P("tp", None)}, sequence_parallel=True),
        ["sequence_parallel=True needs tensor-parallel column/row layer pairs", "split no row layer",
         "(mesh {'tp': 2})", "Fix: add tensor-parallel specs", "or drop sequence_parallel"],
    ),
    (
        "sequence-parallel-without-row-layer:no-specs",
        lambda: plan(gpt(), AbstractMesh({"dp": 2}), None, sequence_parallel=True),
        ["sequence_parallel=True needs", "split no row layer", "{'dp': 2}"],
    ),
    (
        "sequence-parallel-without-entry",
        lambda: plan(mlp(), TP2, {"0.weight": P("tp", None), "2.weight": P(None, "tp")}, sequence_parallel=True),
        ["sequence_parallel=True needs an entry into the sequence-parallel region", "Sequential has neither",
         "Fix: pass sp_entry="],
    ),
    (
        "two-tensor-axes",
        lambda: plan(gpt(), TP2_EP2, {"blocks.*.mlp.fc_in.weight": P("tp", "ep")}),
        ["the spec P('tp', 'ep')", "(pattern 'blocks.*.mlp.fc_in.weight')", "of blocks.0.mlp.fc_in.weight",
         "(shape (64, 16))", "splits it over several tensor axes ['tp', 'ep']", "Fix: use one axis"],
    ),
    (
        "two-tensor-axes:one-entry",
        lambda: plan(gpt(), TP2_EP2, {"blocks.*.mlp.fc_in.weight": P(("tp", "ep"), None)}),
        ["the spec P(('tp', 'ep'), None)", "blocks.0.mlp.fc_in.weight", "several tensor axes ['tp', 'ep']"],
    ),
    (
        "data-and-tensor-axis-in-one-entry",
        lambda: plan(gpt(), DP2_TP2, {"blocks.*.mlp.fc_in.weight": P(("dp", "tp"), None)}),
        ["the spec P(('dp', 'tp'), None)", "(pattern 'blocks.*.mlp.fc_in.weight')", "of blocks.0.mlp.fc_in.weight",
         "mixes the data axis and the tensor axis 'tp' in one dimension", "Fix: drop the data axis from the spec"],
    ),
    (
        "data-and-tensor-axis-in-one-entry:reversed",
        lambda: plan(gpt(), DP2_TP2, {"blocks.*.attn.o_proj.weight": P(None, ("tp", "dp"))}, zero_stage=3),
        ["P(None, ('tp', 'dp'))", "blocks.0.attn.o_proj.weight", "mixes the data axis and the tensor axis 'tp'"],
    ),
    (
        "unsupported-module-split",
        lambda: plan(nn.Sequential(Scale()), TP2, {"0.weight": P("tp", None)}),
        ["0.weight of Scale 0 is split over 'tp'", "(spec P('tp', None))",
         "lowers only Linear, Conv1D and Embedding weights", "Fix: leave it replicated"],
    ),
    (
        "vocab-parallel-logits-without-output-layer",
        lambda: plan(gpt(), TP2, tp_specs(), vocab_parallel_logits=True),  # lm_head tied to a replicated wte
        ["vocab_parallel_logits=True keeps the logits of the output layer", "(a column-parallel Linear with no "
         "row-parallel partner: the LM head)", "but GPT has none on the mesh {'tp': 2}",
         "Fix: split the LM head by output features (P('tp', None) on its weight", "or drop vocab_parallel_logits"],
    ),
    (
        "vocab-parallel-logits-without-output-layer:no-tp-layer",
        lambda: plan(gpt(), AbstractMesh({"dp": 2}), None, vocab_parallel_logits=True),
        ["but GPT has none on the mesh {'dp': 2} (no layer is tensor parallel)"],
    ),
    (
        "vocab-parallel-logits-on-a-pipeline",
        lambda: plan(gpt(n_layer=2), AbstractMesh({"pp": 2, "tp": 2}), gpt_preset().specs, **gpt_preset().options),
        ["vocab_parallel_logits=True on the pipeline mesh {'pp': 2, 'tp': 2}", "forward_backward's criterion, which "
         "is given the whole vocabulary", "Fix: vocab_parallel_logits=False (models.gpt_preset() sets it"],
    ),
    (
        "vocab-parallel-logits-not-a-bool",
        lambda: plan(gpt(), TP2, gpt_preset().specs, vocab_parallel_logits="yes"),
        ["vocab_parallel_logits must be True or False, got 'yes' of type str"],
    ),
    (
        "embedding-with-max-norm-split",
        lambda: plan(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)), TP2, {"0.weight": P("tp", None)}),
        ["0.weight of the embedding 0 is split over 'tp'", "['max_norm']", "Fix: leave this embedding replicated"],
    ),
]

KINDS = {case_id.split(":")[0] for case_id, _, _ in CASES}


def test_cases_are_distinct():
    assert len(KINDS) >= 12
    assert len({case_id for case_id, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("call, parts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_tensor_parallel_spec_raises_sharding_error(call, parts):
    with pytest.raises(ShardingError, match=pattern(parts)):
        call()


@pytest.mark.parametrize("call", [
    lambda: plan(gpt(n_head=4), TP4, tp_specs()),  # 4 heads over 4
    lambda: plan(gpt(n_head=4), TP2, dict(tp_specs(), **{"wte.weight": P("tp", None)}), sequence_parallel=True),
    lambda: plan(GQAModel(hidden=32, heads=8, kv_heads=4, head_dim=4), TP4, GQA_SPECS),  # kv 4 over 4
    lambda: plan(GQAModel(hidden=32, heads=8, kv_heads=2, head_dim=4, on_config=True), TP2, GQA_SPECS),
    lambda: plan(gpt(), DP2_TP2, dict(tp_specs(), **{"blocks.*.mlp.fc_in.weight": P("tp", "dp")}), zero_stage=3),
    lambda: plan(gpt(), TP2, dict(tp_specs(), **{"blocks.*.mlp.fc_in.bias": P("tp")})),  # a bias follows its weight
], ids=["heads-4-over-4", "gpt-vocab-parallel-sp", "kv-heads-4-over-4", "kv-heads-2-over-2-config",
        "tp-and-dp-in-different-dims", "column-bias-with-weight"])
def test_good_tensor_parallel_specs_plan(call):
    """The near misses of the cases above are accepted (the checks are not over-eager)."""
    p = call()
    assert p.tp_layers


def test_gpt_preset_keeps_the_lm_head_logits_vocabulary_parallel():
    """gpt_preset()'s option (Megatron's parallel_output): only the output layer, lm_head, keeps its
    output split; without the option every output layer gathers, as before."""
    for mesh, sp in ((TP2, False), (DP2_TP2, True)):
        p = plan(gpt(), mesh, gpt_preset().specs, sequence_parallel=sp, **gpt_preset().options)
        assert [layer.path for layer in p.tp_layers if layer.parallel_output] == ["lm_head"]
        assert "lm_head               column tp  16 -> 37 (output, vocabulary-parallel)" in p.explain()
    p = plan(gpt(), TP2, gpt_preset().specs)
    assert not any(layer.parallel_output for layer in p.tp_layers)
    assert [layer.path for layer in p.tp_layers if layer.output_layer] == ["lm_head"]


def test_row_layer_bias_split_is_rejected():
    try:
        p = plan(gpt(), TP2, dict(tp_specs(), **{"blocks.*.mlp.fc_out.bias": P("tp")}))
    except ShardingError as exc:
        assert re.search(pattern(["blocks.0.mlp.fc_out.bias", "'tp'", "row"]), str(exc)), str(exc)
        return
    bias = p.param("blocks.0.mlp.fc_out.bias")
    assert bias.spec == P("tp") and bias.tp_axis is None  # what happens: the spec is kept and ignored
    raise AssertionError(f"P('tp') on the row-parallel bias was accepted and ignored: strategy {bias.strategy!r}")


def test_mismatched_qkv_message_does_not_list_the_offender_as_matching():
    with pytest.raises(ShardingError) as info:
        plan(gpt(), TP2_EP2, {"blocks.*.attn.[qv]_proj.weight": P("tp", None),
                              "blocks.*.attn.k_proj.weight": P("ep", None),
                              "blocks.*.attn.o_proj.weight": P(None, "tp")})
    message = str(info.value)
    assert "while blocks.0.attn.q_proj, blocks.0.attn.v_proj are" in message, message


# -- on every rank, before any communication ---------------------------------------------------

BAD_TP_CALLS = [
    ("heads", {"n_head": 3, "n_embd": 12}, {"tp": 2}, tp_specs(), {}),
    ("row", {}, {"tp": 2}, {"blocks.*.attn.o_proj.weight": P(None, "tp")}, {}),
    ("qkv", {}, {"tp": 2}, {"blocks.*.attn.[qv]_proj.weight": P("tp", None), "blocks.*.attn.o_proj.weight": P(None, "tp")}, {}),
    ("norm", {}, {"tp": 2}, dict(tp_specs(), **{"blocks.0.ln_2.weight": P("tp")}), {}),
    ("bias", {}, {"tp": 2}, {"blocks.0.mlp.fc_in.bias": P("tp")}, {}),
    ("sp", {}, {"tp": 2}, {"wte.weight": P("tp", None)}, {"sequence_parallel": True}),
    ("two-axes", {}, {"tp": 2, "ep": 1}, {"blocks.*.mlp.fc_in.weight": P("tp", "ep")}, {}),
    ("mix", {}, {"dp": 1, "tp": 2}, {"blocks.*.mlp.fc_in.weight": P(("dp", "tp"), None)}, {}),
]


def _shard_tp_badly_on_every_rank():
    """Per bad call: (error type, message, collectives recorded); then a sequence length that
    sequence parallelism cannot split (raised in the forward, on both ranks); then a check that
    the ranks are still in step."""
    import shardlib
    from shardlib.models.gpt import GPT, GPTConfig

    calls = []
    for _, cfg, mesh_shape, specs, options in BAD_TP_CALLS:
        mesh = shardlib.init_mesh(mesh_shape)
        mesh.comm.reset()
        conf = dict(vocab_size=37, block_size=8, n_layer=1, n_head=4, n_embd=16)
        conf.update(cfg)
        try:
            shardlib.shard(GPT(GPTConfig(**conf)), mesh, specs, **options)
            calls.append(None)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            calls.append((type(exc).__name__, str(exc), mesh.comm.calls()))
    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    specs = dict(tp_specs(), **{"wte.weight": P("tp", None)})
    smodel = shardlib.shard(GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=4, n_embd=16)), mesh, specs,
                            sequence_parallel=True)
    idx = torch.zeros(2, 7, dtype=torch.long)
    try:
        smodel(idx, idx)
        runtime = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        runtime = (type(exc).__name__, str(exc))
    after = shardlib.all_reduce(torch.ones(1), "tp", mesh=mesh).item()
    return {"calls": calls, "runtime": runtime, "after": after}


@pytest.mark.multiprocess
def test_bad_tp_specs_raise_on_every_rank_before_communication():
    ranks = run_on(2, _shard_tp_badly_on_every_rank)
    assert len(ranks[0]["calls"]) == len(BAD_TP_CALLS)
    for i, (name, *_) in enumerate(BAD_TP_CALLS):
        outcomes = [r["calls"][i] for r in ranks]
        assert all(o is not None and o[0] == "ShardingError" for o in outcomes), (name, outcomes)
        assert outcomes[0][1] == outcomes[1][1], f"{name}: the ranks raised different messages"
        assert outcomes[0][2] == outcomes[1][2] == 0, f"{name}: communicated before raising"
    runtime = {r["runtime"] for r in ranks}
    assert len(runtime) == 1, runtime
    exc_type, message = runtime.pop()
    assert exc_type == "ShardingError"
    assert re.search(pattern(["sequence_parallel splits the sequence over 'tp' (size 2)", "sequence length is 7",
                              "Fix: use a length divisible by 2"]), message), message
    assert [r["after"] for r in ranks] == [2.0, 2.0]


class _BlockWithSplitAux(nn.Module):
    """A block that also returns its column layer's output (as a decoder layer returns the
    attention weights of its heads): split over tp by the lowering."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.relu(h)), h


class _NetWithSplitAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_BlockWithSplitAux()])

    def forward(self, x):
        return self.blocks[0](x)[0]


def _shard_a_block_with_a_split_aux_output():
    import shardlib

    mesh = shardlib.init_mesh({"tp": 2})
    try:
        shardlib.shard(_NetWithSplitAux(), mesh, {"blocks.0.up.weight": P("tp", None), "blocks.0.down.weight": P(None, "tp")},
                       verify_input=torch.randn(2, 8))
    except ShardingError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.multiprocess
def test_a_split_output_besides_the_first_is_named_without_sequence_parallelism():
    """The refusal said 'only the first output of a sequence-parallel block is a sequence shard'
    with sequence parallelism off (Falcon's decoder layer returns its heads' attention weights; a
    new user's finding). It now names the output, its shapes and what to do."""
    for message in run_on(2, _shard_a_block_with_a_split_aux_output):
        assert "output 1 has shape (2, 8) sharded, (2, 16) expected: an output besides the first" in message, message
        assert "sequence-parallel" not in message, message
