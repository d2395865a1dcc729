"""Parameter gathers as FSDP runs them (runtime/prefetch.py) equal one device, and run as asked.

Oracle: the same zoo model on one device, compared at every step as `--check` does
(runtime/check.py derives the bounds), for every path of the gather schedule: each gathered
weight kept until backward or freed after forward and gathered again (FSDP's
reshard_after_forward), gathers prefetched 0, 1 and 2 units ahead, on 2 and 4 gloo processes.
Beside the numerics, the schedule's own counts say that the path under test ran: re-gathers
happened exactly when asked, units were started as far ahead as the depth (capped by the units
there are), and the gradients were reduce-scattered asynchronously.

How it runs: fsdp plans made here (tests/test_runtime.py's planning), one `run_workers` call
per world size trains every case (tests/prefetch_workers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from costmodel.launch import run_workers
from runtime.check_report import judge
from tests.prefetch_workers import run_gather_cases
from tests.test_runtime import LR, MODELS, _plan_json

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


def _case_id(world_size: int, model: str, regather: bool, depth: int) -> str:
    return f"{world_size}-{model}-{'regather' if regather else 'keep'}-depth{depth}"


@pytest.fixture(scope="module")
def worlds() -> Callable[[int], dict[str, list[dict[str, Any]]]]:
    """world size -> {case id: the case's result on each rank}; each world is run once."""
    done: dict[int, dict[str, list[dict[str, Any]]]] = {}

    def get(world_size: int) -> dict[str, list[dict[str, Any]]]:
        if world_size not in done:
            chosen = [c for c in CASES if c[0] == world_size]
            cases = [
                {
                    "id": _case_id(*c),
                    "model": MODELS[c[1]][0],
                    "model_kwargs": MODELS[c[1]][1],
                    "plan": _plan_json(c[1], world_size, "fsdp"),
                    "steps": STEPS,
                    "lr": LR,
                    "regather": c[2],
                    "depth": c[3],
                }
                for c in chosen
            ]
            per_rank = run_workers(
                run_gather_cases, world_size, (cases,), timeout_s=WORKER_TIMEOUT_S
            )
            done[world_size] = {c["id"]: [r[i] for r in per_rank] for i, c in enumerate(cases)}
        return done[world_size]

    return get


@pytest.mark.dist
@pytest.mark.parametrize(
    ("world_size", "model", "regather", "depth"), CASES, ids=[_case_id(*c) for c in CASES]
)
def test_gather_paths_match_single_device(
    worlds: Callable[[int], Any], world_size: int, model: str, regather: bool, depth: int
) -> None:
    per_rank = worlds(world_size)[_case_id(world_size, model, regather, depth)]
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
