"""The strategy ILP of one configuration (stage count, stage mesh, micro-batch count,
recomputation), and what its solution predicts.

Lives here: the prices of a graph on a stage mesh that every configuration shares (`Priced`,
`price_graph`), the Problem of one configuration (`build_problem`: objective and memory, see its
docstring), its bound and its solve (`lower_bound_of`, `solve_mesh`), and the prediction of a
solved configuration by the actor simulation (`predict`). Lives elsewhere: prices (`costs`,
`memory`), stages and recomputation (`pipeline`), tied blocks (`reduce`), the solver (`ilp`),
the search over configurations (`search`), hand-plan restrictions (`strategies`).

Each configuration is solved exactly (to MIP_GAP). Within a stage, the objective has one
overlap: the gradient sync runs while the last micro-batch's backward does
(`schedule.hidden_sync_s`); every op's forward and backward, every boxing and the optimizer
update run one after another on each device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import NoFitError
from autosbp.planner.costs import (
    BACKWARD_FACTOR,
    BoxingPricer,
    NodeStrategies,
    Prices,
    edge_matrix,
    node_strategies,
    sync_bucket_bytes,
)
from autosbp.planner.ilp import lower_bound, solve_below
from autosbp.planner.ilp_problem import Costs, MaxTerm, MemoryConstraint, Problem, Solution
from autosbp.planner.memory import candidate_bytes
from autosbp.planner.pipeline import StageSplit, in_flight, recomputed, split_stages
from autosbp.planner.reduce import TiedStages, tie_blocks, tie_graph, tie_stages, twin_key
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh, local_shape
from autosbp.schedule import hidden_sync_s, simulate, sync_buckets

Allow = Callable[[dict, NdSignature], bool]  # may this node (attrs) take this candidate?


@dataclass(frozen=True)
class StageCosts:
    """Per pipeline stage, the ILP-keyed costs that make up its times (seconds), for pricing a
    solution: `busy` one micro-batch's forward + backward (+ recomputation), `forward` its
    forward part, `send` the one-way transfer of its outputs to later stages per micro-batch,
    `update` the per-step gradient sync and optimizer, of which the last micro-batch's backward
    hides part of the sync (`schedule.hidden_sync_s`); and its memory constraint."""

    busy: tuple[Costs, ...]
    forward: tuple[Costs, ...]
    send: tuple[Costs, ...]
    update: tuple[Costs, ...]
    sync: tuple[Costs, ...]  # the gradient-sync part of `update`
    sync_buckets: tuple[int, ...]  # `schedule.sync_buckets` of each stage's parameters
    overlap: float  # the profile's fraction of communication that compute hides
    memory: tuple[MemoryConstraint, ...]


@dataclass(frozen=True)
class MeshProblem:
    """The ILP of one (graph, stage mesh, stages, micro-batches, recomputation) with the
    candidates behind its indices."""

    mesh: Mesh  # every stage's mesh shape (stage s runs on its own devices)
    strategies: dict[str, NodeStrategies]  # every node (tied nodes share their representative's)
    problem: Problem  # keyed by representative nodes
    representative: dict[str, str]
    split: StageSplit
    stage_costs: StageCosts
    micro_batches: int = 1
    recompute: str = "none"
    graph: OpGraph | None = None

    def choice_of(self, solution: Solution, name: str) -> NdSignature:
        return self.strategies[name].candidates[solution.choice[self.representative[name]]]


@dataclass(frozen=True)
class Priced:
    """Prices of a graph on a stage mesh that do not depend on stages, micro-batches or
    recomputation: candidates, and (computed on first use: most configurations of a search are
    ruled out by their node prices alone) the edges' boxing matrices."""

    mesh: Mesh
    representative: dict[str, str]
    strategies: dict[str, NodeStrategies]
    graph: OpGraph
    pricer: BoxingPricer

    matrices: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False
    )  # per edge twin (`reduce.twin_key`), filled on first use
    saved: dict[tuple[str, str], np.ndarray] = field(
        default_factory=dict, repr=False, compare=False
    )  # per (representative, optimizer), filled on first use

    def saved_bytes(self, name: str, optimizer: str) -> np.ndarray:
        """Per candidate, the bytes node `name` (a representative) keeps on a device."""
        if (name, optimizer) not in self.saved:
            attrs, found = self.graph.graph.nodes[name], self.strategies[name]
            self.saved[(name, optimizer)] = _bytes(attrs, found, self.mesh, optimizer)
        return self.saved[(name, optimizer)]

    def edge_prices(self, u: str, v: str) -> tuple[np.ndarray, np.ndarray]:
        """The boxing matrices of edge (u, v), forward + backward and forward alone, per
        micro-batch; priced once for all its twins."""
        key = twin_key(self.graph, self.representative, u, v)
        found = self.matrices.get(key)
        if found is None:
            uses, metas = key[2], key[3]
            su, sv = self.strategies[u], self.strategies[v]
            found = self.matrices[key] = (
                edge_matrix(su, sv, uses, metas, self.pricer, forward_only=False),
                edge_matrix(su, sv, uses, metas, self.pricer, forward_only=True),
            )
        return found


def price_graph(
    graph: OpGraph,
    mesh: Mesh,
    prices: Prices,
    allow: Allow | None = None,
    pricer: BoxingPricer | None = None,
    representative: dict[str, str] | None = None,
) -> Priced:
    """Candidates of every representative node (`reduce.tie_blocks`, or `representative` where
    given); edges on first use. `pricer`: a boxing pricer of `mesh` to reuse (its chains serve
    every micro-batch size)."""
    pricer = pricer or BoxingPricer(prices, mesh)
    rep = representative or tie_blocks(graph)
    bucket_bytes = sync_bucket_bytes(graph)
    strategies: dict[str, NodeStrategies] = {}
    for name in dict.fromkeys(rep.values()):
        found = node_strategies(graph, name, pricer, bucket_bytes)
        strategies[name] = _restricted(found, graph.graph.nodes[name], allow)
    for name in graph.order:  # a tied node is its representative's twin (same op, args, tensors)
        strategies[name] = strategies[rep[name]]
    return Priced(mesh, rep, strategies, graph, pricer)


def build_problem(
    graph: OpGraph,
    mesh: Mesh,
    prices: Prices,
    *,
    optimizer: str,
    memory_limit_bytes: float | None,
    allow: Allow | None = None,
    micro_batches: int = 1,
    split: StageSplit | None = None,
    recompute: str = "none",
    stage_link: str = "inter_node",
    priced: Priced | None = None,
    tied: TiedStages | None = None,
) -> MeshProblem:
    """The ILP of `graph` (one micro-batch) with `split`'s stages, each on a mesh like `mesh`.

    Objective (Narayanan et al. 2021 section 2.2 for 1F1B): the sum of every stage's
    per-micro-batch time, plus (micro_batches - 1) x the slowest stage's (the steady state),
    plus each cross-stage tensor's transfer both ways (fill and drain), plus the slowest stage's
    per-step gradient sync and optimizer update. With one stage: micro_batches x the stage time
    plus its update, every op, boxing, sync and update one after another. Memory: one
    constraint per stage, activations x the micro-batches in flight there (`in_flight`).
    """
    split = split or split_stages(graph, 1)
    priced = priced or price_graph(graph, mesh, prices, allow)
    tied = tied or tie_stages(tie_graph(graph, priced.representative), split)
    terms = _StageTerms(split.num_stages)
    terms.add_nodes(tied, priced, mesh, optimizer, micro_batches, recompute)
    keys = list(dict.fromkeys(priced.representative.values()))
    sizes = {r: len(priced.strategies[r].candidates) for r in keys}
    # Where the nodes alone overflow a stage (each at its fewest bytes), no choice fits: the
    # edges are not priced (most configurations of a deep model end here; `lower_bound_of`
    # then says nothing fits, and the no-fit message reads the node bytes).
    overflows = memory_limit_bytes is not None and any(
        _least_bytes(a, sizes) > memory_limit_bytes for a in terms.memory
    )
    if not overflows:
        terms.add_edges(tied, priced, recompute, _P2P(prices, mesh, stage_link))
    stage_costs = terms.stage_costs(sizes, prices.overlap_efficiency, memory_limit_bytes)
    node_costs, edge_costs, max_terms = _objective(stage_costs, keys, micro_batches)
    constraints = (
        tuple(replace(c, name=f"{c.name} memory") for c in stage_costs.memory)
        if memory_limit_bytes is not None
        else ()
    )
    problem = Problem(node_costs, edge_costs, constraints, max_terms)
    return MeshProblem(
        mesh, priced.strategies, problem, priced.representative, split, stage_costs,
        micro_batches, recompute, graph,
    )  # fmt: skip


class _StageTerms:
    """Per stage, the sums a configuration's costs and memory are built from (see
    `StageCosts`); tied nodes and edges are added once per group, times its count."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.busy, self.forward, self.send, self.update, self.sync, self.memory = (
            [_Acc() for _ in range(num_stages)] for _ in range(6)
        )
        self.param_bytes = [0] * num_stages

    def add_nodes(
        self,
        tied: TiedStages,
        priced: Priced,
        mesh: Mesh,
        optimizer: str,
        micro_batches: int,
        recompute: str,
    ) -> None:
        nodes = priced.graph.graph.nodes
        for (r, s, read_outside), n in tied.nodes.items():
            attrs, found = nodes[r], priced.strategies[r]
            k = in_flight(s, self.num_stages)
            if attrs["role"] is Role.PARAMETER:
                self.update[s].node(r, n * found.compute_s)
                assert found.sync_s is not None, f"{r}: a parameter priced without its sync"
                self.sync[s].node(r, n * found.sync_s)
                if micro_batches > 1:  # every backward but the first adds into the gradient
                    assert found.accumulate_s is not None
                    share = (micro_batches - 1) / micro_batches  # per micro-batch, m of them
                    self.busy[s].node(r, n * share * found.accumulate_s)
                self.param_bytes[s] += n * attrs["outputs"][0].nbytes
            elif attrs["role"] is Role.COMPUTE:
                fwd = found.compute_s / (1.0 + BACKWARD_FACTOR)
                again = recomputed(attrs, recompute)
                self.busy[s].node(r, n * (found.compute_s + (fwd if again else 0.0)))
                self.forward[s].node(r, n * fwd)
            saved = priced.saved_bytes(r, optimizer)
            if attrs["role"] is Role.COMPUTE and recomputed(attrs, recompute):
                kept = recompute == "full" and read_outside  # a block's output stays
                self.memory[s].node(r, n * saved * (k if kept else 0))
                self.memory[s].transient(r, saved)  # one block rematerialized at a time
            else:
                self.memory[s].node(r, n * saved * (1 if attrs["role"] is not Role.COMPUTE else k))

    def add_edges(self, tied: TiedStages, priced: Priced, recompute: str, p2p: _P2P) -> None:
        """Boxing on every edge, and each tensor sent to a later stage (time and memory)."""
        rep, nodes = priced.representative, priced.graph.graph.nodes
        for ((u, v), sv), n in tied.edges.items():
            both, fwd_only = priced.edge_prices(u, v)
            again = recomputed(nodes[rep[v]], recompute)  # tied nodes are recomputed alike
            self.busy[sv].edge((rep[u], rep[v]), n * (both + fwd_only) if again else n * both)
            self.forward[sv].edge((rep[u], rep[v]), n * fwd_only)
        for u, out_idx, sv in tied.sends:
            local = p2p.local_bytes(priced.strategies[u], out_idx, nodes[u]["outputs"][out_idx])
            self.send[sv - 1].node(rep[u], p2p.time_s(local))
            self.memory[sv].node(rep[u], local * in_flight(sv, self.num_stages))

    def stage_costs(
        self, sizes: dict[str, int], overlap: float, memory_limit_bytes: float | None
    ) -> StageCosts:
        limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf

        def costs(sums: list[_Acc]) -> tuple[Costs, ...]:
            return tuple(a.costs(sizes) for a in sums)

        return StageCosts(
            costs(self.busy), costs(self.forward), costs(self.send), costs(self.update),
            costs(self.sync), tuple(sync_buckets(b) for b in self.param_bytes), overlap,
            tuple(
                MemoryConstraint(a.memory_bytes(sizes), limit, name=f"stage {s}")
                for s, a in enumerate(self.memory)
            ),
        )  # fmt: skip


def _objective(
    costs: StageCosts, keys: list[str], micro_batches: int
) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray], tuple[MaxTerm, ...]]:
    """Node costs, edge costs and max terms of `build_problem`'s objective."""
    busy, m = costs.busy, micro_batches
    if len(busy) == 1:
        node_costs = {r: m * busy[0].node_costs[r] for r in keys}
        edge_costs = {e: m * c for e, c in busy[0].edge_costs.items()}
        max_terms: tuple[MaxTerm, ...] = ()
    else:
        node_costs = {
            r: np.sum([c.node_costs[r] for c in busy], axis=0)
            + 2 * np.sum([c.node_costs[r] for c in costs.send], axis=0)
            for r in keys
        }
        edge_costs = _sum_edges(busy)
        max_terms = (MaxTerm(m - 1, busy),)
    exposed = _exposed_update(
        busy, costs.forward, costs.send, costs.update, costs.sync, costs.sync_buckets,
        costs.overlap,
    )  # fmt: skip
    if len(exposed.parts) > 1:
        max_terms += (exposed,)
    else:  # one stage, nothing hidden (one bucket, or no overlap): the update adds up
        for r, c in costs.update[0].node_costs.items():
            node_costs[r] = node_costs[r] + c
    return node_costs, edge_costs, max_terms


def _least_bytes(memory: _Acc, sizes: dict[str, int]) -> float:
    return sum(float(np.min(b)) for b in memory.memory_bytes(sizes).values() if len(b))


def _exposed_update(
    busy: Sequence[Costs],
    forward: Sequence[Costs],
    send: Sequence[Costs],
    update: Sequence[Costs],
    sync: Sequence[Costs],
    buckets: Sequence[int],
    overlap: float,
) -> MaxTerm:
    """How long after stage 0's last backward the step ends: the largest, over stages s, of
    s's update less the sync its last backward hides, less how much earlier than stage 0's that
    backward ended (1F1B drains backward: the gradient goes to s - 1, which runs its backward,
    and so on down to stage 0: the backward and send of every stage before s).

    Per stage, update - h x min(sync, backward) with h = overlap x (1 - 1/k)
    (`schedule.hidden_sync_s`) is the larger of two linear parts, update - h x sync and update
    - h x backward. One bucket, or no overlap, hides nothing."""
    parts: list[Costs] = []
    drained: list[tuple[float, Costs]] = []  # the backward and send of the stages before s
    for b, f, y, u, k, t in zip(busy, forward, sync, update, buckets, send, strict=True):
        share = overlap * (1.0 - 1.0 / k)
        parts.append(_combine((1.0, u), (-share, y), *drained))
        if share > 0:
            parts.append(_combine((1.0, u), (-share, b), (share, f), *drained))
        drained += [(-1.0, b), (1.0, f), (-1.0, t)]
    return MaxTerm(1.0, tuple(parts))


def _combine(*terms: tuple[float, Costs]) -> Costs:
    """The sum of weight x costs, node by node and edge by edge. A forbidden (infinite)
    candidate or pair counts 0: the problem's own costs forbid it."""
    nodes: dict[str, np.ndarray] = {}
    edges: dict[tuple[str, str], np.ndarray] = {}
    for weight, costs in terms:
        for v, c in costs.node_costs.items():
            nodes[v] = nodes.get(v, 0.0) + weight * _finite(c)
        for e, mat in costs.edge_costs.items():
            edges[e] = edges.get(e, 0.0) + weight * _finite(mat)
    return Costs(nodes, edges)


def _finite(costs: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(costs), costs, 0.0)


def _bytes(attrs: dict, found: NodeStrategies, mesh: Mesh, optimizer: str) -> np.ndarray:
    """Per candidate, the bytes one device keeps for this node with one micro-batch in flight."""
    return np.array(
        [
            candidate_bytes(attrs, sig, mesh.shape, optimizer=optimizer, in_flight=1)
            for sig in found.candidates
        ]
    )


class _Acc:
    """Sums node arrays and edge matrices per representative (tied copies add up); an edge
    between two copies of one node (same position in two blocks) lands on the node's diagonal.
    `transient` keeps the largest single copy (one block rematerialized at a time)."""

    def __init__(self) -> None:
        self.nodes: dict[str, np.ndarray] = {}
        self.edges: dict[tuple[str, str], np.ndarray] = {}
        self.peaks: dict[str, np.ndarray] = {}

    def node(self, key: str, values: np.ndarray | float) -> None:
        if key in self.nodes:
            self.nodes[key] = self.nodes[key] + values
        else:
            self.nodes[key] = np.asarray(values, dtype=float) + 0.0

    def edge(self, key: tuple[str, str], matrix: np.ndarray) -> None:
        if key[0] == key[1]:
            self.node(key[0], np.diag(matrix))
        elif key in self.edges:
            self.edges[key] = self.edges[key] + matrix
        else:
            self.edges[key] = matrix

    def transient(self, key: str, values: np.ndarray) -> None:
        self.peaks[key] = np.maximum(self.peaks[key], values) if key in self.peaks else values

    def costs(self, sizes: dict[str, int]) -> Costs:
        nodes = {r: np.broadcast_to(self.nodes.get(r, 0.0), (n,)) + 0.0 for r, n in sizes.items()}
        return Costs(nodes, dict(self.edges))

    def memory_bytes(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        out = {}
        for r, n in sizes.items():
            total = np.broadcast_to(self.nodes.get(r, 0.0), (n,)) + self.peaks.get(r, 0.0)
            out[r] = np.asarray(total, dtype=float) + 0.0
        return out


def _sum_edges(parts: Sequence[Costs]) -> dict[tuple[str, str], np.ndarray]:
    out: dict[tuple[str, str], np.ndarray] = {}
    for part in parts:
        for key, matrix in part.edge_costs.items():
            out[key] = out[key] + matrix if key in out else matrix
    return out


class _P2P:
    """Cross-stage transfer: device i of one stage sends its local piece to device i of the
    next (every stage has the same mesh shape, and a tensor keeps its layout across)."""

    def __init__(self, prices: Prices, mesh: Mesh, link: str) -> None:
        self.prices, self.mesh, self.link = prices, mesh, link

    def local_bytes(self, found: NodeStrategies, out_idx: int, meta) -> np.ndarray:
        return np.array(
            [
                math.prod(local_shape(meta.shape, sig.outputs[out_idx], self.mesh.shape))
                * meta.dtype.itemsize
                for sig in found.candidates
            ],
            dtype=float,
        )

    def time_s(self, nbytes: np.ndarray) -> np.ndarray:
        return np.array([self.prices.p2p_time_s(float(b), self.link) for b in nbytes])


def _restricted(found: NodeStrategies, attrs: dict, allow: Allow | None) -> NodeStrategies:
    """The candidates a hand plan allows. A parameter the plan would split but whose dims the
    mesh does not divide (a (1,)-shaped bias) stays replicated rather than making the plan
    impossible."""
    if allow is None:
        return found
    keep = [i for i, sig in enumerate(found.candidates) if allow(attrs, sig)]
    if not keep and attrs["role"] is Role.PARAMETER:
        keep = [
            i
            for i, sig in enumerate(found.candidates)
            if all(isinstance(s, Broadcast) for s in sig.outputs[0])
        ]
    return found.restricted(keep)


MIP_GAP = 1e-3  # the MIP stops within 0.1% of its bound (the plan reports the proven gap)


def lower_bound_of(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> float | None:
    """A step time no choice on this mesh beats (the LP relaxation's, or `cutoff` once the LP
    shows that), or None if nothing fits (a node without candidates, or memory)."""
    if any(len(s.candidates) == 0 for s in mesh_problem.strategies.values()):
        return None
    try:
        return lower_bound(mesh_problem.problem, time_limit_s=time_limit_s, cutoff=cutoff)
    except NoFitError:
        return None


def solve_mesh(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> Solution | None:
    """The best choice on this mesh, or None if nothing fits in memory or nothing beats
    `cutoff`. For a problem `lower_bound_of` bounded (every node has a candidate)."""
    try:
        return solve_below(mesh_problem.problem, cutoff, time_limit_s=time_limit_s, rel_gap=MIP_GAP)
    except NoFitError:
        return None


@dataclass(frozen=True)
class Prediction:
    """A solved problem priced as the actor system runs it (`schedule.simulate`): per stage its
    per-micro-batch forward/backward, transfer to the next stage and per-step update (seconds),
    the part of the update's sync that the last backward hides, and peak bytes; the step time is
    when the last stage finishes its update."""

    step_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    update_s: tuple[float, ...]
    sync_hidden_s: tuple[float, ...]  # of update_s, what the last backward hides
    peak_bytes: tuple[float, ...]
    bubble_s: tuple[float, ...]


def predict(mp: MeshProblem, solution: Solution) -> Prediction:
    costs, choice = mp.stage_costs, solution.choice
    fwd = tuple(c.value(choice) for c in costs.forward)
    busy = tuple(c.value(choice) for c in costs.busy)
    send = tuple(c.value(choice) for c in costs.send)
    update = tuple(c.value(choice) for c in costs.update)
    bwd = tuple(b - f for b, f in zip(busy, fwd, strict=True))
    hidden = tuple(
        hidden_sync_s(c.value(choice), b, k, costs.overlap)
        for c, b, k in zip(costs.sync, bwd, costs.sync_buckets, strict=True)
    )
    timeline = simulate(
        mp.split.num_stages, mp.micro_batches, fwd.__getitem__, bwd.__getitem__, send.__getitem__
    )
    ends = [
        max(f.end_s for f in timeline.firings if f.stage == s) + update[s] - hidden[s]
        for s in range(mp.split.num_stages)
    ]
    peaks = tuple(
        mem.constant_bytes + sum(float(b[choice[v]]) for v, b in mem.bytes_per_candidate.items())
        for mem in costs.memory
    )
    bubbles = tuple(timeline.bubble_s(s) for s in range(mp.split.num_stages))
    return Prediction(max(ends), fwd, bwd, send, update, hidden, peaks, bubbles)
