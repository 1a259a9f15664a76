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
    head (2 h + V); full recompute keeps h per block and rebuilds one block; ZeRO-3 adds the
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
    assert full.activations == many * (CFG.n_layer * h + 16 * h + 2 * h + CFG.vocab_size) * 4


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
