"""Primitive costs from a profile: op time (roofline), collective time and p2p time.

Lives here: the bus factors, the alpha-beta model, interpolation of measured tables, and the
precomputed prices (`ComputePrice`, `CollectivePrice`) that `Cluster` holds. Lives elsewhere: which
link class a group uses (`cluster`), where the numbers come from (`profile`, `profiler`).

Conventions (nccl-tests, doc/PERFORMANCE.md; see the team notes
shared/reference/profiling.md, section 3):
- `nbytes` is the message size per rank as nccl-tests defines it: all_reduce the buffer
  (count * element size); all_gather the OUTPUT (the gathered buffer); reduce_scatter the INPUT
  (the buffer before scattering); all_to_all the buffer (input = output size); send_recv the
  message.
- bus bandwidth: busbw = (nbytes / t) * bus_factor, with bus_factor = 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for send_recv. A link class stores one
  busbw per kind, so one profile prices any group size n.
- alpha-beta: t(nbytes, n) = latency + bus_factor(n) * nbytes / busbw (latency per call, not per
  ring step: NCCL's latency grows slowly with n and the profiled range is what we know).
- measured tables (per group size) are interpolated log-log; below the smallest size the time stays
  at the first point, above the largest it grows at the fitted busbw. Times are first de-spiked
  (a running median over up to 5 points: one or two noisy points must not lift every larger size;
  a median filter keeps real steps) and then made non-decreasing in size (Alpa's make_monotonic).
- monotone by construction: the price for group size n is the largest of the table prices of the
  measured sizes <= n and the alpha-beta price of the largest unmeasured size <= n, so more bytes or
  a bigger group never costs less.
- op time (roofline with partial overlap): with c = flops / (peak[dtype] * matmul efficiency)
  + transcendentals / transcendental rate (free where the profile states no rate) and
  m = bytes / (memory bandwidth * memory-bound efficiency), max(c, m) + (1 - o) x min(c, m)
  with o the profile's memory_overlap (1, the roofline's max, where it states none), and at
  least the op overhead floor. Measured on a 2-core EPYC (torch 2.13, 1 thread): a 32-row fp32
  matmul into 1024x1024 weights streamed from memory (16 weights, 64 MiB, in turn) took
  1.49 ms, the same weight over and over 0.94 ms: the weight's read added to the arithmetic,
  hidden by none of it (o near 0), where the roofline's max priced 1.16 ms (with both ranks
  streaming at once, as the profiler measures it: 2.4-2.9 ms).
A group of 1 device, or 0 bytes, costs 0 s.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

from costmodel.profile import CollectiveCost, CollectiveKind, DType, Profile


def bus_factor(kind: CollectiveKind, group_size: int) -> float:
    """nccl-tests busbw / algbw for a group of `group_size` ranks."""
    n = group_size
    if kind is CollectiveKind.SEND_RECV:
        return 1.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


_DESPIKE_RADIUS = 2  # a running median over 2r+1 points removes spikes up to r points wide


def _despike(times: list[float]) -> list[float]:
    """Running median over symmetric windows (narrower at the ends); the first point may only
    drop (to the median of the first three), the last is kept. Median filters keep steps."""
    n, out = len(times), []
    for i in range(n):
        r = min(_DESPIKE_RADIUS, i, n - 1 - i)
        out.append(statistics.median(times[i - r : i + r + 1]))
    if n >= 3:
        out[0] = min(times[0], statistics.median(times[:3]))
    return out


@dataclass(frozen=True, slots=True)
class _Curve:
    """A measured table of one group size, monotone, in log space."""

    log_sizes: tuple[float, ...]
    log_times: tuple[float, ...]
    last_size_bytes: float
    last_time_s: float

    @classmethod
    def of(cls, points: tuple[tuple[float, float], ...]) -> _Curve:
        sizes = [size for size, _ in points]
        times, running = [], 0.0
        for time_s in _despike([time_s for _, time_s in points]):
            running = max(running, time_s)
            times.append(running)
        return cls(tuple(map(math.log, sizes)), tuple(map(math.log, times)), sizes[-1], times[-1])

    def time_s(self, nbytes: float, tail_s_per_byte: float) -> float:
        if nbytes >= self.last_size_bytes:
            return self.last_time_s + (nbytes - self.last_size_bytes) * tail_s_per_byte
        x = math.log(nbytes)
        i = bisect.bisect_right(self.log_sizes, x)
        if i == 0:
            return math.exp(self.log_times[0])
        x0, x1 = self.log_sizes[i - 1], self.log_sizes[i]
        y0, y1 = self.log_times[i - 1], self.log_times[i]
        return math.exp(y0 + (x - x0) * (y1 - y0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class CollectivePrice:
    """The price of one collective kind on one link class, ready for fast repeated queries."""

    kind: CollectiveKind
    latency_s: float
    bus_bandwidth_bytes_per_s: float
    curves: tuple[tuple[int, _Curve], ...]  # (group size, curve), sorted by group size

    @classmethod
    def of(cls, cost: CollectiveCost) -> CollectivePrice:
        curves: tuple[tuple[int, _Curve], ...] = ()
        if cost.table is not None:
            curves = tuple(
                (n, _Curve.of(cost.table.base_points(n))) for n in cost.table.group_sizes
            )
        return cls(cost.kind, cost.latency.base, cost.bus_bandwidth.base, curves)

    def alpha_beta_s(self, nbytes: float, group_size: int) -> float:
        """The fitted model alone (no table)."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        factor = bus_factor(self.kind, group_size)
        return self.latency_s + factor * nbytes / self.bus_bandwidth_bytes_per_s

    def time_s(self, nbytes: float, group_size: int) -> float:
        """Seconds for one call with `nbytes` per rank (nccl-tests sizes) on `group_size` ranks."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        best, measured = 0.0, set()
        for n, curve in self.curves:
            if n > group_size:
                break
            tail = bus_factor(self.kind, n) / self.bus_bandwidth_bytes_per_s
            best = max(best, curve.time_s(nbytes, tail))
            measured.add(n)
        unmeasured = next((m for m in range(group_size, 1, -1) if m not in measured), None)
        if unmeasured is not None:
            best = max(best, self.alpha_beta_s(nbytes, unmeasured))
        return best


@dataclass(frozen=True, slots=True)
class ComputePrice:
    """Roofline rates of one device, in base units, per dtype."""

    flops_per_s: tuple[tuple[DType, float], ...]  # peak * matmul efficiency
    bytes_per_s: float  # memory bandwidth * memory-bound efficiency
    overhead_s: float
    memory_overlap: float = 1.0  # the profile's efficiency.memory_overlap (1: roofline max)
    transcendentals_per_s: float = math.inf  # the profile's device.transcendental_rate

    @classmethod
    def of(cls, profile: Profile) -> ComputePrice:
        dev, eff = profile.device, profile.efficiency
        rates = tuple((d, dev.peak_flops.for_dtype(d).base * eff.matmul.base) for d in DType)
        overlap = 1.0 if eff.memory_overlap is None else eff.memory_overlap.base
        special = math.inf if dev.transcendental_rate is None else dev.transcendental_rate.base
        return cls(
            rates,
            dev.memory_bandwidth.base * eff.memory_bound.base,
            eff.op_overhead.base,
            overlap,
            special,
        )

    def op_time_s(
        self, flops: float, nbytes: float, dtype: DType | str, transcendentals: float = 0.0
    ) -> float:
        """The larger of compute time (flops, then transcendental evaluations at their own
        rate) and memory time, plus the share of the smaller that the larger does not hide; at
        least the overhead floor."""
        wanted = DType.parse(dtype)
        rate = next(r for d, r in self.flops_per_s if d is wanted)
        compute_s = flops / rate + transcendentals / self.transcendentals_per_s
        memory_s = nbytes / self.bytes_per_s
        hidden = self.memory_overlap * min(compute_s, memory_s)
        return max(compute_s + memory_s - hidden, self.overhead_s)
