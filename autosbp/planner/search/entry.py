"""Search: the fastest plan over every configuration (stage count, stage mesh, micro-batch count,
recomputation mode), best-first by proven lower bounds, each configuration solved exactly.

Lives here: the search's entry point (`search`) and its derivation below (the bounds in order,
the dives, the stop rule, the time limit, the proven gap). Lives elsewhere: the heap that runs
it (`best_first.BestFirst`), each configuration's bounds and solve with the
caches configurations share (`evaluate`), the same search split over processes (`parallel`),
the space's meshes, counts and configurations (`space`, re-exported here), the cheap bounds'
formulas (`bounds`), the ILP of one configuration, its LP bound and its prediction (`problem`,
`objective`), hand-plan restrictions (`hand_plans`), why nothing fits (`nofit`), the winner as
a `Plan` (`assemble`).

The space. Every stage count P that divides the devices (and that the graph's blocks can be
cut into), every stage mesh of `mesh_shapes(devices / P)`, every micro-batch count m that
divides the batch (m >= P with stages: every stage then holds a micro-batch in the steady
state), every recomputation mode; a hand plan narrows each (`strategies.Space`). A micro-batch
count whose graph cannot be captured (`MicroBatchError`) is refused, and named if nothing fits.

The value of a configuration c is V(c) = the step `predict` gives the plan that c's ILP solves
to. The search returns the least V it finds and proves how far from the least V of the whole
space it can be, with these lower bounds of every plan of c (so of V(c)), tried in this order:
 (0) floors: the path bounds of `objective` (fill to a stage, its m micro-batches, the drain
     or its own update) with every compute node at its compute floor on the stage's devices
     (`bounds.compute_floors`: flops and bytes spread evenly; the roofline only grows with
     flops and bytes, so no signature is faster), parameters at 0, no boxing, no transfers;
 (1) nodes: the same with each node at its cheapest signature on the stage mesh (a
     parameter's update without its sync, which backward may hide);
 (1b) forest: the same with each stage's boxing, every stage at the least its nodes and a
     spanning forest of its edges cost together (`forest_bound`: exact on the forest by dynamic
     programming; the gathers the blocks' compute may hide at 1 - a of their cost, a the
     profile's overlap), once there is a plan to cut by (and to rank the seeds);
 (2a) shared, by the recomputation modes of one stage count, mesh and micro-batch count: the
     LP relaxation, without memory constraints, of the least recomputing mode in the space;
 (2) LP: the LP relaxation of the configuration's ILP (`problem.lower_bound_of`).
Each is at most the ILP's objective of every choice (dropping edges, transfers and the update
of stage 0 drops non-negative terms; an LP relaxation is at most its ILP; dropping constraints
only lowers an LP), and the objective is at most `predict` of the same choice (`objective`'s
derivation), so each bound is at most V(c). What the blocks' compute hides of the parameters'
conversions (`overlap.hidden_gather_s`: (b - 1) a min(G, C) per stage, direction and
micro-batch, G one block's conversions = the stage's over b) is at most a (b - 1) / b of those
conversions, which are boxing on the stage's edges: boxing less what it hides stays >= 0, so
(0) and (1), which drop all boxing, still drop only non-negative terms. For (2a):
recomputation only adds time, choice by choice and so for every point of the LP. It adds
d >= 0 to a stage's busy time (per candidate and pair: a recomputed forward), which enters a
path bound P(s, k) as m d (stage k), d (a drain stage), and - h d in stage s's update
(h <= 1), so each path bound changes by (m - h) d or (1 - h) d or more, never less than 0;
every mode has the same candidates, pairs and paths. With hiding, d also adds d / b to one
block's compute C, so the hidden part grows by at most a (b - 1) / b d < d: the exposed time
still grows by >= 0 (the hiding term max(C + (1 - a) G, G + (1 - a) C) grows by at least
(1 - a) d / b at every point of the LP, which gives the same).
Under zero bubble (zb1) the path bounds keep P(k, k) alone (its drain passes B, not W): the
drain term had put (1) 24% above zb1's step under some prices (tests/planner/test_forest_bound).
A configuration is infeasible (not a bound, no plan) when a node has no candidate, when a
stage overflows with every node at its fewest bytes, or when its LP is infeasible.

Seeds first. Before best-first, the configurations built as people build plans by hand
(`BestFirst.seeds`: per stage count and mode, the stage mesh whose inner dim is a node, and the
most micro-batches its outer dim splits evenly; Narayanan et al. 2021, section 3.3) are taken
out of turn, cheapest forest bound (1b) first, each on to its LP bound (2) (an integral LP is
a plan); the SEED_SOLVES seeds of least LP bound are solved where they dive, each within
SEED_SOLVE_S (a longer MIP waits for its turn; 76.1B/1024's first seed took 41 s). The
first of them as soon as no seed left can bound below it (a seed's bound is at least its
forest bound, and the seeds come in that order), so that its plan cuts the seeds left; the
second after the last seed. The winner of 1008B/3072 is the 64-stage seed, whose LP is fractional:
solved after the seeds without recomputation, before those with (whose node bounds are above
its LP, and above its plan), it came at 9.5 s of one process instead of 13.9 s, after a
first plan of 121 s at 8.2 s. On GPT-3/1024 the winner is the 8-stage seed, found 9 s into
the search instead of at its end.
A selective mode that recomputes nothing (a fused attention kernel) has none's plans: it is
left out of the space beside none.

The order (best-first, with dives). Every configuration enters a heap at its floor bound. The
search pops the least bound; a configuration at level 0, 1 or 1b gets its next bound (the
largest bound so far is kept) and goes back, one at level 2 is solved (`problem.solve_mesh`, to
MIP_GAP), its plan priced by `predict` and kept if faster. A best-first search finds its plan
last: the configuration that wins is the one whose bound the others pass last (GPT-3 on 1024
A100s: the winner's first LP came at 40% of the search, its plan at 100%). So a configuration
whose LP bound (2a) comes out below DIVE_BELOW of the best plan so far dives: it goes on to its
LP bound (2) at once, out of turn (an integral LP is its plan); one whose LP bound (2) is below
SOLVE_BELOW of it, or any before the first plan, goes on to its solve (a MIP: dearer, so only
where it is likelier to win). A dive only adds work, on a configuration that might win; it
skips nothing. The search stops when
the least bound in the heap reaches the best step found x (1 - MIP_GAP): every configuration
left is then within MIP_GAP of it. No configuration is skipped for any other reason. A bound
(or a solve) that reaches that cutoff retires its configuration with the cutoff as its bound;
a solved one retires with its ILP's proven bound (objective x (1 - its gap)).

The time limit. It stops the search once it holds a plan (a limit costs the proven gap, never
the plan): until the first plan each step gets the whole limit (FIRST_PLAN_S at least), and
a configuration whose solve runs out of time retires with its bound (the gap counts it as unsolved).

The gap. Over the whole space no plan predicts below L = the least bound of every configuration
still in the heap or retired; `gap` = (best - L) / best, and `status` is "optimal" when gap <=
MIP_GAP. On the time limit the search stops where it is: "feasible" and the gap proven so far.

What each bound costs (GPT-3 175B on 1024 A100s, 96 layers, 1248 configurations, quiet 2-core
machine; see bench/plan_speed.py): the floors (0) of every configuration together about 1 s
(one cut into stages per count and stage count); a node bound (1) about 40 ms for the first
configuration of a (count, mesh) (every node's candidates priced) and under 1 ms after; a
forest bound (1b) 2-50 ms (each distinct stage's edges: GPT-3's LP bounds 124 -> 33, Llama 3
405B/8192's 117 -> 32; searches of 2 processes 15.5 -> 8.4-8.6 s and 68 -> 42-45 s, 2026-12-05,
three quiet runs); an LP
bound (2a or 2) about 0.3 s (0.2 s to build the problem: the boxing matrices and kept bytes of
every edge, shared by the configurations of one (count, mesh); 0.1 s for HiGHS); a solve of an
LP that is not integral 0.5-9 s (the MIP, `ilp`).
At the frontier (cProfile, one process, load 2.5-7 beside other jobs): Llama 3 405B on 16384
H100s (504 configurations, 2048 micro-batches of 64 stages): floors 1.0 s in all, node bounds
42 s (404; 38 s of it pricing candidates, `priced.price_graph`), LP bounds 77 s (143; 37 s
building the edges' terms, `stage_terms.add_edges`, 38 s the LPs), and 53 s predicting the 5
plans kept (`schedule.simulate` of 131,072 firings each: the largest single cost then; 26 s
of it the winner's again when rebuilt with its memory constraints, now kept,
`Evaluator.rebuilt`; the simulation is now event-driven, O(firings x log stages): 0.36 s
instead of 4.0 s for 64 stages x 1024 micro-batches, load 2); 1008B on 3072 A100s: floors 2.3 s, node
bounds 54 s (854), LP bounds 32 s (103), predicting 2 plans 18 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from autosbp.planner.search.best_first import BestFirst
from autosbp.planner.search.evaluator import Evaluator, Found, GraphFor, Request, SearchEffort
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

__all__ = [
    "Config", "Found", "GraphFor", "LinkOf", "SearchEffort", "TimeLimitWarning", "divisors",
    "mesh_shapes", "powers_of_two_dividing", "search",
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
) -> Found:
    """The fastest plan (by `predict`) over the configurations of `space` (the module
    docstring), within MIP_GAP of the best of the whole space unless `time_limit_s` (the whole
    search's) runs out first; its `effort` says which. `jobs`: processes to search in (None:
    every core; `parallel`). NoFitError if no configuration has a plan.

    Interleaved (`space.virtual_stages` v > 1), each device runs v virtual stages: the search
    cuts v x P stages over v x `devices` (each virtual stage its own mesh of devices / P) and
    gives each chunk 1/v of a device's memory (its chunks' peaks add up to the device's:
    `problem.predict`)."""
    v = space.virtual_stages
    if v > 1:
        devices *= v
        memory_limit_bytes = memory_limit_bytes / v if memory_limit_bytes is not None else None
        link_of = _devices_link_of(link_of, v)
    request = Request(
        graph_for, batch, devices, prices, link_of, space, optimizer, memory_limit_bytes,
        devices_per_node, progress,
    )  # fmt: skip
    start = time.perf_counter()
    if jobs != 1:
        found = search_in_processes(request, time_limit_s, jobs, start)
        if found is not None:
            return found
    state = BestFirst(Evaluator(request), start + time_limit_s, time_limit_s, start=start)
    return state.outcome().found(start, state)
