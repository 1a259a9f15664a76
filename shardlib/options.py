"""Checks of the scalar options of :func:`shardlib.plan` (names, types, ranges).

Each check raises :class:`~shardlib.ShardingError` naming the option, the value given and what
would be accepted; :func:`check_options` runs them all, on every rank, before the planner looks
at the model (the options are documented on :func:`shardlib.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ShardingError

__all__ = ["DATA_AXIS_NAMES", "OPTIONS", "Options", "check_options"]

DEFAULT_CHUNK_SIZE = 1 << 22  # elements per ZeRO chunk (16 MiB of fp32)
DATA_AXIS_NAMES = ("dp", "fsdp")  # the default data axes (the batch is split along them)
OPTIONS = frozenset({
    "zero_stage", "data_axes", "chunk_size", "optimizer_states", "broadcast_buffers", "logical_axis_rules",
    "sequence_parallel", "sp_entry", "sp_exit", "dropout_seed", "fused", "pp_axis", "strict_specs",
    "param_dtype", "reduce_dtype", "init_rules", "init_seed", "offload_ratio", "optimizer_offload",
})


@dataclass(frozen=True)
class Options:
    """The checked scalar options (the rest are read by the planner where they are used)."""

    data_axes: tuple[str, ...]
    chunk_size: int
    optimizer_states: int
    pp_axis: str | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    offload_ratio: float | None


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


def _check_data_axes(value: Any, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    if value is None:
        return tuple(a for a in mesh_shape if a in DATA_AXIS_NAMES)
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
        ShardingError: an unknown option name; ``data_axes`` naming an axis not in the mesh, or
            one twice; ``chunk_size`` < 1 or not an int; ``optimizer_states`` < 0 or not an int;
            ``pp_axis`` not in the mesh; ``param_dtype``/``reduce_dtype`` not a floating-point
            ``torch.dtype``; ``offload_ratio`` not a number in [0, 1].
    """
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ShardingError(f"unknown plan option(s) {unknown}; valid options are {sorted(OPTIONS)}")
    pp_axis = options.get("pp_axis", "pp" if "pp" in mesh_shape else None)
    if pp_axis is not None and pp_axis not in mesh_shape:
        raise ShardingError(f"pp_axis {pp_axis!r} is not an axis of the mesh {mesh_shape}")
    offload_ratio = options.get("offload_ratio")
    if offload_ratio is not None:
        if isinstance(offload_ratio, bool) or not isinstance(offload_ratio, (int, float)) or not 0.0 <= offload_ratio <= 1.0:
            raise ShardingError(f"offload_ratio must be a number in [0, 1] (fraction of saved activations moved to host), got {offload_ratio!r}")
        offload_ratio = float(offload_ratio)
    return Options(
        data_axes=_check_data_axes(options.get("data_axes"), mesh_shape),
        chunk_size=_check_int("chunk_size", options.get("chunk_size", DEFAULT_CHUNK_SIZE), 1, "a positive number of elements"),
        optimizer_states=_check_int(
            "optimizer_states", options.get("optimizer_states", 2), 0,
            "a non-negative int (optimizer tensors per parameter element: AdamW 2, SGD with momentum 1)",
        ),
        pp_axis=pp_axis,
        param_dtype=_check_dtype("param_dtype", options.get("param_dtype")),
        reduce_dtype=_check_dtype("reduce_dtype", options.get("reduce_dtype")),
        offload_ratio=offload_ratio,
    )
