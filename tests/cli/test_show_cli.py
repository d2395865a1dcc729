"""`autosbp show PLAN --trace T --timeline t.png`: the chart read off its matplotlib figure, and
what `show` says of a plan too large to draw.

The chart: one vocabulary and one legend for both panels (the measured grad_sync and optimizer
are the predicted update), the numbers on bars named in the legend, one x scale for both
panels, and bars that end where the panel's title says the step ends: the predicted step's
span, the measured step's slowest rank (`measured_step_s`), ranks entering the step at
different moments included. Measured steps come from a real 2-process run and from a trace
whose ranks enter 5 ms apart.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.plan import load_plan
from autosbp.timeline import (
    CHART_KIND,
    Event,
    last_step,
    measured_step_s,
    predicted_events,
    read_trace,
    span_s,
    timeline_figure,
    write_chrome_trace,
)
from autosbp.timeline.chart import MICRO_BATCH_LABEL
from tests.plan.test_timeline import as_steps, pipeline_plan

RUNTIME_KINDS = ("forward", "backward", "recv", "grad_sync", "optimizer")


def bar_end_ms(ax) -> float:
    """The right end of the rightmost bar drawn in `ax`."""
    return max(
        float(path.vertices[:, 0].max())
        for collection in ax.collections
        for path in collection.get_paths()
    )


def title_ms(ax) -> float:
    found = re.search(r"step: ([\d.]+) ms", ax.get_title(loc="left"))
    assert found, ax.get_title(loc="left")
    return float(found.group(1))


def entering_apart(events: list[Event], late_s: float) -> list[Event]:
    """`events` with the update split as the runtime records it (grad_sync, then optimizer) and
    stage 1's ranks entering `late_s` later, as ranks on one machine do."""
    out = []
    for e in events:
        shift = late_s if e.stage == 1 else 0.0
        e = dataclasses.replace(e, start_s=e.start_s + shift, end_s=e.end_s + shift)
        if e.kind == "update":
            middle = (e.start_s + e.end_s) / 2
            out += [
                dataclasses.replace(e, kind="grad_sync", end_s=middle),
                dataclasses.replace(e, kind="optimizer", start_s=middle),
            ]
        else:
            out.append(e)
    return out


def check_figure(predicted: list[Event], measured: list[Event]) -> list[str]:
    """The chart's invariants (see the header); the numbers written on bars."""
    fig = timeline_figure(predicted, measured, title="t")
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim()  # one x scale
    step = last_step(measured)
    assert title_ms(top) == pytest.approx(span_s(predicted) * 1e3, abs=5e-4)
    assert title_ms(bottom) == pytest.approx(measured_step_s(step) * 1e3, abs=5e-4)
    # bars end at the step their title states, never past it
    for ax in (top, bottom):
        assert bar_end_ms(ax) == pytest.approx(title_ms(ax), abs=5e-4)
    assert top.get_xlim()[1] == pytest.approx(max(title_ms(top), title_ms(bottom)), abs=5e-4)
    # one legend, one name per phase of either panel
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    merged = any(e.kind == "update" for e in predicted)  # a plan without the update's split
    phases = {CHART_KIND.get(e.kind, e.kind) if merged else e.kind for e in [*predicted, *step]}
    assert len(labels) == len(phases) + 1 and labels[-1] == MICRO_BATCH_LABEL, labels
    assert {label.split(" ")[0] for label in labels[:-1]} == phases, labels
    if merged:  # the measured update drawn as the old plan's one span
        assert not {"grad_sync", "optimizer"} & phases
    else:  # both panels in the runtime's words
        assert "update" not in phases and {"grad_sync", "optimizer"} <= phases
    numbers = [t.get_text() for ax in (top, bottom) for t in ax.texts]
    assert all(n.isdigit() for n in numbers)  # micro-batches, where a bar has room for one
    assert all("(ms" in ax.get_xlabel() for ax in (top, bottom))
    return numbers


def test_chart_of_ranks_entering_apart() -> None:
    predicted = predicted_events(pipeline_plan())
    measured = as_steps(entering_apart(predicted, 0.005), 2)
    assert {e.kind for e in measured} >= {"grad_sync", "optimizer"}
    assert span_s(last_step(measured)) > measured_step_s(last_step(measured))  # apart
    assert check_figure(predicted, measured)  # the 1-3 ms bars have room for their numbers


@pytest.mark.dist
def test_chart_of_a_real_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "mlp", "--devices", "2", "--strategy", "dp", "--out", "p.json"]) == 0
    argv = ["train", "mlp", "--nproc", "2", "--plan", "p.json", "--steps", "3"]
    assert main([*argv, "--trace", "t.json"]) == 0
    measured = read_trace(tmp_path / "t.json").events
    assert {e.kind for e in measured} >= {"forward", "backward", "optimizer"}
    check_figure(predicted_events(load_plan(tmp_path / "p.json")), measured)
    assert main(["show", "p.json", "--trace", "t.json", "--timeline", "t.png"]) == 0


def test_timeline_of_a_plan_over_the_chart_ranks_with_a_trace_says_the_cause(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The plan's own ranks are too many to draw: no trace of it has fewer, so the message
    points at the summary, trace or not."""
    big = tmp_path / "big.json"
    argv = ["plan", "mlp", "--devices", "256", "--strategy", "dp", "--global-batch", "256"]
    assert main([*argv, "--profile", "dgx-a100", "--out", str(big)]) == 0
    plan = load_plan(big)
    events = [
        Event(r, 0, kind, None, i, i + 1.0) for r in (0, 1) for i, kind in enumerate(RUNTIME_KINDS)
    ]
    trace = write_chrome_trace(tmp_path / "t.json", events, plan_digest=plan.digest())
    capfd.readouterr()
    show = ["show", str(big), "--trace", str(trace), "--timeline", str(tmp_path / "t.png")]
    assert main(show) == 2
    out, err = capfd.readouterr()
    err = " ".join(err.split())
    assert "Traceback" not in out + err and "a trace of fewer ranks" not in err, err
    assert "256 ranks are more than the 128" in err, err
    assert "the predicted and measured step is in the summary" in err, err
    assert "--trace TRACE` without --timeline" in err, err
    assert not (tmp_path / "t.png").exists()
