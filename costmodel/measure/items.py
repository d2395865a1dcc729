"""What the profiler measures: the items every rank times, in one order computed from the config.

Lives here: `ProfilerConfig` (what to measure and how long to try: the CLI's default and
--quick), `GroupShape` (a layout of rank groups), `Item` (one thing to time) and `plan_items`.
Lives elsewhere: running the items and aggregating them (`profiler`), timing one item on one
rank (`worker`), fitting a profile (`fitting`).

Invariant: `plan_items` depends on the config alone, so every rank runs the same items in the
same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.cluster import link_class_for_mesh_dim
from costmodel.profile import CollectiveKind, DType, LinkClass

KIB_BYTES = 1024
MIB_BYTES = 1024 * 1024


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
