"""CPU offload: saved activations (``offload_ratio``) and optimizer state (ZeRO-Offload).

Activation offload, with haiscale's ``CPUOffload`` semantics: a fraction ``offload_ratio`` of
the bytes of the activations autograd saves for backward is copied to host memory during the
forward pass (the device copy is then released) and copied back when backward needs it. It is
built on ``torch.autograd.graph.saved_tensors_hooks``, as ``torch.autograd.graph.save_on_cpu``,
with three differences: only a fraction moves; parameters (and views of ZeRO chunks, which the
ZeRO-3 runtime already stores as references to its re-gathered buffers) never move; and a tensor
saved by several operations (a LayerNorm output read by q, k and v) is copied once.

Which tensors move is decided in the order they are saved, deterministically: a tensor of ``n``
bytes moves when that brings the moved fraction of the bytes seen so far closest to the ratio
(``moved + n / 2 <= ratio * (seen + n)``), so ``0.0`` moves nothing, ``1.0`` everything, and
``0.5`` every other tensor of equal size; the moved bytes differ from ``ratio`` times the total
by at most half the largest tensor. A tensor whose storage another saved tensor keeps on the
device stays too (moving it would free nothing). The counters restart at every forward of the
sharded module.

On CUDA, the device-to-host copies run on a side stream into pinned memory (``non_blocking``),
overlapping the forward, with at most two in flight (the host waits for the oldest before a
third starts, so device memory is released as the forward proceeds); the host-to-device copies are issued when backward unpacks the tensor,
and the next tensors backward will need are prefetched on another side stream. On a CPU-only
machine the "device" is the CPU: the tensor is still copied into a separate host buffer and the
original released, so the accounting in :class:`OffloadStats` is real.

Optimizer-state offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
Training", arXiv 2101.06840): the optimizer is built over host copies of the flat tensors this
rank updates (fp32 shards), with host gradient buffers; ``step()`` copies the (reduced, clipped)
gradient shards to the host, runs the update on the CPU and copies the updated shards back. The
optimizer state (AdamW's two moments) lives only on the host.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .saved import Saved, check_version, keep, take

__all__ = ["ActivationOffload", "OffloadStats", "activation_offload", "current_activation_offload", "OptimizerOffload"]

_ACTIVE: list["ActivationOffload"] = []  # activation_offload() contexts, innermost last


def current_activation_offload() -> "ActivationOffload | None":
    """The innermost :func:`activation_offload` context, or None (sharded modules compose it
    with their own saved-tensor hooks, which would otherwise hide it)."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass
class OffloadStats:
    """Byte counts of the saved activations that :class:`ActivationOffload` handles.

    Attributes:
        saved_bytes: bytes of offloadable saved tensors since the last forward began
            (each tensor counted once however often it is saved).
        offloaded_bytes: of those, bytes copied to the host.
        device_bytes: bytes of saved activations held on the compute device now (distinct
            storages, counted while autograd keeps them).
        peak_device_bytes: the largest ``device_bytes`` since :meth:`ActivationOffload.reset_peak`.
        host_bytes, peak_host_bytes: the same for the host copies.
        tensors_offloaded, tensors_kept: counts since the last forward began.
    """

    saved_bytes: int = 0
    offloaded_bytes: int = 0
    device_bytes: int = 0
    peak_device_bytes: int = 0
    host_bytes: int = 0
    peak_host_bytes: int = 0
    tensors_offloaded: int = 0
    tensors_kept: int = 0


class _Kept:
    """A saved activation left on the device (counted by storage while autograd holds it)."""

    __slots__ = ("t", "owner", "key", "version", "__weakref__")

    def __init__(self, owner: "ActivationOffload", t: torch.Tensor):
        self.t, self.owner, self.version = t, owner, t._version  # (autograd's in-place check: .saved)
        self.key = t.untyped_storage().data_ptr()
        owner._hold_device(self.key, t.untyped_storage().nbytes())

    def __del__(self):
        self.owner._release_device(self.key)


class _Offloaded:
    """A saved activation copied to host memory; ``get()`` brings it back to its device."""

    __slots__ = ("host", "device", "event", "owner", "nbytes", "loaded", "loaded_event", "seq", "source", "version",
                 "__weakref__")

    def __init__(self, owner: "ActivationOffload", t: torch.Tensor, seq: int):
        self.owner, self.device, self.seq = owner, t.device, seq
        # autograd's in-place check (.saved) while the device tensor lives on; once freed it can
        # change no more, and the host copy holds its value at pack time
        self.source, self.version = weakref.ref(t), t._version
        self.loaded = None
        self.loaded_event = None
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            stream = owner._stream("d2h", t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy has read it
            owner._throttle(self.event)
        else:  # CPU-only: the "device" is the CPU; still a separate buffer, the original is released
            self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self.host.copy_(t)
        self.nbytes = self.host.numel() * self.host.element_size()
        owner._hold_host(self.nbytes)

    def prefetch(self) -> None:
        """Start the host-to-device copy on the load stream (CUDA only)."""
        if self.device.type != "cuda" or self.loaded is not None:
            return
        stream = self.owner._stream("h2d", self.device)
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            self.loaded = self.host.to(self.device, non_blocking=True)
            self.loaded_event = torch.cuda.Event()
            self.loaded_event.record(stream)

    def get(self) -> torch.Tensor:
        source = self.source()
        if source is not None:
            check_version(source, self.version)
        if self.device.type != "cuda":
            return self.host
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.loaded_event)
        out, self.loaded = self.loaded, None
        out.record_stream(current)
        return out

    def __del__(self):
        self.owner._release_host(self.nbytes)


class _Inner:
    """Marks a value packed by an inner pair of hooks (ZeRO-3's chunk views)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class ActivationOffload:
    """Saved-tensor hooks that move ``ratio`` of the saved activation bytes to host memory.

    Args:
        ratio: fraction in ``[0, 1]`` of saved-activation bytes to offload (haiscale's
            ``offload_ratio``).
        min_bytes: tensors smaller than this stay on the device and are not counted (default 0:
            every tensor is counted).
        prefetch: on CUDA, how many of the next tensors backward will need to start copying back
            when one is unpacked (default 2).

    ``stats`` (an :class:`OffloadStats`) has the measured bytes; see the module doc for which
    tensors move. Use through :func:`activation_offload` or ``shard(..., offload_ratio=r)``.

    Raises:
        ValueError: ``ratio`` outside ``[0, 1]``.
    """

    def __init__(self, ratio: float, min_bytes: int = 0, prefetch: int = 2):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
            raise ValueError(f"offload_ratio must be a number in [0, 1] (fraction of saved activations moved to host), got {ratio!r}")
        self.ratio, self.min_bytes, self.prefetch_depth = float(ratio), int(min_bytes), int(prefetch)
        self.stats = OffloadStats()
        self._device_live: dict[int, list[int]] = {}  # storage ptr -> [holders, nbytes]
        self._seen: dict[int, tuple] = {}  # id(tensor) -> (weakref(tensor), weakref(holder))
        self._by_seq: "weakref.WeakValueDictionary[int, _Offloaded]" = weakref.WeakValueDictionary()
        self._seq = 0
        self._streams: dict = {}
        self._inflight: collections.deque = collections.deque()
        self.max_inflight = 2
        self.begin_forward()

    # -- accounting ----------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Restart the selection counters (called at each forward of a sharded module)."""
        self.stats.saved_bytes = self.stats.offloaded_bytes = 0
        self.stats.tensors_offloaded = self.stats.tensors_kept = 0

    def reset_peak(self) -> None:
        """Set the peaks to the current values (as ``torch.cuda.reset_peak_memory_stats``)."""
        self.stats.peak_device_bytes = self.stats.device_bytes
        self.stats.peak_host_bytes = self.stats.host_bytes

    def _hold_device(self, key: int, nbytes: int) -> None:
        entry = self._device_live.get(key)
        if entry is None:
            self._device_live[key] = [1, nbytes]
            self.stats.device_bytes += nbytes
            self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes)
        else:
            entry[0] += 1

    def _release_device(self, key: int) -> None:
        entry = self._device_live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self._device_live[key]
                self.stats.device_bytes -= entry[1]

    def _hold_host(self, nbytes: int) -> None:
        self.stats.host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)

    def _release_host(self, nbytes: int) -> None:
        self.stats.host_bytes -= nbytes

    def _throttle(self, event) -> None:
        """Bound the copies in flight: device memory of a tensor being copied out is only
        released when its copy ends, so without a bound a forward that outruns the copies would
        keep every offloaded tensor on the device (Transformer Engine waits likewise)."""
        self._inflight.append(event)
        while len(self._inflight) > self.max_inflight:
            self._inflight.popleft().synchronize()

    def _stream(self, kind: str, device: torch.device):
        key = (kind, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    # -- the hooks -----------------------------------------------------------------------------
    @staticmethod
    def _offloadable(t: torch.Tensor, exclude: Callable[[torch.Tensor], bool] | None) -> bool:
        if isinstance(t, nn.Parameter) or t.numel() == 0 or t.device.type == "meta":
            return False
        if torch.cuda.is_available() and t.device.type != "cuda":
            return False  # already in host memory
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:  # a parameter or a view of one
            return False
        return not (exclude is not None and exclude(t))

    def hooks(self, inner: tuple[Callable, Callable] | None = None,
              exclude: Callable[[torch.Tensor], bool] | None = None) -> tuple[Callable, Callable]:
        """``(pack, unpack)`` for ``saved_tensors_hooks``; ``inner`` is applied first (a tensor
        it packs into something else is left to it), ``exclude(t)`` keeps a tensor on the device
        uncounted (a sharded module passes its chunk storages)."""
        inner_pack, inner_unpack = inner if inner is not None else (None, None)

        def pack(t: torch.Tensor):
            if inner_pack is not None:
                packed = inner_pack(t)
                if packed is not t and not isinstance(packed, Saved):  # (Saved: the tensor as it is)
                    return _Inner(packed)
            if not self._offloadable(t, exclude):
                return keep(t)
            nbytes = t.numel() * t.element_size()
            if nbytes < self.min_bytes:
                return keep(t)
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t:
                holder = seen[1]()
                if holder is not None:
                    return _Kept(self, t) if isinstance(holder, _Kept) else holder
            s = self.stats
            shares_kept = t.untyped_storage().data_ptr() in self._device_live  # moving it would free nothing
            if not shares_kept and self.ratio > 0 and s.offloaded_bytes + nbytes / 2 <= self.ratio * (s.saved_bytes + nbytes):
                self._seq += 1
                holder = _Offloaded(self, t, self._seq)
                self._by_seq[self._seq] = holder
                s.offloaded_bytes += nbytes
                s.tensors_offloaded += 1
            else:
                holder = _Kept(self, t)
                s.tensors_kept += 1
            s.saved_bytes += nbytes
            key = id(t)
            self._seen[key] = (weakref.ref(t, lambda _, k=key: self._seen.pop(k, None)), weakref.ref(holder))
            return holder

        def unpack(packed):
            if isinstance(packed, _Inner):
                return inner_unpack(packed.value)
            if isinstance(packed, _Kept):
                check_version(packed.t, packed.version)
                return packed.t
            if isinstance(packed, _Offloaded):
                for k in range(1, self.prefetch_depth + 1):  # backward runs roughly in reverse save order
                    nxt = self._by_seq.get(packed.seq - k)
                    if nxt is not None:
                        nxt.prefetch()
                return packed.get()
            return take(packed) if isinstance(packed, Saved) else packed

        return pack, unpack

    @contextlib.contextmanager
    def apply(self, inner: tuple[Callable, Callable] | None = None,
              exclude: Callable[[torch.Tensor], bool] | None = None) -> Iterator["ActivationOffload"]:
        """Install the hooks (composed with ``inner``) for the block."""
        pack, unpack = self.hooks(inner, exclude)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self


@contextlib.contextmanager
def activation_offload(ratio: float, min_bytes: int = 0) -> Iterator[ActivationOffload]:
    """Offload ``ratio`` of the saved activations of the forward passes inside the block.

    The context-manager form of ``shard(..., offload_ratio=ratio)`` (haiscale's ``CPUOffload``;
    with the option, ``smodel.activation_offload.stats`` has the figures, ``0.0`` measuring only),
    also for plain modules. Sharded modules called inside it compose it with their own hooks
    (ZeRO-3 keeps chunk views as references, parameters never move). The backward may run
    after the block: the hooks only act while tensors are saved.

    Args:
        ratio: fraction in ``[0, 1]`` of saved-activation bytes to move to host memory.
        min_bytes: smaller tensors stay on the device.

    Yields:
        The :class:`ActivationOffload`; its ``stats`` hold the measured bytes.

    Raises:
        ValueError: ``ratio`` outside ``[0, 1]``.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        >>> with activation_offload(1.0) as off:
        ...     loss = model(torch.ones(4, 8)).sum()
        >>> loss.backward()
        >>> off.stats.offloaded_bytes == off.stats.saved_bytes > 0
        True
    """
    off = ActivationOffload(ratio, min_bytes)
    _ACTIVE.append(off)
    try:
        with off.apply():
            yield off
    finally:
        _ACTIVE.remove(off)


class OptimizerOffload:
    """Host copies of the flat tensors an optimizer updates, and the copies around its step.

    ZeRO-Offload (arXiv 2101.06840): ``params`` are this rank's device shards (as
    ``ZeroRuntime.optimizer_params()`` returns, each ``(shard_numel,)``); the optimizer is built
    over :attr:`host_params`, fp32 copies in (pinned, with CUDA) host memory with host gradient
    buffers, so its state is allocated on the host. :meth:`step` copies gradients down, runs the
    update on the CPU and copies the updated values back into the device shards.

    Args:
        params: the device tensors the optimizer would update (with ``.grad`` set).
        on_host: per parameter, whether it already lives in host memory (a ZeRO-3 shard under
            ``offload_param_frac``): it is its own host copy, with no copies around the step.
    """

    def __init__(self, params: list[nn.Parameter], on_host: list[bool] | None = None):
        pin = torch.cuda.is_available()
        on_host = list(on_host or [False] * len(params))
        self.host_params: list[nn.Parameter] = []  # in ``params`` order (the optimizer's state_dict order)
        self.device_params, self._copied = [], []  # the ones copied around each step, and their host copies
        for p, already in zip(params, on_host):
            if already:
                self.host_params.append(p)
                continue
            self.device_params.append(p)
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.detach())
            hp = nn.Parameter(host, requires_grad=True)
            hp.grad = torch.zeros(p.shape, dtype=p.grad.dtype if p.grad is not None else p.dtype, device="cpu", pin_memory=pin)
            self.host_params.append(hp)
            self._copied.append(hp)
        self._versions = [p._version for p in self.device_params]
        self._grad_versions = [p.grad._version for p in self._copied]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients to the host, ``optimizer.step()`` there, updated values back.

        A device shard written by anything else since the last step (a checkpoint load, a
        re-gather into the same buffer) is copied to its host master first (its version
        counter tells).

        Raises:
            RuntimeError: a host gradient was modified since the last step (e.g. unscaled by a
                GradScaler): the device gradients are the ones clipped and copied here.
        """
        if any(hp.grad._version != v for hp, v in zip(self._copied, self._grad_versions)):
            raise RuntimeError(
                "optimizer offload: the host gradient buffers were modified outside step() (a GradScaler's unscale_?). "
                "Gradients live on the device until step() copies them; GradScaler with optimizer offload is not supported"
            )
        for i, (dp, hp) in enumerate(zip(self.device_params, self._copied)):
            if dp._version != self._versions[i]:
                hp.data.copy_(dp.detach(), non_blocking=True)
            hp.grad.copy_(dp.grad, non_blocking=True)
        if any(p.device.type == "cuda" for p in self.device_params):
            torch.cuda.synchronize()  # the host update reads the gradients
        optimizer.step()
        for dp, hp in zip(self.device_params, self._copied):
            dp.data.copy_(hp.detach(), non_blocking=True)
        self._versions = [p._version for p in self.device_params]
        self._grad_versions = [p.grad._version for p in self._copied]

    @torch.no_grad()
    def reload(self) -> None:
        """Copy the device shards into the host copies (after parameters were loaded)."""
        for dp, hp in zip(self.device_params, self._copied):
            hp.data.copy_(dp.detach())

    def host_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Measured host bytes: master copies, gradient copies and the optimizer's state tensors."""
        out = {"params": sum(p.numel() * p.element_size() for p in self._copied),  # (offloaded shards: the runtime's)
               "grads": sum(p.grad.numel() * p.grad.element_size() for p in self._copied)}
        states = 0
        if optimizer is not None:
            for state in optimizer.state.values():
                states += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        out["optimizer"] = states
        return out
