"""The objective of one configuration's ILP: a lower bound of the step the actor simulation
predicts, for every choice of signatures, and equal to it on the pipelines the planner meets.

Lives here: `StageCosts` (per stage, the ILP-keyed costs its times are made of) and
`objective_terms` (node costs, edge costs and max terms of the ILP built from them): the 1F1B
path bounds P(s, k, j) over pairs of stages (runs of identical stages reduce them), the device
path bounds D(s, d, j) of interleaved 1F1B, zb1's P(k, k) alone, and what the blocks' compute
hides of the parameters' conversions as max terms (`_Hiding`). Lives elsewhere: summing the
graph into stage costs (`problem.stage_terms`), the simulation (`autosbp.schedule`, priced by
`timing.predict`), the cuts that make it exact where a middle stage is slowest
(`problem.simulation_cuts`), the solver (`ilp`).

Invariant: for every choice, the objective is at most `timing.predict.predict` of it (each path
bound is a chain of firings that precede one another in the simulation); the search's bounds
rest on this. The derivation: docs/planner.md, "The step: the objective" and "Schedules".
Reference: Narayanan et al. 2021 section 2.2 (the bubble of 1F1B and of its interleaving).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autosbp.planner.ilp.formulation import Costs, MaxTerm, MemoryConstraint


@dataclass(frozen=True)
class StageCosts:
    """Per pipeline stage, the ILP-keyed costs that make up its times (seconds), for pricing a
    solution: `busy` one micro-batch's forward + backward (+ recomputation), `forward` its
    forward part (both before any overlap), `send` the one-way transfer of its outputs to later
    stages per micro-batch, `update` the per-step gradient sync and optimizer, of which the
    last micro-batch's backward hides part of the sync (`overlap.hidden_sync_s`); its memory
    constraint; its kind, equal for stages whose costs are equal (what they are made of); and
    what the blocks' compute hides of the parameters' conversions (`overlap.hidden_gather_s`)."""

    busy: tuple[Costs, ...]
    forward: tuple[Costs, ...]
    send: tuple[Costs, ...]
    update: tuple[Costs, ...]
    sync: tuple[Costs, ...]  # the gradient-sync part of `update`
    sync_buckets: tuple[int, ...]  # `overlap.sync_buckets` of each stage's parameters
    overlap: float  # the profile's fraction of communication that compute hides
    memory: tuple[MemoryConstraint, ...]
    kinds: tuple[Hashable, ...] = ()  # per stage; () when not known: every stage its own
    # One block's parameter conversions and compute per micro-batch, forward and backward
    # (`overlap.hidden_gather_s`), and per stage its blocks that hide them (() or 0: none).
    gather_forward: tuple[Costs, ...] = ()
    compute_forward: tuple[Costs, ...] = ()
    gather_backward: tuple[Costs, ...] = ()
    compute_backward: tuple[Costs, ...] = ()
    slots: tuple[int, ...] = ()
    update_memory: tuple[MemoryConstraint, ...] = ()  # at the weight gather: no activations
    staging: tuple[Costs, ...] = ()  # per candidate, its share of the weight gather's buffer
    # at a unit's gathered gradients' reduce-scatter (`problem.stage_terms`): no activations;
    # None where the stage's own constraint implies it
    reduce_memory: tuple[MemoryConstraint | None, ...] = ()

    def hides(self, s: int) -> bool:
        """Does stage s hide parameter communication behind its blocks' compute?"""
        return bool(self.slots) and self.slots[s] > 0 and self.overlap > 0


NodeCosts = dict[str, np.ndarray]
EdgeCosts = dict[tuple[str, str], np.ndarray]
Weighted = tuple[float, Costs]  # weight x costs, a term of a sum


def objective_terms(
    costs: StageCosts, keys: Sequence[str], micro_batches: int, virtual_stages: int = 1,
    schedule: str = "1f1b",
) -> tuple[NodeCosts, EdgeCosts, tuple[MaxTerm, ...]]:  # fmt: skip
    """Node costs, edge costs and max terms of the objective (docs/planner.md, "The step: the
    objective"): with one stage m x busy (less what the blocks' compute hides of the parameters'
    conversions) + the update, each hiding a max term of its own; with stages, the largest path
    bound, whose parts hold the stages' hiding terms (nested max terms); interleaved
    (`virtual_stages` v > 1: `costs` holds v x P virtual stages), the device path bounds too; zb1:
    P(k, k) alone."""
    m, busy = micro_batches, costs.busy
    layout = _Layout(costs)
    hiding = _Hiding(costs)
    if len(busy) == 1:
        linear: list[Weighted] = [(float(m), busy[0])]
        terms: list[MaxTerm] = []
        for s, direction in hiding.keys:
            linear += hiding.exposed(float(m), s, direction)
            streams = hiding.parts(s, direction)
            terms.append(MaxTerm(m * costs.slots[s], tuple(layout.sum(p) for p in streams)))
        updates = update_parts(costs, 0)
        if len(updates) > 1:
            terms.append(MaxTerm(1.0, tuple(layout.sum(u) for u in updates)))
        else:
            linear += updates[0]
        base = layout.sum(linear)
        node_costs = {r: base.node_costs[r] + _forbidden(busy[0].node_costs[r]) for r in keys}
        edge_costs = {e: base.edge_costs[e] + _forbidden(c) for e, c in busy[0].edge_costs.items()}
        return node_costs, edge_costs, tuple(terms)
    # Every cost lives in the max term; the linear costs only carry which candidates and pairs
    # are forbidden (an infinite cost), as the stages' costs say.
    node_costs = {r: _forbidden(np.sum([c.node_costs[r] for c in busy], axis=0)) for r in keys}
    edge_costs = {e: _forbidden(matrix) for e, matrix in _sum_edges(busy).items()}
    runs = _runs(costs)
    inner_terms = [
        MaxTerm(0.0, tuple(layout.sum(p) for p in hiding.parts(*key))) for key in hiding.keys
    ]
    parts: list[Costs] = []
    nested: list[Mapping[int, float]] = []
    pairs = [(a, b, runs[a][0]) for a in range(len(runs)) for b in range(a, len(runs))]
    if schedule == "zb1":  # P(k, k): a = b + 1 drains nothing, the update is k's
        pairs = [(b + 1, b, runs[b][-1]) for b in range(len(runs))]
    for a, b, s in pairs:
        path, inner = hiding.expand(_path(costs, runs, a, b, m))
        for update in update_parts(costs, s):
            parts.append(layout.sum(path + update))
            nested.append(inner)
    if virtual_stages > 1:
        for entries, update in _device_paths(costs, virtual_stages, m):
            path, inner = hiding.expand(entries)
            parts.append(layout.sum(path + update))
            nested.append(inner)
    return node_costs, edge_costs, (*inner_terms, MaxTerm(1.0, tuple(parts), tuple(nested)))


Entry = tuple[float, str, int]  # weight x a stage's time ("forward", "busy" or "send")


def _path(costs: StageCosts, runs: list[list[int]], a: int, b: int, m: int) -> list[Entry]:
    """P(s, k) less the update, for s the first stage of run a and k the last of run b >= a:
    the fill to k, its m micro-batches, the drain back to s. Stages of a run are identical, so
    a run's stages add up as its length times one of them."""
    k = runs[b][-1]
    entries: list[Entry] = [(float(m), "busy", k)]
    for c in range(b + 1):
        q = runs[c][0]  # one stage of run c stands for each of its stages before k
        n = float(len(runs[c]) - (1 if c == b else 0))
        if n == 0:
            continue
        entries += [(n, "forward", q), (n, "send", q)]
        if c >= a:  # the backward of micro-batch m - 1 drains from k down to s
            entries += [(n, "busy", q), (-n, "forward", q), (n, "send", q)]
    return entries


def path_terms(
    costs: StageCosts, paths: Sequence[tuple[list[Entry], list[Weighted]]]
) -> tuple[list[Costs], list[Mapping[int, float]]]:
    """Parts (and their hiding terms' coefficients) of the path max term for `paths`, each a
    path's entries and an update part (`problem.simulation_cuts` adds the simulation's own
    paths)."""
    layout, hiding = _Layout(costs), _Hiding(costs)
    parts: list[Costs] = []
    nested: list[Mapping[int, float]] = []
    for entries, update in paths:
        path, inner = hiding.expand(entries)
        parts.append(layout.sum(path + update))
        nested.append(inner)
    return parts, nested


def _device_paths(costs: StageCosts, v: int, m: int) -> list[tuple[list[Entry], list[Weighted]]]:
    """Interleaved, D(s, d) and device s's update parts for each pair s <= d of devices
    (docs/planner.md, "Interleaved 1F1B"), s the first device of a run of identical devices and d
    the last of a run at or after it: within a run, a later d or an earlier s only adds non-negative
    terms."""
    p = len(costs.busy) // v
    chunks = [[c * p + d for c in range(v)] for d in range(p)]
    runs = _runs_by(p, lambda d: tuple(
        (costs.kinds[q] if costs.kinds else q, costs.sync_buckets[q]) for q in chunks[d]
    ))  # fmt: skip
    out = []
    for a in range(len(runs)):
        s = runs[a][0]
        updates = [update_parts(costs, q) for q in chunks[s]]
        device_updates = [
            [w for parts in updates for w in parts[min(j, len(parts) - 1)]]
            for j in range(max(map(len, updates)))
        ]  # each a sum over the chunks of one part of each: at most the device's update
        for b in range(a, len(runs)):
            d = runs[b][-1]
            entries: list[Entry] = [(float(m), "busy", q) for q in chunks[d]]
            entries += [(1.0, name, q) for q in range(d) for name in ("forward", "send")]
            entries += [
                (w, name, q) for q in range(s, d)
                for w, name in ((1.0, "busy"), (-1.0, "forward"), (1.0, "send"))
            ]  # fmt: skip
            out += [(entries, update) for update in device_updates]
    return out


def _runs_by(n: int, kind: Callable[[int], Hashable]) -> list[list[int]]:
    """0..n-1 as runs of consecutive equal `kind`."""
    runs: list[list[int]] = []
    for i in range(n):
        if runs and kind(runs[-1][-1]) == kind(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class _Hiding:
    """What the blocks' compute hides of the parameters' conversions, as ILP terms. Per stage
    and direction, with G one block's conversions, C its compute, n the stage's slots and a the
    overlap, the exposed time is the stage's time less n a min(G, C), and

        a min(G, C) = G + C - T,   T = max(C + (1 - a) G, G + (1 - a) C) >= 0,

    so a stage's exposed forward is forward - n (Gf + Cf) + n Tf (linear, and n >= 0 times a
    max term), its exposed busy time busy - n (Gf + Cf + Gb + Cb) + n Tf + n Tb. The T terms
    come first in the problem's max terms, one per stage that hides and direction (`keys`)."""

    def __init__(self, costs: StageCosts) -> None:
        self.costs = costs
        self.keys = [
            (s, direction)
            for s in range(len(costs.busy))
            if costs.hides(s)
            for direction in ("forward", "backward")
        ]
        self.index = {key: i for i, key in enumerate(self.keys)}

    def parts(self, s: int, direction: str) -> tuple[list[Weighted], list[Weighted]]:
        """The two parts of T on stage s in `direction`."""
        gather, compute = self._pair(s, direction)
        a = self.costs.overlap
        return [(1.0, compute), (1.0 - a, gather)], [(1.0, gather), (1.0 - a, compute)]

    def exposed(self, weight: float, s: int, direction: str) -> list[Weighted]:
        """weight x -n (G + C): the linear part of weight x the exposed time's change."""
        gather, compute = self._pair(s, direction)
        slots = float(self.costs.slots[s])
        return [(-weight * slots, gather), (-weight * slots, compute)]

    def _pair(self, s: int, direction: str) -> tuple[Costs, Costs]:
        c = self.costs
        if direction == "forward":
            return c.gather_forward[s], c.compute_forward[s]
        return c.gather_backward[s], c.compute_backward[s]

    def expand(self, entries: list[Entry]) -> tuple[list[Weighted], dict[int, float]]:
        """A path's entries as weighted costs of the exposed stage times, and the
        coefficients of the hiding terms in it (each >= 0: forward enters a path no more
        negatively than busy, which holds it)."""
        c = self.costs
        fields = {"forward": c.forward, "busy": c.busy, "send": c.send}
        directions = {"forward": ("forward",), "busy": ("forward", "backward"), "send": ()}
        weighted: list[Weighted] = []
        inner: dict[int, float] = {}
        for weight, name, q in entries:
            weighted.append((weight, fields[name][q]))
            for direction in directions[name]:
                index = self.index.get((q, direction))
                if index is not None:
                    weighted += self.exposed(weight, q, direction)
                    inner[index] = inner.get(index, 0.0) + weight * c.slots[q]
        kept = {i: v for i, v in inner.items() if abs(v) > 1e-12}
        assert all(v > 0 for v in kept.values()), kept
        return weighted, kept


def update_parts(costs: StageCosts, s: int) -> list[list[Weighted]]:
    """u_s as the larger of its linear parts: update - h sync, update - h backward (one part
    when nothing is hidden: one bucket, or no overlap)."""
    share = costs.overlap * (1.0 - 1.0 / costs.sync_buckets[s])
    update = (1.0, costs.update[s])
    if share <= 0:
        return [[update]]
    return [
        [update, (-share, costs.sync[s])],
        [update, (-share, costs.busy[s]), (share, costs.forward[s])],
    ]


def _runs(costs: StageCosts) -> list[list[int]]:
    """The runs of identical consecutive stages (same kind and buckets), in stage order. As
    docs/planner.md derives: pairs (first of a run, last of a run at or after it) dominate the
    others."""
    kinds = costs.kinds
    return _runs_by(len(costs.busy), lambda s: (kinds[s] if kinds else s, costs.sync_buckets[s]))


class _Layout:
    """Every node's candidates and every edge's pairs of a configuration's costs laid out in
    one vector, so that weighted sums of stage costs are a few vector operations; a sum comes
    back as `Costs` whose arrays are views of its vector."""

    def __init__(self, costs: StageCosts) -> None:
        self.nodes: dict[str, tuple[int, int]] = {}
        self.edges: dict[tuple[str, str], tuple[int, tuple[int, ...]]] = {}
        at = 0
        for v, c in costs.busy[0].node_costs.items():
            self.nodes[v] = (at, len(c))
            at += len(c)
        fields = (
            costs.busy, costs.forward, costs.send, costs.update, costs.sync,
            costs.gather_forward, costs.gather_backward,
        )  # fmt: skip
        for field in fields:
            for stage in field:
                for e, matrix in stage.edge_costs.items():
                    if e not in self.edges:
                        self.edges[e] = (at, matrix.shape)
                        at += matrix.size
        self.size = at
        self.flat: dict[int, np.ndarray] = {}  # per Costs (by id), its vector, finite

    def vector(self, costs: Costs) -> np.ndarray:
        found = self.flat.get(id(costs))
        if found is None:
            found = np.zeros(self.size)
            for v, c in costs.node_costs.items():
                at, n = self.nodes[v]
                found[at : at + n] = c
            for e, matrix in costs.edge_costs.items():
                at = self.edges[e][0]
                found[at : at + matrix.size] = matrix.ravel()
            found = self.flat[id(costs)] = _finite(found)
        return found

    def sum(self, terms: Sequence[Weighted]) -> Costs:
        """The sum of weight x costs (a forbidden, infinite, candidate or pair counts 0: the
        problem's own costs forbid it), over every node, and every edge any term has."""
        total = np.zeros(self.size)
        edges: set[tuple[str, str]] = set()
        for weight, costs in terms:
            total += weight * self.vector(costs)
            edges.update(costs.edge_costs)
        nodes = {v: total[at : at + n] for v, (at, n) in self.nodes.items()}
        return Costs(nodes, {e: self._matrix(total, e) for e in edges})

    def _matrix(self, total: np.ndarray, e: tuple[str, str]) -> np.ndarray:
        at, shape = self.edges[e]
        return total[at : at + int(np.prod(shape))].reshape(shape)


def _finite(costs: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(costs), costs, 0.0)


def _forbidden(costs: np.ndarray) -> np.ndarray:
    """0 where `costs` is finite, infinite where it forbids."""
    return np.where(np.isfinite(costs), 0.0, np.inf)


def _sum_edges(parts: Sequence[Costs]) -> EdgeCosts:
    out: EdgeCosts = {}
    for part in parts:
        for key, matrix in part.edge_costs.items():
            out[key] = out[key] + matrix if key in out else matrix
    return out
