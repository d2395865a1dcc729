"""Partial recomputation (issue 47 item 3): `full:K` (Megatron-LM's --recompute-num-layers: the
first K blocks of each stage recomputed whole, the rest kept) and `mlp` (each block's MLP
activation recomputed from its projections' outputs), beside none, selective and full.

Oracles: the modes' own order at one choice of signatures (what a partial mode keeps lies
strictly between none's and full's where its blocks differ, and so does its time); the runs a
SwiGLU MLP's activation makes, read off the graph by hand; the search's choice under a memory
limit that none cannot meet and full:1 can (faster than full); the plan's checks against a plan
whose recomputed nodes contradict its mode; the least K that fits, as brute force over K by
hand plans finds it, where each node and edge at its fewest bytes alone would let a smaller K
through; the search for that K on the LP's memory share against a scan over K. The runtime's
side (--check, measured peaks): tests/runtime/test_regather_check.py.
"""

from __future__ import annotations

import copy
import functools
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosbp.capturing.graph import OpGraph
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import PlanError
from autosbp.plan import Plan, plan_problems
from autosbp.planner.api import ClusterPrices, auto_parallelize
from autosbp.planner.problem.build import MeshProblem, build_problem
from autosbp.planner.problem.priced import price_graph
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.search.evaluator import AIMED, FITS, Evaluator, _least_fitting
from autosbp.planner.space.configs import mesh_shapes
from autosbp.planner.space.recomputation import distinct_modes, recompute_runs
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import strategy_space
from autosbp.zoo import build_model
from autosbp.zoo.models import Gpt
from costmodel import Cluster, load_profile

CLUSTER = Cluster(load_profile("dgx-a100"), nodes=1)
PRICES = ClusterPrices(CLUSTER)
# tests/runtime/test_regather_check.py's WIDE GPT: activations dominate its memory
WIDE = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 32, "seq": 64, "batch": 8}
PIPELINE = "megatron:tp=1,pp=2,dp=1,mb=2"


class SwiGlu(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _graph(swiglu: bool = False) -> OpGraph:
    """The WIDE GPT (its MLPs SwiGLU where asked), 2 micro-batches."""
    model, inputs = build_model("gpt", **WIDE)
    if swiglu:
        assert isinstance(model, Gpt)
        for block in model.blocks:
            block.mlp = SwiGlu(WIDE["hidden"])
    return micro_batch_graphs(model, inputs, (2,), name="gpt")[2]


def _problems(graph: OpGraph, modes: tuple[str, ...]) -> dict[str, MeshProblem]:
    """Each mode's problem with 2 stages, on 4 devices (2 per stage: a tp choice)."""
    space = strategy_space("auto")
    mesh = mesh_shapes(2, lambda shape, d: "intra_node", 8)[0]
    priced = price_graph(graph, mesh, PRICES, space.allow)
    split = split_stages(graph, 2)
    found = {}
    for mode in modes:
        found[mode] = build_problem(
            graph, mesh, PRICES, optimizer="adam", memory_limit_bytes=None, allow=space.allow,
            micro_batches=2, split=split, recompute=mode, stage_link="intra_node", priced=priced,
        )  # fmt: skip
    return found


@pytest.mark.parametrize(
    ("swiglu", "partial"), [(False, "full:1"), (True, "mlp")], ids=["full:1", "mlp"]
)
def test_a_partial_mode_prices_strictly_between_none_and_full(swiglu: bool, partial: str) -> None:
    by_mode = _problems(_graph(swiglu), ("none", partial, "full"))
    solution = solve_mesh(by_mode["none"], 60.0)
    assert solution is not None
    for s in range(2):  # every stage: its first block recomputed, its second kept
        used = {
            m: mp.stage_costs.memory[s].used_bytes(solution.choice) for m, mp in by_mode.items()
        }
        assert used["full"] < used[partial] < used["none"], (s, used)
    step = {m: mp.problem.objective(solution.choice) for m, mp in by_mode.items()}
    assert step["none"] < step[partial] < step["full"], step


def test_the_mlp_mode_recomputes_a_swiglu_activation_as_one_run() -> None:
    # silu(gate) and the gate product, with the up projection program order puts between them;
    # never the gate or down projections. A one-op GELU (the zoo GPT) drops nothing: no run.
    graph = _graph(swiglu=True)
    runs = recompute_runs(graph, "mlp")
    assert len(set(runs.values())) == WIDE["layers"], "one run per block"
    for run in set(runs.values()):
        ops = [graph.node(n).op for n in graph.order if runs.get(n) == run]
        assert ops == ["aten.silu.default", "aten.linear.default", "aten.mul.Tensor"], ops
    gelu = _graph()
    assert not recompute_runs(gelu, "mlp")
    assert "mlp" not in distinct_modes(gelu) and "mlp" in distinct_modes(graph)


def _plan(recompute: str, limit: int | None = None) -> Plan:
    module, inputs = build_model("gpt", **WIDE)
    return auto_parallelize(
        module, inputs, devices=2, strategy=PIPELINE, time_limit_s=60, recompute=recompute,
        profile="dgx-a100", memory_limit=limit,
    )  # fmt: skip


def test_the_search_recomputes_some_blocks_where_none_does_not_fit() -> None:
    # Below what none needs and above what full:1 needs, the search offers full:1 (it is not
    # one of the modes it enumerates) and takes it: faster than full, which also fits.
    limit = 1_750_000
    with pytest.raises(PlanError):  # NoFitError
        _plan("none", limit)
    found, full = _plan("auto", limit), _plan("full", limit)
    assert found.recompute == "full:1"
    assert found.predicted.peak_memory_bytes <= limit
    assert found.predicted.step_time_s < full.predicted.step_time_s
    marked = {n.stage: set() for n in found.nodes.values()}
    for name, node in found.nodes.items():
        if node.recomputed:
            marked[node.stage].add(name)
    assert all(marked.values()), "each stage recomputes its first block"


def test_the_checks_refuse_a_plan_whose_nodes_contradict_its_partial_mode() -> None:
    plan = _plan("full:1")
    graph = _graph()
    assert not [p for p in plan_problems(plan, graph) if "full:1" in p]
    data = copy.deepcopy(plan.to_json())
    data["recompute"] = "full:2"  # every block, where the nodes say the first of each stage
    problems = plan_problems(Plan.from_json(data), graph)
    assert any("full:2" in p and "marked otherwise" in p for p in problems), problems
    with pytest.raises(PlanError, match="full:K"):
        strategy_space(PIPELINE, "full:0")


def test_a_hand_plan_names_its_partial_mode() -> None:
    # `megatron:...,recompute=full:1` is `--recompute full:1`; both at odds are refused.
    named = strategy_space(f"{PIPELINE},recompute=full:1")
    assert named.recompute == strategy_space(PIPELINE, "full:1").recompute == ("full:1",)
    assert strategy_space(f"{PIPELINE},recompute=mlp", "mlp").recompute == ("mlp",)
    with pytest.raises(PlanError, match="give one of them"):
        strategy_space(f"{PIPELINE},recompute=full:1", "none")
    with pytest.raises(PlanError, match="full:K"):
        strategy_space(f"{PIPELINE},recompute=full:x")


DEEP = {**WIDE, "layers": 8}  # 4 blocks a stage: full:1 .. full:3 between none and full
TENSOR_PIPELINE = "megatron:tp=2,pp=2,dp=1,mb=2"  # 2 devices a stage: layouts to choose
DEEP_LIMIT = 1_600_000  # none, full:1 and full:2 do not fit; full:3 does, faster than full


def _deep_plan(recompute: str, limit: int = DEEP_LIMIT) -> Plan | None:
    """The DEEP GPT's plan under TENSOR_PIPELINE on 4 devices, None where nothing fits."""
    module, inputs = build_model("gpt", **DEEP)
    try:
        return auto_parallelize(
            module, inputs, devices=4, strategy=TENSOR_PIPELINE, time_limit_s=60,
            recompute=recompute, profile="dgx-a100", memory_limit=limit,
        )  # fmt: skip
    except PlanError:  # NoFitError
        return None


@functools.cache
def _by_hand() -> dict[str, Plan]:
    """Oracle: each mode planned by hand at DEEP_LIMIT, where it fits."""
    modes = ("none", "full:1", "full:2", "full:3", "full")
    return {m: plan for m in modes if (plan := _deep_plan(m)) is not None}


def _each_alone(self: Evaluator, mp: MeshProblem) -> bool:
    """The bytes bound before `bounds.memory_floor`: each node and each edge at its fewest."""
    return self.refusals.overflows(mp) or any(
        c.least_bytes() > c.limit_bytes for c in mp.problem.memory
    )


def _no_lp(self: Evaluator, config: object, time_left_s: float) -> float:
    raise AssertionError(f"{config}: the forest bound alone tells which K may fit")


@pytest.mark.parametrize("bound", ["forest", "each alone"])
def test_the_search_takes_the_least_k_that_fits_as_brute_force_over_k_does(
    bound: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each node and edge at its fewest bytes alone lets full:2 through, which does not fit:
    # the bound on a stage's nodes with a spanning forest of its edges does not
    # (`bounds.memory_floor`); where the bytes bound is loosened to each alone again, full:2's
    # LP reads as cut off (`full` is solved first) and its least memory share finds full:3.
    by_hand = _by_hand()
    assert [m for m in by_hand if m != "full"] == ["full:3"], by_hand
    if bound == "each alone":
        monkeypatch.setattr(Evaluator, "overflows", _each_alone)
    else:
        monkeypatch.setattr(Evaluator, "memory_share", _no_lp)
    found = _deep_plan("auto")
    assert found is not None and found.recompute == "full:3", found and found.recompute
    assert found.predicted.step_time_s == pytest.approx(by_hand["full:3"].predicted.step_time_s)
    assert found.predicted.step_time_s < by_hand["full"].predicted.step_time_s
    assert found.predicted.peak_memory_bytes <= DEEP_LIMIT


@pytest.mark.parametrize("seed", range(20))
def test_the_least_fitting_k_is_the_linear_scans(seed: int) -> None:
    # Oracle: a scan over every K. Shares fall with K, unevenly; `fall` is a guess.
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 60))
    shares = np.cumsum(-rng.uniform(0, 0.2, count)) + rng.uniform(1, 3)
    probes: list[int] = []

    def share(k: int) -> float:
        probes.append(k)
        return float(shares[k - 1])

    known = (0, math.inf) if seed % 2 else (0, float(shares[0]) + 0.1)
    expected = next((k for k in range(1, count + 1) if shares[k - 1] <= FITS), None)
    got = _least_fitting(1, count, share, float(rng.uniform(0.01, 0.3)), known)
    assert got == expected, (got, expected, probes)
    assert len(set(probes)) == len(probes), probes
    assert len(probes) <= AIMED + math.ceil(math.log2(count + 1)) + 1, probes


def test_a_k_that_does_not_fit_is_refused_for_its_memory() -> None:
    # Each node at its fewest bytes, full:2 fits DEEP_LIMIT; no choice does (`_by_hand`): the
    # error says so with what its LP proves a plan needs (it said "no consistent choice of
    # signatures, though the memory fits", which sent users after their batch size).
    module, inputs = build_model("gpt", **DEEP)
    with pytest.raises(PlanError) as raised:
        auto_parallelize(
            module, inputs, devices=4, strategy=TENSOR_PIPELINE, time_limit_s=60,
            recompute="full:2", profile="dgx-a100", memory_limit=DEEP_LIMIT,
        )  # fmt: skip
    found = re.search(
        r"recompute full:2\) needs at least ([\d.]+) MiB per device", str(raised.value)
    )
    assert str(raised.value).startswith("no plan fits in 1.53 MiB per device"), raised.value
    assert found and float(found[1]) * 2**20 > DEEP_LIMIT, raised.value
