"""The distributed optimizer (ZeRO-1 and ZeRO-2) in the planner: optimizer states and gradients
as SBPs of each parameter (`timing.param_candidates`), chosen by the ILP like any layout.

Oracles: the state layout's rules by table (split exactly where the weight is replicated on more
than one device, evenly); the bytes against ZeRO's own count (Rajbhandari et al. 2020 section
5.1: 2 + 2 + 12/N bytes per element in mixed precision; here fp32 value and gradient plus the
states, the fp32 shard and its gradient over N; ZeRO-2, 2 + 14/N here: no gradient in the
weight's layout); the problem with the choice free solved as brute force solves it, with the
ZeRO-2 twins among its candidates; hand plans that say zero=1 or zero=2 get split states (and
gradients) on every parameter that has them; ZeRO-2's reduce-scatter priced per micro-batch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autosbp.capturing.export import capture
from autosbp.capturing.graph import OpNode, Role, TensorMeta
from autosbp.errors import PlanError
from autosbp.plan import Plan, check_plan
from autosbp.planner.api import auto_parallelize
from autosbp.planner.ilp.formulation import Problem
from autosbp.planner.ilp.solving import solve
from autosbp.planner.memory.device_bytes import candidate_bytes
from autosbp.planner.problem.build import build_problem, price_graph
from autosbp.planner.problem.priced import Priced
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.param_candidates import zero_state_layout
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh, parse_nd_sbp
from autosbp.zoo import build_model
from tests.planner.test_planner import (
    UNLIMITED,
    a100_prices,
    limit_between,
    solved_like_brute_force,
)

# (layout, shape, mesh shape, the state layout or None)
LAYOUTS = [
    ("B", (8, 4), (2,), "S(0)"),
    ("B", (3, 4), (2,), "S(1)"),  # dim 0 does not divide: the next one
    ("B", (3,), (2,), None),  # nothing divides: states like the weight
    ("S(0)", (8, 4), (2,), None),  # already split: FSDP's, nothing to add
    ("BS(0)", (8, 4), (2, 2), "S(1)S(0)"),  # tensor parallel: a dim the weight keeps whole first
    ("BS(0)", (8,), (2, 2), "S(0)S(0)"),  # a vector: the same dim, 4 pieces
    ("BB", (8, 4), (1, 2), "BS(0)"),  # a mesh dim of one device is not replicated
]


@pytest.mark.parametrize(
    ("layout", "shape", "mesh", "want"), LAYOUTS, ids=[str(c) for c in LAYOUTS]
)
def test_state_layout(
    layout: str, shape: tuple[int, ...], mesh: tuple[int, ...], want: str | None
) -> None:
    got = zero_state_layout(parse_nd_sbp(layout), shape, mesh)
    assert got == (parse_nd_sbp(want) if want else None)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_bytes_are_zero_s_count(devices: int) -> None:
    meta = TensorMeta((64, 16), torch.float32)
    node = OpNode(op="placeholder", role=Role.PARAMETER, outputs=(meta,), name="w")
    sig = NdSignature((), (parse_nd_sbp("B"),))
    whole = candidate_bytes(node, sig, (devices,), optimizer="adam")
    split = candidate_bytes(node, sig, (devices,), optimizer="adam", state=parse_nd_sbp("S(0)"))
    n = meta.numel
    grads = candidate_bytes(
        node, sig, (devices,), optimizer="adam", state=parse_nd_sbp("S(0)"),
        gradient=parse_nd_sbp("S(0)"),
    )  # fmt: skip
    assert whole == 16 * n  # value, gradient, Adam's two states: 4 bytes each
    # ZeRO-1 in fp32 with the shard a contiguous slot: the shard's gradient is a view of the
    # synced one (no bytes of its own); the master copy and Adam's states on the shard
    assert split == 8 * n + (4 + 4 + 4) * n / devices
    bf16 = candidate_bytes(
        OpNode(op="placeholder", role=Role.PARAMETER, outputs=(TensorMeta((64, 16), torch.bfloat16),), name="w"),
        sig, (devices,), optimizer="adam", state=parse_nd_sbp("S(0)"),
    )  # fmt: skip
    # the mixed recipe (runtime.parallel.precision): the bf16 copy and the fp32 synced gradient
    # in p; the fp32 master is the shard (Megatron-Core's distributed optimizer), its gradient a
    # view of the fp32 one, beside Adam's states
    assert bf16 == (2 + 4) * n + (4 + 4 + 4) * n / devices
    not_slot = candidate_bytes(node, sig, (devices,), optimizer="adam", state=parse_nd_sbp("S(1)"))
    assert not_slot == 8 * n + (8 + 4 + 4) * n / devices  # S(1): a strided slot, copied
    # ZeRO-2: the gradient in the shard's layout only, fp32, beside the master copy
    assert grads == 4 * n + (8 + 4 + 4) * n / devices


class _Linear(torch.nn.Module):
    """One linear layer and a mean-square loss: few enough nodes to enumerate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


def test_the_choice_solves_as_brute_force() -> None:
    torch.manual_seed(0)
    graph = capture(_Linear(), (torch.randn(4, 8),))
    mesh, prices = Mesh((2,)), a100_prices()
    allow = strategy_space("dp").allow
    priced = price_graph(graph, mesh, prices, allow, zero=None)
    assert any(s.state is not None for s in priced.strategies.values())
    assert any(s.gradient is not None for s in priced.strategies.values())

    def problem(limit: float | None) -> Problem:
        return build_problem(
            graph, mesh, prices, optimizer="adam", memory_limit_bytes=limit, allow=allow,
            priced=priced,
        ).problem  # fmt: skip

    for fraction in (None, 0.2):  # free, then memory tight enough that states must split
        limit = None if fraction is None else limit_between(problem(UNLIMITED).memory, fraction)
        solved_like_brute_force(problem(limit))


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_hand_plans_say_where_states_live(zero: int) -> None:
    model, inputs = build_model("mlp", layers=1, hidden=8, batch=4)
    graph, mesh = capture(model, inputs), Mesh((2,))
    space = strategy_space(f"megatron:tp=1,pp=1,dp=2,zero={zero}")
    priced = price_graph(graph, mesh, a100_prices(), space.allow, zero=space.zero)
    params = [s for n, s in priced.strategies.items() if graph.node(n).role is Role.PARAMETER]
    every = [(s, i) for s in params for i in range(len(s.candidates))]
    assert {s.state_of(i) is not None for s, i in every} == {zero > 0}
    assert {s.gradient_of(i) == s.state_of(i) for s, i in every if zero == 2} <= {True}
    assert {s.gradient_of(i) is not None for s, i in every} == {zero == 2}


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_zero2_scatters_every_micro_batch(micro_batches: int) -> None:
    """ZeRO-2's reduce-scatter runs in each micro-batch's backward; ZeRO-1 syncs the gradient
    in the bucketed all-reduce instead (one bucket here: nothing hidden). The objectives differ
    by m scatters less the sync, plus the adds ZeRO-2 makes on the shard instead of on the
    whole gradient (the oracle: the twins' own prices)."""
    model, inputs = build_model("mlp", layers=1, hidden=64, batch=8)
    graph, mesh, prices = capture(model, inputs), Mesh((2,)), a100_prices()
    space = strategy_space(f"megatron:tp=1,pp=1,dp=2,mb={micro_batches}")
    one = price_graph(graph, mesh, prices, space.allow, zero=1)
    two = price_graph(graph, mesh, prices, space.allow, zero=2)

    def predicted(priced: Priced) -> float:
        return solve(
            build_problem(
                graph, mesh, prices, optimizer="adam", memory_limit_bytes=None,
                allow=space.allow, micro_batches=micro_batches, priced=priced,
            ).problem
        ).objective  # fmt: skip

    want = 0.0
    for name, s1 in one.strategies.items():
        if graph.node(name).role is not Role.PARAMETER or s1.state is None:
            continue
        s2 = two.strategies[name]
        assert s2.scatter_s is not None and s1.accumulate_s is not None
        assert s2.accumulate_s is not None
        assert s1.sync_s is not None and s2.sync_s is not None and s2.sync_s[0] == 0.0
        adds = s2.accumulate_s[0] - s1.accumulate_s[0]  # on the shard, not the whole gradient
        scatters = micro_batches * s2.scatter_s[0] - s1.sync_s[0]
        want += scatters + (micro_batches - 1) * adds
    assert predicted(two) - predicted(one) == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_unknown_zero_stage_is_refused_clearly() -> None:
    with pytest.raises(PlanError, match="zero=3 is not known"):
        strategy_space("megatron:tp=1,pp=1,dp=2,zero=3")


def test_gradient_layout_in_the_plan() -> None:
    """A zero=2 plan states each split gradient's layout (its states'); a plan without the
    field (written before it) reads every gradient as the parameter's; a third layout is
    refused, naming the parameter."""
    model, inputs = build_model("mlp", layers=1, hidden=8, batch=4)
    data = auto_parallelize(
        model, inputs, profile="cpu-gloo", devices=2, strategy="megatron:tp=1,pp=1,dp=2,zero=2",
        time_limit_s=30.0,
    ).to_json()  # fmt: skip
    split = {n: p for n, p in data["params"].items() if p["gradient_sbp"] != p["sbp"]}
    assert split and all(p["gradient_sbp"] == p["optimizer_state_sbp"] for p in split.values())
    older = copy.deepcopy(data)
    for p in older["params"].values():
        del p["gradient_sbp"]
    assert all(p.gradient_sbp == p.sbp for p in Plan.from_json(older).params.values())
    name = next(iter(split))
    data["params"][name]["gradient_sbp"] = "P"
    with pytest.raises(PlanError, match=f"parameter '{name}': gradient layout P"):
        check_plan(Plan.from_json(data))
