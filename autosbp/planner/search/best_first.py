"""The best-first search itself: configurations in a heap by their proven bounds, refined,
dived into, solved, until the least bound reaches the best plan (the derivation and the order:
docs/planner.md, "Bounds and search").

Lives here: `BestFirst` (the heap, the seeds taken first, the stop rule) and `Outcome` (where
one search, or one process's share of it, ended). Lives elsewhere: the entry point and the
proof (`search`), one configuration's work (`search.evaluator`), the search split over processes
(`search.processes`), which runs a `BestFirst` per process.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autosbp.errors import NoFitError, PlanError
from autosbp.planner.ilp.solving import SolverTimeoutError
from autosbp.planner.problem.build import MeshProblem
from autosbp.planner.problem.solve import MIP_GAP
from autosbp.planner.search.evaluator import Evaluator, Found, SearchEffort
from autosbp.planner.space.configs import (
    Config,
)
from autosbp.planner.space.recomputation import distinct_modes, partial_blocks, partial_mode
from autosbp.schedule import check_interleaving

# A configuration whose LP bound is below this share of the best plan so far dives to its LP
# bound (2) at once, and below the second share on to its MIP (docs/planner.md, "The order").
DIVE_BELOW, SOLVE_BELOW = 0.98, 0.9
FIRST_PLAN_S = 10.0  # the least solver time of each step before the first plan (a floor, assumed)
SEED_SOLVE_S = 5.0  # the most each of those solves may take out of turn (assumed: a MIP usually
# takes 0.1-2 s; a longer one waits for its turn)
SEED_SOLVES = 2  # the seeds of least LP bound solved before best-first (docs/planner.md, "Seeds")


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

    def found(self, start: float, state: BestFirst) -> Found:
        """The best plan with its effort (its problem with the memory limit: a plan of bound
        (2a) was solved without); NoFitError if there is none."""
        limit = state.ev.request.memory_limit_bytes
        if self.best is None:
            space = state.ev.request.space
            chunks = space.virtual_stages
            raise NoFitError(state.ev.refusals.message(limit, space.may_gather, chunks))
        best = self.best
        if limit is not None and not best.problem.problem.memory:
            mp = best.problem
            config = Config(mp.split.num_stages, mp.mesh, mp.micro_batches, mp.recompute)
            best = state.ev.rebuilt(config, dict(best.solution.choice), best.prediction)
        best_s = best.prediction.step_time_s
        gap = max(0.0, (best_s - self.least_s) / best_s)
        status = "optimal" if gap <= MIP_GAP * (1 + 1e-9) else "feasible"
        effort = SearchEffort(
            time.perf_counter() - start, self.configurations, self.bounded, self.solved,
            status, gap, state.time_limit_s, self.timed_out, self.improvements,
        )  # fmt: skip
        return replace(best, effort=effort)


FLOOR, NODES, FOREST, LP = 0, 1, 2, 3  # the bound a configuration in the heap holds (`search`)
Entry = tuple[float, int, int, Config, MeshProblem | None]


@dataclass
class BestFirst:
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
    seeds_taken: set[Config] = field(default_factory=set)  # seeds `solve_seeds` took
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
        likeliest to win (`seeds`), cheapest forest bound (1b) first, each on to its LP bound
        and its solve as far as the dive rules take it (docs/planner.md, "Seeds"). The seed of
        least LP bound is solved as soon as no seed left can bound below it: a seed's bound is
        at least its forest bound, and the rest come in that order; its plan then cuts the
        seeds left (1008B on 3072 A100s: the optimum 5 s sooner, the recomputing seeds cut;
        ranked by (1b) rather than (1), 1.7 s sooner again)."""
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
                found = max(floors[config], found, self.ev.forest_bound(config))
                ranked.append((found, next(self.order), config))
        self.seeding = True  # no MIP: each seed's LP first
        solves = SEED_SOLVES
        for bound, _, config in sorted(ranked):
            if solves == SEED_SOLVES and self.seed_lps and bound >= min(self.seed_lps)[0]:
                solves -= self.solve_seeds(1)  # no seed left bounds below the least LP's
            if bound >= self.cutoff() or (self.has_plan() and self.deadline <= time.perf_counter()):
                self.push(bound, NODES, config, None)
            else:
                self.advance(config, NODES, bound, None)
        self.seeding = False
        self.solve_seeds(solves)

    def solve_seeds(self, solves: int) -> int:
        """The `solves` seeds of least LP bound not taken yet, solved where they dive (their
        entries in the heap are stale then: skipped when popped); how many it took."""
        waiting = [s for s in self.seed_lps if s[2] not in self.seeds_taken]
        for bound, _, config, mp in sorted(waiting, key=lambda s: s[:2])[:solves]:
            self.seeds_taken.add(config)
            dives = self.dives(bound, SOLVE_BELOW) and time.perf_counter() < self.deadline
            if dives and self.solve(config, bound, mp, SEED_SOLVE_S):
                self.solved_early.add(config)
        return min(solves, len(waiting))

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
            pipeline, v = num_stages // space.virtual_stages, space.virtual_stages
            for count in counts if meshes else ():  # no mesh: the message below says why
                if (reason := check_interleaving(pipeline, v, count)) is not None:
                    ev.refusals.refuse(f"{count} micro-batches: {reason}")
                    continue
                if pipeline > 1 and count < pipeline:
                    ev.refusals.refuse(
                        f"{count} micro-batches: a pipeline of {pipeline} stages needs at least "
                        f"{pipeline} (one per stage, or a stage idles every step); use mb >= "
                        f"{pipeline}, or fewer stages"
                    )
                    continue
                ours = [m for m in meshes if self.owns(Config(num_stages, m, count, "none"))]
                every += len(meshes) * len(space.recompute)
                stages = ev.stages_of(count, num_stages) if ours else None
                if stages is None:
                    continue
                for mode in distinct_modes(stages.graph, space.recompute):
                    floor = ev.floor_bound(stages, Config(num_stages, ours[0], count, mode))
                    for mesh in ours:
                        self.configurations += 1
                        config = Config(num_stages, mesh, count, mode)
                        self.heap.append((floor, -FLOOR, next(self.order), config, None))
        heapq.heapify(self.heap)
        if not every and not ev.refusals.refused:
            devices = ev.request.devices // space.virtual_stages  # the search's are per chunk
            raise PlanError(
                f"the strategy needs a mesh that {devices} devices cannot form; check that its "
                f"degrees multiply to {devices}."
            )

    def advance(self, config: Config, level: int, bound: float, mp: MeshProblem | None) -> None:
        """The next bound of `config` (back into the heap, or on at once where it dives), or
        its solve at level LP."""
        if level == FLOOR:
            found = self.ev.node_bound(config)
            if found is not None:  # None: the configuration has no plan
                self.push(max(bound, found), NODES, config, None)
        elif level == NODES and self.has_plan():
            forest = self.ev.forest_bound(config)
            if forest > bound:  # back in: it may have passed another's bound, or the cutoff
                self.push(forest, FOREST, config, None)
            else:
                self.bound_shared(config, bound)
        elif level in (NODES, FOREST):
            self.bound_shared(config, bound)
        else:
            assert mp is not None
            self.solve(config, bound, mp)

    def bound_shared(self, config: Config, bound: float) -> None:
        """Bound (2a) once there is a plan: back into the heap, or on to its LP bound (2) where
        it dives or did not rise; kept as solved where (2a) solved it."""
        shared = -math.inf
        if self.has_plan():
            shared = self.ev.shared_bound(config, self.time_left(), self.cutoff())
            plan = self.ev.shared_plan(config)
            if plan is not None:  # (2a) solved it
                self.keep(*plan, max(bound, shared))
                return
        if shared > bound and not self.dives(shared):
            self.push(shared, FOREST, config, None)  # (2a) may have passed another's bound
        else:
            self.bound_by_lp(config, max(bound, shared))

    def bound_by_lp(self, config: Config, bound: float) -> None:
        """Bound (2): back into the heap with the problem behind it, or on to its solve where it
        dives; kept as solved when the LP relaxation is integral; dropped if nothing fits, and
        then partial recomputation offered (`offer_partial`). Under `full:K`, an LP cut off at
        the cutoff may be one that does not fit (HiGHS's dual simplex passes the objective
        bound before it proves that): its memory share tells, and K + 1 on where it does not."""
        cutoff = self.cutoff()
        found = self.ev.lp_bound(config, self.time_left(), cutoff)
        if found is None:
            self.offer_partial(config, bound)
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
        partial = partial_blocks(config.recompute) is not None
        if partial and lp >= cutoff and not self.ev.fits(config, self.time_left()):
            self.offer_partial(config, bound)  # the cutoff hid that its LP does not fit

    def offer_partial(self, config: Config, bound: float) -> None:
        """Where nothing fits under none (or under `full:K`), and the space has none and full,
        `full:K` of the least K that may fit (`Evaluator.least_partial`: by its bytes at their
        fewest; after `full:K`, from K + 1 on its LP's memory share too), unless the bounds (1)
        and (1b) of the least K it could take already reach the cutoff (a larger K only adds
        recomputed forwards): at those bounds, on to its LP bound. So partial recomputation
        costs the search nothing where none fits, and one configuration (rarely more) where
        none does not (docs/planner.md, "Partial recomputation")."""
        modes = self.ev.request.space.recompute
        if "none" not in modes or "full" not in modes or self.ev.request.memory_limit_bytes is None:
            return
        count = partial_blocks(config.recompute)
        if config.recompute != "none" and count is None:
            return
        least = 1 if count is None else count + 1
        trial = replace(config, recompute=partial_mode(least))  # no K above it runs faster
        floor = max(bound, self.ev.node_bound(trial) or math.inf)
        if floor < self.cutoff() and self.has_plan():
            floor = max(floor, self.ev.forest_bound(trial))
        if floor >= self.cutoff():
            self.retired_bound = min(self.retired_bound, floor)
            return
        probe_s = None if count is None else self.time_left()  # K failed: on the LP
        found = self.ev.least_partial(config, least, probe_s)
        if found is not None:  # not counted in `configurations` (the space's, every process's)
            offered = replace(config, recompute=partial_mode(found))
            if found != least:  # its own bounds, at least the least K's
                floor = max(floor, self.ev.node_bound(offered) or math.inf)
                floor = max(floor, self.ev.forest_bound(offered)) if self.has_plan() else floor
            self.push(floor, FOREST, offered, None)

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


def _faster(a: Found, b: Found) -> bool:
    return a.prediction.step_time_s < b.prediction.step_time_s * (1 - 1e-12)
