"""ZB-H1, the zero-bubble pipeline schedule (`zb1`): backward split into two actors per stage.

Lives here: `zb1_orders` (each stage's firings: forward F, input-gradient B, weight-gradient
W), `run_zb1` (their times under given durations, the discrete-event run of the rules below),
`zb1_bubble_s` (the idle time of uniform stages, closed form), `zb1_in_flight` (the
micro-batches whose activations a stage holds at once) and `plan_orders` (the firing order of
any schedule a plan names: the one place the runtime asks). Lives elsewhere: 1F1B and
interleaved 1F1B and the shared `Phase`, `Step`, `Timeline` (`schedule`), what B and W compute
(`runtime.parallel.pipeline`).

Rules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3, ZB-H1; torch's
ScheduleInterleavedZeroBubble with one chunk per rank):
- B[s] reads the gradient of B[s + 1] (the last stage: its own forward) and computes only the
  gradients of the stage's inputs, sent upstream at once; W[s] reads what B[s] kept (the
  autograd graph, the gradients at the weights' consumers) and computes the weights' gradients.
  The saved-activation register is freed by W, not B.
- Stage s warms up with min(P - 1 - s, m) forwards (1F1B's), then takes turns, one forward and
  one B; after each B it runs the oldest pending W once more than s are pending (W credit s:
  the last stage defers the most, stage 0 nothing); after its last B, the pending Ws. So every
  stage holds at most min(P, m) micro-batches (1F1B's peak, stage 0's; `zb1_in_flight`), and
  the deferred Ws fill the wait for the gradients coming back.
- As in 1F1B: one actor at a time per device, blocking receives and non-blocking sends, an
  order from one valid run of the rules (`run_zb1` asserts it completes), a transfer taking
  `transfer_s` after its producer ends. Plain stages only (one chunk per device).
"""

from __future__ import annotations

from collections.abc import Sequence

from autosbp.schedule import (
    SCHEDULES,
    Duration,
    Phase,
    Step,
    Timeline,
    check_interleaving,
    run_orders,
    stage_orders,
)

__all__ = [
    "check_schedule",
    "plan_orders",
    "run_zb1",
    "zb1_bubble_s",
    "zb1_in_flight",
    "zb1_in_flight_counts",
    "zb1_orders",
]


def zb1_orders(num_stages: int, micro_batches: int) -> list[list[Step]]:
    """Each stage's firings (phase, chunk 0, micro-batch) in ZB-H1's order (the rules above)."""
    p, m = num_stages, micro_batches
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        order: list[Step] = [(Phase.FORWARD, 0, mb) for mb in range(warm)]
        weights = 0
        for k in range(m):  # the k-th B, after the forward of micro-batch warm + k if any
            if warm + k < m:
                order.append((Phase.FORWARD, 0, warm + k))
            order.append((Phase.BACKWARD, 0, k))
            if k + 1 - weights > s:
                order.append((Phase.WEIGHT, 0, weights))
                weights += 1
        orders.append(order + [(Phase.WEIGHT, 0, mb) for mb in range(weights, m)])
    return orders


def run_zb1(
    orders: Sequence[Sequence[Step]],
    micro_batches: int,
    forward_s: Duration,
    input_s: Duration,
    weight_s: Duration,
    transfer_s: Duration = lambda _: 0.0,
) -> Timeline:
    """The times of each stage firing `orders` as soon as its input is there and the firing
    before it ended: F on stage s once F[s - 1]'s activation arrived, B once B[s + 1]'s
    gradient arrived (the last stage: its F ended), W once its B ended. `input_s(s)` and
    `weight_s(s)` are one micro-batch's B and W on stage s (`schedule.run_orders` with a
    weight duration). Asserts that the orders complete."""
    return run_orders(orders, micro_batches, forward_s, input_s, transfer_s, weight_s)


def zb1_bubble_s(num_stages: int, forward_s: float, input_s: float, weight_s: float) -> float:
    """Each stage's idle time in a ZB-H1 step of uniform stages without transfer time and with
    micro-batches >= stages: (P - 1)(f + b - min(w, f, b)), against 1F1B's (P - 1)(f + b + w)
    (Qi et al. 2023, section 3.1, for w <= f, b: a third of 1F1B's with f = b = w; a W longer
    than F or B fills only that much of each wait). `run_zb1` is its oracle (tested)."""
    return (num_stages - 1) * (forward_s + input_s - min(weight_s, forward_s, input_s))


def zb1_in_flight(stage: int, num_stages: int, micro_batches: int) -> int:
    """The micro-batches whose saved activations `stage` holds at its peak (F done, W not):
    its warm-up, one more, and the s Ws it defers: min(P, m) on every stage."""
    del stage  # the same on every stage: stage s warms up s fewer and defers s more
    return min(num_stages, micro_batches)


def zb1_in_flight_counts(num_stages: int, micro_batches: int) -> tuple[int, ...]:
    """`zb1_in_flight` of every stage: what the planner's memory constraints count."""
    return tuple(zb1_in_flight(s, num_stages, micro_batches) for s in range(num_stages))


def plan_orders(
    schedule: str, num_stages: int, micro_batches: int, virtual_stages: int = 1
) -> list[list[Step]]:
    """Each stage's firing order under `schedule` (`schedule.SCHEDULES`): what each runtime
    rank executes. ValueError for a zero-bubble schedule with chunks (plain stages only)."""
    if schedule == "zb1":
        reason = check_schedule(schedule, num_stages, virtual_stages, micro_batches)
        if reason is not None:
            raise ValueError(reason)
        return zb1_orders(num_stages, micro_batches)
    assert schedule == "1f1b", schedule
    return stage_orders(num_stages, micro_batches, virtual_stages=virtual_stages)


def check_schedule(
    schedule: str, num_stages: int, virtual_stages: int, micro_batches: int
) -> str | None:
    """Why the actor rules cannot run this pipeline under `schedule`, or None when they can:
    a known schedule, 1F1B's interleaving rules (`schedule.check_interleaving`), zb1 on plain
    stages."""
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r} is not one autosbp runs (known: {list(SCHEDULES)})"
    if schedule == "zb1" and virtual_stages != 1:
        return (
            f"schedule zb1 (ZB-H1) runs plain stages, not {virtual_stages} model chunks per "
            "device; drop vp=V or schedule=zb1"
        )
    return check_interleaving(num_stages, virtual_stages, micro_batches)
