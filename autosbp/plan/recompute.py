"""Which nodes a plan recomputes in backward: what it states, or format 1's rule for it.

Lives here: `recomputed_nodes(plan, graph)`, what the runtime recomputes. A plan of format 2 states
it per node (`NodePlan.recomputed`, written by the planner from the rule it priced); a plan of
format 1 stated only a mode, and is read with the rule that format priced, frozen here
(`_format1_recomputed`) so that a later change of the planner's rule cannot change what an old plan
runs. Lives elsewhere: the planner's current rule and its prices (`planner.space.recomputation`,
`planner.memory.kept`), running recomputation (runtime.execute.program).

Format 1's rule (autosbp 0.1, planner.pipeline.recomputed at the time): under `full`, every
compute node inside a repeated block; under `selective`, those of them whose op family is not
matmul, attention, conv or embedding; under `none`, nothing. An op that writes into one of its
inputs is never recomputed (running it again would write twice).
"""

from __future__ import annotations

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.plan.values import Plan
from autosbp.rules import mutated_inputs

__all__ = ["recomputed_nodes"]

_FORMAT1_KEPT_UNDER_SELECTIVE = frozenset({"matmul", "attention", "conv", "embedding"})


def recomputed_nodes(plan: Plan, graph: OpGraph) -> frozenset[str]:
    """The nodes of `graph` that backward recomputes under `plan`."""
    if plan.version >= 2:
        return frozenset(name for name, node in plan.nodes.items() if node.recomputed)
    return frozenset(
        name for name, attrs in graph.nodes() if _format1_recomputed(attrs, plan.recompute)
    )


def _format1_recomputed(attrs: OpNode, mode: str) -> bool:
    if mode == "none" or attrs.role is not Role.COMPUTE or attrs.block is None:
        return False
    if mutated_inputs(attrs):
        return False
    return mode == "full" or op_family(attrs.op) not in _FORMAT1_KEPT_UNDER_SELECTIVE
