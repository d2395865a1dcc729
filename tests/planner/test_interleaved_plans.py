"""Interleaved hand plans (`megatron:...,vp=V`): the strategy's space, the chunks' activations in
flight, and a plan priced as the interleaved schedule runs it (the simulation is the oracle)."""

from __future__ import annotations

import pytest

from autosbp.errors import PlanError
from autosbp.planner.api import auto_parallelize
from autosbp.planner.memory.in_flight import interleaved_in_flight
from autosbp.planner.space.strategy import strategy_space
from autosbp.schedule import simulate
from autosbp.zoo import load_model


@pytest.mark.parametrize(
    ("strategy", "stages", "virtual"),
    [
        ("megatron:tp=1,pp=2,dp=1,vp=2", (4,), 2),
        ("megatron:tp=2,pp=4,dp=1,vp=3,mb=8", (12,), 3),
        ("megatron:vp=1,tp=1,pp=2,dp=2", (2,), 1),
        ("megatron:tp=1,pp=2,dp=1", (2,), 1),
    ],
    ids=str,
)
def test_vp_cuts_v_chunks_per_stage(strategy: str, stages: tuple[int, ...], virtual: int) -> None:
    space = strategy_space(strategy)
    assert (space.stage_counts, space.virtual_stages) == (stages, virtual)


@pytest.mark.parametrize("bad", ["vp=0", "vp=x", "vp=2,vp=2"], ids=str)
def test_a_bad_vp_is_refused(bad: str) -> None:
    with pytest.raises(PlanError, match="vp must be given once"):
        strategy_space(f"megatron:tp=1,pp=2,dp=1,{bad}")


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6)], ids=str)
def test_chunks_in_flight_add_up_to_the_stage_peak(p: int, v: int, m: int) -> None:
    kept = interleaved_in_flight(p, v, m)
    timeline = simulate(p, m, lambda _: 1.0, lambda _: 2.0, virtual_stages=v)
    for d in range(p):
        chunks = [kept[c * p + d] for c in range(v)]
        assert sum(chunks) == timeline.max_in_flight(d)
        assert all(k <= timeline.max_in_flight(d, c) for c, k in enumerate(chunks))


def test_an_interleaved_plan_is_priced_as_its_schedule_runs() -> None:
    module, inputs = load_model("gpt", {"layers": 4, "hidden": 32, "heads": 2, "vocab": 64})
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=2, time_limit_s=30.0,
        strategy="megatron:tp=1,pp=2,dp=1,vp=2,mb=2",
    )  # fmt: skip
    assert (plan.virtual_stages, plan.pipeline_stages, len(plan.stages)) == (2, 2, 4)
    assert [s.devices for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert [s.blocks for s in plan.stages] == [(0,), (1,), (2,), (3,)]
    stages = plan.stages
    timeline = simulate(
        2, 2, lambda s: stages[s].forward_s, lambda s: stages[s].backward_s,
        lambda s: stages[s].send_s, virtual_stages=2,
    )  # fmt: skip
    ends = [
        timeline.end_s(d) + sum(c.update_s - c.sync_hidden_s for c in stages[d::2])
        for d in range(2)
    ]
    assert plan.predicted.step_time_s == pytest.approx(max(ends))
    # a chunk's stage entry holds its device's peak: both chunks' states and activations
    assert stages[0].peak_memory_bytes == stages[2].peak_memory_bytes
    assert plan.predicted.peak_memory_bytes == max(s.peak_memory_bytes for s in stages)
