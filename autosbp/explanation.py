"""`explain(plan, node)`: why a node got its signature, from the prices recorded in the plan.

Lives here: finding a plan's nodes as the user names them (`find_nodes`: by the module path
written in the model, `blocks.0.attn.qkv`, or a prefix of it, `blocks.0.attn`, or by the
export's node name, `linear_2`), which nodes a listing shows (`shown`: the ops, not the
placeholders and views, unless asked), reading a plan's alternatives for one node (tied nodes
answer with the node of the first block whose choice they share) and showing them. Lives
elsewhere: computing the alternatives (`planner.assemble.alternatives`), the plan format
(`plan`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cache

import torch
from rich.markup import escape
from rich.table import Table

from autosbp.errors import PlanError
from autosbp.plan import Alternative, NodePlan, Plan

__all__ = [
    "Explanation",
    "explain",
    "find_nodes",
    "nodes_table",
    "short_op",
    "shown",
    "unknown_node",
]

TOP = "<top>"  # the path shown for a node at the model's top level (or a plan without paths)


@dataclass(frozen=True)
class Explanation:
    node: str
    plan_node: NodePlan
    decided_at: str  # the node whose variable decided this one (itself unless tied)
    alternatives: tuple[Alternative, ...]
    step_time_s: float
    decided_at_path: str = ""  # where the user wrote `decided_at` ("" where unknown)

    def table(self) -> Table:
        chosen = f"({', '.join(self.plan_node.inputs)} -> {', '.join(self.plan_node.outputs)})"
        where = f"{self.plan_node.path} " if self.plan_node.path else ""
        title = f"{where}{self.node} ({self.plan_node.op}): chose {chosen}"
        if self.decided_at != self.node:
            other = f"{self.decided_at_path} " if self.decided_at_path else ""
            title += f", shared with {other}{self.decided_at} (tied blocks)"
        table = Table(
            title=escape(title),
            caption="step time if this node alone took the signature; every other choice kept",
        )
        for column in ("signature", "step time", "vs plan", "memory vs plan"):
            table.add_column(column, justify="right")
        for alt in self.alternatives:
            if alt.step_time_s is None:
                table.add_row(escape(alt.signature), "not combinable", "-", "-")
                continue
            table.add_row(
                escape(alt.signature),
                f"{alt.step_time_s * 1e3:.3f} ms",
                f"{alt.step_time_s / self.step_time_s:.3f}x",
                f"{alt.memory_delta_bytes / 2**20:+.2f} MiB",
            )
        return table


@cache
def _is_view(op: str) -> bool:
    """Does the ATen op `op` ("aten.view.default") return a view of an input (its schema aliases
    an output to an input without writing it)? False for an op this torch does not know."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        returns = target._schema.returns
    except (AttributeError, RuntimeError):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def shown(node: NodePlan) -> bool:
    """Is `node` an op a listing shows by default: not a placeholder (parameter, buffer, input)
    and not a view (no compute, no choice of its own worth reading)?"""
    return node.op not in ("placeholder", "output") and not _is_view(node.op)


def find_nodes(plan: Plan, query: str, *, every: bool = False) -> list[str]:
    """The nodes of `plan` that `query` names, in program order: the node of that export name,
    else the nodes written in module `query` or below it (`blocks.0.attn` holds
    `blocks.0.attn.qkv`), the views and placeholders among them only if `every` or if they are
    all `query` names (`blocks.0.attn.qkv.weight`). Empty if none."""
    if query in plan.nodes:
        return [query]
    below = [
        name
        for name, node in plan.nodes.items()
        if node.path == query or node.path.startswith(query + ".")
    ]
    ops = [name for name in below if shown(plan.nodes[name])]
    return below if every or not ops else ops


def explain(plan: Plan, node: str) -> Explanation:
    """The cost of each signature `node` could have taken in `plan`. `node` is an export node
    name (`linear_2`) or a module path that holds one op (`blocks.0.attn.qkv`)."""
    found = find_nodes(plan, node)
    if not found:
        raise PlanError(unknown_node(plan, node))
    if len(found) > 1:
        names = ", ".join(f"{n} ({plan.nodes[n].op})" for n in found[:8])
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        raise PlanError(
            f"{node!r} holds {len(found)} ops of the plan of {plan.model_name}: {names}{more}. "
            "Pass one of their node names, or a longer module path."
        )
    name = found[0]
    plan_node = plan.nodes[name]
    decided_at = plan_node.tied_to or name
    alts = plan.alternatives.get(decided_at, ())
    decided = plan.nodes.get(decided_at)
    return Explanation(
        name,
        plan_node,
        decided_at,
        alts,
        plan.predicted.step_time_s,
        decided.path if decided is not None else "",
    )


def unknown_node(plan: Plan, query: str) -> str:
    """Why `query` names no node of `plan`, with the nearest names and module paths."""
    names = list(plan.nodes) + sorted({n.path for n in plan.nodes.values() if n.path})
    near = ", ".join(difflib.get_close_matches(query, names, n=5))
    hint = f" Did you mean: {near}?" if near else ""
    if not any(n.path for n in plan.nodes.values()):
        hint += (
            " This plan was written before plans recorded module paths: find nodes by their "
            "node names, or make the plan again with `autosbp plan` to find them by module path."
        )
    return (
        f"node {query!r} is not in the plan of {plan.model_name}, neither as a node name nor as a "
        f"module path.{hint} `autosbp explain PLAN --all` lists every node."
    )


def nodes_table(plan: Plan, names: list[str], title: str) -> Table:
    """A table of `names`' signatures: module path, op, node name, input and output SBPs."""
    rows = [
        (n.path or TOP, short_op(n.op), name, " ".join(n.inputs), " ".join(n.outputs))
        for name, n in ((name, plan.nodes[name]) for name in names)
    ]
    table = Table(title=title)
    for column in ("module path", "op", "node"):  # names: the SBP lists wrap first
        table.add_column(column, no_wrap=True, overflow="fold")  # then names fold, whole
    for column in ("inputs", "outputs"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))  # names from the file: shown, not obeyed
    return table


def short_op(op: str) -> str:
    """An ATen op as a listing shows it: `aten.linear.default` -> `linear`, `aten.add.Tensor`
    -> `add.Tensor` (other namespaces kept whole)."""
    if not op.startswith("aten."):
        return op
    return op.removeprefix("aten.").removesuffix(".default")
