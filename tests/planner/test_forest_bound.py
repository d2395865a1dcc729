"""Bound (1b) (`bounds.forest`): `forest_min` is the brute-force least on a forest and never above
it with cycles; the bound, and the node bound (1), are at most the ILP objective and the
predicted step of every configuration solved on its own, under 1F1B (with every recomputation
mode), interleaved 1F1B (v = 2) and zero bubble, whose path bounds do not drain (the node
bound's drain term once passed zb1's step). `forest_least_bytes` (`bounds.memory_floor`) lies
between each node's and edge's fewest bytes alone and brute force's fewest, equal to a stage's
own brute force on a tree.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from autosbp.capturing.export import capture
from autosbp.errors import NoFitError
from autosbp.planner.bounds.forest import forest_bound, forest_min
from autosbp.planner.bounds.memory_floor import forest_least_bytes
from autosbp.planner.bounds.nodes import step_bound, unhidden_s
from autosbp.planner.ilp.formulation import MemoryConstraint, Problem
from autosbp.planner.ilp.solving import solve
from autosbp.planner.problem.build import build_problem
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.search.entry import mesh_shapes
from autosbp.planner.space.recomputation import distinct_modes
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.space.ties import tie_graph, tie_stages
from autosbp.planner.timing.predict import gathers_hidden, predict
from autosbp.planner.timing.zero_bubble_price import predict_zb1, weight_shares
from autosbp.sbp import Mesh
from autosbp.schedule import check_interleaving
from autosbp.zoo import build_model
from tests.planner.test_ilp import assignments, memory_per_stage
from tests.planner.test_planner import a100_prices
from tests.planner.test_regather import GPT
from tests.planner.test_search import DEVICES, PER_NODE, RandomPrices, graphs_of, link_of


def brute_force(nodes: dict[str, np.ndarray], edges: dict[tuple[str, str], np.ndarray]) -> float:
    names = list(nodes)
    best = math.inf
    for choice in itertools.product(*(range(len(nodes[r])) for r in names)):
        x = dict(zip(names, choice, strict=True))
        value = sum(nodes[r][x[r]] for r in names)
        value += sum(m[x[u], x[v]] for (u, v), m in edges.items())
        best = min(best, value)
    return best


def random_graph(seed: int, extra_edges: int):
    """A random tree on 6 nodes (2-3 candidates each), plus `extra_edges` that close cycles;
    some pairs forbidden (inf)."""
    rng = np.random.default_rng(seed)
    names = [f"n{i}" for i in range(6)]
    nodes = {r: rng.uniform(0, 1, rng.integers(2, 4)) for r in names}
    pairs = [(names[int(rng.integers(0, i))], names[i]) for i in range(1, 6)]
    while len(pairs) < 5 + extra_edges:
        u, v = rng.choice(names, 2, replace=False)
        if (u, v) not in pairs and (v, u) not in pairs:
            pairs.append((str(u), str(v)))
    edges = {}
    for u, v in pairs:
        m = rng.uniform(0, 2, (len(nodes[u]), len(nodes[v])))
        m[rng.uniform(size=m.shape) < 0.15] = math.inf
        edges[(u, v)] = m
    return nodes, edges


@pytest.mark.parametrize("seed", range(8))
def test_forest_min_is_exact_on_a_tree_and_a_lower_bound_with_cycles(seed: int) -> None:
    nodes, edges = random_graph(seed, 0)
    assert forest_min(nodes, edges) == pytest.approx(brute_force(nodes, edges), rel=1e-12)
    nodes, edges = random_graph(seed, 3)
    least = forest_min(nodes, edges)
    assert least <= brute_force(nodes, edges) + 1e-12
    assert least >= sum(float(np.min(v)) for v in nodes.values()) - 1e-12


def configurations(schedule: str, v: int):
    """(graph, count, pipeline stages, mesh, mode) of a 4-layer GPT on DEVICES: every stage
    count the schedule takes (v x stages <= the 4 blocks), micro-batch count and mesh."""
    graphs = graphs_of("gpt")
    # the modes that recompute something here (`distinct_modes`: the search offers no other)
    modes = ("none",) if schedule == "zb1" else distinct_modes(next(iter(graphs.values())))
    stage_counts = {("1f1b", 1): (1, 2, 4), ("1f1b", 2): (2,), ("zb1", 1): (2, 4)}
    for pipeline in stage_counts[(schedule, v)]:
        meshes = mesh_shapes(
            DEVICES // pipeline, lambda shape, d, p=pipeline: link_of((p, *shape), d + 1), PER_NODE
        )
        for count, mesh, mode in itertools.product(graphs, meshes, modes):
            if count >= pipeline and (v == 1 or check_interleaving(pipeline, v, count) is None):
                yield graphs[count], count, pipeline, mesh, mode


def solved(graph, count, pipeline, mesh, mode, schedule, v, prices, limit):
    """The configuration's problem, its optimum and the step predicted of it (None: no fit)."""
    mp = build_problem(
        graph, mesh, prices, optimizer="adam", memory_limit_bytes=limit, micro_batches=count,
        split=split_stages(graph, pipeline * v), recompute=mode,
        stage_link=link_of((pipeline, mesh.size), 0), allow=strategy_space("auto").allow,
        virtual_stages=v, schedule=schedule,
    )  # fmt: skip
    try:
        solution = solve_mesh(mp, 60, math.inf)
    except NoFitError:
        return None
    if solution is None:  # an infeasible LP: nothing fits
        return None
    if schedule == "zb1":
        return mp, solution, predict_zb1(mp, solution, weight_shares(graph))
    return mp, solution, predict(mp, solution)


CASES = [  # schedule, v, seed, memory limit as a share of the unconstrained plan's peak
    ("1f1b", 1, 3, None), ("1f1b", 1, 5, 0.5), ("1f1b", 2, 4, None), ("zb1", 1, 3, None),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "v", "seed", "share"), CASES)
def test_bounds_are_at_most_the_objective_and_the_step(
    schedule: str, v: int, seed: int, share: float | None
) -> None:
    prices, checked, drained = RandomPrices.draw(seed), 0, 0.0
    for graph, count, pipeline, mesh, mode in configurations(schedule, v):
        if share is not None and mode != "none":  # the limit's gathers: one mode shows them
            continue
        args = (graph, count, pipeline, mesh, mode, schedule, v, prices)
        found = solved(*args, None)
        if share is not None:  # a limit that makes parameters gather (hidden behind compute)
            assert found is not None
            found = solved(*args, share * max(found[2].peak_bytes))
        if found is None:
            continue
        mp, solution, prediction = found
        tied, drain = tie_stages(tie_graph(graph), mp.split), schedule != "zb1"
        forest = forest_bound(
            tied, price_graph(graph, mesh, prices, strategy_space("auto").allow), pipeline * v,
            count, mode, prices.overlap_efficiency, drain=drain,
        )  # fmt: skip
        copies = tied.copies()
        times = {r: unhidden_s(mp.strategies[r]) for _, r in copies}
        nodes = step_bound(graph, copies, pipeline * v, times, count, mode, drain=drain)
        step = prediction.step_time_s
        assert forest <= solution.objective * (1 + 1e-9), (forest, solution.objective, mesh)
        assert max(forest, nodes) <= step * (1 + 1e-9), (forest, nodes, step, count, pipeline)
        checked += 1
        drained = max(drained, step_bound(graph, copies, pipeline * v, times, count, mode) / step)
    assert checked >= 5
    if schedule == "zb1":  # these prices: a drain term passes zb1's step (24%)
        assert drained > 1.1


def test_the_gathers_that_compute_hides_are_left_out() -> None:
    """FSDP of a 4-block GPT on 2 devices: each block's weights are gathered behind the blocks'
    compute, and the bound stays under the objective (it passes it with the gathers counted
    whole: checked by hand)."""
    model, inputs = build_model("gpt", device="meta", **GPT)
    graph, prices, allow = capture(model, inputs), a100_prices(), strategy_space("fsdp").allow
    mp = build_problem(
        graph, Mesh((2,)), prices, optimizer="adam", memory_limit_bytes=None, allow=allow
    )
    solution = solve(mp.problem)
    forward, backward = gathers_hidden(mp.stage_costs, solution.choice)
    assert forward[0] > 0 and backward[0] > 0
    tied = tie_stages(tie_graph(graph), mp.split)
    priced = price_graph(graph, mp.mesh, prices, allow)
    bound = forest_bound(tied, priced, 1, 1, "none", prices.overlap_efficiency)
    assert bound <= solution.objective * (1 + 1e-9)


def fewest_bytes(problem: Problem, mem: MemoryConstraint, keys: set | None = None) -> float:
    """Brute force: the fewest bytes of `mem` over the choices of `keys` (every node where
    None) that `problem` allows among them (finite node costs, finite edge costs)."""
    keys = set(problem.node_costs) if keys is None else keys
    sub = Problem(
        {v: c for v, c in problem.node_costs.items() if v in keys},
        {e: m for e, m in problem.edge_costs.items() if e[0] in keys and e[1] in keys},
    )
    allowed = (c for c in assignments(sub) if math.isfinite(sub.objective(c)))
    return min((mem.used_bytes(c) for c in allowed), default=math.inf)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "cycles"])
def test_forest_least_bytes_lies_between_each_alone_and_every_choice(seed: int, tree: bool) -> None:
    # Oracle: brute force over every choice the problem allows (finite costs), and over its
    # stage's own nodes: the bound reads a stage alone, and is exact there on a tree.
    problem = memory_per_stage(seed, 0.3)
    if tree:  # the chain alone: each node's edge from the one before it
        edges = {(u, v): m for (u, v), m in problem.edge_costs.items() if u == v - 1}
        memory = tuple(
            replace(m, bytes_per_pair={e: b for e, b in m.bytes_per_pair.items() if e in edges})
            for m in problem.memory
        )
        problem = replace(problem, edge_costs=edges, memory=memory)
    for mem in problem.memory:
        least = forest_least_bytes(problem, mem)
        own = set(mem.bytes_per_candidate) | {v for e in mem.bytes_per_pair for v in e}
        assert mem.least_bytes() <= least * (1 + 1e-12)
        assert least <= fewest_bytes(problem, mem) * (1 + 1e-12)
        if tree:
            assert least == pytest.approx(fewest_bytes(problem, mem, own), rel=1e-12)


def test_forest_least_bytes_is_tighter_than_each_alone_on_some_problems() -> None:
    # Guard for the test above: an edge's fewest bytes and its ends' are not one choice.
    tighter = 0
    for seed in range(6):
        problem = memory_per_stage(seed, 0.3)
        tighter += any(
            forest_least_bytes(problem, m) > m.least_bytes() * (1 + 1e-9) for m in problem.memory
        )
    assert tighter > 0
