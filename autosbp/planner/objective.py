"""The objective of one configuration's ILP: a lower bound of the step the actor simulation
predicts, for every choice of signatures, and equal to it on the pipelines the planner meets.

Lives here: `StageCosts` (per stage, the ILP-keyed costs its times are made of) and
`objective_terms` (node costs, edge costs and max terms of the ILP built from them). Lives
elsewhere: summing the graph into stage costs (`problem`), the simulation (`schedule.simulate`,
priced by `problem.predict`), the solver (`ilp`).

Why a lower bound. The search (`search`) proves that no configuration beats its plan by
bounding each configuration from below; an LP relaxation bounds this objective, so the
objective itself must never exceed what `predict` says of the same choice. Write, per stage s
and one micro-batch, f_s its forward, b_s its backward (busy - forward, with recomputation),
busy_s = f_s + b_s, t_s the transfer of its outputs to stage s + 1 (t of the last stage is 0),
and u_s its update less the sync its last backward hides (`schedule.hidden_sync_s`):
u_s = update_s - h_s min(sync_s, b_s) = max(update_s - h_s sync_s, update_s - h_s b_s), with
h_s = overlap (1 - 1 / buckets_s). In the simulation:
- stage k's first firing (the forward of micro-batch 0) starts after every earlier stage's
  forward of micro-batch 0 and its transfer: at >= sum_{s' < k} (f_s' + t_s');
- stage k runs its 2m firings one at a time, m x busy_k in all, and the last of them is the
  backward of micro-batch m - 1 (backwards run in micro-batch order, each after its forward);
- the backward of micro-batch m - 1 on stage s' starts after that of stage s' + 1 has ended and
  its gradient has arrived (t_s'), so stage s's last firing ends at
      E_s >= sum_{s' < k} (f_s' + t_s') + m busy_k + sum_{s <= s' < k} (b_s' + t_s')
  for every k >= s (a chain of firings that precede one another);
- stage s ends its step at E_s + u_s, and the step is the latest stage end.
So for every pair s <= k and part j of u_s, the path bound
      P(s, k, j) = sum_{s' < k} (f_s' + t_s') + m busy_k + sum_{s <= s' < k} (b_s' + t_s') + u_s^j
is at most the simulated step, for every choice; their largest (the ILP's max term) is too,
over any set of pairs. The ILP takes the pairs (s, k) with s the first and k the last stage of a
run of identical stages (same `kinds`: the same tied nodes, edges and transfers, so the same
costs): within a run, a later k or an earlier s only adds non-negative terms (f, b, t >= 0 per
candidate and pair), so the other pairs never exceed these.

Exact where it matters: in 1F1B with the slowest stage last (GPT-style pipelines: the last
stage holds the head and the loss), the pairs (s, last) are the simulation's critical paths (fill
to the last stage, its steady state, the drain back to stage s, then stage s's update), and the
objective equals the prediction (measured on GPT-3 configurations: equal to 1e-5). Where a
middle stage is slowest the simulation can idle more than any path bound sees; the ILP then
minimizes a lower bound, and the plan is priced by the simulation all the same. With one stage
the objective is m busy + u exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from autosbp.planner.ilp_problem import Costs, MaxTerm, MemoryConstraint


@dataclass(frozen=True)
class StageCosts:
    """Per pipeline stage, the ILP-keyed costs that make up its times (seconds), for pricing a
    solution: `busy` one micro-batch's forward + backward (+ recomputation), `forward` its
    forward part, `send` the one-way transfer of its outputs to later stages per micro-batch,
    `update` the per-step gradient sync and optimizer, of which the last micro-batch's backward
    hides part of the sync (`schedule.hidden_sync_s`); its memory constraint; and its kind,
    equal for stages whose costs are equal (what they are made of)."""

    busy: tuple[Costs, ...]
    forward: tuple[Costs, ...]
    send: tuple[Costs, ...]
    update: tuple[Costs, ...]
    sync: tuple[Costs, ...]  # the gradient-sync part of `update`
    sync_buckets: tuple[int, ...]  # `schedule.sync_buckets` of each stage's parameters
    overlap: float  # the profile's fraction of communication that compute hides
    memory: tuple[MemoryConstraint, ...]
    kinds: tuple[Hashable, ...] = ()  # per stage; () when not known: every stage its own


NodeCosts = dict[str, np.ndarray]
EdgeCosts = dict[tuple[str, str], np.ndarray]
Weighted = tuple[float, Costs]  # weight x costs, a term of a sum


def objective_terms(
    costs: StageCosts, keys: Sequence[str], micro_batches: int
) -> tuple[NodeCosts, EdgeCosts, tuple[MaxTerm, ...]]:
    """Node costs, edge costs and max terms of the objective (the module docstring): with one
    stage m x busy + the update, the update's two parts a max term where backward hides some
    of its sync; with stages, the largest path bound."""
    m, busy = micro_batches, costs.busy
    if len(busy) == 1:
        node_costs = {r: m * busy[0].node_costs[r] for r in keys}
        edge_costs = {e: m * c for e, c in busy[0].edge_costs.items()}
        updates = _update_parts(costs, 0)
        if len(updates) > 1:
            layout = _Layout(costs)
            return node_costs, edge_costs, (MaxTerm(1.0, tuple(layout.sum(u) for u in updates)),)
        for r, c in costs.update[0].node_costs.items():
            node_costs[r] = node_costs[r] + c
        return node_costs, edge_costs, ()
    # Every cost lives in the max term; the linear costs only carry which candidates and pairs
    # are forbidden (an infinite cost), as the stages' costs say.
    node_costs = {r: _forbidden(np.sum([c.node_costs[r] for c in busy], axis=0)) for r in keys}
    edge_costs = {e: _forbidden(matrix) for e, matrix in _sum_edges(busy).items()}
    runs, layout = _runs(costs), _Layout(costs)
    parts = tuple(
        layout.sum(_path(costs, runs, a, b, m) + update)
        for a in range(len(runs))
        for b in range(a, len(runs))
        for update in _update_parts(costs, runs[a][0])
    )
    return node_costs, edge_costs, (MaxTerm(1.0, parts),)


def _path(costs: StageCosts, runs: list[list[int]], a: int, b: int, m: int) -> list[Weighted]:
    """P(s, k) less the update, for s the first stage of run a and k the last of run b >= a:
    the fill to k, its m micro-batches, the drain back to s. Stages of a run are identical, so
    a run's stages add up as its length times one of them."""
    k = runs[b][-1]
    terms: list[Weighted] = [(float(m), costs.busy[k])]
    for c in range(b + 1):
        q = runs[c][0]  # one stage of run c stands for each of its stages before k
        n = float(len(runs[c]) - (1 if c == b else 0))
        if n == 0:
            continue
        terms += [(n, costs.forward[q]), (n, costs.send[q])]
        if c >= a:  # the backward of micro-batch m - 1 drains from k down to s
            terms += [(n, costs.busy[q]), (-n, costs.forward[q]), (n, costs.send[q])]
    return terms


def _update_parts(costs: StageCosts, s: int) -> list[list[Weighted]]:
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
    """The runs of identical consecutive stages (same kind), in stage order. The module
    docstring: pairs (first of a run, last of a run at or after it) dominate the others."""
    runs: list[list[int]] = []
    for s in range(len(costs.busy)):
        same = bool(costs.kinds) and bool(runs) and costs.kinds[runs[-1][-1]] == costs.kinds[s]
        if same and costs.sync_buckets[runs[-1][-1]] == costs.sync_buckets[s]:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


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
        for field in (costs.busy, costs.forward, costs.send, costs.update, costs.sync):
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
