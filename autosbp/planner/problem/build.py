"""The strategy ILP of one configuration (stage count, stage mesh, micro-batch count,
recomputation): its objective and memory constraints over the candidates behind its indices.

Lives here: `MeshProblem` (the ILP of one configuration with its candidates), `build_problem`
(objective and memory, see its docstring) and `memory_constraints` (a device's memory: its stage's,
or an interleaved device's chunks' together, and at its weight gathers). Lives elsewhere: the
prices of a graph on a stage mesh that every configuration shares (`problem.priced`), the per-stage
sums (`problem.stage_terms`), the objective made of them (`timing.objective`), its solve
(`problem.solve`), its LP bound (`bounds.lp`), its prediction (`timing.predict`), prices (`timing`,
`memory`), stages, recomputation and ties (`space`), the solver (`ilp`), the search over
configurations (`search`).

Each configuration is solved exactly (to MIP_GAP). Within a stage, the objective has one
overlap: the gradient sync runs while the last micro-batch's backward does
(`overlap.hidden_sync_s`); every op's forward and backward, every boxing and the optimizer
update run one after another on each device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autosbp.boxing.params import gathers_run_beside
from autosbp.capturing.graph import OpGraph
from autosbp.planner.ilp.formulation import MemoryConstraint, Problem, Solution
from autosbp.planner.memory.in_flight import interleaved_in_flight
from autosbp.planner.problem.priced import Priced, price_graph
from autosbp.planner.problem.stage_terms import P2P, StageTerms
from autosbp.planner.space.recomputation import block_modes, partial_blocks
from autosbp.planner.space.stages import StageSplit, split_stages
from autosbp.planner.space.strategy import Allow
from autosbp.planner.space.ties import ModeTies, TiedStages, tie_graph, tie_modes, tie_stages
from autosbp.planner.timing.candidates import NodeStrategies, Prices
from autosbp.planner.timing.finite_check import check_step_s
from autosbp.planner.timing.objective import StageCosts, objective_terms
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh
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
    modes: ModeTies | None = None,
) -> MeshProblem:
    """The ILP of `graph` (one micro-batch) with `split`'s stages, each on a mesh like `mesh`.

    Objective (`timing.objective`): with stages, the largest of the 1F1B path bounds (Narayanan et
    al. 2021 section 2.2: the fill to a stage, its steady state, the drain, a stage's update), a
    lower bound of the simulated step for every choice and equal to it with the slowest stage last;
    with one stage, micro_batches x the stage time plus its update. Within a stage, ops and
    activations' boxing run one after another; parameters' conversions overlap the compute of
    identical blocks (`overlap.hidden_gather_s`) and the gradient sync the last backward
    (`overlap.hidden_sync_s`). Memory: one constraint per stage, what backward keeps x the
    micro-batches in flight there (`problem.stage_terms`), on node candidates and on edge pairs (the
    converted copies kept, unless a parameter re-gathers them). Interleaved (`virtual_stages` v > 1:
    `split` holds v x P virtual stages), each virtual stage keeps the micro-batches its chunk holds
    at its device's peak (`memory.in_flight.interleaved_in_flight`), a device's chunks share its
    `memory_limit_bytes` (`memory_constraints`), and the objective adds to 1F1B's
    path bounds over the virtual stages the device path bounds (`timing.objective`: each device's
    chunks' whole load, its chunk-0 fill and drain), a lower bound of `predict`'s interleaved
    schedule for every choice and equal to it on identical chunks.
    """
    split = split or split_stages(graph, 1)
    gathers = gathers_run_beside(virtual_stages, schedule == "zb1")
    priced = priced or price_graph(
        graph, mesh, prices, allow, gathers=gathers, regathers=schedule != "zb1"
    )
    tied = tied or tie_stages(tie_graph(graph, priced.representative), split)
    if partial_blocks(recompute) is not None and modes is None:  # `full:K`: modes per block
        per_block = block_modes(recompute, split.blocks)
        modes = tie_modes(tie_graph(graph, priced.representative), split, per_block)
    blocks = tuple(len(b) for b in split.blocks)
    kept = zb1_in_flight_counts(split.num_stages, micro_batches) if schedule == "zb1" else None
    if virtual_stages > 1:
        kept = interleaved_in_flight(
            split.num_stages // virtual_stages, virtual_stages, micro_batches
        )
    terms = StageTerms(blocks, priced.blocks_identical(), kept)
    terms.add_nodes(tied, priced, optimizer, micro_batches, recompute, modes)
    devices_stages = split.num_stages // virtual_stages
    terms.add_check(check_step_s(prices, mesh, devices_stages, stage_link), devices_stages)
    keys = list(dict.fromkeys(priced.representative.values()))
    sizes = {r: len(priced.strategies[r].candidates) for r in keys}
    # Where the nodes alone overflow a stage (each at its fewest bytes), no choice fits: the
    # edges are not priced (most configurations of a deep model end here; `lower_bound_of`
    # then says nothing fits, and the no-fit message reads the node bytes).
    overflows = (
        memory_limit_bytes is not None
        and terms.least_bytes(sizes, virtual_stages) > memory_limit_bytes
    )
    if not overflows:
        terms.add_edges(
            tied, priced, recompute, micro_batches, P2P(prices, mesh, stage_link), modes
        )
    stage_costs = terms.stage_costs(sizes, prices.overlap_efficiency, memory_limit_bytes)
    node_costs, edge_costs, max_terms = objective_terms(
        stage_costs, keys, micro_batches, virtual_stages, schedule
    )
    constraints = (
        memory_constraints(stage_costs, virtual_stages) if memory_limit_bytes is not None else ()
    )
    problem = Problem(node_costs, edge_costs, constraints, max_terms)
    return MeshProblem(
        mesh, priced.strategies, problem, priced.representative, split, stage_costs,
        micro_batches, recompute, graph, virtual_stages, schedule,
    )  # fmt: skip


def memory_constraints(costs: StageCosts, virtual_stages: int) -> tuple[MemoryConstraint, ...]:
    """A configuration's memory constraints, each within the limit `costs` was built with (a
    device's): each stage's memory, and where some candidate gathers weights or reduce-scatters
    gathered ones, its bytes at that moment (`gather_constraints`). Interleaved (v > 1), the v
    chunks of a device share its memory: one constraint per device, its chunks' bytes summed
    (each chunk's at the device's peak: `memory.in_flight.interleaved_in_flight`), and at one
    chunk's gather or reduce-scatter, that moment's bytes with the device's other chunks'."""
    stages = [replace(c, name=f"{c.name} memory") for c in costs.memory]
    gathers = gather_constraints(costs)
    v = virtual_stages
    if v == 1:
        return (*stages, *(c for _, c in gathers))
    p = len(stages) // v

    def others(s: int) -> list[MemoryConstraint]:
        return [stages[c * p + s % p] for c in range(v) if c * p + s % p != s]

    devices = tuple(
        summed([stages[c * p + d] for c in range(v)], f"device of stage {d} memory")
        for d in range(p)
    )
    moments = tuple(summed([c, *others(s)], c.name) for s, c in gathers)
    return devices + moments


def summed(parts: list[MemoryConstraint], name: str) -> MemoryConstraint:
    """One constraint holding `parts`' bytes together (their node arrays and edge matrices added
    per key), within the first part's limit."""
    nodes: dict = {}
    pairs: dict = {}
    for part in parts:
        for key, b in part.bytes_per_candidate.items():
            nodes[key] = nodes[key] + b if key in nodes else b
        for key, b in part.bytes_per_pair.items():
            pairs[key] = pairs[key] + b if key in pairs else b
    constant = sum(part.constant_bytes for part in parts)
    return MemoryConstraint(nodes, parts[0].limit_bytes, constant, name, pairs)


def gather_constraints(costs: StageCosts) -> tuple[tuple[int, MemoryConstraint], ...]:
    """The stages' memory at their weight gathers, where some candidate gathers in a bucket, and
    at their gathered weights' reduce-scatters, where some gradient outweighs its copy
    (elsewhere the stage's own constraint implies each: the same bytes, and activations); each
    with its stage."""
    gathers = tuple(
        (s, c)
        for s, (c, staged) in enumerate(zip(costs.update_memory, costs.staging, strict=True))
        if any(np.any(b) for b in staged.node_costs.values())
    )
    reduces = tuple((s, c) for s, c in enumerate(costs.reduce_memory) if c is not None)
    return gathers + reduces
