"""The ILP of `ilp.formulation` as sparse matrices, and the solvers that run on them.

Lives here: `LinearProgram` (the formulation of `ilp.formulation` as numpy/scipy matrices: one build
serves the LP and the MIP; HiGHS reads its columns, `LinearProgram.columns`, built in one sort
rather than through scipy's CSR and CSC conversions), `relax` (the LP relaxation by HiGHS through
scipy, with its reduced costs), `fix_by_reduced_costs` (drops the candidates and pairs that no
solution better than a known value can use), `solve_mip` (the same matrices with x integral, by
OR-Tools; CBC by default: HiGHS through pywraplp ignores the gap setting and prints a banner). Lives
elsewhere: the problem's types (`ilp.formulation`, imported here), the solve over relaxations
(`ilp.solving`, which imports this module; never the other way).

Reduced-cost fixing is textbook branch and bound (MIP solvers do it inside once they hold an
incumbent); why it keeps every better solution: docs/planner.md, "The ILP".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from ortools.linear_solver import pywraplp
from ortools.linear_solver.python import model_builder_helper
from scipy import sparse
from scipy.optimize import OptimizeWarning, linprog
from scipy.sparse import _sparsetools  # type: ignore[attr-defined]  # CSR/CSC kernels

from autosbp.errors import NoFitError, PlanError

try:  # HiGHS as scipy binds it, for `linprog` (private: where it moves, `_linprog` serves)
    from scipy.optimize._highspy import _core as _HIGHS  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - scipy < 1.15
    _HIGHS = None
from autosbp.planner.ilp.formulation import Costs, Key, MaxTerm, Problem

Values = dict[Key, list[float]]  # per node, its candidates' values


@dataclass(frozen=True)
class Relaxed:
    """An optimal LP relaxation: x's values per node, the optimum (seconds, a lower bound of
    the ILP), and per column of `lp` its reduced cost (seconds; >= 0 at the lower bound)."""

    values: Values
    bound_s: float
    reduced_s: np.ndarray
    lp: LinearProgram


@dataclass(frozen=True)
class CutOff:
    """The LP stopped once its bound passed the cutoff: no solution beats `bound_s`."""

    bound_s: float


OBJECTIVE_BOUND_REACHED = "Bound on objective reached"  # HiGHS's words for that model status


def relax(
    problem: Problem, time_limit_s: float, cutoff_s: float = math.inf
) -> Relaxed | CutOff | None:
    """The LP relaxation (x in [0, 1]) solved by HiGHS; `CutOff` as soon as its bound reaches
    `cutoff_s`; None if HiGHS stops without either (out of time).

    The matrices are built with numpy, a fraction of the time pywraplp takes for the same rows.
    Presolve is off: on the 22 LPs of a 96-layer GPT-3 search it took 3x the time of solving
    without it (7.3 s vs 2.3 s), for the same optima (measured, scipy 1.17). A cutoff goes to
    HiGHS as its `objective_bound`: the dual simplex keeps a dual feasible point, whose
    objective bounds the LP's from below, and stops once that passes the cutoff (HiGHS checks
    it with the exact costs). On GPT-3's hopeless configurations that took 45-80% of a full
    solve (measured). HiGHS is called through the binding scipy ships (`_highs_lp`), or
    through `linprog` where that binding is not there."""
    lp = LinearProgram(problem)
    bound = cutoff_s * lp.scale if math.isfinite(cutoff_s) else None
    solved = _highs_lp(lp, time_limit_s, bound) if _HIGHS else _linprog(lp, time_limit_s, bound)
    if solved is None or isinstance(solved, str):
        if solved == "infeasible":
            raise NoFitError("no strategy assignment satisfies the constraints (infeasible LP).")
        return CutOff(cutoff_s) if solved == "cut off" else None
    x, objective, reduced = solved
    values = {v: list(x[at : at + n]) for v, (at, n) in lp.x_at.items()}
    return Relaxed(values, objective / lp.scale, reduced / lp.scale, lp)


Outcome = tuple[np.ndarray, float, np.ndarray] | str | None  # (x, objective, reduced costs)


def _highs_lp(lp: LinearProgram, time_limit_s: float, objective_bound: float | None) -> Outcome:
    """The LP by HiGHS through scipy's own binding of it: the x values, the optimum and the
    reduced costs (HiGHS's column duals: 0 on basic columns, >= 0 at a lower bound, <= 0 at an
    upper), "cut off", "infeasible", or None. scipy's `linprog` wraps the same call, but then
    reads each column's basis status in a Python loop (0.1-0.4 s on a 22k-column GPT-3 LP,
    as long as HiGHS takes to solve it; measured)."""
    assert _HIGHS is not None
    indptr, indices, data = lp.columns()
    lower, upper = lp.row_bounds()
    highs = _HIGHS._Highs()
    options = (("output_flag", False), ("presolve", "off"), ("time_limit", time_limit_s))
    for option, value in options:
        highs.setOptionValue(option, value)
    if objective_bound is not None:
        highs.setOptionValue("objective_bound", objective_bound)
    status = highs.passModel(  # the numpy overload: no copy through Python lists
        lp.size, len(lower), len(data), int(_HIGHS.MatrixFormat.kColwise),
        int(_HIGHS.ObjSense.kMinimize), 0.0, lp.cost, np.zeros(lp.size), lp.upper, lower, upper,
        indptr, indices, data,
        np.zeros(lp.size, dtype=np.int32),  # every column continuous
    )  # fmt: skip
    # A warning (e.g. a coefficient below HiGHS's small-matrix-value, which it drops) passes.
    assert status != _HIGHS.HighsStatus.kError, "HiGHS refused the LP"
    highs.run()
    status = highs.getModelStatus()
    if status == _HIGHS.HighsModelStatus.kInfeasible:
        return "infeasible"
    if status == _HIGHS.HighsModelStatus.kObjectiveBound:
        return "cut off"
    if status != _HIGHS.HighsModelStatus.kOptimal:
        return None  # out of time, or a status this code does not know: no bound
    solution = highs.getSolution()
    objective = float(highs.getInfo().objective_function_value)
    return np.array(solution.col_value), objective, np.array(solution.col_dual)


def _linprog(lp: LinearProgram, time_limit_s: float, objective_bound: float | None) -> Outcome:
    """`_highs_lp` through scipy's `linprog` (the options it does not know, objective_bound,
    go to HiGHS verbatim)."""
    options: dict[str, object] = {"time_limit": time_limit_s, "presolve": False}
    if objective_bound is not None:
        options["objective_bound"] = objective_bound
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unrecognized options", OptimizeWarning)
        result = linprog(
            lp.cost, A_ub=lp.upper_rows(), b_ub=lp.upper_bounds, A_eq=lp.equal_rows(),
            b_eq=lp.equal_bounds, bounds=np.stack([np.zeros(lp.size), lp.upper], axis=1),
            method="highs", options=options,
        )  # fmt: skip
    if result.status == 2:
        return "infeasible"
    if result.status == 4 and OBJECTIVE_BOUND_REACHED in result.message:
        return "cut off"
    if result.status != 0:
        return None
    return result.x, float(result.fun), result.lower.marginals + result.upper.marginals


# A memory row's bound less this (of the limit: 53 bytes at 53 MB): the solvers' feasibility
# tolerances (HiGHS's and CBC's primal 1e-7 of a scaled row) let a choice through a byte or so
# above the limit, which the plan's peak then shows (a full:1 plan 1 byte over, assumed).
MEMORY_SLACK = 1e-6
FIXING_TOLERANCE = 1e-7  # relative; HiGHS's optima and duals are good to ~1e-9 of the costs


def fix_by_reduced_costs(problem: Problem, relaxed: Relaxed, upper_s: float) -> Problem:
    """`problem` less the candidates and edge pairs whose reduced cost exceeds `upper_s` - the
    LP bound, so its solutions include every solution of `problem` better than `upper_s`
    (docs/planner.md, "The ILP": reduced-cost fixing)."""
    slack_s = upper_s - relaxed.bound_s
    slack_s += FIXING_TOLERANCE * max(abs(upper_s), abs(relaxed.bound_s))  # the LP's own error
    return restrict(problem, relaxed.lp, relaxed.reduced_s <= slack_s)


def restrict(problem: Problem, lp: LinearProgram, keep: np.ndarray) -> Problem:
    """`problem` with the columns of `lp` (`problem`'s) that `keep` does not hold forbidden (an
    infinite cost), and with them every pair of a forbidden candidate: same keys and candidate
    indices, and no column for them in its own LinearProgram."""
    kept = {v: keep[at : at + n] for v, (at, n) in lp.x_at.items()}
    nodes = {v: np.where(kept[v], c, np.inf) for v, c in problem.node_costs.items()}
    edges = {}
    for (u, v), matrix in problem.edge_costs.items():
        first, i, j = lp.y_at[(u, v)]
        dropped = ~keep[first : first + len(i)] | ~kept[u][i] | ~kept[v][j]
        restricted = np.array(matrix, dtype=float)
        restricted[i[dropped], j[dropped]] = np.inf
        edges[(u, v)] = restricted
    return replace(problem, node_costs=nodes, edge_costs=edges)


class LinearProgram:
    """The formulation of `ilp.formulation` as sparse matrices: columns x (per node, its
    candidates), y (per edge, its allowed pairs), z (per max term); rows one-hot, marginals
    (equalities), memory and max terms (upper bounds). Costs are scaled so the largest is 1e3
    (`objective_scale`), memory rows by their limit."""

    def __init__(self, problem: Problem) -> None:
        self.x_at: dict[Key, tuple[int, int]] = {}
        costs: list[np.ndarray] = []
        upper: list[np.ndarray] = []
        columns = 0
        for v, node_costs in problem.node_costs.items():
            c = np.asarray(node_costs, dtype=float)
            self.x_at[v] = (columns, len(c))
            columns += len(c)
            finite = np.isfinite(c)
            costs.append(np.where(finite, c, 0.0))
            upper.append(finite.astype(float))  # an infinite cost: the candidate is forbidden
        self._x_cols = {v: at + np.arange(n) for v, (at, n) in self.x_at.items()}  # per node
        self._eq: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rows, cols, values)
        rows = len(self.x_at)
        for row, (v, (_, n)) in enumerate(self.x_at.items()):  # one-hot
            self._eq.append((np.full(n, row), self._x_cols[v], np.ones(n)))
        equal_bounds = [np.ones(rows)]
        self.y_at: dict[tuple[Key, Key], tuple[int, np.ndarray, np.ndarray]] = {}
        self._y_flat: dict[tuple[Key, Key], tuple[np.ndarray, tuple[int, int]]] = {}  # `_flat`
        for (u, v), matrix in problem.edge_costs.items():
            nu, nv = self.x_at[u][1], self.x_at[v][1]
            i, j = np.nonzero(np.isfinite(matrix))
            y = columns + np.arange(len(i))
            self.y_at[(u, v)] = (columns, i, j)
            costs.append(matrix[i, j])
            upper.append(np.ones(len(i)))
            # sum_j y[i, j] - x[u, i] = 0, then sum_i y[i, j] - x[v, j] = 0
            self._eq += [
                (rows + i, y, np.ones(len(i))),
                (rows + nu + j, y, np.ones(len(i))),
                (rows + np.arange(nu), self._x_cols[u], -np.ones(nu)),
                (rows + nu + np.arange(nv), self._x_cols[v], -np.ones(nv)),
            ]
            equal_bounds.append(np.zeros(nu + nv))
            rows += nu + nv
            columns += len(i)
        self._ub: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # each block one row
        bounds: list[float] = []
        for mem in problem.memory:  # scaled by the limit, as for the MIP
            per_byte = 1.0 / max(abs(mem.limit_bytes), 1.0)
            for v, per in mem.bytes_per_candidate.items():
                n = self.x_at[v][1]
                self._ub.append((np.full(n, len(bounds)), self._x_cols[v], per_byte * per))
            for edge, matrix in mem.bytes_per_pair.items():
                assert edge in self.y_at, f"memory of edge {edge}, not an edge of the problem"
                first, i, j = self.y_at[edge]
                entries = (np.full(len(i), len(bounds)), first + np.arange(len(i)))
                self._ub.append((*entries, per_byte * np.asarray(matrix, dtype=float)[i, j]))
            bounds.append((mem.limit_bytes - mem.constant_bytes) * per_byte - MEMORY_SLACK)
        self._y_cols = {e: first + np.arange(len(i)) for e, (first, i, _) in self.y_at.items()}
        # Max terms: part + sum_inner c z_inner - z <= 0 for every part; z costs the weight.
        # Part rows are in seconds (scaled below with the costs); z entries are not.
        z_at = columns
        columns += len(problem.max_terms)
        costs.append(np.array([term.weight for term in problem.max_terms]))
        upper.append(np.full(len(problem.max_terms), np.inf))
        part_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for t, term in enumerate(problem.max_terms):
            for p, part in enumerate(term.parts):
                row = len(bounds)
                inner = term.inner_of(p)
                z_cols = np.array([z_at + t, *(z_at + k for k in inner)], dtype=int)
                z_values = np.array([-1.0, *inner.values()])
                self._ub.append((np.full(len(z_cols), row), z_cols, z_values))
                part_rows.append(self._part_row(part, row))
                bounds.append(0.0)
        self.size = columns
        cost = np.concatenate(costs)
        self.scale = objective_scale(
            cost, [values for _, _, values in part_rows], problem.max_terms
        )
        self.cost = cost * self.scale  # z (the last columns) costs its weight: z is scaled
        if problem.max_terms:
            self.cost[z_at:] = [t.weight for t in problem.max_terms]
        self._ub += [(r, c, values * self.scale) for r, c, values in part_rows]
        self.upper = np.concatenate(upper)
        self.upper_bounds = np.array(bounds) if bounds else None
        self.equal_bounds = np.concatenate(equal_bounds)

    def _part_row(self, part: Costs, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A part's costs as one row's entries (columns and values, unscaled)."""
        cols: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for v, c in part.node_costs.items():
            cols.append(self._x_cols[v])
            values.append(np.asarray(c, dtype=float))
        for edge, matrix in part.edge_costs.items():
            assert edge in self.y_at, f"max term edge {edge} is not an edge of the problem"
            cols.append(self._y_cols[edge])
            flat, shape = self._flat(edge)
            assert np.shape(matrix) == shape, f"max term edge {edge}: a matrix of another shape"
            values.append(np.ravel(matrix)[flat])  # matrix[i, j], a quarter of its time
        col = np.concatenate(cols) if cols else np.zeros(0, dtype=int)
        value = np.concatenate(values) if values else np.zeros(0)
        return np.full(len(col), row), col, value

    def _flat(self, edge: tuple[Key, Key]) -> tuple[np.ndarray, tuple[int, int]]:
        """An edge's pairs (`y_at`) as flat indices i * nv + j of its matrix, and the matrix's
        shape (cached): a part row gathers them in one take."""
        found = self._y_flat.get(edge)
        if found is None:
            _, i, j = self.y_at[edge]
            shape = (self.x_at[edge[0]][1], self.x_at[edge[1]][1])
            found = self._y_flat[edge] = (i * shape[1] + j, shape)
        return found

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

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`rows()` in compressed sparse column form (indptr, row indices, values; int32 for
        HiGHS): the entries counted into rows, then into columns (scipy's two O(nnz) kernels),
        which keeps each column's rows in order: the arrays scipy's CSR build, stack and CSC
        conversion give (no entry twice, so nothing to sum), at a fraction of their time. An
        upper block holds one row (`_ub`), so those rows are their blocks in a stable order by
        row, as counting them gives (the max terms' rows, most of a GPT-3 LP's entries)."""
        equal, size = len(self.equal_bounds), self.size
        below = len(self.upper_bounds) if self.upper_bounds is not None else 0
        row, col, value = (
            np.concatenate([e[k] for e in self._eq] or [np.zeros(0)]) for k in range(3)
        )
        n_eq = len(row)
        row_at, cols, by_row = (
            np.empty(equal + below + 1, np.int32),
            np.empty(n_eq, np.int32),
            np.empty(n_eq),
        )
        _sparsetools.coo_tocsr(equal, size, n_eq, row.astype(np.int32), col.astype(np.int32),
                               value.astype(float), row_at[: equal + 1], cols, by_row)  # fmt: skip
        blocks = sorted((b for b in self._ub if len(b[0])), key=lambda b: int(b[0][0]))
        counts = np.zeros(below, dtype=np.int64)
        for r, _, _ in blocks:
            assert r[0] == r[-1], "an upper block spans rows"
            counts[r[0]] += len(r)
        row_at[equal + 1 :] = n_eq + np.cumsum(counts)
        cols = np.concatenate([cols, *(c for _, c, _ in blocks)]).astype(np.int32, copy=False)
        by_row = np.concatenate([by_row, *(v for _, _, v in blocks)]).astype(float, copy=False)
        nnz = len(cols)
        indptr, indices, data = np.empty(size + 1, np.int32), np.empty(nnz, np.int32), np.empty(nnz)
        _sparsetools.csr_tocsc(equal + below, size, row_at, cols, by_row, indptr, indices, data)
        return indptr, indices, data

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


def solve_mip(
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
    lp = LinearProgram(problem)
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


def objective_scale(
    costs: np.ndarray, parts: list[np.ndarray], max_terms: Sequence[MaxTerm]
) -> float:
    """Costs are seconds, often 1e-6..1e-3: scale the largest (of the objective's costs, and
    of each max term's parts times its weight, or times 1 for a term that only nests) to 1e3
    so the solvers' absolute tolerances (about 1e-6) are negligible beside every cost."""
    weights = [term.weight or 1.0 for term in max_terms for _ in term.parts]
    largest = float(np.max(np.abs(costs[: -len(max_terms)] if max_terms else costs), initial=0.0))
    for weight, values in zip(weights, parts, strict=True):
        largest = max(largest, abs(weight) * float(np.max(np.abs(values), initial=0.0)))
    return 1e3 / largest if largest > 0 else 1.0
