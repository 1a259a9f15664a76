"""Inputs for :mod:`tensor_verify`: a sample batch for the model and each unit's captured inputs.

A block's inputs (hidden states, masks, rotary embeddings: whatever its parent passes) are
captured by running the unsharded model on a small random batch with a forward pre-hook on the
first instance of each kind of unit (:mod:`.tensor_verify_units`), stopped as soon as the last one
was reached; embeddings get
random ids and output layers random activations. Everything is drawn from fixed seeds, so every
rank holds the same inputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..spec import shard_range

__all__ = ["SEED", "sample_length", "sample_input", "capture_inputs", "tree_map", "run_device", "inside", "rel",
           "join", "split_seq", "vocab_slices", "vocab_local", "first_float", "put_first_float", "float_outputs",
           "rel_error"]

SEED = 20261201


class _Stop(Exception):
    """Raised by the capture hooks once every unit's input is held."""

def sample_length(model: nn.Module, n: int) -> int:
    cfg = getattr(model, "config", None)
    limit = None
    for key in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"):
        value = getattr(cfg, key, None) if cfg is not None else None
        if isinstance(value, int) and value > 0:
            limit = value
            break
    t = n * max(1, -(-4 // n))  # >= 4 tokens, divisible by the tensor axis (sequence parallelism splits it)
    if limit is not None and t > limit:
        t = max(n, limit // n * n)
    return t


def sample_input(model: nn.Module, plan: Any, n: int) -> tuple[tuple, dict]:
    given = getattr(plan, "verify_input", None)
    if given is not None:
        args = given if isinstance(given, tuple) else (given,)
        return args, {}
    g = torch.Generator().manual_seed(SEED)
    t = sample_length(model, n)
    # the first layer that takes the input: an Embedding or a Linear, in registration order (a model may
    # hold parameters of its own, such as a learned position table, before them)
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    device = run_device(model)
    if isinstance(first, nn.Embedding):
        vocab = first.num_embeddings
        cfg_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(cfg_vocab, int) and 0 < cfg_vocab < vocab:
            vocab = cfg_vocab
        ids = torch.randint(0, vocab, (2, t), generator=g).to(device)
        kwargs = {}
        try:
            names = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            names = {}
        if "decoder_input_ids" in names:  # encoder-decoder (T5, BART): the decoder reads ids too
            kwargs["decoder_input_ids"] = ids.clone()
        return (ids,), kwargs
    if isinstance(first, nn.Linear):
        dtype = first.weight.dtype
        return (torch.randn(2, t, first.in_features, generator=g).to(device, dtype),), {}
    raise ShardingError(
        f"shard(verify=True) runs one block of {type(model).__name__} sharded and unsharded to prove the tensor-parallel "
        f"lowering exact, but cannot build a sample input for it (it has no Embedding or Linear to read one). Fix: pass "
        "verify_input=<a small example batch, the same on every rank> (a tensor or a tuple of positional arguments), "
        "or verify=False to skip the check")


def capture_inputs(model: nn.Module, plan: Any, units: list, n: int) -> str | None:
    """Fill each unit's ``inputs`` (units have ``path``, ``kind``, ``inputs``): synthesized for
    embeddings and output layers, captured for blocks (and the whole model: the sample itself).

    Returns:
        None, or for a model on the meta device whose forward cannot run on meta tensors (HF
        builds masks from values), why the blocks could not be checked."""
    g = torch.Generator().manual_seed(SEED + 1)
    t = sample_length(model, n)
    device = run_device(model)
    todo = {}
    for unit in units:
        m = model.get_submodule(unit.path) if unit.path else model
        if unit.kind == "embedding":
            unit.inputs = ((torch.randint(0, m.num_embeddings, (2, t), generator=g).to(device),), {})
        elif unit.kind == "output":
            width = m.weight.shape[0] if type(m).__name__ == "Conv1D" else m.weight.shape[1]
            unit.inputs = ((torch.randn(2, t, width, generator=g).to(device, m.weight.dtype),), {})
        else:
            todo[unit.path] = unit
    if not todo:
        return
    if any(p.is_meta for p in model.parameters()):
        return _capture_on_meta(model, plan, todo, n, device)
    args, kwargs = sample_input(model, plan, n)
    _run_with_hooks(model, todo, args, kwargs)
    return None


def _run_with_hooks(model: nn.Module, todo: dict, args: tuple, kwargs: dict) -> None:
    """Run ``model(*args, **kwargs)`` in eval mode without gradients, holding each unit's first
    call inputs; stop once all are held.

    Raises:
        ShardingError: the forward raised (the message says how to pass an input or skip)."""
    handles = []

    def hook(path):
        def pre(module, a, k):
            if todo[path].inputs is None:
                todo[path].inputs = tree_map(lambda x: x.detach().clone(), (a, k))
            if all(u.inputs is not None for u in todo.values()):
                raise _Stop
        return pre

    for path in todo:
        m = model.get_submodule(path) if path else model
        handles.append(m.register_forward_pre_hook(hook(path), with_kwargs=True))
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except _Stop:
        pass
    except Exception as exc:
        raise ShardingError(
            f"shard(verify=True) runs {type(model).__name__} on a sample input to capture the inputs of its "
            f"tensor-parallel blocks, and the forward raised {type(exc).__name__}: {exc}. Fix: pass "
            "verify_input=<a small example batch, the same on every rank>, or verify=False to skip the check") from exc
    finally:
        for h in handles:
            h.remove()
        for m, mode in was:
            m.training = mode


def tree_map(fn, obj):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(tree_map(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return obj


def run_device(model: nn.Module) -> torch.device:
    """Where the check runs: the parameters' device, or for a model on meta the device its
    shards will be materialized on (:func:`shardlib.lazy.default_device`)."""
    p = next(model.parameters(), None)
    if p is None or not p.is_meta:
        return p.device if p is not None else torch.device("cpu")
    from ..lazy import default_device

    return default_device()


def _capture_on_meta(model: nn.Module, plan: Any, todo: dict, n: int, device: torch.device) -> str | None:
    """A model on the meta device: run its forward on meta tensors to learn the blocks' input
    shapes, then fill them with fixed-seed values (floats normal; integers (positions) an arange
    along the last dimension; booleans (masks) True). Both sides of the check read the same
    inputs, so their values need only be finite. A forward that cannot run on meta leaves the
    units without inputs (the report says they were not checked)."""
    args, kwargs = sample_input(model, plan, n)
    args, kwargs = tree_map(lambda x: x.to("meta"), (args, kwargs))
    try:
        _run_with_hooks(model, todo, args, kwargs)
    except ShardingError as exc:
        for unit in todo.values():
            unit.inputs = None
        return f"its forward does not run on the meta device ({str(exc.__cause__ or exc)[:160]})"
    g = torch.Generator().manual_seed(SEED + 4)

    def fill(x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:
            return x.to(device)
        if x.is_floating_point():
            return torch.randn(x.shape, generator=g).to(device, x.dtype)
        if x.dtype == torch.bool:
            return torch.ones(x.shape, dtype=torch.bool, device=device)
        last = x.shape[-1] if x.dim() else 1
        return torch.arange(last, device=device).expand(x.shape).to(x.dtype).clone() if x.dim() else \
            torch.zeros((), dtype=x.dtype, device=device)

    for unit in todo.values():
        if unit.inputs is not None:
            unit.inputs = tree_map(fill, unit.inputs)
    return None


def inside(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def rel(path: str, root: str) -> str:
    return path if root == "" else ("" if path == root else path[len(root) + 1:])


def join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def split_seq(x: torch.Tensor, n: int, index: int, dim: int = 1) -> torch.Tensor:
    lo, hi = shard_range(x.shape[dim], n, index)
    return x.narrow(dim, lo, hi - lo)


def vocab_slices(mini: Any, n: int, index: int) -> dict[int, tuple[int, int]]:
    """``{V: (lo, hi)}``: this rank's slice of each output layer kept vocabulary-parallel."""
    return {l.out_features: shard_range(l.out_features, n, index) for l in mini.tp_layers if l.parallel_output}


def vocab_local(ref: torch.Tensor, y: torch.Tensor, vocab: dict[int, tuple[int, int]]) -> torch.Tensor:
    """``ref`` (unsharded), or its slice of the vocabulary where the sharded output ``y`` is an
    output layer's vocabulary-parallel logits (last dimension this rank's width of ``V``)."""
    if not ref.dim() or not y.dim() or ref.shape[-1] not in vocab:
        return ref
    lo, hi = vocab[ref.shape[-1]]
    return ref.narrow(-1, lo, hi - lo) if y.shape[-1] == hi - lo != ref.shape[-1] else ref


def first_float(args, kwargs):
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    for key in ("hidden_states", "x", "input", "inputs"):
        if isinstance(kwargs.get(key), torch.Tensor) and kwargs[key].is_floating_point():
            return kwargs[key]
    return None


def put_first_float(args, kwargs, value):
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return args[:i] + (value,) + args[i + 1:], kwargs
    for key in ("hidden_states", "x", "input", "inputs"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: value}
    return args, kwargs


def float_outputs(out: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a module's output (a tensor, tuple, list, dict or HF
    ``ModelOutput``), in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for v in values for t in float_outputs(v)]


def rel_error(got: torch.Tensor | None, want: torch.Tensor | None, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) (0 when both are absent or zero; inf on a shape
    mismatch)."""
    if got is None and want is None:
        return 0.0
    if got is None or want is None:
        other = got if want is None else want
        return 0.0 if float(other.abs().max()) == 0.0 else float("inf")
    if got.shape != want.shape or not bool(torch.isfinite(got).all()) or not bool(torch.isfinite(want).all()):
        return float("inf")  # NaN on either side proves nothing: refused
    scale = max(float(want.detach().abs().max()) if want.numel() else 0.0, floor)
    diff = float((got.detach() - want.detach()).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
