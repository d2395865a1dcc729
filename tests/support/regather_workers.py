"""Module-level worker for the activation re-gather tests (spawned by
`launching.workers.run_workers`): one world for both kinds of case.

Lives here: `check_and_measure`: the `--check` jobs (`check_workers.run_checked`: rank 0's step
checks) and the memory cases (`memory_workers.measure_cases`: each rank's measured and predicted
peak, and how many activations its backward gathered again). Lives elsewhere: the cases and
their assertions (tests/runtime/test_regather_check.py).
"""

from __future__ import annotations

from typing import Any

from runtime.jobs import TrainSpec
from tests.support.check_workers import run_checked
from tests.support.memory_workers import measure_cases
from tests.support.shared_captures import shares_captures


@shares_captures
def check_and_measure(
    rank: int,
    world_size: int,
    checks: list[tuple[str, TrainSpec, str]],
    memory: list[dict[str, Any]],
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """(the checks' step checks on rank 0, this rank's figures of each memory case)."""
    return run_checked(rank, world_size, checks), measure_cases(rank, world_size, memory)
