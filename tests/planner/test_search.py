"""The outer search against its oracle: exhaustive enumeration of the same space.

On tiny zoo models (4 repeated blocks, so 1, 2 and 4 stages) with random hardware prices and
memory limits, every configuration (stage count, stage mesh, micro-batch count dividing the
batch, recomputation mode) is built and solved on its own, its plan priced by the simulation;
the search must return the least of those (within MIP_GAP, the gap it proves), and every bound
it orders configurations by must be at most that configuration's value. The ILP objective, from
which the LP bound comes, must never exceed the simulation of the same choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from autosbp.capturing.graph import OpGraph
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import MicroBatchError, NoFitError
from autosbp.planner.bounds.forest import forest_bound
from autosbp.planner.bounds.lp import lower_bound_of
from autosbp.planner.bounds.nodes import compute_floors, step_bound, unhidden_s
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.memory.kept import kept_for_backward
from autosbp.planner.problem.build import MeshProblem, build_problem
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.problem.solve import MIP_GAP, solve_mesh
from autosbp.planner.search.entry import divisors, mesh_shapes, search
from autosbp.planner.space.recomputation import distinct_modes
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.space.ties import tie_graph, tie_stages
from autosbp.planner.timing.predict import predict
from autosbp.zoo import build_model

DEVICES, PER_NODE = 4, 2


@dataclass(frozen=True)
class RandomPrices:
    """Hardware drawn from a seed: op rate, memory bandwidth, per-op floor, collective latency
    and bandwidth per link class, p2p, and how much communication compute hides. Any prices
    make valid problems; random ones move the optimum across the space."""

    flops_per_s: float
    bytes_per_s: float
    floor_s: float
    latency_s: dict[str, float]
    link_bytes_per_s: dict[str, float]
    overlap_efficiency: float
    causal_skip = 0.0  # a class attribute, not drawn: a math attention kernel

    @classmethod
    def draw(cls, seed: int) -> RandomPrices:
        rng = np.random.default_rng(seed)

        def log_uniform(lo: float, hi: float) -> float:
            return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

        links = ("intra_node", "inter_node")
        return cls(
            log_uniform(1e8, 1e11), log_uniform(1e8, 1e10), log_uniform(1e-7, 1e-5),
            {link: log_uniform(1e-7, 1e-4) for link in links},
            {link: log_uniform(1e7, 1e10) for link in links}, float(rng.uniform(0, 1)),
        )  # fmt: skip

    def op_time_s(
        self, flops: float, nbytes: float, dtype: torch.dtype, transcendentals: float = 0.0
    ) -> float:
        return max(
            (flops + transcendentals) / self.flops_per_s + nbytes / self.bytes_per_s, self.floor_s
        )

    def collective_time_s(
        self, kind: str, message_bytes: float, group_size: int, link_class: str
    ) -> float:
        if group_size <= 1 or message_bytes <= 0:
            return 0.0
        return self.latency_s[link_class] + message_bytes / self.link_bytes_per_s[link_class]

    def p2p_time_s(self, nbytes: float, link_class: str) -> float:
        return self.latency_s[link_class] + nbytes / self.link_bytes_per_s[link_class]


def link_of(shape: tuple[int, ...], mesh_dim: int) -> str:
    """Row-major device ids, PER_NODE to a node: a mesh dim stays in a node when the devices it
    spans (its size times the sizes inside it) fit in one."""
    return "intra_node" if math.prod(shape[mesh_dim:]) <= PER_NODE else "inter_node"


MODELS = {
    "mlp": {"layers": 4, "hidden": 16, "features": 8, "outputs": 4, "batch": 8},
    "gpt": {"layers": 4, "hidden": 16, "heads": 2, "vocab": 32, "seq": 8, "batch": 8},
}


@functools.cache
def graphs_of(model: str) -> dict[int, OpGraph]:
    module, inputs = build_model(model, device="meta", **MODELS[model])
    return micro_batch_graphs(module, inputs, divisors(MODELS[model]["batch"]))


@dataclass(frozen=True)
class Solved:
    """One configuration of the enumeration, solved on its own."""

    stages: int
    count: int
    mp: MeshProblem
    solution: Solution
    step_s: float


def enumerate_space(
    graphs: dict[int, OpGraph], prices: RandomPrices, limit: float | None
) -> tuple[float, list[Solved]]:
    """The least predicted step over every configuration of the search's space, each built
    without the search's caches, order or bounds, and the configurations solved on the way. A
    configuration is solved below the least so far (`solve_mesh`'s cutoff: None only when no
    choice has an ILP objective below it, and the objective never exceeds the prediction), so
    the least is exact (to MIP_GAP) and the others need no MIP."""
    best, solved = math.inf, []
    blocks = len({a.block for _, a in graphs[1].nodes() if a.block is not None})
    auto = strategy_space("auto").allow  # every rule's own kernel (no ring attention)
    for stages in (s for s in range(1, blocks + 1) if DEVICES % s == 0):
        meshes = mesh_shapes(
            DEVICES // stages, lambda shape, d, p=stages: link_of((p, *shape), d + 1), PER_NODE
        )
        for count in (c for c in graphs if stages == 1 or c >= stages):
            graph = graphs[count]
            for mesh in meshes:
                for mode in distinct_modes(graph):  # as the search offers them
                    mp = build_problem(
                        graph, mesh, prices, optimizer="adam", memory_limit_bytes=limit,
                        micro_batches=count, split=split_stages(graph, stages), recompute=mode,
                        stage_link=link_of((stages, mesh.size), 0), allow=auto,
                    )  # fmt: skip
                    solution = solve_mesh(mp, 60, best)
                    if solution is not None:
                        step = predict(mp, solution).step_time_s
                        solved.append(Solved(stages, count, mp, solution, step))
                        best = min(best, step)
    return best, solved


def search_space(
    graphs: dict[int, OpGraph], prices: RandomPrices, limit: float | None, jobs: int = 1
):
    blocks = len({a.block for _, a in graphs[1].nodes() if a.block is not None})
    return search(
        graphs.__getitem__, 8, DEVICES, prices, link_of, strategy_space("auto", "auto", blocks),
        optimizer="adam", memory_limit_bytes=limit, time_limit_s=120, devices_per_node=PER_NODE,
        jobs=jobs,
    )  # fmt: skip


def bounds_of(graph: OpGraph, prices: RandomPrices, item: Solved) -> dict[str, float]:
    """The search's bounds of one configuration, computed afresh."""
    mp = item.mp
    tied = tie_stages(tie_graph(graph), mp.split)
    copies = tied.copies()
    shares = kept_for_backward(graph, tie_graph(graph).representative, "none").backward_share
    floors = compute_floors(graph, prices, mp.mesh.size, {r for _, r in copies}, shares)
    nodes = {r: unhidden_s(mp.strategies[r]) for _, r in copies}
    priced = price_graph(graph, mp.mesh, prices, strategy_space("auto").allow)
    args = (graph, copies, item.stages)
    least = build_problem(  # bound (2a): the least recomputation, no memory limit
        graph, mp.mesh, prices, optimizer="adam", memory_limit_bytes=None,
        micro_batches=item.count, split=mp.split, recompute="none",
        stage_link=link_of((item.stages, mp.mesh.size), 0),
    )  # fmt: skip
    return {
        "floor": step_bound(*args, floors, item.count, mp.recompute),
        "nodes": step_bound(*args, nodes, item.count, mp.recompute),
        "forest": forest_bound(
            tied, priced, item.stages, item.count, mp.recompute, prices.overlap_efficiency
        ),
        "shared": lower_bound_of(least, 60) or math.inf,
        "lp": lower_bound_of(mp, 60) or math.inf,
    }


CASES = [
    pytest.param(model, seed, fraction, id=f"{model}-s{seed}-{fraction or 'nolimit'}")
    for model, seed, fraction in (
        ("mlp", 0, None), ("mlp", 1, 0.7), ("mlp", 2, 0.5),
        ("gpt", 3, None), ("gpt", 4, 0.7), ("gpt", 5, 0.5),
    )
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("model", "seed", "fraction"), CASES)
def test_search_returns_the_optimum_of_exhaustive_enumeration(
    model: str, seed: int, fraction: float | None
) -> None:
    graphs, prices = graphs_of(model), RandomPrices.draw(seed)
    limit = None
    if fraction is not None:  # below what the fastest plan without a limit needs
        free = search_space(graphs, prices, None)
        limit = fraction * max(free.prediction.peak_bytes)
    best, solved = enumerate_space(graphs, prices, limit)
    found = search_space(graphs, prices, limit)
    assert found.effort is not None and found.effort.status == "optimal", found.effort
    got = found.prediction.step_time_s
    assert got <= best * (1 + MIP_GAP) * (1 + 1e-9), (got, best)
    assert best >= got * (1 - found.effort.gap) * (1 - 1e-9), (got, best, found.effort.gap)
    for item in solved:  # each bound is at most the configuration's value
        for name, bound in bounds_of(graphs[item.count], prices, item).items():
            assert bound <= item.step_s * (1 + 1e-9), (name, bound, item.step_s, item.mp.recompute)
    if fraction is not None:  # the limit binds: the fastest plan without it is faster
        assert free.prediction.step_time_s < best * (1 - 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "seed", "fraction"), CASES)
def test_two_processes_find_the_plan_one_finds(
    model: str, seed: int, fraction: float | None
) -> None:
    # The search split over 2 processes (`search.processes`: each its share of the (count, mesh)
    # pairs, every one cutting with the best plan of both) returns the plan of 1 process: the
    # same configuration, signatures and step, proven optimal, over the same space.
    graphs, prices = graphs_of(model), RandomPrices.draw(seed)
    limit = None
    if fraction is not None:
        limit = fraction * max(search_space(graphs, prices, None).prediction.peak_bytes)
    one, two = (search_space(graphs, prices, limit, jobs) for jobs in (1, 2))
    assert two.effort is not None and one.effort is not None
    assert two.effort.status == "optimal", two.effort
    assert two.effort.configurations == one.effort.configurations
    assert (two.problem.split.num_stages, two.problem.mesh, two.problem.micro_batches) == (
        one.problem.split.num_stages, one.problem.mesh, one.problem.micro_batches,
    )  # fmt: skip
    assert two.problem.recompute == one.problem.recompute
    assert two.solution.choice == one.solution.choice
    assert two.prediction.step_time_s == pytest.approx(one.prediction.step_time_s, rel=1e-12)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_the_objective_never_exceeds_the_simulated_step(stages: int, seed: int) -> None:
    # The LP bound is a bound of the simulated step only because the ILP objective is, for
    # every choice (objective.py): random choices on random prices, every recomputation mode.
    graphs, prices = graphs_of("gpt"), RandomPrices.draw(10 + seed)
    graph, rng = graphs[4], np.random.default_rng(seed)
    mesh = mesh_shapes(DEVICES // stages, lambda shape, d: link_of((stages, *shape), d + 1))[0]
    for mode in distinct_modes(graph):
        mp = build_problem(
            graph, mesh, prices, optimizer="adam", memory_limit_bytes=None, micro_batches=4,
            split=split_stages(graph, stages), recompute=mode, stage_link="inter_node",
        )  # fmt: skip
        problem = mp.problem
        for _ in range(30):
            choice = {v: int(rng.integers(len(c))) for v, c in problem.node_costs.items()}
            value = problem.objective(choice)
            if math.isfinite(value):
                step = predict(mp, Solution(choice, value, "feasible", 0.0, 0.0)).step_time_s
                assert value <= step * (1 + 1e-9), (mode, value, step)


def test_one_stage_objective_is_the_simulated_step() -> None:
    graphs, prices = graphs_of("mlp"), RandomPrices.draw(7)
    mp = build_problem(
        graphs[2], mesh_shapes(DEVICES, link_of)[0], prices, optimizer="adam",
        memory_limit_bytes=None, micro_batches=2,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = {v: int(rng.integers(len(c))) for v, c in mp.problem.node_costs.items()}
        value = mp.problem.objective(choice)
        step = predict(mp, Solution(choice, value, "feasible", 0.0, 0.0)).step_time_s
        assert value == pytest.approx(step, rel=1e-9)


def test_a_count_whose_graph_does_not_capture_is_refused() -> None:
    # A micro-batch count whose graph raises MicroBatchError (capture: BatchNorm on one sample)
    # is left out of the space; when every count is, the no-fit message names them.
    graphs, prices = graphs_of("mlp"), RandomPrices.draw(0)

    def graph_for(refused: set[int]):
        def get(count: int) -> OpGraph:
            if count in refused:
                raise MicroBatchError(f"a micro-batch of {8 // count} sample(s) does not run")
            return graphs[count]

        return get

    space = strategy_space("auto", "auto", 1)
    common = {"optimizer": "adam", "memory_limit_bytes": None, "time_limit_s": 60}
    found = search(graph_for({2, 8}), 8, DEVICES, prices, link_of, space, **common)
    assert found.problem.micro_batches in (1, 4)
    with pytest.raises(NoFitError, match="2 micro-batches: a micro-batch of 4 sample"):
        search(graph_for({1, 2, 4, 8}), 8, DEVICES, prices, link_of, space, **common)


@pytest.mark.slow
def test_on_the_time_limit_the_plan_is_feasible_with_the_gap_proven_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The time runs out right after the first plan is kept: the search returns it as
    # "feasible" with the gap it proved, and the enumeration's optimum is within that gap.
    from autosbp.planner.search import best_first

    graphs, prices = graphs_of("gpt"), RandomPrices.draw(3)
    keep = best_first.BestFirst.keep

    def keep_then_time_out(self, *args) -> None:
        keep(self, *args)
        self.deadline = -math.inf

    monkeypatch.setattr(best_first.BestFirst, "keep", keep_then_time_out)
    found = search_space(graphs, prices, None)
    assert found.effort is not None
    best, _ = enumerate_space(graphs, prices, None)
    got, gap = found.prediction.step_time_s, found.effort.gap
    assert best >= got * (1 - gap) * (1 - 1e-9)
    assert found.effort.status == ("optimal" if gap <= MIP_GAP * (1 + 1e-9) else "feasible")
    assert gap > MIP_GAP, "the first plan kept was already proven: this case tests nothing"
    monkeypatch.setattr(best_first.BestFirst, "keep", keep)
    # Out of time before any plan: the limit never costs the plan, only the gap. The search
    # goes on to its first plan, then stops and says so.
    found = search(
        graphs.__getitem__, 8, DEVICES, prices, link_of, strategy_space("auto", "auto", 4),
        optimizer="adam", memory_limit_bytes=None, time_limit_s=1e-9,
    )  # fmt: skip
    assert found.effort is not None and found.effort.limit_reached
    assert found.effort.status == "feasible" and found.effort.gap > MIP_GAP, found.effort
    assert best >= found.prediction.step_time_s * (1 - found.effort.gap) * (1 - 1e-9)
