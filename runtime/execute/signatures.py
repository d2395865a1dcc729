"""The plan's signatures as the runtime reads them: every node's nd-SBPs, checked by the rules.

Lives here: `read_signatures` (the plan's per-node SBP strings parsed, and each checked to be
one the node's rule offers on this mesh). Lives elsewhere: the rules themselves
(`autosbp.rules.nd_signatures`), the plan's own consistency (`autosbp.plan.check_plan`), the
program that runs the signatures (`runtime.execute.program`).

Invariants: a plan that names another model's nodes, another op, a signature the rules do
not offer, or other collectives inside an op than the rule runs (`NodePlan.exchanges`) is refused before anything runs (a plan edited by hand cannot run something wrong);
the runtime chooses nothing: every signature is the plan's.
"""

from __future__ import annotations

from autosbp.capturing.graph import OpGraph
from autosbp.errors import PlanError
from autosbp.plan import Plan
from autosbp.rules import NdSignature, exchanges, find_signature
from autosbp.sbp import parse_nd_sbp

__all__ = ["read_signatures"]


def read_signatures(
    graph: OpGraph, plan: Plan, mesh_shape: tuple[int, ...]
) -> dict[str, NdSignature]:
    """Every node's nd-signature from the plan, checked: same ops, and a signature the rules
    offer for the node on this mesh (a plan edited by hand cannot run something wrong); of
    several kernels of the plan's layouts (`NdSignature.kernel`), the one whose exchanges it
    states."""
    missing = [name for name in graph.order if name not in plan.nodes]
    if missing:
        raise PlanError(
            f"the plan has no signature for {len(missing)} node(s) of `{graph.model_name}` "
            f"({', '.join(missing[:5])}); it was made for another model: make a new plan."
        )
    out: dict[str, NdSignature] = {}
    for name, attrs in graph.nodes():
        node_plan = plan.nodes[name]
        layouts = (
            tuple(parse_nd_sbp(s) for s in node_plan.inputs),
            tuple(parse_nd_sbp(s) for s in node_plan.outputs),
        )
        found = find_signature(attrs, layouts, node_plan.exchanges, mesh_shape)
        sig = found or NdSignature(*layouts)
        if node_plan.op != attrs.op or found is None:
            raise PlanError(
                f"the plan gives node {name!r} ({attrs.op}, module "
                f"`{attrs.module_path or '<top>'}`) the signature {sig!r} for op "
                f"{node_plan.op}, which its rule does not offer on mesh {mesh_shape}; the plan "
                "was edited or made by another autosbp version: make it again."
            )
        stated = tuple(e.describe() for e in exchanges(attrs, sig, mesh_shape))
        if stated != node_plan.exchanges:
            raise PlanError(
                f"the plan says node {name!r} ({attrs.op}) communicates inside the op as "
                f"{list(node_plan.exchanges) or 'nothing'}, but its rule under {sig!r} runs "
                f"{list(stated) or 'nothing'}; the plan was made by another autosbp version "
                "(it priced other collectives): make it again."
            )
        out[name] = sig
    return out
