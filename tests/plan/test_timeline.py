"""Step timelines: the recorder, Chrome trace files, the predicted step against the actor
simulation it replays (the oracle), `last_step`, and `autosbp show` end to end with bad inputs."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.errors import PlanError
from autosbp.plan import NodePlan, ParamPlan, Plan, StagePlan, load_plan, save_plan
from autosbp.schedule import simulate
from autosbp.timeline import (
    Event,
    Recorder,
    draw_timelines,
    last_step,
    measured_step_s,
    predicted_events,
    read_chrome_trace,
    read_trace,
    span_s,
    write_chrome_trace,
)
from tests.plan.test_plan_json import sample_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FORWARD_S, BACKWARD_S, SEND_S, UPDATE_S = 0.001, 0.002, 0.0005, 0.003


def pipeline_plan() -> Plan:
    """2 stages of 2 devices (a mesh of 2 each, a node on each), 4 micro-batches, hand-set
    times."""
    stage = StagePlan((0, 1), (2,), (), 0.0, 0, FORWARD_S, BACKWARD_S, SEND_S, UPDATE_S)
    last = dataclasses.replace(stage, devices=(2, 3), send_s=0.0)
    nodes = {
        "linear": NodePlan("aten.linear.default", ("S(0)", "B"), ("S(0)",)),
        "loss": NodePlan("aten.mse_loss.default", ("S(0)", "S(0)"), ("P",), stage=1),
    }
    return dataclasses.replace(
        sample_plan(), mesh_shape=(2,), mesh_dims=("d0",), link_classes=("intra_node",),
        stages=(stage, last), micro_batches=4, nodes=nodes,
        params={"fc.weight": ParamPlan("B", 0, "B", (16, 8))},
    )  # fmt: skip


def as_steps(events: list[Event], steps: int, gap_s: float = 0.001) -> list[Event]:
    """`events` repeated `steps` times one after another, each step ending with "optimizer"."""
    one = [dataclasses.replace(e, kind="optimizer") if e.kind == "update" else e for e in events]
    period = span_s(one) + gap_s
    return [
        dataclasses.replace(e, start_s=e.start_s + k * period, end_s=e.end_s + k * period)
        for k in range(steps)
        for e in one
    ]


# ---- recorder and trace files -----------------------------------------------------------------


def test_recorder_spans_and_steps() -> None:
    recorder = Recorder(rank=3, stage=1)
    with recorder.span("forward", 0):
        time.sleep(0.002)
    first = recorder.mark_step()
    with pytest.raises(RuntimeError), recorder.span("backward", 0):
        raise RuntimeError("a failed firing is not recorded")
    with recorder.span("optimizer"):
        pass
    assert [(e.rank, e.stage, e.kind, e.micro_batch) for e in recorder.events] == [
        (3, 1, "forward", 0),
        (3, 1, "optimizer", None),
    ]
    assert first == recorder.events[:1]
    assert recorder.mark_step() == recorder.events[1:]
    forward = first[0]
    assert forward.start_s >= 0 and forward.end_s - forward.start_s >= 0.002


def test_chrome_trace_round_trip(tmp_path: Path) -> None:
    events = [*predicted_events(pipeline_plan()), Event(0, 0, "recv", 2, 0.0123456, 0.0124)]
    path = write_chrome_trace(
        tmp_path / "trace.json", events, plan_digest="abc", metadata={"plan": "p.json"}
    )
    back = read_chrome_trace(path)
    assert len(back) == len(events)
    for got, want in zip(back, events, strict=True):
        assert (got.rank, got.stage, got.kind, got.micro_batch) == (
            want.rank,
            want.stage,
            want.kind,
            want.micro_batch,
        )
        assert got.start_s == pytest.approx(want.start_s, abs=1e-12)
        assert got.end_s == pytest.approx(want.end_s, abs=1e-12)
    data = json.loads(path.read_text())
    assert data["otherData"] == {"plan": "p.json", "plan_digest": "abc"}
    assert read_trace(path).plan_digest == "abc"
    names = [e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"]
    assert names == [f"rank {r} (stage {r // 2})" for r in range(4)]
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary file left


# ---- predicted step: the actor simulation is the oracle ----------------------------------------


def test_predicted_events_replay_the_simulation() -> None:
    plan = pipeline_plan()
    timeline = simulate(2, 4, lambda s: FORWARD_S, lambda s: BACKWARD_S, lambda s: SEND_S)
    events = predicted_events(plan)
    for stage, devices in enumerate(((0, 1), (2, 3))):
        want = [
            (f.phase.value, f.micro_batch, f.start_s, f.end_s)
            for f in sorted(timeline.firings, key=lambda f: f.start_s)
            if f.stage == stage
        ]
        for rank in devices:
            got = [
                (e.kind, e.micro_batch, e.start_s, e.end_s)
                for e in events
                if e.rank == rank and e.kind in ("forward", "backward")
            ]
            assert got == want
            assert {e.stage for e in events if e.rank == rank} == {stage}
    order = [(e.kind[0].upper(), e.micro_batch) for e in events if e.rank == 0 and e.kind != "send"]
    assert order == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3), ("U", None),
    ]  # fmt: skip  # 1F1B on the first stage
    compute = [e for e in events if e.kind in ("forward", "backward")]
    assert span_s(compute) == pytest.approx(timeline.makespan_s)
    assert span_s(events) == pytest.approx(timeline.makespan_s + UPDATE_S)  # stage 0 ends last
    sends = [e for e in events if e.kind == "send"]
    assert len(sends) == 2 * 4 * 2  # each stage's devices send 4 activations or 4 gradients


UPDATE_SPLITS = [  # (grad_sync_s, sync_hidden_s): the sync partly hidden, wholly, or none at all
    pytest.param(0.001, 0.0004, id="partly-hidden"),
    pytest.param(0.001, 0.001, id="wholly-hidden"),
    pytest.param(0.0, 0.0, id="no-sync"),
]


@pytest.mark.parametrize(("sync_s", "hidden_s"), UPDATE_SPLITS)
def test_a_split_update_is_drawn_as_the_runtime_records_it(sync_s: float, hidden_s: float) -> None:
    """After each stage's last backward: "grad_sync" for the sync backward did not hide, then
    "optimizer" for the rest of the update: the runtime's two spans, ending where one
    "update" of the same plan without the split ends."""
    old = pipeline_plan()
    stages = tuple(
        dataclasses.replace(s, grad_sync_s=sync_s, sync_hidden_s=hidden_s) for s in old.stages
    )
    split = dataclasses.replace(old, stages=stages)
    merged = dataclasses.replace(
        old, stages=tuple(dataclasses.replace(s, grad_sync_s=None) for s in stages)
    )
    for rank in (0, 2):
        (update,) = [e for e in predicted_events(merged) if e.rank == rank and e.kind == "update"]
        tail = [e for e in predicted_events(split) if e.rank == rank and e.micro_batch is None]
        assert [e.kind for e in tail] == ["grad_sync", "optimizer"]
        sync, optimizer = tail
        assert sync.start_s == pytest.approx(update.start_s)
        assert sync.end_s - sync.start_s == pytest.approx(sync_s - hidden_s)
        assert optimizer.start_s == pytest.approx(sync.end_s)
        assert optimizer.end_s - optimizer.start_s == pytest.approx(UPDATE_S - sync_s)
        assert optimizer.end_s == pytest.approx(update.end_s)


def test_a_plan_file_without_the_split_reads_as_one_update(tmp_path: Path) -> None:
    """A plan written before `grad_sync_s` existed loads with None and draws one "update"."""
    data = sample_plan().to_json()
    for stage in data["stages"]:
        stage.pop("grad_sync_s", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = load_plan(path)  # the schema and the checks too
    assert all(s.grad_sync_s is None for s in plan.stages)
    assert plan.to_json() == data  # written back as it was: its digest unchanged
    saved = tmp_path / "again.json"
    save_plan(dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, grad_sync_s=0.001) for s in plan.stages
    )), saved)  # fmt: skip
    assert all(s["grad_sync_s"] == 0.001 for s in json.loads(saved.read_text())["stages"])
    assert all(s.grad_sync_s == 0.001 for s in load_plan(saved).stages)


def test_plan_without_times_has_no_prediction() -> None:
    with pytest.raises(PlanError, match="no per-micro-batch times"):
        predicted_events(sample_plan())


@pytest.mark.parametrize("steps", [1, 3], ids=["one-step", "three-steps"])
def test_last_step(steps: int) -> None:
    one = as_steps(predicted_events(pipeline_plan()), 1)
    trace = as_steps(one, steps)
    unfinished = Event(0, 0, "forward", 0, 1e3, 1e3 + FORWARD_S)  # the next step, cut short
    got = last_step([*trace, unfinished])
    shift = (steps - 1) * (span_s(one) + 0.001)
    assert got == [
        dataclasses.replace(e, start_s=e.start_s + shift, end_s=e.end_s + shift) for e in one
    ]


def test_measured_step_is_the_slowest_ranks_own_span() -> None:
    """The one definition (runtime.jobs times its steps alike): ranks entering the step at
    different moments do not stretch it; the slowest rank's first-to-last span is the step."""
    events = [
        Event(0, 0, "forward", 0, 0.000, 0.004),
        Event(0, 0, "optimizer", None, 0.004, 0.005),  # rank 0: 5 ms
        Event(1, 0, "forward", 0, 0.010, 0.016),
        Event(1, 0, "optimizer", None, 0.016, 0.017),  # rank 1: 7 ms, entering 10 ms later
    ]
    assert measured_step_s(events) == pytest.approx(0.007)
    assert span_s(events) == pytest.approx(0.017)  # what `show` printed before: not a step
    assert measured_step_s([]) == 0.0


# ---- autosbp show ------------------------------------------------------------------------------


def test_show_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = save_plan(pipeline_plan(), tmp_path / "plan.json")
    measured = [
        dataclasses.replace(e, start_s=1.1 * e.start_s, end_s=1.1 * e.end_s)
        for e in predicted_events(pipeline_plan())
    ]
    trace = write_chrome_trace(
        tmp_path / "trace.json", as_steps(measured, 2), plan_digest=pipeline_plan().digest()
    )
    png = tmp_path / "timeline.png"
    argv = ["show", str(plan_path), "--trace", str(trace), "--timeline", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    predicted_ms = span_s(predicted_events(pipeline_plan())) * 1e3
    assert f"predicted step {predicted_ms:.3f} ms" in out
    assert f"measured step {1.1 * predicted_ms:.3f} ms" in out and "1.10x" in out
    assert f"timeline written to {png}" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_draw_predicted_only(tmp_path: Path) -> None:
    path = draw_timelines(tmp_path / "p.png", predicted_events(pipeline_plan()), title="t")
    assert path.read_bytes().startswith(PNG_MAGIC)


BAD_TRACES = {
    "missing": None,
    "not-json": "{ half",
    "not-a-trace": json.dumps({"hello": "world"}),
    "foreign-span": json.dumps({"traceEvents": [{"ph": "X", "ts": 1, "dur": 2, "pid": 0}]}),
    "empty": json.dumps({"traceEvents": [], "otherData": {"plan_digest": "PLAN"}}),
    "no-plan": json.dumps({"traceEvents": []}),
    "other-plan": json.dumps({"traceEvents": [], "otherData": {"plan_digest": "0" * 64}}),
}


@pytest.mark.parametrize(
    ("case", "words"),
    [
        pytest.param(case, words, id=case)
        for case, words in [
            ("missing", ("does not exist", "pass a trace written by")),
            ("not-json", ("cannot be read as JSON", "pass a trace written by")),
            ("not-a-trace", ("not a Chrome trace", "'traceEvents' list")),
            ("foreign-span", ("traceEvents[0] is not an autosbp span", "args.stage")),
            ("empty", ("holds no spans", "at least one training step")),
            ("no-plan", ("names no plan", "autosbp train")),
            ("other-plan", ("recorded under another plan", "000000000000...", "--trace")),
            ("plan-missing", ("plan file", "does not exist")),
            ("png-unwritable", ("cannot write the timeline", "writable directory")),
        ]
    ],
)
def test_show_bad_inputs(
    case: str, words: tuple[str, ...], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    plan_path = save_plan(pipeline_plan(), tmp_path / "plan.json")
    trace = tmp_path / "trace.json"
    digest = pipeline_plan().digest()
    write_chrome_trace(trace, predicted_events(pipeline_plan()), plan_digest=digest)
    if case in BAD_TRACES:
        trace.unlink()
        if BAD_TRACES[case] is not None:
            trace.write_text(BAD_TRACES[case].replace("PLAN", digest))
    if case == "plan-missing":
        plan_path.unlink()
    png = tmp_path / ("absent-dir" if case == "png-unwritable" else "") / "timeline.png"
    code = main(["show", str(plan_path), "--trace", str(trace), "--timeline", str(png)])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for word in words:
        assert word in err.replace("\n", " "), err
    assert not png.exists() and not png.with_name("timeline.png.tmp").exists()
