"""The shared harness of the side-by-side benchmarks: shardlib (A) against PyTorch's own tool (B).

Both sides run in the same worker processes (spawned once, gloo, one thread each), on the same
reference :class:`~shardlib.models.GPT` built from the same seed, fed the same byte-level batches
(:func:`shardlib.data.default_corpus`), and are timed in alternating blocks of steps
(A A A, B B B, A A A, ...), so drift of the machine (other jobs, thermal state) falls on both
sides alike. A step is forward, backward and the optimizer step; its time is the slowest rank's
(``time.perf_counter`` around the step, after a barrier), and the figure reported is the median
over ``steps`` measured steps after ``warmup`` unmeasured ones. The spread of the per-round
ratios (median A / median B in each round) is the noise figure, and a bootstrap over the rounds
gives the ratio's 95% confidence interval (:func:`ratio_ci`). The process CPU time of each
step (``time.process_time``, every thread, mean over ranks) is reported too: on a machine shared
with other jobs it moves far less than wall time, though it misses time spent waiting. The
minor page faults of each step (``getrusage``) are reported too: on the CPU they come and go with
each process's heap state and move a 10.8M step by 1-3%.

Besides time, each side reports, from one more unmeasured step each:

* communication: logical bytes per rank and calls per step. shardlib counts at its own call sites
  (:class:`~shardlib.mesh.comm.CommCounter`, the per-rank ring figures of the ZeRO paper);
  PyTorch's tools are counted by :class:`CollectiveProbe`, a ``TorchDispatchMode`` that sees every
  ``c10d``/``_c10d_functional`` op (DDP's C++ reducer included) and prices it with the same ring
  formula. The probe also counts shardlib's *backend* calls (on gloo its all-gathers and
  reduce-scatters are all-reduces underneath);
* model-state memory: bytes of distinct storages of parameters, gradients and optimizer state on
  this rank (shardlib: :func:`shardlib.model_state_bytes`), against the plan and the ZeRO formula;
* activation memory: bytes autograd saves for backward in one step (parameters left out), and
  the peak total ``torch.distributed._tools.mem_tracker.MemTracker`` sees over a step (it runs on
  CPU in torch 2.13; see :func:`activation_bytes` for why its categories are not used).

Run a benchmark module as ``python -m benchmarks.<name>``; ``python -m benchmarks.run`` runs all.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Callable

import torch

try:
    import resource  # page-fault counts (Unix)
except ImportError:  # not on this platform
    resource = None

from .report import print_table, summarize, write_outputs
from .theory import zero_state_formula

__all__ = [
    "train_step",
    "Settings", "SIZES", "Side", "CollectiveProbe", "add_common_args", "settings_from_args", "make_gpt", "batches",
    "time_pair", "measure_side", "storage_bytes", "torch_state_bytes", "saved_activation_bytes", "activation_bytes", "zero_state_formula",
    "compare", "print_table", "write_outputs", "summarize", "worker_group", "run_benchmark",
]

# GPT sizes: "tiny" for the smoke test, "small" for --quick, "10m" (10.8M parameters) for the real run.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=32, block_size=16),
    "small": dict(n_layer=2, n_head=4, n_embd=128, block_size=64),
    "10m": dict(n_layer=6, n_head=6, n_embd=384, block_size=128),
}


@dataclass
class Settings:
    """What one benchmark run measures (the same on every rank).

    Attributes:
        size: a key of :data:`SIZES` (the GPT's shape; vocabulary 256, bytes).
        batch: local batch per data rank (sequences).
        seq: sequence length T (tokens).
        steps: measured steps per side (>= 20 for a real run).
        warmup: unmeasured steps per side before timing.
        block: steps per side in one alternation round.
        seed: model and data seed.
        lr: AdamW learning rate.
        corpus_bytes: bytes of the standard-library corpus to read.
        activations: also measure activation memory with MemTracker (one extra step per side).
    """

    size: str = "small"
    batch: int = 4
    seq: int = 64
    steps: int = 20
    warmup: int = 3
    block: int = 5
    seed: int = 0
    lr: float = 1e-3
    corpus_bytes: int = 400_000
    activations: bool = True

    def gpt_config(self, **overrides):
        from shardlib.models import GPTConfig

        shape = dict(SIZES[self.size])
        shape["block_size"] = max(shape["block_size"], self.seq)
        shape.update(overrides)
        return GPTConfig(**shape)


QUICK = dict(size="small", batch=4, seq=64, steps=20, warmup=3, block=5)
FULL = dict(size="10m", batch=4, seq=128, steps=20, warmup=3, block=5)
SMOKE = dict(size="tiny", batch=2, seq=16, steps=2, warmup=0, block=1, corpus_bytes=50_000, activations=True)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small GPT (0.4M parameters), about a minute per benchmark")
    p.add_argument("--smoke", action="store_true", help="tiny GPT, 2 steps: checks the harness, times mean nothing")
    p.add_argument("--size", choices=sorted(SIZES), default=None)
    p.add_argument("--batch", type=int, default=None, help="local batch per data rank")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="measured steps per side (>= 20 for a real run)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--block", type=int, default=None, help="steps per side per alternation round")
    p.add_argument("--no-activations", action="store_true", help="skip the MemTracker step")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG files")


def settings_from_args(args) -> Settings:
    base = SMOKE if args.smoke else QUICK if args.quick else FULL
    s = Settings(**base)
    for name in ("size", "batch", "seq", "steps", "warmup", "block"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.no_activations:
        s.activations = False
    return s


# ---------------------------------------------------------------------------------------------
# model and data


def make_gpt(settings: Settings, **overrides) -> torch.nn.Module:
    """The reference GPT, initialized from ``settings.seed`` (the same tensors on every call)."""
    from shardlib.models import GPT

    torch.manual_seed(settings.seed)
    return GPT(settings.gpt_config(**overrides))


_CORPUS: dict[int, Any] = {}


def batches(settings: Settings, global_batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches ``(x, y)``, int64 ``(global_batch, seq)``, from the byte corpus.

    The same seed gives the same batches on every rank; each side slices its local part.
    """
    from shardlib.data import default_corpus

    if settings.corpus_bytes not in _CORPUS:
        _CORPUS[settings.corpus_bytes] = default_corpus(max_bytes=settings.corpus_bytes)
    corpus = _CORPUS[settings.corpus_bytes]
    g = torch.Generator().manual_seed(settings.seed + 1)
    return [corpus.get_batch("train", global_batch, settings.seq, g) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# counting collectives at the dispatcher


_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "barrier": "barrier",
}


class CollectiveProbe(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the collectives that reach the dispatcher (``c10d::*``, ``_c10d_functional::*``).

    Each is priced with :func:`shardlib.mesh.comm.ring_bytes` on the payload the ZeRO paper uses
    (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the input before
    scattering; send: the tensor; receives are not counted, so a send is not counted twice).
    Barriers and ``wait_tensor`` are left out. ``table`` is ``{kind: [calls, bytes]}``.
    """

    def __init__(self):
        super().__init__()
        self.table: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs) -> None:
        from shardlib.mesh.comm import ring_bytes

        name = func._schema.name.split("::")[-1]
        kind = _KINDS.get(name)
        if kind is None or kind in ("barrier", "recv"):
            return
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        size = self._group_size(args, kwargs)
        nbytes = [t.numel() * t.element_size() for t in tensors]
        if kind == "all_gather":
            payload = max(nbytes)
        elif kind == "reduce_scatter":
            payload = max(nbytes)
        elif kind in ("all_reduce", "broadcast", "send"):
            payload = sum(nbytes) if name in ("allreduce_", "broadcast_", "send") else nbytes[0]
        else:
            payload = nbytes[0]
        entry = self.table.setdefault(kind, [0, Fraction(0)])
        entry[0] += 1
        entry[1] += ring_bytes(kind, payload, size) if kind != "send" else Fraction(payload)

    @staticmethod
    def _group_size(args, kwargs) -> int:
        import torch.distributed as dist

        for a in list(args) + list(kwargs.values()):
            if isinstance(a, dist.ProcessGroup):
                return a.size()
            if isinstance(a, str) and a:
                try:
                    return dist.distributed_c10d._resolve_process_group(a).size()
                except Exception:  # noqa: BLE001 - not a group name
                    continue
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and a > 1:
                return a  # funcol all_gather/reduce_scatter pass group_size
        return dist.get_world_size()

    def bytes(self) -> float:
        return float(sum((v[1] for v in self.table.values()), Fraction(0)))

    def calls(self) -> int:
        return sum(v[0] for v in self.table.values())

    def summary(self) -> dict[str, list]:
        return {k: [v[0], float(v[1])] for k, v in sorted(self.table.items())}


# ---------------------------------------------------------------------------------------------
# memory


def train_step(model, opt, data: list) -> Callable[[int], Any]:
    """``step(i)``: one optimizer step of ``model(x, y) -> (logits, loss)`` on ``data[i % len]``;
    returns the loss (the same closure for every non-pipeline side)."""

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local tensor)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def torch_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Model-state bytes on this rank of a PyTorch-parallel model: parameters, gradients and the
    optimizer's state tensors (0-dim step counters left out), distinct storages only."""
    seen: set = set()
    params = list(model.parameters())
    out = {"params": storage_bytes(params, seen), "grads": storage_bytes([p.grad for p in params], seen)}
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its own in .optim
    states = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = storage_bytes(states, seen)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def saved_activation_bytes(step: Callable[[], Any], modules: list, blocks: list | None = None):
    """Bytes of the distinct storages autograd saves for backward during ``step`` (one forward
    and backward), parameters left out: the activation memory a step holds at the end of its
    forward. Counted by ``saved_tensors_hooks``; a shardlib ZeRO-3 module installs its own hooks
    inside the forward, so its ``pack`` is wrapped to see the same tensors.

    With ``blocks`` (modules, e.g. the transformer blocks), returns ``(inside, outside)``: the
    bytes saved while one of them runs its forward (outside backward) and the rest."""
    seen: set = set()
    total = [0]
    split = [0, 0]  # inside, outside
    depth = [0]
    hooks = []
    for b in blocks or ():
        def pre(mod, args, b=b):
            if torch._C._current_graph_task_id() == -1:
                depth[0] += 1

        def post(mod, args, out):
            if torch._C._current_graph_task_id() == -1:
                depth[0] -= 1

        hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]

    def params() -> set:
        out = set()
        for m in modules:
            for p in m.parameters():
                try:
                    out.add(getattr(p, "_local_tensor", p).untyped_storage().data_ptr())
                except RuntimeError:  # a ZeRO-3 chunk freed at this point (ShardedAwayError): nothing saved from it
                    pass
        return out

    def record(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = getattr(t, "_local_tensor", t).untyped_storage()
            ptr = st.data_ptr()
            if st.nbytes() and ptr not in seen and ptr not in params():
                seen.add(ptr)
                total[0] += st.nbytes()
                split[0 if depth[0] > 0 else 1] += st.nbytes()
        return t

    patched = []
    for m in modules:
        zero = getattr(m, "_zero", None)
        if zero is not None and getattr(zero, "stage", 0) == 3:
            orig = zero.pack
            zero.pack = lambda t, orig=orig: orig(record(t))
            patched.append(zero)
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            step()
    finally:
        for zero in patched:
            del zero.pack
        for h in hooks:
            h.remove()
    return (split[0], split[1]) if blocks is not None else total[0]



def activation_bytes(step: Callable[[], Any], modules: list, optimizers: list, memtracker: bool = True) -> dict:
    """Activation memory of one call of ``step``: ``{"activation": saved-for-backward bytes
    (:func:`saved_activation_bytes`), "peak_total": peak bytes MemTracker saw over another call}``.

    ``torch.distributed._tools.mem_tracker.MemTracker`` runs on CPU in torch 2.13, but files
    shardlib's flat gradient buffers (allocated in gradient hooks, not as ``.grad``) under
    activations/temporaries, so only its category-free peak total is reported.
    """
    out: dict[str, Any] = {}
    try:
        out["activation"] = saved_activation_bytes(step, modules)
    except Exception as exc:  # noqa: BLE001 - reported in the output
        out["activation_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if not memtracker:
        return out
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(*modules, *optimizers)
        with mt:
            step()
        snap = mt.get_tracker_snapshot("peak")
        cpu = next(iter(snap.values()))
        out["peak_total"] = int(cpu["Total"])
    except Exception as exc:  # noqa: BLE001 - reported in the output
        out["memtracker_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


# ---------------------------------------------------------------------------------------------
# timing


@dataclass
class Side:
    """One side of a comparison, built on every rank.

    Attributes:
        label: printed name (``"shardlib zero-3"``, ``"FSDP2"``).
        step: ``step(i) -> loss`` runs training step ``i`` (forward, backward, optimizer step).
        modules, optimizers: what MemTracker should follow.
        state_bytes: ``() -> {"params", "grads", "optimizer", "total"}`` measured on this rank.
        mesh: the shardlib mesh whose ``comm`` counter counts this side (None for PyTorch).
        extra: anything else to report (plan predictions, theory).
        memtracker: run the MemTracker step (off for pipelines: under MemTracker's dispatch mode
            the receiving rank of shardlib's pipeline never completes its receive; not understood).
    """

    label: str
    step: Callable[[int], Any]
    modules: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    state_bytes: Callable[[], dict] | None = None
    mesh: Any = None
    extra: dict = field(default_factory=dict)
    memtracker: bool = True


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _loss_value(loss) -> float | None:
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def time_pair(a: Side, b: Side, settings: Settings, floor: Side | None = None) -> dict:
    """Alternate blocks of ``settings.block`` steps of ``a`` and ``b`` (and ``floor``), in
    reverse order every other round (a b, b a, a b, ...), until each has ``settings.steps``
    measured steps; returns per-step times (this rank) and losses."""
    order = [("a", a), ("b", b)] + ([("floor", floor)] if floor is not None else [])
    times = {k: [] for k, _ in order}
    cpu = {k: [] for k, _ in order}  # process CPU time per step (all threads): robust to other jobs' load
    faults = {k: [] for k, _ in order}  # minor page faults per step: new memory the kernel maps in (CPU only)
    rounds = {k: [] for k, _ in order}
    losses = {k: [] for k, _ in order}
    counters = {k: 1 for k, _ in order}  # step 0 ran in compare(), when the side was built
    for key, side in order:
        for _ in range(settings.warmup):
            losses[key].append(_loss_value(side.step(counters[key])))
            counters[key] += 1
    rnd = 0
    while any(len(times[k]) < settings.steps for k, _ in order):
        # ABBA: every other round runs the sides in reverse order, so neither always follows the
        # other (a side timed right after another inherits its state: caches, allocator, the
        # peer's progress); the A/A control measured a 1.02-1.05 median with a fixed order
        for key, side in (order if rnd % 2 == 0 else order[::-1]):
            block = []
            for _ in range(min(settings.block, settings.steps - len(times[key]))):
                _barrier()
                f0 = _minor_faults()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = side.step(counters[key])
                block.append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
                faults[key].append(_minor_faults() - f0)
                losses[key].append(_loss_value(loss))
                counters[key] += 1
            times[key] += block
            if block:
                rounds[key].append(block)
        rnd += 1
    return {"times": times, "cpu": cpu, "faults": faults, "rounds": rounds, "losses": losses, "counters": counters}


def _minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``; 0 where the platform has none).
    On the CPU, glibc returns large freed blocks to the kernel, and memory allocated again is
    faulted in page by page: at 10.8M a few thousand faults a step, 1-3% of a step's time, and
    they come and go with the heap's state (``benchmarks/README.md``, 2026-12-08)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def measure_side(side: Side, i: int, settings: Settings) -> dict:
    """Counted communication, model state and activation memory from unmeasured steps."""
    out: dict[str, Any] = {"label": side.label}
    probe = CollectiveProbe()
    if side.mesh is not None:
        side.mesh.comm.reset()
    _barrier()
    with probe:
        side.step(i)
    out["backend"] = {"calls": probe.calls(), "bytes": probe.bytes(), "table": probe.summary()}
    if side.mesh is not None:
        table = side.mesh.comm.table()
        out["comm"] = {"calls": side.mesh.comm.calls(), "bytes": side.mesh.comm.bytes(),
                       "exact_bytes": str(side.mesh.comm.exact_bytes()),
                       "table": {f"{a}/{k}": [c, b] for (a, k), (c, b) in table.items()}, "source": "shardlib CommCounter"}
    else:
        out["comm"] = {"calls": probe.calls(), "bytes": probe.bytes(), "table": probe.summary(),
                       "source": "dispatcher probe"}
    if side.state_bytes is not None:
        out["state_bytes"] = side.state_bytes()
    if settings.activations:
        _barrier()
        steps = iter(range(i + 1, i + 3))
        out["memory"] = activation_bytes(lambda: side.step(next(steps)), side.modules, side.optimizers,
                                       side.memtracker)
    return out


def _gather(obj):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def compare(name: str, make_a: Callable[[], Side], make_b: Callable[[], Side], settings: Settings, theory: dict | None = None,
            make_floor: Callable[[], Side] | None = None) -> dict:
    """Build both sides, time them alternately, measure them, and gather every rank's figures.

    ``make_floor``: a third side timed in the same alternation, the plain model on each rank's
    local batch with no communication (``row["floor"]``; ``row["floor_ratio"]`` = its time over
    the PyTorch side's: the ratio shardlib would reach with free communication and no overhead).

    Returns (on every rank) a row: ``{"name", "a", "b", "ratio", "round_ratios", "ratio_ci",
    "theory"}`` (``ratio_ci``: the ratio's 95% interval, :func:`ratio_ci`),
    where ``a``/``b`` hold ``median_s``, ``iqr_s``, ``times_s`` (slowest rank per step), the
    first losses, and per rank the counted communication, model state and activation memory. A
    side that cannot be built or run gives ``{"error": message}`` instead (e.g. a baseline that
    gloo cannot run), and the other side is still measured alone.
    """
    row: dict[str, Any] = {"name": name, "theory": theory or {}}
    sides, errors = {}, {}
    first = {}
    for key, make in (("a", make_a), ("b", make_b)):
        try:
            side = make()
            first[key] = _loss_value(side.step(0))  # a side that cannot run fails here, alone
            sides[key] = side
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is a result
            errors[key] = f"{type(exc).__name__}: {exc}".strip()[:2000]
            errors[key + "_traceback"] = traceback.format_exc()[-3000:]
    all_errors = _gather(errors)
    failed = {k for e in all_errors for k in e if not k.endswith("_traceback")}
    for key in failed:
        sides.pop(key, None)
        msg = next(e[key] for e in all_errors if key in e)
        row[key] = {"error": msg}
    if not sides:
        return row
    floor = None
    if make_floor is not None and len(sides) == 2:
        floor = make_floor()
        floor.step(0)
    if len(sides) == 2:
        timing = _run_guarded(lambda: time_pair(sides["a"], sides["b"], settings, floor))
    else:
        (key, side), = sides.items()
        dummy = Side("none", lambda i: None)
        timing = _run_guarded(lambda: time_pair(side, dummy, settings) if key == "a" else time_pair(dummy, side, settings))
    if "error" in timing:
        for key in sides:
            row[key] = {"error": timing["error"]}
        return row
    measured = {}
    for key, side in sides.items():
        m = _run_guarded(lambda: measure_side(side, timing["counters"][key], settings))
        measured[key] = m
    per_rank = _gather({"timing": timing, "measured": measured, "first": first})
    for key, side in sides.items():
        steps = list(zip(*[r["timing"]["times"][key] for r in per_rank]))
        slowest = [max(s) for s in steps]
        q = statistics.quantiles(slowest, n=4) if len(slowest) >= 2 else [slowest[0]] * 3
        cpu = [sum(c) / len(c) for c in zip(*[r["timing"]["cpu"][key] for r in per_rank])]
        row[key] = {
            "label": side.label,
            "median_s": statistics.median(slowest),
            "cpu_median_s": statistics.median(cpu),  # process CPU seconds per step, mean over ranks
            "faults_median": [statistics.median(r["timing"]["faults"][key]) for r in per_rank],  # per rank
            "iqr_s": q[2] - q[0],
            "times_s": slowest,
            "losses": next(([r["first"].get(key)] + r["timing"]["losses"][key][:2] for r in per_rank
                            if r["first"].get(key) is not None), None),  # the rank that has the loss
            "ranks": [r["measured"][key] for r in per_rank],
            **side.extra,
        }
    if len(sides) == 2:
        row["ratio"] = row["a"]["median_s"] / row["b"]["median_s"]
        row["cpu_ratio"] = row["a"]["cpu_median_s"] / row["b"]["cpu_median_s"]
        # per round, each step's slowest rank
        slow = {key: [[max(s) for s in zip(*blk)] for blk in zip(*[r["timing"]["rounds"][key] for r in per_rank])]
                for key in ("a", "b")}
        row["round_ratios"] = [statistics.median(x) / statistics.median(y) for x, y in zip(slow["a"], slow["b"])]
        row["ratio_ci"] = ratio_ci(slow["a"], slow["b"])
    if floor is not None:
        slowest = [max(s) for s in zip(*[r["timing"]["times"]["floor"] for r in per_rank])]
        row["floor"] = {"label": floor.label, "median_s": statistics.median(slowest), "times_s": slowest}
        row["floor_ratio"] = row["floor"]["median_s"] / row["b"]["median_s"]
    return row


def ratio_ci(rounds_a: list[list[float]], rounds_b: list[list[float]], level: float = 0.95, resamples: int = 2000,
             seed: int = 0) -> list[float] | None:
    """The ``level`` confidence interval of ``median(a) / median(b)`` (the row's ``ratio``), by a
    percentile bootstrap over alternation rounds (Efron and Tibshirani, *An Introduction to the
    Bootstrap*, 1993, ch. 13): ``resamples`` times, draw as many rounds as were run, with
    replacement, each round's A and B blocks together (they ran back to back, so drift of the
    machine falls on both), and take the ratio of the pooled medians. Rounds, not single steps,
    are drawn because consecutive steps share the machine's state. Seeded: the same times give
    the same interval. ``None`` with fewer than 2 rounds. Times in any one unit (seconds here)."""
    k = min(len(rounds_a), len(rounds_b))
    if k < 2:
        return None
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(k) for _ in range(k)]
        a = [t for i in idx for t in rounds_a[i]]
        b = [t for i in idx for t in rounds_b[i]]
        stats.append(statistics.median(a) / statistics.median(b))
    stats.sort()
    lo = int((1 - level) / 2 * resamples)
    return [stats[lo], stats[resamples - 1 - lo]]


def _run_guarded(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}


_GROUP = {}


def worker_group(n: int = 2):
    """A cached :class:`~shardlib.mesh.launch.WorkerGroup` of ``n`` gloo ranks (spawned once)."""
    from shardlib.mesh.launch import WorkerGroup

    g = _GROUP.get(n)
    if g is None or not g.alive:
        g = WorkerGroup(n, timeout=600.0)
        _GROUP[n] = g
    return g


def run_benchmark(name: str, worker: Callable, settings: Settings, out_dir: str | None, nprocs: int = 2,
                  cases: tuple = (), **kwargs) -> dict:
    """Run ``worker(settings, cases=(case,), **kwargs) -> [row, ...]`` on ``nprocs`` ranks for each case
    in turn (the JSON is rewritten after each, so a long run keeps what it measured), print the
    table, and write the JSON and plots; returns ``{"benchmark", "settings", "rows", "files"}``."""
    if getattr(worker, "__module__", None) == "__main__":  # run as a script: send it by reference, not by value
        import importlib

        worker = getattr(importlib.import_module(f"benchmarks.{name}"), worker.__name__)
    if not cases:
        import importlib

        cases = importlib.import_module(worker.__module__).CASES
    t0 = time.perf_counter()
    result = {"benchmark": name, "settings": asdict(settings), "world_size": nprocs, "torch": torch.__version__, "rows": []}
    for case in cases:
        rows = worker_group(nprocs).run(worker, settings, cases=(case,), timeout=6 * 3600, **kwargs)[0]
        result["rows"].extend(rows)  # (a case may add rows: the pipeline's A/A control)
        print_table(rows, "")
        result["wall_s"] = time.perf_counter() - t0
        if out_dir:
            write_outputs(name, result, out_dir, plots=False)
    result["table"] = print_table(result["rows"], f"== {name} ({settings.size} GPT, world size {nprocs}, gloo, "
                                                  f"{settings.steps} steps/side, wall {result['wall_s']:.0f} s)")
    if out_dir:
        result["files"] = write_outputs(name, result, out_dir)
    return result
