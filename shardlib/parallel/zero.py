"""ZeRO data parallelism over chunked flat buffers (stages 0-3).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv 1910.02054), with ColossalAI Gemini's chunks: parameters are packed, in registration
order, into flat chunks padded to a multiple of the data-axis size ``N``; a chunk is the unit of
every collective, and rank ``i`` owns elements ``[i * S, (i + 1) * S)`` of each (``S = P / N``).

Per rank, from backward to the optimizer step (``P`` = padded elements of a chunk; ``zero_grad``
releases the gradients until the next backward):

=======  ==================  =====================  ==========================================
stage    parameters           gradients              communication per step
=======  ==================  =====================  ==========================================
0 (DDP)  full ``P``           full ``P``             all-reduce of gradients (avg)
1        full ``P``           full ``P``             reduce-scatter grads, all-gather params
2        full ``P``           shard ``S``            reduce-scatter grads, all-gather params
3        shard ``S``          shard ``S``            all-gather in forward and in backward,
                                                     reduce-scatter grads
=======  ==================  =====================  ==========================================

The optimizer updates one flat tensor per trainable chunk: the full chunk (stage 0) or the
rank's shard (stages 1-3), so optimizer state is sharded from stage 1.

Mechanics. Model parameters stay the user's ``nn.Parameter`` objects, with ``.data`` pointing into
their chunk's flat buffer. Gradients arrive through ``register_post_accumulate_grad_hook`` and are
copied (first gradient after ``zero_grad``, which releases the buffers or marks them stale) or
added into the chunk's gradient buffer (:mod:`shardlib.parallel.chunk`); under stage 0
``prm.grad`` then becomes a view of it, as with DDP's ``gradient_as_bucket_view`` (inside
``no_sync()`` its hook is then removed until sync resumes: autograd adds into the view itself);
a chunk is reduced once all its trainable
parameters have their gradient, in a fixed order (descending chunk index) so every rank issues the
same collectives in the same order, as DDP's buckets do. Stage 3 frees a chunk's storage
(``untyped_storage().resize_(0)``, FSDP's way) after the forward of the last module using it and
gathers it again in backward, prefetching the next chunk in each direction
(:mod:`shardlib.parallel.gather`); while it is freed, its parameters raise
:class:`~shardlib.errors.ShardedAwayError` on any use but metadata (:mod:`shardlib.parallel.chunk`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ShardingError
from ..mesh.collectives import raw_all_gather, raw_broadcast
from ..mesh.eager import eager
from .chunk import Chunk, mark_sharded_away
from .full_tensors import FullTensors
from .reduce import GradientReduction
from .gather import ParameterGathering
from .nested_backward import defer_to_outer_backward
from .tensor_grads import TensorGradSums
from .view_hooks import GradViews, ViewHooks

__all__ = ["ZeroRuntime"]

# Under stage 3, gradient reductions run on their own process group (channel 1): launched in a
# fixed order, they never interleave with the parameter gathers of backward, whose timing follows
# the data (a module that runs on one rank only), so the two streams cannot pair up differently on
# different ranks. Stages 0-2 gather nothing during backward: their reductions, in the same fixed
# order on every rank, share channel 0 (one communicator per data-axis group, not two).
_REDUCE = 1


class ZeroRuntime(ParameterGathering, FullTensors, GradientReduction):
    """Installs ZeRO on ``model`` as ``plan`` says; used by ShardedModule and ZeroOptimizer.

    Args:
        model: the module; its parameters become views into flat chunks.
        plan: the :class:`~shardlib.plan.Plan` (``zero_stage``, ``data_axes``, chunks).
        mesh: the :class:`~shardlib.Mesh` the data axes belong to.
        lazy: for a model built on ``meta``, a :class:`shardlib.lazy.LazyInit` that fills each
            chunk's locally stored elements (no broadcast; stage 3 never allocates a full chunk).
        model_name: the class name of the model given to :func:`shardlib.shard`, for the message
            of a parameter touched while its chunk is freed (stage 3).
    """

    def __init__(self, model: nn.Module, plan, mesh, lazy=None, model_name: str | None = None):
        self.model, self.plan, self.mesh = model, plan, mesh
        self.stage = plan.effective_stage
        self.axes = plan.data_axes
        self.n = plan.data_size
        # the shard a rank owns is its slot in the collectives' flat buffers: its group rank
        index = mesh.group_index(self.axes) if self.axes else 0
        by_name = dict(model.named_parameters())
        members: list[list] = [[] for _ in plan.chunks]
        self.param_chunk: dict[int, Chunk] = {}
        for pp in plan.params:
            c, off = plan.placement[pp.name]
            members[c].append((by_name[pp.name], off))
        self._sync = True  # reduce at the end of backward (False inside no_sync(); see the sync property)
        self.unsynced = False  # the last backward ran inside no_sync()
        # no gradient since the start or zero_grad(set_to_none=True): a step updates nothing (torch's
        # optimizers skip a parameter whose .grad is None)
        self.grads_absent = True
        self.reduce_channel = _REDUCE if self.stage == 3 else 0
        if self.n > 1:
            mesh.group(self.axes, self.reduce_channel)  # created now, collectively, on every rank
        # Same starting values on every rank (DDP broadcasts at construction too).
        if self.n > 1:
            for ms in members if lazy is None else ():  # lazy init is the same on every rank by construction
                flat = torch.cat([p.detach().reshape(-1) for p, _ in ms])
                raw_broadcast(flat, mesh, self.axes)
                for p, off in ms:
                    start = off - ms[0][1]
                    with torch.no_grad():
                        p.copy_(flat[start : start + p.numel()].view(p.shape))
            self.broadcast_buffers()
        offloaded = set(plan.offloaded_chunks)
        self.chunks = [Chunk(c, members[c.index], self.stage, index, lazy, offload=c.index in offloaded) for c in plan.chunks]
        self.offloaded = any(c.offloaded for c in self.chunks)
        self._frozen = [c for c in self.chunks if not c.trainable]  # what refuse_unfrozen looks at
        self.param_offset: dict[int, int] = {}  # element offset of each parameter in its chunk
        for chunk in self.chunks:
            for prm, off in chunk.params:
                self.param_chunk[id(prm)] = chunk
                self.param_offset[id(prm)] = off
        # gradients summed over a tensor axis (norm weights under sequence parallelism) are taken
        # from their per-parameter hooks and summed in buckets, in the reduction dtype (tensor_grads)
        self._tp_sums = TensorGradSums.take_over(self.chunks, mesh)
        # stage 0 (one dtype): each parameter's gradient is a view into its chunk's gradient buffer
        self._grad_views = GradViews()
        for chunk in self.chunks if self.stage == 0 else ():
            for prm, off in chunk.params if chunk.trainable and not chunk.mixed else ():
                if prm not in self._tp_sums:  # (their gradient goes to the bucket, the sum into the chunk)
                    self._grad_views.add(chunk, prm, off)
        self._trainable_order = [c for c in reversed(self.chunks) if c.trainable]
        self._next_reduce = 0
        self._launched: set[int] = set()  # chunks whose reduction this backward has started
        self._names = {id(p): n for n, p in by_name.items()}
        self._callback_queued = False
        self._hooks = []
        self._view_hooks = ViewHooks(self._on_grad_ready, self._grad_views)  # silenced inside no_sync()
        for chunk in self.chunks:
            if chunk.trainable:
                for prm, _ in chunk.params:
                    if id(prm) in self._grad_views:
                        self._view_hooks.register(prm)
                    else:
                        self._hooks.append(prm.register_post_accumulate_grad_hook(self._on_grad_ready))
        if self.stage == 3:
            self._mark_sharded_away(by_name, model_name or type(model).__name__)
            self._setup_stage3()

    @property
    def sync(self) -> bool:
        """Whether a backward reduces gradients at its end (False inside ``no_sync()``). Setting it
        True puts back the gradient-view hooks removed while accumulating."""
        return self._sync

    @sync.setter
    def sync(self, flag: bool) -> None:
        self._sync = flag
        if flag:
            self._view_hooks.adopted = []
            if self._view_hooks.silenced:
                self._view_hooks.resume()

    def _adopt_silenced(self) -> None:
        """Before a read of the gradient buffers inside no_sync(): replaced gradients of
        silenced parameters move into their views (see :meth:`ViewHooks.replaced`)."""
        for prm, view in self._view_hooks.replaced():
            self._adopt(self.param_chunk[id(prm)], prm, view)

    # -- set-up helpers ------------------------------------------------------------------------
    def _mark_sharded_away(self, by_name: dict[str, nn.Parameter], model_name: str) -> None:
        """Give every parameter the message it raises with while its chunk is freed."""
        over = ", ".join(f"{a}={self.mesh.size(a)}" for a in self.axes)
        for pp in self.plan.params:
            tied = f" (tied to {', '.join(repr(a) for a in pp.aliases)})" if pp.aliases else ""
            mark_sharded_away(by_name[pp.name], (
                f"parameter '{pp.name}'{tied} of {model_name} was sharded away by shardlib.shard (ZeRO-3 over {over}): "
                "outside the forward and backward of the module shard() returned, this rank stores only its shard "
                "of it, so the original module's tensor has no values to read or write. Use the sharded module: "
                "shardlib.full_state_dict(smodel) (on every rank) for full values, smodel.load_state_dict(...) or "
                "shardlib.checkpoint.load to set them"))

    def broadcast_buffers(self) -> None:
        """Copy every floating buffer from the data-axis root to the other data ranks."""
        if self.n > 1:
            for buf in self.model.buffers():
                tmp = buf.data.contiguous()
                raw_broadcast(tmp, self.mesh, self.axes)
                if tmp.data_ptr() != buf.data_ptr():
                    buf.data.copy_(tmp)

    # -- backward: gradients -------------------------------------------------------------------
    # The autograd engine calls these (a parameter's gradient hook, the end-of-backward callback);
    # under a compiled function that calls ``backward()`` Dynamo would compile their frames too.
    @eager
    def _on_grad_ready(self, prm: nn.Parameter) -> None:
        self.grads_absent = False
        if not self._callback_queued:
            self._queue_callback()
        key = id(prm)
        chunk = self.param_chunk[key]
        if chunk.index in self._launched:
            self._refuse_late_gradient(prm)
        view = self._grad_views.get(key)
        if view is not None:  # stage 0: the gradient lives in the chunk, seen as ``prm.grad``
            self._adopt(chunk, prm, view)
            if not self._sync:  # accumulating: its hook is removed at the end of this backward
                self._view_hooks.adopted.append(prm)
                self._view_hooks.point_ahead(chunk)  # the chunk's first: its others accumulate in place from now
        else:
            if self.stage == 3:
                self._backward_touch(chunk)
            self._begin_accumulation(chunk)
            grad = prm.grad.reshape(-1)
            if prm in self._tp_sums:  # a partial sum on each tensor rank: into its bucket, summed before the reduction
                self._tp_sums.add(prm, grad, launch=self.sync)
            elif chunk.grad_full is None and not chunk.reduce_in_place:
                chunk.defer(prm, self.param_offset[key], grad)  # packed when the chunk's gradients are complete
            else:
                chunk.accumulate(prm, self.param_offset[key], grad)
            prm.grad = None
        chunk.ready.add(key)
        if len(chunk.ready) == chunk.n_trainable:
            if self.stage == 3:
                self._free(chunk)
            self._launch_ready()

    def _refuse_late_gradient(self, prm: nn.Parameter) -> None:
        """A gradient for a chunk whose reduction this backward already started: the parameter's
        gradient arrives in parts, which happens when a module is used several times and a
        reentrant ``torch.utils.checkpoint`` surrounds some uses (each reentrant checkpoint runs
        a backward of its own, firing the parameter's hook once per part). The reduction would
        miss the later parts, so the backward stops here, on every rank alike (the same graph).
        A backward retried on a retained graph after one raised, with no ``zero_grad()`` between
        (which recovers), is stopped here too: its chunks count as started."""
        from ..errors import ShardingError

        raise ShardingError(
            f"parameter '{self._names.get(id(prm), '?')}' received another part of its gradient after its chunk's "
            "gradient reduction had started in this backward: a module used several times, with a reentrant "
            "torch.utils.checkpoint around some of its uses, gets its gradient in parts, and the reduced gradient "
            "would miss the later ones. Fix: non-reentrant checkpointing (use_reentrant=False, torch's default; "
            "Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or "
            "shard(..., activation_checkpointing=...). (A backward run again on a retained graph after one raised looks "
            "the same from here: call zero_grad() before retrying it.)")

    def _begin_accumulation(self, chunk: Chunk) -> None:
        """Stage 1, a sync backward after an earlier one without ``zero_grad``: keep the reduced
        shard aside (added back after this reduction) and restart the unreduced buffer."""
        if self.stage == 1 and chunk.reduced and chunk.carry is None and not chunk.separate_grads:
            chunk.carry = chunk.grad_shard.clone()
            chunk.mark_stale()

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _adopt_grads(self, chunk: Chunk) -> None:
        """Stage 0: ``prm.grad`` is the truth, as in plain PyTorch. A gradient set to None after
        its last backward (``module.zero_grad()`` of the wrapped module) zeroes its region; one
        assigned by hand is copied in and the parameter sees the chunk again."""
        for prm, _ in chunk.params if self._grad_views else ():
            view = self._grad_views.get(id(prm))
            if view is not None:  # (a mixed-precision chunk has no views)
                self._adopt(chunk, prm, view)

    @staticmethod
    def _adopt(chunk: Chunk, prm: nn.Parameter, view: torch.Tensor) -> None:
        """Make ``prm``'s region of the chunk hold ``prm.grad``: nothing when ``prm.grad`` is the
        view (autograd added into it in place), a copy of a new tensor (it was None, or was
        replaced; the parameter then sees the view), zeros for None."""
        grad = prm.grad
        if grad is not view:
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
                prm.grad = view
        if chunk.stale:
            chunk.written.add(id(prm))

    def abandoned_backward(self) -> bool:
        """True when a backward ran gradient hooks here and then raised (an out-of-memory error,
        an exception in a hook or a custom ``backward``): torch drops the end-of-backward
        callback such a backward queued, so :meth:`_end_backward` never ran for it. Checked
        outside any backward (a forward inside one, a reentrant checkpoint's, is not a sign)."""
        return self._callback_queued and torch._C._current_graph_task_id() == -1

    @eager
    def recover_abandoned_backward(self) -> None:
        """Forget what a raised backward left (:meth:`abandoned_backward`), so the next one
        queues its callback and reduces. Its launched reductions are waited for (the same on
        every rank when all raised alike; one rank raising alone leaves the others in a
        collective the mesh timeout ends); its gradients stay, as plain PyTorch's ``.grad``.
        Called by :meth:`zero_grad` and before the next forward."""
        if not self.abandoned_backward():
            return
        self._callback_queued = False
        self._view_hooks.adopted = []  # (their hooks stay: nothing is silenced)
        for chunk in self.chunks:
            self._finish_reduce(chunk)
        self._next_reduce = 0
        self._forget_backward()

    def _forget_backward(self) -> None:
        """The per-backward state back to its start (a backward's end, or a raised one's)."""
        self._tp_sums.end_backward()
        self._launched = set()
        for chunk in self.chunks:
            chunk.ready.clear()
            if chunk.pending:  # no reduction this backward (no_sync): pack them for the next to add to
                chunk.ensure_grad_full()
        if self.stage == 3:
            for chunk in self.chunks:
                self._free(chunk)
            self._bwd_next = self._hi

    @eager
    def _end_backward(self) -> None:
        self._callback_queued = False
        if defer_to_outer_backward(self._queue_callback):
            return
        self.unsynced = not self._sync
        if self._view_hooks.adopted:
            if self._sync:  # (a sync backward silences nothing)
                self._view_hooks.adopted = []
            else:
                self._view_hooks.silence()
        if self._sync:
            self._launch_ready(force=True)
            for chunk in self.chunks:
                self._finish_reduce(chunk)
            self._next_reduce = 0
        self._forget_backward()

    @contextlib.contextmanager
    def one_backward(self):
        """Several backward calls in the block count as one backward: a split backward's weight
        pass (:mod:`~shardlib.parallel.split_backward`: one call per parameter group). No
        end-of-backward callback is queued inside; the end-of-backward work (stage 3: freeing
        the chunks, which stay gathered across the calls; packing deferred gradients; the
        reductions when syncing) runs once, at the exit. A call that raises leaves the backward
        abandoned, recovered as any other (:meth:`recover_abandoned_backward`)."""
        if self._callback_queued:
            self.recover_abandoned_backward()
        self._callback_queued = True  # what a backward's first hook would queue, held until the exit
        yield
        self._end_backward()

    def sync_grads(self) -> None:
        """Reduce the gradients accumulated under ``no_sync()`` now (the pipeline calls this
        once per step, after its last backward)."""
        self.sync = True
        self._launch_ready(force=True)
        for chunk in self.chunks:
            self._finish_reduce(chunk)
        self._next_reduce = 0
        self._launched = set()
        self.unsynced = False

    def local_grad_view(self, prm: nn.Parameter) -> torch.Tensor:
        """The unreduced, accumulated local gradient of ``prm`` (flat view into its chunk)."""
        chunk = self.param_chunk[id(prm)]
        off = self.param_offset[id(prm)]
        self._begin_accumulation(chunk)
        chunk.ensure_grad_full()
        view = self._grad_views.get(id(prm))
        if view is not None:  # stage 0: a gradient not adopted yet (its hook did not run) moves in now
            self._adopt(chunk, prm, view)
            if prm.grad is None:  # no gradient here: the view holds zeros, and from now on the sum written into it
                prm.grad = view
        self._tp_sums.flush(chunk)
        chunk.settle_full()
        return chunk.grad_full[off : off + prm.numel()]

    def owned_grad_region(self, prm: nn.Parameter) -> torch.Tensor:
        """The part of this rank's gradient shard that belongs to ``prm`` (may be empty)."""
        chunk = self.param_chunk[id(prm)]
        off = self.param_offset[id(prm)]
        if self._view_hooks.silenced:
            self._adopt_silenced()
        chunk.settle_shard()
        lo = chunk.slot.start if self.stage >= 1 else 0
        hi = lo + chunk.grad_shard.numel()
        a, b = max(lo, off), min(hi, off + prm.numel())
        return chunk.grad_shard[a - lo : max(a, b) - lo]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Make every gradient zero. ``set_to_none`` (torch's default): the chunks' gradient
        buffers are released (:meth:`Chunk.release_grads`) and allocated again when the next
        gradient or reduction lands, as plain PyTorch frees ``.grad``; False: they are kept and
        marked stale (zeroed lazily, see :mod:`shardlib.parallel.chunk`). Stage 0 sets the
        parameters' ``.grad`` to None either way, until the next backward points them into the
        chunk (as torch's ``zero_grad`` with ``set_to_none``)."""
        if self._callback_queued:
            self.recover_abandoned_backward()
        self._view_hooks.adopted = []
        if self._view_hooks.silenced:
            self._view_hooks.resume()  # each gradient is adopted again
        for chunk in self.chunks:
            if not chunk.trainable:
                continue
            for prm, _ in chunk.params if self._grad_views and not chunk.mixed else ():
                prm.grad = None
            if set_to_none:
                chunk.release_grads()
            else:
                chunk.mark_stale()
                chunk.shard_stale = True
            chunk.carry, chunk.reduced = None, False
        self._tp_sums.zero_grad()
        self.unsynced = False  # gradients accumulated under no_sync() are gone: step() may run
        self.grads_absent = set_to_none

    def settle_grads(self) -> None:
        """Write the zeros that :meth:`zero_grad` deferred into every gradient the optimizer
        reads (called before an optimizer step, a norm or an unscale reads them)."""
        if self._view_hooks.silenced:
            self._adopt_silenced()
        for chunk in self.chunks:
            if chunk.trainable:
                if not self.unsynced:
                    self._adopt_grads(chunk)
                chunk.settle_shard()
        if self.offloaded and self.chunks[0].device.type == "cuda":
            # the host reads the gradient shards the device copied into pinned memory without
            # blocking (_finish_reduce): the update of an offloaded shard runs on the CPU, as
            # ZeRO-Offload's step, so it waits for them here, once per step
            torch.cuda.current_stream(self.chunks[0].device).synchronize()

    def refuse_unfrozen(self) -> None:
        """Raise if a parameter frozen at ``shard()`` time has been made trainable since: its chunk
        has no gradient buffer, hook or optimizer shard, so it would never train.

        Raises:
            ShardingError: naming the parameter (on every rank that unfroze it: the ranks run
                the same code)."""
        for chunk in self._frozen:  # (every forward: most models have none)
            if any(prm.requires_grad for prm, _ in chunk.params):
                woken = {id(prm) for prm, _ in chunk.params if prm.requires_grad}
                name = next(n for n, prm in self.model.named_parameters(remove_duplicate=False) if id(prm) in woken)
                raise ShardingError(
                    f"parameter {name} was frozen (requires_grad=False) when shard() planned it and is trainable now: "
                    "its chunk has no gradient buffer and no optimizer shard, so it would never train. Fix: set "
                    "requires_grad before shard() (freezing after it works: a frozen parameter's gradient is "
                    "skipped), and build the ZeroOptimizer after shard()")

    # -- optimizer support ---------------------------------------------------------------------
    def optimizer_params(self) -> list[nn.Parameter]:
        """The flat tensors the optimizer updates: full chunks (stage 0) or this rank's shards."""
        return [c.opt_param for c in self.chunks if c.trainable]

    def owned_grads(self, tp_sharded: bool | None = None) -> list[torch.Tensor]:
        """Gradients whose elements this rank alone counts toward a global norm (over the data
        axes); ``tp_sharded`` selects the chunks split over a tensor axis (True) or not (False)."""
        self.settle_grads()
        return [c.grad_shard for c in self.chunks if c.trainable and (tp_sharded is None or c.plan.tp_sharded == tp_sharded)]

    def grads_replicated(self) -> bool:
        """True when every data rank holds the same full gradients (stage 0)."""
        return self.stage == 0

    def after_step(self) -> None:
        """Bring updated shards back into the full parameters (stages 1 and 2) and refresh the
        compute copies of mixed precision from the masters (cast, then gathered in their dtype)."""
        self.refresh([c for c in self.chunks if c.trainable])

    def refresh(self, chunks: list[Chunk]) -> None:
        """Rebuild the parameters the model uses (``chunk.full``) from the masters (``chunk.shard``)."""
        if self.stage == 0:
            for c in chunks:
                if c.full.data_ptr() != c.shard.data_ptr():
                    c.full.copy_(c.shard)
        elif self.stage in (1, 2):
            handles = [raw_all_gather(c.full, self._cast_into_slot(c), self.mesh, self.axes, async_op=True,
                                      note=f"chunk {c.index}") for c in chunks]
            for h in handles:
                h.wait()

    @staticmethod
    def _cast_into_slot(chunk: Chunk) -> torch.Tensor:
        """This rank's slot of ``chunk.full`` holding its master shard (cast to the compute dtype)."""
        slot = chunk.full[chunk.slot]
        if slot.data_ptr() != chunk.shard.data_ptr():
            slot.copy_(chunk.shard)
        return slot

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._view_hooks.remove()
