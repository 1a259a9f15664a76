"""The runtime state of one ZeRO chunk: its flat parameter buffers and gradient buffers.

A chunk (ColossalAI Gemini's unit) is a flat buffer of ``P`` elements (the padded total of its
parameters, a multiple of the data-axis size ``N``); rank ``i`` owns the shard
``[i * S, (i + 1) * S)``, ``S = P / N``. See :mod:`shardlib.parallel.zero` for what each ZeRO
stage keeps.

Gradient buffers are allocated at the first gradient after ``zero_grad`` (which releases them,
or with ``set_to_none=False`` only marks them *stale*) and zeroed lazily: a new buffer is stale
(logically zero) too. The first gradient of each parameter in a stale buffer is copied into its
region instead of added, and just before a buffer is reduced or read (:meth:`Chunk.settle_full`,
:meth:`Chunk.settle_shard`) only the regions no gradient reached (unused parameters, padding)
are zeroed. This saves a memset of every buffer per step and turns the first accumulation's
read-add-write into a copy, as torch's ``AccumulateGrad`` steals the first gradient of a
parameter whose ``.grad`` is None.

Freed storage (ZeRO-3). :meth:`Chunk.free_storage` releases the full buffer
(``untyped_storage().resize_(0)``, FSDP's way); the parameters that view it keep their shape but
not their memory, so reading one would read freed memory (a segfault). While the buffer is
freed, each of them therefore carries a subclass of its own class (``ShardedAwayParameter``,
swapped in through ``__class__``: the tensor, its hooks, ``id`` and autograd node stay the same)
whose ``__torch_function__`` lets metadata through (shape, dtype, device, ``requires_grad``,
``grad``: see ``_METADATA``) and raises :class:`~shardlib.errors.ShardedAwayError` for every
other torch function or method, naming the parameter. :meth:`Chunk.restore_storage` allocates
the buffer again before it is gathered into; the original class comes back only once the
gather is complete (:meth:`Chunk.restore_class`, at the wait), so a parameter read while its
chunk is in flight (prefetched, not waited for) cannot see a half-written buffer. Inside the
forward and backward of the sharded module, such a read does not raise: the parameter's
``on_access`` callback (:func:`set_on_access`) gathers or waits for its chunk and the function
runs (a parent module reading a child's parameter, as a tied head ``h @ self.emb.weight.t()``
does, or a ``ParameterList`` entry). The cost is one ``__class__`` assignment per
parameter per free and per gather (4 per step), none in the ops: a gathered parameter has its own
class, so the forward and backward pay no ``__torch_function__`` dispatch. Measured (2-core CPU,
dp=2, a 4-layer GPT of 68 parameters): 60-70 ns a swap, 272 a step, 17 us against a 73 ms step;
the median step of 40 alternated with and without swaps differed by less than the noise
(73.0 vs 74.1 ms on rank 0, 72.9 vs 72.8 ms on rank 1).
"""

from __future__ import annotations

import types

import optree
import torch
from torch import nn

from ..errors import ShardedAwayError

__all__ = ["Chunk", "mark_sharded_away", "set_on_access"]

_T = torch.Tensor
# Torch functions that read a tensor's metadata, never its elements: allowed on a parameter whose
# storage is freed (optimizers, ``zero_grad``, ``named_parameters`` and parameter counts use them).
_METADATA = frozenset(
    [getattr(_T, name).__get__ for name in (
        "shape", "dtype", "device", "layout", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim", "is_cuda",
        "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize", "nbytes", "_version",
        "output_nr", "retains_grad", "_post_accumulate_grad_hooks", "_backward_hooks")]
    + [_T.requires_grad.__set__, _T.grad.__set__, _T.grad.__delete__]
    + [getattr(_T, name) for name in (
        "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
        "is_contiguous", "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "__hash__", "__len__", "__dir__")]
)
_NOTE = "_shardlib_sharded_away"  # a parameter's message while its storage is freed (set at set-up)
_ACCESS = "_shardlib_on_access"  # a weak reference to its runtime's gather-on-access callback (set_on_access)
_AWAY: dict[type, type] = {}  # original parameter class -> its sharded-away subclass
_ORIGINAL: dict[type, type] = {}  # and back


def mark_sharded_away(prm: nn.Parameter, message: str) -> None:
    """Set the message :class:`~shardlib.errors.ShardedAwayError` gives when ``prm`` is touched
    while its chunk's storage is freed (before ``(tried Tensor.<function>)``)."""
    prm.__dict__[_NOTE] = message


def set_on_access(prm: nn.Parameter, callback) -> None:
    """Let ``callback(prm) -> bool`` make ``prm``'s values available when a torch function
    touches it while its chunk is freed or in flight (True: the chunk is gathered and
    ``prm`` has its own class again; False: refuse). Held through a weak reference to the
    bound method, so a parameter does not keep its runtime alive."""
    import weakref

    prm.__dict__[_ACCESS] = weakref.WeakMethod(callback)


def _refuse(cls, func, kinds, args=(), kwargs=None):
    """``__torch_function__`` of a sharded-away parameter: metadata passes; anything else runs
    once the parameter's ``on_access`` callback has gathered its chunk (inside the sharded
    module's forward or backward), or raises :class:`~shardlib.errors.ShardedAwayError`."""
    kwargs = kwargs or {}
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    away = next((t for t in optree.tree_leaves((args, kwargs)) if type(t) in _ORIGINAL), None)
    ref = getattr(away, "__dict__", {}).get(_ACCESS)
    callback = ref() if ref is not None else None
    if callback is not None and callback(away) and type(away) not in _ORIGINAL:
        return func(*args, **kwargs)  # (another argument still sharded away comes back here)
    message = getattr(away, "__dict__", {}).get(_NOTE, "a parameter was sharded away by shardlib.shard (ZeRO-3)")
    raise ShardedAwayError(f"{message} (tried {_function_name(func)})")


def _function_name(func) -> str:
    """``Tensor.sum``, ``Tensor.data``, ``torch.add``: what the user called, for the message."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, types.GetSetDescriptorType):  # a property's __get__ / __set__
        return f"Tensor.{owner.__name__}"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    head, _, tail = name.rpartition(".")
    if head in ("Tensor", "TensorBase", "_TensorBase"):
        return f"Tensor.{tail}"
    return f"torch.{tail}" if head in ("", "_VariableFunctionsClass") else name


def _away_class(cls: type) -> type | None:
    """The sharded-away subclass of parameter class ``cls`` (one per class, made on first use);
    None for a class that cannot be subclassed (its parameters stay plain views of the chunk)."""
    if cls not in _AWAY:
        doc = (f"A {cls.__name__} whose storage ZeRO-3 freed: metadata only; any other torch function raises "
               "ShardedAwayError (see shardlib.parallel.chunk).")
        try:  # no slots added, so ``__class__`` can be assigned between the two; the metaclass is cls's
            sub = type(cls)(f"ShardedAway{cls.__name__}", (cls,), {
                "__slots__": (), "__module__": __name__, "__doc__": doc, "__torch_function__": classmethod(_refuse)})
        except TypeError:
            sub = None
        _AWAY[cls] = sub
        if sub is not None:
            _ORIGINAL[sub] = cls
    return _AWAY[cls]


class Chunk:
    """Runtime state of one planned chunk (:class:`~shardlib.plan_items.ChunkPlan`).

    Args:
        plan: the chunk's plan (``padded_numel`` ``P``, ``shard_numel`` ``S``, dtypes).
        params: ``(parameter, element offset)`` of its unique parameters, in offset order.
        stage: the effective ZeRO stage (0-3).
        data_index: which shard this rank owns: its group rank over the data axes
            (:meth:`~shardlib.mesh.Mesh.group_index`, its slot in the collectives' flat buffers).
        lazy: for a model built on ``meta``, a :class:`shardlib.lazy.LazyInit` that fills the
            elements this rank stores (stage 3: only its shard; its full buffer is allocated in
            the compute dtype and freed, never filled or converted).
        offload: stage 3 only: keep the shard (and its gradient shard, and so the optimizer's
            state for it) in host memory, pinned when the device is CUDA (``offload_param_frac``);
            a gather copies it into the full buffer's own slot first.
    """

    def __init__(self, plan, params: list[tuple[nn.Parameter, int]], stage: int, data_index: int, lazy=None,
                 offload: bool = False):
        self.plan = plan
        self.index = plan.index
        self.params = params  # (param, offset), unique params in order
        self.trainable = plan.requires_grad
        p, s = plan.padded_numel, plan.shard_numel
        slot = slice(data_index * s, (data_index + 1) * s)
        device = params[0][0].device
        self.slot = slot
        # Mixed precision: ``shard`` keeps the master values (stage 0: the full chunk), ``full``
        # is the compute copy in ``compute_dtype`` that the parameters view.
        self.mixed = plan.mixed_compute or plan.separate_grads
        self.separate_grads = plan.separate_grads
        if stage == 3:
            # Only the shard is stored (built on meta: only it is filled). The full buffer, in
            # the dtype the forward uses, is gathered before its first use, so it is never
            # filled or converted here: converting full chunks made a bf16 meta init of LLaMA-7B
            # on fake ranks take 24 s of CPU against 4.7 s in fp32.
            if lazy is not None:
                self.shard = lazy.filled(plan, slot, device)
            else:
                self.shard = self._packed(params, p, device)[slot].clone()
            self.full = torch.empty(p, dtype=plan.compute_dtype or plan.dtype, device=device)
        else:
            self.full = lazy.filled(plan, slice(0, p), device) if lazy is not None else self._packed(params, p, device)
            self.shard = self.full if stage == 0 else self.full[slot]
            if plan.mixed_compute:
                if stage in (1, 2):
                    self.shard = self.shard.clone()
                self.full = self.full.to(plan.compute_dtype)
        for prm, off in params:
            prm.data = self.full[off : off + prm.numel()].view(prm.shape)
        self.device = device
        self.offloaded = bool(offload and stage == 3 and device.type != "meta")  # (a dry run stores nothing)
        self.pinned = self.offloaded and device.type == "cuda"
        if self.offloaded:  # the master shard in host memory: copied in before each gather
            host = torch.empty(self.shard.shape, dtype=self.shard.dtype, device="cpu", pin_memory=self.pinned)
            host.copy_(self.shard)
            self.shard = host
        if stage == 3:
            self.full.untyped_storage().resize_(0)  # never filled: gathered before its first use
        # Gradients: ``grad_full`` (P elements, unreduced, in the reduction dtype) and
        # ``grad_shard`` (what the optimizer reads: the full chunk under stage 0, else S). Stages
        # 0-1 in one dtype (``reduce_in_place``) reduce in place, so ``grad_shard`` views
        # ``grad_full`` and both live from the first gradient to ``zero_grad``; stages 2-3 (and a
        # separate reduction dtype) allocate ``grad_full`` per backward and keep ``grad_shard``
        # apart. None is allocated before the first gradient, and ``zero_grad`` (set_to_none,
        # torch's default) releases them all (:meth:`release_grads`), as plain PyTorch frees its
        # ``.grad`` and FSDP2 its sharded gradients.
        self.stage = stage
        self.reduce_in_place = stage in (0, 1) and not self.separate_grads
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grad_views: dict[int, torch.Tensor] = {}  # stage 0: id(prm) -> its ``.grad`` view of grad_full
        self._packed_end: int | None = None  # where the parameters end if back to back from 0, else -1 (fill_grad_views)
        self.pending: list[tuple[nn.Parameter, int, torch.Tensor]] = []  # gradients not yet packed (:meth:`defer`)
        self.opt_param: nn.Parameter | None = None
        self.stale = True  # grad_full is logically zero outside the regions in ``written``
        self.written: set[int] = set()  # ids of parameters whose region holds this window's gradient
        self.shard_stale = True  # grad_shard (separate storage, or None) is logically zero
        if self.trainable:
            self.opt_param = nn.Parameter(self.shard, requires_grad=True)
        self.gathered = True
        self.away = False  # its parameters carry the sharded-away class (free_storage .. restore_class)
        self.gather_handle = None
        self.copy_event = None  # CUDA, offloaded: the side stream's copy-in of the shard (parallel/gather.py)
        self.reduce_handle = None
        self.reduce_tmp: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.n_trainable = len(params) if self.trainable else 0
        self.carry: torch.Tensor | None = None  # stage 1: reduced grads kept across sync steps
        self.reduced = False

    @staticmethod
    def _packed(params: list[tuple[nn.Parameter, int]], numel: int, device) -> torch.Tensor:
        """The parameters' values in one flat buffer of ``numel`` elements (padding zero)."""
        full = torch.zeros(numel, dtype=params[0][0].dtype, device=device)
        for prm, off in params:
            full[off : off + prm.numel()].copy_(prm.detach().reshape(-1))
        return full

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def free_storage(self) -> None:
        """Release the full buffer's memory (ZeRO-3 between uses); until :meth:`restore_class`
        its parameters raise :class:`~shardlib.errors.ShardedAwayError` on any use but metadata
        (or gather it on access: :func:`set_on_access`)."""
        self.full.untyped_storage().resize_(0)
        for prm, _ in self.params:
            away = None if type(prm) in _ORIGINAL else _away_class(type(prm))
            if away is not None:
                prm.__class__ = away
        self.away = True

    def restore_storage(self, swap: bool = True) -> None:
        """Allocate the full buffer again (uninitialised, to be gathered into) and, with
        ``swap``, give its parameters back their own class (a gather leaves that to its wait:
        :meth:`restore_class`)."""
        self.full.untyped_storage().resize_(self.nbytes)
        if swap:
            self.restore_class()

    def restore_class(self) -> None:
        """Give the parameters back their own class (their buffer holds their values)."""
        if not self.away:
            return
        for prm, _ in self.params:
            original = _ORIGINAL.get(type(prm))
            if original is not None:
                prm.__class__ = original
        self.away = False

    def new_grad_full(self) -> torch.Tensor:
        """An unreduced-gradient buffer for the whole chunk in the reduction dtype, uninitialised
        and marked stale (its regions are copied into, or zeroed by :meth:`settle_full`)."""
        self.mark_stale()
        return torch.empty(self.plan.padded_numel, dtype=self.plan.reduce_dtype or self.plan.dtype, device=self.device)

    def ensure_grad_full(self) -> torch.Tensor:
        """``grad_full``, allocated (stale) if absent, with the deferred gradients packed into it
        (:meth:`defer`); for ``reduce_in_place`` the optimizer's ``grad_shard`` is its view
        (stage 0: all of it, stage 1: this rank's slot)."""
        if self.grad_full is None:
            self.grad_full = self.new_grad_full()
            if self.reduce_in_place:
                self.grad_shard = self.grad_full if self.stage == 0 else self.grad_full[self.slot]
                self.opt_param.grad = self.grad_shard
            pending, self.pending = self.pending[::-1], []
            while pending:  # in arrival order, each freed as soon as it is packed
                prm, off, grad = pending.pop()
                self.accumulate(prm, off, grad)
                del grad
        return self.grad_full

    def defer(self, prm: nn.Parameter, off: int, grad: torch.Tensor) -> None:
        """Keep autograd's flat gradient ``grad`` of ``prm`` as it is until ``grad_full`` is
        allocated (the chunk's reduction, or the end of a backward that reduces nothing), instead
        of allocating the whole chunk's buffer at its first gradient: a block's gradients then
        grow parameter by parameter while its activations are freed, as FSDP2's unsharded
        gradients do before its reduce-scatter copies them into one buffer."""
        self.pending.append((prm, off, grad))

    def grad_view(self, prm: nn.Parameter, off: int) -> torch.Tensor:
        """Stage 0: ``prm``'s gradient as a view of ``grad_full`` (the same tensor until
        :meth:`release_grads`), allocating the buffer if absent."""
        view = self.grad_views.get(id(prm))
        if view is None:
            view = self.ensure_grad_full()[off : off + prm.numel()].view(prm.shape)
            self.grad_views[id(prm)] = view
        return view

    def fill_grad_views(self) -> None:
        """Stage 0: every parameter's :meth:`grad_view` at once, allocating the buffer if absent;
        where the parameters lie back to back from offset 0 (no gap between them), in one call
        (``unflatten_dense_tensors``, as DDP's buckets are viewed) instead of a slice and a view
        per parameter."""
        full = self.ensure_grad_full()
        if len(self.grad_views) == len(self.params):
            return
        if self._packed_end is None:  # the layout never changes: found once
            pos = 0
            for prm, off in self.params:
                pos = off + prm.numel() if off == pos else -1
            self._packed_end = pos
        if self._packed_end < 0:
            for prm, off in self.params:
                self.grad_view(prm, off)
            return
        views = torch._C._nn.unflatten_dense_tensors(full[: self._packed_end], [prm for prm, _ in self.params])
        for (prm, _), view in zip(self.params, views):
            self.grad_views.setdefault(id(prm), view)

    def accumulate(self, prm: nn.Parameter, off: int, grad: torch.Tensor) -> None:
        """Add the flat gradient ``grad`` of ``prm`` (at element ``off``) into ``grad_full``:
        a copy for its first gradient since the buffer went stale, an add after that."""
        region = self.ensure_grad_full()[off : off + grad.numel()]
        if self.stale and id(prm) not in self.written:
            region.copy_(grad)  # cast into the reduction dtype
            self.written.add(id(prm))
        else:
            region.add_(grad)

    def mark_stale(self) -> None:
        """Make ``grad_full`` logically zero, without writing it."""
        self.stale, self.written = True, set()

    def settle_full(self) -> None:
        """Zero the regions of a stale ``grad_full`` that no gradient reached (parameters without
        a gradient, padding), so the whole buffer holds the accumulated gradients."""
        if not self.stale or self.grad_full is None:
            return
        pos = 0
        for prm, off in self.params:
            if id(prm) in self.written:
                if off > pos:
                    self.grad_full[pos:off].zero_()
                pos = max(pos, off + prm.numel())
        if pos < self.grad_full.numel():
            self.grad_full[pos:].zero_()
        self.stale, self.written = False, set()

    def ensure_grad_shard(self) -> torch.Tensor:
        """``grad_shard``, allocated (uninitialised, logically zero) if :meth:`release_grads`
        dropped it, and the optimizer's ``opt_param.grad`` pointed at it."""
        if self.reduce_in_place:
            self.ensure_grad_full()
        elif self.grad_shard is None:  # (where the shard is: host memory when offloaded)
            self.grad_shard = torch.empty(self.shard.shape, dtype=self.shard.dtype, device=self.shard.device,
                                          pin_memory=self.pinned)
            self.opt_param.grad = self.grad_shard
            self.shard_stale = True
        return self.grad_shard

    def release_grads(self) -> None:
        """Drop every gradient buffer of the chunk (``zero_grad`` with ``set_to_none``): they are
        logically zero, and their memory is free until the next gradient or reduction lands (as
        plain PyTorch's ``.grad`` and FSDP2's sharded gradients are None after
        ``zero_grad(set_to_none=True)``). The caller sets the parameters' ``.grad`` to None."""
        self.grad_full = self.grad_shard = None
        self.grad_views = {}
        self.pending = []
        if self.opt_param is not None:
            self.opt_param.grad = None
        self.mark_stale()
        self.shard_stale = True

    def settle_shard(self) -> None:
        """Make every gradient the optimizer reads hold its value (zero where none arrived)."""
        if self.reduce_in_place:
            self.ensure_grad_full()
            self.settle_full()
        elif self.shard_stale:
            self.ensure_grad_shard().zero_()
            self.shard_stale = False
