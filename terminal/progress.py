"""Progress of a long action, for people: a live display on a terminal, timestamped lines elsewhere.

Lives here: `activity` (a context manager around one long action: a plan search, a capture, a
training job, a profile run) and the `Activity` it yields (`update` with a status text and, when
the action counts something, how many of how many are done). Used by every command that runs
for more than a moment (`autosbp plan`, `capture`, `train`, `demo`, `profile`). Lives elsewhere:
what the action reports (its caller), the consoles (`autosbp.cli`). At the bottom layer, like
`terminal.text`, so that every package's command can use it.

Invariants:
- On a terminal: one rich live line per action (spinner, description, status, a bar when the
  total is known, done/total, elapsed, ETA), refreshed by rich's own thread.
- Elsewhere (piped, redirected, a CI log): plain lines "[HH:MM:SS] description: status", one
  when the action starts, one when it ends (with its duration, "done" or "stopped"), and in
  between at most one per `PLAIN_INTERVAL_S` (the latest status at that moment), so a log of a
  long action stays readable. A heartbeat thread repeats the latest status when no update
  came for `PLAIN_INTERVAL_S` (one call that blocks for long, an export, a search in other
  processes), so no action is silent for longer, whether or not it reports (with a clock of
  the caller's, a test's, the lines are the updates' alone).
- The ETA is the remaining count at the rate measured since the first count seen (so a job's
  start-up before its first step does not bias it); none before two counts are seen.
- Text reaching the terminal is the caller's: names from input files go through
  `terminal.text.printable` first (callers do; markup is never interpreted here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["PLAIN_INTERVAL_S", "Activity", "activity", "format_duration"]

# Plain mode: at most one status line per action this often. A status changes every few
# milliseconds in a search or a training job; 5 s keeps a 10-minute action to about 120 lines and
# is short enough that a reader never wonders whether it still runs.
PLAIN_INTERVAL_S = 5.0


def format_duration(seconds: float) -> str:
    """`0:42`, `12:03`, `1:02:03` (an ETA or an elapsed time)."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Activity:
    """One long action's progress; `update` is cheap and may be called as often as wanted."""

    description: str
    total: float | None
    _show: Callable[[Activity], None]  # draws or prints the state (rate-limited in plain mode)
    _clock: Callable[[], float] = time.monotonic
    status: str = ""
    completed: float | None = None
    started_s: float = field(init=False)
    _first: tuple[float, float] | None = field(default=None, init=False)  # (time, count)
    _latest: tuple[float, float] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.started_s = self._clock()

    def update(
        self,
        status: str | None = None,
        *,
        completed: float | None = None,
        total: float | None = None,
    ) -> None:
        """A new status text, and/or how many of `total` are done."""
        if status is not None:
            self.status = status
        if total is not None:
            self.total = total
        if completed is not None:
            now = self._clock()
            self.completed = completed
            if self._first is None:
                self._first = (now, completed)
            self._latest = (now, completed)
        self._show(self)

    def elapsed_s(self) -> float:
        return self._clock() - self.started_s

    def eta_s(self) -> float | None:
        """Seconds left at the rate seen since the first count; None until it can be told."""
        if self.total is None or self._first is None or self._latest is None:
            return None
        (t0, c0), (t1, c1) = self._first, self._latest
        if c1 <= c0 or t1 <= t0:
            return None
        return (self.total - c1) * (t1 - t0) / (c1 - c0)

    def line(self) -> str:
        """The state as one line of text (plain mode, and the live display's status column)."""
        parts = [self.status] if self.status else []
        if self.completed is not None and self.total is not None:
            parts.append(f"{self.completed:g}/{self.total:g}")
        eta = self.eta_s()
        if eta is not None and self.completed != self.total:
            parts.append(f"ETA {format_duration(eta)}")
        return ", ".join(parts)


@contextmanager
def activity(
    console: Console,
    description: str,
    *,
    total: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Activity]:
    """`with activity(console, "planning gpt") as act: ... act.update("bounding ...")`: a live
    display on a terminal console, plain timestamped lines on any other (see the header)."""
    if console.is_terminal:
        with _live(console, description, total, clock) as act:
            yield act
        return
    with _plain(console, description, total, clock) as act:
        yield act


@contextmanager
def _live(
    console: Console, description: str, total: float | None, clock: Callable[[], float]
) -> Iterator[Activity]:
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    with progress:
        task = progress.add_task(escape(description), total=total, status="")

        def show(act: Activity) -> None:
            _draw(progress, task, act)

        yield Activity(description, total, show, clock)


def _draw(progress: Progress, task: TaskID, act: Activity) -> None:
    progress.update(
        task,
        total=act.total,
        completed=act.completed or 0,
        status=escape(act.line()),
    )


@contextmanager
def _plain(
    console: Console, description: str, total: float | None, clock: Callable[[], float]
) -> Iterator[Activity]:
    last = [clock()]

    def say(text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        console.print(
            f"[{stamp}] {description}: {text}", markup=False, highlight=False, soft_wrap=True
        )

    lock = threading.Lock()  # the caller's updates and the heartbeat's: one line per interval

    def show(act: Activity) -> None:
        with lock:
            now = clock()
            if now - last[0] < PLAIN_INTERVAL_S:
                return
            last[0] = now
        say(f"{act.line() or 'running'} ({format_duration(act.elapsed_s())} elapsed)")

    say("started")
    act = Activity(description, total, show, clock)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(act, stop), daemon=True)
    if clock is time.monotonic:
        beat.start()
    try:
        yield act
    except BaseException:
        _end(beat, stop)
        say(f"stopped after {act.elapsed_s():.1f} s")
        raise
    _end(beat, stop)
    done = f", {act.line()}" if act.completed is not None else ""
    say(f"done in {act.elapsed_s():.1f} s{done}")


def _end(beat: threading.Thread, stop: threading.Event) -> None:
    """The heartbeat stopped, so that no line follows the last."""
    stop.set()
    if beat.is_alive():
        beat.join()


def _heartbeat(act: Activity, stop: threading.Event) -> None:
    """Until `stop`: the latest status again (`Activity.update` with nothing new), each time
    `PLAIN_INTERVAL_S` passes; the plain display prints it only if no line came in that time."""
    while not stop.wait(PLAIN_INTERVAL_S / 4):
        act.update()
