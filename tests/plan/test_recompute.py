"""What a plan recomputes: stated per node since format 2, format 1's rule for older plans.

The runtime recomputes `autosbp.plan.recomputed_nodes(plan, graph)` and never asks the planner.
Oracles: two plans written by autosbp before per-node recomputation was stated (format 1,
tests/runtime/data/, saved at commit aaecd13; the runtime trains them in tests/runtime/
test_runtime.py), read against format 1's rule written out from its definition; the planner's
own rule for new plans.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosbp.capturing.export import capture_micro_batch
from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import PlanError
from autosbp.plan import check_plan, load_plan, recomputed_nodes, save_plan
from autosbp.planner.api import auto_parallelize
from autosbp.planner.space.recomputation import recomputed
from autosbp.zoo import build_model
from tests.runtime.test_runtime import MODELS

DATA = Path(__file__).resolve().parents[1] / "runtime" / "data"


def _graph(micro_batches: int) -> OpGraph:
    name, kwargs = MODELS["gpt-2l"]
    model, inputs = build_model(name, seed=0, **kwargs)
    return capture_micro_batch(model, inputs, micro_batches, name=name)


def _in_blocks(graph: OpGraph) -> set[str]:
    return {n for n, a in graph.nodes(Role.COMPUTE) if a.block is not None}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_format1_plan_recomputes_what_format1_priced(mode: str) -> None:
    plan = load_plan(DATA / f"format1-{mode}-gpt-2l.json")
    assert plan.version == 1 and plan.recompute == mode
    graph = _graph(plan.micro_batches)
    plan.check_model(graph.fingerprint())
    kept_families = {"matmul", "attention", "conv", "embedding"}  # format 1's selective rule
    expected = {
        n
        for n in _in_blocks(graph)
        if mode == "full" or op_family(graph.node(n).op) not in kept_families
    }
    assert expected and recomputed_nodes(plan, graph) == expected


def test_a_format1_plan_saved_again_keeps_its_format(tmp_path: Path) -> None:
    plan = load_plan(DATA / "format1-full-gpt-2l.json")
    again = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert again == plan and again.version == 1


def test_a_new_plan_states_each_recomputed_node() -> None:
    name, kwargs = MODELS["gpt-2l"]
    model, inputs = build_model(name, seed=0, **kwargs)
    plan = auto_parallelize(
        model, inputs, profile="cpu-gloo", devices=2, strategy="megatron:tp=1,pp=2,dp=1,mb=2",
        recompute="full", time_limit_s=30.0,
    )  # fmt: skip
    graph = _graph(plan.micro_batches)
    stated = {n for n, node in plan.nodes.items() if node.recomputed}
    assert plan.version == 2
    assert stated == {n for n, _ in graph.nodes() if recomputed(graph, n, "full")}
    assert stated and recomputed_nodes(plan, graph) == stated
    assert json.loads(json.dumps(plan.to_json()))["nodes"][sorted(stated)[0]]["recomputed"]


@pytest.mark.slow
def test_a_plan_cannot_recompute_a_node_outside_the_blocks() -> None:
    name, kwargs = MODELS["gpt-2l"]
    model, inputs = build_model(name, seed=0, **kwargs)
    plan = auto_parallelize(model, inputs, profile="cpu-gloo", devices=2, strategy="dp")
    graph = _graph(plan.micro_batches)
    outside = next(n for n, _ in graph.nodes(Role.COMPUTE) if n not in _in_blocks(graph))
    data = plan.to_json()
    data["nodes"][outside]["recomputed"] = True
    edited = type(plan).from_json(data)
    with pytest.raises(PlanError, match="marked recomputed"):
        check_plan(edited, graph)
