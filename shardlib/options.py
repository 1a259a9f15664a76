"""Checks of the scalar options of :func:`shardlib.plan` (names, types, ranges).

Each check raises :class:`~shardlib.ShardingError` naming the option, the value given and what
would be accepted; :func:`check_options` runs them all, on every rank, before the planner looks
at the model (the options are documented on :func:`shardlib.plan`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ShardingError

__all__ = ["DATA_AXIS_NAMES", "OPTIONS", "Options", "check_options", "check_model_and_mesh", "check_fused_patterns"]

DEFAULT_CHUNK_SIZE = None  # elements per ZeRO chunk; None: searched per model (shardlib.chunking)
DATA_AXIS_NAMES = ("dp", "fsdp")  # the default data axes (the batch is split along them)
OPTIONS = frozenset({
    "zero_stage", "data_axes", "chunk_size", "optimizer_states", "broadcast_buffers", "logical_axis_rules",
    "sequence_parallel", "sp_entry", "sp_exit", "dropout_seed", "fused", "pp_axis", "strict_specs",
    "param_dtype", "reduce_dtype", "init_rules", "init_seed", "offload_ratio", "optimizer_offload",
    "verify", "verify_input", "tp_sum_grads", "vocab_parallel_logits", "activation_checkpointing",
    "offload_param_frac",
})


@dataclass(frozen=True)
class Options:
    """The checked scalar options (the rest are read by the planner where they are used)."""

    data_axes: tuple[str, ...]
    chunk_size: int | None
    optimizer_states: int
    pp_axis: str | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    offload_ratio: float | None
    offload_param_frac: float = 0.0


def _check_int(option: str, value: Any, low: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ShardingError(f"{option} must be {meaning}, got {value!r}")
    return int(value)


def _check_dtype(option: str, value: Any) -> torch.dtype | None:
    """``value`` if it is None or a floating-point dtype torch computes in (not float8)."""
    if value is None or value in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return value
    raise ShardingError(
        f"{option} must be a floating-point torch.dtype (torch.bfloat16, torch.float16, torch.float32, torch.float64) or None, "
        f"got {value!r}{' (a string)' if isinstance(value, str) else ''}. Fix: pass e.g. {option}=torch.bfloat16"
    )


def _check_bool(option: str, value: Any) -> None:
    """A flag must be a bool: ``bool("False")`` is True, so a string would turn it on."""
    if not isinstance(value, (bool, np.bool_)):
        raise ShardingError(f"{option} must be True or False, got {value!r} of type {type(value).__name__}")


def _check_seed(option: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -(2**63) <= value < 2**63:
        raise ShardingError(f"{option} must be an int (a 64-bit seed), got {value!r} of type {type(value).__name__}")


def _positive_int(v: Any) -> bool:
    return not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, np.integer)) and v >= 1


def _check_fused(value: Any) -> None:
    if value is None:
        return
    ok = isinstance(value, Mapping) and all(
        isinstance(k, str) and (_positive_int(v) or (isinstance(v, (tuple, list)) and len(v) > 0
                                                     and all(_positive_int(b) for b in v)))
        for k, v in value.items())
    if not ok:
        raise ShardingError(
            f"fused must map module globs to a number of blocks (an int >= 1) or to the block sizes (a tuple of ints "
            f">= 1), like {{'*.c_attn': 3}} or {{'*.qkv_proj': (64, 16, 16)}}, got {value!r}"
        )


def _check_data_axes(value: Any, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    if value is None:
        return tuple(a for a in mesh_shape if a in DATA_AXIS_NAMES)
    if not isinstance(value, (str, list, tuple)):
        raise ShardingError(
            f"data_axes must be an axis name or a tuple of axis names of the mesh {mesh_shape}, got {value!r} of "
            f"type {type(value).__name__}. Fix: e.g. data_axes=('dp',)"
        )
    axes = (value,) if isinstance(value, str) else tuple(value)
    for a in axes:
        if a not in mesh_shape:
            raise ShardingError(
                f"data_axes names {a!r}, which is not an axis of the mesh {mesh_shape}. Fix: use some of {list(mesh_shape)}"
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(f"data_axes {axes} names an axis twice")
    return axes


def check_options(options: dict, mesh_shape: dict[str, int]) -> Options:
    """Check the option names and the scalar options against ``mesh_shape`` (axis -> size).

    Raises:
        ShardingError: an unknown option name; ``data_axes`` not an axis name or a tuple of them,
            naming an axis not in the mesh, or one twice; ``chunk_size`` < 1 or not an int or None;
            ``optimizer_states`` < 0 or not an int; ``pp_axis`` not in the mesh;
            ``param_dtype``/``reduce_dtype`` not a floating-point ``torch.dtype``;
            ``offload_ratio`` or ``offload_param_frac`` not a number in [0, 1]; a flag (``sequence_parallel``,
            ``broadcast_buffers``, ``optimizer_offload``, ``strict_specs``, ``verify``,
            ``vocab_parallel_logits``) that is not a bool; ``vocab_parallel_logits=True`` on a mesh
            with a pipeline axis; ``tp_sum_grads`` not a list of globs; ``verify_input`` not a tensor or a tuple of them;
            a seed (``dropout_seed``, ``init_seed``) that is not an int; ``fused`` not a dict
            from globs to ints >= 1 or to non-empty tuples of them.
    """
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ShardingError(f"unknown plan option(s) {unknown}; valid options are {sorted(OPTIONS)}")
    for flag in ("sequence_parallel", "broadcast_buffers", "optimizer_offload", "strict_specs", "verify",
                 "vocab_parallel_logits"):
        if flag in options:
            _check_bool(flag, options[flag])
    for seed in ("dropout_seed", "init_seed"):
        if seed in options:
            _check_seed(seed, options[seed])
    _check_fused(options.get("fused"))
    sums = options.get("tp_sum_grads", ())
    if isinstance(sums, str) or not isinstance(sums, (list, tuple)) or not all(isinstance(g, str) for g in sums):
        raise ShardingError(f"tp_sum_grads must be a list of globs over parameter names (like ['*.q_norm.weight']), "
                            f"got {sums!r}")
    given = options.get("verify_input")
    if given is not None and not isinstance(given, torch.Tensor) and not (
            isinstance(given, tuple) and given and all(isinstance(a, torch.Tensor) for a in given)):
        raise ShardingError(f"verify_input must be a tensor or a non-empty tuple of tensors (the positional arguments of "
                            f"one small forward, the same on every rank), got {type(given).__name__}")
    pp_axis = options.get("pp_axis", "pp" if "pp" in mesh_shape else None)
    if pp_axis is not None and pp_axis not in mesh_shape:
        raise ShardingError(f"pp_axis {pp_axis!r} is not an axis of the mesh {mesh_shape}")
    if options.get("vocab_parallel_logits") and pp_axis is not None and mesh_shape[pp_axis] > 1:
        raise ShardingError(
            f"vocab_parallel_logits=True on the pipeline mesh {mesh_shape}: the last stage hands its logits to "
            "forward_backward's criterion, which is given the whole vocabulary. Fix: vocab_parallel_logits=False "
            "(models.gpt_preset() sets it: override it), or a mesh without a pipeline axis")
    offload_ratio = options.get("offload_ratio")
    if offload_ratio is not None:
        if isinstance(offload_ratio, bool) or not isinstance(offload_ratio, (int, float)) or not 0.0 <= offload_ratio <= 1.0:
            raise ShardingError(f"offload_ratio must be a number in [0, 1] (fraction of saved activations moved to host), got {offload_ratio!r}")
        offload_ratio = float(offload_ratio)
    frac = options.get("offload_param_frac", 0.0)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
        raise ShardingError(f"offload_param_frac must be a number in [0, 1] (the fraction of each rank's ZeRO-3 parameter "
                            f"shard bytes kept in host memory), got {frac!r}")
    return Options(
        offload_param_frac=float(frac),
        data_axes=_check_data_axes(options.get("data_axes"), mesh_shape),
        chunk_size=None if options.get("chunk_size") is None else
        _check_int("chunk_size", options["chunk_size"], 1, "a positive number of elements"),
        optimizer_states=_check_int(
            "optimizer_states", options.get("optimizer_states", 2), 0,
            "a non-negative int (optimizer tensors per parameter element: AdamW 2, SGD with momentum 1)",
        ),
        pp_axis=pp_axis,
        param_dtype=_check_dtype("param_dtype", options.get("param_dtype")),
        reduce_dtype=_check_dtype("reduce_dtype", options.get("reduce_dtype")),
        offload_ratio=offload_ratio,
    )


def check_model_and_mesh(model: Any, mesh: Any) -> None:
    """Raises TypeError unless ``model`` is an ``nn.Module`` and ``mesh`` a Mesh / AbstractMesh."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan()/shard() take the model as a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(getattr(mesh, "shape", None), dict) or not hasattr(mesh, "coords"):
        raise TypeError(
            f"plan()/shard() take a shardlib Mesh or AbstractMesh, got {type(mesh).__name__}"
            + (f" {mesh!r}. Fix: init_mesh({mesh!r})" if isinstance(mesh, dict) else "")
        )


def check_fused_patterns(model: torch.nn.Module, fused: Any) -> None:
    """Every ``fused`` glob must match a module: a typo would split a fused projection (GPT-2's
    q/k/v in ``c_attn``) as one block, mixing the heads across ranks without an error."""
    paths = [path for path, _ in model.named_modules() if path]
    for pattern in fused or {}:
        if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
            sample = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
            raise ShardingError(
                f"fused pattern {pattern!r} matches no module of {type(model).__name__} (modules: {sample}). Fix: correct "
                "the glob over module paths (e.g. '*.attn.c_attn'), or remove it"
            )
