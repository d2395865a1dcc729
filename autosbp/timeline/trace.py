"""Chrome trace files of measured steps, each tied to the plan it was recorded under.

Lives here: `write_chrome_trace` and `read_trace` (open the files in Perfetto or
chrome://tracing), `Trace` (a file's events and the plan it names), `check_trace_plan` (a trace
of another plan is refused). Lives elsewhere: the events (`timeline.events`), the plan's id
(`Plan.digest`), writing a file whole or not at all (`plan.files.write_atomically`).

Format: Google's Trace Event Format, "X" (complete) events, ts/dur in microseconds, pid = rank,
tid = 0, cat = kind, args = {stage, micro_batch}; "M" events name each process. "otherData"
holds `plan_digest` (the sha256 of the plan's JSON, `Plan.digest`) and the caller's metadata.

Invariants: a file is written whole or not at all (a temporary file, then a rename); reading
never trusts a span's fields (a file that is not an autosbp trace is an error naming the span).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autosbp.errors import PlanError
from autosbp.plan.files import write_atomically
from autosbp.timeline.events import Event

if TYPE_CHECKING:
    from autosbp.plan import Plan

__all__ = [
    "PLAN_KEY", "Trace", "check_trace_plan", "read_chrome_trace", "read_trace",
    "write_chrome_trace",
]  # fmt: skip

PLAN_KEY = "plan_digest"  # in "otherData": the plan the trace was recorded under
_FIX = "pass a trace written by the autosbp runtime (`autosbp train --trace`)."


@dataclass(frozen=True)
class Trace:
    """A trace file's spans, the digest of the plan they ran under (None in a file that names
    none), and the rest of its "otherData"."""

    events: list[Event]
    plan_digest: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


def write_chrome_trace(
    path: str | os.PathLike[str],
    events: list[Event],
    *,
    plan_digest: str,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `events`, recorded under the plan whose `Plan.digest` is `plan_digest`, as a Chrome
    trace (atomically); `metadata` goes to "otherData" beside the digest."""
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
            "args": {"stage": e.stage, "micro_batch": e.micro_batch, "chunk": e.chunk},
        }
        for e in events
    ]
    other = {**(metadata or {}), PLAN_KEY: plan_digest}
    data = {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": other}
    text = json.dumps(data) + "\n"
    return write_atomically(Path(path), lambda tmp: tmp.write_text(text), "trace")


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """The spans of a trace written by `write_chrome_trace` (its "X" events; the rest skipped),
    and the plan it names."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"trace file {path} does not exist; {_FIX}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise PlanError(f"trace file {path} cannot be read as JSON ({reason}); {_FIX}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise PlanError(
            f"{path} is not a Chrome trace (expected a JSON object with a 'traceEvents' list); "
            f"{_FIX}"
        )
    events = [_event(raw, index, path) for index, raw in enumerate(data["traceEvents"])]
    other = data.get("otherData")
    other = other if isinstance(other, dict) else {}
    digest = other.get(PLAN_KEY)
    return Trace(
        [e for e in events if e is not None],
        digest if isinstance(digest, str) else None,
        {k: v for k, v in other.items() if k != PLAN_KEY},
    )


def read_chrome_trace(path: str | os.PathLike[str]) -> list[Event]:
    """The spans of a trace file (`read_trace(path).events`)."""
    return read_trace(path).events


def _event(raw: Any, index: int, path: Path) -> Event | None:
    """One "X" span as an Event (None for other records); PlanError for a span of another tool."""
    if not isinstance(raw, dict) or raw.get("ph") != "X":
        return None
    try:
        start_s = float(raw["ts"]) / 1e6
        mb = raw["args"]["micro_batch"]
        return Event(
            int(raw["pid"]),
            int(raw["args"]["stage"]),
            str(raw["cat"]),
            None if mb is None else int(mb),
            start_s,
            start_s + float(raw["dur"]) / 1e6,
            int(raw["args"].get("chunk", 0)),  # traces written before chunks: 0
        )
    except (KeyError, TypeError, ValueError) as exc:
        problem = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise PlanError(
            f"{path}: traceEvents[{index}] is not an autosbp span ({problem}; a span has ts, "
            f"dur, pid, cat, args.stage and args.micro_batch); {_FIX}"
        ) from None


def check_trace_plan(trace: Trace, plan: Plan, trace_path: str, plan_path: str) -> None:
    """PlanError unless `trace` was recorded under `plan` (their digests agree): the steps of
    another plan say nothing about this one's prediction."""
    if trace.plan_digest == plan.digest():
        return
    if trace.plan_digest is None:
        why = "names no plan (it was not recorded by `autosbp train --trace`, or by an older one)"
    else:
        why = (
            f"was recorded under another plan (sha256 {trace.plan_digest[:12]}...; "
            f"{plan_path} is {plan.digest()[:12]}...)"
        )
    raise PlanError(
        f"trace {trace_path} {why}, so its steps cannot be set beside {plan_path}'s prediction; "
        f"record one with `autosbp train ... --plan {plan_path} --trace {trace_path}`."
    )
