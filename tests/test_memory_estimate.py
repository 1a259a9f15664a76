"""The predicted peak per rank (shardlib.memory_estimate): its terms on a plan, explain() with
tokens, a model it does not model, bad tokens. Predicted against measured peaks is in
tests/test_benchmarks.py (test_predicted_peak_within_ten_percent_of_the_measured)."""

import pytest
import torch

import shardlib
from shardlib.memory_estimate import block_elements
from shardlib.mesh import AbstractMesh
from shardlib.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def test_terms_follow_the_plan_and_the_formula():
    """Activations: blocks x 16 h x tokens x 4 B (Korthikanti's terms for this block) plus the
    head (2 h + V); full recompute keeps h per block and rebuilds one block's other 15 h; ZeRO-3 adds the
    search's gathered working set; stages 0-1 hold one chunk's gradient buffer at the start of
    backward, stages 2-3 none."""
    model = GPT(CFG)
    tokens, h = 256, CFG.n_embd
    for stage in range(4):
        plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=stage)
        est = plan.peak_estimate(tokens)
        assert block_elements(plan.activation_shape) == 16 * h
        assert est.activations == tokens * (CFG.n_layer * 16 * h + 2 * h + CFG.vocab_size) * 4
        assert est.state == plan.param_bytes + plan.optimizer_bytes
        assert est.gathered == (plan.chunk_search.working_bytes if stage == 3 else 0)
        one = max(c.padded_numel * c.element_size for c in plan.chunks)
        assert est.grads == (one if stage <= 1 else 0) and est.moment == "start of backward"
        assert est.total == est.state + est.gathered + est.grads + est.activations + est.workspace
    full = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, activation_checkpointing="full").peak_estimate(8)
    # tiny activations: the end of backward (every reduced shard, the last chunk packed) is the peak
    assert full.moment == "end of backward" and full.activations == 0
    many = 16384  # enough tokens that the start of backward is the peak again
    full = plan.peak_estimate(many, activation_checkpointing="full")
    assert full.moment == "start of backward"
    # every block's input, plus what the recomputed top block did not keep (16 h - h), plus the head
    assert full.activations == many * (CFG.n_layer * h + 15 * h + 2 * h + CFG.vocab_size) * 4



def test_under_full_recompute_the_lowest_blocks_backward_can_be_the_peak():
    """With full recompute the saved activations are small, and the backward of the lowest
    block can hold more than the start of backward: its rebuilt 16 h per token plus the
    reduced gradient shards of the chunks above it and the unreduced buffer of the last one
    packed (measured on the quick GPT: the peak at blocks.0's recomputed GELU backward, where
    the estimate of the start of backward alone was 0.931 of the measured peak,
    test_benchmarks.test_predicted_peak_within_ten_percent_of_the_measured)."""
    model, tokens, h = GPT(CFG), 256, CFG.n_embd
    plan = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3, activation_checkpointing="full")
    est = plan.peak_estimate(tokens)
    assert est.moment == "backward of blocks.0"
    assert est.activations == tokens * 16 * h * 4  # its input (kept) and the 15 h rebuilt; the blocks above freed theirs
    by_unit = {c.units: c for c in plan.chunks}
    above = [by_unit[(f"blocks.{i}",)] for i in (1, 2, 3)] + [by_unit[("ln_f",)]]
    assert est.grads == sum(c.shard_numel * 4 for c in above) + by_unit[("blocks.1",)].padded_numel * 4
    start = tokens * (CFG.n_layer * h + 15 * h + 2 * h + CFG.vocab_size) * 4
    assert est.activations + est.grads > start  # why it is the peak here
    # without recompute the start of backward stays the peak (every block's 16 h saved)
    assert shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=3).peak_estimate(tokens).moment == "start of backward"
    # stages 0-1: every chunk's buffer from blocks.0's on, the tied one (the head's gradient) included
    plan1 = shardlib.plan(model, AbstractMesh({"dp": 2}), zero_stage=1, activation_checkpointing="full")
    zero1 = plan1.peak_estimate(tokens)
    assert zero1.moment == "backward of blocks.0"
    assert zero1.grads == sum(c.padded_numel * 4 for c in plan1.chunks if c.units != ("wpe",))

def test_explain_prints_the_peak_and_says_when_it_cannot():
    text = shardlib.plan(GPT(CFG), AbstractMesh({"dp": 2}), zero_stage=3).explain(tokens=256)
    assert "peak per rank (predicted, 256 tokens per microbatch, at the start of backward)" in text
    assert "activations (1 microbatch)" in text
    pipe = shardlib.plan(GPT(CFG), AbstractMesh({"pp": 2}), schedule="1f1b", microbatches=4)
    assert "peak per rank (predicted, the stashed microbatches' activations held): pp rank 0" in pipe.summary(tokens=64)
    assert pipe.peak_estimate(64, 0).microbatches == 2 and pipe.peak_estimate(64, 1).microbatches == 1
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    plan = shardlib.plan(mlp, AbstractMesh({"dp": 2}), zero_stage=3)
    assert plan.peak_estimate(16) is None
    assert "peak per rank: not predicted" in plan.explain(tokens=16)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        plan.peak_estimate(0)


def _sp_saved_worker():
    from benchmarks.common import saved_activation_bytes
    from shardlib.models.gpt import tp_specs

    mesh = shardlib.init_mesh({"tp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(CFG), mesh, tp_specs(), sequence_parallel=True)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(1))

    def step():
        smodel(x, x)[1].backward()

    inside, _ = saved_activation_bytes(step, [smodel], list(smodel.module.blocks))
    est = smodel.plan.peak_estimate(x.numel())
    return inside, est


@pytest.mark.multiprocess
def test_sequence_parallel_block_saves_one_gathered_input_per_group():
    """Under tp=2 + SP a block saves Korthikanti's 16 h / t per token plus the all-gathered input
    of its two column-layer groups (q/k/v share one, fc_in has its own): (8 + 2 x (h - h/2)) h
    = 9 h elements per token, the activation term of the estimate. Before the sequence
    all-gather returned a contiguous tensor, q, k and v each saved a copy: 11 h. Measured
    1.003 x (the norms' statistics, attention's log-sum-exp)."""
    from shardlib.testing import run_on

    h, tokens = CFG.n_embd, 2 * CFG.block_size
    for inside, est in run_on(2, _sp_saved_worker):
        expected = CFG.n_layer * tokens * 9 * h * 4
        assert expected <= inside <= 1.01 * expected, inside / expected
        head = tokens * (2 * h + CFG.vocab_size) * 4
        assert est.activations == expected + head


def test_every_kth_block_offload_and_bad_arguments():
    """Recompute of every k-th block counts each block by its own mode (k=2: two blocks keep h,
    two keep 16 h); the model state on the device excludes offloaded shards and their optimizer
    state, and all optimizer state under optimizer_offload (never below 0); bad arguments raise."""
    model, tokens, h = GPT(CFG), 256, CFG.n_embd
    mesh = AbstractMesh({"dp": 2})
    head = 2 * h + CFG.vocab_size
    k2 = shardlib.plan(model, mesh, zero_stage=3, activation_checkpointing=2).peak_estimate(tokens)
    assert k2.activations == tokens * (2 * h + 2 * 16 * h + 15 * h + head) * 4
    plain = shardlib.plan(model, mesh, zero_stage=3)
    assert plain.peak_estimate(tokens, activation_checkpointing=2).activations == k2.activations
    assert plain.peak_estimate(tokens, activation_checkpointing=4).activations == tokens * (3 * 16 * h + h + 15 * h + head) * 4
    for options in (dict(offload_param_frac=1.0), dict(offload_param_frac=1.0, optimizer_offload=True),
                    dict(optimizer_offload=True), dict(offload_param_frac=0.5)):
        plan = shardlib.plan(model, mesh, zero_stage=3, **options)
        est = plan.peak_estimate(tokens)
        device_grads = plan.grad_bytes - sum(c.shard_numel * c.element_size for c in plan.chunks
                                             if c.index in plan.offloaded_chunks)
        assert est.state >= 0 and est.state == plan.device_state_bytes - device_grads, options
    for bad in ("garbage", "FULL", True, 0, lambda path, m: True):
        with pytest.raises(ValueError, match="activation_checkpointing must be"):
            plain.peak_estimate(tokens, activation_checkpointing=bad)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        plain.explain(tokens=0)
    pipe = shardlib.plan(GPT(CFG), AbstractMesh({"pp": 2}), schedule="1f1b", microbatches=4)
    for rank in (-1, 2, True):
        with pytest.raises(ValueError, match="rank must be a pp rank"):
            pipe.peak_estimate(64, rank)


def test_a_state_heavy_step_peaks_at_the_optimizer_step_as_measured():
    """Few tokens (1 x 16) at ZeRO-0 on one CPU rank: the step peaks in the optimizer's update
    (FusedAdamW's CPU blocks: sqrt(v) and its quotient), which the estimate missed (0.83 of the
    measured peak, a new user's pass). Measured with benchmarks.memory._peak (model state plus the
    profiler's running sum); the bound is the issue's 0.9-1.1 (measured 1.000)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.memory import _peak

    mesh = shardlib.init_mesh({"dp": 1})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)), mesh,
                            zero_stage=0)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    data = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad()
        smodel(data[:, :-1], data[:, 1:])[1].backward()
        opt.step()

    step()
    measured = _peak(step, lambda: shardlib.model_state_bytes(smodel, opt), over_ranks=False)
    est = smodel.plan.peak_estimate(16)
    assert est.moment == "optimizer step" and est.workspace > 0, est.lines()
    assert 0.9 <= est.total / measured <= 1.1, (est.total, measured, est.lines())
