"""Run a function on N local processes with torch.distributed initialized, never hanging.

Lives here: `run_workers`, used by the profiler (measurements), the tests (gloo on loopback) and
the CLI's `train` when it runs without torchrun. Lives elsewhere: what the workers do.

Invariants: every wait has a deadline; a worker that raises, dies or outlives the deadline makes
`run_workers` end every other worker and raise `ExecutionError` naming the rank and the cause;
results come back in rank order. `fn` must be importable (a module-level function) because the
workers are spawned, not forked (fork + threads in torch is unsafe).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.errors import ExecutionError

_POLL_S = 0.05


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
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `nproc` spawned processes; return results by rank.

    torch.distributed is initialized in each worker (`backend`, loopback TCP store) with
    `timeout_s` as the collective timeout, and torn down after `fn` returns.
    """
    if nproc < 1:
        raise ExecutionError(f"nproc must be at least 1, got {nproc}.")
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, nproc, port, backend, timeout_s, tuple(args), dict(env or {}), results),
            daemon=True,
        )
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, nproc, timeout_s, getattr(fn, "__name__", repr(fn)))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def _collect(procs: list[Any], results: Any, nproc: int, timeout_s: float, name: str) -> list[Any]:
    # Startup (interpreter + torch import) is not part of the collective timeout: allow it extra.
    deadline = time.monotonic() + timeout_s + 60.0
    done: dict[int, Any] = {}
    while len(done) < nproc:
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            _check_alive(procs, done, name)
            if time.monotonic() > deadline:
                missing = sorted(set(range(nproc)) - set(done))
                raise ExecutionError(
                    f"{name}: ranks {missing} did not finish within {timeout_s:.0f} s (+60 s "
                    "start-up); a collective is probably waiting for a rank that never calls it. "
                    "Check that every rank runs the same collectives in the same order."
                ) from None
            continue
        if not ok:
            raise ExecutionError(f"{name}: rank {rank} of {nproc} failed:\n{payload}")
        done[rank] = payload
    return [done[rank] for rank in range(nproc)]


def _check_alive(procs: list[Any], done: dict[int, Any], name: str) -> None:
    for rank, proc in enumerate(procs):
        if rank not in done and not proc.is_alive() and proc.exitcode not in (None, 0):
            raise ExecutionError(
                f"{name}: rank {rank} died with exit code {proc.exitcode} before returning "
                "(killed, out of memory, or a crash in native code); the other ranks were stopped."
            )


def _worker(
    fn: Callable[..., Any],
    rank: int,
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
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=nproc,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            out = fn(rank, nproc, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # reported to the parent, which raises ExecutionError
        results.put((rank, False, traceback.format_exc()))
