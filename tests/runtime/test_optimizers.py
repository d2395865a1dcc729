"""A plan is trained with the optimizer it was priced for (issue #31 item 3: a plan made with
`--optimizer sgd` was trained with fused Adam, silently).

Oracle: the zoo mlp trained on one device by torch's own optimizer (Adam, SGD, SGD with
momentum 0.9), float32; the 2-process data-parallel job's losses must follow it within fp32
summation-order error (rel 1e-5 over 3 steps: the third step is where momentum departs from
plain SGD, and every step's Adam update differs from SGD's by far more than that).
Checkpoints of every optimizer with elementwise state are tests/runtime/test_checkpoint.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import build_model
from runtime.jobs import TrainSpec, train

STEPS, LR, REL_TOL = 3, 1e-2, 1e-5
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=LR),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
}


def _one_device_losses(kind: str) -> list[float]:
    model, inputs = build_model("mlp")
    optimizer = OPTIMIZERS[kind](list(model.parameters()))
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _plan_json(kind: str) -> dict:
    model, inputs = build_model("mlp")
    plan = auto_parallelize(
        model, inputs, devices=2, strategy="dp", optimizer=kind, time_limit_s=10
    )
    assert plan.optimizer == kind
    return plan.to_json()


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_job_steps_with_the_plans_optimizer(kind: str) -> None:
    result = train(TrainSpec("mlp", {}, _plan_json(kind), STEPS, lr=LR))
    got = [record.loss for record in result.records]
    want = _one_device_losses(kind)
    others = {k: _one_device_losses(k) for k in OPTIMIZERS if k != kind}
    assert got == pytest.approx(want, rel=REL_TOL)
    for other, losses in others.items():  # the oracle tells the optimizers apart
        assert got != pytest.approx(losses, rel=REL_TOL), other
