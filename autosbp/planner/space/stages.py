"""Pipeline stages: which stage runs each node of a graph cut into a number of stages.

Lives here: `split_stages` (a uniform split of the repeated blocks into contiguous stages, the
nodes outside blocks placed where their data is, as a `StageSplit`) and `read_outside_block`.
Lives elsewhere: what recomputation recomputes (`space.recomputation`), the micro-batches a
stage holds at once (`memory.in_flight`), the problem built on a split (`problem.build`), the
actor rules that run the stages (`autosbp.schedule`).

Rules:
- Blocks are dealt to stages in order, as evenly as possible; when they do not divide, the later
  stages take one more (stage 0 holds the most micro-batches in flight, so it gets the fewest).
- A compute node outside the blocks runs on the latest stage of its compute producers (the head
  after the last block); one with none (the embedding, a weight transpose) on the earliest stage
  of its consumers. A parameter or buffer lives on the earliest stage that reads it; later stages
  receive it like an activation. A user input is read directly by every stage that uses it.
- Data only flows forward: an edge from a later stage to an earlier one makes the split invalid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import PlanError


@dataclass(frozen=True)
class StageSplit:
    """The stage of every node and the blocks of every stage."""

    num_stages: int
    stage_of: Mapping[str, int]
    blocks: tuple[tuple[int, ...], ...]


def split_stages(graph: OpGraph, num_stages: int) -> StageSplit:
    """Deal the blocks of `graph` to `num_stages` stages (see the module header)."""
    blocks = sorted({a.block for _, a in graph.nodes() if a.block is not None})
    if num_stages < 1 or (num_stages > 1 and len(blocks) < num_stages):
        raise PlanError(
            f"{num_stages} pipeline stages need at least {num_stages} repeated blocks, but "
            f"`{graph.model_name}` has {len(blocks)}; use fewer stages (pp) or none."
        )
    per_stage = _deal(blocks, num_stages)
    stage_of_block = {b: s for s, members in enumerate(per_stage) for b in members}
    stage: dict[str, int] = {}
    for name in graph.order:  # forward: blocks, then what follows data
        attrs = graph.node(name)
        if attrs.block is not None and attrs.role is Role.COMPUTE:
            stage[name] = stage_of_block[attrs.block]
        elif attrs.role in (Role.COMPUTE, Role.OUTPUT):
            fed = [stage[u] for u in graph.graph.predecessors(name) if u in stage]
            if fed:
                stage[name] = max(fed)
    for name in reversed(graph.order):  # backward: the rest where it is first read
        if name not in stage:
            readers = [stage[v] for v in graph.graph.successors(name) if v in stage]
            stage[name] = min(readers, default=0)
    _check_forward(graph, stage)
    return StageSplit(num_stages, stage, tuple(tuple(b) for b in per_stage))


def _deal(blocks: list[int], num_stages: int) -> list[list[int]]:
    base, extra = divmod(len(blocks), num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for size in sizes:
        out.append(blocks[start : start + size])
        start += size
    return out


def _check_forward(graph: OpGraph, stage: Mapping[str, int]) -> None:
    for u, v in graph.graph.edges:
        if graph.node(u).role is Role.INPUT:
            continue  # every stage reads user inputs itself
        if stage[u] > stage[v]:
            raise PlanError(
                f"cannot cut `{graph.model_name}` into stages: {v!r} (stage {stage[v]}) reads "
                f"{u!r} from the later stage {stage[u]}; plan it with one stage (pp=1)."
            )
        if graph.node(u).role is Role.BUFFER and stage[u] != stage[v]:
            raise PlanError(
                f"cannot cut `{graph.model_name}` into stages: buffer "
                f"{graph.node(u).name!r} is read on stages {stage[u]} and {stage[v]} "
                "(a buffer's updates must stay on one stage); plan it with one stage (pp=1)."
            )


def read_outside_block(graph: OpGraph, name: str) -> bool:
    """Does a node outside `name`'s block read its output (the block's output)?"""
    block = graph.node(name).block
    return any(graph.node(v).block != block for v in graph.graph.successors(name))
