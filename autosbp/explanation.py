"""`explain(plan, node)`: why a node got its signature, from the prices recorded in the plan.

Lives here: reading a plan's alternatives for one node (tied nodes answer with the node of the
first block whose choice they share) and showing them. Lives elsewhere: computing the
alternatives (`planner.assemble.alternatives`), the plan format (`plan`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from rich.table import Table

from autosbp.errors import PlanError
from autosbp.plan import Alternative, NodePlan, Plan


@dataclass(frozen=True)
class Explanation:
    node: str
    plan_node: NodePlan
    decided_at: str  # the node whose variable decided this one (itself unless tied)
    alternatives: tuple[Alternative, ...]
    step_time_s: float

    def table(self) -> Table:
        chosen = f"({', '.join(self.plan_node.inputs)} -> {', '.join(self.plan_node.outputs)})"
        title = f"{self.node} ({self.plan_node.op}): chose {chosen}"
        if self.decided_at != self.node:
            title += f", shared with {self.decided_at} (tied blocks)"
        table = Table(
            title=title,
            caption="step time if this node alone took the signature; every other choice kept",
        )
        for column in ("signature", "step time", "vs plan", "memory vs plan"):
            table.add_column(column, justify="right")
        for alt in self.alternatives:
            if alt.step_time_s is None:
                table.add_row(alt.signature, "not combinable", "-", "-")
                continue
            table.add_row(
                alt.signature,
                f"{alt.step_time_s * 1e3:.3f} ms",
                f"{alt.step_time_s / self.step_time_s:.3f}x",
                f"{alt.memory_delta_bytes / 2**20:+.2f} MiB",
            )
        return table


def explain(plan: Plan, node: str) -> Explanation:
    """The cost of each signature `node` could have taken in `plan`."""
    if node not in plan.nodes:
        near = ", ".join(difflib.get_close_matches(node, list(plan.nodes), n=5))
        hint = f" Did you mean: {near}?" if near else ""
        raise PlanError(
            f"node {node!r} is not in the plan of {plan.model_name}.{hint} `autosbp explain PLAN` lists every node."
        )
    plan_node = plan.nodes[node]
    decided_at = plan_node.tied_to or node
    alts = plan.alternatives.get(decided_at, ())
    return Explanation(node, plan_node, decided_at, alts, plan.predicted.step_time_s)
