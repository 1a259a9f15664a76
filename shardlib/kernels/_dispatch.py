"""When the Triton kernels run: the on/off switch, the optional ``triton`` import, and the
interpreter override used by the CPU tests.

Kernels run when all of these hold:

- they are enabled: the environment variable ``SHARDLIB_KERNELS`` is not ``0``/``false``/``off``
  (read at import) and no :func:`set_enabled(False) <set_enabled>` or ``use_kernels(False)``
  is in force;
- ``triton`` imports (it is optional: without it every op runs its torch reference);
- the tensors are on CUDA, or ``SHARDLIB_KERNELS_FORCE_TRITON=1`` is set (read at call time).
  The latter is for the tests: with ``TRITON_INTERPRET=1`` set before ``triton`` is imported,
  the Triton programs run on CPU tensors in Triton's interpreter (slow; right for fp32 and
  fp16, wrong for bf16).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

import torch

_TRITON: bool | None = None  # imported on first need: ``import shardlib`` does not pay for triton


def triton_available() -> bool:
    """Whether ``triton`` imports (tried once, on the first call)."""
    global _TRITON
    if _TRITON is None:
        try:  # optional dependency: the references cover every op without it
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON = True
        except Exception:  # ImportError, or a broken install (no compiler, unsupported platform)
            _TRITON = False
    return _TRITON


__all__ = ["triton_available", "enabled", "set_enabled", "use_kernels", "use_triton"]

_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


def _from_environment() -> bool:
    value = os.environ.get("SHARDLIB_KERNELS", "1").strip().lower()
    if value not in _OFF + _ON:
        warnings.warn(f"SHARDLIB_KERNELS={value!r} is not understood (kernels stay on): use one of {_ON[1:]} "
                      f"(kernels on) or {_OFF} (kernels off)", stacklevel=2)
    return value not in _OFF


_enabled = _from_environment()


def enabled() -> bool:
    """Whether shardlib may use its kernels (``SHARDLIB_KERNELS`` and :func:`set_enabled`)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the kernels on or off for this process; returns the previous setting.

    Off, every op runs its torch reference and the models, the ZeRO optimizer and
    ``vocab_parallel_cross_entropy`` take their plain PyTorch paths (the environment variable
    ``SHARDLIB_KERNELS=0`` does the same from the start).
    """
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


@contextlib.contextmanager
def use_kernels(flag: bool = True) -> Iterator[None]:
    """Context manager: :func:`set_enabled` ``flag`` inside the block, restore after.

    Example:
        >>> with use_kernels(False):
        ...     enabled()
        False
    """
    previous = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


def _forced() -> bool:
    return os.environ.get("SHARDLIB_KERNELS_FORCE_TRITON", "0") == "1"


def programs():
    """The module of Triton programs (:mod:`shardlib.kernels._programs`; it imports triton):
    for an op whose :func:`use_triton` said True."""
    from . import _programs

    return _programs


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= ``n`` (0 for 0), as ``triton.next_power_of_2`` (which needs triton)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when an op on ``tensors`` should run its Triton program (see the module docstring):
    kernels enabled, triton importable, and every tensor on CUDA (or the interpreter forced)."""
    if not _enabled or not (_forced() or all(t.is_cuda for t in tensors)):
        return False
    return triton_available()
