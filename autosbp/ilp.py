"""The strategy-choice ILP: pick one candidate per node, minimizing node + edge costs under memory.

The whole formulation (tight edge / local-marginal-polytope form, no big-M):

  variables   x[v, i] in {0, 1}     node v takes candidate i
              y[e, i, j] in [0, 1]  edge e = (u, v) takes the pair (i, j); only allowed pairs exist
  objective   min  sum_v sum_i c[v, i] x[v, i]  +  sum_e sum_(i,j) c[e, i, j] y[e, i, j]
  one-hot     sum_i x[v, i] = 1                                   for every node v
  marginals   sum_j y[e, i, j] = x[u, i]    for every edge e = (u, v) and candidate i of u
              sum_i y[e, i, j] = x[v, j]    for every edge e = (u, v) and candidate j of v
  memory      sum_v sum_i m[k, v, i] x[v, i] <= limit[k] - constant[k]   for every constraint k
  max terms   + w[t] z[t],  z[t] >= (the node + edge costs of part p)  for every part p of term t

A max term prices the slowest of several parts (a pipeline: the slowest stage sets the steady
state, `MaxTerm`); z[t] is continuous and, minimized, equals the largest part.

With x integral the marginals force y integral (row i of e holds x[u, i], column j holds x[v, j]),
so only x needs integrality, and the LP relaxation is often integral already (autoparallel
PR #484). A forbidden pair (i, j) has no y variable, which forbids choosing i and j together.

Lives here: `Problem` (plain numbers: costs in seconds, memory in bytes), `solve` (OR-Tools MIP;
CBC by default, fastest here; HiGHS through pywraplp ignores the gap setting and prints a banner),
`brute_force` (the oracle for tests). Lives elsewhere: turning a graph, a mesh and a cost model
into a Problem (`planner`), reducing graphs before solving (`reduce`).
Reference: design.md 3.5; autoparallel optimize_sharding.py; Alpa auto_sharding.py.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp

from autosbp.errors import NoFitError, PlanError

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


def solve(
    problem: Problem, *, time_limit_s: float = 60.0, solver: str = "CBC", rel_gap: float = 1e-9
) -> Solution:
    """Solve `problem` to `rel_gap` (or to the best found within `time_limit_s`).

    The LP relaxation goes first (GLOP): on these problems it is usually integral, and then its
    solution is optimal for the ILP too (the LP bound equals an integral point). Otherwise the
    MIP `solver` runs.
    """
    start = time.perf_counter()
    relaxed = _solve_once(
        problem, "GLOP", integer=False, time_limit_s=time_limit_s, rel_gap=rel_gap
    )
    if not isinstance(relaxed, int) and _integral(relaxed[0]):
        choice = _choice(relaxed[0])
        return Solution(
            choice, problem.objective(choice), "optimal", 0.0, time.perf_counter() - start
        )
    result = _solve_once(problem, solver, integer=True, time_limit_s=time_limit_s, rel_gap=rel_gap)
    if result == pywraplp.Solver.INFEASIBLE:
        raise NoFitError("no strategy assignment satisfies the constraints (infeasible ILP).")
    if isinstance(result, int):
        raise PlanError(
            f"the {solver} solver found no assignment within {time_limit_s:g} s (status {result}); "
            "raise the time limit (--time-limit-s)."
        )
    x, status, bound = result
    choice = _choice(x)
    value = problem.objective(choice)
    optimal = status == pywraplp.Solver.OPTIMAL
    gap = 0.0 if optimal else abs(value - bound) / max(abs(value), 1e-30)
    return Solution(
        choice, value, "optimal" if optimal else "feasible", gap, time.perf_counter() - start
    )


Values = dict[Key, list[float]]


def _solve_once(
    problem: Problem, solver: str, *, integer: bool, time_limit_s: float, rel_gap: float
) -> tuple[Values, int, float] | int:
    """(x values, status, best bound), or the solver's status when it has no solution
    (pywraplp.Solver.INFEASIBLE, or NOT_SOLVED when out of time)."""
    mip = pywraplp.Solver.CreateSolver(solver)
    if mip is None:
        raise PlanError(f"OR-Tools has no {solver} solver here; use solver='CBC' or 'SCIP'.")
    x = _add_node_variables(mip, problem, integer)
    objective = mip.Objective()
    scale = _objective_scale(problem)
    for v, costs in problem.node_costs.items():
        for i, cost in enumerate(costs):
            if math.isfinite(cost):
                objective.SetCoefficient(x[v][i], float(cost) * scale)
    y = {
        (u, v): _add_edge(mip, objective, x[u], x[v], matrix * scale, f"{u}->{v}")
        for (u, v), matrix in problem.edge_costs.items()
    }
    for k, term in enumerate(problem.max_terms):
        _add_max_term(mip, objective, x, y, term, scale, f"max{k}")
    for mem in problem.memory:
        _add_memory(mip, x, mem)
    objective.SetMinimization()
    mip.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    if integer:
        params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, rel_gap)
    status = mip.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return int(status)
    values = {v: [var.solution_value() for var in xs] for v, xs in x.items()}
    bound = (objective.BestBound() if integer else objective.Value()) / scale
    return values, status, bound


def _objective_scale(problem: Problem) -> float:
    """Costs are seconds, often 1e-6..1e-3: scale the largest to 1e3 so the solvers' absolute
    tolerances (about 1e-6) are negligible beside every cost."""
    arrays = [*problem.node_costs.values(), *problem.edge_costs.values()]
    for term in problem.max_terms:
        for part in term.parts:
            arrays += [
                c * term.weight for c in (*part.node_costs.values(), *part.edge_costs.values())
            ]
    finite = [float(np.max(np.abs(a[np.isfinite(a)]))) for a in arrays if np.isfinite(a).any()]
    largest = max(finite, default=0.0)
    return 1e3 / largest if largest > 0 else 1.0


def _integral(values: Values, tol: float = 1e-6) -> bool:
    return all(min(abs(a), abs(1 - a)) <= tol for xs in values.values() for a in xs)


def _choice(values: Values) -> dict[Key, int]:
    return {v: int(np.argmax(xs)) for v, xs in values.items()}


def _add_node_variables(
    mip: pywraplp.Solver, problem: Problem, integer: bool
) -> dict[Key, list[pywraplp.Variable]]:
    x: dict[Key, list[pywraplp.Variable]] = {}
    for v, costs in problem.node_costs.items():
        if len(costs) == 0:
            raise PlanError(f"node {v!r} has no candidate strategy.")
        x[v] = [mip.Var(0.0, 1.0, integer, f"x[{v}][{i}]") for i in range(len(costs))]
        one_hot = mip.Constraint(1.0, 1.0)
        for var in x[v]:
            one_hot.SetCoefficient(var, 1.0)
        for i, cost in enumerate(costs):
            if not math.isfinite(cost):
                x[v][i].SetUb(0)
    return x


def _add_edge(
    mip: pywraplp.Solver,
    objective: pywraplp.Objective,
    xu: list[pywraplp.Variable],
    xv: list[pywraplp.Variable],
    matrix: np.ndarray,
    name: str,
) -> dict[tuple[int, int], pywraplp.Variable]:
    """The pair variables y[i, j] of the allowed pairs, tied to their endpoints' marginals."""
    assert matrix.shape == (len(xu), len(xv)), f"edge {name}: matrix {matrix.shape}"
    rows: list[list[pywraplp.Variable]] = [[] for _ in xu]
    cols: list[list[pywraplp.Variable]] = [[] for _ in xv]
    pairs: dict[tuple[int, int], pywraplp.Variable] = {}
    for i, j in zip(*np.nonzero(np.isfinite(matrix)), strict=True):
        y = pairs[int(i), int(j)] = mip.NumVar(0.0, 1.0, f"y[{name}][{i},{j}]")
        objective.SetCoefficient(y, float(matrix[i, j]))
        rows[i].append(y)
        cols[j].append(y)
    for members, ends in ((rows, xu), (cols, xv)):
        for ys, var in zip(members, ends, strict=True):
            if ys:
                _add_sum_equals(mip, ys, var)
            else:
                var.SetUb(0)
    return pairs


def _add_sum_equals(
    mip: pywraplp.Solver, terms: list[pywraplp.Variable], var: pywraplp.Variable
) -> None:
    """sum(terms) == var, through the constraint API (the natural `sum(...) == var` builds
    expression trees, which dominated building large problems)."""
    row = mip.Constraint(0.0, 0.0)
    for y in terms:
        row.SetCoefficient(y, 1.0)
    row.SetCoefficient(var, -1.0)


def _add_max_term(
    mip: pywraplp.Solver,
    objective: pywraplp.Objective,
    x: dict[Key, list[pywraplp.Variable]],
    y: Mapping[tuple[Key, Key], dict[tuple[int, int], pywraplp.Variable]],
    term: MaxTerm,
    scale: float,
    name: str,
) -> None:
    """z >= every part's cost (scaled like the objective); z costs `weight` in the objective."""
    z = mip.NumVar(0.0, mip.infinity(), name)
    objective.SetCoefficient(z, term.weight)
    for part in term.parts:
        row = mip.Constraint(0.0, mip.infinity())  # z - part >= 0
        row.SetCoefficient(z, 1.0)
        for v, costs in part.node_costs.items():
            for i, c in enumerate(costs):
                if c and math.isfinite(c):
                    row.SetCoefficient(x[v][i], -float(c) * scale)
        for edge, matrix in part.edge_costs.items():
            assert edge in y, f"max term edge {edge} is not an edge of the problem"
            for (i, j), var in y[edge].items():
                if matrix[i, j]:
                    row.SetCoefficient(var, -float(matrix[i, j]) * scale)


def _add_memory(
    mip: pywraplp.Solver, x: dict[Key, list[pywraplp.Variable]], mem: MemoryConstraint
) -> None:
    # Scale by the limit so the solver's tolerances see numbers near 1.
    scale = 1.0 / max(abs(mem.limit_bytes), 1.0)
    row = mip.Constraint(-mip.infinity(), (mem.limit_bytes - mem.constant_bytes) * scale)
    for v, per in mem.bytes_per_candidate.items():
        for i, b in enumerate(per):
            if b:
                row.SetCoefficient(x[v][i], float(b) * scale)


def brute_force(problem: Problem) -> Solution:
    """Enumerate every assignment (small problems only): the oracle for `solve`."""
    start = time.perf_counter()
    keys = list(problem.node_costs)
    sizes = [len(problem.node_costs[k]) for k in keys]
    assert math.prod(sizes) <= 2_000_000, f"brute force over {math.prod(sizes)} assignments"
    best: tuple[float, dict[Key, int]] | None = None
    for combo in itertools.product(*(range(s) for s in sizes)):
        choice = dict(zip(keys, combo, strict=True))
        if problem.feasible(choice):
            value = problem.objective(choice)
            if best is None or value < best[0]:
                best = (value, choice)
    if best is None:
        raise NoFitError("no strategy assignment satisfies the constraints (brute force).")
    return Solution(best[1], best[0], "optimal", 0.0, time.perf_counter() - start)
