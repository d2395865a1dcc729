"""A rank that dies or raises stops the whole job within seconds, with one message naming it.

Through `launching.workers.run_workers` (a worker that fails after a collective while its peer
waits in the next one) and through `autosbp train` (the `AUTOSBP_FAULT` testing hook of
runtime/jobs.py). In every case the message names the failed rank, not the peer whose
collective broke because of it ("Connection reset by peer"), and the job ends long before the
collective timeout.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from autosbp.cli import main
from launching.errors import ExecutionError
from launching.workers import run_workers
from runtime.verify.faults import FAULT_ENV

# Start-up is about 3 s (interpreter + torch per rank), then a failure ends the job in about
# 1 s; 30 s leaves room for a loaded machine and is far below the 120 s collective timeout.
FAILURE_BUDGET_S = 30.0
COLLECTIVE_TIMEOUT_S = 120.0


def fail_after_collective(rank: int, world_size: int, how: str) -> float:
    """Worker: one all-reduce, then rank 1 fails by `how` while rank 0 waits in the next one."""
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        if how == "exit":
            os._exit(1)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":
            raise ValueError("rank 1 failed on purpose")
        if how == "segfault":
            ctypes.string_at(0)
        if how == "hang":
            time.sleep(COLLECTIVE_TIMEOUT_S)
    dist.all_reduce(x)
    return float(x[0])


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("exit", ["died with exit code 1", "without raising a Python exception"]),
        ("kill", ["died with signal SIGKILL", "out-of-memory killer"]),
        ("raise", ["raised ValueError", "Cause: ValueError: rank 1 failed on purpose"]),
        ("segfault", ["died with signal SIGSEGV", "Native traceback of rank 1", "string_at"]),
    ],
    ids=["os-exit", "sigkill", "exception", "segfault"],
)
def test_a_failed_rank_stops_the_job_and_is_named(how: str, expected: list[str]) -> None:
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_workers(fail_after_collective, 2, (how,), timeout_s=COLLECTIVE_TIMEOUT_S)
    elapsed_s = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1 of 2 (pid "), message
    assert "during `fail_after_collective`; the other ranks were stopped" in message
    for text in expected:
        assert text in message, message
    assert "launch.py" not in message and "rank.py" not in message  # the rank's own frames
    assert elapsed_s < FAILURE_BUDGET_S


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_rank_missing_a_collective_is_reported_at_the_timeout() -> None:
    """Rank 1 never reaches the second all-reduce: rank 0's collective times out (bounded), and
    the message says rank 1 was still running."""
    timeout_s = 10.0
    start = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        run_workers(fail_after_collective, 2, ("hang",), timeout_s=timeout_s)
    message = str(info.value)
    assert message.startswith("rank 0 of 2 (pid "), message
    assert "Timed out" in message
    assert "Still running when stopped: ranks [1]." in message
    assert time.monotonic() - start < timeout_s + FAILURE_BUDGET_S


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kill", "died with signal SIGKILL during training"),
        ("raise", f"Cause: RuntimeError: fault injected by {FAULT_ENV}=rank=1,step=1,kind=raise"),
    ],
    ids=["sigkill", "exception"],
)
def test_train_stops_when_a_rank_fails(
    kind: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FAULT_ENV, f"rank=1,step=1,kind={kind}")  # spawned ranks inherit it
    start = time.monotonic()
    code = main(["train", "mlp", "--nproc", "2", "--plan", "dp", "--steps", "3"])
    elapsed_s = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: rank 1 of 2 (pid "), err
    assert "the other ranks were stopped" in err
    assert expected in err, err
    assert "launch.py" not in err and "rank.py" not in err  # no traceback of the launcher
    assert elapsed_s < FAILURE_BUDGET_S
