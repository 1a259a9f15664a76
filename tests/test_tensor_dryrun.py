"""Tensor-parallel communication on meta, as one rank of a fake world (issue 15, item 2).

A dry run (:mod:`shardlib.dryrun`) sets ``mesh.device`` to meta, and check mode
(``SHARDLIB_CHECK_COLLECTIVES=1``, set by conftest and inherited here) raises
:class:`~shardlib.errors.CollectiveDeviceError` for any tensor handed to ``torch.distributed``
elsewhere: a call site that allocates on the CPU without ``device=`` fails here, as NCCL would
reject it on a GPU. A value read back to the host (``.item()``) fails on meta too. Torch's fake
group cannot share a process with the worker pool's gloo group, so everything runs in one fresh
interpreter (about 4 s).
"""

import json

import pytest


def _in_this_process() -> dict:
    """Every case, in this (fresh) process; each result is "ok ..." or the exception raised."""
    import torch

    import shardlib
    from shardlib.dryrun import fake_world
    from shardlib.parallel.cross_entropy import vocab_parallel_cross_entropy

    out: dict = {}
    with fake_world(2, 1):
        mesh = shardlib.init_mesh({"tp": 2})
        mesh.device = torch.device("meta")  # as dry_run sets it
        for eps in (0.0, 0.1):
            try:
                logits = torch.empty(6, 18, device="meta", requires_grad=True)  # rank 1's slice of V = 37
                target = torch.zeros(6, dtype=torch.long, device="meta")
                mesh.comm.reset()
                loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=eps, mesh=mesh)
                loss.backward()
                out[f"ce_eps{eps}"] = f"ok {loss.device} {logits.grad.shape[-1]} calls {mesh.comm.calls('tp')}"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[f"ce_eps{eps}"] = f"{type(exc).__name__}: {exc}"
    from shardlib.dryrun import dry_run
    from shardlib.models import GPTConfig

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=8, n_embd=64)
    for name, kw in DRY_RUNS.items():
        try:
            out[name] = dry_run(config, {"dp": 2, "tp": 2}, 3, sequence_parallel=True, **kw).to_json()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {exc}"
    from shardlib.models import tp_specs

    try:  # blocks split, embedding and head replicated (benchmarks/tensor_parallel.py's layout)
        out["gpt_sp_replicated_head"] = dry_run(config, {"dp": 2, "tp": 2}, 3, zero_stage=1, dtype="fp32",
                                                specs=tp_specs("tp"), sequence_parallel=True).to_json()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["gpt_sp_replicated_head"] = f"{type(exc).__name__}: {exc}"
    return out


# the reference GPT with its preset (vocabulary-parallel logits) and sequence parallelism, as rank
# 3 of {dp: 2, tp: 2}; fp32, and bf16 compute (the loss statistics stay fp32, gradient sums in fp32)
DRY_RUNS = {"gpt_sp_fp32": dict(zero_stage=1, dtype="fp32"), "gpt_sp_bf16": dict(zero_stage=3, dtype="bf16")}


@pytest.fixture(scope="module")
def runs():
    from _inpool import in_fresh_process

    return json.loads(json.dumps(in_fresh_process(_in_this_process)))  # as the tests read it, through JSON


def test_vocab_parallel_cross_entropy_exchanges_widths_on_the_mesh_device(runs):
    """``vocab_size=None``: the local widths are exchanged in a tensor on ``mesh.device`` (at
    8ed393d a CPU tensor: CollectiveDeviceError here, and its ``.item()`` a host sync per call)
    and the global size is never read back to the host (on meta ``.item()`` would raise), with
    and without label smoothing: the exchange and the three all-reduces, then backward."""
    for eps in ("0.0", "0.1"):
        assert runs[f"ce_eps{eps}"] == "ok meta 18 calls 4", runs[f"ce_eps{eps}"]


@pytest.mark.parametrize("case", list(DRY_RUNS))
def test_dry_run_of_sequence_parallel_gpt_with_vocab_parallel_logits(runs, case):
    """One step on meta as rank 3 of {dp: 2, tp: 2}: the bucket buffers of the norm gradient sums
    and the loss's statistics are on the mesh device (else CollectiveDeviceError), and the counted
    tp traffic equals the plan's: the gradient sums once per step in their buckets, the three
    fp32 all-reduces of vocab_parallel_cross_entropy and no logits all-gather."""
    r = runs[case]
    assert isinstance(r, dict), r
    assert r["mismatches"] == [], r["mismatches"]
    assert r["comm_measured"] == r["comm_planned"]
    # tp all-reduces (ring factor 2 (2 - 1) / 2 = 1) on this rank's 16 tokens: the vocabulary-parallel
    # embedding's output (16 x 64, in the compute dtype), the loss's 3 x 16 fp32 statistics, and ONE
    # bucket of the 896 fp32 gradient elements summed (2 blocks x (2 LayerNorms x 128 + 2 row biases
    # x 64) + ln_f's 128); no all-gather of the 16 x 64 logits
    act = {"gpt_sp_fp32": 4, "gpt_sp_bf16": 2}[case]
    assert r["tokens"] == 16
    assert r["comm_measured"]["tp/all_reduce"] == [1 + 3 + 1, 16 * 64 * act + 3 * 16 * 4 + 896 * 4]


def test_sequence_parallel_exit_before_a_replicated_head_is_planned_as_sent(runs):
    """The SP exit before replicated layers all-gathers forward and keeps its slice backward
    (nothing sent): the plan's cost model counted a backward reduce-scatter there, 16 x 64 fp32
    bytes more than sent (the benchmark's tp+sp row: 0.375 MB at 10.8M). Counted == planned."""
    r = runs["gpt_sp_replicated_head"]
    assert isinstance(r, dict), r
    assert r["comm_measured"] == r["comm_planned"]
    # per layer 2 all-gathers + 2 reduce-scatters forward and backward (column/row pairs), the entry's
    # backward all-gather and the exit's forward all-gather: 2 x 4 + 2 calls of each 16 x 64 tokens
    assert r["comm_measured"]["tp/reduce_scatter"][0] == 2 * 2 * 2, r["comm_measured"]
