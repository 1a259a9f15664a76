"""How close a sharded run must be to a single-process run: a tolerance model for training.

A sharded run sums in another order than one process (a reduce-scatter adds rank-partial
gradients, a row-parallel layer adds per-rank partial products), so its fp32 gradients differ
from the single-process ones by a few ulps, and by different ulps on CPUs with different SIMD
kernels (AVX-512 sums in 16 lanes, AVX2 in 8). An optimizer can amplify such a difference
without bound: AdamW's first update is ``lr * g / (|g| + eps)``, whose slope at ``|g| ~ eps``
is ``lr / (4 eps)`` (2.5e5 with lr 1e-2 and eps 1e-8), so a gradient element at rounding-noise
level (one that is zero in exact arithmetic) moves its weight by up to ``lr`` in either
direction, on any correct implementation. A fixed relative tolerance on parameters is then
either too tight (it fails on some CPUs: ``blocks.1.mlp.fc_out.weight`` off by 3.5e-07 against
1e-05 x 3.4e-02 on AVX-512) or too loose to mean anything.

The model here:

1. **Gradients at step 0 are compared tightly**: ``max |g_sharded - g_single| <= rtol *
   max(max |g_single|, floor)`` per tensor, where ``floor`` is ``FLOOR`` (1/1000) of the
   largest gradient's scale (a tensor that is zero in exact arithmetic, such as a key bias
   under softmax, is compared at that floor). Step 0's inputs are identical, so this bound
   holds for every correct lowering; it is where a wrong shard or a missing reduction shows.
2. **Everything downstream of an optimizer step gets a measured sensitivity band.** The
   single-process run is repeated three times with every gradient perturbed, after backward
   and before clipping and the update, by exactly the gradient tolerance of rule 1 (signs
   ``+1``, ``-1`` and a fixed pseudo-random pattern). The band of a quantity (a parameter
   after step k, a gradient, loss or norm at step k) is its largest elementwise deviation
   from the unperturbed run over the three. It measures what an admissible gradient
   difference does to that element through the optimizer and the rest of training: tiny for
   a well-conditioned element, up to ``2 lr`` for an AdamW element whose gradient is noise.
   The bound is ``rtol * scale + SAFETY * band`` elementwise.

A real error is not hidden by the band: the perturbation is at most the gradient tolerance
(1e-5 of a tensor's scale in fp32, about 100x the rounding differences seen), well-conditioned
elements get a band far below ``rtol * scale``, and a lowering bug (a wrong learning rate, a
missed or doubled update, a wrong shard) moves those elements too. ``tests/test_equivalence.py``
shows the harness failing on such bugs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["FLOOR", "SAFETY", "PERTURBATIONS", "gradient_floor", "perturb_gradients_", "sensitivity_bands",
           "assert_close", "compare_records"]

FLOOR = 1e-3  # a gradient tensor below this fraction of the largest one is compared at that floor
SAFETY = 2.0  # the band is a first-order measurement; twice it covers second-order effects
PERTURBATIONS = (1, -1, "random")  # the gradient perturbations of the three band runs


def _scale(t: torch.Tensor | None) -> float:
    return t.detach().double().abs().max().item() if t is not None and t.numel() else 0.0


def gradient_floor(grads: Iterable[torch.Tensor | None]) -> float:
    """``FLOOR`` times the largest gradient magnitude over ``grads`` (0.0 if none)."""
    return FLOOR * max((_scale(g) for g in grads), default=0.0)


def perturb_gradients_(params: Sequence[torch.nn.Parameter], sign: int | str, rtol: float, step: int = 0) -> None:
    """Add the gradient tolerance to every ``p.grad`` in place: ``sign * rtol * max(max |g|, floor)``.

    Args:
        params: the parameters whose ``.grad`` to perturb (``None`` gradients are skipped).
        sign: ``1`` or ``-1`` (every element the same way), or ``"random"``: a fixed
            pseudo-random sign per element (seeded by the step and the parameter's position).
        rtol: the relative tolerance of rule 1 of the module docstring.
        step: the optimizer step, for the random pattern.
    """
    grads = [p.grad for p in params if p.grad is not None]
    floor = gradient_floor(grads)
    for i, g in enumerate(grads):
        delta = rtol * max(_scale(g), floor)
        if sign == "random":
            gen = torch.Generator().manual_seed(1_000_003 * step + i)
            pattern = torch.randint(0, 2, g.shape, generator=gen).to(g.dtype).mul_(2).sub_(1)
            g.add_(pattern.to(g.device), alpha=delta)
        else:
            g.add_(float(sign) * delta)


def _deviation(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.double() - b.double()).abs()
    if isinstance(a, float):
        return abs(a - b)
    return None


def sensitivity_bands(reference: list[dict], perturbed: Sequence[list[dict]]) -> list[dict]:
    """Per step, the largest deviation of each recorded quantity of the ``perturbed`` runs from
    the ``reference`` run: ``{"loss": float, "norm": float | None, "grads": {name: Tensor},
    "params": {name: Tensor}}`` (elementwise, float64), the shape of the records."""
    bands = []
    for step, ref in enumerate(reference):
        band: dict[str, Any] = {"loss": 0.0, "norm": 0.0 if ref.get("norm") is not None else None, "grads": {}, "params": {}}
        for run in perturbed:
            rec = run[step]
            band["loss"] = max(band["loss"], abs(rec["loss"] - ref["loss"]))
            if band["norm"] is not None:
                band["norm"] = max(band["norm"], abs(rec["norm"] - ref["norm"]))
            for kind in ("grads", "params"):
                for name, value in ref[kind].items():
                    if value is None or rec[kind].get(name) is None:
                        continue
                    dev = _deviation(rec[kind][name], value)
                    old = band[kind].get(name)
                    band[kind][name] = dev if old is None else torch.maximum(old, dev)
        bands.append(band)
    return bands


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, step: int,
                 floor: float = 0.0, band: torch.Tensor | float | None = None) -> float:
    """Check ``|actual - expected| <= rtol * max(max |expected|, floor) + SAFETY * band`` elementwise.

    Args:
        name, what, step: for the message (``"step 1: gradient of w differs ..."``).
        actual, expected: tensors of one shape (any dtype; compared in float64).
        rtol: relative tolerance, normwise over the tensor.
        floor: the smallest scale ``rtol`` is taken of.
        band: the sensitivity band (module docstring), elementwise or a scalar; None: 0.

    Returns:
        ``max |actual - expected| / scale``: the relative error, for reports.

    Raises:
        AssertionError: naming the element that exceeds its bound by the most, with its
            difference, ``rtol * scale`` and its band.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"step {step}: {what} {name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if not expected.numel():
        return 0.0
    scale = max(_scale(expected), floor, 1e-30)
    diff = (actual.double() - expected.double()).abs()
    base = rtol * scale
    allowed = base + SAFETY * (band if band is not None else 0.0)
    if isinstance(allowed, torch.Tensor):
        allowed = allowed.to(diff.device)
    excess = diff - allowed
    worst = int(torch.argmax(excess.reshape(-1)).item()) if diff.dim() else 0
    if not bool((excess <= 0).all()):
        d = diff.reshape(-1)[worst].item()
        b = band.reshape(-1)[worst].item() if isinstance(band, torch.Tensor) and band.dim() else float(band or 0.0)
        where = f" at element {tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))}" if diff.dim() else ""
        raise AssertionError(
            f"step {step}: {what} {name} differs from the single-process run{where}: |diff| {d:.3e} > "
            f"rtol {rtol:g} x max |expected| {scale:.3e} + {SAFETY:g} x sensitivity band {b:.3e} "
            f"(max |diff| over the tensor {diff.max().item():.3e})"
        )
    return diff.max().item() / scale


def compare_records(got: list[dict], reference: list[dict], bands: list[dict] | None, rtol: float) -> dict[str, float]:
    """Compare a sharded run's per-step records with the single-process ones (module docstring).

    Records are ``{"loss": float, "grads": {name: Tensor | None}, "params": {name: Tensor},
    "norm": float | None}`` per step; every name of the reference must be in ``got`` (which may
    hold more: a tied parameter under its alias, as a pipeline stage names it).

    Returns:
        The largest relative error seen per kind: ``{"loss", "grad", "param", "norm"}``.

    Raises:
        AssertionError: the first quantity outside its bound (see :func:`assert_close`).
    """
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "norm": 0.0}
    for step, (mine, ref) in enumerate(zip(got, reference)):
        band = bands[step] if bands is not None else {"loss": 0.0, "norm": 0.0, "grads": {}, "params": {}}
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        worst["loss"] = max(worst["loss"], assert_close("loss", f64(mine["loss"]), f64(ref["loss"]), rtol, "the", step,
                                                        band=band["loss"]))
        if ref.get("norm") is not None:
            worst["norm"] = max(worst["norm"], assert_close("norm", f64(mine["norm"]), f64(ref["norm"]), rtol,
                                                            "the gradient", step, band=band["norm"]))
        floor = gradient_floor(ref["grads"].values())
        for name, expected in ref["grads"].items():
            if name not in mine["grads"]:
                raise AssertionError(f"step {step}: the sharded run has no gradient of {name}")
            g = mine["grads"][name]
            if g is None or expected is None:
                if (g is None) != (expected is None):
                    raise AssertionError(f"step {step}: gradient of {name}: sharded {g is None and 'None'}, "
                                         f"single {expected is None and 'None'}")
                continue
            worst["grad"] = max(worst["grad"], assert_close(name, g, expected, rtol, "gradient of", step, floor,
                                                            band["grads"].get(name)))
        for name, value in ref["params"].items():
            if name not in mine["params"]:
                raise AssertionError(f"step {step}: the sharded full_state_dict lacks {name}")
            worst["param"] = max(worst["param"], assert_close(name, mine["params"][name], value, rtol, "parameter", step,
                                                              band=band["params"].get(name)))
    return worst
