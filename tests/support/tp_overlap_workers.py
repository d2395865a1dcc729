"""Module-level worker for the overlapped tensor-parallel tests (spawned by
`launching.workers.run_workers`): each case trained by the Engine on every rank, checked
against one device, with its timeline.

Lives here: `train_cases` (per case: rank 0's step checks, this rank's span kinds of the last
step). Lives elsewhere: the cases and their assertions (tests/runtime/test_tp_overlap.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from autosbp.capturing.export import capture_micro_batch
from autosbp.plan import Plan
from autosbp.timeline import Recorder
from autosbp.zoo import build_model
from runtime import Engine
from runtime.verify.step_check import StepChecker
from tests.support.shared_captures import shares_captures


@shares_captures
def train_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case id: {"checks": rank 0's step checks (None elsewhere), "losses": each step's
    loss, "spans": the span kinds of the last step on this rank, counted}."""
    return {case["id"]: _train(case, rank) for case in cases}


def _train(case: dict[str, Any], rank: int) -> dict[str, Any]:
    model, inputs = build_model(case["model"], seed=0, **case["model_kwargs"])
    plan = Plan.from_json(case["plan"])
    graph = capture_micro_batch(model, inputs, plan.micro_batches, name=case["model"])

    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    recorder = Recorder(rank, 0)
    engine = Engine(model, plan, sgd, example_inputs=inputs, graph=graph, recorder=recorder)
    checker = StepChecker(engine, model, inputs, sgd)
    checks, losses, last = [], [], []
    for step in range(case["steps"]):
        losses.append(engine.step(inputs))
        last = recorder.mark_step()
        checks.append(checker.after_step(step, inputs, losses[-1]))
    spans = Counter(e.kind for e in last)
    return {"checks": checks if rank == 0 else None, "losses": losses, "spans": spans}
