"""torch's own bound on NCCL collectives, made explicit before the NCCL group is made
(:func:`nccl_environment`, called by :func:`~shardlib.mesh.mesh.init_mesh`)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["ASYNC_ERROR_HANDLING", "nccl_environment"]

# torch 2.13, ProcessGroupNCCL.hpp: what the NCCL watchdog does with a collective that failed or
# outlived the group's timeout. 0: nothing (the job hangs); 1: abort the communicators and end the
# process; 2: abort the communicators only; 3 (torch's default since 2.2, the one its comment asks
# users to keep): end the process without aborting (ncclCommAbort can hang itself).
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ASYNC_ERROR_HANDLING_NAMES = (ASYNC_ERROR_HANDLING, "NCCL_ASYNC_ERROR_HANDLING")  # torch reads both, first wins
_ASYNC_ERROR_HANDLING_DEFAULT = "3"


def nccl_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Make torch's own bound on NCCL collectives explicit, before the NCCL group is made.

    On NCCL, shardlib's waits do not block the host, so a collective that never completes is
    ended by torch: the process group's timeout (``init_mesh``'s ``timeout``) and the NCCL
    watchdog's error handling, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (read when the group is
    created). Where neither it nor its old name ``NCCL_ASYNC_ERROR_HANDLING`` is set, this sets
    it to ``3`` (end the process on a timeout or NCCL error; torch 2.13's default, which its
    source marks as the value to keep), so the bound does not rest on an unset variable. A
    value set by the user (torchrun sets 1, also a bounded exit) is kept.

    Args:
        environ: the environment to read and update (default ``os.environ``).

    Returns:
        ``{name: value}`` of what was set (empty when the user had set it).

    Warns:
        UserWarning: the variable is ``0``: a collective that outlives the timeout then leaves
            the job hanging instead of ending it.

    Example:
        >>> nccl_environment({})
        {'TORCH_NCCL_ASYNC_ERROR_HANDLING': '3'}
    """
    import warnings

    env = os.environ if environ is None else environ
    given = next(((name, env[name]) for name in _ASYNC_ERROR_HANDLING_NAMES if name in env), None)
    if given is None:
        env[ASYNC_ERROR_HANDLING] = _ASYNC_ERROR_HANDLING_DEFAULT
        return {ASYNC_ERROR_HANDLING: _ASYNC_ERROR_HANDLING_DEFAULT}
    if given[1].strip() == "0":
        warnings.warn(
            f"{given[0]}=0 turns off torch's NCCL error handling: a collective that outlives the process group's "
            "timeout is only logged, and the job hangs instead of ending. Fix: unset it (shardlib then sets 3: end "
            "the process) or set 1 or 3", UserWarning, stacklevel=2)
    return {}
