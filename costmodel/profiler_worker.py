"""The rank side of the profiler: build each item's call, time it, report progress.

Lives here: `profile_worker` (run by `costmodel.launch.run_workers` in every rank), the calls for
matmul, elementwise add and each collective (nccl-tests sizes, fp32 buffers), and the timing loop.
Lives elsewhere: what to measure and the aggregation over ranks (`profiler`).

Invariants: every rank creates every process group and runs every item in the same order; the
number of calls and repeats comes from an all-reduced estimate, so all ranks agree on it; an op
the backend lacks (RuntimeError on every rank) returns None instead of a timing. torch is imported
inside the functions: this module is imported by the parent before the workers are spawned.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from costmodel.profile import CollectiveKind, DType

if TYPE_CHECKING:
    from costmodel.profiler import GroupShape, Item, ProfilerConfig

_COLLECTIVE_DTYPE_BYTES = 4  # fp32 buffers
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
        call, amount = _make_call(item, rank, device, groups)
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
        name = _cpu_model()
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        how = "os.sysconf: physical memory pages x page size, shared by the ranks of the host"
    return {
        "device_name": name,
        "memory_bytes": memory,
        "memory_how": how,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: no /proc; platform gives a coarser name
        pass
    return platform.processor() or platform.machine() or "CPU"


def _make_call(
    item: Item, rank: int, device: Any, groups: dict[GroupShape, Any]
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
    if item.op in ("elementwise", "overhead"):
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

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = [device.index] if device.type == "cuda" else None  # NCCL: barrier on this GPU
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
    dist.barrier(device_ids=ids)
    start = time.perf_counter()
    call()
    sync()
    estimate = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)  # every rank derives the same k and repeats
    calls, repeats = config.calls_and_repeats(estimate.item())
    times = []
    for _ in range(repeats):
        dist.barrier(device_ids=ids)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return times
