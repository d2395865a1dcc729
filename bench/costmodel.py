"""Benchmark: the cost model's prices vs fresh measurements on this machine.

Loads costmodel/profiles/cpu-gloo.json, re-measures with the profiler's own functions on 2 gloo processes at
sizes BETWEEN the profile's table points (x1.5: tests interpolation, not recall), and prints per
point the measured time, the profile's price (table where measured, else fit) and the alpha-beta
fit alone, with their relative errors; then the median |relative error| overall and for
collectives of 64 KiB and more (target: <= 20%). It measures twice: the second run against the
first is the machine's own noise, the floor under any model's error.

Run: python bench/costmodel.py [--profile PATH] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

# This file is bench/costmodel.py: as a script, its directory would shadow the costmodel package.
REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

from rich.console import Console  # noqa: E402 - after the path fix above
from rich.table import Table  # noqa: E402

from costmodel import Cluster, load_profile  # noqa: E402
from costmodel.measure.items import ProfilerConfig  # noqa: E402
from costmodel.measure.profiler import Measurements, measure  # noqa: E402
from costmodel.prices import CollectivePrice  # noqa: E402
from costmodel.profile import DType  # noqa: E402

TARGET_REL_ERROR = 0.20  # the target for sizes >= 64 KiB
LARGE_BYTES = 64 * 1024


def _config(profile_dpn: int, quick: bool) -> ProfilerConfig:
    base = ProfilerConfig.for_mode(2, "gloo", profile_dpn, quick, "python bench/costmodel.py")
    return replace(
        base,
        collective_sizes_bytes=tuple(s * 3 // 2 for s in base.collective_sizes_bytes[:-1]),
        matmul_sizes=((DType.FP32, (192, 384, 768)), (DType.BF16, (96, 192))),
        elementwise_numels=(3 * 2**18, 3 * 2**20),
    )


@dataclass(frozen=True, slots=True)
class Row:
    collective: bool
    label: str
    nbytes: int
    measured_s: float
    priced_s: float  # what Cluster answers: measured table where it covers the point, else fit
    fit_s: float  # the alpha-beta fit (or roofline) alone

    @property
    def key(self) -> tuple[str, int]:
        return self.label, self.nbytes

    def error(self, predicted_s: float) -> float:
        return (predicted_s - self.measured_s) / self.measured_s


def _rows(cluster: Cluster, m: Measurements) -> list[Row]:
    rows = []
    for s in m.collectives:
        fit = CollectivePrice.of(cluster.profile.link(s.link_class).collective(s.kind))
        label = f"{s.kind.value} {s.link_class.value} n={s.group_size}"
        priced = cluster.collective_time_s(s.kind, s.nbytes, s.group_size, s.link_class)
        fit_s = fit.alpha_beta_s(s.nbytes, s.group_size)
        rows.append(Row(True, label, s.nbytes, s.time_s, priced, fit_s))
    for c in m.compute:
        if c.op != "overhead":
            priced = cluster.op_time_s(c.flops, c.nbytes, c.dtype)
            label = f"{c.op} {c.dtype.value} {c.shape}"
            rows.append(Row(False, label, int(c.nbytes), c.time_s, priced, priced))
    return rows


def _median_abs(values: list[float]) -> float:
    return statistics.median(abs(v) for v in values) if values else float("nan")


def _points_table(title: str, rows: list[Row]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("what", "bytes", "measured (us)", "priced (us)", "err", "fit only (us)", "err"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for r in rows:
        table.add_row(
            r.label, str(r.nbytes), f"{r.measured_s * 1e6:.1f}", f"{r.priced_s * 1e6:.1f}",
            f"{r.error(r.priced_s):+.0%}", f"{r.fit_s * 1e6:.1f}", f"{r.error(r.fit_s):+.0%}",
        )  # fmt: skip
    return table


def _summary_table(rows: list[Row], again_s: dict[tuple[str, int], float]) -> Table:
    groups = {
        "all points": rows,
        "collectives": [r for r in rows if r.collective],
        "collectives >= 64 KiB": [r for r in rows if r.collective and r.nbytes >= LARGE_BYTES],
        "compute (roofline)": [r for r in rows if not r.collective],
    }
    summary = Table(title="median |relative error|", title_justify="left")
    for col in ("points", "n", "profile price", "alpha-beta fit only", "run 2 vs run 1 (noise)"):
        summary.add_column(col)
    for name, group in groups.items():
        priced = _median_abs([r.error(r.priced_s) for r in group])
        fit = _median_abs([r.error(r.fit_s) for r in group])
        noise = _median_abs([r.error(again_s[r.key]) for r in group if r.key in again_s])
        summary.add_row(name, str(len(group)), f"{priced:.1%}", f"{fit:.1%}", f"{noise:.1%}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", type=Path, default=REPO / "costmodel" / "profiles" / "cpu-gloo.json"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 110))
    profile = load_profile(args.profile)
    cluster = Cluster(profile, nodes=1)
    start = time.monotonic()
    config = _config(cluster.devices_per_node, args.quick)
    rows = _rows(cluster, measure(config))
    again_s = {r.key: r.measured_s for r in _rows(cluster, measure(config))}  # repeatability
    console.print(_points_table(f"{profile.name}: price vs fresh measurement", rows))
    console.print(_summary_table(rows, again_s))
    large = [r.error(r.priced_s) for r in rows if r.collective and r.nbytes >= LARGE_BYTES]
    verdict = "meets" if _median_abs(large) <= TARGET_REL_ERROR else "misses"
    console.print(
        f"collectives >= 64 KiB: {_median_abs(large):.1%} median |error|, {verdict} the "
        f"{TARGET_REL_ERROR:.0%} target ({time.monotonic() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
