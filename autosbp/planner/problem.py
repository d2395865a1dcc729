"""The strategy ILP of one configuration (stage count, stage mesh, micro-batch count,
recomputation), and what its solution predicts.

Lives here: the prices of a graph on a stage mesh that every configuration shares (`Priced`,
`price_graph`), the Problem of one configuration (`build_problem`: objective and memory, see its
docstring), its bound and its solve (`lower_bound_of`, `solve_mesh`), and the prediction of a
solved configuration by the actor simulation (`predict`). Lives elsewhere: the per-stage sums
(`stage_terms`), the objective made of them, a lower bound of `predict` (`objective`), prices
(`candidates`, `memory`, what backward keeps: `kept`), stages and recomputation (`pipeline`), tied
blocks (`reduce`), the solver (`ilp`), the search over configurations (`search`), hand-plan
restrictions (`hand_plans`).

Each configuration is solved exactly (to MIP_GAP). Within a stage, the objective has one
overlap: the gradient sync runs while the last micro-batch's backward does
(`schedule.hidden_sync_s`); every op's forward and backward, every boxing and the optimizer
update run one after another on each device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import numpy as np

from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.errors import NoFitError
from autosbp.planner.candidates import (
    BoxingPricer,
    NodeStrategies,
    Prices,
    edge_matrix,
    node_strategies,
    sync_bucket_bytes,
)
from autosbp.planner.ilp import bound_or_solve, solve_below
from autosbp.planner.ilp_problem import Problem, Solution
from autosbp.planner.kept import Kept, kept_for_backward
from autosbp.planner.memory import candidate_bytes, pair_bytes
from autosbp.planner.objective import StageCosts, objective_terms
from autosbp.planner.pipeline import StageSplit, recomputed, split_stages
from autosbp.planner.reduce import TiedStages, tie_blocks, tie_graph, tie_stages, twin_key
from autosbp.planner.stage_terms import P2P, StageTerms
from autosbp.rules import NdSignature
from autosbp.sbp import Broadcast, Mesh
from autosbp.schedule import hidden_gather_s, hidden_sync_s, simulate

Allow = Callable[[OpGraph, str, NdSignature], bool]  # may node `name` take this candidate?


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
class EdgeKept:
    """What an edge's kept uses (`kept.Kept`) cost per pair of its endpoints' candidates, per
    micro-batch: the bytes they keep until backward (`memory.pair_bytes`), the forward
    conversion of them (what a re-gather repeats) and the copies a recomputed consumer keeps
    while its block recomputes."""

    bytes: np.ndarray
    forward_s: np.ndarray
    recomputed_bytes: np.ndarray


@dataclass(frozen=True)
class Priced:
    """Prices of a graph on a stage mesh that do not depend on stages, micro-batches or
    recomputation: candidates, and (computed on first use: most configurations of a search are
    ruled out by their node prices alone) the edges' boxing matrices and what backward keeps
    (`kept_memo`, per recomputation mode: shared by every mesh of the graph)."""

    mesh: Mesh
    representative: dict[str, str]
    strategies: dict[str, NodeStrategies]
    graph: OpGraph
    pricer: BoxingPricer
    kept_memo: dict[str, Kept] = field(default_factory=dict, repr=False, compare=False)

    matrices: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False
    )  # per edge twin (`reduce.twin_key`), filled on first use
    saved: dict[tuple, np.ndarray] = field(
        default_factory=dict, repr=False, compare=False
    )  # per (representative, optimizer, recomputation), filled on first use
    edges_kept: dict[tuple, EdgeKept] = field(default_factory=dict, repr=False, compare=False)
    identical: list[bool] = field(default_factory=list, repr=False, compare=False)  # once

    def blocks_identical(self) -> bool:
        """Are the graph's repeated blocks all alike (`reduce.tie_blocks` ties them)?"""
        if not self.identical:
            tied = self.representative
            if all(r == n for n, r in tied.items()):  # untied by request, or not alike
                tied = tie_blocks(self.graph)
            self.identical.append(any(r != n for n, r in tied.items()))
        return self.identical[0]

    def kept(self, recompute: str) -> Kept:
        """What backward keeps under `recompute` (`kept.kept_for_backward`), once per graph."""
        if recompute not in self.kept_memo:
            self.kept_memo[recompute] = kept_for_backward(
                self.graph, self.representative, recompute
            )
        return self.kept_memo[recompute]

    def kept_bytes(self, name: str, optimizer: str, recompute: str) -> np.ndarray:
        """Per candidate, the bytes node `name` (a representative) keeps on a device with one
        micro-batch in flight: model states, or what its backward keeps (`kept`)."""
        key = (name, optimizer, recompute)
        if key not in self.saved:
            kept = self.kept(recompute)
            extra = 0 if recomputed(self.graph, name, recompute) else kept.extra_bytes.get(name, 0)
            self.saved[key] = self._bytes(name, optimizer, kept.outputs_of(name), extra)
        return self.saved[key]

    def rematerialized_bytes(self, name: str, recompute: str) -> np.ndarray:
        """Per candidate, what a recomputed node holds while its run recomputes."""
        key = (name, "", recompute)
        if key not in self.saved:
            kept = self.kept(recompute)
            outputs = kept.rematerialized.get(name, frozenset())
            extra = kept.extra_bytes.get(name, 0)
            self.saved[key] = self._bytes(name, "", outputs, extra)
        return self.saved[key]

    def _bytes(self, name: str, optimizer: str, outputs: frozenset[int], extra: int) -> np.ndarray:
        attrs, found = self.graph.node(name), self.strategies[name]
        return np.array(
            [
                candidate_bytes(
                    attrs,
                    sig,
                    self.mesh.shape,
                    optimizer=optimizer,
                    outputs=outputs,
                    extra_bytes=extra,
                    state=found.state_of(i),
                )
                for i, sig in enumerate(found.candidates)
            ]
        )

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

    def edge_kept(self, u: str, v: str, recompute: str) -> EdgeKept:
        """What the kept uses of edge (u, v) cost per pair (`EdgeKept`); once for its twins."""
        twin = twin_key(self.graph, self.representative, u, v)
        found = self.edges_kept.get((twin, recompute))
        if found is None:
            kept, outputs = self.kept(recompute), self.graph.node(u).outputs
            su, sv = self.strategies[u], self.strategies[v]
            layouts = (
                [sig.outputs for sig in su.candidates],
                [sig.inputs for sig in sv.candidates],
            )
            shape = (len(su.candidates), len(sv.candidates))

            def held(uses) -> np.ndarray:
                metas = [outputs[use.out_idx] for use in uses]
                return pair_bytes(*layouts, uses, metas, self.mesh.shape)

            uses = kept.uses.get(twin, ())
            forward = np.zeros(shape)
            if uses:
                pairs = [(use.out_idx, use.in_idx) for use in uses]
                metas = [outputs[use.out_idx] for use in uses]
                forward = edge_matrix(su, sv, pairs, metas, self.pricer, forward_only=True)
            found = EdgeKept(held(uses), forward, held(kept.recomputed_uses.get(twin, ())))
            self.edges_kept[(twin, recompute)] = found
        return found


def price_graph(
    graph: OpGraph,
    mesh: Mesh,
    prices: Prices,
    allow: Allow | None = None,
    pricer: BoxingPricer | None = None,
    representative: dict[str, str] | None = None,
    memo: dict[Hashable, NodeStrategies] | None = None,
    kept_memo: dict[str, Kept] | None = None,
    zero: bool | None = False,
) -> Priced:
    """Candidates of every representative node (`reduce.tie_blocks`, or `representative` where
    given); edges on first use. `pricer`: a boxing pricer of `mesh` to reuse (its chains serve
    every micro-batch size); `memo`: parameters' candidates to reuse across graphs (a
    parameter's depend only on its tensor, the mesh, the sync bucket and whether a consumer
    keeps it, `_parameter_key`); `kept_memo`: what backward keeps, shared by every mesh of
    `graph` (with the same `representative`); `zero`: parameters' optimizer states split where
    they can be (True: ZeRO-1), never (False, the default), or the ILP's choice per parameter
    (None)."""
    pricer = pricer or BoxingPricer(prices, mesh)
    rep = representative or tie_blocks(graph)
    kept_memo = {} if kept_memo is None else kept_memo
    if (
        "none" not in kept_memo
    ):  # which parameters some consumer keeps (`candidates.node_strategies`)
        kept_memo["none"] = kept_for_backward(graph, rep, "none")
    regatherable = kept_memo["none"].regatherable
    bucket_bytes = sync_bucket_bytes(graph)
    strategies: dict[str, NodeStrategies] = {}
    for name in dict.fromkeys(rep.values()):
        attrs = graph.node(name)
        again = name in regatherable
        key = _parameter_key(attrs, mesh, bucket_bytes, again) if memo is not None else None
        found = memo.get(key) if memo is not None and key is not None else None
        if found is None:
            found = node_strategies(graph, name, pricer, bucket_bytes, again)
            if memo is not None and key is not None:
                memo[key] = found
        strategies[name] = _restricted(replace(found, name=name), graph, name, allow, zero)
    for name in graph.order:  # a tied node is its representative's twin (same op, args, tensors)
        strategies[name] = strategies[rep[name]]
    return Priced(mesh, rep, strategies, graph, pricer, kept_memo)


def _parameter_key(
    attrs: OpNode, mesh: Mesh, bucket_bytes: int, regatherable: bool
) -> Hashable | None:
    """What a parameter's candidates and prices (`candidates.node_strategies`) read, or None for
    other nodes (their candidates read their inputs and the graph around them)."""
    if attrs.role is not Role.PARAMETER:
        return None
    metas = (tuple(attrs.inputs), tuple(attrs.outputs))
    return (mesh, bucket_bytes, attrs.op, *metas, regatherable)


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
    stage last; with one stage, micro_batches x the stage time plus its update. Within a
    stage, ops and activations' boxing run one after another; parameters' conversions overlap
    the compute of identical blocks (`schedule.hidden_gather_s`) and the gradient sync the
    last backward (`schedule.hidden_sync_s`). Memory: one constraint per stage, what backward
    keeps x the micro-batches in flight there (`stage_terms`), on node candidates and on edge
    pairs (the converted copies kept, unless a parameter re-gathers them).
    """
    split = split or split_stages(graph, 1)
    priced = priced or price_graph(graph, mesh, prices, allow)
    tied = tied or tie_stages(tie_graph(graph, priced.representative), split)
    blocks = tuple(len(b) for b in split.blocks)
    terms = StageTerms(blocks, priced.blocks_identical())
    terms.add_nodes(tied, priced, optimizer, micro_batches, recompute)
    keys = list(dict.fromkeys(priced.representative.values()))
    sizes = {r: len(priced.strategies[r].candidates) for r in keys}
    # Where the nodes alone overflow a stage (each at its fewest bytes), no choice fits: the
    # edges are not priced (most configurations of a deep model end here; `lower_bound_of`
    # then says nothing fits, and the no-fit message reads the node bytes).
    overflows = memory_limit_bytes is not None and terms.least_bytes(sizes) > memory_limit_bytes
    if not overflows:
        terms.add_edges(tied, priced, recompute, P2P(prices, mesh, stage_link))
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


def _restricted(
    found: NodeStrategies, graph: OpGraph, name: str, allow: Allow | None, zero: bool | None
) -> NodeStrategies:
    """The candidates a hand plan allows node `name`. A parameter the plan would split but
    whose dims the mesh does not divide (a (1,)-shaped bias) stays replicated rather than
    making the plan impossible. `zero` (`price_graph`): True keeps, of a layout that has ZeRO-1
    states, that twin only."""
    keep = [i for i, sig in enumerate(found.candidates) if allow is None or allow(graph, name, sig)]
    if not keep and graph.node(name).role is Role.PARAMETER:
        keep = [
            i
            for i, sig in enumerate(found.candidates)
            if all(isinstance(s, Broadcast) for s in sig.outputs[0])
        ]
    if zero is not None and found.state is not None:
        sharded = {(found.candidates[i], found.regathers(i)) for i in keep if found.state[i]}
        keep = [
            i
            for i in keep
            if (found.state[i] is not None)
            == (zero and (found.candidates[i], found.regathers(i)) in sharded)
        ]
    return found if keep == list(range(len(found.candidates))) else found.restricted(keep)


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
    per-micro-batch forward/backward (what stays exposed of the parameters' conversions
    included, `gather_hidden_s` of them hidden behind the blocks' compute), transfer to the
    next stage and per-step update (seconds), the part of the update's sync that the last
    backward hides, and peak bytes; the step time is when the last stage finishes its update."""

    step_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    update_s: tuple[float, ...]
    sync_hidden_s: tuple[float, ...]  # of update_s, what the last backward hides
    peak_bytes: tuple[float, ...]
    bubble_s: tuple[float, ...]
    gather_hidden_s: tuple[float, ...] = ()  # per micro-batch, forward + backward


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
    forward_hidden, backward_hidden = gathers_hidden(costs, choice)
    exposed_fwd = tuple(f - h for f, h in zip(fwd, forward_hidden, strict=True))
    exposed_bwd = tuple(b - h for b, h in zip(bwd, backward_hidden, strict=True))
    timeline = simulate(
        mp.split.num_stages, mp.micro_batches, exposed_fwd.__getitem__,
        exposed_bwd.__getitem__, send.__getitem__,
    )  # fmt: skip
    ends = [
        max(f.end_s for f in timeline.firings if f.stage == s) + update[s] - hidden[s]
        for s in range(mp.split.num_stages)
    ]
    peaks = tuple(mem.used_bytes(choice) for mem in costs.memory)
    bubbles = tuple(timeline.bubble_s(s) for s in range(mp.split.num_stages))
    gathers = tuple(f + b for f, b in zip(forward_hidden, backward_hidden, strict=True))
    return Prediction(
        max(ends), exposed_fwd, exposed_bwd, send, update, hidden, peaks, bubbles, gathers
    )


def gathers_hidden(costs: StageCosts, choice: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage and micro-batch, the parameter communication the blocks' compute hides in
    forward and in backward (`schedule.hidden_gather_s`; 0 where the stage has no slots)."""
    stages = range(len(costs.busy))
    if not costs.slots:
        return (0.0,) * len(stages), (0.0,) * len(stages)

    def hidden(comm: tuple, compute: tuple) -> tuple[float, ...]:
        return tuple(
            hidden_gather_s(
                comm[s].value(choice), compute[s].value(choice), costs.slots[s], costs.overlap
            )
            for s in stages
        )

    return (
        hidden(costs.gather_forward, costs.compute_forward),
        hidden(costs.gather_backward, costs.compute_backward),
    )
