"""zb1 priced as it runs (`planner.timing.zero_bubble_price`): the priced bubble and step against a
brute-force run of the actor rules with separate B and W durations, zb1 with no weight work is
exactly the runtime's 1F1B, and the memory priced with zb1's activations in flight.

Oracle: `_brute`, a fixed point over every firing (a firing starts when the one before it on
its stage ended and its input arrived: F after F[s - 1] + transfer, B after B[s + 1] +
transfer or the last stage's own F, W after its B), written apart from `run_zb1`'s event loop.
"""

from __future__ import annotations

import random
from functools import cache

import pytest

from autosbp.plan import Plan
from autosbp.planner.api import auto_parallelize
from autosbp.planner.timing.zero_bubble_price import weight_shares
from autosbp.schedule import Phase, Step, run_orders, stage_orders
from autosbp.zero_bubble import run_zb1, zb1_orders
from autosbp.zoo import load_model

GPT = {"hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8, "layers": 4}
HAND = "megatron:tp=1,pp=4,dp=1,mb=8"


def _brute(
    orders: list[list[Step]], f: list[float], b: list[float], w: list[float], t: list[float]
) -> tuple[float, list[float]]:
    """(makespan, per stage busy) by relaxing start times until nothing moves."""
    p = len(orders)
    duration = {Phase.FORWARD: f, Phase.BACKWARD: b, Phase.WEIGHT: w}
    end: dict[tuple[Phase, int, int], float] = {}
    for _ in range(sum(map(len, orders)) + 1):
        moved = False
        for s, order in enumerate(orders):
            previous = 0.0
            for phase, _, mb in order:
                needs = {
                    Phase.FORWARD: (Phase.FORWARD, s - 1, mb) if s else None,
                    Phase.BACKWARD: (Phase.BACKWARD, s + 1, mb) if s + 1 < p else None,
                    Phase.WEIGHT: (Phase.BACKWARD, s, mb),
                }[phase]
                ready = 0.0
                if phase is Phase.BACKWARD and s + 1 == p:
                    ready = end.get((Phase.FORWARD, s, mb), 0.0)
                elif needs is not None:
                    hop = 0.0 if phase is Phase.WEIGHT else t[min(s, needs[1])]
                    ready = end.get(needs, 0.0) + hop
                finish = max(previous, ready) + duration[phase][s]
                if end.get((phase, s, mb)) != finish:
                    end[(phase, s, mb)], moved = finish, True
                previous = finish
        if not moved:
            break
    busy = [sum(duration[ph][s] for ph, _, _ in order) for s, order in enumerate(orders)]
    return max(end.values()), busy


@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 5), (4, 4), (4, 9), (6, 7)])
def test_run_zb1_is_the_brute_force_run_of_the_rules(p: int, m: int) -> None:
    rng = random.Random(p * 100 + m)
    f, b, w, t = ([rng.uniform(0.2, 2.0) for _ in range(p)] for _ in range(4))
    timeline = run_zb1(zb1_orders(p, m), m, f.__getitem__, b.__getitem__, w.__getitem__,
                       t.__getitem__)  # fmt: skip
    makespan, busy = _brute(zb1_orders(p, m), f, b, w, t)
    assert timeline.makespan_s == pytest.approx(makespan)
    for s in range(p):
        assert timeline.bubble_s(s) == pytest.approx(makespan - busy[s])


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 7) for m in range(1, 13)])
def test_zb1_without_weight_work_is_the_runtimes_1f1b(p: int, m: int) -> None:
    """Without its W firings zb1's order is 1F1B's (`stage_orders`), and with W = 0 its times
    are those of the runtime's 1F1B order (`run_orders`), on uneven stages and transfers."""
    orders = zb1_orders(p, m)
    assert [[x for x in o if x[0] is not Phase.WEIGHT] for o in orders] == stage_orders(p, m)
    rng = random.Random(p * 100 + m)
    f, b, t = ([rng.uniform(0.2, 2.0) for _ in range(p)] for _ in range(3))
    zb = run_zb1(orders, m, f.__getitem__, b.__getitem__, lambda _: 0.0, t.__getitem__)
    one = run_orders(stage_orders(p, m), m, f.__getitem__, b.__getitem__, t.__getitem__)
    assert zb.makespan_s == pytest.approx(one.makespan_s)


@cache
def _plans() -> tuple[Plan, Plan]:
    module, inputs = load_model("gpt", GPT)
    one, zb = (
        auto_parallelize(
            module, inputs, profile="cpu-gloo", devices=4, strategy=s, time_limit_s=30.0
        )
        for s in (HAND, HAND + ",schedule=zb1")
    )
    return one, zb


def test_weight_shares_count_the_gradients_backward_computes() -> None:
    """Each floating input whose gradient backward computes is one share (the cost model's
    `backward_share`): a linear without bias spends half its backward on its weight, one with
    a bias two thirds; an embedding all of it; ops on activations alone none."""
    from autosbp.capturing.export import capture_micro_batch

    module, inputs = load_model("gpt", GPT)
    graph = capture_micro_batch(module, inputs, 1)
    shares = weight_shares(graph)
    by_op: dict[str, set[float]] = {}
    for name, share in shares.items():
        by_op.setdefault(graph.node(name).op, set()).add(round(share, 3))
    assert by_op["aten.linear.default"] == {0.5, 0.667}  # the head (tied: no bias), the blocks
    assert by_op["aten.embedding.default"] == {1.0}
    assert by_op["aten.scaled_dot_product_attention.default"] == {0.0}


def test_the_planned_zb1_step_is_its_simulation_and_holds_more_in_flight() -> None:
    one, zb = _plans()
    assert (one.schedule, zb.schedule) == ("1f1b", "zb1")
    assert "schedule" not in one.to_json()  # 1F1B plans are written as before
    # the same stages and times per micro-batch; zb1 fills the bubble with deferred W
    assert [s.forward_s for s in one.stages] == pytest.approx([s.forward_s for s in zb.stages])
    assert zb.predicted.step_time_s < one.predicted.step_time_s
    # every stage of zb1 holds min(P, m) = 4 micro-batches, 1F1B's stage s holds P - s
    assert zb.stages[-1].peak_memory_bytes > one.stages[-1].peak_memory_bytes
    assert zb.stages[0].peak_memory_bytes == pytest.approx(one.stages[0].peak_memory_bytes)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 4), (4, 8), (2, 1)])
def test_the_priced_zb1_bubble_is_the_brute_force_one(stages: int, micro_batches: int) -> None:
    """A solved pipeline of a GPT: `predict_zb1`'s bubble and step are the brute-force run of
    its own per-stage F, B = backward - W and W (`weight_s`), its memory counts zb1's in
    flight, and its 1F1B prediction (`predict`) is the one the problem always had."""
    from autosbp.capturing.export import capture_micro_batch
    from autosbp.planner.ilp.solving import solve
    from autosbp.planner.problem.build import build_problem
    from autosbp.planner.space.stages import split_stages
    from autosbp.planner.timing.predict import predict
    from autosbp.planner.timing.zero_bubble_price import predict_zb1, weight_s
    from autosbp.sbp import Mesh
    from tests.planner.test_planner import a100_prices

    module, inputs = load_model("gpt", GPT)
    graph = capture_micro_batch(module, inputs, micro_batches)
    split = split_stages(graph, stages)

    def build(schedule: str):  # type: ignore[no-untyped-def]
        return build_problem(
            graph, Mesh((1,)), a100_prices(), optimizer="adam", memory_limit_bytes=None,
            micro_batches=micro_batches, split=split, schedule=schedule,
        )  # fmt: skip

    one, zb = build("1f1b"), build("zb1")
    solution = solve(one.problem, time_limit_s=30.0)
    base, priced = predict(one, solution), predict_zb1(zb, solution, weight_shares(graph))
    assert solution.objective <= base.step_time_s * (1 + 1e-9)  # 1F1B's bound, as before
    # zb1's objective (P(k, k) alone) bounds its step from below
    own = solve(zb.problem, time_limit_s=30.0)
    assert own.objective <= predict_zb1(zb, own, weight_shares(graph)).step_time_s * (1 + 1e-9)
    found_w = weight_s(zb, solution, weight_shares(graph))
    w = [min(x, b) for x, b in zip(found_w, base.backward_s, strict=True)]
    w[0] = base.backward_s[0]  # the first stage: no input gradient, W its whole backward
    b_in = [b - x for b, x in zip(base.backward_s, w, strict=True)]
    makespan, busy = _brute(zb1_orders(stages, micro_batches), list(base.forward_s), b_in, w,
                            list(base.send_s))  # fmt: skip
    assert all(x > 0 for x in w) and all(x > 0 for x in b_in[1:]) and b_in[0] == 0
    assert priced.bubble_s == pytest.approx([makespan - x for x in busy])
    assert priced.step_time_s >= makespan - 1e-12  # then each stage's update
    assert priced.step_time_s < base.step_time_s  # W fills what 1F1B leaves idle
    if micro_batches >= stages:  # stage 0 holds P in both (1F1B counts P even where m < P)
        assert priced.peak_bytes[0] == pytest.approx(base.peak_bytes[0])
    if stages > 1 and micro_batches > 1:
        assert priced.peak_bytes[-1] > base.peak_bytes[-1]  # the last holds min(P, m), not 1


def test_the_plan_records_w_and_its_timeline_runs_zb1() -> None:
    """A zb1 plan states each stage's W (`StagePlan.weight_s`, absent from 1F1B plans, whose
    files stay as they were), and its predicted timeline is zb1's run: "weight" spans, no send
    after them, and the plan's predicted step."""
    from autosbp.timeline import predicted_events
    from autosbp.timeline.events import span_s

    one, zb = _plans()
    assert all(s.weight_s is None for s in one.stages)
    assert all("weight_s" not in s for s in one.to_json()["stages"])
    assert all(0 < (s.weight_s or 0) < s.backward_s for s in zb.stages[1:])
    assert zb.stages[0].weight_s == zb.stages[0].backward_s  # nothing to send: W is all of it
    assert Plan.from_json(zb.to_json()) == zb
    events = predicted_events(zb, every_rank=False)
    weights = [e for e in events if e.kind == "weight"]
    assert len(weights) == zb.micro_batches * zb.pipeline_stages
    sends = [e for e in events if e.kind == "send"]  # after each F and B that crosses, only
    assert len(sends) == 2 * zb.micro_batches * (zb.pipeline_stages - 1)
    assert span_s(events) == pytest.approx(zb.predicted.step_time_s)
    assert span_s(predicted_events(one, every_rank=False)) == pytest.approx(
        one.predicted.step_time_s
    )
