"""Workers of tests/runtime/test_distribute.py (spawned ranks import them by name)."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch import nn

from autosbp import distribute
from autosbp.plan import Plan
from runtime.verify.step_check import Reference
from runtime.verify.verdict import judge
from tests.support.shared_captures import shares_captures

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 8  # tiny; every dim divides 2 devices
STEPS = 2
LR = 0.1


class SquareLossMlp(nn.Module):
    """Linear-GELU-Linear-GELU-Linear with a mean square loss written as `pow(2).mean()` (torch
    2.13's DTensor gets F.mse_loss's gradient wrong under a sharded batch: runtime/distribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    loss = "pow"  # or "mse": F.mse_loss, the torch bug tests/runtime/test_distribute.py shows

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(x))
        h = nn.functional.gelu(self.mid(h))
        if self.loss == "mse":
            return nn.functional.mse_loss(self.head(h), target)
        return (self.head(h) - target).pow(2).mean()


def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = SquareLossMlp()
    return model, (torch.randn(BATCH, IN), torch.randn(BATCH, OUT))


@shares_captures
def distribute_worker(
    rank: int, world: int, cases: list[tuple[dict, str]]
) -> tuple[list[list[tuple[bool, float, str]]], bool]:
    """Per case (a plan's JSON, the loss: "pow" or "mse"), `train_case` (one world for all:
    spawning one per case would cost most of the test's time); and `freed_at_once` under the
    first case's plan."""
    trained = [train_case(rank, plan_json, loss) for plan_json, loss in cases]
    return trained, freed_at_once(cases[0][0])


def freed_at_once(plan_json: dict) -> bool:
    """Whether a distributed model is freed when its last reference goes, with the cycle
    collector off (runtime.distribute: DTensors alive at interpreter exit abort torch 2.13)."""
    model, inputs = build()
    distribute(model, Plan.from_json(plan_json))
    model(*inputs).backward()
    freed = weakref.ref(model)
    gc.disable()
    try:
        del model
        return freed() is None
    finally:
        gc.enable()


def train_case(rank: int, plan_json: dict, loss: str) -> list[tuple[bool, float, str]]:
    """Train STEPS of SGD under the DTensor model; rank 0 checks each step's loss and gradients
    against one device at the same weights (runtime.verify.step_check's Reference and bounds): (passed,
    worst error / bound, verdict) per step."""
    model, inputs = build()
    model.loss = loss
    reference = Reference(copy.deepcopy(model), None, 1, inputs) if rank == 0 else None
    distribute(model, Plan.from_json(plan_json))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    results = []
    for step in range(STEPS):
        # clones: a replicated DTensor's full_tensor is its local tensor, which the step updates
        before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        value = model(*inputs)
        value.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        loss_value = float(value.detach().full_tensor())  # a collective: on every rank
        optimizer.step()
        if reference is not None:
            check = reference.check(step, inputs, before, loss_value, grads, before)
            worst = max(d.ratio for d in check.worst)
            results.append((judge([check]).passed, worst, judge([check]).text))
    return results
