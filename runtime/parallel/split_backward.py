"""One stage's backward split in two (zero bubble, `autosbp.zero_bubble`): `input_gradients`
(B: the gradients of the stage's inputs, sent upstream at once) and the `WeightGradients` it
leaves for later (W: the weights' gradients, accumulated into `.grad` as a plain backward
would, so gradient sync's hooks fire as usual).

Lives here: the split over torch's autograd graph of one micro-batch. Lives elsewhere: when B
and W run (`autosbp.zero_bubble.zb1_orders`, executed by `runtime.parallel.pipeline`).

How (the method of torch.distributed.pipelining._backward's stage_backward_input /
stage_backward_weight, written anew): the input closure C is every autograd node from which a
stage input's gradient is reached; B runs autograd.grad to the inputs only (it executes C and
nothing else, keeping the graph). A weight's nodes leave C at the nodes of C that also feed the
weight (its intermediates, e.g. the matmul's backward); B's pre-hooks keep the gradients those
nodes received, and W runs backward from them (GradientEdges) to the weights alone, so no node of
C computes its input gradients twice. Weights sharing an intermediate form one group (one
backward call each: each weight's gradient accumulated once); within a group each
intermediate's incoming gradient is clamped to what B kept, so none is counted twice.

Invariants:
- B accumulates nothing into any `.grad`; W accumulates each weight's gradient once.
- Where a weight is reached from a root without passing C (a weight exported to a later stage,
  a term of the loss that no input feeds) or the stage has no input to differentiate (the
  first stage), W is the whole backward restricted to the weights (exact, not split).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradients", "input_gradients"]

Grads = tuple[torch.Tensor | None, ...]


def _node_of(tensor: torch.Tensor) -> Node | None:
    """`tensor`'s autograd node: its grad_fn, or a leaf's gradient accumulator."""
    if tensor.grad_fn is not None or not tensor.requires_grad:
        return tensor.grad_fn
    viewed = tensor.view_as(tensor).grad_fn
    assert viewed is not None, "a leaf that requires grad has a view with a grad_fn"
    return viewed.next_functions[0][0]


@dataclass
class _Group:
    """Weights whose gradients leave the input closure at the same nodes."""

    intermediates: list[Node]
    weights: list[torch.Tensor]
    grads: dict[Node, Grads] = field(default_factory=dict)  # filled by B's pre-hooks


@dataclass
class WeightGradients:
    """What B left for W: the groups (split), or the roots for a whole backward (`whole`)."""

    groups: list[_Group]
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    whole: list[torch.Tensor]  # weights W takes by the whole backward (empty: split)

    def run(self) -> None:
        """Accumulate the weights' gradients (W); the graph is kept (freed with its owners)."""
        if self.whole:
            if self.roots:
                torch.autograd.backward(self.roots, self.root_grads, inputs=self.whole)
            return
        for group in self.groups:
            edges, grads = [], []
            for node in group.intermediates:
                for i, grad in enumerate(group.grads.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            if not edges:
                continue  # no gradient reached the group's weights in this micro-batch
            handles = []
            if len(group.intermediates) > 1:  # one intermediate may feed another: clamp
                for node in group.intermediates:
                    kept = group.grads.get(node)
                    handles.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                torch.autograd.backward(edges, grads, inputs=group.weights, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()


def input_gradients(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """B of one micro-batch: the gradients of `inputs` (None where none reaches one) from
    `roots` seeded with `root_grads`, and what W needs to add the gradients of `weights`."""
    roots, root_grads = list(roots), list(root_grads)
    differentiable = [x for x in inputs if x.requires_grad]
    if not differentiable or not roots:  # nothing to send: W is the whole backward, if any
        trained = [w for w in weights if w.requires_grad]
        return [None] * len(inputs), WeightGradients([], roots, root_grads, trained)
    root_nodes = [n for n in map(_node_of, roots) if n is not None]
    parents = _parents(root_nodes)
    weight_of = {n: w for w in weights if (n := _node_of(w)) is not None and n in parents}
    closure = _closure({n for x in differentiable if (n := _node_of(x)) is not None}, parents)
    groups = _groups(weight_of, closure, parents, set(root_nodes))
    later = WeightGradients(groups or [], roots, root_grads, [])
    if groups is None:
        later.whole = list(weight_of.values())
    handles = [
        node.register_prehook(lambda grads, g=group, n=node: g.grads.__setitem__(n, grads))
        for group in later.groups
        for node in group.intermediates
    ]
    try:
        found = torch.autograd.grad(
            roots, differentiable, root_grads, retain_graph=True, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, differentiable), found, strict=True))
    return [by_input.get(id(x)) for x in inputs], later


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reached from `roots` -> the nodes that send it gradients."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = set(roots), list(roots)
    for root in roots:
        parents.setdefault(root, [])  # a root is reached, with no parent
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _closure(starts: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """`starts` and every node that sends gradients to one of them, transitively."""
    out, stack = set(starts), list(starts)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in out:
                out.add(parent)
                stack.append(parent)
    return out


def _groups(
    weight_of: dict[Node, torch.Tensor],
    closure: set[Node],
    parents: dict[Node, list[Node]],
    roots: set[Node],
) -> list[_Group] | None:
    """The weights grouped by shared intermediates (the nodes of `closure` feeding them), or
    None where a weight is reached from a root outside `closure` (W: the whole backward)."""
    group_of: dict[Node, _Group] = {}
    for node, weight in weight_of.items():
        seen, stack, met = {node}, [node], set()
        while stack:
            current = stack.pop()
            if current in roots and current not in closure:
                return None
            for parent in parents[current]:
                if parent in closure:
                    met.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        merged = _Group(sorted(met, key=id), [weight])
        for other in {id(g): g for n in met if (g := group_of.get(n))}.values():
            merged.intermediates += [n for n in other.intermediates if n not in met]
            merged.weights += other.weights
        for n in merged.intermediates:
            group_of[n] = merged
    return list({id(g): g for g in group_of.values()}.values())
