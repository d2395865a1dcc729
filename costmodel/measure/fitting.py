"""Turn measurements into a Profile: alpha-beta fits per (link class, kind), roofline rates.

Lives here: `fit_alpha_beta` (relative least squares), `build_profile` and the sources a measured
profile cites. Lives elsewhere: taking the measurements (`profiler`), pricing (`prices`).

Fits (all empirical, all recorded with the run's date and command):
- collectives: t = latency + bus_factor(n) * bytes / busbw over every group size of the link class,
  weighted by 1/t^2 so every size counts by its relative error; the table is kept beside the fit.
- peak flops per dtype = the best matmul rate measured; matmul efficiency = geometric mean of
  rate / peak over all matmul points; memory bandwidth = the best rate of the elementwise add,
  memory-bound efficiency = its rate at the largest size / that best (the largest is many times
  any cache, as the weights, gradients and activations a training step streams are: the
  geometric mean over sizes priced a 2-core EPYC's big elementwise ops at half their measured
  time); the op overhead floor = a third of one small op's forward and backward under
  autograd (`profiler_worker.OVERHEAD_OPS` one-element adds and their backward, per op: the
  planner prices backward at 2x forward; a bare add without autograd took half of that here).
- overlap = the profiler's median hidden fraction (`profiler.hidden_fraction`), as measured.
- transcendental rate = elements per second of the exp item (torch.exp, in cache).
- memory overlap = the hidden fraction of the streamed matmul: its compute time c and memory
  time m priced by the rates above, its measured time t: clamp((c + m - t) / min(c, m), 0, 1).
The topology is "scalable" (a Cluster picks the node count): a link class with nothing measured
(one host: no inter_node) copies the other, marked as an assumption; a kind the backend lacks
is priced as an all-reduce of the same buffer (assumption).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from costmodel.measure.profiler import (
    CollectiveSample,
    ComputeSample,
    Measurements,
    OverlapSample,
    hidden_fraction,
)
from costmodel.prices import bus_factor
from costmodel.profile import (
    CollectiveCost,
    CollectiveKind,
    Device,
    DType,
    Efficiency,
    Link,
    LinkClass,
    MeasuredTable,
    PeakFlops,
    Profile,
    Quantity,
    Source,
    Topology,
)

_MIN_LATENCY_S = 0.0
_MAX_BUS_BANDWIDTH_BYTES_PER_S = 1e15  # guard for a flat fit (no size dependence measured)


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) minimizing sum(((alpha + beta * x - t) / t) ** 2), both >= 0."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    alpha, beta = _MIN_LATENCY_S - 1.0, 0.0
    if len(points) >= 2 and det > 0:
        alpha = (sxx * st - sx * sxt) / det
        beta = (sw * sxt - sx * st) / det
    if alpha < _MIN_LATENCY_S or beta <= 0:  # refit one parameter
        if beta <= 0 or len(points) < 2:
            return statistics.median(t for _, t in points), 1.0 / _MAX_BUS_BANDWIDTH_BYTES_PER_S
        alpha, beta = _MIN_LATENCY_S, sxt / sxx
    return alpha, max(beta, 1.0 / _MAX_BUS_BANDWIDTH_BYTES_PER_S)


def _sig(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits (profiles are read by people)."""
    return float(f"{value:.{digits}g}")


class _Sources:
    """The named sources a measured profile cites."""

    def __init__(self, m: Measurements) -> None:
        cfg, date = m.config, m.started
        how = (
            f"torch {m.torch_version}, {cfg.backend}, {cfg.nproc} ranks x {m.threads_per_rank} "
            f"thread(s); median over {cfg.min_repeats}-{cfg.max_repeats} repeats of the slowest "
            "rank, each repeat averaging back-to-back calls after a barrier"
        )
        self.run = Source.measured(date, cfg.command, how, name="run")
        self.fit = Source.measured(
            date,
            cfg.command,
            "relative least-squares fit of t = latency + "
            "bus_factor(n) * bytes / bus_bandwidth to this link's table",
            name="alpha-beta-fit",
        )
        self.roofline = Source.measured(
            date,
            cfg.command,
            "best rate measured (peak); efficiency: geometric mean of rate / peak over the "
            "matmul points, rate at the largest size / peak for the elementwise add",
            name="roofline-fit",
        )
        self.memory = Source.measured(date, cfg.command, m.memory_how, name="memory")
        self.transcendental = Source.measured(
            date, cfg.command,
            f"torch.exp of {cfg.exp_numel} fp32 elements into a preallocated output: elements "
            "per second (one evaluation counted as one op)",
            name="transcendental",
        )  # fmt: skip
        self.overlap = Source.measured(date, cfg.command, _overlap_note(m.overlap), name="overlap")
        streamed = next(s for s in m.compute if s.op == "streamed")
        self.memory_overlap = Source.measured(
            date, cfg.command, _memory_overlap_note(streamed, cfg.streamed_matmul),
            name="memory-overlap",
        )  # fmt: skip
        self.fp16 = Source.assumption(
            "fp16 matmul is not profiled on CPU (torch's CPU kernels run it like bf16): "
            "taken equal to the bf16 peak",
            name="fp16-as-bf16",
        )
        self.single_host = Source.assumption(
            "every rank ran on one host, so no inter-node link was measured: the inter_node "
            "costs repeat the intra_node ones; profile across hosts for real numbers",
            name="single-host",
        )


def build_profile(m: Measurements, name: str) -> Profile:
    """The profile of a measurement run (see the module doc for every fit)."""
    src = _Sources(m)
    device, efficiency = _compute_part(m, src)
    links = _links(m, src)
    cfg = m.config
    topology = Topology(Quantity(cfg.devices_per_node, "devices", src.run), None)
    description = (
        f"Measured by `{cfg.command}`: {cfg.nproc} {cfg.backend} ranks on {m.device_name} "
        f"({'quick' if cfg.quick else 'default'} mode, {m.seconds:.0f} s)."
    )
    return Profile(_profile_name(name), description, device, efficiency, topology, links)


def _profile_name(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "profile"


def _compute_part(m: Measurements, src: _Sources) -> tuple[Device, Efficiency]:
    rates: dict[DType, list[float]] = defaultdict(list)
    for s in m.compute:
        if s.op == "matmul":
            rates[s.dtype].append(s.flops / s.time_s)
    peak = {d: max(r) for d, r in rates.items()}
    ratios = [r / peak[d] for d, rs in rates.items() for r in rs]
    elementwise = sorted((s for s in m.compute if s.op == "elementwise"), key=lambda s: s.nbytes)
    bandwidths = [s.nbytes / s.time_s for s in elementwise]
    overhead_s = min(s.time_s for s in m.compute if s.op == "overhead")
    exp = next(s for s in m.compute if s.op == "exp")
    unit = "TFLOP/s" if m.config.backend == "nccl" else "GFLOP/s"
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    flops = {d: Quantity(_sig(peak[d] / scale), unit, src.roofline) for d in peak}
    fp16 = flops.get(DType.FP16) or replace(flops[DType.BF16], source=src.fp16)
    device = Device(
        m.device_name
        + (
            f" (1 of {m.config.nproc} ranks, {m.threads_per_rank} thread(s))"
            if m.config.backend != "nccl"
            else ""
        ),
        Quantity(_sig(m.memory_bytes / m.config.devices_per_node / 2**30), "GiB", src.memory),
        Quantity(_sig(max(bandwidths) / 1e9), "GB/s", src.roofline),
        PeakFlops(flops[DType.FP32], flops[DType.BF16], fp16),
        Quantity(_sig(exp.flops / exp.time_s / scale), unit, src.transcendental),
    )
    efficiency = Efficiency(
        Quantity(_sig(min(1.0, _geomean(ratios)), 3), "ratio", src.roofline),
        Quantity(_sig(bandwidths[-1] / max(bandwidths), 3), "ratio", src.roofline),
        Quantity(_sig(overhead_s * 1e6), "us", src.run),
        overlap=Quantity(_sig(m.overlap.ratio, 3), "ratio", src.overlap),
    )
    streamed = next(s for s in m.compute if s.op == "streamed")
    compute_s = streamed.flops / (device.peak_flops.fp32.base * efficiency.matmul.base)
    memory_s = streamed.nbytes / (device.memory_bandwidth.base * efficiency.memory_bound.base)
    hidden = hidden_fraction(compute_s, memory_s, streamed.time_s)
    return device, replace(
        efficiency, memory_overlap=Quantity(_sig(hidden, 3), "ratio", src.memory_overlap)
    )


def _overlap_note(o: OverlapSample) -> str:
    return (
        f"per repeat on every rank: (a) {o.matmul_n}^3 fp32 matmuls alone, median "
        f"{o.compute_s * 1e3:.2f} ms; (b) all-reduce of {o.nbytes} B on all ranks alone, "
        f"{o.collective_s * 1e3:.2f} ms; (c) both at once (all-reduce async_op=True beside the "
        f"matmuls), {o.both_s * 1e3:.2f} ms; overlap = clamp((a + b - c) / min(a, b), 0, 1), "
        f"median over {o.repeats} repeats of the slowest rank"
    )


def _memory_overlap_note(s: ComputeSample, streamed: tuple[int, int, int]) -> str:
    rows, n, weights = streamed
    return (
        f"a {rows} x {n} fp32 matrix times one of {weights} {n} x {n} weights, the next each "
        f"call (so each comes from memory): median {s.time_s * 1e6:.0f} us; memory overlap = "
        "clamp((c + m - t) / min(c, m), 0, 1) with c its flops at the fp32 peak x matmul "
        "efficiency, m its bytes (weight, input, output) at the memory bandwidth x memory-bound "
        "efficiency, t the time measured"
    )


def _geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _links(m: Measurements, src: _Sources) -> tuple[Link, ...]:
    by_key: dict[tuple[LinkClass, CollectiveKind], list[CollectiveSample]] = defaultdict(list)
    for s in m.collectives:
        by_key[(s.link_class, s.kind)].append(s)
    costs: dict[tuple[LinkClass, CollectiveKind], CollectiveCost] = {
        key: _fit_cost(samples, m, src) for key, samples in by_key.items()
    }
    measured = {lc for lc, _ in costs}
    links = []
    for lc in LinkClass:
        other = next(iter(measured - {lc}), None)
        collectives = tuple(_fill(costs, lc, kind, other, m, src) for kind in CollectiveKind)
        links.append(Link(lc, _medium(m, lc, lc in measured), collectives))
    return tuple(links)


def _medium(m: Measurements, lc: LinkClass, measured: bool) -> str:
    if m.config.backend == "nccl":
        text = "NVLink / PCIe inside a node (NCCL)" if lc is LinkClass.INTRA_NODE else "NIC (NCCL)"
    else:
        text = "loopback TCP between processes of one host (gloo)"
    return text if measured else text + "; not measured, copied from the other link class"


def _fill(
    costs: dict[tuple[LinkClass, CollectiveKind], CollectiveCost],
    lc: LinkClass,
    kind: CollectiveKind,
    other: LinkClass | None,
    m: Measurements,
    src: _Sources,
) -> CollectiveCost:
    """The measured cost, else the other link's (single host), else all-reduce's (unsupported)."""
    if (lc, kind) in costs:
        return costs[(lc, kind)]
    if other is not None and (other, kind) in costs:
        cost = costs[(other, kind)]
        return replace(
            cost,
            latency=replace(cost.latency, source=src.single_host),
            bus_bandwidth=replace(cost.bus_bandwidth, source=src.single_host),
            note=(cost.note + "; " if cost.note else "") + "copied from " + other.value,
        )
    assert kind is not CollectiveKind.ALL_REDUCE, "every backend has all_reduce"
    base = _fill(costs, lc, CollectiveKind.ALL_REDUCE, other, m, src)
    why = f"{m.config.backend} has no {kind.value}: priced as an all-reduce of the same buffer"
    unsupported = Source.assumption(why, name=f"no-{kind.value.replace('_', '-')}")
    return CollectiveCost(
        kind,
        replace(base.latency, source=unsupported),
        replace(base.bus_bandwidth, value=_sig(base.bus_bandwidth.value / 2), source=unsupported),
        None,
        why,
    )


def _fit_cost(samples: list[CollectiveSample], m: Measurements, src: _Sources) -> CollectiveCost:
    kind = samples[0].kind
    points = [(bus_factor(kind, s.group_size) * s.nbytes, s.time_s) for s in samples]
    alpha_s, beta = fit_alpha_beta(points)
    errors = [abs(alpha_s + beta * x - t) / t for x, t in points]
    by_group: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: (s.group_size, s.nbytes)):
        by_group[s.group_size].append((s.nbytes, _sig(s.time_s * 1e6)))
    table = MeasuredTable(
        "B", "us", src.run, tuple((g, tuple(pts)) for g, pts in sorted(by_group.items()))
    )
    note = f"fit: median |error| {statistics.median(errors):.0%} over {len(points)} points"
    if kind is CollectiveKind.REDUCE_SCATTER and m.config.backend == "gloo":
        note += "; gloo builds reduce_scatter on an all-reduce (pytorch/pytorch#118911)"
    return CollectiveCost(
        kind,
        Quantity(_sig(alpha_s * 1e6), "us", src.fit),
        Quantity(_sig(1.0 / beta / 1e9), "GB/s", src.fit),
        table,
        note,
    )
