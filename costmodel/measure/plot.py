"""A PNG of a profiling run: measured vs fitted collective times and bus bandwidths.

Lives here: `plot_profile`, one column per collective kind, time (top) and busbw (bottom) against
message size, measured points per (link class, group size) and the profile's alpha-beta fit as a
dashed line. Uses matplotlib's Agg canvas directly, so it never touches the global backend.
Lives elsewhere: the numbers (`profiler`, `fitting`, `prices`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from costmodel.measure.profiler import Measurements
from costmodel.prices import CollectivePrice, bus_factor
from costmodel.profile import CollectiveKind, Profile

_FIGURE_SIZE_INCHES = (4.0 * len(CollectiveKind), 7.5)


def plot_profile(m: Measurements, profile: Profile, path: Path) -> Path:
    """Write the plot to `path` (PNG) and return it."""
    fig = Figure(figsize=_FIGURE_SIZE_INCHES)  # no layout engine: 2-3x faster to draw
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(CollectiveKind), squeeze=False)
    series: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for s in m.collectives:
        series[(s.kind, s.link_class, s.group_size)].append((s.nbytes, s.time_s))
    for col, kind in enumerate(CollectiveKind):
        top, bottom = axes[0][col], axes[1][col]
        for (k, link_class, n), points in sorted(series.items(), key=lambda kv: str(kv[0])):
            if k is not kind:
                continue
            points.sort()
            sizes = [p[0] for p in points]
            label = f"{link_class.value} n={n}"
            fit = CollectivePrice.of(profile.link(link_class).collective(kind))
            grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 63) for i in range(64)]
            fitted = [fit.alpha_beta_s(size, n) for size in grid]
            factor = bus_factor(kind, n)
            line = top.plot(sizes, [p[1] for p in points], "o", ms=4, label=label)[0]
            color = line.get_color()
            top.plot(grid, fitted, "--", color=color, lw=1)
            busbw = [factor * s / t / 1e9 for s, t in points]
            bottom.plot(sizes, busbw, "o", ms=4, color=color, label=label)
            fitted_busbw = [factor * s / t / 1e9 for s, t in zip(grid, fitted, strict=True)]
            bottom.plot(grid, fitted_busbw, "--", color=color, lw=1)
        top.set(title=kind.value, xscale="log", yscale="log", ylabel="time (s)")
        bottom.set(xscale="log", xlabel="bytes per rank (nccl-tests)", ylabel="busbw (GB/s)")
        top.legend(fontsize=7, title="o measured, -- fit", title_fontsize=7)
        top.grid(True, alpha=0.3)
        bottom.grid(True, alpha=0.3)
    fig.suptitle(f"{profile.name}: {profile.device.name}", fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.92, bottom=0.08, wspace=0.3, hspace=0.15)
    fig.savefig(path, dpi=100)
    return path
