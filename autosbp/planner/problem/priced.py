"""The prices of a graph on a stage mesh that every configuration of that mesh shares: the
candidates of each node (`price_graph`, restricted by a hand plan's `Allow`), and, on first use,
the boxing matrices of each edge twin and what backward keeps (`Priced`).

Lives here: `Priced`, `EdgeKept`, `price_graph`, the candidates a hand plan allows, and
`MeshPrices` (what a search shares of them across its configurations). Lives elsewhere: the
problem of one configuration built from these prices (`problem.build`), the prices themselves
(`timing`, `memory`; what backward keeps: `memory.kept`), tied blocks (`space.ties`), the
per-stage sums (`problem.stage_terms`).

Invariants: every entry is a function of (graph, mesh, representative) and its key alone
(twin edges, one representative node, one recomputation mode), so one `Priced` serves every
stage count, micro-batch count and recomputation of its mesh; a tied node shares its
representative's `NodeStrategies`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import numpy as np

from autosbp.capturing.graph import OpGraph, OpNode, Role
from autosbp.overlap import regathers_beside_input_gradient
from autosbp.planner.memory.device_bytes import candidate_bytes, pair_bytes, wire_pair_bytes
from autosbp.planner.memory.kept import Kept, kept_for_backward
from autosbp.planner.space.recomputation import recomputed
from autosbp.planner.space.sequence_parallel import data_nodes, split_candidates
from autosbp.planner.space.strategy import Allow
from autosbp.planner.space.ties import tie_blocks, twin_key
from autosbp.planner.timing.candidates import (
    BoxingPricer,
    NodeStrategies,
    Prices,
    edge_matrices,
    edge_matrix,
    node_strategies,
    sync_bucket_bytes,
    without_dominated_kernels,
)
from autosbp.planner.timing.recipe import PLAIN, Recipe
from autosbp.planner.timing.regather import regather_terms
from autosbp.sbp import Broadcast, Mesh


@dataclass(frozen=True)
class EdgeKept:
    """What an edge's kept uses (`memory.kept.Kept`) cost per pair of its endpoints' candidates, per
    micro-batch: the bytes they keep until backward (`memory.device_bytes.pair_bytes`), the forward
    conversion of them (what a re-gather repeats), the copies a recomputed consumer keeps
    while its block recomputes, and what a consumer that re-gathers them keeps and runs again."""

    bytes: np.ndarray
    forward_s: np.ndarray
    recomputed_bytes: np.ndarray
    # where the consumer has twins that re-gather an input this edge carries
    # (`timing.regather.regather_terms`): what each pair adds to the time (the conversion run
    # again, inf where a twin may not take the pair) and keeps in place of `bytes` (None: no
    # such twin, or the producer is a parameter, which re-gathers itself)
    twin_s: np.ndarray | None = None
    twin_bytes: np.ndarray | None = None


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
    # may a parameter reach a consumer through a collective (a gather)? Where not (a Megatron
    # layout, or beside a schedule the runtime runs no gathers with:
    # `boxing.params.gathers_run_beside`), such pairs of a parameter's edges are forbidden
    gathers: bool = True
    # Megatron's sequence parallelism (`space.strategy.Space.sequence_parallel`) on the mesh's
    # last dim: an activation all-reduced there is forbidden, and a kept copy a twin could
    # re-gather must be re-gathered (`timing.regather.regather_terms`)
    sequence_parallel: bool = False
    # what the step runs around each parameter (`timing.recipe`): the dtype a gathered
    # weight's gradient is reduce-scattered in (`wire_bytes`)
    recipe: Recipe = PLAIN

    matrices: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False
    )  # per edge twin (`space.ties.twin_key`), filled on first use
    saved: dict[tuple, np.ndarray] = field(
        default_factory=dict, repr=False, compare=False
    )  # per (representative, optimizer, recomputation), filled on first use
    edges_kept: dict[tuple, EdgeKept] = field(default_factory=dict, repr=False, compare=False)
    wires: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    identical: list[bool] = field(default_factory=list, repr=False, compare=False)  # once

    def blocks_identical(self) -> bool:
        """Are the graph's repeated blocks all alike (`space.ties.tie_blocks` ties them)?"""
        if not self.identical:
            tied = self.representative
            if all(r == n for n, r in tied.items()):  # untied by request, or not alike
                tied = tie_blocks(self.graph)
            self.identical.append(any(r != n for n, r in tied.items()))
        return self.identical[0]

    def kept(self, recompute: str) -> Kept:
        """What backward keeps under `recompute` (`memory.kept.kept_for_backward`), once per
        graph."""
        if recompute not in self.kept_memo:
            self.kept_memo[recompute] = kept_for_backward(
                self.graph, self.representative, recompute
            )
        return self.kept_memo[recompute]

    def kept_bytes(
        self, name: str, optimizer: str, recompute: str, readers: str | None = None
    ) -> np.ndarray:
        """Per candidate, the bytes node `name` (a representative) keeps on a device with one
        micro-batch in flight: model states, or what its backward keeps (`memory.kept`). Its
        outputs as `readers` keep them where its consumers run under another mode (a block's
        output read by the next block, `space.ties.tie_modes`): their saves or their run's
        checkpoint decide what stays of it."""
        key = (name, optimizer, recompute, readers or recompute)
        if key not in self.saved:
            kept = self.kept(recompute)
            again = recomputed(self.graph, name, recompute)  # extras held while it reruns
            extra = 0 if again else kept.extra_bytes.get(name, 0)
            outputs = self.kept(readers or recompute).outputs_of(name)
            self.saved[key] = self._bytes(name, optimizer, outputs, extra, not again)
        return self.saved[key]

    def rematerialized_bytes(self, name: str, recompute: str) -> np.ndarray:
        """Per candidate, what a recomputed node holds while its run recomputes."""
        key = (name, "", recompute)
        if key not in self.saved:
            kept = self.kept(recompute)
            outputs = kept.rematerialized.get(name, frozenset())
            extra = kept.extra_bytes.get(name, 0)
            self.saved[key] = self._bytes(name, "", outputs, extra, held=True)
        return self.saved[key]

    def _bytes(
        self, name: str, optimizer: str, outputs: frozenset[int], extra: int, held: bool
    ) -> np.ndarray:
        """Per candidate: `candidate_bytes`, plus what its exchanges hold (`timing.op_exchanges`)
        if `held`."""
        attrs, found = self.graph.node(name), self.strategies[name]
        exchanged = found.held_bytes if held and found.held_bytes is not None else 0.0
        return exchanged + np.array(
            [
                candidate_bytes(
                    attrs,
                    sig,
                    self.mesh.shape,
                    optimizer=optimizer,
                    outputs=outputs,
                    extra_bytes=extra,
                    state=found.state_of(i),
                    gradient=found.gradient_of(i),
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
            activation = self.graph.node(u).role is not Role.PARAMETER
            scattered_on = (
                len(self.mesh.shape) - 1 if self.sequence_parallel and activation else None
            )
            found = edge_matrices(
                su, sv, uses, metas, self.pricer, self.gathers or activation, scattered_on
            )
            self.matrices[key] = found
        return found

    def wire_bytes(self, u: str, v: str, less_gradient: bool) -> np.ndarray:
        """Per pair of parameter edge (u, v), the gathered gradient its reduce-scatter holds
        (`memory.device_bytes.wire_pair_bytes`); once for its twins."""
        key = (twin_key(self.graph, self.representative, u, v), less_gradient)
        found = self.wires.get(key)
        if found is None:
            uses, metas = key[0][2], key[0][3]
            su, sv = self.strategies[u], self.strategies[v]
            found = wire_pair_bytes(
                [sig.outputs for sig in su.candidates], [sig.inputs for sig in sv.candidates],
                uses, metas, [self.recipe.wire(m).dtype for m in metas], self.mesh.shape,
                less_gradient=less_gradient,
            )  # fmt: skip
            self.wires[key] = found
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
            twins = sv.regather_input
            if twins is not None and self.graph.node(u).role is not Role.PARAMETER:
                op = self.graph.node(v).op

                def beside_s(index: int) -> np.ndarray | None:  # its input-gradient matmul
                    overlaps = regathers_beside_input_gradient(op, index)
                    return sv.forward_s if overlaps else None

                terms = regather_terms(
                    su.candidates, sv.candidates, twins, frozenset(i for _, i in twin[2]), uses,
                    [outputs[use.out_idx] for use in uses], found.bytes, self.pricer,
                    recomputed(self.graph, v, recompute), self.sequence_parallel, beside_s,
                )  # fmt: skip
                if terms is not None:
                    found = replace(found, twin_s=terms[0], twin_bytes=terms[1])
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
    zero: int | None = 0,
    gathers: bool = True,
    recipe: Recipe = PLAIN,
    regathers: bool = True,
    sequence_parallel: bool = False,
    tp_overlap: int | None = None,
) -> Priced:
    """Candidates of every representative node (`space.ties.tie_blocks`, or `representative` where
    given); edges on first use. `pricer`: a boxing pricer of `mesh` to reuse (its chains serve
    every micro-batch size); `memo`: parameters' candidates to reuse across graphs (a
    parameter's depend only on its tensor, the mesh, the sync bucket and whether a consumer
    keeps it, `_parameter_key`); `kept_memo`: what backward keeps, shared by every mesh of
    `graph` (with the same `representative`); `zero`: parameters' optimizer states split where
    they can be (1: ZeRO-1; 2: ZeRO-2, gradients too), never (0, the default), or the ILP's
    choice per parameter (None); `gathers`: may a parameter be gathered (`Priced.gathers`);
    `recipe`: what the step runs around each parameter (`timing.recipe`); `regathers`: may an
    op re-gather its kept activations in backward (`timing.regather`; not beside zero bubble,
    whose weight-gradient pass would gather them again); `sequence_parallel`: Megatron's
    (`Priced.sequence_parallel`); `tp_overlap`: the chunks of the overlapped twins
    (`space.strategy.Space.tp_overlap`: None the search's choice, K >= 2 forced, 0 none)."""
    pricer = pricer or BoxingPricer(prices, mesh)
    rep = representative or tie_blocks(graph)
    kept_memo = {} if kept_memo is None else kept_memo
    if (
        "none" not in kept_memo
    ):  # which parameters some consumer keeps (`timing.candidates.node_strategies`)
        kept_memo["none"] = kept_for_backward(graph, rep, "none")
    regatherable = kept_memo["none"].regatherable
    regather_inputs = kept_memo["none"].regather_inputs
    bucket_bytes = sync_bucket_bytes(graph)
    data = data_nodes(graph) if sequence_parallel else frozenset()
    strategies: dict[str, NodeStrategies] = {}
    for name in dict.fromkeys(rep.values()):
        attrs = graph.node(name)
        again = name in regatherable
        key = _parameter_key(attrs, mesh, bucket_bytes, again) if memo is not None else None
        found = memo.get(key) if memo is not None and key is not None else None
        if found is None:
            share = kept_memo["none"].backward_share.get(name, 1.0)
            inputs = regather_inputs.get(name, frozenset()) if regathers else frozenset()
            found = node_strategies(
                graph, name, pricer, bucket_bytes, again, share, allow, recipe, inputs, tp_overlap
            )
            if memo is not None and key is not None:
                memo[key] = found
        allowed = _restricted(replace(found, name=name), graph, name, allow, zero)
        if sequence_parallel:  # no replicated compute on tp between its regions
            keep = split_candidates(graph, name, allowed.candidates, data)
            allowed = allowed if len(keep) == len(allowed.candidates) else allowed.restricted(keep)
        if tp_overlap:  # a hand plan's overlap: each candidate that has a twin runs as it
            allowed = _overlapped_only(allowed)
        strategies[name] = without_dominated_kernels(allowed)
    for name in graph.order:  # a tied node is its representative's twin (same op, args, tensors)
        strategies[name] = strategies[rep[name]]
    return Priced(
        mesh, rep, strategies, graph, pricer, kept_memo, gathers=gathers,
        sequence_parallel=sequence_parallel, recipe=recipe,
    )  # fmt: skip


def _overlapped_only(found: NodeStrategies) -> NodeStrategies:
    """`found` without the in-line copy of each candidate that has an overlapped twin
    (`timing.tp_overlap`): the twin forced where it applies."""
    twinned = {found.candidates[i] for i in range(len(found.candidates)) if found.chunks_of(i)}
    keep = [
        i
        for i, sig in enumerate(found.candidates)
        if found.chunks_of(i) or sig not in twinned or found.regathers(i)
    ]
    return found if len(keep) == len(found.candidates) else found.restricted(keep)


def _zero_stage(found: NodeStrategies, i: int) -> int:
    """The ZeRO stage of candidate `i`: 2 (states and gradient split), 1 (states), 0."""
    if found.gradient_of(i) is not None:
        return 2
    return 1 if found.state_of(i) is not None else 0


def _parameter_key(
    attrs: OpNode, mesh: Mesh, bucket_bytes: int, regatherable: bool
) -> Hashable | None:
    """What a parameter's candidates and prices (`timing.candidates.node_strategies`) read, or None
    for other nodes (their candidates read their inputs and the graph around them)."""
    if attrs.role is not Role.PARAMETER:
        return None
    metas = (tuple(attrs.inputs), tuple(attrs.outputs))
    return (mesh, bucket_bytes, attrs.op, *metas, regatherable)


def _restricted(
    found: NodeStrategies, graph: OpGraph, name: str, allow: Allow | None, zero: int | None
) -> NodeStrategies:
    """The candidates a hand plan allows node `name`. A parameter the plan would split but
    whose dims the mesh does not divide (a (1,)-shaped bias) stays replicated rather than
    making the plan impossible. `zero` (`price_graph`): of a layout that has ZeRO twins, 1 keeps
    its ZeRO-1 twin only, 2 its ZeRO-2 twin, 0 its own."""
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
            if (found.candidates[i], found.regathers(i)) not in sharded
            or _zero_stage(found, i) == zero
        ]
    return found if keep == list(range(len(found.candidates))) else found.restricted(keep)


@dataclass
class MeshPrices:
    """The prices a search shares across its configurations: one `Priced` per (micro-batch
    count, stage mesh), shared by every stage count and recomputation mode; the parameters'
    candidates, shared by every count and mesh (`price_graph`'s memo); one boxing pricer per
    stage mesh, shared by every count (its chains serve every micro-batch size): `pricers`,
    which depend on the prices and mesh alone, may be given to share them wider (every search
    of a plan request: `search.graph_memo.GraphMemo`)."""

    prices: Prices
    allow: Allow | None
    zero: int | None
    gathers: bool
    recipe: Recipe = PLAIN
    regathers: bool = True  # may ops re-gather their kept activations (`price_graph`)
    sequence_parallel: bool = False  # Megatron's (`Priced.sequence_parallel`)
    tp_overlap: int | None = None  # the overlapped twins' chunks (`price_graph`)
    priced: dict[tuple[int, Mesh], Priced] = field(default_factory=dict)
    pricers: dict[Mesh, BoxingPricer] = field(default_factory=dict)
    parameters: dict[Hashable, NodeStrategies] = field(default_factory=dict)

    def of(
        self,
        count: int,
        mesh: Mesh,
        graph: OpGraph,
        representative: dict[str, str],
        kept: Callable[[], dict[str, Kept]],
    ) -> Priced:
        """The prices of `graph` (of `count` micro-batches) on `mesh`; `kept`: what backward
        keeps in it, asked for on first use."""
        key = (count, mesh)
        if key not in self.priced:
            pricer = self.pricers.get(mesh)
            if pricer is None:
                pricer = self.pricers[mesh] = BoxingPricer(self.prices, mesh)
            self.priced[key] = price_graph(
                graph, mesh, self.prices, self.allow, pricer, representative, self.parameters,
                kept(), self.zero, self.gathers, self.recipe, self.regathers,
                self.sequence_parallel, self.tp_overlap,
            )  # fmt: skip
        return self.priced[key]
