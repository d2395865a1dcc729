"""Megatron's sequence parallelism as a restriction of the space (`megatron:...,sp=1`).

Lives here: `split_candidates` (of an op's candidates, those sequence parallelism allows: none
that computes replicated on the tp mesh dim, where the op reads the model's data and can do
otherwise) and `data_nodes`. Lives elsewhere: the hand plan's parsing (`space.strategy`), the
rest of what `sp=1` pins, priced on edges (`problem.priced.Priced.sequence_parallel`: no
activation all-reduced on tp, every kept copy a contraction reads gathered re-gathered in
backward: `timing.regather`), the runtime's re-gather (`runtime.parallel.regather`).

Model (Korthikanti et al. 2022, section 4.2.2): between tensor-parallel regions (norms, dropout,
residual adds) the activations are split along the sequence on the tp devices instead of
replicated, so each device computes and keeps 1/t of them; an all-gather brings the whole
sequence to a column-parallel linear, and a reduce-scatter (not an all-reduce) takes a
row-parallel linear's partial sums back to the split. Here the split's dim is the ILP's choice
among the op's rows (the sequence, or the batch where it divides: the same bytes), and what no
row can split (the loss, a scalar) stays whole. Ops that do not read the data (positions,
rotary tables, masks made from shapes) are left free: they are small and alike on every device.
"""

from __future__ import annotations

import networkx as nx

from autosbp.capturing.graph import OpGraph, Role
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast

__all__ = ["data_nodes", "split_candidates"]


def data_nodes(graph: OpGraph) -> frozenset[str]:
    """The compute nodes that read the model's data: reachable from a user input."""
    found: set[str] = set()
    for name, _ in graph.nodes(Role.INPUT):
        found |= nx.descendants(graph.graph, name)
    return frozenset(n for n in found if graph.node(n).role is Role.COMPUTE)


def split_candidates(
    graph: OpGraph, name: str, candidates: tuple[NdSignature, ...], data: frozenset[str]
) -> list[int]:
    """The indices of `candidates` of node `name` that sequence parallelism allows: where the
    node reads the data (`data`), those that do not compute replicated on the mesh's last dim
    (every floating tensor B there), if it has any; every candidate elsewhere."""
    keep = list(range(len(candidates)))
    if name not in data:
        return keep
    attrs = graph.node(name)
    metas = (*attrs.inputs, *attrs.outputs)
    floating = [k for k, meta in enumerate(metas) if meta.dtype.is_floating_point]

    def replicated(sig: NdSignature) -> bool:
        layouts = (*sig.inputs, *sig.outputs)
        return all(isinstance(layouts[k][-1], Broadcast) for k in floating)

    split = [j for j in keep if not replicated(candidates[j])]
    return split or keep
