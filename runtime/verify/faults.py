"""A testing hook that makes one rank of a job fail, hang or slow down at a chosen step.

Lives here: `FAULT_ENV` (read on every rank before each step) and `inject_fault`. Lives elsewhere:
the job that calls it (runtime/jobs.py), the tests that set it (tests/capturing/test_failures.py,
tests/runtime/test_checkpoint_faults.py).
"""

from __future__ import annotations

import os
import signal
import time

from autosbp.errors import ExecutionError

FAULT_ENV = "AUTOSBP_FAULT"
"""Testing hook: "rank=R,step=S,kind=K" makes rank R fail just before its step S (0-based) by K:
`exit` (os._exit(1)), `kill` (SIGKILL to itself), `raise` (a RuntimeError) or `hang` (sleeps,
reporting no progress); `slow` makes each of its steps from S on SLOW_STEP_S longer (progress
still reported every step). Tests use it to check that one failed rank stops the whole job with
a message naming it, and that a slow job is not one."""
SLOW_STEP_S = 1.0


def inject_fault(rank: int, step: int) -> None:
    """Fail here if FAULT_ENV names this rank and step (a testing hook)."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return
    kinds = "exit, kill, raise, hang or slow"
    try:
        fields = dict(item.split("=", 1) for item in value.split(","))
        (at_rank, at_step), kind = (int(fields["rank"]), int(fields["step"])), fields["kind"]
    except (KeyError, ValueError):
        raise ExecutionError(
            f"{FAULT_ENV}={value!r} is not rank=R,step=S,kind=K (K: {kinds})."
        ) from None
    if kind == "slow" and rank == at_rank and step >= at_step:
        time.sleep(SLOW_STEP_S)  # a slow step, but progress: each step reports
        return
    if (rank, step) != (at_rank, at_step) or kind == "slow":
        return
    if kind == "exit":
        os._exit(1)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV}={value}")
    if kind == "hang":
        while True:  # stuck in its own code: no progress, no collective
            time.sleep(1.0)
    raise ExecutionError(f"{FAULT_ENV}={value!r}: unknown kind {kind!r} ({kinds}).")
