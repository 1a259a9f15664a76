"""What ``torch.compile`` must not trace: collectives and the ZeRO runtime run eagerly.

shardlib's collectives post ``torch.distributed`` calls through the trace, the optional
cross-rank check and the watchdog (:mod:`.guard`), and on gloo exchange views of a flat buffer
point to point; ZeRO-3 frees and re-gathers parameter storage in module hooks. None of this is a
pure tensor function. Traced by Dynamo it crashed (AOT autograd's functionalization of the views
passed to ``isend``/``irecv`` at the LM head's all-gather: "incorrect out shape after application
of ViewMeta sequence"), read a freed ZeRO-3 parameter (``ShardedAwayError``), or compiled the
gradient hooks of a step that calls ``backward()``. So each such entry point is wrapped by
:func:`eager`: Dynamo breaks the graph at the call and the call runs eagerly, exactly as without
compile (an autograd-aware collective is then an ordinary autograd node whose backward is the
eager collective), and the code between the breaks compiles as usual. This is
``torch.compiler.disable``, whose documented effect is that graph break; it is applied lazily,
because creating it imports ``torch._dynamo`` (1.1 s of CPU time, 1.8-13 s of wall time on the
shared 2-core machine), which a process that never compiles should not pay.

Cost outside compile: 170 ns a call against 30 ns for the bare function (200,000 calls, 2-core
CPU), one ``torch.compiler.is_compiling()`` test; after Dynamo has met shardlib in a process,
every call goes through the disabled version (440 ns), so no frame below a collective is
compiled even when a compiled region runs eager code (a step that calls ``backward()``).
Against a collective (tens of microseconds at least) or a module hook, both are noise.

Consequences, documented for users: a compiled sharded model has a graph break at every
collective in its forward (Megatron TP: the all-reduces and the all-gather of the output layer;
sequence parallelism: the all-gathers and reduce-scatters) and, under ZeRO-3, at the gathering
hooks of every module that holds parameters; ZeRO stages 0-2 compile the whole forward into one
graph (their collectives run in backward hooks). ``torch.compile(..., fullgraph=True)`` is
refused by Dynamo at the first collective with a message naming it. Full graphs would need the
collectives written as functional collectives (``torch.distributed._functional_collectives``)
or custom ops, without the trace and watchdog, as torchtitan's compiled FSDP2/TP do on NCCL.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

__all__ = ["eager"]

F = TypeVar("F", bound=Callable)

# (slot, fn, reason) of every wrapped function. The slots receive the torch.compiler.disable()d
# versions the first time Dynamo meets one of them (it is imported then); from that moment every
# call goes through them, compiled or not, so that no frame below a collective or a ZeRO hook is
# ever compiled (Dynamo compiles the frames that eager code calls while a compiled region runs).
_WRAPPED: list[tuple[list, Callable, str]] = []
_CALL_CODE: list = []  # the code object shared by every wrapper (``call`` below)


def _disable_all() -> None:
    """Fill every slot, and tell Dynamo never to compile a wrapper's own frame (it runs one when
    a graph break leaves the call to eager code; compiled, each call site would be another
    guarded entry of the same code object, up to Dynamo's recompile limit)."""
    for slot, fn, reason in _WRAPPED:
        if slot[0] is None:
            slot[0] = torch.compiler.disable(fn, recursive=True, reason=reason)
    # torch._dynamo.eval_frame.skip_code is not public API (what torch.compiler.disable(recursive=False)
    # and torch._dynamo.skip use inside): looked up, not required
    skip_code = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    if skip_code is not None:  # without it (another torch), the wrappers' frames compile to nothing
        for code in _CALL_CODE:
            skip_code(code)


def eager(fn: F) -> F:
    """``fn``, run eagerly under ``torch.compile`` (a graph break at each call), else unchanged.

    Under ``torch.compile(..., fullgraph=True)`` a call raises Dynamo's error for a graph break,
    whose message names ``fn`` ("shardlib runs shardlib.mesh.collectives.all_reduce eagerly ...").

    Args:
        fn: a function or method that issues collectives or changes runtime state (hooks).

    Returns:
        A wrapper with ``fn``'s name, docstring and signature (``__wrapped__`` is ``fn``).
    """
    slot: list = [None]
    reason = (f"shardlib runs {fn.__module__}.{fn.__qualname__} eagerly: it issues collectives or changes "
              "ZeRO state, which torch.compile does not trace (see shardlib.mesh.eager)")
    _WRAPPED.append((slot, fn, reason))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = slot[0]
        if disabled is not None:  # Dynamo has met shardlib in this process
            return disabled(*args, **kwargs)
        if torch.compiler.is_compiling():  # Dynamo is tracing this call, the first time in this process
            torch._dynamo.graph_break(msg=reason)  # what fullgraph=True reports
            _disable_all()  # itself a graph break (torch.compiler.disable is not traceable)
            return slot[0](*args, **kwargs)
        return fn(*args, **kwargs)

    if not _CALL_CODE:
        _CALL_CODE.append(call.__code__)
    return call  # type: ignore[return-value]
