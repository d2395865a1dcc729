"""The least bytes a stage can hold: its nodes and a spanning forest of its edges together.

Lives here: `forest_least_bytes` (a memory constraint's least over the choices a problem
allows, by `bounds.forest.forest_min`). Lives elsewhere: the constraint itself
(`ilp.formulation.MemoryConstraint`, whose `least_bytes` takes each node and each edge at its
fewest alone), the bytes it sums (`memory`, `problem.stage_terms`), the search that asks which
`full:K` may fit (`search.evaluator.Evaluator.least_partial`).

Invariant: at least `MemoryConstraint.least_bytes`, at most the bytes of every choice the
problem allows (a candidate or an edge pair of infinite cost is not one). It is tighter where
an edge's fewest bytes and its ends' fewest are not one choice: a layout that shards an
activation at its producer but not at its consumer pays a conversion's bytes between them.
Llama 3 405B at TP8 PP16 v=2 on 8192 H100s, `full:3`: 1.085 of the limit against 0.981 each
alone, and its LP finds no fit either (measured).
"""

from __future__ import annotations

import math

import numpy as np

from autosbp.planner.bounds.forest import forest_min
from autosbp.planner.ilp.formulation import MemoryConstraint, Problem

__all__ = ["forest_least_bytes"]


def forest_least_bytes(problem: Problem, memory: MemoryConstraint) -> float:
    """No choice that `problem` allows holds fewer bytes in `memory`: its nodes (those it
    counts, and the ends of the edges it counts) with every edge of `problem` between them,
    at the least that they and a spanning forest of those edges take together (`forest_min`:
    exact on the forest; an edge left out takes its fewest bytes given one end)."""
    keys = set(memory.bytes_per_candidate)
    for u, v in memory.bytes_per_pair:
        keys |= {u, v}
    nodes = {}
    for v in keys:
        allowed = np.isfinite(np.asarray(problem.node_costs[v], dtype=float))
        held = memory.bytes_per_candidate.get(v)
        nodes[v] = np.where(allowed, 0.0 if held is None else held, math.inf)
    edges = {}
    for (u, v), costs in problem.edge_costs.items():
        if u in keys and v in keys:
            held = memory.bytes_per_pair.get((u, v))
            edges[(u, v)] = np.where(np.isfinite(costs), 0.0 if held is None else held, math.inf)
    return memory.constant_bytes + forest_min(nodes, edges)
