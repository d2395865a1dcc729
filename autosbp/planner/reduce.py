"""Shrink the ILP before solving: repeated blocks share one set of variables.

Lives here: `tie_blocks`, which maps every node of block k > 0 to the node at the same position
of the first block, when the blocks are identical (same ops, shapes and dtypes in the same order).
The problem builder sums the costs and memory of tied nodes onto their representative and merges
the edges between them, so a 96-layer transformer costs the solver what one layer costs.
Lives elsewhere: building and solving the problem (`search`, `ilp`).

This restricts the search to plans where every repeated block takes the same signatures, as
Megatron-LM and Alpa do; the result is exact for that space (brute force agrees in the tests).
Reference: autoparallel `repeated_subgraphs` (ilp-planners.md, "Graph-size reduction").
"""

from __future__ import annotations

from collections import defaultdict

from autosbp.graph import OpGraph


def tie_blocks(graph: OpGraph) -> dict[str, str]:
    """node name -> its representative (itself when not tied)."""
    members: dict[int, list[str]] = defaultdict(list)
    for name, attrs in graph.nodes():
        if attrs.get("block") is not None:
            members[attrs["block"]].append(name)
    representative = {name: name for name in graph.order}
    if len(members) < 2:
        return representative
    blocks = [members[b] for b in sorted(members)]
    first = blocks[0]
    if any(not _same_shape(graph, first, other) for other in blocks[1:]):
        return representative
    for other in blocks[1:]:
        for rep, name in zip(first, other, strict=True):
            representative[name] = rep
    return representative


def _same_shape(graph: OpGraph, a: list[str], b: list[str]) -> bool:
    """Same length, and position by position the same op, role, arguments and tensor metadata
    (so the same candidates and prices: the planner computes them once per representative)."""
    if len(a) != len(b):
        return False
    nodes = graph.graph.nodes
    for x, y in zip(a, b, strict=True):
        ax, ay = nodes[x], nodes[y]
        if (ax["op"], ax["role"], ax["inputs"], ax["outputs"]) != (
            ay["op"],
            ay["role"],
            ay["inputs"],
            ay["outputs"],
        ):
            return False
    return True
