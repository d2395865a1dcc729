"""Cuts that make a 1F1B configuration's ILP (interleaved, or plain: v = 1) exact at its
solution: the simulation's own critical paths added to the objective's path max term.

Lives here: `critical_entries` (one device's critical path through an interleaved timeline, as
the objective's path entries), `with_cuts` (a problem with the critical paths of a choice added).
Lives elsewhere: the loop that solves, cuts and solves again (`problem.solve.cut_to_simulation`),
the path bounds the objective starts from (`timing.objective`), the schedule
(`schedule.interleaved_orders`).

Invariant: each cut is a lower bound of every choice's simulated step (the orders depend on
(P, v, m) alone, so a path's firings and transfers end before its last firing does), and equals
the prediction at the choice it was read from (docs/planner.md, "Cuts to the simulation").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from autosbp.planner.ilp.formulation import MaxTerm, Problem
from autosbp.planner.timing.objective import Entry, StageCosts, Weighted, path_terms, update_parts
from autosbp.schedule import Firing, Phase, Timeline

FiringKey = tuple[Phase, int, int]  # (phase, virtual stage, micro-batch)


def critical_entries(timeline: Timeline, device: int, send_s: tuple[float, ...]) -> list[Entry]:
    """The path that ends `device`'s last firing, as path entries (weight, "forward" | "busy"
    | "send", virtual stage): at each firing, the later of its input's arrival and its device's
    previous firing's end, back to a firing that waited for neither."""
    p, last_stage = timeline.num_stages, timeline.num_stages * timeline.virtual_stages - 1
    by_key: dict[FiringKey, Firing] = {}
    previous: dict[FiringKey, Firing] = {}
    last: dict[int, Firing] = {}
    for f in timeline.firings:  # each device's firings in its order
        key = (f.phase, f.chunk * p + f.stage, f.micro_batch)
        by_key[key] = f
        if f.stage in last:
            previous[key] = last[f.stage]
        last[f.stage] = f
    entries: list[Entry] = []
    at: Firing | None = last[device]
    while at is not None:
        phase, vs, mb = at.phase, at.chunk * p + at.stage, at.micro_batch
        data: tuple[Firing, int | None] | None = None  # the input's firing, its transfer's stage
        if phase is Phase.FORWARD:
            entries.append((1.0, "forward", vs))
            if vs > 0:
                data = (by_key[(phase, vs - 1, mb)], vs - 1)
        else:
            entries += [(1.0, "busy", vs), (-1.0, "forward", vs)]
            if vs == last_stage:
                data = (by_key[(Phase.FORWARD, vs, mb)], None)
            else:
                data = (by_key[(phase, vs + 1, mb)], vs)
        before = previous.get((phase, vs, mb))
        data_s = (
            -1.0 if data is None else data[0].end_s + (0.0 if data[1] is None else send_s[data[1]])
        )
        device_s = -1.0 if before is None else before.end_s
        if data is not None and data_s >= device_s:
            if data[1] is not None:
                entries.append((1.0, "send", data[1]))
            at = data[0]
        else:
            at = before
    return entries


def with_cuts(
    problem: Problem,
    costs: StageCosts,
    choice: Mapping[str, int],
    timeline: Timeline,
    send_s: tuple[float, ...],
) -> Problem:
    """`problem` with, per device, its critical path at `choice` and the update part of each of
    its chunks that is largest at `choice`, added to the path max term (the last)."""
    p, v = timeline.num_stages, timeline.virtual_stages
    paths: list[tuple[list[Entry], list[Weighted]]] = []
    for device in range(p):
        update: list[Weighted] = []
        for c in range(v):
            options = update_parts(costs, c * p + device)
            update += max(options, key=lambda part: sum(w * x.value(choice) for w, x in part))
        paths.append((critical_entries(timeline, device, send_s), update))
    parts, nested = path_terms(costs, paths)
    term = problem.max_terms[-1]
    cut = replace(term, parts=(*term.parts, *parts), inner=(*_inner(term), *nested))
    return replace(problem, max_terms=(*problem.max_terms[:-1], cut))


def _inner(term: MaxTerm) -> tuple[Mapping[int, float], ...]:
    """The term's hiding coefficients per part (its `inner`, or none for each part)."""
    return tuple(term.inner) if term.inner else tuple({} for _ in term.parts)
