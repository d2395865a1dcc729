"""Module-level workers for the checkpoint tests (spawned by `launching.workers.run_workers`).

Lives here: `run_checkpoint_cases`: per case, build an `Engine`, optionally load a checkpoint,
train some steps, optionally save one, and report losses (and the full state on rank 0) or the
error. Lives elsewhere: planning, damaging checkpoints and the single-device oracle
(tests/runtime/test_checkpoint.py, in the parent process), checkpoints themselves (`runtime.state.checkpoint`).

Invariants: every rank runs the cases in the same order (collectives match by order); a failed
load or save raises on every rank (runtime.state.checkpoint agrees on failures), so it is reported as
data and the next case still runs; results are plain Python and numpy.
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
from runtime.engine import Engine
from runtime.state.checkpoint import load_checkpoint, save_checkpoint

Case = dict[str, Any]
"""{"id": str, "model": zoo name, "model_kwargs": dict, "plan": Plan JSON, "optimizer": "adam" or
"sgd", "lr": float, "load": path or None, "steps": int, "save": path or None, "state": bool}"""

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def run_checkpoint_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Per case: {"losses": [...]} (plus {"state": {name: array}} on rank 0 when asked), or
    {"error": "ErrorClass: message"}."""
    graphs: dict[tuple[str, str, int], OpGraph] = {}
    results = []
    for case in cases:
        model, inputs = build_model(case["model"], seed=0, **case["model_kwargs"])
        micro_batches = case["plan"]["micro_batches"]
        key = (case["model"], repr(sorted(case["model_kwargs"].items())), micro_batches)
        if key not in graphs:  # the Engine runs one micro-batch: its graph is at that size
            graphs[key] = capture_micro_batch(model, inputs, micro_batches, name=case["model"])
        try:
            results.append(_run(case, model, inputs, graphs[key], rank))
        except AutosbpError as exc:
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def _run(
    case: Case, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], graph: OpGraph, rank: int
) -> dict[str, Any]:
    optimizer, lr = OPTIMIZERS[case["optimizer"]], case["lr"]
    engine = Engine(
        model,
        Plan.from_json(case["plan"]),
        lambda params: optimizer(params, lr=lr),
        example_inputs=inputs,
        graph=graph,
    )
    if case["load"] is not None:
        load_checkpoint(engine, case["load"])
    losses = [engine.step(inputs) for _ in range(case["steps"])]
    if case["save"] is not None:
        save_checkpoint(engine, case["save"])
    out: dict[str, Any] = {"losses": losses}
    if case["state"]:
        state = engine.full_state_dict()
        if rank == 0:
            out["state"] = {name: np.array(t.detach()) for name, t in state.items()}
    return out
