"""Measure this machine: matmul, a memory-bound op, the per-op overhead under autograd, a matmul
streaming its weights, compute beside communication, and every collective over sizes and groups.

Lives here: running the items on N spawned ranks and aggregating (`measure`), and the raw
results (`Measurements`). Lives elsewhere: what is measured (`items`: `ProfilerConfig`,
`plan_items`), how one rank times an item (`worker`), fitting and building the Profile
(`fitting`), the plot (`plot`), the command line (`autosbp.commands.profile`).

Timing recipe (nccl-tests and Galvatron; the team notes shared/reference/profiling.md, sections 1
and 3):
warm-up calls; then a calibration call whose time (max over ranks) fixes k, the number of
back-to-back calls per repeat (about 1 ms), and the number of repeats (a time budget per item);
then per repeat: barrier, k calls, synchronize, time / k. A measurement is the median over repeats
of the slowest rank's time: many short repeats let the median drop the ones where a rank was
descheduled (2 ranks on 2 shared cores). Every rank measures at once (the groups of a layout
run concurrently, as all groups of a mesh dim do). On CUDA: NCCL, device =
local rank, torch.cuda.synchronize before reading the clock. Message sizes follow nccl-tests
(see `prices`); collectives use fp32 buffers.

Overlap (Galvatron's overlap coefficient, profiling.md section 1): per repeat, every rank times
(a) a loop of fp32 matmuls alone (about `overlap_compute_s`), (b) an all-reduce of the world group
alone, its buffer calibrated so that b is about a, and (c) both at once (the all-reduce launched
async_op=True, the loop, then wait); hidden = a + b - c, and the profile's efficiency.overlap is
the median over repeats of clamp(hidden / min(a, b), 0, 1), each phase the slowest rank's.

Transcendentals: every rank times torch.exp on `exp_numel` fp32 elements (in cache on a CPU):
elements per second is the profile's device.transcendental_rate.

Memory overlap (how much of an op's memory traffic its arithmetic hides): every rank times a
`streamed_matmul` = (rows, n, weights): a rows x n matrix times one of `weights` n x n fp32
weights, the next one each call, so each weight comes from memory (together they are at least
twice a big CPU's L3 or a GPU's L2); `fitting` compares the time with the profile's own compute
and memory rates. rows = 32 puts the two near each other (intensity 16 flop/byte).

Group layouts: for each divisor n >= 2 of nproc, the contiguous groups of n ranks and the strided
ones (stride nproc / n); a layout whose groups cross a node boundary (devices_per_node) measures
inter_node, else intra_node; one layout per (link class, n) is kept. send_recv runs on layouts of
n = 2 (first rank sends to the second).

Invariants: every rank runs the same items in the same order (the list is computed from the config
alone); an op the backend lacks is recorded as unsupported, not fatal.
"""

from __future__ import annotations

import datetime
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.measure.items import Item, ProfilerConfig, plan_items
from costmodel.measure.worker import OVERHEAD_OPS, profile_worker
from costmodel.profile import CollectiveKind, DType, LinkClass
from launching.workers import run_workers

# The planner prices an op's backward at 2x its forward (autosbp.planner.timing.candidates.BACKWARD_FACTOR;
# costmodel cannot import autosbp): the overhead item's forward + backward per op counts 3 floors.
_BACKWARD_PER_FORWARD = 2.0


@dataclass(frozen=True, slots=True)
class CollectiveSample:
    kind: CollectiveKind
    link_class: LinkClass
    group_size: int
    nbytes: int  # nccl-tests size per rank
    time_s: float


@dataclass(frozen=True, slots=True)
class ComputeSample:
    op: str  # "matmul" | "elementwise" | "overhead" | "streamed" | "exp" (flops: evaluations)
    dtype: DType
    shape: str  # "1024x1024x1024" (m x k x n) or "numel=1048576"
    flops: float
    nbytes: float  # bytes read and written
    time_s: float


@dataclass(frozen=True, slots=True)
class OverlapSample:
    """An fp32 matmul loop and an all-reduce on all ranks, alone and at once (slowest rank)."""

    matmul_n: int
    nbytes: int  # the all-reduce buffer, sized so that it takes about as long as the loop
    compute_s: float  # median over repeats: the loop alone
    collective_s: float  # the all-reduce alone
    both_s: float  # the all-reduce launched async_op=True, the loop, then wait
    ratio: float  # median over repeats of hidden_fraction
    repeats: int


def hidden_fraction(compute_s: float, collective_s: float, both_s: float) -> float:
    """The share of the shorter task that running both at once hid, clamped to [0, 1]."""
    hidden_s = compute_s + collective_s - both_s
    return min(1.0, max(0.0, hidden_s / min(compute_s, collective_s)))


@dataclass(frozen=True, slots=True)
class Measurements:
    config: ProfilerConfig
    collectives: tuple[CollectiveSample, ...]
    compute: tuple[ComputeSample, ...]
    unsupported: tuple[CollectiveKind, ...]
    overlap: OverlapSample
    device_name: str
    memory_bytes: int  # per device
    memory_how: str  # how memory_bytes was read
    torch_version: str
    threads_per_rank: int
    started: str  # ISO 8601, UTC
    seconds: float


ProgressFn = Callable[[int, int, str], None]  # (done, total, label)


def measure(config: ProfilerConfig, on_progress: ProgressFn | None = None) -> Measurements:
    """Run `plan_items(config)` on `config.nproc` ranks and aggregate the timings."""
    import torch.multiprocessing as mp

    items = plan_items(config)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    progress = mp.get_context("spawn").Queue() if on_progress is not None else None
    stop = threading.Event()
    pump = threading.Thread(target=_pump, args=(progress, on_progress, stop), daemon=True)
    if progress is not None:
        pump.start()
    try:
        per_rank = run_workers(
            profile_worker,
            config.nproc,
            (config, items, progress),
            backend=config.backend,
            timeout_s=config.timeout_s,
        )
    finally:
        stop.set()
        if progress is not None:
            pump.join(timeout=5)
    return _aggregate(config, items, per_rank, started, time.monotonic() - t0)


def _pump(progress: Any, on_progress: ProgressFn | None, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            done, total, label = progress.get(timeout=0.1)
        except queue.Empty:
            continue
        if on_progress is not None:
            on_progress(done, total, label)


def _aggregate(
    config: ProfilerConfig, items: Sequence[Item], per_rank: list[Any], started: Any, seconds: float
) -> Measurements:
    info = per_rank[0]["info"]
    collectives, compute, unsupported, overlap = [], [], set(), None
    for i, item in enumerate(items):
        rows = [rank["results"][i] for rank in per_rank]
        if item.op == "overlap":
            overlap = _overlap_sample(item, rows)
            continue
        if any(row is None for row in rows):
            unsupported.add(CollectiveKind(item.op))
            continue
        time_s = statistics.median(max(reps) for reps in zip(*(r[1] for r in rows), strict=True))
        amount = rows[0][0]
        if item.shape is not None:
            collectives.append(
                CollectiveSample(
                    CollectiveKind(item.op),
                    item.shape.link_class,
                    item.shape.size,
                    int(amount),
                    time_s,
                )
            )
        else:
            compute.append(_compute_sample(item, time_s, config))
    assert overlap is not None, "plan_items always measures the overlap"
    return Measurements(
        config,
        tuple(collectives),
        tuple(compute),
        tuple(k for k in CollectiveKind if k in unsupported),
        overlap,
        info["device_name"],
        info["memory_bytes"],
        info["memory_how"],
        info["torch_version"],
        info["threads"],
        started.isoformat(timespec="seconds"),
        seconds,
    )


def _compute_sample(item: Item, time_s: float, config: ProfilerConfig) -> ComputeSample:
    elt = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2}[item.dtype]
    if item.op == "overhead":  # per op, and per forward: its backward counts as two forwards
        per_op_s = time_s / (OVERHEAD_OPS * (1 + _BACKWARD_PER_FORWARD))
        return ComputeSample("overhead", item.dtype, "numel=1", 1.0, 3.0 * elt, per_op_s)
    if item.op == "matmul":
        n = item.size
        return ComputeSample(
            "matmul", item.dtype, f"{n}x{n}x{n}", 2.0 * n**3, 3.0 * n * n * elt, time_s
        )
    if item.op == "exp":
        numel = item.size
        return ComputeSample(
            "exp", item.dtype, f"numel={numel}", float(numel), 2.0 * numel * elt, time_s
        )
    if item.op == "streamed":
        rows, n, _ = config.streamed_matmul
        nbytes = float((n * n + 2 * rows * n) * elt)  # the weight, the input and the output
        return ComputeSample(
            "streamed", item.dtype, f"{rows}x{n}x{n}", 2.0 * rows * n * n, nbytes, time_s
        )
    numel = item.size
    return ComputeSample(
        item.op, item.dtype, f"numel={numel}", float(numel), 3.0 * numel * elt, time_s
    )


def _overlap_sample(item: Item, rows: list[Any]) -> OverlapSample:
    """rows: per rank (bytes, [(compute, collective, both) per repeat]); slowest rank per phase."""
    slowest = [
        tuple(max(phase) for phase in zip(*ranks, strict=True))
        for ranks in zip(*(row[1] for row in rows), strict=True)
    ]
    compute_s, collective_s, both_s = (
        statistics.median(phase) for phase in zip(*slowest, strict=True)
    )
    ratio = statistics.median(hidden_fraction(*repeat) for repeat in slowest)
    return OverlapSample(
        item.size, int(rows[0][0]), compute_s, collective_s, both_s, ratio, len(slowest)
    )
