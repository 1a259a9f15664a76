"""One-GPU check of shardlib's CUDA paths: one table, well under 8 minutes (issue 15).

    python -m benchmarks.gpu_check            # on a CUDA machine (an H200 when one is lent)
    python -m benchmarks.gpu_check --tiny     # small sizes, about a minute: what `pytest -m gpu` runs

Checks, each in its own ``try`` (a broken check is a FAIL row with its exception; the others
still run):

* ``nccl``: ``init_mesh({"dp": 1})`` without torchrun (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
  ``WORLD_SIZE``/``LOCAL_RANK`` set in-process) picks NCCL, ``mesh.device`` is the CUDA device;
  ``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` through
  ``shardlib.mesh.guard.post`` on the one-rank group, and check mode
  (``SHARDLIB_CHECK_COLLECTIVES=1``, set here for every check) refuses a tensor on another device;
* ``train``: ``shard(GPT, mesh)`` at ZeRO stages 0-3, and with ``tp_specs`` on ``{"tp": 1}`` with
  and without sequence parallelism, forward, backward, ``ZeroOptimizer(AdamW)`` step: losses and
  final weights against the same model trained without ``shard`` (same seed, same batches); a
  pipeline schedule at pp = 1 where ``shard`` allows one (today it refuses: a SKIP row says why);
* ``kernels``: the Triton kernels against their torch references in bf16/fp16/fp32
  (:func:`benchmarks.kernels_gpu.check_correctness`, tolerances
  :data:`benchmarks.kernels_gpu.TOLERANCE`);
* ``offload``: ``shard(..., offload_ratio=1.0)`` gives the step of the non-offloaded module; the
  host buffers are pinned; the device-to-host copies run on a side stream (profiler trace);
* ``throughput``: the reference GPT at GPT-2 medium size (n_layer 24, n_embd 1024, n_head 16,
  block 1024, vocabulary 50304; about 354M parameters) in bf16, plain PyTorch (``torch.autocast``,
  AdamW ``fused=True``) against ``shard(..., mesh {"dp": 1})`` under the same autocast with
  ``ZeroOptimizer`` (and, for information, ``param_dtype=torch.bfloat16``): tokens/s, MFU and
  the ratio of step times ours/torch (target <= 1.03, the repo's one-rank target).

MFU and the FLOPs formula: :mod:`benchmarks.gpu_throughput` (H200 dense bf16 peak 989 TFLOP/s;
``--peak-tflops`` overrides; ``6 N`` and ``6 N + 12 L T C`` per token).

Output: a progress line per check on stderr, then on stdout the device line and the one table
(check, setting, result, figures, status), then the traceback of each FAIL row.

Exit status: 0 every check passed (a MISS row, a speed target missed, does not fail the run
unless ``--strict``); 1 a check failed, or the run passed :data:`WALL_LIMIT` (470 s: then
``faulthandler`` prints every thread's stack instead of the table); 77 no CUDA device (nothing
was checked: the "skipped" code of automake and CTest), after one line saying so.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from .gpu_throughput import check_throughput, gpt, gpt_config, peak_for, random_batches

SKIPPED = 77
WALL_LIMIT = 470.0  # seconds: the run must end within 8 minutes
# Losses and weights (per tensor, normwise; see _weights_rel) of shard() against the same model
# without it, fp32. On CPU (gloo), measured: 0.0 at stages 0-3 (the same AdamW arithmetic block by
# block); at tp=1, with and without SP, losses 8.5e-8 and weights 3.1e-7 to 3.5e-7 (the parallel layers'
# own matmuls). On CUDA shardlib's AdamW is the Triton kernel and torch's the foreach one: they
# agree to 1e-5 normwise per update (kernels_gpu's fp32 tolerance for a flat shard's update);
# three steps at lr 1e-3 move weights by ~3e-3, so their difference stays far below 1e-4.
TRAIN_RTOL = 1e-4
OFFLOAD_RTOL = 1e-5  # offload moves saved tensors to host and back bit for bit; slack for atomics in attention backward


class Skip(Exception):
    """A check that does not apply here (the message says why)."""


@dataclass
class Row:
    """One line of the table: ``status`` PASS, FAIL, MISS (a speed target missed) or SKIP."""

    check: str
    setting: str
    result: str
    figures: str
    status: str
    detail: str = ""  # the traceback of a FAIL, printed after the table


def run_check(rows: list[Row], check: str, setting: str, fn: Callable[[], tuple]) -> None:
    """Run ``fn() -> (result, figures[, status])`` and append its row; an exception is a FAIL row
    with the exception text (a :class:`Skip` a SKIP row), so later checks still run."""
    t0 = time.perf_counter()
    try:
        out = fn()
        rows.append(Row(check, setting, out[0], out[1], out[2] if len(out) > 2 else "PASS"))
    except Skip as exc:
        rows.append(Row(check, setting, "skipped", str(exc), "SKIP"))
    except Exception as exc:  # noqa: BLE001 - a failed check is a row, not the end of the run
        first = (str(exc).strip().splitlines() or [""])[0]
        rows.append(Row(check, setting, f"{type(exc).__name__}: {first}"[:120], "", "FAIL", traceback.format_exc()[-2500:]))
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"[gpu_check] {check} / {setting}: {rows[-1].status} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def format_table(rows: list[Row]) -> str:
    """The one table: check, setting, result, figures, status (columns as wide as their text)."""
    head = ("check", "setting", "result", "figures", "status")
    cells = [head] + [(r.check, r.setting, r.result, r.figures, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exit_code(rows: list[Row], strict: bool = False) -> int:
    """0 unless a row FAILed (or, with ``strict``, MISSed a speed target): then 1."""
    bad = {"FAIL", "MISS"} if strict else {"FAIL"}
    return 1 if any(r.status in bad for r in rows) else 0


# -- set-up ------------------------------------------------------------------------------------


def init_single_rank(shape: dict | None = None):
    """``init_mesh(shape)`` (default ``{"dp": 1}``) as one rank without torchrun: the rendezvous
    variables are set in-process when nothing is initialized, so NCCL is chosen on CUDA."""
    import torch.distributed as dist

    import shardlib

    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return shardlib.init_mesh(shape or {"dp": 1}, timeout=120.0)  # a stuck collective fails within the run's budget


def _weights_rel(full: dict, ref: dict) -> float:
    """The largest ``||W - W_ref|| / ||W_ref||`` over the floating tensors, the key biases left
    out: their gradient is analytically zero (softmax ignores a per-query constant), so AdamW
    turns rounding noise (~1e-9) into moves of ~1e-6 whose sign follows the summation order
    (measured at tp=1 on CPU: 0.41-0.56 for ``k_proj.bias``, at most 3.5e-7 for every other tensor)."""
    errs = [float((full[n].detach().double() - w.detach().double()).norm() / w.detach().double().norm().clamp_min(1e-30))
            for n, w in ref.items() if w.is_floating_point() and not n.endswith("k_proj.bias")]
    return max(errs)


def _train(model, opt, data: list) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


# -- a: NCCL init and the training step ------------------------------------------------------


def check_nccl(mesh) -> tuple:
    """The mesh's backend and device, three flat collectives on the one-rank group, and check
    mode's refusal of a tensor on another device (on CUDA a CPU tensor; on CPU a meta one)."""
    import torch.distributed as dist

    from shardlib import CollectiveDeviceError
    from shardlib.mesh.guard import native_all_gather, native_reduce_scatter, post

    dev = mesh.device
    if torch.cuda.is_available() and (mesh.backend != "nccl" or dev.type != "cuda"):
        raise AssertionError(f"init_mesh chose backend {mesh.backend} on {dev}; expected nccl on cuda")
    group = mesh.group("dp")
    t = torch.arange(8.0, device=dev)
    post(mesh, dist.all_reduce, t, group=group)
    out = torch.empty(8, device=dev)
    post(mesh, native_all_gather(), out, t, group=group)
    red = torch.empty(8, device=dev)
    post(mesh, native_reduce_scatter(), red, out, group=group)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if not (torch.equal(t.cpu(), torch.arange(8.0)) and torch.equal(red.cpu(), torch.arange(8.0))):
        raise AssertionError(f"one-rank collectives changed the data: {red.cpu().tolist()}")
    if not mesh.trace.check:
        raise AssertionError("SHARDLIB_CHECK_COLLECTIVES is off: the device check did not run")
    wrong = torch.zeros(2, device="cpu" if dev.type == "cuda" else "meta")
    try:
        post(mesh, dist.all_reduce, wrong, group=group)
    except CollectiveDeviceError:
        pass
    else:
        raise AssertionError(f"check mode let a tensor on {wrong.device} through to {mesh.backend}")
    return ("collectives ok; wrong device refused", f"backend {mesh.backend}, device {dev}, native {mesh.native}")


def check_training(mesh, device: torch.device, cfg, batch: int, steps: int = 3, **options) -> tuple:
    """``shard(GPT, mesh, **options)`` + ``ZeroOptimizer(AdamW)`` against the plain model and
    ``torch.optim.AdamW``: per-step losses and final weights within :data:`TRAIN_RTOL`."""
    import shardlib

    data = random_batches(cfg, batch, cfg.block_size, steps, device)
    ref = gpt(cfg, device)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    smodel = shardlib.shard(gpt(cfg, device), mesh, **options)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    off = [n for n, p in smodel.named_parameters() if p.device.type != device.type]
    if off:
        raise AssertionError(f"parameters off {device.type} after shard(): {off[:3]}")
    losses = _train(smodel, opt, data)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    weight_err = _weights_rel(shardlib.full_state_dict(smodel), dict(ref.named_parameters()))
    if not (loss_err <= TRAIN_RTOL and weight_err <= TRAIN_RTOL):
        raise AssertionError(f"shard() differs from plain PyTorch: loss rel {loss_err:.2e}, weights {weight_err:.2e} "
                             f"(> {TRAIN_RTOL:g}); losses {losses} vs {ref_losses}")
    return (f"= plain PyTorch within {TRAIN_RTOL:g}",
            f"{steps} steps; loss rel {loss_err:.1e}, weights rel {weight_err:.1e}; loss {losses[0]:.4f}->{losses[-1]:.4f}")


def check_param_offload(mesh, device: torch.device, cfg, batch: int, steps: int = 3) -> tuple:
    """``shard(GPT, {"dp": 1}, zero_stage=3, offload_param_frac=1.0)`` (ZeRO-Infinity on one
    GPU): every chunk's shard in pinned host memory, copied in on a side stream before each
    gather, updated on the CPU; losses and weights against the plain model within
    :data:`TRAIN_RTOL` (:func:`check_training`), and the shards really on the pinned host."""
    import shardlib

    row = check_training(mesh, device, cfg, batch, steps, zero_stage=3, offload_param_frac=1.0)
    smodel = shardlib.shard(gpt(cfg, device), mesh, zero_stage=3, offload_param_frac=1.0)
    chunks = smodel._zero.chunks
    where = {(c.shard.device.type, c.shard.is_pinned()) for c in chunks}
    if not all(c.offloaded for c in chunks) or where != {("cpu", device.type == "cuda")}:  # (pinned only with CUDA)
        raise AssertionError(f"offloaded shards not in {'pinned ' if device.type == 'cuda' else ''}host memory: {where}")
    return row[0], f"{len(chunks)} chunks' shards on the host{' (pinned)' if device.type == 'cuda' else ''}; " + row[1]


def check_pipeline_pp1(mesh, device: torch.device, cfg, batch: int) -> tuple:
    """A pipeline schedule on the mesh ``{"pp": 1}``: run it against the plain model where
    ``shard`` allows it, else a SKIP row with shard's refusal."""
    import torch.nn.functional as F

    import shardlib

    try:
        smodel = shardlib.shard(gpt(cfg, device), mesh, schedule="1f1b", microbatches=2)
    except shardlib.ShardingError as exc:
        raise Skip(f"shard refuses: {str(exc).splitlines()[0][:150]}") from None
    (x, y), = random_batches(cfg, batch, cfg.block_size, 1, device)
    losses, _ = smodel.forward_backward(x, criterion=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
                                        labels=(y,))
    _, ref = gpt(cfg, device)(x, y)
    got = float(torch.stack([v.detach() for v in losses]).mean())
    if abs(got - float(ref)) > TRAIN_RTOL * abs(float(ref)):
        raise AssertionError(f"pp=1 loss {got} != plain {float(ref)}")
    return ("= plain PyTorch", f"loss {got:.5f}")


# -- b: kernels --------------------------------------------------------------------------------


def check_kernels(dtype: torch.dtype, device: torch.device, small: bool) -> tuple:
    from .kernels_gpu import TOLERANCE, check_correctness

    errs = check_correctness(dtype, device, small=small)
    worst = max(errs, key=errs.get)
    return (f"{len(errs)} outputs within tolerance", f"worst {worst} {errs[worst]:.1e} (tol {TOLERANCE[dtype]:g}; "
                                                     f"fp32 state/statistics 1e-5)")


# -- c: activation offload ---------------------------------------------------------------------


def _memcpy_streams(trace_path: str) -> dict:
    """From a Chrome trace of ``torch.profiler``: the streams of device-to-host copies, of
    compute kernels, and the copies' names (Kineto names pinned targets ``Device -> Pinned``)."""
    import json
    from collections import Counter

    events = json.load(open(trace_path)).get("traceEvents", [])
    kernels = Counter(e.get("args", {}).get("stream") for e in events if e.get("cat") == "kernel")
    dtoh = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    return {"compute_stream": kernels.most_common(1)[0][0] if kernels else None,
            "dtoh_streams": sorted({e.get("args", {}).get("stream") for e in dtoh}, key=str),
            "dtoh": len(dtoh), "names": sorted({e.get("name", "") for e in dtoh})}


def check_offload(mesh, device: torch.device, cfg, batch: int, steps: int = 2) -> tuple:
    """``shard(..., offload_ratio=1.0)`` against ``shard(...)``: equal losses and weights; every
    saved activation moved; host buffers pinned; copies on a side stream (CUDA)."""
    import tempfile

    import shardlib

    data = random_batches(cfg, batch, cfg.block_size, steps, device)
    base = shardlib.shard(gpt(cfg, device), mesh)
    base_losses = _train(base, shardlib.ZeroOptimizer(base, torch.optim.AdamW, lr=1e-3), data)
    smodel = shardlib.shard(gpt(cfg, device), mesh, offload_ratio=1.0)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3)
    cuda = device.type == "cuda"
    losses, pinned, trace = [], None, None
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        if i == 0 and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _, loss = smodel(x, y)
                holders = list(smodel.activation_offload._by_seq.values())  # the host copies autograd holds now
                pinned = (sum(h.host.is_pinned() for h in holders), len(holders))
                loss.backward()
                torch.cuda.synchronize()
            trace = os.path.join(tempfile.mkdtemp(), "offload_trace.json")
            prof.export_chrome_trace(trace)
        else:
            _, loss = smodel(x, y)
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    st = smodel.activation_offload.stats
    if not (st.offloaded_bytes > 0 and st.offloaded_bytes == st.saved_bytes):
        raise AssertionError(f"offload_ratio=1.0 moved {st.offloaded_bytes} of {st.saved_bytes} saved bytes")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
    weight_err = _weights_rel(shardlib.full_state_dict(smodel), shardlib.full_state_dict(base))
    if not (loss_err <= OFFLOAD_RTOL and weight_err <= OFFLOAD_RTOL):
        raise AssertionError(f"offloaded step differs: loss rel {loss_err:.2e}, weights {weight_err:.2e} (> {OFFLOAD_RTOL:g})")
    figures = f"{st.offloaded_bytes / 2**20:.1f} MiB moved/step; loss rel {loss_err:.1e}, weights {weight_err:.1e}"
    if not cuda:
        return ("= non-offloaded step", figures + "; CPU: no pinned memory or streams to check")
    if pinned[0] != pinned[1] or not pinned[1]:
        raise AssertionError(f"{pinned[1] - pinned[0]} of {pinned[1]} host buffers are not pinned")
    seen = _memcpy_streams(trace)
    if seen["dtoh"] == 0:
        raise AssertionError(f"the profiler saw no device-to-host copies in the offloaded step ({trace})")
    if seen["compute_stream"] in seen["dtoh_streams"]:
        raise AssertionError(f"device-to-host copies ran on the compute stream {seen['compute_stream']}: {seen}")
    return ("= non-offloaded step; pinned; side stream",
            figures + f"; {pinned[1]} host buffers pinned; {seen['dtoh']} DtoH copies on streams {seen['dtoh_streams']} "
                      f"(compute {seen['compute_stream']}) {', '.join(seen['names'])[:60]}")


# -- the run -----------------------------------------------------------------------------------


def run_checks(device: torch.device, tiny: bool, only: tuple = ("nccl", "train", "kernels", "offload", "throughput"),
               peak: float | None = None, steps: int = 20, warmup: int = 5) -> list[Row]:
    """Every check in ``only`` on ``device``, one row each (``tiny``: small sizes)."""
    rows: list[Row] = []
    meshes: dict = {}

    def mesh(shape=("dp",)):
        """The one-rank mesh of ``shape``, made once; a failed first ``init_mesh`` (the NCCL
        rendezvous) is raised again by every check that needs it, not retried."""
        if shape not in meshes:
            try:
                meshes[shape] = init_single_rank({a: 1 for a in shape})
            except Exception as exc:  # noqa: BLE001 - each check's row shows it
                meshes[shape] = exc
        if isinstance(meshes[shape], Exception):
            raise RuntimeError(f"init_mesh({ {a: 1 for a in shape} }) failed: {meshes[shape]}") from meshes[shape]
        return meshes[shape]

    cfg = gpt_config("tiny" if tiny else "check")
    batch = 2 if tiny else 8
    if "nccl" in only:
        run_check(rows, "nccl", "init_mesh({'dp': 1}) in-process, check mode", lambda: check_nccl(mesh()))
    if "train" in only:
        from shardlib.models import tp_specs

        for stage in range(4):
            run_check(rows, "train", f"shard dp=1 zero_stage={stage}, fp32",
                      lambda: check_training(mesh(), device, cfg, batch, zero_stage=stage))
        for sp in (False, True):
            options = dict(sequence_parallel=True, sp_exit="ln_f") if sp else {}
            run_check(rows, "train", f"shard tp=1 tp_specs{' + SP' if sp else ''}, fp32",
                      lambda: check_training(mesh(("tp",)), device, cfg, batch, specs=tp_specs("tp"), **options))
        run_check(rows, "train", "pipeline 1f1b at pp=1", lambda: check_pipeline_pp1(mesh(("pp",)), device, cfg, batch))
    if "kernels" in only:
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
            run_check(rows, "kernels", f"Triton vs torch reference, {name}", lambda: check_kernels(dtype, device, tiny))
    if "offload" in only:
        run_check(rows, "offload", "shard offload_ratio=1.0 vs none, 2 steps", lambda: check_offload(mesh(), device, cfg, batch))
        run_check(rows, "offload", "shard dp=1 zero_stage=3 offload_param_frac=1.0 vs plain",
                  lambda: check_param_offload(mesh(), device, cfg, batch))
    if "throughput" in only:
        big = gpt_config("tiny" if tiny else "medium")
        tb = 2 if tiny else 8
        setting = f"GPT {big.n_layer}x{big.n_embd}, {tb}x{big.block_size} tokens, bf16"
        sides: list = []

        def measure():
            sides.extend(check_throughput(mesh(), device, big, tb, warmup, steps, peak))
            return ("measured", "")

        run_check(rows, "throughput", setting, measure)
        if rows[-1].status == "PASS":  # one row per side in place of the placeholder
            rows.pop()
            rows += [Row("throughput", f"{setting}: {kind}", result, figures, status) for kind, result, figures, status in sides]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small models and kernel sizes (about a minute)")
    ap.add_argument("--only", nargs="*", default=["nccl", "train", "kernels", "offload", "throughput"],
                    choices=["nccl", "train", "kernels", "offload", "throughput"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per throughput side")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by GPU name)")
    ap.add_argument("--strict", action="store_true", help="a missed speed target (MISS) fails the run too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"benchmarks.gpu_check: no CUDA device here (torch {torch.__version__}); nothing checked, exit {SKIPPED} (skipped)")
        return SKIPPED
    os.environ["SHARDLIB_CHECK_COLLECTIVES"] = "1"  # every tensor handed to NCCL must be on mesh.device
    faulthandler.dump_traceback_later(WALL_LIMIT, exit=True)  # a hang: every thread's stack, then exit 1, inside 8 min
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or peak_for(name)
    t0 = time.perf_counter()
    rows = run_checks(device, args.tiny, tuple(args.only), peak, args.steps, args.warmup)
    wall = time.perf_counter() - t0
    faulthandler.cancel_dump_traceback_later()
    rows.append(Row("wall time", "whole run, target < 480 s", f"{wall:.0f} s", "", "PASS" if wall < 480 else "MISS"))
    print(f"== benchmarks.gpu_check on {name} (torch {torch.__version__}, peak {peak or '?'} TFLOP/s dense bf16)")
    print(format_table(rows))
    for r in rows:
        if r.detail:
            print(f"\n-- {r.check} / {r.setting}:\n{r.detail}")
    return exit_code(rows, args.strict)


if __name__ == "__main__":
    sys.exit(main())
