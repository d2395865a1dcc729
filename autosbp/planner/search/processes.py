"""The search split over processes: each searches its share of the configurations, and every
process cuts with the best plan any of them has found.

Lives here: `search_in_processes` (the shares, the processes, the shared best step, and the
outcome put back together: the best plan, the least bound left, the effort) and
`available_cores`. Lives elsewhere: the search each process runs (`search.best_first.BestFirst`),
one configuration's work (`search.evaluator`).

Invariants: a share is whole (count, mesh) pairs, dealt in turn in the order of the space, so
each pair is priced once, by one process; the seeds (`BestFirst.seed_first`) are taken here
first, once, so every process starts with the seeds' plan as its cutoff; the cutoff is a shared
double, only ever lowered; the gap is proven as in one process (docs/planner.md, "Over
processes"). Processes are forked once the graphs are captured and tied (children inherit them:
no pickling, no imports; so is the request's `search.graph_memo.GraphMemo`, whose entries
a process adds stay its own), each runs torch on one thread; the winner's plan is built again
here from its configuration and choice.
"""

from __future__ import annotations

import heapq
import os
import traceback
from collections.abc import Hashable
from dataclasses import dataclass, replace
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any

from autosbp.errors import NoFitError, PlanError
from autosbp.planner.search.best_first import BestFirst, Outcome
from autosbp.planner.search.evaluator import Evaluator, Found, Request
from autosbp.planner.search.graph_memo import GraphMemo
from autosbp.planner.space.configs import Config

MIN_CONFIGURATIONS = 64  # a default search smaller than this runs in one process (a fork costs)


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class _Share:
    """One process's outcome, as plain data: its best (configuration, choice, step) or None,
    the least bound it left, what it did, and why it refused what it could not use."""

    best: tuple[Config, dict[str, int], float] | None
    least_s: float
    configurations: int
    bounded: int
    solved: int
    timed_out: bool
    least_bytes: float
    refusal: str
    improvements: tuple[tuple[float, float], ...]


def search_in_processes(
    request: Request, time_limit_s: float, jobs: int | None, start: float, memo: GraphMemo
) -> Found | None:
    """The search in `jobs` processes (None: every core, when the space has at least
    MIN_CONFIGURATIONS configurations); None when it is better run in one (the caller does).
    `memo`: the request's (`search.graph_memo`), inherited by every process."""
    ev = Evaluator(replace(request, progress=None), memo)
    counts = ev.counts()
    for count in counts:  # captured and tied here, inherited by every process
        ev.graph_of(count)
    deal = _deal(ev, counts)
    wanted = jobs if jobs is not None else available_cores()
    if jobs is None and sum(n for _, n in deal.values()) < MIN_CONFIGURATIONS:
        return None
    processes = min(wanted, max(len(deal), 1))
    if processes <= 1:
        return None
    seeded = BestFirst(ev, start + time_limit_s, time_limit_s, start=start)
    seeded.enter_space()
    seeded.seed_first()  # here, once: every process starts with its plan as the cutoff
    if not seeded.heap or seeded.heap[0][0] >= seeded.cutoff():
        return seeded.outcome(entered=True).found(start, seeded)
    if request.progress:
        request.progress(f"searching in {processes} processes")
    owner = {k: i % processes for k, (i, _) in deal.items()}
    shares = _run(seeded, owner, processes)
    return _merged(seeded, shares, start)


def _deal(ev: Evaluator, counts: list[int]) -> dict[Hashable, tuple[int, int]]:
    """Every (count, mesh) pair of the space in its order -> (its position, configurations)."""
    space = ev.request.space
    found: dict[Hashable, tuple[int, int]] = {}
    for num_stages in space.stage_counts:
        pipeline = num_stages // space.virtual_stages  # interleaved: P devices, v x P stages
        for count in counts:
            if pipeline > 1 and count < pipeline:
                continue
            for mesh in ev.meshes(num_stages):
                key = (count, mesh)
                at, n = found.get(key, (len(found), 0))
                found[key] = (at, n + len(space.recompute))
    return found


def _run(seeded: BestFirst, owner: dict[Hashable, int], processes: int) -> list[_Share]:
    context = get_context("fork")
    best = context.Value("d", seeded.best_s())
    children, pipes = [], []
    for index in range(processes):
        here, there = context.Pipe(duplex=False)
        child = context.Process(
            target=_work, args=(seeded, owner, index, best, there), daemon=True
        )  # fmt: skip
        child.start()
        there.close()
        children.append(child)
        pipes.append(here)
    results: dict[int, Any] = {}
    try:
        while len(results) < processes:
            for ready in wait([p for i, p in enumerate(pipes) if i not in results]):
                assert isinstance(ready, Connection)
                index = pipes.index(ready)
                try:
                    results[index] = ready.recv()
                except EOFError:
                    results[index] = PlanError(
                        f"search process {index} ended without an answer (exit code "
                        f"{children[index].exitcode}); plan with jobs=1 (--jobs 1)."
                    )
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    for index in range(processes):
        if isinstance(results[index], BaseException):
            raise results[index]
    return [results[i] for i in range(processes)]


def _work(
    seeded: BestFirst, owner: dict[Hashable, int], index: int, best: Any, pipe: Connection
) -> None:
    """One process: the search of its share of what the seeding left in the heap, sent back as
    a `_Share` (or the exception)."""
    import torch

    torch.set_num_threads(1)
    ev = seeded.ev
    bounded, solved = ev.bounded, ev.solved  # the seeding's, counted by the parent

    def offer(step_s: float) -> None:
        with best.get_lock():
            best.value = min(best.value, step_s)

    try:
        state = BestFirst(
            ev, seeded.deadline, seeded.time_limit_s,
            owns=lambda c: owner[(c.count, c.mesh)] == index, incumbent_s=lambda: best.value,
            offer=offer, start=seeded.start, solved_early=seeded.solved_early,
        )  # fmt: skip
        state.heap = [e for e in seeded.heap if state.owns(e[3])]
        heapq.heapify(state.heap)
        outcome = state.outcome(entered=True)
        found = outcome.best
        mine = None
        if found is not None:
            config = Config(
                found.problem.split.num_stages, found.problem.mesh,
                found.problem.micro_batches, found.problem.recompute,
            )  # fmt: skip
            mine = (config, dict(found.solution.choice), found.prediction.step_time_s)
        refusals = ev.refusals
        share = _Share(
            mine, outcome.least_s, 0, outcome.bounded - bounded, outcome.solved - solved,
            outcome.timed_out, refusals.least_bytes,
            refusals.message(
                ev.request.memory_limit_bytes, chunks=ev.request.space.virtual_stages
            ), outcome.improvements,
        )  # fmt: skip
        pipe.send(share)
    except BaseException as exc:  # sent to the parent, which raises it
        try:
            pipe.send(exc)
        except Exception:  # an exception that does not pickle: its text
            pipe.send(PlanError(f"search process {index} failed: {traceback.format_exc()}"))
    finally:
        pipe.close()


def _merged(seeded: BestFirst, shares: list[_Share], start: float) -> Found:
    """The seeding's and the processes' outcomes as one search's: the fastest plan (a process's
    rebuilt here), the least bound left anywhere, the effort summed."""
    ev = seeded.ev
    solved = [s for s in shares if s.best is not None]
    found = seeded.best
    if solved:
        winner = min(solved, key=lambda s: (s.best[2], shares.index(s)))  # type: ignore[index]
        assert winner.best is not None
        config, choice, step_s = winner.best
        if found is None or step_s < found.prediction.step_time_s * (1 - 1e-12):
            found = ev.rebuilt(config, choice)
    if found is None:
        closest = min(shares, key=lambda s: s.least_bytes)
        raise NoFitError(closest.refusal)
    seeds = Outcome(
        found, min([seeded.retired_bound] + [s.least_s for s in shares]),
        seeded.configurations, ev.bounded + sum(s.bounded for s in shares),
        ev.solved + sum(s.solved for s in shares), any(s.timed_out for s in shares),
        _running_best(seeded.improvements, shares),
    )  # fmt: skip
    return seeds.found(start, seeded)


def _running_best(
    seeded: list[tuple[float, float]], shares: list[_Share]
) -> tuple[tuple[float, float], ...]:
    """When a better plan was found, here or by any process (seconds since the start, step)."""
    out: list[tuple[float, float]] = []
    for t, step_s in sorted([*seeded, *(f for s in shares for f in s.improvements)]):
        if not out or step_s < out[-1][1]:
            out.append((t, step_s))
    return tuple(out)
