"""Keep or re-gather an activation for backward (issue 47 item 1): the ILP's per-edge choice, its
prices, and sequence parallelism (`megatron:...,sp=1`) as the hand plan that pins it.

Oracles: a price summed by hand from the layouts (the gathered copy's bytes, the shard's, one
all-gather at the profile's price); brute-force enumeration of every choice (the ILP's optimum
must equal it, and use a twin where the memory limit binds); the actor simulation's step (the
one-stage objective equals it); the plan's checks (what the runtime would refuse).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

import numpy as np
import pytest
import torch
from torch import nn

from autosbp.capturing.export import capture
from autosbp.capturing.graph import OpGraph
from autosbp.errors import PlanError
from autosbp.plan import Plan
from autosbp.plan.checks import plan_problems
from autosbp.planner.ilp.solving import brute_force, solve
from autosbp.planner.problem.build import MeshProblem, build_problem
from autosbp.planner.problem.priced import Priced, price_graph
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.predict import predict
from autosbp.sbp import Broadcast, Mesh, Partial, Split, parse_nd_sbp
from tests.planner.test_planner import UNLIMITED, a100_prices, limit_between, plan

MEGATRON = strategy_space("megatron:tp=2,pp=1,dp=1").allow
GPT = {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128, "batch": 8}


class NormLinear(nn.Module):
    """A norm feeding a linear: Megatron's sequence parallelism in one step (the norm on the
    sequence split, the linear column-parallel on its gathered input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = nn.functional.layer_norm(x, (64,))
        return nn.functional.mse_loss(self.fc(h), target)


@cache
def norm_linear() -> tuple[OpGraph, Priced]:
    """Its graph on 2 devices under Megatron's layouts (weights split, none gathered)."""
    graph = capture(NormLinear(), [torch.randn(4, 256, 64), torch.randn(4, 256, 64)])
    return graph, price_graph(graph, Mesh((2,)), a100_prices(), MEGATRON, gathers=False)


def problem_at(share: float | None) -> MeshProblem:
    """The one-stage problem, its memory limit `share` of the way from its fewest bytes to its
    most (None: no limit)."""
    graph, priced = norm_linear()

    def build(limit: float | None) -> MeshProblem:
        return build_problem(
            graph, Mesh((2,)), a100_prices(), optimizer="adam", memory_limit_bytes=limit,
            allow=MEGATRON, priced=priced,
        )  # fmt: skip

    if share is None:
        return build(None)
    return build(limit_between(build(UNLIMITED).problem.memory, share))


def _index(priced: Priced, name: str, want: str, twin: int | None) -> int:
    """The candidate of `name` printed `want` that re-gathers input `twin` (None: keeps)."""
    found = priced.strategies[name]
    return next(
        j
        for j, sig in enumerate(found.candidates)
        if repr(sig) == want and found.regathered_input(j) == twin
    )


def test_a_twin_keeps_the_shard_and_runs_the_gather_again_in_backward() -> None:
    graph, priced = norm_linear()
    meta = graph.node("layer_norm").outputs[0]  # [4, 256, 64] fp32: 262,144 bytes whole
    norm = _index(priced, "layer_norm", "(S(1) -> S(1))", None)
    whole = _index(priced, "layer_norm", "(B -> B)", None)
    keep = _index(priced, "linear", "(B, S(0) -> S(2))", None)
    again = _index(priced, "linear", "(B, S(0) -> S(2))", 0)
    kept = priced.edge_kept("layer_norm", "linear", "none")
    assert kept.twin_s is not None and kept.twin_bytes is not None
    # kept: the gathered copy, whole on each device; re-gathered: the norm's half of it (the
    # linear is its only holder), and the all-gather S(1) -> B once more, in backward, beside the
    # linear's input-gradient matmul (its forward's flops): the profile's overlap efficiency of
    # the lesser of the two hidden (`runtime.parallel.regather._RegatheredLinear`)
    assert kept.bytes[norm, keep] == kept.twin_bytes[norm, keep] == meta.nbytes
    assert kept.twin_bytes[norm, again] == meta.nbytes / 2
    gather = priced.pricer.time_s((Split(1),), (Broadcast(),), meta)
    input_gradient = priced.strategies["linear"].forward_s[again]
    hidden = a100_prices().overlap_efficiency * min(gather, input_gradient)
    assert 0 < hidden < gather and input_gradient > 0
    assert kept.twin_s[norm, again] == pytest.approx(gather - hidden, rel=1e-12)
    assert kept.twin_s[norm, keep] == 0
    # from a whole norm output the linear reads a view: nothing to re-gather, the twin may not
    assert math.isinf(kept.twin_s[whole, again]) and kept.twin_s[whole, keep] == 0


def test_a_recomputed_consumer_never_takes_its_twin() -> None:
    """Recomputation converts again anyway: where a configuration recomputes the consumer (the
    GPT's MLP fc, under `full`), every pair of its twins is forbidden."""
    model_graph = _gpt_graph()
    priced = price_graph(model_graph, Mesh((2,)), a100_prices(), MEGATRON, gathers=False)
    consumer = "linear_2"  # the first block's MLP fc: column-parallel, its input gatherable
    producer = model_graph.producers(consumer)[0][0]  # type: ignore[index]
    twins = priced.strategies[consumer].regather_input
    assert twins is not None and (twins >= 0).any()
    for mode, forbidden in (("none", False), ("full", True)):
        kept = priced.edge_kept(producer, consumer, mode)
        assert kept.twin_s is not None
        columns = kept.twin_s[:, twins >= 0]
        assert bool(np.isinf(columns).all()) == forbidden, mode


@cache
def _gpt_graph() -> OpGraph:
    from autosbp.zoo import build_model

    model, inputs = build_model("gpt", device="meta", **GPT)
    return capture(model, inputs)


@pytest.mark.parametrize("share", [None, 0.5, 0.3, 0.1], ids=lambda s: f"limit-{s}")
def test_the_ilp_equals_brute_force_and_regathers_where_memory_binds(share: float | None) -> None:
    mp = problem_at(share)
    assert math.prod(len(c) for c in mp.problem.node_costs.values()) <= 20_000
    expected, got = brute_force(mp.problem), solve(mp.problem)
    assert got.objective == pytest.approx(expected.objective, rel=1e-9, abs=1e-15)
    assert mp.problem.feasible(got.choice)
    again = [r for r in mp.problem.node_costs if mp.strategies[r].regathers(got.choice[r])]
    binds = share is not None and share <= 0.3  # the unlimited optimum no longer fits there
    assert again == (["linear"] if binds else []), (share, again)
    if binds:  # the sequence-parallel step: the norm on the split, the linear gathered whole
        assert repr(mp.choice_of(got, "layer_norm")) == "(S(1) -> S(1))"
        free = solve(problem_at(None).problem)
        assert got.objective > free.objective and not mp.problem.feasible(free.choice)


@pytest.mark.parametrize("share", [None, 0.3], ids=["keep", "regather"])
def test_one_stage_objective_equals_the_prediction(share: float | None) -> None:
    mp = problem_at(share)
    solution = solve(mp.problem)
    prediction = predict(mp, solution)
    assert prediction.step_time_s == pytest.approx(solution.objective, rel=1e-9)
    if share is not None:
        assert max(prediction.peak_bytes) <= mp.problem.memory[0].limit_bytes * (1 + 1e-9)


@cache
def gpt_plan(strategy: str, share: float | None = None) -> Plan:
    """The 2-layer GPT on 2 dgx-a100 devices, at `share` of its unlimited plan's peak."""
    if share is None:
        return plan("gpt", 2, strategy, **GPT)
    limit = int(share * gpt_plan(strategy).predicted.peak_memory_bytes)
    return plan("gpt", 2, strategy, memory=limit, **GPT)


def test_the_search_regathers_only_where_the_limit_binds() -> None:
    strategy = "megatron:tp=2,pp=1,dp=1,mb=1"
    free, tight = gpt_plan(strategy), gpt_plan(strategy, 0.9)
    assert not any(node.regathered for node in free.nodes.values())
    regathered = {n: node for n, node in tight.nodes.items() if node.regathered}
    assert regathered and tight.recompute == "none"
    assert tight.predicted.step_time_s > free.predicted.step_time_s
    for name, node in regathered.items():  # a linear's input, reached gathered
        assert node.op == "aten.linear.default" and node.regathered == (0,), name
        assert node.inputs[0] == "B"


def test_sequence_parallelism_splits_between_regions_and_regathers() -> None:
    sp = gpt_plan("megatron:tp=2,pp=1,dp=1,mb=1,sp=1")
    graph = _gpt_graph()
    norms = [n for n, node in sp.nodes.items() if node.op == "aten.layer_norm.default"]
    assert norms and all("S(" in sp.nodes[n].outputs[0] for n in norms)  # split, not whole
    gathered = [
        v
        for v, node in sp.nodes.items()
        if node.op == "aten.linear.default" and node.inputs[0] == "B"
    ]
    assert gathered and all(sp.nodes[v].regathered == (0,) for v in gathered)
    for u, v in graph.graph.edges:  # no activation all-reduced on tp: reduce-scattered instead
        for out, index in graph.uses(u, v):
            src = parse_nd_sbp(sp.nodes[u].outputs[out])
            dst = parse_nd_sbp(sp.nodes[v].inputs[index])
            whole = isinstance(dst[-1], Broadcast) and graph.node(u).outputs[out].numel > 1
            assert not (isinstance(src[-1], Partial) and whole), (u, v)


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ("megatron:tp=1,pp=2,dp=1,sp=1", "needs tp=T with T > 1"),
        ("megatron:tp=2,pp=2,dp=1,sp=1,schedule=zb1", "needs tp=T with T > 1 and schedule 1f1b"),
        ("megatron:tp=2,pp=1,dp=1,sp=2", "sp=2 is not known"),
    ],
    ids=["no-tp", "zb1", "sp2"],
)
def test_sequence_parallelism_is_refused_where_it_cannot_run(strategy: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        strategy_space(strategy)


def test_plans_state_the_regathered_inputs_and_older_plans_load_without() -> None:
    tight = gpt_plan("megatron:tp=2,pp=1,dp=1,mb=1", 0.9)
    data = tight.to_json()
    assert Plan.from_json(data) == tight
    stated = [n for n, node in data["nodes"].items() if "regathered" in node]
    assert stated and all(data["nodes"][n]["regathered"] == [0] for n in stated)
    for node in data["nodes"].values():
        node.pop("regathered", None)
    old = Plan.from_json(data)
    assert not any(node.regathered for node in old.nodes.values())


def test_the_checks_refuse_a_regather_the_planner_never_states() -> None:
    tight = gpt_plan("megatron:tp=2,pp=1,dp=1,mb=1", 0.9)
    graph = _gpt_graph()
    assert plan_problems(tight, graph) == []
    name = next(n for n, node in tight.nodes.items() if node.regathered)
    weight = next(i for i, p in enumerate(graph.producers(name)) if p and "weight" in p[0])
    same = next(  # an activation read in the layout it was made in: nothing gathered
        v
        for v, node in tight.nodes.items()
        if (p := graph.producers(v)) and p[0] and graph.node(p[0][0]).role.name == "COMPUTE"
        and tight.nodes[p[0][0]].outputs[p[0][1]] == node.inputs[0]
    )  # fmt: skip
    wrong = {
        "a weight": {name: replace(tight.nodes[name], regathered=(weight,))},
        "recomputed": {name: replace(tight.nodes[name], recomputed=True)},
        "no exchange": {same: replace(tight.nodes[same], regathered=(0,))},
    }
    for why, nodes in wrong.items():
        problems = plan_problems(replace(tight, nodes={**tight.nodes, **nodes}), graph)
        assert any("re-gathered in backward" in p for p in problems), why
    zb1 = plan_problems(replace(tight, schedule="zb1"), graph)
    assert any("would gather them twice" in p for p in zb1)
