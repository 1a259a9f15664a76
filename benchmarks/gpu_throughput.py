"""The reference GPT on one GPU: building it and its batches, model FLOPs and MFU, and timed
training steps of plain PyTorch against ``shard`` (the throughput rows of
:mod:`benchmarks.gpu_check`).

MFU = model FLOPs per second over the GPU's dense bf16 peak (:data:`PEAK_TFLOPS`: H200/H100
SXM 989 TFLOP/s, NVIDIA's data sheets). Model FLOPs per token are ``6 N`` (N = all parameters,
the tied embedding once: forward 2N, backward 4N) and, in a second column, ``6 N + 12 L T C``
with the attention score and value matmuls (PaLM, arXiv 2204.02311, appendix B: ``12 L H Q T``,
``H Q = C``). A side's time is taken with ``torch.cuda.synchronize()`` only before and after
its timed window.
"""

from __future__ import annotations

import time

import torch

__all__ = ["PEAK_TFLOPS", "SPEED_TARGET", "MEDIUM", "gpt_config", "random_batches", "gpt", "n_params", "flops_per_token",
           "mfu", "peak_for", "time_side", "check_throughput"]

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, SXM parts (NVIDIA data sheets)
SPEED_TARGET = 1.03  # ours / torch step time at one rank (benchmarks.run's shard_dp1_vs_plain target)
MEDIUM = dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304)  # GPT-2 medium, ~355M


def gpt_config(size: str):
    """The GPT shapes of the GPU checks: ``tiny`` (CPU tests, ``--tiny``), ``check`` (training and
    offload checks on a GPU) and ``medium`` (GPT-2 medium, the throughput rows)."""
    from shardlib.models import GPTConfig

    shapes = {"tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=32),
              "check": dict(n_layer=4, n_head=8, n_embd=256, block_size=128), "medium": MEDIUM}
    return GPTConfig(**shapes[size])


def random_batches(cfg, batch: int, seq: int, n: int, device: torch.device) -> list:
    """``n`` batches ``(x, y)`` of token ids, int64 ``(batch, seq)`` on ``device``, y = x shifted
    by one (the same on every call)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        xy = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((xy[:, :-1].to(device), xy[:, 1:].to(device)))
    return out


def gpt(cfg, device: torch.device):
    """The reference GPT from seed 0, built on ``device`` (the same tensors on every call)."""
    from shardlib.models import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)


def n_params(cfg) -> int:
    """Parameters of the reference GPT of ``cfg`` (the tied embedding once), counted on meta."""
    return gpt(cfg, torch.device("meta")).num_params()


def flops_per_token(n: int, n_layer: int, seq: int, n_embd: int, attention: bool = False) -> int:
    """Training FLOPs per token of a model of ``n`` parameters: ``6 N`` (forward 2N, backward 4N),
    plus with ``attention`` the score and value matmuls, ``12 L T C`` (PaLM arXiv 2204.02311
    appendix B), ``T`` the sequence length."""
    return 6 * n + (12 * n_layer * seq * n_embd if attention else 0)


def mfu(tokens_per_s: float, per_token_flops: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: ``tokens/s * FLOPs per token`` over ``peak_tflops * 1e12``."""
    return tokens_per_s * per_token_flops / (peak_tflops * 1e12)


def peak_for(name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of the GPU called ``name``, if :data:`PEAK_TFLOPS` knows it."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name.upper()), None)


def time_side(kind: str, mesh, device: torch.device, cfg, batch: int, warmup: int, steps: int) -> dict:
    """Tokens/s of one side: ``torch`` (plain GPT, autocast bf16, AdamW fused), ``shardlib``
    (shard on the one-rank mesh, the same autocast, ZeroOptimizer) or ``shardlib-bf16``
    (``param_dtype=torch.bfloat16``, no autocast). Synchronizes only around the timed window."""
    import contextlib

    import shardlib

    model = gpt(cfg, device)
    amp = contextlib.nullcontext
    if kind == "torch":
        fused = True if device.type == "cuda" else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    else:
        options = {"param_dtype": torch.bfloat16} if kind == "shardlib-bf16" else {}
        model = shardlib.shard(model, mesh, **options)
        opt = shardlib.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4)
    if kind != "shardlib-bf16":
        amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    data = random_batches(cfg, batch, cfg.block_size, 4, device)

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with amp():
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    first = [step(i) for i in range(max(1, warmup))]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    last = [step(i) for i in range(steps)][-1]
    sync()
    seconds = time.perf_counter() - t0
    # the model, optimizer and batches go with this frame; the caller empties the CUDA cache
    return {"kind": kind, "step_s": seconds / steps, "tokens_per_s": batch * cfg.block_size * steps / seconds,
            "loss0": float(first[0]), "loss": float(last)}


def check_throughput(mesh, device: torch.device, cfg, batch: int, warmup: int, steps: int, peak: float | None) -> list[tuple]:
    """The three sides; returns one ``(setting, result, figures, status)`` per side."""
    n = n_params(cfg)
    per6 = flops_per_token(n, cfg.n_layer, cfg.block_size, cfg.n_embd)
    per_attn = flops_per_token(n, cfg.n_layer, cfg.block_size, cfg.n_embd, attention=True)
    sides = []
    for kind in ("torch", "shardlib", "shardlib-bf16"):
        sides.append(time_side(kind, mesh, device, cfg, batch, warmup, steps))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = sides[0]
    out = []
    for s in sides:
        if not torch.isfinite(torch.tensor(s["loss"])):
            raise AssertionError(f"{s['kind']}: loss {s['loss']} is not finite")
        u = (f"MFU {mfu(s['tokens_per_s'], per6, peak):.1%} (6N), {mfu(s['tokens_per_s'], per_attn, peak):.1%} (+attn)"
             if peak else "MFU - (unknown peak: --peak-tflops)")
        ratio = s["step_s"] / base["step_s"]
        status = "PASS" if s["kind"] != "shardlib" or ratio <= SPEED_TARGET else "MISS"
        result = f"{s['tokens_per_s']:,.0f} tokens/s" + ("" if s is base else f", ours/torch {ratio:.3f}")
        out.append((s["kind"], result, f"{s['step_s'] * 1e3:.1f} ms/step; {u}; loss {s['loss0']:.3f}->{s['loss']:.3f}",
                    status))
    return out
