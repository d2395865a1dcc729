"""FSDP as it runs, in the plan: per parameter keep or re-gather (`reshard_after_forward`), per
stage the prefetch depth and what it hides; older plans load without them.

Oracles: the ILP's own objective equals the prediction of the actor simulation (one stage:
the hidden gathers priced alike in both), a tighter memory limit can only re-gather more and
never speed the step up, and a plan written before these fields existed loads with the
defaults that mean what such plans priced (keep, nothing prefetched).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from autosbp.capturing.export import capture
from autosbp.plan import Plan, load_plan, save_plan
from autosbp.planner.ilp.solving import solve
from autosbp.planner.problem.build import build_problem
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.predict import gathers_hidden, predict
from autosbp.sbp import Mesh
from autosbp.zoo import build_model
from tests.planner.test_planner import a100_prices, plan

GPT = {"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128, "batch": 8}


@cache
def fsdp_plan(fraction: float | None) -> Plan:
    """The fsdp plan of a 4-block GPT on 2 devices, at `fraction` of the unlimited plan's peak."""
    if fraction is None:
        return plan("gpt", 2, "fsdp", **GPT)
    limit = int(fraction * fsdp_plan(None).predicted.peak_memory_bytes)
    return plan("gpt", 2, "fsdp", memory=limit, **GPT)


def regathered(p: Plan) -> int:
    return sum(param.reshard_after_forward for param in p.params.values())


def test_unlimited_fsdp_keeps_every_gathered_weight_and_prefetches_one_block() -> None:
    keep = fsdp_plan(None)
    assert regathered(keep) == 0  # a re-gather only adds time: never chosen where memory allows
    assert all("S(" in param.sbp for name, param in keep.params.items() if "weight" in name)
    ((stage,),) = [keep.stages]
    assert stage.prefetch_blocks == 1 and stage.gather_hidden_s > 0
    assert keep.predicted.breakdown["param_comm_hidden_s"] == pytest.approx(
        keep.micro_batches * stage.gather_hidden_s, rel=1e-12
    )


def test_a_tighter_limit_regathers_instead_of_keeping() -> None:
    keep, tight = fsdp_plan(None), fsdp_plan(0.9)
    assert tight.predicted.peak_memory_bytes <= 0.9 * keep.predicted.peak_memory_bytes
    assert tight.recompute == keep.recompute == "none" and tight.micro_batches == 1
    assert 0 < regathered(tight) < len(tight.params)  # re-gathered: the weights it had to free
    assert tight.predicted.step_time_s > keep.predicted.step_time_s
    for name, param in tight.params.items():  # only sharded weights have a copy to free
        assert "S(" in param.sbp or not param.reshard_after_forward, name


def _strip(data: dict[str, Any]) -> dict[str, Any]:
    for param in data["params"].values():
        param.pop("reshard_after_forward", None)
    for stage in data["stages"]:
        stage.pop("prefetch_blocks", None)
        stage.pop("gather_hidden_s", None)
    return data


@pytest.mark.parametrize("fraction", [None, 0.9], ids=["keep", "regather"])
def test_plans_round_trip_and_older_plans_load_with_keep_and_no_prefetch(
    fraction: float | None, tmp_path: Any
) -> None:
    new = fsdp_plan(fraction)
    assert load_plan(save_plan(new, tmp_path / "plan.json")) == new
    old = Plan.from_json(_strip(new.to_json()))
    assert regathered(old) == 0
    assert all(s.prefetch_blocks == 0 and s.gather_hidden_s == 0 for s in old.stages)
    assert old.nodes == new.nodes and old.predicted == new.predicted


@pytest.mark.parametrize("memory", [False, True], ids=["unlimited", "limited"])
def test_one_stage_objective_equals_the_prediction_with_gathers_hidden(memory: bool) -> None:
    model, inputs = build_model("gpt", device="meta", **GPT)
    graph = capture(model, inputs)
    allow = strategy_space("fsdp").allow

    def build(limit: float | None) -> Any:
        return build_problem(
            graph, Mesh((2,)), a100_prices(), optimizer="adam", memory_limit_bytes=limit,
            allow=allow,
        )  # fmt: skip

    free = build(None)
    limit = None
    if memory:
        peak = predict(free, solve(free.problem)).peak_bytes[0]
        limit = 0.9 * peak
    mp = build(limit)
    solution = solve(mp.problem)
    prediction = predict(mp, solution)
    forward, backward = gathers_hidden(mp.stage_costs, solution.choice)
    assert forward[0] > 0 and backward[0] > 0
    again = [r for r in mp.problem.node_costs if mp.strategies[r].regathers(solution.choice[r])]
    assert bool(again) == memory  # the limit binds: some weights are re-gathered
    assert prediction.step_time_s == pytest.approx(solution.objective, rel=1e-9)
    assert mp.problem.objective(solution.choice) == pytest.approx(solution.objective, rel=1e-9)
