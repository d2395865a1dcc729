"""Pipeline stages and recomputation: which stage runs each node, and which outputs are recomputed.

Lives here: `split_stages` (a uniform split of the repeated blocks into contiguous stages, the
nodes outside blocks placed where their data is), `in_flight` (micro-batches alive on a stage
under 1F1B), `recomputed` (what a recomputation mode recomputes) and the mode names. Lives
elsewhere: prices (`candidates`, `memory`), the problem built from them (`search`), the actor rules
(`schedule`).

Rules:
- Blocks are dealt to stages in order, as evenly as possible; when they do not divide, the later
  stages take one more (stage 0 holds the most micro-batches in flight, so it gets the fewest).
- A compute node outside the blocks runs on the latest stage of its compute producers (the head
  after the last block); one with none (the embedding, a weight transpose) on the earliest stage
  of its consumers. A parameter or buffer lives on the earliest stage that reads it; later stages
  receive it like an activation. A user input is read directly by every stage that uses it.
- Data only flows forward: an edge from a later stage to an earlier one makes the split invalid.
- Recomputation (Chen et al. 2016; Korthikanti et al. 2022) recomputes runs of a block's ops
  in backward (`recompute_runs`; the runtime checkpoints each run, `runtime.execute.program`): `full`
  every op of each block, keeping what the block reads from outside; `selective` the attention
  core of each block alone (Korthikanti et al. section 5: from the product of queries and keys
  through the softmax, its mask and dropout to the product with the values, whose score
  tensors grow with the sequence squared and cost few flops). A fused attention kernel
  (`scaled_dot_product_attention`) keeps no scores: there is nothing to drop, and selective
  recomputes nothing. An op that writes into an input is never recomputed (its write would run
  twice). So what full keeps is a subset of selective's, and selective's of none's; a
  recomputing stage also holds, one run at a time, what the run's ops save while it recomputes.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.errors import PlanError
from autosbp.rules import mutated_inputs
from autosbp.rules.core import HIDDEN_WRITES
from autosbp.schedule import Phase, simulate

RECOMPUTE_MODES = ("none", "selective", "full")
# What an attention core may hold between its two products (cheap ops of few flops per element).
_CORE_FAMILIES = frozenset({"elementwise", "view", "copy", "factory", "dropout", "softmax"})


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


def in_flight(stage: int, num_stages: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B (schedule quotas)."""
    return num_stages - stage


def interleaved_in_flight(
    num_stages: int, virtual_stages: int, micro_batches: int
) -> tuple[int, ...]:
    """Per virtual stage (chunk c of stage d: c x P + d), the micro-batches whose activations
    chunk c holds at the moment stage d holds the most chunk activations under interleaved
    1F1B (`schedule.simulate`, unit durations): the chunks' in-flight counts that add up to
    the stage's peak (exact where the chunks' activations are alike, as equal blocks are)."""
    p, v = num_stages, virtual_stages
    timeline = simulate(p, micro_batches, lambda _: 1.0, lambda _: 2.0, virtual_stages=v)
    out = [0] * (p * v)
    for d in range(p):
        events = sorted(
            (f.end_s if f.phase is Phase.BACKWARD else f.start_s,
             -1 if f.phase is Phase.BACKWARD else 1, f.chunk)
            for f in timeline.firings if f.stage == d
        )  # fmt: skip
        alive, best = [0] * v, [0] * v
        for _, delta, chunk in events:  # a backward's end frees before a forward starts
            alive[chunk] += delta
            if sum(alive) > sum(best):
                best = list(alive)
        for c in range(v):
            out[c * p + d] = best[c]
    return tuple(out)


def recomputed(graph: OpGraph, name: str, mode: str) -> bool:
    """Is node `name`'s output recomputed in backward (not kept) under `mode`?"""
    return name in recompute_runs(graph, mode)


_RUNS: dict[int, tuple[weakref.ref, dict[str, Mapping[str, int]]]] = {}  # per live graph


def recompute_runs(graph: OpGraph, mode: str) -> Mapping[str, int]:
    """Every node `mode` recomputes -> its run: the maximal stretches, in program order, of
    recomputed compute nodes of one block (the module docstring; computed once per graph).
    The runtime checkpoints each run as one step; a run saves what it reads from outside it."""
    if mode not in RECOMPUTE_MODES:
        raise PlanError(
            f"recompute {mode!r} is not known; use one of {', '.join(RECOMPUTE_MODES)}."
        )
    key = id(graph)
    entry = _RUNS.get(key)
    if entry is None or entry[0]() is not graph:
        entry = _RUNS[key] = (weakref.ref(graph, lambda _: _RUNS.pop(key, None)), {})
    memo = entry[1]
    if mode not in memo:
        chosen = _attention_cores(graph) if mode == "selective" else _block_ops(graph)
        memo[mode] = _runs(graph, chosen) if mode != "none" else {}
    return memo[mode]


def _block_ops(graph: OpGraph) -> set[str]:
    return {n for n, a in graph.nodes(Role.COMPUTE) if a.block is not None and not _writes(a)}


def _writes(attrs: OpNode) -> bool:
    """Does the op write into an input (`rules.mutated_inputs`, asked only of ops whose schema
    is mutable or that write in training: the common case costs a lookup)?"""
    schema = getattr(attrs.target, "_schema", None)
    if schema is not None and not schema.is_mutable and attrs.op not in HIDDEN_WRITES:
        return False
    return bool(mutated_inputs(attrs))


def _runs(graph: OpGraph, chosen: set[str]) -> dict[str, int]:
    """The chosen nodes numbered by run: consecutive compute nodes of one block."""
    runs: dict[str, int] = {}
    run, last = 0, None  # the block of the run going on (None: none)
    for name, attrs in graph.nodes(Role.COMPUTE):
        block = attrs.block if name in chosen else None
        if block is None or block != last:
            run += 1
        last = block
        if block is not None:
            runs[name] = run
    return runs


def _attention_cores(graph: OpGraph) -> set[str]:
    """The attention cores of the blocks: for each softmax of a block between two products
    of activations (queries x keys before it, x values after it, each reached through cheap
    ops), every compute node of the block from the first product to the second in program
    order, when all between are cheap (`_CORE_FAMILIES`) and none writes into an input."""
    position = {n: i for i, n in enumerate(graph.order)}
    cores: set[str] = set()
    for name, attrs in graph.nodes(Role.COMPUTE):
        if attrs.block is None or op_family(attrs.op) != "softmax":
            continue
        first, last = _product(graph, name, up=True), _product(graph, name, up=False)
        if first is None or last is None:
            continue
        span = graph.order[position[first] : position[last] + 1]
        core = [
            n
            for n in span
            if graph.node(n).role is Role.COMPUTE and graph.node(n).block == attrs.block
        ]
        inner = [graph.node(n) for n in core if n not in (first, last)]
        if all(op_family(a.op) in _CORE_FAMILIES and not _writes(a) for a in inner):
            cores.update(core)
    return cores


def _product(graph: OpGraph, start: str, *, up: bool) -> str | None:
    """The one matmul of two activations reached from `start` through cheap ops of its block,
    against (`up`) or along the data; None if there is none, several, or a projection (a
    product with a parameter) comes first."""
    block = graph.node(start).block
    step = graph.graph.predecessors if up else graph.graph.successors
    seen, frontier, found = {start}, [start], set()
    while frontier:
        for n in step(frontier.pop()):
            attrs = graph.node(n)
            if n in seen or attrs.role is not Role.COMPUTE or attrs.block != block:
                continue
            seen.add(n)
            family = op_family(attrs.op)
            if family == "matmul":
                if any(_of_parameter(graph, p[0]) for p in graph.producers(n) if p):
                    return None
                found.add(n)
            elif family in _CORE_FAMILIES:
                frontier.append(n)
    return found.pop() if len(found) == 1 else None


def _of_parameter(graph: OpGraph, name: str) -> bool:
    """Is `name` a parameter, or a view of one?"""
    while True:
        attrs = graph.node(name)
        if attrs.role is Role.PARAMETER:
            return True
        if attrs.role is not Role.COMPUTE or op_family(attrs.op) != "view":
            return False
        found = graph.producers(name)
        if not found or found[0] is None:
            return False
        name = found[0][0]


def read_outside_block(graph: OpGraph, name: str) -> bool:
    """Does a node outside `name`'s block read its output (the block's output)?"""
    block = graph.node(name).block
    return any(graph.node(v).block != block for v in graph.graph.successors(name))
