"""The peak memory per rank of a training step, predicted from the plan before launch.

``plan.explain(tokens=..., activation_checkpointing=...)`` and :func:`estimate_peak` add up what
a rank holds at the start of backward, where a step peaks (every activation is still saved and
the gradients begin to arrive):

- **model state** that lives through the step: parameters and optimizer state as the plan stores
  them (``plan.param_bytes``, ``plan.optimizer_bytes``; gradients are released at ``zero_grad``);
- **gathered chunks** (ZeRO-3): the largest set a forward holds, the prefetched chunk and the
  tied chunk included (:func:`shardlib.chunking.gathered_peak`); backward holds the same set
  at its start (the top chunk, the next one prefetched, the tied one);
- **gradients in flight**: at stages 0-1 the top chunk's unreduced buffer (allocated whole at
  its first gradient); at stages 2-3 none yet (a chunk's gradients wait in autograd's tensors
  until it is packed, and grow while its block's activations are freed). At the end of
  backward instead: every gradient buffer (stages 0-1) or every reduced shard plus the last
  chunk being packed (stages 2-3); the estimate is the larger moment;
- **activations**: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198, section 4.1), per transformer layer and token
  ``h (34 + 5 a s / h)`` bytes in 16-bit, counted term by term for the model as built
  (:func:`block_elements`), divided by ``t`` under tensor + sequence parallelism (plus the all-gathered input of each
  column-layer group, which shardlib keeps whole for backward where Megatron-LM keeps the
  shard and gathers again); only each
  block's input under full recompute; plus the head (final norm input and output, the
  log-softmax output over the vocabulary). A pipeline stage holds the microbatches its
  schedule keeps in flight (1F1B: ``p - r`` on stage ``r``, GPipe: all ``m``);
- **workspace**: the gradients flowing through one block's MLP at that moment (its output and
  its hidden activation's gradient, ``T (h + ffn)`` elements).

Under recompute a third kind of moment can be the highest: the backward of a lower block, which
holds its rebuilt activations while the gradients of the chunks above it are reduced
(:func:`_block_moments`). And with few tokens per step the optimizer step is: the gradients it
reads plus its update's temporaries (:func:`_step_temporaries`). The estimate is the largest
moment, and names it.

Modelled: :class:`shardlib.models.GPT` (its config gives width, heads, MLP width, vocabulary,
dropout; attention through ``scaled_dot_product_attention``, a fused kernel that keeps no
``s x s`` probabilities). Another model gets no activation estimate (the explanation says so)
rather than a wrong one. Units: bytes per rank; tokens per microbatch per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ActivationShape", "PeakEstimate", "activation_shape", "block_elements", "estimate_peak"]


@dataclass(frozen=True)
class ActivationShape:
    """What the activation formula needs from the model, recorded at plan time.

    Attributes:
        hidden: ``h``, the residual stream width. heads: ``a``. ffn: the MLP hidden width.
        vocab: the vocabulary (the log-softmax output's width). block_paths: the transformer
        blocks this plan holds (a pipeline stage: its own). head: whether it holds the final norm and the
        LM head. dropout: any dropout probability above 0 (the formula's masks are saved).
        element_size: bytes per activation element (the compute dtype's).
    """

    hidden: int
    heads: int
    ffn: int
    vocab: int
    block_paths: tuple[str, ...]  # the blocks held, in order (which of them recompute: the plan's option)
    head: bool
    dropout: bool
    element_size: int = 4

    @property
    def blocks(self) -> int:
        return len(self.block_paths)

    @property
    def first_block(self) -> str:
        """The first block held (its tensor-parallel layers stand for every block's), or ``""``."""
        return self.block_paths[0] if self.block_paths else ""


def activation_shape(model: nn.Module, param_names: list[str], blocks: list[str], element_size: int) -> ActivationShape | None:
    """The :class:`ActivationShape` of ``model`` (the whole model) restricted to ``param_names``
    (a pipeline stage's), or None for a model the formula does not model (see the module).
    ``blocks``: the model's transformer block paths."""
    from .models.gpt import GPT

    if not isinstance(model, GPT):
        return None
    cfg = model.config
    held = [b for b in blocks if any(n.startswith(b + ".") for n in param_names)]
    return ActivationShape(hidden=cfg.n_embd, heads=cfg.n_head, ffn=int(cfg.mlp_ratio * cfg.n_embd), vocab=cfg.vocab_size,
                           block_paths=tuple(held), head=any(n.startswith(("ln_f.", "lm_head.")) for n in param_names),
                           dropout=cfg.dropout > 0 or cfg.attn_dropout > 0, element_size=element_size)


def block_elements(shape: ActivationShape) -> float:
    """Elements one transformer block saves per token without recompute, Korthikanti et al.'s
    terms (their 34 + 5as/h bytes in 16-bit) for a pre-norm GPT block with fused attention:
    attention 6 h (the norm's input, the QKV projection's input, Q, K, V, the output
    projection's input), MLP ``2 h + 2 ffn`` (the norm's input, the first linear's input, the
    activation's input and output); with dropout, a 1-byte mask per residual dropout
    (``2 h`` bytes). No ``a s^2`` term: the fused kernel keeps only a log-sum-exp per row.
    16 h at ``ffn = 4 h`` without dropout."""
    h, f = shape.hidden, shape.ffn
    masks = 2 * h / shape.element_size if shape.dropout else 0.0
    return 6 * h + 2 * h + 2 * f + masks


@dataclass(frozen=True)
class PeakEstimate:
    """Predicted peak bytes per rank of one training step, by term (see the module)."""

    state: int
    gathered: int
    grads: int
    activations: int
    workspace: int
    microbatches: float  # activations of this many microbatches are held at the peak (a pipeline's stash over v)
    tokens: int
    moment: str = "start of backward"  # "end of backward" or "backward of <block>": where the step peaks

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.grads + self.activations + self.workspace

    def lines(self) -> list[str]:
        from .explain_summary import human

        parts = (("model state", self.state), ("gathered chunks", self.gathered), ("gradients in flight", self.grads),
                 (f"activations ({self.microbatches:g} microbatch{'es' if self.microbatches != 1 else ''})", self.activations),
                 ("optimizer temporaries" if self.moment == "optimizer step" else "workspace", self.workspace))
        return [f"peak per rank (predicted, {self.tokens} tokens per microbatch, at the {self.moment}): {human(self.total)} = "
                + " + ".join(f"{k} {human(v)}" for k, v in parts if v),
                f"  bytes: {self.total:,} (Korthikanti et al. 2022 activations; see shardlib.memory_estimate)"]


def _block_modes(plan, shape: ActivationShape, activation_checkpointing: Any) -> list[str | None]:
    """Each held block's recompute (``"full"``, ``"selective"`` or None) under the plan's option,
    or under ``activation_checkpointing`` when given: False (none), ``"full"``, ``"selective"``
    (every block) or an int ``k`` (full recompute of blocks ``k, 2k, ...``, counting from 1).

    Raises:
        ValueError: another ``activation_checkpointing``.
    """
    n = shape.blocks
    if activation_checkpointing is None:
        chosen = dict(plan.activation_checkpointing)
        return [chosen.get(path) for path in shape.block_paths]
    if activation_checkpointing is False:
        return [None] * n
    if activation_checkpointing in ("full", "selective"):
        return [activation_checkpointing] * n
    if isinstance(activation_checkpointing, int) and not isinstance(activation_checkpointing, bool) and activation_checkpointing >= 1:
        return ["full" if (i + 1) % activation_checkpointing == 0 else None for i in range(n)]
    raise ValueError(f"peak estimate: activation_checkpointing must be None (the plan's own), False, 'full', 'selective' or "
                     f"an int k >= 1 (every k-th block), got {activation_checkpointing!r}")


def estimate_peak(plan, tokens: int, activation_checkpointing: Any = None, in_flight: float = 1,
                  accumulating: bool = False) -> PeakEstimate | None:
    """The predicted peak per rank of a step of ``plan`` (a :class:`~shardlib.plan.Plan`; a
    pipeline stage's plan with ``in_flight`` microbatches held), or None when the model's
    activations are not modelled (:func:`activation_shape`).

    The larger of two moments (see the module for the terms): the start of backward (every
    activation saved, one chunk's gradients, under full recompute the top block's activations
    rebuilt) and the end of backward (stages 0-1: every chunk's gradient buffer, reduced in
    place; stages 2-3: every reduced shard, plus the last chunk's buffer and its gradients
    being packed into it). With ``accumulating`` (a pipeline's microbatches: gradients
    accumulate unreduced until the step's last backward) every chunk's unreduced buffer is
    alive from the first backward on, so at the first moment too.

    Args:
        plan: the plan.
        tokens: tokens per microbatch per rank (local batch x sequence length / microbatches).
        activation_checkpointing: ``"full"``, ``"selective"``, ``False`` (none) or None (the
            plan's own option).
        in_flight: microbatches whose activations are held at once (a pipeline schedule's).
        accumulating: gradients accumulate over several backwards before one reduction.

    Raises:
        ValueError: ``tokens`` not a positive int.
    """
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ValueError(f"estimate_peak: tokens must be a positive int (tokens per microbatch per rank), got {tokens!r}")
    shape = plan.activation_shape
    if shape is None:
        return None
    from .chunking import gathered_peak

    mesh = dict(plan.mesh_shape)
    tp = max((mesh[layer.axis] for layer in plan.tp_layers), default=1)
    sp = plan.sequence_parallel and tp > 1
    e, h = shape.element_size, shape.hidden
    modes = _block_modes(plan, shape, activation_checkpointing)
    full_block = block_elements(shape)
    if sp:  # Korthikanti's 34sbh/t, plus what shardlib keeps whole: the gathered input of each group of
        # column layers (one all-gather per input, shared by its readers), where Megatron keeps the shard
        groups = {layer.group or layer.path: layer.in_features for layer in plan.tp_layers
                  if layer.kind == "column" and shape.first_block and layer.path.startswith(shape.first_block + ".")}
        full_block = full_block / tp + sum(n - n / tp for n in groups.values())
    elif tp > 1:  # the norms' inputs and outputs stay whole
        full_block = (full_block - 4 * h) / tp + 4 * h
    split = tp if sp else 1
    # full recompute keeps a block's input; selective also its matmul outputs (q, k, v, the
    # attention projection, both MLP linears: 5 h + ffn, over t under tensor parallelism)
    kept = {None: full_block, "full": h / split, "selective": h / split + (5 * h + shape.ffn) / tp}
    parallel_logits = any(layer.parallel_output for layer in plan.tp_layers)
    head = (2 * h + shape.vocab / (tp if parallel_logits else 1)) if shape.head else 0.0
    activations = tokens * (sum(kept[m] for m in modes) + head) * e * in_flight
    # a recomputed block's backward holds its activations again: what it did not keep, rebuilt
    rebuilt = tokens * max((full_block - kept[m] for m in modes if m), default=0.0) * e
    stage = plan.effective_stage
    gathered = 0
    if stage == 3 and plan.chunks:
        chunks = [{"numel": c.numel, "units": list(c.units), "tied": not c.reshard_after_forward,
                   "itemsize": c.compute_element_size} for c in plan.chunks]
        gathered = gathered_peak(chunks, plan.data_size, [p.unit for p in plan.params])
    trainable = [c for c in plan.chunks if c.requires_grad]
    unreduced = [c.padded_numel * c.element_size for c in trainable]
    one = max(unreduced, default=0)
    if stage <= 1:
        at_end = sum(unreduced)
    else:
        at_end = sum(c.shard_numel * c.element_size for c in trainable) + 2 * one
    workspace = tokens * (h + shape.ffn) / (tp if sp else 1) * e if shape.blocks else 0.0
    # parameters and optimizer state on the device (plan.device_state_bytes less its gradients,
    # which are released at zero_grad and counted above as in flight)
    state = plan.device_state_bytes - (plan.grad_bytes - plan.offloaded_shard_bytes(trainable=True))
    # at the start of backward: stages 0-1 allocate the top chunk's whole buffer at its first
    # gradient; at stages 2-3 a chunk's gradients wait in autograd's tensors until it is packed
    # (Chunk.defer), growing as the block's activations are freed, so about none are held yet
    grads_start = sum(unreduced) if accumulating else (one if stage <= 1 else 0)
    start = activations + rebuilt + grads_start
    moments = [(start, "start of backward", grads_start, activations + rebuilt)]
    if not accumulating:
        moments.append((at_end, "end of backward", at_end, 0.0))
    if any(modes) and shape.blocks > 1:  # a lower block's backward can be higher than the start (see _block_moments)
        moments += _block_moments(plan, shape, modes, kept, full_block, tokens * e, in_flight, accumulating, stage)
    # (gathered chunks and the MLP workspace at every backward moment)
    moments = [(total + gathered + workspace, moment, grads, acts, gathered, workspace)
               for total, moment, grads, acts in moments]
    step_grads = sum(unreduced) if stage <= 1 else sum(c.shard_numel * c.element_size for c in trainable)
    temporaries = _step_temporaries(plan, trainable, stage)
    moments.append((step_grads + temporaries, "optimizer step", step_grads, 0.0, 0, temporaries))
    _, moment, grads, acts, gathered, workspace = max(moments, key=lambda m: m[0])
    return PeakEstimate(state=state, gathered=int(gathered), grads=int(grads), activations=int(round(acts)),
                        workspace=int(workspace), microbatches=in_flight, tokens=tokens, moment=moment)


def _step_temporaries(plan, trainable: list, stage: int) -> int:
    """Bytes the optimizer step allocates on the device beyond its state, for the AdamW that
    :class:`~shardlib.ZeroOptimizer` runs (torch.optim.AdamW becomes
    :class:`shardlib.kernels.FusedAdamW`): on the CPU torch's single-tensor update block by block
    (:data:`~shardlib.kernels.adamw.CPU_BLOCK` elements), whose ``sqrt(v)`` and its quotient are
    both alive: two blocks of the largest tensor it updates (stage 0: a whole chunk, else this
    rank's shard); on CUDA one fused pass with none (a plan on an AbstractMesh: a cluster's).
    None with the optimizer state on the host (ZeRO-Offload). Measured on the CPU: the whole
    difference on a state-heavy step (ZeRO-0, 16 tokens: 0.83 of the measured peak without it,
    1.000 with it)."""
    if plan.optimizer_offload or not trainable:
        return 0
    device = getattr(getattr(plan, "mesh", None), "device", None)
    if device is None or getattr(device, "type", device) != "cpu":
        return 0
    from .kernels.adamw import CPU_BLOCK

    return 2 * max(min(c.padded_numel if stage == 0 else c.shard_numel, CPU_BLOCK) * c.element_size for c in trainable)


def _block_moments(plan, shape: ActivationShape, modes: list, kept: dict, full_block: float, token_bytes: float,
                   in_flight: float, accumulating: bool, stage: int) -> list[tuple[float, str, float, float]]:
    """``(activations + gradients, moment, gradients, activations)`` in bytes at the backward of
    each held block that recomputes (under recompute, the peak can move there: measured on the
    quick GPT at ZeRO-3 with full recompute, at the lower block's recomputed MLP backward, 0.6 MiB
    above the start of backward). At block ``i``'s backward a rank holds what every block up to
    ``i`` kept, block ``i``'s rebuilt activations, the other microbatches in flight (whole), and
    the gradients of the chunks whose units run after block ``i``: at stages 0-1 their unreduced
    buffers and block ``i``'s own (allocated whole at its first gradient), at stages 2-3 their
    reduced shards plus the unreduced buffer of the last one packed (in flight); the tied
    chunk's buffer counts from the head's backward on."""
    order = {u: i for i, u in enumerate(dict.fromkeys(p.unit for p in plan.params))}
    trainable = [c for c in plan.chunks if c.requires_grad]
    first = [min((order.get(u, 0) for u in c.units), default=0) for c in trainable]
    unreduced = [c.padded_numel * c.element_size for c in trainable]
    held = sum(kept[m] for m in modes)
    others = (in_flight - 1) * token_bytes * held  # the stash: other microbatches keep what they saved
    out = []
    below = 0.0
    for path, mode in zip(shape.block_paths, modes):
        below += kept[mode]
        if not mode:
            continue
        at = [i for u, i in order.items() if u == path or u.startswith(path + ".")]
        lo, hi = (min(at), max(at)) if at else (0, 0)
        acts = others + token_bytes * (below + full_block - kept[mode])
        if accumulating:
            grads = sum(unreduced)
        elif stage <= 1:
            grads = sum(b for b, f, c in zip(unreduced, first, trainable) if f >= lo or not c.reshard_after_forward)
        else:
            done = [(f, c.shard_numel * c.element_size, b) for f, c, b in zip(first, trainable, unreduced)
                    if f > hi and c.reshard_after_forward]
            grads = sum(d[1] for d in done) + (min(done)[2] if done else 0)  # the last one packed: in flight
        out.append((acts + grads, f"backward of {path}", grads, acts))
    return out
