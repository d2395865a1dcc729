"""Interleaved 1F1B on gloo processes (`megatron:...,vp=2`): every step checked against one
device (`--check`'s oracle, runtime/verify/step_check.py), each rank's measured peak memory
against the plan's, and what the runtime refuses to interleave.

Plans come from the planner (`auto_parallelize`, the cpu-gloo profile) as `autosbp plan
--strategy megatron:tp=1,pp=P,dp=1,vp=2` writes them: 2 x P virtual stages, chunk c of stage d
on stage d's device. The GPT has 2 blocks per device (one per chunk); the tied one sends its
embedding from virtual stage 0 to the head on the last virtual stage every micro-batch.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.jobs import TrainSpec
from runtime.verify.verdict import judge
from tests.support import real_models
from tests.support.check_workers import run_checked
from tests.support.memory_workers import assert_predicted_peak
from tests.support.runtime_workers import run_cases

STEPS = 3
LR = 1e-2
WORKER_TIMEOUT_S = 600.0  # one world runs every case of its size
GPT = {"hidden": 32, "heads": 2, "vocab": 64, "seq": 8, "batch": 8}
# (processes, model arguments, strategy)
CHECKED: list[tuple[int, dict[str, Any], str]] = [
    (2, {**GPT, "layers": 4}, "megatron:tp=1,pp=2,dp=1,vp=2,mb=4"),
    (2, {**GPT, "layers": 4, "tied": True}, "megatron:tp=1,pp=2,dp=1,vp=2,mb=2"),
    (4, {**GPT, "layers": 8}, "megatron:tp=1,pp=4,dp=1,vp=2,mb=4"),
    # beside ZeRO-2 (gradients reduce-scattered over dp in every chunk's backward)
    (4, {**GPT, "layers": 4}, "megatron:tp=1,pp=2,dp=2,vp=2,mb=2,zero=2"),
    # bucketed syncs over dp, and over tp (the replicated norms and biases): the second
    # chunk's gradients are final before the rank's last backward (they read 0 until
    # 2026-12-06, when the sync was armed only there)
    (4, {**GPT, "layers": 4}, "megatron:tp=1,pp=2,dp=2,vp=2,mb=2"),
    (4, {**GPT, "layers": 4}, "megatron:tp=2,pp=2,dp=1,vp=2,mb=4"),
]
# Wide enough that a peak is hundreds of kB (test_memory.py's reason).
WIDE = {"layers": 4, "hidden": 64, "heads": 2, "vocab": 128, "seq": 16, "batch": 4}


@cache
def _plan(devices: int, model_args: tuple[tuple[str, Any], ...], strategy: str) -> dict[str, Any]:
    module, inputs = load_model("gpt", dict(model_args))
    plan = auto_parallelize(
        module, inputs, profile="cpu-gloo", devices=devices, strategy=strategy, time_limit_s=30.0
    )
    assert plan.virtual_stages == 2 and len(plan.stages) == 2 * plan.pipeline_stages
    return plan.to_json()


def _id(n: int, args: dict[str, Any], strategy: str) -> str:
    return f"{n}-{'tied-' if args.get('tied') else ''}{strategy}"


# Hugging Face Llama computes its rotary cos and sin once, before the first layer, and every
# layer reads them: with 2 chunks a rank, a chunk reads them from the rank's own first chunk
# (`Transfers`'s mailbox; a p2p to itself failed on gloo until 2026-12-06).
LLAMA = f"{Path(real_models.__file__).resolve()}:llama"
LLAMA_STRATEGY = "megatron:tp=1,pp=2,dp=2,vp=2,mb=2"


def _world(n: int) -> dict[str, list]:
    """Every checked case of `n` processes in one world (each world started once)."""
    if n not in _WORLDS:
        cases = [
            (_id(m, a, s), TrainSpec("gpt", a, _plan(m, tuple(sorted(a.items())), s), STEPS,
                                     lr=LR, check=True), "none")
            for m, a, s in CHECKED
            if m == n
        ]  # fmt: skip
        if n == 4 and importlib.util.find_spec("transformers") is not None:
            module, inputs = load_model(LLAMA, {"layers": 4})
            plan = auto_parallelize(
                module, inputs, devices=4, strategy=LLAMA_STRATEGY, time_limit_s=60
            )
            spec = TrainSpec(LLAMA, {"layers": 4}, plan.to_json(), STEPS, lr=LR, check=True)
            cases.append(("llama", spec, "none"))
        _WORLDS[n] = run_workers(run_checked, n, (cases,), timeout_s=WORKER_TIMEOUT_S)[0]
    return _WORLDS[n]


_WORLDS: dict[int, dict[str, list]] = {}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)  # the first case of a size runs the world of every case of it
@pytest.mark.parametrize(("n", "args", "strategy"), CHECKED, ids=[_id(*c) for c in CHECKED])
def test_interleaved_steps_match_one_device(n: int, args: dict[str, Any], strategy: str) -> None:
    checks = _world(n)[_id(n, args, strategy)]
    verdict = judge(checks)
    assert len(checks) == STEPS
    assert verdict.passed, verdict.text


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_an_interleaved_hugging_face_llama_matches_one_device() -> None:
    verdict = judge(_world(4)["llama"])
    assert verdict.passed, verdict.text


@pytest.mark.dist
def test_interleaved_peak_memory_is_the_predicted_peak() -> None:
    """Each rank holds its 2 chunks' states and their activations in flight at the rank's peak
    (`planner.memory.in_flight.interleaved_in_flight`)."""
    plan = _plan(2, tuple(sorted(WIDE.items())), "megatron:tp=1,pp=2,dp=1,vp=2,mb=4")
    case = {"id": "vp2", "model": "gpt", "model_kwargs": WIDE, "plan": plan, "regather": None}
    assert_predicted_peak(case, 2)


@pytest.mark.dist
def test_interleaving_beside_parameter_gathers_is_refused() -> None:
    """A weight stored split (S(0) over data parallelism) and read whole is gathered: the
    runtime does not interleave that yet, and says so on every rank before any step."""
    args = {**GPT, "layers": 4}
    plan = copy.deepcopy(_plan(4, tuple(sorted(args.items())), "megatron:tp=1,pp=2,dp=2,vp=2,mb=2"))
    plan["params"]["wpe.weight"].update(sbp="S(0)", optimizer_state_sbp="S(0)", gradient_sbp="S(0)")
    plan["nodes"]["p_wpe_weight"]["outputs"] = ["S(0)"]
    case = {"id": "gathers", "model": "gpt", "model_kwargs": args, "plan": plan, "steps": 1,
            "lr": LR}  # fmt: skip
    per_rank = run_workers(run_cases, 4, ([case],), timeout_s=120.0)
    for result in per_rank:
        assert "ExecutionError" in result[0]["error"], result[0]
        assert "gathers parameters" in result[0]["error"], result[0]
