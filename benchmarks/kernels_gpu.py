"""GPU check of shardlib's Triton kernels: correctness in bf16/fp16/fp32, then speed.

For each kernel (fused AdamW over a flat shard, LayerNorm/RMSNorm forward and backward, the
fused vocab-parallel cross-entropy statistics and in-place gradient) this script

1. checks the Triton program against its torch reference on the same device, in bf16, fp16
   and fp32 (normwise relative error ``||a - b|| / ||b||`` below 1e-5 in fp32, 2e-3 in fp16,
   1e-2 in bf16: both sides accumulate in fp32 and round once to the output dtype);
2. times it (median of CUDA-event timings), and prints the achieved bandwidth (the bytes the
   op must read and write, over the time) and its speed relative to the torch reference and to
   ``torch.compile`` of the reference (ratio > 1: the kernel is faster).

One run takes about 1-3 minutes on one GPU (most of it ``torch.compile``; ``--no-compile``
skips that column)::

    python -m benchmarks.kernels_gpu                 # on a CUDA machine
    python -m benchmarks.kernels_gpu --interpret     # CPU: tiny fp32/fp16 correctness in Triton's interpreter

Without CUDA (and without ``--interpret``) it prints that it needs CUDA and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _expect(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = _rel(got, want)
    if not err <= tol:
        raise AssertionError(f"{name}: normwise relative error {err:.3g} > {tol:g}")
    return err


def _sizes(device: torch.device, small: bool) -> dict:
    if small or device.type != "cuda":
        return dict(adam_n=1500, rows=7, width=40, ce_rows=5, vocab=300)
    return dict(adam_n=1 << 26, rows=8192, width=4096, ce_rows=8192, vocab=32768)


def check_correctness(dtype: torch.dtype, device: torch.device, small: bool = False) -> dict[str, float]:
    """Triton vs torch reference for every kernel in ``dtype`` on ``device``.

    Returns ``{check: normwise relative error}``. Raises AssertionError past :data:`TOLERANCE`,
    or if the Triton program did not run (kernels off, no triton, not CUDA and not forced).
    """
    from shardlib import kernels
    from shardlib.kernels import cross_entropy as kce
    from shardlib.kernels import norms as kn

    probe = torch.zeros(1, device=device)
    if not kernels.use_triton(probe):
        raise AssertionError(f"the Triton kernels would not run on {device} (enabled={kernels.enabled()}, "
                             f"triton={kernels.HAS_TRITON})")
    sz = _sizes(device, small)
    tol = TOLERANCE[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    errs = {}

    # AdamW: fp32 master shard; the grad and the written copy in ``dtype``
    n = sz["adam_n"]
    p = torch.randn(n, device=device, generator=g)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ref = [t.clone() for t in (p, m, v)]
    copy = torch.empty(n, device=device, dtype=dtype)
    for step in (1, 2, 3):
        grad = torch.randn(n, device=device, generator=g).to(dtype)
        kernels.adamw_(p, grad, m, v, copy, 1e-3, 0.9, 0.95, 1e-8, 0.1, float(step))
        kernels.adamw_reference_(ref[0], grad, ref[1], ref[2], None, 1e-3, 0.9, 0.95, 1e-8, 0.1, float(step))
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        errs[f"adamw.{name}"] = _expect(f"adamw {name}", got, want, 1e-5)  # fp32 state whatever the grad dtype
    if not torch.equal(copy, p.to(dtype)):
        raise AssertionError("adamw: the low-precision copy is not the rounded master weight")

    # LayerNorm / RMSNorm
    x = (torch.randn(sz["rows"], sz["width"], device=device, generator=g) * 2 + 1).to(dtype)
    w = torch.randn(sz["width"], device=device, generator=g).to(dtype)
    b = torch.randn(sz["width"], device=device, generator=g).to(dtype)
    dy = torch.randn(sz["rows"], sz["width"], device=device, generator=g).to(dtype)
    for rms in (False, True):
        bias = None if rms else b
        name = "rms_norm" if rms else "layer_norm"
        y, mean, rstd = kn.norm_forward(x, w, bias, 1e-5, rms)
        y_r, mean_r, rstd_r = kn.norm_reference(x, w, bias, 1e-5, rms)
        dx, dw, db = kn.norm_backward(dy, x, w, mean, rstd, bias is not None, rms)
        dx_r, dw_r, db_r = kn.norm_backward_reference(dy, x, w, mean_r, rstd_r, bias is not None, rms)
        errs[f"{name}.y"] = _expect(f"{name} y", y, y_r, tol)
        errs[f"{name}.rstd"] = _expect(f"{name} rstd", rstd, rstd_r, 1e-5)
        errs[f"{name}.dx"] = _expect(f"{name} dx", dx, dx_r, tol)
        errs[f"{name}.dw"] = _expect(f"{name} dweight", dw, dw_r, tol)
        if not rms:
            errs[f"{name}.db"] = _expect(f"{name} dbias", db, db_r, tol)

    # vocab-parallel cross-entropy phases (one slice of the vocabulary)
    rows, vocab = sz["ce_rows"], sz["vocab"]
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 3).to(dtype)
    t = torch.randint(-vocab // 4, vocab, (rows,), device=device, generator=g)  # a quarter elsewhere
    stats = kce.vocab_ce_stats(logits, t, True)
    stats_r = kce.vocab_ce_stats_reference(logits, t, True)
    for name, got, want in zip(("max", "sumexp", "target", "sum"), stats, stats_r):
        errs[f"ce.{name}"] = _expect(f"cross-entropy {name}", got, want, 1e-5)
    m_g, s_g = stats_r[0] + 0.25, stats_r[1] * 1.5  # as if other ranks held part of the mass
    up = torch.rand(rows, device=device, generator=g)
    got, want = logits.clone(), logits.clone()
    kce.vocab_ce_grad_(got, t, m_g, s_g, up, 0.1 / vocab, 0.9)
    kce.vocab_ce_grad_reference_(want, t, m_g, s_g, up, 0.1 / vocab, 0.9)
    errs["ce.grad"] = _expect("cross-entropy grad", got, want, tol)
    return errs


# -- timing ------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on GPU, perf_counter elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _row(kernel: str, dtype: str, nbytes: int, fns: dict[str, Callable], device: torch.device) -> dict:
    times = {name: _time_ms(fn, device) for name, fn in fns.items() if fn is not None}
    ours = times["triton"]
    out = {"kernel": kernel, "dtype": dtype, "ms": ours, "GB/s": nbytes / ours / 1e6}
    for name, ms in times.items():
        if name != "triton":
            out[f"x vs {name}"] = ms / ours
    return out


def benchmark(dtype: torch.dtype, device: torch.device, compile_ref: bool, small: bool = False) -> list[dict]:
    """Time each kernel against its torch reference (and ``torch.compile`` of it)."""
    import torch.nn.functional as F

    from shardlib import kernels
    from shardlib.kernels import cross_entropy as kce
    from shardlib.kernels import norms as kn

    def compiled(fn):
        return torch.compile(fn, dynamic=False) if compile_ref else None

    sz = _sizes(device, small)
    es = torch.finfo(dtype).bits // 8
    dname = [k for k, v in DTYPES.items() if v == dtype][0]
    rows = []

    # AdamW on one flat fp32 shard with a ``dtype`` gradient and compute copy
    n = sz["adam_n"]
    p, m, v = torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    grad, copy = torch.randn(n, device=device).to(dtype), torch.empty(n, device=device, dtype=dtype)
    args = (1e-3, 0.9, 0.95, 1e-8, 0.1, 10.0)
    nbytes = n * (4 * 3 * 2 + es * 2)  # read+write p, m, v (fp32); read grad, write copy
    ref_adam = kernels.adamw_reference_
    ref_adam_c = compiled(ref_adam)
    torch_fused = None
    if device.type == "cuda":  # torch's own fused AdamW (fp32 grads only), then the copy it cannot write
        q = torch.nn.Parameter(p.clone())
        q.grad = grad.float()
        opt = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        torch_fused = lambda: (opt.step(), copy.copy_(q.detach()))  # noqa: E731
    rows.append(_row("adamw (flat shard)", dname, nbytes, {
        "triton": lambda: kernels.adamw_(p, grad, m, v, copy, *args),
        "torch ref": lambda: ref_adam(p, grad, m, v, copy, *args),
        "compiled ref": (lambda: ref_adam_c(p, grad, m, v, copy, *args)) if ref_adam_c else None,
        "torch fused AdamW": torch_fused,
    }, device))

    # norms: forward and backward separately
    r, c = sz["rows"], sz["width"]
    x = torch.randn(r, c, device=device).to(dtype)
    w, b = torch.randn(c, device=device).to(dtype), torch.randn(c, device=device).to(dtype)
    dy = torch.randn(r, c, device=device).to(dtype)
    for rms in (False, True):
        name = "rms_norm" if rms else "layer_norm"
        bias = None if rms else b
        _, mean, rstd = kn.norm_forward(x, w, bias, 1e-5, rms)
        fwd_c, bwd_c = compiled(kn.norm_reference), compiled(kn.norm_backward_reference)
        native = (lambda: F.rms_norm(x, (c,), w, 1e-5)) if rms else (lambda: F.layer_norm(x, (c,), w, bias, 1e-5))
        rows.append(_row(f"{name} fwd", dname, 2 * r * c * es, {
            "triton": lambda: kn.norm_forward(x, w, bias, 1e-5, rms),
            "torch ref": lambda: kn.norm_reference(x, w, bias, 1e-5, rms),
            "compiled ref": (lambda: fwd_c(x, w, bias, 1e-5, rms)) if fwd_c else None,
            "F." + name: native,
        }, device))
        rows.append(_row(f"{name} bwd", dname, 3 * r * c * es, {
            "triton": lambda: kn.norm_backward(dy, x, w, mean, rstd, bias is not None, rms),
            "torch ref": lambda: kn.norm_backward_reference(dy, x, w, mean, rstd, bias is not None, rms),
            "compiled ref": (lambda: bwd_c(dy, x, w, mean, rstd, bias is not None, rms)) if bwd_c else None,
        }, device))

    # cross-entropy: statistics (one read) and the in-place gradient (read + write)
    nr, vocab = sz["ce_rows"], sz["vocab"]
    logits = (torch.randn(nr, vocab, device=device) * 3).to(dtype)
    t = torch.randint(0, vocab, (nr,), device=device)
    m_g, s_g, _, _ = kce.vocab_ce_stats_reference(logits, t, True)
    up = torch.full((nr,), 1.0 / nr, device=device)
    stats_c, grad_c = compiled(kce.vocab_ce_stats_reference), compiled(kce.vocab_ce_grad_reference_)
    full = logits.detach().clone().requires_grad_()

    def f_ce_fwd_bwd():
        full.grad = None
        F.cross_entropy(full.float(), t, label_smoothing=0.1).backward()

    rows.append(_row("vocab CE stats", dname, nr * vocab * es, {
        "triton": lambda: kce.vocab_ce_stats(logits, t, True),
        "torch ref": lambda: kce.vocab_ce_stats_reference(logits, t, True),
        "compiled ref": (lambda: stats_c(logits, t, True)) if stats_c else None,
    }, device))
    rows.append(_row("vocab CE grad (in place)", dname, 2 * nr * vocab * es, {
        "triton": lambda: kce.vocab_ce_grad_(logits, t, m_g, s_g, up, 0.1 / vocab, 0.9),
        "torch ref": lambda: kce.vocab_ce_grad_reference_(logits, t, m_g, s_g, up, 0.1 / vocab, 0.9),
        "compiled ref": (lambda: grad_c(logits, t, m_g, s_g, up, 0.1 / vocab, 0.9)) if grad_c else None,
    }, device))
    rows.append(_row("vocab CE stats+grad", dname, 3 * nr * vocab * es, {
        "triton": lambda: (kce.vocab_ce_stats(logits, t, True),
                           kce.vocab_ce_grad_(logits, t, m_g, s_g, up, 0.1 / vocab, 0.9)),
        "F.cross_entropy fwd+bwd": f_ce_fwd_bwd,
    }, device))
    return rows


def _print(rows: list[dict]) -> None:
    cols = ["kernel", "dtype", "ms", "GB/s"] + sorted({k for r in rows for k in r if k.startswith("x vs")})
    print("  ".join(f"{c:>26}" if i == 0 else f"{c:>14}" for i, c in enumerate(cols)))
    for r in rows:
        cells = []
        for i, c in enumerate(cols):
            val = r.get(c, "")
            val = f"{val:.3f}" if isinstance(val, float) else str(val)
            cells.append(f"{val:>26}" if i == 0 else f"{val:>14}")
        print("  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated subset of bf16,fp16,fp32")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--interpret", action="store_true",
                    help="without CUDA: tiny fp32/fp16 correctness checks in Triton's interpreter")
    args = ap.parse_args(argv)
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    if not torch.cuda.is_available():
        if not args.interpret:
            print("benchmarks/kernels_gpu.py needs CUDA (no GPU here); "
                  "--interpret runs a tiny correctness pass in Triton's interpreter instead")
            return 0
        if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("SHARDLIB_KERNELS_FORCE_TRITON") != "1":
            # the interpreter must be chosen before triton is imported: run again in a fresh process
            env = dict(os.environ, TRITON_INTERPRET="1", SHARDLIB_KERNELS_FORCE_TRITON="1")
            return subprocess.call([sys.executable, "-m", "benchmarks.kernels_gpu", *(argv or sys.argv[1:])], env=env)
        for dtype in dtypes:
            if dtype == torch.bfloat16:
                print("bf16: skipped (the Triton interpreter computes bf16 wrongly; run on a GPU)")
                continue
            errs = check_correctness(dtype, torch.device("cpu"), small=True)
            print(f"{dtype}: ok, largest normwise error {max(errs.values()):.2e} ({max(errs, key=errs.get)})")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    run(device, dtypes, compile_ref=not args.no_compile)
    return 0


def run(device: torch.device, dtypes: list[torch.dtype], compile_ref: bool) -> list[dict]:
    """Correctness for every dtype, then the timing table; returns its rows (tiny sizes off CUDA)."""
    import torch._dynamo as dynamo

    # each reference is compiled once per dtype and variant (up to 6): stay under the recompile
    # limit, past which torch.compile silently runs eager and the column would be wrong
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
    t0 = time.perf_counter()
    rows = []
    for dtype in dtypes:
        errs = check_correctness(dtype, device)
        print(f"{dtype}: correct, largest normwise error {max(errs.values()):.2e} ({max(errs, key=errs.get)})")
    for dtype in dtypes:
        rows += benchmark(dtype, device, compile_ref=compile_ref)
    _print(rows)
    print(f"GB/s: bytes the op must move / time. 'x vs NAME' = NAME's time / the kernel's (> 1: kernel faster). "
          f"{time.perf_counter() - t0:.0f} s")
    return rows

if __name__ == "__main__":
    sys.exit(main())
