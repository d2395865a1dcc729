"""The rank side of the profiler: build each item's call, time it, report progress.

Lives here: `profile_worker` (run by `launching.workers.run_workers` in every rank), the calls for
matmul, elementwise add and each collective (nccl-tests sizes, fp32 buffers), the timing loop, the
streamed matmul (the next of several weights each call: `ProfilerConfig.streamed_matmul`), and
the overlap item (a matmul loop and a matched all-reduce, alone and at once: `_time_overlap`).
Lives elsewhere: what to measure and the aggregation over ranks (`profiler`).

Invariants: every rank creates every process group and runs every item in the same order; the
number of calls and repeats comes from an all-reduced estimate, so all ranks agree on it; an op
the backend lacks (RuntimeError on every rank) returns None instead of a timing. torch is imported
inside the functions: this module is imported by the parent before the workers are spawned.
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from costmodel.machine import cpu_model
from costmodel.measure.items import GroupShape, Item, ProfilerConfig
from costmodel.profile import CollectiveKind, DType

_COLLECTIVE_DTYPE_BYTES = 4  # fp32 buffers
OVERHEAD_OPS = 20  # the overhead item: this many one-element adds under autograd, and backward
_OVERLAP_PROBE_NUMEL = 2**18  # 1 MiB: the first all-reduce timed to size the overlap buffer
_OVERLAP_MAX_NUMEL = 2**28  # 1 GiB: the cap on very fast links (then b < a; min(a, b) copes)
_MAX_MATMULS = 10_000  # the cap on the overlap item's compute loop (a very fast device)
# how backends word a missing op (gloo: "does not support", c10d: "not implemented"); other
# RuntimeErrors (out of memory, a dead peer) are real failures and propagate
_UNSUPPORTED = re.compile(r"not support|unsupported|not implemented", re.IGNORECASE)


def profile_worker(
    rank: int, world: int, config: ProfilerConfig, items: Sequence[Item], progress: Any
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = _worker_device(rank, config.backend)
    groups = {}
    for shape in config.group_shapes():  # every rank creates every group, in the same order
        for ranks in shape.groups(world):
            pg = None if len(ranks) == world else dist.new_group(list(ranks))
            if rank in ranks:
                groups[shape] = (pg, ranks)
    results: list[Any] = []
    for i, item in enumerate(items):
        if item.op == "overlap":
            results.append(_time_overlap(item.size, config, device))
        else:
            call, amount = _make_call(item, config, rank, device, groups)
            times = _time_call(call, config, device)
            results.append(None if times is None else (amount, times))
        if progress is not None and rank == 0:
            progress.put((i + 1, len(items), item.label))
    return {"info": _device_info(device, torch), "results": results}


def _worker_device(rank: int, backend: str) -> Any:
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _device_info(device: Any, torch: Any) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, int(props.total_memory)
        how = "torch.cuda.get_device_properties(device).total_memory"
    else:
        name = cpu_model()
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        how = "os.sysconf: physical memory pages x page size, shared by the ranks of the host"
    return {
        "device_name": name,
        "memory_bytes": memory,
        "memory_how": how,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _make_call(
    item: Item, config: ProfilerConfig, rank: int, device: Any, groups: dict[GroupShape, Any]
) -> tuple[Callable[[], Any], float]:
    """A no-argument callable doing the item once, and its size (bytes, or n / numel)."""
    import torch

    dtype = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[
        item.dtype
    ]
    if item.op == "matmul":
        a, b = (torch.randn(item.size, item.size, device=device).to(dtype) for _ in range(2))
        c = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=c)), float(item.size)
    if item.op == "streamed":
        rows, n, count = config.streamed_matmul
        x = torch.randn(rows, n, device=device)
        weights = itertools.cycle([torch.randn(n, n, device=device) for _ in range(count)])
        out = torch.empty(rows, n, device=device)
        return (lambda: torch.matmul(x, next(weights), out=out)), float(n)
    if item.op == "overhead":  # OVERHEAD_OPS one-element adds under autograd, then backward
        leaf = torch.ones(1, device=device, requires_grad=True)

        def chain() -> None:
            out = leaf
            for _ in range(OVERHEAD_OPS):
                out = out + 1.0
            out.backward()

        return chain, float(item.size)
    if item.op == "exp":
        x = torch.randn(item.size, device=device)
        y = torch.empty_like(x)
        return (lambda: torch.exp(x, out=y)), float(item.size)
    if item.op == "elementwise":
        a, b = (torch.randn(item.size, device=device) for _ in range(2))
        c = torch.empty_like(a)
        return (lambda: torch.add(a, b, out=c)), float(item.size)
    assert item.shape is not None
    pg, ranks = groups[item.shape]
    return _collective_call(CollectiveKind(item.op), item.size, pg, ranks, rank, device)


def _collective_call(
    kind: CollectiveKind, nbytes: int, pg: Any, ranks: tuple[int, ...], rank: int, device: Any
) -> tuple[Callable[[], Any], float]:
    import torch
    import torch.distributed as dist

    n = len(ranks)
    numel = max(n, nbytes // _COLLECTIVE_DTYPE_BYTES // n * n)  # divisible by the group size
    full, other = torch.ones(numel, device=device), torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls: dict[CollectiveKind, Callable[[], Any]] = {
        CollectiveKind.ALL_REDUCE: lambda: dist.all_reduce(full, group=pg),
        CollectiveKind.ALL_GATHER: lambda: gather(full, part, group=pg),
        CollectiveKind.REDUCE_SCATTER: lambda: scatter(part, full, group=pg),
        CollectiveKind.ALL_TO_ALL: lambda: dist.all_to_all_single(other, full, group=pg),
        CollectiveKind.SEND_RECV: (
            (lambda: dist.send(full, dst=ranks[1]))
            if rank == ranks[0]
            else (lambda: dist.recv(full, src=ranks[0]))
        ),
    }
    return calls[kind], float(numel * _COLLECTIVE_DTYPE_BYTES)


def _time_call(call: Callable[[], Any], config: ProfilerConfig, device: Any) -> list[float] | None:
    """Per-repeat seconds per call on this rank, or None if the backend lacks the op."""
    import torch
    import torch.distributed as dist

    sync, ids = _sync_and_barrier_ids(device)
    ok = torch.ones(1, device=device)
    try:
        call()
    except RuntimeError as exc:  # "ProcessGroupGloo does not support alltoall" and the like
        if not _UNSUPPORTED.search(str(exc)):
            raise
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        return None
    for _ in range(config.warmup - 1):
        call()
    sync()
    estimate_s = _slowest_rank_s(_seconds(call, device), device)  # same k and repeats everywhere
    calls, repeats = config.calls_and_repeats(estimate_s)
    times = []
    for _ in range(repeats):
        dist.barrier(device_ids=ids)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return times


def _sync_and_barrier_ids(device: Any) -> tuple[Callable[[], Any], list[int] | None]:
    """(wait for the device's queued work, device_ids for dist.barrier: NCCL's GPU or None)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.synchronize, [device.index]
    return (lambda: None), None


def _seconds(call: Callable[[], Any], device: Any) -> float:
    """Seconds of one call on this rank, started after a barrier, ended when the device is done."""
    import torch.distributed as dist

    sync, ids = _sync_and_barrier_ids(device)
    sync()
    dist.barrier(device_ids=ids)
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def _slowest_rank_s(seconds: float, device: Any) -> float:
    """The largest of every rank's `seconds` (all-reduce MAX): the same on every rank."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _time_overlap(
    n: int, config: ProfilerConfig, device: Any
) -> tuple[float, list[tuple[float, float, float]]]:
    """(all-reduce bytes, per repeat: (matmul loop alone, all-reduce alone, both at once) s)."""
    import torch
    import torch.distributed as dist

    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    c = torch.empty_like(a)

    def matmuls(count: int) -> Callable[[], None]:
        def loop() -> None:
            for _ in range(count):
                torch.matmul(a, b, out=c)

        return loop

    def all_reduce(numel: int) -> Callable[[], Any]:
        return partial(dist.all_reduce, torch.ones(numel, device=device))

    compute = matmuls(_sized_to(config.overlap_compute_s, matmuls, 1, _MAX_MATMULS, device))
    target_s = _slowest_rank_median_s(compute, device)  # the loop as it really came out
    numel = _sized_to(target_s, all_reduce, _OVERLAP_PROBE_NUMEL, _OVERLAP_MAX_NUMEL, device)
    buffer = torch.ones(numel, device=device)
    collective = partial(dist.all_reduce, buffer)

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    _seconds(both, device)  # warm-up of the async path
    _, repeats = config.calls_and_repeats(3 * target_s)
    times = []
    for _ in range(repeats):
        compute_s, collective_s = _seconds(compute, device), _seconds(collective, device)
        times.append((compute_s, collective_s, _seconds(both, device)))
    return float(numel * _COLLECTIVE_DTYPE_BYTES), times


def _sized_to(
    target_s: float, make: Callable[[int], Callable[[], Any]], size: int, cap: int, device: Any
) -> int:
    """The size (>= 1, <= cap) whose `make(size)` takes about `target_s` on the slowest rank.

    Three tries, each rescaling linearly from the last: the first may be latency-bound (a small
    probe), and on a shared CPU the time per matmul grows with the loop's length (measured: 0.5 ms
    at 5 matmuls of 256^3, 0.9 ms at 20). Every rank gets the same size (timings all-reduced MAX).
    """
    for _ in range(3):
        took_s = _slowest_rank_median_s(make(size), device)
        size = int(min(cap, max(1, round(size * target_s / took_s))))
    return size


def _slowest_rank_median_s(call: Callable[[], Any], device: Any, tries: int = 3) -> float:
    """After one warm-up call, the slowest rank's median seconds over `tries` calls."""
    call()
    return _slowest_rank_s(statistics.median(_seconds(call, device) for _ in range(tries)), device)
