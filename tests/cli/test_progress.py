"""Progress of long actions (terminal.progress): plain timestamped lines off a terminal
(start, rate-limited status, end), a live display on one, the ETA from the measured rate; a
rank's finished steps reach the parent while the job runs (launching.rank's `done` channel,
the watchdog's). `autosbp train` piped prints the step, loss and step time: tests/cli/test_readme.py
runs it as the README writes it."""

from __future__ import annotations

import io
import itertools
import re
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from rich.console import Console

from launching.workers import report_progress, run_workers
from terminal.progress import PLAIN_INTERVAL_S, activity, format_duration

STAMP = r"\[\d\d:\d\d:\d\d\] "


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def plain_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=200), buffer


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0:00"), (42, "0:42"), (723, "12:03"), (3723, "1:02:03")],
    ids=["zero", "seconds", "minutes", "hours"],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_plain_lines_are_rate_limited_with_an_eta() -> None:
    console, buffer = plain_console()
    clock = FakeClock()
    with activity(console, "training 10 steps", total=10, clock=clock) as act:
        clock.now_s += 2.0  # start-up: not counted in the rate
        act.update("step 1", completed=1)  # too soon after "started": no line
        for step in range(2, 5):
            clock.now_s += 3.0  # 3 s per step
            act.update(f"step {step}", completed=step)
    lines = buffer.getvalue().splitlines()
    assert all(re.match(STAMP + "training 10 steps: ", line) for line in lines), lines
    assert lines[0].endswith("started")
    # 5 s after the start comes the first status line (at 5 s, step 2); the next at 11 s
    assert len(lines) == 4, lines
    assert lines[1].endswith("step 2, 2/10, ETA 0:24 (0:05 elapsed)")  # 8 steps at 3 s
    assert lines[2].endswith("step 4, 4/10, ETA 0:18 (0:11 elapsed)")
    assert lines[3].endswith("done in 11.0 s, step 4, 4/10, ETA 0:18")


def test_plain_line_when_stopped() -> None:
    console, buffer = plain_console()
    clock = FakeClock()

    def fail() -> None:
        with activity(console, "planning", clock=clock):
            clock.now_s += 1.5
            raise KeyError("x")

    with pytest.raises(KeyError):
        fail()
    assert buffer.getvalue().splitlines()[-1].endswith("planning: stopped after 1.5 s")


def test_terminal_gets_a_live_display() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with activity(console, "training 4 steps", total=4) as act:
        act.update("step 2: loss 0.5", completed=2)
    out = buffer.getvalue()
    assert "\x1b[" in out  # drawn, not logged
    assert "training 4 steps" in out and "step 2: loss 0.5" in out and "2/4" in out
    assert not re.search(STAMP, out)
    assert PLAIN_INTERVAL_S > 0


def stepping_worker(rank: int, world: int, steps: int) -> list[float]:
    dist.barrier()  # every rank joined before any leaves
    for step in range(steps):
        report_progress(f"step {step} done", done=(step + 1, 10.0 * rank + step, 0.001))
    return [float(rank)]


@pytest.mark.dist
def test_finished_steps_reach_the_parent() -> None:
    seen: list[tuple[int, tuple[float, ...]]] = []
    run_workers(stepping_worker, 2, (5,), timeout_s=60, on_done=lambda r, v: seen.append((r, v)))
    for rank in (0, 1):
        mine = [values for r, values in seen if r == rank]
        assert mine, seen  # the latest report per poll: at least the last one
        assert mine[-1][:3] == (5.0, 10.0 * rank + 4, 0.001)
        steps = [v[0] for v in mine]
        assert steps == sorted(set(steps))  # in order, none twice


MODEL_NAMED_LIKE_AN_EMOJI = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return (self.fc(x) - y).pow(2).mean()


def llama():
    g = torch.Generator().manual_seed(0)
    return Net(), (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g))
"""


@pytest.mark.dist
def test_the_progress_line_and_the_table_count_steps_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`step 3: loss X` is the table's row 3 (it was row 2: the table counted from 0), and a
    file function named `llama` titles the table as written, not as rich's `:llama:` emoji."""
    from autosbp.cli import main

    (tmp_path / "m.py").write_text(MODEL_NAMED_LIKE_AN_EMOJI)
    spec = f"{tmp_path}/m.py:llama"
    assert main(["train", spec, "--nproc", "2", "--plan", "dp", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    said = re.findall(r"step 3: loss ([\d.]+)", out)
    assert said, out
    row = re.search(rf"│ +3 │ +{re.escape(said[-1])} │", out)
    assert row is not None, out
    title = re.sub(r"\s", "", out)  # rich wraps the title where the tmp path makes it long
    assert "m.py:llama:dpplan" in title and "\U0001f999" not in out, out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_sigterm_stops_a_job_saying_so(tmp_path: Path) -> None:
    """SIGTERM (a scheduler ending the job) unwinds like Ctrl-C: the ranks stopped, one line
    said, exit 128 + 15, no traceback nor multiprocessing's leaked-semaphore warning."""
    import os
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(repo), os.environ.get("PYTHONPATH")))),
    }
    argv = [sys.executable, "-m", "autosbp.cli", "train", "mlp", "--nproc", "2", "--plan", "dp"]
    job = subprocess.Popen(
        [*argv, "--steps", "1000000"], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert job.stdout is not None
    deadline = time.monotonic() + 90
    for line in job.stdout:  # wait for a trained step: the ranks are running
        if re.search(r"step \d+: loss", line) or time.monotonic() > deadline:
            break
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, out + err
    assert "terminated (SIGTERM)" in err and "stopped after" in out, out + err
    assert "Traceback" not in err and "leaked semaphore" not in err, err


def test_a_call_that_blocks_still_gets_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat: no update for a long while (one blocking call), yet the latest status is
    said again each interval, and nothing after the last line."""
    monkeypatch.setattr("terminal.progress.PLAIN_INTERVAL_S", 0.2)
    console, buffer = plain_console()
    with activity(console, "capturing m") as act:
        act.update("tracing on fake tensors")
        time.sleep(1.0)  # five intervals without an update
    lines = buffer.getvalue().splitlines()
    assert lines[0].endswith("capturing m: started") and "done in" in lines[-1], lines
    beats = [line for line in lines[1:-1] if "tracing on fake tensors (0:0" in line]
    assert len(beats) >= 2 and len(beats) == len(lines) - 2, lines


SLOW_MODEL = """
import time

import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.5)  # a forward that traces slowly, as a large model's export does
        return self.fc(x).pow(2).mean()


def build():
    return Slow(), (torch.randn(8, 4),)
"""


@pytest.mark.parametrize(
    "argv",
    [["capture"], ["plan", "--devices", "2", "--compare", "--out", "p.json"]],
    ids=["capture", "plan-compare"],
)
def test_long_commands_are_never_silent(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`capture` and `plan --compare` of a model whose export takes several intervals: lines
    keep coming while it traces, each with the status and the time elapsed."""
    from autosbp.cli import main

    monkeypatch.setattr("terminal.progress.PLAIN_INTERVAL_S", 0.1)  # five intervals in one forward
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    command, *flags = argv
    assert main([command, f"{tmp_path}/slow.py:build", *flags]) == 0
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if re.match(STAMP, line)]
    between = progress[1:-1]
    assert between and all(line.endswith("elapsed)") for line in between), progress
    assert progress[-1].split(": ", 1)[1].startswith("done in"), progress
    # the same status said twice in a row: no update came, the heartbeat said it again
    said = [re.sub(STAMP, "", line).rsplit(" (", 1)[0] for line in between]
    assert any(a == b for a, b in itertools.pairwise(said)), progress
