"""The zero-bubble schedule in the auto search (`auto:zb1`, `search.schedules`): its options are
checked, it adds one space (stage counts from 2, no recomputation), and the search over both
schedules returns the least plan of an exhaustive enumeration that includes zb1 (the oracle:
every configuration built and solved on its own, a zb1 plan priced by `predict_zb1`, gathers
forbidden as the runtime refuses them there), and a space whose every plan gathers beside zb1
has no plan, with the reason.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autosbp.errors import NoFitError, PlanError
from autosbp.planner.problem.build import build_problem
from autosbp.planner.problem.solve import MIP_GAP, solve_mesh
from autosbp.planner.search.entry import mesh_shapes
from autosbp.planner.search.evaluator import Found
from autosbp.planner.search.schedules import best_of, search_spaces
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import auto_options, strategy_space
from autosbp.planner.timing.zero_bubble_price import predict_zb1, weight_shares
from tests.planner.test_gather_spaces import gathers
from tests.planner.test_interleaved_search import BLOCKS, searched, searched_in
from tests.planner.test_search import DEVICES, PER_NODE, RandomPrices, graphs_of, link_of


def test_auto_options_are_checked() -> None:
    assert auto_options("auto") == (1, False)
    assert auto_options("auto:zb1") == (1, True)
    assert auto_options("auto:max_vp=2,zb1") == (2, True)
    assert auto_options("auto:zb1,max_vp=4") == (4, True)
    for bad in ("auto:", "auto:zb2", "auto:zb1,zb1", "auto:max_vp=0", "auto:max_vp=2,max_vp=4"):
        with pytest.raises(PlanError, match="max_vp=V"):
            strategy_space(bad)


def test_zb1_is_one_more_space_without_recomputation() -> None:
    spaces = search_spaces("auto:max_vp=2,zb1", "auto", 8)
    assert [(s.virtual_stages, s.schedule) for s in spaces] == [
        (1, "1f1b"),
        (2, "1f1b"),
        (1, "zb1"),
    ]
    zb1 = spaces[-1]
    assert zb1.stage_counts == tuple(range(2, 9)) and zb1.recompute == ("none",)
    assert [s.schedule for s in search_spaces("auto", "auto", 8)] == ["1f1b"]  # opt-in
    assert [s.schedule for s in search_spaces("auto:zb1", "full", 8)] == ["1f1b"]  # none only


def enumerate_zb1(seed: int) -> float:
    """The least predicted step over every zb1 configuration: 2 or 4 pipeline stages, every
    micro-batch count of at least the stages, every mesh, no recomputation."""
    graphs, prices = graphs_of("gpt"), RandomPrices.draw(seed)
    allow, best = strategy_space("auto").allow, math.inf
    for stages in (2, 4):
        meshes = mesh_shapes(
            DEVICES // stages, lambda shape, d, p=stages: link_of((p, *shape), d + 1), PER_NODE
        )
        for count in (c for c in graphs if c >= stages):
            for mesh in meshes:
                mp = build_problem(
                    graphs[count], mesh, prices, optimizer="adam", memory_limit_bytes=None,
                    micro_batches=count, split=split_stages(graphs[count], stages),
                    recompute="none", stage_link=link_of((stages, mesh.size), 0), allow=allow,
                    schedule="zb1",
                )  # fmt: skip
                solution = solve_mesh(mp, 60, math.inf)
                if solution is None:
                    continue
                prediction = predict_zb1(mp, solution, weight_shares(graphs[count]))
                assert not gathers(Found(mp, solution, prediction, graphs[count]))
                best = min(best, prediction.step_time_s)
    return best


WINS = [5, 7]  # seeds whose prices make zb1 win (found by this search, checked below)


@pytest.mark.parametrize("seed", WINS)
def test_auto_runs_zb1_where_it_wins(seed: int) -> None:
    found, plain = searched("auto:zb1", seed), searched("auto", seed)
    assert found.problem.schedule == "zb1" and plain.problem.schedule == "1f1b"
    assert found.prediction.step_time_s < plain.prediction.step_time_s
    assert not gathers(found)  # the runtime splits its backward


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, *WINS])
def test_the_search_with_zb1_is_the_optimum_of_exhaustive_enumeration(seed: int) -> None:
    found, plain = searched("auto:zb1", seed), searched("auto", seed)
    # 1F1B's part: the plain search, itself the optimum of its enumeration (test_search.py)
    best = min(enumerate_zb1(seed), plain.prediction.step_time_s)
    got = found.prediction.step_time_s
    assert found.effort is not None
    assert got <= best * (1 + MIP_GAP) * (1 + 1e-9), (got, best)
    assert best >= got * (1 - found.effort.gap) * (1 - 1e-9), (got, best, found.effort.gap)
    assert got <= plain.prediction.step_time_s * (1 + 1e-9)  # one more space never costs
    assert BLOCKS == 4  # the enumeration's stage counts (2, 4) are the space's that divide 4


@pytest.mark.slow
@pytest.mark.dist
def test_the_runtime_trains_what_the_zb1_search_emits() -> None:
    """The zb1 space's plan (cpu-gloo prices, 2 devices, 2 stages), every step checked against
    one device (`--check`'s oracle)."""
    import torch

    from autosbp.capturing.rebatch import micro_batch_graphs
    from autosbp.planner.api import ClusterPrices
    from autosbp.planner.assemble import PlanContext, assemble_plan
    from autosbp.planner.search.entry import search
    from autosbp.zoo import load_model
    from costmodel import Cluster, load_profile
    from launching.workers import run_workers
    from runtime.jobs import TrainSpec
    from runtime.verify.verdict import judge
    from tests.support.check_workers import run_checked

    args = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8}
    module, inputs = load_model("gpt", args)
    graphs = micro_batch_graphs(module, inputs, (2, 4))
    cluster = Cluster(load_profile("cpu-gloo"), nodes=1)
    space = search_spaces("auto:zb1", "auto", BLOCKS)[-1]
    found = search(
        graphs.__getitem__, 8, 2, ClusterPrices(cluster),
        lambda shape, d: cluster.link_class_for_mesh_dim(shape, d).value,
        replace(space, stage_counts=(2,), micro_batches=(2, 4)), optimizer="adam",
        memory_limit_bytes=None, time_limit_s=60.0, devices_per_node=2,
    )  # fmt: skip
    assert not gathers(found)
    plan = assemble_plan(found, PlanContext("cpu-gloo", 2**34, "auto", 8, torch.float32, "adam"))
    assert plan.schedule == "zb1" and len(plan.stages) == 2
    spec = TrainSpec("gpt", args, plan.to_json(), 3, lr=1e-2, check=True)
    checks = run_workers(run_checked, 2, ([("zb1", spec, "none")],), timeout_s=300.0)
    verdict = judge(checks[0]["zb1"])
    assert verdict.passed, verdict.text


def test_a_space_whose_every_plan_gathers_beside_zb1_has_none_and_says_why() -> None:
    """FSDP's layouts (every weight stored split, read whole) beside zb1: the runtime runs no
    gather there, so no plan, and a NoFitError that names the cause and the way out, rather
    than a plan the runtime refuses at its first step."""
    space = replace(strategy_space("fsdp", "none", BLOCKS), stage_counts=(2,))
    assert gathers(searched_in(space, 3))  # its 1F1B plan gathers
    with pytest.raises(NoFitError, match=r"gathers no parameter .* vp=1 and schedule 1f1b"):
        best_of([replace(space, schedule="zb1")], lambda one, _: searched_in(one, 3), 60.0)
