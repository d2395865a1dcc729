"""Profile JSON <-> frozen `Profile`, and the checks JSON Schema cannot express.

Lives here: `profile_from_dict` (after schema validation: refuses numbers that are not finite
and text with control characters anywhere, and values beyond any hardware (`MAX_BASE`);
resolves named sources, checks that sizes in measured tables increase and that a multi-node
topology has an inter_node link) and
`profile_to_dict` (shared sources written once in `sources`, referenced by name), and
`profile_error`, the one place a ProfileError message is phrased (file, JSON path, problem,
expected, fix). Lives elsewhere: finding, reading and schema-validating files (`profile_io`).

Invariants: `profile_from_dict(profile_to_dict(p)) == p`; the dict holds only JSON types.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any

from costmodel.errors import ProfileError
from costmodel.machine import Fingerprint
from costmodel.profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CollectiveCost,
    CollectiveKind,
    Device,
    DType,
    Efficiency,
    Link,
    LinkClass,
    MeasuredOn,
    MeasuredTable,
    PeakFlops,
    Profile,
    Quantity,
    Source,
    SourceKind,
    Topology,
)
from costmodel.units import Dimension, dimension_of, to_base
from terminal.text import has_control, printable

# The largest value a profile may state, per dimension, in base units: about 100x beyond the
# largest hardware of 2025 (spec sheets: B200 192 GB HBM3e at 8 TB/s, 4.5e15 dense fp8 flop/s;
# NVLink 5 at 1.8 TB/s per GPU), so a typo or a fit that overflowed is refused, not priced (a
# 1e300 flop/s device turns every compute time into 0 and the plan into nonsense). Times: an
# op, a message or an overhead of more than an hour is no measurement.
MAX_BASE: dict[Dimension, float] = {
    Dimension.TIME: 3600.0,
    Dimension.BYTES: 2.0**50,
    Dimension.BANDWIDTH: 1e15,
    Dimension.FLOP_RATE: 1e18,
    Dimension.RATIO: 1.0,
    Dimension.DEVICES: 2.0**20,
    Dimension.NODES: 2.0**20,
}
_BASE_UNIT = {
    Dimension.TIME: " s", Dimension.BYTES: " B", Dimension.BANDWIDTH: " B/s",
    Dimension.FLOP_RATE: " flop/s", Dimension.RATIO: "", Dimension.DEVICES: " devices",
    Dimension.NODES: " nodes",
}  # fmt: skip


def profile_error(origin: str, path: str, problem: str, expected: str, fix: str) -> ProfileError:
    """The message every profile problem gets: where (file and JSON path), what, expected, fix."""
    return ProfileError(f"profile {origin}: at {path}: {problem}. Expected {expected}. Fix: {fix}")


class _Decoder:
    def __init__(self, origin: str, data: Mapping[str, Any]) -> None:
        self.origin = origin
        self.shared = {
            name: _source(obj, name) for name, obj in dict(data.get("sources", {})).items()
        }

    def source(self, obj: Any, path: str) -> Source:
        if isinstance(obj, dict):
            return _source(obj, "")
        if obj not in self.shared:
            known = ", ".join(sorted(self.shared)) or "none"
            raise profile_error(
                self.origin,
                path,
                f"unknown source {obj!r} referenced",
                f"an inline source object or one of the names in `sources` ({known})",
                f"define {obj!r} under the top-level `sources`, or fix the name",
            )
        return self.shared[obj]

    def quantity(self, obj: Mapping[str, Any], path: str) -> Quantity:
        self.bounded(obj["value"], obj["unit"], f"{path}.value")
        return Quantity(obj["value"], obj["unit"], self.source(obj["source"], f"{path}.source"))

    def bounded(self, value: float, unit: str, path: str) -> None:
        """ProfileError unless `value` (in `unit`) is within its dimension's MAX_BASE."""
        dimension = dimension_of(unit)
        limit = MAX_BASE[dimension]
        if to_base(value, unit) > limit:
            raise profile_error(
                self.origin,
                path,
                f"{value:g} {unit} is beyond any hardware",
                f"at most {limit:g}{_BASE_UNIT[dimension]} (about 100x the largest "
                "hardware of 2025; see costmodel.profile_codec.MAX_BASE)",
                "check the number and its unit",
            )

    def table(self, obj: Mapping[str, Any], path: str) -> MeasuredTable:
        points = []
        for group, pts in obj["points"].items():
            sizes = [size for size, _ in pts]
            if any(b <= a for a, b in itertools.pairwise(sizes)):
                raise profile_error(
                    self.origin,
                    f"{path}.points.{group}",
                    f"message sizes {sizes} do not increase",
                    "[size, time] pairs sorted by strictly increasing size",
                    "sort the points by size and drop repeated sizes",
                )
            for index, (size, time) in enumerate(pts):
                where = f"{path}.points.{group}[{index}]"
                self.bounded(size, obj["size_unit"], where)
                self.bounded(time, obj["time_unit"], where)
            points.append((int(group), tuple((s, t) for s, t in pts)))
        points.sort()
        source = self.source(obj["source"], f"{path}.source")
        return MeasuredTable(obj["size_unit"], obj["time_unit"], source, tuple(points))

    def link(self, link_class: LinkClass, obj: Mapping[str, Any], path: str) -> Link:
        costs = []
        for kind in CollectiveKind:
            entry, where = obj["collectives"][kind.value], f"{path}.collectives.{kind.value}"
            table = self.table(entry["table"], f"{where}.table") if "table" in entry else None
            costs.append(
                CollectiveCost(
                    kind,
                    self.quantity(entry["latency"], f"{where}.latency"),
                    self.quantity(entry["bus_bandwidth"], f"{where}.bus_bandwidth"),
                    table,
                    entry.get("note", ""),
                )
            )
        return Link(link_class, obj["medium"], tuple(costs))


def _source(obj: Mapping[str, Any], name: str) -> Source:
    fields = {key: obj[key] for key in ("ref", "why", "date", "command", "note") if key in obj}
    return Source(SourceKind(obj["kind"]), name=name, **fields)


def profile_from_dict(data: Mapping[str, Any], origin: str) -> Profile:
    """A schema-valid profile dict as a `Profile`; ProfileError for the semantic faults left."""
    _check_leaves(data, origin)
    dec = _Decoder(origin, data)
    dev, eff, topo = data["device"], data["efficiency"], data["topology"]
    peak = {
        d: dec.quantity(dev["peak_flops"][d.value], f"$.device.peak_flops.{d.value}") for d in DType
    }
    device = Device(
        dev["name"],
        dec.quantity(dev["memory"], "$.device.memory"),
        dec.quantity(dev["memory_bandwidth"], "$.device.memory_bandwidth"),
        PeakFlops(peak[DType.FP32], peak[DType.BF16], peak[DType.FP16]),
        (
            dec.quantity(dev["transcendental_rate"], "$.device.transcendental_rate")
            if "transcendental_rate" in dev
            else None
        ),
    )
    given = {key: dec.quantity(eff[key], f"$.efficiency.{key}") for key in eff}
    efficiency = Efficiency(
        given["matmul"],
        given["memory_bound"],
        given["op_overhead"],
        given.get("overlap"),
        given.get("memory_overlap"),
        given.get("causal_skip"),
    )
    nodes = None if topo["nodes"] == "scalable" else dec.quantity(topo["nodes"], "$.topology.nodes")
    topology = Topology(
        dec.quantity(topo["devices_per_node"], "$.topology.devices_per_node"), nodes
    )
    links = tuple(
        dec.link(lc, data["links"][lc.value], f"$.links.{lc.value}")
        for lc in LinkClass
        if lc.value in data["links"]
    )
    if (nodes is None or nodes.value > 1) and LinkClass.INTER_NODE.value not in data["links"]:
        raise profile_error(
            origin,
            "$.links",
            "the topology allows several nodes but no `inter_node` link is defined",
            'links.inter_node when topology.nodes is "scalable" or more than 1',
            "add links.inter_node (measured across hosts, or from the NIC spec), or set "
            'topology.nodes to {"value": 1, "unit": "nodes", ...}',
        )
    machine = _measured_on(data["machine"]) if "machine" in data else None
    return Profile(
        data["name"], data.get("description", ""), device, efficiency, topology, links, machine
    )


def _measured_on(obj: Mapping[str, Any]) -> MeasuredOn:
    fingerprint = Fingerprint(obj["cpu"], obj["cores"], obj["memory_bytes"], obj["torch"])
    return MeasuredOn(
        fingerprint, obj["date"], obj["command"], obj.get("host", ""), obj.get("load_1min")
    )


def _machine_dict(on: MeasuredOn) -> dict[str, Any]:
    f = on.fingerprint
    where = {"host": on.host} if on.host else {}
    load = {} if on.load_1min is None else {"load_1min": on.load_1min}
    return {
        "cpu": f.cpu, "cores": f.cores, "memory_bytes": f.memory_bytes, "torch": f.torch,
        **where, **load, "date": on.date, "command": on.command,
    }  # fmt: skip


def _check_leaves(data: Mapping[str, Any], origin: str) -> None:
    """Every number finite (NaN passes every range check of the schema: each comparison with
    it is false), and no text with control characters (it reaches the terminal)."""
    for path, value in _leaves(data):
        if isinstance(value, float) and not math.isfinite(value):
            raise profile_error(
                origin, path, f"{value} is not a number to price with", "a finite number",
                "write the measured or spec-sheet value",
            )  # fmt: skip
        if isinstance(value, str) and has_control(value):
            raise profile_error(
                origin, path, f"the text {printable(repr(value))} holds control characters",
                "plain text", "remove the control characters (they would drive the terminal)",
            )  # fmt: skip


def _leaves(data: Any) -> Iterator[tuple[str, Any]]:
    """(JSON path, value) of every leaf and key, without recursion (the file was parsed, so
    its depth is bounded by the JSON reader's)."""
    stack: list[tuple[str, Any]] = [("$", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            for key, item in value.items():
                yield path, key
                stack.append((f"{path}.{key}", item))
        elif isinstance(value, list | tuple):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        else:
            yield path, value


class _Encoder:
    def __init__(self) -> None:
        self.shared: dict[str, dict[str, Any]] = {}

    def optional(self, key: str, quantity: Quantity | None) -> dict[str, Any]:
        """{key: the quantity} for an optional field, {} where the profile omits it."""
        return {} if quantity is None else {key: self.quantity(quantity)}

    def source(self, source: Source) -> str | dict[str, Any]:
        obj: dict[str, Any] = {"kind": source.kind.value}
        for key in ("ref", "why", "date", "command", "note"):
            if getattr(source, key):
                obj[key] = getattr(source, key)
        if not source.name:
            return obj
        previous = self.shared.setdefault(source.name, obj)
        assert previous == obj, f"two different sources are both named {source.name!r}"
        return source.name

    def quantity(self, q: Quantity) -> dict[str, Any]:
        return {"value": q.value, "unit": q.unit, "source": self.source(q.source)}

    def collective(self, cost: CollectiveCost) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "latency": self.quantity(cost.latency),
            "bus_bandwidth": self.quantity(cost.bus_bandwidth),
        }
        if cost.table is not None:
            t = cost.table
            obj["table"] = {
                "size_unit": t.size_unit,
                "time_unit": t.time_unit,
                "source": self.source(t.source),
                "points": {str(g): [list(p) for p in pts] for g, pts in t.points},
            }
        if cost.note:
            obj["note"] = cost.note
        return obj


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON form of a profile (see costmodel/schemas/profile.schema.json)."""
    enc = _Encoder()
    d, e, t = profile.device, profile.efficiency, profile.topology
    body = {
        "device": {
            "name": d.name,
            "memory": enc.quantity(d.memory),
            "memory_bandwidth": enc.quantity(d.memory_bandwidth),
            "peak_flops": {dt.value: enc.quantity(d.peak_flops.for_dtype(dt)) for dt in DType},
            **enc.optional("transcendental_rate", d.transcendental_rate),
        },
        "efficiency": {
            "matmul": enc.quantity(e.matmul),
            "memory_bound": enc.quantity(e.memory_bound),
            "op_overhead": enc.quantity(e.op_overhead),
            **enc.optional("overlap", e.overlap),
            **enc.optional("memory_overlap", e.memory_overlap),
            **enc.optional("causal_skip", e.causal_skip),
        },
        "topology": {
            "devices_per_node": enc.quantity(t.devices_per_node),
            "nodes": "scalable" if t.nodes is None else enc.quantity(t.nodes),
        },
        "links": {
            link.link_class.value: {
                "medium": link.medium,
                "collectives": {c.kind.value: enc.collective(c) for c in link.collectives},
            }
            for link in profile.links
        },
    }
    head = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": profile.name}
    if profile.description:
        head["description"] = profile.description
    if profile.machine is not None:
        head["machine"] = _machine_dict(profile.machine)
    if enc.shared:
        head["sources"] = enc.shared
    return {**head, **body}
