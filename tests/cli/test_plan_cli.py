"""`autosbp plan`: every flag does what it says, changed alone against the same baseline.

One small GPT on 4 DGX A100 GPUs (big enough that the roofline, not the per-op floor, prices
its matmuls, so the dtype shows); each case runs the command in process with one flag changed
and checks the plan or its prediction moved as the flag says.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.plan import Plan, load_plan

MODEL = ["gpt", "--model-args", "layers=2,hidden=512,heads=8,vocab=512,seq=128,batch=8"]
BASE = [*MODEL, "--devices", "4", "--profile", "dgx-a100"]


def plan_with(tmp: Path, *flags: str) -> Plan:
    out = tmp / f"plan{abs(hash(flags))}.json"
    assert main(["plan", *BASE, *flags, "--out", str(out)]) == 0
    return load_plan(out)


@functools.cache
def baseline(tmp: Path) -> Plan:
    return plan_with(tmp, "--dtype", "fp32")


Check = Callable[[Plan, Plan], None]


def _dtype(base: Plan, plan: Plan) -> None:
    # bf16 halves every tensor's bytes (an op's memory time halves) and runs at the bf16 peak
    # (16x the fp32 one on the A100 spec sheet): the compute of a step at most about halves
    # (ops at the per-op floor do not shrink), and the activations and weights take less.
    assert (base.dtype, plan.dtype) == ("fp32", "bf16")
    compute, base_compute = (p.predicted.breakdown["compute_s"] for p in (plan, base))
    assert compute < 0.55 * base_compute
    assert plan.predicted.step_time_s < base.predicted.step_time_s
    assert plan.predicted.peak_memory_bytes < base.predicted.peak_memory_bytes


def _global_batch(base: Plan, plan: Plan) -> None:
    # Four times the samples per step: the captured batch grows (not only the label), so the
    # step takes longer, and the throughput is counted on 32 samples.
    assert (base.global_batch, plan.global_batch) == (8, 32)
    assert plan.predicted.step_time_s > 2 * base.predicted.step_time_s
    assert plan.predicted.throughput_samples_per_s == pytest.approx(32 / plan.predicted.step_time_s)


def _memory(base: Plan, plan: Plan) -> None:
    limit = 0.5 * base.predicted.peak_memory_bytes
    assert plan.memory_limit_bytes == int(limit)
    assert plan.predicted.peak_memory_bytes <= limit < base.predicted.peak_memory_bytes
    assert plan.predicted.step_time_s >= base.predicted.step_time_s * (1 - 1e-9)


def _devices(base: Plan, plan: Plan) -> None:
    assert (base.device_count, plan.device_count) == (4, 8)
    assert plan.predicted.step_time_s != base.predicted.step_time_s


def _optimizer(base: Plan, plan: Plan) -> None:
    # SGD keeps no state (Adam two fp32 moments per element): less memory, a cheaper update.
    assert (base.optimizer, plan.optimizer) == ("adam", "sgd")
    assert plan.predicted.peak_memory_bytes < base.predicted.peak_memory_bytes


def _recompute(base: Plan, plan: Plan) -> None:
    assert plan.recompute == "full" != base.recompute
    assert plan.predicted.step_time_s > base.predicted.step_time_s


def _micro_batches(base: Plan, plan: Plan) -> None:
    assert plan.micro_batches == 4 != base.micro_batches


def _materialize(base: Plan, plan: Plan) -> None:
    # Real weights plan exactly like the meta device: planning reads shapes only.
    assert plan.fingerprint == base.fingerprint
    assert plan.predicted.step_time_s == base.predicted.step_time_s
    assert plan.nodes == base.nodes


CASES: list[tuple[str, list[str] | Callable[[Plan], list[str]], Check]] = [
    ("dtype", ["--dtype", "bf16"], _dtype),
    ("global-batch", ["--dtype", "fp32", "--global-batch", "32"], _global_batch),
    (
        "memory-gib",
        lambda base: ["--memory-gib", repr(0.5 * base.predicted.peak_memory_bytes / 2**30)],
        _memory,
    ),
    ("devices", ["--devices", "8"], _devices),
    ("optimizer", ["--optimizer", "sgd"], _optimizer),
    ("recompute", ["--recompute", "full"], _recompute),
    ("micro-batches", ["--micro-batches", "4"], _micro_batches),
    ("materialize", ["--materialize"], _materialize),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "check"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_flag_changed_alone_changes_the_plan_as_it_says(
    tmp_path_factory: pytest.TempPathFactory,
    flags: list[str] | Callable[[Plan], list[str]],
    check: Check,
) -> None:
    tmp = tmp_path_factory.getbasetemp()
    base = baseline(tmp)
    given = flags(base) if callable(flags) else flags
    check(base, plan_with(tmp, *given))


@pytest.mark.slow
def test_the_command_plans_what_the_api_plans(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The baseline command's model through `auto_parallelize` (meta, fp32, the same profile and
    # devices): the same search, so the same plan and prediction.
    from autosbp.planner.api import auto_parallelize
    from autosbp.zoo import build_model

    base = baseline(tmp_path_factory.getbasetemp())
    model, inputs = build_model(
        "gpt", layers=2, hidden=512, heads=8, vocab=512, seq=128, batch=8, device="meta"
    )
    api = auto_parallelize(model, inputs, profile="dgx-a100", devices=4, dtype="fp32")
    assert api.fingerprint == base.fingerprint and api.predicted == base.predicted
    assert (api.mesh_shape, api.micro_batches, api.recompute) == (
        base.mesh_shape, base.micro_batches, base.recompute,
    )  # fmt: skip
    assert api.stages == base.stages and api.nodes == base.nodes
