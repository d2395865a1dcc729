"""Activations re-gathered in backward (issue 47 item 1) and partial recomputation (item 3) run
as planned: `--check` on 2 gloo processes, and each rank's measured peak against the plan's.

Cases: sequence parallelism (`megatron:tp=2,...,sp=1`) of the zoo GPT and of a Hugging Face
Llama (GQA, SwiGLU; 2 micro-batches), whose column-parallel linears read their input gathered
from the sequence split and gather it again in backward; and the ILP's own choice on a 4-layer
GPT under a memory limit (no sp): its peak measured, and the same plan with every copy kept (its
`regathered` removed) measured beside it, so the bytes the re-gathers save are seen.

Oracles: the check's float64 single-device reference (runtime/verify/step_check.py), its
verdict the assertion; the planner's prediction of each rank's peak (issue 16's 10%,
tests/runtime/test_memory.py); the plan's own alternatives (what keeping the copies would cost,
per tied op) against the measured difference; the runtime's count of conversions run again.
Partial recomputation: a Hugging Face Llama under `full:1` (4 layers, pp=2: each stage's first
block recomputed, its second kept) and under `mlp` (tp=2: each SwiGLU's silu, up projection and
gate product recomputed), checked; the WIDE GPT's search (dp=2) under a memory limit none
cannot meet (it takes full:2 of its 4 blocks), its peak measured against the plan's on each
rank (0.978 on both).
All cases run in one 2-process world.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from autosbp.plan import Plan
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import StepCheck, judge
from tests.support import real_models
from tests.support.memory_workers import PEAK_TOLERANCE
from tests.support.regather_workers import check_and_measure

STEPS = 2
MEASURED_STEPS = 3  # `memory_workers`: one step, then the measure's two
WORKER_TIMEOUT_S = 600.0
HF = importlib.util.find_spec("transformers") is not None
LLAMA = f"{Path(real_models.__file__).resolve()}:llama"
GPT = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "batch": 4}
# Activations dominate (4 layers, sequence 64, a small vocabulary: the head's backward
# transients, unpriced, stay small beside them); at 0.75 of its unlimited peak the ILP
# re-gathers both linears of every block that read a gathered input
WIDE = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 32, "seq": 64, "batch": 8}
LIMITED = "megatron:tp=2,pp=1,dp=1,mb=1"
SP = "megatron:tp=2,pp=1,dp=1,mb=1,sp=1"
CHECKS = [("gpt", SP), *([(LLAMA, "megatron:tp=2,pp=1,dp=1,mb=2,sp=1")] if HF else [])]
# Partial recomputation: (model, its arguments, strategy, mode) checked; and the WIDE GPT's plan
# under PARTIAL_LIMIT bytes, where the search takes full:1 (none needs more), measured.
LAYERS4 = {"layers": 4}
PARTIAL = [
    (LLAMA, LAYERS4, "megatron:tp=1,pp=2,dp=1,mb=2", "full:1"),
    (LLAMA, {}, "megatron:tp=2,pp=1,dp=1,mb=2", "mlp"),
] if HF else []  # fmt: skip
# one stage over data parallelism: layouts a one-device stage would make trivial (pp=2 on 2
# processes) are priced there as conversions on some edges and views on others, whatever
# the recomputation (the WIDE GPT's full:1 under pp=2 measured 0.91-1.16 of its plans' peaks
# as the search's choice of equivalent layouts moved)
PARTIAL_GPT, PARTIAL_LIMIT = "megatron:tp=1,pp=1,dp=2,mb=1", 2_400_000


@cache
def _plan(model: str, strategy: str, share: float | None = None) -> Plan:
    """Planned on dgx-a100 prices (tensor parallelism pays there); with `share`, the WIDE GPT at
    that share of its unlimited plan's peak."""
    module, inputs = load_model(model, (WIDE if share else GPT) if model == "gpt" else {})

    def planned(limit: int | None) -> Plan:
        return auto_parallelize(
            module, inputs, devices=2, strategy=strategy, time_limit_s=60, recompute="none",
            profile="dgx-a100", memory_limit=limit,
        )  # fmt: skip

    if share is None:
        return planned(None)
    return planned(int(share * planned(None).predicted.peak_memory_bytes))


@cache
def _partial_plan(mode: str) -> Plan:
    """The PARTIAL case of `mode` planned (dgx-a100 prices); with `mode` auto, the WIDE GPT's
    plan under PARTIAL_LIMIT."""
    model, kwargs, strategy = next(
        ((m, k, s) for m, k, s, r in PARTIAL if r == mode), ("gpt", WIDE, PARTIAL_GPT)
    )
    module, inputs = load_model(model, kwargs)
    return auto_parallelize(
        module, inputs, devices=2, strategy=strategy, time_limit_s=60, recompute=mode,
        profile="dgx-a100", memory_limit=PARTIAL_LIMIT if mode == "auto" else None,
    )  # fmt: skip


def _kept(plan: Plan) -> dict[str, Any]:
    """`plan` with every gathered copy kept for backward."""
    data = copy.deepcopy(plan.to_json())
    for node in data["nodes"].values():
        node.pop("regathered", None)
    return data


@cache
def _world() -> tuple[dict[str, Any], dict[str, list[dict[str, float]]]]:
    """One 2-process world: rank 0's step checks per check case, each rank's memory figures."""
    checks = [
        (
            f"{m}-{s}",
            TrainSpec(m, GPT if m == "gpt" else {}, _plan(m, s).to_json(), STEPS, check=True),
            "none",
        )
        for m, s in CHECKS
    ]
    limited = _plan("gpt", LIMITED, 0.75)
    checks.append(
        ("gpt-limited", TrainSpec("gpt", WIDE, limited.to_json(), STEPS, check=True), "none")
    )
    checks += [
        (r, TrainSpec(m, k, _partial_plan(r).to_json(), STEPS, check=True), "none")
        for m, k, _, r in PARTIAL
    ]
    partial = _partial_plan("auto")
    memory = [
        {"id": i, "model": "gpt", "model_kwargs": WIDE, "plan": p, "regather": None, "depth": 0}
        for i, p in (
            ("regather", limited.to_json()), ("keep", _kept(limited)),
            ("regather-again", limited.to_json()), ("keep-again", _kept(limited)),
            ("partial", partial.to_json()),
        )
    ]  # fmt: skip
    per_rank = run_workers(check_and_measure, 2, (checks, memory), timeout_s=WORKER_TIMEOUT_S)
    figures = {case["id"]: [rank[1][k] for rank in per_rank] for k, case in enumerate(memory)}
    return per_rank[0][0], figures


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("model", "strategy"),
    [*CHECKS, ("gpt", LIMITED)],
    ids=[*(f"{Path(m).name.split(':')[-1]}-sp" for m, _ in CHECKS), "gpt-ilp-choice"],
)
def test_regathered_activations_train_like_one_device(model: str, strategy: str) -> None:
    plan = _plan("gpt", LIMITED, 0.75) if strategy == LIMITED else _plan(model, strategy)
    regathered = {n: node for n, node in plan.nodes.items() if node.regathered}
    assert regathered, "the plan re-gathers some activation"
    for name, node in regathered.items():  # the input of a linear, read whole from a split
        assert node.op == "aten.linear.default" and node.regathered == (0,), name
        assert node.inputs[0] == "B", name
    _assert_matches_one_device(
        _world()[0]["gpt-limited" if strategy == LIMITED else f"{model}-{strategy}"]
    )


def _assert_matches_one_device(checks: list[StepCheck]) -> None:
    assert len(checks) == STEPS
    verdict = judge(checks)
    assert verdict.passed, verdict.text
    assert "matches single-device training" in verdict.text


@pytest.mark.slow
@pytest.mark.dist
def test_the_measured_peak_is_the_predicted_one_and_the_saving_is_seen() -> None:
    plan = _plan("gpt", LIMITED, 0.75)
    figures = _world()[1]
    again, kept = figures["regather"], figures["keep"]
    ratios = [r["measured_bytes"] / r["predicted_bytes"] for r in again]
    assert all(abs(ratio - 1) <= PEAK_TOLERANCE for ratio in ratios), (
        f"measured / predicted peak per rank: {[f'{x:.3f}' for x in ratios]}"
    )
    regathered = sum(1 for node in plan.nodes.values() if node.regathered)
    assert [r["regathered"] for r in again] == [MEASURED_STEPS * regathered] * 2  # per micro-batch
    # every one a linear's activation, gathered beside its input-gradient matmul (as priced:
    # `autosbp.overlap.hidden_regather_s`)
    assert [r["beside"] for r in again] == [r["regathered"] for r in again]
    assert [r["regathered"] for r in kept] == [0, 0]
    # what keeping the copies costs, from the plan's own alternatives (each tied op's twin
    # switched back to its base: every copy of its block), against the measured difference
    predicted = 0
    for name in {node.tied_to or n for n, node in plan.nodes.items() if node.regathered}:
        node = plan.nodes[name]
        base = f"({', '.join(node.inputs)} -> {', '.join(node.outputs)})"
        predicted += next(
            a.memory_delta_bytes for a in plan.alternatives[name] if a.signature == base
        )
    # each side's steady peak, the lesser of two measured steps per rank: a buffer gloo's worker
    # thread frees late lands beside one step's peak now and then (65,536 bytes more "saved" on
    # one rank in 1 of 3 runs alone), a difference of two single steps doubles such noise
    steady = [
        [min(a["measured_bytes"], b["measured_bytes"]) for a, b in zip(*pair, strict=True)]
        for pair in ((kept, figures["keep-again"]), (again, figures["regather-again"]))
    ]
    saved = [k - r for k, r in zip(*steady, strict=True)]
    assert predicted > 0 and all(0.5 * predicted <= s <= 1.1 * predicted for s in saved), (
        f"saved {saved} bytes per rank; the plan predicts {predicted}"
    )


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("model", "kwargs", "strategy", "mode"), PARTIAL, ids=[f"llama-{c[3]}" for c in PARTIAL]
)
def test_partial_recomputation_trains_like_one_device(
    model: str, kwargs: dict[str, Any], strategy: str, mode: str
) -> None:
    plan = _partial_plan(mode)
    assert plan.recompute == mode
    recomputed = [n for n, node in plan.nodes.items() if node.recomputed]
    kept = [n for n, node in plan.nodes.items() if not node.recomputed and node.stage == 0]
    assert recomputed and kept
    _assert_matches_one_device(_world()[0][mode])


@pytest.mark.slow
@pytest.mark.dist
def test_a_partially_recomputing_plan_peaks_where_predicted() -> None:
    plan = _partial_plan("auto")
    assert plan.recompute == "full:2"  # what the search takes under PARTIAL_LIMIT
    figures = _world()[1]["partial"]
    ratios = [r["measured_bytes"] / r["predicted_bytes"] for r in figures]
    assert all(abs(ratio - 1) <= PEAK_TOLERANCE for ratio in ratios), (
        f"measured / predicted peak per rank: {[f'{x:.3f}' for x in ratios]}"
    )
