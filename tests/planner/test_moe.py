"""Mixture of experts: the zoo's capacity-based `moe`, the routing rules, expert parallelism.

Oracles: GShard's dispatch written token by token (a loop) for the zoo's routing; one device for
the groups' exactness; the planner's own hand plans for "the planner shards experts that do not
fit replicated" (dgx-a100, 8 devices); one device in float64 (`--check`, runtime/verify/step_check.py) for
expert-parallel training on 2 and 4 gloo processes; DTensor for the routing rules (their
execution proof on simulated devices is tests/rules/test_rules.py's, over the ROUTING cases of
tests/support/rules_helpers.py).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch
import torch.nn.functional as F

from autosbp import capture
from autosbp.boxing import StepKind, plan_boxing
from autosbp.capturing.graph import OpGraph, OpNode, Role, TensorMeta
from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import PlanError
from autosbp.planner.api import auto_parallelize, plan_graphs
from autosbp.planner.space.strategy import strategy_space
from autosbp.rules import NdSignature
from autosbp.sbp import B, Mesh, NdSbp, S, dtensor_names, parse_nd_sbp
from autosbp.zoo import MoeMlp, build_model, expert_capacity, load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import judge
from tests.support import real_models
from tests.support.check_workers import run_checked
from tests.support.rules_helpers import dtensor_worker

STEPS = 3
WORKER_TIMEOUT_S = 300.0


# ------------------------------------------------------------------------- the zoo's routing
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "factor", "capacity"),
    [(16, 4, 2, 1.25, 10), (2048, 8, 2, 1.25, 640), (1024, 64, 1, 1.0, 16), (8, 4, 2, 0.5, 2)],
    ids=["zoo-default", "mixtral-like", "switch-balanced", "tight"],
)
def test_expert_capacity(
    tokens: int, experts: int, top_k: int, factor: float, capacity: int
) -> None:
    assert expert_capacity(tokens, experts, top_k, factor) == capacity


def loop_moe(mlp: MoeMlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """GShard's algorithm 1 token by token: in each group, every token's first choice, then every
    second choice ..., takes the next free slot of its expert; a full expert drops it. Returns
    the output, the balance loss and the count of dropped assignments."""
    groups, tokens, _ = x.shape
    capacity = expert_capacity(tokens, mlp.experts, mlp.top_k, mlp.capacity_factor)
    y, balance, dropped = torch.zeros_like(x), torch.zeros((), dtype=x.dtype), 0
    for g in range(groups):
        probs = (x[g] @ mlp.router.weight.T).softmax(dim=-1)
        order = [sorted(range(mlp.experts), key=lambda e: -float(p[e]))[: mlp.top_k] for p in probs]
        fill = [0] * mlp.experts
        for k in range(mlp.top_k):
            for s in range(tokens):
                e = order[s][k]
                if fill[e] == capacity:
                    dropped += 1
                    continue
                fill[e] += 1
                gate = probs[s, e] / sum(probs[s, c] for c in order[s])
                y[g, s] += gate * (F.gelu(x[g, s] @ mlp.w_in[e]) @ mlp.w_out[e])
        first = torch.tensor(
            [sum(o[0] == e for o in order) for e in range(mlp.experts)], dtype=x.dtype
        )
        balance += mlp.experts * (first / tokens * probs.mean(dim=0)).sum() / groups
    return y, balance, dropped


@pytest.mark.parametrize(
    ("top_k", "factor", "drops"),
    [(2, 0.5, True), (2, 1.25, None), (1, 0.75, True), (2, 8.0, False)],
    ids=["top2-tight", "top2-switch", "top1-tight", "top2-roomy"],
)
def test_routing_equals_gshard_token_by_token(
    top_k: int, factor: float, drops: bool | None
) -> None:
    torch.manual_seed(0)
    mlp = MoeMlp(8, 16, 4, top_k, factor).double()
    x = torch.randn(3, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        y, balance = mlp(x)
        want_y, want_balance, dropped = loop_moe(mlp, x)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(balance, want_balance, rtol=1e-12, atol=1e-12)
    if drops is not None:  # the case tests what it says: tokens dropped, or none
        assert (dropped > 0) == drops, dropped


def test_groups_route_alone_so_a_split_batch_routes_as_one_device() -> None:
    """The property that makes data parallelism exact: each group (sequence) is routed alone, so
    the halves of a batch give the whole batch's output; one group of every token would not
    (capacity is per group: with drops, which tokens are dropped depends on the group)."""
    torch.manual_seed(0)
    mlp = MoeMlp(8, 16, 4, 2, 0.5).double()
    x = torch.randn(4, 12, 8, dtype=torch.float64)
    whole, _ = mlp(x)
    halves = torch.cat([mlp(x[:2])[0], mlp(x[2:])[0]])
    torch.testing.assert_close(halves, whole, rtol=1e-12, atol=1e-12)
    pooled, _ = mlp(x.reshape(1, 48, 8))
    assert (pooled.reshape(x.shape) - whole).abs().max() > 1e-3


# --------------------------------------------------------------------- plans and their layouts
def expert_reads(plan: dict[str, Any], graph: OpGraph) -> dict[str, list[NdSbp]]:
    """Per expert weight (a parameter of 3 dims), the layouts its readers take it in."""
    out: dict[str, list[NdSbp]] = {}
    for name, attrs in graph.nodes():
        if attrs.role is Role.PARAMETER and len(attrs.outputs[0].shape) == 3:
            out[attrs.name] = [
                parse_nd_sbp(plan["nodes"][reader]["inputs"][i])
                for reader in graph.graph.successors(name)
                for _, i in graph.uses(name, reader)
            ]
    return out


def all_to_alls(plan: dict[str, Any], graph: OpGraph) -> int:
    """The edges of the plan that carry an activation (not a weight) through an all-to-all."""
    mesh = tuple(plan["mesh"]["shape"])
    count = 0
    for u, v, uses in graph.edges():
        if graph.node(u).role is not Role.COMPUTE:
            continue
        for o, i in uses:
            src = plan["nodes"][u]["outputs"][o]
            dst = plan["nodes"][v]["inputs"][i]
            shape = graph.node(u).outputs[o].shape
            steps = plan_boxing(src, dst, shape, mesh) if src != dst else []
            count += any(step.kind is StepKind.ALL_TO_ALL for step in steps)
    return count


def is_expert_split(nd: NdSbp) -> bool:
    return S(0) in nd


# A MoE whose experts do not fit replicated on an 80 GB A100: 2 layers of 32 Mixtral-sized
# experts (hidden 4096, ffn 14336): 7.5e9 expert weights, 120 GB of Adam state replicated.
# 32 experts a layer, of a width (ffn 12288) whose states fit an A100 only split over the 8
# devices at 18 bytes a parameter (bf16 with fp32 masters and gradients:
# runtime.parallel.precision); Mixtral's 14336 fitted at the 16 bytes priced before, not now.
BIG_MOE = {
    "layers": 2, "hidden": 4096, "heads": 32, "experts": 32, "top_k": 2, "ffn": 12288,
    "vocab": 32000, "seq": 1024, "batch": 64,
}  # fmt: skip
EP_HAND_PLANS = (
    "megatron:tp=1,pp=1,dp=8,ep=8",
    "megatron:tp=1,pp=1,dp=8,ep=4",
    "megatron:tp=1,pp=1,dp=8,ep=2",
    "megatron:tp=2,pp=1,dp=4,ep=4",
    "megatron:tp=1,pp=2,dp=4,ep=4",
)


@pytest.mark.slow
def test_planner_shards_experts_that_do_not_fit_replicated_on_dgx_a100() -> None:
    model, inputs = build_model("moe", device="meta", **BIG_MOE)
    graphs = micro_batch_graphs(model.to(torch.bfloat16), inputs, (1, 2, 4, 8))
    common = {"profile": "dgx-a100", "devices": 8, "memory_limit": None, "global_batch": None}
    common |= {"optimizer": "adam", "dtype": "bf16", "time_limit_s": 60}
    auto = plan_graphs(graphs, **common, strategy="auto", compare=True)
    hand = {h.strategy: h.step_time_s for h in auto.hand_plans}
    assert hand["dp"] is None, "replicated experts were expected not to fit"
    for strategy in EP_HAND_PLANS:
        hand[strategy] = plan_graphs(graphs, **common, strategy=strategy).predicted.step_time_s
    fitting = {s: t for s, t in hand.items() if t is not None}
    assert len(fitting) >= len(EP_HAND_PLANS) + 2, hand
    assert all(auto.predicted.step_time_s <= t * (1 + 1e-9) for t in fitting.values()), (
        auto.predicted.step_time_s, hand,
    )  # fmt: skip
    plan = auto.to_json()
    graph = graphs[plan["micro_batches"]]
    reads = expert_reads(plan, graph)
    assert reads and all(is_expert_split(nd) for nds in reads.values() for nd in nds), reads
    assert all_to_alls(plan, graph) >= 2 * BIG_MOE["layers"]  # dispatch and return per layer


# ------------------------------------------------------------- expert parallel, like one device
MIXTRAL = f"{Path(real_models.__file__).resolve()}:mixtral"  # Hugging Face's, tiny, random


@cache
def load_graph(model: str) -> OpGraph:
    module, inputs = load_model(model)
    return capture(module, inputs)


@cache
def ep_plan(model: str, devices: int, strategy: str) -> dict[str, Any]:
    module, inputs = load_model(model)
    plan = auto_parallelize(module, inputs, devices=devices, strategy=strategy, time_limit_s=30.0)
    return plan.to_json()


def with_expert_rows(plan: dict[str, Any], graph: OpGraph) -> dict[str, Any]:
    """`plan` with every grouped matmul taking its experts split (tokens B, expert weights S(0)
    -> P: each device its experts' rows, `routing.ExpertRows`), and the views between the
    weight and the matmul keeping S(0). The planner prefers moving the weights to a column split
    at the suite's tiny sizes (S(0) -> S(2), an all-to-all of weights); a plan is data, the
    runtime boxes around the edited nodes and refuses a signature the rules do not list."""
    nodes = dict(plan["nodes"])

    def relayout(name: str, inputs: list[str], outputs: list[str]) -> None:
        nodes[name] = {
            **nodes[name], "inputs": inputs, "outputs": outputs,
            "inputs_dtensor": [dtensor_names(parse_nd_sbp(s)) for s in inputs],
            "outputs_dtensor": [dtensor_names(parse_nd_sbp(s)) for s in outputs],
        }  # fmt: skip

    for name in graph.order:
        if graph.node(name).op == "transformers.grouped_mm_fallback.default":
            relayout(name, ["B", "S(0)", "B"], ["P"])
            weight = graph.producers(name)[1]
            while weight is not None and graph.node(weight[0]).role is Role.COMPUTE:
                relayout(weight[0], ["S(0)"], ["S(0)"])  # a transpose of the last two dims
                weight = graph.producers(weight[0])[0]
    return {**plan, "nodes": nodes}


# processes -> (model, expert-parallel strategy): the zoo's moe with every split of its experts
# that 2 and 4 devices allow, and Hugging Face's Mixtral with its grouped matmuls split by expert
EP_JOBS: dict[int, list[tuple[str, str]]] = {
    2: [("moe", "megatron:tp=1,pp=1,dp=2,ep=2"), (MIXTRAL, "megatron:tp=1,pp=1,dp=2,ep=2")],
    4: [("moe", "megatron:tp=1,pp=1,dp=4,ep=4"), ("moe", "megatron:tp=1,pp=1,dp=4,ep=2")],
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("devices", sorted(EP_JOBS), ids=lambda n: f"{n}-processes")
def test_expert_parallel_plans_train_like_one_device(devices: int) -> None:
    cases = []
    for model, strategy in EP_JOBS[devices]:
        graph = load_graph(model)
        plan = ep_plan(model, devices, strategy)
        if model == MIXTRAL:  # dropless routing: tokens stay whole, expert outputs are summed
            plan = with_expert_rows(plan, graph)
        else:  # capacity: tokens go to their experts' devices and back, by all-to-all
            layers = len({a.block for _, a in graph.nodes()} - {None})
            assert all_to_alls(plan, graph) >= 2 * layers
        reads = expert_reads(plan, graph)
        assert reads and all(is_expert_split(nd) for nds in reads.values() for nd in nds), reads
        case_id = f"{Path(model).name}-{strategy}"
        cases.append((case_id, TrainSpec(model, {}, plan, STEPS, check=True), "none"))
    checks = run_workers(run_checked, devices, (cases,), timeout_s=WORKER_TIMEOUT_S)[0]
    for case_id, _, _ in cases:
        verdict = judge(checks[case_id])
        assert len(checks[case_id]) == STEPS and verdict.passed, (case_id, verdict.text)


# ----------------------------------------------------------------------- the strategy string
@pytest.mark.parametrize(
    ("strategy", "mesh", "expert", "dense"),
    [
        ("megatron:tp=1,pp=1,dp=4,ep=4", (4,), (S(0),), (B,)),
        ("megatron:tp=1,pp=1,dp=4,ep=2", (2, 2), (B, S(0)), (B, B)),
        ("megatron:tp=2,pp=1,dp=2,ep=2", (2, 2), (S(0), S(2)), (B, S(1))),
    ],
    ids=["ep-all-dp", "ep-half-dp", "ep-with-tp"],
)
def test_ep_splits_expert_weights_on_their_expert_dim(
    strategy: str, mesh: tuple[int, ...], expert: NdSbp, dense: NdSbp
) -> None:
    space = strategy_space(strategy)
    assert space.mesh_ok(Mesh.of(mesh)) and space.allow is not None
    assert not any(space.mesh_ok(Mesh.of(other)) for other in ((4,), (2, 2)) if other != mesh)

    def allowed(shape: tuple[int, ...], nd: NdSbp) -> bool:
        weight = OpGraph(nx.DiGraph(), [])
        weight.add_node(
            "w", OpNode("placeholder", Role.PARAMETER, outputs=(TensorMeta(shape, torch.float32),))
        )
        return space.allow(weight, "w", NdSignature((), (nd,)))

    assert allowed((4, 8, 16), expert) and allowed((16, 8), dense)
    assert not allowed((4, 8, 16), (B,) * len(mesh))  # experts are never replicated whole
    assert not allowed((4, 8, 16), (S(1),) * len(mesh))  # nor split but on their expert dim


@pytest.mark.parametrize(
    ("strategy", "says"),
    [
        ("megatron:tp=1,pp=1,dp=4,ep=3", "ep=3 must divide dp=4"),
        ("megatron:tp=2,pp=1,dp=4,ep=2", "ep must equal dp"),
        ("megatron:tp=1,dp=2,ep=0", "degrees must be positive"),
        ("megatron:tp=1,dp=2,xp=2", "unknown degree"),
    ],
    ids=["not-dividing", "tp-and-partial-ep", "zero", "misspelt"],
)
def test_ep_errors_say_what_to_change(strategy: str, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        strategy_space(strategy)


# --------------------------------------------------------------- routing rules against DTensor
ROUTING_SAMPLE = [
    "topk", "topk-dim-smallest", "sort", "sort-stable", "one_hot", "histc", "scatter_add",
    "scatter-src", "scatter-value-zero", "index_add", "index_put-accumulate",
    "index_put-broadcast-values",
]  # fmt: skip


THEIRS = {"Replicate()": "B", "Partial(sum)": "P"}  # DTensor's placement names -> ours


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_routing_rules_agree_with_dtensor() -> None:
    """Every signature of the sampled routing ops runs under DTensor to the global result, and
    where DTensor needed no collective its output placement is ours (where it did, it chose to
    redistribute: scatter of a P self, which it shards first)."""
    records = run_workers(dtensor_worker, 2, (ROUTING_SAMPLE,), timeout_s=120.0)[0]
    assert {r["case"] for r in records} == set(ROUTING_SAMPLE)
    failed = [(r["case"], r["sig"], r.get("error")) for r in records if not r.get("equal")]
    assert not failed, failed
    agree = [r for r in records if not r["comms"]]
    for r in agree:
        theirs = [THEIRS.get(p, p.replace("Shard", "S")) for p in r["theirs"]]
        assert theirs == r["ours"], (r["case"], r["sig"], theirs)
    assert len(agree) >= len(records) - 2, [(r["case"], r["sig"]) for r in records if r["comms"]]
