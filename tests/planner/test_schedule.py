"""The actor firing rules give 1F1B from quotas: makespan, memory in flight, per-stage order;
and the price of a step is the runtime's fixed orders run with the real durations."""

from __future__ import annotations

import itertools
import random

import pytest

from autosbp.schedule import Phase, run_schedule, simulate, stage_orders


@pytest.mark.parametrize(
    ("stages", "micro", "tf", "tb"),
    [
        (1, 1, 1.0, 2.0),
        (1, 4, 1.0, 2.0),
        (2, 4, 1.0, 2.0),
        (4, 8, 1.0, 2.0),
        (4, 4, 3.0, 3.0),
        (3, 7, 0.5, 1.5),
    ],
    ids=lambda v: str(v),
)
def test_uniform_stages_match_the_1f1b_formula(
    stages: int, micro: int, tf: float, tb: float
) -> None:
    timeline = simulate(stages, micro, lambda _: tf, lambda _: tb)
    # (M + S - 1) (tf + tb): Narayanan et al. 2021 (PipeDream-Flush / 1F1B), no transfer time.
    assert timeline.makespan_s == pytest.approx((micro + stages - 1) * (tf + tb))
    for s in range(stages):
        assert timeline.max_in_flight(s) == min(stages - s, micro)
        assert timeline.bubble_s(s) == pytest.approx((stages - 1) * (tf + tb))


def test_gpipe_quota_keeps_every_micro_batch_in_flight() -> None:
    stages, micro = 3, 5
    timeline = simulate(stages, micro, lambda _: 1.0, lambda _: 2.0, quotas=[micro] * stages)
    assert timeline.max_in_flight(0) == micro
    one_f_one_b = simulate(stages, micro, lambda _: 1.0, lambda _: 2.0)
    assert timeline.makespan_s >= one_f_one_b.makespan_s


def test_transfer_time_delays_the_step() -> None:
    fast = simulate(2, 4, lambda _: 1.0, lambda _: 2.0)
    slow = simulate(2, 4, lambda _: 1.0, lambda _: 2.0, transfer_s=lambda _: 0.5)
    # At least the first activation's and the last gradient's trip lie on the critical path.
    assert slow.makespan_s >= fast.makespan_s + 2 * 0.5


def test_stage_orders_are_one_forward_one_backward_in_steady_state() -> None:
    orders = [[(phase, mb) for phase, _, mb in order] for order in stage_orders(4, 8)]
    # Stage 0 warms up with S forwards, then alternates, then drains backwards.
    assert orders[0][:4] == [(Phase.FORWARD, m) for m in range(4)]
    assert orders[0][4:6] == [(Phase.BACKWARD, 0), (Phase.FORWARD, 4)]
    assert orders[3][:4] == [
        (Phase.FORWARD, 0),
        (Phase.BACKWARD, 0),
        (Phase.FORWARD, 1),
        (Phase.BACKWARD, 1),
    ]
    for order in orders:
        assert sorted(order, key=lambda x: (x[0].value, x[1])) == sorted(
            [(Phase.FORWARD, m) for m in range(8)] + [(Phase.BACKWARD, m) for m in range(8)],
            key=lambda x: (x[0].value, x[1]),
        )


@pytest.mark.parametrize("seed", range(40))
def test_the_priced_step_runs_the_runtimes_orders(seed: int) -> None:
    """Uneven stages: `run_schedule` fires each stage in exactly the order the runtime executes
    (`stage_orders`, fixed whatever the durations), each firing once its input has arrived
    and the one before it ended; the rules' own run (`simulate`) may pick other orders, which
    are never faster here. Uniform stages: the same step as the rules' run."""
    rng = random.Random(seed)
    p, m = rng.randint(2, 6), rng.randint(1, 12)
    fwd = [rng.uniform(0.5, 2.0) for _ in range(p)]
    bwd = [rng.uniform(1.0, 4.0) for _ in range(p)]
    send = [rng.uniform(0.0, 0.3) for _ in range(p)]
    priced = run_schedule(p, m, fwd.__getitem__, bwd.__getitem__, send.__getitem__)
    orders = stage_orders(p, m)
    for s in range(p):
        fired = sorted((f for f in priced.firings if f.stage == s), key=lambda f: f.start_s)
        assert [(f.phase, f.chunk, f.micro_batch) for f in fired] == orders[s]
        for before, after in itertools.pairwise(fired):
            assert after.start_s >= before.end_s - 1e-12
    for f in priced.firings:  # a firing starts once its input is there (its producer + send)
        if f.phase is Phase.FORWARD and f.stage > 0:
            producer = next(
                g for g in priced.firings
                if (g.stage, g.phase, g.micro_batch) == (f.stage - 1, Phase.FORWARD, f.micro_batch)
            )  # fmt: skip
            assert f.start_s >= producer.end_s + send[f.stage - 1] - 1e-12
    rules = simulate(p, m, fwd.__getitem__, bwd.__getitem__, send.__getitem__)
    assert priced.makespan_s <= rules.makespan_s + 1e-9
    uniform = run_schedule(p, m, lambda _: fwd[0], lambda _: bwd[0], lambda _: send[0])
    same = simulate(p, m, lambda _: fwd[0], lambda _: bwd[0], lambda _: send[0])
    assert uniform.makespan_s == pytest.approx(same.makespan_s)
