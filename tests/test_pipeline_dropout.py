"""Dropout is mesh-independent under pipelines too: every layout draws the single-process masks.

A sharded run with dropout on trains like one process (losses, gradients, parameters after every
step, under the equivalence harness's tolerance model) on pipelines with 1, 2 and 4
microbatches, interleaved 1F1B, the zero-bubble schedules (with activation checkpointing, whose
recompute runs in both halves of a split backward), pp x dp, pp x tp with sequence parallelism, and without a
pipeline on dp and tp + sequence parallelism; its dropout counters are the single process's, so a
checkpoint resumes on another mesh and microbatching as if the run had not stopped.
"""

import functools
import re
from pathlib import Path

import pytest
import torch

import shardlib
import shardlib.checkpoint as ckpt
from shardlib.models import GPT, GPTConfig, gpt_preset
from shardlib.random import MeshDropout, mesh_independent_dropout
from shardlib.testing import default_tolerances, run_on
from shardlib.testing.tolerance import ReferenceRun, compare_records, reference_with_bands

pytestmark = pytest.mark.multiprocess

SEED = 5  # the dropout seed of every run
STEPS = 3
ROWS = 8  # the global batch
RTOL = default_tolerances(torch.float32)


def _config(layers, dropout):
    return GPTConfig(vocab_size=37, block_size=8, n_layer=layers, n_head=2, n_embd=16, bias=False, dropout=dropout)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 37, (ROWS, 9), generator=g) for _ in range(STEPS)]


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _counters(module):
    return {path: m.calls for path, m in module.named_modules() if isinstance(m, MeshDropout)}


def _build(shape, layers, dropout, options):
    mesh = shardlib.init_mesh(shape)
    torch.manual_seed(0)
    options = dict(options)
    specs = gpt_preset().specs if options.pop("tp_specs", False) else None
    smodel = shardlib.shard(GPT(_config(layers, dropout)), mesh, specs, chunk_size=400, dropout_seed=SEED, **options)
    return mesh, smodel, shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)


def _train(mesh, smodel, opt, batches):
    """One record per batch: this rank's loss (None off the last stage), full gradients and parameters."""
    records = []
    for x in batches:
        xl = shardlib.distribute(x, mesh, smodel.batch_spec)
        if isinstance(smodel, shardlib.PipelineModule):
            losses, _ = smodel.forward_backward(xl[:, :-1], criterion=_ce, labels=(xl[:, 1:],))
            loss = None if losses is None else torch.stack(losses).mean().item()
        else:
            _, out = smodel(xl[:, :-1], xl[:, 1:])
            out.backward()
            loss = out.item()
        grads = shardlib.full_grads(smodel)
        opt.step()
        records.append({"loss": loss, "grads": grads, "params": shardlib.full_state_dict(smodel), "norm": None})
        opt.zero_grad()
    return records


def _worker(shape, layers, dropout, options):
    mesh, smodel, opt = _build(shape, layers, dropout, options)
    return {"records": _train(mesh, smodel, opt, _batches()), "counters": _counters(smodel.module)}


def _reference_run(layers, dropout, runs):
    """A fresh single-process run with the mesh-independent masks (kept in ``runs``)."""
    torch.manual_seed(0)
    model = GPT(_config(layers, dropout))
    mesh_independent_dropout(model, seed=SEED)
    batches = _batches()
    run = ReferenceRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       lambda m, step: m(batches[step][:, :-1], batches[step][:, 1:])[1])
    runs.append(run)
    return run


def _reference(layers, dropout):
    runs = []
    ref, bands = reference_with_bands(functools.partial(_reference_run, layers, dropout, runs), STEPS, RTOL)
    return ref, bands, _counters(runs[0].model)


def _compare(results, ref, bands, first_step=0):
    """Every rank's records against the single process's from ``first_step`` on; the loss is the
    mean over the ranks that have one (data replicas differ, tensor replicas agree)."""
    last = [r for r in results if r["records"][0]["loss"] is not None]
    assert last, "no rank computed a loss"
    for r in results:
        got = [dict(rec, loss=sum(q["records"][k]["loss"] for q in last) / len(last)) for k, rec in enumerate(r["records"])]
        try:
            compare_records(got, ref[first_step:], bands[first_step:], RTOL)
        except AssertionError as err:  # its steps count from first_step
            raise AssertionError(f"steps counted from {first_step}: {err}" if first_step else str(err)) from None


CASES = [
    ({"pp": 2}, 4, 0.1, {"schedule": "gpipe", "microbatches": 1}),
    ({"pp": 2}, 4, 0.5, {"schedule": "1f1b", "microbatches": 2}),
    ({"pp": 2}, 4, 0.1, {"schedule": "gpipe", "microbatches": 4}),
    ({"pp": 2}, 2, 0.5, {"schedule": "interleaved_1f1b", "microbatches": 2, "virtual_stages": 2}),
    ({"pp": 2, "dp": 2}, 4, 0.1, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 1}),
    ({"pp": 2, "tp": 2}, 4, 0.5, {"schedule": "1f1b", "microbatches": 2, "tp_specs": True, "sequence_parallel": True}),
    # split backwards: the recompute of a checkpointed block runs in I and again in W, drawing the forward's masks
    ({"pp": 2}, 4, 0.5, {"schedule": "zb_h1", "microbatches": 2, "activation_checkpointing": "full"}),
    ({"pp": 2, "dp": 2}, 2, 0.1, {"schedule": "zbv", "microbatches": 2, "zero_stage": 3,
                                  "activation_checkpointing": 2}),
    ({"pp": 2}, 2, 0.5, {"schedule": "dualpipev", "microbatches": 4}),
    ({"dp": 2}, 4, 0.5, {"zero_stage": 3}),
    ({"tp": 2}, 4, 0.1, {"tp_specs": True, "sequence_parallel": True}),
]


@pytest.mark.parametrize("shape,layers,dropout,options", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_dropout_training_equals_single_process(shape, layers, dropout, options):
    """Losses, gradients and parameters after every AdamW step equal one process's (so do the
    masks: a wrong mask moves the step-0 gradients far beyond rtol 1e-5), and every dropout
    counter is the single process's (one per forward of the global batch, not per microbatch)."""
    world = 1
    for size in shape.values():
        world *= size
    results = run_on(world, _worker, shape, layers, dropout, options)
    ref, bands, counters = _reference(layers, dropout)
    _compare(results, ref, bands)
    held = {}
    for r in results:
        assert r["counters"] == {path: counters[path] for path in r["counters"]}
        held.update(r["counters"])
    assert held == counters  # every dropout of the model was on some rank


def test_reference_masks_are_active():
    """The reference really drops: with dropout 0.5 every step-0 gradient tensor differs from the
    one without dropout by 40% to 200% of its scale (measured on this model), against the 1e-5
    the comparisons above allow, so they are about masks, not identity maps."""
    with_drop = reference_with_bands(functools.partial(_reference_run, 2, 0.5, []), 1, RTOL)[0][0]["grads"]
    without = reference_with_bands(functools.partial(_reference_run, 2, 0.0, []), 1, RTOL)[0][0]["grads"]
    for name, g in without.items():
        assert (with_drop[name] - g).abs().max() > 0.1 * g.abs().max(), name


def _resume_worker(shape, options, path, start, stop):
    """Train from ``start`` to ``stop`` on the shared batches; load ``path`` first if ``start``,
    save there at ``stop`` if not."""
    mesh, smodel, opt = _build(shape, 4, 0.5, options)
    if start:
        assert ckpt.load(path, smodel, opt) == {"step": start}
    records = _train(mesh, smodel, opt, _batches()[start:stop])
    if not start:
        ckpt.save(path, smodel, opt, extra={"step": stop})
    return {"records": records, "counters": _counters(smodel.module)}


def test_pipeline_checkpoint_resumes_on_any_layout(tmp_path):
    """pp=2 with 2 microbatches, one step, a checkpoint: resumed there, the next two steps are bit
    for bit those of the run that never stopped; resumed on pp=2 with 4 microbatches and on dp=2
    (no pipeline), they equal one process's steps 1-2 under the tolerance model: the saved
    counters mean forwards of the global batch on every layout; and on ZB-V's V layout."""
    path = str(tmp_path / "ckpt")
    pp = ({"pp": 2}, {"schedule": "1f1b", "microbatches": 2})
    straight = run_on(2, _resume_worker, *pp, str(tmp_path / "unused"), 0, STEPS)
    run_on(2, _resume_worker, *pp, path, 0, 1)
    same = run_on(2, _resume_worker, *pp, path, 1, STEPS)
    for rank in range(2):
        for a, b in zip(same[rank]["records"], straight[rank]["records"][1:]):
            assert a["loss"] == b["loss"]
            assert all(torch.equal(a["params"][k], v) for k, v in b["params"].items())
    ref, bands, _ = _reference(4, 0.5)
    # (ZB-V: stages 0 and 3 on rank 0, the checkpoint's stages 0-1 and 2-3 cut differently)
    for shape, options in [({"pp": 2}, {"schedule": "gpipe", "microbatches": 4}), ({"dp": 2}, {}),
                           ({"pp": 2}, {"schedule": "zbv", "microbatches": 2})]:
        _compare(run_on(2, _resume_worker, shape, options, path, 1, STEPS), ref, bands, first_step=1)


def test_train_gpt_check_with_dropout_on_pp2_dp2(tmp_path):
    """The issue's report: ``examples/train_gpt.py --check 3 --dropout 0.1`` on pp=2,dp=2 replays
    one process within its 1e-4 (it was 1.24e-3 at these sizes, 3.1e-4 at the defaults; now about
    1e-7, fp32 rounding of the data-parallel mean)."""
    from _inpool import run_main

    # the script's main on the pool's 4 ranks (test_examples runs it under torchrun)
    script = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    results = run_main(4, script, ["--mesh", "pp=2,dp=2", "--microbatches", "2", "--dropout", "0.1", "--check", "3",
                                   "--steps", "3", "--eval-every", "3", "--eval-batches", "1", "--batch-size", "4",
                                   "--block-size", "32", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                                   "--sample", "0"], cwd=tmp_path)
    rc, out = results[0]  # rank 0 replays and compares
    found = re.search(r"max relative loss difference (\S+) \(tolerance 1e-04\)", out)
    assert found, out[-3000:]
    assert rc == 0 and float(found.group(1)) <= 1e-4, out[-3000:]
