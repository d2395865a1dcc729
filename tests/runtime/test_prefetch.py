"""Parameter gathers as FSDP runs them (runtime/parallel/prefetch.py) equal one device, and run as asked.

Oracle: the same zoo model on one device, compared at every step as `--check` does
(runtime/verify/step_check.py derives the bounds), for every path of the gather schedule: each gathered
weight kept until backward or freed after forward and gathered again (FSDP's
reshard_after_forward), gathers prefetched 0, 1 and 2 units ahead, on 2 and 4 gloo processes.
Beside the numerics, the schedule's own counts say that the path under test ran: re-gathers
happened exactly when asked, units were started as far ahead as the depth (capped by the units
there are), and the gradients were reduce-scattered asynchronously; and the engine runs what
the plan states (per parameter `reshard_after_forward`, per stage `prefetch_blocks`) when it is
given no policy of its own. The step's timeline (the spans an `Engine` records) shows it:
gathers of several units in flight at once exactly when prefetching, re-gathers and gradient
reduce-scatters inside backward.

How it runs: fsdp plans made here (tests/runtime/test_runtime.py's planning), one `run_workers` call
per world size trains every case (tests/support/prefetch_workers.py).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from runtime.verify.verdict import judge
from tests.runtime.test_runtime import LR, MODELS, _plan_json
from tests.support.prefetch_workers import run_gather_cases
from tests.support.worlds import cases_by_world

STEPS = 2
WORKER_TIMEOUT_S = 120.0
# (world size, model, regather, prefetch depth): gpt-2l has four units of gathers (embeddings,
# two blocks, the head), so depth 2 runs two units ahead of the one in use; gpt-tied's plan
# gathers one unit (its tied embedding), so no depth can run ahead there.
CASES: list[tuple[int, str, bool, int]] = [
    *((2, "gpt-2l", regather, depth) for regather in (False, True) for depth in (0, 1, 2)),
    (2, "gpt-tied", True, 1),
    *((4, "gpt-2l", regather, depth) for regather, depth in ((False, 1), (True, 0), (True, 2))),
    (4, "gpt-tied", True, 2),
]


# Read from the plan: the plan JSON states every parameter re-gathered and this depth, the
# engine gets no policy of its own.
FROM_PLAN: list[tuple[int, str, bool, int]] = [(2, "gpt-2l", True, 2)]


def _case_id(world_size: int, model: str, regather: bool, depth: int) -> str:
    return f"{world_size}-{model}-{'regather' if regather else 'keep'}-depth{depth}"


def _plan_stating(model: str, world_size: int, regather: bool, depth: int) -> dict[str, Any]:
    plan = copy.deepcopy(_plan_json(model, world_size, "fsdp"))
    for param in plan["params"].values():
        param["reshard_after_forward"] = regather
    for stage in plan["stages"]:
        stage["prefetch_blocks"] = depth
    return plan


def _cases(world_size: int) -> list[dict[str, Any]]:
    chosen = [(c, False) for c in CASES if c[0] == world_size]
    chosen += [(c, True) for c in FROM_PLAN if c[0] == world_size]
    return [
        {
            "id": _case_id(*c) + ("-from-plan" if from_plan else ""),
            "model": MODELS[c[1]][0],
            "model_kwargs": MODELS[c[1]][1],
            "plan": _plan_stating(c[1], world_size, c[2], c[3])
            if from_plan
            else _plan_json(c[1], world_size, "fsdp"),
            "steps": STEPS,
            "lr": LR,
            "regather": c[2],
            "depth": c[3],
            "from_plan": from_plan,
        }
        for c, from_plan in chosen
    ]


@pytest.fixture(scope="module")
def worlds() -> Callable[[int], dict[str, list[dict[str, Any]]]]:
    """world size -> {case id: the case's result on each rank}; each world is run once."""
    return cases_by_world(run_gather_cases, _cases, WORKER_TIMEOUT_S)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("world_size", "model", "regather", "depth", "from_plan"),
    [(*c, False) for c in CASES] + [(*c, True) for c in FROM_PLAN],
    ids=[_case_id(*c) for c in CASES] + [_case_id(*c) + "-from-plan" for c in FROM_PLAN],
)
def test_gather_paths_match_single_device(
    worlds: Callable[[int], Any],
    world_size: int,
    model: str,
    regather: bool,
    depth: int,
    from_plan: bool,
) -> None:
    case_id = _case_id(world_size, model, regather, depth) + ("-from-plan" if from_plan else "")
    per_rank = worlds(world_size)[case_id]
    for rank, result in enumerate(per_rank):
        assert result["losses"] == per_rank[0]["losses"], f"rank {rank} reports another loss"
    verdict = judge(per_rank[0]["checks"])
    assert verdict.passed, verdict.text
    counts, units = per_rank[0]["counts"], per_rank[0]["units"]
    assert counts is not None and units >= 1, "an fsdp plan gathers parameters"
    assert (counts["regathers"] > 0) == regather
    assert counts["ahead_units"] == min(depth, units - 1)
    if regather:
        assert counts["ahead_units_backward"] == min(depth, units - 1)
    assert counts["deferred_reduces"] > 0
    spans = per_rank[0]["spans"]
    ahead = _overlapping(spans, "param_gather")
    assert ahead == (depth > 0 and units > 1), "the timeline shows gathers in flight together"
    if regather:
        assert _within(spans, "param_regather", "backward"), "re-gathers run in backward"
    assert _within(spans, "grad_reduce", "backward"), "reduce-scatters run in backward"


Span = tuple[str, int | None, float, float]  # kind, micro-batch, start s, end s


def _overlapping(spans: list[Span], kind: str) -> bool:
    """Two spans of `kind` of one micro-batch in flight at once (a unit started ahead)."""
    mine = sorted((s for s in spans if s[0] == kind), key=lambda s: (s[1] or 0, s[2]))
    return any(a[1] == b[1] and b[2] < a[3] for a, b in itertools.pairwise(mine))


def _within(spans: list[Span], kind: str, outer: str) -> bool:
    """Some span of `kind` starts inside a span of `outer` and there is one of each."""
    inner, around = [s for s in spans if s[0] == kind], [s for s in spans if s[0] == outer]
    return any(o[2] <= s[2] <= o[3] for s in inner for o in around)
