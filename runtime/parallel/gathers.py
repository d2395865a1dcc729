"""Which parameter boxings a program runs as FSDP gathers, in which units, under which policy.

Lives here: `GatherPolicy` (what the plan says: how many blocks ahead to gather, which
parameters to free after forward; `plan_gather_policy` reads it off a plan), `ParamBox` (a
parameter boxing a program emitted), `ParamGather` (one that the program runs through the
schedule) and `plan_gathers` (boxes into gathers: units, re-gather, deferred gradients).
Lives elsewhere: running them (`runtime.parallel.prefetch`), finding the boxes
(`runtime.execute.program`), whether the plan gathers any parameter at all
(`autosbp.boxing.params.gathers_parameters`, the planner's test too).

Invariants: a unit is a run of boxes, in program order, whose readers lie in one repeated block
(or a run outside blocks); every rank derives the same units from the same program, so every
group meets the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autosbp.boxing.steps import BoxingStep
from autosbp.plan import Plan

__all__ = [
    "GatherPolicy",
    "ParamBox",
    "ParamGather",
    "plan_gather_policy",
    "plan_gathers",
]


@dataclass(frozen=True, slots=True)
class GatherPolicy:
    """How a program runs its parameter gathers: `prefetch_blocks` units ahead of their use (0:
    each when its first reader needs it), and the parameters in `regather` freed after forward
    and gathered again in backward (FSDP's reshard_after_forward; the others are kept)."""

    prefetch_blocks: int = 0
    regather: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ParamGather:
    """Parameter `name` boxed by `steps` (no relabels; at least one collective) for the readers
    of unit `unit`; `index` orders gathers in the program. `regather`: freed after forward and
    gathered again in backward; `deferred_grad`: its gradient is reduce-scattered
    asynchronously and added into the parameter's by the schedule (every read of the
    parameter goes through scheduled gathers)."""

    index: int
    name: str
    unit: int
    steps: tuple[BoxingStep, ...]
    regather: bool
    deferred_grad: bool


@dataclass(frozen=True, slots=True)
class ParamBox:
    """A boxing of parameter `name` (at `slot`) into `dst` that a program emitted as its step
    number `step`, for a reader in repeated block `block` (None: outside blocks)."""

    step: int
    name: str
    slot: int
    dst: int
    block: int | None
    steps: tuple[BoxingStep, ...]


def plan_gathers(
    boxes: Sequence[ParamBox], read_directly: set[int], policy: GatherPolicy
) -> list[ParamGather]:
    """One `ParamGather` per box (in program order): units are runs of boxes whose readers
    share a block; a parameter's gradient is deferred when no step reads its slot directly
    (`read_directly`: slots read by other steps or sent to other stages)."""
    gathers: list[ParamGather] = []
    unit, block = -1, None
    for index, box in enumerate(boxes):
        if index == 0 or box.block != block:
            unit, block = unit + 1, box.block
        regather, deferred = box.name in policy.regather, box.slot not in read_directly
        gathers.append(ParamGather(index, box.name, unit, box.steps, regather, deferred))
    return gathers


def plan_gather_policy(plan: Plan, stage: int) -> GatherPolicy:
    """The policy `plan` was priced with on `stage`: its `prefetch_blocks`, and the parameters
    whose gathered copies it frees after forward (`reshard_after_forward`). Plans written
    before they were recorded load as 0 and keep-all: what they priced."""
    regather = frozenset(name for name, p in plan.params.items() if p.reshard_after_forward)
    return GatherPolicy(plan.stages[stage].prefetch_blocks, regather)
