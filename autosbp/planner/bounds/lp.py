"""Bound (2): the LP relaxation of a configuration's ILP, a step time no choice of it beats.

Lives here: `lower_bound_of` and `bound_mesh` (the LP relaxation, and the plan itself when the LP
is integral, cut to the simulation as a solve would be). Lives elsewhere: the problem
(`problem.build`), the relaxation (`ilp.solving.bound_or_solve`), the shared bound (2a) of a
configuration's recomputation modes (`search.evaluator`), the order of the bounds
(`search.entry`).
"""

from __future__ import annotations

import math

from autosbp.errors import NoFitError
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.ilp.solving import bound_or_solve
from autosbp.planner.problem.build import MeshProblem
from autosbp.planner.problem.solve import cut_to_simulation


def lower_bound_of(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> float | None:
    """A step time no choice on this mesh beats (the LP relaxation's, or `cutoff` once the LP
    shows that), or None if nothing fits (a node without candidates, or memory)."""
    found = bound_mesh(mesh_problem, time_limit_s, cutoff)
    return None if found is None else found[0]


def bound_mesh(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> tuple[float, Solution | None] | None:
    """`lower_bound_of`, and the optimal solution when the LP relaxation is integral."""
    if any(len(s.candidates) == 0 for s in mesh_problem.strategies.values()):
        return None
    try:
        bound, solution = bound_or_solve(
            mesh_problem.problem, time_limit_s=time_limit_s, cutoff=cutoff
        )
    except NoFitError:
        return None
    if solution is None or mesh_problem.schedule == "zb1":
        return bound, solution
    cut = cut_to_simulation(mesh_problem, solution, time_limit_s, cutoff)
    return (bound, None) if cut is None else (max(bound, cut.objective * (1 - cut.gap)), cut)
