"""The in-memory hardware profile: frozen values, every number with its unit and its source.

Lives here: the closed vocabularies (`DType`, `LinkClass`, `CollectiveKind`, `SourceKind`) and the
frozen dataclasses a profile is made of. Lives elsewhere: JSON reading, validation and writing
(`profile_io`, `profile_codec`), pricing (`prices`, `cluster`), measuring (`measure.profiler`).

Invariants: a `Profile` mirrors the JSON file one to one (numbers stay in the unit they were written
in; `Quantity.base` converts), so save -> load is the identity; an optional field the file omits
(device.transcendental_rate, efficiency.overlap, efficiency.memory_overlap,
efficiency.causal_skip, machine) is None, and stays
omitted when saved; every `Quantity` has a `Source`; every link class a profile defines has all five collective kinds (send_recv is the p2p cost);
the JSON shape and its rules are in costmodel/schemas/profile.schema.json.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from costmodel.errors import ProfileError
from costmodel.machine import Fingerprint
from costmodel.units import to_base

PROFILE_FORMAT = "autosbp.profile"
PROFILE_VERSION = 1


class SourceKind(Enum):
    """Where a number comes from."""

    MEASURED = "measured"  # by `autosbp profile`: date and command
    SPEC = "spec"  # a vendor spec sheet or paper: ref
    ASSUMPTION = "assumption"  # a judgement: why


class DType(Enum):
    """Element types with a peak flop rate in a profile."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @classmethod
    def parse(cls, name: DType | str) -> DType:
        """Accept `DType`, "bf16", "bfloat16" or "torch.bfloat16"."""
        if isinstance(name, DType):
            return name
        key = str(name).removeprefix("torch.")
        key = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            key, key
        )
        try:
            return cls(key)
        except ValueError:
            known = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown dtype {name!r}; a profile prices {known}") from None


class LinkClass(Enum):
    """The kind of link a communication group uses: inside one node, or across nodes."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


class CollectiveKind(Enum):
    """The communication primitives the cost model prices (send_recv is point to point)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


@dataclass(frozen=True, slots=True)
class Source:
    """The origin of a number. `name` is its key in the profile's shared `sources` table."""

    kind: SourceKind
    ref: str = ""  # spec: the document (and page) the number is read from
    why: str = ""  # assumption: the reasoning
    date: str = ""  # measured: ISO 8601 date and time
    command: str = ""  # measured: the command that reproduces it
    note: str = ""
    name: str = ""  # "" = written inline in the JSON

    @classmethod
    def measured(cls, date: str, command: str, note: str = "", name: str = "") -> Source:
        return cls(SourceKind.MEASURED, date=date, command=command, note=note, name=name)

    @classmethod
    def spec(cls, ref: str, note: str = "", name: str = "") -> Source:
        return cls(SourceKind.SPEC, ref=ref, note=note, name=name)

    @classmethod
    def assumption(cls, why: str, note: str = "", name: str = "") -> Source:
        return cls(SourceKind.ASSUMPTION, why=why, note=note, name=name)

    def describe(self) -> str:
        """One line for people: `spec: NVIDIA A100 datasheet`."""
        text = {
            SourceKind.MEASURED: f"{self.date} `{self.command}`",
            SourceKind.SPEC: self.ref,
            SourceKind.ASSUMPTION: self.why,
        }[self.kind]
        return f"{self.kind.value}: {text}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True, slots=True)
class Quantity:
    """A number as written in the profile: value, unit (see `costmodel.units`) and source."""

    value: float
    unit: str
    source: Source

    @property
    def base(self) -> float:
        """The value in base units: s, bytes, bytes/s, flop/s, or a plain ratio or count."""
        return to_base(self.value, self.unit)


@dataclass(frozen=True, slots=True)
class PeakFlops:
    """Peak dense flop rate per dtype (no sparsity)."""

    fp32: Quantity
    bf16: Quantity
    fp16: Quantity

    def for_dtype(self, dtype: DType | str) -> Quantity:
        return getattr(self, DType.parse(dtype).value)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    memory: Quantity  # capacity per device, bytes
    memory_bandwidth: Quantity  # bytes/s
    peak_flops: PeakFlops
    # exp (or log, erf, tanh) evaluations per second, fp32, on data in cache; None = not stated:
    # priced as free beside their flops and bytes (a GPU's special-function units)
    transcendental_rate: Quantity | None = None


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of peak that real ops reach, the per-op floor (launch, framework overhead), how
    much communication running beside compute hides (None = not stated: nothing hidden), and how
    much of an op's memory traffic its arithmetic hides (None = not stated: all of the shorter,
    the roofline's max)."""

    matmul: Quantity  # ratio of peak flops reached by compute-bound ops
    memory_bound: Quantity  # ratio of memory bandwidth reached by memory-bound ops
    op_overhead: Quantity  # s, no op is faster than this
    overlap: Quantity | None = None  # ratio in [0, 1]: fraction of a collective's time hidden
    # when it runs beside compute (of the shorter of the two; Galvatron's overlap coefficient)
    memory_overlap: Quantity | None = None  # ratio in [0, 1]: fraction of the shorter of an
    # op's compute time and memory time that the other hides (1: roofline max; 0: their sum)
    causal_skip: Quantity | None = None  # ratio in [0, 1]: fraction of a causal attention's
    # masked scores its kernel does not compute (flash kernels skip masked blocks; a math
    # kernel computes every score under the mask: 0, also what an unstated one means)


@dataclass(frozen=True, slots=True)
class Topology:
    devices_per_node: Quantity  # devices
    nodes: Quantity | None  # nodes; None = "scalable": a Cluster chooses the node count

    @property
    def max_nodes(self) -> int | None:
        return None if self.nodes is None else int(self.nodes.value)


@dataclass(frozen=True, slots=True)
class MeasuredTable:
    """Measured (message size, time) points per group size, sizes strictly increasing."""

    size_unit: str
    time_unit: str
    source: Source
    points: tuple[tuple[int, tuple[tuple[float, float], ...]], ...]  # (group size, points)

    def base_points(self, group_size: int) -> tuple[tuple[float, float], ...]:
        """The points of one group size in bytes and seconds (empty if not measured)."""
        for size, pts in self.points:
            if size == group_size:
                return tuple(
                    (to_base(s, self.size_unit), to_base(t, self.time_unit)) for s, t in pts
                )
        return ()

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(size for size, _ in self.points)


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """time = latency + bus_factor(kind, n) * bytes / bus_bandwidth, or the table where measured."""

    kind: CollectiveKind
    latency: Quantity  # s
    bus_bandwidth: Quantity  # bytes/s, nccl-tests busbw
    table: MeasuredTable | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Link:
    link_class: LinkClass
    medium: str  # for people: "NVLink 3 through NVSwitch", "loopback TCP (gloo)"
    collectives: tuple[CollectiveCost, ...]  # one per CollectiveKind, in enum order

    def collective(self, kind: CollectiveKind) -> CollectiveCost:
        for cost in self.collectives:
            if cost.kind is kind:
                return cost
        raise AssertionError(f"link {self.link_class.value} has no {kind.value}")  # validated


@dataclass(frozen=True, slots=True)
class MeasuredOn:
    """The machine a measured profile describes, and where, when and how it was measured."""

    fingerprint: Fingerprint
    date: str  # ISO 8601 date and time, UTC
    command: str  # the command that measured it
    host: str = ""  # the host name, for people ("" = not recorded); not part of the fingerprint
    load_1min: float | None = None  # other work's 1-minute load average meanwhile (None: unknown)


@dataclass(frozen=True, slots=True)
class Profile:
    """A hardware profile: one device kind, its node topology, and its link classes."""

    name: str
    description: str
    device: Device
    efficiency: Efficiency
    topology: Topology
    links: tuple[Link, ...]  # in LinkClass order
    machine: MeasuredOn | None = None  # a machine's own profile says which (None: not stated)

    def __repr__(self) -> str:  # the full tree is in the JSON; this is for logs and errors
        links = ", ".join(c.value for c in self.link_classes)
        return f"Profile({self.name!r}, device={self.device.name!r}, links=({links}))"

    @property
    def link_classes(self) -> tuple[LinkClass, ...]:
        return tuple(link.link_class for link in self.links)

    def link(self, link_class: LinkClass | str) -> Link:
        """The link of a class; ProfileError naming the profile if it does not define it."""
        wanted = LinkClass(link_class)
        for link in self.links:
            if link.link_class is wanted:
                return link
        defined = ", ".join(c.value for c in self.link_classes)
        raise ProfileError(
            f"profile {self.name!r} has no {wanted.value!r} link (it defines: {defined}). "
            f"Use a profile that describes {wanted.value} communication, or add a "
            f"links.{wanted.value} section to it."
        )

    def sources(self) -> Iterator[Source]:
        """Every source the profile cites, in file order, with repeats."""
        d, e = self.device, self.efficiency
        yield from (q.source for q in (d.memory, d.memory_bandwidth))
        if d.transcendental_rate is not None:
            yield d.transcendental_rate.source
        yield from (q.source for q in (d.peak_flops.fp32, d.peak_flops.bf16, d.peak_flops.fp16))
        yield from (q.source for q in (e.matmul, e.memory_bound, e.op_overhead))
        yield from (q.source for q in (e.overlap, e.memory_overlap) if q is not None)
        yield self.topology.devices_per_node.source
        if self.topology.nodes is not None:
            yield self.topology.nodes.source
        for link in self.links:
            for cost in link.collectives:
                yield cost.latency.source
                yield cost.bus_bandwidth.source
                if cost.table is not None:
                    yield cost.table.source

    def source_kinds(self) -> tuple[SourceKind, ...]:
        """The kinds of source cited, in enum order."""
        cited = {source.kind for source in self.sources()}
        return tuple(kind for kind in SourceKind if kind in cited)
