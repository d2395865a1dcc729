"""Interleaved hand plans (`megatron:...,vp=V`): the strategy's space, the chunks' activations in
flight, and a plan priced as the interleaved schedule runs it (the simulation is the oracle)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.errors import PlanError
from autosbp.planner.api import auto_parallelize
from autosbp.planner.memory.in_flight import interleaved_in_flight
from autosbp.planner.problem.build import build_problem
from autosbp.planner.problem.solve import solve_mesh
from autosbp.planner.space.stages import split_stages
from autosbp.planner.space.strategy import strategy_space
from autosbp.planner.timing.predict import predict
from autosbp.sbp import Mesh
from autosbp.schedule import simulate
from autosbp.zoo import build_model, load_model
from tests.planner.test_planner import a100_prices
from tests.planner.test_search import MODELS


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


def test_a_devices_chunks_share_its_memory() -> None:
    """Interleaved, a device's v chunks share its memory: one constraint per device whose bytes
    are its chunks' summed (each chunk at the device's peak), within the device's whole limit,
    for any choice; at the optimum, the device's peak the plan reports. Each chunk within 1/v of
    the device would refuse plans that fit: here device 0's chunks hold 3 and 2 micro-batches."""
    module, inputs = build_model("gpt", device="meta", **MODELS["gpt"])
    graph = micro_batch_graphs(module, inputs, (4,))[4]
    mesh = Mesh((2,), link_classes=("intra_node",))
    limit = 10**12
    mp = build_problem(
        graph, mesh, a100_prices(), optimizer="adam", memory_limit_bytes=limit, micro_batches=4,
        split=split_stages(graph, 4), recompute="none", stage_link="intra_node",
        allow=strategy_space("auto").allow, virtual_stages=2,
    )  # fmt: skip
    assert interleaved_in_flight(2, 2, 4)[0::2] == (3, 2)
    chunks = mp.stage_costs.memory
    devices = [c for c in mp.problem.memory if c.name.startswith("device")]
    assert len(devices) == 2 and all(c.limit_bytes == limit for c in mp.problem.memory)
    rng = np.random.default_rng(0)
    sizes = {k: len(b) for k, b in mp.problem.node_costs.items()}
    choices = [{k: int(rng.integers(n)) for k, n in sizes.items()} for _ in range(20)]
    solution = solve_mesh(mp, 60, math.inf)
    assert solution is not None
    for choice in [*choices, solution.choice]:
        for d, device in enumerate(devices):
            both = chunks[d].used_bytes(choice) + chunks[2 + d].used_bytes(choice)
            assert device.used_bytes(choice) == pytest.approx(both)
    peaks = predict(mp, solution).peak_bytes
    assert [peaks[d] for d in range(2)] == pytest.approx(
        [c.used_bytes(solution.choice) for c in devices]
    )
    assert chunks[0].used_bytes(solution.choice) > peaks[0] / 2  # the first chunk holds more
