"""Search: over stage counts, stage meshes, micro-batch counts and recomputation modes, build
the strategy ILP of each configuration, solve it, keep the fastest plan.

Lives here: mesh shapes worth trying, the loops over configurations (`search`), the bounds that
skip configurations before pricing or solving them (`compute_floors`, `step_bound`, then the LP
cutoff of `problem.lower_bound_of`), the message when nothing fits. Lives elsewhere: the
Problem of one configuration and its prediction (`problem`), hand-plan restrictions
(`strategies`), turning the winner into a `Plan` (`assemble`).

The outer loops are heuristic where stated in `search`; each configuration is solved exactly.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import NoFitError, PlanError
from autosbp.plan import format_bytes
from autosbp.planner.costs import (
    BACKWARD_FACTOR,
    BoxingPricer,
    NodeStrategies,
    Prices,
    returns_view,
)
from autosbp.planner.ilp_problem import Solution
from autosbp.planner.pipeline import StageSplit, recomputed, split_stages
from autosbp.planner.problem import (
    MeshProblem,
    Prediction,
    Priced,
    build_problem,
    lower_bound_of,
    predict,
    price_graph,
    solve_mesh,
)
from autosbp.planner.reduce import TiedGraph, TiedStages, tie_graph, tie_stages
from autosbp.planner.strategies import Space
from autosbp.sbp import Mesh

LinkOf = Callable[[tuple[int, ...], int], str]  # (mesh shape, mesh dim) -> link class name


def mesh_shapes(devices: int, link_of: LinkOf, devices_per_node: int | None = None) -> list[Mesh]:
    """The 1D mesh and the 2D factorizations of `devices` (row-major over node-major device
    ids) whose inner dim stays inside a node (divides `devices_per_node`; every factorization
    when None); each mesh dim gets the link class its groups cross."""
    inner_ok = (
        (lambda n: True) if devices_per_node is None else (lambda n: devices_per_node % n == 0)
    )
    shapes = [(devices,)] + [
        (devices // inner, inner)
        for inner in range(2, devices)
        if devices % inner == 0 and inner_ok(inner)
    ]
    return [
        Mesh(
            shape,
            tuple(f"d{i}" for i in range(len(shape))),
            link_classes=tuple(link_of(shape, d) for d in range(len(shape))),
        )
        for shape in shapes
    ]


@dataclass(frozen=True)
class Found:
    problem: MeshProblem
    solution: Solution
    prediction: Prediction
    graph: OpGraph
    effort: SearchEffort | None = None  # of the search that found it


@dataclass(frozen=True)
class SearchEffort:
    """What a search did: its wall time, the configurations it reached (stage count, stage
    mesh, micro-batch count, recomputation), how many of them an LP bounded (the rest were cut
    by the cheaper bounds or overflowed memory) and how many it solved."""

    seconds: float
    configurations: int
    bounded: int
    solved: int


IDLE_STAGE_COUNTS = 2  # see `search` (measured on GPT-3: the best stage count is the first)


GraphFor = Callable[[int], OpGraph]  # micro-batch count -> the graph of one micro-batch


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
    """The fastest plan (by `predict`) over stage counts x stage meshes x micro-batch counts x
    recomputation modes, each signature choice from the ILP.

    Stage counts are tried in increasing order, and the search ends after IDLE_STAGE_COUNTS
    of them in a row found nothing faster (the step time is taken to be unimodal in the stage
    count). Micro-batch counts are tried in increasing order. With one stage, more micro-batches only
    save memory, so the search stops at the first count where a plan fits without
    recomputation. With stages, more micro-batches shrink the bubble but add per-micro-batch
    overheads: the search stops once a count is slower than the one before (the step time is
    taken to be unimodal in the count; a heuristic, stated in the plan's breakdown).
    """
    return _Search(
        graph_for, batch, devices, prices, link_of, space, optimizer, memory_limit_bytes,
        time_limit_s, devices_per_node, progress,
    ).run()  # fmt: skip


@dataclass(frozen=True)
class _AtCount:
    """One micro-batch count of one stage count: its graph, stages, ties and compute floors."""

    count: int
    num_stages: int
    graph: OpGraph
    split: StageSplit
    tied: TiedStages
    copies: Counter[tuple[int, str]]
    floors: dict[str, np.ndarray]


@dataclass
class _Outcome:
    """What one micro-batch count gave: its fastest plan, whether a plan fit without
    recomputation, whether a bound cut a configuration (the loops' stop rules read these)."""

    best_here: Found | None = None
    fits_plainly: bool = False
    cut: bool = False


@dataclass
class _Search:
    """One `search`: its request, then its state: the best plan so far, what was tried and
    refused, the boxing pricers (one per stage mesh) and ties (one per micro-batch count) it
    reuses, and its effort."""

    graph_for: GraphFor
    batch: int
    devices: int
    prices: Prices
    link_of: LinkOf
    space: Space
    optimizer: str
    memory_limit_bytes: float | None
    time_limit_s: float
    devices_per_node: int | None
    progress: Callable[[str], None] | None
    best: Found | None = None
    tried: list[MeshProblem] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    pricers: dict[Mesh, BoxingPricer] = field(default_factory=dict)
    graphs_tied: dict[int, TiedGraph] = field(default_factory=dict)
    reached: int = 0
    bounded: int = 0
    solved: int = 0

    def run(self) -> Found:
        start = time.perf_counter()
        idle = 0  # stage counts in a row that found nothing faster
        for num_stages in self.space.stage_counts:
            if self.devices % num_stages:
                self.refused.append(f"{num_stages} stages do not divide {self.devices} devices")
                continue
            if idle >= IDLE_STAGE_COUNTS:
                break
            best_before = self.best
            self.stage_count(num_stages)
            idle = idle + 1 if self.best is not None and self.best is best_before else 0
        if self.best is None and not self.tried and not self.refused:
            raise PlanError(
                f"the strategy needs a mesh that {self.devices} devices cannot form; check that "
                f"its degrees multiply to {self.devices}."
            )
        if self.best is None:
            raise NoFitError(_no_fit_message(self.tried, self.memory_limit_bytes, self.refused))
        effort = SearchEffort(time.perf_counter() - start, self.reached, self.bounded, self.solved)
        return replace(self.best, effort=effort)

    def stage_count(self, num_stages: int) -> None:
        """Every micro-batch count worth trying with `num_stages` stages (`search`'s rules)."""
        stage_devices = self.devices // num_stages

        def stage_link(shape: tuple[int, ...], dim: int) -> str:
            return self.link_of((num_stages, *shape), dim + 1)

        meshes = [
            m
            for m in mesh_shapes(stage_devices, stage_link, self.devices_per_node)
            if self.space.mesh_ok(m)
        ]
        across = self.link_of((num_stages, stage_devices), 0)
        previous: float | None = None
        for count in self.space.micro_batches or powers_of_two_dividing(self.batch):
            if num_stages > 1 and count < num_stages:
                continue
            here = self.at_count(count, num_stages, stage_devices)
            if here is None:
                break  # the graph cannot be cut into these stages (refused)
            outcome = _Outcome()
            candidates = [c for mesh in meshes for c in self.bound(here, mesh, across, outcome)]
            self.solve(here, candidates, outcome)
            best_here, cut = outcome.best_here, outcome.cut
            if num_stages == 1 and (outcome.fits_plainly or (cut and best_here is None)):
                break  # more micro-batches only add per-micro-batch overheads
            if best_here is None and not cut:
                continue  # nothing fits yet: more micro-batches keep less in flight
            time_here = best_here.prediction.step_time_s if best_here else math.inf
            if num_stages > 1 and previous is not None and time_here >= previous:
                break  # not faster than with fewer micro-batches (or, twice, all cut off)
            previous = time_here if previous is None else min(previous, time_here)

    def at_count(self, count: int, num_stages: int, stage_devices: int) -> _AtCount | None:
        graph = self.graph_for(count)
        try:
            split = split_stages(graph, num_stages)
        except PlanError as exc:
            self.refused.append(str(exc))
            return None
        if count not in self.graphs_tied:
            self.graphs_tied[count] = tie_graph(graph)
        tied = tie_stages(self.graphs_tied[count], split)
        copies = tied.copies()
        floors = compute_floors(graph, self.prices, stage_devices, {r for _, r in copies})
        return _AtCount(count, num_stages, graph, split, tied, copies, floors)

    def cutoff(self) -> float:
        return self.best.prediction.step_time_s if self.best is not None else math.inf

    def bound(
        self, here: _AtCount, mesh: Mesh, across: str, outcome: _Outcome
    ) -> list[tuple[float, MeshProblem]]:
        """The configurations of `mesh` at this count (one per recomputation mode) that no
        cheaper bound cuts, each with its LP bound."""
        graph, count, num_stages = here.graph, here.count, here.num_stages
        priced: Priced | None = None
        bounded: list[tuple[float, MeshProblem]] = []
        for mode in self.space.recompute:
            self.reached += 1
            cutoff = self.cutoff()
            if step_bound(graph, here.copies, num_stages, here.floors, count, mode) >= cutoff:
                outcome.cut = True
                continue  # even perfectly sharded compute alone is too slow
            if self.progress:
                self.progress(
                    f"stages {num_stages}, mesh {'x'.join(map(str, mesh.shape))}, "
                    f"{count} micro-batches, recompute {mode}"
                )
            if mesh not in self.pricers:
                self.pricers[mesh] = BoxingPricer(self.prices, mesh)
            priced = priced or price_graph(
                graph, mesh, self.prices, self.space.allow, self.pricers[mesh],
                here.tied.representative,
            )  # fmt: skip
            node_times = {r: _unhidden_s(priced.strategies[r]) for _, r in here.copies}
            if step_bound(graph, here.copies, num_stages, node_times, count, mode) >= cutoff:
                outcome.cut = True
                continue  # its cheapest signatures, without boxing, are too slow
            mp = build_problem(
                graph, mesh, self.prices, optimizer=self.optimizer,
                memory_limit_bytes=self.memory_limit_bytes, allow=self.space.allow,
                micro_batches=count, split=here.split, recompute=mode, stage_link=across,
                priced=priced, tied=here.tied,
            )  # fmt: skip
            self.tried.append(mp)
            bound = lower_bound_of(mp, self.time_limit_s, cutoff)
            if bound is not None:
                self.bounded += 1
                bounded.append((bound, mp))
        return bounded

    def solve(
        self, here: _AtCount, candidates: list[tuple[float, MeshProblem]], outcome: _Outcome
    ) -> None:
        """Most promising first (least LP bound): its plan then cuts the others unsolved."""
        for bound, mp in sorted(candidates, key=lambda c: c[0]):  # stable: ties keep order
            cutoff = self.cutoff()
            solution = solve_mesh(mp, self.time_limit_s, cutoff) if bound < cutoff else None
            self.solved += bound < cutoff
            if solution is None:
                outcome.cut = outcome.cut or math.isfinite(cutoff)
                continue
            outcome.fits_plainly |= mp.recompute == "none"
            found = Found(mp, solution, predict(mp, solution), here.graph)
            if outcome.best_here is None or _faster(found, outcome.best_here):
                outcome.best_here = found
            if self.best is None or _faster(found, self.best):
                self.best = found


def compute_floors(
    graph: OpGraph, prices: Prices, devices: int, only: Collection[str] | None = None
) -> dict[str, np.ndarray]:
    """Per compute node (of `only`, where given), the least forward + backward time any
    signature on `devices` devices can take (one value: its flops and bytes spread evenly; a
    signature's local share is never smaller, and the roofline only grows with flops and
    bytes)."""
    floors: dict[str, np.ndarray] = {}
    for name, attrs in graph.nodes(Role.COMPUTE):
        if (attrs["flops"] or attrs["bytes"]) and (only is None or name in only):
            dtype = attrs["outputs"][0].dtype if attrs["outputs"] else torch.float32
            moved = 0.0 if returns_view(attrs["target"]) else attrs["bytes"] / devices
            special = attrs["transcendentals"] / devices
            forward = prices.op_time_s(attrs["flops"] / devices, moved, dtype, special)
            floors[name] = np.array([forward * (1.0 + BACKWARD_FACTOR)])
    return floors


def step_bound(
    graph: OpGraph,
    copies: Counter[tuple[int, str]],
    num_stages: int,
    times: Mapping[str, np.ndarray],
    micro_batches: int,
    recompute: str,
) -> float:
    """A step time no plan with these stages, micro-batch count and recomputation can beat,
    from per-node times alone (`times` per representative node: per candidate, or one floor;
    compute nodes per micro-batch, parameters per step), each node at its cheapest, no boxing
    and no transfers. Stage s works its micro-batches after every earlier stage's first
    forward and before every earlier stage's last backward, and updates after its last
    backward (parameters' `times` may leave out the sync, which backward may hide)."""
    busy = [0.0] * num_stages
    first = [0.0] * num_stages  # forward of one micro-batch
    update = [0.0] * num_stages
    for (s, name), n in copies.items():
        values = times.get(name)
        if values is None or not len(values):
            continue
        attrs, least = graph.graph.nodes[name], n * float(np.min(values))
        if attrs["role"] is Role.PARAMETER:
            update[s] += least
        elif attrs["role"] is Role.COMPUTE:
            forward = least / (1.0 + BACKWARD_FACTOR)
            busy[s] += least + (forward if recomputed(attrs, recompute) else 0.0)
            first[s] += forward
    return max(
        micro_batches * busy[s] + max(sum(busy[:s]), sum(first[:s]) + update[s])
        for s in range(num_stages)
    )


def _unhidden_s(found: NodeStrategies) -> np.ndarray:
    """A node's time no overlap hides: a parameter's optimizer update (its sync may hide behind
    backward), a compute node's forward and backward."""
    return found.compute_s - found.sync_s if found.sync_s is not None else found.compute_s


def _faster(a: Found, b: Found) -> bool:
    return a.prediction.step_time_s < b.prediction.step_time_s * (1 - 1e-12)


def powers_of_two_dividing(batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... while they divide `batch`."""
    counts, count = [], 1
    while count <= batch and batch % count == 0:
        counts.append(count)
        count *= 2
    return tuple(counts)


def _no_fit_message(
    tried: Sequence[MeshProblem], limit: float | None, refused: Sequence[str]
) -> str:
    """Why nothing fits: the least memory any plan could need, and what takes it."""
    floors = []
    for mp in tried:
        for mem in mp.problem.memory:
            per_node = {v: float(np.min(b)) for v, b in mem.bytes_per_candidate.items() if len(b)}
            floors.append((sum(per_node.values()), mp, per_node, mem.name))
    if not tried and refused:
        return "; ".join(refused)
    stuck = _without_candidates(tried)
    if limit is None or not floors or (stuck and min(f[0] for f in floors) <= limit):
        return (
            "no plan exists for this model on these devices: "
            + (f"{stuck} can take no signature on the meshes tried" if stuck else "no signature")
            + " (a batch, or another dim, that the devices do not divide evenly?). Use a batch "
            "the data-parallel degree divides, other degrees, or another device count."
        )
    # Per problem its tightest stage; over problems the least of those.
    tightest: dict[int, tuple] = {}
    for floor in floors:
        key = id(floor[1])
        if key not in tightest or floor[0] > tightest[key][0]:
            tightest[key] = floor
    need, mesh_problem, per_node, stage = min(tightest.values(), key=lambda f: f[0])
    graph_nodes = mesh_problem.representative
    top = sorted(per_node.items(), key=lambda kv: -kv[1])[:5]
    tied = Counter(graph_nodes.values())
    consumers = ", ".join(
        f"{_label(mesh_problem.graph, v)}"
        f"{f' (and {tied[v] - 1} tied copies)' if tied[v] > 1 else ''} {format_bytes(b)}"
        for v, b in top
        if b > 0
    )
    return (
        f"no plan fits in {format_bytes(limit)} per device: even the most sharded plan (mesh "
        f"{'x'.join(map(str, mesh_problem.mesh.shape))}, {mesh_problem.split.num_stages} "
        f"stage(s), {mesh_problem.micro_batches} micro-batch(es), recompute "
        f"{mesh_problem.recompute}) needs at least {format_bytes(need)} per device ({stage}). The "
        f"biggest consumers there: {consumers}. Raise --memory-gib, use more devices, a smaller "
        "batch, or an optimizer with fewer states (sgd)."
    )


def _without_candidates(tried: Sequence[MeshProblem]) -> str:
    """The nodes (with their shapes) that had no candidate in some tried problem."""
    named: dict[str, str] = {}
    for mp in tried:
        for name, found in mp.strategies.items():
            if not found.candidates and mp.graph is not None and len(named) < 3:
                shape = mp.graph.graph.nodes[name]["outputs"][0].shape
                named[_label(mp.graph, name)] = "x".join(map(str, shape))
    return ", ".join(f"{label} (shape {shape})" for label, shape in named.items())


def _label(graph: OpGraph | None, node: str) -> str:
    if graph is None:
        return node
    attrs = graph.graph.nodes[node]
    return attrs.get("name") or attrs.get("module_path") or node
