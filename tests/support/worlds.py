"""Run each world size once: every case of a test module that needs N processes, in one job.

Lives here: `cases_by_world`, the body of the module-scoped `worlds` fixtures of the runtime
tests. Spawning a world costs seconds on 2 cores; running all of a module's cases of one world
size in one job, and handing each test its case's per-rank results, keeps the suite fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from launching.workers import run_workers

__all__ = ["cases_by_world"]

CaseResults = dict[str, list[Any]]  # case id -> that case's result on each rank


def cases_by_world(
    worker: Callable[..., list[Any]],
    cases_of: Callable[[int], Sequence[dict[str, Any]]],
    timeout_s: float,
) -> Callable[[int], CaseResults]:
    """world size -> {case id: the case's result on each rank}. The first call for a world size
    runs `worker(rank, world, cases)` on that many processes with `cases_of(world_size)` (each a
    dict with an "id"), the worker returning one result per case in order; later calls reuse it."""
    done: dict[int, CaseResults] = {}

    def get(world_size: int) -> CaseResults:
        if world_size not in done:
            cases = list(cases_of(world_size))
            per_rank = run_workers(worker, world_size, (cases,), timeout_s=timeout_s)
            done[world_size] = {c["id"]: [r[i] for r in per_rank] for i, c in enumerate(cases)}
        return done[world_size]

    return get
