"""The benchmarks' "theory": the papers' closed formulas on the model's own shapes, and where the
plan deliberately differs from them.

A theory column is only worth something if it is *not* the code under test: these formulas are
written from the papers, on the parameter count and shapes of the model, and never call the
plan's cost model (:mod:`shardlib.cost`). What the plan does differently on purpose (padding a
chunk to a multiple of the data-axis size, keeping a chunk gathered from forward to backward,
sequence-parallel region ends, gathering the logits) is itemized from the plan's recorded
choices as "plan - paper", each item with its reason, so that

    counted bytes == paper formula + (plan - paper)

is a check of the whole account, and ``counted / paper`` says how far the implementation is
from the formula.

Units: bytes per rank per step, the per-rank ring figures of the ZeRO paper (all-reduce of
``B`` bytes over ``N`` ranks: ``2 B (N-1)/N``; all-gather of a ``B``-byte output or
reduce-scatter of a ``B``-byte input: ``B (N-1)/N``), as :mod:`shardlib.mesh.comm` counts.
Values are exact :class:`~fractions.Fraction` s.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["zero_paper_bytes", "zero_plan_differences", "megatron_paper_bytes", "tp_plan_differences",
           "zero_state_formula", "ring", "theory_entry"]


def ring(kind: str, payload_bytes, n: int) -> Fraction:
    """Per-rank bytes of one ring collective (ZeRO arXiv 1910.02054 section 7): ``all_reduce``
    ``2 B (N-1)/N``; ``all_gather`` (``B`` the gathered output) and ``reduce_scatter`` (``B`` the
    input) ``B (N-1)/N``. Written out here, not taken from shardlib."""
    if n <= 1:
        return Fraction(0)
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[kind]
    return Fraction(factor * (n - 1), n) * payload_bytes


# -- ZeRO --------------------------------------------------------------------------------------


def zero_paper_bytes(stage: int, n_params: int, n: int, gather_itemsize: int = 4, reduce_itemsize: int | None = None) -> Fraction:
    """Per-rank bytes per step of ZeRO data parallelism (Rajbhandari et al., arXiv 1910.02054,
    section 7), ``Ψ`` the model's parameters in bytes of the dtype each collective moves.

    * stage 0 (DDP): one all-reduce of the gradients, ``2Ψ(N-1)/N``;
    * stages 1-2: a reduce-scatter of the gradients ``Ψ(N-1)/N`` and an all-gather of the
      updated parameters ``Ψ(N-1)/N`` (the same ``2Ψ(N-1)/N``);
    * stage 3: an all-gather of the parameters in forward, another in backward and a
      reduce-scatter of the gradients: ``3Ψ(N-1)/N``.

    Args:
        stage: ZeRO stage 0-3.
        n_params: trainable parameter elements of the model (a tied tensor once).
        n: data-parallel ranks ``N``.
        gather_itemsize: bytes per element of the parameters all-gathered (4: fp32; 2 with
            bf16 compute copies).
        reduce_itemsize: bytes per element of the gradients reduced (default ``gather_itemsize``).

    Returns:
        Bytes per rank per step (exact).
    """
    g = gather_itemsize
    r = g if reduce_itemsize is None else reduce_itemsize
    if stage == 0:
        return ring("all_reduce", n_params * r, n)
    if stage in (1, 2):
        return ring("reduce_scatter", n_params * r, n) + ring("all_gather", n_params * g, n)
    if stage == 3:
        return 2 * ring("all_gather", n_params * g, n) + ring("reduce_scatter", n_params * r, n)
    raise ValueError(f"zero_paper_bytes: stage must be 0-3, got {stage!r}")


def zero_plan_differences(plan) -> list[tuple[str, Fraction]]:
    """What a ZeRO plan communicates beyond (or short of) :func:`zero_paper_bytes`, from the
    plan's own choices, item by item: ``[(why, bytes per rank per step)]`` (items of 0 bytes
    left out).

    * padding: each chunk is padded to a multiple of ``N`` elements (``padded_numel``), and the
      padding travels in every pass over the chunk;
    * kept gathered (stage 3): a chunk with ``reshard_after_forward`` False (the one holding the
      embedding tied to the LM head) stays gathered from its forward gather to the end of
      backward, so its backward all-gather is not issued;
    * frozen chunks (stage 3): gathered like the others, but not counted in the paper's ``Ψ``
      (trainable parameters) and never reduced.
    """
    n = plan.data_size
    stage = plan.zero_stage
    padding = kept = frozen = Fraction(0)
    kept_names: list[str] = []
    if n <= 1:
        return []
    for c in plan.chunks:
        g, r = c.compute_element_size, c.reduce_element_size
        gathers = (2 if c.reshard_after_forward else 1) if stage == 3 else (1 if stage in (1, 2) else 0)
        if not c.requires_grad:
            if stage == 3:
                frozen += gathers * ring("all_gather", c.padded_numel * g, n)
            continue
        per_element = gathers * ring("all_gather", g, n) + ring("all_reduce" if stage == 0 else "reduce_scatter", r, n)
        padding += (c.padded_numel - c.numel) * per_element
        if stage == 3 and not c.reshard_after_forward:
            kept -= ring("all_gather", c.numel * g, n)
            kept_names.append(f"chunk {c.index} ({c.params[0]}{', ...' if len(c.params) > 1 else ''}: {c.numel} elements)")
    out = []
    if padding:
        out.append(("padding: chunks padded to a multiple of N elements, in every pass", padding))
    if kept:
        out.append(("kept gathered forward->backward (reshard_after_forward False, as FSDP2's root): no backward "
                    "all-gather of " + "; ".join(kept_names), kept))
    if frozen:
        out.append(("frozen chunks: gathered at stage 3, not in the paper's trainable psi", frozen))
    return out


def zero_state_formula(stage: int, psi: int, n: int, itemsize: int = 4, k: int = 2) -> int:
    """ZeRO's model-state bytes per rank (arXiv 1910.02054, section 5.1) for fp32 training:
    parameters ``P = itemsize * psi``, gradients ``G = P``, optimizer ``O = k * P`` (AdamW: 2);
    stage 0 keeps all, 1 divides O by N, 2 divides G + O, 3 divides everything."""
    p = itemsize * psi
    g, o = p, k * p
    if stage == 0:
        return p + g + o
    if stage == 1:
        return p + g + o // n
    if stage == 2:
        return p + (g + o) // n
    return (p + g + o) // n


# -- Megatron tensor (and sequence) parallelism ------------------------------------------------


def megatron_paper_bytes(n_layer: int, tokens: int, hidden: int, t: int, itemsize: int = 4,
                         vocab_parallel_embedding: bool = False, parallel_head: bool = False,
                         loss_itemsize: int = 4) -> Fraction:
    """Per-rank bytes of tensor parallelism for one micro-batch (forward and backward).

    * every transformer layer: 4 all-reduces of ``(b s, h)`` activations, 2 forward (after the
      attention and the MLP row-parallel layers, Megatron's ``g``) and 2 backward (at their
      column-parallel inputs, ``f``): Shoeybi et al., arXiv 1909.08053, section 3, figure 4.
      With sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter of
      the same tensor (Korthikanti et al., arXiv 2205.05198, section 4.2.2), the same bytes, so
      this figure covers both;
    * a vocabulary-parallel input embedding: one all-reduce of ``(b s, h)`` in forward
      (1909.08053 section 3, "input embedding");
    * a vocabulary-parallel output layer: one all-reduce of its ``(b s, h)`` input gradient in
      backward, and the loss fused with the split logits (1909.08053 section 3: communicating
      ``b s`` values instead of the ``b s v`` logits) as Megatron-LM's
      ``_VocabParallelCrossEntropy`` does it: three all-reduces of ``b s`` fp32 values (the
      maximum, the target logit, the sum of exponentials).

    Args:
        n_layer: transformer layers. tokens: ``b s``, tokens of one micro-batch on one rank
            before any sequence split. hidden: ``h``. t: tensor-parallel ranks.
        itemsize: bytes per activation element. loss_itemsize: bytes per loss statistic.
        vocab_parallel_embedding, parallel_head: whether the model splits them (the benchmark's
            :func:`shardlib.models.tp_specs` keeps both replicated).

    Returns:
        Bytes per rank per micro-batch (exact).
    """
    act = tokens * hidden * itemsize
    total = n_layer * 4 * ring("all_reduce", act, t)
    if vocab_parallel_embedding:
        total += ring("all_reduce", act, t)
    if parallel_head:
        total += ring("all_reduce", act, t) + 3 * ring("all_reduce", tokens * loss_itemsize, t)
    return total


def tp_plan_differences(plan, tokens: int, loss_itemsize: int = 4) -> list[tuple[str, Fraction]]:
    """What a tensor-parallel plan communicates beyond :func:`megatron_paper_bytes` for one
    micro-batch, from the plan's choices (its sequence-parallel region and its layers), item by
    item: ``[(why, bytes per rank)]``.

    * sequence-parallel region ends: splitting at the entry is free in forward, its backward
      all-gathers ``(b s, h)``; the exit (``sp_exit``) all-gathers ``(b s, h)`` in forward, and
      in backward, before a replicated head, takes its slice of the gradient, which is the same
      on every rank (Megatron-LM's ``scatter_to_sequence_parallel_region`` and
      ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``; measured: the
      counted bytes have no reduce-scatter there). Before a split head the exit's all-gather and
      its backward reduce-scatter stand in for the head's input all-reduce the paper counts: no
      difference;
    * gradient sums of the parameters replicated over the axis but used on sequence shards
      (norm weights and row-parallel biases: ``plan.sp_grad_params``), one all-reduce each
      (Megatron-LM sums them too, ``_allreduce_layernorm_grads``);
    * a split output layer whose logits are all-gathered (``(b s, v)``, padded to a multiple of
      ``t``), where the paper fuses the loss with the split logits (three ``b s`` all-reduces).
    """
    if not plan.tp_layers:
        return []
    t = dict(plan.mesh_shape)[plan.tp_layers[0].axis]
    itemsize = plan.params[0].dtype.itemsize if plan.params else 4
    act_size = plan.param_dtype.itemsize if plan.param_dtype is not None else itemsize
    grad_size = plan.reduce_dtype.itemsize if plan.reduce_dtype is not None else itemsize
    hidden = next((layer.in_features for layer in plan.tp_layers if layer.kind == "column"), plan.tp_layers[0].out_features)
    act = tokens * hidden * act_size
    heads = [layer for layer in plan.tp_layers if layer.kind == "column" and layer.output_layer]
    out = []
    if plan.sequence_parallel:
        if plan.sp_entry:
            out.append((f"SP entry at {plan.sp_entry!r}: backward all-gather of (tokens, hidden)", ring("all_gather", act, t)))
        if plan.sp_exit and not heads:
            out.append((f"SP exit at {plan.sp_exit!r} (replicated head): forward all-gather of (tokens, hidden); its "
                        "backward takes the local slice of a replicated gradient", ring("all_gather", act, t)))
        sums = [p for p in plan.params if p.name in plan.sp_grad_params]
        if sums:
            out.append((f"SP gradient sums of {len(sums)} replicated norm/bias tensors ({sum(p.numel for p in sums)} "
                        "elements), one all-reduce each", sum((ring("all_reduce", p.numel * grad_size, t) for p in sums),
                                                              Fraction(0))))
    for head in heads:
        padded = -(-head.out_features // t) * t
        out.append((f"logits of {head.path!r} all-gathered ({padded} columns) instead of the paper's fused loss "
                    "(3 all-reduces of b s)", ring("all_gather", tokens * padded * act_size, t)
                    - 3 * ring("all_reduce", tokens * loss_itemsize, t)))
    return [(why, b) for why, b in out if b]


def theory_entry(paper: Fraction, formula: str, items: list[tuple[str, Fraction]], predicted: float | None = None) -> dict:
    """The communication part of a row's ``theory``: ``bytes_rank0`` the paper's figure (what
    ``counted / paper`` divides by), ``plan_minus_paper`` and its ``plan_minus_paper_items``
    (``[why, bytes]``), ``expected_exact`` = paper + (plan - paper) as an exact fraction (the
    counted bytes must equal it), and, given the plan's own prediction (``plan_bytes``, from
    :func:`shardlib.cost.comm_per_step`), ``unexplained_bytes``: what that cost model predicts
    beyond paper + items (0 when it agrees with this account; the table prints it otherwise)."""
    diff = sum((b for _, b in items), Fraction(0))
    out = {"bytes_rank0": float(paper), "paper_exact": str(paper), "bytes_formula": formula,
           "plan_minus_paper": float(diff), "plan_minus_paper_items": [[why, float(b)] for why, b in items],
           "expected_bytes": float(paper + diff), "expected_exact": str(paper + diff)}
    if predicted is not None:
        out["plan_bytes"] = predicted
        out["unexplained_bytes"] = predicted - float(paper + diff)
    return out
