"""The zero-bubble schedule on gloo processes (`megatron:...,schedule=zb1`, ZB-H1): every step
checked against one device (`--check`'s oracle, runtime/verify/step_check.py), each rank's
measured peak memory against the plan's, and what the runtime refuses beside it.

Plans come from the planner (`auto_parallelize`, the cpu-gloo profile) as `autosbp plan
--strategy megatron:tp=1,pp=P,dp=D,schedule=zb1` writes them. Each stage splits its backward:
the input gradients sent upstream at once, the weights' gradients later in the order
`autosbp.zero_bubble.zb1_orders` gives (`runtime.parallel.split_backward`).
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import judge
from tests.support.check_workers import run_checked
from tests.support.memory_workers import assert_predicted_peak
from tests.support.runtime_workers import run_cases

STEPS = 3
# Wide enough that a peak is hundreds of kB (test_memory.py's reason).
WIDE = {"layers": 4, "hidden": 64, "heads": 2, "vocab": 128, "seq": 16, "batch": 4}
LR = 1e-2
WORKER_TIMEOUT_S = 600.0  # one world runs every case of its size
GPT = {"hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8}
# (processes, model arguments, strategy, recomputation)
CHECKED: list[tuple[int, dict[str, Any], str, str]] = [
    (2, {**GPT, "layers": 2}, "megatron:tp=1,pp=2,dp=1,mb=4,schedule=zb1", "none"),
    (2, {**GPT, "layers": 2, "tied": True}, "megatron:tp=1,pp=2,dp=1,mb=2,schedule=zb1", "none"),
    (4, {**GPT, "layers": 4}, "megatron:tp=1,pp=4,dp=1,mb=4,schedule=zb1", "none"),
    (4, {**GPT, "layers": 2}, "megatron:tp=1,pp=2,dp=2,mb=2,schedule=zb1", "none"),
    # tensor parallelism (collectives inside B and W) and ZeRO-2 (gradients reduce-scattered)
    (4, {**GPT, "layers": 2}, "megatron:tp=2,pp=2,dp=1,mb=4,schedule=zb1", "none"),
    (4, {**GPT, "layers": 2}, "megatron:tp=1,pp=2,dp=2,mb=2,zero=2,schedule=zb1", "none"),
]


@cache
def _plan(
    devices: int, model_args: tuple[tuple[str, Any], ...], strategy: str, recompute: str = "none"
) -> dict[str, Any]:
    module, inputs = load_model("gpt", dict(model_args))
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=devices, strategy=strategy,
        recompute=recompute, time_limit_s=30.0,
    )  # fmt: skip
    assert plan.schedule == "zb1" and plan.virtual_stages == 1 and plan.recompute == recompute
    assert plan.to_json()["schedule"] == {"name": "zb1", "virtual_stages": 1}
    return plan.to_json()


def _id(n: int, args: dict[str, Any], strategy: str, recompute: str) -> str:
    return f"{n}-{'tied-' if args.get('tied') else ''}{strategy}-{recompute}"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)  # the first case of a size runs the world of every case of it
@pytest.mark.parametrize(
    ("n", "args", "strategy", "recompute"), CHECKED, ids=[_id(*c) for c in CHECKED]
)
def test_zero_bubble_steps_match_one_device(
    n: int, args: dict[str, Any], strategy: str, recompute: str
) -> None:
    checks = _world(n)[_id(n, args, strategy, recompute)]
    verdict = judge(checks)
    assert len(checks) == STEPS
    assert verdict.passed, verdict.text


def _world(n: int) -> dict[str, list]:
    """Every checked case of `n` processes in one world (each world started once)."""
    if n not in _WORLDS:
        cases = [
            (_id(*c), TrainSpec("gpt", c[1], _plan(c[0], tuple(sorted(c[1].items())), c[2], c[3]),
                                STEPS, lr=LR, check=True), "none")
            for c in CHECKED
            if c[0] == n
        ]  # fmt: skip
        _WORLDS[n] = run_workers(run_checked, n, (cases,), timeout_s=WORKER_TIMEOUT_S)[0]
    return _WORLDS[n]


_WORLDS: dict[int, dict[str, list]] = {}


@pytest.mark.dist
def test_zero_bubble_peak_memory_is_the_predicted_peak() -> None:
    """Every stage holds min(P, m) micro-batches at its peak (`zero_bubble.zb1_in_flight`): the
    last stage 2 under zb1 where 1F1B holds 1. Unpriced beside them: the gradients B keeps at
    the weights' consumers for W (measured about 5% of this peak)."""
    plan = _plan(2, tuple(sorted(WIDE.items())), "megatron:tp=1,pp=2,dp=1,mb=4,schedule=zb1")
    case = {"id": "zb1", "model": "gpt", "model_kwargs": WIDE, "plan": plan, "regather": None}
    assert_predicted_peak(case, 2)


@pytest.mark.dist
def test_zero_bubble_beside_recomputation_is_refused() -> None:
    """W runs backward once per weight group, and each run would recompute the checkpointed
    blocks again: the runtime refuses a recomputing zb1 plan on every rank before any step
    (the planner makes none: `space.strategy`)."""
    args = {**GPT, "layers": 2}
    module, inputs = load_model("gpt", args)
    recomputing = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=2, strategy="megatron:tp=1,pp=2,dp=1,mb=2",
        recompute="full", time_limit_s=30.0,
    ).to_json()  # fmt: skip
    recomputing["schedule"] = {"name": "zb1", "virtual_stages": 1}
    case = {"id": "recompute", "model": "gpt", "model_kwargs": args, "plan": recomputing,
            "steps": 1, "lr": LR}  # fmt: skip
    for result in run_workers(run_cases, 2, ([case],), timeout_s=120.0):
        assert "ExecutionError" in result[0]["error"], result[0]
        assert "recomputes activations" in result[0]["error"], result[0]


@pytest.mark.dist
def test_zero_bubble_beside_parameter_gathers_is_refused() -> None:
    """A weight stored split (S(0) over data parallelism) and read whole is gathered: the
    runtime does not split such a backward yet, and says so on every rank before any step."""
    args = {**GPT, "layers": 2}
    plan = copy.deepcopy(_plan(4, tuple(sorted(args.items())), CHECKED[4][2]))
    plan["params"]["wpe.weight"].update(sbp="S(0)", optimizer_state_sbp="S(0)", gradient_sbp="S(0)")
    plan["nodes"]["p_wpe_weight"]["outputs"] = ["S(0)"]
    case = {"id": "gathers", "model": "gpt", "model_kwargs": args, "plan": plan, "steps": 1,
            "lr": LR}  # fmt: skip
    per_rank = run_workers(run_cases, 4, ([case],), timeout_s=120.0)
    for result in per_rank:
        assert "ExecutionError" in result[0]["error"], result[0]
        assert "zb1 schedule" in result[0]["error"], result[0]
