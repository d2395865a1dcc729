"""Inside one rank started by `launching.workers.run_workers`: die with the parent, join the
world, report progress, hand back the result or the failure.

Lives here: `report_progress` (a rank says it made progress and what it does now, and, after a unit
of work such as a training step, up to `DONE_VALUES` numbers about it that the parent may show: the
step, its loss, its time), the shared `ProgressTable` those reports go to, `RankLog` (the anonymous
file a rank's faulthandler dumps go to), `Failure` (how a rank failed, as the parent reports it)
and `worker`, the entry point of a spawned rank, with `pickled_call` (how the parent hands it its
function and arguments). Lives elsewhere: the parent's side, watching and stopping the ranks
(`launching.workers`); what the ranks compute (the caller's function).

Invariants:
- A rank dies with its parent, however the parent ends (SIGKILL included): Linux kills it the
  moment the process that forked it goes (`prctl(PR_SET_PDEATHSIG, SIGKILL)`, set before
  anything else: the parent, or the parent's forkserver, which Linux kills with the parent,
  `launching.forkserver_guard`; a parent already gone by then is noticed by its pid);
  elsewhere a thread watching both pids ends it within `PARENT_POLL_S`. So that "before
  anything else" is milliseconds after the start, the request is made while the rank's
  arguments are unpickled, by the first of them (`ParentDeath`), and this module (the
  target's) imports no torch at load.
- The rank joins the world through the parent's store on 127.0.0.1 (a client; the parent is the
  server) and never listens beyond loopback itself (gloo's sockets: see `launching.workers`).
- Reports are cheap (a time and a short label written into shared memory, a few microseconds)
  so a rank may report every firing; outside a `run_workers` rank they do nothing.
- A failure is stamped and reported before the process group goes (the moment its peers start
  failing), so the parent can tell the cause from its consequences.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.reduction import ForkingPickler
from typing import Any

from terminal.errors import AutosbpError

__all__ = ["Failure", "ParentDeath", "ProgressTable", "RankLog", "report_progress", "worker"]

LABEL_BYTES = 160  # a progress report is cut to this many bytes of UTF-8: a line of a message
DONE_VALUES = 8  # numbers a rank may report about its last unit of work (their meaning: the job's)
PARENT_POLL_S = 0.5  # without prctl: how often a rank looks whether its parent is still there
STACK_SIGNAL = signal.SIGUSR1  # the parent asks a rank for its Python stacks with it
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True, slots=True)
class Failure:
    """How one rank failed: `event` completes "rank R (pid P) ...", `cause` follows "Cause: "."""

    rank: int
    pid: int
    at_s: float  # time.time() when it failed (for a death: when the parent noticed)
    died: bool  # ended without a report: a signal, os._exit, a native crash
    event: str  # "raised ValueError", "died with signal SIGKILL"
    cause: str
    trace: str = ""  # the rank's own traceback (Python, or faulthandler's for a native crash)


class ProgressTable:
    """Per rank, in shared memory: when it last reported progress (`time.monotonic()`, one clock
    for every process of a machine; 0 until it first reports), the grace its current activity
    has beyond the stall timeout, and what it said it does now. Each rank writes its own slot;
    the parent reads them all (a label read while it is being written may mix two reports: it
    is only shown). Beside them, the numbers it last reported about a finished unit of work
    (`done`: up to DONE_VALUES, NaN where unset; a version counter says when they changed)."""

    def __init__(self, ctx: Any, nproc: int) -> None:
        self.times = ctx.RawArray("d", nproc)
        self.graces = ctx.RawArray("d", nproc)
        self.labels = ctx.RawArray("c", nproc * LABEL_BYTES)
        self.values = ctx.RawArray("d", [float("nan")] * (nproc * DONE_VALUES))
        self.versions = ctx.RawArray("l", nproc)

    def report(
        self, rank: int, doing: str, grace_s: float, done: tuple[float, ...] | None = None
    ) -> None:
        data = doing.encode(errors="replace")[:LABEL_BYTES].ljust(LABEL_BYTES, b"\0")
        self.labels[rank * LABEL_BYTES : (rank + 1) * LABEL_BYTES] = data
        if done is not None:
            padded = [*done[:DONE_VALUES], *[float("nan")] * (DONE_VALUES - len(done))]
            self.values[rank * DONE_VALUES : (rank + 1) * DONE_VALUES] = padded
            self.versions[rank] += 1
        self.graces[rank] = grace_s
        self.times[rank] = time.monotonic()

    def done(self, rank: int) -> tuple[int, tuple[float, ...]]:
        """(how many times the rank reported `done`, the numbers it reported last)."""
        values = tuple(self.values[rank * DONE_VALUES : (rank + 1) * DONE_VALUES])
        return int(self.versions[rank]), values

    def last(self, rank: int) -> tuple[float, float, str]:
        """(monotonic time of the last report or 0, its grace in seconds, what it said)."""
        raw = bytes(self.labels[rank * LABEL_BYTES : (rank + 1) * LABEL_BYTES])
        return self.times[rank], self.graces[rank], raw.rstrip(b"\0").decode(errors="replace")


class RankLog:
    """An anonymous file (never named on disk, so nothing is left behind however the job ends)
    that one rank's faulthandler writes its crash and stack dumps into and the parent reads.
    It reaches the spawned rank as an inherited descriptor: unpickled there, it is that int."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 - open for the job, closed by close()

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _inherited_fd, (reduction.DupFd(self._file.fileno()),)

    def read(self) -> str:
        """Everything written so far (pread: the rank's write offset is shared and kept)."""
        fd = self._file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def close(self) -> None:
        self._file.close()


def _inherited_fd(dup: Any) -> int:
    return int(dup.detach())


# A rank's own slot in the parent's table, set by `worker` (module state of the rank process,
# as torch.distributed keeps its world: one per process, none in the parent).
_reporter: tuple[ProgressTable, int] | None = None


def report_progress(
    doing: str, *, grace_s: float = 0.0, done: tuple[float, ...] | None = None
) -> None:
    """In a rank started by `run_workers`: it made progress and now does `doing` (a few words,
    e.g. "step 12: recv of micro-batch 1"), which may take `grace_s` beyond the stall timeout
    (setting up: loading a model, capturing it, reading a checkpoint). The parent ends the job
    when a rank has not reported for that long, naming what it last reported. With `done`, the
    rank also finished a unit of work and says up to DONE_VALUES numbers about it (a training
    step: its index, loss, time), which the parent hands to `run_workers`' `on_done`.
    Elsewhere: nothing."""
    if _reporter is not None:
        table, rank = _reporter
        table.report(rank, doing, grace_s, done)


class ParentDeath:
    """The first argument of every rank: unpickled first in the spawned process (pickle builds
    a Process's target, then its arguments in order), it makes the rank die with its parent
    there and then, before the arguments after it are unpickled (their modules import torch:
    seconds). The rank receives the parent's pid in its place."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid

    def __reduce__(self) -> tuple[Callable[[int], int], tuple[int]]:
        return _die_with_parent, (self.parent_pid,)


def pickled_call(
    fn: Callable[..., Any], args: Sequence[Any]
) -> bytes | tuple[Callable[..., Any], tuple[Any, ...]]:
    """`fn` and its arguments as one rank's `worker` takes them: pickled here, in the parent, and
    unpickled in the rank after it has started. Inside the Process's own pickle they would be
    unpickled while the parent still writes it (their modules import torch: seconds a rank),
    so the ranks would start one after another; as bytes, the parent's write ends as soon as the
    rank reads them. One pickle per rank: a tensor shared by file descriptor is handed over once.
    Arguments that only the spawn itself can hand over (a queue, a pipe, a lock: "through
    inheritance") go in the Process's own pickle, as they are."""
    try:
        return bytes(ForkingPickler.dumps((fn, tuple(args))))
    except RuntimeError as exc:  # multiprocessing's assert_spawning
        if "inheritance" not in str(exc):
            raise
        return fn, tuple(args)


def worker(
    parent_pid: int,
    rank: int,
    log_fd: int,
    call: bytes | tuple[Callable[..., Any], tuple[Any, ...]],
    nproc: int,
    store_port: int,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    results: Any,
    progress: ProgressTable,
) -> None:
    """A spawned rank, already bound to die with its parent (`ParentDeath`): join the world,
    call `fn(rank, nproc, *args)` (`call`, from `pickled_call`), report its result (or its
    failure) to `results`."""
    global _reporter
    faulthandler.enable(log_fd, all_threads=False)  # a native crash leaves its stack here
    faulthandler.register(STACK_SIGNAL, log_fd, all_threads=True)  # the parent asks on a stall
    _reporter = (progress, rank)
    try:
        os.environ.clear()  # the parent's at the call, not the forkserver's from its start
        os.environ.update(env)
        fn, args = pickle.loads(call) if isinstance(call, bytes) else call
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, nproc, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nproc, timeout=timeout)
        _run_rank(fn, rank, nproc, args, results)
    except BaseException as exc:  # reported to the parent, which raises ExecutionError
        results.put((rank, False, raised(rank, exc)))
    finally:
        faulthandler.disable()


def _die_with_parent(parent_pid: int) -> int:
    """End this process when the parent ends (see the module's invariants); the parent's pid.
    The process that forked this one is the parent, or the parent's forkserver, which ends
    when the parent does (`launching.workers`): either way its end is the parent's."""
    forker = os.getppid()
    watched = killed_with_parent()
    if not _alive(parent_pid) or os.getppid() != forker:  # gone before the request took effect
        os._exit(1)
    if not watched:
        threading.Thread(
            target=_watch_parent, args=(parent_pid, forker), name="autosbp-parent-watch",
            daemon=True,
        ).start()  # fmt: skip
    return parent_pid


def killed_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it ends; whether it
    could (not elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, and not ours to signal
        pass
    return True


def _watch_parent(parent_pid: int, forker: int) -> None:
    while os.getppid() == forker and _alive(parent_pid):
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # reparented, or the parent is gone: so must the rank be


def _run_rank(
    fn: Callable[..., Any], rank: int, nproc: int, args: tuple[Any, ...], results: Any
) -> None:
    """Call fn; a failure is stamped and reported before the process group goes."""
    import torch.distributed as dist

    try:  # pickled here, so a result that cannot be is this rank's error, not a silent exit
        out = bytes(ForkingPickler.dumps(fn(rank, nproc, *args)))
    except BaseException as exc:  # reported to the parent, which raises ExecutionError
        results.put((rank, False, raised(rank, exc)))
        return
    finally:
        dist.destroy_process_group()
    results.put((rank, True, out))


def raised(rank: int, exc: BaseException) -> Failure:
    """A rank's exception, with its traceback from below the frame that caught it (none for a
    user-facing `AutosbpError`: its message says the cause and the fix)."""
    if isinstance(exc, AutosbpError):
        event, cause = f"raised {type(exc).__name__}", f"{type(exc).__name__}: {exc}"
        return Failure(rank, os.getpid(), time.time(), False, event, cause)
    tb = exc.__traceback__
    tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    lines = traceback.format_exception(type(exc), exc, tb)[1:]  # past "Traceback (most ...):"
    trace = f"Traceback of rank {rank} (most recent call last):\n" + "".join(lines)
    event = f"raised {type(exc).__name__}"
    return Failure(
        rank, os.getpid(), time.time(), False, event, f"{type(exc).__name__}: {exc}", trace
    )
