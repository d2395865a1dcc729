"""Search: the fastest plan over every configuration (stage count, stage mesh, micro-batch count,
recomputation mode), best-first by proven lower bounds, each configuration solved exactly.

Lives here: the search itself (`search`: the bounds in order, the stop rule, the proven gap).
Lives elsewhere: the space's meshes, counts and configurations (`space`, re-exported here), the
cheap bounds' formulas (`bounds`), the ILP of one
configuration, its LP bound and its prediction (`problem`, `objective`), hand-plan restrictions
(`strategies`), why nothing fits (`nofit`), the winner as a `Plan` (`assemble`).

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

The order (best-first). Every configuration enters a heap at its floor bound. The search pops
the least bound; a configuration at level 0 or 1 gets its next bound (the largest bound so far
is kept) and goes back; one at level 2 is solved (`problem.solve_mesh`, to MIP_GAP), its plan
priced by `predict` and kept if faster. It stops when the least bound in the heap reaches the
best step found x (1 - MIP_GAP): every configuration left is then within MIP_GAP of it. No
configuration is skipped for any other reason. A bound (or a solve) that reaches that cutoff
retires its configuration with the cutoff as its bound; a solved one retires with its ILP's
proven bound (objective x (1 - its gap)).

The gap. Over the whole space no plan predicts below L = the least bound of every configuration
still in the heap or retired; `gap` = (best - L) / best, and `status` is "optimal" when gap <=
MIP_GAP. On the time limit the search stops where it is: "feasible" and the gap proven so far.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field, replace

import numpy as np

from autosbp.capturing.graph import OpGraph
from autosbp.errors import MicroBatchError, NoFitError, PlanError
from autosbp.planner.bounds import compute_floors, step_bound, unhidden_s
from autosbp.planner.candidates import BoxingPricer, NodeStrategies, Prices
from autosbp.planner.hand_plans import Space
from autosbp.planner.ilp import SolverTimeoutError
from autosbp.planner.ilp_problem import Solution
from autosbp.planner.nofit import Refusals
from autosbp.planner.pipeline import RECOMPUTE_MODES, StageSplit, split_stages
from autosbp.planner.problem import (
    MIP_GAP,
    MeshProblem,
    Prediction,
    Priced,
    bound_mesh,
    build_problem,
    lower_bound_of,
    predict,
    price_graph,
    solve_mesh,
)
from autosbp.planner.reduce import TiedGraph, TiedStages, tie_graph, tie_stages
from autosbp.planner.space import (
    Config,
    LinkOf,
    divisors,
    mesh_shapes,
    powers_of_two_dividing,
    structure,
)
from autosbp.sbp import Mesh

__all__ = [
    "Config", "Found", "GraphFor", "LinkOf", "SearchEffort", "divisors", "mesh_shapes",
    "powers_of_two_dividing", "search",
]  # fmt: skip

GraphFor = Callable[[int], OpGraph]  # micro-batch count -> the graph of one micro-batch


@dataclass(frozen=True)
class SearchEffort:
    """What a search did and proved: its wall time, the configurations of its space, how many an
    LP bounded and how many it solved (an integral LP, or its MIP); the status and gap proven
    over the whole space."""

    seconds: float
    configurations: int
    bounded: int
    solved: int
    status: str = "optimal"
    gap: float = 0.0


@dataclass(frozen=True)
class Found:
    problem: MeshProblem
    solution: Solution
    prediction: Prediction
    graph: OpGraph
    effort: SearchEffort | None = None  # of the search that found it


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
) -> Found:
    """The fastest plan (by `predict`) over the configurations of `space` (the module
    docstring), within MIP_GAP of the best of the whole space unless `time_limit_s` (the whole
    search's) runs out first; its `effort` says which. NoFitError if no configuration has a
    plan, PlanError if the time ran out before any plan was found."""
    state = _Search(
        graph_for, batch, devices, prices, link_of, space, optimizer, memory_limit_bytes,
        time.perf_counter() + time_limit_s, time_limit_s, devices_per_node, progress,
    )  # fmt: skip
    return state.run()


@dataclass(frozen=True)
class _Stages:
    """One micro-batch count cut into one stage count: its graph, stages, ties, floors."""

    graph: OpGraph
    split: StageSplit
    tied: TiedStages
    copies: Counter[tuple[int, str]]
    floors: dict[str, np.ndarray]


FLOOR, NODES, LP = 0, 1, 2  # the bound a configuration in the heap holds (the module docstring)


@dataclass
class _Search:
    """One `search`: its request, then its state: the heap of configurations by bound, the
    best plan so far, the least bound of retired configurations, caches, and what it refused.
    Bound (2a) is computed once a plan is known (before, nothing is cut: it would only cost)."""

    graph_for: GraphFor
    batch: int
    devices: int
    prices: Prices
    link_of: LinkOf
    space: Space
    optimizer: str
    memory_limit_bytes: float | None
    deadline: float
    time_limit_s: float
    devices_per_node: int | None
    progress: Callable[[str], None] | None
    heap: list[tuple[float, int, int, Config, MeshProblem | None]] = field(default_factory=list)
    best: Found | None = None
    retired_bound: float = math.inf
    refusals: Refusals = field(default_factory=Refusals)
    graphs: dict[int, OpGraph | None] = field(default_factory=dict)  # None: refused
    ties: dict[int, TiedGraph] = field(default_factory=dict)
    stages: dict[tuple[int, int], _Stages] = field(default_factory=dict)
    structures: dict[int, Hashable] = field(default_factory=dict)  # per count (`space.structure`)
    cuts: dict[tuple[Hashable, int], tuple[StageSplit, TiedStages]] = field(default_factory=dict)
    priced: dict[tuple[int, Mesh], Priced] = field(default_factory=dict)
    pricers: dict[Mesh, BoxingPricer] = field(default_factory=dict)
    parameters: dict[Hashable, NodeStrategies] = field(default_factory=dict)  # `price_graph`
    kept: dict[int, dict] = field(default_factory=dict)  # per count: what backward keeps
    shared: dict[tuple[int, Mesh, int], float] = field(default_factory=dict)  # bound (2a)
    configurations: int = 0
    bounded: int = 0
    solved: int = 0
    timed_out: bool = False
    order: itertools.count = field(default_factory=itertools.count)  # ties: the space's order

    def run(self) -> Found:
        start = time.perf_counter()
        self.enter_space()
        while self.heap and self.heap[0][0] < self.cutoff():
            if time.perf_counter() >= self.deadline:
                self.timed_out = True
                break
            bound, negative_level, _, config, problem = heapq.heappop(self.heap)
            self.advance(config, -negative_level, bound, problem)
        if self.best is None:
            if self.timed_out:
                raise PlanError(
                    f"the search found no plan within {self.time_limit_s:g} s; raise the time "
                    "limit (--time-limit-s)."
                )
            raise NoFitError(self.refusals.message(self.memory_limit_bytes))
        least = min(self.retired_bound, self.heap[0][0] if self.heap else math.inf)
        best_s = self.best.prediction.step_time_s
        gap = max(0.0, (best_s - least) / best_s)
        status = "optimal" if gap <= MIP_GAP * (1 + 1e-9) else "feasible"
        effort = SearchEffort(
            time.perf_counter() - start, self.configurations, self.bounded, self.solved,
            status, gap,
        )  # fmt: skip
        return replace(self.best, effort=effort)

    def cutoff(self) -> float:
        """No configuration bounded at or above this can improve the best plan by MIP_GAP."""
        return self.best.prediction.step_time_s * (1 - MIP_GAP) if self.best else math.inf

    def push(self, bound: float, level: int, config: Config, mp: MeshProblem | None) -> None:
        if bound >= self.cutoff():
            self.retired_bound = min(self.retired_bound, bound)
        else:  # deeper levels first on equal bounds, then the order of the space
            heapq.heappush(self.heap, (bound, -level, next(self.order), config, mp))

    def enter_space(self) -> None:
        """Every configuration of the space, at its floor bound."""
        counts = [c for c in self.space.micro_batches or divisors(self.batch) if self.splits(c)]
        if not counts:
            self.refusals.refuse(
                f"no micro-batch count cuts the batch of {self.batch} into micro-batches that "
                f"{self.space.data_parallel} data-parallel replicas divide; use a batch they divide"
            )
        for num_stages in self.space.stage_counts:
            meshes = self.meshes(num_stages)
            for count in counts:
                if num_stages > 1 and count < num_stages:
                    continue
                stages = self.stages_of(count, num_stages) if meshes else None
                if stages is None:
                    continue
                for mode in self.space.recompute:
                    floor = step_bound(
                        stages.graph, stages.copies, num_stages, stages.floors, count, mode
                    )
                    for mesh in meshes:
                        self.configurations += 1
                        config = Config(num_stages, mesh, count, mode)
                        self.heap.append((floor, -FLOOR, next(self.order), config, None))
        heapq.heapify(self.heap)
        if not self.configurations and not self.refusals.refused:
            raise PlanError(
                f"the strategy needs a mesh that {self.devices} devices cannot form; check that "
                f"its degrees multiply to {self.devices}."
            )

    def splits(self, count: int) -> bool:
        """Does `count` cut the batch into micro-batches the data-parallel degree divides?"""
        size, rest = divmod(self.batch, count)
        return not rest and size % self.space.data_parallel == 0

    def meshes(self, num_stages: int) -> list[Mesh]:
        if self.devices % num_stages:
            self.refusals.refuse(f"{num_stages} stages do not divide {self.devices} devices")
            return []
        stage_devices = self.devices // num_stages

        def stage_link(shape: tuple[int, ...], dim: int) -> str:
            return self.link_of((num_stages, *shape), dim + 1)

        return [
            m
            for m in mesh_shapes(stage_devices, stage_link, self.devices_per_node)
            if self.space.mesh_ok(m)
        ]

    def stages_of(self, count: int, num_stages: int) -> _Stages | None:
        """The graph of `count` cut into `num_stages` stages (cached), or None if refused.
        Counts whose graphs have one structure and the same ties (rebatched graphs) share
        the cut and its counts; the floors are each count's own."""
        key = (count, num_stages)
        if key not in self.stages:
            graph = self.graph_of(count)
            if graph is None:
                return None
            shape = (self.structures[count], num_stages)
            if shape not in self.cuts:
                try:
                    split = split_stages(graph, num_stages)
                except PlanError as exc:
                    self.refusals.refuse(str(exc))
                    return None
                self.cuts[shape] = (split, tie_stages(self.ties[count], split))
            split, tied = self.cuts[shape]
            copies = tied.copies()
            representatives: Collection[str] = {r for _, r in copies}
            floors = compute_floors(graph, self.prices, self.devices // num_stages, representatives)
            self.stages[key] = _Stages(graph, split, tied, copies, floors)
        return self.stages[key]

    def graph_of(self, count: int) -> OpGraph | None:
        if count not in self.graphs:
            try:
                graph: OpGraph | None = self.graph_for(count)
            except MicroBatchError as exc:
                self.refusals.refuse(f"{count} micro-batches: {exc}")
                graph = None
            self.graphs[count] = graph
            if graph is not None:
                tied = self.ties[count] = tie_graph(graph)
                self.structures[count] = structure(tied)
        return self.graphs[count]

    def advance(self, config: Config, level: int, bound: float, mp: MeshProblem | None) -> None:
        """The next bound of `config` (back into the heap), or its solve at level LP."""
        if level == FLOOR:
            found = self.node_bound(config)
            if found is not None:  # None: the configuration has no plan
                self.push(max(bound, found), NODES, config, None)
        elif level == NODES:
            shared = self.shared_bound(config)
            if shared > bound:  # back into the heap: (2a) may have passed another's bound
                self.push(shared, NODES, config, None)
            else:
                self.bound_by_lp(config, bound)
        else:
            assert mp is not None
            self.solve(config, bound, mp)

    def priced_of(self, config: Config) -> Priced:
        key = (config.count, config.mesh)
        if key not in self.priced:
            stages = self.stages[(config.count, config.num_stages)]
            pricer = self.pricers.setdefault(config.mesh, BoxingPricer(self.prices, config.mesh))
            self.priced[key] = price_graph(
                stages.graph, config.mesh, self.prices, self.space.allow, pricer,
                stages.tied.representative, self.parameters, self.kept.setdefault(config.count, {}),
            )  # fmt: skip
        return self.priced[key]

    def node_bound(self, config: Config) -> float | None:
        """Bound (1), or None if a node can take no signature on this mesh."""
        stages, priced = self.stages[(config.count, config.num_stages)], self.priced_of(config)
        stuck = [r for _, r in stages.copies if not len(priced.strategies[r].candidates)]
        if stuck:
            self.refusals.no_candidates(stages.graph, stuck)
            return None
        times = {r: unhidden_s(priced.strategies[r]) for _, r in stages.copies}
        return step_bound(
            stages.graph, stages.copies, config.num_stages, times, config.count, config.recompute
        )

    def shared_bound(self, config: Config) -> float:
        """Bound (2a), of every recomputation mode of this stage count, mesh and count at once:
        the LP relaxation of the least recomputing mode without memory constraints. Computed
        once a plan is known (it only helps against a cutoff); -inf before, or when no other
        mode of the space could use it."""
        key = (config.num_stages, config.mesh, config.count)
        if key not in self.shared:
            if self.best is None or len(self.space.recompute) == 1:
                return -math.inf
            least = min(self.space.recompute, key=RECOMPUTE_MODES.index)
            mp = self.build(replace(config, recompute=least), memory_limit_bytes=None)
            self.bounded += 1
            found = lower_bound_of(mp, self.time_left(), self.cutoff())
            self.shared[key] = math.inf if found is None else found
        return self.shared[key]

    def build(self, config: Config, memory_limit_bytes: float | None) -> MeshProblem:
        stages = self.stages[(config.count, config.num_stages)]
        if self.progress:
            self.progress(f"bounding {config.describe()}")
        return build_problem(
            stages.graph, config.mesh, self.prices, optimizer=self.optimizer,
            memory_limit_bytes=memory_limit_bytes, allow=self.space.allow,
            micro_batches=config.count, split=stages.split, recompute=config.recompute,
            stage_link=self.link_of((config.num_stages, config.mesh.size), 0),
            priced=self.priced_of(config), tied=stages.tied,
        )  # fmt: skip

    def bound_by_lp(self, config: Config, bound: float) -> None:
        """Bound (2): back into the heap with the problem behind it; kept as solved when the
        LP relaxation is integral (its optimum); dropped if nothing fits."""
        mp = self.build(config, self.memory_limit_bytes)
        if self.memory_limit_bytes is not None and self.refusals.overflows(mp):
            return
        self.bounded += 1
        found = bound_mesh(mp, self.time_left(), self.cutoff())
        if found is None:
            return
        lp, solution = found
        if solution is None:
            self.push(max(bound, lp), LP, config, mp)
        else:  # solved by its LP
            self.solved += 1
            self.keep(mp, solution, max(bound, min(lp, solution.objective)))

    def solve(self, config: Config, bound: float, mp: MeshProblem) -> None:
        if self.progress:
            self.progress(f"solving {config.describe()}")
        cutoff = self.cutoff()
        self.solved += 1
        try:
            solution = solve_mesh(mp, self.time_left(), cutoff)
        except SolverTimeoutError:
            self.push(bound, LP, config, mp)  # still open: the search is out of time
            self.deadline = time.perf_counter()
            return
        if solution is None:
            self.push(max(bound, cutoff), LP, config, mp)  # nothing below the cutoff
        else:
            self.keep(mp, solution, max(bound, solution.objective * (1 - solution.gap)))

    def keep(self, mp: MeshProblem, solution: Solution, proven: float) -> None:
        """A solved configuration: its plan becomes the best if faster; it retires with the
        bound its solve proved."""
        assert mp.graph is not None, "the search builds its problems with their graph"
        found = Found(mp, solution, predict(mp, solution), mp.graph)
        if self.best is None or _faster(found, self.best):
            self.best = found
        self.retired_bound = min(self.retired_bound, proven)

    def time_left(self) -> float:
        return max(self.deadline - time.perf_counter(), 1e-3)


def _faster(a: Found, b: Found) -> bool:
    return a.prediction.step_time_s < b.prediction.step_time_s * (1 - 1e-12)
