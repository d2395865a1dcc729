"""Interleaved 1F1B and zero bubble in the auto search: the virtual-stage counts v (model
chunks per pipeline device) and schedules that `auto` tries, the space of each, and one plan out
of the searches of every one.

Lives here: `search_spaces` (a strategy's spaces, one per v and one for zb1), `best_of` (the
fastest of the per-space searches, with the gap proven over all of them). Lives elsewhere: one
search (`search.entry`: at v > 1 it counts each device v times, and a device's chunks share
its memory), the rules of the interleaved schedule (`schedule.check_interleaving`), the bounds
that prune interleaved configurations (`timing.objective`: the device path bounds), hand plans
(`space.strategy`: `vp=V` there is one space).

Invariants: `auto` searches v = 1 only; `auto:max_vp=V` the powers of two up to V, at stage
counts v x P with P >= 2 and v x P <= blocks; `auto:zb1` one more space, zb1 at every stage
count from 2 without recomputation. A space at v > 1, and zb1's, forbids every gathering pair of
a parameter's edges (`Space.may_gather`, the runtime's own test), so its search returns the best
plan the runtime runs. A v whose space has no configuration, or none that fits, is left out; if
every v is, the plain search's error stands. The gap kept is proven over the union of the
spaces, and the time limit is the whole search's: each v gets what the earlier ones left
(docs/planner.md, "One search per schedule").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from autosbp.errors import PlanError
from autosbp.planner.problem.solve import MIP_GAP
from autosbp.planner.search.evaluator import Found
from autosbp.planner.space.strategy import Space, auto_options, strategy_space

LEAST_TIME_S = 1e-3  # a search's time limit once the earlier v's spent the whole one


def search_spaces(strategy: str, recompute: str, blocks: int) -> list[Space]:
    """The spaces `strategy` searches: one for a hand plan; for `auto[:max_vp=V]` one per v
    whose space has a stage count (the module docstring; docs/planner.md, "One search per
    schedule")."""
    space = strategy_space(strategy, recompute, blocks)
    if not strategy.startswith("auto"):
        return [space]
    spaces = [space]
    most, zb1 = auto_options(strategy)
    for v in (2**i for i in range(most.bit_length()) if 2**i <= most):
        counts = tuple(v * p for p in range(2, blocks // v + 1))
        if v > 1 and counts:
            spaces.append(replace(space, stage_counts=counts, virtual_stages=v))
    counts = tuple(range(2, blocks + 1))
    if zb1 and counts and "none" in space.recompute:  # zb1 runs without recomputation
        spaces.append(replace(space, stage_counts=counts, recompute=("none",), schedule="zb1"))
    return spaces


def _least_s(found: Found) -> float:
    """No plan of the search's space predicts below this (its proven gap)."""
    if found.effort is None:
        return -math.inf
    return found.prediction.step_time_s * (1 - found.effort.gap)


def best_of(
    spaces: list[Space], search_one: Callable[[Space, float], Found], time_limit_s: float
) -> Found:
    """The fastest plan of `search_one(space, time limit)` over `spaces`, its effort's gap and
    status over all of them (docs/planner.md, "One search per schedule"). The first space's
    error if none has a plan."""
    deadline = time.perf_counter() + time_limit_s
    founds: list[Found] = []
    least: list[float] = []  # per search, no plan of its space below it
    first_error: PlanError | None = None
    for space in spaces:
        left_s = max(deadline - time.perf_counter(), LEAST_TIME_S)
        try:
            found = search_one(space, left_s if founds else time_limit_s)
        except PlanError as exc:  # this v has no configuration, or none fits
            first_error = first_error or exc
            continue
        least.append(_least_s(found))
        founds.append(found)
    if not founds:
        assert first_error is not None
        raise first_error
    best = min(founds, key=lambda f: f.prediction.step_time_s)
    if len(least) == 1 or best.effort is None:
        return best
    best_s = best.prediction.step_time_s
    gap = max(0.0, (best_s - min(least)) / best_s)
    efforts = [f.effort for f in founds if f.effort is not None]
    effort = replace(
        best.effort,
        seconds=sum(e.seconds for e in efforts),
        configurations=sum(e.configurations for e in efforts),
        bounded=sum(e.bounded for e in efforts),
        solved=sum(e.solved for e in efforts),
        status="optimal" if gap <= MIP_GAP * (1 + 1e-9) else "feasible",
        gap=gap,
        time_limit_s=time_limit_s,
        limit_reached=any(e.limit_reached for e in efforts),
    )
    return replace(best, effort=effort)
