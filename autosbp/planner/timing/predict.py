"""A solved configuration's step, predicted as the runtime runs it: its per-stage times through
the actor simulation of its schedule (1F1B, plain or interleaved).

Lives here: `Prediction` (per stage its exposed forward, backward, transfer, update, bubble and
peak bytes; the step) and `predict` (a solution's stage costs priced and run through
`schedule.run_schedule`), with what the blocks' compute hides of the parameters' conversions
(`gathers_hidden`). Lives elsewhere: the per-stage sums it reads (`problem.stage_terms`,
`timing.objective.StageCosts`), the actor rules (`autosbp.schedule`), zero bubble's step
(`timing.zero_bubble_price`), the ILP's objective, a lower bound of this prediction
(`timing.objective`).

Invariant: a prediction reads only a configuration's stage costs and its schedule's shape
(`Configured`), never the graph: the same costs predict the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from autosbp.overlap import hidden_gather_s, hidden_sync_s
from autosbp.planner.ilp.formulation import Solution
from autosbp.planner.space.stages import StageSplit
from autosbp.planner.timing.objective import StageCosts
from autosbp.schedule import run_schedule


class Configured(Protocol):
    """What a prediction reads of one configuration's problem (`problem.build.MeshProblem`)."""

    @property
    def stage_costs(self) -> StageCosts: ...
    @property
    def split(self) -> StageSplit: ...
    @property
    def micro_batches(self) -> int: ...
    @property
    def virtual_stages(self) -> int: ...
    @property
    def pipeline_stages(self) -> int: ...


@dataclass(frozen=True)
class Prediction:
    """A solved problem priced as the runtime runs it (`schedule.run_schedule`; interleaved,
    `peak_bytes` and `bubble_s` are each virtual stage's device's, all its chunks): per stage its
    per-micro-batch forward/backward (what stays exposed of the parameters' conversions included,
    `gather_hidden_s` of them hidden behind the blocks' compute), transfer to the next stage and
    per-step update (seconds; `sync_s` of it the gradient sync, the rest the optimizer's), the part
    of the update's sync that the last backward hides, and peak bytes; the step time is when the
    last stage finishes its update."""

    step_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_s: tuple[float, ...]
    update_s: tuple[float, ...]
    sync_hidden_s: tuple[float, ...]  # of update_s, what the last backward hides
    peak_bytes: tuple[float, ...]
    bubble_s: tuple[float, ...]
    gather_hidden_s: tuple[float, ...] = ()  # per micro-batch, forward + backward
    sync_s: tuple[float, ...] = ()  # of update_s, the gradient sync (the rest: the optimizer)
    weight_s: tuple[float, ...] = ()  # zb1: of backward_s, W's (`timing.zero_bubble_price`)


def predict(mp: Configured, solution: Solution) -> Prediction:
    costs, choice = mp.stage_costs, solution.choice
    fwd = tuple(c.value(choice) for c in costs.forward)
    busy = tuple(c.value(choice) for c in costs.busy)
    send = tuple(c.value(choice) for c in costs.send)
    update = tuple(c.value(choice) for c in costs.update)
    bwd = tuple(b - f for b, f in zip(busy, fwd, strict=True))
    hidden = tuple(
        hidden_sync_s(c.value(choice), b, k, costs.overlap)
        for c, b, k in zip(costs.sync, bwd, costs.sync_buckets, strict=True)
    )
    forward_hidden, backward_hidden = gathers_hidden(costs, choice)
    exposed_fwd = tuple(f - h for f, h in zip(fwd, forward_hidden, strict=True))
    exposed_bwd = tuple(b - h for b, h in zip(bwd, backward_hidden, strict=True))
    p, v = mp.pipeline_stages, mp.virtual_stages
    timeline = run_schedule(
        p, mp.micro_batches, exposed_fwd.__getitem__, exposed_bwd.__getitem__,
        send.__getitem__, virtual_stages=v,
    )  # fmt: skip

    def device(values: Sequence[float], s: int) -> float:
        """Of virtual stage s: the sum over its device's chunks."""
        return sum(values[c * p + s % p] for c in range(v))

    ends = [
        timeline.end_s(s % p) + device(update, s) - device(hidden, s)
        for s in range(mp.split.num_stages)
    ]
    used = [
        max(
            mem.used_bytes(choice), _update_bytes(costs, s, choice), _reduce_bytes(costs, s, choice)
        )
        for s, mem in enumerate(costs.memory)
    ]
    peaks = tuple(device(used, s) for s in range(mp.split.num_stages))
    bubbles = tuple(timeline.bubble_s(s % p) for s in range(mp.split.num_stages))
    gathers = tuple(f + b for f, b in zip(forward_hidden, backward_hidden, strict=True))
    sync = tuple(c.value(choice) for c in costs.sync)
    return Prediction(
        max(ends), exposed_fwd, exposed_bwd, send, update, hidden, peaks, bubbles, gathers, sync
    )


def _reduce_bytes(costs: StageCosts, s: int, choice: dict) -> float:
    """Stage s's bytes at its gathered weights' reduce-scatters (`problem.stage_terms`; 0
    without a constraint there)."""
    found = costs.reduce_memory[s] if costs.reduce_memory else None
    return found.used_bytes(choice) if found is not None else 0.0


def _update_bytes(costs: StageCosts, s: int, choice: dict) -> float:
    """Stage s's bytes at its weight gather under `choice`: the buffer is the chosen bucketed
    parameters' pieces, at most one bucket's (where the constraint prices a bucket whatever
    the choice, its constant)."""
    if not costs.update_memory:
        return 0.0
    mem = costs.update_memory[s]
    if not mem.constant_bytes:  # exact: the pieces are in its bytes
        return mem.used_bytes(choice)
    buffer = min(mem.constant_bytes, costs.staging[s].value(choice))
    return mem.used_bytes(choice) - mem.constant_bytes + buffer


def gathers_hidden(costs: StageCosts, choice: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage and micro-batch, the parameter communication the blocks' compute hides in
    forward and in backward (`overlap.hidden_gather_s`; 0 where the stage has no slots)."""
    stages = range(len(costs.busy))
    if not costs.slots:
        return (0.0,) * len(stages), (0.0,) * len(stages)

    def hidden(comm: tuple, compute: tuple) -> tuple[float, ...]:
        return tuple(
            hidden_gather_s(
                comm[s].value(choice), compute[s].value(choice), costs.slots[s], costs.overlap
            )
            for s in stages
        )

    return (
        hidden(costs.gather_forward, costs.compute_forward),
        hidden(costs.gather_backward, costs.compute_backward),
    )
