"""Tensor-parallel reductions overlapped with their matmul (issue 47 item 2) train like one
device: `--check`'s comparison on 2 gloo processes of a tp=2 plan whose row-parallel matmuls
run in chunks, each chunk's all-reduce started while the next computes, and in backward each
chunk's dual all-reduce waited just before the chunk's gradient matmuls, beside the same plan
run whole, and under full recomputation (backward runs the chunks and their all-reduces
again, as priced); the timeline shows the overlapped ops.

Oracles: the step check's float64 single-device reference (runtime/verify/step_check.py), its
verdict the assertion, for each plan; the overlapped plans' losses against the whole one's
(equal within rounding); the timeline's "tp_overlap" spans (one per overlapped op and
micro-batch, twice that recomputed) and "tp_wait" spans (that many forward, and one per chunk
in backward), absent from the plan run whole. One 2-process world runs every case.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest

from autosbp.plan import Plan
from autosbp.planner.api import auto_parallelize
from autosbp.zoo import load_model
from launching.workers import run_workers
from runtime.verify.verdict import judge
from tests.support.tp_overlap_workers import train_cases

STEPS = 2
MLP = {"layers": 3, "hidden": 32, "features": 16, "outputs": 8, "batch": 8}
STRATEGY = "megatron:tp=2,pp=1,dp=1,mb=2"
CHUNKS = 2


def _overlapped(plan: Plan) -> dict[str, Any]:
    """`plan` with its row-parallel linears (partial sums all-reduced for the gelu after them)
    overlapped in CHUNKS chunks."""
    data = copy.deepcopy(plan.to_json())
    for node in data["nodes"].values():
        if node["op"] == "aten.linear.default" and node["outputs"] == ["P"]:
            node["overlap_chunks"] = CHUNKS
    return data


@cache
def _plans() -> dict[str, dict[str, Any]]:
    """The tp=2 plan of the MLP run whole, overlapped, and overlapped under full recomputation
    (each block's linear and gelu checkpointed together: backward runs the chunks and their
    all-reduces again, as the planner prices a recomputed twin)."""
    module, inputs = load_model("mlp", MLP)
    plans = {
        mode: auto_parallelize(
            module, inputs, devices=2, strategy=STRATEGY, time_limit_s=60, recompute=mode,
            profile="dgx-a100",
        )
        for mode in ("none", "full")
    }  # fmt: skip
    return {
        "whole": plans["none"].to_json(),
        "overlapped": _overlapped(plans["none"]),
        "recomputed": _overlapped(plans["full"]),
    }


@cache
def _world() -> dict[str, Any]:
    cases = [
        {"id": k, "model": "mlp", "model_kwargs": MLP, "plan": p, "steps": STEPS}
        for k, p in _plans().items()
    ]
    return run_workers(train_cases, 2, (cases,), timeout_s=300.0)


@pytest.mark.dist
def test_overlapped_reductions_train_like_one_device_and_like_the_plan_run_whole() -> None:
    plans = {k: Plan.from_json(p) for k, p in _plans().items()}
    marked = [n for n, node in plans["overlapped"].nodes.items() if node.overlap_chunks]
    assert len(marked) == MLP["layers"], "every hidden layer's linear is row-parallel"
    again = plans["recomputed"]
    assert all(again.nodes[n].overlap_chunks and again.nodes[n].recomputed for n in marked)
    per_rank = _world()
    results = per_rank[0]
    for case in plans:
        verdict = judge(results[case]["checks"])
        assert verdict.passed, f"{case}: {verdict.text}"
    for case in ("overlapped", "recomputed"):
        assert results[case]["losses"] == pytest.approx(results["whole"]["losses"], rel=1e-6)
    runs = len(marked) * plans["overlapped"].micro_batches
    for rank in per_rank:  # one span per overlapped op and micro-batch, and none without
        spans = rank["overlapped"]["spans"]
        assert spans["tp_overlap"] == runs
        assert spans["tp_wait"] == runs + runs * CHUNKS  # forward's, and backward's per chunk
        assert rank["whole"]["spans"]["tp_overlap"] == rank["whole"]["spans"]["tp_wait"] == 0
        # recomputed: run again in backward, chunks and all-reduces (priced so: timing.tp_overlap)
        again_spans = rank["recomputed"]["spans"]
        assert again_spans["tp_overlap"] == 2 * runs
        assert again_spans["tp_wait"] == 2 * runs + runs * CHUNKS
