"""Spaces without parameter gathers (`Space.may_gather`, `problem.priced.Priced.gathers`): a
Megatron hand plan computes on its stored pieces, and interleaved or zero-bubble spaces hold only
plans the runtime runs. The oracle is the runtime's own test (`boxing.params.gathers_parameters`) on
each plan; each case also solves the same space with gathers allowed, whose plan gathers (so the
case is not vacuous) and can only be faster."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autosbp.boxing.params import gathers_parameters
from autosbp.planner.problem.build import build_problem
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.problem.solve import MIP_GAP, solve_mesh
from autosbp.planner.search.entry import mesh_shapes, search
from autosbp.planner.search.evaluator import Found
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.predict import predict
from tests.planner.test_search import DEVICES, PER_NODE, RandomPrices, graphs_of, link_of


def gathers(found: Found) -> bool:
    """The runtime's test of a gathering plan, on `found`."""
    mp = found.problem
    return gathers_parameters(found.graph, lambda name: mp.choice_of(found.solution, name), mp.mesh)


@pytest.mark.parametrize("strategy", ["megatron:tp=2,pp=1,dp=2", "megatron:tp=2,pp=2,dp=1"])
@pytest.mark.parametrize("seed", range(2))
def test_a_megatron_plan_gathers_no_parameter(strategy: str, seed: int) -> None:
    graphs, prices = graphs_of("gpt"), RandomPrices.draw(seed)
    space = replace(strategy_space(strategy), micro_batches=(2,))
    assert not space.may_gather

    def found_in(gathers_allowed: bool) -> Found:
        return search(
            graphs.__getitem__, 8, DEVICES, prices, link_of,
            replace(space, gathers=gathers_allowed), optimizer="adam",
            memory_limit_bytes=None, time_limit_s=60.0, devices_per_node=PER_NODE,
        )  # fmt: skip

    megatron, hybrid = found_in(False), found_in(True)
    assert not gathers(megatron)
    assert gathers(hybrid)  # stored split, read whole: FSDP over the tp dim, not Megatron
    assert hybrid.prediction.step_time_s <= megatron.prediction.step_time_s * (1 + MIP_GAP)


@pytest.mark.parametrize(("seed", "count"), [(0, 2), (2, 4)])
@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_an_interleaved_or_zero_bubble_problem_forbids_gathers(
    seed: int, count: int, schedule: str
) -> None:
    """v = 2 (or zb1 on 2 stages): the problem forbids the gathering pairs, so its solution is
    the best plan the runtime runs, where the one with gathers allowed gathers."""
    graphs, prices = graphs_of("gpt"), RandomPrices.draw(seed)
    graph, allow = graphs[count], strategy_space("auto").allow
    v = 2 if schedule == "1f1b" else 1
    mesh = mesh_shapes(DEVICES // 2, lambda shape, d: link_of((2, *shape), d + 1), PER_NODE)[0]

    def solved(gathers_allowed: bool | None) -> Found:
        priced = (
            None if gathers_allowed is None
            else price_graph(graph, mesh, prices, allow, gathers=gathers_allowed)
        )  # fmt: skip
        mp = build_problem(
            graph, mesh, prices, optimizer="adam", memory_limit_bytes=None, micro_batches=count,
            split=split_stages(graph, 2 * v), recompute="none", stage_link=link_of((2, 4), 0),
            allow=allow, virtual_stages=v, schedule=schedule, priced=priced,
        )  # fmt: skip
        solution = solve_mesh(mp, 60, math.inf)
        assert solution is not None
        return Found(mp, solution, predict(mp, solution), graph)

    own, allowed = solved(None), solved(True)  # None: build_problem's own pricing
    assert not gathers(own)
    assert gathers(allowed)
    assert allowed.prediction.step_time_s <= own.prediction.step_time_s * (1 + MIP_GAP)
