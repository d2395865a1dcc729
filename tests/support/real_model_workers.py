"""Module-level worker of the real-model suite (spawned by `launching.workers.run_workers`).

Lives here: `train_checked`, which trains each case (a model of tests/support/real_models.py under a
plan) on every rank for a few steps with `--check`'s machinery as `autosbp train --check` runs
it (`runtime.verify.step_check.StepChecker` beside the Engine on every rank, the verdict by
`runtime.verify.verdict.judge` on rank 0). One world serves every case: process start-up and
the imports of torch and transformers cost seconds, a case far less. Lives elsewhere: planning
and the assertions (tests/models/test_real_models.py), the models (tests/support/real_models.py).

Invariants: every rank runs the cases in the same order (collectives match by order); a case
refused with an `AutosbpError` is refused on every rank alike (the plan checks run before any
collective), so it is reported as data and the next case still runs; any other failure ends the
job at once (`run_workers` stops every rank and names the one that failed), since the other
ranks may be waiting in a collective it will never join.
"""

from __future__ import annotations

from typing import Any

import torch

from autosbp.errors import AutosbpError
from autosbp.plan import Plan
from autosbp.zoo import build_model
from runtime.engine import Engine
from runtime.jobs import adam
from runtime.verify.one_device import disable_dropout
from runtime.verify.step_check import StepChecker
from runtime.verify.verdict import judge
from tests.support.real_model_families import BUILDERS

Case = dict[str, Any]
"""{"id": str, "model": a BUILDERS name or "zoo:NAME", "plan": Plan JSON, "steps": int,
"lr": float, optional "args": the builder's keyword arguments}"""


def build(
    name: str, device: str = "cpu", args: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A model of tests/support/real_models.py with `args` (default: none), or the zoo's
    `zoo:NAME` at its defaults, on `device`."""
    if name.startswith("zoo:"):
        return build_model(name.removeprefix("zoo:"), device=device)
    with torch.device(device):
        return BUILDERS[name](**(args or {}))


def train_checked(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Per case on rank 0: {"passed": bool, "verdict": text, "losses": [...]}, or {"error":
    "ErrorClass: message"} when refused; other ranks return their losses (or the error) only."""
    results = []
    for case in cases:
        try:
            results.append(_train(case, rank))
        except AutosbpError as exc:  # refused alike on every rank: the next case still runs
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def _train(case: Case, rank: int) -> dict[str, Any]:
    model, inputs = build(case["model"], args=case.get("args"))
    dropout = disable_dropout(model)
    lr = case["lr"]
    engine = Engine(
        model, Plan.from_json(case["plan"]), lambda ps: adam(ps, lr), example_inputs=inputs
    )
    checker = StepChecker(engine, model, inputs, lambda ps: adam(ps, lr), dropout)
    losses, checks = [], []
    for step in range(case["steps"]):
        loss = engine.step(inputs)
        losses.append(loss)
        checks.append(checker.after_step(step, inputs, loss))
    if rank != 0:
        return {"losses": losses}
    verdict = judge([c for c in checks if c is not None])
    return {"passed": verdict.passed, "verdict": verdict.text, "losses": losses}
