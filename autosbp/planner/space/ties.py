"""Shrink the ILP before solving: repeated blocks share one set of variables.

Lives here: `tie_blocks`, which maps every node of block k > 0 to the node at the same position
of the first block, when the blocks are identical (same ops, shapes and dtypes in the same order);
`tie_graph` and `tie_stages`, the nodes and edges of a graph cut into stages counted per
representative (the first once per graph, the second per stage count). The problem builder
sums the costs and memory of tied nodes onto their representative and merges the edges between
them, so a 96-layer transformer costs the solver what one layer costs, and it loops over these
counts, not over the graph, so it builds about as fast as for one layer.
Lives elsewhere: building and solving the problem (`problem`, `ilp`), stages (`space.stages`).

This restricts the search to plans where every repeated block takes the same signatures, as
Megatron-LM and Alpa do; the result is exact for that space (brute force agrees in the tests).
Reference: autoparallel `repeated_subgraphs` (ilp-planners.md, "Graph-size reduction").
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from autosbp.capturing.graph import OpGraph, Role
from autosbp.planner.space.stages import StageSplit, read_outside_block


def tie_blocks(graph: OpGraph) -> dict[str, str]:
    """node name -> its representative (itself when not tied)."""
    members: dict[int, list[str]] = defaultdict(list)
    for name, attrs in graph.nodes():
        if attrs.block is not None:
            members[attrs.block].append(name)
    representative = {name: name for name in graph.order}
    if len(members) < 2:
        return representative
    blocks = [members[b] for b in sorted(members)]
    first = blocks[0]
    if any(not _same_shape(graph, first, other) for other in blocks[1:]):
        return representative
    for other in blocks[1:]:
        for rep, name in zip(first, other, strict=True):
            representative[name] = rep
    return representative


@dataclass(frozen=True)
class TiedStages:
    """A graph cut into stages, counted per representative (`tie_blocks`). An edge stands for
    its twins: the edges between the same representatives with the same uses and tensors (one
    boxing price serves them all, `twin_key`)."""

    representative: dict[str, str]
    nodes: Counter[tuple[str, int, bool]]  # (representative, stage, read outside its block) -> n
    edges: Counter[tuple[tuple[str, str], int]]  # (an edge for its twins, consumer's stage) -> n
    sends: tuple[tuple[str, int, int], ...]  # (producer, output index, stage receiving it)

    def copies(self) -> Counter[tuple[int, str]]:
        """(stage, representative) -> how many nodes it stands for there."""
        found: Counter[tuple[int, str]] = Counter()
        for (rep, stage, _), n in self.nodes.items():
            found[(stage, rep)] += n
        return found


@dataclass(frozen=True)
class TiedGraph:
    """What `tie_stages` needs of a graph, whatever its stages: each node's representative and
    whether a node outside its block reads it, each edge's twin that stands for it."""

    graph: OpGraph
    representative: dict[str, str]
    read_outside: dict[str, bool]
    member: dict[tuple[str, str], tuple[str, str]]  # edge -> the first of its twins


def tie_graph(graph: OpGraph, representative: dict[str, str] | None = None) -> TiedGraph:
    """`graph`'s ties (`tie_blocks`, or `representative` where given)."""
    rep = representative or tie_blocks(graph)
    members: dict[tuple, tuple[str, str]] = {}
    member = {
        (u, v): members.setdefault(twin_key(graph, rep, u, v), (u, v)) for u, v in graph.graph.edges
    }
    outside = {name: read_outside_block(graph, name) for name in graph.order}
    return TiedGraph(graph, rep, outside, member)


def tie_stages(tied: TiedGraph, split: StageSplit) -> TiedStages:
    """Count the graph's nodes and edges per representative and stage; every tensor that a
    later stage reads from an earlier one (not a model input) once per receiving stage."""
    graph, rep, stage_of = tied.graph, tied.representative, split.stage_of
    nodes = Counter((rep[name], stage_of[name], tied.read_outside[name]) for name in graph.order)
    edges = Counter((member, stage_of[v]) for (_, v), member in tied.member.items())
    sends: dict[tuple[str, int, int], None] = {}
    for u, v, uses in graph.edges():
        if stage_of[u] != stage_of[v] and graph.node(u).role is not Role.INPUT:
            for out_idx, _ in uses:
                sends[(u, out_idx, stage_of[v])] = None
    return TiedStages(rep, nodes, edges, tuple(sends))


@dataclass(frozen=True)
class ModeTies:
    """`TiedStages`' counts split by the recomputation each copy runs under a mode that differs
    per block (`space.recomputation.block_modes`, `full:K`): per node copy its own block's mode
    (its time, what its own backward saves, whether it reruns) and its readers' (what is kept of
    its outputs: its consumers' saves, or their run's checkpoint), per edge its consumer's."""

    nodes: Counter[tuple[str, int, bool, str, str]]  # (rep, stage, read outside, own, readers)
    edges: Counter[tuple[tuple[str, str], int, str]]  # (an edge for its twins, stage, consumer's)
    recomputing: tuple[int, ...]  # per stage, its blocks that run under full


def tie_modes(tied: TiedGraph, split: StageSplit, modes: Mapping[int, str]) -> ModeTies:
    """`tie_stages`' counts of `split` by mode, `modes` the mode of each block; a node outside
    the blocks runs under none, and its readers' mode is that of the first block reading it."""
    graph, rep, stage_of = tied.graph, tied.representative, split.stage_of

    def own(name: str) -> str:
        block = graph.node(name).block
        return "none" if block is None else modes[block]

    def readers(name: str) -> str:
        if not tied.read_outside[name]:
            return own(name)
        blocks = (graph.node(v).block for v in graph.graph.successors(name))
        return next((modes[b] for b in blocks if b is not None), own(name))

    nodes = Counter(
        (rep[n], stage_of[n], tied.read_outside[n], own(n), readers(n)) for n in graph.order
    )
    edges = Counter((member, stage_of[v], own(v)) for (_, v), member in tied.member.items())
    recomputing = tuple(sum(modes[b] == "full" for b in blocks) for blocks in split.blocks)
    return ModeTies(nodes, edges, recomputing)


def twin_key(graph: OpGraph, rep: Mapping[str, str], u: str, v: str) -> tuple:
    """Equal for edges that boxing prices alike: between the same representatives, with the
    same uses (output index -> input index) of the same tensors."""
    uses = tuple(graph.uses(u, v))
    metas = tuple(graph.node(u).outputs[out_idx] for out_idx, _ in uses)
    return (rep[u], rep[v], uses, metas)


def _same_shape(graph: OpGraph, a: list[str], b: list[str]) -> bool:
    """Same length, and position by position the same op, role, arguments and tensor metadata
    (so the same candidates and prices: the planner computes them once per representative)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        ax, ay = graph.node(x), graph.node(y)
        if (ax.op, ax.role, ax.inputs, ax.outputs) != (
            ay.op,
            ay.role,
            ay.inputs,
            ay.outputs,
        ):
            return False
    return True
