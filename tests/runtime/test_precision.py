"""Mixed precision as the plan prices it, on every layout (issue #45): bf16 compute, fp32
master weights and optimizer states, fp32 gradient accumulation and sync.

Oracle: `--check`'s reference running the same recipe on one device (runtime/verify/
step_check.py: the model's draws in bf16 at the plan's fp32 masters rounded once, every
micro-batch's gradient accumulated in fp32, the job's AdamW on fp32 masters; bounds from
bf16's rounding of the computation, measured by nudged draws, and fp32's for the update).
What each part catches:
- a layout that keeps no fp32 master (its weights rounded to bf16 after each update) fails
  the update comparison, whose bound is fp32's rounding of the update: bf16 rounding of a
  weight is 2^16 times that;
- a gradient summed in bf16 unasked is read off the collectives themselves: every gradient
  collective's wire dtype is recorded where the runtime hands the gradient over (the sync's
  buckets, FSDP's reduce-scatters, ZeRO-2's conversions, weight boxings' backward), and must
  be fp32 (bf16 only with --reduce-dtype bf16);
- the dtypes of what the optimizer steps and holds: fp32.
Plans come from the planner (`auto_parallelize(dtype="bf16")`) on the cpu-gloo profile; the
user's model stays fp32 (the plan's capture casts fakes, not the model).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from runtime.verify.verdict import judge
from tests.support.precision_workers import STEPS, run_precision_cases
from tests.support.worlds import cases_by_world

GPT = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8}
MOE = {"layers": 2, "hidden": 32, "heads": 2, "experts": 4, "ffn": 64, "vocab": 64, "seq": 8,
       "batch": 8}  # fmt: skip
# (processes, model, model arguments, strategy, dtype, reduce dtype, the gradient collectives
# the layout runs: each must carry the reduce dtype)
CASES: list[tuple[int, str, dict[str, Any], str, str, str, tuple[str, ...]]] = [
    (2, "gpt", GPT, "dp", "bf16", "fp32", ("sync",)),
    (2, "gpt", GPT, "fsdp", "bf16", "fp32", ("gather-reduce",)),
    (2, "gpt", GPT, "megatron:tp=2,pp=1,dp=1", "bf16", "fp32", ("sync",)),
    (2, "gpt", GPT, "megatron:tp=1,pp=2,dp=1,mb=2", "bf16", "fp32", ()),
    (2, "gpt", GPT, "megatron:tp=1,pp=2,dp=1,vp=2,mb=2", "bf16", "fp32", ()),
    (2, "gpt", GPT, "megatron:tp=1,pp=2,dp=1,mb=2,schedule=zb1", "bf16", "fp32", ()),
    (2, "gpt", GPT, "megatron:tp=1,pp=1,dp=2,zero=1", "bf16", "fp32", ("sync",)),
    (2, "gpt", GPT, "megatron:tp=1,pp=1,dp=2,zero=2,mb=2", "bf16", "fp32", ("zero2",)),
    (2, "gpt", GPT, "megatron:cp=2", "bf16", "fp32", ("sync",)),
    (2, "moe", MOE, "megatron:tp=1,pp=1,dp=2,ep=2", "bf16", "fp32", ("sync",)),
    (2, "gpt", GPT, "dp", "bf16", "bf16", ("sync",)),  # --reduce-dtype bf16: half the sync
    (2, "gpt", GPT, "dp", "fp16", "fp32", ("sync",)),  # dynamic loss scaling
    (4, "gpt", GPT, "megatron:tp=2,pp=2,dp=1,mb=2", "bf16", "fp32", ("sync",)),
    (4, "gpt", GPT, "megatron:tp=1,pp=1,dp=4,zero=1", "bf16", "fp32", ("sync",)),
]


def _id(case: tuple) -> str:
    n, model, _, strategy, dtype, reduce, _ = case
    return f"{n}-{model}-{strategy}-{dtype}" + ("-reduce-bf16" if reduce == "bf16" else "")


@cache
def _plan(n: int, model: str, strategy: str, dtype: str, reduce: str) -> dict[str, Any]:
    args = GPT if model == "gpt" else MOE
    module, inputs = load_model(model, args)
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=n, strategy=strategy, dtype=dtype,
        reduce_dtype=reduce, optimizer="adamw", time_limit_s=30.0,
    )  # fmt: skip
    assert plan.precision.compute == dtype and plan.precision.reduce == reduce
    return plan.to_json()


def _cases(world_size: int) -> list[dict[str, Any]]:
    return [
        {"id": _id(c), "model": c[1], "args": c[2], "plan": _plan(c[0], c[1], c[3], c[4], c[5])}
        for c in CASES
        if c[0] == world_size
    ]


_worlds = cases_by_world(run_precision_cases, _cases, timeout_s=600.0)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_mixed_precision_steps_match_the_recipe_on_one_device(case: tuple) -> None:
    n, _, _, strategy, dtype, reduce, collectives = case
    per_rank = _worlds(n)[_id(case)]
    checks, facts = per_rank[0]
    assert len(checks) == STEPS  # compared; fp16 skips its scale's overflows before them
    assert facts["skipped"] == 0 or dtype == "fp16"
    verdict = judge(checks)
    assert verdict.passed, verdict.text
    wire = {"fp32": "float32", "bf16": "bfloat16"}[reduce]
    compute = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    seen_wires = set().union(*(seen["wires"] for _, seen in per_rank))
    for _, seen in per_rank:
        assert seen["masters"] <= {"float32"} and seen["stepped"] <= {"float32"}
        assert seen["states"] <= {"float32"} and seen["gradients"] <= {"float32"}
        assert seen["compute"] <= {compute}
        assert seen["user_model"] == {"float32"}  # the user's model is never cast
        # ZeRO's fp32 masters are its shards: the whole ones released (a read gives NaN)
        assert seen["released"] and seen["released_read_nan"]
        assert seen["sharded"] or "zero=" not in strategy
    for kind in collectives:  # every gradient collective the layout runs, in the reduce dtype
        assert f"{kind}:{wire}" in seen_wires, seen_wires
    assert all(w.endswith(wire) for w in seen_wires), seen_wires
