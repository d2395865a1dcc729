"""One configuration's ILP solved: to MIP_GAP, then cut until its objective is the simulated step.

Lives here: `solve_mesh` (the best choice of a configuration below a cutoff) and
`cut_to_simulation` (the simulation's critical paths added as cuts, `problem.simulation_cuts`,
until the objective reaches the prediction). Lives elsewhere: the problem (`problem.build`), the
solver (`ilp`), the prediction (`timing.predict`), the LP bound (`bounds.lp`).
"""

from __future__ import annotations

import math

from autosbp.errors import NoFitError
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.ilp.solving import solve_below
from autosbp.planner.problem.build import MeshProblem
from autosbp.planner.problem.simulation_cuts import with_cuts
from autosbp.planner.timing.predict import predict
from autosbp.schedule import run_schedule

MIP_GAP = 1e-3  # the MIP stops within 0.1% of its bound (the plan reports the proven gap)


def solve_mesh(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> Solution | None:
    """The best choice on this mesh, or None if nothing fits in memory or nothing beats
    `cutoff`. For a problem `lower_bound_of` bounded (every node has a candidate)."""
    try:
        solution = solve_below(
            mesh_problem.problem, cutoff, time_limit_s=time_limit_s, rel_gap=MIP_GAP
        )
    except NoFitError:
        return None
    if solution is None or mesh_problem.schedule == "zb1":
        return solution
    return cut_to_simulation(mesh_problem, solution, time_limit_s, cutoff)


MAX_CUTS = 8  # rounds of cuts per solve (a solve that stops short keeps its bound)


def cut_to_simulation(
    mp: MeshProblem, solution: Solution, time_limit_s: float, cutoff: float = math.inf
) -> Solution | None:
    """1F1B, plain or interleaved (not zb1, whose timeline differs): until the solution's
    objective reaches its prediction (to MIP_GAP), add the simulation's critical paths at it
    (`problem.simulation_cuts`, each a lower bound of every choice's step) and solve again; then the
    solution minimizes the simulated step (to MIP_GAP). None if nothing beats `cutoff` once
    cut. After MAX_CUTS rounds the last solution stands, its objective still a lower bound of
    the configuration's every plan."""
    problem = mp.problem
    for _ in range(MAX_CUTS):
        prediction = predict(mp, solution)
        if prediction.step_time_s <= solution.objective * (1 + MIP_GAP):
            break
        timeline = run_schedule(
            mp.pipeline_stages, mp.micro_batches, prediction.forward_s.__getitem__,
            prediction.backward_s.__getitem__, prediction.send_s.__getitem__,
            virtual_stages=mp.virtual_stages,
        )  # fmt: skip
        problem = with_cuts(problem, mp.stage_costs, solution.choice, timeline, prediction.send_s)
        found = solve_below(problem, cutoff, time_limit_s=time_limit_s, rel_gap=MIP_GAP)
        if found is None:
            return None
        solution = found
    return solution
