"""The strategy-choice ILP: pick one candidate per node, minimizing node + edge costs under memory.

The whole formulation (tight edge / local-marginal-polytope form, no big-M):

  variables   x[v, i] in {0, 1}     node v takes candidate i
              y[e, i, j] in [0, 1]  edge e = (u, v) takes the pair (i, j); only allowed pairs exist
  objective   min  sum_v sum_i c[v, i] x[v, i]  +  sum_e sum_(i,j) c[e, i, j] y[e, i, j]
  one-hot     sum_i x[v, i] = 1                                   for every node v
  marginals   sum_j y[e, i, j] = x[u, i]    for every edge e = (u, v) and candidate i of u
              sum_i y[e, i, j] = x[v, j]    for every edge e = (u, v) and candidate j of v
  memory      sum_v sum_i m[k, v, i] x[v, i] + sum_e sum_(i,j) m[k, e, i, j] y[e, i, j]
                  <= limit[k] - constant[k]                           for every constraint k
  max terms   + w[t] z[t],  z[t] >= (the node + edge costs of part p) + sum_t' c[t, p, t'] z[t']
                                            for every part p of term t (t' < t, c >= 0)

A max term prices the slowest of several parts (a pipeline: the slowest stage sets the steady
state, `MaxTerm`); z[t] is continuous and, minimized, equals the largest part. A part may hold
earlier terms with non-negative coefficients (a max of sums of maxes: a stage's time that is
itself the larger of communication and compute); those z only ever push the outer ones up, so
at the optimum each equals its largest part too.

With x integral the marginals force y integral (row i of e holds x[u, i], column j holds x[v, j]),
so only x needs integrality, and the LP relaxation is often integral already (autoparallel
PR #484). A forbidden pair (i, j) has no y variable, which forbids choosing i and j together.

Lives here: `Problem` (costs per node candidate and edge pair in seconds, memory constraints in
bytes per node candidate and per edge pair, max terms, which may nest), its parts (`Costs`,
`MaxTerm`, `MemoryConstraint`) and `Solution`; pricing one assignment (`Problem.objective`,
`Problem.term_values`, `Problem.feasible`). Lives elsewhere: the solve over relaxations
(`ilp.solving`), the sparse matrices and solvers (`ilp.solvers`). This module imports neither:
the solvers read these types, `solving` reads both.
Reference: docs/planner.md ("The ILP"); autoparallel optimize_sharding.py; Alpa auto_sharding.py.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Key = Any  # a node's name (str) in the planner; any hashable value in tests
# node -> its candidate: an int (one assignment), or an int array (many, priced at once)
Choice = Mapping[Key, Any]


@dataclass(frozen=True)
class MemoryConstraint:
    """sum over nodes of bytes[v][chosen candidate] + sum over edges (u, v) of
    pair_bytes[(u, v)][chosen pair] + constant_bytes <= limit_bytes. An edge with bytes must be
    an edge of the Problem (its pairs are the LP's y columns)."""

    bytes_per_candidate: Mapping[Key, np.ndarray]
    limit_bytes: float
    constant_bytes: float = 0.0
    name: str = "memory"
    bytes_per_pair: Mapping[tuple[Key, Key], np.ndarray] = field(default_factory=dict)

    def used_bytes(self, choice: Choice) -> Any:
        """The bytes one assignment keeps (of each assignment, given arrays: `Costs.value`)."""
        return self.constant_bytes + Costs(self.bytes_per_candidate, self.bytes_per_pair).value(
            choice
        )

    def least_bytes(self) -> float:
        """No assignment keeps fewer bytes: each node and each edge at its fewest."""
        nodes = sum(float(np.min(b)) for b in self.bytes_per_candidate.values() if len(b))
        edges = sum(float(np.min(b)) for b in self.bytes_per_pair.values() if b.size)
        return self.constant_bytes + nodes + edges


@dataclass(frozen=True)
class Costs:
    """Node-candidate and edge-pair costs; `value` prices one assignment."""

    node_costs: Mapping[Key, np.ndarray]
    edge_costs: Mapping[tuple[Key, Key], np.ndarray] = field(default_factory=dict)

    def value(self, choice: Choice) -> Any:
        """One assignment's cost (a float); given an array of candidates per node (one entry per
        assignment), each assignment's cost (an array; `ilp.solving.brute_force`)."""
        total: Any = sum(c[choice[v]] for v, c in self.node_costs.items())
        total += sum(m[choice[u], choice[v]] for (u, v), m in self.edge_costs.items())
        return total if isinstance(total, np.ndarray) else float(total)


@dataclass(frozen=True)
class MaxTerm:
    """`weight` x the largest of `parts`. Every edge of a part must be an edge of the Problem
    (its matrix there says which pairs are allowed).

    Terms may nest: `inner[p]` (when given, one mapping per part) adds to part p the values of
    earlier terms of the Problem (index -> coefficient, every coefficient >= 0). A term's value
    is then max_p (parts[p] + sum_t c_t value_t): a max of sums of maxes, which the LP prices
    exactly because every inner value only ever enters with a non-negative coefficient (so
    minimizing pushes each inner variable down to its largest part)."""

    weight: float
    parts: Sequence[Costs]
    inner: Sequence[Mapping[int, float]] = ()

    def __post_init__(self) -> None:
        assert not self.inner or len(self.inner) == len(self.parts), "one inner map per part"
        assert all(c >= 0 for nested in self.inner for c in nested.values()), self.inner

    def inner_of(self, part: int) -> Mapping[int, float]:
        return self.inner[part] if self.inner else {}


@dataclass(frozen=True)
class Problem:
    """Costs per node candidate and per edge pair; `math.inf` in an edge matrix forbids a pair.
    The objective adds `max_terms` to the node and edge costs."""

    node_costs: Mapping[Key, np.ndarray]
    edge_costs: Mapping[tuple[Key, Key], np.ndarray] = field(default_factory=dict)
    memory: Sequence[MemoryConstraint] = ()
    max_terms: Sequence[MaxTerm] = ()

    def __post_init__(self) -> None:
        for t, term in enumerate(self.max_terms):
            for p in range(len(term.parts)):
                assert all(0 <= inner < t for inner in term.inner_of(p)), "inner terms come first"

    def objective(self, choice: Choice) -> Any:
        """One assignment's objective (of each, given arrays: `Costs.value`)."""
        total = Costs(self.node_costs, self.edge_costs).value(choice)
        for term, value in zip(self.max_terms, self.term_values(choice), strict=True):
            total += term.weight * value
        return total

    def term_values(self, choice: Choice) -> list[Any]:
        """Each max term's value (its largest part, inner terms included), in order."""
        values: list[Any] = []
        for term in self.max_terms:
            values.append(functools.reduce(np.maximum, self.part_values(term, choice, values)))
        return [v if isinstance(v, np.ndarray) else float(v) for v in values]

    @staticmethod
    def part_values(term: MaxTerm, choice: Choice, earlier: Sequence[Any]) -> list[Any]:
        """Each part of `term` at `choice`, given the values of the terms before it."""
        return [
            part.value(choice) + sum(c * earlier[t] for t, c in term.inner_of(p).items())
            for p, part in enumerate(term.parts)
        ]

    def feasible(self, choice: Choice, tol: float = 1e-6) -> Any:
        """Whether one assignment is allowed and fits (of each, given arrays: a bool array)."""
        ok = np.isfinite(self.objective(choice))
        for mem in self.memory:
            ok = ok & (mem.used_bytes(choice) <= mem.limit_bytes * (1 + tol))
        return ok if isinstance(ok, np.ndarray) else bool(ok)


@dataclass(frozen=True)
class Solution:
    choice: dict[Key, int]
    objective: float
    status: str  # "optimal" | "feasible"
    gap: float
    seconds: float
