"""The communication of tensor and sequence parallelism, per micro-batch, from the plan alone.

Megatron's analysis (arXiv 1909.08053 section 3; 2205.05198 section 4): a transformer layer
does two all-reduces of the activations ``(tokens, hidden)`` forward and two backward; with
sequence parallelism each becomes an all-gather plus a reduce-scatter of the same payload, so
the volume is unchanged. Every entry here is one collective of ``per_token * tokens`` elements
per micro-batch, where ``tokens`` is the number of tokens in one micro-batch on one rank before
any sequence split, or of ``fixed`` elements once per step: the buckets of gradient sums of
replicated parameters (:mod:`shardlib.parallel.tensor_grads`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .recompute import recompute_paths
from .tensor_grads import grad_sum_buckets

__all__ = ["TPCollective", "tensor_parallel_collectives"]


@dataclass(frozen=True)
class TPCollective:
    """One collective of a tensor-parallel layer per micro-batch.

    Attributes:
        layer: module path (or what the collective serves). phase: ``"forward"`` or
        ``"backward"``. kind: collective kind. axis: the tensor axis. per_token: payload
        elements per token, per micro-batch. (``"recompute"``: a forward collective run again
        in backward by activation checkpointing.) fixed: payload elements of a collective issued
        once per step, independent of tokens (a bucket of parameter gradients). fp32: the
        payload is in at least float32 whatever the activations' dtype (the statistics of
        :func:`~shardlib.parallel.cross_entropy.vocab_parallel_cross_entropy`).
    """

    layer: str
    phase: str
    kind: str
    axis: str
    per_token: int
    fixed: int = 0
    fp32: bool = False

    def payload(self, tokens: int) -> int:
        return self.per_token * tokens + self.fixed


def tensor_parallel_collectives(plan) -> list[TPCollective]:
    """Every tensor/sequence-parallel collective one micro-batch issues under ``plan``."""
    out: list[TPCollective] = []
    sp = plan.sequence_parallel
    mesh_shape = dict(plan.mesh_shape)
    seen_groups: set[str] = set()
    for layer in plan.tp_layers:
        a = layer.axis
        n = mesh_shape[a]
        if layer.kind == "column":
            if layer.group:
                if layer.group not in seen_groups:
                    seen_groups.add(layer.group)
                    if sp:
                        out += [TPCollective(layer.group, "forward", "all_gather", a, layer.in_features),
                                TPCollective(layer.group, "backward", "reduce_scatter", a, layer.in_features)]
                    else:
                        out.append(TPCollective(layer.group, "backward", "all_reduce", a, layer.in_features))
            else:
                if sp and plan.sp_exit:
                    pass  # the exit's all-gather (and its reduce-scatter backward) serve this layer
                elif sp:
                    out += [TPCollective(layer.path, "forward", "all_gather", a, layer.in_features),
                            TPCollective(layer.path, "backward", "reduce_scatter", a, layer.in_features)]
                else:
                    out.append(TPCollective(layer.path, "backward", "all_reduce", a, layer.in_features))
                if layer.output_layer and layer.parallel_output:  # no gather: the loss's three all-reduces of a
                    # number per token (vocab_parallel_cross_entropy without label smoothing, as the reference GPT)
                    out += [TPCollective(layer.path, "forward", "all_reduce", a, 1, fp32=True)] * 3
                elif layer.output_layer:
                    block = -(-layer.out_features // n)
                    out.append(TPCollective(layer.path, "forward", "all_gather", a, block * n))
        elif layer.kind == "row":
            if sp:
                out += [TPCollective(layer.path, "forward", "reduce_scatter", a, layer.out_features),
                        TPCollective(layer.path, "backward", "all_gather", a, layer.out_features)]
            else:
                out.append(TPCollective(layer.path, "forward", "all_reduce", a, layer.out_features))
        elif layer.kind == "vocab":
            out.append(TPCollective(layer.path, "forward", "all_reduce", a, layer.out_features))
        else:  # embed_dim
            block = -(-layer.out_features // n)
            out.append(TPCollective(layer.path, "forward", "all_gather", a, block * n))
    if sp and plan.tp_layers:
        a = plan.tp_layers[0].axis
        hidden = next((layer.in_features for layer in plan.tp_layers if layer.kind == "column"),
                      plan.tp_layers[0].out_features)  # a pipeline stage of embeddings only: their width
        if plan.sp_entry is not None:  # None: a pipeline stage whose input arrives split
            out.append(TPCollective(plan.sp_entry, "backward", "all_gather", a, hidden))
        if plan.sp_exit:  # as tensor_lower lowers it: the backward reduce-scatter only before a
            out.append(TPCollective(plan.sp_exit, "forward", "all_gather", a, hidden))  # TP output layer
            if any(layer.output_layer for layer in plan.tp_layers):
                out.append(TPCollective(plan.sp_exit, "backward", "reduce_scatter", a, hidden))
    if plan.activation_checkpointing:  # a checkpointed module's forward collectives run again in its recompute
        inside = recompute_paths(plan)
        out += [dataclasses.replace(c, phase="recompute") for c in out if c.phase == "forward" and inside(c.layer)]
    if plan.tp_layers:
        a = plan.tp_layers[0].axis
        for chunk, names, numel in grad_sum_buckets(plan):  # once per step, however many micro-batches
            out.append(TPCollective(f"gradient sums of chunk {chunk} ({len(names)} parameters)", "backward", "all_reduce",
                                    a, 0, numel))
    return out
