"""A Hugging Face Llama whose eager RMSNorms capture as torch's fused rms_norm
(`autosbp.capturing.fused_norms`) trains like one device and holds the memory the planner
predicts, on 2 gloo processes.

Oracles: `--check` (runtime/verify/step_check.py: every step's loss, gradients and update against
the user's eager model on one device, float64 and nudged draws in the plan's dtype) under the auto
plan and tensor parallel 2 in float32 (where fused and eager compute the same bits forward) and
tensor parallel 2 in bfloat16 (where Llama's weight product is rounded once fused and twice
eager); the runtime's measured peak per rank against the plan's predicted peak, within issue 16's
10%, for plans whose norms keep what the fused kernel keeps (the input and an fp32 rstd per
row: the eager norm's fp32 products are no longer kept). Mutations: the kernel's weight gradient
times 1.001 fails both float32 checks (bfloat16's bound, its rounding 2^-9, lets it pass); the
runtime running torch's CPU composite while the plan prices the fused kernel measures 1.16-1.24
(the figures at MEASURED_ARGS). Every case runs in one 2-process world
(`norm_world`). Lives elsewhere: capture and the kernel (tests/capturing/test_fused_norms.py),
the memory tests of the zoo (tests/runtime/test_memory.py), the check's own proofs
(tests/runtime/test_check.py).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import StepCheck, judge
from tests.support import real_models
from tests.support.check_workers import run_checked
from tests.support.memory_workers import PEAK_TOLERANCE, measure_cases

LLAMA = f"{Path(real_models.__file__).resolve()}:llama"
TP2 = "megatron:tp=2,pp=1,dp=1"
STEPS = 2
LR = 1e-2
WORKER_TIMEOUT_S = 600.0
CHECKED = [("auto", "fp32"), (TP2, "fp32"), (TP2, "bf16")]
# Hidden 128 beside the vocabulary's 128: at the suite's hidden 32 the logits' backward
# transients (the size of the logits, which the planner does not price: tests/runtime/
# test_memory.py) are 15% of the peak, here a few %. One layer (3 norms) of 8 x 64 tokens.
# Measured / predicted per rank (2026-12-07, 2 cores under load; the same on both ranks but
# tp2-eager's 1.067 / 1.067): fused, dp2 fp32 1.066, tp2 fp32 1.025, dp2 bf16 1.055; the same
# model with its norms eager (before fusing) 1.061, 1.067, 1.083; fused but the runtime's kernel
# torch's CPU composite (which keeps the fp32 upcast and products) 1.158, 1.241, 1.196. Fusing
# took 524,288 bytes off dp2 fp32's measured peak and the same off its prediction.
MEASURED_ARGS = {"batch": 8, "seq": 64, "layers": 1, "hidden": 128}
MEASURED = [("megatron:tp=1,pp=1,dp=2", "fp32"), (TP2, "fp32"), ("megatron:tp=1,pp=1,dp=2", "bf16")]


@cache
def _plan(strategy: str, dtype: str, args: tuple[tuple[str, int], ...] = ()) -> dict[str, Any]:
    model, inputs = load_model(LLAMA, dict(args), device="meta")  # as the CLI plans it
    plan = auto_parallelize(
        model, inputs, profile="cpu-gloo", devices=2, strategy=strategy, dtype=dtype,
        name="llama", time_limit_s=60.0,
    )  # fmt: skip
    return plan.to_json()


def norm_world(
    rank: int, world_size: int, checks: list[tuple[str, TrainSpec, str]], memory: list[dict]
) -> dict[str, Any]:
    """One world for both: the checked jobs, then the measured steps."""
    return {
        "checks": run_checked(rank, world_size, checks),
        "memory": measure_cases(rank, world_size, memory),
    }


@pytest.fixture(scope="module")
def world() -> tuple[dict[str, list[StepCheck]], list[list[dict[str, float]]]]:
    checks = [
        (f"{s}-{d}", TrainSpec(LLAMA, {}, _plan(s, d), STEPS, lr=LR, check=True), "none")
        for s, d in CHECKED
    ]
    args = tuple(sorted(MEASURED_ARGS.items()))
    memory = [
        {"id": f"{s}-{d}", "model": LLAMA, "model_kwargs": MEASURED_ARGS,
         "plan": _plan(s, d, args), "regather": None, "depth": 0}
        for s, d in MEASURED
    ]  # fmt: skip
    per_rank = run_workers(norm_world, 2, (checks, memory), timeout_s=WORKER_TIMEOUT_S)
    return per_rank[0]["checks"], [r["memory"] for r in per_rank]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("strategy", "dtype"), CHECKED, ids=[f"{s}-{d}" for s, d in CHECKED])
def test_a_fused_norm_llama_trains_like_one_device(
    world: tuple[dict[str, list[StepCheck]], Any], strategy: str, dtype: str
) -> None:
    ops = {node["op"] for node in _plan(strategy, dtype)["nodes"].values()}
    assert "aten.rms_norm.default" in ops and "aten.rsqrt.default" not in ops  # fused
    checks = world[0][f"{strategy}-{dtype}"]
    assert len(checks) == STEPS
    verdict = judge(checks)
    assert verdict.passed, verdict.text


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("index", "strategy", "dtype"),
    [(i, s, d) for i, (s, d) in enumerate(MEASURED)],
    ids=[f"{s}-{d}" for s, d in MEASURED],
)
def test_measured_peak_is_the_predicted_peak_with_fused_norms(
    world: tuple[Any, list[list[dict[str, float]]]], index: int, strategy: str, dtype: str
) -> None:
    per_rank = [rank[index] for rank in world[1]]
    ratios = [r["measured_bytes"] / r["predicted_bytes"] for r in per_rank]
    assert all(abs(ratio - 1) <= PEAK_TOLERANCE for ratio in ratios), (
        f"{strategy} {dtype}: measured / predicted peak per rank {[f'{x:.3f}' for x in ratios]} "
        f"(measured {[int(r['measured_bytes']) for r in per_rank]}, predicted "
        f"{int(per_rank[0]['predicted_bytes'])})"
    )
