"""The strategy ILP of one configuration (stage count, stage mesh, micro-batch count,
recomputation), and what its solution predicts.

Lives here: the prices of a graph on a stage mesh that every configuration shares (`Priced`,
`price_graph`), the Problem of one configuration (`build_problem`: objective and memory, see its
docstring), its bound and its solve (`lower_bound_of`, `solve_mesh`), and the prediction of a
solved configuration by the actor simulation (`predict`). Lives elsewhere: the objective made
of the stages' costs, a lower bound of `predict` (`objective`), prices (`costs`, `memory`),
stages and recomputation (`pipeline`), tied blocks (`reduce`), the solver (`ilp`), the search
over configurations (`search`), hand-plan restrictions (`strategies`).

Each configuration is solved exactly (to MIP_GAP). Within a stage, the objective has one
overlap: the gradient sync runs while the last micro-batch's backward does
(`schedule.hidden_sync_s`); every op's forward and backward, every boxing and the optimizer
update run one after another on each device.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
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
from autosbp.planner.ilp import bound_or_solve, solve_below
from autosbp.planner.ilp_problem import Costs, MemoryConstraint, Problem, Solution
from autosbp.planner.memory import candidate_bytes
from autosbp.planner.objective import StageCosts, objective_terms
from autosbp.planner.pipeline import StageSplit, in_flight, recomputed, split_stages
from autosbp.planner.reduce import TiedStages, tie_blocks, tie_graph, tie_stages, twin_key
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh, local_shape
from autosbp.schedule import hidden_sync_s, simulate, sync_buckets

Allow = Callable[[dict, NdSignature], bool]  # may this node (attrs) take this candidate?


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
    memo: dict[Hashable, NodeStrategies] | None = None,
) -> Priced:
    """Candidates of every representative node (`reduce.tie_blocks`, or `representative` where
    given); edges on first use. `pricer`: a boxing pricer of `mesh` to reuse (its chains serve
    every micro-batch size); `memo`: parameters' candidates to reuse across graphs (a
    parameter's depend only on its tensor, the mesh and the sync bucket, `_parameter_key`)."""
    pricer = pricer or BoxingPricer(prices, mesh)
    rep = representative or tie_blocks(graph)
    bucket_bytes = sync_bucket_bytes(graph)
    strategies: dict[str, NodeStrategies] = {}
    for name in dict.fromkeys(rep.values()):
        attrs = graph.graph.nodes[name]
        key = _parameter_key(attrs, mesh, bucket_bytes) if memo is not None else None
        found = memo.get(key) if memo is not None and key is not None else None
        if found is None:
            found = node_strategies(graph, name, pricer, bucket_bytes)
            if memo is not None and key is not None:
                memo[key] = found
        strategies[name] = _restricted(replace(found, name=name), attrs, allow)
    for name in graph.order:  # a tied node is its representative's twin (same op, args, tensors)
        strategies[name] = strategies[rep[name]]
    return Priced(mesh, rep, strategies, graph, pricer)


def _parameter_key(attrs: dict, mesh: Mesh, bucket_bytes: int) -> Hashable | None:
    """What a parameter's candidates and prices (`costs.node_strategies`) read, or None for
    other nodes (their candidates read their inputs and the graph around them)."""
    if attrs["role"] is not Role.PARAMETER:
        return None
    return (mesh, bucket_bytes, attrs["op"], tuple(attrs["inputs"]), tuple(attrs["outputs"]))


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

    Objective (`objective`): with stages, the largest of the 1F1B path bounds (Narayanan et
    al. 2021 section 2.2: the fill to a stage, its steady state, the drain, a stage's update),
    a lower bound of the simulated step for every choice and equal to it with the slowest
    stage last; with one stage, micro_batches x the stage time plus its update, every op,
    boxing, sync and update one after another. Memory: one constraint per stage, activations
    x the micro-batches in flight there (`in_flight`).
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
    node_costs, edge_costs, max_terms = objective_terms(stage_costs, keys, micro_batches)
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
        # Per stage, what its time costs are made of: equal for stages whose costs are equal.
        self.kinds: list[Counter[tuple]] = [Counter() for _ in range(num_stages)]

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
            self.kinds[s][("node", r, read_outside)] += n
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
            self.kinds[sv][("edge", u, v)] += n
            both, fwd_only = priced.edge_prices(u, v)
            again = recomputed(nodes[rep[v]], recompute)  # tied nodes are recomputed alike
            self.busy[sv].edge((rep[u], rep[v]), n * (both + fwd_only) if again else n * both)
            self.forward[sv].edge((rep[u], rep[v]), n * fwd_only)
        for u, out_idx, sv in tied.sends:
            self.kinds[sv - 1][("send", rep[u], out_idx, nodes[u]["outputs"][out_idx])] += 1
            local = p2p.local_bytes(priced.strategies[u], out_idx, nodes[u]["outputs"][out_idx])
            self.send[sv - 1].node(rep[u], p2p.time_s(local))
            self.memory[sv].node(rep[u], local * in_flight(sv, self.num_stages))

    def stage_costs(
        self, sizes: dict[str, int], overlap: float, memory_limit_bytes: float | None
    ) -> StageCosts:
        limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf

        kinds = tuple(frozenset(kind.items()) for kind in self.kinds)
        first = {kind: s for s, kind in reversed(list(enumerate(kinds)))}

        def costs(sums: list[_Acc]) -> tuple[Costs, ...]:  # stages of one kind share theirs
            built = {s: sums[s].costs(sizes) for s in set(first.values())}
            return tuple(built[first[kind]] for kind in kinds)

        return StageCosts(
            costs(self.busy), costs(self.forward), costs(self.send), costs(self.update),
            costs(self.sync), tuple(sync_buckets(b) for b in self.param_bytes), overlap,
            tuple(
                MemoryConstraint(a.memory_bytes(sizes), limit, name=f"stage {s}")
                for s, a in enumerate(self.memory)
            ),
            kinds,
        )  # fmt: skip


def _least_bytes(memory: _Acc, sizes: dict[str, int]) -> float:
    return sum(float(np.min(b)) for b in memory.memory_bytes(sizes).values() if len(b))


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
        return Costs(
            {r: _per_candidate(self.nodes.get(r), n) for r, n in sizes.items()}, self.edges
        )

    def memory_bytes(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        out = {}
        for r, n in sizes.items():
            total = _per_candidate(self.nodes.get(r), n)
            out[r] = total + self.peaks[r] if r in self.peaks else total
        return out


def _per_candidate(values: np.ndarray | None, n: int) -> np.ndarray:
    """`values` as one number per candidate (a scalar is every candidate's; None is 0)."""
    if values is None:
        return np.zeros(n)
    return values if values.shape == (n,) else np.full(n, float(values))


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
    found = bound_mesh(mesh_problem, time_limit_s, cutoff)
    return None if found is None else found[0]


def bound_mesh(
    mesh_problem: MeshProblem, time_limit_s: float, cutoff: float = math.inf
) -> tuple[float, Solution | None] | None:
    """`lower_bound_of`, and the optimal solution when the LP relaxation is integral."""
    if any(len(s.candidates) == 0 for s in mesh_problem.strategies.values()):
        return None
    try:
        return bound_or_solve(mesh_problem.problem, time_limit_s=time_limit_s, cutoff=cutoff)
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
