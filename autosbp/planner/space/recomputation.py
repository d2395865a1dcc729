"""Recomputation: which of a graph's ops a recomputation mode recomputes in backward.

Lives here: the mode names (`RECOMPUTE_MODES`), `recompute_runs` (every recomputed node and
its run) and `recomputed`. Lives elsewhere: what the modes keep from forward to backward
(`memory.kept`), the runtime's checkpointed runs (`runtime.execute.recompute_runs`), the
stage split (`space.stages`).

Recomputation (Chen et al. 2016; Korthikanti et al. 2022) recomputes runs of a block's ops
in backward (`recompute_runs`; the runtime checkpoints each run, `runtime.execute.program`): `full`
every op of each block, keeping what the block reads from outside; `selective` the attention
core of each block alone (Korthikanti et al. section 5: from the product of queries and keys
through the softmax, its mask and dropout to the product with the values, whose score
tensors grow with the sequence squared and cost few flops); `mlp` the activation of each
block's MLP alone (`_mlp_activations`: the cheap ops between the up/gate projections and the
down projection, e.g. SwiGLU's silu and gate product, or an eager GELU's pieces, with what
program order puts between them: SwiGLU's up projection, recomputed too), recomputed from what
the run reads (the gate projection's output, the MLP's input) so that its intermediates are
dropped: SwiGLU's silu and up-projection outputs (the down projection keeps the gate product,
its own input, whatever the mode). An activation of one op (torch's `F.gelu`) drops nothing
and is not a run. A fused attention kernel (`scaled_dot_product_attention`) keeps no
scores: there is nothing to drop, and selective recomputes nothing. An op that writes into an
input is never recomputed (its write would run twice). So what full keeps is a subset of
selective's and mlp's, and theirs of none's; a recomputing stage also holds, one run at a time,
what the run's ops save while it recomputes.

Partial recomputation `full:K` (Megatron-LM's --recompute-num-layers; `partial_blocks`,
`block_modes`, `recomputed_nodes`): of each stage's blocks the first K run under full, the rest
under none, so which nodes it recomputes depends on the stage split; the planner prices each
copy by its block's mode (`space.ties.tie_modes`), and the search offers it where none does not
fit (`search.best_first.BestFirst.offer_partial`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

from autosbp.capturing.flops import op_family
from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.errors import PlanError
from autosbp.rules import mutated_inputs
from autosbp.rules.core import HIDDEN_WRITES

RECOMPUTE_MODES = ("none", "selective", "mlp", "full")  # by what they recompute, least first


# What an attention core may hold between its two products (cheap ops of few flops per element).
_CORE_FAMILIES = frozenset({"elementwise", "view", "copy", "factory", "dropout", "softmax"})


def recomputed(graph: OpGraph, name: str, mode: str) -> bool:
    """Is node `name`'s output recomputed in backward (not kept) under `mode` (one of
    `RECOMPUTE_MODES`: the same for every block)?"""
    return name in recompute_runs(graph, mode)


def distinct_modes(graph: OpGraph, modes: Sequence[str] = RECOMPUTE_MODES) -> tuple[str, ...]:
    """`modes` less those of `RECOMPUTE_MODES` that recompute nothing in `graph` (selective
    beside a fused attention kernel, mlp beside a one-op activation) while none is among them:
    their plans are none's (the search leaves them out)."""
    return tuple(
        m
        for m in modes
        if m == "none"
        or "none" not in modes
        or m not in RECOMPUTE_MODES
        or recompute_runs(graph, m)
    )


PARTIAL = "full:"  # `full:K`: the first K blocks of each stage under full, the rest under none


def partial_blocks(mode: str) -> int | None:
    """K of `full:K` (Megatron-LM's --recompute-num-layers K: of each stage's blocks, the first
    K recomputed whole, the rest kept), None for a mode of `RECOMPUTE_MODES`; PlanError for
    any other name."""
    if mode in RECOMPUTE_MODES:
        return None
    count = mode.removeprefix(PARTIAL)
    if mode.startswith(PARTIAL) and count.isdigit() and int(count) >= 1:
        return int(count)
    raise PlanError(
        f"recompute {mode!r} is not known; use one of {', '.join(RECOMPUTE_MODES)}, or "
        f"{PARTIAL}K (K >= 1: the first K blocks of each stage recomputed whole)."
    )


def base_modes(modes: Sequence[str]) -> tuple[str, ...]:
    """The modes of `RECOMPUTE_MODES` that `modes` run their blocks under (`full:K`: full and
    none), in order, once each."""
    found = (
        m for mode in modes for m in ((mode,) if partial_blocks(mode) is None else ("full", "none"))
    )
    return tuple(dict.fromkeys(found))


def partial_mode(count: int) -> str:
    """The name of `full:K` for K = `count`."""
    assert count >= 1, count
    return f"{PARTIAL}{count}"


def block_modes(mode: str, stage_blocks: Sequence[Sequence[int]]) -> dict[int, str]:
    """Per repeated block, the mode of `RECOMPUTE_MODES` its copy runs under `mode` with these
    blocks per stage (`space.stages.StageSplit.blocks`): `mode` itself for every block, or, for
    `full:K`, full for the first K blocks of each stage and none for the rest."""
    count = partial_blocks(mode)
    return {
        b: mode if count is None else ("full" if i < count else "none")
        for blocks in stage_blocks
        for i, b in enumerate(blocks)
    }


def recomputed_nodes(
    graph: OpGraph, mode: str, stage_blocks: Sequence[Sequence[int]]
) -> frozenset[str]:
    """Every node `mode` recomputes with these blocks per stage (`block_modes`)."""
    count = partial_blocks(mode)
    if count is None:
        return frozenset(recompute_runs(graph, mode))
    modes = block_modes(mode, stage_blocks)
    blocks = {n: graph.node(n).block for n in recompute_runs(graph, "full")}
    return frozenset(n for n, b in blocks.items() if b is not None and modes.get(b) == "full")


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
        chosen = _CHOSEN[mode](graph)
        memo[mode] = _runs(graph, chosen) if chosen else {}
    return memo[mode]


def _mlp_activations(graph: OpGraph) -> set[str]:
    """The MLP activations of the blocks: for each projection (a product with a parameter) of
    a block, the compute nodes of its block that reach its activation input through cheap ops
    (`_ACTIVATION_FAMILIES`), when every way up ends at projections of the block (the up and
    gate ones) and one of them is read inside the set alone (an intermediate the run drops:
    one op alone drops nothing, its input and output being kept by the projections beside
    it); with every compute node of the block that program order puts between them (one run:
    SwiGLU's up projection, between the silu and the gate product, is recomputed too), when
    none writes into an input."""
    position = {n: i for i, n in enumerate(graph.order)}
    found: set[str] = set()
    for name, attrs in graph.nodes(Role.COMPUTE):
        if attrs.block is None or not _projection(graph, name):
            continue
        for p in graph.producers(name):
            if p is None or _of_parameter(graph, p[0]):
                continue
            chain = _activation_chain(graph, p[0], attrs.block)
            if chain is None or not _drops(graph, chain):
                continue
            at = sorted(position[n] for n in chain)
            span = [  # one run: what program order puts between (SwiGLU's up projection)
                n
                for n in graph.order[at[0] : at[-1] + 1]
                if graph.node(n).role is Role.COMPUTE and graph.node(n).block == attrs.block
            ]
            if not any(_writes(graph.node(n)) for n in span):
                found.update(span)
    return found


# What an MLP's activation may hold between its projections (cheap ops of few flops per element).
_ACTIVATION_FAMILIES = frozenset({"elementwise", "view"})


def _activation_chain(graph: OpGraph, start: str, block: int) -> set[str] | None:
    """The cheap ops of `block` from `start` up to projections of the block; None if a way up
    reaches anything else (an input of the block, an attention core, a product of activations)."""
    chain, frontier = set(), [start]
    while frontier:
        n = frontier.pop()
        if n in chain:
            continue
        attrs = graph.node(n)
        if attrs.role is Role.COMPUTE and op_family(attrs.op) == "matmul":
            if attrs.block != block or not _projection(graph, n):
                return None
            continue  # an up or gate projection: the run's input
        if attrs.role is not Role.COMPUTE:
            if attrs.role is Role.PARAMETER or attrs.role is Role.BUFFER:
                continue  # a bias: the run reads it as the projection does
            return None
        if attrs.block != block or op_family(attrs.op) not in _ACTIVATION_FAMILIES:
            return None
        if _writes(attrs):
            return None
        chain.add(n)
        frontier.extend(p[0] for p in graph.producers(n) if p)
    return chain or None


def _drops(graph: OpGraph, chain: set[str]) -> bool:
    """Does the run drop a value: a non-view op of it read by ops of it alone?"""
    return any(
        op_family(graph.node(n).op) != "view" and all(v in chain for v in graph.graph.successors(n))
        for n in chain
    )


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
                if _projection(graph, n):
                    return None
                found.add(n)
            elif family in _CORE_FAMILIES:
                frontier.append(n)
    return found.pop() if len(found) == 1 else None


def _projection(graph: OpGraph, name: str) -> bool:
    """Is node `name` a projection: a matmul with a parameter (or a view of one) as an operand?"""
    return op_family(graph.node(name).op) == "matmul" and any(
        p and _of_parameter(graph, p[0]) for p in graph.producers(name)
    )


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


# The nodes each mode recomputes, before they are cut into runs (`recompute_runs`).
_CHOSEN = {
    "none": lambda graph: set(),
    "selective": _attention_cores,
    "mlp": _mlp_activations,
    "full": _block_ops,
}
