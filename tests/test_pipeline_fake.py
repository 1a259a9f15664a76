"""A pipeline step on torch's fake process group: one process plays every rank of the world.

A fake group (``init_process_group("fake", store=FakeStore(), ...)``) completes every collective
at once and moves nothing: a dry run of the real layout, whose shapes and counted bytes are those
of the rank played. The default group of a process is made once, so the ranks run in a fresh
interpreter (this file run as a script, once for every case), one after another.
"""

import functools
import json

import pytest

transformers = pytest.importorskip("transformers")


def _play_every_rank(shape: dict, specs_name: str | None) -> list[dict]:
    """In this process (no default group yet): shard a tiny LLaMA as each rank of ``shape`` on a
    fake group, run one pipeline step and one optimizer step, and report what the rank saw."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardlib
    from shardlib.models import llama_preset

    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    world = 1
    for size in shape.values():
        world *= size
    x = torch.randint(0, 37, (8, 9), generator=torch.Generator().manual_seed(0))  # global (B, T + 1)
    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = shardlib.init_mesh(shape)
            torch.manual_seed(0)
            specs = llama_preset().specs if specs_name else None
            smodel = shardlib.shard(transformers.LlamaForCausalLM(cfg), mesh, specs, schedule="1f1b", microbatches=2,
                                    zero_stage=1)
            opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
            local = shardlib.distribute(x, mesh, smodel.batch_spec)  # (B / dp, T + 1)
            mesh.comm.reset()
            losses, _ = smodel.forward_backward(
                local[:, :-1], criterion=lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                            y.flatten()),
                labels=(local[:, 1:],))
            sent, calls = mesh.comm.bytes("pp", "send"), mesh.comm.calls("pp", "send")
            opt.step()
            pplan, index = smodel.pipeline_plan, mesh.index("pp")
            tokens = local.shape[0] // pplan.m * (local.shape[1] - 1)  # per microbatch
            out.append({"rank": rank, "pp": index, "losses": None if losses is None else [float(v) for v in losses],
                        "sent": sent, "calls": calls, "planned_calls": pplan.transfers_per_step(index),
                        "planned_bytes": pplan.transfers_per_step(index) * pplan.boundary_bytes(tokens)})
        finally:
            dist.destroy_process_group()
    return out


def _refuse_unknown_width() -> str:
    """A pipeline without a config width cannot be dry-run on a fake group: refused, named."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardlib
    from shardlib.errors import ShardingError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = shardlib.init_mesh({"pp": 2})
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        smodel = shardlib.shard(model, mesh, microbatches=2)
        with pytest.raises(ShardingError, match=r"fake process group: a fake receive fills no buffer, so each stage "
                                                r"receives zeros of the planned boundary shape .* the width of "
                                                r"Sequential is unknown"):
            smodel.forward_backward(torch.zeros(4, 4), criterion=lambda y: y.sum())
        # a stage whose output shape depends on the data: transfers are sized by the first microbatch
        from shardlib.models import GPT, GPTConfig

        gpt = shardlib.shard(GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)), mesh,
                             microbatches=2)
        stage, calls = gpt.module, []

        def forward(chunk, x):
            out = type(stage).forward(stage, chunk, x)
            calls.append(1)
            return out[:, :-1] if len(calls) == 2 else out  # the second microbatch's output one position short

        stage.forward = forward
        x = torch.zeros(4, 9, dtype=torch.long)
        with pytest.raises(ShardingError, match=r"stage 0's output for microbatch 1 has shape \(2, 7, 16\) \(float32\), "
                                                r"but this input signature's first microbatch gave \(2, 8, 16\) "
                                                r"\(float32\)\. Transfers between stages are sized once per input shape"):
            gpt.forward_backward(x[:, :-1], criterion=lambda y, t: y.sum(), labels=(x[:, 1:],))
        return "refused"
    finally:
        dist.destroy_process_group()


CASES = [("play", {"pp": 2, "dp": 2}, None), ("play", {"pp": 2, "dp": 2, "tp": 2}, "llama"), ("refuse",)]


def _every_case(cases) -> list:
    return [_play_every_rank(*case[1:]) if case[0] == "play" else _refuse_unknown_width() for case in cases]


@functools.lru_cache(maxsize=None)
def _fresh_results() -> list:
    """Every case of CASES, one after another in one fresh process with no process group
    (tests/_inpool.py): one process for all three, not one each. Through JSON, as the tests read them."""
    from _inpool import in_fresh_process

    return json.loads(json.dumps(in_fresh_process(_every_case, CASES)))


def _in_fresh_process(*case) -> object:
    return _fresh_results()[CASES.index(tuple(case))]


@pytest.mark.parametrize("shape,specs", [case[1:] for case in CASES if case[0] == "play"])
def test_pipeline_step_on_fake_group(shape, specs):
    """Every rank of the world runs its step: the last stages get their microbatch losses, the
    others (None, None); each counted its planned sends, of the planned boundary bytes."""
    ranks = _in_fresh_process("play", shape, specs)  # the results of one fresh process for every case
    world = len(ranks)
    assert [r["rank"] for r in ranks] == list(range(world)) and world == 2 * shape["dp"] * shape.get("tp", 1)
    for r in ranks:
        if r["pp"] == 1:
            assert len(r["losses"]) == 2 and all(v == v and v > 0 for v in r["losses"])  # finite cross-entropies
        else:
            assert r["losses"] is None
        assert r["calls"] == r["planned_calls"] == 2  # 2 microbatches: activations out of stage 0, gradients out of 1
        assert r["sent"] == r["planned_bytes"] == 2 * 2 * 8 * 16 * 4  # (rows 2, seq 8, width 16) fp32, twice


def test_fake_group_refuses_a_pipeline_of_unknown_width_and_data_dependent_shapes():
    assert _in_fresh_process("refuse") == "refused"
