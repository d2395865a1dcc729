"""Module-level workers for the parameter-gather tests (spawned by `launching.workers.run_workers`).

Lives here: `run_gather_cases`, which trains an `Engine` per case on every rank under the case's
`GatherPolicy` (keep or re-gather every parameter, prefetch depth), each step compared with one
device on rank 0 (`runtime.verify.step_check.StepChecker`, as `--check`), and reports what the schedule did
(`GatherCounts`). Lives elsewhere: planning and the assertions (tests/runtime/test_prefetch.py), the
schedule (`runtime.parallel.prefetch`).

Invariants: every rank runs the cases in the same order (collectives match by order); results
are plain Python so they pickle cheaply back to the parent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autosbp.capturing.export import capture_micro_batch
from autosbp.plan import Plan
from autosbp.timeline import Recorder
from autosbp.zoo import build_model
from runtime import Engine
from runtime.parallel.gathers import GatherPolicy
from runtime.verify.step_check import StepChecker
from tests.support.shared_captures import shares_captures

Case = dict[str, Any]
"""{"id": str, "model": zoo name, "model_kwargs": dict, "plan": Plan JSON, "steps": int,
"lr": float, "depth": int, "regather": bool, "from_plan": bool (the plan states depth and
re-gather; the engine reads them)}"""


@shares_captures
def run_gather_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Per case: {"losses": [...], "counts": GatherCounts as a dict or None, "units": how many,
    "spans": the last step's timeline as (kind, micro-batch, start s, end s)} on every rank,
    plus {"checks": [one StepCheck per step]} on rank 0."""
    return [_train(case, rank) for case in cases]


def _train(case: Case, rank: int) -> dict[str, Any]:
    model, inputs = build_model(case["model"], seed=0, **case["model_kwargs"])
    plan = Plan.from_json(case["plan"])
    graph = capture_micro_batch(model, inputs, plan.micro_batches, name=case["model"])
    names = frozenset(name for name, _ in model.named_parameters())
    policy = GatherPolicy(case["depth"], names if case["regather"] else frozenset())
    if case["from_plan"]:
        policy = None  # the plan's own (runtime.parallel.prefetch.plan_gather_policy)
    lr = case["lr"]

    def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=lr)

    recorder = Recorder(rank, 0)
    engine = Engine(
        model, plan, adam, example_inputs=inputs, graph=graph, recorder=recorder, gathers=policy
    )
    checker = StepChecker(engine, model, inputs, adam)
    losses, checks = [], []
    for step in range(case["steps"]):
        losses.append(engine.step(inputs))
        last = recorder.mark_step()
        checks.append(checker.after_step(step, inputs, losses[-1]))
    schedule = engine.program.gathers
    out: dict[str, Any] = {
        "losses": losses,
        "counts": dataclasses.asdict(schedule.counts) if schedule is not None else None,
        "units": schedule.last_unit + 1 if schedule is not None else 0,
        "spans": [(e.kind, e.micro_batch, e.start_s, e.end_s) for e in last],
    }
    if rank == 0:
        out["checks"] = checks
    return out
