"""Search: the fastest plan over every configuration (stage count, stage mesh, micro-batch count,
recomputation mode), best-first by proven lower bounds, each configuration solved exactly.

Lives here: the search's entry point (`search`): the request, the seeds, then one best-first
search here or its shares in other processes, and the winner with the effort and the gap
proven over the whole space. Lives elsewhere: the heap, the dives and the stop rule
(`search.best_first.BestFirst`), each configuration's bounds and solve with the caches
configurations share (`search.evaluator`), the same search split over processes
(`search.processes`), the space's meshes, counts and configurations (`space.configs`,
re-exported here), the bounds (`bounds`), the ILP of one configuration (`problem`), hand-plan
restrictions (`space.strategy`), why nothing fits (`search.nofit`), the winner as a `Plan`
(`assemble`).

Invariant: every bound the search orders configurations by is at most the predicted step of
every plan of its configuration, so the gap it reports is proven over the whole space (the
derivation, the order and the stop rule: docs/planner.md, "Bounds and search"; tests:
tests/planner/test_search.py, against exhaustive enumeration).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autosbp.planner.search.best_first import BestFirst
from autosbp.planner.search.evaluator import Evaluator, Found, GraphFor, Request, SearchEffort
from autosbp.planner.search.graph_memo import GraphMemo
from autosbp.planner.search.processes import search_in_processes
from autosbp.planner.space.configs import (
    Config,
    LinkOf,
    divisors,
    mesh_shapes,
    powers_of_two_dividing,
)
from autosbp.planner.space.strategy import Space
from autosbp.planner.timing.candidates import Prices
from autosbp.planner.timing.recipe import PLAIN, Recipe

__all__ = [
    "Config", "Found", "GraphFor", "GraphMemo", "LinkOf", "SearchEffort", "TimeLimitWarning",
    "divisors", "mesh_shapes", "powers_of_two_dividing", "search",
]  # fmt: skip


class TimeLimitWarning(UserWarning):
    """The search's time limit stopped it before it proved its plan optimal (`auto_parallelize`
    warns with `SearchEffort.limit_note`: the proven gap, the plan so far, how to raise it)."""


def _devices_link_of(link_of: LinkOf, virtual_stages: int) -> LinkOf:
    """The link classes of a mesh of virtual stages (leading dim: v x P) as those of the P
    stages' devices they run on."""

    def of(shape: tuple[int, ...], mesh_dim: int) -> str:
        return link_of((shape[0] // virtual_stages, *shape[1:]), mesh_dim)

    return of


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
    jobs: int | None = 1,
    recipe: Recipe = PLAIN,
    memo: GraphMemo | None = None,
) -> Found:
    """The fastest plan (by `predict`) over the configurations of `space` (docs/planner.md,
    "The space"), within MIP_GAP of the best of the whole space unless `time_limit_s` (the whole
    search's) runs out first; its `effort` says which. `jobs`: processes to search in (None:
    every core; `search.processes`). `memo`: what the other searches of its request computed
    of the graphs (`search.graph_memo`; None: a fresh one). NoFitError if no configuration has
    a plan.

    Interleaved (`space.virtual_stages` v > 1), each device runs v virtual stages: the search
    cuts v x P stages over v x `devices` (each virtual stage its own mesh of devices / P), whose
    chunks share a device's memory (`problem.build.memory_constraints`)."""
    v = space.virtual_stages
    if v > 1:
        devices *= v
        link_of = _devices_link_of(link_of, v)
    request = Request(
        graph_for, batch, devices, prices, link_of, space, optimizer, memory_limit_bytes,
        devices_per_node, progress, recipe,
    )  # fmt: skip
    memo = memo if memo is not None else GraphMemo()
    start = time.perf_counter()
    if jobs != 1:
        found = search_in_processes(request, time_limit_s, jobs, start, memo)
        if found is not None:
            return found
    state = BestFirst(Evaluator(request, memo), start + time_limit_s, time_limit_s, start=start)
    return state.outcome().found(start, state)
