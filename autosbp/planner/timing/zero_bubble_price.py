"""The zero-bubble schedule (`zb1`, `autosbp.zero_bubble`) priced as the runtime runs it.

Lives here: `weight_shares` (per op, the part of its backward that computes the gradients of
inputs a parameter alone feeds: W's part), `weight_s` (each stage's W per micro-batch under a
solution) and `predict_zb1` (a solved problem's step under zb1: `timing.predict`'s per-stage
times with each backward split into B and W, run through `zero_bubble.run_zb1`). Lives
elsewhere: the orders and their run (`autosbp.zero_bubble`), 1F1B's prediction
(`timing.predict`), the ILP (its objective keeps zb1's path bounds P(k, k):
`timing.objective`).

Model (derived, not fitted; docs/planner.md, "Zero bubble"): each gradient of a floating input
that requires grad is as much work as its share (`timing.candidates.BACKWARD_FACTOR`,
`Kept.backward_share`); W of a stage sums its ops' weight shares of their backward, B is the
rest. The first stage runs its backward whole in W (it has no input gradient to send); the
gradient sync is armed before the last W, which hides part of it (`overlap.hidden_sync_s`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from autosbp.capturing.graph import OpGraph, Role
from autosbp.overlap import hidden_sync_s
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.memory.autograd_probe import requires_grad_of
from autosbp.planner.timing.candidates import NodeStrategies
from autosbp.planner.timing.predict import Configured, Prediction, predict
from autosbp.zero_bubble import run_zb1, zb1_orders

__all__ = ["predict_zb1", "weight_s", "weight_shares"]


class Solved(Configured, Protocol):
    """What zb1's price reads of one configuration's problem (`problem.build.MeshProblem`)."""

    @property
    def graph(self) -> OpGraph | None: ...
    @property
    def representative(self) -> Mapping[str, str]: ...
    @property
    def strategies(self) -> Mapping[str, NodeStrategies]: ...


def weight_shares(graph: OpGraph) -> dict[str, float]:
    """Per compute op, the share of its backward that W computes: of its floating inputs that
    require grad, those a parameter alone feeds (`OpGraph.weight_only`); 0 where none."""
    flags = requires_grad_of(graph)
    weights = graph.weight_only
    out: dict[str, float] = {}
    for name, attrs in graph.nodes(Role.COMPUTE):
        needed = [
            producer
            for producer, meta in zip(graph.producers(name), attrs.inputs, strict=True)
            if producer is not None and meta.dtype.is_floating_point and flags.get(producer, False)
        ]
        if needed and name not in weights:  # an op of weights alone: W's whole (`weight_s`)
            out[name] = sum(1 for src, _ in needed if src in weights) / len(needed)
    return out


def weight_s(mp: Solved, solution: Solution, shares: Mapping[str, float]) -> list[float]:
    """Each stage's W per micro-batch under `solution`: its ops' backward (each candidate's
    compute minus its forward) times their weight share; ops of weights alone (a transpose, a
    cast of a weight) whole, as their backward only carries weight gradients."""
    out = [0.0] * mp.split.num_stages
    assert mp.graph is not None, "the search builds its problems with their graph"
    weights = mp.graph.weight_only
    for name, _ in mp.graph.nodes(Role.COMPUTE):
        share = 1.0 if name in weights else shares.get(name, 0.0)
        rep = mp.representative[name]
        found = mp.strategies[rep]
        if share == 0.0 or found.forward_s is None:
            continue
        k = solution.choice[rep]
        out[mp.split.stage_of[name]] += share * float(found.compute_s[k] - found.forward_s[k])
    return out


def predict_zb1(mp: Solved, solution: Solution, shares: Mapping[str, float]) -> Prediction:
    """`solution`'s step under zb1: `predict`'s per-stage forward, backward, transfer and update,
    each backward split into B (the rest) and W (`weight_s`, at most the backward; the first stage's
    whole backward), run in zb1's orders; peak memory as the problem's constraints count it (built
    with schedule zb1: `zero_bubble.zb1_in_flight_counts`)."""
    assert mp.virtual_stages == 1, "zb1 runs plain stages"
    base = predict(mp, solution)
    p, m = mp.split.num_stages, mp.micro_batches
    w = [min(x, b) for x, b in zip(weight_s(mp, solution, shares), base.backward_s, strict=True)]
    w[0] = base.backward_s[0]  # the first stage sends no input gradient: W is all of it
    b_input = [b - x for b, x in zip(base.backward_s, w, strict=True)]
    timeline = run_zb1(
        zb1_orders(p, m), m, base.forward_s.__getitem__, b_input.__getitem__, w.__getitem__,
        base.send_s.__getitem__,
    )  # fmt: skip
    costs = mp.stage_costs
    hidden = tuple(
        hidden_sync_s(sync, last_s, k, costs.overlap)
        for sync, last_s, k in zip(base.sync_s, w, costs.sync_buckets, strict=True)
    )
    ends = [timeline.end_s(s) + base.update_s[s] - hidden[s] for s in range(p)]
    return replace(
        base,
        step_time_s=max(ends),
        sync_hidden_s=hidden,
        bubble_s=tuple(timeline.bubble_s(s) for s in range(p)),
        weight_s=tuple(w),
    )
