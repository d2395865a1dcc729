"""The strategy-choice ILP solved: by parts, over relaxations, below a cutoff.

Max terms make the MIP slow (measured: 2-9 s per pipelined GPT-3 problem, where the same problem
without them takes under a second). So `solve` first prices each max term by one chosen part ("the last stage is
the slowest"): that relaxation is a plain problem whose optimum is a lower bound (a part never
exceeds the max), and its solution's true objective an upper bound. When they meet (within the
gap) the solution is optimal; otherwise the parts that were largest at that solution are chosen
next, and after a few rounds the full formulation with z[t] decides.

A fractional LP is rounded (the MIP over the candidates it uses), and that solution's value
fixes the columns whose reduced costs show they cannot beat it, before the MIP of what is left
(`ilp.solvers.fix_by_reduced_costs`): a binding memory limit makes the LP fractional at a few
nodes, and the fixing keeps about a fifth of the columns.

Lives here: `solve`, `solve_below` (which gives up as soon as a bound shows nothing beats a cutoff: a search skips
hopeless problems) and `lower_bound` (a search orders problems by it), `least_memory_share`
(how far the LP relaxation is from fitting, where a cutoff would hide it), `brute_force` (the
oracle for tests). Lives elsewhere: the formulation and its values (`ilp.formulation`: `Problem`, plain numbers:
costs in seconds, memory in bytes), the problem as sparse matrices and the solvers run on them
(`ilp.solvers`: the LP relaxation by HiGHS through scipy, the MIP by OR-Tools, CBC by default),
turning a graph, a mesh and a cost model into a Problem (`problem.build`), tying repeated blocks
before solving (`space.ties`).
Reference: docs/planner.md ("The ILP").
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from operator import attrgetter

import numpy as np
from ortools.linear_solver import pywraplp

from autosbp.errors import NoFitError, PlanError
from autosbp.planner.ilp.formulation import Costs, Key, MaxTerm, Problem, Solution
from autosbp.planner.ilp.solvers import (
    CutOff,
    Relaxed,
    Values,
    fix_by_reduced_costs,
    relax,
    restrict,
    solve_mip,
)


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


def lower_bound(problem: Problem, *, time_limit_s: float = 60.0, cutoff: float = math.inf) -> float:
    """A bound no solution of `problem` beats: its LP relaxation's optimum, or `cutoff` as soon
    as the LP shows that no solution beats it (-inf if the LP runs out of time). NoFitError if
    nothing fits (each node at its smallest bytes, or an infeasible LP)."""
    return bound_or_solve(problem, time_limit_s=time_limit_s, cutoff=cutoff)[0]


def bound_or_solve(
    problem: Problem, *, time_limit_s: float = 60.0, cutoff: float = math.inf
) -> tuple[float, Solution | None]:
    """`lower_bound`, and the optimal solution when the LP relaxation is integral (then its
    bound is the optimum: an integral point of the relaxation is a solution)."""
    _check_memory_floor(problem)
    relaxed = relax(problem, time_limit_s, cutoff)
    if isinstance(relaxed, CutOff):
        return relaxed.bound_s, None
    if relaxed is None:
        return -math.inf, None
    if not _integral(relaxed.values):
        return relaxed.bound_s, None
    choice = _choice(relaxed.values)
    return relaxed.bound_s, Solution(choice, problem.objective(choice), "optimal", 0.0, 0.0)


def least_memory_share(problem: Problem, *, time_limit_s: float = 60.0) -> float | None:
    """The least, over fractional choices of `problem`, of its fullest memory constraint's
    share of its limit (its bytes over its limit): at most 1 - `MEMORY_SLACK` exactly where the
    LP relaxation fits. No time objective: HiGHS minimizes the share alone, so a cutoff cannot
    hide an LP that does not fit as it does in `bound_or_solve` (the dual simplex reaches the
    objective bound before it proves the primal infeasible); and the share says how far from
    fitting it is (`search.evaluator.Evaluator.least_partial` aims its next K by it). None if
    HiGHS runs out of time; inf if no choice is allowed."""
    free = {v: np.where(np.isfinite(c), 0.0, math.inf) for v, c in problem.node_costs.items()}
    edges = {e: np.where(np.isfinite(m), 0.0, math.inf) for e, m in problem.edge_costs.items()}
    parts = []
    for mem in problem.memory:
        per_byte = 1.0 / max(abs(mem.limit_bytes), 1.0)
        nodes = {
            v: np.asarray(b, dtype=float) * per_byte for v, b in mem.bytes_per_candidate.items()
        }
        pairs = {e: np.asarray(b, dtype=float) * per_byte for e, b in mem.bytes_per_pair.items()}
        anchor = next(iter(nodes or problem.node_costs))  # a node whose x sums to 1
        constant = mem.constant_bytes * per_byte  # on every candidate of one node: paid once
        nodes[anchor] = nodes.get(anchor, np.zeros(len(free[anchor]))) + constant
        parts.append(Costs(nodes, pairs))
    if not parts:
        return 0.0
    try:
        relaxed = relax(Problem(free, edges, (), (MaxTerm(1.0, parts),)), time_limit_s)
    except NoFitError:  # no choice is allowed at all
        return math.inf
    assert not isinstance(relaxed, CutOff), "no cutoff was given"
    return None if relaxed is None else relaxed.bound_s


def solve_below(
    problem: Problem,
    cutoff: float,
    *,
    time_limit_s: float = 60.0,
    solver: str = "CBC",
    rel_gap: float = 1e-9,
) -> Solution | None:
    """`solve`, or None as soon as a lower bound (an LP relaxation's) shows that no solution
    beats `cutoff`: a search over many problems skips the MIP of those that cannot win.

    A fractional LP is rounded first: the MIP over the candidates the LP uses (a few per node)
    gives a solution, and its value fixes every column whose reduced cost shows it cannot beat
    that (`ilp.solvers.fix_by_reduced_costs`) before the MIP of the whole problem."""
    start = time.perf_counter()
    _check_memory_floor(problem)
    deadline = start + time_limit_s  # one limit for every step below

    def left() -> float:
        return max(deadline - time.perf_counter(), 1e-3)

    if problem.max_terms:
        by_parts = _solve_by_parts(problem, cutoff, solver, time_limit_s, rel_gap)
        if by_parts is not _UNDECIDED:
            return by_parts and replace(by_parts, seconds=time.perf_counter() - start)
    relaxed = relax(problem, left(), cutoff)
    if isinstance(relaxed, CutOff) or (relaxed is not None and relaxed.bound_s >= cutoff):
        return None
    rounded = None
    if relaxed is not None:
        if _integral(relaxed.values):
            choice = _choice(relaxed.values)
            return Solution(
                choice, problem.objective(choice), "optimal", 0.0, time.perf_counter() - start
            )
        rounded = _solve_on_support(problem, relaxed, solver, left())
    upper = min(cutoff, rounded.objective if rounded is not None else math.inf)
    found: Solution | None
    if relaxed is None or not math.isfinite(upper):
        found, lower = _solve_whole(problem, solver, left(), rel_gap)
    else:
        found, lower = _solve_fixed(problem, relaxed, upper, solver, left(), rel_gap)
    best = min((s for s in (found, rounded) if s is not None), key=objective_of, default=None)
    if best is None and lower < cutoff:
        raise SolverTimeoutError(_out_of_time(solver, time_limit_s))
    if best is None or best.objective >= cutoff:
        return None
    gap = max(0.0, best.objective - lower) / max(abs(best.objective), 1e-30)
    return replace(
        best, status="optimal" if gap <= 1e-9 else "feasible", gap=gap,
        seconds=time.perf_counter() - start,
    )  # fmt: skip


def _solve_whole(
    problem: Problem, solver: str, time_limit_s: float, rel_gap: float
) -> tuple[Solution, float]:
    """The MIP of `problem`: its solution and the bound the solver proves."""
    result = solve_mip(problem, solver, time_limit_s=time_limit_s, rel_gap=rel_gap)
    if result == pywraplp.Solver.INFEASIBLE:
        raise NoFitError("no strategy assignment satisfies the constraints (infeasible ILP).")
    if isinstance(result, int):
        raise SolverTimeoutError(_out_of_time(solver, time_limit_s, result))
    return _solution_of(problem, result[0]), result[2]


def _solve_fixed(
    problem: Problem,
    relaxed: Relaxed,
    upper: float,
    solver: str,
    time_limit_s: float,
    rel_gap: float,
) -> tuple[Solution | None, float]:
    """The MIP of `problem` less what cannot beat `upper` (`fix_by_reduced_costs`): its
    solution (None if nothing left, or out of time) and a bound of the whole problem's."""
    result = solve_mip(
        fix_by_reduced_costs(problem, relaxed, upper), solver,
        time_limit_s=time_limit_s, rel_gap=rel_gap,
    )  # fmt: skip
    if result == pywraplp.Solver.INFEASIBLE:
        return None, upper  # every solution is one the fixing dropped: none beats `upper`
    if isinstance(result, int):
        return None, relaxed.bound_s
    # What the fixing dropped is worse than `upper`; the solver bounds what it kept.
    return _solution_of(problem, result[0]), min(result[2], upper)


SUPPORT_WEIGHT = 1e-6  # an LP value above this puts the candidate in the rounding MIP


def _solve_on_support(
    problem: Problem, relaxed: Relaxed, solver: str, time_limit_s: float
) -> Solution | None:
    """A solution using only candidates the LP gives weight (a small MIP: the LP is fractional
    at a few nodes), or None if none fits."""
    used = np.ones(relaxed.lp.size, dtype=bool)  # every pair of the used candidates
    for v, (at, n) in relaxed.lp.x_at.items():
        used[at : at + n] = np.array(relaxed.values[v]) > SUPPORT_WEIGHT
    support = restrict(problem, relaxed.lp, used)
    result = solve_mip(support, solver, time_limit_s=time_limit_s, rel_gap=1e-9)
    return None if isinstance(result, int) else _solution_of(problem, result[0])


def _solution_of(problem: Problem, values: Values) -> Solution:
    choice = _choice(values)
    return Solution(choice, problem.objective(choice), "feasible", math.nan, 0.0)


objective_of = attrgetter("objective")


class SolverTimeoutError(PlanError):
    """The solver ran out of time before it found any assignment."""


def _out_of_time(solver: str, time_limit_s: float, status: int | None = None) -> str:
    said = f" (status {status})" if status is not None else ""
    return (
        f"the {solver} solver found no assignment within {time_limit_s:g} s{said}; "
        "raise the time limit (--time-limit-s)."
    )


def _check_memory_floor(problem: Problem) -> None:
    for mem in problem.memory:
        if mem.least_bytes() > mem.limit_bytes:  # each node and edge at its smallest: too big
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
    deadline = time.perf_counter() + time_limit_s  # every round within the one limit
    while chosen not in tried and len(tried) < PART_ROUNDS:
        tried.add(chosen)
        relaxation = _priced_by(problem, chosen)
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        found = solve_below(relaxation, cutoff, solver=solver, time_limit_s=left, rel_gap=rel_gap)
        if found is None:
            return None  # a lower bound of `problem` reaches the cutoff
        lower = max(lower, found.objective * (1 - found.gap))
        value = problem.objective(found.choice)
        if best is None or value < best.objective:
            best = Solution(found.choice, value, found.status, found.gap, found.seconds)
        if best.objective <= lower * (1 + tol):
            gap = max(0.0, (best.objective - lower) / max(abs(best.objective), 1e-30))
            return replace(best, status="optimal" if gap <= tol else "feasible", gap=gap)
        chosen = _largest_parts(problem, found.choice)
    return _UNDECIDED


def _largest_parts(problem: Problem, choice: dict[Key, int]) -> tuple[int, ...]:
    """Per max term, the part that is largest at `choice`."""
    values: list[float] = []
    chosen = []
    for term in problem.max_terms:
        parts = problem.part_values(term, choice, values)
        chosen.append(int(np.argmax(parts)))
        values.append(max(parts))
    return tuple(chosen)


def _heaviest_part(term: MaxTerm) -> int:
    """The part whose cheapest candidates cost the most (likely the largest at the optimum)."""
    floors = [
        sum(float(np.min(c)) for c in part.node_costs.values() if len(c)) for part in term.parts
    ]
    return int(np.argmax(floors))


def _priced_by(problem: Problem, chosen: Sequence[int]) -> Problem:
    """`problem` with each max term replaced by weight x its chosen part, and each inner term
    in it by its own chosen part (a lower bound: a max is at least any part, and inner terms
    enter with non-negative coefficients)."""
    nodes = {v: np.asarray(c, dtype=float) for v, c in problem.node_costs.items()}
    edges = {e: np.asarray(m, dtype=float) for e, m in problem.edge_costs.items()}
    weights = [term.weight for term in problem.max_terms]
    for t in reversed(range(len(problem.max_terms))):  # outer terms hand weight to inner ones
        term, index = problem.max_terms[t], chosen[t]
        for inner, coefficient in term.inner_of(index).items():
            weights[inner] += weights[t] * coefficient
    for term, index, weight in zip(problem.max_terms, chosen, weights, strict=True):
        if weight == 0:
            continue  # (0 x an infinite cost would be nan)
        part = term.parts[index]
        for v, c in part.node_costs.items():
            nodes[v] = nodes[v] + weight * c
        for e, m in part.edge_costs.items():
            assert e in edges, f"max term edge {e} is not an edge of the problem"
            edges[e] = edges[e] + weight * m
    return Problem(nodes, edges, problem.memory)


def _integral(values: Values, tol: float = 1e-6) -> bool:
    return all(min(abs(a), abs(1 - a)) <= tol for xs in values.values() for a in xs)


def _choice(values: Values) -> dict[Key, int]:
    return {v: int(np.argmax(xs)) for v, xs in values.items()}


def brute_force(problem: Problem, chunk: int = 1 << 16) -> Solution:
    """Enumerate every assignment (small problems only): the oracle for `solve`. Priced
    `chunk` assignments at a time (`Problem.objective` on arrays), in `itertools.product`'s
    order over the nodes' candidates: the first of the best wins."""
    start = time.perf_counter()
    keys = list(problem.node_costs)
    sizes = [len(problem.node_costs[k]) for k in keys]
    total = math.prod(sizes)
    assert total <= 2_000_000, f"brute force over {total} assignments"
    best: tuple[float, int] | None = None  # (objective, the assignment's place in the order)
    for first in range(0, total, chunk):
        places = np.arange(first, min(first + chunk, total))
        candidates = np.unravel_index(places, sizes) if keys else ()
        choice = dict(zip(keys, candidates, strict=True))
        value = problem.objective(choice) + np.zeros(len(places))  # an array when no node
        value[~(problem.feasible(choice) & np.ones(len(places), bool))] = math.inf
        i = int(np.argmin(value))
        if math.isfinite(value[i]) and (best is None or value[i] < best[0]):
            best = (float(value[i]), first + i)
    if best is None:
        raise NoFitError("no strategy assignment satisfies the constraints (brute force).")
    chosen = np.unravel_index(best[1], sizes) if keys else ()
    choice = {k: int(c) for k, c in zip(keys, chosen, strict=True)}
    return Solution(choice, best[0], "optimal", 0.0, time.perf_counter() - start)
