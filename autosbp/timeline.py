"""Step timelines: what each rank did in a training step (measured) or will do (predicted).

Lives here: `Event` (one span of one rank), the `Recorder` the runtime wraps every actor firing
in, Chrome trace files (`write_chrome_trace`, `read_chrome_trace`; open them in Perfetto or
chrome://tracing), the plan's predicted step as events (`predicted_events`, the actor simulation
of `schedule`), and `draw_timelines`, a Gantt chart of predicted vs measured. Lives elsewhere:
when the runtime records (runtime/engine.py), how long a firing should take (planner).

Invariants: times are seconds from an origin (the recorder's creation, or the predicted step's
start); a rank's step ends with its "optimizer" span, so `last_step` can cut a multi-step trace
without step markers in the file. Predicted events use the runtime's kinds ("forward",
"backward", "send") plus "update": gradient sync and optimizer as one span after the last
backward, the stage's `update_s` less the sync that backward hides (`sync_hidden_s`). matplotlib is imported only to draw, so
recording in the runtime never loads it.

Trace format: Google's Trace Event Format, "X" (complete) events, ts/dur in microseconds,
pid = rank, tid = 0, cat = kind, args = {stage, micro_batch}; "M" events name each process.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

from autosbp.errors import PlanError
from autosbp.schedule import Phase, simulate

if TYPE_CHECKING:
    from autosbp.plan import Plan

__all__ = [
    "Event", "Recorder", "SpanHook", "check_chart", "check_drawable", "draw_timelines",
    "last_step", "predicted_events", "read_chrome_trace", "span_s", "write_chrome_trace",
]  # fmt: skip

UPDATE = "update"  # the predicted gradient sync + optimizer span (see the header)
STEP_END = "optimizer"  # the measured span that ends a rank's step
_Record = tuple[str, int | None, float, float]  # what a Recorder keeps: kind, mb, start, end
# What `show` agrees to simulate and draw. The simulation takes about 12 us per firing here
# (measured: 80,000 firings in 0.96 s), so its bound is about a second; drawing takes about
# 40 us per span (20,000 spans in 0.8 s) and a row per rank stops being readable (or fitting
# matplotlib's 2^16 pixels) long before a few hundred rows.
MAX_SIMULATED_FIRINGS = 100_000
MAX_DRAWN_SPANS = 100_000
MAX_DRAWN_RANKS = 128


class SpanHook(Protocol):
    """What the runtime wraps each actor firing in: a `Recorder`, or any object with `span`
    (a training job also reports its progress there: runtime.train)."""

    def span(self, kind: str, micro_batch: int | None = None) -> AbstractContextManager[None]: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One span on one rank: `kind` is "forward", "backward", "send", "recv", "grad_sync",
    "optimizer" (runtime), "update" (predicted) or anything else; `micro_batch` None for
    per-step work."""

    rank: int
    stage: int
    kind: str
    micro_batch: int | None
    start_s: float
    end_s: float


class Recorder:
    """Records the spans of one rank. `span` appends one tuple: 2-3 us per firing (measured).

    Times are `time.perf_counter()` seconds since `origin_s` (default: now). perf_counter is one
    monotonic clock per machine, so ranks on one machine line up when they share an origin, or
    nearly when each creates its recorder right after a barrier.
    """

    def __init__(self, rank: int, stage: int, origin_s: float | None = None) -> None:
        self.rank = rank
        self.stage = stage
        self.origin_s = perf_counter() if origin_s is None else origin_s
        self._spans: list[_Record] = []
        self._step_begin = 0  # index of the first span after the last mark_step()

    def span(self, kind: str, micro_batch: int | None = None) -> _Span:
        """`with recorder.span("forward", 3): ...` records the time the body takes (not
        recorded when the body raises)."""
        return _Span(self._spans, kind, micro_batch)

    def mark_step(self) -> list[Event]:
        """End a step: return its events (those since the previous mark). Nothing is dropped."""
        step = self._to_events(self._spans[self._step_begin :])
        self._step_begin = len(self._spans)
        return step

    @property
    def events(self) -> list[Event]:
        """Every span recorded so far, in the order they ended."""
        return self._to_events(self._spans)

    def _to_events(self, spans: list[_Record]) -> list[Event]:
        o = self.origin_s
        return [Event(self.rank, self.stage, k, mb, s - o, e - o) for k, mb, s, e in spans]


class _Span:
    """The context manager of `Recorder.span`: a slotted class, 2-3x cheaper than @contextmanager."""

    __slots__ = ("_kind", "_micro_batch", "_spans", "_start_s")

    def __init__(self, spans: list[_Record], kind: str, micro_batch: int | None) -> None:
        self._spans, self._kind, self._micro_batch = spans, kind, micro_batch

    def __enter__(self) -> None:
        self._start_s = perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self._spans.append((self._kind, self._micro_batch, self._start_s, perf_counter()))


# ---- Chrome trace files ---------------------------------------------------------------------


def write_chrome_trace(
    path: str | os.PathLike[str], events: list[Event], *, metadata: dict[str, Any] | None = None
) -> Path:
    """Write `events` as a Chrome trace (atomically); `metadata` goes to "otherData"."""
    names = {e.rank: f"rank {e.rank} (stage {e.stage})" for e in events}
    trace = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}}
        for rank, name in sorted(names.items())
    ]
    trace += [
        {
            "name": e.kind if e.micro_batch is None else f"{e.kind} {e.micro_batch}",
            "cat": e.kind,
            "ph": "X",
            "ts": e.start_s * 1e6,
            "dur": (e.end_s - e.start_s) * 1e6,
            "pid": e.rank,
            "tid": 0,
            "args": {"stage": e.stage, "micro_batch": e.micro_batch},
        }
        for e in events
    ]
    data = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": metadata or {}}
    text = json.dumps(data) + "\n"
    return _write_atomically(Path(path), lambda tmp: tmp.write_text(text), "trace")


def read_chrome_trace(path: str | os.PathLike[str]) -> list[Event]:
    """The events of a trace written by `write_chrome_trace` (its "X" events; the rest skipped)."""
    path = Path(path)
    fix = "pass a trace written by the autosbp runtime (or `write_chrome_trace`)."
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"trace file {path} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise PlanError(f"trace file {path} cannot be read as JSON ({reason}); {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise PlanError(
            f"{path} is not a Chrome trace (expected a JSON object with a 'traceEvents' list); {fix}"
        )
    events = []
    for index, raw in enumerate(data["traceEvents"]):
        if not isinstance(raw, dict) or raw.get("ph") != "X":
            continue
        try:
            start_s = float(raw["ts"]) / 1e6
            mb = raw["args"]["micro_batch"]
            events.append(
                Event(
                    int(raw["pid"]),
                    int(raw["args"]["stage"]),
                    str(raw["cat"]),
                    None if mb is None else int(mb),
                    start_s,
                    start_s + float(raw["dur"]) / 1e6,
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise PlanError(
                f"{path}: traceEvents[{index}] is not an autosbp span ({problem}; a span has ts, "
                f"dur, pid, cat, args.stage and args.micro_batch); {fix}"
            ) from None
    return events


def _write_atomically(path: Path, write: Callable[[Path], object], what: str) -> Path:
    """Call `write(tmp)`, then rename tmp to `path`: a failure never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PlanError(
            f"cannot write the {what} to {path} ({exc.strerror or exc}); choose a path in an "
            "existing, writable directory."
        ) from None
    return path


# ---- predicted and measured steps -----------------------------------------------------------


def check_drawable(plan: Plan) -> None:
    """PlanError unless the plan's step is small enough to simulate (MAX_SIMULATED_FIRINGS)."""
    firings = 2 * len(plan.stages) * plan.micro_batches
    if firings > MAX_SIMULATED_FIRINGS:
        raise PlanError(
            f"the plan's step has {firings} firings ({len(plan.stages)} stages x "
            f"{plan.micro_batches} micro-batches, forward and backward), more than the "
            f"{MAX_SIMULATED_FIRINGS} a timeline simulates (about a second); its predicted step "
            f"time is in the plan's summary ({plan.predicted.step_time_s:.6g} s)."
        )


def check_chart(ranks: int, spans: int) -> None:
    """PlanError unless a chart of `ranks` rows and `spans` bars can be drawn and read."""
    fix = "record a trace of fewer ranks or steps, or leave out --timeline"
    if ranks > MAX_DRAWN_RANKS:
        raise PlanError(
            f"a timeline draws one row per rank, and {ranks} ranks are more than the "
            f"{MAX_DRAWN_RANKS} a chart can show; {fix}."
        )
    if spans > MAX_DRAWN_SPANS:
        raise PlanError(
            f"a timeline of {spans} spans is more than the {MAX_DRAWN_SPANS} a chart can show "
            f"(a few seconds to draw); {fix}."
        )


def predicted_events(plan: Plan, *, every_rank: bool = True) -> list[Event]:
    """One step of `plan` as the actor simulation runs it, on every rank (rank = device id;
    with `every_rank` False, on the first rank of each stage: the others repeat it): forward
    and backward firings, a "send" after each firing whose output goes to another stage, and
    an "update" after each stage's last backward. Sorted by rank, then start."""
    check_drawable(plan)
    stages = plan.stages
    if all(s.forward_s == 0 and s.backward_s == 0 for s in stages):
        raise PlanError(
            f"the plan for {plan.model_name} has no per-micro-batch times (forward_s and "
            "backward_s are 0 in every stage), so it has no predicted timeline; make the plan "
            "again with an autosbp that records them."
        )
    timeline = simulate(
        len(stages),
        plan.micro_batches,
        lambda s: stages[s].forward_s,
        lambda s: stages[s].backward_s,
        lambda s: stages[s].send_s,
    )
    spans: list[tuple[int, str, int | None, float, float]] = []  # stage, kind, mb, start, end
    for f in timeline.firings:
        spans.append((f.stage, f.phase.value, f.micro_batch, f.start_s, f.end_s))
        to = f.stage + 1 if f.phase is Phase.FORWARD else f.stage - 1
        if 0 <= to < len(stages) and stages[min(f.stage, to)].send_s > 0:
            end_s = f.end_s + stages[min(f.stage, to)].send_s  # send_s: stage s <-> s + 1
            spans.append((f.stage, "send", f.micro_batch, f.end_s, end_s))
    for s, stage in enumerate(stages):
        last = max(f.end_s for f in timeline.firings if f.stage == s)
        spans.append((s, UPDATE, None, last, last + stage.update_s - stage.sync_hidden_s))
    events = [
        Event(rank, *span)
        for span in spans
        for rank in (stages[span[0]].devices if every_rank else stages[span[0]].devices[:1])
    ]
    return sorted(events, key=lambda e: (e.rank, e.start_s, e.kind))


def last_step(events: list[Event]) -> list[Event]:
    """The last complete step: on each rank, the spans after the end of its next-to-last
    "optimizer" span up to its last one. Spans after a rank's last optimizer (an unfinished step)
    are dropped; a rank without optimizer spans is taken whole."""
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    out = []
    for _, mine in sorted(by_rank.items()):
        ends = sorted(e.end_s for e in mine if e.kind == STEP_END)
        after = ends[-2] if len(ends) >= 2 else float("-inf")
        until = ends[-1] if ends else float("inf")
        out += [e for e in mine if e.start_s >= after and e.end_s <= until]
    return out


def span_s(events: list[Event]) -> float:
    """Seconds from the first start to the last end (0 for no events)."""
    if not events:
        return 0.0
    return max(e.end_s for e in events) - min(e.start_s for e in events)


# ---- drawing --------------------------------------------------------------------------------

COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "send": "tab:green",
    "recv": "tab:olive",
    "grad_sync": "tab:red",
    "optimizer": "tab:purple",
    UPDATE: "tab:purple",
}
OTHER_COLOUR = "tab:gray"
# Drawn as a thin band under the compute bar: a send overlaps the next firing on its rank.
COMMUNICATION = frozenset({"send", "recv", "grad_sync"})


def draw_timelines(
    path_png: str | os.PathLike[str],
    predicted: list[Event],
    measured: list[Event] | None = None,
    *,
    title: str,
) -> Path:
    """A Gantt chart, one row per rank and one colour per kind: predicted on top, the last
    complete step of `measured` (see `last_step`) below, each from 0 ms. Written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [("predicted", predicted)]
    if measured is not None:
        panels.append(("measured (last step)", last_step(measured)))
    check_chart(
        sum(len({e.rank for e in events}) for _, events in panels),
        sum(len(events) for _, events in panels),
    )
    rows = sum(len({e.rank for e in events}) or 1 for _, events in panels)
    fig = Figure(figsize=(12.0, 1.2 + 0.45 * rows + 0.6 * len(panels)))
    FigureCanvasAgg(fig)
    ratios = [len({e.rank for e in events}) or 1 for _, events in panels]
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=ratios)
    for ax, (name, events) in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, name, events)
    axes[-1, 0].set_xlabel("time in step (ms)")
    kinds = sorted({e.kind for _, events in panels for e in events})
    handles = [Patch(color=COLOURS.get(k, OTHER_COLOUR), label=k) for k in kinds]
    fig.legend(handles=handles, loc="upper right", ncol=len(kinds), fontsize=8)
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _write_atomically(
        Path(path_png), lambda tmp: fig.savefig(tmp, format="png", dpi=100), "timeline"
    )


def _draw_panel(ax: Any, name: str, events: list[Event]) -> None:
    """One row per rank; the bars of one row, colour and band are one `broken_barh` call
    (matplotlib's cost is per call: a call per span took 4 ms, so 20,000 spans took minutes)."""
    ranks = sorted({e.rank for e in events})
    row_of = {rank: row for row, rank in enumerate(ranks)}
    stage_of = {e.rank: e.stage for e in events}
    t0 = min((e.start_s for e in events), default=0.0)
    total_ms = span_s(events) * 1e3
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        row = row_of[e.rank]
        x, width = (e.start_s - t0) * 1e3, (e.end_s - e.start_s) * 1e3
        thin = e.kind in COMMUNICATION
        bars[(row, COLOURS.get(e.kind, OTHER_COLOUR), thin)].append((x, width))
        if e.micro_batch is not None and not thin and width > total_ms / 60:
            ax.text(
                x + width / 2, row - 0.07, str(e.micro_batch), ha="center", va="center", fontsize=7
            )
    for (row, colour, thin), spans in bars.items():
        y, height = (row + 0.2, 0.15) if thin else (row - 0.35, 0.55)
        ax.broken_barh(spans, (y, height), facecolors=colour, edgecolor="white", lw=0.5)
    ax.set_yticks(range(len(ranks)), [f"rank {r} (stage {stage_of[r]})" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_title(f"{name}: {total_ms:.3f} ms", loc="left", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
