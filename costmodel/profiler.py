"""Measure this machine: matmul, a memory-bound op, the per-op overhead under autograd, a matmul
streaming its weights, compute beside communication, and every collective over sizes and groups.

Lives here: what is measured (`ProfilerConfig`, `plan_items`), running it on N spawned ranks and
aggregating (`measure`), and the raw results (`Measurements`). Lives elsewhere: how one rank times
an item (`profiler_worker`), fitting and building the Profile (`fitting`), the plot (`plot`), the
command line (`commands`).

Timing recipe (nccl-tests and Galvatron; the team notes shared/reference/profiling.md, sections 1
and 3):
warm-up calls; then a calibration call whose time (max over ranks) fixes k, the number of
back-to-back calls per repeat (about 1 ms), and the number of repeats (a time budget per item);
then per repeat: barrier, k calls, synchronize, time / k. A measurement is the median over repeats
of the slowest rank's time: many short repeats let the median drop the ones where a rank was
descheduled (2 ranks on 2 shared cores). Every rank measures at once (the groups of a layout
run concurrently, as all groups of a mesh dim do). On CUDA: NCCL, device =
local rank, torch.cuda.synchronize before reading the clock. Message sizes follow nccl-tests
(see `costs`); collectives use fp32 buffers.

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

from costmodel.cluster import link_class_for_mesh_dim
from costmodel.launch import run_workers
from costmodel.profile import CollectiveKind, DType, LinkClass
from costmodel.profiler_worker import OVERHEAD_OPS, profile_worker

KIB_BYTES = 1024
MIB_BYTES = 1024 * 1024
# The planner prices an op's backward at 2x its forward (autosbp.planner.costs.BACKWARD_FACTOR;
# costmodel cannot import autosbp): the overhead item's forward + backward per op counts 3 floors.
_BACKWARD_PER_FORWARD = 2.0


@dataclass(frozen=True, slots=True)
class GroupShape:
    """Groups {base + i * stride : i < size} covering all ranks; `link_class` from the layout."""

    size: int
    stride: int
    link_class: LinkClass

    def groups(self, nproc: int) -> tuple[tuple[int, ...], ...]:
        block = self.size * self.stride
        return tuple(
            tuple(outer * block + inner + i * self.stride for i in range(self.size))
            for outer in range(nproc // block)
            for inner in range(self.stride)
        )


@dataclass(frozen=True, slots=True)
class ProfilerConfig:
    """What to measure and how long to try; `for_mode` gives the CLI's default and --quick."""

    nproc: int
    backend: str
    devices_per_node: int
    quick: bool
    collective_sizes_bytes: tuple[int, ...]
    matmul_sizes: tuple[tuple[DType, tuple[int, ...]], ...]  # square n x n x n
    elementwise_numels: tuple[int, ...]
    warmup: int
    target_repeat_s: float  # k back-to-back calls fill about this long
    max_calls_per_repeat: int
    budget_s: float  # per item: repeats fill about this long, within [min_repeats, max_repeats]
    min_repeats: int
    max_repeats: int
    timeout_s: float
    command: str  # how to reproduce, recorded in the profile's sources
    overlap_matmul_n: int = 256  # overlap item: the compute loop runs fp32 n x n x n matmuls
    overlap_compute_s: float = 0.005  # ... and lasts about this long; the all-reduce is matched
    streamed_matmul: tuple[int, int, int] = (32, 1024, 16)  # rows, n, weights (fp32, in turn)
    exp_numel: int = 2**16  # the transcendental item: torch.exp of this many fp32 elements

    @classmethod
    def for_mode(
        cls, nproc: int, backend: str, devices_per_node: int, quick: bool, command: str
    ) -> ProfilerConfig:
        cuda = backend == "nccl"
        matmul: tuple[tuple[DType, tuple[int, ...]], ...]
        if quick:
            sizes = tuple(4 * KIB_BYTES * 16**i for i in range(4))  # 4 KiB .. 16 MiB
        else:
            sizes = tuple(4 * KIB_BYTES * 2**i for i in range(15))  # 4 KiB .. 64 MiB
        if cuda:
            big = (1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192)
            matmul = tuple((d, big) for d in DType)
            numels = (2**24, 2**26) if quick else (2**22, 2**24, 2**26)
        else:  # CPU: bf16 matmul has no fast kernel on most CPUs (about 1 GFLOP/s here)
            matmul = (
                (DType.FP32, (256, 512) if quick else (128, 256, 512, 1024)),
                (DType.BF16, (64, 128) if quick else (64, 128, 256)),
            )
            numels = (2**20, 2**22) if quick else (2**18, 2**20, 2**22)
        return cls(
            nproc,
            backend,
            devices_per_node,
            quick,
            sizes,
            matmul,
            numels,
            warmup=1 if quick else 2,
            target_repeat_s=0.001,
            max_calls_per_repeat=20,
            budget_s=0.08 if quick else 0.4,
            min_repeats=3 if quick else 5,
            max_repeats=9 if quick else 31,
            timeout_s=300.0 if quick else 900.0,
            command=command,
            overlap_matmul_n=2048 if cuda else 256,
            streamed_matmul=(32, 8192, 4) if cuda else (32, 1024, 16),  # 1 GiB / 64 MiB
            exp_numel=2**20 if cuda else 2**16,  # in the L2 of a GPU, in cache on a CPU
        )

    def calls_and_repeats(self, call_s: float) -> tuple[int, int]:
        """(back-to-back calls per repeat, repeats) for an op that takes about `call_s`."""
        calls = int(
            min(self.max_calls_per_repeat, max(1.0, self.target_repeat_s / max(call_s, 1e-9)))
        )
        repeats = int(self.budget_s / max(calls * call_s, 1e-9))
        return calls, min(self.max_repeats, max(self.min_repeats, repeats))

    def group_shapes(self) -> tuple[GroupShape, ...]:
        """One layout per (link class, group size), contiguous before strided."""
        shapes: dict[tuple[LinkClass, int], GroupShape] = {}
        for size in (n for n in range(2, self.nproc + 1) if self.nproc % n == 0):
            for stride in dict.fromkeys((1, self.nproc // size)):
                mesh = (self.nproc // (size * stride), size, stride)
                link = link_class_for_mesh_dim(mesh, 1, 0, self.devices_per_node)
                shapes.setdefault((link, size), GroupShape(size, stride, link))
        return tuple(shapes.values())


@dataclass(frozen=True, slots=True)
class Item:
    """One thing to time. `op` is a CollectiveKind value, "matmul", "elementwise", "overhead",
    "streamed" (a matmul whose weights come from memory), "exp" (transcendental evaluations) or
    "overlap" (compute beside an all-reduce of the world group)."""

    op: str
    size: int  # collective: requested bytes; matmul, overlap, streamed: n; elementwise, exp: numel
    dtype: DType = DType.FP32
    shape: GroupShape | None = None

    @property
    def label(self) -> str:
        if self.shape is not None:
            return f"{self.op} {self.shape.link_class.value} n={self.shape.size} {self.size} B"
        return f"{self.op} {self.dtype.value} {self.size}"


def plan_items(config: ProfilerConfig) -> tuple[Item, ...]:
    """Everything to time, in the order every rank runs it."""
    items = [Item("overhead", 1)]
    items += [Item("matmul", n, dtype) for dtype, sizes in config.matmul_sizes for n in sizes]
    items += [Item("elementwise", numel) for numel in config.elementwise_numels]
    items.append(Item("streamed", config.streamed_matmul[1]))
    items.append(Item("exp", config.exp_numel))
    items.append(Item("overlap", config.overlap_matmul_n))
    for shape in config.group_shapes():
        for kind in CollectiveKind:
            if kind is CollectiveKind.SEND_RECV and shape.size != 2:
                continue
            items += [
                Item(kind.value, nbytes, shape=shape) for nbytes in config.collective_sizes_bytes
            ]
    return tuple(items)


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
