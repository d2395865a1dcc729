"""Step timelines as events: what each rank did in a training step (measured) or will do
(predicted).

Lives here: `Event` (one span of one rank), the `Recorder` the runtime wraps every span in
(each firing of its stage's order, each receive, collective and update), the plan's predicted
step as events (`predicted_events`: its times run through the same orders,
`schedule.run_schedule`), a trace's last complete step (`last_step`) and the one definition of a measured
step's time (`measured_step_s`), and the sizes a timeline refuses to simulate or draw. Lives
elsewhere: trace files (`timeline.trace`), the chart (`timeline.chart`), when the runtime
records (runtime/engine.py), how long a firing should take (planner).

Invariants: times are seconds from an origin (the recorder's creation, or the predicted step's
start, when every rank enters it); a rank's step ends with its "optimizer" span, so `last_step`
can cut a multi-step trace without step markers in the file. Predicted events use the runtime's
kinds: "forward", "backward" ("weight" too under zb1), "send", then after the last backward
"grad_sync" (the stage's
`grad_sync_s` less what backward hides, `sync_hidden_s`) and "optimizer" (the rest of
`update_s`). A plan written before the update was split (`grad_sync_s` None) has one "update"
span there instead: `update_s` less `sync_hidden_s`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from autosbp.errors import PlanError
from autosbp.schedule import Phase, Timeline, run_schedule
from autosbp.zero_bubble import run_zb1, zb1_orders

if TYPE_CHECKING:
    from autosbp.plan import Plan, StagePlan

__all__ = [
    "GRAD_SYNC", "MAX_DRAWN_RANKS", "MAX_DRAWN_SPANS", "MAX_SIMULATED_FIRINGS", "STEP_END",
    "UPDATE", "Event", "Recorder", "SpanHook", "check_chart", "check_drawable", "last_step", "measured_step_s",
    "predicted_events", "span_s",
]  # fmt: skip

UPDATE = "update"  # an old plan's predicted gradient sync + optimizer span (see the header)
GRAD_SYNC = "grad_sync"  # the runtime's gradient-sync span, and the predicted one
STEP_END = "optimizer"  # the measured (and predicted) span that ends a rank's step
# What `show` agrees to simulate and draw. The simulation takes about 12 us per firing here
# (measured: 80,000 firings in 0.96 s), so its bound is about a second; drawing takes about
# 40 us per span (20,000 spans in 0.8 s) and a row per rank stops being readable (or fitting
# matplotlib's 2^16 pixels) long before a few hundred rows.
MAX_SIMULATED_FIRINGS = 100_000
MAX_DRAWN_SPANS = 100_000
MAX_DRAWN_RANKS = 128


_Record = tuple[str, int | None, int, float, float]  # a Recorder keeps: kind, mb, chunk, start, end


class SpanHook(Protocol):
    """What the runtime wraps each span in (each firing, receive, collective and update): a `Recorder`, or any object with `span`
    (a training job also reports its progress there: runtime.jobs)."""

    def span(
        self, kind: str, micro_batch: int | None = None, chunk: int = 0
    ) -> AbstractContextManager[None]: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One span on one rank: `kind` is "forward", "backward", "send", "recv", "grad_sync",
    "optimizer" (runtime), "update" (predicted) or anything else; `micro_batch` None for
    per-step work; `chunk` the model chunk an interleaved stage ran it for (0 otherwise)."""

    rank: int
    stage: int
    kind: str
    micro_batch: int | None
    start_s: float
    end_s: float
    chunk: int = 0


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

    def span(self, kind: str, micro_batch: int | None = None, chunk: int = 0) -> _Span:
        """`with recorder.span("forward", 3): ...` records the time the body takes (not
        recorded when the body raises)."""
        return _Span(self._spans, kind, micro_batch, chunk)

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
        return [Event(self.rank, self.stage, k, mb, s - o, e - o, c) for k, mb, c, s, e in spans]


class _Span:
    """The context manager of `Recorder.span`: a slotted class, 2-3x cheaper than @contextmanager."""

    __slots__ = ("_chunk", "_kind", "_micro_batch", "_spans", "_start_s")

    def __init__(
        self, spans: list[_Record], kind: str, micro_batch: int | None, chunk: int
    ) -> None:
        self._spans, self._kind, self._micro_batch, self._chunk = spans, kind, micro_batch, chunk

    def __enter__(self) -> None:
        self._start_s = perf_counter()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            record = (self._kind, self._micro_batch, self._chunk, self._start_s, perf_counter())
            self._spans.append(record)


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


def check_chart(ranks: int, spans: int, *, fix: str | None = None) -> None:
    """PlanError unless a chart of `ranks` rows and `spans` bars can be drawn and read; `fix`
    says what to do instead (default: for a measured trace)."""
    fix = fix or "record a trace of fewer ranks or steps, or leave out --timeline"
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
    """One step of `plan` as its firing orders run it (`_simulated`), on every rank (rank = device id;
    with `every_rank` False, on the first rank of each stage: the others repeat it): forward
    and backward firings, a "send" after each firing whose output goes to another stage, and
    after each stage's last backward its "grad_sync" and "optimizer" (one "update" for a plan
    written before the split). Sorted by rank, then start."""
    check_drawable(plan)
    stages = plan.stages
    if all(s.forward_s == 0 and s.backward_s == 0 for s in stages):
        raise PlanError(
            f"the plan for {plan.model_name} has no per-micro-batch times (forward_s and "
            "backward_s are 0 in every stage), so it has no predicted timeline; make the plan "
            "again with an autosbp that records them."
        )
    p = plan.pipeline_stages  # interleaved, stages[c * p + d] is chunk c of stage d
    timeline = _simulated(plan)
    # stage, kind, mb, start, end, chunk
    spans: list[tuple[int, str, int | None, float, float, int]] = []
    for f in timeline.firings:
        spans.append((f.stage, f.phase.value, f.micro_batch, f.start_s, f.end_s, f.chunk))
        at = f.chunk * p + f.stage
        to = at + 1 if f.phase is Phase.FORWARD else at - 1
        if f.phase is not Phase.WEIGHT and 0 <= to < len(stages) and stages[min(at, to)].send_s:
            end_s = f.end_s + stages[min(at, to)].send_s  # send_s: stage s <-> s + 1
            spans.append((f.stage, "send", f.micro_batch, f.end_s, end_s, f.chunk))
    for s in range(p):
        last = timeline.end_s(s)  # then the update of all its chunks
        spans += [(s, kind, None, a, b, 0) for kind, a, b in _update_spans(stages[s::p], last)]
    events = [
        Event(rank, *span)
        for span in spans
        for rank in (stages[span[0]].devices if every_rank else stages[span[0]].devices[:1])
    ]
    return sorted(events, key=lambda e: (e.rank, e.start_s, e.kind))


def _simulated(plan: Plan) -> Timeline:
    """The plan's step as its schedule runs (`schedule.run_schedule`; zb1: `zero_bubble.run_zb1`,
    each backward split by the stage's `weight_s`)."""
    stages, m = plan.stages, plan.micro_batches
    if plan.schedule == "zb1":
        weight = [s.weight_s or 0.0 for s in stages]
        return run_zb1(
            zb1_orders(len(stages), m), m, lambda s: stages[s].forward_s,
            lambda s: stages[s].backward_s - weight[s], weight.__getitem__,
            lambda s: stages[s].send_s,
        )  # fmt: skip
    return run_schedule(
        plan.pipeline_stages, m, lambda s: stages[s].forward_s, lambda s: stages[s].backward_s,
        lambda s: stages[s].send_s, virtual_stages=plan.virtual_stages,
    )  # fmt: skip


def _update_spans(chunks: Sequence[StagePlan], last_s: float) -> list[tuple[str, float, float]]:
    """A device's update after its last backward ends at `last_s`, over its stage's chunks
    (one but for interleaved plans): (kind, start, end) of its exposed gradient sync and its
    optimizer, or of one "update" (a plan without the split)."""
    end_s = last_s + sum(c.update_s - c.sync_hidden_s for c in chunks)
    syncs = [(c.grad_sync_s, c.sync_hidden_s) for c in chunks]
    if any(g is None for g, _ in syncs):
        return [(UPDATE, last_s, end_s)]
    synced_s = last_s + sum(max(g - hidden, 0.0) for g, hidden in syncs if g is not None)
    return [(GRAD_SYNC, last_s, synced_s), (STEP_END, synced_s, max(end_s, synced_s))]


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
    """Seconds from the first start to the last end (0 for no events). Of a predicted step (every
    rank enters it at 0) this is the step's time."""
    if not events:
        return 0.0
    return max(e.end_s for e in events) - min(e.start_s for e in events)


def measured_step_s(events: list[Event]) -> float:
    """A measured step's time, the one definition (`runtime.jobs` times its steps the same way):
    its slowest rank's, from the start of that rank's first span in the step to the end of its
    last. `events` are one step's (`last_step`). Each rank is timed on its own clock, so ranks on
    several machines, or entering the step at different moments, do not stretch it."""
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    return max((span_s(mine) for mine in by_rank.values()), default=0.0)
