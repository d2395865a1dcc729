"""ZB-H1 (`autosbp.zero_bubble`): its orders against the rules, its closed-form bubble against
the discrete-event run of those orders with separate B and W durations, and 1F1B unchanged.

Oracles: `run_zb1` (each firing as soon as its input arrived and its device is free) and the
rules themselves, counted over the orders (every micro-batch once per actor, W after its B,
at most min(P, m) activations alive, stage s deferring at most s Ws).
"""

from __future__ import annotations

import pytest

from autosbp.errors import PlanError
from autosbp.planner.space.strategy import strategy_space
from autosbp.schedule import Phase, pipeline_bubble_s, simulate, stage_orders
from autosbp.zero_bubble import (
    check_schedule,
    plan_orders,
    run_zb1,
    zb1_bubble_s,
    zb1_in_flight,
    zb1_orders,
)

SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, p - 1, p, 2 * p, 3 * p + 1) if m >= 1]
# (forward, input gradient, weight gradient) seconds of one micro-batch on a stage
DURATIONS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 1.5),
             (1.0, 0.5, 1.0)]  # fmt: skip


@pytest.mark.parametrize(("p", "m"), SHAPES, ids=[f"P{p}-m{m}" for p, m in SHAPES])
def test_orders_keep_the_rules(p: int, m: int) -> None:
    for s, order in enumerate(zb1_orders(p, m)):
        for phase in Phase:
            assert sorted(mb for ph, _, mb in order if ph is phase) == list(range(m))
        alive = deferred = peak = most_deferred = 0
        done_b: set[int] = set()
        for phase, chunk, mb in order:
            assert chunk == 0
            if phase is Phase.FORWARD:
                alive += 1
            elif phase is Phase.BACKWARD:
                done_b.add(mb)
                deferred += 1
            else:
                assert mb in done_b, "a W before its B"
                alive, deferred = alive - 1, deferred - 1
            peak = max(peak, alive)
            if phase is Phase.WEIGHT or len(done_b) < m:
                most_deferred = max(most_deferred, deferred - (phase is Phase.BACKWARD))
        assert peak == zb1_in_flight(s, p, m) == min(p, m)
        assert most_deferred <= s


@pytest.mark.parametrize(("p", "m"), [c for c in SHAPES if c[1] >= c[0]])
@pytest.mark.parametrize(("f", "b", "w"), DURATIONS)
def test_priced_bubble_is_the_simulated_one(p: int, m: int, f: float, b: float, w: float) -> None:
    timeline = run_zb1(zb1_orders(p, m), m, lambda _: f, lambda _: b, lambda _: w)
    for s in range(p):
        assert timeline.bubble_s(s) == pytest.approx(zb1_bubble_s(p, f, b, w))
    # 1F1B of the same work (B and W as one backward) idles (P - 1)(f + b + w): zb1 a third
    # of it where f = b = w
    one_f_one_b = simulate(p, m, lambda _: f, lambda _: b + w)
    assert one_f_one_b.bubble_s(0) == pytest.approx(pipeline_bubble_s(p, 1, f, b + w))
    if f == b == w:
        assert 3 * zb1_bubble_s(p, f, b, w) == pytest.approx(pipeline_bubble_s(p, 1, f, b + w))


def test_transfers_and_uneven_stages_complete() -> None:
    """Blocking receives in these orders never deadlock, whatever the durations."""
    timeline = run_zb1(
        zb1_orders(4, 6), 6, lambda s: 1.0 + s, lambda s: 2.0 - 0.3 * s, lambda s: 0.5,
        lambda s: 0.25,
    )  # fmt: skip
    assert len(timeline.firings) == 3 * 4 * 6


def test_plan_orders_is_1f1b_for_1f1b_and_refuses_zb1_with_chunks() -> None:
    assert plan_orders("1f1b", 4, 8) == stage_orders(4, 8)
    assert plan_orders("1f1b", 2, 4, 2) == stage_orders(2, 4, virtual_stages=2)
    assert plan_orders("zb1", 3, 5) == zb1_orders(3, 5)
    with pytest.raises(ValueError, match="plain stages"):
        plan_orders("zb1", 2, 4, 2)
    assert check_schedule("zb2", 2, 1, 4) is not None


@pytest.mark.parametrize(
    ("strategy", "schedule"),
    [("megatron:tp=1,pp=2,dp=1", "1f1b"), ("megatron:tp=1,pp=2,dp=1,schedule=zb1", "zb1"),
     ("megatron:schedule=zb1,tp=2,pp=2,dp=1,mb=4", "zb1"),
     ("megatron:tp=1,pp=2,dp=1,vp=2,schedule=1f1b", "1f1b")],
)  # fmt: skip
def test_hand_plans_name_the_schedule(strategy: str, schedule: str) -> None:
    space = strategy_space(strategy)
    assert space.schedule == schedule
    assert space.stage_counts == strategy_space(strategy.replace(f",schedule={schedule}", "")
                                                .replace(f"schedule={schedule},", "")).stage_counts  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "match"),
    [("megatron:tp=1,pp=2,dp=1,schedule=zb2", "schedule must be given once"),
     ("megatron:tp=1,pp=2,dp=1,schedule=zb1,schedule=zb1", "schedule must be given once"),
     ("megatron:tp=1,pp=2,dp=1,vp=2,schedule=zb1", "plain stages")],
)  # fmt: skip
def test_bad_schedules_are_refused_with_a_fix(strategy: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        strategy_space(strategy)


def test_zb1_plans_without_recomputation() -> None:
    """W runs once per weight group: recomputation would run each block again that often."""
    assert strategy_space("megatron:tp=1,pp=2,dp=1,schedule=zb1").recompute == ("none",)
    assert strategy_space("megatron:tp=1,pp=2,dp=1").recompute != ("none",)
    with pytest.raises(PlanError, match="without recomputation"):
        strategy_space("megatron:tp=1,pp=2,dp=1,schedule=zb1", recompute="full")
