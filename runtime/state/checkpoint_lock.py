"""One live job per checkpoint folder: a lock file beside the folder naming the job that holds it.

Lives here: `hold_checkpoint_dir` (the folder held for a `with` block: the lock taken, or an
ExecutionError naming the job that holds it; released at the end), `lock_path` and
`LockHolder` (what a lock file says). Lives elsewhere: the checkpoints themselves
(`runtime.state.checkpoint`), the job that holds its folder for its whole life (`autosbp
train`, from before it looks into the folder; a Python caller of `runtime.jobs.train` or
`save_checkpoint` holds it with `hold_checkpoint_dir`).

Why: two jobs saving into one folder replace each other's `DIR.tmp` and `DIR` mid-save (issue
48 item 5: one job failed with a FileNotFoundError, and the checkpoint left had a rank file that
failed its sha256).

How: the lock is `<DIR>.lock`, beside the folder (inside it, it would move with the renames
that publish a checkpoint: `runtime.state.checkpoint`), created with O_CREAT | O_EXCL (one
creator wins, on NFS too) and holding JSON: the holder's host, pid, process start time (from
/proc, where there is one) and the time it took the lock. A lock whose holder ran on this host
and runs no more (no such pid, or the pid now names a process started at another time) is
stale: it is taken over, under an flock of the parent folder, so that two jobs finding one
stale lock at once cannot both take it. Whether a job on another host still runs cannot be
seen from here: its lock is refused, and the message says to remove the file once that job is
known to be gone.

Invariants:
- Re-entrant within one process (a caller's hold around `autosbp train`'s, say); released
  when the outermost hold ends.
- Under torchrun one rank (rank 0, through `on_rank0`) holds it for the job; every rank gets
  its refusal.
- The file is removed only by the process it names (a lock taken over from this process while
  it ran is left to its new holder).
Reference: the pid-file convention of lockfile(1) and of PostgreSQL's postmaster.pid (a pid
checked for life, and for reuse by its start time).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autosbp.errors import ExecutionError
from terminal.text import printable

__all__ = ["LockHolder", "hold_checkpoint_dir", "lock_path"]

_held: dict[Path, int] = {}  # lock file -> how many holds of this process are open on it


@dataclass(frozen=True, slots=True)
class LockHolder:
    """What a lock file says: the job's host and pid, its process's start time (ticks since
    boot, /proc/PID/stat's 22nd field; None where unknown) and when it took the lock."""

    host: str
    pid: int
    started: str | None
    since: str

    def describe(self) -> str:
        return f"the job of pid {self.pid} on host {printable(self.host)} (since {self.since})"


def lock_path(directory: str | os.PathLike[str]) -> Path:
    """The lock file of checkpoint folder `directory`: `<directory>.lock`, beside it."""
    folder = Path(directory).absolute()
    return folder.with_name(folder.name + ".lock")


def _hold_here(directory: Path) -> None:
    """This process holds `directory`: a nested hold, or the lock taken (ExecutionError if
    another job holds it)."""
    lock = lock_path(directory)
    if lock not in _held:
        _take(lock, directory)
        _held[lock] = 0
    _held[lock] += 1


@contextlib.contextmanager
def hold_checkpoint_dir(
    directory: str | os.PathLike[str],
    on_rank0: Callable[[Callable[[], None]], None] = lambda take: take(),
) -> Iterator[None]:
    """Hold checkpoint folder `directory` for the block: ExecutionError, naming the job that
    holds it, if another live job does. `on_rank0(take)` runs `take` where the job's lock is
    taken (in this process by default; under torchrun `runtime.jobs.made_on_rank0`, which
    raises its refusal on every rank)."""
    folder = Path(directory)
    on_rank0(lambda: _hold_here(folder))
    try:
        yield
    finally:
        lock = lock_path(folder)
        if lock in _held:  # not on the ranks that did not take it
            _held[lock] -= 1
            if not _held[lock]:
                del _held[lock]
                _release(lock)


def _me() -> LockHolder:
    pid = os.getpid()
    since = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return LockHolder(socket.gethostname(), pid, _process_start(pid), since)


def _take(lock: Path, directory: Path) -> None:
    """Create `lock` naming this process, taking over a stale one; else ExecutionError."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        with _one_taker_at_a_time(lock.parent):
            for _ in range(2):  # a stale lock removed, then one more try
                try:
                    handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = _read(lock)
                    if holder is None or not _stale(holder):
                        raise _in_use(directory, lock, holder) from None
                    lock.unlink(missing_ok=True)
                    continue
                with os.fdopen(handle, "w") as file:
                    json.dump(asdict(_me()), file)
                    file.flush()
                    os.fsync(file.fileno())
                return
            raise _in_use(directory, lock, _read(lock))
    except OSError as exc:
        raise ExecutionError(
            f"cannot make the lock file {lock} that keeps other jobs out of checkpoint folder "
            f"{directory}: {exc.strerror or exc}. Choose a checkpoint folder in a place this user "
            "can write."
        ) from None


@contextlib.contextmanager
def _one_taker_at_a_time(folder: Path) -> Iterator[None]:
    """An flock of `folder` for the block: on one host, two jobs never check and take over a
    stale lock at the same time. Where the filesystem has no flock (some NFS), the block runs
    unguarded: O_EXCL still lets one creator win."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the flock


def _read(lock: Path) -> LockHolder | None:
    """The lock's holder, or None where the file is not a lock this module wrote."""
    try:
        data: Any = json.loads(lock.read_text())
        started = data["started"]
        return LockHolder(
            str(data["host"]),
            int(data["pid"]),
            None if started is None else str(started),
            str(data["since"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stale(holder: LockHolder) -> bool:
    """The holder ran on this host and runs no more (its pid is gone, or reused by a process
    started at another time). A holder on another host is never stale: it cannot be checked."""
    if holder.host != socket.gethostname():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it runs
    now = _process_start(holder.pid)
    return holder.started is not None and now is not None and now != holder.started


def _process_start(pid: int) -> str | None:
    """Process `pid`'s start time in ticks since boot (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (command) ": field 3 onwards
    return fields[19] if len(fields) > 19 else None


def _in_use(directory: Path, lock: Path, holder: LockHolder | None) -> ExecutionError:
    if holder is None:
        return ExecutionError(
            f"checkpoint folder {directory} is locked by {lock}, which does not name a job "
            "(damaged, or written by something else). If no job uses this folder, remove "
            f"{lock}; else choose another folder."
        )
    elsewhere = holder.host != socket.gethostname()
    gone = (
        f" That job runs on another host, so whether it still runs cannot be checked from here: "
        f"once it is known to be gone (its host went down), remove {lock} and start again."
        if elsewhere
        else ""
    )
    return ExecutionError(
        f"checkpoint folder {directory} is in use by {holder.describe()}, which holds {lock}: "
        "two jobs saving into one folder destroy each other's checkpoints. Wait for that job to "
        f"end, or choose another folder.{gone}"
    )


def _release(lock: Path) -> None:
    """Remove `lock` if it still names this process."""
    holder, me = _read(lock), _me()
    if holder is not None and (holder.host, holder.pid, holder.started) == (
        me.host,
        me.pid,
        me.started,
    ):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
