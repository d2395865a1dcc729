"""Module-level worker for the mixed-precision tests (spawned by `launching.workers.run_workers`):
an Engine under a bf16 (or fp16) plan, every step checked against one device running the same
recipe, and what dtype every gradient collective carried.

Lives here: `run_precision_cases` (per case: rank 0's `StepCheck`s, and on every rank the
dtypes it saw: masters, compute copies, optimizer states, gradients, and the wire of each
gradient collective, recorded where the runtime hands a gradient to a collective: the
gradient sync's buckets, the parameter gathers' reduce-scatters, ZeRO-2's conversions and the
weight boxings' backward). Lives elsewhere: the cases (tests/runtime/test_precision.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from autosbp.plan import Plan
from autosbp.zoo import load_model
from runtime.engine import Engine
from runtime.execute import collectives
from runtime.optim import OptimizerRecipe
from runtime.parallel import grad_sync, prefetch, sharded_update
from runtime.verify.one_device import disable_dropout
from runtime.verify.step_check import StepChecker
from tests.support.shared_captures import shares_captures

STEPS = 2  # steps compared with one device (fp16's skipped ones do not count)
MAX_STEPS = 24  # fp16's scale starts at 2^16 and halves per overflow: at most 16 skipped
LR = 1e-2


@contextlib.contextmanager
def recording_wires(seen: set[str]) -> Iterator[None]:
    """Each gradient collective's wire dtype into `seen` (as "sync:bfloat16", ...)."""
    launch = grad_sync.GradSync._launch
    started = prefetch.StartedChain
    scatter_now = sharded_update._scatter_now
    summed_in = collectives.execute_boxing_summed_in

    def sync(self: grad_sync.GradSync, until: int) -> None:
        before = self._next
        launch(self, until)
        for bucket in self.buckets[before:until]:  # each launched bucket's all-reduced buffer
            assert bucket.flat is not None
            seen.add(f"sync:{_name(bucket.flat.dtype)}")

    def chain(tensor: torch.Tensor, steps: Any, groups: Any, **kwargs: Any) -> Any:
        if kwargs.get("donate"):  # a gradient's reduce-scatter (gathers donate nothing)
            seen.add(f"gather-reduce:{_name(tensor.dtype)}")
        return started(tensor, steps, groups, **kwargs)

    def zero2(entry: Any) -> Any:
        hook = scatter_now(entry)

        def recorded(param: torch.Tensor) -> None:
            assert param.grad is not None
            seen.add(f"zero2:{_name(param.grad.dtype)}")
            hook(param)

        return recorded

    def boxing(local: torch.Tensor, steps: Any, groups: Any, dtype: torch.dtype) -> Any:
        seen.add(f"weight-boxing:{_name(dtype)}")
        return summed_in(local, steps, groups, dtype)

    with (
        mock.patch.object(grad_sync.GradSync, "_launch", sync),
        mock.patch.object(prefetch, "StartedChain", chain),
        mock.patch.object(sharded_update, "_scatter_now", zero2),
        mock.patch("runtime.execute.instructions.execute_boxing_summed_in", boxing),
    ):
        yield


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@shares_captures
def run_precision_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Per case: (rank 0's step checks, the dtypes this rank saw)."""
    out = []
    for case in cases:
        model, inputs = load_model(case["model"], case["args"])
        dropout = disable_dropout(model)
        plan = Plan.from_json(case["plan"])
        recipe = OptimizerRecipe(plan.optimizer, LR, 0.1 if plan.optimizer == "adamw" else 0.0)
        wires: set[str] = set()
        with recording_wires(wires):
            engine = Engine(model, plan, recipe, example_inputs=inputs)
            checker = StepChecker(engine, model, inputs, recipe, dropout)
            checks: list[Any] = []
            for step in range(MAX_STEPS):  # fp16's first steps overflow its scale: skipped
                loss = engine.step(inputs)
                checks.append(checker.after_step(step, inputs, loss))
                if len(checks) - engine.skipped_steps == STEPS:
                    break
        seen = {
            "masters": {_name(t.dtype) for t in engine.parameters.values()},
            "compute": {_name(t.dtype) for t in engine.weights.compute.values()},
            "stepped": {_name(t.dtype) for t in engine.optimized.values()},
            "gradients": {
                _name(t.grad.dtype) for t in engine.optimized.values() if t.grad is not None
            },
            "states": {
                _name(v.dtype)
                for state in engine.optimizer.state.values()
                for v in state.values()
                if torch.is_tensor(v) and v.dim() > 0
            },
            "wires": wires,
            "user_model": {_name(p.dtype) for p in model.parameters()},
            # masters held as ZeRO's shards (`Weights.release`): this rank's parameters whose
            # plan shards their states, each one NaN where it was
            "released": engine.weights.released
            == {name for name in engine.parameters if name in engine.update.names},
            "sharded": bool(engine.update.names),
            "released_read_nan": all(
                bool(torch.isnan(engine.parameters[name]).all()) for name in engine.weights.released
            ),
            "skipped": engine.skipped_steps,
        }
        out.append(([c for c in checks if c is not None], seen))
    return out
