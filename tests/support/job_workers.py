"""Module-level worker for the training job's parts (spawned by `launching.workers.run_workers`):
engines under plans, asked what a job relies on.

Lives here: `run_job_cases`, which runs each case's `kind` on every rank and returns the rank's
findings (plain numbers and lists: results cross processes by pickling):
- "norm": one step with clipping; the engine's global gradient norm, and on every rank the
  whole gradients (`Engine.full_gradients`);
- "resume": 4 steps on a data set with a checkpoint (and the loader's state) after step 2,
  then a fresh engine and loader resumed from it for steps 3 and 4: both runs' losses;
- "rows": the rows of a global batch this rank reads (`Engine.batch_layout`), and the inputs
  its programs read;
- "weights": one step on a batch whose labels ignore some targets, micro-batched: the loss
  and whole gradients;
- "mixed-batches": a step given another batch on rank 1: the error's text;
- "eval": `Engine.evaluate` of the example batch twice, then a training step's loss.
Lives elsewhere: the cases and their oracles (tests/runtime/test_job_parts.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autosbp.errors import AutosbpError
from autosbp.plan import Plan
from autosbp.zoo import load_model
from runtime.engine import Engine
from runtime.optim import OptimizerRecipe
from tests.support.shared_captures import shares_captures

LR = 1e-2


@shares_captures
def run_job_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    return [_KINDS[case["kind"]](case) for case in cases]


def _engine(case: dict[str, Any], **options: Any) -> tuple[Engine, tuple[torch.Tensor, ...]]:
    model, inputs = load_model(case["model"], case["args"])
    plan = Plan.from_json(case["plan"])
    recipe = OptimizerRecipe(plan.optimizer, LR)
    return Engine(model, plan, recipe, example_inputs=inputs, **options), inputs


def _gradients(engine: Engine) -> dict[str, list[float]]:
    return {n: g.flatten().tolist() for n, g in engine.full_gradients().items()}


def _norm(case: dict[str, Any]) -> dict[str, Any]:
    engine, inputs = _engine(case, clip_grad_norm=case["clip"])
    engine.step(inputs)
    return {"norm": engine.grad_norm, "gradients": _gradients(engine)}


def _resume(case: dict[str, Any]) -> dict[str, Any]:
    from runtime.data import stdlib_text
    from runtime.state.checkpoint import load_checkpoint, save_checkpoint

    folder = Path(case["folder"])
    data = stdlib_text(seq=case["args"]["seq"])
    engine, _ = _engine(case)
    loader = engine.loader(data, seed=3)
    first = []
    for step in range(4):
        batch, _ = next(loader)
        first.append(engine.step(batch))
        if step == 1:
            save_checkpoint(engine, folder, step=2, extra={"data": loader.state()})
    again, _ = _engine(case)
    manifest = load_checkpoint(again, folder)
    again.weights.refresh()
    resumed_loader = again.loader(data, state=manifest.extra["data"])
    resumed = [again.step(next(resumed_loader)[0]) for _ in range(2)]
    return {"first": first, "resumed": resumed}


def _rows(case: dict[str, Any]) -> dict[str, Any]:
    engine, _ = _engine(case)
    layout = engine.batch_layout()
    return {
        "rows": list(layout.rows()),
        "reads": [i for i, box in enumerate(layout.boxes) if box is not None],
        "stage": engine.stage,
    }


def _weights(case: dict[str, Any]) -> dict[str, Any]:
    engine, inputs = _engine(case)
    ids, labels = inputs
    labels = labels.clone()
    labels[: len(labels) // 2, 2:] = -100  # the first micro-batch mostly ignored
    loss = engine.step((ids, labels))
    return {"loss": loss, "gradients": _gradients(engine), "weights": engine.loss_weights}


def _mixed_batches(case: dict[str, Any]) -> str:
    engine, inputs = _engine(case)
    batch = tuple(x.flip(0) if dist.get_rank() == 1 else x for x in inputs)  # other rows
    try:
        engine.step(batch)
    except AutosbpError as exc:
        return str(exc)
    return ""


def _evaluations(case: dict[str, Any]) -> dict[str, Any]:
    engine, inputs = _engine(case)
    first, again = engine.evaluate(inputs), engine.evaluate(inputs)
    return {"evaluations": [first, again], "trained": engine.step(inputs)}


_KINDS = {
    "norm": _norm,
    "resume": _resume,
    "rows": _rows,
    "weights": _weights,
    "mixed-batches": _mixed_batches,
    "eval": _evaluations,
}
