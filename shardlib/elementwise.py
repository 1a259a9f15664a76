"""Which optimizers :class:`~shardlib.ZeroOptimizer` may run on flat ZeRO chunks and shards.

ZeRO (arXiv 1910.02054) hands the inner optimizer 1-D tensors that concatenate many parameters,
cut at arbitrary offsets (a rank's shard of a flat chunk). That is only the unsharded training
if the optimizer is *elementwise*: its update of any part of a tensor is that part of its update
of the whole tensor. Adam's is; Adafactor's (row and column statistics of a 2-D weight), LAMB's
and LARS's (per-tensor norms), Muon's (orthogonalized matrices) and LBFGS's (the whole
parameter vector, through a closure) are not: run on chunks they train another model, silently.

Accepted: torch's elementwise optimizers by exact class (:data:`ELEMENTWISE_OPTIMIZERS`,
checked against torch 2.13's source: every state tensor is per element and every update a
function of the same element's parameter, gradient and state, scalar step counts aside), also
inside a ``functools.partial``; and a class (or factory) that declares ``shardlib_elementwise
= True`` itself. Everything else is refused by :func:`check_elementwise`: :func:`probe`, on
small float64 CPU tensors with the caller's hyperparameters, can show an update is not
elementwise but never that it is (a review found optimizers that read a whole tensor only above
64 elements, or from the fourth step on, and passed it), so its finding only goes into the
message.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .errors import NotElementwiseError
from .kernels import FusedAdamW

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_elementwise", "probe", "requires_closure"]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD, FusedAdamW,
)

# The probe: parameters shaped like a model's (weights and biases), their gradients at different
# scales (a per-tensor statistic then shows), the flat concatenation cut inside the first weight.
PROBE_SHAPES = ((5, 3), (3,), (2, 4), (4,))
PROBE_SPLIT = 13  # of 30 elements: two flat pieces, as a ZeRO shard boundary cuts a chunk
PROBE_STEPS = 3
PROBE_RTOL = 1e-12  # float64; elementwise updates agree to rounding (fused multiply-adds)


def _name(optimizer_cls: Any) -> str:
    """``torch.optim.Adafactor`` (the public path when torch.optim exports it), ``mod.Class``."""
    name = getattr(optimizer_cls, "__qualname__", None) or repr(optimizer_cls)
    if getattr(torch.optim, name, None) is optimizer_cls:
        return f"torch.optim.{name}"
    module = getattr(optimizer_cls, "__module__", None)
    return f"{module}.{name}" if module else name


def _run(optimizer_cls: Any, kwargs: dict, tensors: list[torch.Tensor], grads: list[list[torch.Tensor]]):
    params = [t.clone().requires_grad_() for t in tensors]
    opt = optimizer_cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def probe(optimizer_cls: Any, optimizer_kwargs: dict) -> str | None:
    """Run ``optimizer_cls(params, **optimizer_kwargs)`` for :data:`PROBE_STEPS` steps on a few
    float64 CPU parameters ``PROBE_SHAPES``, and on their flat concatenation cut into two pieces
    at :data:`PROBE_SPLIT`, with the same gradients; torch's global RNG is left as it was.

    Returns:
        None if the two agree (relative :data:`PROBE_RTOL`, and some parameter moved), else why
        not, as a phrase (``"raised TypeError: ..."``, ``"gave other values on the split tensor
        (max relative difference 4.1e-02)"``).
    """
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g, dtype=torch.float64) for s in PROBE_SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) * 10.0**i for i, s in enumerate(PROBE_SHAPES)]
             for _ in range(PROBE_STEPS)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    pieces = list(flat.split([PROBE_SPLIT, flat.numel() - PROBE_SPLIT]))
    flat_grads = []
    for step_grads in grads:
        cat = torch.cat([t.reshape(-1) for t in step_grads])
        flat_grads.append(list(cat.split([PROBE_SPLIT, cat.numel() - PROBE_SPLIT])))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same draws on every rank: every rank decides alike
            whole = _run(optimizer_cls, optimizer_kwargs, tensors, grads)
            torch.manual_seed(0)
            split = _run(optimizer_cls, optimizer_kwargs, pieces, flat_grads)
    except Exception as exc:  # noqa: BLE001 - any failure means: not shown elementwise
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"raised {type(exc).__name__}{': ' + text[:200] if text else ''}"
    if not (torch.isfinite(whole).all() and torch.isfinite(split).all()):
        return "gave non-finite values"
    if torch.equal(whole, flat):
        return "left the parameters unchanged (lr=0?), so nothing was shown"
    err = ((whole - split).abs() / whole.abs().clamp_min(1e-6)).max().item()  # values are O(1)
    if not err <= PROBE_RTOL:
        return f"gave other values on the split tensor (max relative difference {err:.1e})"
    return None


def _unwrap(optimizer_cls: Any) -> Any:
    """The class behind ``functools.partial(cls, ...)`` (any depth), else ``optimizer_cls``."""
    import functools

    while isinstance(optimizer_cls, functools.partial):
        optimizer_cls = optimizer_cls.func
    return optimizer_cls


def requires_closure(optimizer_cls: Any) -> bool:
    """Whether ``optimizer_cls.step`` has a ``closure`` parameter without a default (LBFGS: its
    line search re-evaluates the loss several times per step). ``functools.partial`` is looked
    through; a factory that is not a class has no ``step`` to read and is taken as not needing one."""
    step = getattr(_unwrap(optimizer_cls), "step", None)
    if step is None:
        return False
    try:
        param = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return param is not None and param.default is inspect.Parameter.empty


def check_elementwise(optimizer_cls: Any, optimizer_kwargs: dict) -> None:
    """Refuse an optimizer whose update of a ZeRO shard may not be the shard of its update.

    A probe on small tensors can show that an optimizer is *not* elementwise, never that it is
    (an update may read a whole tensor only above some size, or from some step on), so only two
    kinds are accepted: torch's elementwise optimizers by exact class, and a class or factory
    that declares ``shardlib_elementwise = True`` itself (its author's word). Everything else is
    refused; :func:`probe` runs only to say in the message what it found.

    Args:
        optimizer_cls: what :class:`~shardlib.ZeroOptimizer` was given (a class, a
            ``functools.partial`` of one, or a factory ``f(params, **kwargs)``).
        optimizer_kwargs: its hyperparameters (the probe uses them).

    Raises:
        NotElementwiseError: ``optimizer_cls.step()`` requires a closure (LBFGS; refused even when
            declared elementwise: :meth:`ZeroOptimizer.step` runs a closure once itself and then
            steps the inner optimizer without one, so such an optimizer would fail at its first
            step); or ``optimizer_cls`` is neither one of :data:`ELEMENTWISE_OPTIMIZERS`
            (exact classes, also inside a ``functools.partial``) nor declares
            ``shardlib_elementwise = True`` in its own class body (or as a function attribute).
            No communication: every rank decides alike.
    """
    inner = _unwrap(optimizer_cls)
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS[:-1])
    if requires_closure(optimizer_cls):
        name = _name(inner)
        raise NotElementwiseError(
            f"ZeroOptimizer(smodel, {name}): {name}.step() requires a closure (it re-evaluates the loss during its "
            f"step, as LBFGS's line search does, over the whole parameter vector), but ZeroOptimizer runs the optimizer "
            f"on flat ZeRO shards and steps it without a closure (step(closure) evaluates the closure once, then "
            f"updates), so it would fail at the first step. Fix: use an elementwise optimizer (torch.optim.{known})"
        )
    if any(inner is c for c in ELEMENTWISE_OPTIMIZERS):
        return
    if vars(inner).get("shardlib_elementwise") is True if hasattr(inner, "__dict__") else False:
        return  # the author's word for it (not inherited: a subclass may change the update)
    why = probe(optimizer_cls, dict(optimizer_kwargs))
    name = _name(inner)
    short = getattr(inner, "__name__", name)
    vouch = "" if name.startswith("torch.") else (
        f", or, if {short}'s update is elementwise at every size and step, declare it with "
        f"{short}.shardlib_elementwise = True (set on the class itself; subclasses do not inherit it)")
    if why is None:
        found = ("a probe on a few float64 parameters and their flat concatenation cut in two found no difference, "
                 "but that cannot prove an update elementwise at other sizes or steps, and shardlib does not run what "
                 "it cannot prove exact")
    else:
        found = f"on a few float64 parameters and their flat concatenation cut in two it {why}"
    raise NotElementwiseError(
        f"ZeroOptimizer(smodel, {name}): the optimizer must be elementwise, because it runs on flat 1-D ZeRO "
        f"chunks and shards that concatenate many parameters and cut them anywhere, so an update that reads a "
        f"whole tensor (its norm, rows and columns, or shape: Adafactor, LAMB, LARS, Muon, LBFGS) would train "
        f"another model. {name} is not one of torch's elementwise optimizers, and {found}. "
        f"Fix: use an elementwise optimizer (torch.optim.{known}){vouch}"
    )
