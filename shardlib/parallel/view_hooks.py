"""Stage 0's gradient hooks on parameters whose ``.grad`` is a view into their chunk.

Such a parameter needs its post-accumulate-grad hook inside ``no_sync()`` only until its
gradient is adopted (``prm.grad`` is the view): autograd then adds into the view itself. A hook
costs the autograd engine a Python call per parameter and backward (about 4 µs, m per step in a
pipeline), so :class:`ViewHooks` removes it once ``.grad`` is the view, and registers it again
when sync resumes or ``zero_grad`` makes the gradients None (DDP's ``gradient_as_bucket_view``
accumulates in place the same way, from C++). The first hook of each chunk in a ``no_sync()`` backward
points every other parameter of the chunk that the backward reaches at its zeroed view
(:meth:`ViewHooks.point_ahead`), so a window's first backward runs one hook per chunk, not one per
parameter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ..mesh.eager import eager

__all__ = ["GradViews", "ViewHooks"]


class GradViews:
    """Stage 0's ``{id(prm): view}``: each such parameter's ``.grad`` as a view into its chunk's
    gradient buffer (:meth:`~.chunk.Chunk.grad_view`). The buffer is released at ``zero_grad``
    and allocated again by the first gradient after it, so a view is looked up, never kept:
    ``views[id(prm)]`` and ``views.get(id(prm))`` allocate the buffer if it is absent; which
    parameters have a view (``in``, ``len``) never changes."""

    def __init__(self):
        self._where: dict[int, tuple] = {}  # id(prm) -> (chunk, prm, element offset)

    def add(self, chunk, prm: nn.Parameter, off: int) -> None:
        self._where[id(prm)] = (chunk, prm, off)

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, key: int):
        chunk, prm, off = self._where[key]
        return chunk.grad_view(prm, off)

    def get(self, key: int):
        return self[key] if key in self._where else None


class ViewHooks:
    """The hooks of the gradient-view parameters of one :class:`~.zero.ZeroRuntime`.

    Args:
        on_ready: the hook, ``on_ready(prm)``.
        views: the :class:`GradViews`, each parameter's view into its chunk's gradients.

    Attributes:
        adopted: parameters adopted in the running no_sync() backward (hooks to remove at its end).
        silenced: parameters whose hook is removed until :meth:`resume`.
    """

    def __init__(self, on_ready: Callable, views: GradViews):
        self._on_ready, self._views = on_ready, views
        self._handles: dict[int, object] = {}  # id(prm) -> hook handle, while registered
        self._nodes: dict[int, object] = {}  # id(prm) -> its AccumulateGrad node (held, so it stays the same)
        self.adopted: list[nn.Parameter] = []
        self.silenced: list[nn.Parameter] = []

    def register(self, prm: nn.Parameter) -> None:
        self._handles[id(prm)] = prm.register_post_accumulate_grad_hook(self._on_ready)
        if id(prm) not in self._nodes:
            self._nodes[id(prm)] = get_gradient_edge(prm).node

    def point_ahead(self, chunk) -> None:
        """A gradient of ``chunk`` adopted inside ``no_sync()``: every other parameter of the
        chunk whose hook is registered, whose ``.grad`` is None and whose gradient this backward
        computes (its ``AccumulateGrad`` node runs in it: ``torch._C._will_engine_execute_node``,
        as torch's ``register_multi_grad_hook`` asks) gets its view as ``.grad`` now and its hook
        removed (silenced), so autograd adds this window's gradients into the view in place without
        a Python call per parameter and backward (DDP's ``gradient_as_bucket_view`` does the same
        from C++). The chunk is first zeroed where no gradient was written yet, in one pass
        (:meth:`~.chunk.Chunk.settle_full`). A parameter this backward does not reach keeps
        ``.grad`` None and its hook, as in plain PyTorch. Nothing to do (the chunk was pointed
        already) costs a loop over the chunk's parameters.

        Per chunk, not for every chunk at the backward's first gradient: each chunk's gradient
        buffer is then allocated when the backward reaches the chunk, after the activations
        behind it were freed, as plain PyTorch's ``.grad`` tensors are. All at once, a pipeline
        stage's buffers (three 7.1 MB chunks of the 10.8M GPT's stage) were new memory every
        step, and the CPU page-faulted them in: 8117-10580 minor faults a step on one pipeline
        rank, 6344-7411 with the buffers allocated chunk by chunk, 4863-5164 for torch's
        pipelining (each side run alone; ``benchmarks/README.md``, 2026-12-08).

        Measured on the 0.4M GPT's pipeline stage (18 parameters, 2 gloo ranks): the first
        backward of a step took 1.1 ms longer than torch's with a hook per parameter adopting its
        gradient (slice, view, copy, bookkeeping: about 35 µs each on the CPU)."""
        views, will_run, handles = self._views, torch._C._will_engine_execute_node, self._handles
        todo = [(id(prm), prm) for prm, _ in chunk.params
                if id(prm) in handles and prm.grad is None and prm.requires_grad and will_run(self._nodes[id(prm)])]
        if todo:
            chunk.fill_grad_views()
            chunk.settle_full()
        for key, prm in todo:
            prm.grad = views[key]
            self._handles.pop(key).remove()
            self.silenced.append(prm)

    def silence(self) -> None:
        """End of a no_sync() backward: remove the hooks of the parameters it adopted (whose
        ``.grad`` is still their view; one replaced by a later hook keeps adopting)."""
        for prm in self.adopted:
            handle = self._handles.get(id(prm))
            if handle is not None and prm.grad is self._views[id(prm)]:
                del self._handles[id(prm)]
                handle.remove()
                self.silenced.append(prm)
        self.adopted = []

    @eager
    def resume(self) -> None:
        """Register the removed hooks again. A parameter frozen since (``requires_grad`` False,
        which takes no hook) stays listed until a later call finds it trainable; until then a
        sync backward's reduction adopts its gradient."""
        keep = []
        for prm in self.silenced:
            if prm.requires_grad:
                self.register(prm)
            else:
                keep.append(prm)
        self.silenced = keep

    def replaced(self) -> list:
        """``[(prm, view)]``: silenced parameters whose ``.grad`` was replaced since (the wrapped
        module's own ``zero_grad`` and a backward, a gradient set by hand, ``create_graph=True``),
        to be adopted before the buffers are read."""
        return [(prm, self._views[id(prm)]) for prm in self.silenced
                if prm.grad is not None and prm.grad is not self._views[id(prm)]]

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles, self._nodes, self.adopted, self.silenced = {}, {}, [], []
