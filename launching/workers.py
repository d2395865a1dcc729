"""Run a function on N local processes with torch.distributed initialized: no hang, no leftovers.

Lives here: the parent's side, `run_workers`: start the ranks, watch them, stop them, and name
the cause of a failure or a stall. Used by the profiler (measurements), the tests (gloo on loopback)
and `autosbp train` / `autosbp demo` (through `runtime.jobs`). Lives elsewhere: the rank's side
(`launching.rank`: joining the world, dying with the parent, `report_progress`, re-exported
here), the other way to get a world (`launching.torchrun`: this process is one rank that
torchrun started), what the workers do.

Invariants:
- No deadline for the job, a watchdog on progress: the parent ends the job when a rank has made
  no progress for `timeout_s` (a stall). Progress is a call of `report_progress` (the training
  loop reports every step and every firing), so a job that keeps reporting runs as long as
  it needs. The message names every stalled rank, what it last reported, and its Python stack
  (faulthandler's dump, asked for with `rank.STACK_SIGNAL`). A report may ask for grace beyond
  the timeout (a job's setup: loading and capturing its model). A rank that never reports
  stalls `timeout_s` after a start-up allowance (`STARTUP_S`): for functions that do not report
  (the profiler's, the tests') that is a deadline for the whole call.
- Collectives time out `COLLECTIVE_MARGIN_S` after the stall timeout, so on a stall the watchdog
  (which names every rank) speaks first, and a collective's own timeout still bounds a rank.
- The first rank that raises or dies makes `run_workers` stop every other rank (SIGTERM, then
  SIGKILL) and raise one `ExecutionError` naming that rank, its pid and the cause (the exception,
  or the exit code or signal); results come back in rank order.
- Ranks die with the parent however it ends (`launching.rank`), and the job leaves nothing on
  disk: each rank's crash and stack log is an anonymous file (`rank.RankLog`).
- The rendezvous store lives in the parent and listens on 127.0.0.1 only, on the port the OS gave
  the socket it is handed (bound and listening before any rank starts: no free-then-bind race);
  gloo's own sockets bind the loopback interface (GLOO_SOCKET_IFNAME, unless already set).
- Backends: "gloo" or "nccl" (`torchrun.process_group_backend`: NCCL jobs join as
  "cpu:gloo,cuda:nccl").
- `fn` must be importable (a module-level function): ranks are forked from multiprocessing's
  forkserver (`_rank_context`; spawned where there is none), never from this process (fork +
  threads in torch is unsafe). The server is a clean process of its own that imported torch
  and the first call's `fn`'s module once; it dies with this process
  (`launching.forkserver_guard`). Each rank takes this process's environment as it is at the
  call (the server's is as it was at its start), and its working folder and import path
  (multiprocessing's own preparation), as a spawned one would.
  Call `run_workers` from the main thread: Linux's parent-death signal fires when the thread
  that started a rank (or the server) ends.

Which rank is the cause: when one rank fails, its peers' collectives fail too ("Connection reset
by peer"), and their reports may reach the parent first. So failures are gathered for
`FAILURE_GRACE_S` after the first one, then the cause is a rank that died without reporting (a
signal, os._exit, a native crash: it cannot be the consequence of a peer's failure), else the
rank that raised first (each rank stamps its failure before tearing down its process group, the
moment its peers start failing; one host, one clock).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from launching import rank as rank_side
from launching.errors import ExecutionError
from launching.rank import Failure, ProgressTable, RankLog, report_progress
from launching.torchrun import process_group_backend

__all__ = ["STARTUP_S", "report_progress", "run_workers"]

_POLL_S = 0.05
# After the first failure, how long to wait for the rest before naming the cause. A peer's
# consequent error follows its cause by milliseconds on one host (measured: under 0.1 s on
# loopback gloo); 1 s leaves a wide margin and is all a failing job waits for.
FAILURE_GRACE_S = 1.0
_STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
# Before a rank's first report (interpreter and torch import, measured 3-5 s here), and the
# grace a job gives its setup activities (loading and capturing a model: 2-10 s for the zoo).
STARTUP_S = 60.0
# The watchdog polls every _POLL_S and takes up to _STACK_WAIT_S for the stacks; 5 s more lets
# it speak before a collective that waits since the same moment times out, on a loaded machine.
COLLECTIVE_MARGIN_S = 5.0
# for the stalled ranks' faulthandler dumps, each whole (milliseconds alone; a loaded machine
# wrote one rank's before the other's had its last frames)
_STACK_WAIT_S = 3.0
_NATIVE_CRASHES = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
)
_TRACE_LINES = 30  # of a native crash's dump; a stall shows the innermost _STALL_FRAMES frames
_STALL_FRAMES = 8


def run_workers(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    job: str | None = None,
    on_done: Callable[[int, tuple[float, ...]], None] | None = None,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `nproc` processes; return results by rank.

    torch.distributed is initialized in each worker (`backend`, the parent's loopback store)
    and torn down after `fn` returns. `timeout_s` is the stall timeout (see the module's
    invariants); collectives time out `COLLECTIVE_MARGIN_S` later. `job` names what the workers
    do in error messages ("training"; default: fn's name). `on_done(rank, values)` is called
    in this process, from the watch loop, when a rank reports a finished unit of work
    (`report_progress(..., done=values)`; the latest report per poll).
    """
    if nproc < 1:
        raise ExecutionError(f"nproc must be at least 1, got {nproc}.")
    job = job or f"`{getattr(fn, '__name__', repr(fn))}`"
    ctx = _rank_context(fn)
    results: Any = ctx.Queue()
    progress = ProgressTable(ctx, nproc)
    logs = [RankLog() for _ in range(nproc)]
    collective_s = timeout_s + COLLECTIVE_MARGIN_S
    store, port = _loopback_store(nproc, collective_s)
    # the whole environment: a rank forked from the forkserver has the server's, of its start
    worker_env = {**os.environ, **_loopback_gloo_env(), **(env or {})}
    pg_backend = process_group_backend(backend)
    static = (nproc, port, pg_backend, collective_s, worker_env, results, progress)
    procs: list[Any] = []
    try:
        for rank in range(nproc):  # ParentDeath first: see launching.rank
            death = rank_side.ParentDeath(os.getpid())
            call = rank_side.pickled_call(fn, args)
            procs.append(
                ctx.Process(
                    target=rank_side.worker,
                    args=(death, rank, logs[rank], call, *static),
                    daemon=True,
                )
            )
            procs[-1].start()
        return _Watch(procs, results, progress, logs, timeout_s, job, on_done).collect()
    finally:
        _stop(procs)
        for log in logs:
            log.close()
        del store  # the server goes with the job


def _rank_context(fn: Callable[..., Any]) -> Any:
    """How ranks start: forked from this process's forkserver where the platform has one, else
    spawned. The server starts at the first call and imports torch and that call's `fn`'s
    module once (its list is read then; later calls' modules import in the rank); each rank
    is then a fork of a process that has imported them: milliseconds instead of seconds of
    imports per rank (measured: a 4-rank world of the tests' workers started in 7.3 s
    spawned, 0.0 s forked from a warm server, whose own start took 2.7 s)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    module = getattr(fn, "__module__", None)
    preload = ["launching.forkserver_guard", "torch", "torch.distributed"]  # the guard first
    ctx.set_forkserver_preload([*preload, module] if module and module != "__main__" else preload)
    return ctx


def _loopback_store(nproc: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The rendezvous server, on a socket bound to 127.0.0.1 and already listening (the OS
    picks the port; nothing can take it between choosing and binding)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, nproc))
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(
        "127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
    )  # fmt: skip
    return store, port


def _loopback_gloo_env() -> dict[str, str]:
    """Bind gloo's sockets to the loopback interface (it takes the host name's address
    otherwise), unless the environment already chose one. Set for "nccl" jobs too: their CPU
    tensors go through gloo."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((n for n in ("lo", "lo0") if n in names), None)  # Linux, macOS
    return {"GLOO_SOCKET_IFNAME": loopback} if loopback else {}


class _Watch:
    """The parent's loop: gather results and failures, notice deaths and stalls."""

    def __init__(
        self,
        procs: list[Any],
        results: Any,
        progress: ProgressTable,
        logs: list[RankLog],
        timeout_s: float,
        job: str,
        on_done: Callable[[int, tuple[float, ...]], None] | None = None,
    ) -> None:
        self.procs, self.results, self.progress, self.logs = procs, results, progress, logs
        self.timeout_s, self.job, self.on_done = timeout_s, job, on_done
        self.started_s = time.monotonic()
        self.done: dict[int, Any] = {}
        self.failures: dict[int, Failure] = {}
        self.seen = [0] * len(procs)  # per rank: how many `done` reports were handed on

    def _hand_on_done(self) -> None:
        if self.on_done is None:
            return
        for rank in range(len(self.procs)):
            version, values = self.progress.done(rank)
            if version != self.seen[rank]:
                self.seen[rank] = version
                self.on_done(rank, values)

    def collect(self) -> list[Any]:
        nproc = len(self.procs)
        first_failure_s = float("inf")
        while len(self.done) < nproc:
            _read_reports(self.results, self.done, self.failures, _POLL_S)
            self._hand_on_done()
            self._notice_deaths()
            now = time.monotonic()
            if self.failures:
                first_failure_s = min(first_failure_s, now)
                finished = len(self.done) + len(self.failures) == nproc
                if finished or now > first_failure_s + FAILURE_GRACE_S:
                    raise ExecutionError(self._failure_message())
                continue
            stalled = [r for r in self._running() if now > self._stalls_at(r)]
            if stalled:
                raise ExecutionError(self._stall_message(stalled))
        self._hand_on_done()  # the last reports, made just before the results
        return [self.done[rank] for rank in range(nproc)]

    def _running(self) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.done and r not in self.failures]

    def _stalls_at(self, rank: int) -> float:
        """When the rank counts as stalled: the stall timeout after its last report (plus the
        grace it asked for), or after a start-up allowance before its first."""
        reported_s, grace_s, _ = self.progress.last(rank)
        if reported_s == 0:
            return self.started_s + STARTUP_S + self.timeout_s
        return reported_s + grace_s + self.timeout_s

    def _notice_deaths(self) -> None:
        for rank in self._running():
            if not self.procs[rank].is_alive():
                _read_reports(self.results, self.done, self.failures, 0.0)  # reported, then left?
                if rank not in self.done and rank not in self.failures:
                    self.failures[rank] = _death(rank, self.procs[rank], self.logs[rank])

    # ---- messages ---------------------------------------------------------------------------

    def _failure_message(self) -> str:
        by_time = sorted(self.failures.values(), key=lambda f: f.at_s)
        cause = next((f for f in by_time if f.died), by_time[0])
        nproc = len(self.procs)
        stopped = "; the other ranks were stopped" if nproc > 1 else ""
        lines = [
            f"rank {cause.rank} of {nproc} (pid {cause.pid}) {cause.event} during {self.job}"
            f"{stopped}. Cause: {cause.cause}"
        ]
        then = [f"rank {f.rank} {f.event}" for f in by_time if f is not cause]
        running = self._running()
        if then:
            lines.append(f"Then {', '.join(then)}.")
        if running:
            lines.append(f"Still running when stopped: ranks {running}.")
        lines += self._reports(range(nproc))
        if cause.trace:
            lines.append(cause.trace.rstrip())
        return "\n".join(lines)

    def _stall_message(self, stalled: list[int]) -> str:
        """Who stalled, and where every running rank is: a rank whose stack sits in
        torch.distributed waits for a peer; one elsewhere is stuck in its own code, and is the
        likely cause, even if its own timer has not run out yet (ranks that hang together
        report within milliseconds of each other, and either may be the first past it)."""
        nproc, now = len(self.procs), time.monotonic()
        stacks = self._stacks([r for r in self._running() if self.progress.last(r)[0] > 0])
        waiting = [r for r in stacks if _in_collective(stacks[r])]
        stuck = [r for r in stacks if r not in waiting]
        pids = ", ".join(f"{r}: {self.procs[r].pid}" for r in stalled)
        lines = [
            f"{_ranks(stalled)} of {nproc} (pid {pids}) made no progress for {self.timeout_s:g} "
            f"s (the stall timeout) during {self.job}, so the job was stopped"
            + (f"; {_ranks(stuck)} outside any collective" if stuck else "")
            + (f"; {_ranks(waiting)} waiting in a collective" if waiting else "")
            + ". A rank stalls when it waits for a peer that never answers (ranks running "
            "different collectives, or different plans) or is stuck in its own code; if a step "
            f"may take longer than {self.timeout_s:g} s, raise the stall timeout."
        ]
        lines += self._reports(range(nproc), now)
        for rank, stack in stacks.items():
            lines.append(f"Python stack of rank {rank} (innermost call first):\n{stack}")
        return "\n".join(lines)

    def _reports(self, ranks: range, now: float | None = None) -> list[str]:
        """One line per rank that reported progress: what it last said, and how long ago."""
        now = time.monotonic() if now is None else now
        out = []
        for rank in ranks:
            at_s, _, doing = self.progress.last(rank)
            if at_s > 0:
                state = "finished; " if rank in self.done else ""
                out.append(f"rank {rank}: {state}last reported `{doing}` {now - at_s:.1f} s ago")
        return [f"Progress reports: {'; '.join(out)}."] if out else []

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The main thread's innermost frames of each rank (faulthandler, on STACK_SIGNAL; only
        ranks that reported progress have its handler installed)."""
        before = {r: len(self.logs[r].read()) for r in ranks}
        for rank in ranks:
            os.kill(self.procs[rank].pid, rank_side.STACK_SIGNAL)
        deadline = time.monotonic() + _STACK_WAIT_S

        def dumped() -> dict[int, str]:  # a dump read half-written has no launcher frame yet
            return {r: _main_thread(self.logs[r].read()[before[r] :]) for r in ranks}

        stacks = dumped()
        while time.monotonic() < deadline and not all(stacks.values()):
            time.sleep(_POLL_S)
            stacks = dumped()
        return {r: s for r, s in stacks.items() if s}


def _main_thread(dump: str) -> str:
    """From faulthandler's dump of every thread: the thread that runs the worker, its innermost
    _STALL_FRAMES frames above the launcher's own (those and the interpreter's below are cut)."""
    for block in dump.split("\n\n"):
        frames = [line.strip() for line in block.splitlines()[1:]]
        ours = [i for i, line in enumerate(frames) if rank_side.__file__ in line]
        if ours:
            return "\n".join(f"  {line}" for line in frames[: ours[0]][:_STALL_FRAMES])
    return ""


def _in_collective(stack: str) -> bool:
    """Whether a stack's innermost frame is torch.distributed's (a wait for peers)."""
    first = stack.split("\n", 1)[0]
    return f"torch{os.sep}distributed{os.sep}" in first


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _read_reports(
    results: Any, done: dict[int, Any], failures: dict[int, Failure], block_s: float
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
        if proc.pid is None:  # never started
            continue
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_STOP_GRACE_S)


def _death(rank: int, proc: Any, log: RankLog) -> Failure:
    """A rank that ended without reporting: what its exit code or signal says about why."""
    code = proc.exitcode
    trace = ""
    if code is not None and code < 0:
        sig = _signal(-code)
        event = f"died with signal {sig.name if sig else -code}"
        if sig in _NATIVE_CRASHES:
            cause = "a crash in native code (a torch kernel, an extension, or the transport)."
            trace = _native_trace(rank, log)
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
    return Failure(rank, proc.pid, time.time(), True, event, cause, trace)


def _native_trace(rank: int, log: RankLog) -> str:
    """faulthandler's dump of the crashed rank, down to the launcher's frame that called fn."""
    lines = []
    for line in log.read().splitlines():
        if rank_side.__file__ in line or line.startswith("Extension modules"):
            break
        lines.append(line)
    trace = "\n".join(lines[-_TRACE_LINES:]).strip()
    return f"Native traceback of rank {rank} (faulthandler):\n{trace}" if trace else ""


def _signal(number: int) -> signal.Signals | None:
    try:
        return signal.Signals(number)
    except ValueError:  # a real-time signal has no name
        return None
