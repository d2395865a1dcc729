"""Module-level workers for the runtime tests (spawned by `launching.workers.run_workers`).

Lives here: `run_cases`, which builds an `Engine` per case on every rank and trains it, each
step compared with one device on rank 0 (the oracle: `runtime.verify.step_check.StepChecker`, as `--check`),
and the plain-data case/result formats it speaks. Lives elsewhere: planning and the verdict
(tests/runtime/test_runtime.py, in the parent process), the runtime itself (`runtime`).

Invariants: every rank runs the cases in the same order (collectives match by order); a case
that fails with an `AutosbpError` fails on every rank alike (the checks run before any
collective), so it is reported as data and the next case still runs; results are plain Python
(lists of floats, numpy arrays, frozen StepCheck values) so they pickle cheaply back to the
parent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from autosbp.capturing.export import capture_micro_batch
from autosbp.capturing.graph import OpGraph
from autosbp.errors import AutosbpError
from autosbp.plan import Plan
from autosbp.zoo import build_model
from runtime import Engine
from runtime.verify.step_check import StepChecker
from tests.support.shared_captures import shares_captures

Case = dict[str, Any]
"""{"id": str, "model": zoo name, "model_kwargs": dict, "plan": Plan JSON, "steps": int,
"lr": float} (Adam's learning rate)"""


@shares_captures
def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Per case: {"losses": [...]} on every rank, plus {"state": {name: array}, "checks": [one
    StepCheck per step]} on rank 0, or {"error": "ErrorClass: message"} when the Engine refuses
    the case."""
    graphs: dict[tuple[str, str], OpGraph] = {}
    results = []
    for case in cases:
        model, inputs = build_model(case["model"], seed=0, **case["model_kwargs"])
        micro_batches = case["plan"]["micro_batches"]
        key = (case["model"], repr(sorted(case["model_kwargs"].items())), micro_batches)
        if key not in graphs:  # the Engine runs one micro-batch: its graph is at that size
            graphs[key] = capture_micro_batch(model, inputs, micro_batches, name=case["model"])
        try:
            results.append(_train(case, model, inputs, graphs[key], rank))
        except AutosbpError as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def _train(
    case: Case, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], graph: OpGraph, rank: int
) -> dict[str, Any]:
    plan = Plan.from_json(case["plan"])
    lr = case["lr"]

    def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=lr)

    engine = Engine(model, plan, adam, example_inputs=inputs, graph=graph)
    checker = StepChecker(engine, model, inputs, adam)
    losses, checks = [], []
    for step in range(case["steps"]):
        losses.append(engine.step(inputs))
        checks.append(checker.after_step(step, inputs, losses[-1]))
    state = engine.full_state_dict()
    out: dict[str, Any] = {"losses": losses}
    if rank == 0:
        out["state"] = {name: np.array(t.detach()) for name, t in state.items()}
        out["checks"] = checks  # runtime.verify.verdict.StepCheck, one per step
    return out
