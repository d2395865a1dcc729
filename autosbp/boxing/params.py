"""Which parameters reach a consumer through a collective: the one test the planner and the
runtime share of whether a plan gathers parameters (an FSDP/ZeRO-3 layout).

Lives here: `has_collective` (a chain of steps holds one), `gathers_parameters` (some
parameter's conversion to a consumer's layout holds one) and `gathers_run_beside` (the
schedules the runtime runs gathers beside). Lives elsewhere: the runtime's refusal of a
gathering plan beside the others (`runtime.engine`), the planner's spaces that forbid gathers
there (`planner.problem.priced`: a gathering pair of a parameter's edge is priced infinite), running
the gathers (`runtime.parallel.gathers`).

Invariant: the steps are `plan_boxing`'s on one stage's mesh, the chain the runtime's `Boxer`
runs (it drops relabels, which are local). A local step (slicing S from B, zero-padding P from S
or B) is no gather: a weight stored S(0) and read P on the same mesh dim costs no message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autosbp.boxing.chains import plan_boxing
from autosbp.boxing.steps import BoxingStep, StepKind
from autosbp.capturing.graph import OpGraph, Role
from autosbp.rules import NdSignature
from autosbp.sbp import Mesh

__all__ = ["gathers_parameters", "gathers_run_beside", "has_collective"]


def has_collective(steps: Sequence[BoxingStep]) -> bool:
    """Does one of `steps` exchange data between devices?"""
    return any(step.kind is not StepKind.LOCAL for step in steps)


def gathers_run_beside(virtual_stages: int, split_backward: bool) -> bool:
    """Does the runtime run parameter gathers beside this schedule? Not beside interleaving
    (each chunk would prefetch on its own) nor beside a backward split in two (zero bubble: its
    weight-gradient pass would gather again)."""
    return virtual_stages == 1 and not split_backward


def gathers_parameters(
    graph: OpGraph, signature_of: Callable[[str], NdSignature], mesh: Mesh
) -> bool:
    """Whether any parameter's conversion to a consumer's layout on `mesh` holds a collective
    (every rank answers alike, from the whole graph and every node's signature)."""
    for node, attrs in graph.nodes(Role.PARAMETER):
        have, shape = signature_of(node).outputs[0], attrs.outputs[0].shape
        for consumer in graph.graph.successors(node):
            for _, index in graph.uses(node, consumer):
                want = signature_of(consumer).inputs[index]
                if have != want and has_collective(plan_boxing(have, want, shape, mesh)):
                    return True
    return False
