"""A stage's backward split in two: the input gradient now, the parameter gradients later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv
2401.10241) run a stage's backward as ``I`` (the gradient to the stage input, which the
previous stage waits for) and ``W`` (the parameter gradients, which nothing waits for), so ``W``
can fill the bubble. This works through autograd on any stage built from ordinary modules, as
torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight`` do:

1. :func:`backward_input` walks the graph from the stage output. Nodes from which the stage
   input is reachable form the *input closure*; walking up from each parameter's gradient
   accumulator, the first nodes met in that closure are the parameter's *intermediates* (for a
   ``Linear``: its matmul node, whose inputs are the activation and the weight). Parameters
   sharing intermediates form one group.
2. It runs ``torch.autograd.grad`` to the input only, keeping the graph (``retain_graph``), with
   a hook on each intermediate that keeps the gradient flowing into it: everything ``W`` needs
   to start from there.
3. :meth:`WeightPass.run` runs, per group, a backward from its intermediates (with the kept
   gradients) to its parameters only (``inputs=``), so nothing on the input path is computed
   again and the gradients accumulate into ``.grad`` through the usual accumulators and their
   hooks (ZeRO's packing and reductions see an ordinary backward). Each intermediate's incoming
   gradient is held at the kept value (a node pre-hook, which runs after the tensor hooks): a
   hook on the activation (``h.register_hook(lambda g: 0.5 * g)``) already shaped the kept
   gradient and is not applied twice in effect (it still runs again, so a hook with side
   effects sees two calls), and where a group's intermediates lie on one path (a weight used
   twice in a row) the path between them adds nothing twice. Such a path may run through
   another group's nodes, so then every group's backward keeps the graph (it is freed with the
   weight pass). The groups' backwards count as one backward for ZeRO
   (:meth:`~shardlib.parallel.zero.ZeroRuntime.one_backward`): stage-3 chunks stay gathered
   across them and the end-of-backward work runs once.

Fallbacks, each still exact: a stage whose output is its input (an identity stage) passes the
incoming gradient on; a stage whose input needs no gradient (the first stage: token ids) has
no ``I`` work, and its ``W`` is the whole backward (torch does the same); parameters
the walk does not reach through the input (an output that depends on them directly) get their
gradients in ``W`` by a backward from the stage output restricted to them; a graph holding a
reentrant ``torch.utils.checkpoint`` (which refuses ``torch.autograd.grad``) runs its whole
backward in ``I`` and leaves ``W`` empty.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["WeightPass", "backward_input"]

_REENTRANT = "CheckpointFunctionBackward"


class WeightPass:
    """What a stage's ``I`` leaves for its ``W`` (see the module).

    Attributes:
        groups: ``[(accumulators, intermediates, kept gradients)]`` per parameter group.
        rest: ``(output, gradient, accumulators)`` for parameters ``W`` reaches from the stage
            output (the whole backward on a stage whose input needs no gradient; accumulators
            None: every leaf reached), or None.
    """

    def __init__(self, groups: list, rest: tuple | None):
        self.groups, self.rest = groups, rest

    def run(self, zero: Any) -> None:
        """Accumulate the parameter gradients into ``.grad`` (through their hooks), one backward
        per group, counted as one backward by ``zero`` (a ZeroRuntime)."""
        # a group whose intermediates lie on one path runs through the nodes between them, which may be
        # another group's (a weight used twice around another layer), and the rest runs from the output
        retain = self.rest is not None or any(len(nodes) > 1 for _, nodes, _ in self.groups)
        with zero.one_backward():
            for accs, nodes, kept in self.groups:
                edges, grads = [], []
                for node, got in zip(nodes, kept):
                    for i, g in enumerate(got):
                        if g is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(g)
                if not edges:
                    continue
                # each intermediate takes its kept gradient: the tensor hooks ran on it in I (they run again
                # before this pre-hook), and on one path it is not kept + what flows from the others
                holds = [node.register_prehook(lambda _, got=got: got) for node, got in zip(nodes, kept)]
                try:
                    torch.autograd.backward(edges, grads, retain_graph=retain, inputs=[GradientEdge(a, 0) for a in accs])
                finally:
                    for h in holds:
                        h.remove()
            if self.rest is not None:
                out, grad, accs = self.rest
                torch.autograd.backward(out, grad, inputs=[GradientEdge(a, 0) for a in accs] if accs else None)
        self.groups, self.rest = [], None


def _graph(root) -> tuple[list, dict]:
    """Every node reachable from ``root`` and, for each, the nodes with an edge to it."""
    parents: dict = {root: []}
    order, todo = [root], deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                order.append(child)
                todo.append(child)
            parents[child].append(node)
    return order, parents


def _closure(start, parents: dict) -> set:
    """``start`` and every node above it (from which it is reachable)."""
    seen, todo = {start}, deque([start])
    while todo:
        for up in parents[todo.popleft()]:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def _intermediates(acc, parents: dict, closure: set) -> set:
    """The first nodes of ``closure`` met walking up from accumulator ``acc``."""
    met, seen, todo = set(), {acc}, deque([acc])
    while todo:
        for up in parents[todo.popleft()]:
            if up in closure:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return met


def _groups(accs: list, parents: dict, closure: set) -> tuple[list, list]:
    """``([(accumulators, intermediates)], accumulators met by no intermediate)``: parameters
    sharing an intermediate share a group."""
    owner: dict = {}  # intermediate -> group index
    groups: list[tuple[list, set]] = []
    lone = []
    for acc in accs:
        met = _intermediates(acc, parents, closure)
        if not met:
            lone.append(acc)
            continue
        joined = sorted({owner[n] for n in met if n in owner})
        if not joined:
            groups.append(([acc], set(met)))
            index = len(groups) - 1
        else:
            index = joined[0]
            for other in joined[1:]:  # merge the groups this parameter links
                groups[index][0].extend(groups[other][0])
                groups[index][1].update(groups[other][1])
                groups[other] = ([], set())
            groups[index][0].append(acc)
            groups[index][1].update(met)
        for n in groups[index][1]:
            owner[n] = index
    return [(a, list(n)) for a, n in groups if a], lone


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor) -> tuple[torch.Tensor | None, WeightPass]:
    """The ``I`` of a split backward (see the module): the gradient of ``out`` (with incoming
    gradient ``grad``; None for a scalar loss) with respect to ``inp`` only, and the
    :class:`WeightPass` that finishes the backward.

    Args:
        out: the stage output (local shape of the boundary activation) or its scaled loss.
        grad: the gradient arriving from the next stage (``out``'s shape), or None.
        inp: the stage input, a leaf (requires grad when the input carries one).

    Returns:
        ``(input gradient or None, weight pass)``; None when ``inp`` needs no gradient or
        ``out`` does not depend on it (the caller sends zeros).
    """
    root = out.grad_fn
    if root is None:
        if out is inp:  # an identity stage: the gradient passes through
            return grad, WeightPass([], None)
        # a leaf needing a gradient (a parameter returned as it is) gets it in W; else nothing does
        return None, WeightPass([], (out, grad, None) if out.requires_grad else None)
    order, parents = _graph(root)
    if any(node.name().endswith(_REENTRANT) for node in order):  # refuses autograd.grad: the whole backward now
        torch.autograd.backward(out, grad)
        return inp.grad if inp.requires_grad else None, WeightPass([], None)
    accs = [n for n in order if n.name() == "torch::autograd::AccumulateGrad"]
    source = next((n for n in accs if n.variable is inp), None)
    accs = [n for n in accs if n is not source and n.variable.requires_grad]
    if source is None:  # the input needs no gradient: W is the whole backward
        return None, WeightPass([], (out, grad, accs) if accs else None)
    closure = _closure(source, parents)
    groups, lone = _groups(accs, parents, closure)
    kept: dict = {}
    hooks = [node.register_prehook(lambda g, node=node: kept.__setitem__(node, g))
             for _, nodes in groups for node in nodes]
    try:
        (dinp,) = torch.autograd.grad(out, inp, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    weight = [(a, nodes, [kept.get(n, ()) for n in nodes]) for a, nodes in groups]
    return dinp, WeightPass(weight, (out, grad, lone) if lone else None)
