"""The plan's schedule: old plans are 1F1B with one chunk per stage; an interleaved plan keeps
its schedule through JSON, and the whole-plan checks refuse what the actor rules cannot run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autosbp.plan import NodePlan, ParamPlan, Plan, StagePlan, load_plan, plan_problems, save_plan
from autosbp.schedule import simulate
from autosbp.timeline import (
    draw_timelines,
    predicted_events,
    read_chrome_trace,
    write_chrome_trace,
)
from tests.plan.test_plan_json import sample_plan


def interleaved_plan(virtual: int = 2, micro_batches: int = 2, devices: bool = True) -> Plan:
    """2 stages of one device, `virtual` chunks each: virtual stage s on device s % 2 (or, with
    `devices` False, the last on the wrong device)."""
    stages = [StagePlan((s % 2,), (1,), (s,), 0.01, 10) for s in range(2 * virtual)]
    if not devices:
        stages[-1] = dataclasses.replace(stages[-1], devices=(0,))
    nodes = {
        f"linear{s}": NodePlan("aten.linear.default", ("B", "B"), ("B",), stage=s)
        for s in range(2 * virtual)
    }
    params = {f"fc{s}.weight": ParamPlan("B", s, "B", (4, 4)) for s in range(2 * virtual)}
    return dataclasses.replace(
        sample_plan(), device_count=2, mesh_shape=(1,), mesh_dims=("d0",),
        link_classes=("intra_node",), stages=tuple(stages), nodes=nodes, params=params,
        micro_batches=micro_batches, virtual_stages=virtual,
    )  # fmt: skip


def test_a_plan_without_a_schedule_is_1f1b_of_one_chunk(tmp_path: Path) -> None:
    path = save_plan(sample_plan(), tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert "schedule" not in data  # written as before: old plans' files and digests unchanged
    plan = load_plan(path)
    assert (plan.schedule, plan.virtual_stages, plan.pipeline_stages) == ("1f1b", 1, 1)


def test_an_interleaved_plan_round_trips(tmp_path: Path) -> None:
    plan = interleaved_plan()
    path = save_plan(plan, tmp_path / "plan.json")
    assert json.loads(path.read_text())["schedule"] == {"name": "1f1b", "virtual_stages": 2}
    assert load_plan(path) == plan
    assert plan.pipeline_stages == 2
    assert plan_problems(plan) == []


@pytest.mark.parametrize(
    ("plan", "says"),
    [
        (interleaved_plan(micro_batches=3), "not a multiple of 2"),
        (interleaved_plan(devices=False), "virtual stage 3 lists devices [0]"),
        (dataclasses.replace(interleaved_plan(), schedule="zb-v"), "schedule 'zb-v' is not"),
        (dataclasses.replace(interleaved_plan(), virtual_stages=3), "do not hold 3 model chunks"),
    ],
    ids=["micro-batches", "devices", "name", "chunks"],
)
def test_the_checks_refuse_a_schedule_the_rules_cannot_run(plan: Plan, says: str) -> None:
    assert any(says in p for p in plan_problems(plan)), plan_problems(plan)


# ---- the interleaved step drawn: the actor simulation is the oracle --------------------------
def timed_plan() -> Plan:
    """`interleaved_plan` (2 stages x 2 chunks, 4 micro-batches) with per-chunk times."""
    plan = interleaved_plan(micro_batches=4)
    stages = tuple(
        dataclasses.replace(s, forward_s=1e-3 * (1 + v), backward_s=2e-3, send_s=1e-4,
                            update_s=5e-4 * (1 + v), sync_hidden_s=1e-4)
        for v, s in enumerate(plan.stages)
    )  # fmt: skip
    return dataclasses.replace(plan, stages=stages)


def test_predicted_events_draw_each_chunk_as_the_simulation_runs_it(tmp_path: Path) -> None:
    plan = timed_plan()
    stages = plan.stages
    timeline = simulate(
        2, 4, lambda v: stages[v].forward_s, lambda v: stages[v].backward_s,
        lambda v: stages[v].send_s, virtual_stages=2,
    )  # fmt: skip
    events = predicted_events(plan)
    for rank in (0, 1):
        want = sorted(
            (f.start_s, f.phase.value, f.micro_batch, f.chunk)
            for f in timeline.firings
            if f.stage == rank
        )
        got = sorted(
            (e.start_s, e.kind, e.micro_batch, e.chunk)
            for e in events
            if e.rank == rank and e.kind in ("forward", "backward")
        )
        assert got == want
        (update,) = [e for e in events if e.rank == rank and e.kind == "update"]
        chunks = stages[rank::2]  # its two chunks' update, less what their backward hid
        assert update.end_s - update.start_s == pytest.approx(
            sum(c.update_s - c.sync_hidden_s for c in chunks)
        )
    # every firing but the first stage's backward of chunk 0 and the last chunk's forward sends
    assert len([e for e in events if e.kind == "send"]) == 2 * 4 * 3
    back = read_chrome_trace(write_chrome_trace(tmp_path / "t.json", events, plan_digest="d"))
    assert [e.chunk for e in back] == [e.chunk for e in events]
    assert {e.chunk for e in back} == {0, 1}
    draw_timelines(tmp_path / "t.png", events, title="interleaved")
    assert (tmp_path / "t.png").stat().st_size > 0
