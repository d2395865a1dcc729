"""A plan in torch DTensor's terms: a `DeviceMesh` per stage and the placements of a tensor.

Lives here: `device_mesh` and `placements` (free functions of a plan),
`dtensor_placement` (one SBP as a DTensor placement), `check_dtensor_expressible` (a plan whose
ops communicate inside themselves, context parallelism, is refused with the reason). Lives elsewhere: the plan's values
(`plan.values`), turning a model's parameters and inputs into DTensors (`runtime.distribute`,
the public `autosbp.distribute`).

Invariants: SBP and DTensor agree by construction (docs/architecture.md, "Contracts"): S(d) is Shard(d), B is
Replicate(), P is Partial(op); mesh dims apply outer first in both, so the nd-SBP `S(0)B` on a
2x2 mesh is the placements (Shard(0), Replicate()) on a DeviceMesh of the same shape and device
order (row-major). torch.distributed is imported only when asked, so reading a plan never needs
it.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from autosbp.errors import PlanError
from autosbp.plan.values import Plan
from autosbp.sbp import Broadcast, Sbp, Split, parse_nd_sbp

if TYPE_CHECKING:  # torch.distributed loads only when a mesh is built
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = ["check_dtensor_expressible", "device_mesh", "dtensor_placement", "placements"]


def check_dtensor_expressible(plan: Plan) -> None:
    """Refuse a plan that placements alone cannot state: one whose ops communicate inside
    themselves (`NodePlan.exchanges`: context-parallel attention all-gathers keys and values
    in the op). DTensor's op propagation would run those ops its own way (torch 2.13: no
    sequence-split strategy for SDPA), not the plan's."""
    inside = [(name, node) for name, node in plan.nodes.items() if node.exchanges]
    if inside:
        name, node = inside[0]
        raise PlanError(
            f"the plan for {plan.model_name} runs {len(inside)} op(s) that communicate inside "
            f"themselves (node {name!r}, {node.op}: {', '.join(node.exchanges)}; context "
            "parallelism), which DTensor placements cannot state: its op propagation would "
            "not split their work. Train this plan with autosbp's runtime (`autosbp train "
            "--plan`, autosbp.Engine), or make a plan without cp for DTensor."
        )


def dtensor_placement(sbp: Sbp) -> Placement:
    """`S(d)` -> Shard(d), `B` -> Replicate(), `P(op)` -> Partial(op)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(sbp, Split):
        return Shard(sbp.dim)
    if isinstance(sbp, Broadcast):
        return Replicate()
    return Partial(sbp.op)


def placements(plan: Plan, name: str) -> tuple[Placement, ...]:
    """The DTensor placements of parameter `name` (as the model names it, "blocks.0.fc.weight"),
    or of the first output of graph node `name` (an input such as "x"), one per mesh dim."""
    if name in plan.params:
        text = plan.params[name].sbp
    elif name in plan.nodes and plan.nodes[name].outputs:
        text = plan.nodes[name].outputs[0]
    else:
        known = [*plan.params, *plan.nodes]
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise PlanError(
            f"the plan for {plan.model_name} has no parameter or node named {name!r}{hint}; "
            "give a parameter's name as model.named_parameters() says it, or a node of "
            "`autosbp explain PLAN`."
        )
    return tuple(dtensor_placement(sbp) for sbp in parse_nd_sbp(text))


def device_mesh(plan: Plan, stage: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """The torch DeviceMesh of `stage`'s devices (default: the only stage), shaped as the plan's
    stage mesh with its dim names. Call it on every rank of an initialized world of the plan's
    device count (DeviceMesh creates a process group per mesh dim). `device_type`: "cpu" or
    "cuda" (default: "cuda" when the world's backend includes NCCL, else "cpu")."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    stage = _stage(plan, stage)
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(
            "device_mesh(plan) needs an initialized torch.distributed world; call "
            f"dist.init_process_group first (under torchrun --nproc-per-node {plan.device_count})."
        )
    plan.check_world(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    ranks = torch.tensor(plan.stages[stage].devices).reshape(plan.stages[stage].mesh_shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(plan.mesh_dims))


def _stage(plan: Plan, stage: int | None) -> int:
    count = len(plan.stages)
    if stage is None:
        if count > 1:
            raise PlanError(
                f"the plan for {plan.model_name} has {count} pipeline stages, each with a mesh of "
                f"its own; name one: device_mesh(plan, stage=0..{count - 1})."
            )
        return 0
    if not 0 <= stage < count:
        raise PlanError(
            f"the plan for {plan.model_name} has {count} stage(s); stage {stage} is not one of "
            f"0..{count - 1}."
        )
    return stage
