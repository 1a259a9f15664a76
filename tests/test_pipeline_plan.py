"""The pipeline plan: plan() on a pp mesh is what shard() applies, and sequence parallelism over
stages is refused where it would not be exact (every rank, before any communication)."""

import pickle

import pytest
import torch

import shardlib
from shardlib import AbstractMesh, ShardingError
from shardlib.models import GPT, GPTConfig, gpt_preset, tp_specs
from shardlib.parallel.schedules import bubble_fraction
from shardlib.pipeline_plan import PipelinePlan
from shardlib.testing import assert_equivalent, run_on

PP2_DP2 = AbstractMesh({"pp": 2, "dp": 2})
PP2_TP2 = AbstractMesh({"pp": 2, "tp": 2})


def _gpt(layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=layers, n_head=2, n_embd=16, bias=False))


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _shard_and_step(shape, options):
    mesh = shardlib.init_mesh(shape)
    smodel = shardlib.shard(_gpt(), mesh, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    x = shardlib.distribute(torch.randint(0, 37, (8, 9), generator=torch.Generator().manual_seed(1)), mesh, smodel.batch_spec)
    mesh.comm.reset()
    smodel.forward_backward(x[:, :-1], criterion=_ce, labels=(x[:, 1:],))
    opt.step()  # the optimizer state exists from here
    comm = {key: value for key, value in mesh.comm.table().items() if key[0] == "dp"}
    return {"pplan": smodel.pipeline_plan, "layers": smodel.stage_layers, "bytes": shardlib.model_state_bytes(smodel, opt),
            "plan": smodel.plan, "pp": mesh.index("pp"), "comm": comm}


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_plan_on_abstract_mesh_is_what_shard_applies(zero_stage):
    """plan(model, AbstractMesh({"pp": 2, "dp": 2}), schedule=...) needs no process, and equals
    the plan every rank of shard() applies: stage layers, per-stage bytes (measured after an
    optimizer step: parameter, gradient and AdamW state storage), the bubble, and the data-axis
    communication of one step of 4 microbatches (ZeRO-3 gathers in each; the stage plans printed
    one microbatch's gathers beside the step's reduce-scatter, found by a new user)."""
    options = dict(schedule="1f1b", microbatches=4, zero_stage=zero_stage, chunk_size=400)
    pplan = shardlib.plan(_gpt(), PP2_DP2, **options)
    assert isinstance(pplan, PipelinePlan) and pplan.bubble == bubble_fraction(2, 4) == 0.2
    assert pplan.stage_layers == (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    assert pickle.loads(pickle.dumps(pplan)) == pplan
    for rank, got in enumerate(run_on(4, _shard_and_step, {"pp": 2, "dp": 2}, options)):
        assert got["pplan"] == pplan  # the same value on a real mesh, on every rank
        assert got["layers"] == [list(layers) for layers in pplan.stage_layers]
        mine = shardlib.plan(_gpt(), AbstractMesh({"pp": 2, "dp": 2}, rank=rank), **options).stages[got["pp"]]
        assert got["plan"] == mine
        assert got["bytes"] == {"params": mine.param_bytes, "grads": mine.grad_bytes, "optimizer": mine.optimizer_bytes,
                                "total": mine.model_state_bytes}, (rank, got["bytes"])
        assert got["comm"] == mine.comm_per_step(micro_steps=4), (rank, got["comm"])
        calls, nbytes = got["comm"][("dp", "all_gather")]
        assert f"dp     all_gather      {calls:>5} calls  {nbytes:>16,.0f} B" in pplan.explain()
    whole = shardlib.plan(_gpt(), AbstractMesh({"dp": 2}), zero_stage=zero_stage, chunk_size=400)
    assert pplan.whole.params == whole.params  # the whole model's layout; each stage holds about half of it
    assert sum(s.param_bytes for s in pplan.stages) < 1.2 * whole.param_bytes


def test_stage_comm_counts_whole_schedule_runs():
    """A ZeRO-3 stage plan counts its schedule's gathers, so a step's microbatches must be whole
    runs of it: 3 of a 2-microbatch schedule are refused with the fix named, on an abstract mesh."""
    stage = shardlib.plan(_gpt(), PP2_DP2, schedule="zbv", microbatches=2, zero_stage=3).stages[0]
    with pytest.raises(ValueError, match=r"comm_per_step\(micro_steps=3\) of a pipeline stage: .* a positive multiple "
                                         r"of 2. Fix: micro_steps=2 for one forward_backward"):
        stage.comm_per_step(micro_steps=3)


def test_pipeline_plan_explain():
    pplan = shardlib.plan(_gpt(), PP2_DP2, schedule="1f1b", microbatches=4, zero_stage=1)
    text = pplan.explain()
    # (issue 14: the bubble is on the line after the schedule, and the model state per pp rank a
    # table, so that every line of the summary fits in 100 characters)
    assert "schedule 1f1b, 4 microbatches\n  bubble (p-1)/(vm+p-1) = 0.200; peak stashed microbatches per rank [2, 1]\n" in text
    assert "stage 0 on rank 0: embed, blocks.0, blocks.1 (3 layers" in text and "stage 1 on rank 1: blocks.2" in text
    s0, s1 = pplan.stages
    row = next(line.split() for line in text.splitlines() if line.startswith("  1  "))  # pp rank 1's row
    assert row[:5] == ["1"] + [f"{b:,}" for b in (s1.param_bytes, s1.grad_bytes, s1.optimizer_bytes, s1.model_state_bytes)]
    assert "tied across stages: wte.weight = lm_head.weight on pp ranks [0, 1]" in text
    assert "bytes per boundary transfer: needs tokens=" in text
    assert " 0F0 " in text and "stage plan of pp rank 1 (stages 1; communication per step of 4 microbatches):" in text
    assert "rank 2 at {'pp': 1, 'dp': 0}" in text  # stage 1 seen from the rank at pp 1 with our dp coordinate
    # 2 rows x 8 tokens per microbatch, width 16, fp32; each rank sends 4 activations or 4 gradients
    assert "bytes per boundary transfer: 1,024 (16 tokens per microbatch" in pplan.summary(tokens=16)
    assert "transfers per step: rank 0 4, rank 1 4" in pplan.summary(tokens=16)
    interleaved = shardlib.plan(_gpt(6), PP2_DP2, schedule="interleaved_1f1b", microbatches=4, virtual_stages=2)
    assert interleaved.transfers_per_step(0) == 4 * 3 and interleaved.bubble == bubble_fraction(2, 4, 2)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert "bytes per boundary transfer: unknown" in shardlib.plan(seq, AbstractMesh({"pp": 2})).summary(tokens=8)


def test_pipeline_options_without_a_pipeline_axis():
    """plan() and shard() refuse pipeline options on a mesh without pp with the same message."""
    messages = []
    for make in (lambda: shardlib.plan(_gpt(), AbstractMesh({"dp": 1}), schedule="1f1b"),
                 lambda: shardlib.shard(_gpt(), shardlib.init_mesh({"dp": 1}), schedule="1f1b")):
        with pytest.raises(ShardingError, match=r"option schedule='1f1b' needs a pipeline axis 'pp' of size > 1 in the "
                                                r"mesh \{'dp': 1\}. Fix: add the axis to the mesh") as err:
            make()
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    with pytest.raises(ShardingError, match="option microbatches=4 needs a pipeline axis 'pp'"):
        shardlib.plan(_gpt(), AbstractMesh({"dp": 2, "pp": 1}), microbatches=4)
    assert isinstance(shardlib.plan(_gpt(), AbstractMesh({"dp": 2, "pp": 1})), shardlib.Plan)  # pp of size 1: no pipeline


SP = dict(sequence_parallel=True, schedule="1f1b", microbatches=2)
REFUSED = [
    (dict(specs=gpt_preset().specs, sp_entry="blocks.2"), ["entry 'blocks.2' is on stage 1", "not on stage 0",
                                                            "Fix: sp_entry= a module of the first stage"]),
    (dict(specs=tp_specs(), sp_exit="blocks.3", split_points=["head"]),
     ["'blocks.3' gathers the sequence but is on stage 0", "not on the last stage 1", "Fix: split_points="]),
    (dict(specs=tp_specs(), sp_exit="blocks.1"), ["sp_exit 'blocks.1' is inside the sequence-parallel region's block",
                                                  "Fix: sp_exit='blocks.3'"]),
    (dict(specs=tp_specs(), sp_exit="ln_f", split_points=["blocks.0"]),
     ["pp rank 0 holds layers ['embed'] with no tensor-parallel layer", "Fix: split_points= that give every stage a block"]),
]


@pytest.mark.parametrize("given,parts", REFUSED)
def test_sequence_parallel_over_stages_refused_where_not_exact(given, parts):
    import re

    given = dict(given)
    specs = given.pop("specs")
    with pytest.raises(ShardingError, match=".*".join(re.escape(p) for p in parts)):
        shardlib.plan(_gpt(), PP2_TP2, specs, **SP, **given)


def _gpt_out(out, y):
    return _ce(out[0] if isinstance(out, tuple) else out, y)


@pytest.mark.multiprocess
def test_sequence_parallel_exit_defaults_to_the_last_block():
    """No tensor-parallel LM head to gather the sequence (tp_specs() leaves it replicated): the
    last block gathers it (backward: this rank's slice), on the last stage, and training is exact
    (on 59e6484 this layout was refused: "nothing gathers the sequence")."""
    p = shardlib.plan(_gpt(), PP2_TP2, tp_specs(), **SP)
    assert p.whole.sp_exit == "blocks.3" and p.stages[1].sp_exit == "blocks.3" and p.stages[0].sp_exit == ""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 37, (4, 9), generator=g)
    assert_equivalent(_gpt, {"pp": 2, "tp": 2}, tp_specs(), (x[:, :-1], x[:, 1:]), steps=2, loss_fn=_gpt_out, **SP)


def test_sequence_parallel_allowed_layouts():
    """The exit on the last stage (a replicated LM head after ln_f's gather); the embedding stage
    alone when its embedding is vocabulary parallel; the entry fields per rank."""
    pplan = shardlib.plan(_gpt(), PP2_TP2, tp_specs(), sp_exit="ln_f", **SP)
    assert [s.sp_exit for s in pplan.stages] == ["", "ln_f"] and [s.sp_entry for s in pplan.stages] == ["drop", None]
    pplan = shardlib.plan(_gpt(), PP2_TP2, gpt_preset().specs, split_points=["blocks.0"], **SP)
    assert pplan.stage_layers[0] == ("embed",) and [layer.kind for layer in pplan.stages[0].tp_layers] == ["vocab"]
    assert pplan.stages[0].sp_grad_params == () and "ln_f.weight" in pplan.stages[1].sp_grad_params
    assert "sequence parallel over 'tp': stage 0 splits the sequence at 'drop'" in pplan.explain(tokens=16)
    assert pplan.boundary_bytes(16) == 8 * 16 * 4


def test_hugging_face_pipelines_refuse_sequence_parallel():
    """HF models pipeline (shardlib.models.hf, tests/test_hf_pipeline.py), but not under sequence
    parallelism: their layers build masks and positions from each layer's input length."""
    transformers = pytest.importorskip("transformers")
    from shardlib.models import llama_preset

    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    with pytest.raises(ShardingError, match="LlamaForCausalLM's pipeline layers build masks and rotary positions"):
        shardlib.plan(transformers.LlamaForCausalLM(cfg), PP2_TP2, llama_preset().specs, **SP)
    assert shardlib.plan(transformers.LlamaForCausalLM(cfg), PP2_TP2, llama_preset().specs,
                         **dict(SP, sequence_parallel=False)).stage_layers[1][-1] == "head"


def _refused_on_every_rank(case):
    mesh = shardlib.init_mesh({"pp": 2, "tp": 2})
    if case == "plan":
        shardlib.shard(_gpt(), mesh, gpt_preset().specs, sp_entry="blocks.2", **SP)
    smodel = shardlib.shard(_gpt(), mesh, gpt_preset().specs, **SP)
    x = torch.randint(0, 37, (4, 8))  # a sequence of 7 does not split over tp=2
    mesh.comm.reset()
    try:
        smodel.forward_backward(x[:, :-1], criterion=_ce, labels=(x[:, 1:],))
    finally:
        assert not mesh.comm.calls("pp", "send")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,words", [("plan", "not on stage 0"), ("run", "sequence length divisible by 2")])
def test_sequence_parallel_refusals_on_every_rank(case, words):
    with pytest.raises(shardlib.WorkerError) as err:
        run_on(4, _refused_on_every_rank, case)
    assert set(err.value.errors) == {0, 1, 2, 3}
    assert all(t == "ShardingError" and words in m for t, m in err.value.errors.values())


def test_a_stage_planned_apart_from_the_verified_whole_model_is_refused(monkeypatch):
    """Each stage is planned again on its own containers; where that differed from the whole model's
    plan (the one shard(verify=True) proves), a stage ran an unverified layout (OPT's layer norms
    summed over tp; see test_hf_pipeline). A stage whose tensor-parallel layers differ is now
    refused: here the stage's analysis is made to plan the LM head as a row layer."""
    import dataclasses
    import importlib

    from shardlib.parallel.pipeline import Stage

    plan_mod = importlib.import_module("shardlib.plan")  # the module (shardlib.plan is the function)

    real = plan_mod.analyze_tensor_parallel

    def drifting(model, *args, **kwargs):
        roles, layers = real(model, *args, **kwargs)
        if isinstance(model, Stage):
            layers = [dataclasses.replace(l, output_layer=False) if l.output_layer else l for l in layers]
        return roles, layers

    shardlib.plan(_gpt(), PP2_TP2, gpt_preset().specs, microbatches=2)  # as planned: accepted
    monkeypatch.setattr(plan_mod, "analyze_tensor_parallel", drifting)
    with pytest.raises(ShardingError, match=r"pp rank 1: the stage's tensor-parallel layout differs from the whole "
                                            r"model's, which is the one verified \(first difference: lm_head"):
        shardlib.plan(_gpt(), PP2_TP2, gpt_preset().specs, microbatches=2)
