"""The plan checks refuse an `overlap_chunks` statement the runtime cannot run as priced (issue 47
item 2): each way a statement can be wrong, made by editing a plan the planner wrote, names its
node, its cause and its fix; the statements the planner writes pass.

Oracle: the runtime's own refusal (`runtime.execute.builder.ProgramBuilder.emit_overlapped`) and
what the planner prices (`planner.timing.tp_overlap`): each case is one the runtime would refuse
or run other than priced. One plan of the zoo MLP (tp=2, pp=2: its blocks linear -> gelu, each
linear row-parallel, its partial sums all-reduced for the gelu), planned once, and one of a linear read twice; no process run.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch

from autosbp.capturing.export import capture, capture_micro_batch
from autosbp.capturing.graph import OpGraph
from autosbp.plan import Plan
from autosbp.plan.checks import plan_problems
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model

MLP = {"layers": 3, "hidden": 32, "features": 16, "outputs": 8, "batch": 8}
ROW = "linear_1"  # block 0's linear (row-parallel: its output partial sums), read by gelu_1


@cache
def _planned() -> tuple[Plan, OpGraph]:
    """The MLP's tp=2, pp=2 plan with its row-parallel linears overlapped in 2 chunks (what
    the planner states where it overlaps), and the graph of one micro-batch."""
    module, inputs = load_model("mlp", MLP)
    plan = auto_parallelize(
        module, inputs, devices=4, strategy="megatron:tp=2,pp=2,dp=1,mb=2", time_limit_s=60,
        recompute="none", profile="dgx-a100",
    )  # fmt: skip
    rows = [n for n, node in plan.nodes.items() if node.op.startswith("aten.linear")]
    rows = [n for n in rows if plan.nodes[n].outputs == ("P",)]
    assert ROW in rows and len(rows) == MLP["layers"]
    nodes = {n: replace(plan.nodes[n], overlap_chunks=2) for n in rows}
    graph = capture_micro_batch(module, inputs, plan.micro_batches, name="mlp")
    return replace(plan, nodes={**plan.nodes, **nodes}), graph


def _edit(plan: Plan, **nodes: dict[str, object]) -> Plan:
    return replace(
        plan, nodes={**plan.nodes, **{n: replace(plan.nodes[n], **c) for n, c in nodes.items()}}
    )  # type: ignore[arg-type]


CASES = {  # id -> (the edit, what the problem says)
    "not a matmul": ({"gelu_1": {"overlap_chunks": 2}}, "only a matmul-like op"),
    "one chunk": ({ROW: {"overlap_chunks": 1}}, "at least 2 chunks"),
    "no reduction": (  # the head linear's output is split, not partial sums
        {"linear": {"overlap_chunks": 2}},
        "through no single all-reduce or reduce-scatter",
    ),
    "reader on another stage": ({"gelu_1": {"stage": 1}}, "runs on stage 1, not 0"),
    "recomputed alone": ({ROW: {"recomputed": True}}, "it is recomputed and its reader"),
    "too many chunks": ({ROW: {"overlap_chunks": 64}}, "has 64 or more entries to cut"),
    "scatter along the cut": (  # P -> S(0): reduce-scattered along the batch, the cut dim
        {"gelu_1": {"inputs": ("S(0)",), "outputs": ("S(0)",)}},
        "splits dim 0, the dim the chunks cut",
    ),
}


def test_the_statements_the_planner_writes_pass() -> None:
    plan, graph = _planned()
    assert plan_problems(plan, graph) == []
    both = _edit(plan, **{ROW: {"recomputed": True}, "gelu_1": {"recomputed": True}})
    assert plan_problems(both, graph) == []  # recomputed with its reader: run again, priced so


class _Swish(torch.nn.Module):
    """A linear whose output two ops read (h * sigmoid(h))."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h * torch.sigmoid(h)).sum()


def test_an_output_read_twice_is_refused() -> None:
    module, inputs = _Swish(), (torch.randn(4, 8),)
    plan = auto_parallelize(module, inputs, devices=2, strategy="dp", recompute="none")
    graph = capture(module, inputs)
    (name,) = [n for n, node in plan.nodes.items() if node.op == "aten.linear.default"]
    problems = plan_problems(_edit(plan, **{name: {"overlap_chunks": 2}}), graph)
    assert any("read 2 times, not once" in p for p in problems), problems


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_statement_the_runtime_cannot_run_as_priced_is_refused(case: str) -> None:
    plan, graph = _planned()
    edit, says = CASES[case]
    problems = [p for p in plan_problems(_edit(plan, **edit), graph) if "chunks beside" in p]
    assert len(problems) == 1, problems
    assert says in problems[0] and "drop its overlap_chunks" in problems[0], problems[0]
