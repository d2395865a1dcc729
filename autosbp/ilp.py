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

Max terms make the MIP slow (measured: 2-9 s per pipelined GPT-3 problem, where the same problem
without them takes under a second). So `solve` first prices each max term by one chosen part ("the last stage is
the slowest"): that relaxation is a plain problem whose optimum is a lower bound (a part never
exceeds the max), and its solution's true objective an upper bound. When they meet (within the
gap) the solution is optimal; otherwise the parts that were largest at that solution are chosen
next, and after a few rounds the full formulation with z[t] decides.

With x integral the marginals force y integral (row i of e holds x[u, i], column j holds x[v, j]),
so only x needs integrality, and the LP relaxation is often integral already (autoparallel
PR #484). A forbidden pair (i, j) has no y variable, which forbids choosing i and j together.

Lives here: `Problem` (plain numbers: costs in seconds, memory in bytes), `solve`,
`solve_below` (which gives up as soon as a bound shows nothing beats a cutoff: a search skips
hopeless problems) and `lower_bound` (a search orders problems by it), one set of sparse
matrices built with numpy (`_LinearProgram`) for the LP relaxation (HiGHS through scipy) and the
MIP (the same matrices with x integral, solved by OR-Tools; CBC by default, fastest here;
HiGHS through pywraplp ignores the gap setting and prints a banner; HiGHS's own MIP through
scipy was slower on GPT-3's problems, measured), `brute_force` (the oracle for tests). Lives
elsewhere: turning a graph, a mesh and a cost model into a Problem (`planner`), reducing graphs
before solving (`reduce`).
Reference: design.md 3.5; autoparallel optimize_sharding.py; Alpa auto_sharding.py.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp
from ortools.linear_solver.python import model_builder_helper
from scipy import sparse
from scipy.optimize import linprog

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

    The LP relaxation goes first (HiGHS): on these problems it is usually integral, and then its
    solution is optimal for the ILP too (the LP bound equals an integral point). Otherwise the
    MIP `solver` runs.
    """
    found = solve_below(
        problem, math.inf, time_limit_s=time_limit_s, solver=solver, rel_gap=rel_gap
    )
    assert found is not None  # nothing is cut off below infinity
    return found


def lower_bound(problem: Problem, *, time_limit_s: float = 60.0) -> float:
    """A bound no solution of `problem` beats: its LP relaxation's optimum (-inf if the LP
    runs out of time). NoFitError if nothing fits (each node at its smallest bytes, or an
    infeasible LP)."""
    _check_memory_floor(problem)
    relaxed = _relaxation(problem, time_limit_s)
    return relaxed[1] if relaxed is not None else -math.inf


def solve_below(
    problem: Problem,
    cutoff: float,
    *,
    time_limit_s: float = 60.0,
    solver: str = "CBC",
    rel_gap: float = 1e-9,
) -> Solution | None:
    """`solve`, or None as soon as a lower bound (an LP relaxation's) shows that no solution
    beats `cutoff`: a search over many problems skips the MIP of those that cannot win."""
    start = time.perf_counter()
    _check_memory_floor(problem)
    if problem.max_terms:
        by_parts = _solve_by_parts(problem, cutoff, solver, time_limit_s, rel_gap)
        if by_parts is not _UNDECIDED:
            return by_parts and replace(by_parts, seconds=time.perf_counter() - start)
    relaxed = _relaxation(problem, time_limit_s)
    if relaxed is not None:
        values, bound = relaxed
        if bound >= cutoff:
            return None
        if _integral(values):
            choice = _choice(values)
            return Solution(
                choice, problem.objective(choice), "optimal", 0.0, time.perf_counter() - start
            )
    result = _solve_once(problem, solver, time_limit_s=time_limit_s, rel_gap=rel_gap)
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
    # The solver says OPTIMAL once within `rel_gap`: report the gap its bound proves.
    gap = max(0.0, value - bound) / max(abs(value), 1e-30)
    optimal = status == pywraplp.Solver.OPTIMAL and gap <= 1e-9
    return Solution(
        choice, value, "optimal" if optimal else "feasible", gap, time.perf_counter() - start
    )


def _check_memory_floor(problem: Problem) -> None:
    for mem in problem.memory:
        least = sum(float(np.min(b)) for b in mem.bytes_per_candidate.values() if len(b))
        if least + mem.constant_bytes > mem.limit_bytes:  # each node at its smallest: too big
            raise NoFitError(f"no strategy assignment fits {mem.name} (each node's least bytes).")


PART_ROUNDS = 3  # choices of parts tried before the full formulation (measured: 1 usually does)
_UNDECIDED = Solution({}, math.nan, "undecided", math.nan, 0.0)


def _solve_by_parts(
    problem: Problem, cutoff: float, solver: str, time_limit_s: float, rel_gap: float
) -> Solution | None:
    """Solve with each max term priced by one chosen part (see the module docstring): the
    solution, None if a relaxation's bound reaches `cutoff`, or `_UNDECIDED` when the bounds do
    not meet within `PART_ROUNDS` choices."""
    chosen = tuple(_heaviest_part(term) for term in problem.max_terms)
    lower, best, tried = -math.inf, None, set[tuple[int, ...]]()
    tol = max(rel_gap, 1e-9)
    while chosen not in tried and len(tried) < PART_ROUNDS:
        tried.add(chosen)
        relaxation = _priced_by(problem, chosen)
        found = solve_below(
            relaxation, cutoff, solver=solver, time_limit_s=time_limit_s, rel_gap=rel_gap
        )
        if found is None:
            return None  # a lower bound of `problem` reaches the cutoff
        lower = max(lower, found.objective * (1 - found.gap))
        value = problem.objective(found.choice)
        if best is None or value < best.objective:
            best = Solution(found.choice, value, found.status, found.gap, found.seconds)
        if best.objective <= lower * (1 + tol):
            gap = max(0.0, (best.objective - lower) / max(abs(best.objective), 1e-30))
            return replace(best, status="optimal" if gap <= tol else "feasible", gap=gap)
        chosen = tuple(
            int(np.argmax([part.value(found.choice) for part in term.parts]))
            for term in problem.max_terms
        )
    return _UNDECIDED


def _heaviest_part(term: MaxTerm) -> int:
    """The part whose cheapest candidates cost the most (likely the largest at the optimum)."""
    floors = [
        sum(float(np.min(c)) for c in part.node_costs.values() if len(c)) for part in term.parts
    ]
    return int(np.argmax(floors))


def _priced_by(problem: Problem, chosen: Sequence[int]) -> Problem:
    """`problem` with each max term replaced by weight x its chosen part (a lower bound)."""
    nodes = {v: np.asarray(c, dtype=float) for v, c in problem.node_costs.items()}
    edges = {e: np.asarray(m, dtype=float) for e, m in problem.edge_costs.items()}
    for term, index in zip(problem.max_terms, chosen, strict=True):
        if term.weight == 0:
            continue  # (0 x an infinite cost would be nan)
        part = term.parts[index]
        for v, c in part.node_costs.items():
            nodes[v] = nodes[v] + term.weight * c
        for e, m in part.edge_costs.items():
            assert e in edges, f"max term edge {e} is not an edge of the problem"
            edges[e] = edges[e] + term.weight * m
    return Problem(nodes, edges, problem.memory)


Values = dict[Key, list[float]]


def _relaxation(problem: Problem, time_limit_s: float) -> tuple[Values, float] | None:
    """The LP relaxation (x in [0, 1]) solved by HiGHS through scipy: x's values and the
    optimum, a lower bound of the ILP; None if HiGHS stops without one (out of time). The
    matrices are built with numpy, a fraction of the time pywraplp takes for the same rows.
    Presolve is off: on the 22 LPs of a 96-layer GPT-3 search it took 3x the time of solving
    without it (7.3 s vs 2.3 s), for the same optima (measured, scipy 1.17)."""
    lp = _LinearProgram(problem)
    result = linprog(
        lp.cost, A_ub=lp.upper_rows(), b_ub=lp.upper_bounds, A_eq=lp.equal_rows(),
        b_eq=lp.equal_bounds, bounds=np.stack([np.zeros(lp.size), lp.upper], axis=1),
        method="highs", options={"time_limit": time_limit_s, "presolve": False},
    )  # fmt: skip
    if result.status == 2:
        raise NoFitError("no strategy assignment satisfies the constraints (infeasible LP).")
    if result.status != 0:
        return None
    values = {v: list(result.x[at : at + n]) for v, (at, n) in lp.x_at.items()}
    return values, float(result.fun) / lp.scale


class _LinearProgram:
    """The formulation of the module docstring as sparse matrices: columns x (per node, its
    candidates), y (per edge, its allowed pairs), z (per max term); rows one-hot, marginals
    (equalities), memory and max terms (upper bounds)."""

    def __init__(self, problem: Problem) -> None:
        self.scale = scale = _objective_scale(problem)  # as for the MIP: costs near 1e3
        self.x_at: dict[Key, tuple[int, int]] = {}
        costs: list[np.ndarray] = []
        upper: list[np.ndarray] = []
        columns = 0
        for v, node_costs in problem.node_costs.items():
            c = np.asarray(node_costs, dtype=float) * scale
            self.x_at[v] = (columns, len(c))
            columns += len(c)
            finite = np.isfinite(c)
            costs.append(np.where(finite, c, 0.0))
            upper.append(finite.astype(float))  # an infinite cost: the candidate is forbidden
        self._eq: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, cols, values)
        rows = 0
        for at, n in self.x_at.values():  # one-hot
            self._eq.append((np.full(n, rows), at + np.arange(n), np.ones(n)))
            rows += 1
        equal_bounds = [np.ones(rows)]
        self.y_at: dict[tuple[Key, Key], tuple[int, np.ndarray, np.ndarray]] = {}
        for (u, v), matrix in problem.edge_costs.items():
            (u_at, nu), (v_at, nv) = self.x_at[u], self.x_at[v]
            i, j = np.nonzero(np.isfinite(matrix))
            y = columns + np.arange(len(i))
            self.y_at[(u, v)] = (columns, i, j)
            costs.append(matrix[i, j] * scale)
            upper.append(np.ones(len(i)))
            # sum_j y[i, j] - x[u, i] = 0, then sum_i y[i, j] - x[v, j] = 0
            self._eq += [
                (rows + i, y, np.ones(len(i))),
                (rows + nu + j, y, np.ones(len(i))),
                (rows + np.arange(nu), u_at + np.arange(nu), -np.ones(nu)),
                (rows + nu + np.arange(nv), v_at + np.arange(nv), -np.ones(nv)),
            ]
            equal_bounds.append(np.zeros(nu + nv))
            rows += nu + nv
            columns += len(i)
        self._ub: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        bounds: list[float] = []
        for mem in problem.memory:  # scaled by the limit, as for the MIP
            per_byte = 1.0 / max(abs(mem.limit_bytes), 1.0)
            for v, per in mem.bytes_per_candidate.items():
                at, n = self.x_at[v]
                self._ub.append((np.full(n, len(bounds)), at + np.arange(n), per_byte * per))
            bounds.append((mem.limit_bytes - mem.constant_bytes) * per_byte)
        for term in problem.max_terms:  # part - z <= 0 for every part; z costs weight
            z = columns
            costs.append(np.array([term.weight]))
            upper.append(np.array([np.inf]))
            columns += 1
            for part in term.parts:
                row = len(bounds)
                self._ub.append((np.array([row]), np.array([z]), np.array([-1.0])))
                for v, c in part.node_costs.items():
                    at, n = self.x_at[v]
                    self._ub.append((np.full(n, row), at + np.arange(n), scale * c))
                for edge, matrix in part.edge_costs.items():
                    assert edge in self.y_at, f"max term edge {edge} is not an edge of the problem"
                    first, i, j = self.y_at[edge]
                    self._ub.append(
                        (np.full(len(i), row), first + np.arange(len(i)), scale * matrix[i, j])
                    )
                bounds.append(0.0)
        self.size = columns
        self.cost = np.concatenate(costs)
        self.upper = np.concatenate(upper)
        self.upper_bounds = np.array(bounds) if bounds else None
        self.equal_bounds = np.concatenate(equal_bounds)

    def equal_rows(self) -> sparse.csr_matrix:
        return _sparse(self._eq, len(self.equal_bounds), self.size)

    def upper_rows(self) -> sparse.csr_matrix | None:
        if self.upper_bounds is None:
            return None
        return _sparse(self._ub, len(self.upper_bounds), self.size)

    def rows(self) -> sparse.csr_matrix:
        """Every row: the equalities, then the upper bounds (`row_bounds` in the same order)."""
        upper = self.upper_rows()
        return sparse.vstack([self.equal_rows(), *([upper] if upper is not None else [])]).tocsr()

    def row_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row of `rows`, its least and greatest value."""
        below = self.upper_bounds if self.upper_bounds is not None else np.zeros(0)
        lower = np.concatenate([self.equal_bounds, np.full(len(below), -np.inf)])
        return lower, np.concatenate([self.equal_bounds, below])


def _sparse(
    entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]], rows: int, columns: int
) -> sparse.csr_matrix:
    row, col, value = (np.concatenate([e[k] for e in entries]) for k in range(3))
    return sparse.csr_matrix((value, (row, col)), shape=(rows, columns))


def _solve_once(
    problem: Problem, solver: str, *, time_limit_s: float, rel_gap: float
) -> tuple[Values, int, float] | int:
    """(x values, status, best bound), or the solver's status when it has no solution
    (pywraplp.Solver.INFEASIBLE, or NOT_SOLVED when out of time). The model is the LP's
    matrices with x integral, handed to OR-Tools whole (building it row by row through
    pywraplp took 0.3-0.5 s of a 1 s GPT-3 solve, measured)."""
    mip = pywraplp.Solver.CreateSolver(solver)
    if mip is None:
        raise PlanError(f"OR-Tools has no {solver} solver here; use solver='CBC' or 'SCIP'.")
    for v, costs in problem.node_costs.items():
        if len(costs) == 0:
            raise PlanError(f"node {v!r} has no candidate strategy.")
    lp = _LinearProgram(problem)
    model = model_builder_helper.ModelBuilderHelper()
    lower, upper = lp.row_bounds()
    arrays = (np.zeros(lp.size), lp.upper, lp.cost, lower, upper)
    model.fill_model_from_sparse_data(*arrays, lp.rows())  # type: ignore[arg-type]  # a wrong stub
    for at, n in lp.x_at.values():
        for column in range(at, at + n):
            model.set_var_integrality(column, True)
    message = mip.LoadModelFromProto(model_builder_helper.to_mpmodel_proto(model))
    assert not message, f"OR-Tools refused the model: {message}"
    mip.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, rel_gap)
    status = mip.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return int(status)
    columns = mip.variables()
    values = {
        v: [columns[k].solution_value() for k in range(at, at + n)]
        for v, (at, n) in lp.x_at.items()
    }
    return values, status, mip.Objective().BestBound() / lp.scale


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
