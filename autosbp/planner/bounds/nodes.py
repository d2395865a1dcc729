"""Cheap lower bounds of a configuration's step time, from per-node times alone.

Lives here: `compute_floors` (per compute node, a time no signature on a number of devices
beats), `step_bound` (a step no plan of a configuration beats, from per-node times: floors, or
each node's cheapest signature), `path_bound` (the pipeline's path bounds of per-stage sums)
and `unhidden_s` (the part of a node's time no overlap hides).
Lives elsewhere: the search that orders configurations by these bounds (`search.best_first`;
why they bound the predicted step: docs/planner.md, "Bounds and search"), the objective's path
bounds (`timing.objective`), the forest bound (`bounds.forest`), the LP bound (`bounds.lp`).

Both bounds are the path bounds of `timing.objective` with every per-node cost at its least and
every edge (boxing) and transfer at 0, which can only lower them: a path bound sums per-node costs
with non-negative weights (f, b, busy >= 0), and boxing and transfers only add time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from autosbp.capturing.graph import OpGraph, Role
from autosbp.planner.space.recomputation import recomputed
from autosbp.planner.timing.candidates import BACKWARD_FACTOR, NodeStrategies, Prices, returns_view
from autosbp.rules import work_fraction


def compute_floors(
    graph: OpGraph,
    prices: Prices,
    devices: int,
    only: Collection[str] | None = None,
    backward_share: Mapping[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Per compute node (of `only`, where given), the least forward + backward time any
    signature on `devices` devices can take (one value: its flops and bytes spread evenly; a
    signature's local share is never smaller, and the roofline only grows with flops and
    bytes). `backward_share`: per node, the share of backward that runs, as its candidates are
    priced (`memory.kept.Kept.backward_share`; 1 where absent). The flops are those the least
    working kernel computes (`rules.work_fraction` of no signature: causal attention's kept scores)."""
    shares = backward_share or {}
    floors: dict[str, np.ndarray] = {}
    for name, attrs in graph.nodes(Role.COMPUTE):
        if (attrs.flops or attrs.bytes) and (only is None or name in only):
            dtype = attrs.outputs[0].dtype if attrs.outputs else torch.float32
            moved = 0.0 if returns_view(attrs.target) else attrs.bytes / devices
            share = work_fraction(attrs, None, (), prices.causal_skip) / devices
            special = attrs.transcendentals * share
            forward = prices.op_time_s(attrs.flops * share, moved, dtype, special)
            floors[name] = np.array([forward * (1.0 + BACKWARD_FACTOR * shares.get(name, 1.0))])
    return floors


def step_bound(
    graph: OpGraph,
    copies: Counter[tuple[int, str]],
    num_stages: int,
    times: Mapping[str, np.ndarray],
    micro_batches: int,
    recompute: str,
    *,
    drain: bool = True,
    again: Mapping[tuple[int, str], int] | None = None,
) -> float:
    """A step time no plan with these stages, micro-batch count and recomputation can beat,
    from per-node times alone (`times` per representative node: per candidate, or one floor;
    compute nodes per micro-batch, parameters per step), each node at its cheapest, no boxing
    and no transfers: the largest over stages k of the path bounds P(0, k) (the fill to k, its
    micro-batches, the drain back to stage 0) and P(k, k) with k's update (the fill to k, its
    micro-batches, its update; a parameter's `times` may leave out the sync, which backward
    may hide, `unhidden_s`); `path_bound` of those sums. `again`: under `full:K`, per (stage,
    representative) the copies that recompute (`recompute` is then not read)."""
    busy = [0.0] * num_stages
    first = [0.0] * num_stages  # forward of one micro-batch
    update = [0.0] * num_stages
    for (s, name), n in copies.items():
        values = times.get(name)
        if values is None or not len(values):
            continue
        attrs, least = graph.node(name), n * float(np.min(values))
        if attrs.role is Role.PARAMETER:
            update[s] += least
        elif attrs.role is Role.COMPUTE:
            forward = least / (1.0 + BACKWARD_FACTOR)
            if again is not None:  # `full:K`: the copies that rerun their forward
                busy[s] += least + forward * again.get((s, name), 0) / n
            else:
                busy[s] += least + (forward if recomputed(graph, name, recompute) else 0.0)
            first[s] += forward
    steady = [micro_batches * b + u for b, u in zip(busy, update, strict=True)]
    return path_bound(busy, first, steady, micro_batches, drain=drain)


def path_bound(
    busy: Sequence[float],
    first: Sequence[float],
    steady: Sequence[float],
    micro_batches: int,
    *,
    drain: bool = True,
) -> float:
    """The largest over stages k of the path bounds P(0, k) (the fill to k, its micro-batches,
    the drain back to stage 0) and P(k, k) (the fill, its micro-batches and its update), from
    per stage lower bounds of one micro-batch's busy time and forward, and of the micro-batches
    and update together (`steady`), transfers at 0 (`timing.objective`'s derivation; each path bound
    only grows with its terms). `drain`: False under zero bubble (zb1), whose drain passes B
    alone: only P(k, k) bounds its step."""
    return max(
        max(
            (micro_batches * busy[k] + sum(busy[:k])) if drain else 0.0,
            sum(first[:k]) + steady[k],
        )
        for k in range(len(busy))
    )


def unhidden_s(found: NodeStrategies) -> np.ndarray:
    """A node's time no overlap hides: a parameter's optimizer update (its sync may hide behind
    backward), a compute node's forward and backward."""
    return found.compute_s - found.sync_s if found.sync_s is not None else found.compute_s
