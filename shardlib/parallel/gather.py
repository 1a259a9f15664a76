"""ZeRO-3 parameter gathering: chunks freed after forward and gathered again in backward.

FSDP's scheme (Zhao et al., "PyTorch FSDP", arXiv 2304.11277) over shardlib's flat chunks: a
module's forward pre-hook gathers the chunks holding its parameters and, the first time a
chunk is reached, prefetches the next one (at most one chunk ahead, in both directions); its
forward hook frees a chunk once the last module using it in this forward is done
(:meth:`~shardlib.parallel.chunk.Chunk.free_storage`: ``untyped_storage().resize_(0)``, and its
parameters refuse any use but metadata until it is gathered again), except chunks with
``reshard_after_forward`` False (a tied embedding), which stay gathered until the end of
backward. In backward a chunk is gathered on
the first saved tensor that needs it (``saved_tensors_hooks``: tensors that are views of a
chunk are saved as (chunk, strides) and rebuilt from the re-gathered storage) or its first
gradient, together with every chunk above it not yet gathered: gathers go in descending chunk
order, the same on every rank whatever the data does, so they pair up across ranks. A forward
run inside backward (activation checkpointing's recompute, reentrant or not) gathers its chunks
that same backward way and frees none: they are freed once their gradients are complete.

On a pipeline rank holding several model chunks (interleaved 1F1B, the V schedules) the
schedule names the model chunk each action runs (:meth:`ParameterGathering.use_model_chunk`):
the ascending and descending orders then run over that model chunk's ZeRO chunks only (consecutive,
holding nothing of another model chunk: :func:`~shardlib.plan_items.plan_entries`), and a chunk
of another model chunk it uses (a tied embedding the LM head reads) is gathered alone.

A parameter read outside its own module's forward (a parent reading a child's parameter, as a
tied head ``h @ self.emb.weight.t()`` does, or a ``ParameterList`` entry) is gathered on access
(:meth:`ParameterGathering._on_access`): inside the sharded module's forward the forward way
(every chunk up to its own, ascending; with gradients on, kept until its gradients are done,
as a tied chunk), inside backward the backward way; a chunk in flight is waited for first. Every rank runs the same code, so these
gathers pair up like the hooks' own. Outside forward and backward the read still raises.

:class:`ParameterGathering` is a mixin of :class:`~shardlib.parallel.zero.ZeroRuntime`; it
uses its ``chunks``, ``param_chunk``, ``model``, ``mesh``, ``axes``, ``stage``, ``plan``,
``_hooks``, ``_queue_callback`` and ``_cast_into_slot``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..mesh.collectives import raw_all_gather
from ..mesh.eager import eager
from .chunk import Chunk, set_on_access
from .saved import Saved, keep, take

__all__ = ["ParameterGathering"]


class ParameterGathering:
    """Stage-3 gathering and freeing of chunks around forward and backward (see the module)."""

    def _setup_stage3(self) -> None:
        for chunk in self.chunks:
            chunk.free_storage()
            chunk.gathered = False
        self._windows: dict[int, tuple[int, int]] = {}  # model chunk -> (first, last) of its ZeRO chunks
        for chunk in self.chunks:
            lo, hi = self._windows.get(chunk.plan.model_chunk, (chunk.index, chunk.index))
            self._windows[chunk.plan.model_chunk] = (min(lo, chunk.index), max(hi, chunk.index))
        self._lo, self._hi = 0, len(self.chunks) - 1  # the chunks the orders run over: all, or a model chunk's
        self._bwd_next = self._hi
        self._fwd_next = 0
        self._module_chunks: dict[nn.Module, list[Chunk]] = {}
        self._static_uses = [0] * len(self.chunks)
        for module in self.model.modules():
            chunks = sorted({self.param_chunk[id(p)].index for p in module._parameters.values() if p is not None and id(p) in self.param_chunk})
            if chunks:
                self._module_chunks[module] = [self.chunks[i] for i in chunks]
                for i in chunks:
                    self._static_uses[i] += 1
                self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(module.register_forward_hook(self._post_forward))
        self._uses = list(self._static_uses)
        self._storage_ptr: dict[int, Chunk] = {}
        self._in_forward = False  # between the root's pre- and post-forward: a read gathers on access
        self._accessed: set[int] = set()  # chunks gathered on access in this forward: kept for backward
        for chunk in self.chunks:
            for prm, _ in chunk.params:
                set_on_access(prm, self._on_access)

    def use_model_chunk(self, model_chunk: int | None) -> None:
        """Run the next forward or backward for pipeline model chunk ``model_chunk`` of the stage
        (its index in :class:`~shardlib.parallel.pipeline.Stage`; None: the whole module, as
        outside a pipeline): the gathers' orders run over its ZeRO chunks only (see the module).
        Called between actions, when no backward is under way; nothing below stage 3."""
        if self.stage != 3:
            return
        if model_chunk is None:
            self._lo, self._hi = 0, len(self.chunks) - 1
        else:  # (a model chunk without parameters: an empty range)
            self._lo, self._hi = self._windows.get(model_chunk, (0, -1))
        self._fwd_next, self._bwd_next = self._lo, self._hi

    def module_chunks(self, module: nn.Module) -> list[Chunk]:
        """The chunks holding ``module``'s own parameters (not its submodules'), ascending."""
        return self._module_chunks.get(module, []) if self.stage == 3 else []

    def _gather(self, chunk: Chunk) -> None:
        if chunk.gathered:
            return
        chunk.restore_storage(swap=False)  # its parameters stay sharded away until the wait (_wait)
        if chunk.offloaded:
            self._gather_offloaded(chunk)
        else:
            src = self._cast_into_slot(chunk) if chunk.full.dtype != chunk.shard.dtype else chunk.shard
            chunk.gather_handle = raw_all_gather(chunk.full, src, self.mesh, self.axes, async_op=True,
                                                 note=f"chunk {chunk.index}")
        chunk.gathered = True
        self._storage_ptr[_storage_key(chunk.full)] = chunk

    def _gather_offloaded(self, chunk: Chunk) -> None:
        """Gather a chunk whose shard is in host memory (``offload_param_frac``): the shard is
        copied into the full buffer's own slot (cast to the compute dtype), then all-gathered in
        place. On CUDA the copy (from pinned memory) and the all-gather are issued on a side
        stream that first waits for the compute stream's work so far (the buffer's memory may
        be a freed chunk's), so the copy overlaps the compute issued after it; :meth:`_wait` orders
        the compute stream after the all-gather and after an event recorded on the side stream
        (on one data rank the all-gather moves nothing, and the event is all there is to wait
        for). On CPU: a plain copy."""
        slot = chunk.full[chunk.slot]
        stream = None
        if chunk.full.is_cuda:
            stream = getattr(self, "_h2d_stream", None)
            if stream is None:
                stream = self._h2d_stream = torch.cuda.Stream(device=chunk.full.device)
            stream.wait_stream(torch.cuda.current_stream(chunk.full.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            slot.copy_(chunk.shard, non_blocking=chunk.pinned)
            chunk.gather_handle = raw_all_gather(chunk.full, slot, self.mesh, self.axes, async_op=True,
                                                 note=f"chunk {chunk.index}")
            if stream is not None:  # one data rank gathers nothing to wait for: the wait is on the copy itself
                chunk.copy_event = torch.cuda.Event()
                chunk.copy_event.record(stream)

    def _wait(self, chunk: Chunk) -> None:
        if chunk.gather_handle is not None:
            chunk.gather_handle.wait()
            chunk.gather_handle = None
        event = getattr(chunk, "copy_event", None)
        if event is not None:  # (CUDA: the compute stream waits for the side stream's copy-in)
            torch.cuda.current_stream(chunk.full.device).wait_event(event)
            chunk.copy_event = None
        chunk.restore_class()

    def _on_access(self, prm: nn.Parameter) -> bool:
        """A torch function touched ``prm`` while its chunk was freed or in flight (see the
        module): make it readable and return True, or return False (outside the sharded module's
        forward and backward: the read raises ShardedAwayError). A chunk gathered in forward this
        way stays gathered until its gradients are complete (as a tied chunk does)."""
        chunk = self.param_chunk.get(id(prm)) if self.stage == 3 else None
        if chunk is None:
            return False
        if chunk.gathered:  # in flight (a prefetch): only this rank's wait is missing
            self._wait(chunk)
            return True
        if torch._C._current_graph_task_id() != -1:  # a forward run inside backward (a recompute)
            self._backward_touch(chunk)
            return True
        if not self._in_forward:
            return False
        top = min(chunk.index, self._hi)  # (another model chunk's: gathered alone, below)
        for i in range(self._fwd_next, top + 1):  # the forward's ascending order, as _pre_forward
            self._gather(self.chunks[i])
        self._fwd_next = max(self._fwd_next, top + 1)
        self._gather(chunk)  # (freed after an earlier use in this forward)
        self._wait(chunk)
        self._accessed.add(chunk.index)
        return True

    def _free(self, chunk: Chunk) -> None:
        if not chunk.gathered or self.stage != 3:
            return
        self._wait(chunk)
        self._storage_ptr.pop(_storage_key(chunk.full), None)
        chunk.free_storage()
        chunk.gathered = False

    # The root hooks test, in code torch.compile traces (plan constants), whether they have
    # anything to do, so stages 0-2 without buffer broadcasts compile the whole forward in one
    # graph; the work itself runs eagerly (a graph break: :mod:`shardlib.mesh.eager`).
    def root_pre_forward(self) -> None:
        if self.plan.broadcast_buffers or self.stage == 3 or self._callback_queued:
            self._root_pre_forward()

    @eager
    def _root_pre_forward(self) -> None:
        if self._callback_queued:  # (a backward raised part-way; nothing when this forward runs inside one)
            self.recover_abandoned_backward()
        if self.plan.broadcast_buffers:
            self.broadcast_buffers()
        if self.stage == 3:
            # a chunk kept gathered for a backward that never came (a forward with gradients on
            # and no backward, then maybe an optimizer step or a load into the shards) may be
            # stale: free it, this forward gathers it again. Rank-consistent: every rank ran the
            # same forwards and backwards.
            for chunk in self.chunks:
                self._free(chunk)
            self._uses = list(self._static_uses)
            self._fwd_next = self._lo
            self._bwd_next = self._hi
            self._in_forward = True
            self._accessed = set()

    def root_post_forward(self) -> None:
        if self.stage == 3:
            self._root_post_forward()

    @eager
    def _root_post_forward(self) -> None:
        self._in_forward = False
        keep = torch.is_grad_enabled()  # a backward follows: resident chunks stay gathered for it, and
        # so do chunks gathered on access (a tied head's weight read by the parent: its backward
        # reads it first, and gathering it there would gather every chunk above it at once)
        for chunk in self.chunks:
            if not (keep and (not chunk.plan.reshard_after_forward or chunk.index in self._accessed)):
                self._free(chunk)
        self._bwd_next = self._hi

    @eager
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        chunks = self._module_chunks[module]
        if torch._C._current_graph_task_id() != -1:
            # a forward run inside backward: activation checkpointing's recompute. Its chunks are
            # gathered the backward way (descending, the same on every rank) and freed when their
            # gradients are complete or at the end of backward, not by the forward's use counts
            for c in sorted(chunks, key=lambda c: -c.index):
                self._backward_touch(c)
            return
        top = min(max(c.index for c in chunks), self._hi)  # (another model chunk's: gathered alone, below)
        for i in range(self._fwd_next, top + 1):
            self._gather(self.chunks[i])
        self._fwd_next = max(self._fwd_next, top + 1)
        for c in chunks:
            self._gather(c)  # a chunk freed earlier in this forward (a module called twice)
        if self._fwd_next == top + 1 <= self._hi:  # prefetch the chunk after this module's, once
            self._gather(self.chunks[self._fwd_next])
            self._fwd_next += 1
        for c in chunks:
            self._wait(c)

    @eager
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # a recompute (see _pre_forward)
            return
        for c in self._module_chunks[module]:
            self._uses[c.index] -= 1
            if self._uses[c.index] <= 0 and c.plan.reshard_after_forward:
                self._free(c)

    def _backward_touch(self, chunk: Chunk) -> None:
        """Gather ``chunk`` (and every chunk above it not yet gathered) in backward order."""
        self._queue_callback()
        mine = self._lo <= chunk.index <= self._hi  # else another model chunk's (a tied parameter): alone
        if not chunk.gathered:
            if mine:
                for i in range(self._bwd_next, chunk.index - 1, -1):
                    self._gather(self.chunks[i])
                self._bwd_next = min(self._bwd_next, chunk.index - 1)
            self._gather(chunk)
        if mine and self._bwd_next == chunk.index - 1 >= self._lo:  # prefetch the chunk below this one, once
            self._gather(self.chunks[self._bwd_next])
            self._bwd_next -= 1
        self._wait(chunk)

    @eager
    def pack(self, t: torch.Tensor):
        if self.stage != 3:
            return t
        chunk = self._storage_ptr.get(_storage_key(t))
        if chunk is None or t.untyped_storage().nbytes() == 0:
            # with its version: hooks skip autograd's in-place check (see .saved); a dry run's meta tensor as it is
            return t if t.device.type == "meta" else keep(t)
        return (_SavedChunkView, chunk, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    @eager
    def unpack(self, packed):
        if isinstance(packed, tuple) and packed and packed[0] is _SavedChunkView:
            _, chunk, shape, stride, offset, dtype = packed
            self._backward_touch(chunk)
            base = chunk.full if chunk.full.dtype == dtype else chunk.full.view(dtype)
            return base.as_strided(shape, stride, offset)
        return take(packed) if isinstance(packed, Saved) else packed


def _storage_key(t: torch.Tensor):
    """What identifies ``t``'s storage among the gathered chunks': its address, or on the meta
    device (a dry run), where every address is 0, the storage object itself (``_cdata``), so a
    dry run rebuilds saved parameter views from their chunks, and gathers for them, as a real run."""
    storage = t.untyped_storage()
    return ("meta", storage._cdata) if t.device.type == "meta" else storage.data_ptr()


class _SavedChunkView:
    """Marker for a saved tensor rebuilt from a re-gathered chunk in backward."""
