"""Prove a tensor-parallel lowering exact on the user's modules before training: ``shard(verify=True)``.

The rules in :mod:`tensor_rules` decide roles from module types and names; they cannot see what
a module's ``forward`` does with them. An embedding subclass that scales its output, an
attention that reshapes by a global head count, a replicated parameter used on split
activations, an all-reduce on the wrong tensor: each trains the wrong model without an error.
So, before anything is lowered, every distinct unit the plan transforms is run twice on random
input, unsharded and sharded, and the outputs and gradients are compared:

- units: each decoder block (an element of a ``ModuleList``) holding column/row layers, or the
  attention/MLP module itself when it is not inside a block; each parallel embedding and output
  layer (LM head) of a subclass (Gemma's scaled embedding; a plain ``nn.Embedding``/``nn.Linear``
  lowers the same in every model, proven by shardlib's own tests); a model of at most
  ``WHOLE_MODEL_LIMIT`` parameters also whole (the sequence-parallel entry and exit, replicated
  layers between units). One instance per distinct computation (:mod:`.tensor_verify_units`:
  class, layout, parameter shapes and the operations its forward runs), so an 80-layer model
  costs one block, and two instances of one class that compute differently are each run;
- inputs: (like ``shard()`` itself, this assumes every rank built the same model, from the same
  seed) a block's real inputs (hidden states, masks, rotary embeddings) are captured by running
  the unsharded model on a small random batch (token ids for a model that starts with an
  embedding), stopped as soon as the last unit to capture was reached; embeddings get random
  ids, output layers random activations;
- both copies of a unit get the same random weights (a fixed seed, identical on every rank) in
  float64, so an exact lowering agrees to ~1e-15 and any structural error shows at O(1e-2) or
  more; the sharded copy is lowered exactly as :func:`lower_tensor_parallel` lowers the model
  (sequence-split input and output for blocks inside the sequence-parallel region);
- compared: the output, the input's gradient and every parameter's gradient (this rank's slice
  of split ones). Errors are all-reduced (max) over the tensor axis, so every rank of the group
  reaches the same verdict and raises the same :class:`~shardlib.errors.ShardingError`, naming
  the unit, what differs, and the likely cause (a parameter whose per-rank gradients sum to the
  right one: used on split activations; an embedding ``forward`` override; an attribute holding
  a global size).

This is the check the HF tp plans and Megatron leave to the user; torchtitan's parity tests do it
once per model in CI. Cost, at shard() time: one forward and backward of one block per distinct
computation, and a forward of every other block on a few tokens, without gradients, to tell them apart.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh.collectives import raw_all_reduce
from .tensor_lower import LOCALIZED, lower_tensor_parallel
from .tensor_rules import head_counts, is_attention, split_param_names
from .tensor_verify_dropouts import refuse_split_dropouts
from .tensor_verify_units import Unit as _Unit, candidate_units, distinct_units, representatives
from .tensor_verify_inputs import (SEED, capture_inputs, first_float, float_outputs, inside, join, put_first_float,
                                   rel, rel_error, run_device, sample_input, split_seq, tree_map, vocab_local,
                                   vocab_slices)

__all__ = ["verify_tensor_parallel", "TOLERANCE"]

# Relative to the largest value of the tensor (and at least 1e-3 of the unit's largest gradient, so
# a gradient that is zero in exact arithmetic, like an attention key bias, compares its noise to the
# unit's scale). Measured: exact lowerings agree to <= 1e-15 in float64, and to <= 9.4e-8 where a
# module computes in float32 internally (Gemma's RMSNorm casts to float); every defect class of
# issue 14 shows at >= 3e-2 (a lost embedding scale 0.75, partial-sum gradients 0.5-0.9, a
# misplaced all-reduce 0.7). 1e-5 sits two decades from both.
TOLERANCE = 1e-5
# models up to this many parameters are also checked whole (three float64 copies: 480 MB at the limit)
WHOLE_MODEL_LIMIT = 20_000_000


def verify_tensor_parallel(model: nn.Module, plan: Any, mesh: Any) -> dict | None:
    """Check, on ``model``'s own module classes, that ``plan``'s tensor parallelism is exact.

    Call before the lowering, on every rank of the mesh (each tensor-parallel group runs its
    collectives); ``model`` is not changed.

    Args:
        model: the unsharded model, as given to ``shard()``.
        plan: the :class:`~shardlib.plan.Plan` about to be applied (``verify``, ``verify_input``,
            ``tp_layers``, ``sequence_parallel``, ``sp_grad_params`` are read).
        mesh: the :class:`~shardlib.mesh.Mesh`.

    Returns:
        ``{"units": [paths checked], "skipped": reason or None, "max_error": float, "unreached":
        [units the sample forward never called (not checked)]}``, or None when
        there is nothing to verify (no tensor axis of size > 1, or ``verify=False``). The check's
        collectives are not counted in ``mesh.comm`` (they are not the training's); they appear in
        the collective trace (the agreement on the verdict noted ``verify``).

    Raises:
        ShardingError: a unit whose sharded output or gradients differ from the unsharded ones
            (the message names the unit, the tensors and the likely cause), or a model the check
            cannot run (no sample input can be built: pass ``verify_input=``).
    """
    if not getattr(plan, "verify", True) or not plan.tp_layers:
        return None
    axis = plan.tp_layers[0].axis
    n = mesh.size(axis)
    if n == 1:
        return None
    if getattr(mesh, "fake", False):
        return {"units": [], "skipped": "a fake process group (collectives move no data)", "max_error": 0.0,
                "unreached": []}
    counter = mesh.comm
    enabled, counter.enabled = counter.enabled, False  # the check's traffic is not the training's
    try:
        return _verify(model, plan, mesh, axis, n)
    finally:
        counter.enabled = enabled


def _verify(model: nn.Module, plan: Any, mesh: Any, axis: str, n: int) -> dict:
    candidates = candidate_units(model, plan)
    units = representatives(candidates)
    why = capture_inputs(model, plan, units, n)
    if why is not None:  # a meta-built model HF code cannot run on meta: check nothing, say so
        return {"units": [], "skipped": f"{type(model).__name__} is on the meta device and {why}", "max_error": 0.0,
                "unreached": [u.path for u in units]}
    units = distinct_units(model, candidates, run_device(model))  # instances of a kind that compute otherwise
    limit = int(os.environ.get("SHARDLIB_VERIFY_WHOLE_LIMIT", WHOLE_MODEL_LIMIT))  # tests lower it to check units alone
    if sum(p.numel() for p in model.parameters()) <= limit:
        # small enough to run whole: also proves how the units compose (the sequence-parallel
        # entry and exit, replicated layers between them), which no single unit shows
        units.append(_Unit("", "model", inputs=tree_map(lambda x: x.to(run_device(model)), sample_input(model, plan, n))))
    index = mesh.index(axis)
    results = []  # (unit, [(what, error, is_replicated_param_name or None)])
    unreached = [u for u in units if u.inputs is None]
    if unreached:  # same on every rank (same sample, same code): refused before any collective
        names = ", ".join(f"{u.path} ({type(model.get_submodule(u.path)).__name__})" for u in unreached[:4])
        raise ShardingError(
            f"shard(verify=True): the sample forward of {type(model).__name__} never called {names}, so their "
            "tensor-parallel lowering cannot be proven exact (an optional input or a training-only branch reaches "
            "them). Fix: pass verify_input=<a small example batch whose forward reaches them>, or verify=False")
    for unit in units:
        results.append((unit, _check(model, plan, mesh, axis, n, index, unit)))
    errors = torch.tensor([e for _, checks in results for _, e, _ in checks] + [0.0], dtype=torch.float64,
                          device=run_device(model))
    raw_all_reduce(errors, mesh, axis, op="max", note="verify")
    errors = errors.tolist()
    i = 0
    failures = []
    for unit, checks in results:
        for what, _, replicated in checks:
            if errors[i] > TOLERANCE:
                failures.append((unit, what, errors[i], replicated))
            i += 1
    if failures:
        partial, whole = _partial_sums(model, plan, mesh, axis, failures)
        raise ShardingError(_message(model, plan, mesh, axis, failures, partial, whole))
    return {"units": [u.path for u, _ in results], "skipped": None, "max_error": max(errors[:-1], default=0.0),
            "unreached": [u.path for u in units if u.inputs is None]}


# -- one unit ----------------------------------------------------------------------------------
def _randomize(module: nn.Module) -> None:
    """Same random float64 weights on every rank: norms near 1, other vectors near 0, matrices
    scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    g = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for mname, m in module.named_modules():
            for pname, p in m._parameters.items():
                if p is None or not p.is_floating_point():
                    continue
                r = torch.randn(p.shape, generator=g, dtype=torch.float64)
                if p.dim() >= 2:
                    r /= min(p.shape) ** 0.5
                else:
                    r = r * 0.2 + (1.0 if "norm" in type(m).__name__.lower() else 0.0)
                p.copy_(r.to(p.device))


def _mini_plan(plan: Any, root: str, sp: bool) -> SimpleNamespace:
    layers = tuple(dataclasses.replace(l, path=rel(l.path, root), group=rel(l.group, root) if l.group else "")
                   for l in plan.tp_layers if inside(l.path, root))
    names = tuple(rel(x, root) for x in plan.sp_grad_params if inside(x, root))
    return SimpleNamespace(tp_layers=layers, sequence_parallel=sp, sp_entry=None, sp_exit="", sp_grad_params=names)


def _unit_plan(plan: Any, unit: _Unit) -> SimpleNamespace:
    """The plan fields :func:`lower_tensor_parallel` reads, for this unit alone (the whole model:
    the plan's own, entry and exit included)."""
    if unit.kind == "model":
        return SimpleNamespace(tp_layers=plan.tp_layers, sequence_parallel=plan.sequence_parallel, sp_entry=plan.sp_entry,
                               sp_exit=plan.sp_exit, sp_grad_params=plan.sp_grad_params)
    return _mini_plan(plan, unit.path, bool(plan.sequence_parallel and unit.split_in))


def _check(model: nn.Module, plan: Any, mesh: Any, axis: str, n: int, index: int, unit: _Unit) -> list:
    """[(what, relative error, replicated parameter name or None)] for one unit (the same list,
    in the same order, on every rank: errors are reduced over the axis afterwards)."""
    original = model.get_submodule(unit.path) if unit.path else model
    mini = _unit_plan(plan, unit)
    split_names = {rel(n_, unit.path) for n_ in split_param_names(plan.tp_layers) if inside(n_, unit.path)}
    dtype = torch.float64

    def run(module, split):
        # a fresh copy of every input: a stateful one (a Hugging Face KV cache with use_cache=True)
        # would carry the unsharded run's keys into the sharded one
        args, kwargs = tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, copy.deepcopy(unit.inputs))
        first = first_float(args, kwargs)
        if first is not None:
            if split:
                first = split_seq(first, n, index).clone()
            first.requires_grad_(True)
            args, kwargs = put_first_float(args, kwargs, first)
        return first, float_outputs(module(*args, **kwargs))

    for dtype in (torch.float64, torch.float32):  # float32 where a kernel takes no float64 (HF MoE grouped GEMMs)
        ref = _working_copy(original, dtype)
        _randomize(ref)
        ref.eval()
        order: list[str] = []
        hooks = [m.register_forward_pre_hook(lambda mod, a, p=p_: order.append(p)) for p_, m in ref.named_modules()]
        try:
            x_ref, y_ref = run(ref, False)
            break
        except Exception as exc:  # the same on every rank: no collective ran yet
            if dtype == torch.float32:
                raise ShardingError(
                    f"shard(verify=True): the unsharded {unit.kind} {unit.path or '<root>'} ({type(original).__name__}) "
                    f"raised {type(exc).__name__}: {exc} on the inputs captured for it, so its tensor-parallel lowering "
                    "cannot be checked. Fix: pass verify_input=<a small example batch>, or verify=False") from exc
    for h in hooks:
        h.remove()
    if not y_ref:
        raise ShardingError(f"shard(verify=True): {unit.kind} {unit.path or '<root>'} ({type(original).__name__}) returned "
                            "no floating-point tensor to compare. Fix: pass verify=False")
    # every floating output the loss may read (a block's auxiliary output, a MoE model's aux loss)
    checks = [("output", None)] + [(f"output {i} (of {len(y_ref)})", None) for i in range(1, len(y_ref))]
    checks += [("input gradient", None)]
    checks += [(f"gradient of {join(unit.path, name)}", None if name in split_names else name)
               for name, p in ref.named_parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(SEED + 3)
    cots = [torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype) for y in y_ref]
    sum((y * c).sum() for y, c in zip(y_ref, cots)).backward()
    scale = max([float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None and p.grad.numel()] + [0.0])

    grads = copy.deepcopy(ref)  # the reference gradients, sliced by the same lowering as the weights
    # first the dropout probe's copy: its training-mode forward may change buffers (a norm's running
    # statistics) or caches, which nothing reads from this copy (one deep copy less: 4% of the pool's CPU
    # on test_pipeline + test_zero_bubble, py-spy)
    refuse_split_dropouts(grads, mini, order, lambda m: run(m, False), f"{unit.path or '<root>'} ({type(original).__name__})",
                          axis)
    with torch.no_grad():
        for (_, p), (_, q) in zip(ref.named_parameters(), grads.named_parameters()):
            q.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    try:
        shd, _ = lower_tensor_parallel(copy.deepcopy(ref), mini, mesh)
        grads, _ = lower_tensor_parallel(grads, SimpleNamespace(**{**vars(mini), "sp_grad_params": ()}), mesh)
        x_s, y_s = run(shd, unit.split_in)
        vocab = vocab_slices(mini, n, index)
        cots_s = [vocab_local(split_seq(c, n, index) if unit.split_out and i == 0 else c, y, vocab)
                  for i, (c, y) in enumerate(zip(cots, y_s))]
        shapes = [tuple(c.shape) for c in cots_s]
        if [tuple(y.shape) for y in y_s] != shapes:
            i = next(i for i, (y, c) in enumerate(zip(y_s, shapes)) if tuple(y.shape) != c)
            why = ("a sequence-parallel block's first output is its sequence shard" if unit.split_out and i == 0 else
                   "an output besides the first, such as attention weights of this rank's heads, stays split; "
                   "if the model discards it, verify=False" if i else "the unsharded shape")
            raise RuntimeError(f"output {i} has shape {tuple(y_s[i].shape)} sharded, {shapes[i]} expected: {why}")
        sum((y * c).sum() for y, c in zip(y_s, cots_s)).backward()
    except ShardingError:
        raise
    except Exception as exc:
        what = f"the sharded forward/backward raised {type(exc).__name__}: {str(exc)[:300]}"
        return [(what, float("inf"), None)] + [(w, 0.0, r) for w, r in checks[1:]]
    out = [(checks[i][0], rel_error(y, vocab_local(split_seq(r, n, index) if unit.split_out and i == 0 else r, y, vocab)),
            None) for i, (y, r) in enumerate(zip(y_s, y_ref))]
    gx = None if x_ref is None or x_ref.grad is None else (split_seq(x_ref.grad, n, index) if unit.split_in else x_ref.grad)
    out.append(("input gradient", rel_error(x_s.grad if x_s is not None else None, gx), None))
    floor = 1e-3 * scale
    sgrads = dict(shd.named_parameters())
    rgrads = dict(grads.named_parameters())
    for (what, replicated), (name, _) in zip(checks[len(y_ref) + 1:],
                                             [(nm, p) for nm, p in ref.named_parameters() if p.requires_grad]):
        mine = sgrads.get(name)
        out.append((what, rel_error(mine.grad if mine is not None else None, rgrads.get(name), floor), replicated))
    return out


def _working_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` in ``dtype``; on the meta device, materialized where the check runs
    (weights are drawn by :func:`_randomize` anyway; float buffers drawn here, so nothing holds
    uninitialized memory)."""
    c = copy.deepcopy(module)
    if any(t.is_meta for t in list(c.parameters()) + list(c.buffers())):
        c = c.to_empty(device=run_device(module))
        g = torch.Generator().manual_seed(SEED + 5)
        with torch.no_grad():
            for b in c.buffers():
                if b.is_floating_point():
                    b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return c.to(dtype)


def _dtype_for(module: nn.Module, unit: _Unit) -> torch.dtype:
    """float64, unless the unit cannot run in it (grouped GEMMs of HF MoE experts take float32
    at most): then float32. Decided by a forward of a throwaway copy, on this rank only (the same
    code on every rank gives the same answer)."""
    if unit.kind not in ("block", "model"):
        return torch.float64
    probe = _working_copy(module, torch.float64)
    args, kwargs = tree_map(lambda x: x.double() if x.is_floating_point() else x, unit.inputs)
    try:
        with torch.no_grad():
            probe(*args, **kwargs)
        return torch.float64
    except Exception:
        return torch.float32


# -- diagnosis ---------------------------------------------------------------------------------
def _partial_sums(model, plan, mesh, axis, failures) -> tuple[set[str], set[str]]:
    """Names of failing replicated parameters whose gradients, summed over the axis, are right;
    and of those whose own (unsummed) gradients are right though the lowering sums them (taken
    to run on split activations, they run before the split). Two all-reduces per such
    parameter, the same list on every rank."""
    names = sorted({(u.path, r) for u, _, _, r in failures if r is not None})
    found, whole = set(), set()
    by_path: dict[str, list[str]] = {}
    for path, r in names:
        by_path.setdefault(path, []).append(r)
    for path, rels in by_path.items():
        unit = next(u for u, _, _, _ in failures if u.path == path)
        n, index = mesh.size(axis), mesh.index(axis)
        sums = _summed_grads(model, plan, mesh, axis, n, index, unit, rels)
        for name, (summed_ok, own_ok) in sums.items():
            if summed_ok:
                found.add(join(path, name))
            elif own_ok and join(path, name) in set(plan.sp_grad_params):
                whole.add(join(path, name))
    return found, whole


def _summed_grads(model, plan, mesh, axis, n, index, unit, rels) -> dict[str, tuple[bool, bool]]:
    """Re-run the unit with no gradient sums installed; is the sum over ranks of each named
    parameter's gradient equal to the unsharded one, and is each rank's own (max over ranks)?"""
    original = model.get_submodule(unit.path) if unit.path else model
    dtype = _dtype_for(original, unit)
    ref = _working_copy(original, dtype)
    _randomize(ref)
    ref.eval()
    mini = _unit_plan(plan, unit)
    mini.sp_grad_params = ()
    shd, _ = lower_tensor_parallel(copy.deepcopy(ref), mini, mesh)
    vocab = vocab_slices(mini, n, index)
    out = {}
    for module, split in ((ref, False), (shd, unit.split_in)):
        args, kwargs = tree_map(lambda x: x.to(dtype).clone() if x.is_floating_point() else x, unit.inputs)
        first = first_float(args, kwargs)
        if first is not None and split:
            args, kwargs = put_first_float(args, kwargs, split_seq(first, n, index).clone())
        ys = float_outputs(module(*args, **kwargs))
        g = torch.Generator().manual_seed(SEED + 3)
        loss = 0
        for i, y in enumerate(ys):  # the same cotangents as _check: drawn at the unsharded shapes
            shard_out = split and unit.split_out and i == 0
            cot = torch.randn(y.shape if not shard_out else (y.shape[0], y.shape[1] * n) + tuple(y.shape[2:]),
                              generator=g, dtype=torch.float64).to(y.device, y.dtype)
            loss = loss + (y * vocab_local(split_seq(cot, n, index) if shard_out else cot, y, vocab)).sum()
        loss.backward()
    want = dict(ref.named_parameters())
    have = dict(shd.named_parameters())
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in want.values() if p.grad is not None)
    for name in rels:
        g = have[name].grad.detach().clone() if have[name].grad is not None else torch.zeros_like(have[name])
        own = torch.tensor([rel_error(g, want[name].grad, floor)], dtype=torch.float64, device=g.device)
        raw_all_reduce(own, mesh, axis, op="max", note="verify")
        raw_all_reduce(g, mesh, axis, note="verify")
        out[name] = (rel_error(g, want[name].grad, floor) <= TOLERANCE, float(own[0]) <= TOLERANCE)
    return out


def _message(model, plan, mesh, axis, failures, partial, whole=frozenset()) -> str:
    n = mesh.size(axis)
    lines = []
    for unit, what, err, replicated in failures[:12]:
        m = model.get_submodule(unit.path) if unit.path else model
        head = f"  {unit.kind} {unit.path or '<root>'} ({type(m).__name__}): "
        lines.append(head + (what if what.startswith("the sharded") else f"{what} differs (max relative error {err:.2g})"))
    causes = []
    if partial:
        causes.append(
            f"{', '.join(sorted(partial)[:6])} {'is' if len(partial) == 1 else 'are'} replicated but used on activations "
            f"split over {axis!r} (inside the attention heads or on sequence shards): each rank's gradient is a partial sum "
            f"(the sum over the {n} ranks matches). Fix: tp_sum_grads=['<glob>'] to sum their gradients over {axis!r} "
            "(HF calls this replicated_with_grad_allreduce), or split the module that uses them")
    if whole:
        causes.append(
            f"{', '.join(sorted(whole)[:6])} {'runs' if len(whole) == 1 else 'run'} on the replicated input, before the "
            f"split, but {'its gradient is' if len(whole) == 1 else 'their gradients are'} summed over {axis!r}: "
            "shardlib takes a module of a column/row pair's parent registered after the first column layer to run on "
            "split activations (Qwen3's per-head norms). Fix: register it before the column layers in its module's "
            "__init__, or move it out of that module")
    for unit in {u.path: u for u, _, _, _ in failures}.values():
        m = model.get_submodule(unit.path) if unit.path else model
        if unit.kind == "embedding" and type(m) is not nn.Embedding and type(m).forward is not nn.Embedding.forward:
            causes.append(f"{type(m).__name__}.forward overrides nn.Embedding.forward without reaching the parallel lookup "
                          "through super().forward(ids): it reads this rank's rows as the whole table")
        hints = _global_sizes(m, [rel(l.path, unit.path) for l in plan.tp_layers if inside(l.path, unit.path)])
        if hints and unit.kind == "block":
            causes.append(f"what may hold a global size the lowering did not make local: {', '.join(hints[:6])}")
        if unit.split_in:
            mixers = [p for p, c in m.named_modules() if is_attention(c) and not any(
                inside(l.path, join(unit.path, p)) for l in plan.tp_layers)]
            if mixers:
                causes.append(f"{', '.join(mixers[:4])} mix positions (attention) but are replicated inside the "
                              "sequence-parallel region, where each rank holds only part of the sequence")
    if not causes:
        causes.append("the module's forward uses the split weights or activations in a way the column/row lowering does "
                      "not model (a fused projection whose blocks are not declared with fused=, a global size, a reshape)")
    causes = list(dict.fromkeys(causes))
    return (f"shard(verify=True): the tensor-parallel lowering over {axis!r} (size {n}) of {type(model).__name__} is not "
            f"exact on its own modules (mesh {dict(plan.mesh_shape)}; each unit run sharded and unsharded in float64 on "
            f"random input, tolerance {TOLERANCE:g}):\n" + "\n".join(lines) + "\nLikely cause: " + "; ".join(causes) +
            ".\nNothing was sharded. Fix the specs (leave the named modules replicated) or the model, or pass "
            "verify=False to train anyway at your own risk")


def _global_sizes(m: nn.Module, split: list[str]) -> list[str]:
    """``path.attr=value`` for int attributes of split attention modules (holding a parallel
    layer) that still equal a global head count or width."""
    out = []
    for path, c in m.named_modules():
        if not is_attention(c) or not any(inside(s_, path) and s_ != path for s_ in split):
            continue
        head_dim, heads, kv = head_counts(c)
        for pname, prm in c.named_parameters():
            owner = join(path, pname.rpartition(".")[0])
            if any(inside(s_, owner) and s_ == owner for s_ in split) or not prm.dim():
                continue
            if kv and kv != heads and prm.shape[0] == kv:  # Cohere's k_norm (kv_heads, head_dim)
                out.append(f"{join(path, pname)} {tuple(prm.shape)} (one row per key/value head of all {kv}, replicated)")
            elif heads and heads in tuple(prm.shape):
                out.append(f"{join(path, pname)} {tuple(prm.shape)} (one entry per head of all {heads}, replicated)")
        for k, v in vars(c).items():
            if k in ("head_dim", "head_size", "key_value_proj_dim", "d_kv", "num_key_value_groups") or k in LOCALIZED:
                continue  # per-head sizes and ratios are the same on every rank; the lowering made these local
            if isinstance(v, int) and not isinstance(v, bool) and heads and v in (heads, kv or -1, heads * (head_dim or 0)):
                out.append(f"{join(path, k)}={v}")
    return out
