"""One live job per checkpoint folder (issue 48 item 5): the lock beside the folder.

Oracle: the lock file's own contents and the processes it names, real ones: this test's
process, a child that runs (`sleep`), a child that has exited (its pid no longer exists), and
a pid whose process started at another time than the lock says (a reused pid). What must hold:
a live holder on this host refuses, naming its pid and host; a holder on another host refuses
and says to remove the file once that job is gone; a dead or reused pid is taken over; a damaged
lock refuses and says what to do; holds nest within one process; the file goes with the last
hold. Two real jobs on one folder are tests/runtime/test_checkpoint_faults.py's (the CLI).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from autosbp.errors import ExecutionError
from runtime.state.checkpoint_lock import hold_checkpoint_dir, lock_path


def _write_lock(directory: Path, host: str, pid: int, started: str | None) -> Path:
    lock = lock_path(directory)
    holder = {"host": host, "pid": pid, "started": started, "since": "2026-12-07 10:00:00"}
    lock.write_text(json.dumps(holder))
    return lock


def _start_of(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2 :].split()[19]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_the_lock_names_this_job_while_held_and_goes_with_the_last_hold(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    lock = lock_path(directory)
    assert lock == tmp_path / "ckpt.lock"  # beside the folder: publishing renames the folder
    with hold_checkpoint_dir(directory):
        holder = json.loads(lock.read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        with hold_checkpoint_dir(directory):  # a nested hold: the same lock
            assert lock.exists()
        assert lock.exists()
    assert not lock.exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_live_job_on_this_host_holds_its_folder(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    directory = tmp_path / "ckpt"
    lock = _write_lock(directory, socket.gethostname(), sleeper.pid, _start_of(sleeper.pid))
    with pytest.raises(ExecutionError) as error, hold_checkpoint_dir(directory):
        pass
    text = str(error.value)
    assert f"is in use by the job of pid {sleeper.pid} on host {socket.gethostname()}" in text
    assert "Wait for that job to end, or choose another folder" in text
    assert "another host" not in text
    assert json.loads(lock.read_text())["pid"] == sleeper.pid  # never taken from a live job


def test_a_job_on_another_host_holds_its_folder_until_the_lock_is_removed(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    lock = _write_lock(directory, "elsewhere.example", 1, None)
    with pytest.raises(ExecutionError) as error, hold_checkpoint_dir(directory):
        pass
    assert "pid 1 on host elsewhere.example" in str(error.value)
    assert f"once it is known to be gone (its host went down), remove {lock}" in str(error.value)
    lock.unlink()
    with hold_checkpoint_dir(directory):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("how", ["exited", "pid-reused"])
def test_a_dead_jobs_lock_is_taken_over(tmp_path: Path, how: str) -> None:
    directory = tmp_path / "ckpt"
    if how == "exited":
        child = subprocess.Popen(["true"])
        child.wait()
        pid, started = child.pid, None
    else:  # this process's pid, but a start time that is not this process's
        pid, started = os.getpid(), str(int(_start_of(os.getpid())) - 1)
    lock = _write_lock(directory, socket.gethostname(), pid, started)
    with hold_checkpoint_dir(directory):
        holder = json.loads(lock.read_text())
        assert (holder["pid"], holder["started"]) == (os.getpid(), _start_of(os.getpid()))
    assert not lock.exists()


def test_a_damaged_lock_is_refused_with_what_to_do(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    lock = lock_path(directory)
    lock.write_text("{not json")
    with (
        pytest.raises(ExecutionError, match="does not name a job") as error,
        hold_checkpoint_dir(directory),
    ):
        pass
    assert f"If no job uses this folder, remove {lock}" in str(error.value)
    assert lock.read_text() == "{not json"
