"""Bound (1b): the path bounds of `bounds.nodes` with each stage's boxing in them, every stage at
the least that its nodes and a spanning forest of its edges can cost together.

Lives here: `forest_min` (the least, over every choice of candidates, of a sum of node costs
and of the costs of a spanning forest's edges: exact on the forest, by dynamic programming)
and `forest_bound` (a configuration's bound from it). Lives elsewhere: the node bound (1) and
the path bounds (`bounds.nodes`), the search that tries (1b) between (1) and the LP bound (2a)
(`search.best_first`), the prices it sums (`problem.priced.Priced`, as `problem.stage_terms`
sums them).

Invariant: at most the ILP's objective of every choice, so at most the predicted step (why:
docs/planner.md, "Bounds and search"). Cost: per configuration, one pass over the edges of each
distinct stage (stages with the same tied counts share theirs) and a min-plus product per forest
edge for each of its four sums (2-50 ms on GPT-3 175B / 1024 A100s, beside 0.1-1 s for an LP
bound); its edges are priced once per (count, mesh) (`Priced.edge_prices`), as the LP's build
prices them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autosbp.capturing.graph import Role
from autosbp.planner.bounds.nodes import path_bound
from autosbp.planner.problem.priced import Priced
from autosbp.planner.space.recomputation import recomputed
from autosbp.planner.space.ties import ModeTies, TiedStages

__all__ = ["forest_bound", "forest_min"]

Edges = Mapping[tuple[str, str], np.ndarray]


def forest_min(nodes: Mapping[str, np.ndarray], edges: Edges) -> float:
    """The least over every choice x of sum_r nodes[r][x_r] plus, over the edges (u, v) of a
    spanning forest of `edges`, edges[u, v][x_u, x_v] (rows: u's candidates; both ends in
    `nodes`). Exact on the forest (each subtree's least per choice of its root, passed up edge
    by edge); at most the least with every edge, whose costs are >= 0. The forest keeps the
    costliest edges first (by their mean finite cost)."""
    adjacent, left_out = _spanning_forest(nodes, edges)
    costs = {r: np.asarray(values, dtype=float) for r, values in nodes.items()}
    for u, v in left_out:  # what the edge costs whatever the other end: on its ends
        rows = np.min(edges[u, v], axis=1)
        costs[u] = costs[u] + rows
        finite = np.where(np.isinf(rows)[:, None], 0.0, rows[:, None])
        costs[v] = costs[v] + np.min(edges[u, v] - finite, axis=0)
    seen: set[str] = set()
    total = 0.0
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        order: list[tuple[str, str | None, np.ndarray | None]] = [(root, None, None)]
        for r, _, _ in order:  # grows as it goes: every node after its parent
            for child, matrix in adjacent[r]:
                if child not in seen:
                    seen.add(child)
                    order.append((child, r, matrix))
        least = {r: costs[r] for r, _, _ in order}
        for r, parent, matrix in reversed(order):
            if parent is not None:
                least[parent] = least[parent] + np.min(matrix + least[r], axis=1)
        total += float(np.min(least[root]))
    return total


def _spanning_forest(
    nodes: Mapping[str, np.ndarray], edges: Edges
) -> tuple[dict[str, list[tuple[str, np.ndarray]]], list[tuple[str, str]]]:
    """Kruskal's forest of the costliest edges: per node, its neighbours with the matrix whose
    rows are the node's candidates; and the edges left out."""
    root = {r: r for r in nodes}

    def find(r: str) -> str:
        while root[r] != r:
            root[r] = root[root[r]]
            r = root[r]
        return r

    adjacent: dict[str, list[tuple[str, np.ndarray]]] = {r: [] for r in nodes}
    left_out: list[tuple[str, str]] = []
    for (u, v), matrix in sorted(edges.items(), key=lambda item: -_weight(item[1])):
        a, b = find(u), find(v)
        if a != b:
            root[a] = b
            adjacent[u].append((v, matrix))
            adjacent[v].append((u, matrix.T))
        else:
            left_out.append((u, v))
    return adjacent, left_out


def _weight(matrix: np.ndarray) -> float:
    finite = matrix[np.isfinite(matrix)]
    return float(finite.mean()) if finite.size else 0.0


class _Sums:
    """One stage's node and edge costs (per representative and pair of representatives: tied
    copies add up, an edge between two copies of one node lands on its diagonal), as
    `problem.stage_terms.StageTerms` sums them."""

    def __init__(self) -> None:
        self.nodes: dict[str, np.ndarray] = {}
        self.edges: dict[tuple[str, str], np.ndarray] = {}

    def node(self, r: str, values: np.ndarray) -> None:
        self.nodes[r] = self.nodes[r] + values if r in self.nodes else values

    def edge(self, key: tuple[str, str], matrix: np.ndarray) -> None:
        if key[0] == key[1]:
            self.node(key[0], np.diag(matrix))
        else:
            self.edges[key] = self.edges[key] + matrix if key in self.edges else matrix

    def times(self, factor: float) -> _Sums:
        scaled = _Sums()
        scaled.nodes = {r: factor * values for r, values in self.nodes.items()}
        scaled.edges = {key: factor * matrix for key, matrix in self.edges.items()}
        return scaled

    def least(self, priced: Priced) -> float:
        nodes = dict(self.nodes)
        for pair in self.edges:
            for r in pair:
                if r not in nodes:
                    nodes[r] = np.zeros(len(priced.strategies[r].candidates))
        return forest_min(nodes, self.edges)


def forest_bound(
    tied: TiedStages,
    priced: Priced,
    num_stages: int,
    micro_batches: int,
    recompute: str,
    overlap: float,
    *,
    drain: bool = True,
    modes: ModeTies | None = None,
) -> float:
    """Bound (1b) of a configuration (docs/planner.md, "Bounds and search"): the graph cut into
    `num_stages` stages as `tied` counts it, priced on the stage mesh (`problem.priced`), the
    profile's `overlap`; `drain`: False under zero bubble (`bounds.nodes.path_bound`); `modes`:
    under `full:K`, the copies by mode. Stages of equal counts share one computation."""
    items: list[list[tuple]] = [[] for _ in range(num_stages)]
    if modes is None:
        for (r, s, _), n in tied.nodes.items():
            items[s].append(("node", r, n, recompute))
        for ((u, v), s), n in tied.edges.items():
            items[s].append(("edge", u, v, n, recompute))
    else:  # `full:K`: each copy under its block's mode (`space.ties.tie_modes`)
        for (r, s, _, own, _), n in modes.nodes.items():
            items[s].append(("node", r, n, own))
        for ((u, v), s, own), n in modes.edges.items():
            items[s].append(("edge", u, v, n, own))
    known: dict[frozenset, tuple[float, ...]] = {}
    busy, first, steady = [], [], []
    for s in range(num_stages):
        key = frozenset(items[s])
        if key not in known:
            sums = _stage_sums(items[s], priced, overlap, micro_batches)
            known[key] = tuple(part.least(priced) for part in sums)
        busy.append(known[key][0])
        first.append(known[key][1])
        steady.append(max(known[key][2:]))
    return path_bound(busy, first, steady, micro_batches, drain=drain)


def _stage_sums(
    items: list[tuple], priced: Priced, overlap: float, micro_batches: int
) -> tuple[_Sums, _Sums, _Sums, _Sums]:
    """One stage's sums of one micro-batch's busy time and forward, and of its micro-batches with
    its update (docs/planner.md, "Bounds and search": parameters' edges into blocks at 1 - overlap
    of their cost; a recomputed node and its edges pay their forward again; a parameter's update
    less overlap x its sync)."""
    graph, rep = priced.graph, priced.representative
    busy, forward, update, hidden = _Sums(), _Sums(), _Sums(), _Sums()
    for item in items:
        if item[0] == "node":
            _, r, n, recompute = item
            found, role = priced.strategies[r], graph.node(r).role
            if role is Role.COMPUTE:
                fwd = found.forward_part_s()
                again = fwd if recomputed(graph, r, recompute) else 0.0
                busy.node(r, n * (found.compute_s + again))
                forward.node(r, n * fwd)
            elif role is Role.PARAMETER and found.sync_s is not None:
                update.node(r, n * found.compute_s)
                hidden.node(r, n * overlap * found.sync_s)
                busy.node(r, n * found.per_micro_batch_s(micro_batches))
            continue
        _, u, v, n, recompute = item
        both, fwd_only = priced.edge_prices(u, v)
        weight = float(n)
        if graph.node(u).role is Role.PARAMETER and graph.node(rep[v]).block is not None:
            weight *= 1.0 - overlap  # what the blocks' compute may hide of a gather
        again = recomputed(graph, rep[v], recompute)
        key = (rep[u], rep[v])
        busy.edge(key, _scaled(both + fwd_only if again else both, weight))
        forward.edge(key, _scaled(fwd_only, weight))
    by_sync = busy.times(micro_batches)  # the last backward hides at most a x the sync ...
    by_backward = busy.times(micro_batches - overlap)  # ... and at most a x itself
    for r, values in update.nodes.items():
        by_sync.node(r, values - hidden.nodes[r])
        by_backward.node(r, values)
    return busy, forward, by_sync, by_backward


def _scaled(matrix: np.ndarray, weight: float) -> np.ndarray:
    """weight x matrix, a forbidden pair (inf) forbidden still (also at weight 0)."""
    return np.where(np.isinf(matrix), matrix, weight * matrix)
