"""The strategy-choice ILP's problem and solution, as plain values (the formulation is in `ilp`).

Lives here: `Problem` (costs per node candidate and edge pair in seconds, memory constraints in
bytes, max terms), its parts (`Costs`, `MaxTerm`, `MemoryConstraint`) and `Solution`; pricing one
assignment (`Problem.objective`, `Problem.feasible`). Lives elsewhere: the formulation and the
search over relaxations (`ilp`), the sparse matrices and solvers (`ilp_solvers`). This module
imports neither: the solvers read these types, `ilp` reads both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Key = Any  # a node's name (str) in the planner; any hashable value in tests


@dataclass(frozen=True)
class MemoryConstraint:
    """sum over nodes of bytes[v][chosen candidate] + constant_bytes <= limit_bytes."""

    bytes_per_candidate: Mapping[Key, np.ndarray]
    limit_bytes: float
    constant_bytes: float = 0.0
    name: str = "memory"


@dataclass(frozen=True)
class Costs:
    """Node-candidate and edge-pair costs; `value` prices one assignment."""

    node_costs: Mapping[Key, np.ndarray]
    edge_costs: Mapping[tuple[Key, Key], np.ndarray] = field(default_factory=dict)

    def value(self, choice: Mapping[Key, int]) -> float:
        total = sum(float(c[choice[v]]) for v, c in self.node_costs.items())
        total += sum(float(m[choice[u], choice[v]]) for (u, v), m in self.edge_costs.items())
        return total


@dataclass(frozen=True)
class MaxTerm:
    """`weight` x the largest of `parts`. Every edge of a part must be an edge of the Problem
    (its matrix there says which pairs are allowed)."""

    weight: float
    parts: Sequence[Costs]


@dataclass(frozen=True)
class Problem:
    """Costs per node candidate and per edge pair; `math.inf` in an edge matrix forbids a pair.
    The objective adds `max_terms` to the node and edge costs."""

    node_costs: Mapping[Key, np.ndarray]
    edge_costs: Mapping[tuple[Key, Key], np.ndarray] = field(default_factory=dict)
    memory: Sequence[MemoryConstraint] = ()
    max_terms: Sequence[MaxTerm] = ()

    def objective(self, choice: Mapping[Key, int]) -> float:
        total = Costs(self.node_costs, self.edge_costs).value(choice)
        for term in self.max_terms:
            total += term.weight * max(part.value(choice) for part in term.parts)
        return total

    def feasible(self, choice: Mapping[Key, int], tol: float = 1e-6) -> bool:
        if not math.isfinite(self.objective(choice)):
            return False
        for mem in self.memory:
            used = mem.constant_bytes + sum(
                float(b[choice[v]]) for v, b in mem.bytes_per_candidate.items()
            )
            if used > mem.limit_bytes * (1 + tol):
                return False
        return True


@dataclass(frozen=True)
class Solution:
    choice: dict[Key, int]
    objective: float
    status: str  # "optimal" | "feasible"
    gap: float
    seconds: float
