"""Step timelines: what each rank did in a training step (measured) or will do (predicted).

Lives here, one module per responsibility: the events, the recorder the runtime wraps every
span in (each firing of its stage's order, each receive, collective and update), the predicted
step (the plan's times run through the same orders: `schedule.run_schedule`) and the one definition
of a measured step's time (`events`); Chrome trace files tied to their plan (`trace`); the
Gantt chart of predicted beside measured (`chart`, which alone loads matplotlib). Lives
elsewhere: when the runtime records (runtime/engine.py), how long a firing should take
(planner), the commands that write and show them (`commands.train`, `commands.show`).
"""

from __future__ import annotations

from autosbp.timeline.chart import CHART_KIND, COLOURS, draw_timelines, timeline_figure
from autosbp.timeline.events import (
    GRAD_SYNC,
    MAX_DRAWN_RANKS,
    MAX_DRAWN_SPANS,
    MAX_SIMULATED_FIRINGS,
    STEP_END,
    UPDATE,
    Event,
    Recorder,
    SpanHook,
    check_chart,
    check_drawable,
    last_step,
    measured_step_s,
    predicted_events,
    span_s,
)
from autosbp.timeline.trace import (
    Trace,
    check_trace_plan,
    read_chrome_trace,
    read_trace,
    write_chrome_trace,
)

__all__ = [
    "CHART_KIND", "COLOURS", "GRAD_SYNC", "MAX_DRAWN_RANKS", "MAX_DRAWN_SPANS", "MAX_SIMULATED_FIRINGS",
    "STEP_END", "UPDATE", "Event", "Recorder", "SpanHook", "Trace", "check_chart", "check_drawable", "check_trace_plan",
    "draw_timelines", "last_step", "measured_step_s", "predicted_events", "read_chrome_trace",
    "read_trace", "span_s", "timeline_figure", "write_chrome_trace",
]  # fmt: skip
