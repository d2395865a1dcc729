"""The timeline chart: a Gantt chart of a predicted step beside a measured one.

Lives here: `draw_timelines` and its colours. Lives elsewhere: the events and the step
definitions (`timeline.events`), files (`timeline.trace`). matplotlib is imported only to draw,
so recording in the runtime never loads it.

Readability, by construction: one colour per kind, none shared (the predicted "update" is the
gradient sync and optimizer together, so it has a colour of its own); each panel has its own
time axis from its step's start, so a predicted step much shorter than the measured one is
drawn across the full width, not squeezed into a corner (the panel titles give both
durations); a micro-batch number is written on a bar only where it fits; axes are titled; the
chunks of an interleaved stage are told apart by hatching (chunk 0 plain) and a "c1" after the
micro-batch.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from autosbp.plan.files import write_atomically
from autosbp.timeline.events import (
    UPDATE,
    Event,
    check_chart,
    last_step,
    measured_step_s,
    span_s,
)

__all__ = ["COLOURS", "draw_timelines"]

COLOURS = {  # matplotlib's tab10, one each
    "forward": "tab:blue",
    "backward": "tab:orange",
    "send": "tab:green",
    "recv": "tab:olive",
    "grad_sync": "tab:red",
    "optimizer": "tab:purple",
    UPDATE: "tab:brown",
}
OTHER_COLOUR = "tab:gray"
# Drawn as a thin band under the compute bar: a send overlaps the next firing on its rank.
COMMUNICATION = frozenset({"send", "recv", "grad_sync"})
# Chunks of an interleaved stage: chunk 0 plain, the others hatched (one pattern each, in turn).
CHUNK_HATCHES = (None, "//", "..", "xx")
WIDTH_IN, DPI = 12.0, 100  # the figure's width and resolution: 1200 pixels across
PLOT_FRACTION = 0.8  # of the width, the axes' (the rest: rank labels and margins)
CHAR_PX = 7.0  # a digit's width at the bars' 7-point font and DPI (7 pt = 9.7 px tall, ~0.7 wide)


def draw_timelines(
    path_png: str | os.PathLike[str],
    predicted: list[Event],
    measured: list[Event] | None = None,
    *,
    title: str,
) -> Path:
    """A Gantt chart, one row per rank and one colour per kind: predicted on top, the last
    complete step of `measured` (see `last_step`) below, each on its own time axis from 0 ms.
    Written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(f"predicted step: {span_s(predicted) * 1e3:.3f} ms", predicted)]
    if measured is not None:
        step = last_step(measured)
        name = f"measured, last step: {measured_step_s(step) * 1e3:.3f} ms (its slowest rank)"
        panels.append((name, step))
    check_chart(
        sum(len({e.rank for e in events}) for _, events in panels),
        sum(len(events) for _, events in panels),
    )
    ratios = [len({e.rank for e in events}) or 1 for _, events in panels]
    fig = Figure(figsize=(WIDTH_IN, 1.4 + 0.45 * sum(ratios) + 1.1 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=ratios)
    for ax, (name, events) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, name, events)
    kinds = sorted({e.kind for _, events in panels for e in events})
    handles = [Patch(color=COLOURS.get(k, OTHER_COLOUR), label=k) for k in kinds]
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.legend(
        handles=handles, loc="upper right", bbox_to_anchor=(0.99, 0.995), ncol=len(kinds),
        fontsize=8, frameon=False,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    return write_atomically(
        Path(path_png), lambda tmp: fig.savefig(tmp, format="png", dpi=DPI), "timeline"
    )


def _draw_panel(ax: Any, name: str, events: list[Event]) -> None:
    """One row per rank; the bars of one row, colour and band are one `broken_barh` call
    (matplotlib's cost is per call: a call per span took 4 ms, so 20,000 spans took minutes)."""
    ranks = sorted({e.rank for e in events})
    row_of = {rank: row for row, rank in enumerate(ranks)}
    stage_of = {e.rank: e.stage for e in events}
    t0 = min((e.start_s for e in events), default=0.0)
    total_ms = max(span_s(events) * 1e3, 1e-9)
    px_per_ms = WIDTH_IN * DPI * PLOT_FRACTION / total_ms
    bars: dict[tuple[int, str, bool, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        row = row_of[e.rank]
        x, width = (e.start_s - t0) * 1e3, (e.end_s - e.start_s) * 1e3
        thin = e.kind in COMMUNICATION
        bars[(row, COLOURS.get(e.kind, OTHER_COLOUR), thin, e.chunk)].append((x, width))
        label = "" if e.micro_batch is None else str(e.micro_batch)
        if label and e.chunk:  # interleaved: micro-batch 3 of chunk 1 is "3c1", hatched
            label = f"{label}c{e.chunk}"
        if label and not thin and width * px_per_ms >= CHAR_PX * (len(label) + 1):
            ax.text(x + width / 2, row - 0.07, label, ha="center", va="center", fontsize=7)
    for (row, colour, thin, chunk), spans in bars.items():
        y, height = (row + 0.2, 0.15) if thin else (row - 0.35, 0.55)
        hatch = CHUNK_HATCHES[chunk % len(CHUNK_HATCHES)]
        ax.broken_barh(
            spans, (y, height), facecolors=colour, edgecolor="white", lw=0.5, hatch=hatch
        )
    ax.set_yticks(range(len(ranks)), [f"rank {r} (stage {stage_of[r]})" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, total_ms)
    ax.set_title(name, loc="left", fontsize=9)
    ax.set_xlabel("time since the step's start (ms)", fontsize=8)
    ax.set_ylabel("rank (stage)", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
