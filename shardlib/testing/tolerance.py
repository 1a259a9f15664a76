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
2. **Everything downstream of an optimizer step gets a measured sensitivity band.** Beside
   the single-process run, three copies train in lockstep whose gradients, after backward and
   before clipping and the update, are replaced at every step by the reference gradient moved
   to the edge of what rule 1 admits there: ``g_ref + s * (rtol * max(scale, floor) + band)``,
   with signs ``s`` of ``+1``, ``-1`` and a fixed pseudo-random pattern, and ``band`` the
   gradient's own band at that step (zero at step 0). The band of a quantity (a parameter after
   step k, a gradient, the loss or the norm at step k) is its largest elementwise deviation from
   the reference over the three copies. For an update that is monotone in each gradient element
   (SGD; AdamW, Adagrad near their first steps) the all-plus and all-minus copies are the
   extremes of what any admissible gradients reach, so the band bounds the sharded run's
   deviation: tiny for a well-conditioned element, up to ``2 lr`` for an AdamW or Adagrad
   element whose gradient is noise (its sign is arbitrary). The bound is ``rtol * scale +
   SAFETY * band`` elementwise. An element whose reference gradient was, at some step, within
   that edge of zero has an update of undetermined sign (weight decay or an optimizer state may
   then carry either sign on), so from then on its band is at least twice the distance the
   copies moved it. A parameter's scale is the largest magnitude it has had so far: fp32 rounds
   relative to the operands, and an update may cancel most of a value.
3. **A trajectory that rounding alone scatters is not compared.** If the copies' losses spread
   by more than ``CHAOS`` (relative) at some step, fp32 training is chaotic there (a large
   learning rate over many steps): no sharded run could be held to the single-process one, and
   the harness says so (:class:`NotComparable`) instead of passing or failing.

A real error is not hidden by the band: the perturbation is the gradient tolerance plus the
gradient's own band (at step 0, 1e-5 of a tensor's scale in fp32, about 100x the rounding
differences seen), well-conditioned elements get a band far below ``rtol * scale``, and a lowering bug (a wrong learning rate, a
missed or doubled update, a wrong shard) moves those elements too. ``tests/test_equivalence.py``
shows the harness failing on such bugs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["FLOOR", "SAFETY", "CHAOS", "PERTURBATIONS", "NotComparable", "ReferenceRun", "reference_with_bands",
           "gradient_floor", "assert_close", "compare_records"]

FLOOR = 1e-3  # a gradient tensor below this fraction of the largest one is compared at that floor
SAFETY = 2.0  # the band is measured at the edges; twice it covers updates that are not monotone
CHAOS = 1e-3  # relative loss spread of the band copies beyond which a step is not comparable
PERTURBATIONS = (1, -1, "random")  # the gradient perturbations of the three band copies


class NotComparable(AssertionError):
    """The single-process run is itself scattered by fp32 rounding (rule 3 of the module doc)."""


def _scale(t: torch.Tensor | None) -> float:
    return t.detach().double().abs().max().item() if t is not None and t.numel() else 0.0


def gradient_floor(grads: Iterable[torch.Tensor | None]) -> float:
    """``FLOOR`` times the largest gradient magnitude over ``grads`` (0.0 if none)."""
    return FLOOR * max((_scale(g) for g in grads), default=0.0)


def _pattern(sign: int | str, like: torch.Tensor, step: int, index: int) -> torch.Tensor | float:
    if sign != "random":
        return float(sign)
    gen = torch.Generator().manual_seed(1_000_003 * step + index)
    return torch.randint(0, 2, like.shape, generator=gen).to(like.dtype).mul_(2).sub_(1).to(like.device)


class ReferenceRun:
    """One single-process training run, stepped from outside (the lockstep of
    :func:`reference_with_bands`).

    Args:
        model: the unsharded model.
        optimizer: its optimizer.
        loss: ``loss(model, step) -> scalar tensor`` (the forward of one step).
        max_grad_norm: clip to this global norm before the update (``torch.nn.utils.clip_grad_norm_``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss, max_grad_norm: float | None = None):
        self.model, self.optimizer, self.loss, self.max_grad_norm = model, optimizer, loss, max_grad_norm
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def backward(self, step: int) -> dict:
        loss = self.loss(self.model, step)
        loss.backward()
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in self.model.named_parameters()}
        return {"loss": loss.item(), "grads": grads}

    def update(self) -> dict:
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                  self.max_grad_norm).item()
        self.optimizer.step()
        params = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.optimizer.zero_grad()
        return {"norm": norm, "params": params}


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in state.items()}


def _max_dev(values: Sequence[Any], ref: Any) -> Any:
    if ref is None:
        return None
    if isinstance(ref, torch.Tensor):
        out = torch.zeros_like(ref, dtype=torch.float64)
        for v in values:
            if v is not None:
                out = torch.maximum(out, (v.double() - ref.double()).abs())
        return out
    return max((abs(v - ref) for v in values), default=0.0)


def reference_with_bands(make_run, steps: int, rtol: float) -> tuple[list[dict], list[dict]]:
    """The single-process run's records and their sensitivity bands (module docstring, rule 2).

    Args:
        make_run: builds a fresh :class:`ReferenceRun` (the same seed each time: four are built).
        steps: optimizer steps.
        rtol: the gradient tolerance of rule 1.

    Returns:
        ``(records, bands)``, one dict per step each: ``{"loss", "grads", "params", "norm"}``
        (bands elementwise, float64).

    Raises:
        NotComparable: the copies' losses spread by more than ``CHAOS`` relative (rule 3).
    """
    runs = [make_run() for _ in range(1 + len(PERTURBATIONS))]
    records, bands = [], []
    noise: dict[str, torch.Tensor] = {}  # elements whose gradient was once within tolerance of zero
    travel: dict[str, torch.Tensor] = {}  # per element, the sum over steps of the largest move of any copy
    before = [_snapshot(run.model.state_dict()) for run in runs]  # each copy's values before the step
    for step in range(steps):
        back = [run.backward(step) for run in runs]
        ref = back[0]
        band: dict[str, Any] = {"loss": _max_dev([b["loss"] for b in back[1:]], ref["loss"]), "grads": {}}
        for name, g in ref["grads"].items():
            band["grads"][name] = _max_dev([b["grads"][name] for b in back[1:]], g)
        if band["loss"] > CHAOS * max(abs(ref["loss"]), 1e-30):
            raise NotComparable(
                f"step {step}: the single-process run is scattered by rounding alone: moving its gradients within the "
                f"tolerance (rtol {rtol:g}) moves the loss {ref['loss']:.6g} by {band['loss']:.3g} (relative "
                f"{band['loss'] / max(abs(ref['loss']), 1e-30):.1e} > {CHAOS:g}), so fp32 training is chaotic there and no "
                "sharded run can be compared with it. Fix: fewer steps, a smaller learning rate, or float64")
        floor = gradient_floor(ref["grads"].values())
        edges = {}
        for name, g in ref["grads"].items():
            if g is not None:
                edges[name] = rtol * max(_scale(g), floor) + band["grads"][name].to(g.dtype).to(g.device)
                unsigned = g.double().abs() <= edges[name].double()  # its sign is not determined
                noise[name] = unsigned if name not in noise else noise[name] | unsigned
        for run, sign in zip(runs[1:], PERTURBATIONS):
            for index, (name, p) in enumerate(run.named):
                g = ref["grads"].get(name)
                if g is not None:
                    p.grad = g + _pattern(sign, g, step, index) * edges[name]
        ups = [run.update() for run in runs]
        band["norm"] = _max_dev([u["norm"] for u in ups[1:]], ups[0]["norm"])
        band["params"] = {}
        for name, v in ups[0]["params"].items():
            moved = (v.double() - before[0][name]).abs()
            for u, old in zip(ups[1:], before[1:]):
                moved = torch.maximum(moved, (u["params"][name].double() - old[name]).abs())
            travel[name] = moved if name not in travel else travel[name] + moved
            b = _max_dev([u["params"][name] for u in ups[1:]], v)
            if name in noise:  # an update of undetermined sign: anywhere within twice the distance travelled
                b = torch.where(noise[name].to(b.device), torch.maximum(b, 2 * travel[name]), b)
            band["params"][name] = b
        before = [_snapshot(u["params"]) for u in ups]
        records.append({**ref, **ups[0]})
        bands.append(band)
    return records, bands


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
    largest: dict[str, float] = {}  # per parameter, the largest magnitude it has had so far
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
            # fp32 rounds relative to the operands: an update that cancels most of a value (a bias
            # of 0.1 brought to 1e-3 by Adagrad and weight decay) keeps the rounding of 0.1
            largest[name] = max(largest.get(name, 0.0), _scale(value))
            worst["param"] = max(worst["param"], assert_close(name, mine["params"][name], value, rtol, "parameter", step,
                                                              largest[name], band["params"].get(name)))
    return worst
