"""Peer oracle: torch DTensor on 2 gloo processes agrees with our 1D signatures.

For each of our signatures of a sample of ops, the worker (tests/support/rules_helpers.py) places the
global inputs as DTensors with our input placements, runs the op, and reports DTensor's output
placements, the collectives it issued, and whether full_tensor() equals the op on whole tensors.
Where DTensor ran the op without communication, its output placement must be ours, except the
listed, explained differences of convention; where DTensor's own result is wrong (DTENSOR_WRONG:
cross-entropy's mean with ignored targets), it is listed with the reason, ours being proven by
simulation.
"""

from __future__ import annotations

import pytest

from launching.workers import run_workers
from tests.support.rules_helpers import dtensor_worker

SAMPLE = [
    "linear-bias", "bmm", "matmul-nd-2d", "add-broadcast", "mul-broadcast", "div", "sum-dim",
    "mean-dim", "_softmax", "layer_norm", "embedding", "view-split-heads", "view-merge",
    "transpose", "gelu", "cat", "split", "amax", "ce-mean", "where", "select", "expand-size1",
    "gather", "cumsum", "where-scalar-other", "index-first", "hardswish", "to-dtype_layout",
    "ce-ignored", "min-other", "roll", "diff", "argmax", "type_as", "div-floor",
    "group_norm-per-channel", "rms_norm",
]  # fmt: skip

# Comm-free outputs whose placement differs by convention only: (case, our signature) -> reason.
SAME_VALUE = {
    ("mean-dim", "(S(2) -> P)"): "DTensor keeps local means as Partial(avg); we pre-scale, sum",
    (
        "ce-mean",
        "(S(0), B -> P)",
    ): "DTensor keeps local means as Partial(avg); we pre-scale, sum",
    ("expand-size1", "(B -> S(0))"): "DTensor has no comm-free B -> S expand: it returns Replicate",
}

# Where DTensor's own result is wrong (ours is proven by simulation in tests/rules/test_rules.py):
# (case, our signature) -> why. Kept in the sample so the day DTensor fixes it, this test says so.
DTENSOR_WRONG = {
    (
        "ce-ignored",
        "(S(0), B -> P)",
    ): "DTensor averages the shards' means (Partial(avg)); with ignored targets the shards keep "
    "different counts, so the average of means is not the mean",
}

# DTensor placement name -> our SBP text (its _MaskPartial is the vocabulary-parallel P)
OURS = {"Replicate()": "B", "Partial(sum)": "P", "_MaskPartial(sum)": "P", "Partial(max)": "P(max)"}


def as_ours(name: str) -> str:
    return OURS.get(name) or name.replace("Shard", "S")


@pytest.fixture(scope="module")
def records() -> list[list[dict[str, object]]]:
    return run_workers(dtensor_worker, 2, (SAMPLE,), timeout_s=120.0)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_dtensor_runs_every_sampled_signature_to_the_global_result(
    records: list[list[dict[str, object]]],
) -> None:
    rank0, rank1 = records
    assert [r.get("theirs") for r in rank0] == [r.get("theirs") for r in rank1]
    assert {r["case"] for r in rank0} == set(SAMPLE)
    errors = [f"{r['case']} {r['sig']}: {r['error']}" for r in rank0 if "error" in r]
    assert not errors, "DTensor refused signatures:\n" + "\n".join(errors)
    wrong = {(r["case"], r["sig"]) for r in rank0 if not r["equal"]}
    assert wrong == set(DTENSOR_WRONG), (
        f"DTensor's result differs from the op on whole tensors: {wrong}"
    )


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_dtensor_output_placements_equal_ours_where_it_did_not_communicate(
    records: list[list[dict[str, object]]],
) -> None:
    agree = differ = 0
    for record in records[0]:
        if record["comms"] or (record["case"], record["sig"]) in DTENSOR_WRONG:
            continue  # DTensor redistributed (its strategy differs) or is wrong: nothing to compare
        theirs = [as_ours(p) for p in record["theirs"]]  # type: ignore[attr-defined]
        if theirs == record["ours"]:
            agree += 1
        else:
            key = (record["case"], record["sig"])
            assert key in SAME_VALUE, f"{key}: DTensor gives {theirs}, we say {record['ours']}"
            differ += 1
    assert differ == len(SAME_VALUE) and agree >= 85, (agree, differ)  # 90 of 96 in torch 2.13
