"""Run a function on N local processes with torch.distributed initialized, never hanging.

Lives here: `run_workers`, used by the profiler (measurements), the tests (gloo on loopback) and
`autosbp train` / `autosbp demo` (through `runtime.train`). Lives elsewhere: what the workers do.

Invariants: every wait has a deadline; the first rank that raises or dies makes `run_workers`
stop every other rank (SIGTERM, then SIGKILL) and raise one `ExecutionError` that names that
rank, its pid and the cause (the exception, or the exit code or signal); results come back in
rank order. `fn` must be importable (a module-level function) because the workers are spawned,
not forked (fork + threads in torch is unsafe).

Which rank is the cause: when one rank fails, its peers' collectives fail too ("Connection reset
by peer"), and their reports may reach the parent first. So failures are gathered for
`FAILURE_GRACE_S` after the first one, then the cause is a rank that died without reporting (a
signal, os._exit, a native crash: it cannot be the consequence of a peer's failure), else the
rank that raised first (each rank stamps its failure before tearing down its process group, the
moment its peers start failing; one host, one clock).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.errors import ExecutionError

_POLL_S = 0.05
# After the first failure, how long to wait for the rest before naming the cause. A peer's
# consequent error follows its cause by milliseconds on one host (measured: under 0.1 s on
# loopback gloo); 1 s leaves a wide margin and is all a failing job waits for.
FAILURE_GRACE_S = 1.0
_STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
_STARTUP_S = 60.0  # interpreter + torch import, not part of the collective timeout
_NATIVE_CRASHES = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
)
_NATIVE_TRACE_LINES = 30


@dataclass(frozen=True, slots=True)
class _Failure:
    """How one rank failed: `event` completes "rank R (pid P) ...", `cause` follows "Cause: "."""

    rank: int
    pid: int
    at_s: float  # time.time() when it failed (for a death: when the parent noticed)
    died: bool  # ended without a report: a signal, os._exit, a native crash
    event: str  # "raised ValueError", "died with signal SIGKILL"
    cause: str
    trace: str = ""  # the rank's own traceback (Python, or faulthandler's for a native crash)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    job: str | None = None,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `nproc` spawned processes; return results by rank.

    torch.distributed is initialized in each worker (`backend`, loopback TCP store) with
    `timeout_s` as the collective timeout, and torn down after `fn` returns. `job` names what
    the workers do in error messages ("training"; default: fn's name).
    """
    if nproc < 1:
        raise ExecutionError(f"nproc must be at least 1, got {nproc}.")
    job = job or f"`{getattr(fn, '__name__', repr(fn))}`"
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autosbp-ranks-") as logs:
        static = (fn, nproc, port, backend, timeout_s, tuple(args), dict(env or {}), results)
        procs = [
            ctx.Process(target=_worker, args=(rank, _native_log(logs, rank), *static), daemon=True)
            for rank in range(nproc)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, timeout_s, job, logs)
        finally:
            _stop(procs)


def _collect(procs: list[Any], results: Any, timeout_s: float, job: str, logs: str) -> list[Any]:
    nproc = len(procs)
    deadline = time.monotonic() + timeout_s + _STARTUP_S
    done: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    first_failure_s = float("inf")
    while len(done) < nproc:
        _read_reports(results, done, failures, _POLL_S)
        for rank, proc in enumerate(procs):
            if rank not in done and rank not in failures and not proc.is_alive():
                _read_reports(results, done, failures, 0.0)  # reported just before exiting?
                if rank not in done and rank not in failures:
                    failures[rank] = _death(rank, proc, _native_log(logs, rank))
        now = time.monotonic()
        if failures:
            first_failure_s = min(first_failure_s, now)
            if len(done) + len(failures) == nproc or now > first_failure_s + FAILURE_GRACE_S:
                raise ExecutionError(_failure_message(failures, done, nproc, job))
        if now > deadline:
            missing = sorted(set(range(nproc)) - set(done))
            raise ExecutionError(
                f"ranks {missing} did not finish {job} within {timeout_s:.0f} s (+{_STARTUP_S:.0f} "
                "s start-up) and were stopped; a collective is probably waiting for a rank that "
                "never calls it. Check that every rank runs the same collectives in the same order."
            )
    return [done[rank] for rank in range(nproc)]


def _read_reports(
    results: Any, done: dict[int, Any], failures: dict[int, _Failure], block_s: float
) -> None:
    """Move every report waiting in `results` into `done` or `failures` (a rank's first failure
    report is its cause; one from its teardown after that is not)."""
    timeout = block_s
    while True:
        try:
            rank, ok, payload = results.get(timeout=timeout)
        except queue.Empty:
            return
        timeout = 0.0
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            failures.setdefault(rank, payload)


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_STOP_GRACE_S)


def _failure_message(
    failures: dict[int, _Failure], done: dict[int, Any], nproc: int, job: str
) -> str:
    by_time = sorted(failures.values(), key=lambda f: f.at_s)
    cause = next((f for f in by_time if f.died), by_time[0])
    stopped = "; the other ranks were stopped" if nproc > 1 else ""
    lines = [
        f"rank {cause.rank} of {nproc} (pid {cause.pid}) {cause.event} during {job}{stopped}. "
        f"Cause: {cause.cause}"
    ]
    then = [f"rank {f.rank} {f.event}" for f in by_time if f is not cause]
    running = [rank for rank in range(nproc) if rank not in failures and rank not in done]
    if then:
        lines.append(f"Then {', '.join(then)}.")
    if running:
        lines.append(f"Still running when stopped: ranks {running}.")
    if cause.trace:
        lines.append(cause.trace.rstrip())
    return "\n".join(lines)


def _death(rank: int, proc: Any, native_log: Path) -> _Failure:
    """A rank that ended without reporting: what its exit code or signal says about why."""
    code = proc.exitcode
    trace = ""
    if code is not None and code < 0:
        sig = _signal(-code)
        event = f"died with signal {sig.name if sig else -code}"
        if sig in _NATIVE_CRASHES:
            cause = "a crash in native code (a torch kernel, an extension, or the transport)."
            trace = _native_trace(rank, native_log)
        elif sig == signal.SIGKILL:
            cause = (
                "SIGKILL comes from outside the process: usually the kernel's out-of-memory "
                "killer (see `dmesg`), else a user or a job scheduler."
            )
        else:
            cause = "the signal came from outside the job (a user, a job scheduler, a terminal)."
    elif code == 0:
        event = "exited with code 0 without returning a result"
        cause = "the worker function or a library it called ended the process (os._exit(0))."
    else:
        event = f"died with exit code {code}"
        cause = (
            "it exited without raising a Python exception (os._exit, or exit in native code); "
            "its own output above may say why."
        )
    return _Failure(rank, proc.pid, time.time(), True, event, cause, trace)


def _native_trace(rank: int, native_log: Path) -> str:
    """faulthandler's dump of the crashed rank, down to the launcher's frame that called fn."""
    lines = []
    for line in native_log.read_text(errors="replace").splitlines():
        if __file__ in line or line.startswith("Extension modules"):
            break
        lines.append(line)
    trace = "\n".join(lines[-_NATIVE_TRACE_LINES:]).strip()
    return f"Native traceback of rank {rank} (faulthandler):\n{trace}" if trace else ""


def _signal(number: int) -> signal.Signals | None:
    try:
        return signal.Signals(number)
    except ValueError:  # a real-time signal has no name
        return None


def _raised(rank: int, exc: BaseException) -> _Failure:
    """A rank's exception, with its traceback from below the launcher's frame that caught it."""
    tb = exc.__traceback__
    tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    lines = traceback.format_exception(type(exc), exc, tb)[1:]  # past "Traceback (most ...):"
    trace = f"Traceback of rank {rank} (most recent call last):\n" + "".join(lines)
    event = f"raised {type(exc).__name__}"
    return _Failure(
        rank, os.getpid(), time.time(), False, event, f"{type(exc).__name__}: {exc}", trace
    )


def _native_log(logs: str, rank: int) -> Path:
    return Path(logs) / f"rank{rank}.native.txt"


def _worker(
    rank: int,
    native_log: Path,
    fn: Callable[..., Any],
    nproc: int,
    port: int,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription
    with native_log.open("w") as log:
        faulthandler.enable(log, all_threads=False)  # a native crash leaves its stack here
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=nproc,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            _run_rank(fn, rank, nproc, args, results)
        except BaseException as exc:  # reported to the parent, which raises ExecutionError
            results.put((rank, False, _raised(rank, exc)))
        finally:
            faulthandler.disable()


def _run_rank(
    fn: Callable[..., Any], rank: int, nproc: int, args: tuple[Any, ...], results: Any
) -> None:
    """Call fn; a failure is stamped and reported before the process group goes (the moment
    its peers start failing), so the parent can tell the cause from its consequences."""
    try:  # pickled here, so a result that cannot be is this rank's error, not a silent exit
        out = bytes(ForkingPickler.dumps(fn(rank, nproc, *args)))
    except BaseException as exc:  # reported to the parent, which raises ExecutionError
        results.put((rank, False, _raised(rank, exc)))
        return
    finally:
        dist.destroy_process_group()
    results.put((rank, True, out))
