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
from dataclasses import dataclass, replace

import numpy as np
import torch

from autosbp.errors import NoFitError, PlanError
from autosbp.graph import OpGraph, Role
from autosbp.ilp import Solution
from autosbp.plan import format_bytes
from autosbp.planner.costs import (
    BACKWARD_FACTOR,
    BoxingPricer,
    NodeStrategies,
    Prices,
    returns_view,
)
from autosbp.planner.pipeline import recomputed, split_stages
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
from autosbp.planner.reduce import TiedGraph, tie_graph, tie_stages
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
    start = time.perf_counter()
    reached = bounded = solved = 0
    best: Found | None = None
    tried: list[MeshProblem] = []
    refused: list[str] = []
    counts = space.micro_batches or powers_of_two_dividing(batch)
    idle = 0  # stage counts in a row that found nothing faster
    pricers: dict[Mesh, BoxingPricer] = {}  # one per stage mesh, across micro-batch counts
    graphs_tied: dict[int, TiedGraph] = {}  # per micro-batch count, across stage counts
    for num_stages in space.stage_counts:
        if devices % num_stages:
            refused.append(f"{num_stages} stages do not divide {devices} devices")
            continue
        if idle >= IDLE_STAGE_COUNTS:
            break
        best_before = best
        stage_devices = devices // num_stages

        def stage_link(shape: tuple[int, ...], dim: int, p: int = num_stages) -> str:
            return link_of((p, *shape), dim + 1)

        meshes = [
            m for m in mesh_shapes(stage_devices, stage_link, devices_per_node) if space.mesh_ok(m)
        ]
        across = link_of((num_stages, stage_devices), 0)
        previous: float | None = None
        for count in counts:
            if num_stages > 1 and count < num_stages:
                continue
            graph = graph_for(count)
            try:
                split = split_stages(graph, num_stages)
            except PlanError as exc:
                refused.append(str(exc))
                break
            if count not in graphs_tied:
                graphs_tied[count] = tie_graph(graph)
            tied = tie_stages(graphs_tied[count], split)
            copies = tied.copies()
            floors = compute_floors(graph, prices, stage_devices, {r for _, r in copies})
            best_here, fits_plainly, cut = None, False, False
            candidates: list[tuple[float, int, MeshProblem]] = []  # (lower bound, order, problem)
            for mesh in meshes:
                priced: Priced | None = None
                for mode in space.recompute:
                    reached += 1
                    cutoff = best.prediction.step_time_s if best is not None else math.inf
                    if step_bound(graph, copies, num_stages, floors, count, mode) >= cutoff:
                        cut = True
                        continue  # even perfectly sharded compute alone is too slow
                    if progress:
                        progress(
                            f"stages {num_stages}, mesh {'x'.join(map(str, mesh.shape))}, "
                            f"{count} micro-batches, recompute {mode}"
                        )
                    if mesh not in pricers:
                        pricers[mesh] = BoxingPricer(prices, mesh)
                    priced = priced or price_graph(
                        graph, mesh, prices, space.allow, pricers[mesh], tied.representative
                    )
                    node_times = {r: _unhidden_s(priced.strategies[r]) for _, r in copies}
                    if step_bound(graph, copies, num_stages, node_times, count, mode) >= cutoff:
                        cut = True
                        continue  # its cheapest signatures, without boxing, are too slow
                    mp = build_problem(
                        graph, mesh, prices, optimizer=optimizer,
                        memory_limit_bytes=memory_limit_bytes, allow=space.allow,
                        micro_batches=count, split=split, recompute=mode, stage_link=across,
                        priced=priced, tied=tied,
                    )  # fmt: skip
                    tried.append(mp)
                    bound = lower_bound_of(mp, time_limit_s, cutoff)
                    bounded += bound is not None
                    if bound is not None:
                        candidates.append((bound, len(candidates), mp))
            # Most promising first (least LP bound): its plan then cuts the others unsolved.
            for bound, _, mp in sorted(candidates, key=lambda c: c[:2]):
                cutoff = best.prediction.step_time_s if best is not None else math.inf
                solution = solve_mesh(mp, time_limit_s, cutoff) if bound < cutoff else None
                solved += bound < cutoff
                if solution is None:
                    cut = cut or math.isfinite(cutoff)
                    continue
                fits_plainly |= mp.recompute == "none"
                found = Found(mp, solution, predict(mp, solution), graph)
                if best_here is None or _faster(found, best_here):
                    best_here = found
                if best is None or _faster(found, best):
                    best = found
            if num_stages == 1 and (fits_plainly or (cut and best_here is None)):
                break  # more micro-batches only add per-micro-batch overheads
            if best_here is None and not cut:
                continue  # nothing fits yet: more micro-batches keep less in flight
            time_here = best_here.prediction.step_time_s if best_here else math.inf
            if num_stages > 1 and previous is not None and time_here >= previous:
                break  # not faster than with fewer micro-batches (or, twice, all cut off)
            previous = time_here if previous is None else min(previous, time_here)
        idle = idle + 1 if best is not None and best is best_before else 0
    if best is None and not tried and not refused:
        raise PlanError(
            f"the strategy needs a mesh that {devices} devices cannot form; check that its "
            f"degrees multiply to {devices}."
        )
    if best is None:
        raise NoFitError(_no_fit_message(tried, memory_limit_bytes, refused))
    effort = SearchEffort(time.perf_counter() - start, reached, bounded, solved)
    return replace(best, effort=effort)


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
