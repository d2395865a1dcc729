"""The timeline chart: a Gantt chart of a predicted step beside a measured one.

Lives here: `timeline_figure` (the matplotlib figure), `draw_timelines` (it, as a PNG) and the
colours. Lives elsewhere: the events and the step definitions (`timeline.events`), files
(`timeline.trace`). matplotlib is imported only to draw, so recording in the runtime never
loads it.

Readability, by construction:
- one vocabulary for both panels: the runtime's phases, the plan's update drawn as the runtime
  records it ("grad_sync", then "optimizer"), so one legend names every bar of either panel,
  one colour per phase; against a plan written before the update was split (one predicted
  "update"), the measured "grad_sync" and "optimizer" are drawn as "update" (`CHART_KIND`);
- one time axis: both panels share the x scale, from 0 to the longer step, so a bar's length
  means the same time above and below;
- a measured rank is drawn from its own step start, as `measured_step_s` times it (each rank on
  its own clock: ranks enter a step at different moments), so no bar runs past the step time
  in the panel's title; a predicted step starts on every rank at 0;
- the numbers written on bars (where they fit) are micro-batch indices, as the legend says;
  axes are titled with their units;
- the chunks of an interleaved stage are told apart by hatching (chunk 0 plain) and a "c1"
  after the micro-batch.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosbp.plan.files import write_atomically
from autosbp.timeline.events import (
    GRAD_SYNC,
    STEP_END,
    UPDATE,
    Event,
    check_chart,
    last_step,
    measured_step_s,
    span_s,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CHART_KIND", "COLOURS", "MICRO_BATCH_LABEL", "draw_timelines", "timeline_figure"]

# The measured phases drawn under an old plan's phase name: a plan written before the update's
# split prices the gradient sync and the optimizer as one update (`timeline.events`).
CHART_KIND = {GRAD_SYNC: UPDATE, STEP_END: UPDATE}
COLOURS = {  # matplotlib's tab10, one each
    "forward": "tab:blue",
    "backward": "tab:orange",
    "weight": "tab:gray",  # zb1's deferred weight gradients (`zero_bubble`)
    "send": "tab:green",
    "recv": "tab:olive",
    GRAD_SYNC: "gold",  # tab10 has no colour left: matplotlib's named "gold"
    STEP_END: "tab:brown",  # the optimizer
    UPDATE: "tab:brown",
    # measured only: the communication of sharded parameters and ops (runtime.parallel.prefetch,
    # runtime.execute.op_comm), which the plan prices inside forward and backward
    "param_gather": "tab:cyan",
    "param_regather": "tab:pink",
    "grad_reduce": "tab:red",
    "exchange": "tab:purple",
}
LEGEND = {  # a phase's legend text, if not its name
    GRAD_SYNC: "grad_sync (gradient sync)",
    STEP_END: "optimizer (non-finite check + step)",
    UPDATE: "update (gradient sync + optimizer)",
}
MICRO_BATCH_LABEL = "n on a bar: micro-batch n"
OTHER_COLOUR = "tab:gray"
# Drawn as a thin band under the compute bar: communication overlaps the firings on its rank.
COMMUNICATION = frozenset(
    {"send", "recv", "param_gather", "param_regather", "grad_reduce", "exchange"}
)
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
    """`timeline_figure` written as a PNG, atomically."""
    fig = timeline_figure(predicted, measured, title=title)
    return write_atomically(
        Path(path_png), lambda tmp: fig.savefig(tmp, format="png", dpi=DPI), "timeline"
    )


def timeline_figure(
    predicted: list[Event], measured: list[Event] | None = None, *, title: str
) -> Figure:
    """A Gantt chart, one row per rank and one colour per phase: predicted on top, the last
    complete step of `measured` (see `last_step`) below, on one time axis from 0 ms."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    since = "time since the step's start (ms)"
    panels = [(f"predicted step: {span_s(predicted) * 1e3:.3f} ms", since, _from_zero(predicted))]
    if measured is not None:
        step = last_step(measured)
        name = f"measured, last step: {measured_step_s(step) * 1e3:.3f} ms (its slowest rank)"
        since = "time since the rank's own step start (ms; each rank on its own clock)"
        panels.append((name, since, _each_rank_from_zero(step)))
    merged = any(e.kind == UPDATE for e in predicted)  # a plan without the update's split
    panels = [
        (name, since, [_charted(e, merged) for e in events]) for name, since, events in panels
    ]
    every = [e for *_, events in panels for e in events]
    check_chart(sum(len({e.rank for e in events}) for *_, events in panels), len(every))
    total_ms = max(max((e.end_s for e in every), default=0.0) * 1e3, 1e-9)  # one x scale
    ratios = [len({e.rank for e in events}) or 1 for *_, events in panels]
    fig = Figure(figsize=(WIDTH_IN, 1.4 + 0.45 * sum(ratios) + 1.1 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=ratios)
    for ax, (name, since, events) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, events, total_ms)
        ax.set_title(name, loc="left", fontsize=9)
        ax.set_xlabel(since, fontsize=8)
    order = list(COLOURS)  # the phases in step order, then any other kind by name
    kinds = sorted(
        {e.kind for e in every},
        key=lambda k: (k not in order, order.index(k) if k in order else 0, k),
    )
    handles = [Patch(color=COLOURS.get(k, OTHER_COLOUR), label=LEGEND.get(k, k)) for k in kinds]
    if any(e.micro_batch is not None for e in every):
        handles.append(Patch(fill=False, edgecolor="none", label=MICRO_BATCH_LABEL))
    # The title on its own line, the legend on the line below it: a long title and a legend
    # of many phases never overlap (the legend once covered the title's end).
    height = fig.get_figheight()
    fig.suptitle(title, x=0.01, y=1 - 0.08 / height, ha="left", va="top", fontsize=10)
    fig.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(0.01, 1 - 0.38 / height),
        ncol=len(handles), fontsize=8, frameon=False,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))
    return fig


def _charted(event: Event, merged: bool) -> Event:
    """`event` under the chart's name for its kind (`CHART_KIND` against an old plan)."""
    return replace(event, kind=CHART_KIND.get(event.kind, event.kind)) if merged else event


def _from_zero(events: list[Event]) -> list[Event]:
    """`events` shifted so that the earliest starts at 0 (a predicted step: every rank at once)."""
    t0 = min((e.start_s for e in events), default=0.0)
    return [replace(e, start_s=e.start_s - t0, end_s=e.end_s - t0) for e in events]


def _each_rank_from_zero(events: list[Event]) -> list[Event]:
    """Each rank's `events` shifted so that its own earliest starts at 0: a measured step as
    `measured_step_s` times it, on each rank's own clock."""
    t0: dict[int, float] = {}
    for e in events:
        t0[e.rank] = min(t0.get(e.rank, e.start_s), e.start_s)
    return [replace(e, start_s=e.start_s - t0[e.rank], end_s=e.end_s - t0[e.rank]) for e in events]


def _draw_panel(ax: Any, events: list[Event], total_ms: float) -> None:
    """One row per rank, times in ms from 0 (`events` are shifted already); the bars of one
    row, colour and band are one `broken_barh` call (matplotlib's cost is per call: a call per
    span took 4 ms, so 20,000 spans took minutes)."""
    ranks = sorted({e.rank for e in events})
    row_of = {rank: row for row, rank in enumerate(ranks)}
    stage_of = {e.rank: e.stage for e in events}
    px_per_ms = WIDTH_IN * DPI * PLOT_FRACTION / total_ms
    bars: dict[tuple[int, str, bool, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        row, kind = row_of[e.rank], e.kind
        x, width = e.start_s * 1e3, (e.end_s - e.start_s) * 1e3
        thin = kind in COMMUNICATION
        bars[(row, COLOURS.get(kind, OTHER_COLOUR), thin, e.chunk)].append((x, width))
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
    ax.set_ylabel("rank (stage)", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
