"""The distributed optimizer (ZeRO-1 and ZeRO-2) trains like one device: `--check` on gloo
processes.

Oracle: `runtime.verify.step_check` (every step's loss, gradients and updates against one device
within their derived bounds), on plans whose optimizer states are split over data parallelism
(`megatron:...,zero=1`), and gradients too (`zero=2`: reduce-scattered in backward, accumulated
on the shard over micro-batches): data parallel on 2 and 4 processes, with tensor parallelism
and with a pipeline on 4; the weights gathered bucket by bucket with gloo's broadcasts, and
with the all-gather other backends run (`ALL_GATHER`, on gloo), and every piece in place as
large ones are (`IN_PLACE`, `IN_PLACE_ALL_GATHER`). A runtime that steps the shards but never gathers them back into the
weights fails (the check sees the updates missing), and so does a ZeRO-2 that keeps only the last
micro-batch's gradient in the shard (the check sees the gradients wrong). The plans state it: some parameter has a
split state layout, and with zero=2 its gradient's layout is the same.
Lives elsewhere: the planner's side (tests/planner/test_zero.py), peak memory
(tests/runtime/test_memory.py), the runtime (runtime/parallel/sharded_update.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import judge
from tests.support.check_workers import ALL_GATHER, IN_PLACE, IN_PLACE_ALL_GATHER, run_checked

LR = 1e-2
STEPS = 3
WORKER_TIMEOUT_S = 300.0
# What the verdict names for each injected bug: the weights missing their update, or the
# gradients missing all micro-batches but the last.
CORRECT = ("none", ALL_GATHER, IN_PLACE, IN_PLACE_ALL_GATHER)  # variants that are no bug
FAULT_SEEN = {"no-gather": "update", "no-accumulate": "gradient"}
# (processes, model, strategy, injected bug)
JOBS: list[tuple[int, str, str, str]] = [
    (2, "mlp", "megatron:tp=1,pp=1,dp=2,zero=1", "none"),
    (2, "gpt", "megatron:tp=1,pp=1,dp=2,zero=1", "none"),
    (2, "mlp", "megatron:tp=1,pp=1,dp=2,zero=1", "no-gather"),
    (2, "gpt", "megatron:tp=1,pp=1,dp=2,zero=1", ALL_GATHER),
    (2, "gpt", "megatron:tp=1,pp=1,dp=2,zero=1", IN_PLACE),
    (4, "mlp", "megatron:tp=1,pp=1,dp=4,zero=1", "none"),
    (4, "mlp", "megatron:tp=2,pp=1,dp=2,zero=1", "none"),
    (4, "mlp", "megatron:tp=2,pp=1,dp=2,zero=1", ALL_GATHER),
    (4, "mlp", "megatron:tp=2,pp=1,dp=2,zero=1", IN_PLACE_ALL_GATHER),
    (4, "gpt", "megatron:tp=1,pp=2,dp=2,zero=1", "none"),
    (2, "mlp", "megatron:tp=1,pp=1,dp=2,mb=2,zero=2", "none"),
    (2, "gpt", "megatron:tp=1,pp=1,dp=2,mb=2,zero=2", "none"),
    (2, "mlp", "megatron:tp=1,pp=1,dp=2,zero=2", "no-gather"),
    (2, "mlp", "megatron:tp=1,pp=1,dp=2,mb=2,zero=2", "no-accumulate"),
    (4, "mlp", "megatron:tp=1,pp=1,dp=4,zero=2", "none"),
    (4, "mlp", "megatron:tp=2,pp=1,dp=2,mb=2,zero=2", "none"),
    (4, "gpt", "megatron:tp=1,pp=2,dp=2,mb=2,zero=2", "none"),
]


@cache
def _plan(model: str, devices: int, strategy: str) -> dict[str, Any]:
    module, inputs = load_model(model)
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=devices, strategy=strategy, time_limit_s=30.0
    )
    return plan.to_json()


@cache
def _checks(world_size: int) -> dict[str, Any]:
    cases = [
        (f"{m}-{s}-{f}", TrainSpec(m, {}, _plan(m, n, s), STEPS, lr=LR, check=True), f)
        for n, m, s, f in JOBS
        if n == world_size
    ]
    return run_workers(run_checked, world_size, (cases,), timeout_s=WORKER_TIMEOUT_S)[0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("world_size", "model", "strategy", "fault"),
    JOBS,
    ids=[f"{n}-{m}-{s}-{f}" for n, m, s, f in JOBS],
)
def test_zero_trains_like_one_device(
    world_size: int, model: str, strategy: str, fault: str
) -> None:
    plan = _plan(model, world_size, strategy)
    split = [n for n, p in plan["params"].items() if p["optimizer_state_sbp"] != p["sbp"]]
    assert split, "the plan shards no optimizer state"
    grads = [n for n, p in plan["params"].items() if p["gradient_sbp"] != p["sbp"]]
    assert grads == (split if strategy.endswith("zero=2") else [])
    checks = _checks(world_size)[f"{model}-{strategy}-{fault}"]
    assert len(checks) == STEPS
    verdict = judge(checks)
    assert verdict.passed == (fault in CORRECT), verdict.text
    if fault not in CORRECT:
        assert FAULT_SEEN[fault] in verdict.text, verdict.text
