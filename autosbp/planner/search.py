"""Search: the fastest plan over every configuration (stage count, stage mesh, micro-batch count,
recomputation mode), best-first by proven lower bounds, each configuration solved exactly.

Lives here: the search itself (`search`: the bounds in order, the dives, the stop rule, the
time limit, the proven gap). Lives elsewhere: each configuration's bounds and solve with the
caches configurations share (`evaluate`), the same search split over processes (`parallel`),
the space's meshes, counts and configurations (`space`, re-exported here), the cheap bounds'
formulas (`bounds`), the ILP of one configuration, its LP bound and its prediction (`problem`,
`objective`), hand-plan restrictions (`strategies`), why nothing fits (`nofit`), the winner as
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
 (2a) shared, by the recomputation modes of one stage count, mesh and micro-batch count: the
     LP relaxation, without memory constraints, of the least recomputing mode in the space;
 (2) LP: the LP relaxation of the configuration's ILP (`problem.lower_bound_of`).
Each is at most the ILP's objective of every choice (dropping edges, transfers and the update
of stage 0 drops non-negative terms; an LP relaxation is at most its ILP; dropping constraints
only lowers an LP), and the objective is at most `predict` of the same choice (`objective`'s
derivation), so each bound is at most V(c). What the blocks' compute hides of the parameters'
conversions (`schedule.hidden_gather_s`: (b - 1) a min(G, C) per stage, direction and
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
A configuration is infeasible (not a bound, no plan) when a node has no candidate, when a
stage overflows with every node at its fewest bytes, or when its LP is infeasible.

Seeds first. Before best-first, the configurations built as people build plans by hand
(`_Search.seeds`: per stage count and mode, the stage mesh whose inner dim is a node, and the
most micro-batches its outer dim splits evenly; Narayanan et al. 2021, section 3.3) are taken
out of turn, cheapest node bound first, each on to its LP bound (2) (an integral LP is a
plan); then the SEED_SOLVES seeds of least LP bound are solved where they dive, each within
SEED_SOLVE_S (a longer MIP waits for its turn; 76.1B/1024's first seed took 41 s) (the
winner of 1008B/3072 is the 64-stage seed, whose LP is fractional). On GPT-3/1024 the winner
is the 8-stage seed, found 9 s into the search instead of at its end.
A selective mode that recomputes nothing (a fused attention kernel) has none's plans: it is
left out of the space beside none.

The order (best-first, with dives). Every configuration enters a heap at its floor bound. The
search pops the least bound; a configuration at level 0 or 1 gets its next bound (the largest
bound so far is kept) and goes back, one at level 2 is solved (`problem.solve_mesh`, to
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
configuration of a (count, mesh) (every node's candidates priced) and under 1 ms after; an LP
bound (2a or 2) about 0.3 s (0.2 s to build the problem: the boxing matrices and kept bytes of
every edge, shared by the configurations of one (count, mesh); 0.1 s for HiGHS); a solve of an
LP that is not integral 0.5-9 s (the MIP, `ilp`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autosbp.capturing.graph import OpGraph
from autosbp.errors import NoFitError, PlanError
from autosbp.planner.costs import Prices
from autosbp.planner.evaluate import Evaluator, Found, GraphFor, Request, SearchEffort
from autosbp.planner.ilp import SolverTimeoutError
from autosbp.planner.pipeline import recompute_runs
from autosbp.planner.problem import MIP_GAP, MeshProblem
from autosbp.planner.space import (
    Config,
    LinkOf,
    divisors,
    mesh_shapes,
    powers_of_two_dividing,
)
from autosbp.planner.strategies import Space

__all__ = [
    "Config", "Found", "GraphFor", "LinkOf", "SearchEffort", "TimeLimitWarning", "divisors",
    "mesh_shapes", "powers_of_two_dividing", "search",
]  # fmt: skip

# A configuration whose LP bound is below this share of the best plan so far dives to its LP
# bound (2) at once, and below the second share on to its MIP (the docstring).
DIVE_BELOW, SOLVE_BELOW = 0.98, 0.9
FIRST_PLAN_S = 10.0  # the least solver time of each step before the first plan (a floor, assumed)
SEED_SOLVE_S = 5.0  # the most each of those solves may take out of turn (assumed: a MIP usually
# takes 0.1-2 s; a longer one waits for its turn)
SEED_SOLVES = 2  # the seeds with the least LP bounds solved before best-first (the docstring)


class TimeLimitWarning(UserWarning):
    """The search's time limit stopped it before it proved its plan optimal (`auto_parallelize`
    warns with `SearchEffort.limit_note`: the proven gap, the plan so far, how to raise it)."""


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
    every core; `parallel`). NoFitError if no configuration has a plan."""
    request = Request(
        graph_for, batch, devices, prices, link_of, space, optimizer, memory_limit_bytes,
        devices_per_node, progress,
    )  # fmt: skip
    start = time.perf_counter()
    if jobs != 1:
        from autosbp.planner.parallel import search_in_processes

        found = search_in_processes(request, time_limit_s, jobs, start)
        if found is not None:
            return found
    state = _Search(Evaluator(request), start + time_limit_s, time_limit_s, start=start)
    return state.outcome().found(start, state)


@dataclass(frozen=True)
class Outcome:
    """Where one search (or one process's share of it) ended: its best plan, the least bound
    of what it did not solve, and what it did."""

    best: Found | None
    least_s: float
    configurations: int
    bounded: int
    solved: int
    timed_out: bool
    improvements: tuple[tuple[float, float], ...] = ()  # (seconds since the start, step)

    def found(self, start: float, state: _Search) -> Found:
        """The best plan with its effort (its problem with the memory limit: a plan of bound
        (2a) was solved without); NoFitError if there is none."""
        limit = state.ev.request.memory_limit_bytes
        if self.best is None:
            raise NoFitError(state.ev.refusals.message(limit))
        best = self.best
        if limit is not None and not best.problem.problem.memory:
            mp = best.problem
            config = Config(mp.split.num_stages, mp.mesh, mp.micro_batches, mp.recompute)
            best = state.ev.rebuilt(config, dict(best.solution.choice))
        best_s = best.prediction.step_time_s
        gap = max(0.0, (best_s - self.least_s) / best_s)
        status = "optimal" if gap <= MIP_GAP * (1 + 1e-9) else "feasible"
        effort = SearchEffort(
            time.perf_counter() - start, self.configurations, self.bounded, self.solved,
            status, gap, state.time_limit_s, self.timed_out, self.improvements,
        )  # fmt: skip
        return replace(best, effort=effort)


FLOOR, NODES, LP = 0, 1, 2  # the bound a configuration in the heap holds (the module docstring)
Entry = tuple[float, int, int, Config, MeshProblem | None]


@dataclass
class _Search:
    """One `search` (or one process's share: the configurations `owns` says, beside the best
    plan of every process, `incumbent_s`): the heap of configurations by bound, the best plan
    so far, the least bound of retired configurations. Bound (2a) is computed once a plan is
    known (before, nothing is cut: it would only cost)."""

    ev: Evaluator
    deadline: float
    time_limit_s: float
    owns: Callable[[Config], bool] = lambda config: True
    incumbent_s: Callable[[], float] = lambda: math.inf
    offer: Callable[[float], None] = lambda step_s: None
    start: float = field(default_factory=time.perf_counter)
    heap: list[Entry] = field(default_factory=list)
    best: Found | None = None
    retired_bound: float = math.inf
    configurations: int = 0
    timed_out: bool = False
    seeding: bool = False  # in `seed_first`
    seed_lps: list[tuple[float, int, Config, MeshProblem]] = field(default_factory=list)
    solved_early: set[Config] = field(default_factory=set)  # seeds solved out of turn
    improvements: list[tuple[float, float]] = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)  # ties: the space's order

    def outcome(self, *, entered: bool = False) -> Outcome:
        """Search to the stop rule (`entered`: the space is in the heap and seeded already)."""
        if not entered:
            self.enter_space()
            self.seed_first()
        while self.heap and self.heap[0][0] < self.cutoff():
            if self.has_plan() and time.perf_counter() >= self.deadline:
                self.timed_out = True
                break
            bound, negative_level, _, config, problem = heapq.heappop(self.heap)
            if config not in self.solved_early:  # else a seed's stale entry: done already
                self.advance(config, -negative_level, bound, problem)
        least = min(self.retired_bound, self.heap[0][0] if self.heap else math.inf)
        return Outcome(
            self.best, least, self.configurations, self.ev.bounded, self.ev.solved,
            self.timed_out, tuple(self.improvements),
        )  # fmt: skip

    def seed_first(self) -> None:
        """Before best-first, out of turn, the configurations a cheap estimate says are
        likeliest to win (`seeds`), cheapest node bound (1) first, each on to its LP bound and
        its solve as far as the dive rules take it (the module docstring)."""
        seeds = self.seeds()
        if not seeds:
            return
        floors = {entry[3]: entry[0] for entry in self.heap if entry[3] in seeds}
        self.heap = [entry for entry in self.heap if entry[3] not in seeds]
        heapq.heapify(self.heap)
        ranked = []
        for config in seeds:
            found = self.ev.node_bound(config)
            if found is not None:
                ranked.append((max(floors[config], found), next(self.order), config))
        self.seeding = True  # no MIP: each seed's LP first
        for bound, _, config in sorted(ranked):
            if bound >= self.cutoff() or (self.has_plan() and self.deadline <= time.perf_counter()):
                self.push(bound, NODES, config, None)
            else:
                self.advance(config, NODES, bound, None)
        self.seeding = False
        self.solve_seeds()

    def solve_seeds(self) -> None:
        """The SEED_SOLVES seeds of least LP bound, solved where they dive; their entries in
        the heap are stale then (skipped when popped)."""
        for bound, _, config, mp in sorted(self.seed_lps, key=lambda s: s[:2])[:SEED_SOLVES]:
            dives = self.dives(bound, SOLVE_BELOW) and time.perf_counter() < self.deadline
            if dives and self.solve(config, bound, mp, SEED_SOLVE_S):
                self.solved_early.add(config)

    def seeds(self) -> set[Config]:
        """Per stage count and mode, the configuration built as people build plans by hand
        (Narayanan et al. 2021, section 3.3): the stage mesh whose inner dim is a whole node
        (else the widest inner dim), and the most micro-batches whose samples its outer dim
        still splits evenly."""
        per_node = self.ev.request.devices_per_node
        best: dict[tuple[int, str], tuple[tuple, Config]] = {}
        for _, _, _, config, _ in self.heap:
            mesh = config.mesh
            inner = mesh.shape[-1] if len(mesh.shape) > 1 else 1
            if (self.ev.request.batch // config.count) % mesh.shape[0]:
                continue
            rank = (inner == per_node, inner, config.count)
            key = (config.num_stages, config.recompute)
            if key not in best or rank > best[key][0]:
                best[key] = (rank, config)
        return {config for _, config in best.values()}

    def best_s(self) -> float:
        own = self.best.prediction.step_time_s if self.best else math.inf
        return min(own, self.incumbent_s())

    def has_plan(self) -> bool:
        return self.best_s() < math.inf

    def cutoff(self) -> float:
        """No configuration bounded at or above this can improve the best plan by MIP_GAP."""
        return self.best_s() * (1 - MIP_GAP)

    def dives(self, bound: float, share: float = DIVE_BELOW) -> bool:
        """Does a configuration with this LP bound go on out of turn?"""
        return bound < self.best_s() * share

    def push(self, bound: float, level: int, config: Config, mp: MeshProblem | None) -> None:
        if bound >= self.cutoff():
            self.retired_bound = min(self.retired_bound, bound)
        else:  # deeper levels first on equal bounds, then the order of the space
            heapq.heappush(self.heap, (bound, -level, next(self.order), config, mp))

    def enter_space(self) -> None:
        """Every configuration of the space (that this search owns), at its floor bound."""
        ev, space = self.ev, self.ev.request.space
        counts, every = ev.counts(), 0
        for num_stages in space.stage_counts:
            meshes = ev.meshes(num_stages)
            for count in counts:
                if num_stages > 1 and count < num_stages:
                    continue
                ours = [m for m in meshes if self.owns(Config(num_stages, m, count, "none"))]
                every += len(meshes) * len(space.recompute)
                stages = ev.stages_of(count, num_stages) if ours else None
                if stages is None:
                    continue
                for mode in space.recompute:
                    if _same_as_none(mode, space.recompute, stages.graph):
                        continue
                    floor = ev.floor_bound(stages, Config(num_stages, ours[0], count, mode))
                    for mesh in ours:
                        self.configurations += 1
                        config = Config(num_stages, mesh, count, mode)
                        self.heap.append((floor, -FLOOR, next(self.order), config, None))
        heapq.heapify(self.heap)
        if not every and not ev.refusals.refused:
            raise PlanError(
                f"the strategy needs a mesh that {ev.request.devices} devices cannot form; "
                f"check that its degrees multiply to {ev.request.devices}."
            )

    def advance(self, config: Config, level: int, bound: float, mp: MeshProblem | None) -> None:
        """The next bound of `config` (back into the heap, or on at once where it dives), or
        its solve at level LP."""
        if level == FLOOR:
            found = self.ev.node_bound(config)
            if found is not None:  # None: the configuration has no plan
                self.push(max(bound, found), NODES, config, None)
        elif level == NODES:
            shared = -math.inf
            if self.has_plan():
                shared = self.ev.shared_bound(config, self.time_left(), self.cutoff())
                plan = self.ev.shared_plan(config)
                if plan is not None:  # (2a) solved it
                    self.keep(*plan, max(bound, shared))
                    return
            if shared > bound and not self.dives(shared):
                self.push(shared, NODES, config, None)  # (2a) may have passed another's bound
            else:
                self.bound_by_lp(config, max(bound, shared))
        else:
            assert mp is not None
            self.solve(config, bound, mp)

    def bound_by_lp(self, config: Config, bound: float) -> None:
        """Bound (2): back into the heap with the problem behind it, or on to its solve where it
        dives; kept as solved when the LP relaxation is integral; dropped if nothing fits."""
        found = self.ev.lp_bound(config, self.time_left(), self.cutoff())
        if found is None:
            return
        lp, mp, solution = found
        if solution is not None:  # solved by its LP
            self.keep(mp, solution, max(bound, min(lp, solution.objective)))
        elif not self.seeding and (not self.has_plan() or self.dives(max(bound, lp), SOLVE_BELOW)):
            self.solve(config, max(bound, lp), mp)
        else:
            self.push(max(bound, lp), LP, config, mp)
            if self.seeding:
                self.seed_lps.append((max(bound, lp), next(self.order), config, mp))

    def solve(
        self, config: Config, bound: float, mp: MeshProblem, cap_s: float | None = None
    ) -> bool:
        """Solve `config`: its plan kept, or its bound raised; False when out of time (of
        `cap_s`, where given: a solve out of turn, back in the heap then)."""
        cutoff = self.cutoff()
        try:
            seconds = self.time_left() if cap_s is None else min(self.time_left(), cap_s)
            solution = self.ev.solve(mp, seconds, cutoff)
        except SolverTimeoutError:
            if cap_s is not None:  # its turn comes again, with the time left then
                self.push(bound, LP, config, mp)
            elif self.has_plan():  # still open: the search is out of time
                self.push(bound, LP, config, mp)
                self.deadline = time.perf_counter()
            else:  # no plan to stop with: the next configuration gets its turn
                self.retired_bound = min(self.retired_bound, bound)
            return False
        if solution is None:
            self.push(max(bound, cutoff), LP, config, mp)  # nothing below the cutoff
        else:
            self.keep(mp, solution, max(bound, solution.objective * (1 - solution.gap)))
        return True

    def keep(self, mp: MeshProblem, solution, proven: float) -> None:
        """A solved configuration: its plan becomes the best if faster (and is offered to the
        other processes); it retires with the bound its solve proved."""
        found = self.ev.found(mp, solution)
        if self.best is None or _faster(found, self.best):
            self.best = found
            self.offer(found.prediction.step_time_s)
            step_s = found.prediction.step_time_s
            self.improvements.append((time.perf_counter() - self.start, step_s))
        self.retired_bound = min(self.retired_bound, proven)

    def time_left(self) -> float:
        """The solver's time: what is left of the limit; before any plan, the whole limit and
        at least FIRST_PLAN_S."""
        if not self.has_plan():
            return max(self.deadline - time.perf_counter(), self.time_limit_s, FIRST_PLAN_S)
        return max(self.deadline - time.perf_counter(), 1e-3)


def _same_as_none(mode: str, modes: tuple[str, ...], graph: OpGraph) -> bool:
    """Is `mode` a recomputation that recomputes nothing here (selective beside a fused
    attention kernel), while `none` is in the space too? Its plans are none's: left out."""
    return mode != "none" and "none" in modes and not recompute_runs(graph, mode)


def _faster(a: Found, b: Found) -> bool:
    return a.prediction.step_time_s < b.prediction.step_time_s * (1 - 1e-12)
