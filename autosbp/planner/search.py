"""Search: over stage counts, stage meshes, micro-batch counts and recomputation modes, build
the strategy ILP of each configuration, solve it, keep the fastest plan.

Lives here: mesh shapes worth trying, the Problem of one configuration (`build_problem`), the
bounds that skip configurations before pricing or solving them (`compute_floors`,
`step_bound`, the LP cutoff of `ilp.solve_below`), hand-plan restrictions (`dp`, `fsdp`,
`megatron:tp=..,pp=..,dp=..`) as limits on what the search may choose, and the prediction of a
solved configuration by the actor simulation (`predict`). Lives elsewhere: prices (`costs`,
`memory`), stages and recomputation (`pipeline`), the solver (`ilp`), turning the winner into
a `Plan` (`assemble`).

Each configuration is solved exactly (to MIP_GAP); the outer loops are heuristic where stated
in `search`. Within a stage, the objective has one overlap: the gradient sync runs while the
last micro-batch's backward does (`schedule.hidden_sync_s`); every op's forward and backward,
every boxing and the optimizer update run one after another on each device.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from autosbp.errors import NoFitError, PlanError
from autosbp.graph import OpGraph, Role
from autosbp.ilp import (
    Costs,
    MaxTerm,
    MemoryConstraint,
    Problem,
    Solution,
    lower_bound,
    solve_below,
)
from autosbp.plan import format_bytes
from autosbp.planner.costs import (
    BACKWARD_FACTOR,
    BoxingPricer,
    NodeStrategies,
    Prices,
    edge_matrix,
    node_strategies,
    returns_view,
    sync_bucket_bytes,
)
from autosbp.planner.memory import candidate_bytes
from autosbp.planner.pipeline import (
    RECOMPUTE_MODES,
    StageSplit,
    in_flight,
    recomputed,
    split_stages,
)
from autosbp.planner.reduce import (
    TiedGraph,
    TiedStages,
    tie_blocks,
    tie_graph,
    tie_stages,
    twin_key,
)
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh, NdSbp, Split, local_shape
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


LinkOf = Callable[[tuple[int, ...], int], str]  # (mesh shape, mesh dim) -> link class name


def mesh_shapes(devices: int, link_of: LinkOf, devices_per_node: int | None = None) -> list[Mesh]:
    """The 1D mesh and the 2D factorizations of `devices` (row-major over node-major device
    ids) whose inner dim stays inside a node (divides `devices_per_node`; every factorization
    when None); each mesh dim gets the link class its groups cross."""
    inner_ok = (
        (lambda n: True) if devices_per_node is None else (lambda n: devices_per_node % n == 0)
    )
    shapes = [(devices,)] + [
        (devices // inner, inner)
        for inner in range(2, devices)
        if devices % inner == 0 and inner_ok(inner)
    ]
    return [
        Mesh(
            shape,
            tuple(f"d{i}" for i in range(len(shape))),
            link_classes=tuple(link_of(shape, d) for d in range(len(shape))),
        )
        for shape in shapes
    ]


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
    pricer_p2p = _P2P(prices, mesh, stage_link)
    stages = range(split.num_stages)
    busy = [_Acc() for _ in stages]
    forward = [_Acc() for _ in stages]
    send = [_Acc() for _ in stages]
    update = [_Acc() for _ in stages]
    sync = [_Acc() for _ in stages]
    param_bytes = [0] * split.num_stages
    memory = [_Acc() for _ in stages]
    rep, strategies, nodes = priced.representative, priced.strategies, graph.graph.nodes
    kept_bytes: dict[str, np.ndarray] = {}  # per representative: tied nodes keep the same

    def saved_bytes(name: str, attrs: dict) -> np.ndarray:
        if rep[name] not in kept_bytes:
            kept_bytes[rep[name]] = _bytes(attrs, strategies[name], mesh, optimizer)
        return kept_bytes[rep[name]]

    # Tied nodes and edges are twins: price each group once, times its count.
    for (r, s, read_outside), n in tied.nodes.items():
        attrs, found = nodes[r], strategies[r]
        k = in_flight(s, split.num_stages)
        if attrs["role"] is Role.PARAMETER:
            update[s].node(r, n * found.compute_s)
            assert found.sync_s is not None, f"{r}: a parameter priced without its sync"
            sync[s].node(r, n * found.sync_s)
            if micro_batches > 1:  # every backward but the first adds into the gradient
                assert found.accumulate_s is not None
                share = (micro_batches - 1) / micro_batches  # per micro-batch, m of them
                busy[s].node(r, n * share * found.accumulate_s)
            param_bytes[s] += n * attrs["outputs"][0].nbytes
        elif attrs["role"] is Role.COMPUTE:
            fwd = found.compute_s / (1.0 + BACKWARD_FACTOR)
            again = recomputed(attrs, recompute)
            busy[s].node(r, n * (found.compute_s + (fwd if again else 0.0)))
            forward[s].node(r, n * fwd)
        saved = saved_bytes(r, attrs)
        if attrs["role"] is Role.COMPUTE and recomputed(attrs, recompute):
            kept = recompute == "full" and read_outside  # a block's output stays
            memory[s].node(r, n * saved * (k if kept else 0))
            memory[s].transient(r, saved)  # one block rematerialized at a time
        else:
            memory[s].node(r, n * saved * (1 if attrs["role"] is not Role.COMPUTE else k))
    keys = list(dict.fromkeys(rep[n] for n in graph.order))
    sizes = {r: len(strategies[r].candidates) for r in keys}
    # Where the nodes alone overflow a stage (each at its fewest bytes), no choice fits: the
    # edges are not priced (most configurations of a deep model end here; `lower_bound_of`
    # then says nothing fits, and the no-fit message reads the node bytes).
    overflows = memory_limit_bytes is not None and any(
        _least_bytes(a, sizes) > memory_limit_bytes for a in memory
    )
    for ((u, v), sv), n in tied.edges.items() if not overflows else ():
        both, fwd_only = priced.edge_prices(u, v)
        again = recomputed(nodes[rep[v]], recompute)  # tied nodes are recomputed alike
        busy[sv].edge((rep[u], rep[v]), n * (both + fwd_only) if again else n * both)
        forward[sv].edge((rep[u], rep[v]), n * fwd_only)
    for u, out_idx, sv in tied.sends if not overflows else ():
        meta = nodes[u]["outputs"][out_idx]
        local = pricer_p2p.local_bytes(strategies[u], out_idx, meta)
        send[sv - 1].node(rep[u], pricer_p2p.time_s(local))
        memory[sv].node(rep[u], local * in_flight(sv, split.num_stages))
    busy_c = tuple(a.costs(sizes) for a in busy)
    forward_c = tuple(a.costs(sizes) for a in forward)
    update_c = tuple(a.costs(sizes) for a in update)
    sync_c = tuple(a.costs(sizes) for a in sync)
    send_c = tuple(a.costs(sizes) for a in send)
    buckets = tuple(sync_buckets(b) for b in param_bytes)
    m = micro_batches
    if split.num_stages == 1:
        node_costs = {r: m * busy_c[0].node_costs[r] for r in keys}
        edge_costs = {e: m * c for e, c in busy_c[0].edge_costs.items()}
        max_terms: tuple[MaxTerm, ...] = ()
    else:
        node_costs = {
            r: np.sum([c.node_costs[r] for c in busy_c], axis=0)
            + 2 * np.sum([c.node_costs[r] for c in send_c], axis=0)
            for r in keys
        }
        edge_costs = _sum_edges(busy_c)
        max_terms = (MaxTerm(m - 1, busy_c),)
    overlap = prices.overlap_efficiency
    exposed = _exposed_update(busy_c, forward_c, send_c, update_c, sync_c, buckets, overlap)
    if len(exposed.parts) > 1:
        max_terms += (exposed,)
    else:  # one stage, nothing hidden (one bucket, or no overlap): the update adds up
        for r, c in update_c[0].node_costs.items():
            node_costs[r] = node_costs[r] + c
    constraints = (
        tuple(
            MemoryConstraint(a.memory_bytes(sizes), memory_limit_bytes, name=f"stage {s} memory")
            for s, a in enumerate(memory)
        )
        if memory_limit_bytes is not None
        else ()
    )
    stage_costs = StageCosts(
        busy_c,
        forward_c,
        send_c,
        update_c,
        sync_c,
        buckets,
        overlap,
        tuple(
            MemoryConstraint(
                a.memory_bytes(sizes), memory_limit_bytes or math.inf, name=f"stage {s}"
            )
            for s, a in enumerate(memory)
        ),
    )
    problem = Problem(node_costs, edge_costs, constraints, max_terms)
    return MeshProblem(
        mesh, strategies, problem, rep, split, stage_costs, micro_batches, recompute, graph
    )


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


# ---- hand plans as restrictions ---------------------------------------------------------------


def strategy_space(strategy: str, recompute: str = "auto", max_stages: int | None = None) -> Space:
    """What `strategy` lets the search choose (`auto` restricts nothing; stage counts up to
    `max_stages` then). `recompute`: a mode, or `auto` for every mode."""
    modes: tuple[str, ...]
    if recompute == "auto":
        modes = RECOMPUTE_MODES
    elif recompute in RECOMPUTE_MODES:
        modes = (recompute,)
    else:
        raise PlanError(
            f"recompute {recompute!r} is not known; use auto, {', '.join(RECOMPUTE_MODES)}."
        )
    if strategy == "auto":
        return Space(tuple(range(1, (max_stages or 1) + 1)), modes)
    if strategy == "dp":
        return Space(
            (1,), modes, allow=_allow(param=lambda nd, shape: all(isinstance(s, Broadcast) for s in nd)),
            mesh_ok=lambda m: m.ndim == 1,
        )  # fmt: skip
    if strategy == "fsdp":
        return Space(
            (1,), modes, allow=_allow(param=lambda nd, shape: isinstance(nd[0], Split)),
            mesh_ok=lambda m: m.ndim == 1,
        )  # fmt: skip
    if strategy.startswith("megatron:"):
        tp, pp, dp, mb = _megatron_degrees(strategy)
        counts = (mb,) if mb is not None else None
        if tp == 1:  # no tensor parallelism: plain data parallelism in each stage
            allow = _allow(param=lambda nd, shape: all(isinstance(s, Broadcast) for s in nd))
            return Space((pp,), modes, counts, allow, lambda m: m.shape == (dp,))
        # Megatron: every weight matrix (and embedding table) split on the tp mesh dim, the ILP
        # picking which dim (column or row parallel); vectors (biases, norms) free; data split
        # on the dp mesh dim, where weights are replicated.
        if dp == 1:  # tensor parallelism alone: every device sees the whole batch
            allow = _allow(param=_tensor_parallel(0), data=lambda nd: nd == (Broadcast(),))
            return Space((pp,), modes, counts, allow, lambda m: m.shape == (tp,))
        allow = _allow(
            param=lambda nd, shape: isinstance(nd[0], Broadcast) and _tensor_parallel(1)(nd, shape),
            data=lambda nd: nd == (Split(0), Broadcast()),
        )
        return Space((pp,), modes, counts, allow, lambda m: m.shape == (dp, tp))
    raise PlanError(
        f"unknown strategy {strategy!r}; use auto, dp, fsdp or megatron:tp=T,pp=P,dp=D[,mb=M]."
    )


def hand_strategies(devices: int, devices_per_node: int, blocks: int) -> list[str]:
    """The hand plans worth comparing with: dp, fsdp, and Megatron-style plans with tensor
    parallel 2 or a whole node, 2 to 16 stages (at most one per block), data parallel for the
    rest (micro-batch counts searched)."""
    tps = sorted({t for t in (1, 2, devices_per_node) if t <= devices})
    stage_counts = [p for p in (1, 2, 4, 8, 16) if p <= max(blocks, 1)]
    megatron = [
        f"megatron:tp={tp},pp={pp},dp={devices // (tp * pp)}"
        for tp in tps
        for pp in stage_counts
        if tp * pp > 1 and devices % (tp * pp) == 0
    ]
    return ["dp", "fsdp", *megatron]


def _megatron_degrees(strategy: str) -> tuple[int, int, int, int | None]:
    """(tp, pp, dp, mb) of `megatron:tp=T,pp=P,dp=D,mb=M` (each optional: 1, mb searched)."""
    example = "write it like megatron:tp=2,pp=2,dp=1 (mb=4 optional)"
    try:
        fields = {
            k: int(v)
            for k, v in (item.split("=") for item in strategy.removeprefix("megatron:").split(","))
        }
    except ValueError:
        raise PlanError(f"cannot read {strategy!r}; {example}.") from None
    unknown = sorted(set(fields) - {"tp", "dp", "pp", "mb"})
    if unknown:
        raise PlanError(f"{strategy!r} has unknown degree(s) {unknown}; {example}.")
    if any(v < 1 for v in fields.values()):
        raise PlanError(f"{strategy!r}: degrees must be positive; {example}.")
    return fields.get("tp", 1), fields.get("pp", 1), fields.get("dp", 1), fields.get("mb")


def _tensor_parallel(mesh_dim: int) -> Callable[[NdSbp, tuple[int, ...]], bool]:
    """Matrices split on `mesh_dim`; vectors anything."""
    return lambda nd, shape: len(shape) < 2 or isinstance(nd[mesh_dim], Split)


def _allow(param: Callable | None = None, data: Callable | None = None) -> Allow:
    """`param(nd_sbp, shape) -> bool` filters parameter layouts, `data(nd_sbp)` input layouts
    (default: the batch split on every mesh dim)."""

    def allow(attrs: dict, sig: NdSignature) -> bool:
        if attrs["role"] is Role.PARAMETER and param is not None:
            return bool(param(sig.outputs[0], attrs["outputs"][0].shape))
        if attrs["role"] is Role.INPUT:
            nd = sig.outputs[0]
            if data is not None:
                return bool(data(nd))
            return all(isinstance(s, Split) and s.dim == 0 for s in nd)
        return True

    return allow


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


@dataclass(frozen=True)
class Space:
    """What the search may choose: stage counts, micro-batch counts (None: powers of two that
    divide the batch), recomputation modes, and the hand-plan restrictions."""

    stage_counts: tuple[int, ...]
    recompute: tuple[str, ...]
    micro_batches: tuple[int, ...] | None = None
    allow: Allow | None = None
    mesh_ok: Callable[[Mesh], bool] = lambda mesh: True


@dataclass(frozen=True)
class Found:
    problem: MeshProblem
    solution: Solution
    prediction: Prediction
    graph: OpGraph


MIP_GAP = 1e-3  # the MIP stops within 0.1% of its bound (the plan reports the proven gap)
IDLE_STAGE_COUNTS = 2  # see `search` (measured on GPT-3: the best stage count is the first)
GraphFor = Callable[[int], OpGraph]  # micro-batch count -> the graph of one micro-batch


def search(
    graph_for: GraphFor,
    batch: int,
    devices: int,
    prices: Prices,
    link_of: LinkOf,
    space: Space,
    *,
    optimizer: str,
    memory_limit_bytes: float | None,
    time_limit_s: float,
    devices_per_node: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Found:
    """The fastest plan (by `predict`) over stage counts x stage meshes x micro-batch counts x
    recomputation modes, each signature choice from the ILP.

    Stage counts are tried in increasing order, and the search ends after IDLE_STAGE_COUNTS
    of them in a row found nothing faster (the step time is taken to be unimodal in the stage
    count). Micro-batch counts are tried in increasing order. With one stage, more micro-batches only
    save memory, so the search stops at the first count where a plan fits without
    recomputation. With stages, more micro-batches shrink the bubble but add per-micro-batch
    overheads: the search stops once a count is slower than the one before (the step time is
    taken to be unimodal in the count; a heuristic, stated in the plan's breakdown).
    """
    best: Found | None = None
    tried: list[MeshProblem] = []
    refused: list[str] = []
    counts = space.micro_batches or powers_of_two_dividing(batch)
    idle = 0  # stage counts in a row that found nothing faster
    pricers: dict[Mesh, BoxingPricer] = {}  # one per stage mesh, across micro-batch counts
    graphs_tied: dict[int, TiedGraph] = {}  # per micro-batch count, across stage counts
    for num_stages in space.stage_counts:
        if devices % num_stages:
            refused.append(f"{num_stages} stages do not divide {devices} devices")
            continue
        if idle >= IDLE_STAGE_COUNTS:
            break
        best_before = best
        stage_devices = devices // num_stages

        def stage_link(shape: tuple[int, ...], dim: int, p: int = num_stages) -> str:
            return link_of((p, *shape), dim + 1)

        meshes = [
            m for m in mesh_shapes(stage_devices, stage_link, devices_per_node) if space.mesh_ok(m)
        ]
        across = link_of((num_stages, stage_devices), 0)
        previous: float | None = None
        for count in counts:
            if num_stages > 1 and count < num_stages:
                continue
            graph = graph_for(count)
            try:
                split = split_stages(graph, num_stages)
            except PlanError as exc:
                refused.append(str(exc))
                break
            if count not in graphs_tied:
                graphs_tied[count] = tie_graph(graph)
            tied = tie_stages(graphs_tied[count], split)
            copies = tied.copies()
            floors = compute_floors(graph, prices, stage_devices, {r for _, r in copies})
            best_here, fits_plainly, cut = None, False, False
            candidates: list[tuple[float, int, MeshProblem]] = []  # (lower bound, order, problem)
            for mesh in meshes:
                priced: Priced | None = None
                for mode in space.recompute:
                    cutoff = best.prediction.step_time_s if best is not None else math.inf
                    if step_bound(graph, copies, num_stages, floors, count, mode) >= cutoff:
                        cut = True
                        continue  # even perfectly sharded compute alone is too slow
                    if progress:
                        progress(
                            f"stages {num_stages}, mesh {'x'.join(map(str, mesh.shape))}, "
                            f"{count} micro-batches, recompute {mode}"
                        )
                    if mesh not in pricers:
                        pricers[mesh] = BoxingPricer(prices, mesh)
                    priced = priced or price_graph(
                        graph, mesh, prices, space.allow, pricers[mesh], tied.representative
                    )
                    node_times = {r: _unhidden_s(priced.strategies[r]) for _, r in copies}
                    if step_bound(graph, copies, num_stages, node_times, count, mode) >= cutoff:
                        cut = True
                        continue  # its cheapest signatures, without boxing, are too slow
                    mp = build_problem(
                        graph, mesh, prices, optimizer=optimizer,
                        memory_limit_bytes=memory_limit_bytes, allow=space.allow,
                        micro_batches=count, split=split, recompute=mode, stage_link=across,
                        priced=priced, tied=tied,
                    )  # fmt: skip
                    tried.append(mp)
                    bound = lower_bound_of(mp, time_limit_s, cutoff)
                    if bound is not None:
                        candidates.append((bound, len(candidates), mp))
            # Most promising first (least LP bound): its plan then cuts the others unsolved.
            for bound, _, mp in sorted(candidates, key=lambda c: c[:2]):
                cutoff = best.prediction.step_time_s if best is not None else math.inf
                solution = solve_mesh(mp, time_limit_s, cutoff) if bound < cutoff else None
                if solution is None:
                    cut = cut or math.isfinite(cutoff)
                    continue
                fits_plainly |= mp.recompute == "none"
                found = Found(mp, solution, predict(mp, solution), graph)
                if best_here is None or _faster(found, best_here):
                    best_here = found
                if best is None or _faster(found, best):
                    best = found
            if num_stages == 1 and (fits_plainly or (cut and best_here is None)):
                break  # more micro-batches only add per-micro-batch overheads
            if best_here is None and not cut:
                continue  # nothing fits yet: more micro-batches keep less in flight
            time_here = best_here.prediction.step_time_s if best_here else math.inf
            if num_stages > 1 and previous is not None and time_here >= previous:
                break  # not faster than with fewer micro-batches (or, twice, all cut off)
            previous = time_here if previous is None else min(previous, time_here)
        idle = idle + 1 if best is not None and best is best_before else 0
    if best is None and not tried and not refused:
        raise PlanError(
            f"the strategy needs a mesh that {devices} devices cannot form; check that its "
            f"degrees multiply to {devices}."
        )
    if best is None:
        raise NoFitError(_no_fit_message(tried, memory_limit_bytes, refused))
    return best


def compute_floors(
    graph: OpGraph, prices: Prices, devices: int, only: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Per compute node (of `only`, where given), the least forward + backward time any
    signature on `devices` devices can take (one value: its flops and bytes spread evenly; a
    signature's local share is never smaller, and the roofline only grows with flops and
    bytes)."""
    floors: dict[str, np.ndarray] = {}
    for name, attrs in graph.nodes(Role.COMPUTE):
        if (attrs["flops"] or attrs["bytes"]) and (only is None or name in only):
            dtype = attrs["outputs"][0].dtype if attrs["outputs"] else torch.float32
            moved = 0.0 if returns_view(attrs["target"]) else attrs["bytes"] / devices
            special = attrs["transcendentals"] / devices
            forward = prices.op_time_s(attrs["flops"] / devices, moved, dtype, special)
            floors[name] = np.array([forward * (1.0 + BACKWARD_FACTOR)])
    return floors


def step_bound(
    graph: OpGraph,
    copies: Counter[tuple[int, str]],
    num_stages: int,
    times: Mapping[str, np.ndarray],
    micro_batches: int,
    recompute: str,
) -> float:
    """A step time no plan with these stages, micro-batch count and recomputation can beat,
    from per-node times alone (`times` per representative node: per candidate, or one floor;
    compute nodes per micro-batch, parameters per step), each node at its cheapest, no boxing
    and no transfers. Stage s works its micro-batches after every earlier stage's first
    forward and before every earlier stage's last backward, and updates after its last
    backward (parameters' `times` may leave out the sync, which backward may hide)."""
    busy = [0.0] * num_stages
    first = [0.0] * num_stages  # forward of one micro-batch
    update = [0.0] * num_stages
    for (s, name), n in copies.items():
        values = times.get(name)
        if values is None or not len(values):
            continue
        attrs, least = graph.graph.nodes[name], n * float(np.min(values))
        if attrs["role"] is Role.PARAMETER:
            update[s] += least
        elif attrs["role"] is Role.COMPUTE:
            forward = least / (1.0 + BACKWARD_FACTOR)
            busy[s] += least + (forward if recomputed(attrs, recompute) else 0.0)
            first[s] += forward
    return max(
        micro_batches * busy[s] + max(sum(busy[:s]), sum(first[:s]) + update[s])
        for s in range(num_stages)
    )


def _unhidden_s(found: NodeStrategies) -> np.ndarray:
    """A node's time no overlap hides: a parameter's optimizer update (its sync may hide behind
    backward), a compute node's forward and backward."""
    return found.compute_s - found.sync_s if found.sync_s is not None else found.compute_s


def _faster(a: Found, b: Found) -> bool:
    return a.prediction.step_time_s < b.prediction.step_time_s * (1 - 1e-12)


def powers_of_two_dividing(batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... while they divide `batch`."""
    counts, count = [], 1
    while count <= batch and batch % count == 0:
        counts.append(count)
        count *= 2
    return tuple(counts)


def _no_fit_message(
    tried: Sequence[MeshProblem], limit: float | None, refused: Sequence[str]
) -> str:
    """Why nothing fits: the least memory any plan could need, and what takes it."""
    floors = []
    for mp in tried:
        for mem in mp.problem.memory:
            per_node = {v: float(np.min(b)) for v, b in mem.bytes_per_candidate.items() if len(b)}
            floors.append((sum(per_node.values()), mp, per_node, mem.name))
    if not tried and refused:
        return "; ".join(refused)
    stuck = _without_candidates(tried)
    if limit is None or not floors or (stuck and min(f[0] for f in floors) <= limit):
        return (
            "no plan exists for this model on these devices: "
            + (f"{stuck} can take no signature on the meshes tried" if stuck else "no signature")
            + " (a batch, or another dim, that the devices do not divide evenly?). Use a batch "
            "the data-parallel degree divides, other degrees, or another device count."
        )
    # Per problem its tightest stage; over problems the least of those.
    tightest: dict[int, tuple] = {}
    for floor in floors:
        key = id(floor[1])
        if key not in tightest or floor[0] > tightest[key][0]:
            tightest[key] = floor
    need, mesh_problem, per_node, stage = min(tightest.values(), key=lambda f: f[0])
    graph_nodes = mesh_problem.representative
    top = sorted(per_node.items(), key=lambda kv: -kv[1])[:5]
    tied = Counter(graph_nodes.values())
    consumers = ", ".join(
        f"{_label(mesh_problem.graph, v)}"
        f"{f' (and {tied[v] - 1} tied copies)' if tied[v] > 1 else ''} {format_bytes(b)}"
        for v, b in top
        if b > 0
    )
    return (
        f"no plan fits in {format_bytes(limit)} per device: even the most sharded plan (mesh "
        f"{'x'.join(map(str, mesh_problem.mesh.shape))}, {mesh_problem.split.num_stages} "
        f"stage(s), {mesh_problem.micro_batches} micro-batch(es), recompute "
        f"{mesh_problem.recompute}) needs at least {format_bytes(need)} per device ({stage}). The "
        f"biggest consumers there: {consumers}. Raise --memory-gib, use more devices, a smaller "
        "batch, or an optimizer with fewer states (sgd)."
    )


def _without_candidates(tried: Sequence[MeshProblem]) -> str:
    """The nodes (with their shapes) that had no candidate in some tried problem."""
    named: dict[str, str] = {}
    for mp in tried:
        for name, found in mp.strategies.items():
            if not found.candidates and mp.graph is not None and len(named) < 3:
                shape = mp.graph.graph.nodes[name]["outputs"][0].shape
                named[_label(mp.graph, name)] = "x".join(map(str, shape))
    return ", ".join(f"{label} (shape {shape})" for label, shape in named.items())


def _label(graph: OpGraph | None, node: str) -> str:
    if graph is None:
        return node
    attrs = graph.graph.nodes[node]
    return attrs.get("name") or attrs.get("module_path") or node
