"""One configuration's bounds and solve, with what configurations share cached.

Lives here: `Evaluator` (a search's request and what its configurations share: the graph of
each micro-batch count, each count cut into each stage count with its floors, the shared bound
(2a) per stage count, mesh and count; the prices per count and mesh, `problem.priced.
MeshPrices`, with its own caches) and its steps: the floor (0), node (1), forest (1b), shared
(2a) and LP (2) bounds of a configuration, which `full:K` may fit (`least_partial`), its solve
and its plan (docs/planner.md says why each is a bound). Lives elsewhere: the bounds' formulas
(`bounds`), the order and stop rule (`search.best_first`), the workers that run these steps in
other processes (`search.processes`), the problem itself (`problem`), what every search of a
request shares (`search.graph_memo.GraphMemo`: each graph's ties and structure, its cuts into
stages, what backward keeps, the boxing pricers per mesh).

Shared work: every search of a request shares the graph-only work (`GraphMemo`: counts whose
graphs have one structure, rebatched graphs, share the cut into stages and its counts, and
which values backward keeps; every mesh of a count shares what backward keeps; every count
shares the boxing pricer of a mesh); within a search, every count shares the parameters'
candidates; every problem of one (count, mesh) shares its candidates, boxing matrices and kept
bytes (`problem.priced.Priced`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from autosbp.capturing.graph import OpGraph
from autosbp.errors import MicroBatchError, PlanError
from autosbp.planner.bounds.forest import forest_bound
from autosbp.planner.bounds.lp import bound_mesh
from autosbp.planner.bounds.memory_floor import forest_least_bytes
from autosbp.planner.bounds.nodes import compute_floors, step_bound, unhidden_s
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.ilp.solvers import MEMORY_SLACK
from autosbp.planner.ilp.solving import least_memory_share
from autosbp.planner.memory.kept import Kept
from autosbp.planner.problem.build import MeshProblem, build_problem, memory_constraints
from autosbp.planner.problem.priced import MeshPrices, Priced
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.search.graph_memo import GraphFacts, GraphMemo
from autosbp.planner.search.nofit import Refusals
from autosbp.planner.space.configs import Config, LinkOf, divisors, mesh_shapes
from autosbp.planner.space.recomputation import (
    RECOMPUTE_MODES,
    block_modes,
    partial_blocks,
    partial_mode,
    recomputed,
)
from autosbp.planner.space.stages import StageSplit
from autosbp.planner.space.strategy import Space
from autosbp.planner.space.ties import ModeTies, TiedStages, tie_modes
from autosbp.planner.timing.candidates import Prices
from autosbp.planner.timing.predict import Prediction, predict
from autosbp.planner.timing.recipe import PLAIN, Recipe
from autosbp.planner.timing.zero_bubble_price import predict_zb1, weight_shares
from autosbp.sbp import Mesh

GraphFor = Callable[[int], OpGraph]  # micro-batch count -> the graph of one micro-batch


@dataclass(frozen=True)
class Request:
    """What a search plans: the graphs, batch, devices, prices and space it searches."""

    graph_for: GraphFor
    batch: int
    devices: int
    prices: Prices
    link_of: LinkOf
    space: Space
    optimizer: str
    memory_limit_bytes: float | None
    devices_per_node: int | None = None
    progress: Callable[[str], None] | None = None
    recipe: Recipe = PLAIN  # the sync's dtype and clipping (`timing.recipe`)


@dataclass(frozen=True)
class Stages:
    """One micro-batch count cut into one stage count: its graph, stages, ties, floors."""

    graph: OpGraph
    split: StageSplit
    tied: TiedStages
    copies: Counter[tuple[int, str]]
    floors: dict[str, np.ndarray]


@dataclass(frozen=True)
class SearchEffort:
    """What a search did and proved: its wall time, the configurations of its space, how many an
    LP bounded and how many it solved (an integral LP, or its MIP); the status and gap proven
    over the whole space; whether its time limit (`time_limit_s`) stopped it first; and when it
    found each better plan (`found`: seconds since the search began, the plan's step)."""

    seconds: float
    configurations: int
    bounded: int
    solved: int
    status: str = "optimal"
    gap: float = 0.0
    time_limit_s: float = math.inf
    limit_reached: bool = False
    found: tuple[tuple[float, float], ...] = ()

    def first_within(self, share: float, best_s: float) -> float | None:
        """Seconds until a plan within `share` of `best_s` was found (None: never)."""
        return next((t for t, s in self.found if s <= best_s * (1 + share)), None)

    def limit_note(self, step_time_s: float) -> str | None:
        """What a user must be told when the time limit stopped the search before it proved
        its plan (of `step_time_s`) optimal, in words; None when it did not."""
        if not self.limit_reached or self.status == "optimal":
            return None
        return (
            f"The time limit of {self.time_limit_s:g} s stopped the search before it proved "
            f"its plan optimal: the plan is the best found so far ({step_time_s:.2f} s per "
            f"step), at most {self.gap:.1%} slower than the best plan of the whole space (the "
            f"proven gap; {self.solved} of {self.configurations} configurations solved). To "
            f"close the gap, raise the limit: --time-limit-s {4 * self.time_limit_s:g} "
            "(time_limit_s= in the API)."
        )


@dataclass(frozen=True)
class Found:
    """A solved configuration: its problem, solution and prediction."""

    problem: MeshProblem
    solution: Solution
    prediction: Prediction
    graph: OpGraph
    effort: SearchEffort | None = None  # of the search that found it


@dataclass
class Evaluator:
    """A search's request and caches (the module docstring); `memo`: what it shares with the
    other searches of its request (a fresh one where none is given); `refusals` says what it
    could not use, `bounded` and `solved` count its LP bounds and solves."""

    request: Request
    memo: GraphMemo = field(default_factory=GraphMemo)
    refusals: Refusals = field(default_factory=Refusals)
    graphs: dict[int, OpGraph | None] = field(default_factory=dict)  # None: refused
    facts: dict[int, GraphFacts] = field(default_factory=dict)  # per count: ties, structure
    stages: dict[tuple[int, int], Stages] = field(default_factory=dict)
    priced: MeshPrices = field(init=False)  # per (count, mesh), shared across them
    shares: dict[int, dict[str, float]] = field(default_factory=dict)  # zb1: per graph id
    shared: dict[tuple[int, Mesh, int], float] = field(default_factory=dict)  # bound (2a)
    shared_plans: dict[tuple[int, Mesh, int], tuple[MeshProblem, Solution]] = field(
        default_factory=dict
    )  # where bound (2a) is a plan
    # per (count, stage count, `full:K` mode): its copies' counts by mode (`space.ties.tie_modes`)
    mode_ties: dict[tuple[int, int, str], ModeTies] = field(default_factory=dict)
    shares_of_limit: dict[Config, float] = field(default_factory=dict)  # `memory_share`
    bounded: int = 0
    solved: int = 0

    def __post_init__(self) -> None:
        space = self.request.space
        self.priced = MeshPrices(
            self.request.prices,
            space.allow,
            space.zero,
            space.may_gather,
            self.request.recipe,
            regathers=space.schedule != "zb1",
            sequence_parallel=space.sequence_parallel,
            tp_overlap=space.tp_overlap,
            pricers=self.memo.pricers_of(self.request.prices),
        )

    # ---- the space ---------------------------------------------------------------------------
    def counts(self) -> list[int]:
        """The micro-batch counts of the space whose micro-batches the data-parallel degree
        divides (refused, and said, when there is none)."""
        space, batch = self.request.space, self.request.batch
        counts = [c for c in space.micro_batches or divisors(batch) if self._splits(c)]
        if not counts:
            self.refusals.refuse(
                f"no micro-batch count cuts the batch of {batch} into micro-batches that "
                f"{space.data_parallel} data-parallel replicas divide; use a batch they divide"
            )
        return counts

    def _splits(self, count: int) -> bool:
        size, rest = divmod(self.request.batch, count)
        return not rest and size % self.request.space.data_parallel == 0

    def meshes(self, num_stages: int) -> list[Mesh]:
        """The stage meshes of `num_stages` stages the space allows."""
        r = self.request
        if r.devices % num_stages:
            self.refusals.refuse(f"{num_stages} stages do not divide {r.devices} devices")
            return []

        def stage_link(shape: tuple[int, ...], dim: int) -> str:
            return r.link_of((num_stages, *shape), dim + 1)

        meshes = mesh_shapes(r.devices // num_stages, stage_link, r.devices_per_node)
        meshes += [  # a hand plan's own meshes (3D: dp x cp x tp)
            Mesh(shape, tuple(f"d{i}" for i in range(len(shape))),
                 link_classes=tuple(stage_link(shape, d) for d in range(len(shape))))
            for shape in r.space.meshes
            if math.prod(shape) * num_stages == r.devices
        ]  # fmt: skip
        return [m for m in meshes if r.space.mesh_ok(m)]

    def stages_of(self, count: int, num_stages: int) -> Stages | None:
        """The graph of `count` cut into `num_stages` stages (cached), or None if refused."""
        key = (count, num_stages)
        if key not in self.stages:
            graph = self.graph_of(count)
            if graph is None:
                return None
            try:
                split, tied = self.memo.cut(graph, num_stages)
            except PlanError as exc:
                self.refusals.refuse(str(exc))
                return None
            copies = tied.copies()
            representatives: Collection[str] = {r for _, r in copies}
            floors = compute_floors(
                graph, self.request.prices, self.request.devices // num_stages, representatives,
                self.backward_share(count),
            )  # fmt: skip
            self.stages[key] = Stages(graph, split, tied, copies, floors)
        return self.stages[key]

    def graph_of(self, count: int) -> OpGraph | None:
        if count not in self.graphs:
            try:
                graph: OpGraph | None = self.request.graph_for(count)
            except MicroBatchError as exc:
                self.refusals.refuse(f"{count} micro-batches: {exc}")
                graph = None
            self.graphs[count] = graph
            if graph is not None:
                self.facts[count] = self.memo.facts(graph)
        return self.graphs[count]

    # ---- bounds ------------------------------------------------------------------------------
    def floor_bound(self, stages: Stages, config: Config) -> float:
        """Bound (0)."""
        return step_bound(
            stages.graph, stages.copies, config.num_stages, stages.floors, config.count,
            config.recompute, drain=self.drains, again=self._again(config),
        )  # fmt: skip

    def node_bound(self, config: Config) -> float | None:
        """Bound (1), or None if a node can take no signature on this mesh."""
        stages, priced = self.stages[(config.count, config.num_stages)], self.priced_of(config)
        stuck = [r for _, r in stages.copies if not len(priced.strategies[r].candidates)]
        if stuck:
            self.refusals.no_candidates(stages.graph, stuck)
            return None
        times = {r: unhidden_s(priced.strategies[r]) for _, r in stages.copies}
        return step_bound(
            stages.graph, stages.copies, config.num_stages, times, config.count,
            config.recompute, drain=self.drains, again=self._again(config),
        )  # fmt: skip

    def forest_bound(self, config: Config) -> float:
        """Bound (1b): (1) with each stage's boxing, along a spanning forest of its edges."""
        stages, priced = self.stages[(config.count, config.num_stages)], self.priced_of(config)
        return forest_bound(
            stages.tied, priced, config.num_stages, config.count, config.recompute,
            self.request.prices.overlap_efficiency, drain=self.drains,
            modes=self.modes_of(config),
        )  # fmt: skip

    @property
    def drains(self) -> bool:  # do the schedule's path bounds drain (`bounds.nodes.path_bound`)?
        return self.request.space.schedule != "zb1"

    def shared_bound(self, config: Config, time_left_s: float, cutoff: float) -> float:
        """Bound (2a), of every recomputation mode of this stage count, mesh and count at once:
        the LP relaxation of the least recomputing mode of the space without memory
        constraints (inf when nothing beats `cutoff`); -inf when no other mode could use it.
        Where that LP is integral and its plan fits, it is the least mode's plan
        (`shared_plan`): the optimum of a relaxation, and feasible."""
        key = (config.num_stages, config.mesh, config.count)
        if key not in self.shared:
            if len(self.request.space.recompute) == 1:
                return -math.inf
            least = min(self.request.space.recompute, key=RECOMPUTE_MODES.index)
            mp = self.build(replace(config, recompute=least), memory_limit_bytes=None)
            self.bounded += 1
            found = bound_mesh(mp, time_left_s, cutoff)
            self.shared[key] = math.inf if found is None else found[0]
            if found is not None and found[1] is not None and self._fits(mp, found[1]):
                self.solved += 1
                self.shared_plans[key] = (mp, found[1])
        return self.shared[key]

    def shared_plan(self, config: Config) -> tuple[MeshProblem, Solution] | None:
        """The plan bound (2a) found for `config`, when it is of `config`'s mode."""
        found = self.shared_plans.get((config.num_stages, config.mesh, config.count))
        return found if found is not None and found[0].recompute == config.recompute else None

    def _fits(self, mp: MeshProblem, solution: Solution) -> bool:
        limit = self.request.memory_limit_bytes
        memory = memory_constraints(mp.stage_costs, mp.virtual_stages)
        return limit is None or all(c.used_bytes(solution.choice) <= limit for c in memory)

    def lp_bound(
        self, config: Config, time_left_s: float, cutoff: float
    ) -> tuple[float, MeshProblem, Solution | None] | None:
        """Bound (2) and the problem behind it, with its optimum when the LP is integral; None
        when nothing fits."""
        r = self.request
        mp = self.build(config, r.memory_limit_bytes)
        if r.memory_limit_bytes is not None and self.refusals.overflows(mp):
            return None
        self.bounded += 1
        found = bound_mesh(mp, time_left_s, cutoff)
        if found is None:
            return None
        lp, solution = found
        if solution is not None:
            self.solved += 1
        return lp, mp, solution

    def solve(self, mp: MeshProblem, time_left_s: float, cutoff: float) -> Solution | None:
        """The configuration's best plan, None if nothing beats `cutoff` (SolverTimeoutError
        when out of time)."""
        if self.request.progress:
            self.request.progress(f"solving {_describe(mp)}")
        self.solved += 1
        return solve_mesh(mp, time_left_s, cutoff)

    # ---- problems and plans ------------------------------------------------------------------
    def priced_of(self, config: Config) -> Priced:
        """The prices of `config`'s graph on its stage mesh (`problem.priced.MeshPrices`)."""
        stages = self.stages[(config.count, config.num_stages)]
        return self.priced.of(
            config.count, config.mesh, stages.graph, stages.tied.representative,
            lambda: self.kept_of(config.count),
        )  # fmt: skip

    def backward_share(self, count: int) -> Mapping[str, float]:
        """`Kept.backward_share` of the graph of `count` (`memory.kept.KeptMemo`)."""
        return self.memo.kept.backward_share(*self._kept_key(count))

    def kept_of(self, count: int) -> dict[str, Kept]:
        """What backward keeps in the graph of `count` under each mode of the space
        (`memory.kept.KeptMemo`, shared by the request's searches)."""
        return self.memo.kept.of(*self._kept_key(count), self.request.space.recompute)

    def _kept_key(self, count: int) -> tuple[OpGraph, Hashable, dict[str, str]]:
        facts = self.facts[count]
        return facts.graph, facts.structure, facts.tied.representative

    def build(self, config: Config, memory_limit_bytes: float | None) -> MeshProblem:
        r = self.request
        stages = self.stages[(config.count, config.num_stages)]
        if r.progress:
            r.progress(f"bounding {config.describe()}")
        return build_problem(
            stages.graph, config.mesh, r.prices, optimizer=r.optimizer,
            memory_limit_bytes=memory_limit_bytes, allow=r.space.allow,
            micro_batches=config.count, split=stages.split, recompute=config.recompute,
            stage_link=r.link_of((config.num_stages, config.mesh.size), 0),
            priced=self.priced_of(config), tied=stages.tied,
            virtual_stages=r.space.virtual_stages,
            schedule=r.space.schedule, modes=self.modes_of(config),
        )  # fmt: skip

    def _again(self, config: Config) -> Counter[tuple[int, str]] | None:
        """Under `full:K`, per (stage, representative) its copies that recompute (the bounds'
        `again`); else None."""
        modes = self.modes_of(config)
        if modes is None:
            return None
        again: Counter[tuple[int, str]] = Counter()
        graph = self.stages[(config.count, config.num_stages)].graph
        for (r, s, _, own, _), n in modes.nodes.items():
            if own == "full" and recomputed(graph, r, "full"):  # not an op writing its input
                again[(s, r)] += n
        return again

    def least_partial(self, config: Config, least: int, probe_s: float | None = None) -> int | None:
        """The least K >= `least` for which `full:K` of `config` may fit, below the most blocks
        of a stage (there, it is full); None if none may. Memory falls as K grows: first a
        bisection on its bytes at their fewest (`overflows`; no LP). Given `probe_s` (after
        `full:K` for K = `least` - 1 did not fit at its LP; the time each LP may take), then
        the least K from there that fits at its LP relaxation (`memory_share`), each share
        aiming the next K (`_least_fitting`: first by the forest bound's fall per K, then by
        the shares'): at most AIMED + log2(blocks) LPs, 3 on GPT-3's stage of 96 blocks."""
        split = self.stages[(config.count, config.num_stages)].split
        high = max(len(blocks) for blocks in split.blocks) - 1
        limit = self.request.memory_limit_bytes

        def partial(count: int) -> Config:
            return replace(config, recompute=partial_mode(count))

        floor = _least_passing(
            least, high, lambda k: not self.overflows(self.build(partial(k), limit))
        )
        if probe_s is None or floor is None:
            return floor
        fall = (self.forest_share(partial(floor)) - self.forest_share(partial(high))) / max(
            high - floor, 1
        )
        known = (least - 1, self.shares_of_limit.get(partial(least - 1), math.inf))  # K failed
        return _least_fitting(
            floor, high, lambda k: self.memory_share(partial(k), probe_s), fall, known
        )

    def overflows(self, mp: MeshProblem) -> bool:
        """Does some stage of `mp` overflow at its fewest bytes: each node alone
        (`Refusals.overflows`, which remembers the closest problem), then its nodes with a
        spanning forest of its edges (`bounds.memory_floor.forest_least_bytes`)?"""
        return self.refusals.overflows(mp) or any(
            forest_least_bytes(mp.problem, c) > c.limit_bytes for c in mp.problem.memory
        )

    def forest_share(self, config: Config) -> float:
        """The fullest stage's forest bound (`bounds.memory_floor`) over its limit."""
        mp = self.build(config, self.request.memory_limit_bytes)
        return max(
            (forest_least_bytes(mp.problem, c) / c.limit_bytes for c in mp.problem.memory),
            default=0.0,
        )

    def memory_share(self, config: Config, time_left_s: float) -> float:
        """The least share of its limit that the fullest stage of `config` takes at the LP
        relaxation (`ilp.solving.least_memory_share`; cached): at most FITS where it fits;
        0 where the LP ran out of time (it may fit: its LP bound decides)."""
        if config not in self.shares_of_limit:
            mp = self.build(config, self.request.memory_limit_bytes)
            share = least_memory_share(mp.problem, time_limit_s=time_left_s)
            self.shares_of_limit[config] = 0.0 if share is None else share
        return self.shares_of_limit[config]

    def fits(self, config: Config, time_left_s: float) -> bool:
        """Does `config` fit at its LP relaxation (`memory_share`)?"""
        return self.memory_share(config, time_left_s) <= FITS

    def modes_of(self, config: Config) -> ModeTies | None:
        """Under `full:K`, the counts of `config`'s copies by mode (cached); else None."""
        if partial_blocks(config.recompute) is None:
            return None
        key = (config.count, config.num_stages, config.recompute)
        if key not in self.mode_ties:
            split = self.stages[(config.count, config.num_stages)].split
            per_block = block_modes(config.recompute, split.blocks)
            self.mode_ties[key] = tie_modes(self.facts[config.count].tied, split, per_block)
        return self.mode_ties[key]

    def found(self, mp: MeshProblem, solution: Solution) -> Found:
        """`solution` priced as its schedule runs (`timing.predict.predict`, `predict_zb1`)."""
        assert mp.graph is not None, "the search builds its problems with their graph"
        if mp.schedule == "zb1":  # its graph is one of `graphs`: a stable id
            if id(mp.graph) not in self.shares:
                self.shares[id(mp.graph)] = weight_shares(mp.graph)
            prediction = predict_zb1(mp, solution, self.shares[id(mp.graph)])
            return Found(mp, solution, prediction, mp.graph)
        return Found(mp, solution, predict(mp, solution), mp.graph)

    def rebuilt(
        self, config: Config, choice: dict[str, int], known: Prediction | None = None
    ) -> Found:
        """The plan of `config` with this choice (solved in another process, or here without
        memory constraints). `known`: the choice's prediction where this process made it; the
        memory limit changes only the constraints' limits, never a stage's times or bytes, so
        it stands (the simulation of a deep pipeline is the costliest step of a search)."""
        if self.stages_of(config.count, config.num_stages) is None:
            raise PlanError(f"{config.describe()}: refused where another process solved it")
        mp = self.build(config, self.request.memory_limit_bytes)
        solution = Solution(choice, mp.problem.objective(choice), "optimal", 0.0, 0.0)
        if known is None:
            return self.found(mp, solution)
        assert mp.graph is not None, "the search builds its problems with their graph"
        return Found(mp, solution, known, mp.graph)


def _least_passing(low: int, high: int, passes: Callable[[int], bool]) -> int | None:
    """The least K in `low` .. `high` that `passes` (every K above it passes too), or None."""
    found = None
    while low <= high:
        middle = (low + high) // 2
        if passes(middle):
            found, high = middle, middle - 1
        else:
            low = middle + 1
    return found


FITS = 1 - MEMORY_SLACK  # the most share of its limit a memory row of the LP may take
AIMED = 3  # Ks aimed by the fall of the shares before halving (GPT-3 175B's stage of 96 blocks
# on 1024 A100s, after full:44 did not fit at 1.09: full:50, 49 and 48, measured)


def _least_fitting(
    low: int, high: int, share: Callable[[int], float], fall: float, known: tuple[int, float]
) -> int | None:
    """The least K in `low` .. `high` whose `share` is at most FITS, or None. Shares fall as K
    grows: by about `fall` per K at first, then as the last two fell. `known`: a K below `low`
    and its share (inf where unknown: then `low` first). The first AIMED Ks go where a line at
    that fall crosses FITS, within what is known so far; the rest halve what is left."""
    below, above = low - 1, high + 1
    k, value = known
    for probe in itertools.count():
        if below + 1 >= above:
            break
        if probe == 0 and not math.isfinite(value):
            aim = below + 1  # nothing to aim by: the least K its bytes allow
        elif fall > 0 and probe < AIMED and math.isfinite(value):
            step = (value - FITS) / fall
            aim = k + math.ceil(step) if value > FITS else k - int(-step)
        else:
            aim = (below + above) // 2
        last_k, last_value = k, value
        k = min(max(aim, below + 1), above - 1)
        value = share(k)
        if value <= FITS:
            above = k
        else:
            below = k
        if math.isfinite(value) and math.isfinite(last_value) and last_value != value:
            fall = (last_value - value) / (k - last_k)
    return above if above <= high else None


def _describe(mp: MeshProblem) -> str:
    return (
        f"stages {mp.split.num_stages}, mesh {'x'.join(map(str, mp.mesh.shape))}, "
        f"{mp.micro_batches} micro-batches, recompute {mp.recompute}"
    )
