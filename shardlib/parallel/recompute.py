"""Activation checkpointing as a plan option: which modules recompute their forward in backward.

``shard(..., activation_checkpointing=...)`` names modules whose activations are not kept from
forward to backward: each such module's forward runs under non-reentrant
``torch.utils.checkpoint`` (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv
1604.06174; torch's default semantics), and backward runs it again to rebuild what it needs.
The forms (:func:`resolve_activation_checkpointing`):

- ``"full"``: every transformer block (Megatron-LM's full recompute, arXiv 2205.05198 section
  5: only a block's input is kept); the blocks are the modules named by a Hugging Face model's
  ``_no_split_modules``, else the children of the model's largest ``nn.ModuleList`` of modules of
  one type (:func:`transformer_blocks`).
- ``"selective"``: every block, keeping the outputs of its matrix multiplications
  (``aten.mm``, ``aten.addmm``) and recomputing the rest: attention scores, softmax, dropout
  and the elementwise operations (Korthikanti et al. 2022, "selective activation recomputation",
  through torch's ``create_selective_checkpoint_contexts``).
- an int ``k``: full recompute of every ``k``-th block (blocks ``k, 2k, ...`` counting from 1;
  torchtitan's ``selective_ac_option``).
- a callable ``fn(path, module) -> False | True | "full" | "selective"`` over the model's
  modules in ``named_modules()`` order; a module's descendants are not asked once it is chosen.

The plan keeps the result as ``(module path, mode)`` pairs; :func:`apply_activation_checkpointing`
installs them on the lowered module (after tensor parallelism replaced layers and ZeRO packed
the parameters), keeping every module path and parameter name. What it composes with:

- ZeRO-3: a recompute runs the module's forward inside backward; the chunks of the module and
  its submodules are gathered the backward way (descending, :mod:`shardlib.parallel.gather`)
  before it starts, so a chunk is gathered once for the recompute and the
  module's backward together, and nothing is freed until its gradients are complete.
- tensor and sequence parallelism: a checkpointed block's forward collectives (the row layers'
  all-reduce or reduce-scatter, the column layers' all-gather under sequence parallelism) run
  again in the recompute, as in Megatron-LM; the plan's ``comm_per_step`` counts them.
- mesh-independent dropout (:class:`~shardlib.random.MeshDropout`): the recompute sets each
  dropout module's counter and microbatch back to where the forward had them, so it draws the
  forward's masks.
- buffers the forward changes (BatchNorm's running statistics and ``num_batches_tracked``, a
  counter): the recompute reads them as the forward did and leaves them as they were
  (:class:`_Buffers`; plain ``torch.utils.checkpoint`` updates them a second time).
- ``torch.compile``: a block whose recompute needs none of the above compiles with torch's own
  checkpoint contexts; any other runs eagerly inside the compiled model (a graph break), since
  torch.compile takes no other contexts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ShardingError

__all__ = ["MODES", "find_blocks", "transformer_blocks", "resolve_activation_checkpointing", "apply_activation_checkpointing",
           "recompute_paths"]

MODES = ("full", "selective")
_SAVED_OPS = ("mm", "addmm")  # selective: kept from forward (the matrix multiplications' outputs)


def find_blocks(model: nn.Module) -> list[str]:
    """The paths of ``model``'s transformer blocks as :func:`transformer_blocks` finds them, or
    ``[]`` when no module qualifies (the chunk packing's module boundaries, which need none)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [f"{path}.{i}" if path else str(i) for path, m in model.named_modules() if isinstance(m, nn.ModuleList)
                 for i, c in enumerate(m) if type(c).__name__ in names]
        if found:
            return found
    best: list[str] = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best):
            kinds = {type(c) for c in m}
            if len(kinds) == 1 and all(any(True for _ in c.parameters()) for c in m):
                best = [f"{path}.{i}" if path else str(i) for i in range(len(m))]
    return best


def transformer_blocks(model: nn.Module) -> list[str]:
    """The paths of ``model``'s transformer blocks, in ``named_modules()`` order.

    A Hugging Face model's blocks are the elements of an ``nn.ModuleList`` whose class is in its
    ``_no_split_modules`` (which also names embedding classes, not blocks); any other model's are
    the children of its largest ``nn.ModuleList`` whose children are all of one class and hold
    parameters (the first such list on a tie).

    Raises:
        ShardingError: no module qualifies, naming the model and the fix (a callable).
    """
    best = find_blocks(model)
    if not best:
        raise ShardingError(
            f"activation_checkpointing found no transformer blocks in {type(model).__name__}: it has no Hugging Face "
            "_no_split_modules and no nn.ModuleList of modules of one type with parameters. Fix: pass "
            "activation_checkpointing=lambda path, module: <True for the modules to recompute>")
    return best


def _choose(value: Any, path: str, module: nn.Module) -> str | None:
    choice = value(path, module)
    if choice is None or choice is False:
        return None
    mode = "full" if choice is True else choice
    if not (isinstance(mode, str) and mode in MODES):
        raise ShardingError(
            f"activation_checkpointing's function returned {choice!r} for module {path!r} ({type(module).__name__}); "
            f"it must return False, True, 'full' or 'selective'")
    if type(module).forward is nn.Module.forward:  # _forward_unimplemented: a container
        raise ShardingError(
            f"activation_checkpointing's function chose {path!r}, a {type(module).__name__}, which is never called "
            "(it has no forward of its own), so nothing would be recomputed. Fix: choose the modules inside it "
            f"(e.g. return True for its children {path + '.0' if path else '0'}, ...)")
    return mode


def stage_choice(choices: tuple[tuple[str, str], ...]) -> Callable[[str, nn.Module], str | None]:
    """The whole model's choices as the function a pipeline stage's plan is given: the stage's
    share of them, which may be none."""
    chosen = dict(choices)

    def choose(path: str, module: nn.Module) -> str | None:
        return chosen.get(path)

    choose.stage = True  # a stage may hold none of the chosen modules
    return choose


def resolve_activation_checkpointing(model: nn.Module, value: Any) -> tuple[tuple[str, str], ...]:
    """The ``(module path, mode)`` pairs that ``value`` selects in ``model``, in module order.

    Args:
        model: the module being planned (a pipeline stage is given the whole model's choice as a
            function, :func:`stage_choice`, and may hold none of the chosen modules).
        value: ``None`` or ``False`` (nothing), ``True`` or ``"full"``, ``"selective"``, an int
            ``k >= 1``, or a function ``(path, module) -> False | True | "full" | "selective"``
            (see the module docstring).

    Raises:
        ShardingError: another value; a function choosing a container (an ``nn.ModuleList``,
            never called); a model whose ``config.use_cache`` is True (a Hugging Face
            model: each recompute would append to the cache again); ``k`` larger than the number of blocks (nothing would be
            recomputed); a function returning something else, or selecting no module; no
            transformer blocks found for the string and int forms.
    """
    if value is None or value is False:
        return ()
    chosen = _resolve(model, value, strict=not getattr(value, "stage", False))
    config = getattr(model, "config", None)
    if chosen and getattr(config, "use_cache", False) is True:
        raise ShardingError(
            f"activation_checkpointing on {type(model).__name__} with config.use_cache=True: its blocks append their keys "
            "and values to the returned cache, and each recompute in backward would append them again. Fix: "
            "model.config.use_cache = False before shard() (Hugging Face does the same under gradient checkpointing)")
    return chosen


def _resolve(model: nn.Module, value: Any, strict: bool) -> tuple[tuple[str, str], ...]:
    if callable(value) and not isinstance(value, (str, int)):
        chosen: list[tuple[str, str]] = []
        for path, module in model.named_modules():
            if any(_within(path, p) for p, _ in chosen):
                continue  # inside a chosen module
            mode = _choose(value, path, module)
            if mode is not None:
                chosen.append((path, mode))
        if strict and not chosen:
            raise ShardingError(f"activation_checkpointing's function selected no module of {type(model).__name__}. "
                                "Fix: return True for the modules to recompute (e.g. the transformer blocks)")
        return tuple(chosen)
    if value is True or (isinstance(value, str) and value in MODES):
        mode = "full" if value is True else value
        return tuple((path, mode) for path in transformer_blocks(model))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        blocks = transformer_blocks(model)
        if value > len(blocks):
            raise ShardingError(
                f"activation_checkpointing={value} (every {value}-th block) on {type(model).__name__}, which has "
                f"{len(blocks)} transformer blocks: none would be recomputed. Fix: an int in [1, {len(blocks)}]")
        return tuple((path, "full") for i, path in enumerate(blocks, start=1) if i % value == 0)
    raise ShardingError(
        f"activation_checkpointing must be None, 'full', 'selective', an int k >= 1 (every k-th block) or a function "
        f"(path, module) -> bool | 'full' | 'selective', got {value!r}")


def _within(path: str, root: str) -> bool:
    """Is the module at ``path`` the module at ``root`` or inside it (``""``: the root module)?"""
    return root == "" or path == root or path.startswith(root + ".")


def recompute_paths(plan) -> Callable[[str], bool]:
    """``path -> bool``: does the module at ``path`` run inside a checkpointed module of ``plan``?"""
    roots = [p for p, _ in plan.activation_checkpointing]
    return lambda path: any(_within(path, p) for p in roots)


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(getattr(op, "overloadpacket", None), "__name__", "")
    return CheckpointPolicy.MUST_SAVE if name in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Buffers:
    """The forward context of one checkpointed call, and the module's buffers around its
    recompute: the recompute reads them as the forward read them and leaves them as the forward
    left them. Without it every recompute updated them a second time, as torch.utils.checkpoint
    does: BatchNorm's running statistics took two momentum steps per step and
    ``num_batches_tracked`` counted each step twice.

    The forward keeps a copy of the module's persistent buffers (BatchNorm's kernel updates its
    statistics without bumping their version counter, so only a copy tells; such buffers are
    small: statistics, counters) and notes any other buffer it changed by assignment or a
    versioned in-place op, copied before each later forward (``learned``). The recompute sets
    them back to those values (:meth:`rewind`) and puts the current ones back after it
    (:meth:`restore`)."""

    def __init__(self, module: nn.Module, learned: set, inner: Any = None):
        self.module, self.learned, self.inner = module, learned, inner
        self.before: dict = {}  # (module, name) -> (tensor, version, copy or None) at the forward's start

    def __enter__(self):
        for m in self.module.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    keep = name not in m._non_persistent_buffers_set or (id(m), name) in self.learned
                    self.before[(m, name)] = (b, b._version, b.detach().clone() if keep else None)
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        if self.inner is not None:
            self.inner.__exit__(*exc)
        kept = {}
        for (m, name), (b, version, copy) in self.before.items():
            if m._buffers.get(name) is not b or b._version != version:
                self.learned.add((id(m), name))
            elif copy is None:
                continue  # an unchanged non-persistent buffer (a causal mask): nothing to restore
            kept[(m, name)] = (b, version, copy)
        self.before = kept
        return False

    def rewind(self) -> list:
        """Before a recompute: each buffer as before the forward; returns the current ones for
        :meth:`restore`."""
        after = []
        for (m, name), (old, _, copy) in self.before.items():
            now = m._buffers.get(name)
            after.append((m, name, now, now.detach().clone() if now is not None else None))
            if now is not old:  # assigned: the old tensor holds the value before the forward
                m._buffers[name] = old
            elif copy is not None:
                with torch.autograd._unsafe_preserve_version_counter(old):
                    old.copy_(copy)
        return after

    @staticmethod
    def restore(after: list) -> None:
        """After a recompute: the buffers as they were before it (version counters kept, so a
        tensor the recompute saved for backward is not taken as changed in place)."""
        for m, name, tensor, value in after:
            m._buffers[name] = tensor
            if value is not None:
                with torch.autograd._unsafe_preserve_version_counter(tensor):
                    tensor.copy_(value)


class _Replay:
    """The recompute context of one checkpointed call: the dropout counters of the forward, the
    buffers it changed (:class:`_Buffers`), and under ZeRO-3 the chunks of the module and its
    submodules gathered the backward way. Entered once per recompute (a second backward through
    a retained graph recomputes again)."""

    def __init__(self, chunks: list, dropouts: list, zero: Any, buffers: _Buffers, cache: Any = None):
        self.chunks, self.dropouts, self.zero, self.buffers, self.cache = chunks, dropouts, zero, buffers, cache
        self.saved = [(d.calls, d.microbatch) for d in dropouts]  # taken when the forward runs
        self.now: list = []
        self.after: list = []

    def __enter__(self):
        # every chunk the recompute uses, before it starts: a gather inside it would run ops the
        # forward did not, which selective checkpointing's op cache refuses
        for chunk in self.chunks:
            self.zero._backward_touch(chunk)
        self.now.append([(d.calls, d.microbatch) for d in self.dropouts])
        for d, (calls, micro) in zip(self.dropouts, self.saved):
            d.calls, d.microbatch = calls, micro
            d.replaying += 1
        self.after.append(self.buffers.rewind())
        if self.cache is not None:
            self.cache.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cache is not None:
            self.cache.__exit__(*exc)
        _Buffers.restore(self.after.pop())
        for d, (calls, micro) in zip(self.dropouts, self.now.pop()):
            d.calls, d.microbatch = calls, micro
            d.replaying -= 1
        return False


def _contexts(module: nn.Module, learned: set, chunks: list, mode: str, dropouts: list, zero: Any):
    forward, recompute = None, None
    if mode == "selective":  # the gathers, the counters and the buffers first, outside the op cache
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    buffers = _Buffers(module, learned, forward)
    return buffers, _Replay(chunks, dropouts, zero, buffers, recompute)


def _compiled_contexts(mode: str) -> dict:
    """``checkpoint``'s keywords under ``torch.compile``, which takes torch's own contexts only
    (none, or the selective pair of ``TorchDispatchMode``): the compiled backward recomputes
    from the traced graph, where buffer updates are applied once and nothing is gathered."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "selective":
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}
    return {}  # (dynamo recognizes torch's default only when no context_fn is passed)


def _refuse_cache(path: str, kwargs: dict) -> None:
    for key, value in kwargs.items():
        if "cache_utils" in type(value).__module__ or (key == "use_cache" and value is True):
            raise RuntimeError(
                f"activation_checkpointing recomputes {path!r}, which was called with {key}={type(value).__name__}"
                f"{'' if value is not True else ' (True)'}: its keys and values would be appended to the cache again in "
                "each recompute. Fix: call the model with use_cache=False in training")


def _checkpointed(module: nn.Module, path: str, mode: str, zero: Any) -> Callable:
    """``module.forward`` run under non-reentrant checkpointing (with gradients enabled)."""
    from torch.utils.checkpoint import checkpoint

    from ..random import MeshDropout

    inner = module.forward
    dropouts = [m for m in module.modules() if isinstance(m, MeshDropout)]
    # ZeRO-3: the chunks of the module and its submodules, descending (backward's gather order)
    chunks = {c.index: c for m in module.modules() for c in (zero.module_chunks(m) if zero is not None else ())}
    ordered = [chunks[i] for i in sorted(chunks, reverse=True)]
    buffered = any(b is not None and n not in m._non_persistent_buffers_set
                   for m in module.modules() for n, b in m._buffers.items())
    contexts = functools.partial(_contexts, module, set(), ordered, mode, dropouts, zero)
    # under torch.compile, which takes torch's own contexts only: compiled with them when the
    # recompute needs none of ours, else this call runs eagerly (a graph break), with ours; a
    # compiled recompute updated BatchNorm's statistics a second time (ZeRO-3's gathers break
    # the graph anyway)
    compiled = _compiled_contexts(mode) if not (ordered or buffered or dropouts) else None

    def run(how: dict, args: tuple, kwargs: dict):
        # the module's keywords bound here: checkpoint() would take debug=, determinism_check=, ...
        # as its own. No early stop: the recompute runs the whole forward, so its collectives
        # are the forward's (torch stops after the last saved tensor, which depends on the model)
        return checkpoint(functools.partial(inner, **kwargs) if kwargs else inner, *args, use_reentrant=False,
                          early_stop=False, **how)

    eager = torch.compiler.disable(run)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        _refuse_cache(path, kwargs)
        if torch.compiler.is_compiling():
            return run(compiled, args, kwargs) if compiled is not None else eager({"context_fn": contexts}, args, kwargs)
        return run({"context_fn": contexts}, args, kwargs)

    return forward


def apply_activation_checkpointing(root: nn.Module, choices: tuple[tuple[str, str], ...], zero: Any = None) -> list[str]:
    """Make each chosen module of ``root`` recompute its forward in backward (non-reentrant
    ``torch.utils.checkpoint`` around its ``forward``; its hooks, paths and names unchanged).

    Args:
        root: the lowered module (a pipeline stage holds only its own layers: the others are
            skipped).
        choices: ``(module path, mode)`` pairs from the plan.
        zero: the :class:`~shardlib.parallel.zero.ZeroRuntime` (under ZeRO-3 a recompute gathers
            the module's own chunks first).

    Returns:
        The paths installed.
    """
    installed = []
    for path, mode in choices:
        try:
            module = root.get_submodule(path)
        except AttributeError:
            continue  # another pipeline stage's
        module.forward = _checkpointed(module, path, mode, zero)
        installed.append(path)
    return installed


def warn_selective_offload(recompute: tuple[tuple[str, str], ...], offload_ratio: float) -> None:
    """Warn (``UserWarning``) when activation offload meets selective recompute: the kept matmul
    outputs stay on the device (see the message)."""
    if offload_ratio and any(mode == "selective" for _, mode in recompute):
        import warnings

        warnings.warn(
            "offload_ratio with activation_checkpointing 'selective': the matrix multiplications' outputs that "
            "selective recompute keeps are held by torch's checkpoint cache (create_selective_checkpoint_contexts), "
            "which the activation offload's saved-tensor hooks do not see: they stay on the device and are not in "
            "smodel.activation_offload.stats; the offload moves the rest (the blocks' inputs and what lies outside "
            "the recomputed blocks)", UserWarning, stacklevel=4)
