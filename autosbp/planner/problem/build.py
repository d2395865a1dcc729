"""The strategy ILP of one configuration (stage count, stage mesh, micro-batch count,
recomputation), and what its solution predicts.

Lives here: the Problem of one configuration (`build_problem`: objective and memory, see its
docstring), its bound and its solve (`lower_bound_of`, `bound_mesh`, `solve_mesh`), and the
prediction of a solved configuration by the actor simulation (`predict`). Lives elsewhere: the
prices of a graph on a stage mesh that every configuration shares (`priced`: `Priced`,
`price_graph`), the per-stage sums (`stage_terms`), the objective made of them, a lower bound of
`predict` (`objective`), prices (`candidates`, `memory`, what backward keeps: `kept`), stages and
recomputation (`pipeline`), tied blocks (`reduce`), the solver (`ilp`), the search over
configurations (`search`), hand-plan restrictions (`hand_plans`).

Each configuration is solved exactly (to MIP_GAP). Within a stage, the objective has one
overlap: the gradient sync runs while the last micro-batch's backward does
(`overlap.hidden_sync_s`); every op's forward and backward, every boxing and the optimizer
update run one after another on each device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from autosbp.boxing.params import gathers_run_beside
from autosbp.capturing.graph import OpGraph
from autosbp.errors import NoFitError
from autosbp.overlap import hidden_gather_s, hidden_sync_s
from autosbp.planner.ilp.formulation import MemoryConstraint, Problem, Solution
from autosbp.planner.ilp.solving import bound_or_solve, solve_below
from autosbp.planner.problem.priced import Allow, Priced, price_graph
from autosbp.planner.problem.simulation_cuts import with_cuts
from autosbp.planner.problem.stage_terms import P2P, StageTerms
from autosbp.planner.space.stages import StageSplit, interleaved_in_flight, split_stages
from autosbp.planner.space.ties import TiedStages, tie_graph, tie_stages
from autosbp.planner.timing.candidates import NodeStrategies, Prices
from autosbp.planner.timing.finite_check import check_step_s
from autosbp.planner.timing.objective import StageCosts, objective_terms
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh
from autosbp.schedule import run_schedule
from autosbp.zero_bubble import zb1_in_flight_counts


@dataclass(frozen=True)
class MeshProblem:
    """The ILP of one (graph, stage mesh, stages, micro-batches, recomputation) with the
    candidates behind its indices."""

    mesh: Mesh  # every stage's mesh shape (stage s runs on its own devices)
    strategies: dict[str, NodeStrategies]  # every node (tied nodes share their representative's)
    problem: Problem  # keyed by representative nodes
    representative: dict[str, str]
    split: StageSplit
    stage_costs: StageCosts
    micro_batches: int = 1
    recompute: str = "none"
    graph: OpGraph | None = None
    # Interleaved 1F1B: `split`'s stages are v x P virtual stages, c x P + d on stage d's
    # devices (the search's device count then counts each device v times).
    virtual_stages: int = 1
    schedule: str = "1f1b"  # the pipeline schedule it prices (`schedule.SCHEDULES`)

    @property
    def pipeline_stages(self) -> int:
        return self.split.num_stages // self.virtual_stages

    def choice_of(self, solution: Solution, name: str) -> NdSignature:
        return self.strategies[name].candidates[solution.choice[self.representative[name]]]


def build_problem(
    graph: OpGraph,
    mesh: Mesh,
    prices: Prices,
    *,
    optimizer: str,
    memory_limit_bytes: float | None,
    allow: Allow | None = None,
    micro_batches: int = 1,
    split: StageSplit | None = None,
    recompute: str = "none",
    stage_link: str = "inter_node",
    priced: Priced | None = None,
    tied: TiedStages | None = None,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
) -> MeshProblem:
    """The ILP of `graph` (one micro-batch) with `split`'s stages, each on a mesh like `mesh`.

    Objective (`objective`): with stages, the largest of the 1F1B path bounds (Narayanan et
    al. 2021 section 2.2: the fill to a stage, its steady state, the drain, a stage's update),
    a lower bound of the simulated step for every choice and equal to it with the slowest
    stage last; with one stage, micro_batches x the stage time plus its update. Within a
    stage, ops and activations' boxing run one after another; parameters' conversions overlap
    the compute of identical blocks (`overlap.hidden_gather_s`) and the gradient sync the
    last backward (`overlap.hidden_sync_s`). Memory: one constraint per stage, what backward
    keeps x the micro-batches in flight there (`stage_terms`), on node candidates and on edge
    pairs (the converted copies kept, unless a parameter re-gathers them). Interleaved
    (`virtual_stages` v > 1: `split` holds v x P virtual stages), each virtual stage keeps the
    micro-batches its chunk holds at its device's peak (`pipeline.interleaved_in_flight`) and
    the objective adds to 1F1B's path bounds over the virtual stages the device path bounds
    (`objective`: each device's chunks' whole load, its chunk-0 fill and drain), a lower bound
    of `predict`'s interleaved schedule for every choice and equal to it on identical chunks.
    """
    split = split or split_stages(graph, 1)
    gathers = gathers_run_beside(virtual_stages, schedule == "zb1")
    priced = priced or price_graph(graph, mesh, prices, allow, gathers=gathers)
    tied = tied or tie_stages(tie_graph(graph, priced.representative), split)
    blocks = tuple(len(b) for b in split.blocks)
    kept = zb1_in_flight_counts(split.num_stages, micro_batches) if schedule == "zb1" else None
    if virtual_stages > 1:
        kept = interleaved_in_flight(
            split.num_stages // virtual_stages, virtual_stages, micro_batches
        )
    terms = StageTerms(blocks, priced.blocks_identical(), kept)
    terms.add_nodes(tied, priced, optimizer, micro_batches, recompute)
    devices_stages = split.num_stages // virtual_stages
    terms.add_check(check_step_s(prices, mesh, devices_stages, stage_link), devices_stages)
    keys = list(dict.fromkeys(priced.representative.values()))
    sizes = {r: len(priced.strategies[r].candidates) for r in keys}
    # Where the nodes alone overflow a stage (each at its fewest bytes), no choice fits: the
    # edges are not priced (most configurations of a deep model end here; `lower_bound_of`
    # then says nothing fits, and the no-fit message reads the node bytes).
    overflows = memory_limit_bytes is not None and terms.least_bytes(sizes) > memory_limit_bytes
    if not overflows:
        terms.add_edges(tied, priced, recompute, P2P(prices, mesh, stage_link))
    stage_costs = terms.stage_costs(sizes, prices.overlap_efficiency, memory_limit_bytes)
    node_costs, edge_costs, max_terms = objective_terms(
        stage_costs, keys, micro_batches, virtual_stages, schedule
    )
    constraints = (
        tuple(replace(c, name=f"{c.name} memory") for c in stage_costs.memory)
        + gather_constraints(stage_costs)
        if memory_limit_bytes is not None
        else ()
    )
    problem = Problem(node_costs, edge_costs, constraints, max_terms)
    return MeshProblem(
        mesh, priced.strategies, problem, priced.representative, split, stage_costs,
        micro_batches, recompute, graph, virtual_stages, schedule,
    )  # fmt: skip


MIP_GAP = 1e-3  # the MIP stops within 0.1% of its bound (the plan reports the proven gap)


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
    (`interleaved_cuts`, each a lower bound of every choice's step) and solve again; then the
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


@dataclass(frozen=True)
class Prediction:
    """A solved problem priced as the runtime runs it (`schedule.run_schedule`; interleaved,
    `peak_bytes` and `bubble_s` are each virtual stage's device's, all its chunks): per stage its
    per-micro-batch forward/backward (what stays exposed of the parameters' conversions
    included, `gather_hidden_s` of them hidden behind the blocks' compute), transfer to the
    next stage and per-step update (seconds; `sync_s` of it the gradient sync, the rest the
    optimizer's), the part of the update's sync that the last backward hides, and peak bytes; the step time is when the last stage finishes its update."""

    step_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    update_s: tuple[float, ...]
    sync_hidden_s: tuple[float, ...]  # of update_s, what the last backward hides
    peak_bytes: tuple[float, ...]
    bubble_s: tuple[float, ...]
    gather_hidden_s: tuple[float, ...] = ()  # per micro-batch, forward + backward
    sync_s: tuple[float, ...] = ()  # of update_s, the gradient sync (the rest: the optimizer)
    weight_s: tuple[float, ...] = ()  # zb1: of backward_s, W's (`zero_bubble_price`)


def predict(mp: MeshProblem, solution: Solution) -> Prediction:
    costs, choice = mp.stage_costs, solution.choice
    fwd = tuple(c.value(choice) for c in costs.forward)
    busy = tuple(c.value(choice) for c in costs.busy)
    send = tuple(c.value(choice) for c in costs.send)
    update = tuple(c.value(choice) for c in costs.update)
    bwd = tuple(b - f for b, f in zip(busy, fwd, strict=True))
    hidden = tuple(
        hidden_sync_s(c.value(choice), b, k, costs.overlap)
        for c, b, k in zip(costs.sync, bwd, costs.sync_buckets, strict=True)
    )
    forward_hidden, backward_hidden = gathers_hidden(costs, choice)
    exposed_fwd = tuple(f - h for f, h in zip(fwd, forward_hidden, strict=True))
    exposed_bwd = tuple(b - h for b, h in zip(bwd, backward_hidden, strict=True))
    p, v = mp.pipeline_stages, mp.virtual_stages
    timeline = run_schedule(
        p, mp.micro_batches, exposed_fwd.__getitem__, exposed_bwd.__getitem__,
        send.__getitem__, virtual_stages=v,
    )  # fmt: skip

    def device(values: Sequence[float], s: int) -> float:
        """Of virtual stage s: the sum over its device's chunks."""
        return sum(values[c * p + s % p] for c in range(v))

    ends = [
        timeline.end_s(s % p) + device(update, s) - device(hidden, s)
        for s in range(mp.split.num_stages)
    ]
    used = [
        max(mem.used_bytes(choice), _update_bytes(costs, s, choice))
        for s, mem in enumerate(costs.memory)
    ]
    peaks = tuple(device(used, s) for s in range(mp.split.num_stages))
    bubbles = tuple(timeline.bubble_s(s % p) for s in range(mp.split.num_stages))
    gathers = tuple(f + b for f, b in zip(forward_hidden, backward_hidden, strict=True))
    sync = tuple(c.value(choice) for c in costs.sync)
    return Prediction(
        max(ends), exposed_fwd, exposed_bwd, send, update, hidden, peaks, bubbles, gathers, sync
    )


def gather_constraints(costs: StageCosts) -> tuple[MemoryConstraint, ...]:
    """The stages' memory at their weight gathers, where some candidate gathers in a bucket
    (elsewhere the stage's own constraint implies it: the same bytes, and activations)."""
    return tuple(
        c
        for c, staged in zip(costs.update_memory, costs.staging, strict=True)
        if any(np.any(b) for b in staged.node_costs.values())
    )


def _update_bytes(costs: StageCosts, s: int, choice: dict) -> float:
    """Stage s's bytes at its weight gather under `choice`: the buffer is the chosen bucketed
    parameters' pieces, at most one bucket's (where the constraint prices a bucket whatever
    the choice, its constant)."""
    if not costs.update_memory:
        return 0.0
    mem = costs.update_memory[s]
    if not mem.constant_bytes:  # exact: the pieces are in its bytes
        return mem.used_bytes(choice)
    buffer = min(mem.constant_bytes, costs.staging[s].value(choice))
    return mem.used_bytes(choice) - mem.constant_bytes + buffer


def gathers_hidden(costs: StageCosts, choice: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage and micro-batch, the parameter communication the blocks' compute hides in
    forward and in backward (`overlap.hidden_gather_s`; 0 where the stage has no slots)."""
    stages = range(len(costs.busy))
    if not costs.slots:
        return (0.0,) * len(stages), (0.0,) * len(stages)

    def hidden(comm: tuple, compute: tuple) -> tuple[float, ...]:
        return tuple(
            hidden_gather_s(
                comm[s].value(choice), compute[s].value(choice), costs.slots[s], costs.overlap
            )
            for s in stages
        )

    return (
        hidden(costs.gather_forward, costs.compute_forward),
        hidden(costs.gather_backward, costs.compute_backward),
    )
